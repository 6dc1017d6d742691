"""Device feeds, the client's side: a run's chunks reach their worker straight from the client, one small message each.

A chunk sent as its own Dask task costs a scheduler round trip: the graph
update, the transitions, the worker's task state machine and the completion
notice. On two cores that is about 5 ms of client CPU and 2 ms of worker CPU
per chunk (``docs/benchmarks.md``), more than the J2 update of 32,768 points
costs, and the client's CPU is taken from the workers.

A *feed* pays that once per run and device thread. It is one Dask task
(:func:`run_feed`) pinned to a device worker like a chunk, holding a share of
the device's resource, that waits for chunks in an inbox of its worker. The
client sends each chunk's descriptor (references into the run's store and
its output slot, a few hundred bytes) with a direct RPC to that worker, over
Dask's own comms (TLS included); the feed runs it, and the RPC's reply is
the chunk's outcome and timings. Nothing goes through the scheduler per
chunk. About 0.35 ms of client CPU and 0.2 ms of worker CPU per chunk.

The scheduler still sees each feed as a task (dashboard task stream, worker
restrictions, resources), and with the dashboard the per-device rows come
from chunk events (``dsched-chunks``). A worker that dies fails its chunks'
RPCs: the dispatcher runs them again as tasks (:mod:`dsched.dispatch`).

Devices are shared: several clients may run on the same workers at once.
So a feed does not hold its thread for a whole run when others wait for the
worker. When another task is ready or waits for the device's resource (an
other client's chunk or feed, or a chunk of this run sent as a task), the
feed *retires* after its current chunk, leaving its inbox open, and the
client starts a successor task on that inbox, which queues behind the
others. Without contention a feed lives as long as its run.

A solver calls again and again, and a feed's task takes a scheduler round
trip to start (about 10 ms here, a quarter of a 100,000-point call). So when
a run ends without the dashboard, its feeds are *parked* rather than stopped:
each waits on its worker, holding its thread and its share of the device,
for ``dsched.feed-linger`` seconds (2 by default; 0 stops them at once). The
client's next run from the same thread, of any dispatcher, takes them: it
sends its program to each (one small message) and then its chunks. A parked feed ends at once when
any other task waits for its worker, and when its time is up.

The worker side (:mod:`dsched.worker.feed`) is a handler installed by
:class:`FeedPlugin`, registered by the dispatcher on first use. This module
is the client's side: a run's :class:`Feeds`, and the parked feeds kept
between runs (:func:`release_parked`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import itertools
import threading
import time
from dataclasses import dataclass

from distributed.protocol.serialize import ToPickle

from dsched.devices.device import device_resource, placement_device
from dsched.dispatch.completion import notify_when_done
from dsched.names import CHUNK_EVENT_TOPIC, DASHBOARD_PLUGIN, is_feed_key
from dsched.worker.feed import FeedPlugin, _unwrap, run_feed

# Also importable from here (the old path ``dsched.feed`` names this module): the worker's side and the names.
__all__ = ["FeedPlugin", "Feeds", "FeedOutcome", "FeedTicket", "run_feed", "is_feed_key", "release_parked",
           "CHUNK_EVENT_TOPIC"]

WINDOW = 2  # chunks of one feed on its worker at a time (one running, one queued): the rest wait on the client
LINGER = 2.0  # seconds a feed waits, parked, for the same client's next run on that thread (``dsched.feed-linger``)
_REUSE_MARGIN = 0.5  # a parked feed is reused only this long before its worker would end it


class _ProcessState:
    """What the client's side keeps for the whole process, across runs and clients (one instance: :data:`_state`).

    A client's parked feeds themselves are kept on the client (:func:`_parked`);
    the lock here guards them.
    """

    def __init__(self):
        self.calls = set()  # RPCs under way: asyncio keeps only weak references to tasks
        self.feed_numbers = itertools.count()  # the <n> of feed ids (_new_feed_id)
        self.parked_lock = threading.Lock()  # held while a client's parked pool is read or changed
        self.registered = set()  # ids of the clients' schedulers that have the plugin


_state = _ProcessState()


@dataclass
class FeedTicket:
    """A chunk sent to a feed, standing where a chunk task's future would (``key``, ``status``, ``release``)."""

    key: str
    status: str = "pending"

    def release(self):
        pass


@dataclass
class FeedOutcome:
    """What a feed replied for one chunk: ``lost`` if its worker could not be reached."""

    ticket: FeedTicket
    index: int
    address: str
    ok: bool
    value: object
    start: float
    stop: float
    lost: bool = False


