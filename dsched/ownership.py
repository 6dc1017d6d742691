"""Which workers own which devices, read from their Dask resources."""

from __future__ import annotations

from .devices import Device, device_of_resources, device_resource, placement_device

__all__ = ["device_owners", "device_capacities", "device_threads", "check_devices_owned"]


def device_owners(client, devices) -> dict:
    """``{Device: [address of each worker that owns it]}`` for ``devices``."""
    wanted = {placement_device(d): Device(d) for d in devices}
    owners = {Device(d): [] for d in devices}
    for address, info in client.scheduler_info(n_workers=-1)["workers"].items():
        device = device_of_resources(info.get("resources"))
        if device is not None and device in wanted:
            owners[wanted[device]].append(address)
    return owners


def device_capacities(client) -> dict:
    """``{Device: smallest capacity in items among the workers that own it}``."""
    capacities = {}
    for info in client.scheduler_info(n_workers=-1)["workers"].values():
        device = device_of_resources(info.get("resources"))
        if device is not None:
            amount = info["resources"][device_resource(device)]
            capacities[device] = min(amount, capacities.get(device, amount))
    return capacities


def check_devices_owned(client, scheduler):
    """A ValueError, before any work, for a device no worker owns or whose capacity is below its batch size."""
    capacities = device_capacities(client)
    missing = [str(s.device) for s in scheduler.status() if placement_device(s.device) not in capacities]
    if missing:
        have = ", ".join(sorted(map(str, capacities))) or "none"
        raise ValueError(
            f"devices: no worker of the cluster owns {', '.join(missing)} (owned devices: {have}); "
            f"start one with LocalHybridCluster or `dask worker --resources {device_resource(missing[0])}=<capacity>`"
        )
    for s in scheduler.status():
        held = capacities[placement_device(s.device)]
        if held < s.batch_size:
            raise ValueError(
                f"batch_sizes: {s.batch_size} for {s.device} exceeds the {held:g} items its worker may run at once "
                f"(the worker's {device_resource(s.device)} resource)"
            )


def device_threads(client) -> dict:
    """``{Device: threads of all the workers that own it}``: how many of its chunks can run at once."""
    threads = {}
    for info in client.scheduler_info(n_workers=-1)["workers"].values():
        device = device_of_resources(info.get("resources"))
        if device is not None:
            threads[device] = threads.get(device, 0) + int(info.get("nthreads", 1))
    return threads
