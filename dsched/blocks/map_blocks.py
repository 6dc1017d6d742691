"""The dask.array path: a batch as a Dask array chunked by a scheduler's plan.

``as_batched`` chunks an array by the plan (:mod:`dsched.blocks.planning`), and
``map_blocks`` is ``dask.array.map_blocks`` with each block on the device
planned for it (:mod:`dsched.placement` pins the blocks), a lazy Dask array
that composes (and fuses) with the rest of a graph.
"""

from __future__ import annotations

import logging
import math
import numbers
from functools import partial
from itertools import product

import numpy as np

from dsched.blocks.engines import engine_of, is_dask_array
from dsched.blocks.planning import MAX_PLAN_CHUNKS, plan, plan_blocks
from dsched.checks import check_callable
from dsched.cluster.placement import PlannedBlock, run_block
from dsched.devices import backends

__all__ = ["as_batched", "map_blocks"]

logger = logging.getLogger("dsched.array")  # the name users filter on since the first release


# --- batched arrays --------------------------------------------------------------

def _is_array(x) -> bool:
    return is_dask_array(x) or isinstance(x, np.ndarray)


def _batch_length(arrays, fields) -> int:
    lengths = {}
    for field, x in zip(fields, arrays):
        if x.ndim == 0:
            raise ValueError(f"{field}: a 0-d array has no batch axis; pass it as a keyword argument instead")
        if isinstance(x.shape[0], float) and math.isnan(x.shape[0]):
            raise ValueError(f"{field}: the length of axis 0 is unknown (call compute_chunk_sizes() first)")
        lengths[field] = int(x.shape[0])
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{f} has {m}" for f, m in lengths.items())
        raise ValueError(f"{fields[0]}: the arrays disagree on the batch length along axis 0 ({described})")
    n = next(iter(lengths.values()))
    if n < 1:
        raise ValueError(f"{fields[0]}: the batch is empty (length 0 along axis 0)")
    return n


def _chunk_as_planned(x, sizes):
    """``x`` as a Dask array chunked ``sizes`` along axis 0 and whole along the others."""
    import dask.array as da

    if is_dask_array(x):
        return x.rechunk({0: sizes, **{axis: -1 for axis in range(1, x.ndim)}})
    return da.from_array(x, chunks=(sizes,) + tuple(x.shape[1:]))


def as_batched(x, scheduler, *, speeds=None):
    """``x`` chunked by the scheduler's plan along axis 0, and the plan.

    Parameters
    ----------
    x : numpy.ndarray or dask.array.Array
        The batch, items along axis 0. Other axes are left whole.
    scheduler : WorkScheduler
    speeds : dict, optional
        Passed to :func:`plan`.

    Returns
    -------
    (dask.array.Array, list of (Device, int))

    Examples
    --------
    >>> import numpy as np
    >>> from dsched import SimpleScheduler
    >>> xb, p = as_batched(np.zeros((10, 6)), SimpleScheduler("cpu", 4))
    >>> xb.chunks
    ((4, 4, 2), (6,))
    """
    if not _is_array(x):
        raise ValueError(f"x: expected a NumPy or Dask array, got {type(x).__name__}")
    n = _batch_length([x], ["x"])
    chunks = plan(n, scheduler, speeds=speeds)
    return _chunk_as_planned(x, tuple(m for _, m in chunks)), chunks


