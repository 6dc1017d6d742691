"""Array backends: NumPy, CuPy, torch and NEML2's typed tensors behind one small interface.

Dispatch, the loaders, the joins and the data plane never test array types
inline; they ask this module. Every function takes any supported array:

========================  ==================================================
``backend_of(x)``         the :class:`Backend` ``x`` belongs to (``None`` for
                          a non-array; :class:`UnsupportedArrayError` for an
                          object that merely carries ``shape`` and ``dtype``)
``host_view(x)``          a zero-copy NumPy view of a host array
``from_host(a, like)``    ``like``'s host type rebuilt around NumPy ``a``
                          (zero-copy): a CPU tensor for torch, the same NEML2
                          type for NEML2, NumPy for NumPy and CuPy
``to_device(x, device)``  ``x`` on ``device`` (torch: the CUDA_VISIBLE_DEVICES-
                          aware :func:`torch_device`; NumPy: CuPy on a real GPU)
``to_host(x)``            back in host memory, same type (CuPy gives NumPy)
``batch_shape(x)``        the axes a batch may be split along
``take(x, axis, a, b)``   items ``a:b`` along the batch ``axis``, same type
``concatenate(xs, axis)`` the pieces joined along ``axis``, same type
``empty_like(x, n, axis)``an uninitialised array like ``x`` with ``n`` items
                          along ``axis``
``template(x, axis)``     a small picklable stand-in for ``like`` (no items)
``detach(x)``             ``x`` without autograd history (zero-copy)
========================  ==================================================

Autograd: a NumPy view or a copy between processes cannot carry a graph, so
:func:`host_view` always detaches, and :func:`to_device` / :func:`to_host`
detach unless ``keep_grad=True`` (then the copy is differentiable, which
only helps where the chunk runs in the caller's process: sync mode or
in-process workers).

Streamed inputs (Zarr and Dask arrays, wrapped by :mod:`dsched.dataplane.sources`)
speak a small protocol: ``shape``, ``dtype`` and ``__dsched_rows__(axis, start,
stop)``, which returns a reference to those rows, read or computed where the
chunk runs. :func:`take` returns that reference.

NEML2 typed tensors (``SR2``, ``Scalar``, ...) keep their structure: the
batch axis counts their *dynamic batch* axes only, so an ``SR2`` of shape
``(N, 6)`` has one batch axis of ``N`` items and an unbatched ``SR2`` (shape
``(6,)``) has none and goes whole into every chunk.
"""

from __future__ import annotations

import sys
import threading
import warnings

import numpy as np

from dsched.devices.context import current_device, is_emulated_here
from dsched.devices.cuda import cuda_local_ordinal
from dsched.devices.device import Device

__all__ = [
    "array_module",
    "Backend",
    "UnsupportedArrayError",
    "backend_of",
    "is_array",
    "host_view",
    "from_host",
    "to_device",
    "to_host",
    "batch_shape",
    "take",
    "concatenate",
    "empty_like",
    "template",
    "detach",
    "torch_device",
    "map_arrays",
]


class UnsupportedArrayError(ValueError, TypeError):
    """An object with ``shape`` and ``dtype`` that no backend knows (a pandas Series, a Dask array...)."""


def _real_cuda(device) -> Device | None:
    """``device`` (default: the running chunk's) if it is a CUDA device computed on for real, else None."""
    device = current_device() if device is None else Device(device)
    if device is None or not device.is_cuda or is_emulated_here():
        return None
    return device


def torch_device(device=None):
    """The ``torch.device`` a chunk placed on ``device`` computes on.

    ``cpu`` and emulated CUDA devices give ``torch.device("cpu")``; a real
    ``cuda:N`` gives its number in this process, which differs from ``N``
    on workers pinned through ``CUDA_VISIBLE_DEVICES`` (dask-cuda rotates
    the list so a worker's own GPU is 0). ``device`` defaults to
    :func:`~dsched.current_device`.

    Examples
    --------
    >>> torch_device("cpu")  # doctest: +SKIP
    device(type='cpu')
    """
    import torch

    cuda = _real_cuda(device)
    if cuda is None:
        return torch.device("cpu")
    device = torch.device("cuda", cuda_local_ordinal(cuda))
    if not _linalg_loaded and torch.cuda.is_available():
        _load_cuda_linalg(torch, device)
    return device


