"""Which workers own which devices, read from their Dask resources, and devices whose worker is away."""

from __future__ import annotations

import threading
import time

from dask import config

from dsched.devices.device import EMULATED_RESOURCE, Device, device_of_resources, device_resource, placement_device
from dsched.names import DASHBOARD_PLUGIN

__all__ = ["cluster_info", "recent_cluster_info", "forget_cluster_info", "has_dashboard", "dashboard_registered",
           "emulated_devices", "device_owners", "device_capacities", "device_threads", "check_devices_owned",
           "lost_device_timeout", "absent_since", "wait_for_devices"]

RECENT = 1.0  # seconds a run's start may take the cluster as an earlier question of the same client found it
LOST_DEVICE_TIMEOUT = 30.0  # ``dsched.lost-device-timeout``: seconds a device may be without a worker (a nanny restarts one)
_POLL = 0.1  # seconds between looks at the cluster while a call waits for a device's worker
_UNWATCHED = 10.0  # seconds without a look after which a device's absence is counted afresh


class _Sightings:
    """What this process saw of each cluster (by :func:`scheduler_key`): the devices a worker owned, and since
    when a device has been without one. One instance, :data:`_sightings`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owned = {}  # scheduler_key -> {Device} some worker owned when this process looked
        self.absent = {}  # (scheduler_key, Device) -> [first seen without a worker, last seen so]


_sightings = _Sightings()


def scheduler_key(client) -> tuple:
    """``(address, id)`` of ``client``'s scheduler: what this process keeps of a cluster is kept under it.

    The address alone is not enough: a scheduler that closed leaves its port to
    the next one (a test suite starts dozens), which must not inherit what was
    seen of the first (its dashboard: runs would never replay). The id is the
    one the scheduler gave the client as it connected, read without a question.
    """
    identity = getattr(client, "_scheduler_identity", None) or {}
    return client.scheduler.address, identity.get("id")


def cluster_info(client) -> dict:
    """The scheduler's identity with every worker: what ``client.scheduler_info(n_workers=-1)`` means to say.

    Asked of the scheduler and returned as it answers. ``scheduler_info`` returns
    the client's cached copy instead, which the client's periodic refresh (every
    2 s, asking for no workers) can replace between the answer and the return: a
    cluster of workers then reads as one without any (seen in the suite).
    ``info["dsched-dashboard"]`` says whether the scheduler has dsched's dashboard
    (see :func:`has_dashboard`).
    """
    generation, asked = client.__dict__.get(_GENERATION), time.monotonic()
    info = client.sync(client.scheduler.identity, n_workers=-1)
    info["dsched-dashboard"] = has_dashboard(client)
    owned = {device_of_resources(w.get("resources")) for w in info.get("workers", {}).values()} - {None}
    with _sightings.lock:  # a device seen owned is no longer away; it may be waited for if it goes
        _sightings.owned.setdefault(scheduler_key(client), set()).update(owned)
        for device in owned:
            _sightings.absent.pop((scheduler_key(client), device), None)
    if client.__dict__.get(_GENERATION) is generation:  # not forgotten meanwhile (a worker left as it answered)
        client.__dict__[_KEPT] = (info, asked)
    return info


_KEPT = "_dsched_cluster_info"  # on a client: its last cluster_info answer and when it was asked for
_GENERATION = "_dsched_cluster_generation"  # on a client: a new object each time its answer is forgotten


def recent_cluster_info(client, scheduler=None) -> dict:
    """:func:`cluster_info` as a run starts: the last answer, if it is under :data:`RECENT` seconds old and has
    a worker for each of ``scheduler``'s devices, with room for its batch size.

    A solver that calls :func:`dsched.dispatch` every step asks the scheduler
    once a second rather than once a step (a round trip through both event
    loops, about a third of a small call's fixed cost). A worker that leaves
    is forgotten at once where this process hears of it (a feed's worker, a
    failed run: :func:`forget_cluster_info`); otherwise a run that finds a
    worker gone handles it as it handles one that leaves mid-run. A device
    the last answer lacks is looked for in a new one (a worker that just joined).
    """
    kept = client.__dict__.get(_KEPT)
    if kept is None or time.monotonic() - kept[1] >= RECENT or not _serves(client, scheduler, kept[0]["workers"]):
        return cluster_info(client)
    info = dict(kept[0])
    info["dsched-dashboard"] = has_dashboard(client)  # a dashboard registered since is known at once
    return info


def _serves(client, scheduler, workers) -> bool:
    """Whether ``workers`` own each of ``scheduler``'s devices, with room for its batch size (no scheduler: yes)."""
    if scheduler is None:
        return True
    capacities = device_capacities(client, workers)
    return all(capacities.get(placement_device(s.device), 0) >= s.batch_size for s in scheduler.status())


def cluster_generation(client):
    """An object that stays the same until ``client``'s cluster answer is forgotten (:func:`forget_cluster_info`:
    a worker left, or a run failed): what a run may keep of the cluster holds while it is."""
    return client.__dict__.setdefault(_GENERATION, object())


def forget_cluster_info(client) -> None:
    """The next run asks the scheduler again (a worker left, or a run failed)."""
    client.__dict__[_GENERATION] = object()
    client.__dict__.pop(_KEPT, None)


DASHBOARD_RECHECK = 5.0  # seconds: how long "no dashboard" is believed before the scheduler is asked again
_dashboards = {}  # scheduler_key -> (has dsched's dashboard, time.monotonic() of the answer)


def has_dashboard(client) -> bool:
    """Whether ``client``'s scheduler has dsched's dashboard plugin; runs tell it of their chunks if so.

    Asked once per scheduler (a run's one question to the scheduler is
    the cheap ``identity``; a remote function call costs twice that): a plugin
    added later by :func:`dsched.observe.dashboard.plugin.register` is known at
    once (:func:`dashboard_registered`), one added another way within
    :data:`DASHBOARD_RECHECK` seconds.
    """
    key = scheduler_key(client)
    known = _dashboards.get(key)
    if known is not None and (known[0] or time.monotonic() - known[1] < DASHBOARD_RECHECK):
        return known[0]
    present = bool(client.run_on_scheduler(_has_dashboard))
    _dashboards[key] = (present, time.monotonic())
    return present


def dashboard_registered(client) -> None:
    """The dashboard was just added to ``client``'s scheduler."""
    _dashboards[scheduler_key(client)] = (True, time.monotonic())


def _has_dashboard(dask_scheduler=None) -> bool:
    return DASHBOARD_PLUGIN in dask_scheduler.plugins


def _workers(client, workers):
    """The cluster's workers as :func:`cluster_info` lists them: ``workers`` when the caller read them already."""
    return cluster_info(client)["workers"] if workers is None else workers


def _owning(client, workers=None):
    """``(address, Device, worker info)`` for every worker that owns a device, read from its resources."""
    for address, info in _workers(client, workers).items():
        device = device_of_resources(info.get("resources"))
        if device is not None:
            yield address, device, info


def device_owners(client, devices, workers=None) -> dict:
    """``{Device: [address of each worker that owns it]}`` for ``devices``.

    Each function here takes the ``workers`` of one :func:`cluster_info`
    call, so that a run asks the scheduler once rather than once per question.
    """
    wanted = {placement_device(d): Device(d) for d in devices}
    owners = {Device(d): [] for d in devices}
    for address, device, _ in _owning(client, workers):
        if device in wanted:
            owners[wanted[device]].append(address)
    return owners


def device_capacities(client, workers=None) -> dict:
    """``{Device: smallest capacity in items among the workers that own it}``."""
    capacities = {}
    for _, device, info in _owning(client, workers):
        amount = info["resources"][device_resource(device)]
        capacities[device] = min(amount, capacities.get(device, amount))
    return capacities


def check_devices_owned(client, scheduler, workers=None):
    """A ValueError, before any work, for a device no worker owns or whose capacity is below its batch size."""
    capacities = device_capacities(client, workers)
    missing = [str(s.device) for s in scheduler.status() if placement_device(s.device) not in capacities]
    if missing:
        raise _not_owned(missing, capacities)
    _check_batch_sizes(scheduler, capacities)


def _not_owned(missing, capacities, grace=None) -> ValueError:
    have = ", ".join(sorted(map(str, capacities))) or "none"
    names = ", ".join(map(str, missing))
    what = f"owns {names}" if grace is None else f"has owned {names} for {grace:g} s"
    return ValueError(
        f"devices: no worker of the cluster {what} (owned devices: {have}); "
        f"start one with LocalHybridCluster or `dask worker --resources {device_resource(missing[0])}=<capacity>`"
    )


def _check_batch_sizes(scheduler, capacities):
    for s in scheduler.status():
        held = capacities.get(placement_device(s.device))
        if held is not None and held < s.batch_size:
            raise ValueError(
                f"batch_sizes: {s.batch_size} for {s.device} exceeds the {held:g} items its worker may run at once "
                f"(the worker's {device_resource(s.device)} resource)"
            )


def lost_device_timeout() -> float:
    """Seconds a device may be without a worker before its chunks run elsewhere (``dsched.lost-device-timeout``)."""
    return float(config.get("dsched.lost-device-timeout", LOST_DEVICE_TIMEOUT))


def absent_since(client, devices) -> dict:
    """``{device: time.monotonic() since which it has been without a worker}`` for ``devices``, as this process saw.

    Call it with the devices no worker owns now. The clock is shared by the
    calls and runs of this process, so a device lost during one run is not
    waited for again, in full, by the next call; it starts again when a worker
    owns the device, or when nobody looked for 10 s (it may have come back).
    """
    now = time.monotonic()
    since = {}
    with _sightings.lock:
        for device in devices:
            seen = _sightings.absent.setdefault((scheduler_key(client), placement_device(device)), [now, now])
            if now - seen[1] > _UNWATCHED:  # it may have come back and gone again meanwhile
                seen[0] = now
            seen[1] = now
            since[device] = seen[0]
    return since


def _awaited(client, devices) -> list:
    """Those of ``devices`` whose worker may be restarting: a worker owned it when this process looked earlier,
    or the client's own cluster runs it (a LocalHybridCluster's nanny brings a killed worker back)."""
    with _sightings.lock:
        seen = set(_sightings.owned.get(scheduler_key(client), ()))
    seen |= {placement_device(d) for d in getattr(getattr(client, "cluster", None), "devices", None) or ()}
    return [d for d in devices if placement_device(d) in seen]


def wait_for_devices(client, scheduler, cluster, grace=None) -> dict:
    """``cluster`` (a :func:`cluster_info`) once a worker owns each of ``scheduler``'s devices, read again if it
    had to wait; a ValueError, before any work, for a device it cannot wait for.

    A device whose worker is restarting (a killed worker its nanny brings back)
    is waited for under the rule chunks in flight follow
    (:class:`~dsched.dispatch.completion.DeviceWatch`): up to ``grace`` seconds
    (``dsched.lost-device-timeout``) since this process found it without a
    worker. Past that the call starts anyway, and its chunks run on another
    device, with a :class:`~dsched.placement.PlacementWarning`, until a worker
    owns it again. A device no worker of the cluster ever owned is refused at
    once, as is a batch size above a device's capacity.
    """
    grace = lost_device_timeout() if grace is None else grace
    while True:
        capacities = device_capacities(client, cluster["workers"])
        missing = [s.device for s in scheduler.status() if placement_device(s.device) not in capacities]
        unknown = [d for d in missing if d not in _awaited(client, missing)]
        if unknown:
            raise _not_owned(unknown, capacities)
        if not missing:
            break
        since = absent_since(client, missing)
        if time.monotonic() - max(since.values()) >= grace:  # lost: the run moves their chunks elsewhere
            if not capacities:
                raise _not_owned(missing, capacities, grace)
            break
        time.sleep(_POLL)
        cluster = cluster_info(client)
    _check_batch_sizes(scheduler, capacities)
    return cluster


def device_threads(client, workers=None) -> dict:
    """``{Device: threads of all the workers that own it}``: how many of its chunks can run at once."""
    threads = {}
    for _, device, info in _owning(client, workers):
        threads[device] = threads.get(device, 0) + int(info.get("nthreads", 1))
    return threads


def emulated_devices(client) -> dict:
    """``{Device: emulated?}`` for the devices a cluster's workers own, read from their resources.

    A Device hashes like its string, so ``table.get("cuda:0")`` works too.
    """
    table = {}
    for _, device, info in _owning(client):
        table[device] = table.get(device, False) or EMULATED_RESOURCE in info["resources"]
    return table
