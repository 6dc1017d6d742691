"""The data plane of one run: how each chunk's inputs reach its worker and where its outputs go.

A :class:`RunData` is made at the start of a run and closed at its end
(also after a failure or Ctrl-C). It decides, per device, how chunks travel:

- devices whose workers share this host (or this process) get references
  (:class:`~dsched.store.SharedWork`) into a :class:`~dsched.store.RunStore`,
  a few hundred bytes per task whatever the chunk size;
- devices owned by a worker on another host get each chunk's slice straight
  from the client (``client.scatter(direct=True)``), so no batch data goes
  through the Dask scheduler either way.

When the join is the concatenation, outputs are written in place
(:mod:`dsched.outputs`): each chunk's task carries an
:class:`~dsched.outputs.OutputSlot` and returns only its timings. Until the
layout of a result is known (not declared, and no chunk back yet) chunks
return their results, which the client writes into place as they arrive.
"""

from __future__ import annotations

import math
import os

import numpy as np

from dsched.dataplane.loaders import uncovered
from dsched.dataplane.outputs import (
    BY_VALUE,
    ChunkResultError,
    Leftover,
    OutputLayout,
    OutputSlot,
    ZarrTarget,
    _flatten,
    _path_name,
    check_out_path,
    write_rows,
)
from dsched.dataplane.sources import holds_dask_rows, streams_dask, submit_rows
from dsched.dataplane.store import (
    ArrayRef,
    RunStore,
    SealedWork,
    classify_workers,
    find_shared,
    in_gpu_memory,
    resolve_work,
    share_generator,
)
from dsched.devices import backends

__all__ = ["RunData", "check_out", "direct_to_workers", "zarr_chunk_items"]


def direct_to_workers() -> bool:
    """Whether results are fetched straight from the workers (Dask config ``dsched.direct-to-workers``, default true).

    Dask's default relays them through the scheduler; turn this off only where
    the client cannot open connections to the workers.
    """
    from dask import config

    return bool(config.get("dsched.direct-to-workers", True))


def check_out(out, total: int, axis: int, overwrite: bool = False):
    """Validate ``out`` before any work: a Zarr path to create, or arrays whose batch axis fits; returns it normalised."""
    if out is None:
        return None
    if isinstance(out, (str, os.PathLike)):
        return check_out_path(out, overwrite)

    for path, array in _flatten(out):
        if not (hasattr(array, "shape") and hasattr(array, "dtype")):
            raise ValueError(f"out: {_path_name(path)[6:] or 'out'} is {type(array).__name__}, not an array")
        shape = tuple(array.shape)
        if not -len(shape) <= axis < len(shape) or shape[axis] != total:
            raise ValueError(
                f"out{_path_name(path)[6:]}: shape {shape} does not hold {total} items along axis {axis}"
            )
    return out


