"""A resident batch in host memory: every field one array that the workers map, each update one ``dispatch``.

Where every device of a batch is served by workers on this host (worker
processes, or workers in this process) and none is a real GPU, a chunk's fields
need not live in its worker: the workers map this host's shared memory
(:func:`dsched.shared_empty`), so a field can be a single array for all items,
and a chunk's rows a view of it. :class:`HostBatch` keeps each field so, and
runs an update as one run of :class:`~dsched.resident.host_update.ChunkUpdate`
over the batch: a step costs what a call costs (a fast lane's round trip per
device), not a Dask task per chunk and field. A like update's program is kept
with a :class:`~dsched.dispatch.dispatcher.WorkDispatcher` of its own
(:class:`_UpdateRunner`), which a solver's steps reach without
:func:`dsched.dispatch`'s look at the arguments, and replay from the second on.

- **Chunks.** The batch's chunks are those :func:`dsched.plan` cut it into, the
  same at every update: dispatch cuts them by
  :class:`~dsched.schedulers.planned.PlannedChunks`, which replays the plan.
- **Two arrays per field written.** An update reads the fields' current arrays
  (read-only, by reference) and its chunks write the fields they update into the
  field's *spare* array (dispatch's ``out=``; where the worker can, the results
  are made in those rows and nothing is copied). Once every chunk has ended the
  two swap. A chunk run again (its worker died) reads the values it read the
  first time; a failed chunk's rows are copied from the current array into the
  spare one before the swap, so it keeps its previous values and the others keep
  their results.
- **Order.** Updates return at once and run one after another, in the order
  pushed, on the batch's :class:`~dsched.resident.jobs.JobQueue`; ``get``,
  ``reduce`` and ``set`` wait for the last update that uses the field, and run
  those the queue's thread has not started themselves (a step's ``update`` then
  ``get`` is one call on the caller's thread).
- **Layouts.** A field keeps its item shape and dtype; an update whose results
  change them (or that makes a new field whose layout it does not declare)
  runs without ``out=``, and the arrays dispatch makes are copied into new
  arrays of the fields'. A new field declared (``layouts=``) is allocated first
  and written in place like the others.
- **Memory.** Arrays come from the segment pool (:func:`~dsched.dataplane.store.pooled_empty`).
  ``set`` writes into the field's array (a new one only for a new shape or
  dtype), ``get`` copies the rows out; :meth:`HostBatch.close` lets go of
  every segment at once: back to the pool, where the next batch of the same
  size finds pages the workers have mapped already, or unlinked where something
  else still holds an array (an error's traceback). The arrays a cancelled
  update's chunks may still write into are unlinked as it is cancelled.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref
from concurrent.futures import CancelledError
from dataclasses import dataclass

import numpy as np

from dsched.checks import setting
from dsched.dataplane.loaders import MappingLoader
from dsched.dataplane.segments import free_shared
from dsched.dataplane.store import find_shared, pooled_empty
from dsched.dispatch import WorkDispatcher, dispatch
from dsched.errors import AggregateError
from dsched.resident.host_update import CHUNK_ATTRIBUTE, ChunkUpdate, LayoutChanged, UpdateWork, flat, layout_of
from dsched.resident.hostdata import inputs_in_shared_memory, out_arrays
from dsched.resident.jobs import Job, JobQueue
from dsched.resident.tasks import Update
from dsched.schedulers.planned import PlannedChunks

__all__ = ["HostBatch", "HostUpdate"]

PROGRAMS_KEPT = 8  # ChunkUpdate programs kept per batch: a like update reuses its program and dispatcher


@dataclass
class _Field:
    """A field's arrays: ``current`` holds its values; ``spare`` (made at its first write) takes the next ones."""

    current: np.ndarray
    spare: np.ndarray | None = None


