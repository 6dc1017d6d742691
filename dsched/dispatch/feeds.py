"""Device feeds, the client's side: a run's chunks reach their worker straight from the client, one small message each.

A chunk sent as its own Dask task costs a scheduler round trip: the graph update, the transitions, the worker's
task state machine and the completion notice (``docs/benchmarks.md``). A *feed* pays that once per run and device
thread: one Dask task (:func:`run_feed`) pinned to a device worker like a chunk, holding a share of the device's
resource, that runs the chunks arriving in an inbox of its worker. The client sends each chunk's descriptor
(references into the run's store and its output slot, a few hundred bytes) over the feed's fast lane
(:mod:`dsched.dispatch.lanes`), else with a direct RPC over Dask's comms (TLS included); the reply is the chunk's
outcome and timings. Nothing goes through the scheduler per chunk. A run's new feeds of every device start
together, each device's lanes opened just before its first chunks go (a handshake waits for its worker).

The scheduler still sees each feed as a task (dashboard task stream, worker restrictions, resources), and with
the dashboard the per-device rows come from chunk events (``dsched-chunks``).

A worker that dies costs no more than the chunks it held. Its feeds are forgotten as soon as the client hears of it
(a failed RPC or lane, the scheduler's ``remove-worker`` event on the worker's topic, or a run's look at the cluster
each tick): their chunks run again as tasks (:mod:`dsched.dispatch`), a run's end never waits for them, and their
tasks are released. Every message to a worker is bounded (Dask retries a refused connection for 30 s; a feed's
worker that refuses is gone). As soon as a worker on this host owns the device again (a nanny's restart), the run
starts feeds on it, so it takes its full share.

Devices are shared: several clients may run on the same workers at once.
So a feed does not hold its thread for a whole run when others wait for the
worker. When another task is ready or waits for the device's resource (an
other client's chunk or feed, or a chunk of this run sent as a task), the
feed *retires* after its current chunk, leaving its inbox open, and the
client starts a successor task on that inbox, which queues behind the
others. Without contention a feed lives as long as its run.

A solver calls again and again, and a feed's task takes a scheduler round trip to start (about 10 ms here, a quarter
of a 100,000-point call, though sent at once: ``send_now``). So when a run ends without the dashboard, its feeds are
*parked* rather than stopped: each waits on its worker, holding its thread and its share of the device, for
``dsched.feed-linger`` seconds (2 by default; 0 stops them at once). The client's next run from the same thread, of
any dispatcher, takes them: its first chunks to each carry its program (no round trip before them), or name it where
the feed's inbox keeps it from an earlier run (a solver taking turns between models sends each once). A parked feed
ends at once when any other task waits for its worker, and when its time is up. A feed with a fast lane is told it
is parked only after ``dsched.feed-park-delay`` seconds (0.25 by default) without a next run: a solver's next call
usually comes sooner and takes it on, so a call pays no park message and its worker no wake-up for one. One that had
ended unnoticed refuses those chunks, and the run sends them to a new feed on that worker; one whose worker is gone
fails them, and they run again as tasks while the run starts feeds where the device is now.

The worker side (:mod:`dsched.worker.feed`) is a handler installed by :class:`FeedPlugin`, registered by
the dispatcher on first use. This module is the client's side: a run's :class:`Feeds`, and the parked feeds
kept between runs (:func:`release_parked`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import threading
from dataclasses import dataclass

import dask
from distributed.protocol.serialize import ToPickle

from dsched.dataplane.store import classify_workers
from dsched.devices.device import device_resource, placement_device
from dsched.devices.ownership import device_owners
from dsched.dispatch.completion import ask_worker, notify_when_done, send_now, submit_task, until_done, watch_worker
from dsched.dispatch.lanes import FastLanes, hold_program, lanes_enabled, open_lane
from dsched.dispatch.parking import (
    ANSWER_WAIT,
    _is_gone,
    _new_feed_id,
    _park,
    _running,
    _state,
    _take_parked,
    _worker_left,
    register_plugin,
    release_parked,
    send_parks,
    tell_parked_later,
)
from dsched.names import CHUNK_EVENT_TOPIC, is_feed_key
from dsched.worker.feed import CHUNK_OP, CHUNKS_OP, ENDED, STOP_OP, FeedPlugin, _unwrap, run_feed

# Also importable from here (the old path ``dsched.feed`` names this module): the worker's side and the names.
__all__ = ["FeedPlugin", "Feeds", "FeedOutcome", "FeedTicket", "LaneLost", "run_feed", "is_feed_key",
           "release_parked", "CHUNK_EVENT_TOPIC"]

WINDOW = 2  # messages of one feed on its worker at a time (one running, one queued): the rest wait on the client
MAX_BATCH = 64  # chunks in one message at most, where the backlog is deep (``dsched.feed-batch``)
BATCH_SECONDS = 0.002  # a message's chunks run this long at most: their outcomes wait for the last one
LINGER = 2.0  # seconds a feed waits, parked, for the same client's next run on that thread (``dsched.feed-linger``)
PARK_DELAY = 0.25  # seconds before a lane's feed is told it is parked, if no run took it (``dsched.feed-park-delay``)
_END_WAIT = 10.0  # with the dashboard, seconds a run's end waits for its stopped feeds' tasks to end


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


@dataclass
class LaneLost:
    """The event loop gave up a feed that has a fast lane: the run moves the lane's chunks (:meth:`Feeds.lane_lost`)."""

    feed: object


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
    lost: bool = False  # its worker is gone
    error: object = None  # why
    stopped: bool = False
    epoch: int = 0  # of its last park or rearm message: the worker applies only newer ones
    rearm: bool = False  # taken from the parked ones: its messages carry the run's program until one is answered
    successor: object = None  # the new feed that took its chunks, had it ended before the rearm reached it
    reuse_until: float = 0.0  # parked: time.monotonic() until which a run may take it
    owner: object = None  # the run's Feeds it serves; None while parked or after its run
    chunk_seconds: float = float("inf")  # how long its recent chunks ran (unknown: as if long)
    lane: object = None  # its fast lane (dsched.dispatch.lanes), where its worker shares this file system
    lane_due: bool = False  # started with a lane to open: opened just before its device's first chunks go
    # The dispatchers whose programs its worker keeps, the one it runs now last (dsched.dispatch.lanes.hold_program).
    programs: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    def let_go(self):
        """Release its task (it ends, or has) and close its lane."""
        self.future.release()
        if self.lane is not None:
            self.lane.close()

    def task_ended(self, future):
        """Its task's completion notice, for the run it serves now (one watcher per task, whatever the runs)."""
        owner = self.owner
        if owner is not None:
            owner.put(future)


