"""Shared-memory segments under ``/dev/shm``: made, mapped, page-locked, tracked and unlinked.

The memory beneath the data plane (:mod:`dsched.dataplane.store` places a
run's arrays in it): segments this process creates (exclusively, mode 0600,
registered with the resource tracker), this process's lasting mappings of any
segment (plain, or page-locked for a GPU) and their release once their run
ended, the sweep of segments whose creator is gone, :func:`shared_empty`
arrays, which live in a segment from the start, and the pool of segments kept
for the next call (:class:`SegmentPool`).
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import secrets
import threading
import time
import weakref

import numpy as np

from dsched.checks import setting
from dsched.names import SEGMENT_PREFIX

__all__ = ["SHM_DIR", "mapped_segment", "pinned_segment", "forget_vanished_segments", "sweep_stale_segments",
           "sweep_now_and_then", "note_user_segment", "forget_user_segment", "shared_empty", "shared_copy",
           "SegmentPool", "POOL", "release_pool", "record_semaphores", "free_shared", "on_free", "shareable",
           "advise_huge_pages", "shared_memory_huge_pages"]

SHM_DIR = "/dev/shm"
_PREFIX = SEGMENT_PREFIX
# dsched-semaphores-<pid>: the named semaphores of the processes <pid> started (not dsched-<pid>-*: no segment)
_LEDGER = f"{SEGMENT_PREFIX}semaphores-"

_mapped: dict = {}  # (token, writable) -> mmap of a whole segment, kept for this process's later chunks
_pinned: dict = {}  # (token, writable) -> (bytes view, pointer) of mappings this process page-locked for a GPU
_mapped_lock = threading.Lock()
_MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels refuse it and pages are faulted one by one
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page (x86-64 and arm64 with 4 KiB pages)


def mapped_segment(token: str, writable: bool, own: bool = True) -> np.ndarray:
    """This process's mapping of a whole segment, as bytes; made once per segment and process.

    A mapping is kept rather than made per chunk: a page is faulted into this
    process once, however many chunks (and calls) touch it, which is what lets
    a worker reading a :func:`shared_empty` array call after call run as fast as
    if the array were its own. The segment itself lives in this process's own
    mapping when it made it (``own=False``: a mapping of its own even then).
    Mappings of segments that have since been unlinked (runs that ended) are
    dropped the next time a chunk maps a segment.
    """
    segment = _own_segments.get(token) if own else None
    if segment is not None:
        return np.frombuffer(segment, np.uint8)
    with _mapped_lock:
        buffer = _mapped.get((token, writable))
        if buffer is None:
            _forget_vanished_segments()
            fd = os.open(os.path.join(SHM_DIR, token), os.O_RDWR if writable else os.O_RDONLY)
            try:
                prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
                buffer = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=prot)
            finally:
                os.close(fd)
            advise_huge_pages(buffer)
            _mapped[(token, writable)] = buffer
    return np.frombuffer(buffer, np.uint8)


def pinned_segment(token: str, writable: bool) -> np.ndarray:
    """This process's page-locked mapping of a whole segment, as bytes; registered once per segment.

    Page-locked (``cudaHostRegister``) host memory is what lets a GPU copy a
    chunk by DMA while it computes another. Registration is costly, so it is
    done once per segment and process; segments that have since been unlinked
    are unregistered when their mapping is dropped.
    """
    # A mapping of its own (never the segment's maker's), so that it is unregistered when it is dropped.
    view = mapped_segment(token, writable, own=False)
    with _mapped_lock:
        if (token, writable) not in _pinned:
            import cupy

            # cudaHostRegisterPortable (1), plus cudaHostRegisterReadOnly (8) for inputs.
            cupy.cuda.runtime.hostRegister(view.ctypes.data, view.nbytes, 1 if writable else 1 | 8)
            _pinned[(token, writable)] = (view, view.ctypes.data)
        return _pinned[(token, writable)][0]


def _forget_vanished_segments():
    """Drop (and unregister) this process's mappings of segments no longer in ``/dev/shm``: their runs ended."""
    for key in [k for k in _mapped if not os.path.exists(os.path.join(SHM_DIR, k[0]))]:
        buffer = _mapped.pop(key)
        pinned = _pinned.pop(key, None)
        if pinned is not None:
            import cupy

            cupy.cuda.runtime.hostUnregister(pinned[1])
        try:
            buffer.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes when it does
            pass


