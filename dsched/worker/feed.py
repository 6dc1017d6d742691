"""Device feeds, the worker's side: the inbox a feed's chunks wait in, the handlers that fill it, the feed's task.

A feed (:mod:`dsched.dispatch.feeds` says why, and holds the client's side) is one Dask task, :func:`run_feed`, pinned
to a device worker, that runs the chunks arriving in an inbox of its worker. The client sends each chunk with a direct
RPC to that worker; the handler :class:`FeedPlugin` installs queues it in the feed's inbox and replies with the
chunk's outcome and timings once the feed ran it. With the dashboard, the feed tells the scheduler of each chunk as it
starts and ends (``dsched-chunks`` events).

A feed *retires* after its current chunk when other tasks wait for its worker (its inbox stays open for a successor
task the client starts), and between two runs of its client it may be *parked*: it waits, idle, for the next run to
*rearm* it with that run's program (or name one its inbox keeps from an earlier run), and ends when its time is up or
anyone else waits for the worker. The rearm travels with the run's first chunks (no round trip of its own); a feed
that had ended refuses them with :data:`ENDED`, and the client sends them to a new feed.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import pickle
import queue
import select
import threading
import time

from distributed import get_worker
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol.serialize import ToPickle

from dsched.checks import setting
from dsched.names import CHUNK_EVENT_TOPIC, FEED_WORKER_PLUGIN
from dsched.worker import lane as lanes
from dsched.worker.chunk import _compute, _initialise
from dsched.worker.kept import KeptPlans, KeptPrograms, run_kept
from dsched.worker.wakeups import restore_policy, yield_on_wake

__all__ = ["FeedPlugin", "run_feed", "RETIRED"]

CHUNK_OP, STOP_OP, PARK_OP = "dsched_feed_chunk", "dsched_feed_stop", "dsched_feed_park"
CHUNKS_OP = "dsched_feed_chunks"  # several chunks in one message, their outcomes in one reply
LANE_OP = "dsched_lane_address"  # where this worker's fast lane listens, and its key (dsched.worker.lane)
ENDED = "ended"  # the reply to chunks that rearm a parked feed which had ended: they did not run
# With the dashboard on the scheduler, a feed tells it of each chunk as it starts and ends:
# (phase "start", "done" or "failed", run id, client id, device, items, worker address, chunk key, start, stop).
_POLL = 0.05  # seconds between an idle feed's checks that its task is still wanted and nobody waits for it
#: seconds a feed looks for a short call's next fast-lane message before it sleeps (``dsched.feed-spin``)
SPIN = 300e-6
_SHORT_WORK = 1e-3  # seconds: a message whose work took less is a short call's, whose next comes soon
_WAKE = ("wake",)  # queued for a feed whose worker was given a task: it looks at once whether to give way
LANE = "lane"  # what Inbox.next tags a message from the feed's fast lane with


class _Inbox:
    """The chunks waiting for one feed, and the program they run; once closed, what arrives is refused.

    Between two runs of its client a feed may be *parked*: it waits, idle, until
    ``park_until``, for the next run to *rearm* it with that run's program (sent
    with its first chunks). The client numbers its parks and rearms (``epoch``),
    which travel on different connections: a late park must not park the next
    run's feed.
    """

    def __init__(self):
        self.queue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.closed = False
        self.error = None  # why it closed: what chunks that arrive later fail with
        self.attached = False  # a feed task is taking chunks from it
        self.stopping = False  # the client said the run is over
        self.program = None  # what its chunks run: the first task's program, then each rearming run's
        self.programs = KeptPrograms()  # those it ran lately, for a rearm that names one
        self.park_until = None  # parked: time.monotonic() at which it ends if no run rearms it
        self.epoch = 0  # of the last park or rearm applied
        self.woken = False  # a _WAKE is queued and not yet taken
        self.lane = None  # the client's fast-lane connection (dsched.worker.lane), read by the feed's thread
        self._polled = None  # (lane, select.poll, bell's and lane's descriptors) of the feed's thread (_poller)
        self.kept = KeptPlans()  # the chunks of replayed plans (dsched.worker.kept), the feed's thread's
        self.spin = float(setting("feed-spin", SPIN))
        self.taken = None  # time.perf_counter() its last wait ended with a lane message, else None
        # Rung on every put, so the feed's thread waits on its queue and its lane at once.
        self.bell = lanes.Bell()

    def next(self, timeout):
        """The next thing for the feed: a queued item, ``(LANE, message)`` from its lane, or :data:`_WAKE` after
        ``timeout`` seconds of nothing (a quiet poll). Queued items first: they are the feed's controls."""
        if not self.queue.empty():  # (an exception raised per lane message would cost more than this look)
            try:
                return self.queue.get_nowait()
            except queue.Empty:
                pass
        lane = self.lane
        if self.closed:  # its bell is closed too: the feed looks at why and ends
            return _WAKE
        try:
            poller, bell, lane_fd = self._poller(lane)
            ready = lanes.look(poller, self.spin) if self._soon() else None
            self.taken = None
            ready = ready or poller.poll(timeout * 1000)
        except (OSError, ValueError):  # closed while waiting (the inbox closed)
            return _WAKE
        if any(fd == bell for fd, _ in ready):
            self.bell.clear()
            try:
                return self.queue.get_nowait()
            except queue.Empty:
                pass
        if lane is not None and any(fd == lane_fd for fd, _ in ready):
            try:
                message = lanes.loads(lane.recv_bytes())
                self.taken = time.perf_counter()
                return LANE, message
            except (EOFError, OSError):  # the client went away: the feed's task ends by its cancel or stop
                self.drop_lane(lane)
            except Exception:  # noqa: BLE001  a message this worker cannot load (an argument it cannot unpickle):
                # its chunks are unknown, so the lane goes; the client runs them again as tasks, whose sealed
                # work fails each chunk with the reason (dsched.dataplane.store.SealedWork)
                self.drop_lane(lane)
        return _WAKE

    def _soon(self) -> bool:
        """Whether the next message is likely within ``dsched.feed-spin``: the last one came over the lane and
        its work took under a millisecond (a solver's short calls; long chunks leave the core to others)."""
        return bool(self.spin) and self.taken is not None and time.perf_counter() - self.taken < _SHORT_WORK

    def _poller(self, lane):
        """``(poll, bell's descriptor, lane's descriptor)``: the feed's thread's poll over its bell and ``lane``,
        made again only when the lane changes (making one per wait costs more than the wait). The descriptors
        are those registered: one closed meanwhile reads -1, and its number may be another socket's by then."""
        if self._polled is None or self._polled[0] is not lane:
            poller, bell = select.poll(), self.bell.waitable.fileno()
            poller.register(bell, select.POLLIN)
            lane_fd = None if lane is None else lane.fileno()
            if lane_fd is not None:
                poller.register(lane_fd, select.POLLIN)
            self._polled = (lane, poller, bell, lane_fd)
        return self._polled[1:]

    def attach_lane(self, connection):
        """The client's fast lane (from the accept thread); a closed inbox closes it, so the client knows."""
        with self.lock:
            old, closed = self.lane, self.closed
            if not closed:
                self.lane = connection
        if old is not None:
            old.close()
        if closed:
            connection.close()
        else:
            self.bell.ring()  # a feed waiting on its queue alone now waits on the lane too

    def drop_lane(self, lane):
        with self.lock:
            if self.lane is lane:
                self.lane = None
        if lane is not None:
            lane.close()

    def reply(self, message, plain=False):
        """Send ``message`` on the lane; a client that went away loses only its reply. ``plain``: it holds
        nothing but plain values (no result, no error), which plain pickle writes."""
        lane = self.lane
        if lane is not None:
            try:
                lane.send_bytes(pickle.dumps(message, protocol=5) if plain else lanes.dumps(message))
            except OSError:
                self.drop_lane(lane)

    def put_many(self, items) -> bool:
        """Queue all of ``items``, or none if the inbox is closed."""
        with self.lock:
            if not self.closed:
                for item in items:
                    self.queue.put(item)
                self.bell.ring()
            return not self.closed

    def retire(self) -> bool:
        """Its feed leaves (a successor will take over); ``False`` if the run is over, or the feed is parked
        (no run waits for a successor), and it should end instead."""
        with self.lock:
            if self.stopping or self.park_until is not None:
                return False
            self.attached = False
            _fed.discard(self)
            return True

    def attach(self, program):
        with self.lock:
            self.attached = True
            _fed.add(self)
            self.programs.add(program)
            if self.program is None:  # a successor's program may be older than a rearming run's
                self.program = self.programs.resolve(program)

    def wake(self):
        """Have the feed look now, not at its next poll, whether others wait for its worker (one wake queued)."""
        with self.lock:
            if not self.closed and not self.woken:
                self.woken = True
                self.queue.put(_WAKE)
                self.bell.ring()

    def take_wake(self):
        with self.lock:
            self.woken = False

    def park(self, linger, epoch):
        """The run is over; wait ``linger`` seconds for the next run of the same client. With no feed
        attached (it retired as the run ended) nothing would ever take the inbox: it closes."""
        with self.lock:
            if epoch <= self.epoch:
                return
            self.epoch, self.park_until = epoch, time.monotonic() + linger
            attached = self.attached
        if not attached:
            self.close(RuntimeError("the feed had retired when its run ended"))

    def rearm(self, program, epoch) -> bool:
        """A new run takes the parked feed, with its program; ``False`` if the feed has ended.

        Each of the run's messages sends it until one is answered: the first to arrive applies it, the
        others of the same ``epoch`` find it applied (their program, another copy, is not taken).
        """
        with self.lock:
            if self.closed:
                return False
            if epoch > self.epoch:  # not a message of a run that parked it since
                # No program: the one it runs (the same dispatcher's); a ProgramRef: one it keeps, or else refused.
                kept = None if program is None else self.programs.resolve(program)
                if program is not None and kept is None:
                    return False
                self.epoch, self.park_until = epoch, None
                self.program = self.program if kept is None else kept
            return True

    def end_if_parked(self) -> bool:
        """Parked: the feed ends now (others wait for its worker), and a rearm that comes later is refused."""
        with self.lock:
            if self.park_until is None:
                return False
            self.closed, self.error = True, RuntimeError("the parked feed gave its worker to others")
            return True

    def expired(self) -> bool:
        """Parked past its time with nothing queued: the feed ends, and what arrives later is refused."""
        with self.lock:
            if self.park_until is None or time.monotonic() < self.park_until or not self.queue.empty():
                return False
            self.closed, self.error = True, RuntimeError("the feed was parked past its time")
            return True

    def stop(self):
        """The run is over: its feed ends once the inbox is empty; with no feed attached, it closes now."""
        with self.lock:
            self.stopping = True
            attached = self.attached
            self.queue.put(None)
            self.bell.ring()
        if not attached:
            self.close(RuntimeError("the run is over"))

    def close(self, error, keep_lane=False):
        """Refuse what comes next, and fail what is still waiting, with ``error``; close the lane unless
        ``keep_lane`` (the feed's thread still answers on it, then drops it)."""
        with self.lock:
            self.closed = True
            self.error = error
            self.program = None  # closed inboxes are kept a while (to refuse late chunks): not their models
            self.kept, self.programs = KeptPlans(), KeptPrograms()  # nor their plans' mappings
            _fed.discard(self)
            lane = None if keep_lane else self.lane
            self.lane = self.lane if keep_lane else None
        if lane is not None:  # the client reads the end of the lane as the feed's end
            lane.close()
        # Closed inboxes are kept by the thousand: not their sockets. A feed's thread waiting on the bell wakes
        # (or times out) and finds the inbox closed.
        self.bell.close()
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item is not _WAKE:
                _resolve(item[-2], item[-1], _failure(error))


