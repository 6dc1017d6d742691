"""Scheduling policies: which device takes the next chunk, and how big it is."""

from .base import DeviceStatus, WorkScheduler
from .hybrid import StaticHybridScheduler
from .mpi import SimpleMPIScheduler
from .simple import SimpleScheduler

__all__ = ["WorkScheduler", "DeviceStatus", "SimpleScheduler", "StaticHybridScheduler", "SimpleMPIScheduler"]
