"""One chunk of a NEML2 model: its inputs as NEML2 takes them, evaluated block by block, the results joined.

On a CPU, a chunk is evaluated in blocks of rows (:mod:`dsched.models.row_blocks`):
equal blocks for an eager model, fixed pieces padded to a size already
compiled for a compiled one. Per-item results are joined along the batch;
``param_vjp`` is summed over the blocks in block order. A compiled model's
values computed in one piece go straight into the chunk's output rows where
dispatch hands them over (:func:`rows_to_compute_into`), and a chunk's values
evaluated in blocks are written there block by block, each while it is still in
the caches: nothing is joined, and nothing copied again.
"""

from __future__ import annotations

import functools

import numpy as np

from dsched.devices import backends
from dsched.models.neml2_surface import ordered_sum
from dsched.models.row_blocks import joined, padded, pieces, rows_of, spans, unpadded

__all__ = ["evaluate", "as_neml2_value", "kind_of", "numpy_storage", "rows_to_compute_into"]


def kind_of(values) -> str:
    """``"neml2"``, ``"torch"`` or ``"numpy"``: the kind of arrays among ``values``, which the results come back as."""
    values = list(values)
    if all(type(v) in _NUMPY_KIND for v in values):  # a solver's call: NumPy arrays and numbers, told at a glance
        return "numpy"
    kinds = {backends.backend_of(v).name for v in values if backends.backend_of(v) is not None}
    if "neml2" in kinds:
        return "neml2"
    return "torch" if "torch" in kinds else "numpy"


_NUMPY_KIND = (np.ndarray, float, int, np.float64)
ROW_VIEWS_KEPT = 64  # torch views of output rows an engine keeps (id -> (array, view)), for a replay's next call


def numpy_storage(shape, dtype):
    """A torch tensor in memory NumPy allocated (so that dsched can place it in a chunk's output rows)."""
    import torch

    if dtype != torch.float64:
        return torch.empty(shape, dtype=dtype)
    return backends.TORCH.from_host(np.empty(shape), None)


def as_neml2_value(value, variable_type, device, torch):
    """An input as NEML2 takes it on ``device``: typed tensors kept, arrays as float64 tensors, a number in every component."""
    # A NumPy array (a solver's usual input) is told by its type, not by asking every backend in turn.
    backend = backends.NUMPY if type(value) is np.ndarray else backends.backend_of(value)
    if backend is None:
        base = tuple(getattr(variable_type, "BASE_SHAPE", ()))
        return variable_type(torch.full(base, float(value), dtype=torch.float64, device=device))
    if backend is backends.NEML2:
        return value if value.device == device else value.to(device)
    if backend.name == "numpy":  # any strides torch takes: a row slice of a history is not copied
        value = np.asarray(value)
        value = backends.TORCH.from_host(value if min(value.strides, default=0) >= 0 else value.copy(), None)
    elif backend.name == "cupy":
        value = torch.as_tensor(value, device=device)  # through __cuda_array_interface__, no host copy
    return variable_type(value if value.device == device else value.to(device))


def rows_to_compute_into(out, base_shapes, batch):
    """``out`` (a chunk's output rows by name, or ``None``) if a compiled model can compute its values there:
    every output of the model (``base_shapes``) in it, each a writable, C-contiguous float64 ``(rows, *base)``
    array for the chunk's one batch axis ``batch`` (the layout the graph is compiled for); else ``None``."""
    if not isinstance(out, dict) or set(out) != set(base_shapes) or len(batch) != 1:
        return None
    for name, array in out.items():
        if (type(array) is not np.ndarray or array.dtype != np.float64 or not array.flags.writeable
                or not array.flags.c_contiguous or array.shape != (batch[0], *base_shapes[name])):
            return None
    return out


def _bounds(engine, rows, device, block):
    if engine.compiled:  # fixed pieces on a CPU, the whole chunk elsewhere: padded to few sizes
        return pieces(rows, block if device.type == "cpu" else None)
    return spans(rows, block) if device.type == "cpu" else [(0, rows)]


