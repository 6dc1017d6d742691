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
from dsched.devices import backends
from dsched.devices.backends import array_module
from dsched.devices.context import running_on, selected
from dsched.errors import AggregateError

__all__ = ["Update", "read_only"]


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

    __slots__ = ("future", "previous", "submitted", "call", "member", "outcome", "__weakref__")

    def __init__(self, call, previous):
        self.call, self.previous = call, previous  # call: (func, args, key, resources) until submitted
        self.future = None
        self.member = None  # in a fused task (see _run_fused): its index there
        self.submitted = threading.Event()
        self.outcome = None  # (status, error), kept when its batch closes and its future is released

    def result(self):
        """The future, once the task was handed to Dask (waits for that); ``None`` if it could not be."""
        self.submitted.wait()
        return self.future

    def failed(self) -> bool:
        """Whether it failed (or was cancelled) in Dask, or could not be handed to Dask at all."""
        if self.future is not None:
            return self.future.status in ("error", "cancelled")
        return self.outcome is not None and self.outcome[0] == "error"

    def not_handed(self, error):
        """It could not be handed to Dask (``error`` says why): it failed, and its waiters learn so at once."""
        self.call, self.outcome = None, ("error", error)
        self.submitted.set()


@dataclass(frozen=True)
class _Version:
    """A field's version in a task's arguments: replaced by its op's future when the task is handed to Dask."""

    op: object
    field: str


@dataclass(slots=True)
class _UpdateSpec:
    """What every chunk task of one update needs, shipped with it (not frozen: its fields are set at once, and
    one is made per update)."""

    fn: object
    label: str
    reads: tuple
    writes: tuple
    inplace: bool
    kwargs: dict


# --- what runs on the workers ---------------------------------------------------

def read_only(array):
    """A read-only view of a NumPy ``array`` (anything else as it is): what a caller or a chunk may read, not write."""
    if isinstance(array, np.ndarray):
        array = array.view()
        array.flags.writeable = False
    return array


def _on_device(array, device, copy=False):
    """``array`` in the device's memory: CuPy on a GPU; on the CPU and emulated devices the array itself.

    On the host, shared memory (the batch's lineage, kept until it closes) is
    already where the chunk computes: the version is a read-only view of it,
    copied only by an in-place update, on its first write. ``copy``: the
    caller's own array (in-process workers), copied so the batch owns it.
    """
    xp = array_module(device)
    if xp is not np:
        return xp.asarray(array)
    return np.array(array, copy=True) if copy else array


def _load(chunk, refs):
    """A chunk's first (or set) version of some fields: the data plane's rows, on the device."""
    with running_on(chunk.device), selected(chunk.device):
        return {name: _on_device(ref.resolve(), chunk.device, copy=not ref.ref.shared) if isinstance(ref, SliceRef)
                else _on_device(ref, chunk.device) for name, ref in refs.items()}


def _load_set(chunk, refs, generation_ref, generation):
    """A chunk's version of fields given by ``Batch.set``: its rows, copied, from the field's reused segment.

    The segment is written again by the field's next ``set`` (:class:`~dsched.resident.batch.Batch` keeps
    ``/dev/shm`` flat), so the version is a copy, and a load run again later (Dask rebuilding a lost worker's
    chunk) finds another generation there and fails rather than load the newer values.
    """
    found = int(generation_ref.rows(0, 1)[0])
    if found != generation:
        raise RuntimeError(f"{chunk}: the values set() gave as generation {generation} of "
                           f"{', '.join(refs)} were overwritten by generation {found}; a lost worker's chunk "
                           "cannot be rebuilt from them (set the field again)")
    with running_on(chunk.device), selected(chunk.device):
        return {name: _on_device(ref.resolve(), chunk.device, copy=True) for name, ref in refs.items()}


def _writable(array):
    """``array`` to mutate in place: itself, or a private copy of a read-only (data-plane) NumPy version."""
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        return array.copy()
    return array


