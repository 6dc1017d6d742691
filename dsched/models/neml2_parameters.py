"""A NEML2 model's calibration parameters as its caller sets them, sent with every call to every device's copy.

NEML2's ``Model.set_parameter`` and ``named_parameters`` change one model
object. A :class:`~dsched.models.NEML2Model` has a copy per worker thread
and device, built where its chunks run, so a change made on the client
must travel. :class:`ParameterValues` holds the values the caller set; every
call sends the ones that differ from the file's (or the artifact's) as entries
of its inputs, one item long, which dsched passes whole to every chunk. The copy
that runs a chunk sets them before evaluating, and puts back the file's value
of any it no longer receives. So the copies agree with the client at every
call, however many workers hold one, and a model whose parameters were never
changed sends nothing.

>>> import torch
>>> values = ParameterValues({"E": torch.tensor(200e3, dtype=torch.float64)})
>>> values.set("E", 210e3)
>>> {name: float(v) for name, v in values.changed().items()}
{'E': 210000.0}
>>> sorted(values.entries())
['@parameter:E']
"""

from __future__ import annotations

__all__ = ["ParameterValues", "PARAMETER", "parameter_entries", "split_parameters"]

PARAMETER = "@parameter:"  # the prefix of a parameter's entry among a call's inputs (no NEML2 variable has an @)


class ParameterValues:
    """The parameters of a model: their values as the caller set them, and the file's.

    Parameters
    ----------
    defaults : dict
        ``{qualified name: torch tensor}``: the values the model loads with
        (on the CPU). They are copied; the copies are the caller's to change.
    """

    def __init__(self, defaults):
        self.defaults = {name: value.detach().cpu().clone() for name, value in defaults.items()}
        self.values = {name: value.clone() for name, value in self.defaults.items()}
        self._known = None  # (each value's version and storage, the changed ones then): changed() compares once

    def __getstate__(self):
        # A worker needs only the values set: it has the file's own (or builds them), and the defaults would
        # double what travels with a model.
        return {"defaults": {}, "values": self.changed()}

    def __setstate__(self, state):
        self.defaults, self.values = state["defaults"], state["values"]
        self._known = None

    def names(self) -> list:
        return list(self.values)

    def check_name(self, name, field="name") -> str:
        if name not in self.values:
            known = ", ".join(self.values) if self.values else "none"
            raise ValueError(f"{field}: {name!r} is not a parameter of this model (its parameters: {known})")
        return name

    def set(self, name, value) -> None:
        """Set ``name`` to ``value`` (a number or a tensor of the parameter's shape); a ValueError before anything
        changes otherwise."""
        import torch

        self.check_name(name)
        current = self.values[name]
        try:
            new = torch.as_tensor(value, dtype=current.dtype).detach().cpu()
            fits = tuple(torch.broadcast_shapes(new.shape, current.shape)) == tuple(current.shape)
        except (TypeError, ValueError, RuntimeError):
            fits = False
        if not fits:
            shape = tuple(getattr(value, "shape", ()))
            raise ValueError(f"value: {name!r} takes a number or a tensor of shape {tuple(current.shape)}, got "
                             f"{type(value).__name__} of shape {shape} (a value per point is an input, not a "
                             "parameter)")
        with torch.no_grad():
            current.copy_(new)

    def changed(self) -> dict:
        """``{name: value}`` of the parameters whose value differs from the file's."""
        import torch

        if not self.defaults:  # a worker's copy: it holds only what was changed
            return dict(self.values)
        # A value changes in place (set(), fill_, copy_, an optimizer's step: each bumps its version) or has its
        # .data replaced (a new storage): compared with the file's again only then, not at every call.
        stamp = tuple((value._version, value.data_ptr()) for value in self.values.values())
        if self._known is None or self._known[0] != stamp:
            self._known = (stamp, {name: value for name, value in self.values.items()
                                   if not torch.equal(value, self.defaults[name])})
        return dict(self._known[1])

    def entries(self) -> dict:
        """The changed parameters as entries of a call's inputs: ``{PARAMETER + name: value[None]}``.

        One item long along the batch axis, so every chunk receives each whole.
        """
        return parameter_entries(self.changed())


def parameter_entries(values) -> dict:
    """``{PARAMETER + name: value[None]}``: parameters as entries of a call's inputs, each passed whole to every chunk."""
    return {PARAMETER + name: value.unsqueeze(0) for name, value in values.items()}


def split_parameters(entries):
    """``(inputs, parameters)`` from a chunk's entries: the parameters' own values (the leading item axis dropped),
    ``None`` when the call sent none."""
    if not any(key.startswith(PARAMETER) for key in entries):
        return entries, None
    inputs, parameters = {}, {}
    for key, value in entries.items():
        if key.startswith(PARAMETER):
            parameters[key[len(PARAMETER):]] = _torch_of(value)[0]
        else:
            inputs[key] = value
    return inputs, parameters


def _torch_of(value):
    import numpy as np
    import torch

    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return getattr(value, "data", value) if not isinstance(value, torch.Tensor) else value
