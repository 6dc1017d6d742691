"""How much Dask says: quiet by default, more with ``dsched run -v``.

The level is the Dask config ``dsched.log-level`` (``"warning"`` unless set).
It applies to Dask's ``distributed`` loggers in this process and, through
this module as a worker preload, in every worker process. Above INFO a failed
chunk's "Compute Failed" log is dropped as well (the dispatcher raises that
chunk's error itself, once), and so are the "ended with CancelledError" lines
of chunks cancelled by Ctrl-C.
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


_COMPUTE_FAILED_FILTER = _DropComputeFailed()
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
    """Dask's ``distributed`` logs at ``level`` in this process; above INFO without "Compute Failed"."""
    value = check_level(level)
    logging.getLogger("distributed").setLevel(value)
    for name in _FILTERED_LOGGERS:
        if value > logging.INFO:
            logging.getLogger(name).addFilter(_COMPUTE_FAILED_FILTER)
        else:
            logging.getLogger(name).removeFilter(_COMPUTE_FAILED_FILTER)


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
