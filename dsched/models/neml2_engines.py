"""What evaluates a :class:`~dsched.models.NEML2Model`'s chunks on one worker thread and device.

Two engines, one interface (``run(operation, state, extra, params)``) over
NEML2's whole sensitivity surface (:data:`OPERATIONS`):

- :class:`NativeEngine`: NEML2's own model, loaded from its input file,
  eager or compiled in place with ``neml2.compile`` (``torch.compile``, one
  graph per distinct input shape: :mod:`dsched.models.row_blocks` pads the
  chunks so a device sees few);
- :class:`ArtifactEngine`: an AOTI artifact exported with
  ``neml2.export_model_for_aoti``, its ``<device>/<dtype>`` leaf loaded by
  ``neml2.aoti.AOTIModel``.

Parameters reach an engine through :meth:`use_parameters` before each call
(see :mod:`dsched.models.neml2_parameters`): a native model sets them on its
own copy (NEML2's ``set_parameter``), an artifact passes them per call
(``param_overrides``), so neither keeps a value the client no longer sends.

A compiled native engine also writes values straight into arrays it is
given (:class:`ValuesInto`): a chunk's output rows in shared memory, so that
a compiled model's results are never copied after they are computed.

Compilations are counted by torch's own counter: :func:`compiled_graphs`
is the number of graphs ``torch.compile`` has built in this process.
"""

from __future__ import annotations

import sys

__all__ = ["OPERATIONS", "NativeEngine", "ArtifactEngine", "ValuesInto", "compile_options", "compiled_graphs"]

