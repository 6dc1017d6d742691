"""Scheduling policies: which device takes the next chunk, and how big it is."""

from .base import DeviceStatus, WorkScheduler
from .hybrid import StaticHybridScheduler
from .model import PerformanceModelScheduler
from .mpi import SimpleMPIScheduler
from .simple import SimpleScheduler

__all__ = ["WorkScheduler", "DeviceStatus", "SimpleScheduler", "StaticHybridScheduler", "SimpleMPIScheduler",
           "PerformanceModelScheduler"]
