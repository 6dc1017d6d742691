"""The plan: the chunks a scheduler would cut a batch into, decided ahead of time, and where blocks go.

``plan(n, scheduler)`` decides, ahead of time, the chunks a dispatcher would
send: their devices and sizes along axis 0; ``plan_blocks(sizes, scheduler)``
gives the devices of blocks already cut. :mod:`dsched.blocks.map_blocks`
chunks arrays by the plan and places their blocks; a resident
:class:`~dsched.Batch` places its chunks by it.

The plan replays the scheduler's greedy policy in simulated time: a device
takes a chunk when it has room (``load + batch_size <= capacity``), the
highest priority first, the first listed on ties; a device works through its
chunks one after another at its estimated speed (items per second), and a
completion frees its items. So every device keeps busy until the batch is
planned and they all finish at about the same time. The speed estimate, in
order of preference:

1. ``speeds={device: items_per_s}`` passed by the caller;
2. a measured profile, when ``dsched.schedulers.profiles.profile_speeds(scheduler)``
   exists and returns one for every device;
3. the priorities: a device of priority 2 is taken to be twice as fast as
   one of priority 1 (a priority <= 0 counts as the smallest positive one,
   or 1 if there is none).

For a single device (``SimpleScheduler``) the plan is uniform chunks of the
batch size with a short last chunk. A plan holds at most ``MAX_PLAN_CHUNKS``
chunks: a batch that needs more is refused at once (a ``ValueError``), not
planned for minutes.
"""

from __future__ import annotations

import heapq
import math
import numbers

from dsched.checks import check_positive_int
from dsched.devices.device import device_entries, placement_device
from dsched.schedulers.profiles import profile_speeds

__all__ = ["plan", "plan_blocks", "default_speeds", "MAX_PLAN_CHUNKS"]


def default_speeds(scheduler) -> tuple[dict, str]:
    """The speed estimate ``plan`` uses without ``speeds``, and where it came from.

    Returns ``({Device: items_per_s}, source)`` with ``source`` ``"profile"``
    or ``"priorities"``.
    """
    status = scheduler.status()
    measured = profile_speeds(scheduler)
    if measured:
        try:
            speeds = _check_speeds(measured, status, field="profile_speeds")
            return speeds, "profile"
        except ValueError:
            pass  # a profile that does not cover these devices: fall back to priorities
    positive = [s.priority for s in status if s.priority > 0]
    floor = min(positive) if positive else 1.0
    return {s.device: (s.priority if s.priority > 0 else floor) for s in status}, "priorities"


def _check_speeds(speeds, status, field="speeds") -> dict:
    if not hasattr(speeds, "items"):
        raise ValueError(f"{field}: expected a mapping {{device: items_per_s}}, got {speeds!r}")
    devices = [s.device for s in status]
    out = {}
    for device, value in device_entries(speeds, devices, field, among="the scheduler's devices"):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{field}[{str(device)!r}]: expected a finite number of items per second > 0, got {value!r}")
        out[device] = float(value)
    missing = [str(d) for d in devices if d not in out]
    if missing:
        raise ValueError(f"{field}: no speed for {', '.join(missing)}")
    return out


