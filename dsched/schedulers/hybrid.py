"""StaticHybridScheduler: greedy by priority and capacity over a CPU and GPUs at once."""

from __future__ import annotations

from dsched.schedulers.base import WorkScheduler, build_status

__all__ = ["StaticHybridScheduler"]


class StaticHybridScheduler(WorkScheduler):
    """Send each chunk to the highest-priority device with room for it.

    A device has room when ``load + batch_size <= capacity``; on equal
    priorities the first listed device wins (NEML2's documented rule; v2.1.6
    returned the last available device instead).

    Parameters
    ----------
    devices : list of str or Device
        At most one CPU; no duplicates; a bare ``cuda`` never next to ``cuda:N``.
    batch_sizes, capacities, priorities : scalar or list
        A scalar or a list of one broadcasts; otherwise one value per device.
        Capacities default to the batch sizes, priorities to 1.

    Examples
    --------
    >>> s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 16], priorities=[1, 2])
    >>> s.schedule_work()
    (Device('cuda:0'), 16)
    >>> s.dispatched_work("cuda:0", 16)
    >>> s.schedule_work()
    (Device('cpu'), 4)
    """

    def __init__(self, devices, batch_sizes, capacities=None, priorities=None):
        super().__init__(build_status(devices, batch_sizes, capacities, priorities))
