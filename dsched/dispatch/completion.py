"""Knowing when chunks finish: completion notices from the client's event loop, workers that leave, lost
devices, and a submitted call's cancel from another thread; and new tasks told to the scheduler at once."""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import queue
import threading
import time
import weakref
from concurrent.futures import CancelledError
from multiprocessing.connection import wait as wait_for_readable

from distributed.core import send_recv

from dsched.cluster.placement import PlacementWarning
from dsched.devices.device import placement_device
from dsched.devices.ownership import absent_since, cluster_info, device_capacities, lost_device_timeout
from dsched.errors import unsendable_fn
from dsched.worker.lane import Bell

__all__ = ["notify_when_done", "until_done", "ask_worker", "watch_worker", "send_now", "DeviceWatch", "Mailbox",
           "Cancellation", "CancelledError", "cancellable", "current_cancellation"]

CONNECT_WAIT = 3.0  # seconds to reach a worker (Dask retries a refused connection for its 30 s connect timeout)
_POLL = 0.05  # seconds between looks at whether a worker being connected to is known to have left


def notify_when_done(client, futures, put):
    """Call ``put(future)`` on the client's event loop as each of ``futures`` finishes (or fails, or is cancelled).

    One loop callback per submitted batch, and the put straight from the loop:
    ``Future.add_done_callback`` wakes the loop once per future and hops through
    Dask's callback thread once per completion, which cost about 90 us of client
    CPU per chunk on two cores (docs/benchmarks.md).
    """
    if futures:
        client.loop.add_callback(_watch_futures, futures, put)


_watchers = set()  # running watcher tasks: asyncio keeps only weak references to tasks


async def _watch_futures(futures, put):
    for future in futures:
        task = asyncio.ensure_future(_watch_future(future, put))
        _watchers.add(task)
        task.add_done_callback(_watchers.discard)


async def _watch_future(future, put):
    # What Future.add_done_callback awaits (distributed.client.done_callback), without its thread hop.
    # ``_state`` is distributed's own; should a release rename it, fall back to the public callback.
    state = getattr(future, "_state", None)
    if state is None or not hasattr(state, "wait"):
        future.add_done_callback(put)
        return
    # "lost": its worker died holding it and the scheduler runs it again, so it is not done yet.
    while future.status in ("pending", "lost"):
        await state.wait()
    put(future)


async def until_done(futures, timeout):
    """Wait, on the client's event loop, until each of ``futures`` is done (or released), at most ``timeout`` s."""
    async def done(future):
        state = getattr(future, "_state", None)
        while future.status in ("pending", "lost"):
            await (state.wait() if hasattr(state, "wait") else asyncio.sleep(0.01))

    waits = [asyncio.ensure_future(done(f)) for f in futures]
    if waits:
        _, late = await asyncio.wait(waits, timeout=timeout)
        for wait in late:
            wait.cancel()


class Mailbox:
    """A run's completion notices, put from any thread, and waited for together with the run's fast lanes.

    A queue with a :class:`~dsched.worker.lane.Bell`: each :meth:`put` rings it,
    so the run's loop can wait in one call for a notice from the event loop or a
    reply on any lane (:mod:`dsched.dispatch.lanes`).
    """

    def __init__(self):
        self._queue = queue.SimpleQueue()
        # A bell of an earlier run of this thread's (a socket pair costs a few system calls).
        self.bell = _idle_bells.pop(threading.get_ident(), None) or Bell()

    def put(self, item):
        self._queue.put(item)
        self.bell.ring()

    def drain(self) -> list:
        """Every notice queued now."""
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items

    def wait(self, connections, timeout) -> list:
        """Wait until a notice is queued or one of ``connections`` is readable, at most ``timeout`` seconds; the
        readable ones."""
        if not self._queue.empty():
            timeout = 0
        ready = wait_for_readable([self.bell.waitable, *connections], timeout)
        if self.bell.waitable in ready:
            self.bell.clear()
            return [c for c in ready if c is not self.bell.waitable]
        return ready

    def close(self):
        """The run is over: its bell, quiet again, waits for the thread's next run (one is kept per living thread);
        a notice that comes later (a late event of the loop) rings a bell nobody waits on, which is harmless."""
        self.bell.clear()
        me = threading.get_ident()
        if me not in _idle_bells:
            for ident in set(_idle_bells) - {t.ident for t in threading.enumerate()}:  # threads that ended
                _idle_bells.pop(ident).close()
            if len(_idle_bells) < _IDLE_BELLS_KEPT:
                _idle_bells[me] = self.bell
                return
        self.bell.close()


