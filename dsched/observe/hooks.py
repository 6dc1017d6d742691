"""The observer interface: hooks a dispatch run calls as it goes, for traces, progress bars and the dashboard.

The dispatch loop knows nothing of what watches it. It calls the hooks of
:class:`RunObserver` at five points of a run, and every observer (the Chrome
trace, a progress callback, the dashboard's run record, your own) overrides the
hooks it needs. The base class implements each as a no-op, as
``distributed.diagnostics.plugin.SchedulerPlugin`` does, so a new hook never
breaks an existing observer.

Hooks run on the thread that called ``run`` (the client side), in the order
observers were given; they should return quickly, since the loop waits for
them. An exception raised by a hook ends the run as a failure of the run
itself (not of a chunk), after the chunks in flight are cancelled.

Examples
--------
>>> import numpy as np, dsched
>>> class CountChunks(RunObserver):
...     def __init__(self):
...         self.done = 0
...     def chunk_completed(self, record):
...         self.done += record.error is None
>>> counter = CountChunks()
>>> d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 4), lambda w, dev: w.stop - w.start,
...                           mode="sync", observers=[counter])
>>> d.run(dsched.SliceGenerator(0, 10)), counter.done
([4, 4, 2], 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RunObserver", "RunStart", "Observers"]


@dataclass(frozen=True)
class RunStart:
    """What an observer learns when a run starts.

    Attributes
    ----------
    run_id : str
        The run's name, also the prefix of its task keys (``dsched-<id>-<n>``).
    mode : str
        ``"sync"`` or ``"async"``.
    scheduler : WorkScheduler
        The policy of the run.
    total : int
        Items the run will hand out.
    client : distributed.Client or None
        The cluster's client (``None`` in sync mode).
    """

    run_id: str
    mode: str
    scheduler: Any
    total: int
    client: Any = None


class RunObserver:
    """Base class of run observers: override the hooks you need; each is a no-op here."""

    def run_started(self, run: RunStart) -> None:
        """The run is about to schedule its first chunk."""

    def work_scheduled(self, choice, start: float, stop: float) -> None:
        """``scheduler.schedule_work()`` returned ``choice`` (``(device, n)`` or ``None``), between ``start`` and ``stop`` (epoch seconds)."""

    def work_dispatched(self, device, n: int, start: float, stop: float) -> None:
        """``scheduler.dispatched_work(device, n)`` was called for a chunk, between ``start`` and ``stop``."""

    def chunk_completed(self, record) -> None:
        """A chunk's load was given back: it succeeded (``record.error is None``) or failed.

        ``record`` is its :class:`~dsched.observe.report.ChunkRecord`; its times
        (``start``, ``stop``, ``worker``) may still be filled in by the run's final gather.
        """

    def run_finished(self, report) -> None:
        """The run ended (also after a failure or an interrupt); ``report`` is its :class:`~dsched.observe.report.RunReport`."""


class Observers(RunObserver):
    """Several observers as one: each hook is called on every observer, in order.

    The loop holds one of these; without observers every hook is an empty loop.
    """

    def __init__(self, observers=()):
        observers = list(observers)
        for i, observer in enumerate(observers):
            if not isinstance(observer, RunObserver):
                raise ValueError(f"observers[{i}]: expected a dsched.observe.RunObserver, got {observer!r}")
        self.observers = observers

    def __bool__(self) -> bool:
        return bool(self.observers)

    def run_started(self, run):
        for observer in self.observers:
            observer.run_started(run)

    def work_scheduled(self, choice, start, stop):
        for observer in self.observers:
            observer.work_scheduled(choice, start, stop)

    def work_dispatched(self, device, n, start, stop):
        for observer in self.observers:
            observer.work_dispatched(device, n, start, stop)

    def chunk_completed(self, record):
        for observer in self.observers:
            observer.chunk_completed(record)

    def run_finished(self, report):
        # Every observer hears the end, even if an earlier one fails (a trace file must stay balanced).
        errors = []
        for observer in self.observers:
            try:
                observer.run_finished(report)
            except Exception as err:
                errors.append(err)
        if errors:
            raise errors[0]
