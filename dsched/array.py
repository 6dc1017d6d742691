"""The dask.array path: a batch as a Dask array chunked by a scheduler's plan.

``plan(n, scheduler)`` decides, ahead of time, the chunks a dispatcher would
send: their devices and sizes along axis 0. ``as_batched`` chunks an array
that way, and ``map_blocks`` applies a model to every chunk, each on the
device planned for it (:mod:`dsched.placement` pins the blocks), as a lazy
Dask array that composes with the rest of a graph.

The plan replays the scheduler's greedy policy in simulated time: a device
takes a chunk when it has room (``load + batch_size <= capacity``), the
highest priority first, the first listed on ties; a device works through its
chunks one after another at its estimated speed (items per second), and a
completion frees its items. So every device keeps busy until the batch is
planned and they all finish at about the same time. The speed estimate, in
order of preference:

1. ``speeds={device: items_per_s}`` passed by the caller;
2. a measured profile, when ``dsched.tuning.profile_speeds(scheduler)``
   exists and returns one for every device;
3. the priorities: a device of priority 2 is taken to be twice as fast as
   one of priority 1 (a priority <= 0 counts as the smallest positive one,
   or 1 if there is none).

For a single device (``SimpleScheduler``) the plan is uniform chunks of the
batch size with a short last chunk.
"""

from __future__ import annotations

import heapq
import math
import numbers

import numpy as np

from .devices import device_entries, placement_device
from .placement import PlannedBlock

__all__ = ["plan", "as_batched", "map_blocks", "default_speeds"]


# --- the plan ------------------------------------------------------------------

def default_speeds(scheduler) -> tuple[dict, str]:
    """The speed estimate ``plan`` uses without ``speeds``, and where it came from.

    Returns ``({Device: items_per_s}, source)`` with ``source`` ``"profile"``
    or ``"priorities"``.
    """
    status = scheduler.status()
    try:
        from . import tuning

        measured = tuning.profile_speeds(scheduler)
    except (ImportError, AttributeError):
        measured = None
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
    if isinstance(n, bool) or not isinstance(n, (numbers.Integral,)) or int(n) < 1:
        raise ValueError(f"n: expected an integer number of items >= 1, got {n!r}")
    if not hasattr(scheduler, "status"):
        raise ValueError(f"scheduler: expected a WorkScheduler, got {scheduler!r}")
    status = scheduler.status()
    speed = _check_speeds(speeds, status) if speeds is not None else default_speeds(scheduler)[0]
    return _simulate(int(n), status, speed)


def _simulate(n, status, speed) -> list:
    load = [0] * len(status)
    free_at = [0.0] * len(status)  # when each device finishes the chunks it already holds
    events = []  # (finish time, dispatch order, device position, size)
    chunks = []
    now = 0.0
    remaining = n
    while remaining:
        while remaining:
            # schedule_work's rule: highest priority with room, first listed on ties.
            best = None
            for i, s in enumerate(status):
                if load[i] + s.batch_size <= s.capacity and (best is None or s.priority > status[best].priority):
                    best = i
            if best is None:
                break
            m = min(status[best].batch_size, remaining)
            remaining -= m
            load[best] += m
            free_at[best] = max(now, free_at[best]) + m / speed[status[best].device]
            heapq.heappush(events, (free_at[best], len(chunks), best, m))
            chunks.append((placement_device(status[best].device), m))
        if remaining:
            now, _, i, m = heapq.heappop(events)
            load[i] -= m
    return chunks


# --- batched arrays --------------------------------------------------------------

def _is_dask_array(x) -> bool:
    try:
        import dask.array as da
    except ImportError:  # pragma: no cover - dask is a dependency
        return False
    return isinstance(x, da.Array)


def _is_array(x) -> bool:
    return _is_dask_array(x) or isinstance(x, np.ndarray)


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

    if _is_dask_array(x):
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


