"""Knowing when chunks finish: completion notices from the client's event loop, and lost devices."""

from __future__ import annotations

import asyncio
import queue
import time

from dsched.cluster.placement import PlacementWarning
from dsched.devices.device import placement_device
from dsched.devices.ownership import device_capacities

__all__ = ["notify_when_done", "wait_for_one", "DeviceWatch"]


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


def wait_for_one(done, timeout):
    """The next finished future, or ``None`` after ``timeout`` seconds without one."""
    try:
        return done.get(timeout=timeout)
    except queue.Empty:
        return None


class DeviceWatch:
    """Notices devices that lost every worker while chunks wait on them, and says where to run those instead.

    A device counts as lost once no worker has owned it for ``grace`` seconds
    (Dask config ``dsched.lost-device-timeout``, default 30: time for a
    nanny to restart a worker). Its chunks then go, as ``map_blocks`` blocks
    do, to another device of the same kind, else to any device a worker owns,
    with a :class:`~dsched.placement.PlacementWarning`; they go back once a
    worker owns the device again.
    """

    def __init__(self, client, grace=None, workers=None):
        from dask import config

        self.client = client
        self.grace = float(config.get("dsched.lost-device-timeout", 30.0) if grace is None else grace)
        self.missing_since = {}  # device -> when it was first seen without a worker
        self.redirect = {}  # lost device -> the device its chunks run on instead
        self.capacities = device_capacities(client, workers)  # Device -> items its workers may run at once

    def check(self, busy):
        """Update from the cluster; the devices newly redirected, ``{lost: fallback}``."""
        owned = self.capacities = device_capacities(self.client)
        now = time.monotonic()
        for device in list(self.redirect):
            if placement_device(device) in owned:  # a worker came back
                del self.redirect[device]
                self.missing_since.pop(device, None)
        newly = {}
        for device in busy:
            if placement_device(device) in owned or device in self.redirect:
                self.missing_since.pop(device, None)
                continue
            since = self.missing_since.setdefault(device, now)
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