def map_blocks(fn, *args, scheduler, rechunk=False, to_device=True, to_host=True, speeds=None, name=None, token=None,
               dtype=None, chunks=None, drop_axis=None, new_axis=None, enforce_ndim=False, meta=None,
               backend="numpy", **kwargs):
    """``dask.array.map_blocks``, every batch block on the device ``scheduler`` plans for it.

    Every semantic of ``dask.array.map_blocks`` holds: Dask arrays are the
    blocked inputs, aligned on their last axes and broadcast as Dask does
    (an input with one block along an axis serves every block); anything
    else (NumPy arrays, constants, delayed objects) passes whole to every
    call; ``name``, ``token``, ``dtype``, ``chunks``, ``drop_axis``,
    ``new_axis``, ``enforce_ndim``, ``meta``, ``block_id`` and ``block_info``
    mean what they mean there, on both array engines; output chunks are the inputs'.

    One thing is added. The *batch axis* is axis 0 of the inputs with the
    most axes; its blocks are the batch blocks. Each output block runs on the
    device of its batch block (with the placement plugins installed:
    ``LocalHybridCluster``, :func:`dsched.register`, or the preload
    modules): inputs cut by the plan (:func:`as_batched`, or
    ``rechunk=True``) get the plan's devices; any other chunking gets the
    devices the same policy gives blocks of those sizes (:func:`plan_blocks`).
    A block whose output shape differs from the declared one (``chunks``)
    raises a ``ValueError`` when computed, instead of a silently wrong shape
    (axes of length 1 may differ, as Dask tolerates).

    Nothing is placed when ``drop_axis`` drops the batch axis (every output
    block then reads the whole batch); this, and a ``rechunk=True`` that
    cannot be honoured, is logged on the ``dsched.array`` logger.

    Parameters
    ----------
    fn : callable
        ``fn(*blocks, **kwargs)``, one call per block.
    *args
        Dask arrays (blocked), and anything else (passed whole).
    scheduler : WorkScheduler
        ``SimpleScheduler`` or ``StaticHybridScheduler``: its policy places the blocks.
    rechunk : bool
        Cut the batch inputs (those of full length along the batch axis) by
        :func:`plan` first, so every block is a planned sub-batch. Not done
        when ``chunks`` declares other lengths along the batch axis than the
        inputs' (a function that changes that length): Dask's blocks are
        kept then.
    to_device, to_host : bool
        On a real GPU, pass the blocks to ``fn`` as CuPy arrays on that GPU,
        and copy a CuPy result back to NumPy (``False``: it stays CuPy; give
        ``meta`` accordingly).
    speeds : dict, optional
        ``{device: items_per_s}`` for the plan.
    backend : {"numpy", "torch"}
        ``"torch"``: ``fn`` gets every NumPy array argument (its blocks
        included) as a torch tensor on the block's device (``torch_device``:
        the GPU on a real one, else the CPU) and may return tensors, which come
        back as NumPy. Dask arrays hold NumPy chunks; the model computes in
        torch. ``to_device`` and ``to_host`` are then torch's own moves.
    **kwargs
        ``dask.array.map_blocks``'s keyword arguments and ``fn``'s.

    Returns
    -------
    dask.array.Array

    Examples
    --------
    >>> import dask.array as da
    >>> from dsched import SimpleScheduler
    >>> x = da.arange(10.0, chunks=5)
    >>> map_blocks(np.sqrt, x, scheduler=SimpleScheduler("cpu", 4)).chunks
    ((5, 5),)
    >>> y = map_blocks(np.sqrt, x, scheduler=SimpleScheduler("cpu", 4), rechunk=True)
    >>> y.chunks, float(y.sum().compute(scheduler="sync"))
    (((4, 4, 2),), 19.30600052603572)
    """
    fn, to_device, to_host, engine = _check_arguments(fn, args, backend, scheduler, to_device, to_host)
    drop_axis, new_axis, out_ind = _axes(args, drop_axis, new_axis, chunks)
    layout = _BatchLayout.of(args, scheduler, speeds, chunks, out_ind, rechunk)
    args, chunks = layout.apply(args, chunks, out_ind)
    first = _dask_array(engine, fn, args, meta, out_ind, dict(name=name, token=token, dtype=dtype, chunks=chunks,
                        drop_axis=drop_axis, new_axis=new_axis, enforce_ndim=enforce_ndim, **kwargs))
    call = _block_call(fn, args, out_ind, enforce_ndim, to_device, to_host)
    return _rebuild(engine, first, fn, call, args, out_ind, drop_axis, layout, name, token, kwargs)


