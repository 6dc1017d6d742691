"""BalancedScheduler: one chunk per device, cut where the devices finish together, learned from call to call.

A program that calls again and again over the same points (a Newton loop,
time steps, a finite-element material) often has points whose cost is uneven
and stays uneven from one call to the next: a plastic zone, points whose
Newton solve takes more iterations, a range of strain rates. Equal parts then
leave one device waiting for the other at every call, and a policy of fixed
batch sizes cannot see it.

This policy cuts each call's batch into one chunk per device, in the order
the devices are listed (so a device keeps about the same points from call to
call), and learns from each call where to cut the next. After a call it takes
each chunk's seconds, timed on its worker, as spread evenly over the chunk's
points: that makes a cost for every stretch of the batch, and the new cuts
share the whole cost equally between the devices (a call whose chunks took
within ``tolerance`` of the same time leaves them). Costs that hold from one
call to the next would be balanced after one call on devices of equal speed,
and within a few on devices of different speeds (a stretch that moves to
another device is costed at its old device's speed, so the cuts close in
geometrically). By default a call moves the cuts half of the way there
(``step``), so that a one-off delay moves them only half as far. The cuts
are learned per batch size, as fractions of the batch: a call of a size not
seen yet starts from the fractions learned last.

Each device keeps at least :data:`MIN_SHARE` of the batch (one item at the
least), so that a device slowed down once is still timed, and taken back
when it recovers. A run with a chunk that failed, or was not timed, or was
not cut as planned (a run over several ranges, such as the chunks a failed
run left), leaves the cuts as they were.

Examples
--------
>>> s = BalancedScheduler(["cpu", "cuda:0"], step=1.0)   # all the way at each call
>>> s.begin_run(100)
>>> [(str(d), n) for d, n in s.plan(100)]
[('cpu', 50), ('cuda:0', 50)]
>>> for device, n in s.plan(100):                # the dispatcher's calls, one chunk per device
...     _ = s.schedule_work(); s.dispatched_work(device, n)
>>> s.completed_work("cpu", 50); s.observe("cpu", 50, 0.3)        # the first half cost three times the second
>>> s.completed_work("cuda:0", 50); s.observe("cuda:0", 50, 0.1)
>>> [(str(d), n) for d, n in s.plan(100)]           # 0.2 s each: 33 of the first points, the rest on cuda:0
[('cpu', 33), ('cuda:0', 67)]
"""

from __future__ import annotations

import collections
import math

import numpy as np

from dsched.checks import check_positive_int
from dsched.devices.device import Device
from dsched.schedulers.base import WorkScheduler, broadcast, build_status

__all__ = ["BalancedScheduler", "MIN_SHARE"]

#: the least fraction of a batch each device keeps (so that it is still timed)
MIN_SHARE = 0.01
SIZES_KEPT = 64  # batch sizes whose cuts are kept (the oldest learned is forgotten first)