#: NEML2's sensitivity surface, as its multi-device ``DispatchedModel`` chunks it.
OPERATIONS = ("values", "jacobian", "jvp", "param_jacobian", "param_vjp")


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` built in this process so far (torch's ``unique_graphs`` counter; 0 before any)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def _blocks(jacobian, batch_ndim):
    """Raw ``{out: {x: tensor}}`` blocks as NEML2's dynamic-base ``Tensor`` (as its ``jacobian`` returns them)."""
    from neml2.types import Tensor

    return {out: {x: Tensor(block, batch_ndim) for x, block in row.items()} for out, row in jacobian.items()}


def compile_options(compile):
    """``neml2.compile``'s keywords for ``compile`` (``None``: not compiled); a ValueError naming the field."""
    if compile is False or compile is None:
        return None
    if compile is True:
        return {}
    if isinstance(compile, str):
        return {"mode": compile}
    if isinstance(compile, dict) and all(isinstance(k, str) for k in compile) and "dynamic" not in compile:
        return dict(compile)
    raise ValueError(f"compile: expected True, False, a torch.compile mode or a dict of torch.compile options "
                     f"(but dynamic, which neml2.compile fixes), got {compile!r}")


class ValuesInto:
    """A compiled model's values computed into arrays given: its forward and the copy into them in one
    ``torch.compile`` graph.

    Inductor then stores each result where the copy would have put it (the
    chunk's output rows), so the values are written once, by the model's own
    kernels, instead of computed into fresh memory and copied after: for a
    cheap model (linear elasticity) the copy cost as much as the model.
    ``forward`` is the model's own, before ``neml2.compile`` replaced it;
    ``options`` are ``neml2.compile``'s keywords (``dynamic`` fixed off, as
    there).
    """

    def __init__(self, forward, options):
        import torch

        def values_into(args, outs):
            result = forward(*args)
            for out, value in zip(outs, result if isinstance(result, tuple) else (result,)):
                out.copy_(value.data)  # an unbatched value broadcasts over the rows

        self._compiled = torch.compile(values_into, **{"fullgraph": False, **options, "dynamic": False})

    def __call__(self, args, outs) -> None:
        """Write the values of ``args`` (the inputs, typed, in the model's order) into ``outs`` (tensors, in the
        outputs' order), gradients off."""
        self._compiled(tuple(args), tuple(outs))


class NativeEngine:
    """NEML2's own model on one device, eager or compiled (``compiled``: chunks are padded to few sizes; ``into``:
    its :class:`ValuesInto`)."""

    def __init__(self, model, compiled=False, into=None):
        self.model, self.compiled, self.into = model, bool(compiled), into
        self.input_spec, self.output_spec = dict(model.input_spec), dict(model.output_spec)
        self.defaults = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.row_views = {}  # torch views of output rows it computed into (neml2_evaluate: _row_targets)
        self._applied = {}  # the parameters set to something else than the file's value: name -> value

    def use_parameters(self, wanted) -> None:
        """Make the model's parameters the file's, but for ``wanted`` (``{name: tensor}``)."""
        import torch

        for name in [name for name in self._applied if name not in wanted]:
            self.model.set_parameter(name, self.defaults[name])
            del self._applied[name]
        for name, value in wanted.items():
            held = self._applied.get(name)
            if held is None or not torch.equal(held, value):
                self.model.set_parameter(name, value)  # in place (NEML2 casts to its dtype and device)
                self._applied[name] = value

    def run(self, operation, state, extra, params):
        """NEML2's ``operation`` on ``state`` (typed, by input name): ``(values, second)`` as NEML2 returns them,
        the parameter Jacobian's blocks as dynamic-base ``Tensor``s and its values typed."""
        model = self.model
        if operation == "values":
            return model.call_by_name(state), None
        if operation == "jacobian":
            return model.jacobian(state)
        if operation == "jvp":
            return model.jvp(state, extra)
        if operation == "param_jacobian":
            raw, jacobian = model.param_jacobian(state, params)
            values = {name: self.output_spec[name](value) for name, value in raw.items()}
            batch_ndim = max((len(v.dynamic_batch_shape) for v in values.values()), default=0)
            return values, _blocks(jacobian, batch_ndim)
        if operation == "param_vjp":
            return None, model.param_vjp(state, extra, params)
        raise ValueError(f"operation: expected one of {OPERATIONS}, got {operation!r}")


class ArtifactEngine:
    """An AOTI artifact's leaf for one device and dtype (``neml2.aoti.AOTIModel``): batch sizes are dynamic,
    so no chunk is padded."""

    compiled, into = False, None

    def __init__(self, model):
        self.model, self.inner = model, model._inner
        self.input_spec, self.output_spec = dict(model.input_spec), dict(model.output_spec)
        self.defaults = {name: value.detach().clone() for name, value in self.inner.named_parameters().items()}
        self.row_views = {}  # torch views of output rows its blocks are written into (neml2_evaluate: _row_targets)
        self._overrides = {}

    def use_parameters(self, wanted) -> None:
        self._overrides = {name: value.to(device=self.inner.device, dtype=self.inner.dtype)
                           for name, value in wanted.items()}

    def _raw(self, values, spec, batch):
        """Typed values as the artifact takes them: each at ``(*batch, *base)``, contiguous, its dtype."""
        out = {}
        for name, value in values.items():
            base = tuple(getattr(spec[name], "BASE_SHAPE", ()))
            data = getattr(value, "data", value).to(device=self.inner.device, dtype=self.inner.dtype)
            out[name] = data.expand(*batch, *base).contiguous()
        return out

    def _typed(self, raw):
        return {name: self.output_spec[name](value) for name, value in raw.items()}

    def run(self, operation, state, extra, params):
        import numpy as np

        batch = tuple(np.broadcast_shapes(*(tuple(v.dynamic_batch_shape) for v in state.values())))
        raw, inner, overrides = self._raw(state, self.input_spec, batch), self.inner, self._overrides
        if operation == "values":
            return self._typed(inner.forward(raw, overrides)), None
        if operation == "jacobian":
            values, jacobian = inner.jacobian(raw, overrides)
            return self._typed(values), _blocks(jacobian, len(batch))
        if operation == "jvp":
            values, jvp = inner.jvp(raw, self._raw(extra, self.input_spec, batch), overrides)
            return self._typed(values), self._typed(jvp)
        if operation == "param_jacobian":
            values, jacobian = inner.param_jacobian(raw, overrides)
            wanted = params if params is not None else list(self.defaults)
            return self._typed(values), _blocks(
                {out: {p: row[p] for p in wanted if p in row} for out, row in jacobian.items()}, len(batch))
        if operation == "param_vjp":
            grads = inner.param_vjp(raw, self._raw(extra, self.output_spec, batch), overrides)
            return None, {p: grads[p] for p in (params if params is not None else grads) if p in grads}
        raise ValueError(f"operation: expected one of {OPERATIONS}, got {operation!r}")
