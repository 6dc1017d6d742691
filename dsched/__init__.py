"""dsched: spread one large batch of independent model evaluations over CPUs and GPUs, on Dask.

Examples
--------
>>> import numpy as np, dsched
>>> s = dsched.StaticHybridScheduler(["cpu"], batch_sizes=4)
>>> dsched.dispatch(np.sqrt, np.arange(10.0), scheduler=s, mode="sync").shape
(10,)
"""

from dsched import legacy

legacy.install()  # old module paths (dsched.feed, dsched.mpi, ...) keep working

from dsched.blocks import as_batched, map_blocks, plan
from dsched.cluster.local import LocalHybridCluster
from dsched.cluster.placement import PlacementWarning, register
from dsched.dataplane.loaders import ArrayLoader, MappingLoader, SliceGenerator, WorkGenerator
from dsched.dataplane.outputs import ChunkResultError
from dsched.dataplane.store import shared_copy, shared_empty
from dsched.devices import Device, array_module, current_device, torch_device, visible_gpus
from dsched.devices.per_thread import PerThread
from dsched.dispatch import DispatchFuture, WorkDispatcher, dispatch, submit
from dsched.dataplane.reduce import concat_reduce, derivative_reduce
from dsched.errors import AggregateError, ChunkTimeoutError, DispatchError, RecoverableError
from dsched.observe.collect import RunReports, run_reports
from dsched.models.fe_material import FEMaterial
from dsched.observe.hooks import RunObserver
from dsched.observe.report import ChunkRecord, RunReport
from dsched.resident.batch import Batch
from dsched.resident.driver import TransientDriver
from dsched.resident.trial import TrialState
from dsched.schedulers import (
    BalancedScheduler,
    DeviceStatus,
    PerformanceModelScheduler,
    SimpleMPIScheduler,
    SimpleScheduler,
    StaticHybridScheduler,
    WorkScheduler,
)

__version__ = "0.1.0"

__all__ = [
    "Device", "current_device", "visible_gpus", "array_module", "torch_device",
    "WorkScheduler", "DeviceStatus", "SimpleScheduler", "StaticHybridScheduler", "SimpleMPIScheduler",
    "PerformanceModelScheduler", "BalancedScheduler",
    "WorkGenerator", "SliceGenerator", "ArrayLoader", "MappingLoader",
    "concat_reduce", "derivative_reduce",
    "WorkDispatcher", "dispatch", "submit", "DispatchFuture", "shared_empty", "shared_copy", "ChunkRecord",
    "RunReport", "RunObserver", "run_reports", "RunReports",
    "DispatchError", "RecoverableError", "AggregateError", "ChunkTimeoutError", "ChunkResultError",
    "LocalHybridCluster", "PerThread",
    "plan", "as_batched", "map_blocks", "register", "PlacementWarning",
    "Batch", "TransientDriver", "TrialState", "FEMaterial",
]


def __getattr__(name):
    """``dsched.array``, ``dsched.logs``, ...: an old module path read as an attribute is imported on first use."""
    return legacy.module_attribute(name)
