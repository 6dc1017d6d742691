"""Argument checks shared across the package, with the messages its errors have always had.

A ground-floor module: it imports only the standard library, NumPy and Dask's config, so
every module of dsched can use it without an import cycle.

Examples
--------
>>> check_positive_int(4, "batch_size")
4
>>> check_positive_int(0, "batch_size")
Traceback (most recent call last):
...
ValueError: batch_size: must be >= 1, got 0
>>> check_positive_int(0, "threads", integers=int, below=None)
Traceback (most recent call last):
...
ValueError: threads: expected an integer >= 1, got 0
"""

from __future__ import annotations

import reprlib

import dask.config
import numpy as np

__all__ = ["check_positive_int", "check_callable", "check_scheduler", "described", "did_you_mean", "setting"]

#: what every work scheduler has (``dsched.schedulers.base.WorkScheduler``'s protocol)
SCHEDULER_METHODS = ("schedule_work", "dispatched_work", "completed_work", "devices", "status")


def check_positive_int(value, field: str, *, integers=(int, np.integer), expected="an integer >= 1",
                       below="must be >= 1") -> int:
    """``value`` as an int >= 1, or a ValueError naming ``field``.

    ``integers`` are the types accepted (``bool`` never is). A value of
    another type raises ``"<field>: expected <expected>, got <value!r>"``; an
    integer below 1 raises ``"<field>: <below>, got <value!r>"``, or the
    first message when ``below`` is ``None``.
    """
    if isinstance(value, bool) or not isinstance(value, integers):
        raise ValueError(f"{field}: expected {expected}, got {value!r}")
    if int(value) < 1:
        raise ValueError(f"{field}: {f'expected {expected}' if below is None else below}, got {value!r}")
    return int(value)


def described(value) -> str:
    """``value`` for a one-line message: an array by its type, shape and dtype (never its values), anything else
    by a repr cut short.

    >>> described(np.ones((1000, 3))), described("x" * 100)[:12]
    ('ndarray of shape (1000, 3) and dtype float64', "'xxxxxxxxxxx")
    """
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return f"{type(value).__name__} of shape {tuple(shape)} and dtype {dtype}"
    return reprlib.repr(value).replace("\n", " ")


def check_callable(value, field: str, error=ValueError):
    """``value`` if it is callable, else ``error`` naming ``field``: ``fn: expected a callable, got ndarray of shape
    (1000, 3) and dtype float64`` (arguments given in the wrong order)."""
    if not callable(value):
        raise error(f"{field}: expected a callable, got {described(value)}")
    return value


def check_scheduler(scheduler):
    """``scheduler`` if it has every method of a work scheduler, else ``ValueError`` naming those it lacks."""
    missing = [name for name in SCHEDULER_METHODS if not hasattr(scheduler, name)]
    if missing:
        raise ValueError(f"scheduler: {scheduler!r} is not a scheduler (it lacks {', '.join(missing)})")
    return scheduler


def did_you_mean(word: str, candidates, suffix: str = "") -> str:
    """``"; did you mean <candidate><suffix>?"`` for the candidate closest to a mistyped ``word``, or ``""``.

    Examples
    --------
    >>> did_you_mean("clinet", ["scheduler", "client"], "=")
    '; did you mean client=?'
    >>> did_you_mean("colour", ["scheduler", "client"])
    ''
    >>> did_you_mean("J2", ["j2", "neml2"])
    '; did you mean j2?'
    """
    import difflib

    lowered = {str(c).lower(): c for c in candidates}  # 'J2' is close to 'j2'
    close = difflib.get_close_matches(str(word).lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean {lowered[close[0]]}{suffix}?" if close else ""


_UNSET = object()


def setting(name: str, default):
    """Dask config ``dsched.<name>`` (hyphens or underscores alike), read straight from Dask's config dict.

    ``dask.config.get`` parses its key on every call; a solver's loop reads a few settings per call, thousands of
    times a second. Dask keeps its config in one dict that ``dask.config.set`` changes in place, so a read here
    sees every change at once.
    """
    section = dask.config.config.get("dsched")
    if not isinstance(section, dict):
        return default
    value = section.get(name, _UNSET)
    if value is _UNSET:
        value = section.get(name.replace("-", "_") if "-" in name else name.replace("_", "-"), default)
    return value
