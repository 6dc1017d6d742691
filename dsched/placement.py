"""Placement: pin planned blocks to the workers that own their devices.

Dask's graph optimizer drops annotations (``notes/dask-mechanisms.md``), so a
planned block carries its device *inside its task*: :func:`dsched.map_blocks`
wraps each block's task in a :class:`PlannedBlock`, a small picklable
callable holding the planned device and size. Blockwise and linear fusion
keep a task's callable (a fused task nests the originals in its run_spec),
so the :class:`PlacementPlugin` finds the plan by walking the run_spec of
every new or touched task in ``update_graph``, which the scheduler calls
after creating the TaskStates and before placing any of them, and sets the
task's resource restriction there. This holds under the default
configuration, for compositions the optimizer fuses, with ``persist``, and
for keys the scheduler has seen before (``update_graph`` lists every
touched task, not only new ones). Tasks without a planned block are left
to Dask.

A block requests ``min(size, capacity)`` of its device's resource
``dsched-<device>``: its item count, as dispatched chunks do, so an owner
bounds the items executing at once; never more than the largest amount an
owner holds, so it cannot wait forever in ``no-worker``.

When the last owner of a device leaves (a worker died), the plugin relaxes
the restriction of that device's unfinished blocks to the workers owning
the same kind of device (``cuda``, ``cpu``), or to any worker if none does,
and says so: an event on the topic ``dsched-placement``, a scheduler log
warning, and a :class:`PlacementWarning` in every client that called
:func:`register`. When an owner comes back, blocks that have not started
are pinned again.

The :class:`DeviceWorkerPlugin` gives a worker its device: the one named
(``--dsched-device``), else the one its resources claim, else, with
``claim=True``, the GPU it sees (its first ``CUDA_VISIBLE_DEVICES`` entry,
as dask-cuda pins workers) or the CPU. It selects that GPU for CuPy.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from .devices import (
    EMULATED_RESOURCE,
    RESOURCE_PREFIX,
    UNLIMITED_CAPACITY,
    Device,
    cuda_local_ordinal,
    device_resource,
    placement_device,
    running_on,
    selected,
    to_device,
    to_host,
    visible_gpus,
    worker_device,
    worker_is_emulated,
)

__all__ = [
    "PlannedBlock",
    "PlacementPlugin",
    "DeviceWorkerPlugin",
    "PlacementWarning",
    "register",
    "planned_block_of",
    "EVENT_TOPIC",
    "SCHEDULER_PLUGIN_NAME",
    "WORKER_PLUGIN_NAME",
]

logger = logging.getLogger(__name__)

EVENT_TOPIC = "dsched-placement"
SCHEDULER_PLUGIN_NAME = "dsched-placement"
WORKER_PLUGIN_NAME = "dsched-device"
# The annotation a pinned task carries: visible on the dashboard, and the
# marker telling the plugin it has already placed this task.
DEVICE_ANNOTATION = "dsched-device"
RELAXED_ANNOTATION = "dsched-relaxed"
# Bound on the nodes walked in one run_spec, so a pathological task cannot stall the scheduler.
_WALK_LIMIT = 100_000


class PlacementWarning(UserWarning):
    """A planned block ran, or will run, on another device than planned."""


# --- the block ---------------------------------------------------------------

class PlannedBlock:
    """A block's task, bound to the device the plan chose for it.

    Called with the block's dependency values (in ``dep_keys`` order), it
    runs the wrapped task where ``current_device()`` reports the device the
    block really runs on, optionally moving the inputs to that device first
    (CuPy on a real GPU) and the result back to NumPy after.

    Parameters
    ----------
    task : dask._task_spec.Task
        The block's original task (what ``dask.array.map_blocks`` built).
    dep_keys : tuple
        The keys of the task's dependencies, in the order they are passed.
    device : Device
        The planned device.
    size : int
        Items in the block (its length along axis 0).
    to_device, to_host : bool
        Move array inputs to the device before, and array outputs to host
        memory after (both only matter on a real GPU).
    """

    __slots__ = ("task", "dep_keys", "device", "size", "to_device", "to_host")

    def __init__(self, task, dep_keys, device, size, *, to_device=True, to_host=True):
        self.task = task
        self.dep_keys = tuple(dep_keys)
        self.device = placement_device(device)
        self.size = int(size)
        self.to_device = bool(to_device)
        self.to_host = bool(to_host)

    def __getstate__(self):
        return (self.task, self.dep_keys, str(self.device), self.size, self.to_device, self.to_host)

    def __setstate__(self, state):
        task, dep_keys, device, size, to_dev, to_hst = state
        self.task, self.dep_keys, self.device, self.size = task, dep_keys, Device(device), size
        self.to_device, self.to_host = to_dev, to_hst

    def __repr__(self):
        return f"PlannedBlock({self.device}, size={self.size})"

    def __call__(self, *dep_values):
        device = resolve_device(self.device)
        values = dict(zip(self.dep_keys, dep_values))
        with running_on(device), selected(device):
            if self.to_device:
                values = {k: to_device(v, device) for k, v in values.items()}
            result = self.task(values)
            if self.to_host:
                result = to_host(result)
        return result


def resolve_device(planned: Device) -> Device:
    """The device a block planned for ``planned`` really runs on, here.

    On a worker owning ``planned``: that device. On a worker owning another
    device (the plan was relaxed after a worker died, or the placement plugin
    is missing): the worker's device. On a worker owning none: the CPU.
    Outside any worker (a local Dask scheduler): the planned device if it is
    the CPU or a GPU this process sees, else the CPU.
    """
    from .devices import _current_worker

    worker = _current_worker()
    if worker is None:
        if planned.type == "cpu" or planned in visible_gpus():
            return planned
        return Device("cpu")
    owned = worker_device(worker)
    return owned if owned is not None else Device("cpu")


# --- finding the plan in a task ---------------------------------------------

def planned_block_of(run_spec) -> PlannedBlock | None:
    """The planned block inside a task's run_spec, or ``None``.

    Walks nested tasks, fused subgraphs (``_execute_subgraph`` keeps the
    original tasks in a dict argument) and containers. If fusion merged
    blocks planned for different devices into one task, the block with the
    most items wins (the first found on a tie).
    """
    from dask._task_spec import DataNode, GraphNode, Task

    found = None
    stack = [run_spec]
    visited = 0
    while stack and visited < _WALK_LIMIT:
        node = stack.pop()
        visited += 1
        if isinstance(node, Task):
            func = node.func
            if isinstance(func, PlannedBlock):
                if found is None or func.size > found.size:
                    found = func
            stack.extend(reversed(node.kwargs.values()))
            stack.extend(reversed(node.args))
        elif isinstance(node, (DataNode, GraphNode)):
            continue  # data and aliases carry no function
        elif isinstance(node, dict):
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, (tuple, list)):
            stack.extend(reversed(node))
    return found


# --- the scheduler side -----------------------------------------------------

class PlacementPlugin(SchedulerPlugin):
    """Pin every planned block to a worker that owns its device.

    Install with :func:`register`, ``Scheduler(plugins=[PlacementPlugin()])``
    or the preload module ``plugins/dsched_scheduler.py``; installing it
    twice is harmless (``idempotent``).
    """

    name = SCHEDULER_PLUGIN_NAME
    idempotent = True

    def __init__(self):
        self.scheduler = None
        self.relaxed_total = 0  # blocks relaxed so far (worker deaths, unowned devices)

    async def start(self, scheduler):
        self.scheduler = scheduler

    # update_graph runs after the TaskStates exist and before any is placed.
    def update_graph(self, scheduler, *, client=None, keys=None, tasks=None, **kwargs):
        self.scheduler = scheduler
        relaxed = []
        for key in tasks or ():
            ts = scheduler.tasks.get(key)
            if ts is None or ts.run_spec is None:
                continue
            if ts.annotations and DEVICE_ANNOTATION in ts.annotations:
                continue  # placed when the key was first seen
            block = planned_block_of(ts.run_spec)
            if block is None:
                continue
            if not self._pin(scheduler, ts, block):
                relaxed.append(ts)
        if relaxed:
            self._relax(scheduler, relaxed, reason="no worker of the cluster owns the planned device")

    def _pin(self, scheduler, ts, block) -> bool:
        """Restrict ``ts`` to the owners of its block's device; False when none is alive."""
        resource = device_resource(block.device)
        annotations = dict(ts.annotations or {})
        annotations[DEVICE_ANNOTATION] = str(block.device)
        annotations["dsched-size"] = block.size
        annotations.pop(RELAXED_ANNOTATION, None)
        ts.annotations = annotations
        if ts.state == "processing":
            return True  # placed before this plugin saw it: its resources are acquired, leave them
        held = _live_supply(scheduler, resource)
        if not held:
            return False
        restrictions = {r: v for r, v in (ts.resource_restrictions or {}).items() if not r.startswith(RESOURCE_PREFIX)}
        restrictions[resource] = min(block.size, max(held.values()))
        ts.resource_restrictions = restrictions
        ts.worker_restrictions = None
        ts.loose_restrictions = False
        return True

    def _relax(self, scheduler, tasks, *, reason, stimulus_id=None):
        """Let ``tasks`` run on owners of the same kind of device, or anywhere; warn."""
        by_device = {}
        for ts in tasks:
            device = Device(ts.annotations[DEVICE_ANNOTATION])
            same_kind = sorted(
                addr
                for name, held in scheduler.resources.items()
                if name.startswith(RESOURCE_PREFIX) and name != EMULATED_RESOURCE
                and Device(name[len(RESOURCE_PREFIX):]).type == device.type
                for addr in held
                if addr in scheduler.workers
            )
            ts.resource_restrictions = {
                r: v for r, v in (ts.resource_restrictions or {}).items() if not r.startswith(RESOURCE_PREFIX)
            } or None
            ts.worker_restrictions = set(same_kind) or None
            target = f"the {device.type} workers {', '.join(same_kind)}" if same_kind else "any worker"
            ts.annotations = {**ts.annotations, RELAXED_ANNOTATION: target}
            by_device.setdefault((str(device), target), []).append(ts)
        self.relaxed_total += len(tasks)
        for (device, target), group in by_device.items():
            message = (
                f"{len(group)} block(s) planned for {device} will run on {target}: {reason}"
            )
            logger.warning("dsched: %s", message)
            scheduler.log_event(
                EVENT_TOPIC,
                {"action": "relaxed", "device": device, "target": target, "blocks": len(group),
                 "keys": [str(ts.key) for ts in group[:20]], "reason": reason, "message": message},
            )
        stuck = {ts.key: "processing" for ts in tasks if ts.state == "no-worker"}
        if stuck:
            scheduler.transitions(stuck, stimulus_id or f"dsched-relax-{id(tasks)}")

    def remove_worker(self, scheduler, worker, *, stimulus_id=None, **kwargs):
        orphans = [
            ts for ts in self._planned(scheduler)
            if ts.state in ("released", "waiting", "no-worker") and not _has_candidates(scheduler, ts)
        ]
        if orphans:
            self._relax(scheduler, orphans, reason=f"worker {worker} left the cluster", stimulus_id=stimulus_id)

    def add_worker(self, scheduler, worker):
        # An owner is back (a nanny restarted it): re-pin relaxed blocks not yet handed to a worker.
        for ts in self._planned(scheduler):
            if RELAXED_ANNOTATION in ts.annotations and ts.state in ("released", "waiting"):
                block = planned_block_of(ts.run_spec)
                if block is not None and _live_supply(scheduler, device_resource(block.device)):
                    self._pin(scheduler, ts, block)

    @staticmethod
    def _planned(scheduler):
        return [ts for ts in scheduler.tasks.values() if ts.annotations and DEVICE_ANNOTATION in ts.annotations]