def plan(n, scheduler, *, speeds=None) -> list:
    """The chunks a batch of ``n`` items is cut into: a list of ``(Device, size)``.

    A pure function of ``n``, the scheduler's configuration (its current load
    is ignored and left alone) and the speed estimate (see the module
    docstring). Sizes sum to ``n``; each is the batch size of its device,
    except that the last chunk may be short.

    Parameters
    ----------
    n : int
        Items in the batch, at least 1.
    scheduler : WorkScheduler
        ``SimpleScheduler``, ``StaticHybridScheduler`` or any policy with ``status()``.
    speeds : dict, optional
        ``{device: items per second}`` for every device of the scheduler.

    Examples
    --------
    >>> from dsched import SimpleScheduler, StaticHybridScheduler
    >>> [(str(d), m) for d, m in plan(10, SimpleScheduler("cpu", 4))]
    [('cpu', 4), ('cpu', 4), ('cpu', 2)]
    >>> s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[2, 4], priorities=[1, 2])
    >>> [(str(d), m) for d, m in plan(12, s)]
    [('cuda:0', 4), ('cpu', 2), ('cuda:0', 4), ('cpu', 2)]
    """
    check_positive_int(n, "n", integers=numbers.Integral, expected="an integer number of items >= 1", below=None)
    own_plan = getattr(scheduler, "plan", None)
    if speeds is None and callable(own_plan):  # a policy that plans by its own model (PerformanceModelScheduler)
        return own_plan(int(n))
    status, speed = _policy(scheduler, speeds)
    n = int(n)
    fewest = -(-n // max(s.batch_size for s in status))  # chunks if every one were of the largest size
    if fewest > MAX_PLAN_CHUNKS:
        raise ValueError(
            f"n: {n} items make at least {fewest} chunks of at most {max(s.batch_size for s in status)} items, "
            f"more than a plan holds ({MAX_PLAN_CHUNKS}); raise the batch sizes"
        )
    return _simulate(status, speed, n=n)


def plan_blocks(sizes, scheduler, *, speeds=None) -> list:
    """The device of each block of a batch already cut into ``sizes`` (items per block, in order).

    The same greedy policy in simulated time as :func:`plan`, with the blocks
    given instead of cut: each block goes to the highest-priority device with
    room, so faster devices take more blocks and all finish together. For
    blocks of the plan's own sizes it gives the plan's devices.

    Examples
    --------
    >>> from dsched import StaticHybridScheduler
    >>> s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[2, 4], priorities=[1, 2])
    >>> [str(d) for d in plan_blocks([4, 2, 4, 2], s)]
    ['cuda:0', 'cpu', 'cuda:0', 'cpu']
    """
    sizes = [int(m) for m in sizes]
    if any(m < 0 for m in sizes):
        raise ValueError(f"sizes: expected block sizes >= 0, got {sizes!r}")
    if len(sizes) > MAX_PLAN_CHUNKS:
        raise ValueError(f"sizes: {len(sizes)} blocks, more than a plan holds ({MAX_PLAN_CHUNKS})")
    status, speed = _policy(scheduler, speeds)
    return [device for device, _ in _simulate(status, speed, blocks=sizes)]


# A plan is a list of chunks: past this many, building it (and a graph of as many
# tasks) would take minutes, so plan() refuses up front rather than run for them.
MAX_PLAN_CHUNKS = 1_000_000


def _policy(scheduler, speeds):
    if not hasattr(scheduler, "status"):
        raise ValueError(f"scheduler: expected a WorkScheduler, got {scheduler!r}")
    status = scheduler.status()
    speed = _check_speeds(speeds, status) if speeds is not None else default_speeds(scheduler)[0]
    return status, speed


def _simulate(status, speed, *, n=None, blocks=None) -> list:
    """Replay the greedy policy: ``n`` items cut by batch size, or the given ``blocks``."""
    load = [0] * len(status)
    free_at = [0.0] * len(status)  # when each device finishes the chunks it already holds
    events = []  # (finish time, dispatch order, device position, size)
    chunks = []
    now = 0.0
    remaining = n if blocks is None else len(blocks)
    while remaining:
        while remaining:
            # schedule_work's rule: highest priority with room, first listed on ties.
            best = None
            for i, s in enumerate(status):
                if load[i] + s.batch_size <= s.capacity and (best is None or s.priority > status[best].priority):
                    best = i
            if best is None:
                break
            if blocks is None:
                m = min(status[best].batch_size, remaining)
                remaining -= m
            else:
                m = blocks[len(chunks)]
                remaining -= 1
            if len(chunks) >= MAX_PLAN_CHUNKS:
                raise ValueError(f"n: {n} items make more chunks than a plan holds ({MAX_PLAN_CHUNKS}); "
                                 "raise the batch sizes")
            load[best] += m
            free_at[best] = max(now, free_at[best]) + m / speed[status[best].device]
            heapq.heappush(events, (free_at[best], len(chunks), best, m))
            chunks.append((placement_device(status[best].device), m))
        if remaining:
            now, _, i, m = heapq.heappop(events)
            load[i] -= m
    return chunks
