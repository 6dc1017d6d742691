"""Chosen NumPy allocations placed at given addresses: a NEP 49 memory handler, active per thread.

NumPy (1.22 and later) lets a program choose the functions that allocate array
data, per thread (NEP 49, a context variable). :func:`placing` installs
dsched's handler around one call: the call's allocations are counted in
order, and those a plan names (the allocation at position *n*, if it asks for
exactly the planned number of bytes through ``malloc``) get the planned
address instead of fresh memory. Every other allocation goes to NumPy's own
default handler. A worker uses it to let a model's results be allocated in
the chunk's output rows (:mod:`dsched.worker.result_placement`), so that they
need no copy there.

Rules that keep other arrays safe:

- only ``malloc`` allocations are placed, never ``calloc`` ones: NumPy makes
  arrays of Python objects (and other dtypes that need their memory zeroed)
  through ``calloc``, and their memory must never be written over;
- an address range is never given while an array placed over any part of it
  lives; a placed allocation's ``free`` only forgets it, and ``realloc``
  moves it out to ordinary memory;
- while a placed array lives, the object given with its address (the
  destination's view) is kept alive, which keeps its mapping open;
- when learning, every allocation of the call is logged and followed until
  it is freed (:meth:`Placing.survivors`), so a caller can tell what the code
  it ran keeps;
- an error that frees arrays of the call as it leaves their frame stays
  itself: a callback cannot leave a Python error pending, so ``free`` keeps
  it, and :func:`placing` raises it in place of the ``SystemError`` Python
  makes of an error return without an error.

The handler is built with ctypes against NumPy's C API table, so no compiled
extension is needed; :func:`available` says whether it could be (CPython and
a NumPy with NEP 49), and without it :func:`placing` places nothing. A
callback that fails returns no memory (NumPy raises ``MemoryError``); nothing
is placed on the main thread, where a Ctrl-C could land in a callback.

Examples
--------
>>> import threading
>>> import numpy as np
>>> rows, seen = np.empty(4), {}
>>> def model_call():   # on a worker's thread, as a chunk runs
...     with placing({0: (rows.ctypes.data, rows.nbytes, rows)}) as call:
...         y = np.arange(4.0)   # the call's first allocation: placed in rows
...     seen.update(placed=call.placed, in_rows=y.ctypes.data == rows.ctypes.data)
>>> worker = threading.Thread(target=model_call); worker.start(); worker.join()
>>> seen, rows.tolist()
({'placed': 1, 'in_rows': True}, [0.0, 1.0, 2.0, 3.0])
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading

__all__ = ["Placing", "available", "places_here", "placing", "live_placements", "still_alive"]

_LOG_LIMIT = 100_000  # allocations logged per call at most (a model allocating more is not learned from)


class Placing:
    """One call's placement: the plan, the count of allocations so far and, when learning, their log.

    ``targets`` maps an allocation's position to ``(address, nbytes, keep)``:
    ``keep`` (the destination's view, say) lives as long as the array placed
    there. ``log`` (when ``learn``) lists ``(position, address, nbytes,
    zeroed)`` of every allocation, up to a limit (``overflowed`` past it).
    """

    __slots__ = ("targets", "count", "placed", "addresses", "log", "overflowed", "__weakref__")

    def __init__(self, targets, learn=False):
        self.targets = targets
        self.count = 0
        self.placed = 0
        self.addresses = []  # (address, serial) of the allocations placed by this call
        self.log = [] if learn else None
        self.overflowed = False

    def survivors(self) -> list:
        """Addresses of this call's logged allocations that are not freed yet."""
        return [address for _, address, _, _ in self.log or () if _followed.get(address) is self]

    def unfollow(self, keep=()):
        """Stop following this call's allocations, except the addresses in ``keep``."""
        keep = set(keep)
        for _, address, _, _ in self.log or ():
            if address not in keep and _followed.get(address) is self:
                _followed.pop(address, None)  # freed meanwhile on another thread: already gone


_thread = threading.local()
# Dict operations are atomic under the GIL, which every callback holds.
_live = {}  # address -> (nbytes, keep, serial) of every placed allocation still alive
_serials = itertools.count()  # each placement's own number: a later one at the same address is another
_followed = {}  # address -> the learning Placing that made it, until it is freed or unfollowed


def live_placements(placements) -> list:
    """Those of ``placements`` (``(address, serial)``, as a call's ``addresses`` holds them) still alive: not
    freed, nor replaced by a later placement at the same address (the same rows of a reused segment, in the
    next call's chunk on another thread)."""
    return [(address, serial) for address, serial in placements
            if (_live.get(address) or (None, None, None))[2] == serial]


def still_alive(call, addresses) -> list:
    """Those of ``addresses``, logged by the learning ``call``, not freed yet."""
    return [address for address in addresses if _followed.get(address) is call]


def _overlaps_live(address, size) -> bool:
    # a copy of the items, taken at once: another thread's callback may change _live between two steps of a loop
    return any(other < address + size and address < other + nbytes for other, (nbytes, *_) in tuple(_live.items()))


def _next_position(call):
    position = call.count
    call.count = position + 1
    return position


def _place(call, size):
    """The planned address of the call's next allocation (``malloc`` of ``size`` bytes), or ``None``."""
    target = call.targets.get(_next_position(call))
    if target is None or target[1] != size or _overlaps_live(target[0], size):
        return None
    serial = next(_serials)
    _live[target[0]] = (size, target[2], serial)
    call.placed += 1
    call.addresses.append((target[0], serial))
    return target[0]


def _log(call, size, address, zeroed):
    if call.log is not None and address:
        if len(call.log) < _LOG_LIMIT:
            call.log.append((call.count - 1, address, size, zeroed))
            _followed[address] = call
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
        # NumPy's C API (stable since 1.22): 304 PyDataMem_SetHandler, 306 PyDataMem_DefaultHandler
        set_handler = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(table[304])
        default = ctypes.cast(table[306], ctypes.POINTER(ctypes.py_object)).contents.value
        numpy_handler = _Handler.from_address(get_pointer(default, b"mem_handler"))
    except Exception:  # noqa: BLE001  not CPython, an old NumPy: nothing is placed
        return None
    if numpy_handler.version != 1:
        return None
    return _make(numpy_handler, new_capsule), set_handler


class _Allocator(ctypes.Structure):  # NumPy's PyDataMemAllocator
    _fields_ = [("ctx", ctypes.c_void_p), ("malloc", ctypes.c_void_p), ("calloc", ctypes.c_void_p),
                ("realloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


class _Handler(ctypes.Structure):  # NumPy's PyDataMem_Handler
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("allocator", _Allocator)]


_VOID_P, _SIZE = ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES = {"malloc": (_VOID_P, _VOID_P, _SIZE), "calloc": (_VOID_P, _VOID_P, _SIZE, _SIZE),
               "realloc": (_VOID_P, _VOID_P, _VOID_P, _SIZE), "free": (None, _VOID_P, _VOID_P, _SIZE)}


def _make(numpy_handler, new_capsule):
    """dsched's handler: NumPy's own functions, except for the allocations a plan places."""
    theirs = numpy_handler.allocator
    ctx = theirs.ctx
    # Called with the GIL held (PYFUNCTYPE): NumPy's own calloc releases it around a large calloc itself.
    their = {name: ctypes.PYFUNCTYPE(*signature)(getattr(theirs, name)) for name, signature in _SIGNATURES.items()}
    callback = {name: ctypes.CFUNCTYPE(*signature) for name, signature in _SIGNATURES.items()}

    # A Python exception cannot cross into NumPy: a failing callback gives no memory (NumPy's MemoryError).
    @callback["malloc"]
    def malloc(_, size):
        try:
            call = getattr(_thread, "call", None)
            address = _place(call, size) if call is not None else None
            if address is not None:
                return address
            address = their["malloc"](ctx, size)
            return _log(call, size, address, False) if call is not None else address
        except BaseException:  # noqa: BLE001
            return None

    @callback["calloc"]
    def calloc(_, count, itemsize):
        try:
            call = getattr(_thread, "call", None)
            address = their["calloc"](ctx, count, itemsize)
            if call is None:
                return address
            _next_position(call)  # counted, never placed: object arrays are made zeroed
            return _log(call, count * itemsize, address, True)
        except BaseException:  # noqa: BLE001
            return None

    @callback["realloc"]
    def realloc(_, address, size):
        try:
            placed = _live.get(address)
            if placed is None:
                owner = _followed.pop(address, None)
                moved = their["realloc"](ctx, address, size)
                if owner is not None and moved:
                    _followed[moved] = owner
                return moved
            moved = their["malloc"](ctx, size)  # out of the destination: the array no longer lies there
            if moved:
                ctypes.memmove(moved, address, min(size, placed[0]))
                del _live[address]
            return moved
        except BaseException:  # noqa: BLE001
            return None

    # An error leaving a frame (or a failing ufunc) frees the arrays it made with the error pending. A callback
    # cannot leave it so: the first call that checks Python's error indicator raises it here. So free raises it
    # first, on purpose (pending() checks), and keeps it for placing() to raise in place of the SystemError that
    # NumPy or Python then makes of an error return without an error.
    pending = ctypes.pythonapi.Py_IsInitialized
    pending.restype, pending.argtypes = ctypes.c_int, []

    @callback["free"]
    def free(_, address, size):
        try:
            pending()
        except BaseException as err:  # noqa: BLE001
            _keep_lost(err)
        try:
            _followed.pop(address, None)
            if _live.pop(address, None) is None:
                their["free"](ctx, address, size)
        except BaseException:  # noqa: BLE001  a leak rather than a crash
            pass

    functions = (malloc, calloc, realloc, free)
    handler = _Handler(b"dsched_placing", 1, _Allocator(ctx, *(ctypes.cast(f, ctypes.c_void_p) for f in functions)))
    name = ctypes.create_string_buffer(b"mem_handler")
    capsule = new_capsule(ctypes.addressof(handler), ctypes.addressof(name), None)
    _keep_alive.extend([functions, their, handler, name])
    return capsule


# What Python says of an error return with no error set (the error dropped): the SystemError placing() replaces.
_LOST_SAYS = ("without setting an exception", "error return without exception set",
              "returned a result with an exception set")


def _says_lost(error) -> bool:
    return type(error) is SystemError and any(words in str(error) for words in _LOST_SAYS)


def _keep_lost(error):
    """Keep ``error``, pending as an array was freed, for the placing() under way on this thread (if any): the
    latest, but not the SystemError Python makes of the one kept as it unwinds further."""
    if getattr(_thread, "call", None) is None:
        return
    if _says_lost(error) and getattr(_thread, "lost", None) is not None:
        return
    _thread.lost = error


def _lost_error():
    """The error kept by :func:`_keep_lost` since the last look, now forgotten; ``None`` if none."""
    error, _thread.lost = getattr(_thread, "lost", None), None
    return error


_keep_alive = []  # the callbacks, the structure and its name: arrays allocated by the handler outlive any call
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


def places_here() -> bool:
    """Whether :func:`placing` places anything on this thread: the handler is :func:`available`, and this is not
    the main thread (where a Ctrl-C could land in a callback)."""
    return available() and threading.current_thread() is not threading.main_thread()


@contextlib.contextmanager
def placing(targets, *, learn=False):
    """Within the block, this thread's NumPy allocations at the positions of ``targets`` are placed there.

    ``targets``: ``{position: (address, nbytes, keep)}``; ``learn`` logs and
    follows every allocation (see :class:`Placing`). Yields the :class:`Placing`.
    Without a handler (:func:`available` is false), or on the main thread,
    nothing is placed or logged.
    """
    call = Placing(targets, learn)
    if not places_here():
        yield call
        return
    capsule, set_handler = _handler()
    outer = getattr(_thread, "call", None)
    _thread.call = call
    lost = _lost_error()  # an outer call's, if any
    previous = set_handler(capsule)
    try:
        yield call
    except SystemError as err:
        # The block's own error, lost as an array was freed (see _make), is raised as itself.
        error = _lost_error() if _says_lost(err) else None
        if error is None:
            raise
        raise error from error.__cause__  # its own cause kept; the SystemError is no context of it
    finally:
        set_handler(previous)
        _thread.call = outer
        _thread.lost = lost
