"""Resident batches: named arrays kept across repeated updates, where their chunks compute.

A finite-element solver calls its material model at every iteration of every
step on the same points, with state carried from one call to the next.
:class:`Batch` cuts the points into the chunks :func:`dsched.plan` gives,
keeps each field across updates, and runs every update on each chunk where
the chunk's device is; updates return at once and run in the order pushed
(per chunk and field), and :meth:`Batch.get` and :meth:`Batch.reduce` wait.

Where the fields live (``memory``):

- ``"host"``: in this host's memory, one array per field that the device
  workers map (worker processes on this host, or workers in this process), and
  each update one :func:`dsched.dispatch` of the batch
  (:class:`~dsched.resident.host_batch.HostBatch`): a step costs what a call
  costs;
- ``"device"``: in each chunk's device memory (on a real GPU, GPU memory), and
  each update one Dask task per chunk, ordered by a dependency engine
  (:class:`~dsched.resident.task_batch.TaskBatch`);
- ``"auto"`` (the default): ``"host"`` where every device is served by workers on
  this host and none is a real GPU (an emulated ``cuda`` device computes on the
  CPU), else ``"device"``.

This module checks every argument (a one-line ``ValueError`` naming the field at
fault, before any work) and hands the work to the backend.
"""

from __future__ import annotations

from dsched.blocks.planning import plan
from dsched.checks import check_callable, check_positive_int
from dsched.dataplane.outputs import check_out_path
from dsched.dataplane.store import classify_workers
from dsched.devices.ownership import check_devices_owned, device_owners, recent_cluster_info
from dsched.names import EMULATED_RESOURCE
from dsched.resident.fields import _check_call, _check_fields, _check_inputs, _check_layouts, _names
from dsched.resident.host_batch import HostBatch
from dsched.resident.task_batch import TaskBatch
from dsched.resident.tasks import Update, _Chunk, _client, _UpdateSpec

__all__ = ["Batch", "Update", "MEMORY", "placement"]

MEMORY = ("auto", "host", "device")  # where a batch's fields may live (Batch(memory=...))