def _check_arguments(fn, args, backend, scheduler, to_device, to_host):
    """Check ``fn``, ``backend`` and ``scheduler``; ``fn``, ``to_device`` and ``to_host`` as the blocks use them,
    and the array engine of ``args`` (:func:`~dsched.blocks.engines.engine_of`).

    With ``backend="torch"``, ``fn`` is wrapped in :class:`TorchBlocks`, which
    moves the blocks itself (torch's own moves): no CuPy moves around it.
    """
    check_callable(fn, "fn", TypeError)
    if backend not in ("numpy", "torch"):
        raise ValueError(f"backend: expected 'numpy' or 'torch', got {backend!r}")
    if backend == "torch":
        fn, to_device, to_host = TorchBlocks(fn), False, False
    if not hasattr(scheduler, "status"):
        raise ValueError(f"scheduler: expected a WorkScheduler, got {scheduler!r}")
    return fn, to_device, to_host, engine_of(args)


def _axes(args, drop_axis, new_axis, chunks) -> tuple:
    """``drop_axis`` and ``new_axis`` as lists (``new_axis`` may stay ``None``), and the output's index labels."""
    drop_axis = [drop_axis] if isinstance(drop_axis, numbers.Number) else list(drop_axis or [])
    new_axis = [new_axis] if isinstance(new_axis, numbers.Number) else (None if new_axis is None else list(new_axis))
    return drop_axis, new_axis, _output_indices(args, drop_axis, new_axis, chunks)


def _dask_array(engine, fn, args, meta, out_ind, options):
    """The array the engine's own ``map_blocks`` makes of the call (``options``: its keyword arguments).

    Dask builds the array once (meta, dtype, chunks and all its checks), then
    the layer is rebuilt with one more per-block argument: the block's plan
    (:func:`_rebuild`).
    """
    dask_map_blocks = engine.map_blocks()  # the module's own, however `dask.array` is patched

    first = dask_map_blocks(fn, *args, meta=meta, **options)
    if not is_dask_array(first):
        # A pandas meta makes a DataFrame collection (map_blocks(pd.Series, x)); the same call
        # with an array meta gives its blocks' chunks (the name does not depend on meta).
        probe = dask_map_blocks(fn, *args, meta=np.empty((0,) * len(out_ind), dtype=first.dtype), **options)
        probe._meta = first._meta
        first = probe
    return first


def _block_call(fn, args, out_ind, enforce_ndim, to_device, to_host):
    """What every block runs: ``fn`` on the block's device (its output's dimensions checked with ``enforce_ndim``)."""
    from dask.array.core import apply_and_enforce

    inner = partial(apply_and_enforce, _func=fn, expected_ndim=len(out_ind)) if enforce_ndim else fn
    return _BlockCall(inner, [i for i, a in enumerate(args) if is_dask_array(a)], to_device, to_host)


def funcname_of(fn) -> str:
    from dask.utils import funcname

    try:
        return funcname(fn)
    except Exception:  # an exotic callable: a name is only for messages
        return type(fn).__name__


def _output_indices(args, drop_axis, new_axis, chunks) -> tuple:
    """The output's index labels, as ``dask.array.map_blocks`` computes them.

    Inputs are labelled by their axes counted from the last (``ndim - 1`` for
    axis 0 of the inputs with the most axes); new axes take fresh labels.
    """
    ndims = [a.ndim for a in args if is_dask_array(a)]
    out_ind = tuple(range(max(ndims)))[::-1] if ndims else ()
    if drop_axis:
        dropped = {i % len(out_ind) for i in drop_axis if -len(out_ind) <= i < len(out_ind)}  # Dask rejects the rest
        out_ind = tuple(x for i, x in enumerate(out_ind) if i not in dropped)
    if new_axis is None and chunks is not None and len(out_ind) < len(chunks):
        new_axis = range(len(chunks) - len(out_ind))
    if new_axis:
        out_ind = list(out_ind)
        for ax in sorted(new_axis):
            out_ind.insert(ax, len(out_ind) + len(drop_axis))
        out_ind = tuple(out_ind)
    return out_ind