class RunData:
    """Inputs by reference and outputs in place for one run.

    Parameters
    ----------
    generator : WorkGenerator
        The run's work; NumPy array and mapping loaders are shared by reference.
    client : distributed.Client or None
        ``None`` for a sync run (everything stays in this process).
    owners : dict
        ``{Device: [address of each worker that owns it]}`` for async runs.
    concat_axis : int or None
        The axis results are joined along, in place; ``None`` keeps results as they are.
    layout : OutputLayout, optional
        The declared layout of a chunk's result (else taken from the first result).
    out : str, path or arrays, optional
        Where the joined outputs go: a Zarr store to create, or arrays to fill (checked by :func:`check_out`).
    chunk_items : int
        Zarr chunk length along the axis (a divisor of every batch size, so writers never share a Zarr chunk).
    probe : callable, optional
        ``probe()`` -> the layout of a chunk's result, or ``None``; asked when worker
        processes would otherwise send the first chunks' results back by value.
    """

    def __init__(self, generator, *, client=None, owners=None, concat_axis=None, layout=None, out=None,
                 chunk_items=1, probe=None):
        self.client = client
        self.total = generator.total
        self.axis = concat_axis
        self.layout = layout
        self.out = out
        self.chunk_items = max(int(chunk_items), 1)
        kinds = {}
        if client is not None:
            addresses = {a for addrs in owners.values() for a in addrs}
            by_address = classify_workers(client, addresses) if addresses else {}
            kinds = {d: {by_address[a] for a in addrs} for d, addrs in owners.items()}
        self.owners = owners or {}
        self.remote = {d for d, k in kinds.items() if "remote" in k}
        # Shared memory only when a worker process on this host reads it; otherwise the client's arrays as they are.
        self.store = RunStore(shared=any("host" in k for k in kinds.values()))
        # Sync runs and remote-only devices read the client's arrays directly; nothing to share.
        local = [d for d in kinds if d not in self.remote]
        self.generator = share_generator(generator, self.store) if local else generator
        # Chunks with rows of a Dask array carry futures, which only a task's arguments resolve: no feeds.
        self.streams_dask = streams_dask(generator)
        self.targets = None  # one write target per output array, once the layout is known
        self._failed_early = []  # chunks that failed before it was: their rows are marked once outputs exist
        self.outputs = None  # the client's view of the joined outputs
        self.pieces = {}  # output index -> {offset: rows}, for outputs that travel back by value
        if self.layout is None and self.axis is not None and _out_arrays(out):
            # The user's out= arrays declare the layout: every chunk, the first ones included, writes in place.
            self.layout = layout = OutputLayout.of(out, self.total, self.axis, where="out", origin="as out= holds")
        if layout is None and self.axis is not None and probe is not None and self.store.shared:
            layout = self.layout = _probed(probe)
        if layout is not None:
            self._allocate(layout)

    # --- per chunk ----------------------------------------------------------

    def task_work(self, device, work):
        """What a chunk's task carries: references for local workers, scattered data for remote ones.

        Rows of a Dask array go as a future of their own graph, computed on the cluster.
        """
        if holds_dask_rows(work):
            return submit_rows(work, self.client)
        if device not in self.remote:  # sealed for worker processes (in-process ones load nothing)
            return SealedWork.of(work) if self.store.shared else work
        work = resolve_work(work)
        if not device.is_cuda:  # a CPU worker cannot unpickle a GPU array: it gets the rows' host copy
            work = backends.map_arrays(lambda b, a: b.to_host(a) if in_gpu_memory(a) else a, work)
        # In a list: scatter would send a dict's values under the dict's own keys, shared by every chunk.
        [future] = self.client.scatter([work], workers=self.owners[device], direct=direct_to_workers(),
                                       hash=False)
        return future

    def writes_in_place(self, device) -> bool:
        """Whether ``device``'s chunks write their rows where they run (for chunks of the scheduler's sizes)."""
        return self.axis is not None and self.targets is not None and device not in self.remote and all(
            isinstance(t, (ZarrTarget, ArrayRef)) or t is BY_VALUE for t in self.targets)

    def writes_in_place_everywhere(self) -> bool:
        """Whether every output is written in place in shared memory (none travels back, none goes to Zarr)."""
        return self.targets is not None and all(isinstance(t, ArrayRef) and t.shared for t in self.targets)

    def slot(self, device, start, stop, index):
        """The chunk's :class:`OutputSlot` when its worker can write in place; ``None`` to return the result."""
        if not self.writes_in_place(device):
            return None  # a remote worker, the user's arrays in this process's memory, or no layout yet
        if isinstance(self.out, (str, os.PathLike)) and not self._zarr_aligned(start, stop):
            return None  # a custom size that would share a Zarr chunk with a neighbour: the client writes it
        return OutputSlot(self.layout, self.targets, start, stop, index)

    def fetch(self, future):
        """A finished chunk's value, straight from its worker (not relayed by the scheduler)."""
        return self.client.gather(future, direct=direct_to_workers())

    def accept(self, record, result):
        """Write a result that came back to the client (it had no slot); checks it like a worker would."""
        where = f"chunk {record.index} on {record.device}"
        if self.layout is None:
            self._allocate(OutputLayout.of(result, record.size, self.axis, where=where))
        arrays = self.layout.check(result, record.size, where)
        for i, (leaf, target, array) in enumerate(zip(self.layout.leaves, self.targets, arrays)):
            if target is BY_VALUE:
                self.pieces.setdefault(i, {})[record.offset] = array
            else:
                write_rows(target, leaf.axis, record.offset, record.offset + record.size, array)

    def accept_leftover(self, record, leftover):
        """Keep the rows a chunk sent back by value (it wrote its other outputs in place)."""
        if not isinstance(leftover, Leftover):
            return
        for i, array in leftover.arrays.items():
            self.pieces.setdefault(i, {})[record.offset] = array

    def failed(self, record):
        """Mark a failed chunk's rows: NaN in floating outputs (integer outputs keep what was there); a chunk that
        failed before the outputs were allocated is marked when they are (a reused segment holds a past call's
        values)."""
        if self.targets is None:
            self._failed_early.append(record)
            return
        for leaf, target in zip(self.layout.leaves, self.targets):
            if target is BY_VALUE:
                continue  # its missing rows are filled when the output is joined
            dtype = np.dtype(leaf.dtype)
            if np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating):
                write_rows(target, leaf.axis, record.offset, record.offset + record.size,
                           np.full(leaf.shape(record.size), np.nan, dtype))

    def output(self):
        """The joined outputs, in the structure of a chunk's result."""
        if self.outputs is None:
            raise RuntimeError("no chunk result arrived, so the outputs were never allocated")
        outputs = list(self.outputs)
        for i, target in enumerate(self.targets):
            if target is BY_VALUE:
                outputs[i] = self._join_pieces(i)
        return self.layout.build(outputs)

    def _join_pieces(self, i):
        """Output ``i`` joined from the pieces chunks sent back; rows no chunk sent (a failed one) are empty."""
        leaf = self.layout.leaves[i]
        pieces = self.pieces.get(i, {})
        shape = self.layout.shapes(self.total)[leaf.path]
        if not pieces:
            return np.empty(shape, dtype=leaf.dtype) if np.dtype(leaf.dtype).kind == "O" else np.zeros(shape, leaf.dtype)
        ordered, position, axis = [], 0, leaf.axis
        for offset in sorted(pieces):
            if offset > position:
                ordered.append(_empty_rows(pieces[offset], offset - position, axis))
            ordered.append(pieces[offset])
            position = offset + pieces[offset].shape[axis]
        if position < self.total:
            ordered.append(_empty_rows(ordered[-1], self.total - position, axis))
        return np.concatenate(ordered, axis=axis)

    def fill_undispatched(self, records):
        """Rows of items no chunk was dispatched for (a run that stopped early): NaN in floating outputs, 0 in
        others, since a reused segment holds a past call's values there."""
        if self.targets is None or not self.store.reused_outputs:
            return  # fresh segments read as zeros, as they always have; the user's arrays are theirs
        for start, stop in uncovered([(0, self.total)], [(r.offset, r.offset + r.size) for r in records]):
            for leaf, target in zip(self.layout.leaves, self.targets):
                if target is BY_VALUE:
                    continue
                dtype = np.dtype(leaf.dtype)
                fill = np.nan if dtype.kind in "fc" else 0
                write_rows(target, leaf.axis, start, stop, np.full(leaf.shape(stop - start), fill, dtype))

    def close(self, clean=False):
        """Release the run's shared memory (the returned outputs stay valid).

        ``clean``: every chunk ended and none failed, so the segments may be kept
        for the next call (see :class:`~dsched.dataplane.segments.SegmentPool`).
        """
        self.store.close(clean)

    # --- allocation -----------------------------------------------------------

    def _allocate(self, layout):
        self.layout = layout
        shapes = layout.shapes(self.total)
        if isinstance(self.out, (str, os.PathLike)):
            self.targets, self.outputs = self._create_zarr(layout, shapes)
        elif _out_arrays(self.out):
            self.outputs = _user_arrays(self.out, layout, shapes)
            self.targets = tuple(self._user_target(a) for a in self.outputs)
        else:
            shared = [leaf for leaf in layout.leaves if not leaf.by_value]
            allocated = iter(self.store.allocate_many([(shapes[leaf.path], leaf.dtype) for leaf in shared],
                                                      handed_out=True))
            pairs = [(BY_VALUE, None) if leaf.by_value else next(allocated) for leaf in layout.leaves]
            self.targets = tuple(target for target, _ in pairs)
            self.outputs = [view for _, view in pairs]
        failed, self._failed_early = self._failed_early, []
        for record in failed:
            self.failed(record)

    def _user_target(self, array):
        """Where workers write into one of the user's ``out`` arrays: a reference, or the array itself.

        In this process the workers write into the user's NumPy arrays, and worker processes into those in
        shared memory; anything else (private memory of this process, a Zarr array, whose slice is a copy)
        is written by the client as results arrive.
        """
        if not isinstance(array, np.ndarray):
            return array
        if not self.store.shared:
            return self.store.register(array)
        shared = find_shared(array)  # worker processes write into shared memory directly
        return array if shared is None else shared

    def _create_zarr(self, layout, shapes):
        import zarr

        by_value = [leaf for leaf in layout.leaves if leaf.by_value]
        if by_value:
            raise ChunkResultError(f"out: {_path_name(by_value[0].path)} holds {np.dtype(by_value[0].dtype)} items, "
                                   "which a Zarr store written by workers cannot hold; return numbers, or drop out=")

        group = zarr.open_group(store=os.fspath(self.out), mode="w")
        targets, arrays = [], []
        for leaf in layout.leaves:
            name = "/".join(map(str, leaf.path)) or "data"
            shape = shapes[leaf.path]
            chunks = tuple(min(self.chunk_items, s) if i == leaf.axis else s for i, s in enumerate(shape))
            array = group.create_array(name, shape=shape, chunks=chunks, dtype=leaf.dtype, compressors=None,
                                       fill_value=_fill_value(leaf.dtype))
            targets.append(ZarrTarget(os.fspath(self.out), name))
            arrays.append(array)
        return tuple(targets), arrays

    def _zarr_aligned(self, start, stop):
        c = self.chunk_items
        return start % c == 0 and (stop % c == 0 or stop == self.total)