class Batch:
    """Named arrays cut into chunks once, kept across updates, each update run where each chunk's device is.

    Parameters
    ----------
    fields : dict
        ``{name: array}``, NumPy arrays of one length along axis 0 (the items).
        May be empty with ``n``: the updates' outputs are then the fields.
    scheduler : WorkScheduler
        Cuts the items into chunks and places them (:func:`dsched.plan`).
    n : int, optional
        The number of items: needed only without fields (else it must equal their length).
    client : distributed.Client, optional
        The cluster; by default the current Dask client. Its workers must own the scheduler's devices.
    lookahead : int
        With ``memory="device"``: operations per chunk handed to Dask ahead of the one running (the rest
        wait in the engine). Two keep a device busy while the client hears of a completion.
    memory : {"auto", "host", "device"}
        Where the fields live (see the module docs): ``"host"``, one array per field in this host's memory
        that the workers map, an update one dispatch call; ``"device"``, each chunk's fields in its device's
        memory, an update one Dask task per chunk; ``"auto"``, host memory unless a device is a real GPU.
        The choice is :attr:`memory` afterwards.

    Examples
    --------
    >>> batch = Batch({"x": np.arange(10.0)}, dsched.SimpleScheduler("cpu", 4), client=client)  # doctest: +SKIP
    >>> batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])  # doctest: +SKIP
    >>> batch.reduce(np.sum, "x")  # doctest: +SKIP
    55.0
    """

    def __init__(self, fields, scheduler, *, n=None, client=None, lookahead=2, memory="auto"):
        if not isinstance(memory, str) or memory not in MEMORY:
            raise ValueError(f"memory: expected 'auto', 'host' or 'device', got {memory!r}")
        if n is not None:
            n = check_positive_int(n, "n")
        arrays = _check_fields(fields, n=n, empty_ok=n is not None)
        self.n = n if n is not None else len(next(iter(arrays.values())))
        self.scheduler = scheduler
        self.client = _client(client)
        check_positive_int(lookahead, "lookahead", integers=int, below=None)
        self.lookahead = lookahead
        self.chunks, self._shared, self.memory = placement(self.client, scheduler, self.n, memory)
        self.devices = list(dict.fromkeys(c.device for c in self.chunks))
        if self.memory == "host":
            self._backend = HostBatch(arrays, n=self.n, chunks=self.chunks, scheduler=scheduler, client=self.client,
                                      shared=self._shared)
        else:
            self._backend = TaskBatch(arrays, n=self.n, chunks=self.chunks, client=self.client, shared=self._shared,
                                      lookahead=lookahead)
        self._closed = False

    # --- the public API -----------------------------------------------------------

    @property
    def fields(self) -> list:
        """The fields' names, sorted (those the updates pushed so far make included)."""
        return self._backend.fields

    def update(self, fn, reads=(), writes=(), outputs=(), *, label=None, inplace=False, kwargs=None, inputs=None,
               axis=0, out=None, layouts=None):
        """Run ``fn`` on every chunk where it lives; returns at once with an update handle (``wait()``, ``done()``).

        ``fn(**{field: chunk array for field in reads}, **kwargs)`` returns a
        dict with one array per field in ``writes`` and ``outputs``, each with
        the chunk's length along axis 0 (a ``fn`` that cannot take those
        keywords, with the ``inputs`` and ``out`` below, is refused before any
        work). ``writes`` are existing fields
        (replaced by the returned arrays); ``outputs`` may also name new
        fields. Fields read arrive read-only unless ``inplace`` is true: then a
        field both read and written arrives writable and ``fn`` may mutate it in
        place and return it (it runs only after the earlier reads of that
        field). A failed chunk keeps its previous values (see docs/batch.md for
        what an in-place update that fails leaves).

        ``inputs`` are arrays of this update only, ``{name: array}`` with the
        batch's items along ``axis``: each chunk's ``fn`` gets its own items as
        the keyword ``name`` (read-only), and nothing of them is kept once the
        update ran. They are read by reference where they lie in shared memory
        (:func:`dsched.shared_empty`, or a run's outputs), held until the update
        ran, else copied there once for all chunks.
        A history of ``(steps, items, ...)`` goes whole with ``axis=1``: a
        chunk then reads step ``k`` of its items as ``name[k]``, without a copy.

        ``out`` are arrays in shared memory (:func:`dsched.shared_empty`, or
        with in-process workers any array), ``{name: array}`` of the batch's
        items along axis 0: each chunk's ``fn`` gets its own rows, writable, as
        the keyword ``name``, and what it writes there is in the array once the
        update is done (results straight to the client, no :meth:`get` after).

        ``layouts`` (``{field: (item_shape, dtype)}``, as :meth:`get_many` takes
        them) declares the fields this update makes: in host memory they are
        then allocated first and written in place by the chunks, rather than
        learned from results that travel back once.
        """
        self._check_open()
        check_callable(fn, "fn")
        reads, writes, outputs = _names(reads, "reads"), _names(writes, "writes"), _names(outputs, "outputs")
        knows = self._backend.knows
        for field_name, names in (("reads", reads), ("writes", writes)):
            for name in names:
                if not knows(name):
                    raise ValueError(f"{field_name}: no field {name!r} in this batch "
                                     f"(fields: {', '.join(self.fields)})")
        written = tuple(dict.fromkeys(writes + outputs))
        if not written and not out:
            raise ValueError("writes: an update must write at least one field or out= array "
                             "(reduce() computes values)")
        label = label or getattr(fn, "__name__", "update")
        spec = _UpdateSpec(fn, label, reads, written, bool(inplace), dict(kwargs or {}))
        arrays = _check_inputs(inputs, axis, self.n, reads)
        _check_call(fn, (*reads, *arrays, *(out if isinstance(out, dict) else ()), *spec.kwargs), label)
        return self._backend.update(spec, arrays, axis, out, _check_layouts(layouts, written))

    def set(self, field, values):
        """New values of ``field`` (a new field too) from the host, for every chunk; returns an update handle.

        In host memory they are written into the field's array (a new one only for a new shape or dtype),
        once the updates pushed before that use the field ran; in device memory they are streamed to each
        chunk's device through a segment of the field's own, written again by its next ``set``. Either way
        a solver that sets a field at every step keeps ``/dev/shm`` flat.
        """
        self._check_open()
        if not isinstance(field, str):
            raise ValueError(f"field: expected a field name, got {field!r}")
        [array] = _check_fields({field: values}, n=self.n).values()
        return self._backend.set(field, array)

    def get(self, field):
        """``field`` for every item, in dispatch order: a new array (waits for the updates that write it)."""
        self._check_open()
        self._check_field(field)
        return self._backend.get(field)

    def get_many(self, fields, layouts=None) -> dict:
        """Several fields at once, ``{field: array}``.

        ``layouts`` (``{field: (item_shape, dtype)}``) saves the round trip that
        learns them in device memory, for a caller that knows what its updates make.

        Examples
        --------
        >>> batch.get_many(["stress", "alpha"], layouts={"stress": ((6,), "f8")})  # doctest: +SKIP
        {'stress': array(...), 'alpha': array(...)}
        """
        self._check_open()
        fields = _names(fields, "fields")
        for field in fields:
            self._check_field(field)
        return self._backend.get_many(fields, layouts)

    def reduce(self, fn, field, combine=sum):
        """``combine([fn(chunk) for each chunk of field])``, in dispatch order: the batch's one global synchronisation.

        ``fn`` runs where each chunk runs and returns something small (a
        scalar, a short array); ``combine`` joins the per-chunk values on the
        client (default: their sum; ``max``, ``list``...).
        """
        self._check_open()
        self._check_field(field)
        return self._backend.reduce(fn, field, combine)

    def to_zarr(self, path, fields=None, *, overwrite=False) -> str:
        """Stream ``fields`` (default: all) to a new Zarr store at ``path``, written by the workers; returns it."""
        self._check_open()
        path = check_out_path(path, overwrite, field="path")
        fields = self.fields if fields is None else _names(fields, "fields")
        for field in fields:
            self._check_field(field)
        return self._backend.to_zarr(path, fields, overwrite=overwrite)

    def wait(self):
        """Wait until every pushed update finished; raises their failures."""
        self._check_open()
        self._backend.wait()

    def together(self):
        """A context: the updates pushed in it reach the devices together, when it ends.

        In device memory a chunk's updates go to its worker as Dask tasks, the
        first ``lookahead`` each alone and those pushed meanwhile as one task;
        updates pushed in a ``together()`` block go as one task per chunk for
        the whole block (run in order, and failing together, as any such
        burst): one scheduler round trip per chunk, not one per update. A
        step's several updates pushed at once save the most. Anything that
        waits inside the block (``get``, ``wait``, ``reduce``) hands what it
        holds over first. In host memory each update is one call already:
        nothing changes.
        """
        self._check_open()
        return self._backend.together()

    def close(self):
        """Release the fields: their memory on the workers, and every shared-memory segment of the batch."""
        if self._closed:
            return
        self._closed = True
        self._backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        devices = ", ".join(f"{d}: {sum(c.device == d for c in self.chunks)}" for d in self.devices)
        return (f"<Batch {self.n} items, fields {self.fields}, chunks per device {{{devices}}}, "
                f"{self.memory} memory>")

    # --- checks --------------------------------------------------------------------

    def _check_field(self, field):
        if not self._backend.knows(field):
            raise ValueError(f"field: no field {field!r} in this batch (fields: {', '.join(self.fields)})")

    def _check_open(self):
        if self._closed:
            raise RuntimeError("this Batch is closed")


