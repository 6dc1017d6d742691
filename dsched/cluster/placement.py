"""Placement: pin planned blocks to the workers that own their devices.

Dask's graph optimizer drops annotations (``notes/dask-mechanisms.md``), so a
planned block carries its device *inside its task*: :func:`dsched.map_blocks`
gives each block's task one more argument, a small picklable
:class:`PlannedBlock` holding the planned device, size and declared shape
(a per-block value of the Blockwise layer, as Dask passes ``block_info``).
Blockwise and linear fusion keep a task's arguments (a fused task nests the
originals and their data in its run_spec), so the :class:`PlacementPlugin`
finds the plan by walking the run_spec of every new or touched task in
``update_graph``, which the scheduler calls after creating the TaskStates
and before placing any of them, and sets the task's resource restriction
there. This holds under the default configuration, for compositions the
optimizer fuses, with ``persist``, and for keys the scheduler has seen
before (``update_graph`` lists every touched task, not only new ones), on
both of Dask's array engines: the expression engine
(``array.query-planning``) keeps no annotations either (dask/dask#10937),
and materializes each block's task, plan included, on the scheduler.
Tasks without a planned block are left to Dask. :func:`run_block` runs the
block where it lands and checks its output shape.

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
as dask-cuda pins workers: an index, or a GPU or MIG UUID resolved through
NVML) or the CPU. It selects that GPU for CuPy.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from dsched.checks import check_positive_int
from dsched.devices.backends import to_device as to_device_
from dsched.devices.backends import to_host as to_host_
from dsched.devices.context import _current_worker, running_on, selected, worker_device, worker_is_emulated
from dsched.devices.cuda import cuda_local_ordinal, first_visible_gpu, visible_gpus
from dsched.devices.device import (
    EMULATED_RESOURCE,
    RESOURCE_PREFIX,
    UNLIMITED_CAPACITY,
    Device,
    device_resource,
    placement_device,
)
from dsched.names import (
    DEVICE_ANNOTATION,
    DEVICE_WORKER_PLUGIN,
    PLACEMENT_EVENT_TOPIC,
    PLACEMENT_PLUGIN,
    RELAXED_ANNOTATION,
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

EVENT_TOPIC = PLACEMENT_EVENT_TOPIC
SCHEDULER_PLUGIN_NAME = PLACEMENT_PLUGIN
WORKER_PLUGIN_NAME = DEVICE_WORKER_PLUGIN
# Bound on the nodes walked in one run_spec, so a pathological task cannot stall the scheduler.
_WALK_LIMIT = 100_000


class PlacementWarning(UserWarning):
    """A planned block ran, or will run, on another device than planned."""


# --- the block ---------------------------------------------------------------

class PlannedBlock:
    """The plan of one output block of :func:`dsched.map_blocks`: its device, size and shape.

    It travels inside the block's task as a plain argument, so it survives
    Dask's blockwise and linear fusion (the fused task keeps it among its
    data), and the :class:`PlacementPlugin` finds it there.

    Parameters
    ----------
    device : Device or None
        The planned device; ``None`` for a block the plan does not place
        (it still gets its shape checked).
    size : int or None
        Items of the batch the block holds (its length along the batch axis).
    shape : tuple, optional
        The block's declared output shape (``nan`` where unknown).
    name, block_id : optional
        The output array's name and the block's index, for error messages.
    """

    __slots__ = ("device", "size", "shape", "name", "block_id")

    def __init__(self, device, size, *, shape=None, name=None, block_id=None):
        self.device = None if device is None else placement_device(device)
        self.size = None if size is None else int(size)
        self.shape = None if shape is None else tuple(shape)
        self.name, self.block_id = name, None if block_id is None else tuple(block_id)

    def __getstate__(self):
        return (None if self.device is None else str(self.device), self.size, self.shape, self.name, self.block_id)

    def __setstate__(self, state):
        device, self.size, self.shape, self.name, self.block_id = state
        self.device = None if device is None else Device(device)

    def __dask_tokenize__(self):
        return ("dsched-planned-block", *self.__getstate__())

    def __repr__(self):
        return f"PlannedBlock({self.device}, size={self.size}, shape={self.shape})"


def run_block(block, fn, args, kwargs, positions, *, to_device=True, to_host=True):
    """Call ``fn(*args, **kwargs)`` for one planned block, where it runs.

    ``current_device()`` reports the device the block really runs on (see
    :func:`resolve_device`); the block arguments at ``positions`` move to
    that device first and the result back to host memory after (both only
    matter on a real GPU). A result whose shape differs from the block's
    declared shape is a ``ValueError``: Dask would otherwise carry a wrong
    shape silently.
    """
    device = None if block.device is None else resolve_device(block.device)
    with running_on(device), selected(device):
        if to_device and device is not None and positions:
            args = list(args)
            for i in positions:
                args[i] = to_device_(args[i], device)
        result = fn(*args, **kwargs)
        if to_host:
            result = to_host_(result)
    _check_shape(block, result)
    return result


def _check_shape(block, result):
    """Raise if ``result`` does not have the block's declared shape.

    Axes of length 1 may differ (Dask joins such blocks as declared, and its
    own tests rely on it); unknown (``nan``) lengths match anything.
    """
    shape = getattr(result, "shape", None)
    if block.shape is None or not isinstance(shape, tuple):
        return  # not an array (a list, a DataFrame's partition...): nothing declared to compare
    if len(shape) == len(block.shape):
        got, want = shape, block.shape
    else:
        got, want = [m for m in shape if m != 1], [m for m in block.shape if m != 1]
    if len(got) != len(want) or any(g != w and w == w and g == g for g, w in zip(got, want)):
        raise ValueError(
            f"dsched.map_blocks: block {block.block_id} of {block.name!r} has shape {shape}, "
            f"but the array declares {block.shape} for it; pass chunks= (and drop_axis/new_axis) "
            "that describe what the function returns"
        )


def resolve_device(planned: Device) -> Device:
    """The device a block planned for ``planned`` really runs on, here.

    On a worker owning ``planned``: that device. On a worker owning another
    device (the plan was relaxed after a worker died, or the placement plugin
    is missing): the worker's device. On a worker owning none: the CPU.
    Outside any worker (a local Dask scheduler): the planned device if it is
    the CPU or a GPU this process sees, else the CPU.
    """
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
    original tasks in a dict argument), their data and containers; blocks
    the plan does not place (``device`` ``None``) are skipped. If fusion merged
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
        if isinstance(node, PlannedBlock):
            if node.device is not None and (found is None or node.size > found.size):
                found = node
        elif isinstance(node, Task):
            stack.extend(reversed(node.kwargs.values()))
            stack.extend(reversed(node.args))
        elif isinstance(node, DataNode):
            if isinstance(node.value, (PlannedBlock, tuple, list, dict)):
                stack.append(node.value)  # a block's plan is data of its task
        elif isinstance(node, GraphNode):
            continue  # aliases and references carry no plan
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
        if capacity is not None:
            check_positive_int(capacity, "capacity", integers=int, below=None)
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
            # The first CUDA_VISIBLE_DEVICES entry (dask-cuda rotates the list), an index or a
            # GPU/MIG UUID; unset or unresolvable: the first GPU, as CUDA itself would use.
            return first_visible_gpu() or Device("cuda:0"), False
        return Device("cpu"), False


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
