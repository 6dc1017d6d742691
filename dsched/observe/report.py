"""What a run did: one record per chunk, and the run's report built from them."""

from __future__ import annotations

import math
import socket
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

from dsched.devices.device import Device

__all__ = ["ChunkRecord", "service_seconds", "RunReport", "DeviceOnHost", "worker_host", "relative_error",
           "median_relative_error"]


@dataclass
class ChunkRecord:
    """What happened to one chunk: where it ran, how big it was, and when (epoch seconds).

    ``predicted`` is the seconds the run's policy predicted for the chunk when
    it was dispatched (a :class:`~dsched.schedulers.PerformanceModelScheduler`
    with a model of its device), ``None`` otherwise.
    """

    index: int
    device: Device
    size: int
    worker: str | None = None
    start: float = 0.0
    stop: float = 0.0
    error: BaseException | None = None
    offset: int = 0  # the chunk's first item in the batch
    predicted: float | None = None
    heard: float = 0.0  # when the client heard of its end (a replay's chunks: dsched.dispatch.replay)

    @property
    def duration(self) -> float:
        return self.stop - self.start

    @property
    def prediction_error(self) -> float | None:
        """``|predicted - measured| / measured`` of a chunk that succeeded with a prediction and a measured time."""
        if self.predicted is None or self.error is not None or self.stop <= self.start:
            return None
        return relative_error(self.predicted, self.duration)


def service_seconds(record: ChunkRecord, last_stops: dict) -> float:
    """The seconds ``record``'s device spent on it, on its worker's clock: from its start, or from the end of the
    chunk before it on the same worker and device if it waited behind that one (two in flight on one device).

    ``last_stops`` is the run's ``{(worker, device): latest end}``, updated here. The worker's own clock, not
    when the client heard of each end: a client that reads two replies at once (busy, on a shared core) would see
    a device finish a chunk in no time, and a policy learning from that would size its next chunk far too large.

    Examples
    --------
    >>> last = {}
    >>> first = ChunkRecord(0, Device("cpu"), 10, "w", start=0.0, stop=2.0)
    >>> queued = ChunkRecord(1, Device("cpu"), 10, "w", start=0.5, stop=4.0)  # waited behind the first
    >>> service_seconds(first, last), service_seconds(queued, last)
    (2.0, 2.0)
    """
    key = (record.worker, record.device)
    before = last_stops.get(key, -math.inf)
    last_stops[key] = max(before, record.stop)
    if before > record.stop:  # heard after a chunk that ended later: its own start is all it tells
        return record.stop - record.start
    return record.stop - max(record.start, before)