class Feeds(FastLanes):
    """The feeds of one run: started (or taken from the parked ones) per device on its first chunk, parked or
    stopped when the run ends.

    Parameters
    ----------
    client : distributed.Client
    program : ChunkProgram
        Shipped once per feed: with its task, or with a parked one's first chunks (its rearm).
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
        self.client, self.program, self.run_id, self.owners, self.put = client, program, run_id, owners, put
        self.batch_sizes = batch_sizes
        self._linger = float(dask.config.get("dsched.feed-linger", LINGER))
        self._batch = max(1, int(dask.config.get("dsched.feed-batch", MAX_BATCH)))  # read once, not per message
        self._feeds = {}  # Device -> [_Feed], from its first chunk on (lost ones included)
        self._workers = cluster["workers"]  # address -> its threads and resources, as the run last saw them
        self._events = bool(cluster.get("dsched-dashboard"))  # whether the scheduler has the dashboard
        self._by_key = {}  # task key -> feed, for the tasks not yet ended
        self._fast_lane = lanes_enabled()
        self._chunk_events = []  # the dashboard's events of lane chunks not yet sent (FastLanes.flush_events)
        self._over_comms = False  # a chunk went over Dask's comms (FastLanes.lanes_only)
        # A feed's task ending (the dispatcher's thread) and its renewal (the event loop) swap its task.
        self._tasks_lock = threading.Lock()
        register_plugin(client, cluster.get("id"))
        with _state.parked_lock:
            _running(client).add(self)  # told when a worker leaves (_worker_left)

    def started(self, device) -> bool:
        """Whether ``device``'s feeds were started (or taken from the parked ones) by this run."""
        return device in self._feeds

    def serves(self, device) -> bool:
        """Whether ``device``'s chunks go to feeds: its workers share this host, and one of its feeds (started on
        its first chunk) still has its worker."""
        if device not in self.owners:
            return False
        feeds = self._feeds.get(device)
        if feeds is None:
            feeds = self._start(device)
        return any(not f.lost for f in feeds)

    def send(self, device, chunks) -> list:
        """Send ``chunks`` (``(index, items, work, slot)``) to the least busy feeds of ``device``; their tickets.

        Each chunk's :class:`FeedOutcome` is ``put`` when its feed replies. One
        wake-up of the event loop for them all.
        """
        feeds = self._feeds.get(device)
        if feeds is None:
            feeds = self._start(device)
        for feed in feeds:
            if feed.lane_due:  # the handshake waits for its worker: each device's, just before its chunks go
                feed.lane_due = False
                feed.lane = open_lane(self.client, feed.address, feed.id)
        # A feed lost since serves() was asked answers at once that it is: its chunks run again as tasks.
        feeds = [f for f in feeds if not f.lost] or feeds
        calls, by_lane, tickets = [], {}, []
        for index, items, work, slot in chunks:
            feed = min(feeds, key=lambda f: f.sent)
            feed.sent += 1
            ticket = FeedTicket(f"{feed.id}-{index}")
            tickets.append(ticket)
            about = (self.run_id, self.client.id, str(placement_device(device)), items, ticket.key) \
                if self._events else None
            if feed.lane is not None and not feed.lost:
                by_lane.setdefault(feed, []).append((ticket, index, work, slot, about))
            else:
                calls.append((feed, ticket, index, work, slot, about))
        for feed, items in by_lane.items():
            self._send_lane(feed, items)
        if calls:
            self._over_comms = True
            self.client.loop.add_callback(self._call_all, calls)
        return tickets

    async def _call_all(self, calls):
        for call in calls:
            call[0].backlog.append(call)
        for feed in {id(call[0]): call[0] for call in calls}.values():
            self._pump(feed)

    def _pump(self, feed):
        """Start RPCs for ``feed``'s waiting chunks, up to :data:`WINDOW` at a time (on the event loop).

        Its worker needs the next chunk queued while it runs one, not the whole
        backlog: thousands of concurrent RPCs would each open a connection. A
        backlog deeper than the window (many small chunks in flight) is split
        over the window's messages, at most ``dsched.feed-batch`` chunks each
        (default 64): one message's cost per batch instead of per chunk. Only
        chunks known to be short are batched (a message's chunks report when
        the last one ran, :data:`BATCH_SECONDS` at most): the first chunks, and
        any of a feed whose chunks take longer, go one per message, each
        chunk's outcome as soon as it ran.
        """
        limit = self._batch
        if feed.chunk_seconds < BATCH_SECONDS:
            limit = min(limit, max(1, int(BATCH_SECONDS / max(feed.chunk_seconds, 1e-6))))
        else:
            limit = 1
        while feed.backlog and feed.calling < WINDOW:
            take = min(limit, max(1, len(feed.backlog) // (WINDOW - feed.calling)))
            calls = [feed.backlog.popleft() for _ in range(take)]
            feed.calling += 1
            _spawn(self._call(feed, calls))

    def refuse(self, device):
        """Send no more of ``device``'s chunks to feeds: its workers are gone (the run moves its chunks)."""
        for feed in self._feeds.get(device, ()):
            self.client.loop.add_callback(self._lose, feed, ConnectionError(f"no worker owns {device} any more"))

    async def _call(self, feed, calls):
        """``feed``'s chunks in one message (one chunk, or several where they are short); each one's outcome
        once they all ran."""
        outcomes = None
        if not feed.lost:  # a lost feed's chunks run again at once, without trying its worker
            try:
                replies = await self._send(feed, calls)
                if replies == ENDED:
                    self._renew(feed, calls)
                    feed.calling -= 1
                    return
                feed.rearm = False
                outcomes = [FeedOutcome(ticket, index, feed.address, reply["ok"], _unwrap(reply["value"]),
                                        reply["start"], reply["stop"])
                            for (_, ticket, index, *_), reply in zip(calls, replies)]
            except OSError as err:  # its worker went away (or froze): so did every feed on it
                _worker_left(self.client, feed.address, err)
            except Exception as err:  # noqa: BLE001  the worker refused them: this feed is lost, maybe not the others
                self._lose(feed, err)
        if outcomes is None:  # what waits for them is lost with it: the dispatcher runs them elsewhere
            outcomes = [_lost_outcome(feed, ticket, index) for _, ticket, index, *_ in calls]
        for outcome in outcomes:
            self._answered(feed, outcome)
        feed.calling -= 1
        self._pump(feed)

    async def _send(self, feed, calls):
        """The message of ``calls`` to ``feed``'s worker: the replies, in order, or :data:`ENDED`; raises if the
        worker did not run them."""
        if len(calls) == 1:
            _, _, index, work, slot, about = calls[0]
            reply = await self._ask(feed.address, CHUNK_OP, None, feed=feed.id, index=index, work=ToPickle(work),
                                    slot=ToPickle(slot), about=about, **self._rearming(feed))
            if reply == ENDED:
                return ENDED
            if not isinstance(reply, dict) or "ok" not in reply:  # a worker without the handler, or it failed
                raise RuntimeError(f"worker {feed.address} did not run the chunk: {reply!r}"[:500])
            return [reply]
        chunks = [(index, ToPickle(work), ToPickle(slot), about) for _, _, index, work, slot, about in calls]
        replies = await self._ask(feed.address, CHUNKS_OP, None, feed=feed.id, chunks=chunks, **self._rearming(feed))
        if replies != ENDED and (not isinstance(replies, (list, tuple)) or len(replies) != len(calls)):
            raise RuntimeError(f"worker {feed.address} did not run the chunks: {replies!r}"[:500])
        return replies

    def _ask(self, address, op, wait=None, **message):
        """A message to a feed's worker and its answer (a coroutine), given up once the worker is known gone."""
        return ask_worker(self.client, address, op, wait, functools.partial(_is_gone, address), **message)

    def _lose(self, feed, error):
        """``feed``'s worker is gone (on the event loop): its waiting chunks run again as tasks, and its task is
        released (pinned to the dead worker, it would wait on the scheduler for good). Its chunks in flight fail
        by themselves."""
        if feed.lost:
            return
        feed.lost, feed.error = True, error
        while feed.backlog:
            _, ticket, index, *_ = feed.backlog.popleft()
            self._answered(feed, _lost_outcome(feed, ticket, index))
        if feed.future is not None:
            feed.future.release()
        if feed.lane is not None:  # its lane's chunks are the dispatching thread's to move (a frozen worker's
            self.put(LaneLost(feed))  # lane may never close)

    def lose_worker(self, address, error):
        """The worker at ``address`` left: every feed of the run on it is lost (on the event loop)."""
        for feed in self._all():
            if feed.address == address:
                self._lose(feed, error)

    @staticmethod
    def _outcome(feed, ticket, index, ok, value, start, stop) -> FeedOutcome:
        return FeedOutcome(ticket, index, feed.address, ok, value, start, stop)

    @staticmethod
    def _lost(feed, ticket, index) -> FeedOutcome:
        return _lost_outcome(feed, ticket, index)

    def _answered(self, feed, outcome, put=True):
        """Account for ``outcome`` on its feed; put it in the run's mailbox (or return it, read on the run's
        own thread)."""
        feed.sent -= 1
        if outcome.ok and outcome.stop >= outcome.start > 0:  # recent chunks' time, for how many to batch
            seconds = outcome.stop - outcome.start
            feed.chunk_seconds = seconds if feed.chunk_seconds == float("inf") else \
                0.5 * feed.chunk_seconds + 0.5 * seconds
        outcome.ticket.status = "finished" if outcome.ok else "error"
        if not put:
            return outcome
        self.put(outcome)

    def _all(self) -> list:
        return [f for fs in list(self._feeds.values()) for f in list(fs)]

    def follow(self, workers):
        """Keep the run's feeds on the cluster's workers as a look at it found them (each tick of the run).

        A feed whose worker left is lost (its chunks run again as tasks), and a
        device that lost feeds gets new ones as soon as a worker on this host
        owns it again: a restarted worker takes its full share of chunks.
        """
        self._workers = workers
        for address in {f.address for f in self._all() if not f.lost and f.address not in workers}:
            self.client.loop.add_callback(_worker_left, self.client, address,
                                          ConnectionError(f"worker {address} left the cluster"))
        owners = device_owners(self.client, list(self._feeds), workers)
        for device, feeds in list(self._feeds.items()):
            served = {f.address for f in feeds if not f.lost}
            new = [a for a in owners[device] if a not in served and not _is_gone(a)]
            try:
                kinds = classify_workers(self.client, new) if new else {}
            except Exception:  # noqa: BLE001  it left as it came: the next look tries again
                kinds = {}
            local = [a for a, kind in kinds.items() if kind != "remote"]
            if local:
                self._open({device: local})

    def start(self, devices):
        """Start the feeds of those of ``devices`` this run serves and has not started: parked ones taken first
        (their rearm goes with their first chunks), new ones started."""
        wanted = {}
        for device in devices:
            if device in self.owners and device not in self._feeds:
                self._feeds[device] = []
                wanted[device] = [a for a in self.owners[device] if a in self._workers and not _is_gone(a)]
        if wanted:
            self._open(wanted)

    def _start(self, device) -> list:
        self.start([device])
        return self._feeds[device]

    def _open(self, wanted):
        """Add feeds for each device of ``wanted`` (``{Device: addresses}``) on its addresses: per worker, as many
        as it has threads and room for chunks of its batch size, parked ones first.

        Each feed holds its share of the worker's device resource, so that feeds
        keep the bound a worker's capacity sets on the items it runs at once.
        """
        started = []
        for device, addresses in wanted.items():
            opened = self._lanes(device, addresses)
            self._feeds[device].extend(opened)  # known before anything can fail: an interrupted run cancels them
            for feed in opened:
                if feed.future is None:
                    self._submit(feed, feed.id)
                    started.append(feed)
                else:  # parked: the run's program goes with its first chunks; no round trip before them
                    # Its task's notices come to this run from now on: one that retires gets its successor.
                    self._by_key[feed.future.key], feed.owner, feed.rearm = feed, self, True
        if started:  # new tasks: not held for the client's batch window (nor behind the subscriptions below)
            send_now(self.client)
            for feed in started:  # every device's tasks on their way before any handshake: those overlap them
                feed.lane_due = self._fast_lane
        for address in {a for addresses in wanted.values() for a in addresses}:
            watch_worker(self.client, address, _worker_left)

    def _lanes(self, device, addresses) -> list:
        """``device``'s feeds on ``addresses``, parked ones taken first (not started)."""
        resource = device_resource(device)
        items = self.batch_sizes.get(device, 1)
        opened = []
        for address in addresses:
            info = self._workers.get(address, {})
            held = (info.get("resources") or {}).get(resource, items)
            lanes = max(1, min(int(info.get("nthreads", 1)), int(held // max(items, 1))))
            for _ in range(lanes):
                opened.append(_take_parked(self.client, address, device, held / lanes)
                              or _Feed(_new_feed_id(self.client), device, address, None, held / lanes))
        return opened

    def _renew(self, feed, calls, on_lane=False):
        """A parked feed this run took had ended before its program reached it (``calls`` came back
        :data:`ENDED`, on the event loop; or its lane closed, on the dispatching thread): a new feed on the same
        worker takes them, and the chunks still waiting for the old one. A lane's get a lane of their own."""
        if feed.lost:  # its worker left meanwhile: the dispatcher runs them elsewhere
            for _, ticket, index, *_ in calls:
                self._answered(feed, _lost_outcome(feed, ticket, index))
            return
        with self._tasks_lock:
            new = feed.successor
            if new is None:
                self._by_key.pop(feed.future.key, None)  # its task (or a successor ended() gave it) goes
                feed.owner = None
                feed.future.release()
                feeds = self._feeds[feed.device]
                new = feed.successor = _Feed(_new_feed_id(self.client), feed.device, feed.address, None, feed.holds)
                feeds[feeds.index(feed)] = new
                self._submit(new, new.id)
                if on_lane and self._fast_lane:
                    new.lane = open_lane(self.client, new.address, new.id)
        moved = [(new, *call[1:]) for call in [*calls, *feed.backlog]]
        feed.backlog.clear()
        feed.sent -= len(moved)
        new.sent += len(moved)
        if not on_lane:
            new.backlog.extend(moved)
            self._pump(new)
        elif new.lane is not None:
            self._send_lane(new, [call[1:] for call in moved])
        else:
            self._over_comms = True
            self.client.loop.add_callback(self._call_all, moved)

    def _rearming(self, feed) -> dict:
        """What a message to ``feed`` carries besides its chunks: the run's program, until the feed answered."""
        if not feed.rearm:
            return {}
        hold_program(feed, self.program.dispatcher_id)
        return {"rearm": ToPickle((self.program, feed.epoch))}

    def _submit(self, feed, key):
        self._by_key[key] = feed
        feed.owner = self
        submit_feed(self.client, self.program, feed, key)

    def ended(self, future):
        """A feed's task ended: one that retired (gave its thread to others) gets a successor on its inbox."""
        with self._tasks_lock:
            feed = self._by_key.pop(future.key, None)
            if feed is None or feed.stopped or feed.lost or feed.successor is not None or future.status != "finished":
                # Stopped at the run's end, gone with its worker, cancelled, failed (its chunks were told), or
                # renewed (it had ended before its rearm).
                return
            feed.tasks += 1
            self._submit(feed, f"{feed.id}-{feed.tasks}")

    def close(self):
        """The run is over (its feeds' inboxes are empty): park its feeds for the client's next run, or stop
        them and release their tasks. Feeds whose worker is gone were released already.

        With the dashboard, the page hears of the lanes' chunks off the run's path (queued
        for the client's timer, :func:`~dsched.observe.dashboard.client.tell_page`); of
        the chunks of feeds without a lane before the run returns, by stopping them and
        waiting for their tasks to end.
        """
        feeds = [f for f in self._forget() if not f.lost]
        if not feeds:
            return
        if self._events:  # the page hears of this run's lane chunks off its path
            self.flush_events()
        if self._events and any(f.lane is None for f in feeds):  # chunks over Dask's comms: their events too
            self.client.sync(self._stop_and_wait, feeds)
        elif self._linger > 0:  # parked for the client's next run; the others stop
            parked = [f for f in feeds if not (f.lost or f.stopped) and f.future.status == "pending"]
            feeds = [f for f in feeds if f not in parked]
            messages = _park(self.client, parked, self._linger)
            now = [m for f, m in zip(parked, messages) if f.lane is None]
            later = [(f, m) for f, m in zip(parked, messages) if f.lane is not None]
            if now:
                self.client.loop.add_callback(send_parks, self.client, now, self._linger)
            if later:  # told only if no run takes them meanwhile (the usual case of a solver's loop)
                delay = float(dask.config.get("dsched.feed-park-delay", PARK_DELAY))
                tell_parked_later(self.client, later, self._linger, delay)
        if feeds:
            self.client.loop.add_callback(self._stop, feeds)

    def cancel(self):
        """Give up: cancel the feeds' tasks (chunks still queued on them are refused)."""
        feeds = [f for f in self._forget() if not f.lost]
        if feeds:
            self.client.cancel([f.future for f in feeds])
            self.client.loop.add_callback(self._stop, feeds)

    def _forget(self) -> list:
        """The run's feeds, and drop what the run held (its model may hold the caller's arrays): the stop
        messages still under way must not keep them alive."""
        with _state.parked_lock:
            _running(self.client).discard(self)
        feeds = [f for f in self._all() if f.future is not None]
        for feed in feeds:
            feed.owner = None
        self.program, self._by_key = None, {}
        return feeds

    async def _stop(self, feeds, release=True):
        async def stop(feed):
            if not feed.lost and not feed.stopped:
                feed.stopped = True
                try:
                    await self._ask(feed.address, STOP_OP, ANSWER_WAIT, feed=feed.id)
                except Exception as err:  # noqa: BLE001  its worker is gone, and the feed with it
                    _worker_left(self.client, feed.address, err)
            if feed.lane is not None:  # a stopped feed is never taken again
                feed.lane.close()
            if release:
                feed.future.release()

        await asyncio.gather(*(stop(f) for f in feeds))

    async def _stop_and_wait(self, feeds):
        """Stop ``feeds`` and wait for their tasks to end; a feed whose worker leaves meanwhile is released, which
        ends the wait for it, and no wait is longer than :data:`_END_WAIT`."""
        await self._stop(feeds, release=False)
        await until_done([f.future for f in feeds if not f.lost], _END_WAIT)


def submit_feed(client, program, feed, key):
    """Start ``feed``'s task ``key`` with ``program`` (its first, or a successor on its inbox after it retired),
    pinned to its worker and holding its share of the device; its end is told to the feed's owner."""
    hold_program(feed, program.dispatcher_id)
    feed.future = submit_task(client, run_feed, program, feed.device, feed.id, key=key, workers=[feed.address],
                              allow_other_workers=False, resources={device_resource(feed.device): feed.holds},
                              pure=False)
    notify_when_done(client, [feed.future], feed.task_ended)


def _lost_outcome(feed, ticket, index) -> FeedOutcome:
    """A chunk of a feed whose worker is gone, not run: the dispatcher runs it elsewhere."""
    return FeedOutcome(ticket, index, feed.address, False, feed.error, 0.0, 0.0, lost=True)


def _spawn(coroutine):
    task = asyncio.ensure_future(coroutine)
    _state.calls.add(task)
    task.add_done_callback(_state.calls.discard)