class _BatchLayout:
    """The batch axis of a call, its blocks, and the device planned for each.

    ``label`` is the batch axis's index label (see :func:`_output_indices`),
    ``None`` when there is no batch to place; ``devices[b]`` and
    ``sizes[b]`` are the device and the items of batch block ``b``;
    ``rechunked`` maps argument positions to the arrays re-chunked by the plan
    (``rechunk=True``); ``note`` says what could not be placed, and why.
    """

    def __init__(self, label=None, devices=(), sizes=(), rechunked=None, note=None):
        self.label, self.devices, self.sizes = label, list(devices), tuple(sizes)
        self.rechunked, self.note = dict(rechunked or {}), note

    @classmethod
    def of(cls, args, scheduler, speeds, chunks, out_ind, rechunk):
        arrays = [(i, a) for i, a in enumerate(args) if is_dask_array(a)]
        ndim = max((a.ndim for _, a in arrays), default=0)
        if ndim == 0:
            return cls()  # no blocked input with an axis: no batch
        label = ndim - 1
        if label not in out_ind:
            return cls(note="drop_axis drops the batch axis (axis 0), so every output block reads the whole "
                            "batch; its blocks are not placed")
        batch = [(i, a) for i, a in arrays if a.ndim == ndim]
        # Dask pairs blocks by position and broadcasts a single block: the batch blocks
        # are those of the inputs with the most blocks along axis 0.
        source = max(batch, key=lambda ia: ia[1].numblocks[0])[1]
        # chunks of the wrong length: Dask raises its own error on them just after.
        declared = chunks[out_ind.index(label)] if chunks is not None and len(chunks) == len(out_ind) else None
        if rechunk:
            n = source.shape[0]
            if isinstance(n, float) and math.isnan(n):
                note = "rechunk=True: the batch length is unknown (call compute_chunk_sizes() first)"
            elif declared is not None and declared != source.chunks[0]:
                note = (f"rechunk=True: chunks= declares {declared!r} along the batch axis, so the input's "
                        f"blocks {source.chunks[0]} are kept (a function that changes the length along axis 0)")
            elif n > 0:
                planned = plan(int(n), scheduler, speeds=speeds)
                sizes = tuple(m for _, m in planned)
                rechunked = {i: a.rechunk({0: sizes}) for i, a in batch if a.shape[0] == n}
                return cls(label, [d for d, _ in planned], sizes, rechunked)
            else:
                note = None
            layout = cls.of(args, scheduler, speeds, chunks, out_ind, rechunk=False)
            layout.note = note
            return layout
        sizes = tuple(1 if isinstance(m, float) and math.isnan(m) else int(m) for m in source.chunks[0])
        if len(sizes) > MAX_PLAN_CHUNKS:
            return cls(note=f"{len(sizes)} blocks along the batch axis are more than a plan holds "
                            f"({MAX_PLAN_CHUNKS}); its blocks are not placed")
        return cls(label, plan_blocks(sizes, scheduler, speeds=speeds), sizes)

    def apply(self, args, chunks, out_ind):
        """The arguments (re-chunked where ``rechunk=True`` did), and the declared chunks to match."""
        if not self.rechunked:
            return args, chunks
        args = tuple(self.rechunked.get(i, a) for i, a in enumerate(args))
        if chunks is not None and len(chunks) == len(out_ind):  # declared as the input's: now the plan's
            chunks = tuple(self.sizes if ind == self.label else c for ind, c in zip(out_ind, chunks))
        return args, chunks

    def block_plan(self, index):
        """``(device, size)`` of batch block ``index``, or ``(None, None)``."""
        if self.label is None or index >= len(self.devices):
            return None, None
        return self.devices[index], self.sizes[index]