_linalg_loaded = False  # torch's CUDA linear algebra is loaded in this process
_linalg_lock = threading.Lock()


def _load_cuda_linalg(torch, device) -> None:
    """Load torch's CUDA linear algebra once per process, one thread at a time.

    torch loads it lazily, at the first linear-algebra call on a GPU, and two threads making that first call
    at once fail with "lazy wrapper should be called at most once" (pytorch/pytorch#90613): a GPU worker's
    two threads starting their first NEML2 chunks did, on a real GPU.
    """
    global _linalg_loaded
    with _linalg_lock:
        if not _linalg_loaded:
            # on the chunk's own GPU: a call on another would make a CUDA context there
            torch.linalg.solve(torch.eye(1, device=device, dtype=torch.float64),
                               torch.ones(1, device=device, dtype=torch.float64))
            _linalg_loaded = True


def _index(axis: int, start: int, stop: int):
    return (slice(None),) * axis + (slice(start, stop),)


class Backend:
    """One kind of array. Subclasses implement every method for their type."""

    name = "?"

    def owns(self, x) -> bool:
        raise NotImplementedError

    def host_view(self, x) -> np.ndarray:
        raise NotImplementedError

    def from_host(self, array: np.ndarray, like):
        raise NotImplementedError

    def to_device(self, x, device, keep_grad=False):
        raise NotImplementedError

    def to_host(self, x, keep_grad=False):
        raise NotImplementedError

    def batch_shape(self, x) -> tuple:
        return tuple(x.shape)

    def take(self, x, axis, start, stop):
        return x[_index(axis, start, stop)]

    def concatenate(self, pieces, axis):
        raise NotImplementedError

    def empty_like(self, like, n, axis):
        raise NotImplementedError

    def detach(self, x):
        return x

    def template(self, x, axis):
        """``x`` with no items along the batch ``axis``; see :func:`template`."""
        return self.detach(self.take(x, axis, 0, 0))

    def __repr__(self):
        return f"<dsched backend {self.name}>"


def _shape_with(shape, axis, n):
    shape = list(shape)
    shape[axis] = n
    return tuple(shape)


class NumPyBackend(Backend):
    name = "numpy"

    def owns(self, x):
        return isinstance(x, (np.ndarray, np.generic))

    def host_view(self, x):
        return np.asarray(x)

    def from_host(self, array, like):
        return array

    def to_device(self, x, device, keep_grad=False):
        cuda = _real_cuda(device)
        if cuda is None:
            return x
        # NumPy inputs of a real GPU chunk become CuPy.
        cupy = _cupy_for(cuda)
        with cupy.cuda.Device(cuda_local_ordinal(cuda)):
            if isinstance(x, np.ndarray) and x.ndim and x.flags.c_contiguous and x.dtype.char in _CUPY_TYPES:
                # One copy, straight from x (synchronous: x may change once this returns). cupy.asarray would
                # first copy x into a page-locked buffer of its own, even where x is page-locked already
                # (dsched's shared segments are, on a GPU worker): a host memcpy at a few GB/s per transfer.
                out = cupy.empty(x.shape, dtype=x.dtype)
                out.set(x)
                return out
            return cupy.asarray(x)

    def to_host(self, x, keep_grad=False):
        return x

    def concatenate(self, pieces, axis):
        return np.concatenate(pieces, axis=axis)

    def empty_like(self, like, n, axis):
        return np.empty(_shape_with(np.shape(like), axis, n), dtype=like.dtype)


_CUPY_TYPES = "?bhilqBHILQefdFD"  # the NumPy types CuPy arrays hold


def _cupy_for(device):
    try:
        import cupy
    except ImportError:
        raise RuntimeError(
            f"device {device}: moving NumPy arrays to a CUDA device needs CuPy (pip install 'dsched[cuda13]', or "
            "'dsched[cuda12]' for a CUDA 12 driver); "
            "pass torch tensors for a torch model, or run on an emulated device (LocalHybridCluster(emulate=True))"
        ) from None
    return cupy