class HostUpdate(Update):
    """The handle of an update in host memory: ``wait()`` blocks until it ran and raises its failure (several
    chunks: :class:`~dsched.AggregateError`); ``done()`` tells without blocking."""

    def __init__(self, batch, job):
        super().__init__(job.label, [])
        self._batch, self._job = batch, job

    @property
    def futures(self) -> list:
        """Dask futures: none (the update is one dispatch call, not a task per chunk)."""
        return []

    def done(self) -> bool:
        return self._job.done

    def wait(self):
        self._batch._wait_for(self._job)
        if self._job.error is not None:
            self._job.reported = True
            raise self._job.error
        return self

    def __repr__(self):
        return f"<Update {self.label!r}: {'done' if self.done() else 'pending'}>"


class HostBatch:
    """A :class:`~dsched.Batch`'s fields in host memory: one array per field, each update one dispatch call.

    Parameters
    ----------
    arrays : dict
        The initial fields, checked (``{name: NumPy array}``, ``n`` items each; may be empty): copied once.
    n : int
        The number of items.
    chunks : list of _Chunk
        The batch's chunks, as :func:`dsched.plan` cut them with ``scheduler``.
    scheduler : WorkScheduler
        The scheduler they were planned with (its capacities hold).
    client : distributed.Client
        A cluster whose workers own the chunks' devices, all on this host (checked).
    shared : bool
        Whether worker processes read the fields (in shared memory); else every worker is in this process.
    """

    def __init__(self, arrays, *, n, chunks, scheduler, client, shared):
        self.n, self.chunks, self.client, self._shared = n, list(chunks), client, shared
        plan = [(c.device, c.size) for c in self.chunks]
        self._planned = PlannedChunks(scheduler, plan)  # the updates' runs, on the lane
        self._planned_reads = PlannedChunks(scheduler, plan)  # reduce and to_zarr, on the caller's thread
        self._reads_lock = threading.Lock()
        self._lock = threading.Lock()  # over the table of fields
        self._fields = {}  # name -> _Field, as the updates that ran left them
        self._names = {}  # the fields as the updates pushed will leave them (keys, in order of appearance)
        self._jobs = []  # pushed jobs not known to have succeeded, in push order
        self._last_use, self._last_write = {}, {}  # field -> the last job pushed that reads or writes it, writes it
        self._programs = collections.OrderedDict()
        self._runners = {}  # id of a kept program -> its _UpdateRunner
        self._segments = set()  # the names of every segment the batch made
        self._closed = False
        self._lane = JobQueue()
        # A batch never closed ends its thread when it is collected (or at exit, its updates cancelled).
        self._stop_lane = weakref.finalize(self, self._lane.stop, 30.0, True)
        try:
            # Each item's chunk: tells a chunk's program which one it runs (a few bytes per item).
            self._rows = self._empty((n,), np.uint16 if len(self.chunks) < 2**16 else np.uint32)
            self._rows[:] = np.repeat(np.arange(len(self.chunks)), [c.size for c in self.chunks])
            for name, array in arrays.items():
                self._fields[name] = _Field(self._copy(array))
                self._names[name] = None
        except BaseException:
            self._free_all()
            raise

    @property
    def fields(self) -> list:
        return sorted(self._names)

    def knows(self, field) -> bool:
        """Whether ``field`` is a field, or will be once the updates pushed ran."""
        return field in self._names

    # --- operations, in program order ------------------------------------------------

    def update(self, spec, arrays, axis, out, layouts=None) -> HostUpdate:
        """:meth:`dsched.Batch.update`: ``spec`` (fn, label, reads, writes and outputs, inplace, kwargs) checked,
        ``arrays`` its own inputs along ``axis``, ``out`` its out= arrays (checked here), ``layouts`` those of
        new fields (checked)."""
        outs = out_arrays(out, set(spec.reads) | set(arrays), self.n, self._shared)
        if self._shared and arrays:  # as they are now: the update runs later
            arrays = inputs_in_shared_memory(arrays)
        job = Job(spec.label, spec.reads, spec.writes,
                  functools.partial(self._apply, spec, arrays, axis, outs, dict(layouts or {})))
        self._push(job)
        return HostUpdate(self, job)

    def set(self, field, array) -> HostUpdate:
        """:meth:`dsched.Batch.set`: waits for the updates pushed before that use ``field``, then writes its array
        (a new one only for a new shape or dtype)."""
        self._wait_for(self._last_use.get(field))
        with self._lock:
            kept = self._fields.get(field)
            if kept is not None and kept.current.shape == array.shape and kept.current.dtype == array.dtype:
                np.copyto(kept.current, array)
            else:
                self._fields[field] = _Field(self._copy(array))
            self._names.setdefault(field)
        job = Job(f"set-{field}", (), (field,), _nothing)
        job.run()  # done already: nothing to wait for
        return HostUpdate(self, job)

    def get(self, field) -> np.ndarray:
        """:meth:`dsched.Batch.get`: a copy of the field's rows, once the updates that write it ran."""
        return self.get_many([field])[field]

    def get_many(self, fields, layouts=None) -> dict:
        """:meth:`dsched.Batch.get_many` (``layouts`` are known here: not needed)."""
        del layouts
        current = self._settled(fields)
        return {field: array.copy() for field, array in current.items()}

    def reduce(self, fn, field, combine=sum):
        """:meth:`dsched.Batch.reduce`: ``fn`` on each chunk's rows where the chunk runs, ``combine`` here."""
        current = self._settled([field])[field]
        with self._reads_lock:
            self._planned_reads.start_at(0)
            with WorkDispatcher(self._planned_reads, _ChunkPartial(fn), client=self.client) as dispatcher:
                return combine(dispatcher.run(MappingLoader({"rows": current})))

    def to_zarr(self, path, fields, overwrite=False) -> str:
        """:meth:`dsched.Batch.to_zarr` into ``path`` (checked): each chunk's rows written by its worker."""
        current = self._settled(fields)
        with self._reads_lock:
            self._planned_reads.start_at(0)
            dispatch(_Named(tuple(current)), *current.values(), scheduler=self._planned_reads, client=self.client,
                     out=path, overwrite=overwrite, host_arrays=True)
        return path

    def wait(self):
        """Wait until every pushed update ran; raises the failures not raised yet."""
        self._wait_for(self._jobs[-1] if self._jobs else None)
        self._raise_failures(None)

    def together(self):
        """:meth:`dsched.Batch.together`: in host memory each update is one call already, so nothing changes."""
        return contextlib.nullcontext()

    def close(self):
        """Cancel the updates still pending, and let go of every segment of the batch at once."""
        if self._closed:
            return
        self._closed = True
        try:
            self._lane.stop(cancel=True)
        finally:
            self._free_all()

    # --- the lane's side: one update -------------------------------------------------------

    def _apply(self, spec, inputs, axis, outs, declared, job):
        """Run one update (on the lane): every chunk at once, the fields' arrays swapped once all have ended.
        ``declared``: the layouts of fields it makes, allocated first so that it runs in place."""
        missing = [f for f in spec.reads if f not in self._fields]
        try:
            if missing:
                raise ValueError(f"reads: no field {missing[0]!r}; the update that was to make it failed")
            if all(f in self._fields or f in declared for f in spec.writes):
                made = [f for f in spec.writes if f not in self._fields]
                if made:
                    self._make(declared, made)
                layouts = {f: layout_of(self._fields[f].current) for f in spec.writes}
                try:
                    return self._run_in_place(spec, inputs, axis, outs, layouts)
                except LayoutChanged:
                    self._unmake(made)  # a field's layout changed (or was declared wrong): run again, learning it
                except BaseException:
                    self._unmake(made)  # a new field is made by every chunk or by none
                    raise
            return self._run_learning(spec, inputs, axis, outs)
        finally:
            if any(field not in self._fields for field in spec.writes):
                with self._lock:  # fields the update was to make and did not: gone (unless pushed again since)
                    for field in spec.writes:
                        if field not in self._fields and self._last_write.get(field) is job:
                            self._names.pop(field, None)

    def _run_in_place(self, spec, inputs, axis, outs, layouts):
        """The update with the fields' layouts known: the chunks write into the spare arrays, failed chunks keep
        their rows, and the arrays swap."""
        program = self._program(spec, inputs, outs, layouts)
        reads = [self._fields[f].current for f in spec.reads]
        targets = {f: self._spare(f) for f in spec.writes}
        failed, errors = set(), []
        first = 0
        while first < len(self.chunks):  # a failure stops a run's dispatching: the chunks it never sent go again
            try:
                reached, error = self._run_from(first, program, reads, inputs, axis, outs, targets)
            except BaseException:  # a Ctrl-C on the thread that runs it: as a cancel
                self._forget_writes(targets)
                raise
            if error is None:
                break
            found = _without_run_notes(list(error.errors) if isinstance(error, AggregateError) else [error])
            failed.update(_failed_chunks(found, range(first, reached)))
            errors += found
            if reached == first or isinstance(error, CancelledError) or \
                    any(isinstance(e, LayoutChanged) for e in errors):
                failed.update(c.index for c in self.chunks[reached:])
                break
            first = reached
        if any(isinstance(e, LayoutChanged) for e in errors):
            raise LayoutChanged(str(next(e for e in errors if isinstance(e, LayoutChanged))))
        if any(isinstance(e, CancelledError) for e in errors):
            self._forget_writes(targets)
            raise next(e for e in errors if isinstance(e, CancelledError))
        self._commit(targets, failed)
        if errors:
            raise errors[0] if len(errors) == 1 else AggregateError.of(errors, dispatched=len(self.chunks))

    def _run_from(self, first, program, reads, inputs, axis, outs, targets):
        """One dispatch of the chunks from ``first`` on; ``(index past the last chunk dispatched, its error)``."""
        self._planned.start_at(first)
        try:
            self._dispatch(program, self.chunks[first].start, reads, inputs, axis, outs, targets)
            error = None
        except Exception as err:  # noqa: BLE001  its chunks' outcomes are read from it
            error = err
        return self._planned.dispatched, error

    def _dispatch(self, program, start, reads, inputs, axis, outs, targets):
        """One run of ``program`` over items ``start:``; with ``targets`` (else the arrays it makes) as ``out``."""
        args = [_items_from(self._rows, start), *(_items_from(a, start) for a in reads),
                *(_items_from(a, start, axis) for a in inputs.values()), *(_items_from(a, start) for a in outs.values())]
        axes = (0,) * (1 + len(reads)) + (axis,) * len(inputs) + (0,) * len(outs)
        out = None  # the layouts learned: dispatch makes the arrays
        if targets is not None:  # in place, the results come flat (ChunkUpdate): one array alone, the shortest path
            out = flat([_items_from(a, start) for a in (*targets.values(), *outs.values())])
            if id(program) in self._runners:  # a kept program (keyword arguments that hash): its own dispatcher
                runner = self._runners[id(program)]
                if runner is None:
                    runner = self._runners[id(program)] = _UpdateRunner(program, len(args), self._planned,
                                                                        self.client)
                return runner.run(args, axes, out)
        return dispatch(program, *args, scheduler=self._planned, client=self.client, axis=axes, out_axis=0,
                        out=out, host_arrays=True)

    def _commit(self, targets, failed):
        """The spare arrays become the fields, with the rows of ``failed`` chunks copied from the current ones."""
        if len(failed) == len(self.chunks):
            return  # nothing changed
        with self._lock:
            for field, target in targets.items():
                kept = self._fields[field]
                for chunk in self.chunks:
                    if chunk.index in failed:
                        target[chunk.start:chunk.stop] = kept.current[chunk.start:chunk.stop]
                kept.current, kept.spare = target, kept.current

    def _forget_writes(self, targets):
        """A cancelled update changes no field. Its chunks may still be running, to write their rows late: the
        spare arrays they write into are dropped and unlinked at once, never back to the pool."""
        with self._lock:
            for field in targets:
                if field in self._fields:
                    self._fields[field].spare = None
        for array in targets.values():
            free_shared(array)  # unlinked now: never back to the pool, where another array could take it

    def _make(self, layouts, fields):
        """New ``fields`` of the declared ``layouts`` (``{field: (item shape, dtype)}``), their values to come."""
        with self._lock:
            for field in fields:
                item_shape, dtype = layouts[field]
                self._fields[field] = _Field(self._empty((self.n, *item_shape), dtype))

    def _unmake(self, fields):
        """The new fields of an update that did not make them: gone again."""
        with self._lock:
            for field in fields:
                self._fields.pop(field, None)

    def _run_learning(self, spec, inputs, axis, outs):
        """The update with a layout to learn (a new field, or one whose items changed): dispatch makes the arrays,
        copied into the fields' own; a failure changes nothing."""
        program = self._program(spec, inputs, outs, None)
        reads = [self._fields[f].current for f in spec.reads]
        self._planned.start_at(0)
        fields, rows_out = self._dispatch(program, 0, reads, inputs, axis, outs, None)
        for name, array in rows_out.items():
            np.copyto(outs[name], array)
        with self._lock:
            for field, array in fields.items():
                kept = self._fields.get(field)
                spare = kept.current if kept is not None and layout_of(kept.current) == layout_of(array) else None
                self._fields[field] = _Field(self._copy(array), spare)
        for array in fields.values():  # dispatch's arrays, copied into the batch's own: unlinked now, not pooled
            free_shared(array)

    def _spare(self, field):
        kept = self._fields[field]
        if kept.spare is None:
            kept.spare = self._empty(kept.current.shape, kept.current.dtype)
        return kept.spare

    def _program(self, spec, inputs, outs, layouts):
        """The update's :class:`ChunkUpdate`: a like update's again, run by its own dispatcher
        (:class:`_UpdateRunner`), whose replays then send each feed one small message per step."""
        try:
            # With Dask's config of result placement, which a runner's dispatcher reads once, as dispatch() does.
            key = (spec.fn, spec.label, spec.reads, spec.writes, spec.inplace, tuple(sorted(spec.kwargs.items())),
                   tuple(inputs), tuple(outs), None if layouts is None else tuple(sorted(layouts.items())),
                   bool(setting("place-results", True)))
            program = self._programs.get(key)
        except TypeError:  # keyword arguments that are not hashable: a program of its own
            return ChunkUpdate(spec, inputs, outs, layouts, self.chunks)
        if program is None:
            program = self._programs[key] = ChunkUpdate(spec, inputs, outs, layouts, self.chunks)
            self._runners[id(program)] = None  # kept: its runner is made at its first run in place
            while len(self._programs) > PROGRAMS_KEPT:
                runner = self._runners.pop(id(self._programs.popitem(last=False)[1]), None)
                if runner is not None:
                    runner.close()
        self._programs.move_to_end(key)
        return program

    # --- the caller's side: order and failures ------------------------------------------------

    def _push(self, job):
        with self._lock:
            self._jobs = [j for j in self._jobs if not j.done or (j.error is not None and not j.reported)]
            self._jobs.append(job)
            for field in job.writes:
                self._names.setdefault(field)
            for field in job.reads + job.writes:
                self._last_use[field] = job
            for field in job.writes:
                self._last_write[field] = job
        self._lane.push(job)

    def _wait_for(self, job):
        """Wait until ``job`` (and so every job pushed before it) ended; a Ctrl-C cancels what is pending."""
        if job is None:
            return
        try:
            self._lane.help(job)  # run here what the queue's thread has not started: no hand-off per step
        except KeyboardInterrupt:
            for pending in list(self._jobs):
                pending.cancel()
            raise

    def _settled(self, fields) -> dict:
        """``{field: its current array}`` once the updates pushed before that write them ran; raises their failures
        not raised yet."""
        for field in fields:
            self._wait_for(self._last_write.get(field))
        self._raise_failures(set(fields))
        with self._lock:
            missing = [f for f in fields if f not in self._fields]
            if missing:
                raise ValueError(f"field: no field {missing[0]!r} in this batch (fields: {', '.join(self.fields)})")
            return {field: self._fields[field].current for field in fields}

    def _raise_failures(self, fields):
        """Raise the failures not raised yet of the jobs that ended and write one of ``fields`` (``None``: any)."""
        with self._lock:
            errors = []
            for job in self._jobs:
                if job.done and job.error is not None and not job.reported and (
                        fields is None or fields.intersection(job.writes)):
                    job.reported = True
                    errors.append(job.error)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise AggregateError.of(errors)

    # --- memory ---------------------------------------------------------------------------

    def _empty(self, shape, dtype):
        if not self._shared:
            return np.empty(shape, dtype)
        # From the pool, back there once let go of: a new batch of the same size (a driver per history) reuses
        # pages the workers have mapped, rather than faulting 12 MB of new pages per chunk and field.
        array = pooled_empty(shape, dtype)
        self._segments.add(find_shared(array).token)
        return array

    def _copy(self, array):
        copy = self._empty(array.shape, array.dtype)
        np.copyto(copy, array)
        return copy

    def _free_all(self):
        """Let go of every segment of the batch now: those whose arrays nothing else holds go back to the pool as
        the batch drops them; the others (an error's traceback may hold a field) are unlinked, and their arrays in
        this process stay valid while referenced."""
        with self._lock:
            segments, self._segments = self._segments, set()
            self._fields.clear()
            self._programs.clear()
            runners, self._runners = [r for r in self._runners.values() if r is not None], {}
            self._rows = None
        for runner in runners:
            runner.close()
        for token in segments:
            free_shared(token)  # those back in the pool, or unlinked already, are passed over