def map_blocks(fn, *args, scheduler, to_device=True, to_host=True, speeds=None, **kwargs):
    """``dask.array.map_blocks`` over a batch cut by ``scheduler``, each block on its planned device.

    Every NumPy or Dask array in ``args`` is a batch input: all must have the
    same length along axis 0, and they are chunked by :func:`plan` along
    axis 0 (other axes whole). Other positional arguments and ``kwargs`` pass
    to ``fn`` unchanged, as do ``dask.array.map_blocks``'s own arguments
    (``dtype``, ``chunks``, ``drop_axis``, ``new_axis``, ``meta``, ``name``,
    ``block_info``...). Computed on a cluster where the placement plugins are
    installed (``LocalHybridCluster``, :func:`dsched.register`, or the preload
    modules), every block runs on a worker that owns its planned device.

    Parameters
    ----------
    fn : callable
        ``fn(*blocks, **kwargs)``, one call per block.
    *args
        Batch arrays and constants.
    scheduler : WorkScheduler
        Decides the chunks: ``SimpleScheduler`` or ``StaticHybridScheduler``.
    to_device : bool
        On a real GPU, pass the blocks to ``fn`` as CuPy arrays on that GPU.
    to_host : bool
        On a real GPU, copy ``fn``'s CuPy result back to NumPy. With
        ``False`` the result stays a CuPy array (give ``meta`` accordingly).
    speeds : dict, optional
        ``{device: items_per_s}`` for the plan.
    **kwargs
        ``dask.array.map_blocks`` arguments and keyword arguments for ``fn``.
        In ``chunks``, the batch axis (axis 0 of the output) always takes the
        plan's sizes: an integer given there is replaced by them.

    Returns
    -------
    dask.array.Array

    Examples
    --------
    >>> import numpy as np
    >>> from dsched import SimpleScheduler
    >>> y = map_blocks(np.sqrt, np.arange(10.0), scheduler=SimpleScheduler("cpu", 4))
    >>> y.chunks, float(y.sum().compute(scheduler="sync"))
    (((4, 4, 2),), 19.30600052603572)
    """
    import dask.array as da
    from dask._task_spec import Task, TaskRef
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
    from dask.utils import funcname

    if not callable(fn):
        raise ValueError(f"fn: expected a callable, got {fn!r}")
    positions = [i for i, a in enumerate(args) if _is_array(a)]
    if not positions:
        raise ValueError("args: map_blocks needs at least one NumPy or Dask array to cut into blocks")
    fields = [f"args[{i}]" for i in positions]
    n = _batch_length([args[i] for i in positions], fields)
    drop_axis = kwargs.get("drop_axis")
    if drop_axis is not None and 0 in ([drop_axis] if isinstance(drop_axis, numbers.Integral) else list(drop_axis)):
        raise ValueError("drop_axis: axis 0 is the batch axis the plan cuts; it cannot be dropped")
    chunks = plan(n, scheduler, speeds=speeds)
    sizes = tuple(m for _, m in chunks)
    batched = {i: _chunk_as_planned(args[i], sizes) for i in positions}
    # dask.array.map_blocks aligns inputs of different ndim on their *last*
    # axes (NumPy broadcasting); a batch aligns them on axis 0. So inputs with
    # fewer axes get trailing axes of length 1, removed again before fn sees them.
    ndim = max(x.ndim for x in batched.values())
    padded = {i: x.ndim for i, x in batched.items() if x.ndim < ndim}
    for i in padded:
        batched[i] = batched[i][(Ellipsis,) + (None,) * (ndim - batched[i].ndim)]
    call_args = [batched.get(i, a) for i, a in enumerate(args)]
    mapped = _Unpadded(fn, padded) if padded else fn
    out_chunks = kwargs.get("chunks")
    if (
        out_chunks is not None and kwargs.get("new_axis") is None
        and isinstance(out_chunks, tuple) and out_chunks and isinstance(out_chunks[0], numbers.Integral)
    ):
        kwargs["chunks"] = (sizes,) + out_chunks[1:]

    # dask.array.map_blocks builds the blocks (meta, block_info, broadcasting of
    # the other axes); each block's task is then wrapped in a PlannedBlock.
    user_name = kwargs.pop("name", None)
    plain = da.map_blocks(mapped, *call_args, **kwargs)
    block_of = {}  # an input block's key -> its index along axis 0
    for x in batched.values():
        for key in _flat_keys(x.__dask_keys__()):
            block_of[key] = key[1]
    prefix = kwargs.get("token") or funcname(fn)
    name = user_name or f"{prefix}-dsched-{tokenize(plain.name, [(str(d), m) for d, m in chunks], to_device, to_host)}"
    layer = {}
    for key, task in dict(plain.dask.layers[plain.name]).items():
        indices = {block_of[k] for k in task.dependencies if k in block_of}
        if len(indices) != 1:
            raise ValueError(
                f"fn: block {key[1:]} of the output reads {len(indices)} batch blocks; "
                "every output block must come from exactly one block of the batch"
            )
        index = indices.pop()
        device, size = chunks[index]
        dep_keys = tuple(sorted(task.dependencies, key=str))
        new_key = (name,) + tuple(key[1:])
        block = PlannedBlock(task, dep_keys, device, size, to_device=to_device, to_host=to_host)
        layer[new_key] = Task(new_key, block, *(TaskRef(k) for k in dep_keys))
    layers = dict(plain.dask.layers)
    dependencies = dict(plain.dask.dependencies)
    del layers[plain.name]
    layers[name] = MaterializedLayer(layer)
    dependencies[name] = dependencies.pop(plain.name)
    graph = HighLevelGraph(layers, dependencies)
    return da.Array(graph, name, plain.chunks, meta=plain._meta)


class _Unpadded:
    """``fn`` called with the padded inputs (positions -> original ndim) reshaped back."""

    def __init__(self, fn, ndims):
        self.fn = fn
        self.ndims = dict(ndims)
        try:  # dask passes block_info / block_id only if the signature asks for them
            import inspect

            self.__signature__ = inspect.signature(fn)
        except (TypeError, ValueError):
            pass

    def __call__(self, *args, **kwargs):
        args = list(args)
        for i, ndim in self.ndims.items():
            args[i] = args[i].reshape(args[i].shape[:ndim])
        return self.fn(*args, **kwargs)

    def __dask_tokenize__(self):
        from dask.base import tokenize

        return ("dsched-unpadded", tokenize(self.fn), sorted(self.ndims.items()))

    def __reduce__(self):
        return (_Unpadded, (self.fn, self.ndims))


def _flat_keys(keys):
    if isinstance(keys, list):
        for k in keys:
            yield from _flat_keys(k)
    else:
        yield keys
