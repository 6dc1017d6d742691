"""Parked feeds: a client's feeds kept between its runs, and what the client's side keeps for the process.

When a run ends without the dashboard, its feeds wait on their workers for the
same client's next run (``dsched.feed-linger``), which takes them instead of
starting new ones (:func:`_take_parked`); :func:`release_parked` lets them go.
The pool lives on the client object; :data:`_state` holds what the feeds of
every client of the process share (the lock, feed numbers, workers known gone).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import itertools
import threading
import time
import weakref

from dsched.devices.ownership import forget_cluster_info
from dsched.dispatch.completion import ask_worker
from dsched.worker.feed import PARK_OP, FeedPlugin

__all__ = ["release_parked", "register_plugin", "caller_id", "running_for"]

ANSWER_WAIT = 5.0  # seconds a worker has to answer a stop or park (a frozen worker never does)
PARK_CHECK = 0.05  # seconds between the event loop's looks at the parks waiting to be told
_REUSE_MARGIN = 0.5  # a parked feed is reused only this long before its worker would end it
_GONE_FOR = 30.0  # seconds a worker that failed a feed's message is avoided (a restarted one has a new address)


class _ProcessState:
    """What the client's side keeps for the whole process, across runs and clients (one instance: :data:`_state`).

    A client's parked feeds and running :class:`Feeds` are kept on the client
    (:func:`_parked`, :func:`_running`); the lock here guards them.
    """

    def __init__(self):
        self.calls = set()  # RPCs under way: asyncio keeps only weak references to tasks
        self.feed_numbers = itertools.count()  # the <n> of feed ids (_new_feed_id)
        self.parked_lock = threading.Lock()  # held while a client's parked pool or running runs are read or changed
        self.registered = set()  # ids of the clients' schedulers that have the plugin
        self.gone = {}  # worker address -> time.monotonic() when a message to it failed, or it left the cluster


_state = _ProcessState()


_caller = threading.local()  # .id: the thread a submitted call runs for (dsched.submit's runner sets it)


def caller_id() -> int:
    """Whose parked feeds this thread's runs take and leave: the thread's own, or, while it runs a call submitted
    by another thread (:func:`dsched.submit`), that thread's. A driver's submitted updates and its caller's own
    dispatch calls so take turns on the same feeds rather than each ending the other's (a new feed is a
    scheduler round trip). The feeds a run starts still carry the thread that runs it (:func:`_new_feed_id`):
    two runs going at once, one of them submitted, give way to each other on the workers as before."""
    return getattr(_caller, "id", None) or threading.get_ident()


@contextlib.contextmanager
def running_for(caller):
    """Runs in this block are ``caller``'s (:func:`caller_id`)."""
    before = getattr(_caller, "id", None)
    _caller.id = caller
    try:
        yield
    finally:
        _caller.id = before


def _is_gone(address) -> bool:
    """Whether the worker at ``address`` left, or failed a message, in the last :data:`_GONE_FOR` seconds."""
    since = _state.gone.get(address)
    return since is not None and time.monotonic() - since < _GONE_FOR


def _parked(client) -> dict:
    """The client's parked feeds: ``{(calling thread, worker address, device, items held): [_Feed]}``."""
    return client.__dict__.setdefault("_dsched_parked_feeds", {})


_SWEEP_EVERY = 0.05  # seconds between two sweeps of a client's pool (a solver takes and parks feeds per call)


def _usable(feed, now) -> bool:
    """Whether a parked feed may serve a run: within its time, its task running, its worker not gone."""
    return now < feed.reuse_until and feed.future.status == "pending" and not _is_gone(feed.address)


def _sweep(pool, now, client=None):
    """Let go of the pool's feeds past their time, whose task ended or whose worker is gone (any key: a run may
    never ask for it again, its worker restarted elsewhere or its batch size changed). With ``client``, at most
    every :data:`_SWEEP_EVERY` seconds."""
    if client is not None:
        if now < client.__dict__.get("_dsched_next_sweep", 0.0):
            return
        client.__dict__["_dsched_next_sweep"] = now + _SWEEP_EVERY
    for key, feeds in list(pool.items()):
        keep = [f for f in feeds if _usable(f, now)]
        for feed in feeds:
            if feed not in keep:
                feed.let_go()  # its task ends (or has)
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
        _sweep(pool, now, client)
        for feed in feeds:
            feed.epoch += 1
            feed.reuse_until = now + linger - _REUSE_MARGIN
            pool.setdefault((caller_id(), feed.address, str(feed.device), feed.holds), []).append(feed)
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
        feed.let_go()


