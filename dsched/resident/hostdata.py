"""What a resident batch's tasks read and write in host memory besides its versions.

- :class:`SetSegment`: the values :meth:`~dsched.Batch.set` gives a field on worker
  processes, in a segment of the field's own that the next ``set`` writes again,
  so ``/dev/shm`` stays flat over a long run;
- :class:`_Kept`: an update's inputs and ``out`` arrays, kept until its tasks end;
- :func:`share_inputs`, :func:`out_refs`: where workers read an update's inputs and write its ``out`` arrays;
  :func:`inputs_in_shared_memory`, :func:`out_arrays`: the same for a batch in host memory.
"""

from __future__ import annotations

import numpy as np

from dsched.dataplane.store import ArrayRef, RunStore, find_shared

__all__ = ["SetSegment", "out_refs", "out_arrays", "inputs_in_shared_memory", "share_inputs"]


class SetSegment:
    """A field's values given by :meth:`Batch.set`, in a segment of their own that the next ``set`` writes again,
    with a generation number beside them (:func:`~dsched.resident.tasks._load_set` checks it)."""

    def __init__(self, array):
        self.shape, self.dtype = array.shape, array.dtype
        self.store = RunStore(shared=True)
        (self.ref, self.view), (self.generation_ref, self._generation) = self.store.allocate_many(
            [(array.shape, array.dtype), ((1,), np.int64)])
        self.generation = 0
        self.tasks = []  # the load tasks of the values last written

    def fits(self, array) -> bool:
        return array.shape == self.shape and array.dtype == self.dtype

    def write(self, array):
        np.copyto(self.view, array)
        self.generation += 1
        self._generation[0] = self.generation


class _Kept:
    """What an update's tasks read and write outside the batch, kept until they end: the store its inputs were
    copied into, and the caller's arrays they read or write where they lie (a run's outputs go back to the
    segment pool, to be written by the next call, once the caller's arrays are gone)."""

    def __init__(self, store, arrays, out):
        self.store, self.arrays = store, (arrays, out)

    def close(self, clean=False):
        if self.store is not None:
            self.store.close(clean=clean)
        self.store, self.arrays = None, None


def out_refs(out, taken, n, store=None) -> dict:
    """References to an update's ``out`` arrays (``{name: array}``, ``n`` items each); a ValueError naming the entry
    that workers cannot write. ``store``: in-process workers', where the arrays are registered as they are;
    ``None`` for worker processes, which write only into shared memory."""
    if out is None:
        return {}
    if not isinstance(out, dict):
        raise ValueError(f"out: expected a dict of name -> array, got {type(out).__name__}")
    refs = {}
    for name, value in out.items():
        if not isinstance(name, str) or name in taken:
            raise ValueError(f"out: {name!r} is not a name of its own (a string naming no field read, no input)")
        if isinstance(value, ArrayRef):  # the data plane's own (a store's allocation)
            ref = value
        elif not isinstance(value, np.ndarray):
            raise ValueError(f"out[{name!r}]: expected a NumPy array, got {type(value).__name__}")
        elif store is None:
            ref = find_shared(value)
            if ref is None:
                raise ValueError(f"out[{name!r}]: worker processes write only into shared memory; "
                                 f"allocate it with dsched.shared_empty")
        else:
            ref = store.register(value)
        if not ref.shape or ref.shape[0] != n:
            raise ValueError(f"out[{name!r}]: shape {ref.shape} has no {n} items along axis 0")
        refs[name] = ref
    return refs


def out_arrays(out, taken, n, shared) -> dict:
    """An update's ``out`` arrays (``{name: array}``, ``n`` items each) for a batch in host memory, checked as
    :func:`out_refs` checks them; ``shared``: worker processes write them, so they must lie in shared memory."""
    if out is None:
        return {}
    if not isinstance(out, dict):
        raise ValueError(f"out: expected a dict of name -> array, got {type(out).__name__}")
    for name, value in out.items():
        if not isinstance(name, str) or name in taken:
            raise ValueError(f"out: {name!r} is not a name of its own (a string naming no field read, no input)")
        if not isinstance(value, np.ndarray):
            raise ValueError(f"out[{name!r}]: expected a NumPy array, got {type(value).__name__}")
        if shared and find_shared(value) is None:
            raise ValueError(f"out[{name!r}]: worker processes write only into shared memory; "
                             f"allocate it with dsched.shared_empty")
        if not value.shape or value.shape[0] != n:
            raise ValueError(f"out[{name!r}]: shape {value.shape} has no {n} items along axis 0")
    return dict(out)


def inputs_in_shared_memory(arrays) -> dict:
    """An update's ``inputs`` for a batch in host memory on worker processes: each array in shared memory as it
    is now, ``{name: array}``.

    Arrays already there (:func:`dsched.shared_empty`, a run's outputs) are kept as they are, to be read where
    they lie; the others are copied now, into segments that go back to the pool once the update has run and
    dropped them (the caller may change its arrays as soon as ``update`` returns, as with the task engine).
    """
    missing = {name: array for name, array in arrays.items() if find_shared(array) is None}
    if not missing:
        return arrays
    store = RunStore(shared=True)
    placed = store.allocate_many([(array.shape, array.dtype) for array in missing.values()], handed_out=True)
    copies = {}
    for (name, array), (_, view) in zip(missing.items(), placed):
        np.copyto(view, array)
        copies[name] = view
    store.close(clean=True)  # the copies' segment is the views': back to the pool when they are gone
    return {**arrays, **copies}


def share_inputs(arrays, shared):
    """An update's ``inputs`` where workers read them: ``(store or None, {name: reference})``.

    Arrays already in shared memory are referenced where they are (no store);
    the others are copied once into a store of the update's own (``shared``: for worker processes).
    """
    if not arrays:
        return None, {}
    if shared:
        found = {name: find_shared(a) for name, a in arrays.items()}
        if all(ref is not None for ref in found.values()):
            return None, found
    store = RunStore(shared=shared)
    return store, dict(zip(arrays, store.share_many(list(arrays.values()))))
