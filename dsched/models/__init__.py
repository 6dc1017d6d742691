"""Material models that the example jobs run, by name.

Each entry of :data:`MODELS` is a :class:`Model`: its ``chunk`` is a job's
``do_work``, called as ``chunk(work_slice, device)``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from dsched.checks import did_you_mean
from dsched.models.imported import imported_fields, is_import_path
from dsched.models.fe_material import FEMaterial
from dsched.models.j2 import J2_INPUTS, J2Parameters, j2_chunk, j2_outputs, j2_update, loading_strain, write_j2_inputs
from dsched.models.neml2 import NEML2ConvergenceError, NEML2Model
from dsched.models.neml2_graph import NEML2Parameters, neml2_chunk

__all__ = [
    "FEMaterial",
    "J2Parameters",
    "j2_update",
    "j2_chunk",
    "loading_strain",
    "write_j2_inputs",
    "Model",
    "MODELS",
    "get_model",
    "NEML2Model",
    "NEML2Parameters",
    "NEML2ConvergenceError",
]


class Model(NamedTuple):
    """A registered model: its do_work, its parameter type and a one-line description."""

    chunk: Callable
    parameters_type: type
    description: str
    outputs: Callable | None = None  # outputs(tangent) -> {name: (item_shape, dtype)}, declared results
    inputs: tuple = ()  # the arrays a chunk may be given instead of a slice (dsched run --input); () for none


MODELS = {
    "j2": Model(
        chunk=j2_chunk,
        parameters_type=J2Parameters,
        description="small-strain J2 plasticity, radial return with linear isotropic hardening",
        outputs=j2_outputs,
        inputs=J2_INPUTS,
    ),
    # Outputs not declared: they depend on the input file (probed on two points instead).
    "neml2": Model(
        chunk=neml2_chunk,
        parameters_type=NEML2Parameters,
        description="a NEML2 model from its input file (neml2 extra), per-thread instances, convergence failures recoverable",
    ),
}


def get_model(name, *, folder=None, generator=None):
    """The :class:`Model` registered as ``name``, or the function an import path names
    (``"package.module:function"``, :mod:`dsched.models.imported`; ``folder``: where else to find its module,
    ``generator``: the import path of its inputs' generator).

    Raises
    ------
    ValueError
        If no model has that name, or the import path does not name a function.
    """
    if is_import_path(name):
        return Model(**imported_fields(name, folder, generator))
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"model: unknown model {name!r}{did_you_mean(str(name), MODELS)}; known: "
                         f"{', '.join(sorted(MODELS))}, or your own function as 'package.module:function'") from None