def _ordered(func, after, *args):
    """``func(*args)``, run by Dask once the operations in ``after`` (their futures, resolved) have finished."""
    del after
    return func(*args)


def _update(spec, chunk, versions, inputs=None, out=None):
    """One chunk of an update: ``fn`` on the chunk's fields where they live; the written fields' new versions.

    ``inputs`` are the update's own arrays (its ``inputs=``): the chunk's rows, by reference;
    ``out`` its ``out=`` arrays: the chunk's rows, writable, where the client reads them.
    """
    arrays = {}
    for field, (value, name) in versions.items():
        array = _pick(value)[name]
        arrays[field] = _writable(array) if (spec.inplace and field in spec.writes) else read_only(array)
    for name, ref in (inputs or {}).items():
        arrays[name] = ref.resolve() if isinstance(ref, SliceRef) else ref
    for name, ref in (out or {}).items():
        arrays[name] = ref.ref.rows(ref.start, ref.stop, writable=True)
    with running_on(chunk.device), selected(chunk.device):
        result = spec.fn(**arrays, **spec.kwargs)
        # Arrays stay as fn made them (torch tensors stay tensors: no round trip through NumPy per step).
        return {field: value if backends.backend_of(value, strict=False) is not None else np.asarray(value)
                for field, value in checked_result(spec, chunk, result).items()}


def checked_result(spec, chunk, result) -> dict:
    """What an update's ``fn`` returned on ``chunk``: ``{field: value}`` of the fields it writes, each with the
    chunk's items along axis 0; a :class:`ChunkResultError` naming the update, the chunk and the field otherwise."""
    if result is None and not spec.writes:  # it wrote only into its out= rows
        result = {}
    if type(result) is dict and len(result) == len(spec.writes) and all(
            type(result.get(f)) is np.ndarray and result[f].ndim and len(result[f]) == chunk.size
            for f in spec.writes):
        return result if tuple(result) == spec.writes else {field: result[field] for field in spec.writes}
    where = f"update {spec.label!r}: {chunk}"  # the checks one by one, for the message
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
    for field in spec.writes:
        shape = getattr(result[field], "shape", None)
        if shape is None or len(shape) == 0 or shape[0] != chunk.size:
            got = "no batch axis" if not shape else f"{shape[0]} items (shape {tuple(shape)})"
            raise ChunkResultError(f"{where}: field {field!r} has {got}; expected {chunk.size} items along "
                                   f"axis 0 (the chunk's size)")
    return {field: result[field] for field in spec.writes}


def _to_host(array) -> np.ndarray:
    """A version in host memory, as NumPy (CuPy, torch and NEML2 tensors alike)."""
    if type(array) is np.ndarray:  # the usual case, without asking every backend
        return array
    if backends.backend_of(array, strict=False) is None:
        return np.asarray(array)
    return backends.host_view(backends.to_host(array))


def _item_layout(value, name):
    array = _to_host(_pick(value)[name])
    return tuple(array.shape[1:]), np.dtype(array.dtype).str


def _write(value, name, target, chunk, layout, field):
    """Write a chunk's version of ``field`` into rows ``start:stop`` of ``target`` (shared memory or Zarr)."""
    array = _to_host(_pick(value)[name])
    if (tuple(array.shape[1:]), np.dtype(array.dtype).str) != layout:
        raise ChunkResultError(f"field {field!r}: {chunk} holds items of shape {tuple(array.shape[1:])} and dtype "
                               f"{array.dtype}; chunk 0 holds {layout[0]}, {np.dtype(layout[1])}")
    write_rows(target, 0, chunk.start, chunk.stop, array)


def _item_layouts(values):
    """``{field: (item shape, dtype)}`` of one chunk's versions (``values``: field -> its op's result)."""
    return {field: _item_layout(value, field) for field, value in values.items()}


