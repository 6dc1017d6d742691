"""Benchmark of the scheduling policies on emulated devices of known speed, each against the same peers.

Every device here is emulated, the CPU included (:mod:`dsched.bench`'s
devices: a chunk of ``n`` items sleeps ``t0 + n / rate`` holding its device's
lock): this measures scheduling, never a device, and says nothing about a
GPU. In one run, on one cluster, with the ways interleaved in every repeat
(so a busy moment of this shared machine hits them alike), and the median
of the repeats reported:

- ``hybrid``: a CPU at 200k items/s and two CUDA devices at 1M items/s,
  ``t0`` = 1 ms, 4M items, chunks of 10 ms on the CPU and 20 ms on the CUDA
  devices (and a second row set with them halved): plain ``client.map``
  (uniform chunks, Dask's placement), a thread-per-device loop (NEML2-like),
  :class:`StaticHybridScheduler` (batch sizes proportional to speed, two
  chunks of capacity) and :class:`PerformanceModelScheduler` (its models
  calibrated by an earlier run). Efficiency is items/s over
  ``sum_d b_d / (t0 + b_d / r_d)``, every device busy back to back on the
  way's own chunks ``b_d``: ``rate x duration`` for the first three (each
  chunk then takes ``t0`` longer), and for the policy the median of the
  chunks it ran (its model sizes them to take those durations ``t0``
  included, so about 10 % smaller at 10 ms);
- ``fast``: a CPU at 10k items/s beside a CUDA device 150 times faster:
  the fast device alone (a :class:`SimpleScheduler`), both under
  StaticHybridScheduler, both under the new policy; the ratio of each wall
  time to the fast device's alone;
- ``learning``: the hybrid devices with speeds unknown at the start: a new
  policy with no saved model runs 4M items (the first run), saves its
  models, and a second new policy reading them runs 4M items again.

Examples
--------
>>> results = run_policy_benchmarks(quick=True)   # doctest: +SKIP
>>> print(format_policy_table(results))           # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import statistics
import tempfile

from dsched.apps.bench.scheduling import (
    EmulatedDevice,
    _DoWork,
    _run_client_map,
    _run_threads,
    _settle,
    ideal_items_per_s,
    timed_dispatch,
)
from dsched.cluster.local import LocalHybridCluster
from dsched.schedulers import PerformanceModelScheduler, SimpleScheduler, StaticHybridScheduler
from dsched.schedulers.model import wait_for_saves
from dsched.apps.bench.scheduling import verdict

__all__ = ["HYBRID_DEVICES", "FAST_PAIR", "run_policy_benchmarks", "format_policy_table"]

HYBRID_DEVICES = (
    EmulatedDevice("cpu", 200_000.0),
    EmulatedDevice("cuda:0", 1_000_000.0),
    EmulatedDevice("cuda:1", 1_000_000.0),
)
FAST_PAIR = (EmulatedDevice("cpu", 10_000.0), EmulatedDevice("cuda:0", 1_500_000.0))
MODEL = "bench-emulated"
PEERS = ("client.map", "threads")  # the ways that are not dsched's: the others are timed on feeds they hold


def _speeds(devices):
    return {d.device: (d.t0, d.rate) for d in devices}


def _dispatch(client, scheduler, devices, total, chunk_sizes=None):
    """One run of ``total`` items under ``scheduler``: (wall seconds, {device: items}); ``chunk_sizes`` as
    :func:`timed_dispatch` fills it."""
    return timed_dispatch(client, scheduler, _DoWork(_speeds(devices)), total, chunk_sizes)


def _static(devices, sizes):
    return StaticHybridScheduler([d.device for d in devices], sizes, [2 * b for b in sizes], [d.rate for d in devices])


def _policy(devices, chunk_seconds, profile_dir, client):
    return PerformanceModelScheduler([d.device for d in devices], model=MODEL, chunk_seconds=list(chunk_seconds),
                                     profile_dir=profile_dir, client=client)


def _calibrate(client, devices, chunk_seconds, total, profile_dir):
    """Run the policy once with nothing known, so the timed runs start from saved models."""
    _dispatch(client, _policy(devices, chunk_seconds, profile_dir, client), devices, total)


def _hybrid(client, devices, chunk_seconds, total, repeats, map_chunks, profile_dir, say):
    sizes = [max(1, round(d.rate * s)) for d, s in zip(devices, chunk_seconds)]
    map_chunk = -(-total // map_chunks)
    speeds = _speeds(devices)
    _calibrate(client, devices, chunk_seconds, total, profile_dir)
    policy_chunks = []  # the policy's median chunk per device, per run: its own chunks take chunk_seconds, t0 included
    ways = {
        "client.map": (lambda: _run_client_map(client, devices, total, map_chunk, speeds), [map_chunk] * len(devices)),
        "threads": (lambda: _run_threads(client, devices, total, sizes, speeds), sizes),
        "StaticHybridScheduler": (lambda: _dispatch(client, _static(devices, sizes), devices, total), sizes),
        "PerformanceModelScheduler": (
            lambda: _dispatch(client, _policy(devices, chunk_seconds, profile_dir, client), devices, total,
                              policy_chunks), None),
    }
    rows = _interleave(client, ways, repeats, devices)
    for name, row in rows.items():
        own = ways[name][1] or [round(statistics.median(run.get(d.device, 0) for run in policy_chunks))
                                for d in devices]
        row["ideal_chunk_sizes"] = list(own)
        row["ideal_items_per_s"] = ideal_items_per_s(devices, own)
        row["items_per_s"] = total / row["wall_s"]
        row["efficiency"] = row["items_per_s"] / row["ideal_items_per_s"]
        row["efficiency_all"] = [total / w / row["ideal_items_per_s"] for w in row["wall_s_all"]]
        say(f"hybrid {chunk_seconds}: {name} efficiency {row['efficiency']:.3f}")
    return {"chunk_seconds": dict(zip((d.device for d in devices), chunk_seconds)), "batch_sizes": sizes,
            "rows": rows}


def _interleave(client, ways, repeats, devices):
    """Run every way once per repeat, in turn; the median wall time and the split of the median run.

    Each repeat of a dsched way (any but :data:`PEERS`) is timed on feeds it holds, as a program calling dsched
    again and again runs: :func:`_settle` lets the last way's feeds go, so an untimed run of a few items takes
    the devices first, and its own seconds (starting the feeds: a scheduler round trip per device) are kept
    beside the row as ``take_s``.
    """
    walls = {name: [] for name in ways}
    splits = {name: [] for name in ways}
    takes = {name: [] for name in ways}
    for _ in range(repeats):
        for name, (run, _sizes) in ways.items():
            _settle(client)
            if name not in PEERS:
                takes[name].append(_take_devices(client, devices))
            wall, split = run()
            walls[name].append(wall)
            splits[name].append(split)
    rows = {}
    for name in ways:
        wall = statistics.median(walls[name])
        nearest = min(range(repeats), key=lambda i: abs(walls[name][i] - wall))
        rows[name] = {"wall_s": wall, "wall_s_all": walls[name], "items_per_device": splits[name][nearest]}
        if takes[name]:
            rows[name]["take_s"] = statistics.median(takes[name])
    return rows


def _take_devices(client, devices) -> float:
    """Seconds of a run of two one-item chunks per device: it starts a feed on each, which the next run takes."""
    return _dispatch(client, _static(devices, [1] * len(devices)), devices, 2 * len(devices))[0]


def _fast_pair(client, devices, chunk_seconds, total, repeats, profile_dir, say):
    fast = max(devices, key=lambda d: d.rate)
    sizes = [max(1, round(d.rate * chunk_seconds)) for d in devices]
    fast_size = max(1, round(fast.rate * chunk_seconds))
    seconds = [chunk_seconds] * len(devices)
    _calibrate(client, devices, seconds, total, profile_dir)
    ways = {
        f"{fast.device} alone": (lambda: _dispatch(client, SimpleScheduler(fast.device, fast_size, 2 * fast_size),
                                                   devices, total), None),
        "StaticHybridScheduler": (lambda: _dispatch(client, _static(devices, sizes), devices, total), None),
        "PerformanceModelScheduler": (lambda: _dispatch(client, _policy(devices, seconds, profile_dir, client),
                                                        devices, total), None),
    }
    rows = _interleave(client, ways, repeats, devices)
    alone = rows[f"{fast.device} alone"]["wall_s_all"]
    for name, row in rows.items():
        ratios = [w / a for w, a in zip(row["wall_s_all"], alone)]  # each against the same repeat's fast device
        row["vs_alone"] = statistics.median(ratios)
        row["vs_alone_all"] = ratios
        say(f"fast pair: {name} {row['vs_alone']:.3f} of {fast.device} alone")
    return {"fast_device": fast.device, "chunk_seconds": chunk_seconds, "rows": rows}


def _learning(client, devices, chunk_seconds, total, repeats, say):
    sizes = [max(1, round(d.rate * s)) for d, s in zip(devices, chunk_seconds)]
    ideal = ideal_items_per_s(devices, sizes)
    first, second, splits = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="dsched-bench-costs-") as folder:  # nothing known at the start
            _settle(client)
            wall, split = _dispatch(client, _policy(devices, chunk_seconds, folder, client), devices, total)
            first.append(total / wall / ideal)
            _settle(client)
            wall, split2 = _dispatch(client, _policy(devices, chunk_seconds, folder, client), devices, total)
            second.append(total / wall / ideal)
            splits.append((split, split2))
            wait_for_saves()  # its cost files are written off the dispatcher's thread: before the folder goes
    say(f"learning: first run {statistics.median(first):.3f}, second {statistics.median(second):.3f} of the ideal")
    return {"ideal_items_per_s": ideal, "batch_sizes": sizes, "first_run_efficiency": statistics.median(first),
            "second_run_efficiency": statistics.median(second), "first_all": first, "second_all": second,
            "items_per_device": splits[len(splits) // 2]}


def run_policy_benchmarks(json_path=None, quick=False, *, total=None, repeats=None, processes=False, client=None,
                          progress=None) -> dict:
    """Run the three suites (hybrid at two chunk lengths, the fast pair, learning); the results.

    ``quick``: 1M items and two repeats (a minute or so); the full run is 4M
    items and five repeats. ``client``: a cluster whose workers own cpu,
    cuda:0 and cuda:1 (emulated); by default an in-process
    :class:`LocalHybridCluster` is started and closed.
    """
    total = total or (1_000_000 if quick else 4_000_000)
    repeats = repeats or (2 if quick else 5)
    say = progress or (lambda line: None)
    from distributed import Client

    results = {"config": {
        "total_items": total, "repeats": repeats, "quick": quick, "processes": processes,
        "hybrid_devices": [dataclasses.asdict(d) for d in HYBRID_DEVICES],
        "fast_pair": [dataclasses.asdict(d) for d in FAST_PAIR],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "load_average": os.getloadavg(),
        "emulation": "every device sleeps t0 + n/rate per chunk holding its lock: scheduling is measured, not any device",
    }}
    with contextlib.ExitStack() as stack:
        if client is None:
            cluster = stack.enter_context(LocalHybridCluster([d.device for d in HYBRID_DEVICES], emulate=True,
                                                             processes=processes, dashboard_address=None))
            client = stack.enter_context(Client(cluster))
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="dsched-bench-costs-"))
        _dispatch(client, _static(HYBRID_DEVICES, [1000] * 3), HYBRID_DEVICES, 30_000)  # warm-up
        results["hybrid"] = [
            _hybrid(client, HYBRID_DEVICES, seconds, total, repeats, 100, os.path.join(folder, f"h{i}"), say)
            for i, seconds in enumerate([(0.01, 0.02, 0.02), (0.005, 0.01, 0.01)])
        ]
        results["fast"] = _fast_pair(client, FAST_PAIR, 0.02, total, repeats, os.path.join(folder, "fast"), say)
        results["learning"] = _learning(client, HYBRID_DEVICES, (0.01, 0.02, 0.02), total, repeats, say)
        wait_for_saves()
    results["config"]["load_average_after"] = os.getloadavg()
    results["targets"] = _targets(results)
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _targets(results) -> dict:
    long, short = (h["rows"]["PerformanceModelScheduler"]["efficiency"] for h in results["hybrid"])
    return {
        "hybrid efficiency >= 0.99 with 10-20 ms chunks": long >= 0.99,
        "hybrid efficiency >= 0.985 with 5-10 ms chunks": short >= 0.985,
        "with a device 150x faster, within 2 % of it alone": results["fast"]["rows"]["PerformanceModelScheduler"]["vs_alone"] <= 1.02,
        "speeds unknown: >= 0.95 of the ideal in the first run": results["learning"]["first_run_efficiency"] >= 0.95,
        "speeds unknown: >= 0.97 of the ideal in the second run": results["learning"]["second_run_efficiency"] >= 0.97,
    }


def format_policy_table(results) -> str:
    """The results as text tables."""
    config = results["config"]
    lines = [
        "Emulated devices (sleep t0 + n/rate per chunk, one chunk at a time; not a GPU measurement); t0 = 1 ms",
        f"{config['total_items']:,} items per run; median of {config['repeats']} interleaved repeats; "
        f"{config['machine']}; load average {config['load_average'][0]:.1f} before, "
        f"{config['load_average_after'][0]:.1f} after (the machine is shared)",
    ]
    for block in results["hybrid"]:
        secs = ", ".join(f"{d} {s * 1e3:g} ms" for d, s in block["chunk_seconds"].items())
        lines += ["", f"hybrid: cpu 200k items/s, cuda:0 and cuda:1 1M items/s; chunks {secs}"]
        lines += _rows_table(block["rows"], "efficiency", "efficiency")
        policy = block["rows"]["PerformanceModelScheduler"].get("ideal_chunk_sizes")
        if policy:  # (results written before each way's ideal had its own chunks have none)
            sizes = ", ".join(f"{n:,}" for n in policy)
            lines.append(f"efficiency: of every device busy back to back on the way's own chunks: rate x duration "
                         f"({', '.join(f'{n:,}' for n in block['batch_sizes'])}), or for the policy the median "
                         f"of its chunks, sized by its model to take the durations t0 included ({sizes})")
    fast = results["fast"]
    lines += ["", f"fast pair: cpu 10k items/s beside {fast['fast_device']} 1.5M items/s (150x); 20 ms chunks"]
    lines += _rows_table(fast["rows"], "vs alone", "vs_alone")
    learning = results["learning"]
    lines += ["", "learning: hybrid devices, speeds unknown at the start (no saved model), 10-20 ms chunks",
              f"first run  {learning['first_run_efficiency']:.3f} of the ideal  "
              f"(all: {', '.join(f'{x:.3f}' for x in learning['first_all'])})",
              f"second run {learning['second_run_efficiency']:.3f} of the ideal  "
              f"(all: {', '.join(f'{x:.3f}' for x in learning['second_all'])}; models saved by the first)", ""]
    for target, met in results["targets"].items():
        lines.append(f"target {target}: {verdict(met)}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m dsched.bench_policy [--quick] [--json FILE]
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int)
    args = parser.parse_args()
    out = run_policy_benchmarks(args.json, args.quick, repeats=args.repeats, progress=print)
    print(format_policy_table(out))


def _rows_table(rows, title, key) -> list:
    """The lines of one table: a row per way, its ``key`` figure, wall time and items per device."""
    header = f"{'way':<26} {title:>10} {'wall s':>8}  items per device"
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        split = ", ".join(f"{d}: {n:,}" for d, n in sorted(row["items_per_device"].items(), key=lambda kv: str(kv[0])))
        lines.append(f"{name:<26} {row[key]:>10.3f} {row['wall_s']:>8.3f}  {split}")
    takes = [f"{name} {row['take_s'] * 1e3:.1f} ms" for name, row in rows.items() if "take_s" in row]
    if takes:
        lines.append("dsched's ways timed on feeds they hold; an untimed run of a few items took the devices first: "
                     + ", ".join(takes) + " (median)")
    return lines