_inboxes: "collections.OrderedDict[str, _Inbox]" = collections.OrderedDict()  # feed id -> inbox, this process
_fed: "set[_Inbox]" = set()  # the open inboxes a feed task takes chunks from, this process: woken by new tasks
_inboxes_lock = threading.Lock()
_CLOSED_KEPT = 1024  # closed inboxes remembered, so that a late chunk is refused rather than left waiting


@atexit.register
def _close_inboxes():
    """At exit, the open inboxes' sockets (their bells and lanes) are closed, not left to the collector."""
    with _inboxes_lock:
        inboxes = list(_inboxes.values())
    for inbox in inboxes:
        if not inbox.closed:
            inbox.close(RuntimeError("the process is exiting"))


def _inbox(feed: str, create=True) -> _Inbox | None:
    with _inboxes_lock:
        inbox = _inboxes.get(feed)
        if inbox is None and create:  # the chunk may arrive before its feed's task starts
            inbox = _inboxes[feed] = _Inbox()
            closed = [k for k, v in _inboxes.items() if v.closed]
            for key in closed[:max(0, len(closed) - _CLOSED_KEPT)]:
                del _inboxes[key]
        return inbox


def _unwrap(x):
    """What a ``ToPickle`` carried: comms between processes unpickle it, in-process ones pass it as it is."""
    return x.data if isinstance(x, ToPickle) else x