class CuPyBackend(Backend):
    name = "cupy"

    def owns(self, x):
        return type(x).__module__.partition(".")[0] == "cupy" and hasattr(x, "__cuda_array_interface__")

    def host_view(self, x):
        raise ValueError(f"a CuPy array on GPU {x.device.id} has no host view; copy it with to_host first")

    def from_host(self, array, like):
        return array  # a CuPy array's host form is NumPy, as dispatch has always returned

    def to_device(self, x, device, keep_grad=False):
        import cupy

        cuda = _real_cuda(device)
        if cuda is None:
            return x.get()
        with cupy.cuda.Device(cuda_local_ordinal(cuda)):
            return cupy.asarray(x)

    def to_host(self, x, keep_grad=False):
        return x.get()

    def concatenate(self, pieces, axis):
        import cupy

        return cupy.concatenate(pieces, axis=axis)

    def empty_like(self, like, n, axis):
        import cupy

        with like.device:
            return cupy.empty(_shape_with(like.shape, axis, n), dtype=like.dtype)


class TorchBackend(Backend):
    name = "torch"
    read_only_warned = False  # torch gave (and from_host silenced) its once-per-process read-only array warning

    def owns(self, x):
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(x, torch.Tensor)

    def host_view(self, x):
        if x.device.type != "cpu":
            raise ValueError(f"a torch tensor on {x.device} has no host view; copy it with to_host first")
        return x.detach().numpy()  # detach() shares storage: still zero-copy

    def from_host(self, array, like):
        import torch

        if self.read_only_warned or array.flags.writeable:
            return torch.from_numpy(array)
        with warnings.catch_warnings():
            # A read-only array (shared memory mapped read-only) gives a tensor that must not be written;
            # torch warns once per process, which would otherwise land in every worker's log. Once it has
            # (silenced here), it never warns again: later calls skip the filter's cost (a step's every input).
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        TorchBackend.read_only_warned = True
        return tensor

    def to_device(self, x, device, keep_grad=False):
        return (x if keep_grad else x.detach()).to(torch_device(device))

    def to_host(self, x, keep_grad=False):
        return (x if keep_grad else x.detach()).cpu()

    def concatenate(self, pieces, axis):
        import torch

        return torch.cat(list(pieces), dim=axis)

    def empty_like(self, like, n, axis):
        import torch

        return torch.empty(_shape_with(like.shape, axis, n), dtype=like.dtype, device=like.device)

    def detach(self, x):
        return x.detach()

    def template(self, x, axis):
        # A fresh empty tensor: a view (even of no items) would pickle its whole storage.
        import torch

        return torch.empty(_shape_with(x.shape, axis, 0), dtype=x.dtype, device=x.device)


class NEML2Backend(Backend):
    """NEML2's typed tensors (``SR2``, ``Scalar``, ...: ``TensorWrapper``) and its dynamic-base ``Tensor``.

    Both hold a torch tensor ``data`` of shape ``(*K, *batch, *sub-batch, *base)``;
    the batch axes are a wrapper's dynamic batch axes, or a ``Tensor``'s
    ``batch_ndim`` leading axes (Jacobian blocks).
    """

    name = "neml2"

    def owns(self, x):
        if "neml2" not in sys.modules:
            return False
        from neml2.types import Tensor, TensorWrapper

        return isinstance(x, (TensorWrapper, Tensor))

    @staticmethod
    def _rewrap(like, data):
        if hasattr(like, "batch_ndim"):  # a dynamic-base Tensor inherits every field
            return like._rewrap(data)
        return like._rewrap(data, sub_batch_ndim=like.sub_batch_ndim)

    def batch_shape(self, x):
        return tuple(x.batch_shape if hasattr(x, "batch_ndim") else x.dynamic_batch_shape)

    def expanded(self, x, batch):
        """``x`` over the batch shape ``batch``: NEML2 leaves a value unbatched where nothing varied (zero strain)."""
        if self.batch_shape(x) == tuple(batch):
            return x
        return (x.batch if hasattr(x, "batch_ndim") else x.dynamic_batch).expand(*batch)

    def _data_axis(self, x, axis):
        batch = self.batch_shape(x)
        if not 0 <= axis < len(batch):
            raise ValueError(
                f"axis: {axis} is out of range for a NEML2 {type(x).__name__} with batch shape {batch}"
            )
        return x.k_ndim + axis

    def host_view(self, x):
        return TORCH.host_view(x.data)

    def from_host(self, array, like):
        return self._rewrap(like, TORCH.from_host(array, like.data))

    def to_device(self, x, device, keep_grad=False):
        return self._rewrap(x, TORCH.to_device(x.data, device, keep_grad))

    def to_host(self, x, keep_grad=False):
        return self._rewrap(x, TORCH.to_host(x.data, keep_grad))

    def take(self, x, axis, start, stop):
        return self._rewrap(x, x.data[_index(self._data_axis(x, axis), start, stop)])

    def concatenate(self, pieces, axis):
        first = pieces[0]
        return self._rewrap(first, TORCH.concatenate([p.data for p in pieces], self._data_axis(first, axis)))

    def empty_like(self, like, n, axis):
        return self._rewrap(like, TORCH.empty_like(like.data, n, self._data_axis(like, axis)))

    def detach(self, x):
        return self._rewrap(x, x.data.detach())

    def template(self, x, axis):
        return self._rewrap(x, TORCH.template(x.data, self._data_axis(x, axis)))


