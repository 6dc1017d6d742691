"""Sub-batch tuning: sweep each device, fit NEML2's saturation model, recommend, save a profile.

NEML2 sizes sub-batches by measurement (``doc/content/development/benchmarking.md``):
run one device at batch sizes doubling from small to large, and fit

    t(N) = t0 * (<N - N*> / N* + 1)

where ``<x> = max(x, 0)``: a chunk of up to ``N*`` items costs the fixed time
``t0`` (the device is not yet full), beyond that the time grows linearly.
Throughput ``N / t(N)`` rises until ``N*`` and then stays at its peak
``N* / t0``. :func:`run_tuning` does this for every device with a
:class:`SimpleScheduler` on a real Dask cluster, timing each chunk on its
worker, and recommends per device:

- ``batch_size``: ``N*``, raised until a chunk takes at least
  ``min_chunk_time`` (20 ms by default), because Dask adds about 1 ms per
  task: below that the dispatch, not the device, would set the pace;
- ``capacity``: room for the chunk computing plus enough queued behind it to
  cover the measured round trip between chunks (at least two chunks), so the
  device never waits for the client.

The result is saved as a profile per host and model (JSON under
``$DSCHED_PROFILE_DIR`` or ``~/.cache/dsched/profiles/<host>/<model>.json``)
that :func:`profile_speeds` reads back for ``plan()`` and the graph files,
and is drawn as throughput against sub-batch size (a PNG).
The cost model itself (``saturation_time``, ``fit_saturation``) lives in
:mod:`dsched.costmodel`, with its examples; the profile store (``profile_path``,
``save_profile``, ``load_profile``, ``profile_speeds``, ``profile_settings``)
in :mod:`dsched.schedulers.profiles`, beside the policies that read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
from distributed import Client

from dsched.checks import check_callable, check_positive_int
from dsched.cluster.local import LocalHybridCluster
from dsched.dataplane.loaders import SliceGenerator
from dsched.devices.cuda import visible_gpus
from dsched.devices.device import Device, parse_devices, placement_device
from dsched.devices.ownership import emulated_devices
from dsched.dispatch.dispatcher import WorkDispatcher
from dsched.models import get_model
from dsched.schedulers import SimpleScheduler, profiles
from dsched.schedulers.costmodel import (
    SaturationFit,
    device_identities,
    device_identity,
    fit_saturation,
    saturation_time,
    save_costs,
)
from dsched.schedulers.profiles import (
    PROFILE_VERSION,
    load_profile,
    profile_dir,
    profile_path,
    profile_settings,
    profile_speeds,
    save_profile,
)

__all__ = [
    "TuningWorkload",
    "SweepPoint",
    "SaturationFit",
    "DeviceTuning",
    "TuningResult",
    "saturation_time",
    "fit_saturation",
    "recommend",
    "run_tuning",
    "sweep_device",
    "save_profile",
    "load_profile",
    "profile_path",
    "profile_dir",
    "profile_speeds",
    "profile_settings",
    "plot_throughput",
    "format_tuning",
]

# --- the model ----------------------------------------------------------------
# The model and its fit live in dsched.costmodel, beside the online calibration
# that refits it while a PerformanceModelScheduler runs.

def recommend(fit: SaturationFit, *, min_chunk_time=0.02, gap=0.0) -> tuple[int, int]:
    """``(batch_size, capacity)`` for a device with this fit.

    The batch size is ``N*`` raised until a chunk takes ``min_chunk_time``;
    the capacity holds the computing chunk plus enough queued chunks to cover
    ``gap`` (the measured seconds between one chunk's end and the next one's
    start when only one is in flight), and at least two chunks.
    """
    batch = max(1, math.ceil(fit.n_star))
    if fit.t0 < min_chunk_time:  # in the linear part t = t0 * N / N*
        batch = max(batch, math.ceil(fit.n_star * min_chunk_time / fit.t0))
    chunk_time = fit.time(batch)
    chunks = 1 + max(1, math.ceil(max(gap, 0.0) / chunk_time)) if chunk_time > 0 else 2
    return batch, chunks * batch


# --- what gets measured -------------------------------------------------------

@dataclasses.dataclass
class TuningWorkload:
    """What to time: ``do_work(work, device)`` on the work of ``make_work(total)`` (a WorkGenerator).

    ``name`` names the profile (one file per host and model).
    """

    name: str
    do_work: Callable
    make_work: Callable | None = None  # total -> WorkGenerator; slices 0..total by default
    preprocess: Callable | None = None
    postprocess: Callable | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"model: expected a plain name for the profile file, got {self.name!r}")
        check_callable(self.do_work, "do_work")
        if self.make_work is None:
            self.make_work = _slices
        else:
            check_callable(self.make_work, "make_work")


def _slices(total):
    return SliceGenerator(0, total)


class _ModelChunk:
    """``do_work`` for a model of :mod:`dsched.models`, with its parameters bound (picklable)."""

    def __init__(self, chunk, parameters, tangent):
        self.chunk, self.parameters, self.tangent = chunk, parameters, tangent

    def __call__(self, work, device):
        return self.chunk(work, device, self.parameters, tangent=self.tangent)


def workload_from(model, parameters=None) -> TuningWorkload:
    """A :class:`TuningWorkload` from a workload, a graph, a built-in model's name, or ``do_work``."""
    if isinstance(model, TuningWorkload):
        return model
    if hasattr(model, "tuning_workload"):
        return model.tuning_workload()
    if isinstance(model, str):
        entry = get_model(model)
        return TuningWorkload(model, _ModelChunk(entry.chunk, entry.parameters_type(**(parameters or {})), True))
    if all(hasattr(model, a) for a in ("model", "parameters", "tangent")):  # a dsched.graph.Graph
        entry = model.entry() if hasattr(model, "entry") else get_model(model.model)
        params = entry.parameters_type(**model.parameters)
        return TuningWorkload(model.model, _ModelChunk(entry.chunk, params, model.tangent))
    if callable(model):
        name = getattr(model, "__name__", None) or type(model).__name__
        return TuningWorkload(name.strip("<>").replace("/", "_") or "model", model)
    raise ValueError(f"model: expected a model name, a graph, a TuningWorkload or do_work, got {model!r}")


