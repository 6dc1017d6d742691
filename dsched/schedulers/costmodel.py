"""The cost of a chunk on a device: NEML2's saturation model, calibrated online, kept per host and device.

NEML2 (``doc/content/development/benchmarking.md``) models the time of a
sub-batch of ``N`` items on one device as

    t(N) = t0 * (<N - N*> / N* + 1),        <x> = max(x, 0)

a flat ``t0`` until the device is full at ``N*`` items, linear beyond it, so
the throughput ``N / t(N)`` rises to its peak ``N* / t0`` and stays there.
This module holds that model and everything that feeds it:

- :func:`fit_saturation`: the least-squares fit of ``t0`` and ``N*`` in log
  time (``dsched tune`` fits a sweep with it; the online calibration refits
  the chunks a device has run);
- :class:`DeviceCalibration`: StarPU's calibration rules applied to one
  device's chunks (at least 10 samples before the model counts as
  calibrated, the first sample discarded since it pays for imports and
  caches, outliers dropped by their distance from the fit);
- :func:`device_identity`: what runs a device (its host and its hardware: a
  GPU's model name from CuPy or NVML, the CPU's model name), read where the
  device's worker runs, so profiles are keyed by what measured them rather
  than by ``cuda:0``;
- cost files, one per host and model
  (``<profile dir>/<host>/<model>.costs.json``), holding a fit per hardware.

Examples
--------
>>> t = saturation_time([100, 1000, 4000], t0=0.01, n_star=1000)
>>> [round(x, 3) for x in t]
[0.01, 0.01, 0.04]
>>> fit = fit_saturation([256, 512, 1024, 2048, 4096], [0.01, 0.01, 0.01024, 0.02048, 0.04096])
>>> round(fit.t0, 4), round(fit.n_star)
(0.01, 1000)
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np

from dsched.devices.context import worker_device, worker_is_emulated
from dsched.devices.cuda import cuda_local_ordinal
from dsched.devices.device import Device, placement_device
from dsched.schedulers.profiles import profile_dir, safe_name, this_host, write_json

__all__ = [
    "saturation_time",
    "SaturationFit",
    "fit_saturation",
    "DeviceCalibration",
    "DeviceIdentity",
    "device_identity",
    "device_identities",
    "profile_dir",
    "costs_path",
    "save_costs",
    "load_costs",
    "MIN_SAMPLES",
]

MIN_SAMPLES = 10  # StarPU's calibration minimum: a model fitted on fewer samples is a guess
COSTS_VERSION = 1


# --- the model ----------------------------------------------------------------

def saturation_time(n, t0, n_star):
    """NEML2's ``t(N) = t0 * (<N - N*>/N* + 1)`` for a number or an array of batch sizes."""
    n = np.asarray(n, dtype=float)
    t = t0 * (np.maximum(n - n_star, 0.0) / n_star + 1.0)
    return t.tolist() if t.ndim else float(t)


@dataclasses.dataclass(frozen=True)
class SaturationFit:
    """``t0`` (seconds), ``n_star`` (items), the rms error of ``log t``, and whether the sweep saw saturation."""

    t0: float
    n_star: float
    rms_log_error: float
    saturated: bool

    @property
    def peak_items_per_s(self) -> float:
        return self.n_star / self.t0

    def time(self, n):
        return saturation_time(n, self.t0, self.n_star)

    def seconds(self, n) -> float:
        """``t(n)`` for one size, in plain Python (the scheduler calls it per chunk)."""
        return self.t0 * (max(n - self.n_star, 0.0) / self.n_star + 1.0)

    def size_for(self, seconds) -> float:
        """The largest ``N`` with ``t(N) <= seconds`` (``N*`` when even the flat part takes longer)."""
        return self.n_star * max(seconds / self.t0, 1.0)


