"""Which rank of an ``mpiexec`` job owns which device, and the layout of the cluster that results.

The planning half of :mod:`dsched.cluster.mpi`: it checks the devices, gives
the k-th worker rank of each node that node's ``devices[k]`` (collectively, so
that every rank raises the same error), refuses loopback across hosts, makes
each worker's Dask options, and describes a cluster's device workers as
:class:`WorkerPlacement` records and as a table (:func:`cluster_layout`,
:func:`format_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dsched.devices.cuda import visible_gpus
from dsched.devices.device import (
    EMULATED_RESOURCE,
    UNLIMITED_CAPACITY,
    Device,
    device_of_resources,
    device_resource,
    parse_devices,
)
from dsched.devices.ownership import cluster_info
from dsched.schedulers.mpi import NodePlacement, check_ranks_fit, place_on_nodes

__all__ = ["WorkerPlacement", "cluster_layout", "format_layout"]


@dataclass(frozen=True)
class WorkerPlacement:
    """One rank of the job: its host, rank and role, and for a worker its device."""

    host: str
    rank: int
    role: str  # "scheduler", "client" or "worker"
    device: str | None = None
    capacity: int | None = None
    emulated: bool = False
    name: str | None = None


# --- planning: which rank owns which device ----------------------------------

def _check_devices(devices) -> list[Device]:
    devices = parse_devices(devices)
    if not devices:
        raise ValueError("devices: at least one device is required, got none")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: duplicate device in {[str(d) for d in devices]}")
    cpus = [str(d) for d in devices if d.type == "cpu"]
    if len(cpus) > 1:
        raise ValueError(f"devices: more than one CPU ({', '.join(cpus)})")
    return devices


def _default_devices() -> list[Device]:
    return [Device("cpu")] + visible_gpus()


def _plan_rank(role, placement: NodePlacement, devices, capacities, emulate, multi_node) -> tuple[WorkerPlacement, str | None]:
    """This rank's placement, and the reason it cannot start (or ``None``)."""
    if role != "worker":
        return WorkerPlacement(placement.host, placement.rank, role), None
    device = devices[placement.local_rank]
    emulated = False
    if device.is_cuda:
        present = [d.ordinal for d in visible_gpus()]
        if device.ordinal not in present:
            if not emulate:
                shown = ", ".join(f"cuda:{i}" for i in present) or "none"
                return WorkerPlacement(placement.host, placement.rank, role, str(device)), (
                    f"devices: {device} is not present on host {placement.host!r} (rank {placement.rank}; "
                    f"visible GPUs: {shown}); pass emulate=True (--emulate) to emulate it"
                )
            emulated = True
    name = f"{device}@{placement.host}" if multi_node else str(device)
    return WorkerPlacement(placement.host, placement.rank, role, str(device), capacities[device], emulated, name), None


def _plan(comm, roles, devices, capacities, emulate, interface=None) -> tuple[list[WorkerPlacement], WorkerPlacement]:
    """Collective: every rank's placement, the same on all ranks; raises the same error on all ranks."""
    rank = comm.Get_rank()
    role = roles(rank)
    placement = place_on_nodes(comm, participate=role == "worker")
    # Every rank sees every node, so all raise this together and none hangs in a collective.
    check_ranks_fit(placement, devices, what="Dask worker ranks",
                    hint="each worker rank owns one device, so start at most {n} worker ranks per node or list more devices")
    worker_nodes = [host for host, ranks in placement.nodes.items() if ranks]
    mine, problem = _plan_rank(role, placement, devices, capacities, emulate, len(worker_nodes) > 1)
    if interface is not None and _is_loopback(interface):  # collective: every rank calls it, whatever its problem
        across_hosts = _loopback_across_hosts(comm, interface)
        problem = problem or across_hosts
    everyone = comm.allgather((mine, problem))
    problems = [p for _, p in everyone if p is not None]
    if problems:
        raise ValueError(problems[0])
    return [p for p, _ in everyone], mine


def _is_loopback(interface) -> bool:
    from distributed.utils import get_ip_interface

    try:
        return get_ip_interface(interface).startswith("127.")
    except ValueError:
        return False  # Dask names the unknown interface itself when it binds


def _loopback_across_hosts(comm, interface) -> str | None:
    """Collective: why loopback cannot work here (ranks on several real hosts), or ``None``.

    Real host names, not ``$DSCHED_NODE_NAME``: fake nodes on one machine share loopback.
    """
    import socket

    hosts = list(dict.fromkeys(comm.allgather(socket.gethostname())))
    if len(hosts) < 2:
        return None
    return (f"--interface: {interface} is loopback, but the job's ranks run on {len(hosts)} hosts "
            f"({', '.join(hosts)}), which cannot reach each other through it; pass the interface that connects "
            "them (--interface eth0, ib0, ...)")


def _worker_options(mine: WorkerPlacement, nthreads: int) -> dict:
    resources = {device_resource(mine.device): mine.capacity}
    if mine.emulated:
        resources[EMULATED_RESOURCE] = 1
    return {"name": mine.name, "resources": resources, "nthreads": nthreads}


def format_layout(layout, devices=None) -> str:
    """The cluster layout as a table: host, rank, role, device (and idle devices per node)."""
    def capacity(p):
        if p.capacity is None:
            return ""
        return "unlimited" if p.capacity >= UNLIMITED_CAPACITY else str(p.capacity)

    # Worker names only add something when they are not just the device (several nodes).
    named = any(p.name not in (None, p.device) for p in layout)
    rows = [("host", "rank", "role", "device", "capacity", *(("worker",) if named else ()), "")]
    for p in sorted(layout, key=lambda p: (p.rank, p.name or "")):
        rank = str(p.rank) if p.rank >= 0 else "-"
        name = ((p.name or "-"),) if named else ()
        rows.append((p.host, rank, p.role, p.device or "-", capacity(p), *name, "(emulated)" if p.emulated else ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    if devices is not None:
        for host in dict.fromkeys(p.host for p in layout if p.role == "worker"):
            owned = {p.device for p in layout if p.role == "worker" and p.host == host}
            idle = [str(d) for d in devices if str(d) not in owned]
            if idle:
                lines.append(f"idle on {host}: {', '.join(idle)} (no worker rank left for them)")
    return "\n".join(lines)


def cluster_layout(client) -> list[WorkerPlacement]:
    """The device workers a client sees, as :class:`WorkerPlacement` records (any dsched cluster).

    Examples
    --------
    >>> print(format_layout(cluster_layout(client)))  # doctest: +SKIP
    host       rank  role    device  capacity
    127.0.0.1  -     worker  cpu     unlimited
    """
    from distributed.comm.addressing import get_address_host

    layout = []
    for address, info in sorted(cluster_info(client)["workers"].items()):
        device = device_of_resources(info.get("resources"))
        if device is None:
            continue
        resources = info["resources"]
        layout.append(WorkerPlacement(
            get_address_host(address), -1, "worker", str(device),
            int(resources[device_resource(device)]), EMULATED_RESOURCE in resources, str(info.get("name")),
        ))
    return layout
