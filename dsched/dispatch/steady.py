"""The steady path: a dispatcher's next run, when its last one went over fast lanes alone.

A solver calls the same function on arrays of the same shapes at every Newton
iteration (:mod:`dsched.dispatch.reuse` keeps the dispatcher). Once a run of a
dispatcher ended cleanly with every chunk sent over a fast lane
(:mod:`dsched.dispatch.lanes`), the dispatcher keeps a :class:`SteadyPath`:
which parked feeds served which device, and the cluster's identity. Its next
run takes those feeds back from the parked ones and runs the policy's loop
(:class:`SteadyRun`) straight on their lanes: no look at the cluster, no
per-run transport objects, no task sender, no ticks. One call then costs the
policy's loop, one message per chunk each way, and the data plane's copies.

Whatever is out of the ordinary leaves the steady path:

- before the run: inputs of a layout no run left a path for (the dispatcher
  keeps one per layout): the full run
  (:class:`~dsched.dispatch.async_run.AsyncRun`); a cluster whose identity
  changed (a worker left, a run failed), a feed no longer parked (it ended,
  or another run took it): the full run, and the path is dropped;
- during the run: a chunk whose lane broke, whose worker left, or whose
  parked feed had ended unnoticed, is not run here; once the others are in,
  the dispatcher runs those chunks' rows again through the full run, into the
  same outputs (``WorkDispatcher._run_again``).

A failed chunk is a failed chunk, as on the full path (its rows NaN, the
others' results kept, the error raised); Ctrl-C and a submitted call's
``cancel()`` cancel the run's feeds and give their loads back.
"""

from __future__ import annotations

import atexit
import collections
import queue
import select


from dsched.checks import setting
from dsched.dataplane.loaders import ArrayLoader, MappingLoader, items_signature, memoized
from dsched.devices.device import placement_device
from dsched.devices.ownership import cluster_generation, has_dashboard
from dsched.dispatch.async_run import record_dispatch
from dsched.dispatch.completion import current_cancellation
from dsched.dispatch.feeds import LINGER, PARK_DELAY, FeedTicket, submit_feed
from dsched.dispatch.lanes import WINDOW, program_to_send
from dsched.dispatch.parking import _park, _running, _state, _take_parked, tell_parked_later
from dsched.names import is_feed_key
from dsched.observe.dashboard.client import tell_page
from dsched.observe.report import service_seconds
from dsched.worker import lane as wire
from dsched.worker.lane import Bell, look

__all__ = ["SteadyPath", "SteadyRun", "plan_key", "steady_path_enabled"]

#: seconds a waiting run looks for replies before it sleeps (Dask config ``dsched.lane-spin``; 0: it sleeps at once)
SPIN = 200e-6
_LOST = "lost"  # a mailbox notice: a worker left (:meth:`SteadyRun.lose_worker`)


def steady_path_enabled() -> bool:
    """Dask config ``dsched.steady-path`` (default true): like runs after a lanes-only run take the steady path."""
    return bool(setting("steady-path", True))


class SteadyPath:
    """What a clean run over fast lanes left for the next run of its dispatcher.

    Parameters
    ----------
    client : distributed.Client
    cluster : dict
        The cluster's identity as that run saw it (:func:`~dsched.devices.ownership.cluster_info`).
    owners : dict
        ``{Device: [address]}`` of the run's devices.
    feeds : dict
        ``{Device: [(address, items held)]}``: the feeds that served each device, parked now.
    """

    def __init__(self, client, cluster, owners, feeds, layout, signature):
        self.client, self.cluster, self.owners, self.feeds = client, cluster, owners, feeds
        self.layout, self.signature = layout, signature
        self.generation = cluster_generation(client)
        self.replay = None  # what the next like runs replay, once a run on this path ended cleanly

    @classmethod
    def after(cls, run, data, generator, cluster, timeout):
        """The path a clean run leaves, or ``None`` if its next run must be a full one: a chunk went as a task
        or over Dask's comms, the outputs are not all written in place in shared memory, feeds are not parked
        between runs, or the run has a timeout."""
        feeds = run.feeds
        if feeds is None or timeout is not None or data.remote:
            return None
        if float(setting("feed-linger", LINGER)) <= 0:
            return None
        if not data.store.shared or not data.writes_in_place_everywhere():
            return None
        signature = inputs_signature(generator)
        if signature is None or not feeds.lanes_only() or not all(isinstance(f, FeedTicket) for f in run.futures):
            return None
        served = {device: [(f.address, f.holds) for f in fs] for device, fs in feeds._feeds.items() if fs}
        return cls(run.client, cluster, data.owners, served, data.layout, signature)

    def holds(self, client) -> bool:
        """Whether the next run may take the path: the same client, running, on a cluster nothing changed. Its
        inputs have the path's layout (so the results keep theirs): the dispatcher found the path by it."""
        return (client is self.client and getattr(client, "status", None) == "running"
                and cluster_generation(client) is self.generation)

    def take_feeds(self):
        """``{Device: [feed]}``, the parked feeds this path names, taken for a run; ``None`` (and nothing
        taken) if one of them is no longer parked with its lane."""
        taken, by_device = [], {}
        for device, keys in self.feeds.items():
            for address, holds in keys:
                feed = _take_parked(self.client, address, device, holds)
                if feed is not None:
                    taken.append(feed)
                if feed is None or feed.lane is None or feed.lost:
                    _repark(self.client, taken)
                    return None
                by_device.setdefault(device, []).append(feed)
        return by_device


    def give_back(self, feeds):
        """Park again ``feeds`` (from :meth:`take_feeds`) that no run used."""
        _repark(self.client, [f for fs in feeds.values() for f in fs])


