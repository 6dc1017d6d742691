"""CUDA discovery: the GPUs this process sees, and ``CUDA_VISIBLE_DEVICES`` as CUDA reads it."""

from __future__ import annotations

import logging
import os
import re

from dsched.devices.device import Device

__all__ = ["visible_gpus", "cuda_local_ordinal", "parse_visible_devices", "match_visible_entry",
           "visible_physical_indices", "first_visible_gpu"]

logger = logging.getLogger(__name__)


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
