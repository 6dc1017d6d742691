"""Which workers own which devices, read from their Dask resources."""

from __future__ import annotations

from dsched.devices.device import EMULATED_RESOURCE, Device, device_of_resources, device_resource, placement_device

__all__ = ["cluster_info", "emulated_devices", "device_owners", "device_capacities", "device_threads", "check_devices_owned"]


def cluster_info(client) -> dict:
    """The scheduler's identity with every worker: what ``client.scheduler_info(n_workers=-1)`` means to say.

    Asked of the scheduler and returned as it answers. ``scheduler_info`` returns
    the client's cached copy instead, which the client's periodic refresh (every
    2 s, asking for no workers) can replace between the answer and the return: a
    cluster of workers then reads as one without any (seen in the suite).
    """
    return client.sync(client.scheduler.identity, n_workers=-1)


def _workers(client, workers):
    """The cluster's workers as :func:`cluster_info` lists them: ``workers`` when the caller read them already."""
    return cluster_info(client)["workers"] if workers is None else workers


def device_owners(client, devices, workers=None) -> dict:
    """``{Device: [address of each worker that owns it]}`` for ``devices``.

    Each function here takes the ``workers`` of one :func:`cluster_info`
    call, so that a run asks the scheduler once rather than once per question.
    """
    wanted = {placement_device(d): Device(d) for d in devices}
    owners = {Device(d): [] for d in devices}
    for address, info in _workers(client, workers).items():
        device = device_of_resources(info.get("resources"))
        if device is not None and device in wanted:
            owners[wanted[device]].append(address)
    return owners


def device_capacities(client, workers=None) -> dict:
    """``{Device: smallest capacity in items among the workers that own it}``."""
    capacities = {}
    for info in _workers(client, workers).values():
        device = device_of_resources(info.get("resources"))
        if device is not None:
            amount = info["resources"][device_resource(device)]
            capacities[device] = min(amount, capacities.get(device, amount))
    return capacities


def check_devices_owned(client, scheduler, workers=None):
    """A ValueError, before any work, for a device no worker owns or whose capacity is below its batch size."""
    capacities = device_capacities(client, workers)
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


def device_threads(client, workers=None) -> dict:
    """``{Device: threads of all the workers that own it}``: how many of its chunks can run at once."""
    threads = {}
    for info in _workers(client, workers).values():
        device = device_of_resources(info.get("resources"))
        if device is not None:
            threads[device] = threads.get(device, 0) + int(info.get("nthreads", 1))
    return threads


def emulated_devices(client) -> dict:
    """``{Device: emulated?}`` for the devices a cluster's workers own, read from their resources.

    A Device hashes like its string, so ``table.get("cuda:0")`` works too.
    """
    table = {}
    for info in cluster_info(client)["workers"].values():
        device = device_of_resources(info.get("resources"))
        if device is not None:
            table[device] = table.get(device, False) or EMULATED_RESOURCE in info["resources"]
    return table
