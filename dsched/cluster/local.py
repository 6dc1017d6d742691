"""LocalHybridCluster: a Dask cluster on this machine with one worker per device."""

from __future__ import annotations

import asyncio
import logging
import uuid

from distributed import Nanny, Scheduler, SpecCluster, Worker
from distributed.core import Status

from dsched.checks import check_positive_int
from dsched.cluster.logs import apply_log_level, configured_log_level, spawn_config, worker_preload
from dsched.cluster.placement import DeviceWorkerPlugin, PlacementPlugin
from dsched.dataplane.segments import record_semaphores, sweep_stale_segments
from dsched.devices.cuda import visible_gpus
from dsched.devices.device import EMULATED_RESOURCE, Device, check_capacities, device_resource, parse_devices
from dsched.devices.threads import ThreadLimits, thread_share
from dsched.observe.dashboard import DashboardPlugin, register_page

__all__ = ["LocalHybridCluster"]

_CLOSE_GRACE = 1.0  # seconds a worker has to close before it is left (a thread) or killed (a process)
_RECORD_POLL = 0.01  # seconds between looks for a starting worker process's queues


def _loopback_port0(host: str) -> str:
    """``host`` with a free port, as a Dask HTTP address (IPv6 hosts in brackets)."""
    return f"[{host}]:0" if ":" in host else f"{host}:0"


def _rotated_visible_devices(ordinal: int, present: list[int]) -> str:
    """dask-cuda's pinning: the worker's own GPU first, so it is CuPy's device 0 there."""
    order = present[present.index(ordinal):] + present[: present.index(ordinal)]
    return ",".join(map(str, order))


