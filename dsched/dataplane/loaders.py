"""Work generators: cut a batch into chunks of the size the scheduler asks for.

Each generator has ``total``, ``offset``, ``has_more()`` and ``next(n)``,
which returns ``(m, work)`` with ``m <= n`` (the last chunk is short).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from dsched.dataplane.sources import as_streamed
from dsched.devices.backends import UnsupportedArrayError, backend_of, batch_shape, take

__all__ = ["uncovered", "WorkGenerator", "SliceGenerator", "ArrayLoader", "MappingLoader", "items_signature", "memoized"]


class WorkGenerator(ABC):
    """A batch of ``total`` items handed out front to back."""

    def __init__(self, total: int):
        self.total = int(total)
        self.offset = 0

    def has_more(self) -> bool:
        return self.offset < self.total

    def next(self, n: int):
        """The next ``(m, work)`` of at most ``n`` items."""
        m = self._check_next(n)
        work = self._take(self.offset, self.offset + m)
        self.offset += m
        return m, work

    def _check_next(self, n: int):
        """The size of the next chunk of at most ``n`` items; raises for a bad ``n`` or an empty batch."""
        _check_chunk_items(n)
        if not self.has_more():
            raise RuntimeError(f"{type(self).__name__} is exhausted ({self.total} items handed out)")
        return min(int(n), self.total - self.offset)

    @abstractmethod
    def _take(self, start: int, stop: int):
        """The work for items ``start:stop`` of the batch."""

    def __repr__(self):
        return f"{type(self).__name__}(total={self.total}, offset={self.offset})"


def _check_chunk_items(n):
    """A chunk size asked of a generator: a whole number >= 1 (``2.0`` too), else a ValueError."""
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"n: a chunk needs at least one item, got {n!r}")


class SliceGenerator(WorkGenerator):
    """Hands out ``slice`` objects over ``range(start, stop)``.

    Examples
    --------
    >>> g = SliceGenerator(0, 10)
    >>> [g.next(4) for _ in range(3)]
    [(4, slice(0, 4, None)), (4, slice(4, 8, None)), (2, slice(8, 10, None))]
    """

    def __init__(self, start: int, stop: int):
        for name, value in (("start", start), ("stop", stop)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"SliceGenerator: {name} must be an integer, got {value!r}")
        if not start < stop:
            raise ValueError(f"SliceGenerator: expected start < stop, got start={start}, stop={stop}")
        super().__init__(stop - start)
        self.start = int(start)

    def _take(self, start, stop):
        return slice(self.start + start, self.start + stop)


def _check_axis(axis, field="axis"):
    """An axis as given: an integer (negative ones count from the end of each entry's own shape)."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise ValueError(f"{field}: expected an integer, got {axis!r}")


def resolve_axis(axis, shape, field):
    """``axis`` of an entry of ``shape`` as a non-negative axis (a negative one counts from its own end).

    An entry with no axis ``axis`` is a ValueError naming it: passing it whole would hand every chunk the
    whole batch of it, silently (a scalar, or an entry marked ``None``, is never asked).

    Examples
    --------
    >>> resolve_axis(-1, (3, 3, 8), "F")
    2
    >>> resolve_axis(3, (6, 8), "state")
    Traceback (most recent call last):
    ...
    ValueError: state: shape (6, 8) has no axis 3 to split along; mark it None to pass it whole to every chunk
    """
    ndim = len(shape)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{field}: shape {tuple(shape)} has no axis {axis} to split along; "
                         "mark it None to pass it whole to every chunk")
    return int(axis) % ndim


def _resolve(axis, shape, key, name):
    """:func:`resolve_axis`, the entry named by ``name(key)`` only if it has no such axis."""
    if -len(shape) <= axis < len(shape):
        return int(axis) % len(shape)
    return resolve_axis(axis, shape, name(key))


def _batch_shape(value, key, name=None):
    """The splittable shape of an entry; a clear error naming it (``name(key)``, or ``key`` itself) for an
    unsliceable object with shape and dtype."""
    try:
        backend_of(value)
    except UnsupportedArrayError as err:
        if not hasattr(value, "__getitem__"):  # sliceable ones (Zarr, memory maps) are cut by indexing
            raise UnsupportedArrayError(f"{key if name is None else name(key)}: {err}") from None
    return batch_shape(value)