class SteadyRun:
    """One run on the steady path: the policy's loop over the lanes of feeds taken from the parked ones.

    Parameters
    ----------
    client, data, report
        The run's Dask client, data plane (:class:`~dsched.dataplane.rundata.RunData`) and report being filled.
    feeds : dict
        ``{Device: [feed]}`` from :meth:`SteadyPath.take_feeds`.
    scheduler, program, next_chunk, observers
        As for :class:`~dsched.dispatch.async_run.AsyncRun`: ``next_chunk()`` gives the policy's next
        ``(device, m, work, offset)``.
    """

    def __init__(self, client, data, report, feeds, *, run_id, scheduler, program, next_chunk, observers):
        self.client, self.data, self.report, self.feeds, self.run_id = client, data, report, feeds, run_id
        # The page's chunk events, sent off the path at close (a replay runs only without the page).
        self.events = [] if run_id is not None and has_dashboard(client) else None
        self.scheduler, self.program, self.next_chunk, self.observers = scheduler, program, next_chunk, observers
        self.observe = getattr(scheduler, "observe", None)  # a policy that learns from chunk timings
        self.last_stops = {}  # (worker, device) -> its latest chunk's end: what service_seconds reads
        self.in_flight = {}  # record index -> (record, feed), sent and not yet answered
        self.undone = []  # records of chunks not run here: the full run takes their rows
        self.failed = False
        self.sent = []  # (device, feed, offset, items) of each chunk, in the order sent: what a replay repeats
        self.overlapped = False  # a chunk was answered before the policy had cut the whole batch
        self.plan_key = None if next_chunk is None else plan_key(scheduler)  # what a replay of this run needs
        self.notices = queue.SimpleQueue()  # from the event loop: feed tasks that ended, workers that left
        self.bell, self.poller, self.by_fd = self._waiting(feeds)
        for fs in feeds.values():
            for feed in fs:
                feed.sent, feed.backlog, feed.owner, feed.rearm = 0, collections.deque(), self, True
        self.cancellation = None
        self.spin = float(setting("lane-spin", SPIN))
        if self.watch_at_start:
            self._watch()

    watch_at_start = True  # a replay watches once its messages went (dsched.dispatch.replay)

    def _watch(self):
        """Be told of workers that leave, of feed tasks that ended, and of a cancel."""
        with _state.parked_lock:
            _running(self.client).add(self)  # told when a worker leaves (lose_worker)
        for fs in self.feeds.values():
            for feed in fs:  # a task that ended between its take and now told no run (it had no owner): told here
                if feed.future.status != "pending":
                    self.put(feed.future)
        self.cancellation = current_cancellation()
        if self.cancellation is not None:
            self.cancellation.bind(self.bell.ring)

    def _waiting(self, feeds) -> tuple:
        """``(bell, poll over the bell and the feeds' lanes, {lane file descriptor: feed})``."""
        bell, poller, by_fd = _bell(), select.poll(), {}
        poller.register(bell.waitable, select.POLLIN)
        for fs in feeds.values():
            for feed in fs:
                fd = feed.lane.connection.fileno()
                by_fd[fd] = feed
                poller.register(fd, select.POLLIN)
        return bell, poller, by_fd

    def _let_bell_go(self):
        _idle_bells.append(self.bell)

    # --- the loop -----------------------------------------------------------

    def loop(self):
        """Schedule while the policy has room, send each chunk on its lane at once, account for each reply."""
        generator = self.data.generator
        while True:
            while not (self.failed or self.undone) and generator.has_more():  # a lost lane: the full run goes on
                chunk = self.next_chunk()
                if chunk is None:
                    break
                self._send(*chunk)
            if not self.in_flight:
                if not (self.failed or self.undone) and generator.has_more():
                    raise RuntimeError(
                        f"{self.scheduler!r} has no room for the next chunk and this run has none in flight; "
                        "a scheduler cannot be shared by dispatchers running at the same time")
                return
            self._wait()

    def _send(self, device, m, work, offset):
        record = record_dispatch(self.scheduler, self.observers, self.report, device, m, offset)
        if device not in self.feeds:  # the last run left this device out (a smaller batch): the full run starts it
            self._leave(record)
            return
        feed = min(self.feeds[device], key=lambda f: (f.lane is None, f.sent))
        feed.sent += 1
        self.sent.append((device, feed, offset, m))
        self.in_flight[record.index] = (record, feed)
        feed.backlog.append((record.index, work, self.data.slot(device, offset, offset + m, record.index)))
        if self.events is not None:
            self.events.append(self._event("start", record, feed))
        if feed.lane is None:  # every feed of the device is lost: left to the full run with the others
            self._lane_ended(feed, lost=True)
        self._pump(feed)

    def _pump(self, feed):
        """Write what waits for ``feed``'s lane, in one message, while fewer than :data:`WINDOW` chunks are
        unanswered on it (neither side may fill the socket and block the other)."""
        room = WINDOW - (feed.sent - len(feed.backlog))
        if feed.lane is None or room <= 0 or not feed.backlog:
            return
        chunks = [feed.backlog.popleft() for _ in range(min(room, len(feed.backlog)))]
        rearm = None
        if feed.rearm:  # its first message of the run takes it on, with the run's program if it holds another
            rearm, feed.rearm = (program_to_send(feed, self.program), feed.epoch), False
        if not feed.lane.send((wire.CHUNKS, rearm, chunks)):
            self._lane_ended(feed)

    def _wait(self):
        """Wait for replies (or a notice), and account for what came."""
        kept = [fd for fd, feed in self.by_fd.items() if feed.lane is not None and feed.lane.pending]
        ready = [(fd, None) for fd in kept] or (self.spin and look(self.poller, self.spin)) or self.poller.poll()
        for fd, _ in ready:  # replies read while a send waited (Lane.pending) first: the socket has them no more
            if fd == self.bell.waitable.fileno():
                self.bell.clear()
                if self.cancellation is not None:
                    self.cancellation.check()
                continue
            feed = self.by_fd.get(fd)
            if feed is not None and feed.lane is not None:
                self._receive(feed)
        while not self.notices.empty():
            self._notice(self.notices.get())

    def _answer(self, feed):
        """``(record, ok, value)`` of the chunk ``feed`` answered, taken from those in flight, its timings and
        worker noted; ``None`` when its lane ended (its chunks are left to the full run: it ended, or its parked
        feed had ended before the run took it), or for an answer to no chunk in flight."""
        try:
            message = feed.lane.receive()
        except (EOFError, OSError):
            message = (wire.ENDED,)
        if message[0] != wire.DONE:
            if not (message[0] == wire.FORGOTTEN and self._send_again(feed)):
                self._lane_ended(feed)
            return None
        _, index, ok, value, start, stop = message
        entry = self.in_flight.pop(index, None)
        if entry is None:
            return None
        record = entry[0]
        feed.sent -= 1
        record.start, record.stop, record.worker = start, stop, feed.address
        return record, ok, value

    def _send_again(self, feed) -> bool:
        """``feed`` let go of the kept chunks it was asked to run again: send them in full; whether they went.
        A steady run sends no kept chunks."""
        return False

    def _receive(self, feed):
        answer = self._answer(feed)
        if answer is None:
            return
        record, ok, value = answer
        self.overlapped = self.overlapped or self.data.generator.has_more()
        self._give_back(record)
        if self.events is not None:
            self.events.append(self._event("done" if ok else "failed", record, feed))
        self._settle(record, ok, value)
        self.observers.chunk_completed(record)
        self._pump(feed)

    def _settle(self, record, ok, value):
        """An answered chunk's outcome: a failure kept (its rows marked), or a success's time told to a policy that
        learns from chunk timings."""
        if not ok:
            record.error, self.failed = value, True
            self.data.failed(record)
        elif self.observe is not None and record.stop > record.start:
            self.observe(record.device, record.size, service_seconds(record, self.last_stops))

    def _event(self, phase, record, feed) -> tuple:
        """A chunk event for the page (:data:`~dsched.names.CHUNK_EVENT_TOPIC`'s fields)."""
        start, stop = (record.start, record.stop) if phase != "start" else (None, None)
        return (phase, self.run_id, self.client.id, str(placement_device(record.device)), record.size, feed.address,
                f"{feed.id}-{record.index}", start, stop)

    # --- what is out of the ordinary ------------------------------------------

    def put(self, item):
        """A notice from the event loop (a feed's task ended): handled on the run's thread."""
        self.notices.put(item)
        self.bell.ring()

    def lose_worker(self, address, error):
        """The worker at ``address`` left (on the event loop): its feeds' chunks are not run here."""
        self.put((_LOST, address))

    def _notice(self, notice):
        if isinstance(notice, tuple) and notice[0] == _LOST:
            for feed in [f for fs in self.feeds.values() for f in fs if f.address == notice[1]]:
                self._lane_ended(feed)
            return
        feed = next((f for fs in self.feeds.values() for f in fs if f.future is notice), None)
        if feed is not None and feed.lane is not None and is_feed_key(str(notice.key)):
            if notice.status == "finished":  # it retired: others wait for its worker; a successor queues
                feed.tasks += 1
                submit_feed(self.client, self.program, feed, f"{feed.id}-{feed.tasks}")
            else:  # cancelled or failed: nothing runs its chunks
                self._lane_ended(feed)

    def _lane_ended(self, feed, lost=False):
        """``feed``'s lane ended (or had, if ``lost``): its chunks not answered are left to the full run, and the
        feed is let go."""
        if feed.lane is None and not lost:
            return
        if feed.lane is not None:
            self.poller.unregister(feed.lane.connection.fileno())
            feed.lost, feed.error = True, ConnectionError(f"feed {feed.id} on {feed.address} ended during the run")
            feed.let_go()
        feed.lane, feed.backlog = None, collections.deque()
        for index, (record, owner) in list(self.in_flight.items()):
            if owner is feed:
                del self.in_flight[index]
                self._leave(record)

    def _leave(self, record):
        """A chunk this run will not run: its load given back, its rows left to the full run."""
        self._give_back(record)
        self.undone.append(record)

    def _give_back(self, record):
        """The policy's load of a chunk answered, or not to be answered."""
        self.scheduler.completed_work(record.device, record.size)

    # --- the end ------------------------------------------------------------

    def abandon(self):
        """Interrupted: cancel the feeds (their queued chunks are refused) and give the loads back."""
        feeds = [f for fs in self.feeds.values() for f in fs if f.lane is not None]
        if feeds:
            self.client.cancel([f.future for f in feeds])
        for feed in feeds:
            feed.lost = True
            feed.let_go()
            feed.lane = None
        for record, _ in self.in_flight.values():
            self._give_back(record)
        self.in_flight.clear()

    def close(self):
        """Park the feeds for the next run, and drop from the report the chunks not run here."""
        if self.cancellation is not None:
            self.cancellation.bind(None)
        with _state.parked_lock:
            _running(self.client).discard(self)
        _repark(self.client, [f for fs in self.feeds.values() for f in fs if f.lane is not None])
        if self.events:
            tell_page(self.client, self.events)
        self._let_bell_go()
        if self.undone:
            lost = {r.index for r in self.undone}
            kept = [(r, v) for r, v in zip(self.report.records, self.report.results) if r.index not in lost]
            self.report.records[:] = [r for r, _ in kept]
            self.report.results[:] = [v for _, v in kept]