class LocalHybridCluster(SpecCluster):
    """One Dask worker per device: a CPU worker and one worker per GPU.

    Each worker owns its device through the resource ``dsched-<device>``,
    whose amount is the device's capacity in items: every chunk requests its
    size, so the items executing on a device never exceed it, however many
    clients share the cluster. GPU workers are pinned with
    ``CUDA_VISIBLE_DEVICES`` as dask-cuda does, with dask-cuda's CPU-affinity
    plugin when it is installed. Everything listens on loopback.

    Parameters
    ----------
    devices : list of str or Device, optional
        Defaults to the CPU plus every visible GPU.
    emulate : bool
        Allow CUDA devices that are not present: their workers compute with
        NumPy on the CPU, claim the device, and advertise ``dsched-emulated``.
        For testing placement and capacity only, never for measuring a GPU.
    threads_per_worker : int
        Chunks each device worker runs at once (2: one computes while the
        other's data moves).
    capacities : dict, optional
        ``{device: items}`` the device may execute at once, across all
        clients; unlimited by default (the dispatchers' own capacities and
        the threads then bound it).
    processes : bool, optional
        Workers in their own processes (needed to pin real GPUs). Defaults
        to True exactly when a real GPU is among the devices.
    host : str
        Address to listen on; loopback by default.
    protocol : str, optional
        ``"inproc://"`` for in-process workers (results reach the client
        without a copy), else ``"tcp://"``. Pass ``"tcp://"`` to let clients
        in other processes share an in-process cluster.
    dashboard_address : str
        The dashboard's address, ``None`` for no dashboard.
    silence_logs : str or int, optional
        Level of Dask's logs in the scheduler and every worker (processes
        included); defaults to the Dask config ``dsched.log-level``
        (``"warning"``; ``dsched run -v`` sets ``"info"``). Below INFO, a
        failed chunk's "Compute Failed" log is dropped too: the dispatcher
        raises that error itself.

    Notes
    -----
    Closing the cluster does not wait for chunks that never return (Ctrl-C, or
    a ``ChunkTimeoutError``): each worker gets one second to close, then an
    in-process worker's thread is left running until the process ends, and a
    worker process is killed. A worker process's nanny talks to it through
    named POSIX semaphores (``/dev/shm/sem.mp-*``); they are recorded, so that
    if this process and its resource tracker are killed together the next run
    on the host removes them with dsched's own segments.

    Examples
    --------
    >>> from distributed import Client
    >>> with LocalHybridCluster(["cpu", "cuda:0"], emulate=True) as cluster:  # doctest: +SKIP
    ...     client = Client(cluster)
    """

    def __init__(
        self,
        devices=None,
        *,
        emulate=False,
        threads_per_worker=2,
        capacities=None,
        processes=None,
        host="127.0.0.1",
        protocol=None,
        dashboard_address="127.0.0.1:8787",
        memory_limit="auto",
        scheduler_options=None,
        worker_options=None,
        silence_logs=None,
        asynchronous=False,
        **kwargs,
    ):
        present = [d.ordinal for d in visible_gpus()]
        self.devices = _checked_devices(devices, present)
        check_positive_int(threads_per_worker, "threads_per_worker", integers=int, below=None)
        self.capacities = check_capacities(capacities, self.devices)
        silence_logs = configured_log_level() if silence_logs is None else silence_logs
        apply_log_level(silence_logs)
        self._log_level = silence_logs
        self._dashboard_host = _listen_host(dashboard_address)
        self.emulated = _which_emulated(self.devices, present, emulate)
        if processes is None:
            processes = any(d.is_cuda and not self.emulated[d] for d in self.devices)
        if not processes and sum(d.is_cuda and not self.emulated[d] for d in self.devices) > 0:
            logging.getLogger(__name__).info("real GPUs in one process: each chunk selects its GPU with CuPy")

        if protocol is None:
            protocol = "tcp://" if processes else "inproc://"
        if processes:  # what killed clients and their nannies left (their semaphores) goes first
            sweep_stale_segments()
        self.protocol = protocol
        scheduler = _scheduler_spec(protocol, host, dashboard_address, scheduler_options)
        workers = {
            str(device): self._worker_spec(
                device, threads_per_worker, processes, host, memory_limit, present, worker_options or {}
            )
            for device in self.devices
        }
        import dask

        with dask.config.set(spawn_config(silence_logs)):  # worker processes start at this log level
            super().__init__(
                workers=workers,
                scheduler=scheduler,
                silence_logs=silence_logs,
                asynchronous=asynchronous,
                # Unique: distributed compares clusters by name, and Cluster.get_client() hands out the current
                # client when its cluster "equals" this one, even another cluster's.
                name=f"LocalHybridCluster-{uuid.uuid4().hex[:8]}",
                **kwargs,
            )

    def _worker_spec(self, device, threads, processes, host, memory_limit, present, extra):
        resources = {device_resource(device): self.capacities[device]}
        if self.emulated[device]:
            resources[EMULATED_RESOURCE] = 1
        options = {
            "nthreads": threads,
            "resources": resources,
            "name": str(device),
            "protocol": self.protocol,
            "host": None if self.protocol.startswith("inproc") else host,
            "memory_limit": memory_limit,
            "dashboard": False,
            # The worker's HTTP server (health, metrics) runs even without a dashboard;
            # keep it on loopback too (with inproc:// there is no host to bind it to).
            "dashboard_address": _loopback_port0(host),
            **extra,
        }
        # torch and BLAS threads per worker: this host's cores over all workers' chunk threads.
        limits = ThreadLimits(thread_share(len(self.devices) * threads))
        options["plugins"] = set(options.get("plugins", ())) | {DeviceWorkerPlugin(), limits}
        if not processes:
            return {"cls": Worker, "options": options}
        if device.is_cuda and not self.emulated[device]:
            options["env"] = {"CUDA_VISIBLE_DEVICES": _rotated_visible_devices(device.ordinal, present)}
            options.setdefault("plugins", set()).update(_cuda_worker_plugins(device.ordinal))
        else:
            options["env"] = {"CUDA_VISIBLE_DEVICES": ""}  # CPU and emulated workers must not grab a GPU
        return {"cls": _Nanny, "options": worker_preload(options, self._log_level)}  # the process's own log level

    async def _close(self):
        # The workers first, each given _CLOSE_GRACE seconds: Dask would wait for a chunk that never
        # returns (30 s for an in-process worker's thread, 4 s before it kills a worker process).
        if self.status == Status.running:
            await asyncio.gather(*(_close_now(w) for w in list(self.workers.values())), return_exceptions=True)
        await super()._close()

    @property
    def dashboard_link(self) -> str:
        """The dashboard's URL on the host it listens on (Dask's own guess is the scheduler's host,
        which for in-process clusters is a non-loopback address the dashboard does not listen on)."""
        link = super().dashboard_link
        if not link or self._dashboard_host is None:
            return link
        from distributed.utils import format_dashboard_link

        return format_dashboard_link(self._dashboard_host, self.scheduler_info["services"]["dashboard"])

    @property
    def device_workers(self) -> dict:
        """``{Device: worker name}``; workers are named after their device."""
        return {d: str(d) for d in self.devices}

    def __repr__(self):
        parts = ", ".join(f"{d}{' (emulated)' if self.emulated[d] else ''}" for d in self.devices)
        return f"LocalHybridCluster({parts}, scheduler={self.scheduler_address!r})"


async def _close_now(worker):
    """Close ``worker`` without waiting for its chunks: a thread that is stuck is left, a process killed."""
    if worker.status != Status.running:  # closed or closing already (a nanny closed by hand, say)
        return
    if not isinstance(worker, Nanny):
        await worker.close(timeout=_CLOSE_GRACE, executor_wait=False, nanny=False, reason="cluster-close")
        return
    worker.close_gracefully(reason="cluster-close")  # its worker process is not restarted when it ends
    if worker.process is not None:
        await worker.process.kill(timeout=_CLOSE_GRACE, executor_wait=False, reason="cluster-close")
    await worker.close(timeout=_CLOSE_GRACE, reason="cluster-close")