@dataclasses.dataclass
class SweepPoint:
    """One batch size: the median chunk time on the worker and every sample."""

    batch_size: int
    seconds: float
    samples: list
    gap: float = 0.0  # median seconds between chunks, client round trip included

    @property
    def items_per_s(self) -> float:
        return self.batch_size / self.seconds


@dataclasses.dataclass
class DeviceTuning:
    """A device's sweep, fit and recommendation."""

    device: Device
    points: list
    fit: SaturationFit
    batch_size: int
    capacity: int
    emulated: bool = False

    @property
    def items_per_s(self) -> float:
        """Throughput at the recommended batch size, from the fit."""
        return self.batch_size / self.fit.time(self.batch_size)


@dataclasses.dataclass
class TuningResult:
    """Every device's tuning, and where the profile and the plot went."""

    model: str
    host: str
    devices: dict  # Device -> DeviceTuning
    mode: str = "async"
    profile_path: str | None = None
    png_path: str | None = None
    identities: dict = dataclasses.field(default_factory=dict)  # Device -> costmodel.DeviceIdentity
    profile_paths: list = dataclasses.field(default_factory=list)  # one per host, and the cost files

    def for_host(self, host) -> "TuningResult":
        """The part of this tuning measured on ``host`` (every device when identities are unknown)."""
        devices = {d: t for d, t in self.devices.items()
                   if d not in self.identities or self.identities[d].host == host}
        return dataclasses.replace(self, host=host, devices=devices, profile_paths=[])

    def speeds(self) -> dict:
        return {d: t.items_per_s for d, t in self.devices.items()}

    def to_profile(self) -> dict:
        return {
            "version": PROFILE_VERSION,
            "model": self.model,
            "host": self.host,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "mode": self.mode,
            "model_formula": "t(N) = t0 * (max(N - n_star, 0) / n_star + 1)",
            "devices": {
                str(d): {
                    "t0": t.fit.t0,
                    "n_star": t.fit.n_star,
                    "rms_log_error": t.fit.rms_log_error,
                    "saturated": t.fit.saturated,
                    "batch_size": t.batch_size,
                    "capacity": t.capacity,
                    "items_per_s": t.items_per_s,
                    "peak_items_per_s": t.fit.peak_items_per_s,
                    "emulated": t.emulated,
                    "hardware": self.identities[d].hardware if d in self.identities else None,
                    "points": [[p.batch_size, p.seconds, p.gap] for p in t.points],
                }
                for d, t in self.devices.items()
            },
        }


