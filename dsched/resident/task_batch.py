"""A resident batch in device memory: each chunk's fields stay on its device, updated by Dask tasks.

:class:`~dsched.Batch` uses this engine (``memory="device"``) where a chunk's
fields must stay where it computes: on a real GPU, between updates. Updates
name the fields they read and the fields they write; a
:class:`~dsched.resident.engine.Engine` orders them per chunk and per field
(reads together, a write after the earlier reads and write, a read after the
write), and Dask runs each chunk's task as soon as its own inputs are ready.
There is no barrier across chunks or updates: :meth:`TaskBatch.reduce` and
:meth:`TaskBatch.get` are the only points where the client waits.

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
- initial values and :meth:`TaskBatch.set` values travel through the data plane
  (:mod:`dsched.store`): shared memory that worker processes on this host map,
  read by reference. They stay until :meth:`TaskBatch.close`, so a lost worker's
  chunks are rebuilt from lineage (those values plus the updates applied) on
  the worker that takes over its device. On the host a chunk's first version
  *is* that memory (a read-only view, copied by an in-place update on its first
  write); arrays already in shared memory (:func:`dsched.shared_empty`) are
  not copied at all, so they must not change while the batch is open;
- updates pushed faster than a chunk runs them (queued behind ``lookahead``)
  are handed to Dask together, as one task that runs them in order
  (:func:`~dsched.resident.tasks._run_fused`): one round trip per burst, not
  per update. Updates fused so succeed or fail together: a failure rolls the
  chunk back to its version before the burst's task;
- what an update returns stays as it is where it lives (torch tensors stay
  tensors, on their device, between updates).

Arguments reach it checked (:class:`~dsched.Batch` checks them, naming the field at fault).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import secrets
import threading
import weakref

import numpy as np

from dsched.dataplane.outputs import ChunkResultError, ZarrTarget
from dsched.dataplane.store import RunStore, SliceRef
from dsched.devices.device import device_resource
from dsched.dispatch.completion import send_now, submit_task
from dsched.resident.engine import Engine
from dsched.resident.hostdata import SetSegment, _Kept, out_refs, share_inputs
from dsched.resident.tasks import (
    Update,
    _fused_call,
    _handed,
    _item_layout,
    _item_layouts,
    _load,
    _load_set,
    _on_loop_thread,
    _ordered,
    _partial,
    _record_outcome,
    _resolve,
    _Task,
    _update,
    _Version,
    _wait,
    _wait_all,
    _wait_unless_released,
    _wait_tasks,
    _write,
    _write_many,
)

__all__ = ["TaskBatch", "Update"]

_batch_ids = itertools.count()
MAX_FUSED = 64  # updates of one chunk handed to Dask as one task, at most
# Operations that may share a task: updates (a load fused with a failing update would roll back to nothing).
_FUSABLE = (_update,)
_SETTLED = "settled"  # an operation's ``previous`` once it finished: no rollback goes past it


class TaskBatch:
    """A :class:`~dsched.Batch`'s fields in its devices' memory: one Dask task per chunk and operation.

    Parameters
    ----------
    arrays : dict
        The initial fields, checked (``{name: NumPy array}``, ``n`` items each; may be empty).
    n : int
        The number of items.
    chunks : list of _Chunk
        The batch's chunks, as :func:`dsched.plan` cut them.
    client : distributed.Client
        A cluster whose workers own the chunks' devices (checked).
    shared : bool
        Whether worker processes read this process's shared memory (else every worker is in this process).
    lookahead : int
        Operations per chunk handed to Dask ahead of the one running.
    """

    def __init__(self, arrays, *, n, chunks, client, shared, lookahead=2):
        self.n, self.chunks, self.client, self.lookahead = n, list(chunks), client, lookahead
        # Worker processes map shared memory; in-process workers read registered arrays.
        self._shared = shared
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
        # Per chunk: held while its queue is handed over. A task's arguments name its predecessors' futures, so
        # a chunk's operations must reach Dask in program order even when the client's thread and a finished
        # task's callback pump the same chunk at once (the later one would otherwise find no future yet).
        self._pump_locks = {c.index: threading.Lock() for c in self.chunks}
        self._inputs = []  # (_Kept, tasks) of updates' inputs and outputs: released once their tasks have ended
        self._seen_layouts = {}  # field -> (item shape, dtype) its last get found
        self._set_segments = {}  # field -> SetSegment: where set() writes its values, again and again
        self._set_stores = []  # their stores, unlinked at close()
        # Every task handed to Dask that something still refers to (an Update kept by a caller, a reference
        # cycle), with its ops' payloads: close() records how each ended and releases it, so the workers free
        # the fields now rather than at the client's next garbage collection.
        self._futures = weakref.WeakKeyDictionary()
        # What waits for the next _flush: the first values, for the first operation (to go to Dask with it: one
        # message, one task), and the updates a together() block holds back.
        self._held = True
        self._deferring = 0  # together() blocks open
        self._load_values(arrays, "init")

    @property
    def fields(self) -> list:
        return sorted({field for field, _ in self._vars})

    def knows(self, field) -> bool:
        """Whether ``field`` is a field, or will be once the updates pushed ran (every field has a chunk 0)."""
        return (field, 0) in self._vars

    def update(self, spec, arrays, axis, out, layouts=None) -> Update:
        """:meth:`dsched.Batch.update`: ``spec`` (fn, label, reads, writes and outputs, inplace, kwargs) checked,
        ``arrays`` its own inputs along ``axis``, ``out`` its out= arrays. ``layouts`` go unused: in device
        memory a chunk keeps what ``fn`` returns as it is."""
        del layouts
        reads, written, label = spec.reads, spec.writes, spec.label
        targets = self._out_refs(out, set(reads) | set(arrays))
        tasks = []
        with self._lock:
            self._rollback_failed()
            self._release_inputs()
            store, refs = share_inputs(arrays, self._shared)
            step = next(self._ops)
            for chunk in self.chunks:
                versions = {f: (self._version(f, chunk), f) for f in reads}
                rows = {name: SliceRef(ref, axis, chunk.start, chunk.stop) for name, ref in refs.items()} or None
                into = {name: SliceRef(ref, 0, chunk.start, chunk.stop) for name, ref in targets.items()} or None
                tasks.append(self._push(chunk, reads, written, f"{label}-{step}", _update, spec, chunk, versions,
                                        rows, into, pump=False))
            if store is not None or refs or targets:
                self._inputs.append((_Kept(store, arrays, out), tasks))
        if self._deferring:
            self._held = True
        else:
            self._flush(everywhere=True)
        return Update(label, tasks)

    @contextlib.contextmanager
    def together(self):
        """:meth:`dsched.Batch.together`: the updates pushed in the block are handed to Dask as it ends, each
        chunk's in one task (:func:`_run_fused`), not the first ``lookahead`` of them each alone."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring:
                self._flush()

    def set(self, field, array) -> Update:
        """:meth:`dsched.Batch.set`, ``array`` checked.

        On worker processes the values go into the field's own segment of shared memory, written again by
        the next ``set`` of the same shape and dtype (once the previous values were loaded where the chunks
        live): a solver that sets a field at every step keeps ``/dev/shm`` flat.
        """
        self._flush()
        if self._shared and array.dtype.kind in "biufc":
            return self._set_shared(field, array)
        with self._lock:
            self._rollback_failed()
            return self._load_values({field: array}, f"set-{field}")

    def _set_shared(self, field, array) -> Update:
        """:meth:`set` on worker processes: the field's segment written again, or a new one for a new layout."""
        kept = self._set_segments.get(field)
        if kept is not None and kept.fits(array):
            _wait([task.result() for task in kept.tasks])  # the previous values were loaded (or failed)
        else:
            kept = self._set_segments[field] = SetSegment(array)
            self._set_stores.append(kept.store)
        kept.write(array)
        with self._lock:
            self._rollback_failed()
            tasks, step = [], next(self._ops)
            for chunk in self.chunks:
                rows = {field: SliceRef(kept.ref, 0, chunk.start, chunk.stop)}
                tasks.append(self._push(chunk, (), (field,), f"set-{field}-{step}", _load_set, chunk, rows,
                                        kept.generation_ref, kept.generation))
            kept.tasks = tasks
        return Update(f"set-{field}", tasks)

    def get(self, field) -> np.ndarray:
        """:meth:`dsched.Batch.get`.

        The field's item shape and dtype are taken from the last ``get`` of it, so a step's ``get`` costs
        one round trip through Dask, not two; should an update have changed them since, the chunks refuse
        that layout, and ``get`` asks chunk 0 for the new one and writes again.
        """
        self._flush()
        guess = self._seen_layouts.pop(field, None)
        try:
            return self._get(field, guess)
        except ChunkResultError:
            if guess is None:
                raise
        return self._get(field, None)  # the layout changed since the last get: asked of chunk 0

    def _get(self, field, layout):
        with RunStore(shared=self._shared) as store:
            layout, tasks, view = self._write_out(field, lambda shape, dtype: store.allocate(shape, dtype), layout)
            _wait_tasks(tasks)
        self._seen_layouts[field] = layout
        return view

    def get_many(self, fields, layouts=None) -> dict:
        """:meth:`dsched.Batch.get_many`: one task per chunk writes them all."""
        self._flush()
        known = {f: (tuple(shape), np.dtype(dtype).str) for f, (shape, dtype) in dict(layouts or {}).items()}
        missing = [f for f in fields if f not in known]
        if missing:
            known.update(self._layouts(missing))
        store = RunStore(shared=self._shared)
        clean = False
        try:  # the arrays' segment goes back to the pool once they are gone (a next get pays no page faults)
            placed = store.allocate_many([((self.n, *known[f][0]), known[f][1]) for f in fields], handed_out=True)
            targets = [ref for ref, _ in placed]
            with self._lock:
                self._rollback_failed()
                step = next(self._ops)
                tasks = [self._push(chunk, fields, (), f"get-{step}", _write_many,
                                    {f: self._version(f, chunk) for f in fields}, targets, chunk,
                                    [known[f] for f in fields]) for chunk in self.chunks]
            _wait_tasks(tasks)
            clean = True
        finally:
            store.close(clean=clean)
        return {field: view for field, (_, view) in zip(fields, placed)}

    def _layouts(self, fields) -> dict:
        """``{field: (item_shape, dtype)}`` of chunk 0's current versions: one task where it lives."""
        with self._lock:
            self._rollback_failed()
            first = {f: self._vars[(f, 0)].last_write for f in fields}
        future = self._submit_now(_item_layouts, {f: _handed(op) for f, op in first.items()},
                                  key=f"{self._id}-layout-{next(self._ops)}",
                                  resources={device_resource(self.chunks[0].device): 1})
        _wait_all([future])
        return future.result()

    def reduce(self, fn, field, combine=sum):
        """:meth:`dsched.Batch.reduce`: ``fn`` runs where each chunk lives."""
        self._flush()
        with self._lock:
            self._rollback_failed()
            tasks, step = [], next(self._ops)
            for chunk in self.chunks:
                tasks.append(self._push(chunk, (field,), (), f"reduce-{field}-{step}", _partial, fn,
                                        self._version(field, chunk), field, chunk))
        _wait_tasks(tasks)
        return combine(self.client.gather([task.future for task in tasks], direct=True))

    def to_zarr(self, path, fields, overwrite=False) -> str:
        """:meth:`dsched.Batch.to_zarr` into ``path`` (checked, ``overwrite`` with it), written by the workers."""
        import zarr

        del overwrite  # the store is created anew (mode "w")
        self._flush()
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
        with self._lock:
            # Releasing the batch's futures frees every version on the workers; pending tasks still finish,
            # reading the lineage's shared memory by name, so the segments go after they end.
            with self._submit_lock:
                self._closed = True  # no pump hands anything over from now on
                for queue in self._queued.values():  # never handed to Dask: nothing to wait for
                    for op in queue:
                        op.payload.outcome = ("cancelled", None)
                    queue.clear()
            for lock in self._pump_locks.values():  # a hand-over under way (a finished task's callback) ends first
                with lock:
                    pass
            pending = [var.last_write.payload.future for var in self._vars.values()
                       if var.last_write.payload.future is not None]
            pending += [t.future for _, tasks in self._inputs for t in tasks if t.future is not None]
            self._vars.clear()
        try:
            _wait_unless_released(pending)
        finally:
            del pending
            for future, payloads in list(self._futures.items()):
                _record_outcome(future, payloads)
                future.release()
        self._release_inputs(everything=True)
        self._store.close()
        for store in self._set_stores:
            store.close()

    # --- internals ----------------------------------------------------------------

    def _push(self, chunk, reads, writes, key, func, *args, pump=True):
        """Push one chunk's operation to the engine and submit its task after its predecessors (``pump``)."""
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
        if pump and not self._held:
            self._pump(chunk)
        return op.payload

    def _flush(self, everywhere=False):
        """Hand over what waits: the batch's first values (until its first operation) or the updates a
        :meth:`together` block held back, and, with ``everywhere``, every chunk's queue.

        From the client's event loop, so that the chunks' tasks leave in one message, sent at once
        (:meth:`_submit_now`) rather than at the end of the client's 10 ms batch window.
        """
        if not (self._held or everywhere):
            return
        self._held = False

        async def pump_all():
            for chunk in self.chunks:
                self._pump(chunk)

        if _on_loop_thread(self.client):
            for chunk in self.chunks:
                self._pump(chunk)
        else:
            self.client.sync(pump_all)

    def _pump(self, chunk):
        """Hand the chunk's queued operations to Dask, in program order, while fewer than ``lookahead`` are there.

        Its predecessors are earlier operations on the same chunk, so they were handed over before it.
        Updates queued one after another (pushed faster than the chunk runs them) go as one task
        (:func:`_run_fused`): a Dask round trip per burst, not per update.
        """
        with self._pump_locks[chunk.index]:
            while True:
                with self._submit_lock:
                    queue = self._queued[chunk.index]
                    if self._closed or not queue or self._in_dask[chunk.index] >= self.lookahead:
                        return
                    ops = [queue.popleft()]
                    while ops[-1].payload.call[0] in _FUSABLE and queue and queue[0].payload.call[0] in _FUSABLE \
                            and len(ops) < MAX_FUSED:
                        ops.append(queue.popleft())
                    self._in_dask[chunk.index] += 1
                try:
                    self._submit(chunk, ops)
                except BaseException as error:  # e.g. fn does not pickle: these ops fail, the chunk goes on
                    self._not_handed(chunk, ops, error)
                    if not isinstance(error, Exception):
                        raise

    def _not_handed(self, chunk, ops, error):
        """``ops`` could not be handed to Dask: each fails with a one-line error (raised where its update is
        waited for, and by the operations that read what it was to write); the chunk's slot is free again."""
        failure = RuntimeError(f"operation {ops[0].label!r} on {chunk} was not sent to its worker: "
                               f"{type(error).__name__}: {error}")
        with self._submit_lock:
            self._in_dask[chunk.index] -= 1
        for op in ops:
            op.payload.not_handed(failure)
            self._engine.complete(op)

    def _submit_now(self, *args, **kwargs):
        """``client.submit(*args, **kwargs)``, sent to the scheduler now: not at the end of the client's 10 ms
        batch window, which a solver's step would wait for."""
        future = submit_task(self.client, *args, **kwargs)
        send_now(self.client)
        return future

    def _submit(self, chunk, ops):
        if len(ops) == 1:
            func, args, key, resources = ops[0].payload.call
            # The data a task reads travels in its arguments; its other predecessors (the earlier reads of
            # what it writes) are passed too, only so that Dask runs it after them.
            after = [o.payload.future for o in ops[0].after if o.payload.future is not None]
            args = _resolve(args)
        else:
            func, args, key, resources, after = _fused_call(ops)
        future = self._submit_now(_ordered, func, after, *args, key=key, resources=resources, pure=False)
        # Weakly: a payload holds its future, which would then never leave this table before close().
        self._futures[future] = [weakref.ref(op.payload) for op in ops]
        for index, op in enumerate(ops):
            op.payload.call = None
            op.payload.future = future
            op.payload.member = index if len(ops) > 1 else None
            op.payload.submitted.set()
        engine = self._engine

        def finished(f):
            for op in ops:
                if f.status == "finished":
                    op.payload.previous = _SETTLED  # the replaced versions are no longer needed for rollback
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

    def _out_refs(self, out, taken) -> dict:
        """References to an update's ``out`` arrays; a ValueError naming the entry that workers cannot write."""
        return out_refs(out, taken, self.n, None if self._shared else self._store)

    def _release_inputs(self, everything=False):
        """Release the stores of updates' inputs whose tasks have all ended (``everything``: all of them)."""
        kept = []
        for store, tasks in self._inputs:
            futures = [t.future for t in tasks]
            if everything or all(f is not None and f.done() for f in futures):
                store.close(clean=all(f is not None and f.status == "finished" for f in futures))
            else:
                kept.append((store, tasks))
        self._inputs = kept

    def _version(self, field, chunk):
        """The current version of ``field`` on ``chunk``: its op's result, once handed to Dask."""
        return _Version(self._vars[(field, chunk.index)].last_write, field)

    def _write_out(self, field, allocate, layout=None):
        """One task per chunk writing ``field`` into what ``allocate(shape, dtype)`` returns (a target, a view);
        ``layout`` (item shape, dtype) if known, else asked of chunk 0."""
        self._check_field(field)
        with self._lock:
            self._rollback_failed()
            first = self._vars[(field, 0)].last_write
        if layout is None:
            layout_future = self._submit_now(_item_layout, _handed(first), field,
                                             key=f"{self._id}-layout-{next(self._ops)}",
                                             resources={device_resource(self.chunks[0].device): 1})
            _wait_all([layout_future])
            layout = layout_future.result()
        item_shape, dtype = layout
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
            # A version that ran once and failed later (Dask rebuilding a lost worker's chunk) has nothing to go
            # back to: it stays, and what reads it fails with its error.
            while op is not None and op.payload.failed() and op.payload.previous is not _SETTLED:
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
