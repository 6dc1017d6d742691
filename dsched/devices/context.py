"""Where code runs: the device of the running chunk, of this worker, and emulation.

Inside a chunk, :func:`current_device` is the device the chunk was placed on
(set by :func:`running_on`); in any other task on a worker that owns a device,
that worker's device. An emulated CUDA worker computes with NumPy:
:func:`is_emulated_here` tells the array backends so.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util

from dsched.devices.cuda import cuda_local_ordinal, visible_gpus
from dsched.devices.device import Device, device_of_resources
from dsched.names import EMULATED_RESOURCE

__all__ = ["running_on", "current_device", "worker_device", "worker_is_emulated", "is_emulated_here", "emulating",
           "numpy_cannot_reach",
           "selected"]

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


def enter_device(device: Device):
    """:func:`running_on` without a context manager, for a chunk path run thousands of times a second: the token
    :func:`leave_device` takes."""
    return _chunk_device.set(device)


def leave_device(token) -> None:
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
    return _emulates(_chunk_device.get())


def _emulates(device) -> bool:
    """Whether chunks on ``device`` compute with NumPy here: it is marked by :func:`emulating`, or this is an
    emulated worker."""
    if device is not None and device in _emulated_here.get():
        return True
    worker = _current_worker()
    return worker is not None and worker_is_emulated(worker)


_emulated_here: contextvars.ContextVar[frozenset] = contextvars.ContextVar("dsched_emulated_here", default=frozenset())


def numpy_cannot_reach(device) -> str | None:
    """Why NumPy arrays cannot reach CUDA ``device`` from this thread (a sync run computes here), or ``None``: the
    device is emulated here (:func:`emulating`, or an emulated worker), or a GPU this process sees, with CuPy to
    move the arrays."""
    device = Device(device)
    if _emulates(device):
        return None
    visible = [str(d) for d in visible_gpus()]
    if str(device) not in visible:
        return f"this process sees no such GPU (visible GPUs: {', '.join(visible) or 'none'})"
    if importlib.util.find_spec("cupy") is None:
        return "NumPy arrays need CuPy to reach it (pip install '.[cuda13]', or '.[cuda12]' for a CUDA 12 driver)"
    return None


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
