"""The worker side of dsched's Prometheus metrics: a GPU worker's device memory, through NVML, on the worker's ``/metrics``.

A Dask worker serves its own ``/metrics`` from ``prometheus_client``'s default
registry of its process. The scheduler's dashboard plugin registers
:class:`WorkerMetricsPlugin` on every worker, present and future
(:func:`add_to_workers`); in each worker process it registers one collector,
which at scrape time exports, for every worker of the process owning a real
(not emulated) CUDA device, labelled ``device`` and ``host`` as the
scheduler's families are:

- ``dsched_gpu_memory_used_bytes``: the GPU's memory in use (by every process
  on it, as NVML counts it);
- ``dsched_gpu_memory_total_bytes``: the GPU's memory.

NVML is read through ``pynvml`` (dask-cuda brings it), with ``cuda:N`` as
NVML's physical index ``N``, dsched's naming whatever the worker's
``CUDA_VISIBLE_DEVICES``. Where NVML is missing (no ``pynvml``, no driver, no
GPU), or ``prometheus_client`` is, there is no family and no error. Workers
in the scheduler's process (an in-process cluster) share its registry, so
there these families are on the scheduler's ``/metrics`` too.
"""

from __future__ import annotations

import logging
import threading
import weakref

from distributed.diagnostics.plugin import WorkerPlugin

from dsched.devices.device import device_of_resources
from dsched.names import EMULATED_RESOURCE, WORKER_METRICS_PLUGIN
from dsched.observe.report import worker_host

__all__ = ["WorkerMetricsPlugin", "WORKER_METRICS_PLUGIN", "add_to_workers", "gpu_memory", "gpu_rows"]

logger = logging.getLogger(__name__)


_lock = threading.Lock()
_workers = weakref.WeakSet()  # the workers of this process that have the plugin
_state = {"registered": False, "nvml": None}  # nvml: None (not tried yet), False (missing) or the module


class WorkerMetricsPlugin(WorkerPlugin):
    """Adds its worker to the process's GPU-memory collector (registered once per process)."""

    name = WORKER_METRICS_PLUGIN
    idempotent = True

    def setup(self, worker):
        try:
            import prometheus_client
        except ImportError:  # the scheduler warns; a worker without it just exports nothing
            logger.debug("dsched: no prometheus_client on worker %s: no GPU memory metrics", worker.address)
            return
        with _lock:
            _workers.add(worker)
            if not _state["registered"]:
                prometheus_client.REGISTRY.register(_GpuCollector())
                _state["registered"] = True

    def teardown(self, worker):
        with _lock:
            _workers.discard(worker)


async def add_to_workers(scheduler) -> None:
    """Register :class:`WorkerMetricsPlugin` on ``scheduler``'s workers, now and later (idempotent)."""
    if WORKER_METRICS_PLUGIN in scheduler.worker_plugins:
        return
    from distributed.protocol.pickle import dumps

    await scheduler.register_worker_plugin(None, dumps(WorkerMetricsPlugin()), WORKER_METRICS_PLUGIN, idempotent=True)


def _nvml():
    """``pynvml``, initialised once per process, or ``None`` where NVML cannot be had."""
    with _lock:
        if _state["nvml"] is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _state["nvml"] = pynvml
            except Exception:  # no pynvml, no driver, no GPU: all mean no NVML
                _state["nvml"] = False
        return _state["nvml"] or None


def gpu_memory(index: int) -> tuple[int, int] | None:
    """``(used, total)`` bytes of the GPU NVML numbers ``index``, or ``None`` without NVML (or that GPU)."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
    except Exception:  # not a GPU of this machine
        return None
    return int(info.used), int(info.total)


def gpu_rows(workers=None) -> dict:
    """``{(device, host): (used, total)}`` for the real CUDA devices the workers (this process's) own."""
    if workers is None:
        with _lock:
            workers = list(_workers)
    rows = {}
    for worker in workers:
        resources = getattr(worker.state, "total_resources", None) or {}
        device = device_of_resources(resources)
        if device is None or not device.is_cuda or EMULATED_RESOURCE in resources:
            continue
        key = (str(device), worker_host(worker.address))
        if key not in rows:  # workers sharing a GPU: one row
            memory = gpu_memory(device.ordinal)
            if memory is not None:
                rows[key] = memory
    return rows


class _GpuCollector:
    """The worker process's collector of GPU memory (no family at all without a GPU row)."""

    def describe(self):
        return []

    def collect(self):
        try:
            rows = gpu_rows()
        except Exception:  # never break the worker's /metrics (Dask's own families are there too)
            logger.exception("dsched: could not read the GPU memory for /metrics")
            return
        if not rows:
            return
        from prometheus_client.core import GaugeMetricFamily

        used = GaugeMetricFamily("dsched_gpu_memory_used_bytes", "Memory in use on the worker's GPU (NVML)",
                                 labels=["device", "host"])
        total = GaugeMetricFamily("dsched_gpu_memory_total_bytes", "Memory of the worker's GPU (NVML)",
                                  labels=["device", "host"])
        for (device, host), (in_use, size) in sorted(rows.items()):
            used.add_metric([device, host], in_use)
            total.add_metric([device, host], size)
        yield used
        yield total
