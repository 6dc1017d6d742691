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


class AggregateError(DispatchError, ExceptionGroup):
    """Several chunks of one run failed; ``errors`` lists them in dispatch order.

    An ``ExceptionGroup`` (PEP 654), so ``except* ValueError`` picks out the
    chunks that raised ValueError. It is also an instance of the most specific
    class all its errors share: when every failed chunk raised ValueError, the
    group is a ValueError too. Whether one chunk failed (re-raised as itself, as
    NEML2 does) or several did, which depends on what else was in flight, the
    same ``except ValueError`` clause catches it.

    ``recoverable`` is true only if every one of the errors is.

    Examples
    --------
    >>> err = AggregateError.of([ValueError("a"), ValueError("b")], dispatched=5)
    >>> isinstance(err, ValueError), isinstance(err, ExceptionGroup), str(err).splitlines()[0]
    (True, True, '2 of 5 chunks failed:')
    """

    def __new__(cls, errors, *, dispatched=None, undispatched=0):
        errors = [e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}") for e in errors]
        return super().__new__(cls, _summary(errors, dispatched, undispatched), errors)

    def __init__(self, errors, *, dispatched=None, undispatched=0):
        self._dispatched, self._undispatched = dispatched, undispatched
        super().__init__(self.message, self.exceptions)

    @classmethod
    def of(cls, errors, *, dispatched=None, undispatched=0):
        """An AggregateError that is also an instance of the errors' most specific common class."""
        return _aggregate_class(_common_class(errors))(errors, dispatched=dispatched, undispatched=undispatched)

    @property
    def errors(self) -> list:
        return list(self.exceptions)

    @property
    def recoverable(self):
        return all(is_recoverable(e) for e in self.exceptions)

    def __str__(self):
        return self.message

    def derive(self, excs):
        # except* splits a group into the parts each clause caught: each part is a group of the same kind
        return AggregateError.of(list(excs), dispatched=self._dispatched)

    def __reduce__(self):
        return _rebuild, (self.errors, self._dispatched, self._undispatched)


_SENT_BY_VALUE = "<dynamic-code>"  # the file name cloudpickle gives code it sends by value (a script's functions)


def note_where_defined(error, fn):
    """Name ``fn``'s file in a note on ``error`` where its traceback runs through ``fn`` as the workers got it.

    cloudpickle sends a function of the user's script by value and names its file ``"<dynamic-code>"`` (its
    payloads are then the same wherever the script lies): a worker's traceback says ``File "<dynamic-code>", line
    6, in boom``. The line numbers are the script's own; the note gives the file.
    """
    code = getattr(getattr(fn, "fn", fn), "__code__", None)  # dispatch's wrapper holds the user's function
    if code is None or code.co_filename == _SENT_BY_VALUE:
        return
    tb = getattr(error, "__traceback__", None)
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == _SENT_BY_VALUE and tb.tb_frame.f_code.co_name == code.co_name:
            note = (f'dsched: File "{_SENT_BY_VALUE}" above is {code.co_filename} (sent to the workers by value), '
                    f"where {code.co_name} is defined at line {code.co_firstlineno}")
            if note not in getattr(error, "__notes__", ()):
                error.add_note(note)
            return
        tb = tb.tb_next


def _ranges(indexes) -> str:
    """Sorted indexes as runs: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs = []
    for i in indexes:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _summary(errors, dispatched, undispatched) -> str:
    """The group's message: one line per distinct error, with the indexes of the errors that read so (a model that
    fails the same way in a hundred chunks says so in one line, not a hundred)."""
    of = "" if dispatched is None else f" of {dispatched}"
    lines = [f"{len(errors)}{of} chunks failed:"]
    alike = {}  # an error's line -> the indexes of the errors that read so, in order of first appearance
    for i, err in enumerate(errors):
        kind = "recoverable" if is_recoverable(err) else "fatal"
        alike.setdefault(f"({kind}) {type(err).__name__}: {err}", []).append(i)
    lines += [f"[{_ranges(indexes)}] {line}" for line, indexes in alike.items()]
    if undispatched:
        lines.append(f"(the run stopped at the first failure: {undispatched} items were never dispatched)")
    return "\n".join(lines)


def _common_class(errors) -> type:
    """The most specific exception class every one of ``errors`` is an instance of."""
    for cls in type(errors[0]).__mro__:
        if issubclass(cls, Exception) and all(isinstance(e, cls) for e in errors):
            return cls
    return Exception


_AGGREGATES = {}  # common class -> AggregateError subclass that is also one


def _aggregate_class(common: type) -> type:
    if common in (Exception, DispatchError, AggregateError) or issubclass(AggregateError, common):
        return AggregateError
    if common not in _AGGREGATES:
        try:
            _AGGREGATES[common] = type(f"AggregateError[{common.__name__}]", (AggregateError, common),
                                       {"__module__": __name__})
        except TypeError:  # a class that cannot be combined (a layout of its own): the plain group
            _AGGREGATES[common] = AggregateError
    return _AGGREGATES[common]


def _rebuild(errors, dispatched, undispatched):
    return AggregateError.of(errors, dispatched=dispatched, undispatched=undispatched)


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


def unsendable_fn(error: BaseException) -> TypeError:
    """The one-line error of a call whose ``fn`` could not be pickled for the workers. ``error`` is the pickler's,
    or Dask's ``Could not serialize object of type ...``, which carries the pickler's as its cause."""
    reason = error.__cause__ or error.__context__ or error
    return TypeError(f"fn: cannot be sent to the workers ({type(reason).__name__}: {reason}); it must pickle, and "
                     "so must what a lambda or closure captures")
