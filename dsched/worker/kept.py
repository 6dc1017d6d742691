"""Chunks a feed keeps for replays: decoded and resolved once, run again on each like call.

A dispatcher whose calls repeat (a solver's call at every Newton iteration) replays
its last plan (:mod:`dsched.dispatch.replay`): it sends each feed's lane that
feed's chunks once, under a plan id (:data:`~dsched.worker.lane.KEEP`), and from
then on only :data:`~dsched.worker.lane.AGAIN`: the plan id and where this call's
outputs go. The feed's thread keeps the chunks with their inputs already mapped
(the dispatcher rewrites the same input segment before each call), and the
output rows of the last few output segments, so a call costs the model, the
write of its result, and one small message each way.
"""

from __future__ import annotations

import collections
import pickle

import numpy as np

from dsched.dataplane.pinned import is_real_gpu
from dsched.dataplane.store import ArrayRef, SharedWork, SliceRef, resolve_work
from dsched.devices.context import enter_device, is_emulated_here, leave_device
from dsched.devices.device import Device
from dsched.worker.chunk import PROGRAMS_KEPT, ProgramRef, _compute
from dsched.worker.result_placement import run_and_write

__all__ = ["KeptPlans", "KeptPrograms", "PLANS_KEPT", "PLACE_FROM"]

# Plans a feed keeps (a plan holds its inputs' mappings: older ones are let go). A NEML2 model with a history reads
# its old state as numbers in its first steps (a plan per step until its state is all arrays), and its steady plan
# has a few placements (dsched.dispatch.replay.INPUTS_KEPT): all of them kept, a solver's steps send no chunks again.
PLANS_KEPT = 8
# Output segments per plan whose rows are kept mapped. The pool lends a few in turn: a solver holding its last two
# steps' outputs while the next call's are allocated (dsched.dispatch.replay's spare) cycles through five.
OUTPUTS_KEPT = 8
PLACE_FROM = 1 << 18  # bytes of a chunk's outputs from which its results are allocated in their rows


class _KeptChunk:
    """One chunk of a plan: its index, its work (resolved once where that is safe) and its output slot."""

    __slots__ = ("index", "work", "resolved", "slot", "views_only")

    def __init__(self, index, work, slot):
        self.index, self.work, self.slot = index, work, slot
        self.resolved = None
        self.views_only = _views_only(work)  # its inputs are NumPy views of placed arrays, and plain values

    def inputs(self, moves=None):
        """The chunk's inputs as its model sees them. Read-only NumPy views of the plan's input segment stay valid
        from call to call (the dispatcher rewrites the segment); torch inputs are private copy-on-write mappings
        a model may write into, so they are made again for each call. ``moves``: where this call's inputs lie,
        for those not where the kept chunks read them (:func:`_moved_work`); resolved for this call only."""
        if moves:
            return resolve_work(self.at(moves))
        if self.resolved is not None:
            return self.resolved
        work = resolve_work(self.work)
        if self.views_only:
            self.resolved = work
        return work

    def at(self, moves):
        """The chunk's work for a call whose inputs of ``moves`` lie elsewhere in shared memory."""
        return _moved_work(self.work, moves) if moves and isinstance(self.work, SharedWork) else self.work


class _KeptPlan:
    """A plan's chunks for one feed, and the output rows of the output segments its calls used lately."""

    def __init__(self, chunks, device):
        self.chunks = [_KeptChunk(index, work, slot) for index, work, slot in chunks]
        self.real_gpu = is_real_gpu(device)  # the feed's device is a GPU this process computes on with CuPy
        # NumPy chunks need no move: the CPU, or an emulated GPU (a real one without CuPy refuses them, as ever)
        self.on_host = not Device(device).is_cuda or is_emulated_here()
        self.outputs = collections.OrderedDict()  # targets -> [(slot, rows)] per chunk

    def jobs(self, targets) -> list:
        """``[(index, chunk, slot, rows)]``: each chunk with its outputs written into ``targets``, pickled (the
        client sends the same bytes for the same outputs: read once) or ``None`` for the plan's own."""
        slots = self.outputs.get(targets)
        if slots is None:
            refs = None if targets is None else pickle.loads(targets)
            slots = [_with_rows(_retarget(c.slot, refs)) for c in self.chunks]
            if all(rows is not None for slot, rows in slots if slot is not None):  # else: mapped as each runs
                self.outputs[targets] = slots
            while len(self.outputs) > OUTPUTS_KEPT:
                self.outputs.popitem(last=False)
        else:
            self.outputs.move_to_end(targets)
        return [(c.index, c, slot, rows) for c, (slot, rows) in zip(self.chunks, slots)]


class KeptPlans:
    """The plans one feed keeps, by id, the most recently used last."""

    def __init__(self):
        self._plans = collections.OrderedDict()

    def keep(self, plan_id, chunks, device):
        """Keep ``chunks`` (``[(index, work, slot)]``) of the feed's ``device`` under ``plan_id``; the plan."""
        plan = self._plans[plan_id] = _KeptPlan(chunks, device)
        self._plans.move_to_end(plan_id)
        while len(self._plans) > PLANS_KEPT:
            self._plans.popitem(last=False)
        return plan

    def get(self, plan_id):
        plan = self._plans.get(plan_id)
        if plan is not None:
            self._plans.move_to_end(plan_id)
        return plan

    def clear(self):
        self._plans.clear()