class ArrayLoader(WorkGenerator):
    """Hands out slices of one array along ``axis``.

    NumPy, CuPy, torch tensors and NEML2's typed tensors (split along their
    dynamic batch axes, each chunk the same type), or anything else sliceable
    with a ``shape`` (Zarr, memory maps).
    """

    def __init__(self, array, axis: int = 0):
        array = as_streamed(array)  # a Zarr or Dask array is read chunk by chunk, never whole
        shape = _batch_shape(array, "array")
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -len(shape) <= axis < len(shape):
            raise ValueError(f"axis: {axis} is out of range for an array of shape {getattr(array, 'shape', ())}")
        axis = int(axis) % len(shape)
        if shape[axis] == 0:
            raise ValueError(f"array: no items along axis {axis} (shape {tuple(array.shape)})")
        super().__init__(shape[axis])
        self.array, self.axis = array, axis

    def _take(self, start, stop):
        return take(self.array, self.axis, start, stop)


class MappingLoader(WorkGenerator):
    """Hands out dicts of slices of a mapping of arrays, each along its own batch axis.

    ``axis`` is one axis for every entry, or ``{key: axis}`` per entry (an entry
    absent from it, or marked ``None``, goes whole); a negative axis counts from
    the end of each entry's own shape. A scalar entry, and one whose size along
    its axis is 1, is passed whole into every chunk; all other sizes must agree,
    and an entry with no such axis is a ValueError. ``names(key)`` is the name
    errors give an entry (default ``mapping['key']``).

    Examples
    --------
    >>> import numpy as np
    >>> g = MappingLoader({"x": np.arange(5), "scale": np.array([2.0])})
    >>> m, work = g.next(3)
    >>> m, work["x"].tolist(), work["scale"].tolist()
    (3, [0, 1, 2], [2.0])
    >>> g = MappingLoader({"F": np.zeros((3, 3, 5)), "state": np.zeros((7, 5))}, axis=-1)
    >>> [v.shape for v in g.next(2)[1].values()]
    [(3, 3, 2), (7, 2)]
    """

    def __init__(self, mapping, axis=0, *, names=None):
        per_entry = isinstance(axis, dict)
        for key, value in (axis.items() if per_entry else [("axis", axis)]):
            if value is not None or not per_entry:
                _check_axis(value, "axis" if not per_entry else f"axis[{key!r}]")
        mapping = {key: as_streamed(value) for key, value in mapping.items()}
        name = (lambda key: f"mapping[{key!r}]") if names is None else names  # read only for an error
        requested = {key: (axis.get(key) if per_entry else axis) for key in mapping}
        shapes = {key: _batch_shape(value, key, name) for key, value in mapping.items() if requested[key] is not None}
        # Resolved per entry: None for those that go whole (scalars, entries marked None).
        self.axes = {key: None if a is None or not shapes[key] else _resolve(a, shapes[key], key, name)
                     for key, a in requested.items()}
        along = {key: shapes[key][a] for key, a in self.axes.items() if a is not None}
        sizes = {key: n for key, n in along.items() if n != 1}
        distinct = set(sizes.values())
        if len(distinct) > 1:
            total = max(distinct)
            key, size = next((k, s) for k, s in sizes.items() if s != total)
            raise ValueError(f"{name(key)}: size {size} along axis {self.axes[key]} is not compatible; "
                             f"expected 1 or {total}")
        if distinct:
            total = distinct.pop()
        elif along:
            total = 1  # every batched entry has exactly one item
        else:
            raise ValueError(f"mapping: no entry has an axis {axis} to split along")
        if total == 0:
            raise ValueError(f"mapping: no items along axis {axis}")
        super().__init__(total)
        self.mapping, self.axis = dict(mapping), axis
        self._batched = set(sizes) if sizes else set(along)
        self.batched_keys = tuple(key for key in self.mapping if key in self._batched)  # in the mapping's order
        self.memo = {}  # what depends only on the entries' keys, types, shapes and dtypes: shared with like()'s

    def _take(self, start, stop):
        return {k: (take(v, self.axes[k], start, stop) if k in self._batched else v) for k, v in self.mapping.items()}

    def like(self, mapping) -> "MappingLoader":
        """A loader over ``mapping``, whose entries have this loader's keys, types, shapes and dtypes (the caller
        has checked): its axes and size are this one's, not resolved and checked again."""
        loader = object.__new__(MappingLoader)
        WorkGenerator.__init__(loader, self.total)
        loader.mapping, loader.axis, loader.axes, loader._batched = dict(mapping), self.axis, self.axes, self._batched
        loader.batched_keys, loader.memo = self.batched_keys, self.memo
        return loader


