"""Devices: naming, discovery, and the array module that computes on each.

A :class:`Device` is ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``.
A Dask worker *owns* a device when it advertises the resource
``device_resource(device)`` (``"dsched-cuda:0"`` and so on); its amount is
the device's capacity in items. Emulated CUDA workers also advertise
``EMULATED_RESOURCE``. A chunk of ``m`` items requests ``m`` of its device's
resource, so it runs on an owning worker and nowhere else, and the items
executing on a device never exceed its capacity.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re

import numpy as np

__all__ = [
    "Device",
    "current_device",
    "visible_gpus",
    "array_module",
    "to_device",
    "to_host",
    "device_resource",
    "EMULATED_RESOURCE",
]

# Canonical spellings only (ASCII digits, no leading zeros, no spaces), so that
# equal devices have equal strings and a Device hashes like its string.
_PATTERN = re.compile(r"(cpu|cuda)(?::(0|[1-9][0-9]*))?", re.ASCII)
RESOURCE_PREFIX = "dsched-"
EMULATED_RESOURCE = "dsched-emulated"
# A worker's amount of its device resource is the device's capacity in items;
# this stands for "no limit beyond the worker's threads".
UNLIMITED_CAPACITY = 10**15


class Device:
    """A compute device: ``Device("cpu")``, ``Device("cuda")`` or ``Device("cuda:1")``.

    Examples
    --------
    >>> d = Device("cuda:1")
    >>> d.type, d.index, str(d)
    ('cuda', 1, 'cuda:1')
    >>> Device(d) == Device("cuda:1")
    True
    """

    __slots__ = ("type", "index")

    def __init__(self, spec):
        if isinstance(spec, Device):
            self.type, self.index = spec.type, spec.index
            return
        if not isinstance(spec, str):
            raise ValueError(f"device: expected a string like 'cpu' or 'cuda:0', got {spec!r}")
        match = _PATTERN.fullmatch(spec)
        if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
            raise ValueError(
                f"device: {spec!r} is not a device; expected 'cpu', 'cuda' or 'cuda:N' with N >= 0"
            )
        self.type = match.group(1)
        self.index = int(match.group(2)) if match.group(2) is not None else None

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self):
        return f"Device({str(self)!r})"

    def __eq__(self, other):
        if isinstance(other, str):
            try:
                other = Device(other)
            except ValueError:
                return NotImplemented
        if not isinstance(other, Device):
            return NotImplemented
        return (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash(str(self))  # equal to its canonical string, so it must hash like it

    def __reduce__(self):
        return (Device, (str(self),))

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def ordinal(self) -> int:
        """The CUDA index, a bare ``cuda`` meaning device 0 (as CuPy and PyTorch do)."""
        return 0 if self.index is None else self.index


def parse_devices(devices, field="devices") -> list[Device]:
    """Turn a list of device specs into Devices, rejecting a bare ``cuda`` next to ``cuda:N``."""
    if isinstance(devices, (str, Device)):
        devices = [devices]
    try:
        parsed = [Device(d) for d in devices]
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None
    bare = any(d.is_cuda and d.index is None for d in parsed)
    indexed = [str(d) for d in parsed if d.is_cuda and d.index is not None]
    if bare and indexed:
        raise ValueError(
            f"{field}: a bare 'cuda' next to {', '.join(indexed)} is ambiguous (it could alias one of them)"
        )
    return parsed


def placement_device(device) -> Device:
    """The device a chunk is placed on: a bare ``cuda`` means ``cuda:0``."""
    device = Device(device)
    return Device(f"cuda:{device.ordinal}") if device.is_cuda else device


def device_resource(device) -> str:
    """The Dask resource a worker advertises to own ``device``.

    Examples
    --------
    >>> device_resource("cuda")
    'dsched-cuda:0'
    """
    return f"{RESOURCE_PREFIX}{placement_device(device)}"


def device_entries(mapping, devices, field, among="the devices"):
    """``(Device, value)`` for each entry of a ``{device: value}`` mapping.

    Raises ValueError naming ``field`` for a key that is not a device, or not
    one of ``devices``.
    """
    devices = [Device(d) for d in devices]
    for key, value in mapping.items():
        try:
            device = Device(key)
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from None
        if device not in devices:
            raise ValueError(f"{field}: {device} is not one of {among} {[str(d) for d in devices]}")
        yield device, value


def check_capacities(capacities, devices) -> dict:
    """``{Device: items}`` for every device: the given capacities, the rest unlimited.

    Raises ValueError naming the entry for a device not in ``devices`` or a
    capacity that is not an integer >= 1.
    """
    result = {Device(d): UNLIMITED_CAPACITY for d in devices}
    for device, value in device_entries(capacities or {}, devices, "capacities"):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"capacities[{str(device)!r}]: expected an integer >= 1, got {value!r}")
        result[device] = int(value)
    return result


def device_of_resources(resources) -> Device | None:
    """The device a worker owns, read from its resources (``None`` if it owns none)."""
    for name in resources or ():
        if name.startswith(RESOURCE_PREFIX) and name != EMULATED_RESOURCE:
            return Device(name[len(RESOURCE_PREFIX):])
    return None


def emulated_devices(client) -> dict:
    """``{Device: emulated?}`` for the devices a cluster's workers own, read from their resources.

    A Device hashes like its string, so ``table.get("cuda:0")`` works too.
    """
    table = {}
    for info in client.scheduler_info(n_workers=-1)["workers"].values():
        device = device_of_resources(info.get("resources"))
        if device is not None:
            table[device] = table.get(device, False) or EMULATED_RESOURCE in info["resources"]
    return table


# --- where code is running -------------------------------------------------

_chunk_device: contextvars.ContextVar[Device | None] = contextvars.ContextVar(
    "dsched_chunk_device", default=None
)


@contextlib.contextmanager
def running_on(device):
    """Mark the code inside as a chunk placed on ``device`` (read by :func:`current_device`)."""
    token = _chunk_device.set(None if device is None else Device(device))
    try:
        yield
    finally:
        _chunk_device.reset(token)


def current_device() -> Device | None:
    """The device the running chunk was placed on.

    In any other task on a worker that owns a device, that worker's device;
    elsewhere ``None``.
    """
    device = _chunk_device.get()
    if device is not None:
        return device
    worker = _current_worker()
    return None if worker is None else worker_device(worker)


def _current_worker():
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def worker_device(worker) -> Device | None:
    """The device a Dask worker owns, or ``None``."""
    return device_of_resources(worker.state.total_resources)


def worker_is_emulated(worker) -> bool:
    return EMULATED_RESOURCE in (worker.state.total_resources or {})


def is_emulated_here() -> bool:
    """Whether the code runs on an emulated CUDA worker (which computes with NumPy).

    Also true for a chunk placed on a device that :func:`emulating` marks (sync runs).
    """
    device = _chunk_device.get()
    if device is not None and device in _emulated_here.get():
        return True
    worker = _current_worker()
    return worker is not None and worker_is_emulated(worker)


_emulated_here: contextvars.ContextVar[frozenset] = contextvars.ContextVar("dsched_emulated_here", default=frozenset())


@contextlib.contextmanager
def emulating(devices):
    """Emulate ``devices`` on this thread: chunks placed on them compute with NumPy.

    Sync-mode runs have no worker to advertise emulation, so a sync run over
    CUDA devices this machine lacks marks them here. For testing only.
    """
    token = _emulated_here.set(_emulated_here.get() | {Device(d) for d in devices})
    try:
        yield
    finally:
        _emulated_here.reset(token)


# --- discovery and array modules -------------------------------------------

def visible_gpus() -> list[Device]:
    """The CUDA devices this process can see, through CuPy or NVML; none if neither is installed."""
    count = 0
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, or no device: all mean "none visible"
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                count = min(count, len([v for v in visible.split(",") if v.strip()]))
        except Exception:
            count = 0
    return [Device(f"cuda:{i}") for i in range(count)]


def cuda_local_ordinal(device) -> int:
    """The CuPy device number of ``device`` in this process.

    Workers pinned through ``CUDA_VISIBLE_DEVICES`` see their GPU under
    another number (dask-cuda rotates the list so it is 0).
    """
    device = Device(device)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if str(device.ordinal) in visible:
        return visible.index(str(device.ordinal))
    return device.ordinal


@contextlib.contextmanager
def selected(device):
    """Make ``device`` CuPy's current GPU inside the block (CuPy's current device is per thread).

    A no-op for the CPU, an emulated device, or where CuPy is not installed.
    """
    device = None if device is None else Device(device)
    cupy = None
    if device is not None and device.is_cuda and not is_emulated_here():
        try:
            import cupy
        except ImportError:
            pass
    if cupy is None:
        yield
        return
    with cupy.cuda.Device(cuda_local_ordinal(device)):
        yield


def array_module(device=None):
    """NumPy for the CPU and emulated devices, CuPy for a real CUDA device.

    Examples
    --------
    >>> array_module("cpu").__name__
    'numpy'
    """
    device = current_device() if device is None else Device(device)
    if device is None or device.type == "cpu" or is_emulated_here():
        return np
    try:
        import cupy
    except ImportError:
        raise RuntimeError(
            f"device {device}: computing on a CUDA device needs CuPy (pip install 'dsched[cuda12]'); "
            "on a machine without a GPU, run on an emulated device (LocalHybridCluster(emulate=True))"
        ) from None
    return cupy


def to_device(x, device=None, keep_grad=False):
    """Copy an array, or a tuple/list/dict of them, to ``device``'s memory.

    A thin wrapper over :func:`dsched.backends.to_device`: NumPy arrays become
    CuPy arrays on a real GPU, torch and NEML2 tensors move to
    :func:`dsched.backends.torch_device`; autograd is detached unless ``keep_grad``.
    """
    from . import backends  # backends imports this module

    return backends.to_device(x, device, keep_grad=keep_grad)


def to_host(x, keep_grad=False):
    """Copy an array (or a container of them) back to host memory: CuPy gives NumPy, tensors stay tensors.

    A thin wrapper over :func:`dsched.backends.to_host`.
    """
    from . import backends

    return backends.to_host(x, keep_grad=keep_grad)