class BalancedScheduler(WorkScheduler):
    """One chunk per device per call, cut so that the devices finish together, as the last calls' timings say.

    Parameters
    ----------
    devices : list of str or Device
        As for :class:`StaticHybridScheduler` (at most one CPU, no duplicates),
        in the order their chunks cover the batch.
    weights : float or list, optional
        The shares of the first call (relative speeds, e.g. ``[1, 4]``);
        equal by default.
    step : float
        How far each call moves the cuts toward those that would have
        balanced it: 1 all the way, 0.5 (the default) half of it, which
        follows a lasting imbalance within a few calls and only half of a
        one-off one (a worker held up by something else, a timing's noise).
    tolerance : float
        The imbalance left alone: a call whose chunks' times are all within
        this fraction of their mean (5 % by default) keeps the cuts. Cuts
        that move at every call follow the timings' noise, and cost the
        workers' memory allocators chunks of a new size each time.

    Notes
    -----
    The dispatcher tells the policy each run's size (``begin_run``) and each
    chunk's seconds on its worker (``observe``): runs of ``dispatch``,
    ``WorkDispatcher`` and ``submit`` on a cluster, replays of a like call's
    chunks included (they replay while the cut holds: :meth:`plan_key`). A
    run in ``mode="sync"`` times nothing, and keeps the cuts. One run at a
    time (``submit`` runs the calls on one scheduler one after another). The
    cuts fall on any item, so an output the run writes to a Zarr array
    (``out=``) is written in chunks of one row.
    """

    def __init__(self, devices, *, weights=None, step=0.5, tolerance=0.05):
        status = build_status(devices, 1, None)
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step <= 1:
            raise ValueError(f"step: expected a fraction in (0, 1], got {step!r}")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
            raise ValueError(f"tolerance: expected a fraction in [0, 1), got {tolerance!r}")
        self.step, self.tolerance = float(step), float(tolerance)
        shares = broadcast(weights, len(status), "weights", default=1.0)
        for i, value in enumerate(shares):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"weights[{i}]: expected a positive number, got {value!r}")
        super().__init__(status)
        total = float(sum(shares))
        self._shares = [float(w) / total for w in shares]  # the shares last learned (or given): a new size's
        self._learned = {}  # batch size -> its shares, each device's fraction in device order
        self._queue = collections.deque()  # this run's chunks not yet handed out: (Device, size)
        self._sizes = {}  # this run's chunks: Device -> size
        self._seconds = {}  # their seconds, as observed
        self._total, self._last = None, status[0].device  # this run's size; the device of its last chunk
        self.runs_learned = 0  # runs whose timings moved the cuts

    @property
    def shares(self) -> list:
        """Each device's fraction of a batch, in device order, as last learned (a batch of a size not seen
        yet starts from them)."""
        with self._lock:
            return [float(share) for share in self._shares]

    def plan(self, n) -> list:
        """The chunks ``n`` items are cut into now, ``[(Device, size)]`` in device order (none of size 0)."""
        n = check_positive_int(n, "n")
        with self._lock:
            return self._cut(n)

    def plan_key(self):
        """The cut of the last run's batch size, while no chunk is out: a like call replays that run's chunks while
        the cut holds (:mod:`dsched.dispatch.replay`), and goes the full way once the timings move it."""
        with self._lock:
            if self._total is None or any(s.load for s in self._status):
                return None
            return "balanced", self._total, tuple(self._learned.get(self._total, self._shares))

    # --- the dispatcher's protocol -----------------------------------------------

    def begin_run(self, total) -> None:
        """A run of ``total`` items starts: its chunks are cut now, by the shares in effect."""
        total = check_positive_int(total, "total")
        with self._lock:
            chunks = self._cut(total)
            self._queue = collections.deque(chunks)
            self._sizes = dict(chunks)
            self._seconds = {}
            self._total = total

    def schedule_work(self):
        """The run's next chunk, ``(Device, size)`` in device order.

        Once the planned chunks are handed out, the rest of the run (a run
        over several ranges, whose generator stops each chunk at a range's
        end) goes to the device of the last one, in chunks as large as the
        generator gives.
        """
        with self._lock:
            if self._queue:
                device, n = self._queue.popleft()
            else:  # the dispatcher asks only while items are left
                device, n = self._last, self._total or 1 << 30
                self._sizes = {}  # a run not cut as planned: its timings teach nothing
            self._last = device
            record = self._index[device]
            record.capacity = max(record.capacity, record.load + n)  # what dispatched_work checks
            return device, n

    def observe(self, device, n, seconds) -> None:
        """A chunk of ``n`` items ran ``seconds`` on ``device``'s worker; the cuts move once every chunk of the
        run is timed."""
        with self._lock:
            device = Device(device)
            if self._sizes.get(device) != n or not (math.isfinite(seconds) and seconds > 0):
                return
            self._seconds[device] = float(seconds)
            if len(self._seconds) == len(self._sizes):
                self._learn()

    # --- internals -----------------------------------------------------------------

    def _cut(self, n) -> list:
        """``n`` items in one chunk per device by the shares of that size (rounded so that they sum to ``n``)."""
        edges, total = [0], 0.0  # in Python, not NumPy: a replayed call asks for it, and a few devices are quick
        for share in self._learned.get(n, self._shares):
            total += share
            edges.append(max(edges[-1], round(total * n)))  # round half to even, as NumPy's rint
        edges[-1] = n
        return [(s.device, b - a) for s, a, b in zip(self._status, edges, edges[1:]) if b > a]

    def _learn(self):
        """The run's batch size's new shares, unless its chunks' times are all within the tolerance of their mean:
        each chunk's seconds spread over its items, the whole cost shared equally by the devices."""
        devices = [s.device for s in self._status]
        sizes = [self._sizes.get(d, 0) for d in devices]
        seconds = [self._seconds.get(d, 0.0) for d in devices]
        self._sizes, self._seconds = {}, {}
        timed = [t for t in seconds if t > 0]
        mean = sum(timed) / len(timed)
        if all(abs(t - mean) <= self.tolerance * mean for t in timed):
            return  # balanced enough: the cuts stay
        n = sum(sizes)
        # The cumulative cost at each chunk edge, as a function of the position in the batch.
        positions = np.cumsum([0] + sizes, dtype=float)
        costs = np.cumsum([0.0] + seconds)
        keep = np.concatenate(([True], np.diff(positions) > 0))  # a device without a chunk adds no edge
        targets = costs[-1] * np.arange(1, len(devices)) / len(devices)
        cuts = np.interp(targets, costs[keep], positions[keep]) / n
        balanced = np.diff(np.concatenate(([0.0], cuts, [1.0])))
        used = np.asarray(sizes, dtype=float) / n  # the run's own cut, which the step starts from
        shares = used + self.step * (balanced - used)
        shares = np.maximum(shares, min(max(MIN_SHARE, 1.0 / n), 1.0 / len(devices)))
        self._learned.pop(n, None)  # the newest last
        self._shares = self._learned[n] = [float(share) for share in shares / shares.sum()]
        if len(self._learned) > SIZES_KEPT:
            del self._learned[next(iter(self._learned))]
        self.runs_learned += 1

    def __repr__(self):
        parts = ", ".join(f"{s.device}({share:.3f})" for s, share in zip(self._status, self._shares))
        return f"BalancedScheduler({parts})"