class _Nanny(Nanny):
    """A nanny that lists its worker process's semaphores for the sweep of ``/dev/shm``.

    Its two queues to the worker process are six named POSIX semaphores, which
    only this process's resource tracker unlinks if this process is killed.
    Listed (:func:`~dsched.dataplane.segments.record_semaphores`) as soon as they
    are made, at each start of the worker process, they are removed by the next
    run on the host when the tracker was killed too.
    """

    async def instantiate(self):
        recording = asyncio.ensure_future(self._record_when_made())
        try:
            return await super().instantiate()
        finally:
            recording.cancel()
            self._record()

    async def _record_when_made(self):
        while not self._record():
            await asyncio.sleep(_RECORD_POLL)

    def _record(self) -> bool:
        names = _queue_semaphores(self.process)
        record_semaphores(id(self), names)
        return bool(names)

    async def close(self, *args, **kwargs):
        try:
            return await super().close(*args, **kwargs)
        finally:
            record_semaphores(id(self), [])  # unlinked with the worker process's queues


def _queue_semaphores(process) -> list:
    """The names (``mp-...``) of the semaphores of a nanny's queues to its worker process; none if not started,
    or if a release of Python lays queues out otherwise."""
    names = []
    for queue in (getattr(process, "init_result_q", None), getattr(process, "child_stop_q", None)):
        for lock in (getattr(queue, "_rlock", None), getattr(queue, "_wlock", None), getattr(queue, "_sem", None)):
            name = getattr(getattr(lock, "_semlock", None), "name", None)
            if name:
                names.append(name.lstrip("/"))
    return names


def _listen_host(address):
    """The host of ``"host:port"`` when it names one (not every interface), else ``None``."""
    if address is None:
        return None
    host = str(address).rpartition(":")[0].strip("[]")
    return None if host in ("", "0.0.0.0", "::") else host


def _checked_devices(devices, present) -> list:
    """The cluster's devices: ``devices`` parsed, or the CPU and every visible GPU (``present``: their ordinals)."""
    devices = parse_devices([Device("cpu")] + [Device(f"cuda:{i}") for i in present] if devices is None else devices)
    if not devices:
        raise ValueError("devices: at least one device is required, got none")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: duplicate device in {[str(d) for d in devices]}")
    return devices


def _which_emulated(devices, present, emulate) -> dict:
    """``{device: whether it is emulated}``: a CUDA device not present is, given ``emulate``; else a ValueError."""
    emulated = {}
    for device in devices:
        missing = device.is_cuda and device.ordinal not in present
        if missing and not emulate:
            raise ValueError(
                f"devices: {device} is not present on this machine (visible GPUs: "
                f"{', '.join(f'cuda:{i}' for i in present) or 'none'}); to rehearse without it (for testing, not "
                f"measuring), emulate it: LocalHybridCluster({[str(d) for d in devices]}, emulate=True), and pass "
                "that cluster's Client to dispatch(client=...) or WorkDispatcher(client=...)"
            )
        emulated[device] = missing
    return emulated


def _scheduler_spec(protocol, host, dashboard_address, scheduler_options) -> dict:
    """The scheduler's spec: on loopback (or in-process), with dsched's plugins (the dashboard page's if it has one)."""
    scheduler = {
        "cls": Scheduler,
        "options": {
            "protocol": protocol,
            "host": None if protocol.startswith("inproc") else host,
            # Without a dashboard the scheduler still serves its HTTP routes (health,
            # metrics), by default on every interface at 8787: keep it on loopback.
            "dashboard_address": dashboard_address if dashboard_address is not None else _loopback_port0(host),
            "dashboard": dashboard_address is not None,
            **(scheduler_options or {}),
        },
    }
    # Pin planned blocks (dsched.map_blocks) without the user calling dsched.register.
    scheduler["options"]["plugins"] = [*scheduler["options"].get("plugins", ()), PlacementPlugin()]
    if dashboard_address is not None:
        # The dsched page of the dashboard: listed before the scheduler builds its dashboard.

        register_page()
        options = scheduler["options"]
        options["plugins"] = [*options.get("plugins", ()), DashboardPlugin()]
    return scheduler


def _cuda_worker_plugins(ordinal: int) -> set:
    """dask-cuda's CPU-affinity plugin for a GPU worker, when dask-cuda is installed."""
    try:
        from dask_cuda.plugins import CPUAffinity
        from dask_cuda.utils import get_cpu_affinity

        return {CPUAffinity(get_cpu_affinity(ordinal))}
    except Exception:  # not installed, or no NVML: affinity is an optimisation, not a need
        return set()
