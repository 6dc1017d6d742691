"""A resident batch's arguments checked on the client: fields, names and an update's own inputs.

Every check raises a one-line ``ValueError`` naming the argument (and the
entry) at fault, before anything is placed or submitted.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from dsched.dispatch.arguments import _signature

# fn (a method's function) -> (bound, keywords) it was found to take (a solver's like updates skip the check), held weakly: not a user's model
_calls_bound = weakref.WeakKeyDictionary()
_calls_lock = threading.Lock()


def _names(value, field) -> tuple:
    if isinstance(value, str):
        value = [value]
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"{field}: expected field names, got {name!r}")
    return names


def _check_fields(fields, n=None, empty_ok=False) -> dict:
    """The fields as NumPy arrays of one length along axis 0; a ValueError naming the field otherwise.

    ``empty_ok``: no fields at all is allowed (the caller knows ``n``).
    """
    if not isinstance(fields, dict) or not (fields or empty_ok):
        raise ValueError(f"fields: expected a non-empty dict of name -> array (or n=, the number of items, for a "
                         f"batch whose updates make its fields), got {type(fields).__name__}")
    arrays = {}
    for name, value in fields.items():
        if not isinstance(name, str):
            raise ValueError(f"fields: names must be strings, got {name!r}")
        array = np.asarray(value)
        if array.ndim == 0:
            raise ValueError(f"fields[{name!r}]: a scalar has no items (axis 0)")
        if array.dtype.hasobject:
            raise ValueError(f"fields[{name!r}]: dtype {array.dtype} cannot live on a device")
        if n is None:
            n = len(array)
        if len(array) != n:
            raise ValueError(f"fields[{name!r}]: {len(array)} items along axis 0; the batch has {n}")
        if n == 0:
            raise ValueError(f"fields[{name!r}]: no items")
        arrays[name] = array
    return arrays


def _check_inputs(inputs, axis, n, reads) -> dict:
    """An update's ``inputs`` as NumPy arrays of ``n`` items along ``axis``; a ValueError naming the entry otherwise."""
    if inputs is None:
        return {}
    if not isinstance(inputs, dict):
        raise ValueError(f"inputs: expected a dict of name -> array, got {type(inputs).__name__}")
    if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
        raise ValueError(f"axis: expected an integer >= 0, got {axis!r}")
    arrays = {}
    for name, value in inputs.items():
        if not isinstance(name, str) or name in reads:
            raise ValueError(f"inputs: {name!r} is not a name of its own (a string that names no field read)")
        array = np.asarray(value)
        if array.ndim <= axis or array.shape[axis] != n:
            raise ValueError(f"inputs[{name!r}]: shape {array.shape} has no {n} items along axis {axis} "
                             f"(the batch's size)")
        if array.dtype.hasobject:
            raise ValueError(f"inputs[{name!r}]: dtype {array.dtype} cannot be shared with the workers")
        arrays[name] = array
    return arrays


def _check_layouts(layouts, written) -> dict:
    """An update's ``layouts`` as ``{field: (item shape, dtype string)}`` of fields it writes; a ValueError naming
    the entry otherwise."""
    if layouts is None:
        return {}
    if not isinstance(layouts, dict):
        raise ValueError(f"layouts: expected a dict of field -> (item shape, dtype), got {type(layouts).__name__}")
    checked = {}
    for name, layout in layouts.items():
        if name not in written:
            raise ValueError(f"layouts: {name!r} is not a field this update writes (it writes {list(written)})")
        try:
            shape, dtype = layout
            shape = tuple(shape)
            if not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in shape):
                raise TypeError
            dtype = np.dtype(dtype)
        except (TypeError, ValueError):
            raise ValueError(f"layouts[{name!r}]: expected (item shape, dtype) such as ((6,), 'f8'), "
                             f"got {layout!r}") from None
        if dtype.hasobject:
            raise ValueError(f"layouts[{name!r}]: dtype {dtype} cannot live on a device")
        checked[name] = (tuple(int(n) for n in shape), dtype.str)
    return checked


def _check_call(fn, keywords, label):
    """That ``fn`` takes ``keywords`` (an update's reads, inputs, ``out=`` arrays and kwargs, by name, as each
    chunk calls it); a ValueError naming what it misses or refuses otherwise, before any chunk fails with it. A
    function whose signature cannot be read passes."""
    # A bound method is made anew at every attribute access: kept by its function (every instance binds alike).
    owner, seen = getattr(fn, "__func__", fn), (hasattr(fn, "__func__"), keywords)
    try:
        with _calls_lock:
            if seen in _calls_bound.get(owner, ()):
                return
        kept = True
    except TypeError:  # a callable that cannot be referenced weakly (or hashed): checked at every update
        kept = False
    signature = _signature(fn)
    if signature is None:
        return
    try:
        signature.bind(**dict.fromkeys(keywords))
    except TypeError as err:
        raise ValueError(f"fn: {label}() {err} (each chunk calls it with the keywords {', '.join(keywords) or 'none'}"
                         ": the fields it reads, its inputs, out= arrays and kwargs)") from None
    if kept:
        with _calls_lock:
            _calls_bound.setdefault(owner, set()).add(seen)