_FORGET_EVERY = 0.5  # seconds between two looks for vanished segments as chunks start (a look stats each one)
_next_forget = [0.0]


def forget_vanished_segments():
    """Unmap this process's mappings of segments whose runs ended (called as a chunk starts, at most every
    :data:`_FORGET_EVERY` seconds: a chunk of a solver's step must not pay a ``stat`` per mapped segment; a new
    segment's mapping looks every time)."""
    now = time.monotonic()
    if _mapped and now >= _next_forget[0]:
        _next_forget[0] = now + _FORGET_EVERY
        with _mapped_lock:
            _forget_vanished_segments()


def _populate(whole, first, length):
    """Fault in the pages of rows about to be written with one call rather than a fault per page."""
    page = mmap.PAGESIZE
    start = first - first % page
    stop = min(-(-(first + length) // page) * page, whole.nbytes)
    buffer = whole.base if isinstance(whole.base, mmap.mmap) else None
    if buffer is not None and stop > start:
        try:
            buffer.madvise(_MADV_POPULATE_WRITE, start, stop - start)
        except (OSError, ValueError):
            pass


def advise_huge_pages(buffer) -> bool:
    """Ask for transparent huge pages over a mapping's whole 2 MiB pieces (``MADV_HUGEPAGE``), before any page of it
    is touched; whether the advice was taken.

    Where ``/dev/shm`` allows huge pages (mounted with ``huge=advise``, ``within_size`` or ``always``), a large
    array streamed from shared memory then runs as fast as one in a process's own memory, which NumPy puts on
    huge pages; on 4 KiB pages a pass over it misses the TLB on every page (the data suite of ``dsched bench``
    measures the two; ``docs/dataplane.md``). Elsewhere the kernel keeps the advice and uses small pages. The
    tail past the last whole piece is left out: a huge page there would hold up to 2 MiB beyond the segment.
    """
    length = len(buffer) - len(buffer) % HUGE_PAGE
    if not length or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE, 0, length)
    except (OSError, ValueError):  # a kernel without transparent huge pages
        return False
    return True


def shared_memory_huge_pages(mounts: str = "/proc/self/mounts") -> str:
    """How ``/dev/shm`` is mounted for huge pages: its ``huge=`` option (``"never"`` when none is given, as by
    default; ``"advise"``, ``"within_size"`` or ``"always"`` let :func:`advise_huge_pages` take effect), or
    ``"unknown"`` where the mount table (``mounts``) cannot be read or has no ``/dev/shm``."""
    try:
        with open(mounts) as table:
            entries = [line.split() for line in table]
    except OSError:
        return "unknown"
    options = [fields[3] for fields in entries if len(fields) > 3 and fields[1] == SHM_DIR]
    if not options:
        return "unknown"
    huge = [o.partition("=")[2] for o in options[-1].split(",") if o.startswith("huge=")]  # the last mount wins
    return huge[0] if huge else "never"


def _map_range(token: str, offset: int, length: int):
    """A private copy-on-write mapping of ``length`` bytes of segment ``token`` from ``offset``, and the offset of
    the data in it (torch inputs, whose tensors are writable)."""
    fd = os.open(os.path.join(SHM_DIR, token), os.O_RDONLY)
    try:
        aligned = offset - offset % mmap.ALLOCATIONGRANULARITY
        buffer = mmap.mmap(fd, max(length + offset - aligned, 1), flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=aligned)
    finally:
        os.close(fd)
    return buffer, offset - aligned


# Segments this process made, by token (weakly: a segment goes when its last view does).
_own_segments: "weakref.WeakValueDictionary[str, mmap.mmap]" = weakref.WeakValueDictionary()


class _Segment:
    """One shared-memory file of this process: created exclusively, mapped, unlinked at close."""

    def __init__(self, nbytes: int, _reused=None):
        if _reused is not None:  # a segment taken from the pool: its file and this process's mapping, as they are
            self.token, self.path, self.buffer = _reused
            _own_segments[self.token] = self.buffer
            return
        self.token = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
        self.path = os.path.join(SHM_DIR, self.token)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            _track(self.token)
            os.ftruncate(fd, max(nbytes, 1))
            self.buffer = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED)
            advise_huge_pages(self.buffer)
            _own_segments[self.token] = self.buffer
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)

    def unlink(self):
        _unlink(self.token, self.path)