class KeptPrograms:
    """The programs one feed's inbox keeps, by their dispatcher's id, the most recently used last
    (:data:`~dsched.worker.chunk.PROGRAMS_KEPT`): a solver whose calls take turns between models rearms the feed
    with a :class:`~dsched.worker.chunk.ProgramRef` to one of them, and its copy here runs again (no copy
    unpickled on every turn, its caches warm)."""

    def __init__(self):
        self._programs = collections.OrderedDict()

    def __iter__(self):
        return iter(self._programs)

    def __len__(self):
        return len(self._programs)

    def add(self, program):
        """Keep ``program``, a feed task's. The feed may run a newer one (a successor's task can start after a
        newer run's rearm), so one new here is kept as the least recently used."""
        if program.dispatcher_id not in self._programs:
            self._programs[program.dispatcher_id] = program
            self._programs.move_to_end(program.dispatcher_id, last=False)
            self._trim()

    def resolve(self, carried):
        """The program a rearm carries, kept as the most recently used: ``carried`` itself, or the one its
        :class:`~dsched.worker.chunk.ProgramRef` names; ``None`` for a name no longer kept (nor ``None`` given)."""
        if isinstance(carried, ProgramRef):
            carried = self._programs.get(carried.dispatcher_id)
            if carried is None:
                return None
        self._programs.pop(carried.dispatcher_id, None)
        self._programs[carried.dispatcher_id] = carried
        self._trim()
        return carried

    def _trim(self):
        while len(self._programs) > PROGRAMS_KEPT:
            self._programs.popitem(last=False)


def run_kept(program, device, chunk, slot, rows, plan, moves=None):
    """Run one kept chunk of ``plan``: its result written in place; what :meth:`OutputSlot.write` returns.
    ``moves``: where this call's inputs lie, for those not where the kept chunks read them (the message's last
    field)."""
    if slot is None or plan.real_gpu:  # the full path: page-locked inputs, a stream of its own
        return _compute(program, device, chunk.at(moves), slot)
    work = chunk.inputs(moves)
    # rows (_with_rows): None, [] where no output lies in memory, else _Rows, with their views and size
    if rows and program.takes_out:
        out = rows.views if rows.views is not None else slot.views(rows)
    else:
        out = None
    # A copy worth saving: results allocated in their rows. Not for a model given its rows (out=): it computes there.
    if out is None and rows and program.place_results and rows.nbytes >= PLACE_FROM:
        return run_and_write(program, slot, rows, lambda: program.run(device, work, out), device)
    on_host = getattr(program.do_work, "on_host", None) if plan.on_host else None  # dispatch's: nothing to move
    token = enter_device(device)  # running_on(device); no GPU to select
    try:
        if on_host is not None and chunk.views_only and program.preprocess is program.postprocess is None:
            result = on_host(work) if out is None else on_host(work, out=out)
        else:
            result = program.call(device, work, out)
    finally:
        leave_device(token)
    return slot.write(result, device, rows=rows)


def _moved_work(work: SharedWork, moves: dict) -> SharedWork:
    """``work`` with the arrays of ``moves`` (``{key: (segment token, offset)}``; key ``None`` for an array
    loader's one array) read where they lie now: the same rows of an array of the same shape elsewhere in shared
    memory (a solver's step ``k`` of a history, or the state its last call returned)."""
    if isinstance(work.payload, SliceRef):
        return SharedWork(_moved(work.payload, moves[None])) if None in moves else work
    return SharedWork({k: _moved(v, moves[k]) if k in moves else v for k, v in work.payload.items()})


def _moved(piece: SliceRef, where) -> SliceRef:
    token, offset = where
    ref = piece.ref  # built field by field: dataclasses.replace costs several times more, per input and call
    return SliceRef(ArrayRef(token, ref.shape, ref.dtype, ref.pid, True, offset), piece.axis, piece.start, piece.stop,
                    piece.template)


def _nbytes(rows) -> int:
    return sum(r.nbytes for r in rows if r is not None)


class _Rows(list):
    """A chunk's output rows (:meth:`~dsched.dataplane.outputs.OutputSlot.rows`), kept with what each call of a
    replay asks of them: their views for a model's ``out=``, and their size."""

    __slots__ = ("views", "nbytes")


def _with_rows(slot) -> tuple:
    """``(slot, its rows)``; rows ``None`` where they cannot be mapped now (the chunk's write says why)."""
    if slot is None:
        return None, None
    try:
        rows = slot.rows()
    except Exception:  # noqa: BLE001  a segment gone: the chunk fails with the reason as it writes
        return slot, None
    if not rows:
        return slot, rows
    kept = _Rows(rows)
    views = slot.views(rows)
    # An array, or a tuple of them, serves every call; a dict (or list) of them is made again for each, since a
    # model may change what it holds.
    plain = type(views) is np.ndarray or type(views) is tuple and all(type(v) is np.ndarray for v in views)
    kept.views = views if plain else None
    kept.nbytes = _nbytes(rows)
    return slot, kept


def _retarget(slot, targets):
    if slot is None or targets is None:
        return slot
    return type(slot)(slot.layout, targets, slot.start, slot.stop, slot.index)


def _views_only(work) -> bool:
    """Whether ``work``'s arrays are all NumPy slices of placed arrays (no torch template, nothing streamed)."""
    if not isinstance(work, SharedWork):
        return False
    payload = work.payload
    values = [payload] if isinstance(payload, SliceRef) else list(payload.values())
    return all(v.template is None if isinstance(v, SliceRef) else _plain(v) for v in values)


def _plain(value) -> bool:
    """A value passed whole that resolves to itself (not rows streamed from Zarr or Dask)."""
    return type(value).__module__.partition(".")[0] in ("builtins", "numpy")
