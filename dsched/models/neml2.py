"""NEML2 models as dsched models: load a NEML2 input file, evaluate it chunk by chunk on any device.

NEML2 3.1's Python path evaluates a model eagerly on one device and leaves
the per-device loop to the user; :class:`NEML2Model` is that loop's model
side. It loads ``neml2.load_model(input, model)`` once per worker thread and
device (NEML2's implicit updates keep their Newton state on the model object,
so threads must not share one), maps inputs to NEML2 variables by name,
returns the outputs (and on request the Jacobian ``{output: {input: block}}``),
and turns NEML2's convergence failures into :class:`~dsched.RecoverableError`.

>>> model = NEML2Model("viscoplastic.i", "model")             # doctest: +SKIP
>>> out = model.dispatch({"E": strain, "t": 1.0, ...}, scheduler=scheduler)  # doctest: +SKIP

Outputs come back as the inputs came: NumPy for NumPy inputs, torch tensors
for torch inputs, NEML2's typed tensors (``SR2``, ``Scalar``...) when any
input is one.

MPI: dsched's :class:`~dsched.SimpleMPIScheduler` follows NEML2 2.1 (more
ranks on a node than devices is an error unless ``allow_shared=True``; idle
devices are allowed). NEML2 3.1's own MPI scheduler shares devices
round-robin when ranks outnumber devices and rejects idle devices: pass
``allow_shared=True`` for its sharing, and list no more devices than ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import numpy as np

from dsched.checks import check_positive_int
from dsched.devices import backends
from dsched.devices.per_thread import PerThread
from dsched.dispatch.front import dispatch
from dsched.errors import NEML2ConvergenceError, as_recoverable  # noqa: F401  (as_recoverable: its old home)
from dsched.models.row_blocks import BLOCK, joined, rows_of, spans
from dsched.models.j2 import loading_strain

__all__ = ["NEML2Model", "NEML2ConvergenceError", "NEML2Parameters", "neml2_chunk", "graph_parameters",
           "as_recoverable"]


def _import_neml2():
    try:
        import neml2
    except ImportError:
        raise ImportError("the NEML2 adapter needs neml2 and a torch it supports: pip install 'dsched[neml2]'") from None
    return neml2


def _load(path, name, overrides):
    neml2 = _import_neml2()
    return neml2.load_input(str(path), additional_args=list(overrides)).get_model(name)


class NEML2Model:
    """A model of a NEML2 input file, evaluated on batches of material points.

    Parameters
    ----------
    input : str or path
        The NEML2 input file (HIT).
    model : str
        The model's name in its ``[Models]`` section.
    outputs : list of str, optional
        The output variables to return; default all.
    derivatives : bool
        Also return the Jacobian blocks ``{output: {input: block}}`` (each
        ``(batch, *output base, *input base)``); a call then returns
        ``(outputs, derivatives)``.
    overrides : list of str
        HIT overrides applied after the file, as on NEML2's command line
        (``"Solvers/newton/max_its:=50"``).
    keep_grad : bool
        Keep the outputs' autograd history (NEML2's implicit updates attach
        one); by default it is dropped, so the outputs can cross processes.
    block : int or None
        Points per NEML2 call on a CPU (default :data:`~dsched.models.row_blocks.BLOCK`,
        25,000): a larger chunk is evaluated block by block, each block's
        temporaries in the caches (:mod:`dsched.models.row_blocks`). ``None``
        calls NEML2 once per chunk. GPU chunks are never cut.

    The file is read once here, so a wrong file, model or output name is a
    ``ValueError`` before any work starts. Each worker thread then loads
    its own copy per device (:class:`~dsched.PerThread`).
    """

    def __init__(self, input, model, *, outputs=None, derivatives=False, overrides=(), keep_grad=False,
                 block=BLOCK):
        if block is not None:
            check_positive_int(block, "block", integers=(int, np.integer), expected="an integer >= 1 or None",
                               below=None)
        self.block = None if block is None else int(block)
        self.input = Path(input).resolve()
        if not self.input.is_file():
            raise ValueError(f"input: no NEML2 input file at {input}")
        self.model, self.overrides = str(model), tuple(overrides)
        try:
            probe = _load(self.input, self.model, self.overrides)
        except (KeyError, ValueError, RuntimeError) as err:
            raise ValueError(f"model: cannot load {self.model!r} from {self.input}: {err}") from None
        self.input_names = list(probe.input_spec)
        self.output_names = list(probe.output_spec)
        #: Every variable's base shape (``(6,)`` for an ``SR2``, ``()`` for a ``Scalar``), inputs and outputs.
        self.base_shapes = {name: tuple(getattr(kind, "BASE_SHAPE", ())) for spec in (
            probe.input_spec, probe.output_spec) for name, kind in spec.items()}
        self.all_output_names = list(self.output_names)
        if outputs is not None:
            unknown = [o for o in outputs if o not in self.output_names]
            if unknown:
                raise ValueError(f"outputs: {unknown} are not outputs of {self.model!r} (it has {self.output_names})")
            self.output_names = list(outputs)
        self.derivatives, self.keep_grad = bool(derivatives), bool(keep_grad)
        self._per_thread = PerThread(self._build)
        self._probes = {}  # what a one-item call returned, per kind and shapes of inputs (see probe_outputs)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_probes"] = {}  # learned on the client, for the client
        return state

    #: dispatch() hands the inputs over as they are (NumPy stays NumPy on a GPU chunk): this model
    #: moves them to its torch device itself, so CuPy is never needed.
    moves_inputs = True

    def _build(self, device):
        return _load(self.input, self.model, self.overrides).to(device=backends.torch_device(device))

    def check_inputs(self, inputs) -> None:
        """A ``ValueError`` naming missing or unknown variables of ``inputs`` (a mapping)."""
        missing = [n for n in self.input_names if n not in inputs]
        unknown = [n for n in inputs if n not in self.input_names]
        if missing or unknown:
            raise ValueError(
                f"inputs: {self.model!r} takes {self.input_names}; "
                + "; ".join(part for part in (missing and f"missing {missing}", unknown and f"unknown {unknown}") if part)
            )

    def __call__(self, inputs):
        """Evaluate one chunk: ``inputs`` maps every input variable to an array or a number.

        A number goes to every point and every component of its variable; a
        NumPy array of a tensor variable without a batch needs a leading axis
        of 1 (``(1, 6)`` for an ``SR2``), since NumPy cannot tell a ``(6,)``
        tensor from six points.
        """
        import torch

        self.check_inputs(inputs)
        device = backends.torch_device()
        model = self._per_thread.get()  # gives this thread the worker's share of torch threads, once
        kind = _kind_of(inputs.values())
        spec = model.input_spec
        state = {name: _as_neml2_value(value, spec[name], device, torch) for name, value in inputs.items()}
        # NumPy's, not torch's: torch.broadcast_shapes imports torch._refs on its first call (a second, per worker)
        batch = np.broadcast_shapes(*(tuple(value.dynamic_batch_shape) for value in state.values()))
        neml2 = _import_neml2()
        try:
            values, jacobian = self._evaluate(model, state, batch, device, kind)
        except neml2.solvers.ConvergenceError as err:
            raise NEML2ConvergenceError(f"NEML2 model {self.model!r} ({self.input.name}): {err}") from None
        outputs = {name: self._returned(backends.NEML2.expanded(values[name], batch), kind)
                   for name in self.output_names}
        if jacobian is None:
            return outputs
        derivatives = {
            out: {inp: self._returned(block, kind) for inp, block in jacobian[out].items()}
            for out in self.output_names
        }
        return outputs, derivatives

    def _call(self, model, state):
        if self.derivatives:
            return model.jacobian(state)
        return model.call_by_name(state), None

    def _evaluate(self, model, state, batch, device, kind):
        """NEML2's ``(values, jacobian)`` over ``state``, block by block on a CPU (:mod:`~dsched.models.row_blocks`)."""
        bounds = spans(batch[0], self.block) if len(batch) == 1 and device.type == "cpu" else [None]
        if len(bounds) == 1:
            return self._call(model, state)
        rows = batch[0]
        parts = [self._call(model, {name: rows_of(value, start, stop, rows) for name, value in state.items()})
                 for start, stop in bounds]
        # NumPy results are allocated by NumPy, so that dsched can place them in the chunk's output rows.
        allocate = _numpy_storage if kind == "numpy" else None
        join = functools.partial(joined, bounds=bounds, allocate=allocate, keep_grad=self.keep_grad)
        values = {name: join([part_values[name] for part_values, _ in parts]) for name in self.output_names}
        if not self.derivatives:
            return values, None
        return values, {out: {inp: join([jacobian[out][inp] for _, jacobian in parts]) for inp in parts[0][1][out]}
                        for out in self.output_names}

    def _returned(self, value, kind):
        if not self.keep_grad:
            value = backends.detach(value)
        if kind == "neml2":
            return value
        if kind == "torch":
            return value.data
        return backends.host_view(backends.to_host(value.data))

    @property
    def probe_outputs(self):
        """What :func:`dsched.dispatch` calls on the client to learn the outputs' layout (one item).

        NEML2's floor per call is paid once per input kind and shapes: the
        outputs of that first one-item call are kept and returned again, so
        a solver calling :meth:`dispatch` every step does not run NEML2 on
        the client every step (263 ms for chaboche2). With ``derivatives``
        the model itself is called.
        """
        return True if self.derivatives else self._probe

    def _probe(self, inputs):
        key = (_kind_of(inputs.values()), tuple(sorted((name, tuple(np.shape(v))[1:]) for name, v in inputs.items()
                                                       if backends.is_array(v))))
        result = self._probes.get(key)
        if result is None:
            result = self._probes[key] = self(inputs)
        return result

    def dispatch(self, inputs, *, scheduler, **options):
        """:func:`dsched.dispatch` of this model over ``inputs``, its variable names checked first."""
        self.check_inputs(inputs)
        return dispatch(self, dict(inputs), scheduler=scheduler, **options)

    def __repr__(self):
        return f"NEML2Model({str(self.input)!r}, {self.model!r})"