class StreamedBackend(Backend):
    """Inputs whose rows are read or computed where a chunk runs (the ``__dsched_rows__`` protocol).

    They are cut, never moved: a chunk's rows (a reference) are resolved to a
    NumPy array before the chunk's code sees them.
    """

    name = "streamed"

    def owns(self, x) -> bool:
        return hasattr(type(x), "__dsched_rows__")

    def take(self, x, axis, start, stop):
        return x.__dsched_rows__(axis, start, stop)

    def host_view(self, x):
        raise ValueError(f"{x!r} is streamed: its rows are read where each chunk runs, never whole")

    def to_device(self, x, device, keep_grad=False):
        return x

    def to_host(self, x, keep_grad=False):
        return x


NUMPY, CUPY, TORCH, NEML2, STREAMED = NumPyBackend(), CuPyBackend(), TorchBackend(), NEML2Backend(), StreamedBackend()
# NEML2 before torch: its wrappers are not tensors, but the order states the intent.
BACKENDS = (NUMPY, NEML2, TORCH, CUPY, STREAMED)


def backend_of(x, strict: bool = True) -> Backend | None:
    """The backend ``x`` belongs to, or ``None`` if ``x`` is not an array.

    Raises
    ------
    UnsupportedArrayError
        With ``strict``, for an object that has ``shape`` and ``dtype`` but
        belongs to no backend (with ``strict=False`` it is ``None``).
    """
    for backend in BACKENDS:
        if backend.owns(x):
            return backend
    if strict and hasattr(x, "shape") and hasattr(x, "dtype"):
        kind = f"{type(x).__module__}.{type(x).__qualname__}"
        raise UnsupportedArrayError(
            f"a {kind} has shape and dtype but is not an array dsched can split or move "
            "(NumPy, CuPy, torch tensors, NEML2's typed tensors, Zarr and Dask arrays are); convert it first, "
            "e.g. with numpy.asarray"
        )
    return None


def is_array(x) -> bool:
    """Whether ``x`` is an array of a known backend (strict: see :func:`backend_of`)."""
    return backend_of(x) is not None


def _require(x, what):
    backend = backend_of(x)
    if backend is None:
        raise UnsupportedArrayError(f"{what}: expected an array, got {type(x).__qualname__}")
    return backend


def host_view(x) -> np.ndarray:
    """A zero-copy NumPy view of a host array (torch CPU tensor, NEML2 tensor, NumPy).

    The view shares memory with ``x`` and carries no autograd. A device
    array (CuPy, CUDA tensor) is a ``ValueError``: copy it with :func:`to_host`.

    Examples
    --------
    >>> import numpy as np
    >>> host_view(np.arange(3)).tolist()
    [0, 1, 2]
    """
    return _require(x, "host_view").host_view(x)


def from_host(array: np.ndarray, like):
    """``like``'s host type rebuilt around the NumPy ``array``, sharing its memory.

    A torch CPU tensor for torch (``torch.from_numpy``), the same NEML2 type
    and structure for NEML2 (``array`` has its full shape, base axes
    included), ``array`` itself for NumPy and CuPy.
    """
    return _require(like, "from_host").from_host(array, like)


