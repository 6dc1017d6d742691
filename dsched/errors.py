"""Errors raised by dispatching.

``DispatchError`` is the base of dsched's own errors. A failure a caller may
retry (a Newton solve that did not converge, say) is a ``RecoverableError``;
when several chunks fail at once they are collected in an ``AggregateError``.
"""

from __future__ import annotations

import sys

__all__ = ["DispatchError", "RecoverableError", "AggregateError", "ChunkTimeoutError", "NEML2ConvergenceError",
           "as_recoverable"]


class DispatchError(Exception):
    """Base class of dsched's errors; ``recoverable`` tells whether a retry may succeed."""

    recoverable = False


class RecoverableError(DispatchError):
    """Raise (or subclass) this in user code for failures worth retrying.

    Examples
    --------
    >>> def do_work(work, device):
    ...     raise RecoverableError("Newton solve did not converge")
    """

    recoverable = True


class ChunkTimeoutError(RecoverableError):
    """A chunk ran past the dispatcher's ``timeout``: it was cancelled and its device's load given back."""


class AggregateError(DispatchError):
    """Several chunks failed; ``errors`` lists them in dispatch order.

    ``recoverable`` is true only if every one of them is.
    """

    def __init__(self, errors):
        self.errors = list(errors)
        lines = [f"{len(self.errors)} concurrent dispatches failed:"]
        for i, err in enumerate(self.errors):
            kind = "recoverable" if is_recoverable(err) else "fatal"
            lines.append(f"[{i}] ({kind}) {type(err).__name__}: {err}")
        super().__init__("\n".join(lines))

    @property
    def recoverable(self):
        return all(is_recoverable(e) for e in self.errors)


def is_recoverable(error: BaseException) -> bool:
    """Whether ``error`` is one a caller may retry (foreign errors are fatal)."""
    return bool(getattr(error, "recoverable", False)) if isinstance(error, DispatchError) else False


class NEML2ConvergenceError(RecoverableError):
    """NEML2's nonlinear solve did not converge on a chunk (retry it, e.g. with a smaller step)."""


def as_recoverable(err):
    """A :class:`NEML2ConvergenceError` for NEML2's ``ConvergenceError`` (raised by user code calling NEML2), else ``None``.

    NEML2 is looked up among the loaded modules, never imported: without it
    loaded, no error can be one of its own.
    """
    solvers = sys.modules.get("neml2.solvers")
    if solvers is not None and isinstance(err, solvers.ConvergenceError):
        return NEML2ConvergenceError(f"NEML2: {err}")
    return None
