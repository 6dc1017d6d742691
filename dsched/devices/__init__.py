"""Devices: their names, where code runs, CUDA discovery, array backends, and which workers own them.

==================  ==========================================================
module              holds
==================  ==========================================================
``device``          :class:`Device` and its Dask resource (``dsched-cuda:0``)
``context``         the device of the running chunk or worker; emulation
``cuda``            the GPUs this process sees; ``CUDA_VISIBLE_DEVICES``
``backends``        NumPy, CuPy, torch and NEML2 arrays behind one interface
``ownership``       which workers of a cluster own which devices
``threads``         compute threads per worker (torch, BLAS)
``per_thread``      a model built once per worker thread and device
==================  ==========================================================
"""

from dsched.devices.backends import array_module, to_device, to_host, torch_device
from dsched.devices.context import (
                                    current_device,
                                    emulating,
                                    is_emulated_here,
                                    running_on,
                                    selected,
                                    worker_device,
                                    worker_is_emulated,
)
from dsched.devices.cuda import (
                                    cuda_local_ordinal,
                                    first_visible_gpu,
                                    match_visible_entry,
                                    parse_visible_devices,
                                    visible_gpus,
                                    visible_physical_indices,
)
from dsched.devices.device import (
                                    EMULATED_RESOURCE,
                                    RESOURCE_PREFIX,
                                    UNLIMITED_CAPACITY,
                                    Device,
                                    check_capacities,
                                    device_entries,
                                    device_of_resources,
                                    device_resource,
                                    parse_devices,
                                    placement_device,
)
from dsched.devices.ownership import emulated_devices

__all__ = [
    "Device", "parse_devices", "placement_device", "device_resource", "device_entries", "check_capacities",
    "device_of_resources", "EMULATED_RESOURCE", "RESOURCE_PREFIX", "UNLIMITED_CAPACITY",
    "current_device", "running_on", "emulating", "is_emulated_here", "selected", "worker_device",
    "worker_is_emulated",
    "visible_gpus", "cuda_local_ordinal", "parse_visible_devices", "match_visible_entry", "visible_physical_indices",
    "first_visible_gpu",
    "array_module", "to_device", "to_host", "torch_device", "emulated_devices",
]