def _failure(err) -> dict:
    return {"ok": False, "value": ToPickle(err), "start": 0.0, "stop": 0.0}


def _resolve(loop, future, reply):
    def set_result():
        if not future.done():
            future.set_result(reply)

    loop.call_soon_threadsafe(set_result)


def _rearmed(feed, rearm) -> bool:
    """Apply a rearm sent with chunks (``(program, epoch)``, pickled); whether the feed takes them."""
    inbox = _inbox(feed, create=False)  # a parked feed's inbox: missing, it ended long ago
    program, epoch = _unwrap(rearm)
    return inbox is not None and inbox.rearm(program, epoch)


def _queued(worker, feed, chunks, rearm):
    """Queue ``chunks`` (``[(index, work, slot, about)]``) on ``feed``'s inbox, all or none: their futures; or the
    reply instead, :data:`ENDED` (a rearming run's chunks for a feed that has ended, even since its rearm: they
    go to a new feed) or the inbox's failure."""
    if rearm is not None and not _rearmed(feed, rearm):
        return None, ENDED
    loop = asyncio.get_running_loop()
    items = [(index, _unwrap(work), _unwrap(slot), about, loop, loop.create_future())
             for index, work, slot, about in chunks]
    inbox = _inbox(feed)
    if not inbox.put_many(items):
        return None, ENDED if rearm is not None else _failure(inbox.error)
    for _, _, _, about, _, _ in items:
        if about is not None:  # in flight from here: the dashboard's chunk events
            worker.log_event(CHUNK_EVENT_TOPIC, ("start", *about[:4], worker.address, about[4], None, None))
    return [item[-1] for item in items], None


