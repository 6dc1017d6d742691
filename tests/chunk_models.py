"""Models the steady-path and replay tests run, and what they read of the runs.

Importable by name (not defined in a test module twice): the worker processes unpickle them by reference.
"""

import os
import time

import numpy as np


def triple(work, device):
    return 3.0 * work


def slow_triple(work, device):
    """:func:`triple` after 5 ms: a chunk whose reply cannot come sooner."""
    time.sleep(0.005)
    return 3.0 * work


def fail_on_negatives(work, device):
    if (work < 0).any():
        raise ValueError(f"negative items at {np.flatnonzero(work < 0)[0]}")
    return 2.0 * work


def chunks_of(report):
    """``[(device, offset, items)]`` of a run's chunks, in dispatch order."""
    return [(str(r.device), r.offset, r.size) for r in report.records]


def runs_taking(monkeypatch, cls) -> list:
    """The runs of ``cls`` (a run class with a ``loop``: the steady path's, a replay's) started from now on, in
    order."""
    seen, loop = [], cls.loop

    def counted(self):
        seen.append(self)
        return loop(self)

    monkeypatch.setattr(cls, "loop", counted)
    return seen


def double_x(work, device):
    return 2.0 * work["x"]


def _load_only_in(pid, value):
    if os.getpid() != pid:
        raise RuntimeError("this value loads only in the process that made it")
    return LoadsOnlyHere(value)


class LoadsOnlyHere:
    """A value that unpickles only in the process that made it: what a GPU array is to a worker without that GPU,
    or an instance of a class to a worker whose Python lacks its module."""

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        return _load_only_in, (os.getpid(), self.value)
