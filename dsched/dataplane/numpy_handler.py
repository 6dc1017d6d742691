"""Chosen NumPy allocations placed at given addresses: a NEP 49 memory handler, active per thread.

NumPy (1.22 and later) lets a program choose the functions that allocate
array data, per thread (NEP 49, a context variable). :func:`placing` installs
dsched's handler around one call: the call's allocations are counted in
order, and those a plan names (the allocation at position *n*, if it asks for
exactly the planned number of bytes) get the planned address instead of
fresh memory. Every other allocation goes to NumPy's own handler. A worker
uses it to let a model's results be allocated in the chunk's output rows
(:mod:`dsched.worker.result_placement`), so that they need no copy there.

A placed allocation is never given to the C allocator: its ``free`` does
nothing but forget it, and ``realloc`` moves it to ordinary memory. While an
array placed at an address lives, an object given with the address (the
destination's view) is kept alive with it, which keeps its mapping open.

The handler is built with ctypes against NumPy's C API table, so no
compiled extension is needed; :func:`available` says whether it could be
(CPython and a NumPy with NEP 49), and without it :func:`placing` places nothing.

Examples
--------
>>> import numpy as np
>>> rows = np.empty(4)
>>> with placing({0: (rows.ctypes.data, rows.nbytes, rows)}) as call:
...     y = np.arange(4.0)   # the call's first allocation: placed in rows
>>> call.placed, y.ctypes.data == rows.ctypes.data, rows.tolist()
(1, True, [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

__all__ = ["Placing", "available", "placing", "live_placements"]

_POSITION_LIMIT = 100_000  # allocations logged per call at most (a model allocating more is not learned from)


class Placing:
    """One call's placement: the plan, the count of allocations so far and, when learning, their log.

    ``targets`` maps an allocation's position to ``(address, nbytes, keep)``:
    ``keep`` (the destination's view, say) lives as long as the array placed
    there. ``log`` (when ``learn``) lists ``(position, address, nbytes)`` of
    every allocation not placed, up to a limit (``overflowed`` past it).
    """

    __slots__ = ("targets", "count", "placed", "addresses", "log", "overflowed")

    def __init__(self, targets, learn=False):
        self.targets = targets
        self.count = 0
        self.placed = 0
        self.addresses = []  # of the allocations placed by this call
        self.log = [] if learn else None
        self.overflowed = False


_thread = threading.local()
_live = {}  # address -> (nbytes, keep) of every placed allocation still alive (dict ops are atomic under the GIL)


def live_placements(addresses) -> list:
    """Those of ``addresses`` at which an array placed there is still alive."""
    return [address for address in addresses if address in _live]


def _place(size):
    """The planned address of this thread's next allocation (of ``size`` bytes), or ``None``."""
    call = getattr(_thread, "call", None)
    if call is None:
        return None
    position = call.count
    call.count = position + 1
    target = call.targets.get(position)
    if target is None or target[1] != size or target[0] in _live:  # an array still there: never twice
        return None
    _live[target[0]] = (size, target[2])
    call.placed += 1
    call.addresses.append(target[0])
    return target[0]


def _log(size, address):
    call = getattr(_thread, "call", None)
    if call is not None and call.log is not None:
        if len(call.log) < _POSITION_LIMIT:
            call.log.append((call.count - 1, address, size))
        else:
            call.overflowed = True
    return address


def _build():
    """The handler's capsule and NumPy's ``PyDataMem_SetHandler``, or ``None`` where they cannot be had."""
    try:
        try:
            from numpy._core import multiarray
        except ImportError:  # NumPy 1.x
            from numpy.core import multiarray
        api = ctypes.pythonapi
        get_pointer = api.PyCapsule_GetPointer
        get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        new_capsule = api.PyCapsule_New
        new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p] * 3
        table = ctypes.cast(get_pointer(multiarray._ARRAY_API, None), ctypes.POINTER(ctypes.c_void_p))
        # PyDataMem_SetHandler and PyDataMem_GetHandler: entries 304 and 305 of NumPy's C API (stable since 1.22)
        set_handler = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(table[304])
        get_handler = ctypes.PYFUNCTYPE(ctypes.py_object)(table[305])
        numpy_handler = _Handler.from_address(get_pointer(get_handler(), b"mem_handler"))
    except Exception:  # noqa: BLE001  not CPython, an old NumPy: nothing is placed
        return None
    if numpy_handler.version != 1:
        return None
    return _make(numpy_handler, new_capsule), set_handler


_MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_CALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
_REALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


class _Allocator(ctypes.Structure):  # NumPy's PyDataMemAllocator
    _fields_ = [("ctx", ctypes.c_void_p), ("malloc", ctypes.c_void_p), ("calloc", ctypes.c_void_p),
                ("realloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


class _Handler(ctypes.Structure):  # NumPy's PyDataMem_Handler
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("allocator", _Allocator)]


def _make(numpy_handler, new_capsule):
    """dsched's handler: NumPy's own functions, except for the allocations a plan places."""
    theirs = numpy_handler.allocator
    ctx = theirs.ctx
    # Called with the GIL held (PYFUNCTYPE): NumPy's own calloc releases it around a large calloc itself.
    their_malloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(theirs.malloc)
    their_calloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)(theirs.calloc)
    their_realloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
        theirs.realloc)
    their_free = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(theirs.free)

    @_MALLOC
    def malloc(_, size):
        address = _place(size)
        return address if address is not None else _log(size, their_malloc(ctx, size))

    @_CALLOC
    def calloc(_, count, itemsize):
        address = _place(count * itemsize)
        if address is None:
            return _log(count * itemsize, their_calloc(ctx, count, itemsize))
        ctypes.memset(address, 0, count * itemsize)
        return address

    @_REALLOC
    def realloc(_, address, size):
        placed = _live.pop(address, None)
        if placed is None:
            return their_realloc(ctx, address, size)
        moved = their_malloc(ctx, size)  # out of the destination: the array no longer lies there
        if moved:
            ctypes.memmove(moved, address, min(size, placed[0]))
        return moved

    @_FREE
    def free(_, address, size):
        if _live.pop(address, None) is None:
            their_free(ctx, address, size)

    functions = (malloc, calloc, realloc, free)
    handler = _Handler(b"dsched_placing", 1, _Allocator(ctx, *(ctypes.cast(f, ctypes.c_void_p) for f in functions)))
    name = ctypes.create_string_buffer(b"mem_handler")
    capsule = new_capsule(ctypes.addressof(handler), ctypes.addressof(name), None)
    _keep_alive.extend([functions, their_malloc, their_calloc, their_realloc, their_free, handler, name])
    return capsule


_keep_alive = []  # the callbacks, the structure and its name: arrays placed by the handler outlive any call
_built = None
_build_lock = threading.Lock()


def _handler():
    global _built
    with _build_lock:
        if _built is None:
            _built = _build() or False
    return _built


def available() -> bool:
    """Whether NumPy allocations can be placed here (CPython, NumPy 1.22 or later)."""
    return bool(_handler())


@contextlib.contextmanager
def placing(targets, *, learn=False):
    """Within the block, this thread's NumPy allocations at the positions of ``targets`` are placed there.

    ``targets``: ``{position: (address, nbytes, keep)}``; ``learn`` logs every
    allocation not placed (see :class:`Placing`). Yields the :class:`Placing`.
    Without a handler (:func:`available` is false) nothing is placed or logged.
    """
    call = Placing(targets, learn)
    built = _handler()
    if not built:
        yield call
        return
    capsule, set_handler = built
    outer = getattr(_thread, "call", None)
    _thread.call = call
    previous = set_handler(capsule)
    try:
        yield call
    finally:
        set_handler(previous)
        _thread.call = outer
