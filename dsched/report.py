"""What a run did: one record per chunk, and the run's report built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .devices import Device

__all__ = ["ChunkRecord", "RunReport"]


@dataclass
class ChunkRecord:
    """What happened to one chunk: where it ran, how big it was, and when (epoch seconds)."""

    index: int
    device: Device
    size: int
    worker: str | None = None
    start: float = 0.0
    stop: float = 0.0
    error: BaseException | None = None

    @property
    def duration(self) -> float:
        return self.stop - self.start


@dataclass
class RunReport:
    """The last run of a dispatcher: per-chunk records and results in dispatch order.

    After a failed run, ``results`` still holds every finished chunk's result
    (``None`` where the chunk failed), so no finished work is lost.
    """

    mode: str
    records: list = field(default_factory=list)
    results: list = field(default_factory=list)
    wall_start: float = 0.0
    wall_stop: float = 0.0

    @property
    def wall_time(self) -> float:
        return self.wall_stop - self.wall_start

    @property
    def items(self) -> int:
        return sum(r.size for r in self.records if r.error is None)

    def by_device(self) -> dict:
        """Per device: chunks, items, busy seconds and items per busy second.

        Busy time is the union of the device's chunk intervals (time with at
        least one chunk running), so overlapping chunks are not counted twice.
        """
        table = {}
        intervals = {}
        for r in self.records:
            row = table.setdefault(r.device, {"chunks": 0, "items": 0, "worker": r.worker})
            row["chunks"] += 1
            row["items"] += r.size
            intervals.setdefault(r.device, []).append((r.start, r.stop))
        for device, row in table.items():
            row["busy"] = _union_length(intervals[device])
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
