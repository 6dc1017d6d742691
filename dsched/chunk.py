"""A chunk's task: what runs on the device worker for one chunk of a dispatch."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from .devices import Device, running_on, selected
from .report import ChunkRecord
from .store import resolve_work

__all__ = ["ChunkProgram", "InFlight", "run_chunk"]


@dataclass(frozen=True)
class ChunkProgram:
    """Everything a worker needs to run a chunk; shipped with each chunk."""

    dispatcher_id: str
    do_work: object
    preprocess: object = None
    postprocess: object = None
    thread_init: object = None

    def run(self, device, work):
        with running_on(device), selected(device):
            if self.preprocess is not None:
                work = self.preprocess(work, device)
            result = self.do_work(work, device)
            if self.postprocess is not None:
                result = self.postprocess(result)
        return result


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
    """A submitted chunk: its record, its work, its future, whether its worker writes its result in place,
    and when it times out (``time.monotonic()``; infinity without a timeout)."""

    record: ChunkRecord
    work: object
    future: object
    in_place: bool
    deadline: float


def run_chunk(program: ChunkProgram, device: Device, work, slot=None):
    """The task that runs on a device worker: initialise once, then compute one chunk.

    ``work`` may hold references into the run's store (resolved to views here);
    with a ``slot`` the result is checked and written in place, and only the
    timings travel back.
    """
    from distributed import get_worker

    worker = get_worker()
    if program.thread_init is not None:
        with _init_registry_lock:
            registry = worker.__dict__.setdefault("_dsched_thread_init", {})
            once = registry.setdefault((program.dispatcher_id, device), _InitOnce())
        once(program.thread_init, device)
    start = time.time()
    result = program.run(device, resolve_work(work))
    if slot is not None:
        slot.write(result, device)
        result = None
    return result, worker.address, start, time.time()
