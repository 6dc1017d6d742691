"""Joined outputs written in place: the layout of a chunk's result, and where its rows go.

When a run's join is the concatenation, the output arrays are allocated once
(shapes and dtypes declared, or taken from the first chunk's result) and each
chunk writes its own rows where it runs. Rows of different chunks are
disjoint, so writers need no lock and nothing is gathered or concatenated at
the end (the *write* dependency of a dependency engine, with one writer per
row range).

An output that cannot live in shared memory (Python objects, strings whose
width varies from chunk to chunk) travels back by value, that output alone:
its chunks' pieces are joined on the client at the end
(:data:`BY_VALUE` is its target), while the run's other outputs are still
written in place.

Every result is checked against its chunk before it is written: the same
structure as the first, the chunk's length along the batch axis, and the
same item shape and dtype. A mismatch is a :class:`ChunkResultError` naming
the chunk, its device and what was expected, never a silently wrong join.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from dsched.dataplane.pinned import copy_to_host, same_memory
from dsched.dataplane.store import ArrayRef
from dsched.devices import backends
from dsched.devices.templates import pack_template, unpack_template
from dsched.errors import DispatchError

__all__ = ["OutputLayout", "ChunkResultError", "OutputSlot", "ZarrTarget", "check_out_path", "BY_VALUE", "Leftover",
           "travels_by_value"]

#: dtype kinds that travel by value: Python objects, and strings (their width may differ per chunk)
BY_VALUE_KINDS = "OUS"


class ChunkResultError(DispatchError):
    """A chunk's result does not fit its chunk (wrong length, structure, shape or dtype)."""


def _flatten(result, path=()):
    """``[(path, leaf)]`` of a result made of arrays in (nested) tuples, lists and dicts."""
    if isinstance(result, dict):
        return [leaf for key in result for leaf in _flatten(result[key], path + (key,))]
    if isinstance(result, (tuple, list)):
        return [leaf for i, item in enumerate(result) for leaf in _flatten(item, path + (i,))]
    return [(path, result)]


def _path_name(path) -> str:
    return "result" + "".join(f"[{key!r}]" for key in path)


@dataclass(frozen=True)
class _Leaf:
    path: tuple
    item_shape: tuple  # the shape without the batch axis
    dtype: str
    template: object = None  # a torch or NEML2 result: an empty one of its type, to rebuild the joined output
    axis: int = 0  # this output's batch axis (a layout's negative axis, resolved by the output's own rank)

    def __reduce__(self):  # positional: every chunk's task carries the layout
        return _leaf, (self.path, self.item_shape, self.dtype, pack_template(self.template), self.axis)

    def shape(self, items: int) -> tuple:
        """The shape of ``items`` items of this output."""
        return self.item_shape[:self.axis] + (items,) + self.item_shape[self.axis:]

    @property
    def by_value(self) -> bool:
        """Whether this output travels back by value (it cannot live in shared memory)."""
        return travels_by_value(self.dtype)


def _leaf(path, item_shape, dtype, template, axis):
    return _Leaf(path, item_shape, dtype, unpack_template(template), axis)


def travels_by_value(dtype) -> bool:
    """Whether arrays of ``dtype`` travel back by value: Python objects and strings.

    Examples
    --------
    >>> travels_by_value(object), travels_by_value("<U3"), travels_by_value("float64")
    (True, True, False)
    """
    return np.dtype(dtype).kind in BY_VALUE_KINDS


def _host_leaf(leaf, axis):
    """``(leaf as an array NumPy can describe, template or None)``: torch and NEML2 results as zero-copy NumPy
    views of their host copy, with an empty one of their type to rebuild the output from."""
    backend = backends.backend_of(leaf, strict=False)
    if backend is None or backend.name in ("numpy", "cupy"):
        return leaf, None
    host = backends.to_host(leaf)
    return backends.host_view(host), backends.template(host, axis)


