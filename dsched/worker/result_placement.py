"""A chunk's results allocated where they go: which NumPy allocation becomes each output, learned once.

A model that returns new arrays makes its worker copy each result into the
chunk's output rows: one more pass over every output byte, on the worker's
core. But a NumPy model allocates the same arrays in the same order for every
chunk of a size. So the first such chunk on a worker is watched (every
allocation logged by :mod:`dsched.dataplane.numpy_handler`), and for each
output the allocation its result came from is noted: the *plan*. The
allocations a plan names are then placed in each later chunk's own output
rows, and the arrays the model returns already lie where they go: the copy
is skipped (:func:`dsched.dataplane.pinned.copy_to_host` sees the same memory).

The plan is a guess, checked at every chunk, so a wrong one costs a copy,
never a wrong value:

- a result that is not in its rows is copied there as before, and the plan
  is learned again (given up after :data:`MISSES_ALLOWED` misses);
- a result that overlaps another output's rows is copied aside before
  anything is written (:meth:`~dsched.dataplane.outputs.OutputSlot.write`);
- a model that keeps an array it returned (alive after its chunk, and still
  alive when the model's next chunk starts) is never placed again on that
  worker: its later writes to that array would land in the outputs. The
  array keeps its memory mapped while it lives.

Models that take ``out=`` compute into their rows already and are not
watched; neither are GPU chunks, torch or NEML2 results, nor outputs that are
not in memory (a Zarr store) or travel by value. The Dask config
``dsched.place-results: false``, where a dispatcher is made, turns placing off for its runs
(:attr:`~dsched.worker.chunk.ChunkProgram.place_results`).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

import numpy as np

from dsched.dataplane.numpy_handler import available, live_placements, placing
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
    positions: dict = None  # output index -> position of the allocation its result comes from; None: learn it
    misses: int = 0
    never: bool = False


_plans: "collections.OrderedDict[tuple, _Plan]" = collections.OrderedDict()
_plans_lock = threading.Lock()
_keeping = set()  # models found keeping an array they returned: never placed again in this process
_suspects = {}  # model -> addresses of its last chunk's placed arrays alive after that chunk
_counts = collections.Counter()  # chunks watched, placed (every planned output in its rows), missed; models kept


def placement_counts() -> dict:
    """This worker's chunks so far: ``watched`` (plan learned), ``placed`` (written with no copy of the outputs
    planned), ``missed`` (a planned output elsewhere), and ``kept`` (models found keeping a result)."""
    return {name: _counts[name] for name in ("watched", "placed", "missed", "kept")}


def run_and_write(program, slot, run, device):
    """``run()`` (a chunk's model call) with its NumPy results allocated in ``slot``'s rows where the plan says,
    then its result written by ``slot``; what :meth:`~dsched.dataplane.outputs.OutputSlot.write` returns."""
    rows = slot.rows()
    name = _name(program)
    placeable = rows and program.place_results and available() and not _keeps_results(name)
    plan = _plan_for(_key(program, slot)) if placeable else None
    if plan is None or plan.never:
        return slot.write(run(), device, rows=rows)
    learning = plan.positions is None
    targets = {} if learning else {position: (_address(rows[k]), rows[k].nbytes, rows[k])
                                   for k, position in plan.positions.items()}
    with placing(targets, learn=learning) as call:
        result = run()
    try:
        arrays = slot.layout.check(result, slot.stop - slot.start, "")
    except ChunkResultError:
        arrays = None  # slot.write raises it, naming the chunk
    if arrays is not None:
        (_learn if learning else _verify)(plan, call, arrays, rows)
    del arrays
    leftover = slot.write(result, device, rows=rows)
    del result
    alive = live_placements(call.addresses) if call.addresses else []
    if alive:  # kept by the model, or only for a moment (a profiler's look at the stack): seen again later?
        _suspects[name] = alive
    return leftover


def _keeps_results(name) -> bool:
    """Whether model ``name`` keeps arrays it returned: some of its last chunk's, alive then, still are."""
    if name in _keeping:
        return True
    suspect = _suspects.pop(name, None)
    if suspect and live_placements(suspect):
        _keeping.add(name)  # whatever the chunk's size
        _counts["kept"] += 1
        logger.warning("dsched: %s keeps arrays it returned; its results are no longer placed in their rows "
                       "on this worker", name)
        return True
    return False


def _name(program) -> str:
    fn = getattr(program.do_work, "fn", program.do_work)  # dsched.dispatch's wrapper: the user's function
    return f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', None) or type(fn).__qualname__}"


def _key(program, slot) -> tuple:
    """What a model's allocations depend on: its code, the outputs' layout and the chunk's size."""
    return (_name(program), program.preprocess is None, program.postprocess is None, slot.layout.leaves,
            slot.stop - slot.start)


def _plan_for(key) -> _Plan:
    with _plans_lock:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans[key] = _Plan()
            while len(_plans) > PLANS_KEPT:
                _plans.popitem(last=False)
        else:
            _plans.move_to_end(key)
        return plan


def _address(array) -> int:
    return array.__array_interface__["data"][0]


def _learn(plan, call, arrays, rows):
    """The plan from a watched chunk: per output, the allocation its result lies at the start of."""
    _counts["watched"] += 1
    if call.overflowed:
        plan.never = True
        return
    where = {address: (position, nbytes) for position, address, nbytes in call.log}  # the last use of an address
    positions = {}
    for k, (array, row) in enumerate(zip(arrays, rows)):
        if row is None or not isinstance(array, np.ndarray) or not array.flags.c_contiguous or \
                array.dtype != row.dtype or array.shape != row.shape:
            continue
        found = where.get(_address(array))
        if found is not None and found[1] == row.nbytes:
            positions[k] = found[0]
    if positions and sum(rows[k].nbytes for k in positions) >= BYTES_PER_ALLOCATION * call.count:
        plan.positions = positions
    else:  # nothing it allocates becomes an output (views, inputs, cached arrays), or too many small allocations
        plan.never = True


def _verify(plan, call, arrays, rows):
    if all(same_memory(arrays[k], rows[k]) for k in plan.positions):
        _counts["placed"] += 1
        return
    _counts["missed"] += 1
    plan.misses += 1
    plan.positions = None
    plan.never = plan.misses >= MISSES_ALLOWED
