"""Stopping a run from another thread: what :meth:`dsched.DispatchFuture.cancel` uses.

A :class:`Cancellation` is made per submitted call and made current on the
thread that runs it (:func:`cancellable`). A run reads the current one when it
starts and gives it a way to wake its loop; :meth:`Cancellation.cancel` then
makes the run raise :class:`concurrent.futures.CancelledError` where it waits,
and the run's usual clean-up on an exception (the one a Ctrl-C takes) cancels
its chunks and gives their loads back.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from concurrent.futures import CancelledError

__all__ = ["Cancellation", "CancelledError", "cancellable", "current_cancellation"]

_current = contextvars.ContextVar("dsched_cancellation", default=None)


class Cancellation:
    """A request to stop one run, made from any thread; the run's wake-up call, once it has started."""

    def __init__(self):
        self._lock = threading.Lock()
        self._requested = False
        self._wake = None

    @property
    def requested(self) -> bool:
        return self._requested

    def cancel(self):
        """Ask the run to stop: it raises ``CancelledError`` where it waits next."""
        with self._lock:
            self._requested, wake = True, self._wake
        if wake is not None:
            wake()

    def bind(self, wake):
        """``wake()`` is called on :meth:`cancel` (at once if it was asked for already); ``None`` unbinds."""
        with self._lock:
            self._wake = wake
            requested = self._requested
        if requested and wake is not None:
            wake()

    def check(self):
        """Raise ``CancelledError`` if the run was asked to stop."""
        if self._requested:
            raise CancelledError("the call was cancelled")


def current_cancellation():
    """The :class:`Cancellation` of the call running on this thread, or ``None``."""
    return _current.get()


@contextlib.contextmanager
def cancellable(cancellation):
    """Make ``cancellation`` the current one while the block runs."""
    token = _current.set(cancellation)
    try:
        yield cancellation
    finally:
        _current.reset(token)