@dataclass(frozen=True)
class OutputLayout:
    """The structure of a chunk's result: its containers, and per array the item shape, dtype and batch axis.

    ``axis`` is the batch axis of every output; a negative one counts from the
    end of each output's own shape (``-1``: each joined along its last axis).

    Examples
    --------
    >>> import numpy as np
    >>> layout = OutputLayout.of({"y": np.zeros((4, 3))}, 4)
    >>> layout.shapes(10)
    {('y',): (10, 3)}
    >>> OutputLayout.of({"P": np.zeros((3, 3, 4)), "s": np.zeros((7, 4))}, 4, axis=-1).shapes(10)
    {('P',): (3, 3, 10), ('s',): (7, 10)}
    """

    skeleton: object  # the result with every array replaced by None
    leaves: tuple
    axis: int = 0
    origin: str = "as the first chunk returned"  # where it came from, for error messages

    def __reduce__(self):
        return OutputLayout, (self.skeleton, self.leaves, self.axis, self.origin)

    @classmethod
    def of(cls, result, size: int, axis: int = 0, *, where: str = "chunk 0",
           origin: str = "as the first chunk returned") -> "OutputLayout":
        """The layout of ``result``, a chunk of ``size`` items; raises if it does not fit its chunk."""
        leaves = []
        for path, leaf in _flatten(result):
            own = _own_axis(path, leaf, size, axis, where)
            leaf, template = _host_leaf(leaf, own)
            _check_leaf(path, leaf, size, own, where)
            shape = tuple(leaf.shape)
            leaves.append(_Leaf(path, shape[:own] + shape[own + 1:], np.dtype(leaf.dtype).str, template, own))
        return cls(_skeleton(result), tuple(leaves), axis, origin)

    @classmethod
    def declared(cls, spec: dict, axis: int = 0) -> "OutputLayout":
        """A layout from ``{name: (item_shape, dtype)}``: a result that is a dict of arrays."""
        leaves = tuple(_Leaf((name,), tuple(shape), np.dtype(dtype).str, None, axis % (len(shape) + 1))
                       for name, (shape, dtype) in spec.items())
        return cls({name: None for name in spec}, leaves, axis, "as output_spec declares")

    def shapes(self, total: int) -> dict:
        """``{path: shape}`` of the joined outputs for a batch of ``total`` items."""
        return {leaf.path: leaf.shape(total) for leaf in self.leaves}

    def check(self, result, size: int, where: str) -> list:
        """The arrays of ``result`` in leaf order; raises :class:`ChunkResultError` if it does not fit."""
        flat = _flatten(result)
        paths = [path for path, _ in flat]
        expected = [leaf.path for leaf in self.leaves]
        if paths != expected:
            raise ChunkResultError(
                f"{where} returned {_describe(result)}; expected {', '.join(map(_path_name, expected))} "
                f"({self.origin})"
            )
        arrays = []
        for leaf, (path, array) in zip(self.leaves, flat):
            array, _ = _host_leaf(array, leaf.axis)
            arrays.append(array)
            _check_leaf(path, array, size, leaf.axis, where)
            shape = tuple(array.shape)
            item = shape[:leaf.axis] + shape[leaf.axis + 1:]
            if item != leaf.item_shape or not _same_dtype(array.dtype, leaf):
                raise ChunkResultError(
                    f"{where} returned {_path_name(path)} with items of shape {item} and dtype "
                    f"{np.dtype(array.dtype)}; expected {leaf.item_shape} and {np.dtype(leaf.dtype)} {self.origin}"
                )
        return arrays

    def build(self, arrays):
        """The result's structure with ``arrays`` (in leaf order) in place of its arrays, each rebuilt as the
        type the chunks returned (a torch tensor sharing the array's memory, say)."""
        rebuilt = [array if leaf.template is None or not isinstance(array, np.ndarray)
                   else backends.from_host(array, leaf.template) for leaf, array in zip(self.leaves, arrays)]
        return _fill(self.skeleton, iter(rebuilt))


