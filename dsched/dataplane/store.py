"""The data plane's memory: a batch is placed once where workers read it, and chunks carry references.

A run's :class:`RunStore` owns the memory of one dispatch. It puts each input
array where the workers can read it without a copy, and hands out
:class:`ArrayRef` descriptors (a name, a shape and a dtype: about a hundred
bytes whatever the array's size):

- workers in the client's own process (an in-process cluster) read the
  client's array itself, through a registry keyed by the reference's token;
- workers on the client's host map a shared-memory segment under
  ``/dev/shm`` (one copy, made once per run) and slice it without copying;
- workers on other hosts cannot map the client's memory: their chunks get
  the slice's bytes straight from the client (``client.scatter(direct=True)``),
  never through the Dask scheduler (see :func:`classify_workers`).

Output arrays are allocated the same way, and each chunk writes its own rows
where it runs (disjoint rows, so no lock).

Lifetime: a segment lives while its run does, and is then kept for the next
call of the same size (:class:`~dsched.dataplane.segments.SegmentPool`): an
input segment when its run ends cleanly, an output segment when the arrays
returned over it are gone. A run that failed, timed out or was interrupted
keeps nothing: :meth:`RunStore.close` unlinks its segments (a chunk still
running somewhere must not write into a later call's memory); the client's
mapping of an output keeps the memory alive for as long as the user holds the
returned array, with no name left in ``/dev/shm``. Segments are registered with
Python's resource tracker, a separate process that unlinks them should the
client be killed. Names carry 128 random bits and files are created with mode
0600 and ``O_EXCL``, so another client (or another run) cannot guess, read
or overwrite a run's segments.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from dsched.dataplane.loaders import ArrayLoader, MappingLoader, Ranges
from dsched.dataplane.segments import (
    _PREFIX,
    POOL,
    SHM_DIR,
    _map_range,
    _populate,
    _Segment,
    _shared_location,
    _unlink,
    forget_user_segment,
    mapped_segment,
    note_user_segment,
    on_free,
    pinned_segment,
    round_to_pages,
    shareable,
    shared_copy,
    shared_empty,
    sweep_now_and_then,
    sweep_stale_segments,  # noqa: F401  (dsched.store, the old path, re-exports it from here)
)
from dsched.dataplane.sources import resolve_rows

_pid = [os.getpid()]  # this process's id, read once per chunk path: os.getpid() is a system call
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def _this_pid() -> int:
    return _pid[0]


# Re-exported: the chunk runner (dsched.worker.chunk) and older code import it from here.
from dsched.devices import backends
from dsched.devices.templates import pack_template, unpack_template

__all__ = ["ArrayRef", "RunStore", "classify_workers", "shared_empty", "shared_copy", "pooled_empty", "find_shared",
           "shared_location", "SHM_DIR"]

# Arrays of this process that in-process workers read directly, by token.
_local_arrays: dict[str, np.ndarray] = {}
_local_lock = threading.Lock()


@dataclass(frozen=True)
class ArrayRef:
    """A reference to an array placed by a :class:`RunStore`: small, picklable, sliceable where it runs.

    ``pid`` is the process that placed it, ``token`` its name (also the segment's
    name under ``/dev/shm`` when ``shared`` is true), ``offset`` where its bytes
    start in that segment (the arrays of one call share a segment).
    """

    token: str
    shape: tuple
    dtype: str
    pid: int
    shared: bool
    offset: int = 0

    def __reduce__(self):
        # Positional, without field names: a chunk's task carries several of these.
        return ArrayRef, (self.token, self.shape, self.dtype, self.pid, self.shared, self.offset)

    def rows(self, start: int, stop: int, *, writable: bool = False, pinned: bool = False,
             private: bool = False) -> np.ndarray:
        """Rows ``start:stop`` (along axis 0) as a view: the client's own array, or a mapping of just those rows.

        ``pinned``: from this process's page-locked mapping of the whole segment
        (:func:`pinned_segment`), so that a GPU copies them by DMA, asynchronously.
        ``private``: a copy-on-write mapping, writable without touching the segment
        (for torch, whose tensors cannot be read-only).
        """
        if self.pid == _this_pid():
            array = _local_arrays.get(self.token)
            if array is not None:
                view = array[start:stop]
                if not writable:
                    view = view.view()
                    view.flags.writeable = False  # inputs are read-only, as in the other processes
                return view
        if not self.shared:
            raise RuntimeError(f"array {self.token} lives in process {self.pid} and was not shared with this one")
        per_row = math.prod(self.shape[1:])
        itemsize = np.dtype(self.dtype).itemsize
        count = stop - start
        first = self.offset + start * per_row * itemsize
        length = count * per_row * itemsize
        if private:  # copy-on-write: a mapping of its own, dropped with the chunk
            buffer, delta = _map_range(self.token, first, length)
            base = np.frombuffer(buffer, np.uint8, count=length, offset=delta)
        else:
            whole = pinned_segment(self.token, writable) if pinned else mapped_segment(self.token, writable)
            base = whole[first:first + length]
            if writable and not pinned:
                _populate(whole, first, length)
        view = base.view(self.dtype).reshape((count,) + tuple(self.shape[1:]))
        if not writable and view.flags.writeable:
            view.flags.writeable = False  # inputs are read-only, also in the process that made the segment
        return view

    def whole(self, *, writable: bool = False) -> np.ndarray:
        return self.rows(0, self.shape[0], writable=writable)

    def take(self, axis: int, start: int, stop: int, pinned: bool = False) -> np.ndarray:
        """Items ``start:stop`` along ``axis`` (read-only); only axis 0 maps less than the whole array."""
        if axis == 0:
            return self.rows(start, stop, pinned=pinned and self.shared)
        return self.whole()[(slice(None),) * axis + (slice(start, stop),)]


class Placement:
    """An array being placed in a store: its reference, and its rows copied as chunks are handed out.

    Copying a chunk's rows just before the chunk is sent, rather than the whole
    batch up front, lets the first chunks start at once.
    """

    def __init__(self, ref, view, source):
        self.ref, self.view, self.source = ref, view, source

    def copy(self, axis, start, stop):
        if self.view is not None:
            index = (slice(None),) * axis + (slice(start, stop),)
            np.copyto(self.view[index], self.source[index])

    def copy_all(self):
        if self.view is not None:
            np.copyto(self.view, self.source)


class RunStore:
    """The memory of one run: inputs shared once, outputs allocated once, all released at :meth:`close`.

    Parameters
    ----------
    shared : bool
        Whether other processes on this host read it (worker processes): arrays
        then live in shared-memory segments; otherwise (an in-process cluster,
        or sync mode) the client's arrays are used as they are, with no copy.

    Examples
    --------
    >>> import numpy as np
    >>> with RunStore(shared=True) as store:
    ...     ref = store.share(np.arange(6.0).reshape(3, 2))
    ...     ref.rows(1, 3).tolist()
    [[2.0, 3.0], [4.0, 5.0]]
    """

    def __init__(self, shared: bool):
        self.shared = shared
        self._segments: list[_Segment] = []  # inputs: kept for the next call after a clean run
        self._leases: list[_Lease] = []  # outputs: kept once the arrays handed out over them are gone
        self.reused_outputs = False  # whether an output segment came from the pool (a fresh one reads as zeros)
        self._tokens: list[str] = []
        if shared:
            sweep_now_and_then()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def share(self, array) -> ArrayRef:
        """A reference to ``array`` (NumPy, any layout) that workers can slice."""
        return self.share_many([array])[0]

    def share_many(self, arrays) -> list:
        """References to ``arrays``, copied once into one segment (or registered as they are, in-process)."""
        placed = self.place_many(arrays)
        for entry in placed:
            entry.copy_all()
        return [entry.ref for entry in placed]

    def place_many(self, arrays) -> list:
        """:class:`Placement` of each of ``arrays``, their rows still to copy into one new segment.

        Nothing is copied in-process, nor for arrays already in shared memory
        (:func:`shared_empty`): those are referenced where they are.
        """
        arrays = [np.asarray(a) for a in arrays]
        if not self.shared:
            return [Placement(self.register(a), None, a) for a in arrays]
        found = [find_shared(a) for a in arrays]
        to_copy = [a for a, ref in zip(arrays, found) if ref is None]
        placed = iter(self.allocate_many([(a.shape, a.dtype) for a in to_copy]) if to_copy else [])
        placements = []
        for array, ref in zip(arrays, found):
            if ref is not None:
                placements.append(Placement(ref, None, array))
            else:
                new_ref, view = next(placed)
                placements.append(Placement(new_ref, view, array))
        return placements

    def allocate(self, shape, dtype):
        """A new uninitialised array: ``(reference, the client's view of it)``."""
        return self.allocate_many([(shape, dtype)])[0]

    def allocate_many(self, specs, *, handed_out=False) -> list:
        """New uninitialised arrays ``[(shape, dtype)]`` in one segment: ``[(reference, the client's view)]``.

        ``handed_out``: the views are returned to the caller (a run's outputs); the
        segment then goes back to the pool when they are all gone, not at :meth:`close`.
        A segment may come from the pool: its contents are a past call's.
        """
        specs = [(tuple(int(n) for n in shape), np.dtype(dtype)) for shape, dtype in specs]
        for _, dtype in specs:
            if dtype.hasobject:
                raise TypeError(f"dtype {dtype}: arrays of Python objects cannot be shared")
        if not self.shared:
            arrays = [np.empty(shape, dtype) for shape, dtype in specs]
            return [(self.register(a), a) for a in arrays]
        offsets, end = [], 0
        for shape, dtype in specs:
            offsets.append(end)
            end += -(-math.prod(shape) * dtype.itemsize // 64) * 64  # 64-byte aligned
        reused = POOL.take(end)
        segment = reused or _Segment(round_to_pages(end))
        base = np.frombuffer(segment.buffer, np.uint8)
        if handed_out:
            self.reused_outputs |= reused is not None  # a past call's values in rows no chunk writes
            self._leases.append(_Lease.of(segment, base))
        else:
            self._segments.append(segment)
        placed = []
        for (shape, dtype), offset in zip(specs, offsets):
            count = math.prod(shape)
            view = base[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
            placed.append((ArrayRef(segment.token, shape, dtype.str, _this_pid(), True, offset), view))
        return placed

    def register(self, array) -> ArrayRef:
        """A reference to this process's own ``array`` (no copy), for workers in this process."""
        token = f"{_PREFIX}local-{secrets.token_hex(16)}"
        with _local_lock:
            _local_arrays[token] = array
        self._tokens.append(token)
        return ArrayRef(token, tuple(array.shape), array.dtype.str, _this_pid(), False)

    def close(self, clean=False):
        """Release everything and drop registrations; the client's views stay valid.

        ``clean``: every chunk of the run ended, so nothing writes into its segments
        any more: they are kept for the next call (inputs now, outputs once their
        arrays are gone). Otherwise they are unlinked.
        """
        segments, self._segments = self._segments, []
        leases, self._leases = self._leases, []
        for segment in segments:
            if clean:
                POOL.give(segment.token, segment.path, segment.buffer)
            else:
                segment.unlink()
        for lease in leases:
            if not clean:
                lease.revoke()
        tokens, self._tokens = self._tokens, []
        with _local_lock:
            for token in tokens:
                _local_arrays.pop(token, None)


class _Lease:
    """An output segment lent to the caller: back to the pool when its arrays are gone, unless revoked."""

    def __init__(self, token, path, buffer):
        self.token, self.path, self.buffer, self.revoked = token, path, buffer, False

    @classmethod
    def of(cls, segment, base):
        lease = cls(segment.token, segment.path, segment.buffer)
        POOL.lend(segment.token, segment.path)  # unlinked at exit if its arrays outlive the pool
        # The outputs handed out are found where they lie: fed back as a later call's inputs (a solver's
        # state, step after step), they travel by reference, not copied into a new segment.
        note_user_segment(segment.token, base.__array_interface__["data"][0], base.nbytes)
        on_free(segment.token, lease.revoke)  # free_shared(array): unlinked now, never back to the pool
        weakref.finalize(base, lease.end)  # base: the array every view of the segment derives from
        return lease

    def revoke(self):
        """Never recycle it (its run did not end cleanly): unlink its name now. Nothing once its arrays are gone:
        the segment is the pool's then, perhaps lent to another run already."""
        if self.buffer is None:
            return
        self.revoked = True
        forget_user_segment(self.token)  # workers could no longer open it by name
        POOL.forget(self.token)
        _unlink(self.token, self.path)

    def end(self):
        forget_user_segment(self.token)  # before the pool may lend the segment again
        if not self.revoked:
            POOL.give(self.token, self.path, self.buffer)
        self.buffer = None


# --- arrays that live in shared memory from the start ----------------------------

def pooled_empty(shape, dtype=float) -> np.ndarray:
    """A new uninitialised array in shared memory, as :func:`shared_empty`, in a segment from the pool where one
    of its size is kept; the segment goes back to the pool once the array and its views are gone
    (:func:`free_shared` unlinks it at once instead).

    For arrays dsched holds for a while and lets go of, such as a resident batch's fields: the next batch of
    that size reuses pages this process and the workers have mapped already, and pays no page faults.
    """
    shape, dtype = shareable(shape, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    segment = POOL.take(nbytes) or _Segment(round_to_pages(nbytes))
    base = np.frombuffer(segment.buffer, np.uint8)
    _Lease.of(segment, base)
    return base[:nbytes].view(dtype).reshape(shape)


def find_shared(array):
    """An :class:`ArrayRef` to ``array`` where it lies, if it is C-contiguous memory of a :func:`shared_empty` array
    or of a run's outputs (while the user holds them)."""
    found = shared_location(array)
    if found is None:
        return None
    token, offset = found
    return ArrayRef(token, tuple(array.shape), array.dtype.str, _this_pid(), True, offset)


def shared_location(array):
    """``(segment token, offset)`` where :func:`find_shared` finds ``array``, or ``None``: without the reference
    (a replay asks where its inputs lie at every call)."""
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous or array.dtype.hasobject:
        return None
    return _shared_location(array)


# --- which workers can read what ---------------------------------------------

def _probe(token: str, expected: bytes):
    """Run on each worker: its process id, and whether it reads the client's probe segment."""
    try:
        with open(os.path.join(SHM_DIR, token), "rb") as f:
            sees = f.read() == expected
    except OSError:
        sees = False
    return os.getpid(), sees


_classified: dict = {}


def classify_workers(client, addresses) -> dict:
    """``{address: "process" | "host" | "remote"}``: whether each worker shares this process, this host's memory, or neither.

    A worker is on this host when it can read a probe segment this process
    writes, which is the test that matters (a container or another mount
    namespace on the same machine does not share ``/dev/shm``). Cached per
    worker address.
    """
    addresses = sorted(addresses)
    missing = [a for a in addresses if (id(client), a) not in _classified]
    if missing:
        expected = secrets.token_bytes(32)
        segment = _Segment(len(expected))
        try:
            segment.buffer[:] = expected
            answers = client.run(_probe, segment.token, expected, workers=missing)
        finally:
            segment.unlink()
        for address, (pid, sees) in answers.items():
            kind = "process" if pid == os.getpid() and sees else ("host" if sees else "remote")
            _classified[(id(client), address)] = kind
    return {a: _classified.get((id(client), a), "remote") for a in addresses}


# --- chunks of work made of references -----------------------------------------

@dataclass(frozen=True)
class SliceRef:
    """Items ``start:stop`` along ``axis`` of a placed array."""

    ref: ArrayRef
    axis: int
    start: int
    stop: int
    template: object = None  # a torch input: an empty tensor of its type, to rebuild the rows as one

    def __reduce__(self):
        return _slice_ref, (self.ref, self.axis, self.start, self.stop, pack_template(self.template))

    def resolve(self, pinned=False):
        if self.template is None:
            return self.ref.take(self.axis, self.start, self.stop, pinned)
        rows = self.ref.rows(self.start, self.stop, private=True) if self.axis == 0 and self.ref.shared else \
            np.array(self.ref.take(self.axis, self.start, self.stop))
        return backends.from_host(rows, self.template)


def _slice_ref(ref, axis, start, stop, template):
    return SliceRef(ref, axis, start, stop, unpack_template(template))


@dataclass(frozen=True)
class SharedWork:
    """A chunk's work whose arrays are :class:`SliceRef` (alone, or as values of a dict): resolved where it runs."""

    payload: object

    def __reduce__(self):
        return SharedWork, (self.payload,)

    def resolve(self, pinned=False):
        if isinstance(self.payload, SliceRef):
            return self.payload.resolve(pinned)
        return {k: (v.resolve(pinned) if isinstance(v, SliceRef) else v) for k, v in self.payload.items()}


class SealedWork:
    """A chunk's work pickled by the client and opened by the chunk itself, on its worker.

    distributed drops a worker whose message does not load: an argument that cannot be unpickled there (a
    class its Python lacks, a GPU array on a worker without that GPU) would take the worker down with every
    chunk it held, and leave the run waiting for it. Sealed, it fails its own chunk, with the reason.
    """

    __slots__ = ("blob", "buffers")

    def __init__(self, blob: bytes, buffers=()):
        self.blob, self.buffers = blob, list(buffers)

    @classmethod
    def of(cls, work):
        from distributed.protocol.pickle import dumps  # cloudpickle where plain pickle cannot (a lambda)

        # Large arrays passed whole stay out of band (pickle protocol 5): Dask's own pickling of the task then
        # sends their memory as it is, as it did before the work was sealed, instead of a copy in the blob.
        buffers = []
        return cls(dumps(work, buffer_callback=buffers.append), buffers)

    def __reduce__(self):
        return SealedWork, (self.blob, self.buffers)

    def open(self):
        from distributed.protocol.pickle import loads

        try:
            return loads(self.blob, buffers=self.buffers)
        except Exception as err:
            raise RuntimeError(f"the chunk's arguments cannot be loaded on this worker: "
                               f"{type(err).__name__}: {err}".splitlines()[0]) from err


def resolve_work(work, pinned=False):
    """The work a chunk's code sees: references resolved to array views (page-locked ones for a GPU with
    ``pinned``), rows of streamed inputs read (Zarr) or computed (Dask), anything else unchanged."""
    if isinstance(work, SealedWork):
        work = work.open()
    return resolve_rows(work.resolve(pinned) if isinstance(work, SharedWork) else work)


def _shareable(array) -> bool:
    return (isinstance(array, np.ndarray) and not array.dtype.hasobject) or _torch_on(array, "cpu") \
        or _neml2_on(array, "cpu") or in_gpu_memory(array)


def in_gpu_memory(array) -> bool:
    """A CuPy array, torch tensor or NEML2 tensor (no K axes) in GPU memory.

    No other process can map it, and a worker without that GPU cannot even unpickle it (a CPU worker of a
    real GPU machine sees no GPU): its chunks go as rows of one host copy, like a host array's, and each GPU
    chunk copies its rows to its own device.
    """
    return backends.backend_of(array, strict=False) is backends.CUPY or _torch_on(array, "cuda") \
        or _neml2_on(array, "cuda")


def _torch_on(array, kind: str) -> bool:
    """A torch tensor (not a subclass, such as a ``Parameter``) on a device of ``kind`` (``"cpu"``, ``"cuda"``)."""
    return type(array).__module__.partition(".")[0] == "torch" and getattr(array, "device", None) is not None \
        and array.device.type == kind and type(array).__name__ == "Tensor"


def _neml2_on(array, kind: str) -> bool:
    """A NEML2 typed tensor (or dynamic-base Tensor) on a device of ``kind`` whose batch axes lead its data (no K
    axes)."""
    return type(array).__module__.partition(".")[0] == "neml2" and backends.backend_of(array, strict=False) \
        is backends.NEML2 and _torch_on(array.data, kind) and getattr(array, "k_ndim", 0) == 0


def _host_and_template(array, axis):
    """A NumPy view of a shareable array, and (torch, NEML2) the template its rows are rebuilt from.

    The template is empty and owns its storage: a chunk carries its rows, by
    reference, and nothing of the batch (a view's pickle holds its whole storage).
    """
    if in_gpu_memory(array):
        array = backends.to_host(array)  # CuPy gives NumPy; torch and NEML2 give CPU tensors of the same type
    if isinstance(array, np.ndarray):
        return array, None
    return backends.host_view(array), backends.template(array, axis)


def share_generator(generator, store: RunStore):
    """``generator`` handing out references instead of slices, its NumPy arrays placed in ``store`` once.

    Array and mapping loaders over NumPy arrays, CPU tensors and arrays in GPU memory (copied to the host once)
    are shared; any other generator (slices, user generators) is returned unchanged.
    """
    if isinstance(generator, Ranges):  # a re-run of what a run left undone: share its source
        shared = share_generator(generator.source, store)
        return generator if shared is generator.source else Ranges(shared, generator.ranges)
    if isinstance(generator, ArrayLoader) and _shareable(generator.array):
        arrays, keys = [generator.array], None
    elif isinstance(generator, MappingLoader) and generator._batched and all(
            _shareable(generator.mapping[k]) for k in generator._batched):
        keys = sorted(generator._batched, key=list(generator.mapping).index)
        arrays = [generator.mapping[k] for k in keys]
    else:
        return generator
    axes = [generator.axis] if keys is None else [generator.axes[k] for k in keys]
    hosts = [_host_and_template(a, axis) for a, axis in zip(arrays, axes)]
    return _SharedLoader(generator, store.place_many([h for h, _ in hosts]), keys, [t for _, t in hosts], axes)


class _SharedLoader:
    """Hands out what an array or mapping loader would, as references to its arrays' placements.

    ``keys`` names the mapping's batched entries (``None`` for an array loader),
    ``axes`` their batch axes. Each chunk's rows are copied into the store just
    before it is handed out.
    """

    def __init__(self, loader, placements, keys, templates, axes):
        self.loader, self.placements, self.keys, self.templates, self.axes = loader, placements, keys, templates, axes
        self.total = loader.total

    @property
    def offset(self):
        return self.loader.offset

    def has_more(self):
        return self.loader.has_more()

    def next(self, n):
        start = self.loader.offset
        m = self.loader._check_next(n)
        self.loader.offset += m
        return m, self._take(start, start + m)

    def _take(self, start, stop):
        for placement, axis in zip(self.placements, self.axes):
            placement.copy(axis, start, stop)
        slices = [SliceRef(p.ref, axis, start, stop, t) for p, t, axis in zip(self.placements, self.templates, self.axes)]
        if self.keys is None:
            return SharedWork(slices[0])
        refs = dict(zip(self.keys, slices))
        return SharedWork({k: refs.get(k, v) for k, v in self.loader.mapping.items()})