def placement(client, scheduler, n, memory) -> tuple:
    """``(chunks, shared, memory)`` of a resident batch of ``n`` items: the scheduler's chunks, whether worker
    processes read its arrays (in shared memory) or workers in this process, and where its fields live
    (``memory`` resolved). A ValueError for a device no worker owns or one on another host."""
    # One answer of the scheduler for every check: a recent one, as a run's (a driver per history makes a batch)
    workers = recent_cluster_info(client, scheduler)["workers"]
    check_devices_owned(client, scheduler, workers)
    chunks, start = [], 0
    for index, (device, size) in enumerate(plan(n, scheduler)):
        chunks.append(_Chunk(index, device, start, start + size))
        start += size
    devices = list(dict.fromkeys(c.device for c in chunks))
    owners = device_owners(client, devices, workers)
    kinds = classify_workers(client, {a for addrs in owners.values() for a in addrs})
    if any(kind == "remote" for kind in kinds.values()):
        raise ValueError("client: a worker owning one of the devices is on another host; resident batches "
                         "need workers that map this host's shared memory (or run in this process)")
    # Worker processes map shared memory; in-process workers read this process's arrays.
    shared = any(kind == "host" for kind in kinds.values())
    return chunks, shared, _memory_for(memory, devices, owners, workers)


def _memory_for(memory, devices, owners, workers) -> str:
    """Where a batch's fields live: ``memory`` as asked, ``"auto"`` resolved; a ValueError for ``"host"`` where a
    device is a real GPU (workers on another host were refused before)."""
    real = [d for d in devices if d.type == "cuda" and not all(
        EMULATED_RESOURCE in (workers.get(a, {}).get("resources") or {}) for a in owners.get(d, []))]
    if memory == "device" or (memory == "auto" and real):
        return "device"
    if real:
        raise ValueError(f"memory: 'host' keeps the fields in this host's memory, but {real[0]} is a real GPU, whose "
                         "chunks keep their fields in its memory (memory='device', or 'auto')")
    return "host"
