"""Joining chunk results back into one batch, in dispatch order.

Arrays join through :mod:`dsched.backends`: NumPy, CuPy, torch tensors
(``torch.cat``) and NEML2's typed tensors (rebuilt as their own type).
"""

from __future__ import annotations

from dsched.devices.backends import backend_of, batch_shape, concatenate

__all__ = ["concat_reduce", "derivative_reduce"]


def _concatenate(pieces, axis: int):
    first = pieces[0]
    if isinstance(first, (dict, tuple, list)):
        # A nested container (a tuple holding a dict, say) joins entry by entry too,
        # instead of being mistaken for a batch-independent value.
        return concat_reduce(pieces, axis)
    if backend_of(first) is None or len(batch_shape(first)) <= axis:
        return first  # no batch axis: a batch-independent value, the same in every chunk
    return concatenate(pieces, axis)


def concat_reduce(results, axis: int = 0):
    """Join a list of arrays, of tuples of arrays, or of dicts of arrays along ``axis``.

    An entry with no ``axis`` dimension carries no batch and is taken from the
    first result unchanged.

    Examples
    --------
    >>> import numpy as np
    >>> concat_reduce([{"y": np.zeros(2)}, {"y": np.ones(1)}])["y"].tolist()
    [0.0, 0.0, 1.0]
    """
    results = list(results)
    if not results:
        raise ValueError("results: nothing to reduce (no chunk results)")
    first = results[0]
    if isinstance(first, dict):
        _check_same_keys(results)
        return {k: _concatenate([r[k] for r in results], axis) for k in first}
    if isinstance(first, (tuple, list)):
        if any(len(r) != len(first) for r in results):
            raise ValueError(f"results: chunks returned tuples of different lengths {sorted({len(r) for r in results})}")
        return type(first)(_concatenate([r[i] for r in results], axis) for i in range(len(first)))
    return _concatenate(results, axis)


def derivative_reduce(results, axis: int = 0):
    """Join nested ``{output: {input: array}}`` maps (Jacobian blocks) along ``axis``.

    A block with no ``axis`` dimension (``ndim <= axis``) carries no batch and
    is taken from the first result unchanged.
    """
    results = list(results)
    if not results:
        raise ValueError("results: nothing to reduce (no chunk results)")
    _check_same_keys(results)
    return {out: concat_reduce([r[out] for r in results], axis) for out in results[0]}


def _check_same_keys(results):
    keys = set(results[0])
    for i, r in enumerate(results[1:], start=1):
        if set(r) != keys:
            raise ValueError(f"results[{i}]: keys {sorted(map(str, r))} differ from the first chunk's {sorted(map(str, keys))}")
