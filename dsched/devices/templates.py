"""How a template travels: a small description of an empty torch tensor or NEML2 typed wrapper, rebuilt once.

A chunk whose inputs or outputs are torch tensors or NEML2's typed tensors
carries, with the references to its rows, a :func:`~dsched.devices.backends.template`
of each: an empty tensor of its type, from which the worker rebuilds the rows
as the user's type. Torch pickles even an empty tensor through its storage
machinery (about 30 us to write and 45 us to read, per input and output of
every chunk); :func:`pack_template` describes it in a tuple instead (1 us each
way), and :func:`unpack_template` rebuilds one template per description and
process.
"""

from __future__ import annotations

import dataclasses
import sys

from dsched.devices.backends import NEML2

__all__ = ["pack_template", "unpack_template", "TEMPLATES_KEPT"]


_TEMPLATES = {}  # what pack_template made of a template -> the template rebuilt, this process
TEMPLATES_KEPT = 1024


class _Packed(tuple):
    """A template's description (:func:`pack_template`): a tuple, told apart from any other value."""

    __slots__ = ()


def pack_template(x):
    """A template as it travels with each chunk: an empty torch tensor, or a NEML2 typed wrapper of one, as a
    small description (type, dtype, shape, device, the wrapper's fields); anything else as it is.

    Examples
    --------
    >>> import torch                                                  # doctest: +SKIP
    >>> pack_template(torch.empty((0, 6), dtype=torch.float64))      # doctest: +SKIP
    ('torch', 'float64', (0, 6), 'cpu')
    """
    if "torch" not in sys.modules:
        return x
    import torch

    if isinstance(x, torch.Tensor):
        if x.numel() or x.requires_grad or type(x) is not torch.Tensor:
            return x
        return _Packed(("torch", str(x.dtype).removeprefix("torch."), tuple(x.shape), str(x.device)))
    if NEML2.owns(x) and dataclasses.is_dataclass(x) and not hasattr(x, "batch_ndim"):  # SR2, Scalar...
        data = pack_template(x.data)
        if isinstance(data, _Packed):
            fields = tuple((f.name, getattr(x, f.name)) for f in dataclasses.fields(x) if f.name != "data")
            try:
                hash(fields)  # the rebuilt templates are looked up by description
            except TypeError:
                return x
            return _Packed(("neml2", type(x), data, fields))
    return x


def unpack_template(packed):
    """The template :func:`pack_template` described (one per description and process), or ``packed`` itself."""
    if not isinstance(packed, _Packed):
        return packed
    template = _TEMPLATES.get(packed)
    if template is None:
        import torch

        if packed[0] == "torch":
            _, dtype, shape, device = packed
            template = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        else:
            _, kind, data, fields = packed
            template = kind(unpack_template(data), **dict(fields))
        if len(_TEMPLATES) >= TEMPLATES_KEPT:  # a long-lived worker of many shapes: start again
            _TEMPLATES.clear()
        template = _TEMPLATES.setdefault(packed, template)
    return template
