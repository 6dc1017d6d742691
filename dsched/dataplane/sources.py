"""Inputs that stay where they live: Zarr arrays and Dask arrays as a batch's inputs, streamed chunk by chunk.

A Zarr array (on a file system the workers reach) or a Dask array can be
passed to :func:`dsched.dispatch` like a NumPy array. The batch is never
loaded whole on the client: each chunk carries a small reference to its rows,
which are read or computed for that chunk alone.

- **Zarr.** A chunk carries :class:`ZarrRows` (the store's path, the array's
  path and the chunk's rows); the worker that runs the chunk reads them from
  the store. An array in memory (a ``MemoryStore``) cannot be opened by another
  process: its rows are read on the client as the chunk is cut, one chunk at a
  time.
- **Dask.** A chunk carries :class:`DaskRows`, the graph of its rows
  (``x[start:stop]``). On a cluster, the run computes them as a future just
  before the chunk is sent (:meth:`DaskRows.submit`), so they are computed on
  the workers and reach the chunk's worker without passing through the client;
  such runs send their chunks as tasks, which take futures as arguments. In
  sync mode the rows are computed on the calling thread.

Both wrappers speak the streamed-input protocol of
:mod:`dsched.devices.backends` (``shape``, ``dtype`` and ``__dsched_rows__``),
so loaders cut them like any array.

Examples
--------
>>> import numpy as np, zarr, tempfile, os, dsched
>>> path = os.path.join(tempfile.mkdtemp(), "x.zarr")
>>> z = zarr.open_array(path, mode="w", shape=(10,), chunks=(4,), dtype="f8")
>>> z[:] = np.arange(10.0)
>>> s = dsched.SimpleScheduler("cpu", 4)
>>> dsched.dispatch(np.sqrt, z, scheduler=s, mode="sync")[:3].tolist()
[0.0, 1.0, 1.4142135623730951]
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

__all__ = ["as_streamed", "is_streamed_source", "ZarrInput", "DaskInput", "ZarrRows", "DaskRows", "resolve_rows",
           "submit_rows", "holds_dask_rows", "streams_dask"]


def _index(axis, start, stop):
    return (slice(None),) * axis + (slice(start, stop),)


def is_streamed_source(x) -> bool:
    """Whether ``x`` is a Zarr or Dask array (checked by type name: neither library is imported here)."""
    module = type(x).__module__.partition(".")[0]
    return (module == "zarr" and type(x).__name__ == "Array") or (module == "dask" and type(x).__name__ == "Array")


def as_streamed(x):
    """``x`` wrapped as a streamed input if it is a Zarr or Dask array, else ``x`` unchanged."""
    if not is_streamed_source(x):
        return x
    if type(x).__module__.startswith("zarr"):
        return ZarrInput(x)
    return DaskInput(x)


@dataclass(frozen=True)
class ZarrRows:
    """A chunk's rows of a Zarr array in a store on disk: read where the chunk runs."""

    store: str
    path: str
    axis: int
    start: int
    stop: int

    def resolve(self) -> np.ndarray:
        import zarr

        array = zarr.open_array(store=self.store, path=self.path, mode="r")
        return np.asarray(array[_index(self.axis, self.start, self.stop)])


class ZarrInput:
    """A Zarr array as a batch input: chunks carry :class:`ZarrRows` (or, for an array in memory, its rows)."""

    def __init__(self, array):
        self.array = array
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)
        self.store = _local_path(array.store)

    def __dsched_rows__(self, axis, start, stop):
        if self.store is None:  # in this process's memory: read here, one chunk at a time
            return np.asarray(self.array[_index(axis, start, stop)])
        return ZarrRows(self.store, self.array.path, axis, start, stop)

    def __repr__(self):
        return f"ZarrInput({self.store or 'memory'}, {self.array.path!r}, shape={self.shape})"


def _local_path(store):
    """The folder of a store on the local file system, or ``None`` (memory, remote object stores)."""
    root = getattr(store, "root", None)
    if root is None or type(store).__name__ != "LocalStore":
        return None
    return os.fspath(root)


@dataclass(frozen=True)
class DaskRows:
    """A chunk's rows of a Dask array: a graph, computed for that chunk alone."""

    rows: object  # a dask array

    def resolve(self) -> np.ndarray:
        return np.asarray(self.rows.compute())

    def submit(self, client):
        """The rows as a future of ``client``'s cluster (computed on its workers)."""
        return client.compute(self.rows)


class DaskInput:
    """A Dask array as a batch input: chunks carry :class:`DaskRows`."""

    def __init__(self, array):
        self.array = array
        self.shape, self.dtype = tuple(array.shape), np.dtype(array.dtype)

    def __dsched_rows__(self, axis, start, stop):
        return DaskRows(self.array[_index(axis, start, stop)])

    def __repr__(self):
        return f"DaskInput(shape={self.shape}, chunks={self.array.chunks})"


def resolve_rows(work):
    """``work`` (an array, or a dict of them) with every :class:`ZarrRows` read and :class:`DaskRows` computed."""
    if isinstance(work, (ZarrRows, DaskRows)):
        return work.resolve()
    if isinstance(work, dict) and any(isinstance(v, (ZarrRows, DaskRows)) for v in work.values()):
        return {k: (v.resolve() if isinstance(v, (ZarrRows, DaskRows)) else v) for k, v in work.items()}
    return work


def holds_dask_rows(work) -> bool:
    """Whether a chunk's work carries rows of a Dask array (they travel as futures, in a task)."""
    if isinstance(work, DaskRows):
        return True
    return isinstance(work, dict) and any(isinstance(v, DaskRows) for v in work.values())


def streams_dask(generator) -> bool:
    """Whether a loader (or a re-run of one) cuts a Dask array."""
    generator = getattr(generator, "source", generator)
    values = [getattr(generator, "array", None), *getattr(generator, "mapping", {}).values()]
    return any(isinstance(v, DaskInput) for v in values)


def submit_rows(work, client):
    """``work`` with its :class:`DaskRows` replaced by futures of ``client`` (a task's arguments resolve them)."""
    if isinstance(work, DaskRows):
        return work.submit(client)
    if isinstance(work, dict):
        return {k: (v.submit(client) if isinstance(v, DaskRows) else v) for k, v in work.items()}
    return work