async def send_parks(client, messages, linger):
    """Tell feeds ``(address, feed id, epoch)`` that they are parked, over Dask's comms (on the event loop)."""
    async def park(address, feed_id, epoch):
        try:
            await ask_worker(client, address, PARK_OP, ANSWER_WAIT, functools.partial(_is_gone, address),
                             feed=feed_id, linger=linger, epoch=epoch)
        except Exception as err:  # noqa: BLE001  its worker is gone: its parked feeds with it
            _worker_left(client, address, err)

    await asyncio.gather(*(park(*m) for m in messages))


def tell_parked_later(client, feeds, linger, delay):
    """Tell ``feeds`` (``[(feed, (address, feed id, epoch))]``) they are parked after ``delay`` seconds, those no
    run took since (their epoch unchanged), with :func:`send_parks`. Also those let go
    of meanwhile: one that retired while it was not known to be parked then closes its inbox on its worker.

    A timer on the client's event loop (started once per client) looks every :data:`PARK_CHECK` seconds: a call
    pays for no message to the event loop, which a solver's next call would find too late to matter.
    """
    due = time.monotonic() + delay
    with _state.parked_lock:
        pending = client.__dict__.setdefault("_dsched_parks_to_tell", {})
        for feed, message in feeds:  # a feed's latest park replaces the one before (whose epoch is gone anyway)
            pending[feed.id] = (due, feed, message, linger)
        start = "_dsched_park_timer" not in client.__dict__
        if start:
            client.__dict__["_dsched_park_timer"] = None
    if start:
        client.loop.add_callback(_start_park_timer, client)


def _start_park_timer(client):
    from tornado.ioloop import PeriodicCallback

    timer = PeriodicCallback(lambda: _tell_due_parks(client, timer), PARK_CHECK * 1000)
    client.__dict__["_dsched_park_timer"] = timer
    timer.start()


def _tell_due_parks(client, timer):
    """On the event loop: send the parks that are due; the timer stops with its client."""
    now = time.monotonic()
    with _state.parked_lock:
        pending = client.__dict__.get("_dsched_parks_to_tell", {})
        due = [key for key, (when, *_) in pending.items() if when <= now]
        by_linger = collections.defaultdict(list)
        for key in due:
            _, feed, message, linger = pending.pop(key)
            if feed.epoch == message[2]:  # no run took it since
                by_linger[linger].append(message)
    if getattr(client, "status", "running") in ("closing", "closed"):
        timer.stop()
        return
    for linger, messages in by_linger.items():
        asyncio.ensure_future(send_parks(client, messages, linger))


def _take_parked(client, address, device, holds):
    """A parked feed of this thread's runs of the client on ``address`` for ``device``, its task still running,
    made ready for a new run (which sends it its program); ``None`` if there is none."""
    now = time.monotonic()
    with _state.parked_lock:
        pool = _parked(client)
        _sweep(pool, now, client)
        waiting = pool.get((caller_id(), address, str(device), holds))
        while waiting and not _usable(waiting[-1], now):  # not swept yet: let go of it now
            waiting.pop().let_go()
        if not waiting:
            return None
        feed = waiting.pop()
        feed.epoch += 1
        feed.sent, feed.calling, feed.backlog = 0, 0, collections.deque()
        return feed


# --- workers that leave ---------------------------------------------------------------

def _worker_left(client, address, error):
    """The worker at ``address`` is gone (on the event loop): the client's parked feeds on it are released, and
    the feeds of its runs on it lost."""
    forget_cluster_info(client)  # the next run asks the scheduler which workers it has
    now = time.monotonic()
    for old in [a for a, since in _state.gone.items() if now - since > _GONE_FOR]:
        del _state.gone[old]
    _state.gone[address] = now
    with _state.parked_lock:
        pool = _parked(client)
        feeds = [f for key in [k for k in pool if k[1] == address] for f in pool.pop(key)]
        runs = list(_running(client))
    for feed in feeds:
        feed.let_go()
    for run in runs:
        run.lose_worker(address, error)


def _running(client) -> weakref.WeakSet:
    """The client's runs whose feeds are out (their :class:`Feeds`)."""
    return client.__dict__.setdefault("_dsched_running_feeds", weakref.WeakSet())


def _new_feed_id(client) -> str:
    """``dsched-feed-<client and thread>-<n>``: a feed outlives its run, so its name carries who runs it (its
    worker tells that caller's other feeds from other tasks by it), not the run. Runs of one client on
    several threads are told apart, as they were when feeds ended with their runs."""
    token = hashlib.sha1(f"{client.id}-{threading.get_ident()}".encode()).hexdigest()[:16]
    return f"dsched-feed-{token}-{next(_state.feed_numbers)}"


def register_plugin(client, scheduler_id):
    """Install :class:`FeedPlugin` on ``client``'s cluster, once per scheduler this process talks to."""
    if scheduler_id is None or scheduler_id not in _state.registered:
        client.register_plugin(FeedPlugin())
        _state.registered.add(scheduler_id)
