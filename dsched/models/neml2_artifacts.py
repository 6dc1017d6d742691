"""NEML2's AOTI artifacts: a root folder per model, one leaf per device and dtype, checked before any work.

``neml2.export_model_for_aoti(input, model, root, device=..., dtype=...)``
writes one shared ``root/metadata.json`` (the variables, the parameters
promoted to runtime values, the derivative graphs compiled in) and the
compiled graphs of one ``root/<device>/<dtype>/`` leaf; export once per
device kind to fill the others. ``neml2.aoti.AOTIModel(root, device, dtype)``
loads one leaf. :class:`Artifacts` reads the metadata on the client, so a
:class:`~dsched.models.NEML2Model` built from it knows its variables before
any worker loads a leaf, and says, before any work starts, which device of a
run has no leaf (:meth:`Artifacts.check_devices`) or which derivative was
not compiled in (:meth:`Artifacts.check_operation`).

A CPU worker, and an emulated ``cuda`` worker (which computes on the CPU),
load the ``cpu`` leaf; a real ``cuda:N`` worker loads the ``cuda`` leaf.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsched.devices.device import Device

__all__ = ["Artifacts", "DTYPES"]

DTYPES = ("float64", "float32")


class Artifacts:
    """The metadata of an artifact root, and the leaves it holds.

    Parameters
    ----------
    root : str or path
        The folder ``neml2.export_model_for_aoti`` wrote (``metadata.json`` and
        ``<device>/<dtype>/`` leaves).
    dtype : str
        The leaves to load: ``"float64"`` (NEML2's default) or ``"float32"``.
    """

    def __init__(self, root, dtype="float64"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
        self.root, self.dtype = Path(root).resolve(), dtype
        path = self.root / "metadata.json"
        if not path.is_file():
            raise ValueError(f"root: no NEML2 artifact at {root} (no metadata.json; write one with "
                             "neml2.export_model_for_aoti)")
        try:
            meta = json.loads(path.read_text())
            aliases = meta.get("boundary_aliases", {})
            self.inputs = _variables(meta["inputs"], aliases.get("inputs", {}))
            self.outputs = _variables(meta["outputs"], aliases.get("outputs", {}))
            renamed = aliases.get("parameters", {})
            #: ``{name: (shape, values)}`` of the parameters promoted to runtime values.
            self.parameters = {renamed.get(p["name"], p["name"]): (tuple(p["shape"]), list(p["values"]))
                               for p in meta.get("parameters", [])}
            self.derivatives = {(out, x) for out, x in meta.get("derivatives", [])}
            self.parameter_derivatives = {(out, renamed.get(p, p)) for out, p in meta.get("parameter_derivatives", [])}
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"root: {path} is not NEML2 artifact metadata ({type(err).__name__}: {err})") from None
        self._leaves = sorted(f"{leaf.parent.name}/{leaf.name}" for leaf in self.root.glob("*/*")
                              if leaf.is_dir() and any(leaf.glob("*.pt2")))
        if not self._leaves:
            raise ValueError(f"root: {self.root} holds no compiled leaf (<device>/<dtype>/ with .pt2 files)")

    def leaves(self) -> list:
        """The ``"<device>/<dtype>"`` leaves present (with compiled graphs in them) when the root was read, sorted."""
        return list(self._leaves)

    @staticmethod
    def leaf_device(device, emulated=False) -> str:
        """The leaf's device folder for a dsched device: ``cpu``, or ``cuda`` for a real GPU."""
        device = Device(device)
        return "cpu" if device.type == "cpu" or emulated else "cuda"

    def has_leaf(self, folder) -> bool:
        return f"{folder}/{self.dtype}" in self.leaves()

    def check_devices(self, devices, emulated=None) -> None:
        """A ValueError naming the first of ``devices`` whose leaf is missing (``emulated``: ``{Device: bool}``)."""
        emulated = emulated or {}
        present = self.leaves()
        for device in devices:
            folder = self.leaf_device(device, emulated.get(Device(device), False))
            if f"{folder}/{self.dtype}" not in present:
                raise ValueError(
                    f"devices: {device} has no artifact: no {folder}/{self.dtype} leaf under {self.root} (it has "
                    f"{', '.join(present)}); export one with neml2.export_model_for_aoti(..., device='{folder}', "
                    f"dtype='{self.dtype}')")

    def check_operation(self, operation, outputs, inputs=(), params=()) -> None:
        """A ValueError naming a derivative ``operation`` needs that the artifact was not compiled with."""
        if operation in ("jacobian", "jvp"):
            wanted, have, flag = [(o, x) for o in outputs for x in inputs], self.derivatives, "OUT:IN"
        elif operation in ("param_jacobian", "param_vjp"):
            wanted, have, flag = [(o, p) for o in outputs for p in params], self.parameter_derivatives, "OUT:PARAM"
        else:
            return
        if not any(pair in have for pair in wanted):
            raise ValueError(f"{operation}: the artifact under {self.root} has none of these derivatives compiled in "
                             f"(it has {sorted(have) or 'none'}); export with derivatives=['{flag}', ...]"
                             + (" and the parameters promoted" if flag == "OUT:PARAM" else ""))


def _variables(infos, alias) -> dict:
    """``{name: NEML2 type name}`` of a metadata variable list, by the names the artifact's boundary uses."""
    return {alias.get(info["name"], info["name"]): info["var_type"] for info in infos}