def _failed_chunks(errors, dispatched) -> set:
    """The indexes of the chunks that failed, of those a run dispatched: each error :class:`ChunkUpdate` raised
    names its chunk; an error that names none (dispatch's own, or one whose pickling lost the name) fails them
    all, so that no chunk is taken for done that was not."""
    named = [getattr(error, CHUNK_ATTRIBUTE, None) for error in errors]
    if any(index is None for index in named):
        return set(dispatched)
    return set(named)


def _without_run_notes(errors) -> list:
    """``errors`` without the note dispatch adds to a failed chunk (its index and items count from where the run
    started, part-way through the batch); :class:`ChunkUpdate` notes the batch's chunk instead."""
    for error in errors:
        notes = getattr(error, "__notes__", None)
        if notes:
            notes[:] = [note for note in notes if not note.startswith("dsched: chunk ")]
    return errors


def _nothing(job):
    del job


def _items_from(array, start, axis=0):
    """``array``'s items from ``start`` on along ``axis``: from 0, the array itself (a solver's step passes the same
    arrays every time, so they are found where they lie in shared memory once)."""
    return array if start == 0 else array[(slice(None),) * axis + (slice(start, None),)]


class _UpdateRunner:
    """A kept program's own dispatcher, and the loader of its last run: a like update skips :func:`dsched.dispatch`'s
    front (its layout of the arguments, its look-up of a recent call) and runs straight on it."""

    def __init__(self, program, count, scheduler, client):
        work = UpdateWork(program, count)
        self.keys = work.keys  # the loader's names for a chunk's arrays, as the work reads them
        self.dispatcher = WorkDispatcher(scheduler, work, join="concat", axis=0, client=client)
        self.signature = self.loader = None

    def run(self, arrays, axes, out):
        """Run the update over ``arrays`` (each along its entry of ``axes``), its results written into ``out``."""
        signature = (axes, *[(type(a), a.shape, a.dtype) for a in arrays])
        if signature == self.signature:
            loader = self.loader.like(dict(zip(self.keys, arrays)))
        else:
            loader = MappingLoader(dict(zip(self.keys, arrays)), axis=dict(zip(self.keys, axes)))
        dispatcher = self.dispatcher
        dispatcher.out = out
        try:
            result = dispatcher.run(loader)
        finally:  # nothing of this run's arrays is kept
            dispatcher.out = dispatcher.last_run = dispatcher._last_generator = None
        if signature != self.signature:
            self.signature, self.loader = signature, loader.like({})
        return result

    def close(self):
        self.dispatcher.close()


class _ChunkPartial:
    """``do_work`` of :meth:`HostBatch.reduce`: ``fn`` on a chunk's rows (read-only); a small result back."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, work, device):
        result = self.fn(work["rows"])
        return result.get() if hasattr(result, "__cuda_array_interface__") else result


class _Named:
    """``dispatch``'s function for :meth:`HostBatch.to_zarr`: the fields' rows as ``{name: rows}``."""

    def __init__(self, names):
        self.names = names
        self.__name__ = "to_zarr"

    def __call__(self, *arrays):
        return dict(zip(self.names, arrays))