def _has_candidates(scheduler, ts) -> bool:
    """Whether any worker alive now (paused or not) satisfies ``ts``'s restrictions."""
    candidates = set(scheduler.workers)
    if ts.worker_restrictions:
        candidates &= set(ts.worker_restrictions)
    for resource, required in (ts.resource_restrictions or {}).items():
        candidates &= {a for a, held in _live_supply(scheduler, resource).items() if held >= required}
    return bool(candidates)


def _live_supply(scheduler, resource) -> dict:
    """``{worker address: amount}`` of ``resource`` among the workers alive now."""
    return {a: s for a, s in (scheduler.resources.get(resource) or {}).items() if a in scheduler.workers}


# --- the worker side ----------------------------------------------------------

class DeviceWorkerPlugin(WorkerPlugin):
    """Give a worker its device: claim its resource if needed, select the GPU for CuPy.

    Parameters
    ----------
    device : str or Device, optional
        The device this worker owns. Without it, the device its resources
        already claim; failing that, with ``claim=True``, the GPU it sees
        (the first ``CUDA_VISIBLE_DEVICES`` entry) or else the CPU.
    capacity : int, optional
        Items the device may execute at once (the resource amount);
        unlimited by default.
    emulate : bool
        Allow a CUDA device that is not present: the worker computes with
        NumPy and advertises ``dsched-emulated`` (placement tests only).
    claim : bool
        Whether a worker that owns no device claims one from what it sees.
    """

    name = WORKER_PLUGIN_NAME
    idempotent = True

    def __init__(self, device=None, *, capacity=None, emulate=False, claim=False):
        self.device = None if device is None else Device(device)
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity: expected an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self.emulate = bool(emulate)
        self.claim = bool(claim)

    async def setup(self, worker):
        device, emulated = self._device_for(worker)
        if device is None:
            return
        wanted = {device_resource(device): self.capacity or UNLIMITED_CAPACITY}
        if emulated:
            wanted[EMULATED_RESOURCE] = 1
        if any(worker.state.total_resources.get(r) != v for r, v in wanted.items()) and (
            self.device is not None or worker_device(worker) is None
        ):
            await _set_resources(worker, wanted)
        if device.is_cuda and not worker_is_emulated(worker):
            _select_gpu(device)
        logger.info("dsched: worker %s owns %s%s", worker.name, device, " (emulated)" if emulated else "")

    def _device_for(self, worker):
        present = visible_gpus()
        if self.device is not None:
            device = placement_device(self.device)
            missing = device.is_cuda and not present
            if missing and not self.emulate:
                raise ValueError(
                    f"dsched-device: {device} is not visible to this worker (visible GPUs: "
                    f"{', '.join(map(str, present)) or 'none'}); pass --dsched-emulate to emulate it"
                )
            return device, missing
        owned = worker_device(worker)
        if owned is not None or not self.claim:
            return owned, False
        if present:
            return Device(f"cuda:{_first_visible_ordinal()}"), False
        return Device("cpu"), False