def _write_many(values, targets, chunk, layouts):
    """:func:`_write` of several fields of one chunk (``values``: field -> its op's result), in one task."""
    for (field, value), target, layout in zip(values.items(), targets, layouts):
        _write(value, field, target, chunk, layout, field)


def _partial(fn, value, name, chunk):
    """``fn`` on a chunk's version of a field, where it lives; a device result comes back to the host."""
    with running_on(chunk.device), selected(chunk.device):
        result = fn(read_only(_pick(value)[name]))
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
        return all(task.outcome is not None or (task.submitted.is_set() and task.future.done())
                   for task in self._tasks)

    def wait(self):
        if all(task.outcome is not None for task in self._tasks):  # its batch is closed: its futures are gone
            _raise_outcomes(self._tasks)
        else:
            _wait_tasks(self._tasks)
        return self

    def __repr__(self):
        state = "done" if self.done() else "pending"
        return f"<Update {self.label!r}: {len(self._tasks)} chunks, {state}>"


def _raise_failures(futures):
    _raise_errors(future.exception() for future in futures if future.status == "error")


def _raise_errors(found):
    """Raise the errors (each once; several as an :class:`~dsched.AggregateError`), if any."""
    errors, seen = [], set()
    for error in found:
        if id(error) not in seen and str(error) not in {str(e) for e in errors}:
            seen.add(id(error))
            errors.append(error)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise AggregateError.of(errors)


def _record_outcome(future, payloads):
    """Keep how ``future`` ended on its ops' payloads (weak references: gone ones are skipped), before its batch
    releases it."""
    status = future.status
    outcome = (status, future.exception() if status == "error" else None)
    for ref in payloads:
        payload = ref()
        if payload is not None:
            payload.outcome = outcome


def _raise_outcomes(tasks):
    """Raise what the recorded outcomes say failed; a RuntimeError for a task its batch closed before it ran."""
    if any(task.outcome[0] not in ("finished", "error") for task in tasks):
        raise RuntimeError("this update had not run when its Batch was closed")
    _raise_errors(task.outcome[1] for task in tasks if task.outcome[0] == "error")


def _wait(futures):
    """Wait until every future is done, on the futures' own client (``distributed.wait`` asks the default
    client, which is another one, on another event loop, when a process holds two). ``None`` (a task that
    never reached Dask) is skipped."""
    futures = [future for future in futures if future is not None]
    if futures:
        from distributed.client import _wait

        futures[0].client.sync(_wait, list(futures))


def _wait_unless_released(futures):
    """:func:`_wait`, where a future the client released meanwhile (Dask then calls it cancelled) is not waited
    for: nothing needs its outcome. Closing a batch waits so, for what still runs."""
    from distributed.client import FuturesCancelledError

    while True:
        futures = [future for future in futures if future is not None and future.status != "cancelled"]
        try:
            return _wait(futures)
        except FuturesCancelledError:  # one was released while we waited: wait for the others
            continue


def _wait_all(futures):
    _wait(futures)
    _raise_failures(futures)


def _wait_tasks(tasks):
    """Wait until every task was handed to Dask and finished; raise the failures (of a task that could not be
    handed to Dask, what stopped it)."""
    futures = [task.result() for task in tasks]
    _wait(futures)
    _raise_errors([task.outcome[1] for task, future in zip(tasks, futures) if future is None and task.failed()]
                  + [future.exception() for future in futures if future is not None and future.status == "error"])


