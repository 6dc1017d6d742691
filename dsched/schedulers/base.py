"""The scheduling protocol every policy fills (NEML2's WorkScheduler, non-blocking).

A dispatcher asks ``schedule_work()`` for the next chunk's device and size,
reports ``dispatched_work`` when it sends a chunk and ``completed_work`` when
the chunk is done. ``schedule_work`` returning ``None`` means "no device has
room now": the dispatcher waits for a completion and asks again.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass

import numpy as np

from dsched.checks import check_positive_int  # its old home: still importable from here
from dsched.devices.device import Device, parse_devices

__all__ = ["WorkScheduler", "SingleDeviceScheduler", "DeviceStatus"]


@dataclass
class DeviceStatus:
    """One device's configuration and its load (items in flight)."""

    device: Device
    batch_size: int
    capacity: int
    priority: float = 1.0
    load: int = 0


class WorkScheduler:
    """Base of the policies: load accounting over a list of :class:`DeviceStatus`.

    Subclasses pass the validated records to ``__init__``; ``_pick`` (highest
    priority, first listed on ties) chooses among the devices that have room
    and may be overridden for another rule. All public methods are thread-safe.
    """

    def __init__(self, status: list[DeviceStatus]):
        self._status = status
        self._index = {s.device: s for s in status}
        self._lock = threading.Lock()

    @property
    def devices(self) -> list[Device]:
        return [s.device for s in self._status]

    def status(self) -> list[DeviceStatus]:
        """Every device's record, in list order (copies, safe to keep)."""
        with self._lock:
            return [DeviceStatus(s.device, s.batch_size, s.capacity, s.priority, s.load) for s in self._status]

    def schedule_work(self):
        """``(device, n)`` for the next chunk, or ``None`` when no device has room now."""
        with self._lock:
            available = [s for s in self._status if s.load + s.batch_size <= s.capacity]
            if not available:
                return None
            chosen = self._pick(available)
            return chosen.device, chosen.batch_size

    def _pick(self, available: list[DeviceStatus]) -> DeviceStatus:
        """The highest priority wins; ``max`` keeps the first listed on ties."""
        return max(available, key=lambda s: s.priority)

    def zero_load_choice(self):
        """The device :meth:`schedule_work` picks while no device carries a load: that of every chunk of a sync
        run, which accounts none (as NEML2's). ``None`` for a policy that chooses by another rule."""
        if type(self).schedule_work is not WorkScheduler.schedule_work:
            return None
        with self._lock:
            return self._pick(list(self._status)).device

    def dispatched_work(self, device, n: int) -> None:
        """Record ``n`` items sent to ``device``."""
        n = _item_count(n, device)
        with self._lock:
            status = self._lookup(device)
            if status.load + n > status.capacity:
                raise RuntimeError(
                    f"Device oversubscribed: {status.device} would carry {status.load + n} items, "
                    f"capacity {status.capacity}"
                )
            status.load += n

    def completed_work(self, device, n: int) -> None:
        """Record ``n`` items of ``device`` finished."""
        n = _item_count(n, device)
        with self._lock:
            status = self._lookup(device)
            if n > status.load:
                raise RuntimeError(f"Device load underflow: {status.device} completed {n} items, load {status.load}")
            status.load -= n

    def plan_key(self):
        """What this policy's chunks depend on, where a batch's chunks depend on nothing else: the devices' batch
        sizes, capacities and priorities, while none carries a load (so a like run's chunks repeat while the
        key does, and a dispatcher may replay them: :mod:`dsched.dispatch.replay`); ``None`` for a policy that
        learns, plans a run's tail, or chooses by any other rule than this class's."""
        return self._records_key() if _chooses_by_records(type(self)) else None

    def _records_key(self):
        """The devices' batch sizes, capacities and priorities; ``None`` while any carries a load."""
        with self._lock:
            if any(s.load for s in self._status):
                return None
            return tuple((s.device, s.batch_size, s.capacity, s.priority) for s in self._status)

    def replayed(self, chunks: int) -> None:
        """A dispatcher replayed ``chunks`` chunks of a plan this policy cut before, without asking it
        (:meth:`plan_key`): a policy that counts what it handed out counts them."""

    def all_work_completed(self) -> bool:
        with self._lock:
            return all(s.load == 0 for s in self._status)

    def _lookup(self, device) -> DeviceStatus:
        try:
            return self._index[Device(device)]
        except (KeyError, ValueError):
            raise RuntimeError(f"Device not found: {device}") from None

    def __repr__(self):
        parts = ", ".join(f"{s.device}(batch={s.batch_size}, capacity={s.capacity}, load={s.load})" for s in self._status)
        return f"{type(self).__name__}({parts})"


