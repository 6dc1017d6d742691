"""Devices: naming, discovery, and the array module that computes on each.

A :class:`Device` is ``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``.
A Dask worker *owns* a device when it advertises the resource
``device_resource(device)`` (``"dsched-cuda:0"`` and so on); its amount is
the device's capacity in items. Emulated CUDA workers also advertise
``EMULATED_RESOURCE``. A chunk of ``m`` items requests ``m`` of its device's
resource, so it runs on an owning worker and nowhere else, and the items
executing on a device never exceed its capacity.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re

import numpy as np

__all__ = [
    "Device",
    "current_device",
    "visible_gpus",
    "array_module",
    "to_device",
    "to_host",
    "device_resource",
    "EMULATED_RESOURCE",
]

logger = logging.getLogger(__name__)

# Canonical spellings only (ASCII digits, no leading zeros, no spaces), so that
# equal devices have equal strings and a Device hashes like its string.
_PATTERN = re.compile(r"(cpu|cuda)(?::(0|[1-9][0-9]*))?", re.ASCII)
RESOURCE_PREFIX = "dsched-"
EMULATED_RESOURCE = "dsched-emulated"
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

    __slots__ = ("type", "index")

    def __init__(self, spec):
        if isinstance(spec, Device):
            self.type, self.index = spec.type, spec.index
            return
        if not isinstance(spec, str):
            raise ValueError(f"device: expected a string like 'cpu' or 'cuda:0', got {spec!r}")
        match = _PATTERN.fullmatch(spec)
        if match is None or (match.group(1) == "cpu" and match.group(2) is not None):
            raise ValueError(
                f"device: {spec!r} is not a device; expected 'cpu', 'cuda' or 'cuda:N' with N >= 0"
            )
        self.type = match.group(1)
        self.index = int(match.group(2)) if match.group(2) is not None else None

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self):
        return f"Device({str(self)!r})"

    def __eq__(self, other):
        if isinstance(other, str):
            try:
                other = Device(other)
            except ValueError:
                return NotImplemented
        if not isinstance(other, Device):
            return NotImplemented
        return (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash(str(self))  # equal to its canonical string, so it must hash like it

    def __reduce__(self):
        return (Device, (str(self),))

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    @property
    def ordinal(self) -> int:
        """The CUDA index, a bare ``cuda`` meaning device 0 (as CuPy and PyTorch do)."""
        return 0 if self.index is None else self.index


def parse_devices(devices, field="devices") -> list[Device]:
    """Turn a list of device specs into Devices, rejecting a bare ``cuda`` next to ``cuda:N``."""
    if isinstance(devices, (str, Device)):
        devices = [devices]
    try:
        parsed = [Device(d) for d in devices]
    except ValueError as err:
        raise ValueError(f"{field}: {err}") from None
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
        try:
            device = Device(key)
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from None
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
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"capacities[{str(device)!r}]: expected an integer >= 1, got {value!r}")
        result[device] = int(value)
    return result


def device_of_resources(resources) -> Device | None:
    """The device a worker owns, read from its resources (``None`` if it owns none)."""
    for name in resources or ():
        if name.startswith(RESOURCE_PREFIX) and name != EMULATED_RESOURCE:
            return Device(name[len(RESOURCE_PREFIX):])
    return None


def emulated_devices(client) -> dict:
    """``{Device: emulated?}`` for the devices a cluster's workers own, read from their resources.

    A Device hashes like its string, so ``table.get("cuda:0")`` works too.
    """
    from .ownership import cluster_info  # ownership builds on this module

    table = {}
    for info in cluster_info(client)["workers"].values():
        device = device_of_resources(info.get("resources"))
        if device is not None:
            table[device] = table.get(device, False) or EMULATED_RESOURCE in info["resources"]
    return table


# --- where code is running -------------------------------------------------

_chunk_device: contextvars.ContextVar[Device | None] = contextvars.ContextVar(
    "dsched_chunk_device", default=None
)


@contextlib.contextmanager
def running_on(device):
    """Mark the code inside as a chunk placed on ``device`` (read by :func:`current_device`)."""
    token = _chunk_device.set(None if device is None else Device(device))
    try:
        yield
    finally:
        _chunk_device.reset(token)


def current_device() -> Device | None:
    """The device the running chunk was placed on.

    In any other task on a worker that owns a device, that worker's device;
    elsewhere ``None``.
    """
    device = _chunk_device.get()
    if device is not None:
        return device
    worker = _current_worker()
    return None if worker is None else worker_device(worker)


def _current_worker():
    try:
        from distributed import get_worker

        return get_worker()
    except (ImportError, ValueError):
        return None


def worker_device(worker) -> Device | None:
    """The device a Dask worker owns, or ``None``."""
    return device_of_resources(worker.state.total_resources)


def worker_is_emulated(worker) -> bool:
    return EMULATED_RESOURCE in (worker.state.total_resources or {})


def is_emulated_here() -> bool:
    """Whether the code runs on an emulated CUDA worker (which computes with NumPy).

    Also true for a chunk placed on a device that :func:`emulating` marks (sync runs).
    """
    device = _chunk_device.get()
    if device is not None and device in _emulated_here.get():
        return True
    worker = _current_worker()
    return worker is not None and worker_is_emulated(worker)


_emulated_here: contextvars.ContextVar[frozenset] = contextvars.ContextVar("dsched_emulated_here", default=frozenset())


@contextlib.contextmanager
def emulating(devices):
    """Emulate ``devices`` on this thread: chunks placed on them compute with NumPy.

    Sync-mode runs have no worker to advertise emulation, so a sync run over
    CUDA devices this machine lacks marks them here. For testing only.
    """
    token = _emulated_here.set(_emulated_here.get() | {Device(d) for d in devices})
    try:
        yield
    finally:
        _emulated_here.reset(token)


# --- discovery and array modules -------------------------------------------

def visible_gpus() -> list[Device]:
    """The CUDA devices this process can see, through CuPy or NVML; none if neither is installed."""
    count = 0
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no CuPy, no driver, or no device: all mean "none visible"
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                count = min(count, len([v for v in visible.split(",") if v.strip()]))
        except Exception:
            count = 0
    return [Device(f"cuda:{i}") for i in range(count)]


def cuda_local_ordinal(device) -> int:
    """The CuPy device number of ``device`` in this process.

    Workers pinned through ``CUDA_VISIBLE_DEVICES`` see their GPU under
    another number (dask-cuda rotates the list so it is 0); entries may be
    indices or GPU/MIG UUIDs (resolved with :func:`visible_physical_indices`).
    """
    device = Device(device)
    physical = visible_physical_indices()
    if physical is not None and device.ordinal in physical:
        return physical.index(device.ordinal)
    return device.ordinal


# --- CUDA_VISIBLE_DEVICES --------------------------------------------------------
#
# CUDA reads the variable as a comma-separated list of GPU indices, GPU UUIDs
# ("GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", or a unique prefix of one) or MIG
# UUIDs ("MIG-<uuid>", or before driver R470 "MIG-GPU-<uuid>/<gi>/<ci>"), and
# stops at the first entry it cannot read. dask-cuda and schedulers such as Slurm
# write UUIDs; a device named "cuda:N" here is NVML's (physical) index N.

_INDEX = re.compile(r"[0-9]+")
_UUID_BODY = r"[0-9a-fA-F][0-9a-fA-F-]*"
_GPU_UUID = re.compile(rf"GPU-{_UUID_BODY}")
_MIG_UUID = re.compile(rf"MIG-{_UUID_BODY}")
_MIG_LEGACY = re.compile(rf"MIG-(GPU-{_UUID_BODY})/([0-9]+)/([0-9]+)")


def parse_visible_devices(value):
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value, as CUDA reads them.

    Returns ``None`` when the variable is unset (every GPU visible), else a
    list of ``("index", int)``, ``("gpu", uuid)`` or ``("mig", uuid)``,
    ending before the first entry CUDA would not accept (so ``""`` or
    ``"-1"`` is an empty list: no GPU). A legacy MIG entry
    ``MIG-GPU-<uuid>/<gi>/<ci>`` is ``("mig", "MIG-GPU-<uuid>/<gi>/<ci>")``.

    Examples
    --------
    >>> parse_visible_devices("1, GPU-8932f937-d72c, MIG-4b0e5b6a-5a0c-5f7e")
    [('index', 1), ('gpu', 'GPU-8932f937-d72c'), ('mig', 'MIG-4b0e5b6a-5a0c-5f7e')]
    >>> parse_visible_devices("0,-1,2")
    [('index', 0)]
    """
    if value is None:
        return None
    entries = []
    for raw in value.split(","):
        entry = raw.strip()
        if _INDEX.fullmatch(entry):
            entries.append(("index", int(entry)))
        elif _MIG_LEGACY.fullmatch(entry) or _MIG_UUID.fullmatch(entry):
            entries.append(("mig", entry))
        elif _GPU_UUID.fullmatch(entry):
            entries.append(("gpu", entry))
        else:
            break  # CUDA ignores this entry and every one after it
    return entries


