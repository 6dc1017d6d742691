"""dsched: spread one large batch of independent model evaluations over CPUs and GPUs, on Dask.

Examples
--------
>>> import numpy as np, dsched
>>> s = dsched.StaticHybridScheduler(["cpu"], batch_sizes=4)
>>> dsched.dispatch(np.sqrt, np.arange(10.0), scheduler=s, mode="sync").shape
(10,)
"""

from .array import as_batched, map_blocks, plan
from .backends import torch_device
from .batch import Batch
from .cluster import LocalHybridCluster
from .devices import Device, array_module, current_device, visible_gpus
from .dispatch import WorkDispatcher, dispatch
from .outputs import ChunkResultError
from .report import ChunkRecord, RunReport
from .errors import AggregateError, ChunkTimeoutError, DispatchError, RecoverableError
from .per_thread import PerThread
from .placement import PlacementWarning, register
from .reduce import concat_reduce, derivative_reduce
from .store import shared_copy, shared_empty
from .schedulers import (DeviceStatus, PerformanceModelScheduler, SimpleMPIScheduler, SimpleScheduler,
                         StaticHybridScheduler, WorkScheduler)
from .work import ArrayLoader, MappingLoader, SliceGenerator, WorkGenerator

__version__ = "0.1.0"

__all__ = [
    "Device", "current_device", "visible_gpus", "array_module", "torch_device",
    "WorkScheduler", "DeviceStatus", "SimpleScheduler", "StaticHybridScheduler", "SimpleMPIScheduler",
    "PerformanceModelScheduler",
    "WorkGenerator", "SliceGenerator", "ArrayLoader", "MappingLoader",
    "concat_reduce", "derivative_reduce",
    "WorkDispatcher", "dispatch", "shared_empty", "shared_copy", "ChunkRecord", "RunReport",
    "DispatchError", "RecoverableError", "AggregateError", "ChunkTimeoutError", "ChunkResultError",
    "LocalHybridCluster", "PerThread",
    "plan", "as_batched", "map_blocks", "register", "PlacementWarning",
    "Batch",
]
