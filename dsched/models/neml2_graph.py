"""NEML2 models in dsched's graph files: a graph's ``[model]`` with ``name = "neml2"``.

A graph job names a NEML2 input file, a model in it, and a value for every
input variable (the loading strain of each point, or a number for all);
:func:`neml2_chunk` evaluates it on a slice of points with a
:class:`~dsched.models.NEML2Model` kept once per process.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from dsched.models.j2 import loading_strain
from dsched.models.neml2 import NEML2Model

__all__ = ["STRAIN", "NEML2Parameters", "neml2_chunk", "graph_parameters"]

STRAIN = "strain"  # the graph value that stands for each point's loading strain


@dataclasses.dataclass(frozen=True)
class NEML2Parameters:
    """A graph's ``[model]`` for ``name = "neml2"``.

    Parameters
    ----------
    input : str
        The NEML2 input file (relative paths are from the graph file).
    model : str
        The model's name in the file.
    inputs : dict
        Every input variable: ``"strain"`` for each point's loading strain
        (:func:`dsched.models.loading_strain`, a Mandel 6-vector as NEML2's
        ``SR2``), or a number given to every point (all components of a
        tensor variable).
    outputs : list of str, optional
        The outputs to keep; default all.
    """

    input: str
    model: str
    inputs: tuple = ()
    outputs: tuple | None = None

    def __post_init__(self):
        inputs = dict(self.inputs)
        for name, value in inputs.items():
            if value != STRAIN and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"inputs.{name}: expected {STRAIN!r} or a number, got {value!r}")
        object.__setattr__(self, "inputs", tuple(sorted(inputs.items())))
        if self.outputs is not None:
            object.__setattr__(self, "outputs", tuple(self.outputs))
        model = _graph_model(self)  # loads the file: every name is checked before any work
        model.check_inputs(inputs)


_GRAPH_MODELS = {}  # NEML2Parameters -> NEML2Model, one per process


def _graph_model(params: NEML2Parameters) -> NEML2Model:
    model = _GRAPH_MODELS.get(params)
    if model is None:
        model = _GRAPH_MODELS[params] = NEML2Model(params.input, params.model, outputs=params.outputs)
    return model


def neml2_chunk(work, device, params: NEML2Parameters, *, tangent=False):
    """A graph job's ``do_work``: the NEML2 model on points ``work`` (a slice), inputs made where it runs.

    Returns a dict of NumPy arrays: the outputs, and with ``tangent`` the
    Jacobian blocks as ``"d(output)/d(input)"``.
    """
    if not isinstance(work, slice) or work.stop is None:
        raise ValueError(f"work must be a slice with a stop, got {work!r}")
    points = np.arange(work.start or 0, work.stop, work.step or 1)
    inputs = {name: loading_strain(points) if value == STRAIN else float(value) for name, value in params.inputs}
    model = _graph_model(params)
    if not tangent:
        return model(inputs)
    if not model.derivatives:
        model = _GRAPH_MODELS[("tangent", params)] = _GRAPH_MODELS.get(("tangent", params)) or NEML2Model(
            params.input, params.model, outputs=params.outputs, derivatives=True
        )
    outputs, derivatives = model(inputs)
    for out, blocks in derivatives.items():
        for inp, block in blocks.items():
            outputs[f"d({out})/d({inp})"] = block
    return outputs


def graph_parameters(table: dict, source: str) -> dict:
    """The :class:`NEML2Parameters` fields of a graph's ``[model]`` table (``input`` resolved against the graph's folder)."""
    for key in ("input", "model", "inputs"):
        if key not in table:
            raise ValueError(f"model.{key}: required for name = 'neml2'")
    if "parameters" in table:
        raise ValueError("model.parameters: not used by name = 'neml2' (give inputs and outputs instead)")
    path = Path(table["input"])
    if not path.is_absolute() and os.path.isfile(source):
        path = Path(source).resolve().parent / path
    fields = {"input": str(path), "model": table["model"], "inputs": dict(table["inputs"])}
    if "outputs" in table:
        fields["outputs"] = list(table["outputs"])
    try:
        NEML2Parameters(**fields)  # loads the file once: every name checked before any cluster starts
    except ImportError as err:
        raise ValueError(f"model.name: {err}") from None
    except ValueError as err:
        raise ValueError(f"model.{err}") from None
    return fields
