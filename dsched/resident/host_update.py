"""One update of a batch in host memory, as its run calls it on each chunk.

:class:`~dsched.resident.host_batch.HostBatch` runs an update over
``(chunk of each item, *fields read, *inputs, *out arrays)``, with ``out=``:
on a dispatcher of its own (:class:`UpdateWork` hands a chunk's arrays in
order), or, while the layouts are learned, as one :func:`dsched.dispatch`.
Every array is split into the batch's chunks, and each chunk's rows reach
:class:`ChunkUpdate` as views of the batch's memory. It calls the update's
``fn`` with them as keywords, as the task engine does (fields read-only, a field
both read and written writable with ``inplace``, the update's ``out`` rows
writable), checks what ``fn`` returned with the same messages
(:func:`~dsched.resident.tasks.checked_result`), and returns
the fields written and the out rows, which dispatch writes in place: into the
spare arrays of the fields written and the caller's ``out`` arrays (flat, in that
order: one array alone takes dispatch's shortest path; while the layouts are
learned, ``(fields, out rows)`` by name, for dispatch to make the arrays).
In place, dispatch hands it those rows as ``out=`` (``takes_out_rows``): ``fn``
gets the caller's out rows themselves and a field changed in place in its
spare rows, so neither is copied on the way in nor on the way back. What it raises
names the batch's chunk (an attribute, and a note), so the batch knows which
chunks failed.

A field keeps its item shape and dtype from one update to the next. A result
that changes them raises :class:`LayoutChanged`, and the batch runs the update
again without ``out=`` (dispatch then allocates arrays of the new layout).
"""

from __future__ import annotations

import numpy as np

from dsched.dataplane.outputs import ChunkResultError
from dsched.devices.threads import limit_this_thread
from dsched.errors import as_recoverable
from dsched.resident.tasks import _to_host, checked_result

__all__ = ["ChunkUpdate", "UpdateWork", "LayoutChanged", "layout_of", "flat", "CHUNK_ATTRIBUTE"]

CHUNK_ATTRIBUTE = "dsched_batch_chunk"  # on an error a chunk raised: the index of the batch's chunk


def _copied(array, rows):
    """A writable copy of ``array``: into ``rows`` (a chunk's output rows) where given, else a new one."""
    if rows is None:
        return np.array(array)
    np.copyto(rows, array)
    return rows


class LayoutChanged(ChunkResultError):
    """An update's result gives a field another item shape or dtype than the field has."""


def flat(arrays):
    """An in-place update's results (the fields written, then the out rows), as :class:`ChunkUpdate` returns them
    and the batch passes its ``out``: one array alone (dispatch's shortest write), else a tuple."""
    return arrays[0] if len(arrays) == 1 else tuple(arrays)


def layout_of(array) -> tuple:
    """``(item shape, dtype string)`` of a field's NumPy array: what a chunk's result must keep."""
    return array.shape[1:], array.dtype.str


