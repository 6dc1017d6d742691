"""Devices and their names: ``cpu``, ``cuda``, ``cuda:N``, and the Dask resource that owns each.

A :class:`Device` is ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``.
A Dask worker *owns* a device when it advertises the resource
``device_resource(device)`` (``"dsched-cuda:0"`` and so on); its amount is
the device's capacity in items. Emulated CUDA workers also advertise
``EMULATED_RESOURCE``. A chunk of ``m`` items requests ``m`` of its device's
resource, so it runs on an owning worker and nowhere else, and the items
executing on a device never exceed its capacity.
"""

from __future__ import annotations

import re

from dsched.checks import check_positive_int
from dsched.names import EMULATED_RESOURCE, RESOURCE_PREFIX

__all__ = ["Device", "parse_device", "parse_devices", "placement_device", "device_resource", "device_entries", "check_capacities",
           "device_of_resources", "EMULATED_RESOURCE", "RESOURCE_PREFIX", "UNLIMITED_CAPACITY"]

# Canonical spellings only (ASCII digits, no leading zeros, no spaces), so that
# equal devices have equal strings and a Device hashes like its string.
_PATTERN = re.compile(r"(cpu|cuda)(?::(0|[1-9][0-9]*))?", re.ASCII)
# A worker's amount of its device resource is the device's capacity in items;
# this stands for "no limit beyond the worker's threads".
UNLIMITED_CAPACITY = 10**15


class Device:
    """A compute device: ``Device("cpu")``, ``Device("cuda")`` or ``Device("cuda:1")``.

    Examples
    --------
    >>> d = Device("cuda:1")
    >>> d.type, d.index, str(d)
    ('cuda', 1, 'cuda:1')
    >>> Device(d) == Device("cuda:1")
    True
    """

    __slots__ = ("type", "index", "_name", "_hash")

    def __init__(self, spec):
        # Devices are made and compared for every chunk: a spelling is parsed once, and the canonical
        # name and its hash are kept.
        if spec.__class__ is Device:
            self.type, self.index, self._name, self._hash = spec.type, spec.index, spec._name, spec._hash
            return
        parsed = _parsed.get(spec) if isinstance(spec, str) else None
        if parsed is None:
            parsed = _parse(spec)
        self.type, self.index, self._name, self._hash = parsed

    def __str__(self):
        return self._name

    def __repr__(self):
        return f"Device({self._name!r})"

    def __eq__(self, other):
        if other.__class__ is Device:
            return self._name == other._name
        if isinstance(other, str):
            try:
                other = Device(other)
            except ValueError:
                return NotImplemented
        if not isinstance(other, Device):
            return NotImplemented
        return self._name == other._name

    def __hash__(self):
        return self._hash  # equal to its canonical string's, so it must hash like it

    def __reduce__(self):
        return (Device, (str(self),))

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def ordinal(self) -> int:
        """The CUDA index, a bare ``cuda`` meaning device 0 (as CuPy and PyTorch do)."""
        return 0 if self.index is None else self.index


_parsed = {}  # spelling -> (type, index, canonical name, hash), for the spellings seen


def _parse(spec) -> tuple:
    if not isinstance(spec, (str, Device)):
        raise ValueError(f"device: expected a string like 'cpu' or 'cuda:0', got {spec!r}")
    if isinstance(spec, Device):  # a subclass
        return spec.type, spec.index, spec._name, spec._hash
    match = _PATTERN.fullmatch(spec)
    if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
        raise ValueError(f"device: {spec!r} is not a device; expected 'cpu', 'cuda' or 'cuda:N' with N >= 0")
    kind = match.group(1)
    index = int(match.group(2)) if match.group(2) is not None else None
    name = kind if index is None else f"{kind}:{index}"
    if len(_parsed) < 1024:  # canonical spellings only match: few of them
        _parsed[spec] = (kind, index, name, hash(name))
    return kind, index, name, hash(name)


def parse_device(spec, field="device") -> Device:
    """``Device(spec)``, its error naming ``field`` once.

    Examples
    --------
    >>> parse_device("cuda0", "devices[1]")
    Traceback (most recent call last):
    ...
    ValueError: devices[1]: 'cuda0' is not a device; expected 'cpu', 'cuda' or 'cuda:N' with N >= 0
    """
    try:
        return Device(spec)
    except ValueError as err:
        raise ValueError(f"{field}: {str(err).removeprefix('device: ')}") from None


def parse_devices(devices, field="devices") -> list[Device]:
    """Turn a list of device specs into Devices, rejecting a bare ``cuda`` next to ``cuda:N``."""
    if isinstance(devices, (str, Device)):
        devices = [devices]
    parsed = [parse_device(d, field) for d in devices]
    bare = any(d.is_cuda and d.index is None for d in parsed)
    indexed = [str(d) for d in parsed if d.is_cuda and d.index is not None]
    if bare and indexed:
        raise ValueError(
            f"{field}: a bare 'cuda' next to {', '.join(indexed)} is ambiguous (it could alias one of them)"
        )
    return parsed


def placement_device(device) -> Device:
    """The device a chunk is placed on: a bare ``cuda`` means ``cuda:0``."""
    device = Device(device)
    return Device(f"cuda:{device.ordinal}") if device.is_cuda else device


def device_resource(device) -> str:
    """The Dask resource a worker advertises to own ``device``.

    Examples
    --------
    >>> device_resource("cuda")
    'dsched-cuda:0'
    """
    return f"{RESOURCE_PREFIX}{placement_device(device)}"


def device_entries(mapping, devices, field, among="the devices"):
    """``(Device, value)`` for each entry of a ``{device: value}`` mapping.

    Raises ValueError naming ``field`` for a key that is not a device, or not
    one of ``devices``.
    """
    devices = [Device(d) for d in devices]
    for key, value in mapping.items():
        device = parse_device(key, field)
        if device not in devices:
            raise ValueError(f"{field}: {device} is not one of {among} {[str(d) for d in devices]}")
        yield device, value


def check_capacities(capacities, devices) -> dict:
    """``{Device: items}`` for every device: the given capacities, the rest unlimited.

    Raises ValueError naming the entry for a device not in ``devices`` or a
    capacity that is not an integer >= 1.
    """
    result = {Device(d): UNLIMITED_CAPACITY for d in devices}
    for device, value in device_entries(capacities or {}, devices, "capacities"):
        result[device] = check_positive_int(value, f"capacities[{str(device)!r}]", below=None)
    return result


def device_of_resources(resources) -> Device | None:
    """The device a worker owns, read from its resources (``None`` if it owns none)."""
    for name in resources or ():
        if name.startswith(RESOURCE_PREFIX) and name != EMULATED_RESOURCE:
            return Device(name[len(RESOURCE_PREFIX):])
    return None
