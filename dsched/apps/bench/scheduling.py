"""Benchmarks against what a user would write instead: hybrid efficiency and dispatch overhead.

Emulated devices of known speed
-------------------------------
Every device here is emulated, the CPU included: a chunk of ``n`` items on a
device of rate ``r`` items/s and fixed cost ``t0`` *sleeps* ``t0 + n / r``
seconds while holding that device's lock on its worker, so each device runs
one chunk at a time (a GPU's stream, a CPU's cores busy with one chunk)
however many threads its worker has. Sleeping stands for computing: it
measures the scheduling, never a device. The numbers say nothing about a
real GPU.

What is measured
----------------
1. Hybrid efficiency: ``N`` items over the devices (default: a CPU at 200k
   items/s and two CUDA devices at 1M items/s each, ``t0`` = 1 ms, 4M items),
   achieved items/s (``N`` over the wall time from the first submission to
   the last result) against the ideal for the chunk sizes used::

       ideal = sum over devices d of  b_d / (t0 + b_d / r_d)

   (each device busy back to back on chunks of its size ``b_d``; with
   ``t0 = 0`` this is the sum of the rates, also reported). Three ways:

   - ``dsched``: :class:`StaticHybridScheduler`, batch sizes proportional to
     speed (50 ms of work each), capacities two batches, async dispatch;
   - ``client.map``: plain Dask, uniform chunks (``N / 100``) restricted to
     the device workers, every chunk submitted at once, Dask's placement
     and work stealing deciding where each runs;
   - ``threads``: a hand-written NEML2-like loop: one Python thread per
     device pulling chunks of that device's batch size from a shared
     counter and running each on its worker (``client.submit(...).result()``,
     one at a time).

2. Dispatch overhead per chunk, with a no-op ``do_work``: ``sync`` mode on
   one device (µs per chunk on the calling thread), and ``async`` mode over
   ``K`` one-item chunks on the device workers, against plain ``client.map``
   of ``K`` no-op tasks restricted to the same workers (so that Dask's
   root-task queuing does not slow the reference), per task, with the
   results gathered (as a dispatch returns them) and without. Async runs
   twice: with room for every chunk (a third of them per device: the
   dispatcher submits in bulk, like the reference) and with two chunks of
   room per device (latency-bound: one round trip per refill).

Every measurement is repeated (interleaved, so a busy moment of the machine
hits every variant alike) after the scheduler has forgotten the previous
one's tasks; the median is reported.

Examples
--------
>>> results = run_benchmarks(quick=True)          # doctest: +SKIP
>>> print(format_table(results))                   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import threading
import time

from dsched.checks import check_positive_int
from dsched.cluster.local import LocalHybridCluster
from dsched.dataplane.loaders import SliceGenerator
from dsched.devices.context import worker_device
from dsched.devices.device import Device, device_of_resources, device_resource, parse_device
from dsched.devices.ownership import cluster_info, emulated_devices
from dsched.dispatch.dispatcher import WorkDispatcher
from dsched.dispatch.feeds import release_parked
from dsched.schedulers import SimpleScheduler, StaticHybridScheduler
from dsched.worker.chunk import ChunkProgram, run_chunk

__all__ = ["EmulatedDevice", "DEFAULT_DEVICES", "emulated_chunk", "ideal_items_per_s", "run_benchmarks",
           "format_table"]


@dataclasses.dataclass(frozen=True)
class EmulatedDevice:
    """A device of known speed: ``rate`` items/s after a fixed ``t0`` seconds per chunk."""

    device: str
    rate: float
    t0: float = 0.001

    def seconds(self, n) -> float:
        return self.t0 + n / self.rate


DEFAULT_DEVICES = (
    EmulatedDevice("cpu", 200_000.0),
    EmulatedDevice("cuda:0", 1_000_000.0),
    EmulatedDevice("cuda:1", 1_000_000.0),
)

_locks_guard = threading.Lock()


class _DeviceClock:
    """One emulated device: a lock (it runs one chunk at a time) and when its last chunk was due to end.

    ``time.sleep`` overshoots (0.2 ms or more per call here), and a thread
    waiting for the lock wakes up late, which would make an emulated device
    slower than its rate by a few percent at 10 ms chunks: time no device
    spends. So the overshoot is not the device's: a chunk that was already
    waiting when the previous one ended starts at that chunk's due end, and
    one that arrives after it ended starts when it arrives less the previous
    chunk's overshoot. A device kept fed then runs at exactly its rate, and
    what it idles is the time between its chunks that the dispatch took (a
    feed's thread answering one chunk and taking the next, a late client).
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.due = float("-inf")  # when the last chunk was due to end
        self.released = float("-inf")  # when it really ended

    def run(self, seconds):
        arrived = time.perf_counter()
        with self.lock:
            overshoot = self.released - self.due if self.due > float("-inf") else 0.0
            self.due = max(self.due, arrived - overshoot) + seconds
            time.sleep(max(0.0, self.due - time.perf_counter()))
            self.released = time.perf_counter()


def _device_clock(worker):
    """One clock per worker (each worker owns one device)."""
    with _locks_guard:
        clock = worker.__dict__.get("_dsched_bench_clock")
        if clock is None:
            clock = worker.__dict__["_dsched_bench_clock"] = _DeviceClock()
        return clock


def emulated_chunk(n, device, speeds):
    """Emulate ``n`` items on ``device`` (``speeds``: ``{device: (t0, rate)}``): sleep while holding the device."""
    from distributed import get_worker

    worker = get_worker()
    here = worker_device(worker)
    device = str(here if device is None else Device(device))
    t0, rate = speeds[device]
    _device_clock(worker).run(t0 + n / rate)
    return n


def _emulated_do_work(speeds):
    return _DoWork(speeds)


class _DoWork:
    """``do_work`` for the dispatcher: the chunk's size from its slice."""

    def __init__(self, speeds):
        self.speeds = speeds

    def __call__(self, work, device):
        return emulated_chunk(work.stop - work.start, device, self.speeds)


def _noop(work, device):
    return None


def _noop_task(i):
    return None


def ideal_items_per_s(devices, batch_sizes) -> float:
    """``sum_d b_d / (t0_d + b_d / r_d)``: every device busy back to back on chunks of its size."""
    return sum(b / d.seconds(b) for d, b in zip(devices, batch_sizes))


# --- the three ways to spread a batch ------------------------------------------

def _run_dsched(client, devices, total, batch_sizes, speeds):
    scheduler = StaticHybridScheduler([d.device for d in devices], batch_sizes, [2 * b for b in batch_sizes],
                                      [d.rate for d in devices])
    return timed_dispatch(client, scheduler, _emulated_do_work(speeds), total)


def timed_dispatch(client, scheduler, do_work, total, chunk_sizes=None):
    """One async run of ``total`` items of ``do_work`` (counting its items): (wall seconds, {device: items}).

    ``chunk_sizes``: a list, given ``{device: its median chunk size}`` of the run.
    """
    dispatcher = WorkDispatcher(scheduler, do_work, reduce=sum, client=client)
    start = time.perf_counter()
    done = dispatcher.run(SliceGenerator(0, total))
    wall = time.perf_counter() - start
    assert done == total, (done, total)
    per_device, sizes = {}, {}
    for r in dispatcher.last_run.records:
        per_device[str(r.device)] = per_device.get(str(r.device), 0) + r.size
        sizes.setdefault(str(r.device), []).append(r.size)
    if chunk_sizes is not None:
        chunk_sizes.append({device: statistics.median(n) for device, n in sizes.items()})
    return wall, per_device


def _device_workers(client):
    return {str(device_of_resources(info["resources"])): address
            for address, info in cluster_info(client)["workers"].items()
            if device_of_resources(info.get("resources")) is not None}


def _run_client_map(client, devices, total, chunk, speeds):
    from distributed import wait

    workers = _device_workers(client)
    sizes = [min(chunk, total - i) for i in range(0, total, chunk)]
    start = time.perf_counter()
    futures = client.map(emulated_chunk, sizes, [None] * len(sizes), [speeds] * len(sizes),
                         workers=[workers[d.device] for d in devices], pure=False)
    wait(futures)
    wall = time.perf_counter() - start
    where = client.run_on_scheduler(_where_tasks_ran, [f.key for f in futures])
    by_address = {a: d for d, a in workers.items()}
    per_device = {}
    for key, n in zip([f.key for f in futures], sizes):
        device = by_address.get(where.get(key))
        per_device[device] = per_device.get(device, 0) + n
    assert sum(f.result() for f in futures) == total
    client.cancel(futures)
    return wall, per_device


def _where_tasks_ran(keys, dask_scheduler=None):
    tasks = dask_scheduler.tasks
    return {k: (tasks[k].who_has and next(iter(tasks[k].who_has)).address) for k in keys if k in tasks}


def _run_threads(client, devices, total, batch_sizes, speeds):
    workers = _device_workers(client)
    counter = {"next": 0}
    lock = threading.Lock()
    per_device = {d.device: 0 for d in devices}
    errors = []

    def loop(device, batch):
        try:
            while True:
                with lock:
                    begin = counter["next"]
                    if begin >= total:
                        return
                    n = min(batch, total - begin)
                    counter["next"] = begin + n
                client.submit(emulated_chunk, n, device, speeds, workers=[workers[device]], pure=False).result()
                per_device[device] += n
        except BaseException as err:  # re-raised on the main thread
            errors.append(err)

    threads = [threading.Thread(target=loop, args=(d.device, b)) for d, b in zip(devices, batch_sizes)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall, per_device


# --- overhead per chunk ---------------------------------------------------------

def _sync_overhead(chunks):
    dispatcher = WorkDispatcher(SimpleScheduler("cpu", 1), _noop, mode="sync")
    start = time.perf_counter()
    dispatcher.run(SliceGenerator(0, chunks))
    return (time.perf_counter() - start) / chunks


def _async_overhead(client, devices, chunks, capacity):
    scheduler = StaticHybridScheduler([d.device for d in devices], 1, capacity)
    dispatcher = WorkDispatcher(scheduler, _noop, client=client)
    start = time.perf_counter()
    dispatcher.run(SliceGenerator(0, chunks))
    return (time.perf_counter() - start) / chunks


def _client_map_overhead(client, devices, tasks, gather):
    from distributed import wait

    workers = _device_workers(client)
    start = time.perf_counter()
    futures = client.map(_noop_task, range(tasks), workers=[workers[d.device] for d in devices], pure=False)
    if gather:
        client.gather(futures)
    else:
        wait(futures)
    per_task = (time.perf_counter() - start) / tasks
    client.cancel(futures)
    return per_task


def _chunk_task_overhead(client, devices, chunks):
    """dsched's chunk tasks (``run_chunk`` with its program, device and slice) through plain client.map + gather.

    The same Dask tasks an async dispatch sends, without the dispatcher: the
    difference to ``client.map + gather`` is the chunk's own cost, the rest of
    the async figure is the dispatcher's.
    """
    import uuid

    program = ChunkProgram(uuid.uuid4().hex, _noop)
    start = time.perf_counter()
    futures = []
    for i, d in enumerate(devices):
        index = range(i, chunks, len(devices))
        futures += client.map(run_chunk, [program] * len(index), [Device(d.device)] * len(index),
                              [slice(j, j + 1) for j in index], resources={device_resource(d.device): 1}, pure=False)
    client.gather(futures)
    per_chunk = (time.perf_counter() - start) / chunks
    client.cancel(futures)
    return per_chunk


def _scheduler_task_count(dask_scheduler=None):
    return len(dask_scheduler.tasks)


def _settle(client, timeout=30.0):
    """Wait until the scheduler has forgotten the last run's tasks, so no timing pays for another's cleanup
    (the feeds a run parked for the next are let go first: the next row may not be dsched's)."""
    import gc

    release_parked(client)
    gc.collect()
    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(_scheduler_task_count) and time.monotonic() < deadline:
        time.sleep(0.01)


# --- the whole run ----------------------------------------------------------------

def _check_devices(devices):
    devices = tuple(devices)
    if not devices:
        raise ValueError("devices: at least one emulated device is required, got none")
    for i, d in enumerate(devices):
        if not isinstance(d, EmulatedDevice):
            raise ValueError(f"devices[{i}]: expected an EmulatedDevice, got {d!r}")
        parse_device(d.device, f"devices[{i}]")
        if not d.rate > 0 or not d.t0 >= 0:
            raise ValueError(f"devices[{i}]: rate must be > 0 and t0 >= 0, got rate={d.rate!r}, t0={d.t0!r}")
    if len({d.device for d in devices}) != len(devices):
        raise ValueError(f"devices: duplicate device in {[d.device for d in devices]}")
    return devices


def run_benchmarks(json_path=None, quick=False, *, devices=DEFAULT_DEVICES, total=None, chunk_seconds=None,
                   map_chunks=100, overhead_chunks=None, repeats=None, client=None, processes=False,
                   progress=None) -> dict:
    """Run every benchmark once per repeat on an emulated cluster; the results (and ``json_path`` written).

    Parameters
    ----------
    json_path : str or path, optional
        Where to write the results as JSON.
    quick : bool
        Small sizes (1M items, 20 ms chunks, 500 overhead chunks, two
        repeats): under a minute on two cores. The full run is 4M items, 50 ms
        chunks, 2000 overhead chunks, five repeats (the median is reported).
    devices : sequence of EmulatedDevice
        The emulated devices and their speeds.
    total, chunk_seconds, map_chunks, overhead_chunks, repeats :
        Override the sizes: items in the hybrid run, seconds of work per dsched
        chunk (batch sizes ``rate * chunk_seconds``), the number of uniform
        ``client.map`` chunks, chunks in the overhead runs, repeats.
    client : distributed.Client, optional
        A cluster whose workers own the devices (emulated); by default an
        in-process :class:`LocalHybridCluster` is started and closed.
    processes : bool
        Start that cluster's workers as processes.
    progress : callable, optional
        Called with a line of text as each measurement finishes.
    """
    devices = _check_devices(devices)
    total, chunk_seconds, map_chunks, overhead_chunks, repeats = _check_sizes(
        quick, total, chunk_seconds, map_chunks, overhead_chunks, repeats, json_path)
    say = progress or (lambda line: None)
    speeds = {d.device: (d.t0, d.rate) for d in devices}
    batch_sizes = [max(1, round(d.rate * chunk_seconds)) for d in devices]
    map_chunk = max(1, math.ceil(total / map_chunks))
    results = {
        "command": None,  # filled by the CLI
        "config": _config(devices, total, batch_sizes, map_chunk, overhead_chunks, repeats, quick, processes),
    }
    with contextlib.ExitStack() as stack:
        client = _device_client(stack, client, devices, processes)
        results["config"]["emulated"] = _check_emulated(client, devices)
        # Warm up: imports and connections before anything is timed.
        _run_dsched(client, devices, sum(batch_sizes), batch_sizes, {k: (0.0, 1e12) for k in speeds})
        results["hybrid"] = _hybrid_efficiency(client, devices, total, batch_sizes, map_chunks, map_chunk, speeds,
                                               repeats, say)
        results["overhead"] = _dispatch_overhead(client, devices, overhead_chunks, repeats, say)

    results["targets"] = _targets(results)
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results


def _check_sizes(quick, total, chunk_seconds, map_chunks, overhead_chunks, repeats, json_path) -> tuple:
    """``(total, chunk_seconds, map_chunks, overhead_chunks, repeats)`` checked, the defaults of ``quick`` filled in.

    Also checks that ``json_path``'s folder exists, so that a long run does
    not end in a failed write.
    """
    def positive(value, field, default):
        return check_positive_int(default if value is None else value, field, integers=int, below=None)

    total = positive(total, "total", 1_000_000 if quick else 4_000_000)
    chunk_seconds = chunk_seconds if chunk_seconds is not None else (0.02 if quick else 0.05)
    if isinstance(chunk_seconds, bool) or not isinstance(chunk_seconds, (int, float)) or not chunk_seconds > 0:
        raise ValueError(f"chunk_seconds: expected a positive number of seconds, got {chunk_seconds!r}")
    map_chunks = positive(map_chunks, "map_chunks", None)
    overhead_chunks = positive(overhead_chunks, "overhead_chunks", 500 if quick else 2000)
    repeats = positive(repeats, "repeats", 2 if quick else 5)
    if json_path is not None:
        parent = os.path.dirname(os.path.abspath(os.fspath(json_path)))
        if not os.path.isdir(parent):
            raise ValueError(f"json_path: the folder {parent} does not exist")
    return total, chunk_seconds, map_chunks, overhead_chunks, repeats


def _config(devices, total, batch_sizes, map_chunk, overhead_chunks, repeats, quick, processes) -> dict:
    """The run's configuration, as the results record it (the devices' emulation is added once they are found)."""
    return {
        "devices": [dataclasses.asdict(d) for d in devices],
        "total_items": total,
        "dsched_batch_sizes": dict(zip((d.device for d in devices), batch_sizes)),
        "dsched_capacities": {d.device: 2 * b for d, b in zip(devices, batch_sizes)},
        "client_map_chunk": map_chunk,
        "overhead_chunks": overhead_chunks,
        "repeats": repeats,
        "quick": quick,
        "processes": processes,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "emulation": "every device sleeps t0 + n/rate per chunk holding its lock: scheduling is measured, "
                     "not any device",
    }


def _device_client(stack, client, devices, processes):
    """``client``, or the client of a new :class:`LocalHybridCluster` of ``devices`` (emulated), closed by ``stack``."""
    from distributed import Client

    if client is None:
        cluster = stack.enter_context(LocalHybridCluster(
            [d.device for d in devices], emulate=True, processes=processes, dashboard_address=None))
        client = stack.enter_context(Client(cluster))
    return client


def _check_emulated(client, devices) -> dict:
    """``{device: whether its worker is emulated}``; a ValueError if no worker of ``client`` owns a device."""
    emulated = emulated_devices(client)
    missing = [d.device for d in devices if str(Device(d.device)) not in emulated]
    if missing:
        raise ValueError(f"client: no worker owns {', '.join(missing)}")
    return {d.device: emulated.get(d.device, False) for d in devices}


def _hybrid_efficiency(client, devices, total, batch_sizes, map_chunks, map_chunk, speeds, repeats, say) -> dict:
    """The hybrid runs, three ways (dsched, ``client.map``, threads): each way's median wall and efficiency."""
    sum_rates = sum(d.rate for d in devices)
    hybrid = {}
    ways = [
        ("dsched", "StaticHybridScheduler, batch ∝ speed, capacity 2 batches (async)",
         lambda: _run_dsched(client, devices, total, batch_sizes, speeds), batch_sizes),
        ("client.map", f"plain Dask, {map_chunks} uniform chunks, restricted to the device workers",
         lambda: _run_client_map(client, devices, total, map_chunk, speeds), [map_chunk] * len(devices)),
        ("threads", "thread per device, submit(...).result() per chunk (NEML2-like)",
         lambda: _run_threads(client, devices, total, batch_sizes, speeds), batch_sizes),
    ]
    # Repeats interleave the ways (A B C A B C ...), so a busy moment of the machine hits all of them alike.
    walls = {name: [] for name, *_ in ways}
    splits = {name: [] for name, *_ in ways}
    for _ in range(repeats):
        for name, _description, run, _sizes in ways:
            _settle(client)
            wall, split = run()
            walls[name].append(wall)
            splits[name].append(split)
    for name, description, _run, sizes in ways:
        wall = statistics.median(walls[name])
        ideal = ideal_items_per_s(devices, sizes)
        achieved = total / wall
        nearest = min(range(repeats), key=lambda i: abs(walls[name][i] - wall))
        hybrid[name] = {
            "description": description,
            "wall_s": wall,
            "wall_s_all": walls[name],
            "items_per_s": achieved,
            "ideal_items_per_s": ideal,
            "efficiency": achieved / ideal,
            "efficiency_vs_sum_of_rates": achieved / sum_rates,
            "items_per_device": splits[name][nearest],
        }
        say(f"hybrid {name}: {achieved:,.0f} items/s, efficiency {achieved / ideal:.3f}")
    return hybrid


def _dispatch_overhead(client, devices, overhead_chunks, repeats, say) -> dict:
    """The overhead per chunk: dsched's sync and async modes against plain ``client.map``, the medians."""
    overhead = {}
    sync_chunks = max(overhead_chunks, 5000)
    sync = [_sync_overhead(sync_chunks) for _ in range(repeats)]
    overhead["sync"] = {"description": "dsched sync mode, no-op chunks, one device", "chunks": sync_chunks,
                        "s_per_chunk": statistics.median(sync), "all": sync}
    say(f"overhead sync: {statistics.median(sync) * 1e6:.1f} us/chunk")
    share = math.ceil(overhead_chunks / len(devices))  # every device gets a third: as spread as the reference
    variants = [
        ("client.map + gather", "plain client.map of no-op tasks on the device workers, results gathered",
         lambda: _client_map_overhead(client, devices, overhead_chunks, gather=True)),
        ("client.map + wait", "the same, waiting for completion without fetching results",
         lambda: _client_map_overhead(client, devices, overhead_chunks, gather=False)),
        ("chunk tasks, no dispatcher", "dsched's chunk tasks (program, device, slice) by client.map + gather",
         lambda: _chunk_task_overhead(client, devices, overhead_chunks)),
        ("async, all in flight", f"dsched async, one-item no-op chunks, capacity {share} per device",
         lambda: _async_overhead(client, devices, overhead_chunks, share)),
        ("async, 2 chunks/device", "dsched async, one-item no-op chunks, capacity 2 per device",
         lambda: _async_overhead(client, devices, overhead_chunks, 2)),
    ]
    values = {name: [] for name, *_ in variants}
    for _ in range(repeats):
        for name, _description, measure in variants:
            _settle(client)
            values[name].append(measure())
    for name, description, _measure in variants:
        overhead[name] = {"description": description, "s_per_chunk": statistics.median(values[name]),
                          "chunks": overhead_chunks, "all": values[name]}
        say(f"overhead {name}: {overhead[name]['s_per_chunk'] * 1e6:.0f} us/chunk")
    return overhead


def verdict(reached) -> str:
    """How a target reads in a table: information about this run, not a pass or a fail of the machine."""
    return "reached" if reached else "not reached on this run"


def _targets(results) -> dict:
    """The issue's targets, met or not."""
    hybrid, overhead = results["hybrid"], results["overhead"]
    reference = overhead["client.map + gather"]["s_per_chunk"]
    best_async = min(v["s_per_chunk"] for k, v in overhead.items() if k.startswith("async"))
    return {
        "dsched hybrid efficiency >= 0.95": hybrid["dsched"]["efficiency"] >= 0.95,
        "async overhead per chunk <= client.map (+ gather) per task": best_async <= reference,
        "async overhead per chunk, all in flight, <= 0.25 x client.map (+ gather) per task":
            overhead["async, all in flight"]["s_per_chunk"] <= 0.25 * reference,
        "sync overhead < 50 us per chunk": overhead["sync"]["s_per_chunk"] < 50e-6,
    }


def format_table(results) -> str:
    """The results as a text table (the README's)."""
    config = results["config"]
    lines = []
    devices = ", ".join(f"{d['device']} {d['rate']:,.0f} items/s" for d in config["devices"])
    t0s = {d["t0"] for d in config["devices"]}
    lines.append(f"Emulated devices (sleep t0 + n/rate per chunk, one chunk at a time; not a GPU measurement): "
                 f"{devices}; t0 = {', '.join(f'{t * 1e3:g} ms' for t in sorted(t0s))}")
    if results.get("command"):
        lines.append(f"$ {results['command']}")
    lines.append(f"Batch of {config['total_items']:,} items; median of {config['repeats']} run(s); "
                 f"{config['machine']}; workers {'in processes' if config['processes'] else 'in-process'}")
    lines.append("")
    header = f"{'hybrid':<12} {'items/s':>12} {'ideal items/s':>14} {'efficiency':>10} {'wall s':>8}  items per device"
    lines += [header, "-" * len(header)]
    for name, row in results["hybrid"].items():
        split = ", ".join(f"{d}: {n:,}" for d, n in sorted(row["items_per_device"].items(), key=lambda kv: str(kv[0])))
        lines.append(f"{name:<12} {row['items_per_s']:>12,.0f} {row['ideal_items_per_s']:>14,.0f} "
                     f"{row['efficiency']:>10.3f} {row['wall_s']:>8.3f}  {split}")
    lines.append("ideal = sum over devices of b / (t0 + b / rate) for the chunk sizes b each way uses")
    lines.append("")
    header = f"{'overhead':<24} {'us per chunk':>13}  what"
    lines += [header, "-" * len(header)]
    for name, row in results["overhead"].items():
        lines.append(f"{name:<24} {row['s_per_chunk'] * 1e6:>13.1f}  {row['description']} ({row['chunks']} chunks)")
    lines.append("")
    if config.get("quick"):
        lines.append("quick sizes: the targets below are set for the full run (dsched bench)")
    for target, met in results.get("targets", {}).items():
        lines.append(f"target {target}: {verdict(met)}")
    return "\n".join(lines)