def sweep_device(workload, device, *, client=None, mode="async", start=64, max_batch=2**22, max_time=2.0,
                 min_time=0.2, min_repeats=3, max_repeats=50, linear_stop=3, on_point=None) -> list:
    """Time ``workload`` on ``device`` at batch sizes doubling from ``start``.

    Each size runs ``r`` chunks (``min_repeats`` or more, until about
    ``min_time`` seconds) through a :class:`SimpleScheduler` with room for
    one chunk; the worker-side median is kept. The sweep stops past
    ``max_batch``, once a chunk takes over ``max_time`` seconds, or after
    ``linear_stop`` doublings in a row that each doubled the time (the
    device is saturated: more points add nothing).
    """
    workload = workload_from(workload)
    device = Device(device)
    points = []
    n, estimate, linear = start, None, 0
    warm = False
    while n <= max_batch:
        repeats = min_repeats if estimate is None else max(min_repeats, math.ceil(min_time / max(estimate, 1e-9)))
        repeats = min(repeats, max_repeats)
        dispatcher = WorkDispatcher(
            SimpleScheduler(device, n), workload.do_work, preprocess=workload.preprocess,
            postprocess=workload.postprocess, mode=mode, client=client,
        )
        if not warm:  # the first chunk pays for imports and caches: not a measurement
            dispatcher.run(workload.make_work(n))
            warm = True
        dispatcher.run(workload.make_work(n * repeats))
        report = dispatcher.last_run
        records = [r for r in report.records if r.size == n]
        samples = [r.duration for r in records]
        gaps = [b.start - a.stop for a, b in zip(records, records[1:])]
        point = SweepPoint(n, statistics.median(samples), samples, statistics.median(gaps) if gaps else 0.0)
        if points and point.seconds >= 1.8 * points[-1].seconds:
            linear += 1
        else:
            linear = 0
        points.append(point)
        if on_point is not None:
            on_point(device, point)
        if point.seconds > max_time or linear >= linear_stop:
            break
        estimate = 2 * point.seconds
        n *= 2
    return points


def run_tuning(model, devices=None, *, client=None, emulate=False, parameters=None, mode="async", start=64,
               max_batch=2**22, max_time=2.0, min_time=0.2, min_repeats=3, min_chunk_time=0.02,
               png_path=None, profile_dir=None, host=None, save=True, on_point=None) -> TuningResult:
    """Sweep, fit and recommend for every device; save the profile and draw the plot.

    Parameters
    ----------
    model : str, Graph, TuningWorkload or callable
        A built-in model's name (``"j2"``), a graph (its model and
        parameters), a :class:`TuningWorkload`, or ``do_work(work, device)``
        over slices.
    devices : list of str or Device, optional
        Defaults to the graph's devices, else the CPU plus every visible GPU.
    client : distributed.Client, optional
        The cluster whose workers measure (``dsched tune --scheduler-address``):
        each device on the worker that owns it, and its profile saved under
        that worker's host, its cost entry under its hardware (a GPU's model
        name). Without one, a :class:`LocalHybridCluster` over ``devices`` runs the
        sweep (``emulate=True`` lets it claim absent CUDA devices: a
        placement test, not a measurement, and the profile says so).
    mode : {"async", "sync"}
        ``"sync"`` times chunks on this thread, without a cluster.
    start, max_batch, max_time, min_time, min_repeats :
        The sweep (see :func:`sweep_device`).
    min_chunk_time : float
        Seconds a recommended chunk takes at least (Dask's per-task cost).
    png_path : str or path, optional
        Where to draw throughput against sub-batch size.
    profile_dir : str or path, optional
        Where profiles live (default ``$DSCHED_PROFILE_DIR`` or
        ``~/.cache/dsched/profiles``); ``save=False`` writes none.
    host : str, optional
        The profile's host name (default: this machine's).

    Returns
    -------
    TuningResult
    """
    workload = workload_from(model, parameters)
    if devices is None:
        devices = model.devices() if hasattr(model, "devices") and callable(model.devices) else \
            [Device("cpu"), *visible_gpus()]
    devices = parse_devices(devices)
    _check_sweep(devices, mode, start, max_batch, min_repeats, max_time, min_time, min_chunk_time, png_path)
    directory = None if not save else profiles.profile_dir(profile_dir)
    with contextlib.ExitStack() as stack:
        if client is None and mode == "async":
            cluster = stack.enter_context(LocalHybridCluster(devices, emulate=emulate, dashboard_address=None))
            client = stack.enter_context(Client(cluster))
        emulated = emulated_devices(client) if client is not None else {}
        identities = device_identities(devices, client) if client is not None else \
            {d: device_identity(d, emulated=bool(emulated.get(str(placement_device(d)), False))) for d in devices}
        results = {}
        for device in devices:
            points = sweep_device(workload, device, client=client, mode=mode, start=start, max_batch=max_batch,
                                  max_time=max_time, min_time=min_time, min_repeats=min_repeats, on_point=on_point)
            fit = fit_saturation([p.batch_size for p in points], [p.seconds for p in points])
            gap = statistics.median(p.gap for p in points)
            batch, capacity = recommend(fit, min_chunk_time=min_chunk_time, gap=gap)
            results[device] = DeviceTuning(device, points, fit, batch, capacity,
                                           bool(emulated.get(str(placement_device(device)), False)))
    hosts = sorted({identities[d].host for d in devices})
    result = TuningResult(workload.name, host or (hosts[0] if len(hosts) == 1 else profiles.this_host()), results,
                          mode, identities=identities)
    if directory is not None:
        _save_tuning(result, workload.name, identities, hosts, host, directory)
    if png_path is not None:
        result.png_path = str(plot_throughput(result, png_path))
    return result


