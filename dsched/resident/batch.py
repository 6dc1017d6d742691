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

import numpy as np

from dsched.blocks.planning import plan
from dsched.checks import check_positive_int
from dsched.dataplane.outputs import ZarrTarget, check_out_path
from dsched.dataplane.store import RunStore, SliceRef, classify_workers
from dsched.devices.device import device_resource
from dsched.devices.ownership import check_devices_owned, device_owners
from dsched.resident.engine import Engine
from dsched.resident.tasks import (
    Update,
    _Chunk,
    _item_layout,
    _load,
    _ordered,
    _partial,
    _resolve,
    _Task,
    _update,
    _UpdateSpec,
    _Version,
    _wait_all,
    _wait_tasks,
    _write,
)

__all__ = ["Batch", "Update"]

_batch_ids = itertools.count()


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
        check_positive_int(lookahead, "lookahead", integers=int, below=None)
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