def _rebuild(engine, first, fn, call, args, out_ind, drop_axis, layout, name, token, kwargs):
    """``first``'s layer again, every block given its plan (device, size, declared shape).

    Built with the engine's own ``blockwise``, named as ``map_blocks``
    documents ``name`` and ``token`` (:meth:`Engine.naming`).
    """
    from dask.array.core import _pass_extra_kwargs
    from dask.layers import ArrayBlockIdDep, ArrayValuesDep
    from dask.utils import has_keyword

    argpairs = _argpairs(args)
    batch_pos = out_ind.index(layout.label) if layout.label in out_ind else None
    blocks = {}
    for block_id in product(*(range(len(c)) for c in first.chunks)):
        device, size = layout.block_plan(block_id[batch_pos]) if batch_pos is not None else (None, None)
        shape = tuple(c[j] for c, j in zip(first.chunks, block_id))
        blocks[block_id] = PlannedBlock(device, size, shape=shape, name=first.name, block_id=block_id)
    extra_names, extra_pairs = ["_dsched_block"], [(ArrayValuesDep(first.chunks, blocks), out_ind)]
    if has_keyword(fn, "block_id"):
        extra_names.append("block_id")
        extra_pairs.append((ArrayBlockIdDep(first.chunks), out_ind))
    if has_keyword(fn, "_overlap_trim_info"):  # dask's map_overlap asks for it
        trim = {b: (b, first.numblocks) for b in product(*(range(len(c)) for c in first.chunks))}
        extra_names.append("_overlap_trim_info")
        extra_pairs.append((ArrayValuesDep(first.chunks, trim), out_ind))
    if has_keyword(fn, "block_info"):
        extra_names.append("block_info")
        info = _block_info(argpairs, out_ind, first, drop_axis)
        extra_pairs.append((ArrayValuesDep(first.chunks, info), out_ind))
    if layout.note:  # logged, not warned: Dask's own callers expect map_blocks to stay silent
        logger.warning("dsched.map_blocks(%s): %s", funcname_of(fn), layout.note)
    return engine.blockwise()(
        _pass_extra_kwargs, out_ind, call, None, tuple(extra_names), None,
        *(x for pair in extra_pairs for x in pair), *(x for pair in argpairs for x in pair),
        **engine.naming(funcname_of(fn), name, token), dtype=_dtype_of(first), concatenate=True, align_arrays=False,
        adjust_chunks=dict(zip(out_ind, first.chunks)), meta=_meta_of(first, len(out_ind)), **kwargs,
    )


def _dtype_of(first):
    """``first``'s dtype as a NumPy dtype (the expression engine keeps ``dtype=int`` as the Python type)."""
    return None if first.dtype is None else np.dtype(first.dtype)


def _meta_of(first, ndim):
    """``first``'s meta; an empty NumPy array of its dtype where the engine inferred none.

    The expression engine keeps no meta when it cannot call the function on
    empty blocks (one that reads ``block_info``, say), and a ``persist()`` of
    such an array then fails on its ``dtype``; the classic engine makes one of
    the dtype, as here.
    """
    meta = first._meta
    return np.empty((0,) * ndim, dtype=_dtype_of(first)) if meta is None else meta


def _argpairs(args) -> list:
    """Each argument with its index labels, as ``dask.array.map_blocks`` pairs them."""
    from dask.blockwise import BlockwiseDep

    pairs = []
    for a in args:
        if is_dask_array(a):
            pairs.append((a, tuple(range(a.ndim))[::-1]))
        elif isinstance(a, BlockwiseDep):  # per-block values (``da.store`` passes slices so)
            pairs.append((a, tuple(range(args[0].ndim))[::-1]))
        else:
            pairs.append((a, None))
    return pairs