def _check_sweep(devices, mode, start, max_batch, min_repeats, max_time, min_time, min_chunk_time, png_path):
    """ValueError naming the first bad argument of :func:`run_tuning`, before any cluster starts."""
    if not devices:
        raise ValueError("devices: at least one device is required, got none")
    if mode not in ("sync", "async"):
        raise ValueError(f"mode: expected 'sync' or 'async', got {mode!r}")
    for field, value in [("start", start), ("max_batch", max_batch), ("min_repeats", min_repeats)]:
        check_positive_int(value, field, integers=int, below=None)
    if max_batch < start:
        raise ValueError(f"max_batch: {max_batch} is below start {start}")
    for field, value in [("max_time", max_time), ("min_time", min_time), ("min_chunk_time", min_chunk_time)]:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{field}: expected a number of seconds >= 0, got {value!r}")
    if png_path is not None:
        _check_parent(png_path, "png_path")


def _save_tuning(result, name, identities, hosts, host, directory):
    """Write the tuning's profile (one per host of the cluster) and each device's cost entry."""
    if host is not None or len(hosts) == 1:
        result.profile_paths = [str(save_profile(result, directory))]
    else:  # a cluster across hosts: each host's profile holds what its workers measured
        result.profile_paths = [str(save_profile(result.for_host(h), directory)) for h in hosts]
    for device, tuning in result.devices.items():
        identity = identities[device] if host is None else dataclasses.replace(identities[device], host=host)
        entry = {"t0": tuning.fit.t0, "n_star": tuning.fit.n_star, "rms_log_error": tuning.fit.rms_log_error,
                 "saturated": tuning.fit.saturated, "samples": sum(len(p.samples) for p in tuning.points),
                 "items_per_s": tuning.fit.peak_items_per_s, "source": "dsched tune"}
        result.profile_paths.append(str(save_costs(name, identity, device, entry, directory)))
    result.profile_path = result.profile_paths[0]


def _check_parent(path, field):
    parent = Path(os.fspath(path)).absolute().parent
    if not parent.is_dir():
        raise ValueError(f"{field}: the folder {parent} does not exist")


# --- output -----------------------------------------------------------------

def plot_throughput(result: TuningResult, png_path) -> Path:
    """Throughput against sub-batch size, measured and fitted, one line per device (PNG, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (device, tuning) in enumerate(result.devices.items()):
        color = f"C{i}"
        label = f"{device}{' (emulated)' if tuning.emulated else ''}"
        sizes = np.array([p.batch_size for p in tuning.points], dtype=float)
        ax.loglog(sizes, [p.items_per_s for p in tuning.points], "o", color=color, label=f"{label}: measured")
        grid = np.geomspace(sizes.min(), sizes.max(), 200)
        ax.loglog(grid, grid / np.asarray(tuning.fit.time(grid)), "-", color=color,
                  label=f"{label}: fit t0={tuning.fit.t0 * 1e3:.3g} ms, N*={tuning.fit.n_star:,.0f}")
        ax.axvline(tuning.batch_size, color=color, linestyle=":", linewidth=1)
    ax.set_xlabel("sub-batch size N (items per chunk)")
    ax.set_ylabel("throughput (items/s)")
    ax.set_title(f"{result.model} on {result.host}: dotted lines mark the recommended batch sizes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(os.fspath(png_path))
    fig.savefig(path, format="png")
    return path


def format_tuning(result: TuningResult) -> str:
    """The per-device table of a tuning, as text."""
    header = (f"{'device':<10} {'emulated':<9} {'t0 ms':>9} {'N*':>10} {'saturated':>9} "
              f"{'batch':>9} {'capacity':>9} {'items/s':>12}")
    lines = [header, "-" * len(header)]
    for device, t in result.devices.items():
        lines.append(
            f"{str(device):<10} {'yes' if t.emulated else 'no':<9} {t.fit.t0 * 1e3:>9.3f} {t.fit.n_star:>10,.0f} "
            f"{'yes' if t.fit.saturated else 'no':>9} {t.batch_size:>9} {t.capacity:>9} {t.items_per_s:>12,.0f}"
        )
    for device, identity in result.identities.items():
        lines.append(f"{device}: measured on {identity.host} ({identity.key})")
    if any(t.emulated for t in result.devices.values()):
        lines.append("emulated devices computed with NumPy on the CPU: their numbers are not a GPU measurement")
    for path in result.profile_paths or ([result.profile_path] if result.profile_path else []):
        lines.append(f"profile: {path}")
    if result.png_path:
        lines.append(f"plot: {result.png_path}")
    return "\n".join(lines)
