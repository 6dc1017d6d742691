"""Resident batches: named arrays that stay on their devices across repeated updates.

A finite-element solver calls its material model at every iteration of every
step on the same points, with state carried from one call to the next.
:class:`Batch` places each chunk of each field once, on the device
:func:`dsched.plan` gives it, and keeps it there. Updates name the fields they
read and the fields they write; a :class:`~dsched.engine.Engine` orders them
per chunk and per field (reads together, a write after the earlier reads and
write, a read after the write), and Dask runs each chunk's task as soon as its
own inputs are ready. There is no barrier across chunks or updates:
:meth:`Batch.reduce` and :meth:`Batch.get` are the only points where the
client waits.

How it maps onto Dask:

- each version of a chunk's field is (a key of) a Dask future held by the
  client, computed on a worker that owns the chunk's device (the task requests
  the chunk's size of the ``dsched-<device>`` resource, so also the device's
  capacity holds);
- an update submits one task per chunk, whose arguments are the latest
  versions of the fields it reads and, as ordering-only arguments, the pending
  reads of the fields it writes;
- new versions replace the old ones in the client's table, and Dask frees a
  superseded version once no pending task needs it (memory recycling);
- initial values and :meth:`Batch.set` values travel through the data plane
  (:mod:`dsched.store`): shared memory that worker processes on this host map,
  read by reference. They stay until :meth:`Batch.close`, so a lost worker's
  chunks are rebuilt from lineage (those values plus the updates applied) on
  the worker that takes over its device.
"""

from __future__ import annotations

import collections
import itertools
import math
import secrets
import threading
from dataclasses import dataclass

import numpy as np

from dsched.blocks.map_blocks import plan
from dsched.devices.backends import array_module
from dsched.devices.device import device_resource
from dsched.devices.context import running_on, selected
from dsched.resident.engine import Engine
from dsched.errors import AggregateError
from dsched.dataplane.outputs import ChunkResultError, ZarrTarget, check_out_path, write_rows
from dsched.devices.ownership import check_devices_owned, device_owners
from dsched.dataplane.store import RunStore, SliceRef, classify_workers

__all__ = ["Batch", "Update"]

_batch_ids = itertools.count()


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
        raise AggregateError(errors)