@dataclass
class RunReport:
    """The last run of a dispatcher: per-chunk records and results in dispatch order.

    After a failed run, ``results`` still holds every finished chunk's result
    (``None`` where the chunk failed), so no finished work is lost. When the
    join is the concatenation, results are written in place instead: ``output``
    holds the joined outputs (a failed chunk's rows are NaN in floating outputs)
    and ``results`` holds ``None`` per chunk.
    """

    mode: str
    records: list = field(default_factory=list)
    results: list = field(default_factory=list)
    wall_start: float = 0.0
    wall_stop: float = 0.0
    sent: float = 0.0  # when a replay's last message went (dsched.dispatch.replay)
    output: object = None

    @property
    def wall_time(self) -> float:
        return self.wall_stop - self.wall_start

    @property
    def items(self) -> int:
        return sum(r.size for r in self.records if r.error is None)

    @property
    def prediction_error(self) -> float | None:
        """The median relative error of the policy's predicted chunk times, ``None`` without predictions.

        Over the chunks that succeeded with a prediction (``record.predicted``)
        and a measured time: the median of ``|predicted - measured| / measured``,
        so ``0.1`` means half the chunks took within 10 % of what the
        performance model said.
        """
        return median_relative_error(r.prediction_error for r in self.records)

    def by_device(self) -> dict:
        """Per device and host: chunks, items, busy seconds and items per busy second.

        Keys are :class:`DeviceOnHost` (``str()`` gives ``cuda:0@node3``): one
        device name owned by workers on several hosts gives one row per host,
        so the balance between nodes shows. Each row also has ``device``,
        ``host``, ``workers`` (the addresses, in order of first use) and
        ``worker`` (the first of them), and ``prediction_error`` (the median
        relative error of its predicted chunk times, ``None`` without
        predictions). Rows come in order of first chunk.

        Busy time is the union of the row's chunk intervals (time with at
        least one chunk running), so overlapping chunks are not counted twice.
        """
        table = {}
        intervals, errors = {}, {}
        for r in self.records:
            key = DeviceOnHost(r.device, worker_host(r.worker))
            row = table.get(key)
            if row is None:
                row = table[key] = {"device": r.device, "host": key.host, "chunks": 0, "items": 0,
                                    "worker": r.worker, "workers": []}
            if r.worker is not None and r.worker not in row["workers"]:
                row["workers"].append(r.worker)
            row["chunks"] += 1
            row["items"] += r.size
            intervals.setdefault(key, []).append((r.start, r.stop))
            errors.setdefault(key, []).append(r.prediction_error)
        for key, row in table.items():
            row["prediction_error"] = median_relative_error(errors[key])
        return _with_busy(table, intervals)

    def by_host(self) -> dict:
        """Per host: its devices, chunks, items, busy seconds and items per busy second.

        A host's busy time is the union over all its devices (time with any
        chunk running there), so its items/s is the node's throughput while it
        worked. Hosts come in order of first chunk.
        """
        table = {}
        intervals = {}
        for r in self.records:
            host = worker_host(r.worker)
            row = table.setdefault(host, {"devices": [], "chunks": 0, "items": 0})
            if r.device not in row["devices"]:
                row["devices"].append(r.device)
            row["chunks"] += 1
            row["items"] += r.size
            intervals.setdefault(host, []).append((r.start, r.stop))
        return _with_busy(table, intervals)


class DeviceOnHost(NamedTuple):
    """A device on one host: the key of a per-device row; ``str()`` gives ``cuda:0@node3``."""

    device: Device
    host: str

    def __str__(self) -> str:
        return f"{self.device}@{self.host}"


def worker_host(address: str | None) -> str:
    """The host part of a worker address (``tcp://10.0.0.3:4000`` → ``10.0.0.3``).

    ``None`` (a sync run, on the calling thread) is this machine's host name.
    """
    if address is None:
        return socket.gethostname()
    scheme, _, location = str(address).rpartition("://")
    if scheme == "inproc":  # inproc://HOST/PID/N
        return location.split("/")[0]
    try:
        from distributed.comm.addressing import parse_host_port

        return parse_host_port(location)[0]
    except (ImportError, ValueError):  # not a host:port address: keep it whole rather than guess
        return location


def relative_error(predicted: float, measured: float) -> float:
    """``|predicted - measured| / measured``: how far a predicted time was from the measured one.

    >>> relative_error(0.75, 1.0), relative_error(2.0, 1.0)
    (0.25, 1.0)
    """
    return abs(predicted - measured) / measured


def median_relative_error(errors) -> float | None:
    """The median of ``errors`` (``None`` entries left out), ``None`` if none is left.

    >>> median_relative_error([0.1, None, 0.3, 0.2]), median_relative_error([None])
    (0.2, None)
    """
    kept = [e for e in errors if e is not None]
    return statistics.median(kept) if kept else None


def _with_busy(table, intervals) -> dict:
    """``table`` with each row's busy seconds (the union of its chunk intervals) and items per busy second."""
    for key, row in table.items():
        row["busy"] = _union_length(intervals[key])
        row["items_per_s"] = row["items"] / row["busy"] if row["busy"] > 0 else float("nan")
    return table


def _union_length(intervals) -> float:
    """Total length covered by a set of ``(start, stop)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