def round_to_pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: the size a pooled segment is kept (and matched) at."""
    page = mmap.PAGESIZE
    return max(-(-int(nbytes) // page) * page, page)


class SegmentPool:
    """Segments of finished calls, kept for the next call of the same size instead of being unlinked.

    A new segment costs a page fault per page, in this process and in every
    worker that touches it; a kept one costs none: its file stays in
    ``/dev/shm``, this process keeps its mapping, and the workers keep theirs
    (they drop a mapping only once its file is gone). A solver that calls
    :func:`dsched.dispatch` once per step with the same shapes reuses the same
    segments step after step.

    Segments come back when a run that used them ended cleanly (inputs) or
    when the arrays handed out over them are gone (outputs). At most
    ``dsched.segment-pool`` bytes are kept (Dask config; default 2 GiB, 0 keeps
    none), the oldest given back first; :func:`release_pool` empties it, and
    every kept segment is unlinked at exit (or by the resource tracker).
    """

    def __init__(self):
        self._free = []  # (nbytes, token, path, buffer), oldest first
        self._lent = {}  # token -> path of segments under arrays handed out, to come back when those are gone
        self._lock = threading.RLock()  # re-entrant: a lease's end (a finalizer) may give back under it
        self._shut = None  # at exit, the tokens shutdown unlinked: what is given back later is unlinked too

    @staticmethod
    def capacity() -> int:
        return int(setting("segment-pool", 2 * 2**30))

    def take(self, nbytes: int):
        """A kept segment of exactly ``round_to_pages(nbytes)`` bytes, or ``None``."""
        nbytes = round_to_pages(nbytes)
        with self._lock:
            for i, (size, token, path, buffer) in enumerate(self._free):
                if size == nbytes:
                    del self._free[i]
                    return _Segment(nbytes, _reused=(token, path, buffer))
        return None

    def lend(self, token, path):
        """A segment now lies under arrays handed out: it comes back by :meth:`give`, or goes by :meth:`forget`."""
        with self._lock:
            self._lent[token] = path

    def forget(self, token):
        """A lent segment will not come back (it was unlinked)."""
        with self._lock:
            self._lent.pop(token, None)

    def give(self, token, path, buffer):
        """Keep a segment this process made for a later call (or unlink it, when over the pool's capacity)."""
        size, cap = len(buffer), self.capacity()
        evicted = []
        with self._lock:
            self._lent.pop(token, None)
            if self._shut is not None:  # at exit, after shutdown (a finalizer): unlinked, unless it was then
                if token not in self._shut:
                    evicted.append((token, path))
            elif size <= cap:
                self._free.append((size, token, path, buffer))
            else:
                evicted.append((token, path))
            while sum(entry[0] for entry in self._free) > cap:
                _, old_token, old_path, _ = self._free.pop(0)
                evicted.append((old_token, old_path))
        for old_token, old_path in evicted:
            _unlink(old_token, old_path)

    def held(self) -> int:
        """Bytes kept now."""
        with self._lock:
            return sum(entry[0] for entry in self._free)

    def release(self):
        """Unlink every kept segment (workers drop their mappings at their next chunk)."""
        with self._lock:
            free, self._free = self._free, []
        for _, token, path, _ in free:
            _unlink(token, path)


    def shutdown(self):
        """At exit: unlink the kept segments and those still lent (their arrays die with the process)."""
        with self._lock:
            lent, self._lent = self._lent, {}
            self._shut = set(lent)
        self.release()
        for token, path in lent.items():
            _unlink(token, path)


POOL = SegmentPool()
atexit.register(POOL.shutdown)


_keepers = weakref.WeakSet()  # owners of segments kept for later calls beside the pool (replays' inputs)


def kept_until_released(owner):
    """Have :func:`release_pool` call ``owner.release_kept()``: it gives back what it keeps for later calls."""
    _keepers.add(owner)


def release_pool() -> int:
    """Unlink the segments kept for later calls (:class:`SegmentPool`, and those replay plans keep); the bytes
    released."""
    for owner in list(_keepers):
        owner.release_kept()  # into the pool, released below
    held = POOL.held()
    POOL.release()
    return held


def _unlink(token, path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    _untrack(token)


def _track(token):
    # The resource tracker is a separate process that unlinks what this one leaves behind
    # if it dies without unlinking (SIGKILL): the same mechanism shared_memory uses.
    from multiprocessing import resource_tracker

    resource_tracker.register("/" + token, "shared_memory")


def _untrack(token):
    from multiprocessing import resource_tracker

    resource_tracker.unregister("/" + token, "shared_memory")


SWEEP_INTERVAL = 30.0  # seconds: a process's runs sweep at most this often (its first run always does)
_last_sweep = [float("-inf")]  # when this process last swept (time.monotonic)


def sweep_now_and_then() -> list:
    """:func:`sweep_stale_segments`, if this process has not swept in the last :data:`SWEEP_INTERVAL` seconds.

    Runs call this: listing ``/dev/shm`` on every call costs more than a short
    call itself does on a busy host, and what a dead process left waits a few seconds more.
    """
    now = time.monotonic()
    if now - _last_sweep[0] < SWEEP_INTERVAL:
        return []
    _last_sweep[0] = now
    return sweep_stale_segments()


def sweep_stale_segments() -> list:
    """Unlink this user's segments whose creating process is gone, and the semaphores it recorded; the names
    removed.

    The resource tracker unlinks a killed client's segments, unless it was
    killed too (a whole process group killed at once): then the next run on the
    host removes them. So too the POSIX semaphores of the nannies the client
    started (``sem.mp-*``, their queues to their worker processes), which it
    listed in its ledger (:func:`record_semaphores`); no other semaphore is
    touched. Dask config ``dsched.sweep-stale-segments: false`` turns this off
    (for containers that share ``/dev/shm`` but not process ids).
    """
    from dask import config

    if not config.get("dsched.sweep-stale-segments", True):
        return []
    removed = []
    for name in os.listdir(SHM_DIR):
        ledger = name.startswith(_LEDGER)
        pid = name[len(_LEDGER if ledger else _PREFIX):].partition("-")[0]
        if not name.startswith(_PREFIX) or not pid.isdigit():
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its creator is gone
            if name == f"{_LEDGER}{pid}":  # not a stray copy being written
                removed += _sweep_semaphores(path)
            if _unlinked(path):
                removed.append(name)
        except (PermissionError, FileNotFoundError):
            pass
    return removed


def _unlinked(path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _sweep_semaphores(ledger) -> list:
    """Unlink the semaphores a dead process listed in its ``ledger`` (those of this user still there)."""
    try:
        with open(ledger) as f:
            names = [n for n in f.read().split() if n.startswith("mp-") and "/" not in n]
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(SHM_DIR, f"sem.{name}")
        try:
            if os.stat(path).st_uid == os.getuid() and _unlinked(path):
                removed.append(f"sem.{name}")
        except FileNotFoundError:  # unlinked when its queue went, as it should be
            pass
    return removed


_semaphores: dict = {}  # owner -> names of the named semaphores it made in this process (a nanny's queues)
_semaphores_lock = threading.Lock()


def record_semaphores(owner, names):
    """List the named semaphores ``owner`` made in this process (``mp-...``; none: forget them) in this process's
    ledger, ``/dev/shm/dsched-semaphores-<pid>``.

    Python's resource tracker unlinks them (and the ledger) if this process is
    killed, but not if the tracker is killed with it; then
    :func:`sweep_stale_segments` does, reading the ledger of the dead process.
    The ledger is replaced whole on each change, and removed with its last name.
    """
    with _semaphores_lock:
        had = bool(_semaphores)
        if names:
            _semaphores[owner] = sorted(names)
        else:
            _semaphores.pop(owner, None)
        listed = sorted({n for ns in _semaphores.values() for n in ns})
        token = f"{_LEDGER}{os.getpid()}"
        path = os.path.join(SHM_DIR, token)
        if not listed:
            if had:
                _unlink(token, path)
            return
        fd = os.open(path + "-new", os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(listed) + "\n")
        os.replace(path + "-new", path)  # a process killed mid-write leaves a whole ledger (and a stray -new)
        if not had:
            _track(token)


# --- arrays that live in shared memory from the start ----------------------------

# token -> (address, size) of the segments under arrays this process's user holds: shared_empty arrays,
# and a run's outputs (their segments lent by the pool) while those arrays live. Fed back as inputs,
# such arrays travel by reference.
_user_segments: dict = {}
_releasers: dict = {}  # token -> what unlinks the segment under a user's arrays now (free_shared)
_user_lock = threading.RLock()  # re-entrant: a lease's end (a finalizer) may run in a collection under it
# Arrays found in those segments, id -> (a weak reference to the array, its (token, offset)), while no segment is
# noted or forgotten: a solver passes the same arrays call after call (a batch's fields).
_found: dict = {}
FOUND_KEPT = 64


def note_user_segment(token, address, size):
    """Arrays over the segment ``token`` (mapped at ``address``, ``size`` bytes) are the user's from now on."""
    with _user_lock:
        _user_segments[token] = (address, max(int(size), 1))
        _found.clear()


def forget_user_segment(token):
    """No array of the user's lies over the segment ``token`` any more (or its name is gone)."""
    with _user_lock:
        _user_segments.pop(token, None)
        _releasers.pop(token, None)
        _found.clear()


def on_free(token, release):
    """``release()`` unlinks the user's segment ``token`` when :func:`free_shared` is called on one of its arrays."""
    with _user_lock:
        _releasers[token] = release


def free_shared(array) -> bool:
    """Unlink now the segment under ``array`` (a :func:`shared_empty` array or a run's output; or the segment's
    name), rather than when its last array is collected; whether there was one.

    Its arrays in this process stay readable and writable; worker processes can no longer open the segment by
    name, and drop their mappings of it at their next chunk. For an owner that knows no one uses the arrays any
    more (a resident batch at ``close()``), so that ``/dev/shm`` gives the memory back at once.

    Examples
    --------
    >>> x = shared_empty(4)
    >>> free_shared(x), free_shared(x), free_shared(np.zeros(4))
    (True, False, False)
    """
    if isinstance(array, str):
        token = array
    else:
        found = _shared_location(array) if isinstance(array, np.ndarray) else None
        if found is None:
            return False
        token = found[0]
    with _user_lock:
        release = _releasers.pop(token, None)
    if release is None:
        return False
    release()
    return True


def shareable(shape, dtype) -> tuple:
    """``(shape as a tuple of ints, np.dtype)`` of an array to place in shared memory; a ValueError for Python
    objects, which cannot be shared."""
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(n) for n in shape)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise ValueError(f"dtype: arrays of Python objects cannot be shared, got {dtype}")
    return shape, dtype


def shared_empty(shape, dtype=float) -> np.ndarray:
    """A new NumPy array in shared memory, for inputs and outputs used again and again.

    :func:`dsched.dispatch` passes it (or a contiguous slice of it) to worker
    processes on this host by reference, with no copy; given as ``out=``, the
    workers write their rows straight into it. Its pages stay mapped between
    calls, so repeated calls pay no page faults. The segment is unlinked when
    the array (and every view of it) is gone, or by the resource tracker if
    the process dies.

    Examples
    --------
    >>> strain = shared_empty((1000, 6))
    >>> strain[:] = 0.0
    """
    shape, dtype = shareable(shape, dtype)
    count = math.prod(shape)
    segment = _Segment(count * dtype.itemsize)
    array = np.frombuffer(segment.buffer, dtype, count=count).reshape(shape)
    note_user_segment(segment.token, array.__array_interface__["data"][0], count * dtype.itemsize)
    buffer, token, path = segment.buffer, segment.token, segment.path
    del segment  # the finalizer must not hold what holds the mapping, or the mapping would never be collected
    on_free(token, weakref.finalize(buffer, _release_user_segment, token, path))  # calling it now unlinks it now
    return array


def shared_copy(array) -> np.ndarray:
    """``array`` copied into a new :func:`shared_empty` array."""
    array = np.asarray(array)
    shared = shared_empty(array.shape, array.dtype)
    np.copyto(shared, array)
    return shared


def _release_user_segment(token, path):
    forget_user_segment(token)
    _unlink(token, path)


def _shared_location(array):
    """``(token, offset)`` of ``array``'s bytes in one of this process's :func:`shared_empty` segments, or ``None``."""
    seen = _found.get(id(array))
    if seen is not None and seen[0]() is array:
        return seen[1]
    start = array.__array_interface__["data"][0]
    with _user_lock:
        for token, (address, size) in list(_user_segments.items()):  # a finalizer may forget one meanwhile
            if address <= start and start + array.nbytes <= address + size:
                if len(_found) >= FOUND_KEPT:
                    _found.clear()
                _found[id(array)] = (weakref.ref(array), (token, start - address))
                return token, start - address
    return None