def _resolve(args, local=None, used=None):
    """Task arguments with every :class:`_Version` replaced by its op's future (nested in tuples and dicts).

    A version made by a fused task is ``(_MEMBER, its future, its index there)``; one made earlier in the
    same fused task (``local``: op -> index) is a :class:`_Local`, whose index is added to ``used``.
    """
    if isinstance(args, _Version):
        op = args.op
        if local is not None and op in local:
            used.add(local[op])
            return _Local(local[op])
        task = op.payload
        if task.future is None:  # an earlier operation of the chunk could not be handed to Dask
            reason = task.outcome[1] if task.outcome and task.outcome[1] else "it was not handed to Dask"
            raise RuntimeError(f"it reads the result of an operation that did not run ({reason})")
        return task.future if task.member is None else (_MEMBER, task.future, task.member)
    if isinstance(args, tuple):
        return tuple(_resolve(a, local, used) for a in args)
    if isinstance(args, dict):
        return {k: _resolve(v, local, used) for k, v in args.items()}
    return args


# --- fused tasks: several updates of one chunk in one task ---------------------------

_MEMBER = "dsched-fused-member"  # marks a version made by a fused task: (_MEMBER, the task's results, index)


@dataclass(frozen=True)
class _Local:
    """In a fused task's arguments: the result of its member ``index``, computed earlier in the same task."""

    index: int


def _pick(value):
    """A version's op result, as it came or picked out of a fused task's results."""
    if isinstance(value, tuple) and len(value) == 3 and value[0] == _MEMBER:
        return value[1][value[2]]
    return value


def _locals(args, results):
    if isinstance(args, _Local):
        return results[args.index]
    if isinstance(args, tuple):
        return tuple(_locals(a, results) for a in args)
    if isinstance(args, dict):
        return {k: _locals(v, results) for k, v in args.items()}
    return args


def _run_fused(entries, keep, last_use):
    """Several operations of one chunk, one after another, in one task: ``{index: result}`` of the members
    whose versions outlive it (``keep``: index -> the fields to keep).

    ``entries`` are ``(func, args)`` in program order; ``last_use[i]`` is the last member that reads
    member ``i``'s result: it is dropped after that one, so the chunk holds one version at a time.
    """
    results = {}
    for j, (func, args) in enumerate(entries):
        results[j] = func(*_locals(args, results))
        for i in [i for i in results if last_use.get(i, -1) <= j]:  # no later member reads it
            if keep.get(i):
                results[i] = {field: value for field, value in results[i].items() if field in keep[i]}
            else:
                del results[i]
    return results


# --- the client's helpers ------------------------------------------------------------------

def _fused_call(ops):
    """``(func, args, key, resources, after)`` of one task running ``ops`` (updates of one chunk) in order.

    A member keeps, for after the task, the fields no later member writes; it is dropped on the
    worker once no later member reads it. Members succeed or fail (and roll back) together.
    """
    local = {op: index for index, op in enumerate(ops)}
    entries, after, last_use = [], {}, {}
    for index, op in enumerate(ops):
        func, args, key, resources = op.payload.call
        used = set()
        entries.append((func, _resolve(args, local, used)))
        for earlier in used:
            last_use[earlier] = index
        for o in op.after:
            if o not in local and o.payload.future is not None:  # (None: it failed before reaching Dask)
                after[o.payload.future.key] = o.payload.future
    keep = {}
    for index, op in enumerate(ops):
        later = {var.name[0] for o in ops[index + 1:] for var in o.writes}
        keep[index] = tuple(var.name[0] for var in op.writes if var.name[0] not in later)
    first = ops[0].payload.call[2]
    return _run_fused, (entries, keep, last_use), f"{first}-fused-{len(ops)}", resources, list(after.values())


def _on_loop_thread(client) -> bool:
    """Whether this thread runs ``client``'s event loop (a Dask callback): it can submit directly."""
    import asyncio

    try:
        return asyncio.get_running_loop() is client.loop.asyncio_loop
    except RuntimeError:
        return False


def _handed(op):
    """An op's result in a task's arguments, once it was handed to Dask (waits for that)."""
    op.payload.result()
    return _resolve(_Version(op, None))


def _client(client):
    if client is not None:
        return client
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        raise ValueError("client: no Dask client given and none is current; pass client=Client(cluster)") from None