def _chunk_handler(worker):
    async def receive_chunk(feed=None, index=None, work=None, slot=None, about=None, rearm=None):
        """RPC handler: queue a chunk for its feed and reply with its outcome once it ran.

        ``about`` (only with the dashboard): ``(run id, client id, device, items, chunk key)``
        for the chunk events. ``rearm``: the run's program for a parked feed, applied before the
        chunk is queued; :data:`ENDED` if the feed had ended.
        """
        futures, reply = _queued(worker, feed, [(index, work, slot, about)], rearm)
        return reply if futures is None else await futures[0]

    return receive_chunk


def _chunks_handler(worker):
    async def receive_chunks(feed=None, chunks=(), rearm=None):
        """RPC handler: several chunks (``[(index, work, slot, about)]``) queued at once; their outcomes, in order,
        once they all ran. A deep backlog of small chunks pays one message's cost, not one per chunk."""
        futures, reply = _queued(worker, feed, chunks, rearm)
        if futures is None:
            return reply if reply == ENDED else [reply] * len(chunks)
        return list(await asyncio.gather(*futures))

    return receive_chunks


async def _receive_stop(feed=None):
    """RPC handler: the run is over; the feed returns once its inbox is empty (at once if it has retired)."""
    _inbox(feed).stop()
    return "OK"


async def _receive_park(feed=None, linger=0.0, epoch=0):
    """RPC handler: the run is over; the feed waits ``linger`` seconds for its client's next run.

    A feed whose task has not started yet (the run ended before the worker had
    a thread for it) is parked too: its inbox is made now, closed, so the task
    ends as it starts. Otherwise it would take chunks from no run, and hold a
    thread that the next runs of its client wait for.
    """
    _inbox(feed).park(linger, epoch)
    return "OK"


async def _lane_address():
    """RPC handler: where this process's fast lane listens and its key (:mod:`dsched.worker.lane`), started on
    first use; ``None`` where it cannot listen. Asked once per client, over Dask's own comms."""
    server = lanes.lane_server(attach_lane)
    return None if server is None else {"address": server.address, "authkey": server.authkey}


def attach_lane(feed, connection):
    """A client opened ``feed``'s fast lane: its thread reads it from now on (made first if the lane comes
    before the feed's task)."""
    _inbox(feed).attach_lane(connection)