def match_visible_entry(entry, inventory):
    """The physical index of one parsed entry, given the GPUs present.

    ``inventory`` lists ``(index, gpu_uuid, [mig_uuids])`` for every GPU (as
    :func:`_nvml_inventory` reads it). A GPU UUID matches by prefix, as CUDA
    allows, and must match exactly one GPU; a MIG UUID resolves to the GPU
    holding that instance. Returns ``None`` when nothing (or more than one
    GPU) matches.
    """
    kind, value = entry
    if kind == "index":
        return value if any(index == value for index, _, _ in inventory) else None
    if kind == "mig":
        legacy = _MIG_LEGACY.fullmatch(value)
        if legacy:
            kind, value = "gpu", legacy.group(1)  # the parent GPU's UUID, written out
        else:
            owners = [index for index, _, migs in inventory if value.lower() in (m.lower() for m in migs)]
            return owners[0] if len(owners) == 1 else None
    owners = [index for index, uuid, _ in inventory if uuid.lower().startswith(value.lower())]
    return owners[0] if len(owners) == 1 else None


def visible_physical_indices(value=None, inventory=None):
    """NVML's (physical) index of every GPU ``CUDA_VISIBLE_DEVICES`` shows, in CUDA's order.

    ``None`` when the variable is unset. Index entries need no lookup; UUIDs
    are resolved through NVML (``inventory`` defaults to what NVML reports,
    read only when a UUID needs it). An entry that cannot be resolved (no
    NVML, an unknown UUID) ends the list there, with a log warning.
    """
    value = os.environ.get("CUDA_VISIBLE_DEVICES") if value is None else value
    entries = parse_visible_devices(value)
    if entries is None:
        return None
    indices = []
    for entry in entries:
        if entry[0] == "index":
            indices.append(entry[1])
            continue
        if inventory is None:
            inventory = _nvml_inventory()
        index = match_visible_entry(entry, inventory) if inventory is not None else None
        if index is None:
            logger.warning("dsched: CUDA_VISIBLE_DEVICES entry %r does not resolve to one GPU%s", entry[1],
                           "" if inventory is not None else " (NVML is not available to read the UUIDs)")
            break
        indices.append(index)
    return indices