def fit_saturation(batch_sizes, seconds, weights=None) -> SaturationFit:
    """Least-squares fit of the saturation model in log time (every sample weighs the same).

    For a given ``N*`` the best ``log t0`` is a mean, so only ``N*`` is
    searched: on a log grid over the sizes seen (and a factor 4 beyond), then
    on finer grids around the best, all vectorised (the online calibration
    refits while chunks run). ``saturated`` is False when the fit puts ``N*``
    at an end of the sizes (the device never left its flat part, or never
    was in it): then ``N*`` is a bound, not a measurement. ``weights`` (one
    per sample, default all 1) let one mean stand for many samples of a size.
    """
    n = np.asarray(batch_sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if n.ndim != 1 or n.shape != t.shape or n.size < 2:
        raise ValueError(f"batch_sizes: expected at least two sizes matching the times, got {n.size} sizes and {t.size} times")
    if np.any(n < 1) or np.any(t <= 0) or not np.all(np.isfinite(t)):
        raise ValueError("seconds: every batch size must be >= 1 and every time positive and finite")
    log_t = np.log(t)
    w = np.ones_like(n) if weights is None else np.asarray(weights, dtype=float)
    w = w / w.sum()

    def costs(log_n_stars):
        n_stars = np.exp(log_n_stars)[:, None]
        log_g = np.log(np.maximum(n[None, :] - n_stars, 0.0) / n_stars + 1.0)
        log_t0 = (log_t[None, :] - log_g) @ w
        return ((log_t[None, :] - log_t0[:, None] - log_g) ** 2) @ w, log_t0

    lo, hi = math.log(n.min()) - math.log(4.0), math.log(n.max()) + math.log(4.0)
    grid = np.linspace(lo, hi, 129)
    for _ in range(7):  # each round zooms 8x around the best point: far below 1e-6 relative in N*
        cost, _ = costs(grid)
        best = int(np.argmin(cost))
        step = grid[1] - grid[0]
        grid = np.linspace(grid[best] - step, grid[best] + step, 17)
    cost, log_t0 = costs(grid)
    best = int(np.argmin(cost))
    n_star = math.exp(grid[best])
    saturated = bool(n.min() < n_star < n.max())
    return SaturationFit(math.exp(float(log_t0[best])), n_star, math.sqrt(max(float(cost[best]), 0.0)), saturated)


# --- online calibration -------------------------------------------------------

class DeviceCalibration:
    """One device's chunk timings and the saturation model fitted to them (StarPU's rules).

    ``add(n, seconds)`` records a chunk. The first sample is discarded (it
    pays for imports, caches, JIT); the model is *calibrated* once
    ``min_samples`` samples are kept. Outliers (a chunk that waited behind
    another program, a paused worker) are dropped before the fit: samples
    whose log time lies more than ``outlier_mads`` median absolute
    deviations (at least 25 %) from a first fit. Only the last ``per_size``
    samples of each size, and the ``sizes`` sizes seen last, are kept: a
    device whose speed changes is followed, and the few small chunks that
    show its fixed cost are not pushed out by hundreds of full-size ones.
    Until it is calibrated, ``fit`` is ``prior`` (a saved fit) where there is
    one; without a prior, the best guess from what has run so far.
    """

    def __init__(self, prior: SaturationFit | None = None, *, min_samples=MIN_SAMPLES, per_size=64, sizes=32,
                 outlier_mads=3.0, discard_first=True):
        self.prior = prior
        self.min_samples = int(min_samples)
        self.per_size, self.max_sizes = int(per_size), int(sizes)
        self.outlier_mads = float(outlier_mads)
        self._discard = bool(discard_first)
        self._by_size: dict = {}  # size -> deque of seconds, least recently added size first
        self._count = 0
        self.seen = 0  # samples offered, the discarded first included
        self.dropped = 0  # outliers left out of the last fit
        self._fit = None
        self._fitted_at = -1
        self._first = None  # the discarded first sample, (n, seconds)

    @property
    def samples(self) -> int:
        """Samples kept (the discarded first and anything past the window excluded)."""
        return self._count

    @property
    def calibrated(self) -> bool:
        return self.samples >= self.min_samples

    def add(self, n, seconds) -> None:
        """Record a chunk of ``n`` items that took ``seconds`` on the device."""
        if not (n >= 1 and seconds > 0 and math.isfinite(seconds)):
            return  # a zero-time or broken sample says nothing about the device
        self.seen += 1
        if self._discard and self.seen == 1:
            self._first = (float(n), float(seconds))
            return
        times = self._by_size.pop(float(n), None)
        if times is None:
            times = collections.deque(maxlen=self.per_size)
        self._count -= len(times)
        times.append(float(seconds))
        self._by_size[float(n)] = times  # re-inserted: the most recently added size is last
        self._count += len(times)
        while len(self._by_size) > self.max_sizes:
            self._count -= len(self._by_size.pop(next(iter(self._by_size))))

    @property
    def fit(self) -> SaturationFit | None:
        """The model from the kept samples (refitted lazily), the prior while there are none.

        With samples of a single size, the device is taken as linear
        (``N* = 1``) at the throughput measured there.
        """
        if self.prior is not None and not self.calibrated:
            return self.prior  # a saved calibration beats a few fresh samples
        if not self._by_size:
            if self._first is not None:  # only the discarded first: better than nothing until the next
                n, t = self._first
                return SaturationFit(t / n, 1.0, 0.0, False)
            return None
        count = self.seen
        if self._fit is not None and self._fitted_at == count:
            return self._fit
        if self._fit is not None and count - self._fitted_at < min(16, self.samples // 4):
            return self._fit  # refit with every sample at first, then every few (a fit costs ~0.3 ms)
        self._fit, self._fitted_at = self._refit(), count
        return self._fit

    def _refit(self) -> SaturationFit:
        n = np.concatenate([np.full(len(t), size) for size, t in self._by_size.items()])
        t = np.concatenate([np.asarray(t) for t in self._by_size.values()])
        if np.unique(n).size < 2:
            # One size says nothing of t0 against N*: take the device as linear (N* = 1), so
            # the next chunks are sized by the throughput measured and a second size is seen.
            low = float(np.exp(np.percentile(np.log(t), 25)))  # as _grouped_fit takes a size's time
            self.dropped = 0
            return SaturationFit(low / float(n[0]), 1.0, float(np.std(np.log(t))), False)
        fit = _grouped_fit(n, t)
        if self.calibrated:
            residual = np.log(t) - np.log(np.asarray(fit.time(n)))
            center = np.median(residual)
            mad = 1.4826 * np.median(np.abs(residual - center))
            keep = np.abs(residual - center) <= max(self.outlier_mads * mad, math.log(1.25))
            self.dropped = int(np.size(keep) - np.count_nonzero(keep))
            if self.dropped and np.unique(n[keep]).size >= 2:
                fit = _grouped_fit(n[keep], t[keep])
        return fit

    def to_dict(self) -> dict:
        fit = self.fit
        return {"t0": fit.t0, "n_star": fit.n_star, "rms_log_error": fit.rms_log_error,
                "saturated": fit.saturated, "samples": self.samples, "dropped": self.dropped,
                "items_per_s": fit.peak_items_per_s}


def _grouped_fit(n, t) -> SaturationFit:
    """The fit to one time per size (the low quartile of its samples), weighted by the size's count.

    On a shared machine noise only adds time (a chunk that waited for the
    GIL, a lock, a late wake-up is never faster than its device), so a size's
    low quartile is its device's time and the rest are its waits; a mean
    would learn the waits and make every chunk smaller than it should be.
    Fitting one time per size costs a few sizes instead of hundreds of samples.
    """
    sizes, index, counts = np.unique(n, return_inverse=True, return_counts=True)
    log_t = np.log(t)
    low = np.array([np.percentile(log_t[index == i], 25) for i in range(sizes.size)])
    fit = fit_saturation(sizes, np.exp(low), weights=counts)
    within = log_t - low[index]
    rms = math.sqrt(fit.rms_log_error ** 2 + float(np.mean(within ** 2)))
    return SaturationFit(fit.t0, fit.n_star, rms, fit.saturated)


# --- what runs a device ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DeviceIdentity:
    """Where a device is and what it is: its host, its hardware's name, and whether it is emulated."""

    host: str
    hardware: str
    emulated: bool = False

    @property
    def key(self) -> str:
        """The key of its cost entry: the hardware, marked when emulated (never mistaken for a GPU)."""
        return f"emulated {self.hardware}" if self.emulated else self.hardware


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu {line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()}"


def _gpu_name(device: Device) -> str | None:
    """The GPU's model name from CuPy (its runtime's view under CUDA_VISIBLE_DEVICES), else NVML."""
    try:
        ordinal = cuda_local_ordinal(device)
    except Exception:
        ordinal = device.index or 0
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(ordinal)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(device.index or 0))
            return name.decode() if isinstance(name, bytes) else str(name)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def device_identity(device, *, emulated=False) -> DeviceIdentity:
    """What runs ``device`` in this process: this host, and the GPU's or the CPU's model name.

    An emulated device, or a CUDA device neither CuPy nor NVML knows here, is
    named by its device string (``emulated cuda:0``): its speed is whatever
    the emulation makes it, never a GPU's.
    """
    device = placement_device(Device(device))
    if emulated or device.type == "cpu":
        hardware = str(device) if emulated else _cpu_name()
    else:
        hardware = _gpu_name(device)
        if hardware is None:  # neither CuPy nor NVML knows it: no GPU of that number here, so emulated
            hardware, emulated = str(device), True
    return DeviceIdentity(this_host(), hardware, bool(emulated))


def _worker_identity(dask_worker=None):
    device = worker_device(dask_worker)
    if device is None:
        return None
    identity = device_identity(device, emulated=worker_is_emulated(dask_worker))
    return str(device), dataclasses.asdict(identity)


def device_identities(devices, client=None, unowned=None) -> dict:
    """``{Device: DeviceIdentity}``: read on the worker that owns each device, else here.

    With a ``client``, every worker reports its host and hardware; a device
    owned by several workers takes the first listed. Devices no worker owns
    (or every device, without a client) are identified in this process, and
    added to the list ``unowned`` if one is given.
    """
    devices = [Device(d) for d in devices]
    found = {}
    if client is not None:
        reports = client.run(_worker_identity)
        for _address, report in sorted(reports.items()):
            if report is not None:
                found.setdefault(Device(report[0]), DeviceIdentity(**report[1]))
    if unowned is not None:
        unowned.extend(d for d in devices if placement_device(d) not in found)
    return {d: found.get(placement_device(d)) or device_identity(d) for d in devices}


# --- cost files -------------------------------------------------------------------
# They live beside the profiles (dsched.schedulers.profiles), named and written by its helpers.

def costs_path(model, host=None, directory=None) -> Path:
    """``<profile dir>/<host>/<model>.costs.json``."""
    return profile_dir(directory) / safe_name(host or this_host()) / f"{safe_name(model)}.costs.json"


def load_costs(model, host=None, directory=None) -> dict:
    """``{hardware key: entry}`` of a host's cost file for ``model`` (empty when there is none)."""
    try:
        data = json.loads(costs_path(model, host, directory).read_text())
    except (OSError, ValueError):
        return {}
    entries = data.get("devices") if isinstance(data, dict) else None
    return entries if isinstance(entries, dict) else {}


def fit_of(entry) -> SaturationFit | None:
    """The :class:`SaturationFit` of a cost or profile entry, or ``None`` when it has none."""
    try:
        t0, n_star = float(entry["t0"]), float(entry["n_star"])
    except (KeyError, TypeError, ValueError):
        return None
    if not (t0 > 0 and n_star >= 1 and math.isfinite(t0) and math.isfinite(n_star)):
        return None
    return SaturationFit(t0, n_star, float(entry.get("rms_log_error", 0.0)), bool(entry.get("saturated", True)))


def save_costs(model, identity: DeviceIdentity, device, entry: dict, directory=None) -> Path:
    """Merge ``entry`` (a fit as :meth:`DeviceCalibration.to_dict` gives) into its host's cost file."""
    entries = load_costs(model, identity.host, directory)
    entries[identity.key] = {**entry, "device": str(device), "hardware": identity.hardware,
                             "emulated": identity.emulated, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    data = {"version": COSTS_VERSION, "model": model, "host": identity.host,
            "model_formula": "t(N) = t0 * (max(N - n_star, 0) / n_star + 1)", "devices": entries}
    return write_json(costs_path(model, identity.host, directory), data)
