"""A plan replayed: chunks decided ahead of time, handed out in their order, as a scheduling policy.

A resident batch in host memory (:class:`~dsched.resident.host_batch.HostBatch`)
runs each update as one :func:`dsched.dispatch` over the whole batch, and its
chunks must be the batch's own, those :func:`dsched.plan` cut it into: the same
rows on the same devices at every update, so that its results do not depend on
which device finished first. :class:`PlannedChunks` is a policy that gives
exactly those chunks, one after another, each when its device has room (the
capacities of the scheduler it replays hold). A run may start part-way through
the plan (:meth:`PlannedChunks.start_at`): the batch runs again the chunks a
failed run never dispatched, and only those.

Examples
--------
>>> from dsched import Device, StaticHybridScheduler
>>> base = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[2, 4], priorities=[1, 2])
>>> planned = PlannedChunks(base, [(Device("cuda:0"), 4), (Device("cpu"), 2), (Device("cuda:0"), 3)])
>>> first = planned.schedule_work(); planned.dispatched_work(*first); str(first[0]), first[1]
('cuda:0', 4)
>>> planned.schedule_work() is None      # the next planned chunk's device is full: wait for a completion
False
>>> planned.dispatched_work(Device("cpu"), 2); planned.schedule_work() is None   # cuda:0 has no room yet
True
>>> planned.completed_work(Device("cuda:0"), 4); planned.schedule_work()[1], planned.dispatched
(3, 2)
"""

from __future__ import annotations

from dsched.devices.device import Device
from dsched.schedulers.base import DeviceStatus, WorkScheduler, _item_count

__all__ = ["PlannedChunks"]


class PlannedChunks(WorkScheduler):
    """The chunks ``plan`` gave, ``[(Device, size)]``, handed out in order within ``scheduler``'s capacities.

    ``schedule_work`` returns the next planned chunk once its device has room (at zero load it always has:
    a planned chunk larger than its device's capacity still runs, alone), ``None`` after the last one.
    ``dispatched`` is the index of the next chunk to hand out; :meth:`start_at` moves it.
    """

    def __init__(self, scheduler, chunks):
        status = [DeviceStatus(s.device, s.batch_size, s.capacity, s.priority) for s in scheduler.status()]
        super().__init__(status)
        self.chunks = [(Device(device), int(size)) for device, size in chunks]
        unknown = sorted({str(d) for d, _ in self.chunks if d not in self._index})
        if unknown:
            raise ValueError(f"chunks: devices {', '.join(unknown)} are not the scheduler's")
        self._next = 0

    @property
    def dispatched(self) -> int:
        """The index of the next chunk to hand out (the number handed out since :meth:`start_at`, plus its index)."""
        with self._lock:
            return self._next

    def start_at(self, index: int) -> None:
        """The next run starts at chunk ``index`` of the plan (0: the whole plan)."""
        with self._lock:
            self._next = int(index)

    def plan_key(self):
        """The planned chunks from the next one on: a run that starts there cuts the batch as they say (so a
        dispatcher may replay it); ``None`` while chunks are in flight."""
        records = self._records_key()
        return None if records is None else ("planned", self.dispatched, tuple(self.chunks), records)

    def replayed(self, chunks: int) -> None:
        """A dispatcher replayed ``chunks`` chunks of the plan without asking (:mod:`dsched.dispatch.replay`):
        they count as handed out."""
        with self._lock:
            self._next += int(chunks)

    def schedule_work(self):
        with self._lock:
            if self._next >= len(self.chunks):
                return None
            device, size = self.chunks[self._next]
            status = self._index[device]
            if status.load and status.load + size > status.capacity:
                return None
            return device, size

    def dispatched_work(self, device, n: int) -> None:
        n = _item_count(n, device)
        with self._lock:
            if self._next >= len(self.chunks) or Device(device) != self.chunks[self._next][0] \
                    or n > self.chunks[self._next][1]:
                planned = self.chunks[self._next] if self._next < len(self.chunks) else "nothing"
                raise RuntimeError(f"Unplanned chunk: {n} items on {device}; the plan's next is {planned}")
            self._index[Device(device)].load += n
            self._next += 1
