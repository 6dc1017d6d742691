"""A chunk's results allocated where they go: which NumPy allocation becomes each output, learned on a worker.

A model that returns new arrays makes its worker copy each result into the
chunk's output rows: one more pass over every output byte, on the worker's
core. But a NumPy model allocates the same arrays in the same order for every
chunk of a size. So a worker watches the first two such chunks of a model
(every allocation logged and followed by :mod:`dsched.dataplane.numpy_handler`)
and notes, for each output, the allocation its result came from: the *plan*.
It adopts the plan when both chunks agree and the second left nothing of its
own alive behind it (a model that keeps arrays, such as a cache or a memo of
its results, is never placed). From then on the allocations the plan names
are made in each chunk's own output rows, the arrays the model returns
already lie where they go, and the copy is skipped
(:func:`dsched.dataplane.pinned.copy_to_host` sees the same memory).

The plan is a guess, checked at every chunk, so a wrong one costs a copy:

- a result that is not in its rows is copied there as before, and the plan
  is learned again (given up after :data:`MISSES_ALLOWED` misses);
- a result that overlaps another output's rows is copied aside before
  anything is written (:meth:`~dsched.dataplane.outputs.OutputSlot.write`);
- a placed array still alive after its chunk, and again when the model's
  next chunk starts, means the model keeps arrays: it is never placed again
  in that process (a warning says so), since its later writes to such an
  array would land in the outputs. The array keeps its memory mapped while
  it lives.

A model that takes ``out=`` is watched like any other: what it computes
into its rows lies there already, and a plan covers the results it
allocates (a batch's update writes its ``out=`` rows and returns new
fields); one that allocates none of them is given up at its first chunk.
Not watched are GPU chunks, torch or NEML2 results, outputs that are
not in memory (a Zarr store) or travel by value, nor models that make more
than one allocation per :data:`BYTES_PER_ALLOCATION` of the outputs placed.
The Dask config ``dsched.place-results: false``, where a dispatcher is made,
turns placing off for its runs
(:attr:`~dsched.worker.chunk.ChunkProgram.place_results`).
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
from dataclasses import dataclass

import numpy as np

from dsched.dataplane.numpy_handler import live_placements, places_here, placing, still_alive
from dsched.dataplane.outputs import ChunkResultError
from dsched.dataplane.pinned import same_memory

__all__ = ["run_and_write", "placement_counts", "BYTES_PER_ALLOCATION", "MISSES_ALLOWED", "PLANS_KEPT"]

logger = logging.getLogger("dsched")

MISSES_ALLOWED = 3  # plans that missed before a model is no longer placed (its allocations vary)
# The handler costs about a microsecond per allocation (a Python call), the price of copying some 10 KB:
# a model is placed only if the outputs placed hold this many bytes per allocation it makes.
BYTES_PER_ALLOCATION = 32 * 1024
PLANS_KEPT = 256  # plans kept per worker process, the least recently used dropped first


@dataclass
class _Plan:
    positions: dict = None  # adopted: output index -> position of the allocation its result comes from
    candidate: dict = None  # seen on one watched chunk: adopted when the next one agrees and keeps nothing
    pending: tuple = None  # (call or None, addresses) alive after the last chunk: judged when the next starts
    misses: int = 0
    never: bool = False


_plans: "collections.OrderedDict[tuple, _Plan]" = collections.OrderedDict()
_lock = threading.Lock()  # over the plans (a process's worker threads share them)
_keeping = set()  # models found keeping arrays they returned: never placed again in this process
_counts = collections.Counter()


def placement_counts() -> dict:
    """This process's chunks so far: ``watched`` (allocations logged), ``placed`` (written with no copy of the
    outputs planned), ``missed`` (a planned output elsewhere); ``kept``: models found keeping arrays."""
    return {name: _counts[name] for name in ("watched", "placed", "missed", "kept")}


def run_and_write(program, slot, rows, run, device):
    """``run()`` (a chunk's model call) with its NumPy results allocated in ``slot``'s rows (``rows``, what
    :meth:`~dsched.dataplane.outputs.OutputSlot.rows` returned) where the plan says, then its result written
    by ``slot``; what :meth:`~dsched.dataplane.outputs.OutputSlot.write` returns."""
    placeable = rows and program.place_results and places_here()  # not in sync mode: the main thread
    plan = _plan_for(program, slot) if placeable else None
    positions = _settled(plan, program) if plan is not None else None
    if plan is None or plan.never:
        return slot.write(run(), device, rows=rows)
    targets = {} if positions is None else {position: (_address(rows[k]), rows[k].nbytes, rows[k])
                                            for k, position in positions.items()}
    with placing(targets, learn=positions is None) as call:
        result = run()
    try:
        arrays = slot.layout.check(result, slot.stop - slot.start, "")
    except ChunkResultError:
        arrays = None  # slot.write raises it, naming the chunk
    agreed = False
    if arrays is not None:
        with _lock:
            if positions is None:
                agreed = _learn(plan, call, arrays, rows)
            else:
                _verify(plan, positions, arrays, rows)
    del arrays
    leftover = None
    try:
        leftover = slot.write(result, device, rows=rows)
        return leftover
    finally:
        del result
        # Outputs travelling back by value are held by dsched until sent, not kept by the model.
        _leave(plan, call, watched=positions is None, agreed=agreed, travelling=_owners(leftover))


def _plan_for(program, slot) -> _Plan:
    """The plan of this model, output layout and chunk size (what a model's allocations depend on)."""
    name = _name(program)
    key = (name, program.preprocess is None, program.postprocess is None, slot.layout.leaves, slot.stop - slot.start)
    with _lock:
        if name in _keeping:
            return None
        plan = _plans.get(key)
        if plan is None:
            plan = _plans[key] = _Plan()
            while len(_plans) > PLANS_KEPT:
                _plans.popitem(last=False)
        else:
            _plans.move_to_end(key)
        return plan


def _name(program) -> str:
    fn = getattr(program.do_work, "fn", program.do_work)  # dsched.dispatch's wrapper: the user's function
    code = getattr(fn, "__code__", None)  # two lambdas of one module share a name, not a line
    return (f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"
            + (f":{code.co_firstlineno}" if code is not None else ""))


def _settled(plan, program):
    """The plan's positions once what the last chunk left alive is judged (``None``: watch this chunk)."""
    if plan.pending is not None and _alive(plan.pending):
        gc.collect()  # a reference cycle holds arrays until the collector runs: not the model keeping them
    with _lock:
        if plan.pending is not None:
            call, addresses = plan.pending
            alive = _alive(plan.pending)
            plan.pending = None
            if call is not None:
                call.unfollow()
            if alive:  # not a passing reference (a profiler's look at the stack): the model keeps arrays
                plan.never = True
                if call is None:
                    _keeping.add(_name(program))
                _counts["kept"] += 1
                logger.warning("dsched: %s keeps arrays it made in a call; its results are not allocated in "
                               "their rows on this worker", _name(program))
            elif call is not None and plan.candidate is not None:
                plan.positions, plan.candidate = plan.candidate, None
        return plan.positions


def _alive(pending) -> list:
    """Of what a chunk left alive, ``(learning call or None, addresses)``, the addresses still alive: followed
    from the call that made them, or placed."""
    call, addresses = pending
    return still_alive(call, addresses) if call is not None else live_placements(addresses)


def _owners(leftover) -> set:
    """Addresses of the memory the arrays of ``leftover`` (a :class:`~dsched.dataplane.outputs.Leftover` or
    ``None``) lie in: each array's own and its bases'."""
    owners = set()
    for array in (leftover.arrays.values() if leftover is not None else ()):
        while isinstance(array, np.ndarray):
            owners.add(_address(array))
            array = array.base
    return owners


def _leave(plan, call, watched, agreed, travelling=frozenset()):
    """After the chunk (its result gone): what it left alive, to be judged when the model's next chunk starts.

    A watched chunk that agreed with the one before is judged on everything it
    allocated (the first may have made what a model makes once: imports,
    tables); a placed one on what was placed. ``travelling``: addresses of
    outputs on their way back by value, held by dsched, not by the model.
    """
    with _lock:
        if watched:
            survivors = [address for address in call.survivors() if address not in travelling] if agreed else []
            call.unfollow(keep=survivors)
            if survivors:
                plan.pending = (call, survivors)
            elif agreed and not plan.never:
                plan.positions, plan.candidate = plan.candidate, None
        else:
            alive = live_placements(call.addresses)
            if alive:
                plan.pending = (None, alive)


def _address(array) -> int:
    return array.__array_interface__["data"][0]


def _learn(plan, call, arrays, rows) -> bool:
    """From a watched chunk: per output, the allocation its result lies at the start of. Whether it agrees with
    the chunk watched before (two must)."""
    _counts["watched"] += 1
    if call.overflowed:
        plan.never = True
        return False
    where = {address: (position, nbytes, zeroed) for position, address, nbytes, zeroed in call.log}  # last use
    positions = {}
    for k, (array, row) in enumerate(zip(arrays, rows)):
        if row is None or not isinstance(array, np.ndarray) or not array.flags.c_contiguous or \
                array.dtype != row.dtype or array.shape != row.shape:
            continue
        found = where.get(_address(array))
        if found is not None and found[1] == row.nbytes and not found[2]:
            positions[k] = found[0]
    worth = sum(rows[k].nbytes for k in positions) >= BYTES_PER_ALLOCATION * call.count
    if not positions or not worth:  # nothing it allocates becomes an output, or too many small allocations
        plan.never = True
        return False
    if plan.candidate == positions:
        return True
    plan.candidate = positions  # a first sighting (or a disagreement): watch the next chunk too
    return False


def _verify(plan, positions, arrays, rows):
    if all(same_memory(arrays[k], rows[k]) for k in positions):
        _counts["placed"] += 1
        return
    _counts["missed"] += 1
    plan.misses += 1
    if plan.positions is positions:
        plan.positions = None
    plan.never = plan.misses >= MISSES_ALLOWED
