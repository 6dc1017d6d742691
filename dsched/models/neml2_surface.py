"""NEML2's sensitivity surface across devices: how a call's entries travel, and how the chunks' results join.

NEML2's multi-device ``DispatchedModel`` (C++ only) chunks ``forward``,
``jvp``, ``jacobian``, ``param_jacobian`` and ``param_vjp``; a
:class:`~dsched.models.NEML2Model` does the same over a dsched scheduler:

- every result per item (outputs, ``jvp``, Jacobian blocks, parameter
  Jacobian blocks) is joined along the batch in dispatch order, as NEML2 joins
  its chunks (``dsched.dispatch``'s join, written in place);
- ``param_vjp`` is a sum over the chunks (:func:`ordered_sum`), taken in
  chunk order, whatever order they finished in: the same inputs give the same
  bits on every run.

A call sends one mapping of entries: the model's inputs by name, the tangents
(``@tangent:<input>``) or cotangents (``@cotangent:<output>``), and the
parameters set on the client (``@parameter:<name>``,
:mod:`dsched.models.neml2_parameters`). Per-item entries are split with the
batch; numbers and entries one item long go whole to every chunk.

>>> ordered_sum([{"E": 1.0}, {"E": 2.0}, {"E": 0.5}])
{'E': 3.5}
"""

from __future__ import annotations

from dsched.models.neml2_parameters import split_parameters

__all__ = ["TANGENT", "COTANGENT", "Operation", "ChunkOfOperation", "split_entries", "ordered_sum", "prefixed",
           "check_names"]

TANGENT, COTANGENT = "@tangent:", "@cotangent:"


def prefixed(prefix, values) -> dict:
    """``values`` as entries of a call: every key behind ``prefix``."""
    return {prefix + name: value for name, value in values.items()}


def split_entries(entries):
    """``(inputs, parameters, tangents, cotangents)`` from a chunk's entries (the parameters ``{}`` when none)."""
    entries, parameters = split_parameters(entries)
    inputs, tangents, cotangents = {}, {}, {}
    for key, value in entries.items():
        if key.startswith(TANGENT):
            tangents[key[len(TANGENT):]] = value
        elif key.startswith(COTANGENT):
            cotangents[key[len(COTANGENT):]] = value
        else:
            inputs[key] = value
    return inputs, parameters or {}, tangents, cotangents


def ordered_sum(results):
    """The sum of the chunks' ``{name: value}`` results, taken in the list's order (dispatch order).

    Floating-point addition is not associative: summing as the chunks
    finish would make the last bits depend on timing. The dispatcher hands
    the results over in dispatch order, and they are added one after the
    other in that order.
    """
    results = list(results)
    if not results:
        return {}
    total = dict(results[0])
    for result in results[1:]:
        for name, value in result.items():
            total[name] = total[name] + value
    return total


def check_names(given, known, field, what) -> None:
    """A ValueError naming ``field`` for names of ``given`` that are not among ``known`` (``what`` names them)."""
    unknown = [name for name in given if name not in known]
    if unknown:
        raise ValueError(f"{field}: {unknown} are not {what} (it has {list(known)})")


class Operation:
    """One operation of a model as :func:`dsched.dispatch` calls it: ``operation(entries)`` on a chunk.

    Kept per model, operation and parameter selection, so that a call like
    the one before is recognised as such (dsched reuses its dispatcher).
    The model moves its inputs itself; the outputs' layout is learned from
    an eager evaluation of one item on the client (:meth:`probe_outputs`).
    """

    moves_inputs = True
    #: dispatch hands it the chunk's output rows (``out=``) where they are NumPy views: a compiled model's
    #: values are computed there (:class:`~dsched.models.neml2_engines.ValuesInto`), not copied after.
    takes_out_rows = True

    def __init__(self, model, operation, params=None):
        self.model, self.operation, self.params = model, operation, params

    def __call__(self, entries, out=None):
        return self.model._evaluate_entries(self.operation, entries, self.params, sent=True, out=out)

    @property
    def probe_outputs(self):
        return self.model._prober(self.operation, self.params)

    def __repr__(self):
        return f"{self.operation} of {self.model!r}"


class ChunkOfOperation:
    """``do_work(work, device)`` of a :class:`~dsched.WorkDispatcher` running ``operation`` on each chunk."""

    def __init__(self, operation):
        self.operation = operation

    def __call__(self, work, device):
        return self.operation(work)
