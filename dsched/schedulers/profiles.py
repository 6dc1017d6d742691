"""The profile store: where saved speed profiles live on disk, and reading and writing them.

``dsched tune`` (:mod:`dsched.tuning`) measures the devices and saves what it
found as a profile per host and model
(``<profile dir>/<host>/<model>.json``, the folder ``$DSCHED_PROFILE_DIR`` or
``~/.cache/dsched/profiles``); the policies read profiles back:
:func:`profile_speeds` for ``plan()``, :func:`profile_settings` for graph
files and schedulers, :func:`load_profile` for a saved fit. The cost files of
:mod:`dsched.costmodel` live in the same folders, named and written by the
same helpers (:func:`profile_dir`, :func:`safe_name`, :func:`this_host`,
:func:`write_json`).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from dsched.devices.device import Device, parse_devices, placement_device

__all__ = [
    "PROFILE_VERSION",
    "this_host",
    "profile_dir",
    "safe_name",
    "write_json",
    "profile_path",
    "save_profile",
    "load_profile",
    "profile_speeds",
    "profile_settings",
]

PROFILE_VERSION = 1


# --- where files live -----------------------------------------------------------

def this_host() -> str:
    """This machine's name, as profiles and cost files are filed under."""
    return socket.gethostname() or "localhost"


def profile_dir(directory=None) -> Path:
    """Where profiles live: ``directory``, else ``$DSCHED_PROFILE_DIR``, else ``~/.cache/dsched/profiles``."""
    if directory is None:
        directory = os.environ.get("DSCHED_PROFILE_DIR") or Path.home() / ".cache" / "dsched" / "profiles"
    return Path(os.fspath(directory))


def safe_name(name: str) -> str:
    """A name as a file or folder name (``cuda:0`` -> ``cuda_0``)."""
    return "".join(c if c.isalnum() or c in "-_.:" else "_" for c in name).replace(":", "_")


def write_json(path: Path, data) -> Path:
    """Write ``data`` as indented JSON to ``path`` (its folder made first); the file's path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)  # a reader never sees half a file
    return path


# --- profiles -----------------------------------------------------------------

def profile_path(model, host=None, directory=None) -> Path:
    """``<profile dir>/<host>/<model>.json``."""
    return profile_dir(directory) / safe_name(host or this_host()) / f"{safe_name(model)}.json"


def save_profile(result, directory=None) -> Path:
    """Write ``result`` (a ``dsched.tuning.TuningResult``) as the profile of its host and model; the file's path."""
    return write_json(profile_path(result.model, result.host, directory), result.to_profile())


_cache: dict = {}


def load_profile(model=None, *, host=None, directory=None) -> dict | None:
    """The saved profile of ``model`` on ``host`` (this machine by default), or ``None``.

    With ``model=None``, the host's most recently saved profile.
    """
    if model is None:
        folder = profile_dir(directory) / safe_name(host or this_host())
        # The cost files of dsched.costmodel live beside the profiles: not profiles.
        candidates = sorted((p for p in folder.glob("*.json") if not p.name.endswith(".costs.json")),
                            key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        if not candidates:
            return None
        path = candidates[-1]
    else:
        path = profile_path(model, host, directory)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    cached = _cache.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    _cache[path] = (stamp, data)
    return data


def _entries(profile, devices, usable=None) -> list | None:
    """Each device's entry in ``profile`` (a bare ``cuda`` reads ``cuda:0``'s), in order.

    ``None`` when a device has no entry, or one that ``usable(entry)`` rejects.
    """
    entries = profile.get("devices", {})
    chosen = []
    for device in devices:
        entry = entries.get(str(placement_device(device))) or entries.get(str(device))
        if entry is None or (usable is not None and not usable(entry)):
            return None
        chosen.append(entry)
    return chosen


def profile_speeds(scheduler, model=None, *, host=None, directory=None) -> dict | None:
    """``{Device: items per second}`` for the scheduler's devices from the profile in effect, or ``None``.

    ``None`` when there is no profile, or it lacks one of the devices (a
    partial profile would skew a plan). Devices are keyed as the scheduler
    lists them; a bare ``cuda`` reads ``cuda:0``'s entry.
    """
    profile = load_profile(model, host=host, directory=directory)
    if not profile:
        return None
    devices = scheduler.devices
    chosen = _entries(profile, devices, usable=lambda entry: entry.get("items_per_s", 0) > 0)
    if chosen is None:
        return None
    return {Device(device): float(entry["items_per_s"]) for device, entry in zip(devices, chosen)}


def profile_settings(devices, model=None, *, host=None, directory=None) -> dict | None:
    """The profile's recommendation for ``devices`` (in their order), for graph files and schedulers.

    Returns ``{"batch_sizes": [...], "capacities": [...], "items_per_s": [...]}``
    or ``None`` when there is no profile or it lacks a device.

    Examples
    --------
    >>> settings = profile_settings(["cpu", "cuda:0"], "j2")  # doctest: +SKIP
    >>> StaticHybridScheduler(["cpu", "cuda:0"], settings["batch_sizes"], settings["capacities"])  # doctest: +SKIP
    """
    profile = load_profile(model, host=host, directory=directory)
    if not profile:
        return None
    chosen = _entries(profile, parse_devices(devices))
    if chosen is None:
        return None
    return {
        "batch_sizes": [int(e["batch_size"]) for e in chosen],
        "capacities": [int(e["capacity"]) for e in chosen],
        "items_per_s": [float(e["items_per_s"]) for e in chosen],
    }
