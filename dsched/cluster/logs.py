"""How much Dask says: quiet by default, more with ``dsched run -v``.

The level is the Dask config ``dsched.log-level`` (``"warning"`` unless set).
It applies to Dask's ``distributed`` loggers in this process and, through
this module as a worker preload, in every worker process. Above INFO a failed
chunk's "Compute Failed" log is dropped as well (the dispatcher raises that
chunk's error itself, once), and so are the "ended with CancelledError" lines
of chunks cancelled by Ctrl-C, and asyncio's report of a Dask send deadline's
timeout that a cluster's event loop stopped before reading (a race of Dask's
teardown, seen after a Ctrl-C).
"""

from __future__ import annotations

import logging
import os

__all__ = ["configured_log_level", "apply_log_level", "worker_preload"]

_ENV = "DSCHED_LOG_LEVEL"  # how a worker process learns its level (Nanny sets its env before the worker starts)


class _DropComputeFailed(logging.Filter):
    """Drops a failed task's "Compute Failed" and a cancelled task's "ended with CancelledError" (Ctrl-C)."""

    def filter(self, record):
        message = str(record.msg)
        return not (message.startswith("Compute Failed") or
                    (message.startswith("Async instruction for") and "CancelledError" in record.getMessage()))


class _DropTeardownTimeout(logging.Filter):
    """Drops asyncio's "Future exception was never retrieved" of a tornado timeout (``TimeoutError('Timeout')``).

    Dask's batched sends wait for their next deadline through tornado's ``with_timeout``; when a cluster's event
    loop stops (closing, after a Ctrl-C) between that timeout and the send reading it, the future is collected
    unread and asyncio reports it, a traceback's last line after the run's own last line.
    """

    def filter(self, record):
        error = record.exc_info[1] if record.exc_info else None
        return not (str(record.msg).startswith("Future exception was never retrieved")
                    and isinstance(error, TimeoutError) and str(error) == "Timeout")


_COMPUTE_FAILED_FILTER = _DropComputeFailed()
_TEARDOWN_TIMEOUT_FILTER = _DropTeardownTimeout()
# Filters apply to the logger a record is logged on, not its children: each logger that says these.
_FILTERED_LOGGERS = ("distributed.worker", "distributed.worker.state_machine")


def configured_log_level():
    """The Dask config ``dsched.log-level``: ``"warning"`` unless set."""
    import dask

    return dask.config.get("dsched.log-level", "warning")


def check_level(level, field="log_level") -> int:
    """``level`` (a name such as ``"info"`` or a number) as a logging level; ValueError naming ``field``."""
    value = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: expected a logging level such as 'warning' or 'info', got {level!r}")
    return value


def apply_log_level(level) -> None:
    """Dask's ``distributed`` logs at ``level`` in this process; above INFO without "Compute Failed" (and the
    teardown's unread timeouts)."""
    value = check_level(level)
    logging.getLogger("distributed").setLevel(value)
    filters = [(name, _COMPUTE_FAILED_FILTER) for name in _FILTERED_LOGGERS] + [("asyncio", _TEARDOWN_TIMEOUT_FILTER)]
    for name, drop in filters:
        if value > logging.INFO:
            logging.getLogger(name).addFilter(drop)
        else:
            logging.getLogger(name).removeFilter(drop)


def worker_preload(options: dict, level) -> dict:
    """Worker (Nanny) options that apply ``level`` in the worker process before it logs anything."""
    options = dict(options)
    options["preload"] = [*options.get("preload", ()), __name__]
    options["env"] = {**options.get("env", {}), _ENV: logging.getLevelName(check_level(level))}
    return options


def spawn_config(level) -> dict:
    """Dask config under which a Nanny spawns its worker process with Dask's logs at ``level``.

    A worker process sets up Dask's logging when it imports ``distributed``,
    before any preload runs; only the environment it is spawned with reaches
    that far (``distributed.nanny.pre-spawn-environ``).
    """
    import dask

    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {})
    environ["DASK_LOGGING__DISTRIBUTED"] = logging.getLevelName(check_level(level)).lower()
    return {"distributed.nanny.pre-spawn-environ": environ}


def dask_setup(worker):
    """Preload hook: runs in the worker process before the worker starts (and logs).

    A terminal's Ctrl-C reaches the whole process group, worker processes
    included; the client cancels the run and closes its cluster, so the
    workers ignore SIGINT rather than each print a KeyboardInterrupt traceback.
    """
    level = os.environ.get(_ENV)
    if level:
        apply_log_level(level)
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