class Ranges:
    """The items of ``source`` in ``ranges`` (``[(start, stop)]``, in order): what a run left undone.

    ``offset`` is the position in ``source`` of the next item, so chunks keep
    their place in the batch (and their rows of an in-place output).

    Examples
    --------
    >>> g = Ranges(SliceGenerator(0, 10), [(2, 4), (7, 10)])
    >>> [g.next(5) for _ in range(2)]
    [(2, slice(2, 4, None)), (3, slice(7, 10, None))]
    """

    def __init__(self, source, ranges):
        self.source, self.ranges = source, [(int(a), int(b)) for a, b in ranges if b > a]
        self.total = source.total
        self._index = 0
        self.offset = self.ranges[0][0] if self.ranges else self.total

    def has_more(self) -> bool:
        return self._index < len(self.ranges)

    def next(self, n: int):
        _check_chunk_items(n)
        if not self.has_more():
            raise RuntimeError("Ranges is exhausted")
        start, stop = self.offset, min(self.offset + int(n), self.ranges[self._index][1])
        work = self.source._take(start, stop)
        if stop == self.ranges[self._index][1]:
            self._index += 1
            self.offset = self.ranges[self._index][0] if self.has_more() else self.total
        else:
            self.offset = stop
        return stop - start, work


def uncovered(ranges, done):
    """The parts of ``ranges`` (sorted, disjoint ``(start, stop)``) not covered by ``done``.

    Examples
    --------
    >>> uncovered([(0, 10)], [(2, 4), (6, 8)])
    [(0, 2), (4, 6), (8, 10)]
    """
    left = []
    done = sorted(done)
    for start, stop in ranges:
        position = start
        for a, b in done:
            if b <= position or a >= stop:
                continue
            if a > position:
                left.append((position, a))
            position = max(position, b)
        if position < stop:
            left.append((position, stop))
    return left


def memoized(loader, name, make):
    """``make(loader)``, kept in the memo a :class:`MappingLoader` shares with the loaders :meth:`~MappingLoader.like`
    makes of it (which have its entries' keys, types, shapes and dtypes): a solver's call asks once per layout.
    Another loader, or one without all its entries (a template), is asked every time."""
    memo = getattr(loader, "memo", None)
    if memo is None or len(loader.mapping) != len(loader.axes):
        return make(loader)
    value = memo.get(name, memo)
    if value is memo:
        value = memo[name] = make(loader)
    return value


def items_signature(mapping, axes) -> tuple:
    """What the layout of a result depends on: each input's type, batch axis, its shape but for the batch's length
    (only whether it is 1, broadcast) and its dtype."""
    out = []
    for key, value in mapping.items():
        # A NumPy array's own shape and dtype (a solver's call, every iteration), without the backends' lookup.
        plain = type(value) is np.ndarray
        shape, axis = value.shape if plain else tuple(batch_shape(value)), axes.get(key)
        items = shape[axis] if axis is not None and -len(shape) <= axis < len(shape) else None
        shape = shape[:axis % len(shape)] + shape[axis % len(shape) + 1:] if items is not None else shape
        dtype = value.dtype if plain else str(getattr(value, "dtype", None))
        out.append((key, type(value), axis, shape, items == 1, dtype))
    return tuple(out)