def _first_visible_ordinal() -> int:
    """The physical index of the GPU a pinned worker sees first (dask-cuda rotates the list)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


async def _set_resources(worker, resources):
    from distributed.core import Status

    if worker.status == Status.running:  # registered: tell the scheduler too
        await worker.set_resources(**resources)
        return
    # Not yet registered (a preload, or Worker(plugins=...)): registration sends these.
    for name, amount in resources.items():
        worker.state.available_resources[name] = (
            worker.state.available_resources.get(name, 0) + amount - worker.state.total_resources.get(name, 0)
        )
        worker.state.total_resources[name] = amount


def _select_gpu(device):
    try:
        import cupy
    except ImportError:
        return
    cupy.cuda.Device(cuda_local_ordinal(device)).use()


# --- registration -------------------------------------------------------------

_registered = weakref.WeakKeyDictionary()
_registered_lock = threading.Lock()


def register(client, *, claim=True):
    """Install dsched's placement plugins on ``client``'s cluster (idempotent).

    Installs the :class:`PlacementPlugin` on the scheduler and the
    :class:`DeviceWorkerPlugin` on every worker (present and future), and
    turns the scheduler's placement events into :class:`PlacementWarning`
    in this client. ``LocalHybridCluster`` and the preload modules install
    the plugins themselves; calling this there too is harmless.

    Parameters
    ----------
    client : distributed.Client
    claim : bool
        Let a worker that owns no device claim the GPU it sees, or else the
        CPU (what makes a ``LocalCUDACluster`` usable as is).

    Examples
    --------
    >>> import dsched
    >>> dsched.register(client)  # doctest: +SKIP
    """
    with _registered_lock:
        if _registered.get(client):
            return
        client.register_plugin(PlacementPlugin(), name=SCHEDULER_PLUGIN_NAME)
        client.register_plugin(DeviceWorkerPlugin(claim=claim), name=WORKER_PLUGIN_NAME)
        client.subscribe_topic(EVENT_TOPIC, _warn_from_event)
        _registered[client] = True


def _warn_from_event(event):
    _, message = event
    text = message.get("message", str(message)) if isinstance(message, dict) else str(message)
    warnings.warn(f"dsched placement: {text}", PlacementWarning, stacklevel=2)


# --- preload entry points (plugins/dsched_scheduler.py, plugins/dsched_worker.py) ---

def scheduler_dask_setup(scheduler):
    """``dask scheduler --preload plugins/dsched_scheduler.py``: install the placement plugin."""
    scheduler.add_plugin(PlacementPlugin(), name=SCHEDULER_PLUGIN_NAME, idempotent=True)


def _worker_setup_command():
    import click

    def check_device(ctx, param, value):
        # Runs when `dask worker` parses its command line, so a bad device stops it before it starts.
        if value is None:
            return None
        try:
            device = placement_device(value)
        except ValueError as err:
            raise click.BadParameter(str(err)) from None
        if device.is_cuda and not ctx.params.get("dsched_emulate") and device not in visible_gpus():
            present = ", ".join(map(str, visible_gpus())) or "none"
            raise click.BadParameter(
                f"dsched-device: {device} is not visible here (visible GPUs: {present}); "
                "add --dsched-emulate to emulate it"
            )
        return str(device)

    @click.command()
    @click.option("--dsched-emulate", is_flag=True, default=False, is_eager=True,
                  help="Emulate a CUDA device that is not present (NumPy on the CPU; placement tests only).")
    @click.option("--dsched-device", default=None, callback=check_device,
                  help="The device this worker owns: cpu, cuda or cuda:N (default: what --resources claims, "
                       "else the GPU it sees, else the CPU).")
    @click.option("--dsched-capacity", type=click.IntRange(min=1), default=None,
                  help="Items the device may execute at once (default: unlimited).")
    async def dask_setup(worker, dsched_emulate, dsched_device, dsched_capacity):
        plugin = DeviceWorkerPlugin(dsched_device, capacity=dsched_capacity, emulate=dsched_emulate, claim=True)
        await worker.plugin_add(plugin, name=WORKER_PLUGIN_NAME, catch_errors=False)

    return dask_setup


worker_dask_setup = _worker_setup_command()
