"""NEML2 models as dsched models: load a NEML2 model, evaluate it chunk by chunk on any device.

NEML2 3.1's Python path evaluates a model on one device and leaves the
per-device loop to the user; :class:`NEML2Model` is that loop's model side.
It loads the model once per worker thread and device (NEML2's implicit
updates keep their Newton state on the model object, so threads must not
share one), maps inputs to NEML2 variables by name, and turns NEML2's
convergence failures into :class:`~dsched.RecoverableError`. The model is
NEML2's own (``NEML2Model(input, model)``), compiled in place on each copy
with ``neml2.compile`` (``compile=True``), or an AOTI artifact exported by
``neml2.export_model_for_aoti`` (:meth:`NEML2Model.from_artifacts`).

Over a scheduler it offers NEML2's whole sensitivity surface, chunked and
joined as NEML2's C++ ``DispatchedModel`` does (:mod:`dsched.models.neml2_surface`):
:meth:`~NEML2Model.dispatch` (the outputs), :meth:`~NEML2Model.jvp`,
:meth:`~NEML2Model.jacobian`, :meth:`~NEML2Model.param_jacobian` and
:meth:`~NEML2Model.param_vjp` (summed over the chunks in chunk order). Its
parameters (:meth:`~NEML2Model.set_parameter`, :meth:`~NEML2Model.named_parameters`)
reach every device's copy at the next call (:mod:`dsched.models.neml2_parameters`).

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

import contextlib
import functools
import uuid
from pathlib import Path

import numpy as np

from dsched.checks import check_positive_int
from dsched.dataplane.loaders import MappingLoader
from dsched.devices import backends
from dsched.devices.ownership import emulated_devices
from dsched.devices.per_thread import PerThread
from dsched.dispatch.dispatcher import WorkDispatcher
from dsched.dispatch.front import dispatch
from dsched.errors import NEML2ConvergenceError, as_recoverable  # noqa: F401  (as_recoverable: its old home)
from dsched.models.neml2_artifacts import Artifacts
from dsched.models.neml2_engines import ArtifactEngine, NativeEngine, ValuesInto, compile_options, compiled_graphs
from dsched.models.neml2_evaluate import as_neml2_value, evaluate, kind_of, numpy_storage, rows_to_compute_into
from dsched.models.neml2_parameters import ParameterValues
from dsched.models.neml2_surface import (
    COTANGENT,
    TANGENT,
    ChunkOfOperation,
    Operation,
    check_names,
    ordered_sum,
    prefixed,
    split_entries,
)
from dsched.models.row_blocks import BLOCK, padded_sizes

__all__ = ["NEML2Model", "NEML2ConvergenceError", "as_recoverable", "compiled_graphs"]


def _import_neml2():
    try:
        import neml2
    except ImportError:
        raise ImportError("the NEML2 adapter needs neml2 and a torch it supports: pip install 'dsched[neml2]'") from None
    return neml2


def _load(path, name, overrides):
    neml2 = _import_neml2()
    return neml2.load_input(str(path), additional_args=list(overrides)).get_model(name)


def _solves(model) -> bool:
    """Whether a loaded NEML2 model has an implicit update (a Newton solve) anywhere in it."""
    try:
        from neml2.models.common.ImplicitUpdate import ImplicitUpdate
    except ImportError:
        return any(type(part).__name__ == "ImplicitUpdate" for part in model.modules())
    return any(isinstance(part, ImplicitUpdate) for part in model.modules())


class NEML2Model:
    """A NEML2 model, evaluated on batches of material points.

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
    block : int, None or "auto"
        Points per NEML2 call on a CPU: a larger chunk is evaluated block by
        block, each block's temporaries in the caches and each block's
        Newton solve stopping when its own points have converged
        (:mod:`dsched.models.row_blocks`). ``None`` calls NEML2 once per
        chunk. GPU chunks are never cut. ``"auto"`` (the default):
        :data:`~dsched.models.row_blocks.BLOCK` (25,000) for an eager model
        with an implicit update (a Newton solve), ``None`` for one without
        (elasticity: a few passes over the points, which blocks only cut
        into more calls) and for a compiled one, whose fused
        kernels keep no large temporaries and whose cost per call is NEML2's
        Python around them.
    compile : bool, str or dict
        Compile each worker thread's copy once with ``neml2.compile``
        (``torch.compile`` with static shapes): ``True``, a ``torch.compile``
        mode (``"max-autotune"``), or a dict of ``torch.compile`` options
        (``{"backend": "aot_eager"}``). A chunk smaller than a size already
        compiled on its device is padded up to it, so a fixed batch compiles
        once per device (:func:`compiled_graphs` counts the graphs); with
        chunk sizes that grow from call to call (a performance-model policy),
        give ``block`` so that pieces of ``block`` rows bound the sizes.
    autograd : bool
        ``True`` (the default): values are evaluated as NEML2's own call
        evaluates them, recording autograd through the model's parameters.
        ``False``: values alone (not the derivatives) are evaluated under
        ``torch.no_grad``, with nothing recorded for a backward pass nobody
        asks for: the cost of recording is saved, most of all by eager
        models. NEML2 takes other paths for some operations when nothing
        needs a gradient, so the results may differ from its default call in
        the last bits (as NEML2's own call under ``torch.no_grad`` does). Not
        with ``keep_grad``.

    The file is read once here, so a wrong file, model or output name is a
    ``ValueError`` before any work starts. Each worker thread then loads
    its own copy per device (:class:`~dsched.PerThread`).
    """

    def __init__(self, input, model, *, outputs=None, derivatives=False, overrides=(), keep_grad=False,
                 block="auto", compile=False, autograd=True):
        self.compile = compile_options(compile)
        self._options(block, derivatives, keep_grad, compiled=self.compile is not None, autograd=autograd)
        self.input = Path(input).resolve()
        if not self.input.is_file():
            raise ValueError(f"input: no NEML2 input file at {input}")
        self.model, self.overrides, self.artifacts = str(model), tuple(overrides), None
        try:
            probe = _load(self.input, self.model, self.overrides)
        except (KeyError, ValueError, RuntimeError) as err:
            raise ValueError(f"model: cannot load {self.model!r} from {self.input}: {err}") from None
        if self.block == "auto":
            self.block = BLOCK if _solves(probe) else None
        self._describe(probe.input_spec, probe.output_spec, dict(probe.named_parameters()), outputs)

    @classmethod
    def from_artifacts(cls, root, *, dtype="float64", outputs=None, derivatives=False, keep_grad=False,
                       block="auto", autograd=True) -> NEML2Model:
        """A model of NEML2's AOTI artifacts under ``root`` (``neml2.export_model_for_aoti``'s output folder).

        Each worker loads the leaf of its own device and ``dtype`` with
        ``neml2.aoti.AOTIModel``: ``cpu`` on a CPU or an emulated GPU,
        ``cuda`` on a real GPU. A run's device with no leaf, or a derivative
        the artifacts were exported without, is a ``ValueError`` before any
        work starts (the metadata and the leaves are read here: export every
        leaf before making the model). The parameters are those promoted at
        export (``promoted=[...]``). Other options as for the constructor.
        """
        import torch

        artifacts = Artifacts(root, dtype)
        self = cls.__new__(cls)
        self.compile = None
        self._options(block, derivatives, keep_grad, compiled=False, autograd=autograd)
        if self.block == "auto":  # the artifacts do not say whether their model solves: blocks, as for one that does
            self.block = BLOCK
        self.input, self.model, self.overrides, self.artifacts = artifacts.root, artifacts.root.name, (), artifacts
        types = _import_neml2().types
        try:
            specs = [{name: getattr(types, kind) for name, kind in variables.items()}
                     for variables in (artifacts.inputs, artifacts.outputs)]
        except AttributeError as err:
            raise ValueError(f"root: {artifacts.root} names a variable type this neml2 lacks ({err})") from None
        defaults = {name: torch.tensor(values, dtype=getattr(torch, dtype)).reshape(shape)
                    for name, (shape, values) in artifacts.parameters.items()}
        self._describe(*specs, defaults, outputs)
        return self

    def _options(self, block, derivatives, keep_grad, compiled, autograd):
        if isinstance(block, str) and block == "auto":
            # An eager model's blocks depend on what it computes, known once it is loaded (see __init__).
            self.block = None if compiled else "auto"
        else:
            if block is not None:
                check_positive_int(block, "block", integers=(int, np.integer),
                                   expected="an integer >= 1, None or 'auto'", below=None)
            self.block = None if block is None else int(block)
        self.derivatives, self.keep_grad = bool(derivatives), bool(keep_grad)
        if not isinstance(autograd, bool):
            raise ValueError(f"autograd: expected True or False, got {autograd!r}")
        if self.keep_grad and not autograd:
            raise ValueError("autograd: False drops what keep_grad=True keeps (the outputs' autograd history)")
        self.autograd = autograd

    def _describe(self, input_spec, output_spec, parameters, outputs):
        """The variables and parameters, from the model loaded on the client (or the artifacts' metadata)."""
        self.input_names = list(input_spec)
        self.output_names = list(output_spec)
        #: Every variable's base shape (``(6,)`` for an ``SR2``, ``()`` for a ``Scalar``), inputs and outputs.
        self.base_shapes = {name: tuple(getattr(kind, "BASE_SHAPE", ())) for spec in (
            input_spec, output_spec) for name, kind in spec.items()}
        self.all_output_names = list(self.output_names)
        if outputs is not None:
            unknown = [o for o in outputs if o not in self.output_names]
            if unknown:
                raise ValueError(f"outputs: {unknown} are not outputs of {self.model!r} (it has {self.output_names})")
            self.output_names = list(outputs)
        #: The parameters as set on this object (:meth:`set_parameter`), sent with every call.
        self.parameters = ParameterValues(parameters)
        self._token = uuid.uuid4().hex  # this model's identity in every process (its padded sizes)
        self._per_thread = PerThread(self._build)
        self._probe_engines = PerThread(functools.partial(self._build, eager=True))
        self._probes = {}  # what a one-item call returned, per operation, kind and shapes of inputs (see _probe)
        self._operations = {}  # (operation, params) -> Operation, kept so that like calls reuse their dispatcher
        self._checked = set()  # (client, scheduler) pairs whose devices were checked against the artifacts

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_probes"], state["_operations"], state["_checked"] = {}, {}, set()  # the client's, for the client
        return state

    #: dispatch() hands the inputs over as they are (NumPy stays NumPy on a GPU chunk): this model
    #: moves them to its torch device itself, so CuPy is never needed.
    moves_inputs = True
    #: ``__call__`` takes ``out=``: the rows its values go to (a driver's last step in host memory computes there).
    computes_into = True

    def _build(self, device, eager=False):
        """This thread's engine on ``device`` (a probe's: eager, on the client)."""
        torch_device = backends.torch_device(device)
        if self.artifacts is not None:
            from neml2.aoti import AOTIModel

            return ArtifactEngine(AOTIModel(str(self.artifacts.root), device=str(torch_device),
                                            dtype=self.artifacts.dtype))
        model = _load(self.input, self.model, self.overrides).to(device=torch_device)
        if self.compile is None or eager:
            return NativeEngine(model)
        into = ValuesInto(model.forward, self.compile)  # the forward before neml2.compile replaces it
        _import_neml2().compile(model, **self.compile)
        return NativeEngine(model, compiled=True, into=into)

    # --- parameters ------------------------------------------------------------------

    def named_parameters(self) -> dict:
        """``{qualified name: tensor}``: the parameters as the next call will use them (NEML2's names).

        The tensors are this object's: change them in place (``.fill_(...)``,
        ``.copy_(...)``, an optimizer's step) or with :meth:`set_parameter`;
        every device's copy takes the values at the next call. Not through
        ``.data`` or a NumPy view of them: torch does not count those as
        changes, and the next call would not see them. An artifact's parameters are those
        promoted at export.
        """
        return dict(self.parameters.values)

    def set_parameter(self, name, value) -> None:
        """Set parameter ``name`` (a key of :meth:`named_parameters`) to ``value``, for every device from the next
        call on. A ValueError for an unknown name or a value of another shape."""
        self.parameters.set(name, value)

    @property
    def parameter_base_shapes(self) -> dict:
        """``{name: shape}`` of every parameter."""
        return {name: tuple(value.shape) for name, value in self.parameters.values.items()}

    @staticmethod
    def compiled_graphs(client=None) -> dict:
        """Graphs ``torch.compile`` has built, per process: ``{worker address: count}`` on ``client``'s workers,
        ``{"client": count}`` in this process too (sync mode and in-process workers compile here)."""
        counts = {"client": compiled_graphs()}
        if client is not None:
            counts.update(client.run(compiled_graphs))
        return counts

    # --- one chunk -----------------------------------------------------------------

    def check_inputs(self, inputs) -> None:
        """A ``ValueError`` naming missing or unknown variables of ``inputs`` (a mapping)."""
        missing = [n for n in self.input_names if n not in inputs]
        unknown = [n for n in inputs if n not in self.input_names]
        if missing or unknown:
            raise ValueError(
                f"inputs: {self.model!r} takes {self.input_names}; "
                + "; ".join(part for part in (missing and f"missing {missing}", unknown and f"unknown {unknown}") if part)
            )

    def __call__(self, inputs, *, out=None):
        """Evaluate one chunk: ``inputs`` maps every input variable to an array or a number.

        A number goes to every point and every component of its variable; a
        NumPy array of a tensor variable without a batch needs a leading axis
        of 1 (``(1, 6)`` for an ``SR2``), since NumPy cannot tell a ``(6,)``
        tensor from six points. The parameters are this object's. ``out``
        (``{output: rows}``, every output of the model, NumPy float64 of the
        chunk's points) is where NumPy values may be computed: a compiled model
        without ``autograd`` computes them there, and a model with ``block``
        writes each block's there; the result is then ``out`` itself.
        """
        return self._evaluate_entries(self._default_operation, inputs, out=out)

    @property
    def _default_operation(self):
        return "jacobian" if self.derivatives else "values"

    def _evaluate_entries(self, operation, entries, params=None, *, sent=False, probe=False, out=None):
        """``operation`` on a chunk's entries (inputs, tangents or cotangents, parameters: see
        :mod:`~dsched.models.neml2_surface`). ``sent``: the entries carry the parameters (a call's), else they are
        this object's. ``probe``: evaluated eagerly, on the client. ``out``: the chunk's output rows, which a
        compiled model's values are computed into where they fit (then returned)."""
        import torch

        inputs, parameters, tangents, cotangents = split_entries(entries)
        if not sent:
            parameters = self.parameters.changed()
        self.check_inputs(inputs)
        device = backends.torch_device()
        engine = (self._probe_engines if probe else self._per_thread).get()  # gives this thread its torch threads
        kind = kind_of(inputs.values())
        state = {name: as_neml2_value(value, engine.input_spec[name], device, torch) for name, value in inputs.items()}
        extra = {}
        if operation == "jvp":
            extra = {name: as_neml2_value(value, engine.input_spec[name], device, torch)
                     for name, value in tangents.items()}
        elif operation == "param_vjp":  # every output has a cotangent: zero where none was given
            extra = {name: as_neml2_value(cotangents.get(name, 0.0), kind_, device, torch)
                     for name, kind_ in engine.output_spec.items()}
        # NumPy's, not torch's: torch.broadcast_shapes imports torch._refs on its first call (a second, per worker)
        batch = np.broadcast_shapes(*(tuple(value.dynamic_batch_shape) for value in (*state.values(), *extra.values())))
        engine.use_parameters(parameters)
        neml2 = _import_neml2()
        recording = self.autograd or operation != "values"  # derivatives need the record whatever the option
        # NumPy values and rows to hold them: a compiled engine computes them there (ValuesInto) when nothing is
        # recorded, and the values of a chunk evaluated in blocks are written there block by block. An eager
        # model called once per chunk has no use for them: its rows are not looked at on every call.
        takes_rows = (engine.into is not None and not recording) or self.block is not None
        into = None if operation != "values" or kind != "numpy" or self.keep_grad or not takes_rows \
            else rows_to_compute_into(out, {name: self.base_shapes[name] for name in self.all_output_names}, batch)
        try:
            with contextlib.nullcontext() if recording else torch.no_grad():
                values, second = evaluate(
                    engine, operation, state, extra, params, batch=batch, device=device, block=self.block,
                    sizes=padded_sizes((self._token, str(device))) if engine.compiled else None,
                    outputs=self.output_names, allocate=numpy_storage if kind == "numpy" else None,
                    keep_grad=self.keep_grad, into=into)
        except neml2.solvers.ConvergenceError as err:
            raise NEML2ConvergenceError(f"NEML2 model {self.model!r} ({self.input.name}): {err}") from None
        if into is not None and values is into:  # computed in the chunk's output rows: nothing to convert
            return into
        return self._results(operation, values, second, batch, kind)

    def _results(self, operation, values, second, batch, kind):
        returned = functools.partial(self._returned, kind=kind)
        if operation == "param_vjp":
            return {name: returned(grad) for name, grad in second.items()}
        outputs = {name: returned(backends.NEML2.expanded(values[name], batch)) for name in self.output_names}
        if operation == "values":
            return outputs
        if operation == "jvp":
            return outputs, {name: returned(backends.NEML2.expanded(second[name], batch)) for name in self.output_names}
        return outputs, {out: {x: returned(block) for x, block in second[out].items()} for out in self.output_names}

    def _returned(self, value, kind):
        if not self.keep_grad:
            value = backends.detach(value)
        if kind == "neml2":
            return value
        if kind == "torch":
            return value.data
        return backends.host_view(backends.to_host(value.data))

    # --- the outputs' layout, learned on the client ------------------------------------

    @property
    def probe_outputs(self):
        """What :func:`dsched.dispatch` calls on the client to learn the outputs' layout (one item).

        NEML2's floor per call is paid once per operation, input kind and
        shapes: the outputs of that first one-item call are kept and returned
        again, so a solver calling :meth:`dispatch` every step does not run
        NEML2 on the client every step (263 ms for chaboche2). The probe is
        eager (a compiled model is not compiled on the client); an artifact
        without a ``cpu`` leaf is not probed (its first chunks send their
        results back instead).
        """
        return self._prober(self._default_operation, None)

    def _prober(self, operation, params):
        if self.artifacts is not None and not self.artifacts.has_leaf("cpu"):
            return False
        return functools.partial(self._probe, operation, params)

    def _probe(self, operation, params, entries):
        key = (operation, params, kind_of(entries.values()),
               tuple(sorted((name, tuple(np.shape(v))[1:]) for name, v in entries.items() if backends.is_array(v))))
        result = self._probes.get(key)
        if result is None:
            result = self._probes[key] = self._evaluate_entries(operation, entries, params, sent=True, probe=True)
        return result

    # --- over a scheduler: NEML2's sensitivity surface -------------------------------

    def _operation(self, operation, params=None) -> Operation:
        key = (operation, params)
        if key not in self._operations:
            self._operations[key] = Operation(self, operation, params)
        return self._operations[key]

    def _prepare(self, operation, inputs, scheduler, options, *, tangents=(), params=()):
        """Every check of a call, before any work: names, and the artifacts' devices and derivatives."""
        self.check_inputs(inputs)
        if self.artifacts is None:
            return
        self.artifacts.check_operation(operation, self.output_names, list(tangents) or self.input_names,
                                       list(params or self.parameters.names()))
        client, mode = options.get("client"), options.get("mode", "async")
        key = (id(client), id(scheduler), mode)
        if key in self._checked:
            return
        emulated = {}
        if mode != "sync":
            client = client or _default_client()
            emulated = emulated_devices(client) if client is not None else {}
        self.artifacts.check_devices(getattr(scheduler, "devices", ()), emulated)
        self._checked.add(key)

    def _params(self, params):
        if params is None:
            return None
        params = tuple(params)
        check_names(params, self.parameters.names(), "params", "parameters of this model")
        return params

    def dispatch(self, inputs, *, scheduler, **options):
        """:func:`dsched.dispatch` of this model over ``inputs``: the outputs (and with ``derivatives`` the
        Jacobian), its variable names checked first."""
        return self._dispatch(self._default_operation, inputs, {}, None, scheduler, options)

    def jacobian(self, inputs, *, scheduler, **options):
        """``(outputs, {output: {input: block}})`` over ``inputs``: each block ``(batch, *output base, *input base)``,
        joined along the batch."""
        return self._dispatch("jacobian", inputs, {}, None, scheduler, options)

    def jvp(self, inputs, tangents, *, scheduler, **options):
        """``(outputs, {output: directional derivative})``: the Jacobian times ``tangents`` (``{input: array}``, an
        input without one counts as zero), per point, joined along the batch."""
        check_names(tangents, self.input_names, "tangents", "inputs of this model")
        return self._dispatch("jvp", inputs, prefixed(TANGENT, tangents), None, scheduler, options, tangents=tangents)

    def param_jacobian(self, inputs, params=None, *, scheduler, **options):
        """``(outputs, {output: {parameter: block}})``: each block ``(batch, *output base, *parameter shape)``,
        per point, joined along the batch. ``params``: the parameters (default all)."""
        params = self._params(params)
        return self._dispatch("param_jacobian", inputs, {}, params, scheduler, options)

    def param_vjp(self, inputs, cotangents, params=None, *, scheduler, client=None, mode="async", timeout=None,
                  trace_file=None):
        """``{parameter: dL/dparameter}`` for ``L = sum over outputs of <cotangent, output>``.

        ``cotangents`` maps outputs to arrays shaped like them (an output
        without one counts as zero). Each chunk's gradient is NEML2's
        ``param_vjp`` on its points; the chunks' are summed in chunk order,
        whatever order they finished in, so a call gives the same bits every
        time. ``params``: the parameters (default all).
        """
        check_names(cotangents, self.all_output_names, "cotangents", "outputs of this model")
        params = self._params(params)
        options = {"client": client, "mode": mode}
        self._prepare("param_vjp", inputs, scheduler, options, params=params or ())
        entries = {**inputs, **prefixed(COTANGENT, cotangents), **self.parameters.entries()}
        dispatcher = WorkDispatcher(scheduler, ChunkOfOperation(self._operation("param_vjp", params)),
                                    reduce=ordered_sum, mode=mode, client=client, timeout=timeout,
                                    trace_file=trace_file)
        with dispatcher:
            grads = dispatcher.run(MappingLoader(entries))
        # NumPy sums 0-d arrays into scalars: every gradient comes back an array, whatever the number of chunks.
        return {name: np.asarray(g) if isinstance(g, np.generic) else g for name, g in grads.items()}

    def _dispatch(self, operation, inputs, extra, params, scheduler, options, *, tangents=()):
        self._prepare(operation, inputs, scheduler, options, tangents=tangents, params=params or ())
        entries = {**inputs, **extra, **self.parameters.entries()}
        return dispatch(self._operation(operation, params), entries, scheduler=scheduler, **options)

    def __repr__(self):
        if self.artifacts is not None:
            return f"NEML2Model.from_artifacts({str(self.input)!r})"
        return f"NEML2Model({str(self.input)!r}, {self.model!r})"


def _default_client():
    try:
        from distributed import default_client

        return default_client()
    except (ImportError, ValueError):
        return None