_idle_bells = {}  # thread id -> the bell of its last run, for its next (closed at exit, or when the thread ended)
_IDLE_BELLS_KEPT = 64  # threads whose bell is kept at most


@atexit.register
def _close_idle_bells():
    while _idle_bells:
        _idle_bells.popitem()[1].close()


async def ask_worker(client, address, op, wait=None, gone=None, **message):
    """``client.rpc(address).<op>(**message)``, bounded: connecting within :data:`CONNECT_WAIT` seconds (a
    worker of this host that refuses is gone), or until ``gone()`` says the worker left, and the answer within
    ``wait`` seconds if given (a chunk's is not bounded: it takes what the model takes)."""
    pool = client.rpc
    comm = await _connect(pool, address, gone)
    try:
        call = send_recv(comm=comm, op=op, serializers=pool.serializers, deserializers=pool.deserializers, **message)
        return await (call if wait is None else asyncio.wait_for(call, wait))
    finally:
        pool.reuse(address, comm)  # a cancelled or failed call closed it: it is not reused


async def _connect(pool, address, gone):
    if any(not comm.closed() for comm in pool.available.get(address, ())):  # each chunk of a run: no waiting
        return await pool.connect(address, timeout=CONNECT_WAIT)
    # Within its timeout Dask retries a refused connection, and the handshake after it has no timeout at all.
    connecting = asyncio.ensure_future(pool.connect(address, timeout=CONNECT_WAIT))
    give_up = time.monotonic() + 2 * CONNECT_WAIT
    while True:
        done, _ = await asyncio.wait([connecting], timeout=_POLL)
        if done:
            return connecting.result()
        if time.monotonic() > give_up or (gone is not None and gone()):
            connecting.cancel()
            raise ConnectionError(f"could not reach worker {address}")


def submit_task(client, *args, **kwargs):
    """``client.submit(*args, **kwargs)``; a task Dask cannot pickle (most often because of ``fn``) is a one-line
    ``TypeError`` that says why, not Dask's "Could not serialize object of type ..." and its graph."""
    try:
        return client.submit(*args, **kwargs)
    except TypeError as err:
        if "serializ" not in str(err):
            raise
        raise unsendable_fn(err) from None


def send_now(client) -> None:
    """Have ``client`` send the messages it holds for the scheduler now (a run's new feed tasks), not when its batch
    window ends.

    Dask's client sends the scheduler at most one batch of messages every 10 ms (its ``BatchedSend``). A run's
    first tasks would wait for what is left of the window: half of it on average, paid by every run that starts
    its feeds (the first call, or one after the feeds' linger). Done on the client's event loop; nothing where
    the stream is not the one this knows (another version of ``distributed``).
    """
    stream = getattr(client, "scheduler_comm", None)
    if not (hasattr(stream, "next_deadline") and hasattr(stream, "waker")):
        return

    def now():
        stream.next_deadline = None  # the window is over: what the buffer holds goes at once
        stream.waker.set()

    client.loop.add_callback(now)


def watch_worker(client, address, left):
    """Call ``left(client, address, error)`` on the event loop as soon as the worker at ``address`` leaves the
    cluster: the scheduler's ``remove-worker`` event on the worker's topic, which carries little else. Once per
    client and worker."""
    watched = client.__dict__.setdefault("_dsched_watched_workers", set())
    if address in watched:
        return
    watched.add(address)
    ref = weakref.ref(client)  # the handler, kept by the client, must not keep it alive

    def heard(event):
        message = event[1] if isinstance(event, tuple) and len(event) == 2 else event
        client = ref()
        if client is not None and isinstance(message, dict) and message.get("action") == "remove-worker":
            left(client, address, ConnectionError(f"worker {address} left the cluster"))
            client.unsubscribe_topic(address)
            getattr(client, "_event_handlers", {}).pop(address, None)  # unsubscribe_topic keeps it (2026.8)

    client.subscribe_topic(address, heard)