def map_arrays(fn, x):
    """``fn(backend, leaf)`` on every array of a (nested) tuple, list or dict; other leaves unchanged."""
    if isinstance(x, dict):
        return {k: map_arrays(fn, v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(map_arrays(fn, v) for v in x)
    backend = backend_of(x, strict=False)
    return x if backend is None else fn(backend, x)


def to_device(x, device=None, keep_grad: bool = False):
    """``x`` (an array, or a tuple/list/dict of them) on ``device`` (default: the running chunk's).

    torch and NEML2 tensors go to :func:`torch_device`; NumPy arrays become
    CuPy arrays on a real GPU (unchanged on the CPU and emulated devices).
    Autograd is detached unless ``keep_grad``.
    """
    return map_arrays(lambda b, a: b.to_device(a, device, keep_grad), x)


def to_host(x, keep_grad: bool = False, keep_cupy: bool = False):
    """``x`` (an array, or a container of them) in host memory, as the same type (CuPy gives NumPy).

    ``keep_cupy``: CuPy arrays stay on their GPU (for a caller that copies them into host memory itself).
    """
    if keep_cupy:
        return map_arrays(lambda b, a: a if b is CUPY else b.to_host(a, keep_grad), x)
    return map_arrays(lambda b, a: b.to_host(a, keep_grad), x)


def detach(x):
    """``x`` (or a container of arrays) without autograd history, sharing memory."""
    return map_arrays(lambda b, a: b.detach(a), x)


def batch_shape(x) -> tuple:
    """The shape a batch is split along: the full shape, a NEML2 tensor's dynamic batch shape, ``()`` for a non-array.

    Objects of no backend that have a ``shape`` (a Zarr array given to an
    :class:`~dsched.ArrayLoader`, say) report it.
    """
    backend = backend_of(x, strict=False)
    if backend is None:
        return tuple(getattr(x, "shape", ()))
    return backend.batch_shape(x)


def take(x, axis: int, start: int, stop: int):
    """Items ``start:stop`` of ``x`` along the batch ``axis``, as the same type (a view where the type allows)."""
    backend = backend_of(x, strict=False)
    if backend is not None:
        return backend.take(x, axis, start, stop)
    if hasattr(x, "__getitem__"):  # anything sliceable: Zarr, h5py, memory maps
        return x[_index(axis, start, stop)]
    raise UnsupportedArrayError(f"a {type(x).__qualname__} cannot be sliced along axis {axis}")


def concatenate(pieces, axis: int = 0):
    """Join same-type arrays along ``axis`` (``torch.cat`` for tensors, NEML2 types rebuilt)."""
    pieces = list(pieces)
    return _require(pieces[0], "concatenate").concatenate(pieces, axis)


def empty_like(like, n: int, axis: int = 0):
    """An uninitialised array of ``like``'s type, dtype and device with ``n`` items along ``axis``."""
    return _require(like, "empty_like").empty_like(like, n, axis)


def template(x, axis: int = 0):
    """``x`` with no items along ``axis``: what :func:`from_host` needs as ``like``, small enough to ship with every chunk.

    The data plane shares ``host_view(x)`` in shared memory and sends
    ``template(x)``; a worker rebuilds the user's type around its rows with
    ``from_host(rows, template)``. A torch or NEML2 template owns a storage of
    its own, empty: a view of ``x``, even of no items, would pickle all of
    ``x``'s storage (one step of a strain history: the whole history).

    Examples
    --------
    >>> import numpy as np
    >>> template(np.zeros((5, 6))).shape
    (0, 6)
    """
    backend = _require(x, "template")
    if len(backend.batch_shape(x)) <= axis:
        return backend.detach(x)  # no batch axis: the whole (batch-independent) value
    return backend.template(x, axis)


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
            f"device {device}: computing on a CUDA device needs CuPy (pip install 'dsched[cuda13]', or "
            "'dsched[cuda12]' for a CUDA 12 driver); "
            "on a machine without a GPU, run on an emulated device (LocalHybridCluster(emulate=True))"
        ) from None
    return cupy
