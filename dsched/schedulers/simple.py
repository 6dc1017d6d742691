"""SimpleScheduler: one device, fixed sub-batch size, a capacity of items in flight."""

from __future__ import annotations

from dsched.devices.device import parse_device
from dsched.schedulers.base import DeviceStatus, SingleDeviceScheduler, check_positive_int

__all__ = ["SimpleScheduler"]


class SimpleScheduler(SingleDeviceScheduler):
    """Dispatch work to a single device in chunks of ``batch_size``.

    Parameters
    ----------
    device : str or Device
    batch_size : int
        Items per chunk (the last chunk may be shorter), at least 1.
    capacity : int, optional
        Items in flight on the device; defaults to ``batch_size`` (one chunk at a
        time). ``capacity = 2 * batch_size`` overlaps one chunk's transfers with
        another's compute.

    Examples
    --------
    >>> s = SimpleScheduler("cpu", batch_size=8, capacity=16)
    >>> s.schedule_work()
    (Device('cpu'), 8)
    """

    def __init__(self, device, batch_size, capacity=None):
        if isinstance(device, (list, tuple)):
            raise ValueError(f"device: SimpleScheduler takes one device, got {[str(d) for d in device]}")
        device = parse_device(device, "device")
        batch_size = check_positive_int(batch_size, "batch_size")
        capacity = batch_size if capacity is None else check_positive_int(capacity, "capacity")
        if capacity < batch_size:
            raise ValueError(f"capacity: {capacity} is below batch_size {batch_size}")
        super().__init__([DeviceStatus(device, batch_size, capacity)])