def _nvml_inventory():
    """``[(index, gpu_uuid, [mig_uuids])]`` for every GPU, from NVML; ``None`` without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, no driver: nothing to read
        return None
    try:
        inventory = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            inventory.append((index, _text(pynvml.nvmlDeviceGetUUID(handle)), _mig_uuids(pynvml, handle)))
        return inventory
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _mig_uuids(pynvml, handle) -> list:
    try:
        count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except Exception:  # not a MIG-capable GPU, or MIG disabled
        return []
    uuids = []
    for slot in range(count):
        try:
            uuids.append(_text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot))))
        except Exception:
            continue  # an empty slot
    return uuids


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def first_visible_gpu():
    """The GPU a worker pinned through ``CUDA_VISIBLE_DEVICES`` owns: its first entry, resolved.

    ``None`` when the variable is unset or names no GPU that resolves (then
    the caller decides: dask-cuda's first GPU is device 0).
    """
    indices = visible_physical_indices()
    return Device(f"cuda:{indices[0]}") if indices else None


@contextlib.contextmanager
def selected(device):
    """Make ``device`` CuPy's current GPU inside the block (CuPy's current device is per thread).

    A no-op for the CPU, an emulated device, or where CuPy is not installed.
    """
    device = None if device is None else Device(device)
    cupy = None
    if device is not None and device.is_cuda and not is_emulated_here():
        try:
            import cupy
        except ImportError:
            pass
    if cupy is None:
        yield
        return
    with cupy.cuda.Device(cuda_local_ordinal(device)):
        yield


def array_module(device=None):
    """NumPy for the CPU and emulated devices, CuPy for a real CUDA device.

    Examples
    --------
    >>> array_module("cpu").__name__
    'numpy'
    """
    device = current_device() if device is None else Device(device)
    if device is None or device.type == "cpu" or is_emulated_here():
        return np
    try:
        import cupy
    except ImportError:
        raise RuntimeError(
            f"device {device}: computing on a CUDA device needs CuPy (pip install 'dsched[cuda12]'); "
            "on a machine without a GPU, run on an emulated device (LocalHybridCluster(emulate=True))"
        ) from None
    return cupy


def to_device(x, device=None, keep_grad=False):
    """Copy an array, or a tuple/list/dict of them, to ``device``'s memory.

    A thin wrapper over :func:`dsched.backends.to_device`: NumPy arrays become
    CuPy arrays on a real GPU, torch and NEML2 tensors move to
    :func:`dsched.backends.torch_device`; autograd is detached unless ``keep_grad``.
    """
    from . import backends  # backends imports this module

    return backends.to_device(x, device, keep_grad=keep_grad)


def to_host(x, keep_grad=False):
    """Copy an array (or a container of them) back to host memory: CuPy gives NumPy, tensors stay tensors.

    A thin wrapper over :func:`dsched.backends.to_host`.
    """
    from . import backends

    return backends.to_host(x, keep_grad=keep_grad)