class FeedPlugin(WorkerPlugin):
    """Installs the feed handlers on every worker (and on workers that join later)."""

    name = FEED_WORKER_PLUGIN
    idempotent = True

    def setup(self, worker):
        worker.handlers[CHUNK_OP] = _chunk_handler(worker)
        worker.handlers[CHUNKS_OP] = _chunks_handler(worker)
        worker.handlers[STOP_OP] = _receive_stop
        worker.handlers[PARK_OP] = _receive_park
        worker.handlers[LANE_OP] = _lane_address

    def transition(self, key, start, finish, **kwargs):
        """A task now waits for a thread or a resource: the feeds look at once whether to give way to it (a
        parked feed ends, a feed of another caller's run retires), rather than at their next poll, 50 ms on."""
        if finish in ("ready", "constrained") and _fed:
            for inbox in list(_fed):
                inbox.wake()


RETIRED = "retired"  # what a feed that gave its thread back returns; its inbox waits for a successor


def run_feed(program, device, feed: str):
    """The task of one feed: run the chunks that arrive in its inbox (or on its fast lane) until told to stop.

    Returns the chunks it ran, or :data:`RETIRED` if it gave its thread back because other tasks wait for the
    worker (another client's chunks, or a chunk of this run sent as a task): a feed must not hold a device that
    others share for a whole run. Its inbox stays open, and the client starts a successor on it. It also ends
    if its task is cancelled (the client went away or gave up on the run), and when it was parked past its time
    or anyone waits for the worker while it is parked.
    """
    worker, inbox = get_worker(), _inbox(feed)
    key = worker.get_current_task()
    policy = yield_on_wake()  # woken by a lane's message, it leaves the dispatching thread its core (wakeups.py)
    inbox.attach(program)
    runner = _Runner(inbox, device, worker)
    ended = RuntimeError(f"feed {feed} has ended")
    try:
        while True:
            parked = inbox.park_until is not None
            if _others_wait(worker, feed, parked):
                if inbox.retire():
                    ended = None
                    return RETIRED
                if inbox.end_if_parked():  # no run waits for it: it ends, not retires
                    return runner.ran
            item = inbox.next(_POLL)
            if item is _WAKE:  # a wake, or a quiet poll: a stream of them must not keep a feed past its time
                inbox.take_wake()
                if inbox.closed or _abandoned(worker, key) or inbox.expired():
                    return runner.ran
                continue
            if item is None:
                return runner.ran
            if item[0] == LANE:
                runner.lane_message(item[1])
                continue
            index, work, slot, about, loop, future = item
            outcome = runner.run(work, slot, about, lambda reply: _resolve(loop, future, reply))
            _resolve(loop, future, {"ok": outcome[0], "value": ToPickle(outcome[1]), "start": outcome[2],
                                    "stop": outcome[3]})
    except _InitFailed as failed:
        ended = None  # the inbox was closed with the error
        raise failed.args[0] from None
    finally:
        restore_policy(policy)  # its thread is the worker pool's: the next task there runs as before
        if ended is not None:
            inbox.close(ended)


class _InitFailed(Exception):
    """A run's ``thread_init`` failed on this feed: it ends, and every chunk sent to it fails with the error."""


