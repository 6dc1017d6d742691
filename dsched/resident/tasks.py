"""A resident batch's chunk tasks: what runs on the workers, and the handles the client waits on.

:class:`~dsched.resident.batch.Batch` turns every operation on a chunk (a
load, an update, a write-out, a reduction's partial) into one Dask task; this
module holds what those tasks carry (the chunk, the update's spec, versions of
fields still to resolve into futures), the functions they run on the workers,
and :class:`Update`, the handle of a pushed update, with the waiting that
raises the chunks' failures.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from dsched.dataplane.outputs import ChunkResultError, write_rows
from dsched.dataplane.store import SliceRef
from dsched.devices.backends import array_module
from dsched.devices.context import running_on, selected
from dsched.errors import AggregateError

__all__ = ["Update"]


@dataclass(frozen=True)
class _Chunk:
    index: int
    device: object
    start: int
    stop: int

    @property
    def size(self):
        return self.stop - self.start

    def __str__(self):
        return f"chunk {self.index} on {self.device} (items {self.start}:{self.stop})"


class _Task:
    """An engine op's payload: its task until it is handed to Dask, then its future; the versions it replaces
    until it succeeds (for rollback)."""

    __slots__ = ("future", "previous", "submitted", "call")

    def __init__(self, call, previous):
        self.call, self.previous = call, previous  # call: (func, args, key, resources) until submitted
        self.future = None
        self.submitted = threading.Event()

    def result(self):
        """The future, once the task was handed to Dask (waits for that)."""
        self.submitted.wait()
        return self.future


@dataclass(frozen=True)
class _Version:
    """A field's version in a task's arguments: replaced by its op's future when the task is handed to Dask."""

    op: object
    field: str


@dataclass(frozen=True)
class _UpdateSpec:
    """What every chunk task of one update needs, shipped with it."""

    fn: object
    label: str
    reads: tuple
    writes: tuple
    inplace: bool
    kwargs: dict


# --- what runs on the workers ---------------------------------------------------

def _read_only(array):
    if isinstance(array, np.ndarray):
        array = array.view()
        array.flags.writeable = False
    return array


def _on_device(array, device):
    """``array`` in the device's memory: a private copy (NumPy on the CPU and emulated devices, CuPy on a GPU)."""
    xp = array_module(device)
    return np.array(array, copy=True) if xp is np else xp.asarray(array)


def _load(chunk, refs):
    """A chunk's first (or set) version of some fields: copied from the data plane into the device's memory."""
    with running_on(chunk.device), selected(chunk.device):
        return {name: _on_device(ref.resolve() if isinstance(ref, SliceRef) else ref, chunk.device)
                for name, ref in refs.items()}


def _ordered(func, after, *args):
    """``func(*args)``, run by Dask once the operations in ``after`` (their futures, resolved) have finished."""
    del after
    return func(*args)


def _update(spec, chunk, versions):
    """One chunk of an update: ``fn`` on the chunk's fields where they live; the written fields' new versions."""
    arrays = {}
    for field, (value, name) in versions.items():
        array = value[name]
        arrays[field] = array if (spec.inplace and field in spec.writes) else _read_only(array)
    with running_on(chunk.device), selected(chunk.device):
        result = spec.fn(**arrays, **spec.kwargs)
        where = f"update {spec.label!r}: {chunk}"
        if not isinstance(result, dict):
            raise ChunkResultError(f"{where} returned {type(result).__name__}; expected a dict of the fields it "
                                   f"writes ({', '.join(spec.writes)})")
        missing = [f for f in spec.writes if f not in result]
        if missing:
            raise ChunkResultError(f"{where} returned no field {missing[0]!r} (it writes: {', '.join(spec.writes)})")
        extra = [f for f in result if f not in spec.writes]
        if extra:
            raise ChunkResultError(f"{where} returned field {extra[0]!r}, which it does not write "
                                   f"(writes: {', '.join(spec.writes)})")
        out = {}
        for field in spec.writes:
            value = result[field]
            shape = getattr(value, "shape", None)
            if shape is None or len(shape) == 0 or shape[0] != chunk.size:
                got = "no batch axis" if not shape else f"{shape[0]} items (shape {tuple(shape)})"
                raise ChunkResultError(f"{where}: field {field!r} has {got}; expected {chunk.size} items along "
                                       f"axis 0 (the chunk's size)")
            out[field] = value if array_module(chunk.device) is not np else np.asarray(value)
        return out


def _to_host(array):
    return array.get() if hasattr(array, "__cuda_array_interface__") else np.asarray(array)


def _item_layout(value, name):
    array = value[name]
    return tuple(array.shape[1:]), np.dtype(array.dtype).str


def _write(value, name, target, chunk, layout, field):
    """Write a chunk's version of ``field`` into rows ``start:stop`` of ``target`` (shared memory or Zarr)."""
    array = value[name]
    if (tuple(array.shape[1:]), np.dtype(array.dtype).str) != layout:
        raise ChunkResultError(f"field {field!r}: {chunk} holds items of shape {tuple(array.shape[1:])} and dtype "
                               f"{array.dtype}; chunk 0 holds {layout[0]}, {np.dtype(layout[1])}")
    write_rows(target, 0, chunk.start, chunk.stop, _to_host(array))


def _partial(fn, value, name, chunk):
    """``fn`` on a chunk's version of a field, where it lives; a device result comes back to the host."""
    with running_on(chunk.device), selected(chunk.device):
        result = fn(_read_only(value[name]))
    return result.get() if hasattr(result, "__cuda_array_interface__") else result


# --- the client's side --------------------------------------------------------------

class Update:
    """The handle of an update: it was pushed, and runs as its chunks' inputs become ready.

    ``wait()`` blocks until every chunk finished and raises the first failure
    (several: :class:`~dsched.AggregateError`); ``done()`` tells without blocking.
    """

    def __init__(self, label, tasks):
        self.label = label
        self._tasks = tasks

    @property
    def futures(self) -> list:
        """The chunks' Dask futures (waits until every chunk's task was handed to Dask)."""
        return [task.result() for task in self._tasks]

    def done(self) -> bool:
        return all(task.submitted.is_set() and task.future.done() for task in self._tasks)

    def wait(self):
        _wait_tasks(self._tasks)
        return self

    def __repr__(self):
        state = "done" if self.done() else "pending"
        return f"<Update {self.label!r}: {len(self._tasks)} chunks, {state}>"


def _raise_failures(futures):
    errors, seen = [], set()
    for future in futures:
        if future.status == "error":
            error = future.exception()
            if id(error) not in seen and str(error) not in {str(e) for e in errors}:
                seen.add(id(error))
                errors.append(error)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise AggregateError.of(errors)


def _wait_all(futures):
    from distributed import wait

    wait(futures)
    _raise_failures(futures)


def _wait_tasks(tasks):
    """Wait until every task was handed to Dask and finished; raise the failures."""
    _wait_all([task.result() for task in tasks])


def _resolve(args):
    """Task arguments with every :class:`_Version` replaced by its op's future (nested in tuples and dicts)."""
    if isinstance(args, _Version):
        return args.op.payload.future
    if isinstance(args, tuple):
        return tuple(_resolve(a) for a in args)
    if isinstance(args, dict):
        return {k: _resolve(v) for k, v in args.items()}
    return args