_RULES = ("schedule_work", "_pick", "dispatched_work", "completed_work")


@functools.cache
def _chooses_by_records(cls) -> bool:
    """Whether ``cls`` chooses as :class:`WorkScheduler` does, from its records alone (it learns nothing from
    timings and plans no run's tail)."""
    return all(getattr(cls, name) is getattr(WorkScheduler, name) for name in _RULES) and not any(
        hasattr(cls, name) for name in ("observe", "begin_run"))


def _item_count(n, device) -> int:
    """A chunk's size as reported to the load accounting: an integer >= 1, or protocol misuse."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise RuntimeError(f"Invalid item count {n!r} for {device}: a chunk has an integer number of items >= 1")
    return int(n)


class SingleDeviceScheduler(WorkScheduler):
    """A policy over exactly one device: ``device``, ``batch_size`` and ``capacity`` read from its record."""

    @property
    def device(self) -> Device:
        return self._status[0].device

    @property
    def batch_size(self) -> int:
        return self._status[0].batch_size

    @property
    def capacity(self) -> int:
        return self._status[0].capacity


def broadcast(values, n: int, field: str, default=None) -> list:
    """A scalar, a list of one (broadcast) or a list of ``n`` values, as a list of ``n``."""
    if values is None:
        return [default] * n
    if isinstance(values, (list, tuple)):
        if len(values) == 1:
            return list(values) * n
        if len(values) != n:
            raise ValueError(f"{field}: expected 1 or {n} values (one per device), got {len(values)}")
        return list(values)
    return [values] * n


def build_status(devices, batch_sizes, capacities, priorities=None) -> list[DeviceStatus]:
    """Validate and expand per-device lists into :class:`DeviceStatus` records."""
    devices = parse_devices(devices)
    if not devices:
        raise ValueError("devices: at least one device is required, got none")
    seen = set()
    for d in devices:
        if d in seen:
            raise ValueError(f"devices: duplicate device {d}")
        seen.add(d)
    cpus = [str(d) for d in devices if d.type == "cpu"]
    if len(cpus) > 1:
        raise ValueError(f"devices: more than one CPU ({', '.join(cpus)}); concurrent CPU chunks only oversubscribe its cores")
    n = len(devices)
    sizes = [check_positive_int(b, f"batch_sizes[{i}]") for i, b in enumerate(broadcast(batch_sizes, n, "batch_sizes"))]
    caps = broadcast(capacities, n, "capacities")
    caps = [sizes[i] if c is None else check_positive_int(c, f"capacities[{i}]") for i, c in enumerate(caps)]
    for i, (b, c) in enumerate(zip(sizes, caps)):
        if c < b:
            raise ValueError(f"capacities[{i}]: {c} is below the batch size {b} of {devices[i]}")
    prios = broadcast(priorities, n, "priorities", default=1.0)
    for i, p in enumerate(prios):
        if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)):
            raise ValueError(f"priorities[{i}]: expected a number, got {p!r}")
        if not math.isfinite(p):
            raise ValueError(f"priorities[{i}]: expected a finite number, got {p!r}")
    return [DeviceStatus(d, b, c, float(p)) for d, b, c, p in zip(devices, sizes, caps, prios)]