class ChunkUpdate:
    """``fn`` of one update on one chunk's rows, as ``dispatch`` calls it: ``(rows, *arrays)`` in, results out.

    Parameters
    ----------
    spec : _UpdateSpec
        The update: ``fn``, ``label``, ``reads``, ``writes`` (its outputs too), ``inplace``, ``kwargs``.
    inputs, outs : tuple of str
        The names of the update's own inputs and ``out`` arrays, in the order their rows follow the fields.
    layouts : dict or None
        ``{field: (item shape, dtype)}`` each written field must keep; ``None`` where they are learned (a new
        field, a changed layout).
    chunks : tuple of _Chunk
        The batch's chunks: ``rows`` (each item's chunk index) tells which one a call runs, for the messages.
    """

    probe_outputs = False  # dispatch never calls it on the client: fn runs where the chunks run, as with tasks
    takes_out_rows = True  # in place, dispatch hands it the chunk's output rows (out=): written there, not copied

    def __init__(self, spec, inputs, outs, layouts, chunks):
        self.spec, self.inputs, self.outs = spec, tuple(inputs), tuple(outs)
        self.layouts = None if layouts is None else dict(layouts)
        self.chunks = tuple(chunks)
        self.__name__ = spec.label
        # A solver's usual update (nothing in place, no out= arrays, the layouts known) takes a short way: the
        # arrays by name straight to fn, and its fields, if they are what the batch expects, straight back.
        plain = self.layouts is not None and not self.outs and not (spec.inplace and set(spec.reads) & set(spec.writes))
        self._names = (*spec.reads, *self.inputs) if plain else None
        self._expected = None if not plain else tuple(
            (field, tuple(self.layouts[field][0]), np.dtype(self.layouts[field][1])) for field in spec.writes)

    def __call__(self, rows, *arrays, out=None):
        chunk = self._chunk(rows)
        try:
            if self._names is not None:
                return self._call_plain(chunk, arrays)
            return self._call(chunk, arrays, out)
        except Exception as err:
            setattr(err, CHUNK_ATTRIBUTE, chunk.index)
            # The batch's chunk, not dispatch's: a run that starts part-way through the plan counts from there.
            err.add_note(f"dsched: update {self.spec.label!r} failed on {chunk}")
            raise

    def _call(self, chunk, arrays, out=None):
        spec = self.spec
        # In place, dispatch may give the chunk's rows of the spare arrays and out= arrays (writable views, in the
        # order flat() lists them): the out rows are fn's own, and a field changed in place is copied there once.
        targets = self._targets(out)
        given = {}
        for field, array in zip(spec.reads, arrays):
            # A field written in place is the chunk's own copy: its rows in the batch change only when fn succeeds.
            if spec.inplace and field in spec.writes:
                given[field] = _copied(array, targets.get(field))
            else:
                given[field] = array
        rest = arrays[len(spec.reads):]
        given.update(zip(self.inputs, rest))
        # The out rows as they are, writable: what fn leaves unwritten keeps its value. dispatch's rows of them
        # are the caller's arrays themselves; the rows read (mapped read-only) are copied.
        outs = {name: targets[name] if name in targets else np.array(array)
                for name, array in zip(self.outs, rest[len(self.inputs):])}
        given.update(outs)
        return self._checked(chunk, spec.fn(**given, **spec.kwargs), outs)

    def _checked(self, chunk, result, outs):
        """``fn``'s ``result`` checked (a field's layout changed: :class:`LayoutChanged`), as :meth:`__call__`
        returns it: by name while layouts are learned, else flat."""
        spec = self.spec
        fields = {field: _to_host(value) for field, value in checked_result(spec, chunk, result).items()}
        if self.layouts is not None:
            for field, value in fields.items():
                found, kept = layout_of(value), self.layouts[field]
                if found != kept:
                    raise LayoutChanged(f"update {spec.label!r}: {chunk}: field {field!r} has items of shape "
                                        f"{found[0]} and dtype {np.dtype(found[1])}; the field's are {kept[0]}, "
                                        f"{np.dtype(kept[1])}")
        if self.layouts is None:  # learning the layouts: dispatch makes the arrays, by name
            return fields, outs
        # In place: the fields written, then the out rows, flat, as the batch's out= lists them.
        return flat([fields[field] for field in spec.writes] + [outs[name] for name in self.outs])

    def _call_plain(self, chunk, arrays):
        """:meth:`_call` of an update with nothing in place and no out= arrays, its layouts known: the fields
        ``fn`` returned, flat, checked at a glance, or by :meth:`_call`'s checks (and their messages) otherwise."""
        spec = self.spec
        result = spec.fn(**dict(zip(self._names, arrays)), **spec.kwargs)
        if type(result) is dict and len(result) == len(self._expected):
            values = [result.get(field) for field, _, _ in self._expected]
            items = (chunk.stop - chunk.start,)
            if all(type(value) is np.ndarray and value.shape[:1] == items and value.shape[1:] == shape and
                   value.dtype == dtype for value, (_, shape, dtype) in zip(values, self._expected)):
                return flat(values)
        return self._checked(chunk, result, {})

    def _targets(self, out) -> dict:
        """``{field or out name: its writable rows}`` of dispatch's ``out=`` (nothing while layouts are learned)."""
        if out is None or self.layouts is None:
            return {}
        rows = out if isinstance(out, tuple) else (out,)
        return dict(zip((*self.spec.writes, *self.outs), rows))

    def _chunk(self, rows):
        """The batch's chunk whose rows these are (``rows``: each item's chunk index)."""
        chunk = self.chunks[int(rows[0])]
        if chunk.size != len(rows) or rows[-1] != rows[0]:  # dispatch cut another chunk: never, but say so
            raise RuntimeError(f"update {self.spec.label!r}: {len(rows)} items from {chunk} on are not a chunk "
                               "of the batch")
        return chunk


class UpdateWork:
    """``do_work`` of an in-place update's own dispatcher: a chunk's arrays, in order, to its :class:`ChunkUpdate`.

    The batch runs a like update again and again: it keeps a
    :class:`~dsched.dispatch.dispatcher.WorkDispatcher` per program, whose loader
    names the arrays ``"0"``, ``"1"``, ... (the items' chunk indexes, then the
    fields read, the inputs and the out arrays). A chunk arrives as host arrays
    (the batch's memory), is never moved, and gets its output rows as ``out=``.

    Parameters
    ----------
    program : ChunkUpdate
        The update.
    count : int
        How many arrays a chunk carries.
    """

    def __init__(self, program, count):
        self.program, self.keys = program, tuple(str(i) for i in range(count))
        self.fn = program.spec.fn  # the user's function, for the note that names its file (errors.note_where_defined)

    def __call__(self, work, device, out=None):
        return self.on_host(work, out)

    def on_host(self, work, out=None):
        """The chunk's update: nothing to move (the chunks of a batch in host memory are host arrays)."""
        limit_this_thread()  # torch's thread count is per thread: give this one the worker's share
        try:
            return self.program(*[work[key] for key in self.keys], out=out)
        except RuntimeError as err:
            recoverable = as_recoverable(err)  # NEML2's own solve failures, from an fn calling NEML2
            if recoverable is None:
                raise
            setattr(recoverable, CHUNK_ATTRIBUTE, getattr(err, CHUNK_ATTRIBUTE, None))  # the batch's chunk
            raise recoverable from err