class _Runner:
    """A feed's thread: the program it initialised, and running one chunk."""

    def __init__(self, inbox, device, worker):
        self.inbox, self.device, self.worker = inbox, device, worker
        self.program = None  # the program initialised on this thread: the inbox's, checked before each chunk
        self.ran = 0

    def run(self, work, slot, about, fail, compute=None) -> tuple:
        """Run one chunk: ``(ok, value, start, stop)``. If the run's ``thread_init`` fails, ``fail(reply)`` tells
        the chunk and the feed ends (:class:`_InitFailed`). ``compute()``, if given, runs it instead of
        ``work`` and ``slot`` (a kept chunk)."""
        inbox = self.inbox
        if inbox.program is not self.program:  # the first chunk, or the first of a run that rearmed the feed
            self.program = inbox.program
            try:
                _initialise(self.program, self.device, self.worker)
            except Exception as err:  # thread_init failed: so does every chunk sent here
                # Closed before the reply: a run that starts once it has it finds the feed ended. Its lane
                # stays open for the reply (and the failures of the chunks sent with it), then closes.
                inbox.close(err, keep_lane=True)
                fail(_failure(err))
                raise _InitFailed(err) from err
        start = time.time()
        try:
            value = _compute(self.program, self.device, work, slot) if compute is None else compute()
            ok = True
        except Exception as err:  # the chunk's failure, not the feed's
            value, ok = err, False
        stop = time.time()
        if about is not None:  # before the reply: the dashboard counts a chunk no later than the client does
            worker = self.worker
            phase = "done" if ok else "failed"
            worker.log_event(CHUNK_EVENT_TOPIC, (phase, *about[:4], worker.address, about[4], start, stop))
        self.ran += 1
        return ok, value, start, stop

    def lane_message(self, message):
        """A message from the client's fast lane (:mod:`dsched.worker.lane`): chunks, a plan's chunks to keep
        and run, a kept plan to run again, or a stop (parks come over Dask's comms, after a delay: see
        :mod:`dsched.dispatch.feeds`)."""
        inbox, kind = self.inbox, message[0]
        if kind == lanes.STOP:
            inbox.stop()
            return
        rearm = message[1]
        if rearm is not None and not inbox.rearm(*rearm):
            inbox.reply((lanes.ENDED,))
            return
        # A lane's chunks log no dashboard events here: the client sends theirs (dsched.dispatch.lanes).
        if kind == lanes.CHUNKS:
            self._run_all([(index, None, work, slot) for index, work, slot in message[2]])
            return
        plan_id, payload, moves = message[2], message[3], (message[4] if len(message) > 4 else None)  # moved inputs
        plan = inbox.kept.keep(plan_id, payload, self.device) if kind == lanes.KEEP else inbox.kept.get(plan_id)
        if plan is None:  # a plan this feed let go of (it keeps kept.PLANS_KEPT): the client sends it again
            inbox.reply((lanes.FORGOTTEN, plan_id))
            return
        program, device = inbox.program, self.device
        jobs = plan.jobs(None if kind == lanes.KEEP else payload)
        if program is not self.program:  # the first chunks since the run's program came: initialise it first
            self._run_all([(index, lambda c=chunk, s=slot, r=rows: run_kept(program, device, c, s, r, plan, moves),
                            None, None) for index, chunk, slot, rows in jobs])
            return
        for index, chunk, slot, rows in jobs:  # a replay's usual case, kept short: its chunks, each answered
            start = time.time()
            try:
                value, ok = run_kept(program, device, chunk, slot, rows, plan, moves), True
            except Exception as err:  # the chunk's failure, not the feed's
                value, ok = err, False
            self.ran += 1
            inbox.reply((lanes.DONE, index, ok, value, start, time.time()), plain=ok and value is None)

    def _run_all(self, chunks):
        """Run ``chunks`` (``(index, compute, work, slot)``) in turn, each answered as it ends."""
        inbox = self.inbox
        for position, (index, compute, work, slot) in enumerate(chunks):
            fail = lambda reply, index=index: inbox.reply(  # noqa: E731
                (lanes.DONE, index, False, _unwrap(reply["value"]), 0.0, 0.0))
            try:
                ok, value, start, stop = self.run(work, slot, None, fail, compute)
            except _InitFailed as failed:  # the message's other chunks fail with it, then the lane closes
                for index, *_ in chunks[position + 1:]:
                    inbox.reply((lanes.DONE, index, False, failed.args[0], 0.0, 0.0))
                inbox.drop_lane(inbox.lane)
                raise
            inbox.reply((lanes.DONE, index, ok, value, start, stop))


def _others_wait(worker, feed, parked=False) -> bool:
    """Whether other tasks wait for a thread or a resource of this worker: any task while the feed is
    parked, otherwise any but the feeds of its caller (its client's runs on one thread, which take turns
    through the client)."""
    own = feed.rpartition("-")[0] + "-"
    return any(parked or not str(ts.key).startswith(own) for ts in _waiting(worker.state))


def _waiting(state) -> tuple:
    """The tasks waiting for a thread or a resource, read from the feed's thread while the event loop changes them."""
    while True:
        try:
            return (*state.ready, *state.constrained)
        except RuntimeError:  # a set changed size while it was read: read it again
            continue


def _abandoned(worker, key) -> bool:
    """Whether the feed's task was cancelled or released, or its worker is closing."""
    ts = worker.state.tasks.get(key)
    return ts is None or ts.state not in ("executing", "long-running") or worker.status.name not in (
        "running", "paused")
