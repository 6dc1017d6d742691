"""A chunk's task: what runs on the device worker for one chunk of a dispatch."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from dsched.dataplane.pinned import chunk_stream, is_real_gpu, slot_copies_from_gpu
from dsched.dataplane.segments import forget_vanished_segments
from dsched.dataplane.store import resolve_work
from dsched.devices.context import running_on, selected
from dsched.devices.device import Device
from dsched.names import ITEMS_ANNOTATION
from dsched.observe.report import ChunkRecord
from dsched.worker.result_placement import run_and_write

__all__ = ["ChunkProgram", "InFlight", "PackError", "ProgramRef", "PROGRAMS_KEPT", "run_chunk", "run_pack", "takes_out",
           "ITEMS_ANNOTATION"]

#: programs a feed's inbox keeps (the most recently used): a solver whose calls take turns between a few models
#: (a stress and a tangent, two materials) sends each to a feed once, then only its :class:`ProgramRef`
PROGRAMS_KEPT = 4

# A chunk task's item count, annotated where it differs from its resource request (a pack, a capped
# request): observers such as the dashboard count items from it.


@dataclass(frozen=True)
class ChunkProgram:
    """Everything a worker needs to run a chunk; shipped with each chunk."""

    dispatcher_id: str
    do_work: object
    preprocess: object = None
    postprocess: object = None
    thread_init: object = None
    takes_out: bool = False  # do_work accepts ``out=``: the chunk's output rows, to compute straight into
    place_results: bool = True  # new NumPy results may be allocated in their rows (dsched.worker.result_placement)

    def run(self, device, work, out=None):
        with running_on(device), selected(device):
            return self.call(device, work, out)

    def call(self, device, work, out=None):
        """The chunk's code, in the caller's device context (:meth:`run` makes it)."""
        if self.preprocess is not None:
            work = self.preprocess(work, device)
        result = self.do_work(work, device) if out is None else self.do_work(work, device, out=out)
        if self.postprocess is not None:
            result = self.postprocess(result)
        return result


class ProgramRef(NamedTuple):
    """A program a feed's inbox keeps already, named by its dispatcher: what a rearm carries in its place."""

    dispatcher_id: str


def takes_out(fn) -> bool:
    """Whether ``fn`` accepts an ``out`` keyword (NumPy's convention: results computed into given arrays)."""
    import inspect

    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    out = parameters.get("out")
    return out is not None and out.kind in (out.POSITIONAL_OR_KEYWORD, out.KEYWORD_ONLY)


_init_registry_lock = threading.Lock()


class _InitOnce:
    """Runs a dispatcher's ``thread_init`` once per device on one worker."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done = False

    def __call__(self, fn, device):
        with self.lock:  # a second chunk waits until the first has initialised the device
            if not self.done:
                with running_on(device):
                    fn(device)  # on failure ``done`` stays False, so the next chunk tries again
                self.done = True


class InFlight(NamedTuple):
    """A submitted chunk: its record, its work, the future of its task (shared by a pack), whether its
    worker writes its result in place, and when it times out (``time.monotonic()``; infinity without)."""

    record: ChunkRecord
    work: object
    future: object
    in_place: bool
    deadline: float


class PackError(Exception):
    """Raised by a pack in which some chunks failed: ``outcomes`` says, per chunk, what happened.

    Each outcome is ``(ok, value, start, stop)``: the result (``None`` when written
    in place) or the chunk's exception, and its epoch-second timings.
    """

    def __init__(self, outcomes):
        self.outcomes = outcomes
        failed = sum(1 for ok, *_ in outcomes if not ok)
        super().__init__(f"{failed} of the {len(outcomes)} chunks of a pack failed")

    def __reduce__(self):
        return PackError, (self.outcomes,)


def _initialise(program, device, worker):
    if program.thread_init is not None:
        with _init_registry_lock:
            registry = worker.__dict__.setdefault("_dsched_thread_init", {})
            once = registry.setdefault((program.dispatcher_id, device), _InitOnce())
        once(program.thread_init, device)


def _compute(program, device, work, slot):
    # On a real GPU: page-locked inputs and a stream of the chunk's own (dsched.transfer); no-ops elsewhere.
    gpu = is_real_gpu(device)
    forget_vanished_segments()  # unmap what ended runs left mapped in this process
    with chunk_stream(device), slot_copies_from_gpu(gpu and slot is not None):
        rows = slot.rows() if slot is not None and not gpu else None  # mapped once, for out= and the write
        out = slot.views(rows) if rows is not None and program.takes_out else None
        work = resolve_work(work, pinned=gpu)
        if rows is not None:  # results allocated in their rows where learned (those computed into out= lie there)
            return run_and_write(program, slot, rows, lambda: program.run(device, work, out), device)
        result = program.run(device, work, out)
        if slot is not None:  # written in place; only outputs that travel by value come back
            return slot.write(result, device, pinned=gpu, rows=rows)
    return result


def run_chunk(program: ChunkProgram, device: Device, work, slot=None):
    """The task that runs one chunk on a device worker: initialise once, then compute.

    ``work`` may hold references into the run's store (resolved to views here);
    with a ``slot`` the result is checked and written in place, and only the
    timings travel back.
    """
    from distributed import get_worker

    worker = get_worker()
    _initialise(program, device, worker)
    start = time.time()
    result = _compute(program, device, work, slot)
    return result, worker.address, start, time.time()


def run_pack(program: ChunkProgram, device: Device, works, slots, topic=None):
    """The task that runs several chunks of one device one after another (batched submission).

    Each chunk's completion is published as it happens on the Dask event
    ``topic`` (``(task key, index in the pack, ok, start, stop)``), so the client keeps
    per-chunk progress and load accounting while the pack goes on. A chunk that
    fails does not stop the others; the pack then raises :class:`PackError`.
    Returns ``(worker address, outcomes)``.
    """
    from distributed import get_worker

    worker = get_worker()
    key = worker.get_current_task() if topic is not None else None
    _initialise(program, device, worker)
    outcomes = []
    for i, (work, slot) in enumerate(zip(works, slots)):
        start = time.time()
        try:
            value, ok = _compute(program, device, work, slot), True
        except Exception as err:  # isolated: the pack's other chunks still run
            value, ok = err, False
        stop = time.time()
        outcomes.append((ok, value, start, stop))
        if topic is not None:
            worker.log_event(topic, (key, i, ok, start, stop))
    if not all(ok for ok, *_ in outcomes):
        raise PackError(outcomes)
    return worker.address, outcomes