def _block_info(argpairs, out_ind, out, drop_axis) -> dict:
    """``block_info`` of every output block, exactly as ``dask.array.map_blocks`` builds it.

    Adapted from dask/array/core.py (dask 2026.8.0, BSD-3-Clause, Copyright (c) Anaconda, Inc. and
    contributors): it is inlined there, and the layer is rebuilt here.
    """
    from dask.utils import cached_cumsum

    starts, num_chunks, shapes = {}, {}, {}
    for i, (arg, in_ind) in enumerate(argpairs):
        if in_ind is None:
            continue
        shapes[i] = arg.shape
        if drop_axis:  # dropped axes are concatenated: one chunk each
            starts[i] = [cached_cumsum(arg.chunks[j], initial_zero=True) if ind in out_ind else [0, arg.shape[j]]
                         for j, ind in enumerate(in_ind)]
            num_chunks[i] = tuple(len(s) - 1 for s in starts[i])
        else:
            starts[i] = [cached_cumsum(c, initial_zero=True) for c in arg.chunks]
            num_chunks[i] = arg.numblocks
    out_starts = [cached_cumsum(c, initial_zero=True) for c in out.chunks]
    result = {}
    for block_id in product(*(range(len(c)) for c in out.chunks)):
        location = {out_ind[i]: loc for i, loc in enumerate(block_id)}
        info = {}
        for i, shape in shapes.items():
            # A dimension with a single chunk is taken as broadcast, as Dask does.
            arr_k = tuple(location.get(ind, 0) if num_chunks[i][j] > 1 else 0 for j, ind in enumerate(argpairs[i][1]))
            info[i] = {"shape": shape, "num-chunks": num_chunks[i],
                       "array-location": [(starts[i][ij][j], starts[i][ij][j + 1]) for ij, j in enumerate(arr_k)],
                       "chunk-location": arr_k}
        info[None] = {"shape": out.shape, "num-chunks": out.numblocks,
                      "array-location": [(out_starts[ij][j], out_starts[ij][j + 1]) for ij, j in enumerate(block_id)],
                      "chunk-location": block_id,
                      "chunk-shape": tuple(out.chunks[ij][j] for ij, j in enumerate(block_id)),
                      "dtype": out.dtype}
        result[block_id] = info
    return result


class TorchBlocks:
    """``fn`` called with torch tensors on the running block's device for its NumPy arguments; its tensor
    results back as NumPy (host copies of GPU tensors, zero-copy views of CPU ones)."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = funcname_of(fn)  # Dask names the output's keys after it

    def __call__(self, *args, **kwargs):
        def to_torch(x):
            if isinstance(x, np.ndarray):
                return backends.TorchBackend().from_host(np.ascontiguousarray(x), None).to(backends.torch_device())
            return x

        result = self.fn(*[to_torch(a) for a in args], **{k: to_torch(v) for k, v in kwargs.items()})
        return backends.map_arrays(lambda b, a: b.host_view(b.to_host(a)) if b.name == "torch" else a, result)

    def __dask_tokenize__(self):
        from dask.base import tokenize

        return ("dsched-torch-blocks", tokenize(self.fn))

    def __reduce__(self):
        return (TorchBlocks, (self.fn,))


class _BlockCall:
    """``fn`` as one block calls it: on the block's device, its output shape checked."""

    def __init__(self, fn, positions, to_device, to_host):
        self.fn, self.positions = fn, tuple(positions)
        self.to_device, self.to_host = bool(to_device), bool(to_host)

    def __call__(self, *args, _dsched_block, **kwargs):
        return run_block(_dsched_block, self.fn, args, kwargs, self.positions,
                         to_device=self.to_device, to_host=self.to_host)

    def __dask_tokenize__(self):
        from dask.base import tokenize

        return ("dsched-block-call", tokenize(self.fn), self.positions, self.to_device, self.to_host)

    def __reduce__(self):
        return (_BlockCall, (self.fn, self.positions, self.to_device, self.to_host))
