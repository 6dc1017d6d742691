"""``with dsched.run_reports() as reports:``: the report of every run inside the block, as Dask's ``get_task_stream``.

:func:`~dsched.dispatch.front.dispatch` returns its outputs alone, as a plain
call should; what it did (chunks, devices, workers, times) is its run's
:class:`~dsched.observe.report.RunReport`. Like ``distributed.get_task_stream``,
a block collects the reports of the runs that end in this process while it is
open, whichever dispatcher ran them (``dispatch``, a kept ``WorkDispatcher``,
``NEML2Model.dispatch``, ``dsched run``'s), in the order they ended, also failed
ones. A collected report keeps no outputs or results (``output`` is ``None``,
``results`` empty): the caller has them already, and a report must not keep a
batch alive.

Examples
--------
>>> import numpy as np, dsched
>>> with dsched.run_reports() as reports:
...     out = dsched.dispatch(np.sqrt, np.arange(10.0), scheduler=dsched.SimpleScheduler("cpu", 4), mode="sync")
>>> len(reports), reports[-1].items, [r.size for r in reports[-1].records]
(1, 10, [4, 4, 2])
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

from dsched.observe.hooks import RunObserver

__all__ = ["RunReports", "run_reports", "open_collectors"]

_lock = threading.Lock()
_open: list = []  # the RunReports of the blocks open now, in any thread


class RunReports(RunObserver):
    """The reports collected by one ``with run_reports()`` block: a sequence, oldest first."""

    def __init__(self):
        self._reports = []

    def run_finished(self, report) -> None:
        with _lock:
            self._reports.append(dataclasses.replace(report, output=None, results=[]))

    def __getitem__(self, index):
        return self._reports[index]

    def __len__(self) -> int:
        return len(self._reports)

    def __iter__(self):
        return iter(list(self._reports))

    def __repr__(self):
        return f"<RunReports: {len(self)} run(s)>"


@contextlib.contextmanager
def run_reports():
    """Collect the :class:`~dsched.observe.report.RunReport` of every run that ends in this process inside the
    block; yields a :class:`RunReports` (``reports[-1]`` is the last)."""
    collector = RunReports()
    with _lock:
        _open.append(collector)
    try:
        yield collector
    finally:
        with _lock:
            _open.remove(collector)


def open_collectors() -> list:
    """The collectors of the blocks open now: observers every run adds to its own."""
    with _lock:
        return list(_open)