def evaluate(engine, operation, state, extra, params, *, batch, device, block, sizes, outputs, allocate=None,
             keep_grad=False, into=None):
    """``(values, second)`` of ``operation`` over the chunk's points, as the engine returns them for one call.

    ``state`` and ``extra`` (tangents or cotangents) are NEML2 values on
    ``device``; ``batch`` is their broadcast batch shape. ``sizes`` is the
    :class:`~dsched.models.row_blocks.PaddedSizes` of a compiled engine.
    ``outputs``: the outputs joined across blocks; ``allocate(shape, dtype)``
    makes the joined storage. ``into``: NumPy arrays, one per output of the
    model (the chunk's output rows), that values computed on a CPU go into:
    a compiled engine's computed there in one piece (nothing recorded), or
    each block's copied there as it is done; the values are then those
    arrays.
    """
    if len(batch) != 1:
        return engine.run(operation, state, extra, params)
    rows = batch[0]
    bounds = _bounds(engine, rows, device, block)
    # One block that needs no padding (a compiled model at its own size: its steady call): the chunk as it is
    if len(bounds) == 1 and (not engine.compiled or sizes.size(rows) == rows):
        if into is not None and engine.into is not None and operation == "values" and device.type == "cpu" \
                and not _recording():
            engine.into([state[name] for name in engine.input_spec], list(_row_targets(into, engine).values()))
            return into, None
        return engine.run(operation, state, extra, params)
    # Values with rows to hold them: each block's go there while they are in the caches, nothing is joined
    targets = _row_targets(into, engine) if operation == "values" and device.type == "cpu" else None
    parts = []
    for start, stop in bounds:
        n = stop - start
        size = sizes.size(n) if engine.compiled else n
        # Padded rows repeat the last point (a solve that converges like it); padded cotangents and tangents are
        # zero, so the padding adds nothing to a parameter gradient.
        part_state = {k: padded(rows_of(v, start, stop, rows), n, size) for k, v in state.items()}
        part_extra = {k: padded(rows_of(v, start, stop, rows), n, size, zeros=True) for k, v in extra.items()}
        values, second = engine.run(operation, part_state, part_extra, params)
        values, second = _unpadded(operation, values, second, n, size)
        if targets is None:
            parts.append((values, second))
            continue
        for name, target in targets.items():
            target[start:stop].copy_(backends.NEML2.expanded(values[name], (n,)).data.detach())
    if targets is not None:
        return into, None
    if len(parts) == 1:
        return parts[0]
    if operation == "param_vjp":
        return None, ordered_sum(second for _, second in parts)
    join = functools.partial(joined, bounds=bounds, allocate=allocate, keep_grad=keep_grad)
    values = {name: join([part_values[name] for part_values, _ in parts]) for name in outputs}
    if operation == "values":
        return values, None
    if operation == "jvp":
        return values, {name: join([second[name] for _, second in parts]) for name in outputs}
    return values, {out: {x: join([second[out][x] for _, second in parts]) for x in parts[0][1][out]}
                    for out in outputs}


def _recording() -> bool:
    import torch

    return torch.is_grad_enabled()


def _row_targets(into, engine):
    """Torch views of the output rows ``into`` (by output name), or ``None`` without them. A replay hands the
    engine the same row arrays call after call: their views are made once (kept with their arrays, a few)."""
    if into is None:
        return None
    kept, targets = engine.row_views, {}
    for name in engine.output_spec:
        array = into[name]
        view = kept.get(id(array))
        if view is None or view[0] is not array:  # (an id is another array's once the first is gone)
            if len(kept) >= ROW_VIEWS_KEPT:
                kept.clear()
            view = kept[id(array)] = (array, backends.TORCH.from_host(array, None))
        targets[name] = view[1]
    return targets


def _unpadded(operation, values, second, rows, size):
    """A padded block's results cut back to its ``rows`` points."""
    if size == rows or operation == "param_vjp":  # the padding's cotangents are zero: nothing to cut from a sum
        return values, second
    values = {name: unpadded(value, rows, size) for name, value in values.items()}
    if operation == "values":
        return values, None
    if operation == "jvp":
        return values, {name: unpadded(value, rows, size) for name, value in second.items()}
    return values, {out: {x: unpadded(block, rows, size) for x, block in row.items()} for out, row in second.items()}