@dataclass(eq=False)  # a feed is itself: lists of feeds are searched by identity
class _Feed:
    id: str  # its inbox's name on its worker, and its first task's key
    device: object
    address: str
    future: object  # of its current task (a successor's after it retired)
    holds: float  # the items of its device it holds: the largest chunk it runs
    sent: int = 0  # chunks sent and not yet answered
    backlog: collections.deque = dataclasses.field(default_factory=collections.deque)  # waiting for an RPC
    calling: int = 0  # RPCs under way
    tasks: int = 1  # tasks it has had (a successor after each retirement)
    lost: bool = False
    stopped: bool = False
    epoch: int = 0  # of its last park or rearm message: the worker applies only newer ones
    reuse_until: float = 0.0  # parked: time.monotonic() until which a run may take it
    owner: object = None  # the run's Feeds it serves; None while parked or after its run

    def task_ended(self, future):
        """Its task's completion notice, for the run it serves now (one watcher per task, whatever the runs)."""
        owner = self.owner
        if owner is not None:
            owner.put(future)


class Feeds:
    """The feeds of one run: started (or taken from the parked ones) per device on its first chunk, parked or
    stopped when the run ends.

    Parameters
    ----------
    client : distributed.Client
    program : ChunkProgram
        Shipped once per feed: with its task, or with the rearm of a parked one.
    run_id : str
        The chunk events (for the dashboard) carry it.
    owners : dict
        ``{Device: [worker address]}``: a device gets one feed per thread of each of its workers.
    put : callable
        Called on the client's event loop with each :class:`FeedOutcome`, and with
        each feed task's future as it ends (for :meth:`ended`).
    cluster : dict
        What :func:`~dsched.ownership.cluster_info` said at the run's start.
    batch_sizes : dict
        ``{Device: its batch size}``: a worker gets as many feeds as it has threads and room for.
    """

    def __init__(self, client, program, run_id, owners, put, cluster, batch_sizes):
        import dask

        self.client, self.program, self.run_id, self.owners, self.put = client, program, run_id, owners, put
        self.batch_sizes = batch_sizes
        self._linger = float(dask.config.get("dsched.feed-linger", LINGER))
        self._feeds = {}  # Device -> [_Feed]
        self._refused = set()  # devices whose feed's worker was lost: their chunks go as tasks
        self._workers = cluster["workers"]  # address -> its threads and resources
        self._events = None  # whether the scheduler has the dashboard, asked when a feed first starts
        self._by_key = {}  # task key -> feed, for the tasks not yet ended
        register_plugin(client, cluster.get("id"))

    def serves(self, device) -> bool:
        """Whether ``device``'s chunks go to feeds: its workers share this host, and none of its feeds was lost."""
        lost = any(f.lost for f in self._feeds.get(device, ()))
        return device in self.owners and device not in self._refused and not lost

    def send(self, device, chunks) -> list:
        """Send ``chunks`` (``(index, items, work, slot)``) to the least busy feeds of ``device``; their tickets.

        Each chunk's :class:`FeedOutcome` is ``put`` when its feed replies. One
        wake-up of the event loop for them all.
        """
        feeds = self._feeds.get(device) or self._start(device)
        # A feed lost since serves() was asked: its chunks would only fail, and run again as tasks.
        feeds = [f for f in feeds if not f.lost] or feeds
        calls = []
        for index, items, work, slot in chunks:
            feed = min(feeds, key=lambda f: f.sent)
            feed.sent += 1
            ticket = FeedTicket(f"{feed.id}-{index}")
            about = (self.run_id, self.client.id, str(placement_device(device)), items, ticket.key) \
                if self._events else None
            calls.append((feed, ticket, index, work, slot, about))
        self.client.loop.add_callback(self._call_all, calls)
        return [call[1] for call in calls]

    async def _call_all(self, calls):
        for call in calls:
            call[0].backlog.append(call)
        for feed in {id(call[0]): call[0] for call in calls}.values():
            self._pump(feed)

    def _pump(self, feed):
        """Start RPCs for ``feed``'s waiting chunks, up to :data:`WINDOW` at a time (on the event loop).

        Its worker needs the next chunk queued while it runs one, not the whole
        backlog: thousands of concurrent RPCs would each open a connection.
        """
        while feed.backlog and feed.calling < WINDOW:
            call = feed.backlog.popleft()
            feed.calling += 1
            _spawn(self._call(*call))

    def refuse(self, device):
        """Send no more of ``device``'s chunks to feeds (its workers are gone; a feed that lost its worker
        refuses its device by itself)."""
        self._refused.add(device)

    async def _call(self, feed, ticket, index, work, slot, about):
        try:
            reply = await self.client.rpc(feed.address).dsched_feed_chunk(
                feed=feed.id, index=index, work=ToPickle(work), slot=ToPickle(slot), about=about)
            if not isinstance(reply, dict) or "ok" not in reply:  # a worker without the handler, or it failed
                raise RuntimeError(f"worker {feed.address} did not run the chunk: {reply!r}"[:500])
            outcome = FeedOutcome(ticket, index, feed.address, reply["ok"], _unwrap(reply["value"]), reply["start"],
                                  reply["stop"])
        except Exception as err:  # its worker went away
            feed.lost = True
            outcome = FeedOutcome(ticket, index, feed.address, False, err, 0.0, 0.0, lost=True)
        self._answered(feed, outcome)
        if feed.lost:  # what waits for it is lost with it: the dispatcher runs it elsewhere
            self._lose_backlog(feed, outcome.value)
        feed.calling -= 1
        self._pump(feed)

    def _lose_backlog(self, feed, error):
        while feed.backlog:
            _, ticket, index, *_ = feed.backlog.popleft()
            self._answered(feed, FeedOutcome(ticket, index, feed.address, False, error, 0.0, 0.0, True))

    def _answered(self, feed, outcome):
        feed.sent -= 1
        outcome.ticket.status = "finished" if outcome.ok else "error"
        self.put(outcome)

    def _start(self, device):
        """Start ``device``'s feeds: per worker, as many as it has threads and room for chunks of its batch size.

        Each feed holds its share of the worker's device resource, so that feeds
        keep the bound a worker's capacity sets on the items it runs at once.
        """
        if self._events is None:
            self._events = self.client.run_on_scheduler(_has_dashboard)
        resource = device_resource(device)
        items = self.batch_sizes.get(device, 1)
        feeds = []
        for address in self.owners[device]:
            info = self._workers.get(address, {})
            held = (info.get("resources") or {}).get(resource, items)
            lanes = max(1, min(int(info.get("nthreads", 1)), int(held // max(items, 1))))
            for _ in range(lanes):
                feeds.append(_take_parked(self.client, address, device, held / lanes)
                             or _Feed(_new_feed_id(self.client), device, address, None, held / lanes))
        # Known to the run before anything can fail: an interrupted run cancels them (a rearmed feed
        # would otherwise wait for chunks that never come).
        self._feeds[device] = feeds
        # Parked feeds get the run's program before any chunk; one that ended meanwhile is replaced.
        # Their tasks' notices come to this run from before the rearm: one that retires right after it
        # gets its successor.
        parked = [f for f in feeds if f.future is not None]
        for f in parked:
            self._by_key[f.future.key], f.owner = f, self
        rearmed = self.client.sync(self._rearm_all, parked) if parked else []
        for feed, ok in zip(parked, rearmed):
            if not ok:  # no scheduler round trip for the others: their tasks run already
                del self._by_key[feed.future.key]
                feed.owner = None
                feed.future.release()
                feeds[feeds.index(feed)] = _Feed(_new_feed_id(self.client), device, feed.address, None, feed.holds)
        for feed in feeds:
            if feed.future is None:
                self._submit(feed, feed.id)
        return feeds

    async def _rearm_all(self, feeds) -> list:
        """Hand parked feeds this run's program, all at once; whether each took it."""
        async def rearm(feed):
            try:
                reply = await self.client.rpc(feed.address).dsched_feed_rearm(
                    feed=feed.id, program=ToPickle(self.program), epoch=feed.epoch)
                return reply == "OK"
            except Exception:  # noqa: BLE001  its worker is gone
                return False

        return await asyncio.gather(*(rearm(f) for f in feeds))

    def _submit(self, feed, key):
        feed.future = self.client.submit(run_feed, self.program, feed.device, feed.id, key=key,
                                         workers=[feed.address], allow_other_workers=False,
                                         resources={device_resource(feed.device): feed.holds}, pure=False)
        self._by_key[key] = feed
        feed.owner = self
        notify_when_done(self.client, [feed.future], feed.task_ended)

    def ended(self, future):
        """A feed's task ended: one that retired (gave its thread to others) gets a successor on its inbox."""
        feed = self._by_key.pop(future.key, None)
        if feed is None or feed.stopped or feed.lost or future.status != "finished":
            return  # stopped at the run's end, gone with its worker, cancelled, or failed (its chunks were told)
        feed.tasks += 1
        self._submit(feed, f"{feed.id}-{feed.tasks}")

    def close(self):
        """The run is over (its feeds' inboxes are empty): park its feeds for the client's next run, or stop
        them and release their tasks.

        With the dashboard, stop them and wait for their tasks to end: their
        chunk events then reached the scheduler before the run returns.
        """
        feeds = self._forget()
        if not feeds:
            return
        if self._events:
            self.client.sync(self._stop, feeds, False)
            for feed in feeds:
                try:
                    feed.future.result(timeout=30)  # a retired feed's last task ended already
                except Exception:  # noqa: S110  a feed that failed told its chunks already
                    pass
        elif self._linger > 0:  # parked for the client's next run; the others stop
            parked = [f for f in feeds if not (f.lost or f.stopped) and f.future.status == "pending"]
            feeds = [f for f in feeds if f not in parked]
            messages = _park(self.client, parked, self._linger)
            self.client.loop.add_callback(self._send_park, messages, self._linger)
        self.client.loop.add_callback(self._stop, feeds)

    def cancel(self):
        """Give up: cancel the feeds' tasks (chunks still queued on them are refused)."""
        feeds = self._forget()
        if feeds:
            self.client.cancel([f.future for f in feeds])
            self.client.loop.add_callback(self._stop, feeds)

    def _forget(self) -> list:
        """The run's feeds, and drop what the run held (its model may hold the caller's arrays): the stop
        messages still under way must not keep them alive."""
        feeds = [f for fs in self._feeds.values() for f in fs if f.future is not None]
        for feed in feeds:
            feed.owner = None
        self.program, self._by_key = None, {}
        return feeds

    async def _send_park(self, messages, linger):
        for address, feed_id, epoch in messages:
            try:
                await self.client.rpc(address).dsched_feed_park(feed=feed_id, linger=linger, epoch=epoch)
            except Exception:  # noqa: S110  its worker is gone: a run that takes the feed finds out
                pass

    async def _stop(self, feeds, release=True):
        for feed in feeds:
            if not feed.lost and not feed.stopped:
                feed.stopped = True
                try:
                    await self.client.rpc(feed.address).dsched_feed_stop(feed=feed.id)
                except Exception:  # noqa: S110  its worker is gone, and the feed with it
                    pass
            if release:
                feed.future.release()


def _has_dashboard(dask_scheduler=None) -> bool:
    return DASHBOARD_PLUGIN in dask_scheduler.plugins


def _spawn(coroutine):
    task = asyncio.ensure_future(coroutine)
    _state.calls.add(task)
    task.add_done_callback(_state.calls.discard)


# --- parked feeds: a client's feeds kept between its runs ------------------------------

def _new_feed_id(client) -> str:
    """``dsched-feed-<client and thread>-<n>``: a feed outlives its run, so its name carries who runs it (its
    worker tells that caller's other feeds from other tasks by it), not the run. Runs of one client on
    several threads are told apart, as they were when feeds ended with their runs."""
    token = hashlib.sha1(f"{client.id}-{threading.get_ident()}".encode()).hexdigest()[:16]
    return f"dsched-feed-{token}-{next(_state.feed_numbers)}"


def _parked(client) -> dict:
    """The client's parked feeds: ``{(calling thread, worker address, device, items held): [_Feed]}``."""
    return client.__dict__.setdefault("_dsched_parked_feeds", {})


def _sweep(pool, now):
    """Let go of the pool's feeds past their time or whose task ended (any key: a run may never ask for it
    again, its worker restarted elsewhere or its batch size changed)."""
    for key, feeds in list(pool.items()):
        keep = [f for f in feeds if now < f.reuse_until and f.future.status == "pending"]
        for feed in feeds:
            if feed not in keep:
                feed.future.release()  # its task ends (or has)
        if keep:
            pool[key] = keep
        else:
            del pool[key]


def _park(client, feeds, linger) -> list:
    """Keep ``feeds`` for the client's next run; the park messages to send, ``(address, feed id, epoch)``."""
    now = time.monotonic()
    messages = []
    with _state.parked_lock:
        pool = _parked(client)
        _sweep(pool, now)
        for feed in feeds:
            feed.epoch += 1
            feed.reuse_until = now + linger - _REUSE_MARGIN
            pool.setdefault((threading.get_ident(), feed.address, str(feed.device), feed.holds), []).append(feed)
            messages.append((feed.address, feed.id, feed.epoch))
    return messages


def release_parked(client):
    """Let go of ``client``'s parked feeds now: their tasks end, and their workers' threads are free at once.

    For a benchmark that must start from idle workers, or a program about to
    hand its devices to someone else; otherwise parked feeds end by themselves.
    """
    with _state.parked_lock:
        feeds = [f for fs in _parked(client).values() for f in fs]
        _parked(client).clear()
    for feed in feeds:
        feed.future.release()


def _take_parked(client, address, device, holds):
    """A parked feed of this thread's runs of the client on ``address`` for ``device``, its task still running,
    made ready for a new run (which sends it its program); ``None`` if there is none."""
    with _state.parked_lock:
        pool = _parked(client)
        _sweep(pool, time.monotonic())
        waiting = pool.get((threading.get_ident(), address, str(device), holds))
        if not waiting:
            return None
        feed = waiting.pop()
        feed.epoch += 1
        feed.sent, feed.calling, feed.backlog = 0, 0, collections.deque()
        return feed


def register_plugin(client, scheduler_id):
    """Install :class:`FeedPlugin` on ``client``'s cluster, once per scheduler this process talks to."""
    if scheduler_id is None or scheduler_id not in _state.registered:
        client.register_plugin(FeedPlugin())
        _state.registered.add(scheduler_id)
