"""Scheduling policies: which device takes the next chunk, and how big it is."""

from dsched.schedulers.balanced import BalancedScheduler
from dsched.schedulers.base import DeviceStatus, WorkScheduler
from dsched.schedulers.hybrid import StaticHybridScheduler
from dsched.schedulers.model import PerformanceModelScheduler
from dsched.schedulers.mpi import SimpleMPIScheduler
from dsched.schedulers.simple import SimpleScheduler

__all__ = ["WorkScheduler", "DeviceStatus", "SimpleScheduler", "StaticHybridScheduler", "SimpleMPIScheduler",
           "PerformanceModelScheduler", "BalancedScheduler"]