def _out_arrays(out) -> bool:
    """Whether ``out`` is the user's arrays (not a store path, not absent)."""
    return out is not None and not isinstance(out, (str, os.PathLike))


def _probed(probe):
    """The layout ``probe`` learns, or ``None`` if it cannot (the chunks then tell, by value)."""
    try:
        return probe()
    except Exception:  # the model fails on its own, or on one item: its real chunks will say how, in context
        return None


def _empty_rows(like, n, axis):
    """``n`` empty rows shaped like ``like``'s (None for objects, empty strings for strings)."""
    shape = tuple(like.shape[:axis]) + (n,) + tuple(like.shape[axis + 1:])
    return np.empty(shape, like.dtype) if like.dtype.kind == "O" else np.zeros(shape, like.dtype)


def _fill_value(dtype):
    dtype = np.dtype(dtype)
    return float("nan") if np.issubdtype(dtype, np.floating) else 0


def _user_arrays(out, layout, shapes):
    """The user's ``out`` arrays in leaf order, checked against the layout."""
    flat = _flatten(out)
    if [p for p, _ in flat] != [leaf.path for leaf in layout.leaves]:
        raise ChunkResultError(
            f"out: its structure ({', '.join(_path_name(p)[6:] or 'out' for p, _ in flat)}) differs from the "
            f"chunks' results ({', '.join(_path_name(leaf.path)[6:] or 'result' for leaf in layout.leaves)})"
        )
    for leaf, (path, array) in zip(layout.leaves, flat):
        if tuple(array.shape) != shapes[leaf.path] or np.dtype(array.dtype) != np.dtype(leaf.dtype):
            raise ChunkResultError(
                f"out{_path_name(path)[6:]}: shape {tuple(array.shape)} and dtype {np.dtype(array.dtype)} do not fit "
                f"the results (shape {shapes[leaf.path]}, dtype {np.dtype(leaf.dtype)})"
            )
    return [array for _, array in flat]


def zarr_chunk_items(batch_sizes) -> int:
    """A Zarr chunk length that divides every batch size, so no two chunks of work write one Zarr chunk."""
    return math.gcd(*[int(b) for b in batch_sizes]) if batch_sizes else 1