def _same_dtype(dtype, leaf) -> bool:
    """A chunk's dtype matches its output's: exactly, or of the same kind for strings (of any width)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "US" and leaf.by_value:
        return dtype.kind == np.dtype(leaf.dtype).kind
    return dtype.str == leaf.dtype


def _own_axis(path, leaf, size, axis, where) -> int:
    """``axis`` for this output: a negative one counted from the end of its own shape."""
    if axis >= 0 or not hasattr(leaf, "shape"):
        return axis
    ndim = len(backends.batch_shape(leaf)) if backends.backend_of(leaf, strict=False) else len(leaf.shape)
    if ndim < -axis:
        raise ChunkResultError(f"{where} returned {_path_name(path)} of shape {tuple(leaf.shape)}; expected "
                               f"{size} items along axis {axis} (the chunk's size)")
    return axis % ndim


def _check_leaf(path, leaf, size, axis, where):
    if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
        raise ChunkResultError(
            f"{where} returned {_path_name(path)} = {_describe(leaf)}; expected an array of {size} items along axis {axis}"
        )
    shape = tuple(leaf.shape)
    if len(shape) <= axis or shape[axis] != size:
        raise ChunkResultError(
            f"{where} returned {_path_name(path)} of shape {shape}; expected {size} items along axis {axis} "
            "(the chunk's size)"
        )


def _describe(value) -> str:
    if hasattr(value, "shape"):
        return f"an array of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _skeleton(result):
    if isinstance(result, dict):
        return {key: _skeleton(value) for key, value in result.items()}
    if isinstance(result, (tuple, list)):
        return type(result)(_skeleton(value) for value in result)
    return None


def _fill(skeleton, arrays):
    if isinstance(skeleton, dict):
        return {key: _fill(value, arrays) for key, value in skeleton.items()}
    if isinstance(skeleton, (tuple, list)):
        return type(skeleton)(_fill(value, arrays) for value in skeleton)
    return next(arrays)


# --- where rows are written ---------------------------------------------------

@dataclass(frozen=True)
class ZarrTarget:
    """One array of a Zarr store on a file system every worker can reach."""

    store: str
    name: str

    def open(self):
        import zarr

        return zarr.open_array(store=self.store, path=self.name, mode="r+")


def _index(axis, start, stop):
    return (slice(None),) * axis + (slice(start, stop),)


class _ByValue:
    """The target of an output that travels back by value: the chunk returns those rows (a :class:`Leftover`)."""

    def __reduce__(self):
        return _by_value, ()

    def __repr__(self):
        return "BY_VALUE"


BY_VALUE = _ByValue()


def _by_value():
    return BY_VALUE


@dataclass(frozen=True)
class Leftover:
    """What a chunk returns when it wrote its result in place except for outputs that travel by value.

    ``arrays`` maps the index of each such output (in leaf order) to the chunk's rows of it.
    """

    arrays: dict


def write_rows(target, axis: int, start: int, stop: int, values, pinned=False):
    """Write ``values`` into items ``start:stop`` along ``axis`` of ``target`` (an ArrayRef, a ZarrTarget or an array).

    ``pinned``: through this process's page-locked mapping of the segment, so that
    a CuPy result is copied from the GPU by DMA (on the chunk's stream).
    """
    if isinstance(target, ArrayRef):
        if axis == 0:
            copy_to_host(values, target.rows(start, stop, writable=True, pinned=pinned and target.shared))
        else:
            target.whole(writable=True)[_index(axis, start, stop)] = _host(values)
    elif isinstance(target, ZarrTarget):
        target.open()[_index(axis, start, stop)] = _host(values)
    else:
        target[_index(axis, start, stop)] = _host(values)


def _host(values):
    return values.get() if hasattr(values, "__cuda_array_interface__") and hasattr(values, "get") else values


@dataclass(frozen=True)
class OutputSlot:
    """Where one chunk's result goes: its layout, one target per array, and its items ``start:stop``.

    Shipped with the chunk's task; the worker checks the result and writes it in place.
    """

    layout: OutputLayout
    targets: tuple
    start: int
    stop: int
    index: int

    def __reduce__(self):
        return OutputSlot, (self.layout, self.targets, self.start, self.stop, self.index)

    def views(self, rows=None):
        """The chunk's output rows as writable NumPy views, in the result's structure, for a model's ``out=``;
        ``None`` where they cannot be views (a Zarr store, another axis, torch or NEML2 results).

        ``rows``: what :meth:`rows` returned, if the caller has it already.
        """
        rows = self.rows() if rows is None else rows
        if not rows or any(r is None for r in rows):
            return None
        return self.layout.build(rows)

    def rows(self) -> list:
        """Per output (leaf order), the chunk's rows as a writable NumPy view where the output lies in memory
        along axis 0 and holds NumPy results, else ``None``; ``[]`` when none does."""
        rows = [t.rows(self.start, self.stop, writable=True)
                if isinstance(t, ArrayRef) and leaf.template is None and leaf.axis == 0 else None
                for leaf, t in zip(self.layout.leaves, self.targets)]
        return rows if any(r is not None for r in rows) else []

    def write(self, result, device, pinned=False, rows=None):
        """Check ``result`` and write it in place; a :class:`Leftover` of the outputs that travel by value, or ``None``.

        ``rows``: what :meth:`rows` returned, if the caller has it already.
        """
        if rows and not pinned and len(rows) == 1 and self.layout.skeleton is None and type(result) is np.ndarray:
            row = rows[0]  # one NumPy output of exactly its rows' shape and dtype (a solver's common case)
            if row is not None and result.shape == row.shape and result.dtype == row.dtype:
                copy_to_host(result, row)  # nothing to copy where the model computed into its rows
                return None
        if rows and not pinned and _in_its_rows(result, rows, self.layout):
            return None  # the model computed into its out= rows and returned them: nothing to check or copy
        arrays = self.layout.check(result, self.stop - self.start, f"chunk {self.index} on {device}")
        if rows is None:
            rows = [] if pinned else self.rows()
        arrays = _apart(arrays, rows)
        leftover = {}
        for i, (leaf, target, array) in enumerate(zip(self.layout.leaves, self.targets, arrays)):
            if target is BY_VALUE:
                leftover[i] = _host(array)
            elif i < len(rows) and rows[i] is not None:
                copy_to_host(array, rows[i])  # nothing to copy where the result already lies there
            else:
                write_rows(target, leaf.axis, self.start, self.stop, array, pinned)
        return Leftover(leftover) if leftover else None


def _in_its_rows(result, rows, layout) -> bool:
    """Whether ``result`` is a dict holding, under each output's name, the very view of that output's rows (what
    :meth:`OutputSlot.views` gave the model as ``out=``), and nothing else."""
    if type(result) is not dict or type(layout.skeleton) is not dict or len(result) != len(rows):
        return False
    for leaf, row in zip(layout.leaves, rows):
        if row is None or len(leaf.path) != 1 or result.get(leaf.path[0]) is not row:
            return False
    return len(rows) == len(layout.leaves)


def _apart(arrays, rows):
    """``arrays`` with those that overlap another output's rows (or their own, but not exactly) copied first:
    writing one output must not change another's values before they are written (a result that is a view
    of a placed allocation, a model's ``out=`` rows returned under another name)."""
    placed = [r for r in rows if r is not None]
    if not placed:
        return arrays
    apart = []
    for array, own in zip(arrays, rows + [None] * (len(arrays) - len(rows))):
        if isinstance(array, np.ndarray) and not (own is not None and same_memory(array, own)):
            if any(np.may_share_memory(array, r) for r in placed):  # the bytes they span overlap
                array = array.copy()
        apart.append(array)
    return apart


def check_out_path(path, overwrite: bool, field: str = "out") -> str:
    """A Zarr store path to create: its folder must exist, and the store must not, unless ``overwrite``."""
    path = os.fspath(path)
    try:
        import zarr  # noqa: F401
    except ImportError:
        raise ValueError(f"{field}: writing the outputs to a Zarr store needs zarr (pip install 'dsched[zarr]')") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{field}: the folder {folder} of {path} does not exist")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"{field}: {path} already exists (pass overwrite=True, or --overwrite, to replace it)")
    return path