class Batch:
    """Named arrays placed once on their devices, updated where they live.

    Parameters
    ----------
    fields : dict
        ``{name: array}``, NumPy arrays of one length along axis 0 (the items).
    scheduler : WorkScheduler
        Cuts the items into chunks and places them (:func:`dsched.plan`).
    client : distributed.Client, optional
        The cluster; by default the current Dask client. Its workers must own the scheduler's devices.
    lookahead : int
        Operations per chunk handed to Dask ahead of the one running (the rest wait in the engine). Two
        keep a device busy while the client hears of a completion, and bound the versions alive per chunk.

    Examples
    --------
    >>> batch = Batch({"x": np.arange(10.0)}, dsched.SimpleScheduler("cpu", 4), client=client)  # doctest: +SKIP
    >>> batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])  # doctest: +SKIP
    >>> batch.reduce(np.sum, "x")  # doctest: +SKIP
    55.0
    """

    def __init__(self, fields, scheduler, *, client=None, lookahead=2):
        arrays = _check_fields(fields)
        self.n = len(next(iter(arrays.values())))
        self.scheduler = scheduler
        self.client = _client(client)
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(f"lookahead: expected an integer >= 1, got {lookahead!r}")
        self.lookahead = lookahead
        check_devices_owned(self.client, scheduler)
        self.chunks = []
        start = 0
        for index, (device, size) in enumerate(plan(self.n, scheduler)):
            self.chunks.append(_Chunk(index, device, start, start + size))
            start += size
        self.devices = list(dict.fromkeys(c.device for c in self.chunks))
        owners = device_owners(self.client, self.devices)
        kinds = classify_workers(self.client, {a for addrs in owners.values() for a in addrs})
        if any(kind == "remote" for kind in kinds.values()):
            raise ValueError("client: a worker owning one of the devices is on another host; resident batches "
                             "need workers that map this host's shared memory (or run in this process)")
        # Worker processes map shared memory; in-process workers read registered arrays.
        self._shared = any(kind == "host" for kind in kinds.values())
        self._store = RunStore(shared=self._shared)  # initial and set() values: the lineage, kept until close()
        self._engine = Engine(queue_ready=False)  # Dask does the waiting
        self._vars = {}  # (field, chunk index) -> engine Variable; its last write holds the current version
        self._lock = threading.Lock()
        self._id = f"dsched-batch-{secrets.token_hex(4)}-{next(_batch_ids)}"
        self._ops = itertools.count()
        self._closed = False
        # Per chunk: operations pushed but not yet handed to Dask (program order), and how many are in Dask.
        self._queued = {c.index: collections.deque() for c in self.chunks}
        self._in_dask = {c.index: 0 for c in self.chunks}
        self._submit_lock = threading.Lock()
        self._load_values(arrays, "init")

    # --- the public API -----------------------------------------------------------

    @property
    def fields(self) -> list:
        return sorted({field for field, _ in self._vars})

    def update(self, fn, reads=(), writes=(), outputs=(), *, label=None, inplace=False, kwargs=None) -> Update:
        """Run ``fn`` on every chunk where it lives; returns at once with an :class:`Update` handle.

        ``fn(**{field: chunk array for field in reads}, **kwargs)`` returns a
        dict with one array per field in ``writes`` and ``outputs``, each with
        the chunk's length along axis 0. ``writes`` are existing fields
        (replaced by the returned arrays); ``outputs`` may also name new
        fields. Fields read arrive read-only unless ``inplace`` is true: then a
        field both read and written arrives writable and ``fn`` may mutate it in
        place and return it (the engine runs it only after the earlier reads of
        that field finished). A failed in-place update may leave what ``fn``
        wrote before it failed.
        """
        self._check_open()
        if not callable(fn):
            raise ValueError(f"fn: expected a callable, got {fn!r}")
        reads, writes, outputs = (_names(v, n) for v, n in ((reads, "reads"), (writes, "writes"),
                                                             (outputs, "outputs")))
        known = set(self.fields)
        for field_name, names in (("reads", reads), ("writes", writes)):
            for name in names:
                if name not in known:
                    raise ValueError(f"{field_name}: no field {name!r} in this batch "
                                     f"(fields: {', '.join(sorted(known))})")
        written = tuple(dict.fromkeys(writes + outputs))
        if not written:
            raise ValueError("writes: an update must write at least one field (reduce() computes values)")
        label = label or getattr(fn, "__name__", "update")
        spec = _UpdateSpec(fn, label, reads, written, bool(inplace), dict(kwargs or {}))
        tasks = []
        with self._lock:
            self._rollback_failed()
            step = next(self._ops)
            for chunk in self.chunks:
                versions = {f: (self._version(f, chunk), f) for f in reads}
                tasks.append(self._push(chunk, reads, written, f"{label}-{step}", _update, spec, chunk, versions))
        return Update(label, tasks)

    def set(self, field, values) -> Update:
        """New values of ``field`` (a new field too) from the host, streamed to where each chunk lives."""
        self._check_open()
        if not isinstance(field, str):
            raise ValueError(f"field: expected a field name, got {field!r}")
        [array] = _check_fields({field: values}, n=self.n).values()
        with self._lock:
            self._rollback_failed()
            return self._load_values({field: array}, f"set-{field}")

    def get(self, field) -> np.ndarray:
        """``field`` for every item, in dispatch order (waits for the updates that write it)."""
        self._check_open()
        with RunStore(shared=self._shared) as store:
            layout, tasks, view = self._write_out(field, lambda shape, dtype: store.allocate(shape, dtype))
            _wait_tasks(tasks)
        return view

    def reduce(self, fn, field, combine=sum):
        """``combine([fn(chunk) for each chunk of field])``, in dispatch order: the batch's one global synchronisation.

        ``fn`` runs where each chunk lives and returns something small (a
        scalar, a short array); ``combine`` joins the per-chunk values on the
        client (default: their sum; ``max``, ``list``...).
        """
        self._check_open()
        self._check_field(field)
        with self._lock:
            self._rollback_failed()
            tasks, step = [], next(self._ops)
            for chunk in self.chunks:
                tasks.append(self._push(chunk, (field,), (), f"reduce-{field}-{step}", _partial, fn,
                                        self._version(field, chunk), field, chunk))
        _wait_tasks(tasks)
        return combine(self.client.gather([task.future for task in tasks], direct=True))

    def to_zarr(self, path, fields=None, *, overwrite=False) -> str:
        """Stream ``fields`` (default: all) to a new Zarr store at ``path``, written by the workers; returns it."""
        import zarr

        self._check_open()
        path = check_out_path(path, overwrite, field="path")
        fields = self.fields if fields is None else _names(fields, "fields")
        for field in fields:
            self._check_field(field)
        group = zarr.open_group(store=path, mode="w")
        # Zarr chunks never straddle two batch chunks: no two workers write one Zarr chunk.
        rows = math.gcd(*[c.size for c in self.chunks[:-1]]) if len(self.chunks) > 1 else self.chunks[0].size
        tasks = []
        for field in fields:
            def create(shape, dtype, field=field):
                group.create_array(field, shape=shape, chunks=(rows,) + tuple(shape[1:]), dtype=dtype,
                                   compressors=None)
                return ZarrTarget(path, field), None

            tasks += self._write_out(field, create)[1]
        _wait_tasks(tasks)
        return path

    def wait(self):
        """Wait until every pushed update finished; raises the failures of the current versions."""
        with self._lock:
            tasks = [var.last_write.payload for var in self._vars.values()]
        _wait_tasks(tasks)

    def close(self):
        """Release every version on the workers and the shared memory of the lineage."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            # Dropping the client's references releases every version (Dask frees them); pending tasks still
            # finish, reading the lineage's shared memory by name, so the segments go after they end.
            with self._submit_lock:
                for queue in self._queued.values():  # never handed to Dask: nothing to wait for
                    queue.clear()
            pending = [var.last_write.payload.future for var in self._vars.values()
                       if var.last_write.payload.future is not None]
            self._vars.clear()
        try:
            from distributed import wait

            wait(pending)
        finally:
            del pending
        self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        devices = ", ".join(f"{d}: {sum(c.device == d for c in self.chunks)}" for d in self.devices)
        return f"<Batch {self.n} items, fields {self.fields}, chunks per device {{{devices}}}>"

    # --- internals ----------------------------------------------------------------

    def _push(self, chunk, reads, writes, key, func, *args):
        """Push one chunk's operation to the engine and submit its task after its predecessors."""
        variables = {}
        for field in reads + tuple(writes):
            var = self._vars.get((field, chunk.index))
            if var is None:  # a new output field
                var = self._vars[(field, chunk.index)] = self._engine.new_variable((field, chunk.index))
            variables[field] = var
        previous = {f: variables[f].last_write for f in writes}
        op = self._engine.push([variables[f] for f in reads], [variables[f] for f in writes], label=key)
        # Every key is new (a step number in it): Dask would answer a repeated key with the old result.
        call = (func, args, f"{self._id}-{key}-{chunk.index}", {device_resource(chunk.device): chunk.size})
        op.payload = _Task(call, previous if writes else None)
        with self._submit_lock:
            self._queued[chunk.index].append(op)
        self._pump(chunk)
        return op.payload

    def _pump(self, chunk):
        """Hand the chunk's queued operations to Dask, in program order, while fewer than ``lookahead`` are there.

        Its predecessors are earlier operations on the same chunk, so they were handed over before it.
        """
        while True:
            with self._submit_lock:
                queue = self._queued[chunk.index]
                if not queue or self._in_dask[chunk.index] >= self.lookahead:
                    return
                op = queue.popleft()
                self._in_dask[chunk.index] += 1
            self._submit(chunk, op)

    def _submit(self, chunk, op):
        task = op.payload
        func, args, key, resources = task.call
        task.call = None
        # The data a task reads travels in its arguments; its other predecessors (the earlier reads of
        # what it writes) are passed too, only so that Dask runs it after them.
        after = [o.payload.future for o in op.after]
        future = self.client.submit(_ordered, func, after, *_resolve(args), key=key, resources=resources,
                                    pure=False)
        task.future = future
        task.submitted.set()
        engine = self._engine

        def finished(f):
            if f.status == "finished":
                task.previous = None  # the replaced versions are no longer needed for rollback
            engine.complete(op)
            with self._submit_lock:
                self._in_dask[chunk.index] -= 1
            if not self._closed:
                self._pump(chunk)

        future.add_done_callback(finished)

    def _load_values(self, arrays, label):
        refs = self._store.share_many(list(arrays.values()))
        tasks, step = [], next(self._ops)
        for chunk in self.chunks:
            # One task per field: a field's first version is freed when it is superseded, whatever the others do.
            for name, ref in zip(arrays, refs):
                tasks.append(self._push(chunk, (), (name,), f"{label}-{name}-{step}", _load, chunk,
                                        {name: SliceRef(ref, 0, chunk.start, chunk.stop)}))
        return Update(label, tasks)

    def _version(self, field, chunk):
        """The current version of ``field`` on ``chunk``: its op's result, once handed to Dask."""
        return _Version(self._vars[(field, chunk.index)].last_write, field)

    def _write_out(self, field, allocate):
        """One task per chunk writing ``field`` into what ``allocate(shape, dtype)`` returns (a target, a view)."""
        self._check_field(field)
        with self._lock:
            self._rollback_failed()
            first = self._vars[(field, 0)].last_write.payload
        layout_future = self.client.submit(_item_layout, first.result(), field, key=f"{self._id}-layout-{next(self._ops)}",
                                           resources={device_resource(self.chunks[0].device): 1})
        _wait_all([layout_future])
        item_shape, dtype = layout_future.result()
        target, view = allocate((self.n,) + item_shape, dtype)
        tasks = []
        with self._lock:
            step = next(self._ops)
            for chunk in self.chunks:
                tasks.append(self._push(chunk, (field,), (), f"get-{field}-{step}", _write,
                                        self._version(field, chunk), field, target, chunk, (item_shape, dtype), field))
        return (item_shape, dtype), tasks, view

    def _rollback_failed(self):
        """Point every field whose latest version failed back at its last good version (the batch stays usable)."""
        dropped = set()
        for (field, index), var in list(self._vars.items()):
            op = var.last_write
            while op is not None and op.payload.future is not None and op.payload.future.status in ("error",
                                                                                                      "cancelled"):
                op = (op.payload.previous or {}).get(field)
            if op is not var.last_write:
                if op is None:  # the update that created the field failed here: the field is gone
                    dropped.add(field)
                else:
                    var.last_write = op
        for field in dropped:
            for key in [k for k in self._vars if k[0] == field]:
                del self._vars[key]

    def _check_field(self, field):
        if field not in self.fields:
            raise ValueError(f"field: no field {field!r} in this batch (fields: {', '.join(self.fields)})")

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this Batch is closed")


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


def _names(value, field) -> tuple:
    if isinstance(value, str):
        value = [value]
    names = tuple(value)
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"{field}: expected field names, got {name!r}")
    return names


def _check_fields(fields, n=None) -> dict:
    """The fields as NumPy arrays of one length along axis 0; a ValueError naming the field otherwise."""
    if not isinstance(fields, dict) or not fields:
        raise ValueError(f"fields: expected a non-empty dict of name -> array, got {type(fields).__name__}")
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


def _client(client):
    if client is not None:
        return client
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        raise ValueError("client: no Dask client given and none is current; pass client=Client(cluster)") from None
