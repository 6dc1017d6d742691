"""GPU transfers of a chunk: page-locked host memory, and a CUDA stream of its own.

On a real GPU each chunk runs inside :func:`chunk_stream`: CuPy's current
stream is a new non-blocking stream for the chunk, so its host-to-device copy,
its compute and its device-to-host copy are ordered on that stream and overlap
with those of the other chunks the worker's threads run at the same time. Its
inputs are views of the run's shared segment, page-locked once per worker
(:func:`dsched.store.pinned_segment`), which is what makes the copies
asynchronous DMA instead of staged through a bounce buffer. On the CPU and on
emulated devices all of this is a no-op.

Written against CuPy's documented API and tested under the ``gpu`` marker;
see docs/dataplane.md for what has been measured on a real GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util

import numpy as np

from dsched.devices.context import is_emulated_here
from dsched.devices.cuda import cuda_local_ordinal
from dsched.devices.device import Device

__all__ = ["is_real_gpu", "chunk_stream", "slot_copies_from_gpu", "results_may_stay_on_gpu", "copy_to_host",
           "same_memory"]


def is_real_gpu(device) -> bool:
    """Whether ``device`` is a CUDA device this process computes on with CuPy (not emulated)."""
    if device is None or not Device(device).is_cuda or is_emulated_here():
        return False
    return _cupy_installed()


@functools.cache
def _cupy_installed() -> bool:
    """Whether CuPy can be imported here; asked once (a look costs a ``stat`` per entry of ``sys.path``)."""
    return importlib.util.find_spec("cupy") is not None


@contextlib.contextmanager
def chunk_stream(device):
    """A CUDA stream of the chunk's own on ``device`` (a no-op elsewhere); synchronised when the block ends."""
    if not is_real_gpu(device):
        yield None
        return
    import cupy

    with cupy.cuda.Device(cuda_local_ordinal(Device(device))):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            yield stream
        stream.synchronize()


# Set while a real GPU's chunk runs whose outputs its slot writes (dsched.worker.chunk): the slot copies a CuPy result
# from the GPU straight into the output's page-locked rows, by DMA. A model wrapper that would bring its result to
# host memory first (dispatch's) leaves it on the GPU then: that copy would land in fresh pageable memory, a
# pageable copy's speed (a tenth of a page-locked one's on an H200), and then be copied again into the rows.
_slot_copies = contextvars.ContextVar("dsched_slot_copies_from_gpu", default=False)


@contextlib.contextmanager
def slot_copies_from_gpu(yes: bool):
    """Inside the block (when ``yes``), :func:`results_may_stay_on_gpu` is true."""
    token = _slot_copies.set(bool(yes))
    try:
        yield
    finally:
        _slot_copies.reset(token)


def results_may_stay_on_gpu() -> bool:
    """Whether the running chunk's CuPy results may be returned on the GPU: its output slot copies them into
    page-locked rows (:func:`copy_to_host`)."""
    return _slot_copies.get()


def copy_to_host(values, target):
    """Copy ``values`` into the host array ``target``: a CuPy array straight from the device (on the current stream)."""
    if hasattr(values, "__cuda_array_interface__") and hasattr(values, "get"):
        values.get(out=target, blocking=False)
    elif not same_memory(values, target):  # a model that computed into its out= rows is written already
        target[...] = values


def same_memory(a, b) -> bool:
    """Whether NumPy array ``a`` is exactly the array ``b``'s items (same address, shape, strides and dtype)."""
    # may_share_memory (a bounds check in C) first: an address read builds a dict per array.
    return isinstance(a, np.ndarray) and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype and \
        np.may_share_memory(a, b) and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
