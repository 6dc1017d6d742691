"""Compute threads per worker: torch's intra-op pool and the BLAS pools sized to each worker's share of the cores.

Every worker thread that runs a chunk calls into torch or BLAS, and each of
those would start one compute thread per core: three workers of two threads
on two cores would run a dozen threads on two cores. :class:`ThreadLimits`
gives every worker ``cores // (workers x threads per worker)`` compute threads
(at least one) when it starts, unless the user has set ``OMP_NUM_THREADS``
in the process that built the cluster. :class:`~dsched.LocalHybridCluster`
installs it on every worker.

torch's count belongs to each thread (OpenMP keeps it per thread), so it is
applied in the threads that run chunks: by :func:`limit_this_thread`, which
:func:`dsched.dispatch`'s chunks, :class:`~dsched.PerThread` models and the
NEML2 adapter call (once per thread; call it in your own ``do_work`` that uses
torch). In a worker's own process the environment also says it before torch
is imported, so every thread starts with it.

Worker processes also get glibc's large-allocation threshold back. Dask's
nanny starts them with ``MALLOC_TRIM_THRESHOLD_=65536``, and setting that
variable freezes glibc's mmap threshold at 128 KiB: every large temporary
tensor is then a fresh ``mmap`` with page faults on first touch, which made
NEML2's viscoplastic update 3 to 4 times slower per chunk than in a plain
process (measured on 20,000 points). :func:`restore_mmap_threshold` sets the
mmap threshold to 32 MiB and the trim threshold to 64 MiB, the values glibc's
own adaptive rule reaches; memory above them still goes back to the system.
It also keeps 64 MiB of top padding: chunks run in worker threads, whose
glibc arenas grow in heaps of their own, and an arena deletes a heap as soon
as it is empty (whatever the trim threshold), so a model whose temporaries
filled one more heap mapped it afresh and faulted every page of it on every
call: 1,624 page faults per step and a quarter of the time of NEML2's
elasticity on 250,000 points in a thread, none with the padding.
"""

from __future__ import annotations

import os
import sys
import threading

from distributed.diagnostics.plugin import WorkerPlugin

from dsched.checks import check_positive_int

__all__ = ["ThreadLimits", "thread_share", "apply_thread_limit", "limit_this_thread", "restore_mmap_threshold",
           "user_thread_settings"]

MMAP_THRESHOLD = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems

_share = None  # compute threads per chunk thread in this process, set by ThreadLimits
_applied = threading.local()

# What the user may set to keep their own thread counts: torch reads the first two at import.
USER_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def thread_share(worker_threads: int, cores: int | None = None) -> int:
    """Compute threads for each chunk: this host's cores over the worker threads running chunks, at least 1.

    Examples
    --------
    >>> thread_share(4, cores=2), thread_share(2, cores=16)
    (1, 8)
    """
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, worker_threads))


def apply_thread_limit(threads: int, *, own_process: bool) -> dict:
    """Limit torch's intra-op pool (and NumPy's BLAS, where threadpoolctl is installed) to ``threads``.

    torch not yet imported: in a worker's own process the environment says
    it for the later import; in the caller's process nothing is changed.
    Returns what was set, for logs and tests.
    """
    done = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
        done["torch"] = threads
    elif own_process:
        for name in USER_VARIABLES:
            os.environ[name] = str(threads)
        done["environment"] = threads
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        pass  # worker processes already get 1 BLAS thread from Dask's nanny environment
    else:
        threadpool_limits(threads)
        done["blas"] = threads
    return done


class ThreadLimits(WorkerPlugin):
    """Give each worker ``threads`` compute threads when it starts (see the module docs).

    Parameters
    ----------
    threads : int
        Compute threads per chunk, usually :func:`thread_share`.
    """

    name = "dsched-thread-limits"
    idempotent = True

    def __init__(self, threads: int):
        check_positive_int(threads, "threads", integers=int, below=None)
        self.threads = threads
        self.user_set = user_thread_settings()
        self.creator_pid = os.getpid()
        self.applied = None

    def setup(self, worker):
        global _share
        if os.getpid() != self.creator_pid and "MALLOC_TRIM_THRESHOLD_" in os.environ:
            restore_mmap_threshold()  # not a thread setting, but the same per-worker compute set-up
        if self.user_set:
            self.applied = {}
            return
        _share = self.threads
        self.applied = apply_thread_limit(self.threads, own_process=os.getpid() != self.creator_pid)


def user_thread_settings() -> dict:
    """The user's ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` in this process.

    Dask's nanny writes its own values (``distributed.nanny.pre-spawn-environ``,
    1 thread) into the environment of the process that starts worker
    processes, and leaves them there; those are not the user's choice.
    """
    import dask

    dask_values = dask.config.get("distributed.nanny.pre-spawn-environ", {}) or {}
    return {name: os.environ[name] for name in USER_VARIABLES
            if name in os.environ and os.environ[name] != str(dask_values.get(name))}


def limit_this_thread() -> None:
    """Give the calling thread this worker's share of torch threads, once per thread (a no-op elsewhere).

    Cheap after the first call; does nothing outside a worker with
    :class:`ThreadLimits`, or before torch is imported.
    """
    if _share is None or getattr(_applied, "threads", None) == _share:
        return
    # Another of the worker's threads may be importing torch right now: its module is then in sys.modules,
    # half made, without set_num_threads yet. This thread is limited on a later call.
    set_num_threads = getattr(sys.modules.get("torch"), "set_num_threads", None)
    if set_num_threads is not None:
        set_num_threads(_share)
        _applied.threads = _share


def restore_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Let glibc serve allocations below ``threshold`` bytes from its heaps, and keep twice that before trimming
    one or deleting a thread's empty heap.

    See the module docs; whether it could (only glibc can).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        # -3: M_MMAP_THRESHOLD; -1: M_TRIM_THRESHOLD (glibc's adaptive rule keeps it at twice the former);
        # -2: M_TOP_PAD, which a thread arena's empty heap must exceed to be deleted.
        return all(libc.mallopt(option, value) for option, value in (
            (-3, int(threshold)), (-1, 2 * int(threshold)), (-2, 2 * int(threshold))))
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to restore
        return False