def _numpy_storage(shape, dtype):
    """A torch tensor in memory NumPy allocated (so that dsched can place it in a chunk's output rows)."""
    import torch

    if dtype != torch.float64:
        return torch.empty(shape, dtype=dtype)
    return backends.TORCH.from_host(np.empty(shape), None)


def _kind_of(values) -> str:
    kinds = {backends.backend_of(v).name for v in values if backends.backend_of(v) is not None}
    if "neml2" in kinds:
        return "neml2"
    return "torch" if "torch" in kinds else "numpy"


def _as_neml2_value(value, variable_type, device, torch):
    """An input as NEML2 takes it on ``device``: typed tensors kept, arrays as float64 tensors, a number in every component."""
    backend = backends.backend_of(value)
    if backend is None:
        base = tuple(getattr(variable_type, "BASE_SHAPE", ()))
        return variable_type(torch.full(base, float(value), dtype=torch.float64, device=device))
    if backend is backends.NEML2:
        return value if value.device == device else value.to(device)
    if backend.name == "numpy":  # any strides torch takes: a row slice of a history is not copied
        value = np.asarray(value)
        value = backends.TORCH.from_host(value if min(value.strides, default=0) >= 0 else value.copy(), None)
    elif backend.name == "cupy":
        value = torch.as_tensor(value, device=device)  # through __cuda_array_interface__, no host copy
    return variable_type(value if value.device == device else value.to(device))


# --- graph files ---------------------------------------------------------------

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