def plan_key(scheduler):
    """The policy's :meth:`~dsched.schedulers.base.WorkScheduler.plan_key`; ``None`` for a policy without one."""
    key = getattr(scheduler, "plan_key", None)
    return None if key is None else key()


def inputs_signature(generator):
    """What the layout of a run's results depends on, for array and mapping loaders (each input's type, batch
    axis, item shape and dtype); ``None`` for any other generator, whose runs take the full way."""
    if isinstance(generator, ArrayLoader):
        return items_signature({None: generator.array}, {None: generator.axis})
    if isinstance(generator, MappingLoader):
        return memoized(generator, "signature", lambda g: items_signature(g.mapping, g.axes))
    return None


def _repark(client, feeds):
    """Park ``feeds`` again for the client's next run; their workers are told only if no run takes them first."""
    if not feeds:
        return
    for feed in feeds:
        feed.owner = None
    linger = float(setting("feed-linger", LINGER))
    messages = _park(client, feeds, linger)
    delay = float(setting("feed-park-delay", PARK_DELAY))
    tell_parked_later(client, list(zip(feeds, messages)), linger, delay)


_idle_bells = []  # bells of ended steady runs, for the next (a socket pair costs a few system calls)


@atexit.register
def _close_idle_bells():
    while _idle_bells:
        _idle_bells.pop().close()


def _bell() -> Bell:
    try:
        bell = _idle_bells.pop()
    except IndexError:
        return Bell()
    bell.clear()
    return bell
