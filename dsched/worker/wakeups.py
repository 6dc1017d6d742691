"""A worker's compute threads, woken by the client, leave the client's thread its core.

A run sends its chunks one message per feed, one after the other. Each message
wakes a worker's thread. On a node with few cores, Linux's scheduler may run a
woken thread at once on the core of the thread that woke it, putting the
dispatching thread back in the run queue while the chunk runs: the next message
then leaves milliseconds late, and its device idles that long: on two cores,
calls of a few milliseconds often took half as long again.

Under the ``SCHED_BATCH`` policy a woken thread does not preempt the one that
woke it: it runs once that thread sleeps or yields (the run's loop does, as it
waits for the replies) or on another core. Chunks lose nothing by it: they are
long against the few microseconds the client still needs. Any user may set it
on their own threads; it exists on Linux only (elsewhere nothing changes). The
Dask config ``dsched.yield-on-wake: false`` leaves the threads as they are.
"""

from __future__ import annotations

import os

from dsched.checks import setting

__all__ = ["yield_on_wake", "restore_policy"]


def yield_on_wake():
    """Put the calling thread under ``SCHED_BATCH`` (a system call: once per feed task, not per chunk); its policy
    before, for :func:`restore_policy`, or ``None`` where nothing changed (no such policy, ``dsched.yield-on-wake:
    false``, a policy the container forbids, or ``SCHED_BATCH`` already)."""
    if not hasattr(os, "SCHED_BATCH") or not setting("yield-on-wake", True):
        return None
    try:
        previous = os.sched_getscheduler(0), os.sched_getparam(0)  # 0: the calling thread, on Linux
        if previous[0] == os.SCHED_BATCH:
            return None
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError:  # a policy the container forbids: the thread runs as before
        return None
    return previous


def restore_policy(previous):
    """Give the calling thread back the policy :func:`yield_on_wake` found (``None``: nothing to do). The feed's
    thread is one of its worker's pool: the tasks it runs next are not feeds, and run as they would have."""
    if previous is None:
        return
    try:
        os.sched_setscheduler(0, *previous)
    except OSError:  # not allowed back (a real-time policy needs privileges it had then): left as it is
        pass