class DeviceWatch:
    """Notices devices that lost every worker while chunks wait on them, and says where to run those instead.

    A device counts as lost once no worker has owned it for ``grace`` seconds
    (Dask config ``dsched.lost-device-timeout``, default 30: time for a
    nanny to restart a worker), counted from when this process first saw it
    without one (a call that waited for it at its start counts too). Its chunks
    then go, as ``map_blocks`` blocks do, to another device of the same kind,
    else to any device a worker owns, with a
    :class:`~dsched.placement.PlacementWarning`; they go back once a worker owns
    the device again. ``workers`` is the cluster's as the last check saw it.
    """

    def __init__(self, client, grace=None, workers=None):
        self.client = client
        self.grace = lost_device_timeout() if grace is None else float(grace)
        self.redirect = {}  # lost device -> the device its chunks run on instead
        self.workers = cluster_info(client)["workers"] if workers is None else workers
        self.capacities = device_capacities(client, self.workers)  # Device -> items its workers may run at once

    def check(self, busy):
        """Update from the cluster; the devices newly redirected, ``{lost: fallback}``."""
        self.workers = cluster_info(self.client)["workers"]
        owned = self.capacities = device_capacities(self.client, self.workers)
        for device in list(self.redirect):
            if placement_device(device) in owned:  # a worker came back
                del self.redirect[device]
        away = [d for d in busy if placement_device(d) not in owned and d not in self.redirect]
        now = time.monotonic()
        newly = {}
        for device, since in absent_since(self.client, away).items():
            if now - since >= self.grace:
                fallback = _fallback(device, owned)
                if fallback is None:
                    raise RuntimeError(
                        f"no worker owns {device} any more (lost for over {self.grace:g} s), "
                        "and no worker owns any other device to run its chunks"
                    )
                self.redirect[device] = newly[device] = fallback
                _warn_relaxed(device, fallback, self.grace)
        return newly

    def request(self, device, size):
        """How much of ``device``'s resource a chunk of ``size`` items asks for: at most what its workers hold,
        so that a chunk moved from a larger device can still run."""
        return min(size, self.capacities.get(placement_device(device), size))

    def where(self, device):
        """The device a chunk scheduled on ``device`` runs on now."""
        return self.redirect.get(device, device)


def _fallback(device, owned):
    same_kind = sorted((d for d in owned if d.type == device.type and d != device), key=str)
    others = sorted((d for d in owned if d.type != device.type), key=lambda d: (d.type != "cpu", str(d)))
    candidates = same_kind + others
    return candidates[0] if candidates else None


def _warn_relaxed(device, fallback, grace):
    import warnings

    warnings.warn(f"no worker has owned {device} for {grace:g} s: its chunks run on {fallback} until one does",
                  PlacementWarning, stacklevel=4)


# --- stopping a run from another thread: what dsched.DispatchFuture.cancel uses --------------
#
# A Cancellation is made per submitted call and made current on the thread that runs it (cancellable).
# A run reads the current one when it starts and gives it a way to wake its loop (a mailbox notice);
# Cancellation.cancel then makes the run raise concurrent.futures.CancelledError where it waits, and
# the run's usual clean-up on an exception (the one a Ctrl-C takes) cancels its chunks and gives their
# loads back.

_current = contextvars.ContextVar("dsched_cancellation", default=None)


class Cancellation:
    """A request to stop one run, made from any thread; the run's wake-up call, once it has started."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requested = False
        self._wake = None

    @property
    def requested(self) -> bool:
        return self._requested

    def cancel(self):
        """Ask the run to stop: it raises ``CancelledError`` where it waits next."""
        with self._lock:
            self._requested, wake = True, self._wake
        if wake is not None:
            wake()

    def bind(self, wake):
        """``wake()`` is called on :meth:`cancel` (at once if it was asked for already); ``None`` unbinds."""
        with self._lock:
            self._wake = wake
            requested = self._requested
        if requested and wake is not None:
            wake()

    def check(self):
        """Raise ``CancelledError`` if the run was asked to stop."""
        if self._requested:
            raise CancelledError("the call was cancelled")


def current_cancellation():
    """The :class:`Cancellation` of the call running on this thread, or ``None``."""
    return _current.get()


class cancellable:
    """Make ``cancellation`` the current one while the block runs (a class, not a generator: a solver's step
    enters one)."""

    __slots__ = ("cancellation", "token")

    def __init__(self, cancellation):
        self.cancellation = cancellation

    def __enter__(self):
        self.token = _current.set(self.cancellation)
        return self.cancellation

    def __exit__(self, *exc):
        _current.reset(self.token)
