"""Benchmarks of the data plane: the J2 update on real arrays, against what a user would write instead.

Every row computes the J2 radial return with its consistent tangent (104 B in,
392 B out per point) for the same points, on this machine's CPU. The "CUDA"
worker of the hybrid rows is *emulated*: a second worker process that claims
``cuda:0`` and computes with NumPy, so the two worker processes stand for two
devices. Nothing here measures a GPU.

Rows, timed in one run (each row run once untimed, then the repeats
interleaved; median and best reported):

- ``numpy``: one :func:`~dsched.models.j2_update` call on the whole batch;
- ``threads``: ``ThreadPoolExecutor(2)`` over the same chunks, results concatenated;
- ``dispatch, plain``: the call a user writes first, ``dsched.dispatch(model,
  strain, plastic_strain, alpha, scheduler=..., client=...)`` with a model that
  returns new arrays, NumPy inputs, nothing declared, on the two worker processes below;
  the same scheduler at every repeat, as a program that calls again keeps it (so the
  repeats after the first are like calls, on the steady path);
- ``dispatch, plain, copied``: the same with ``dsched.place-results: false``: the
  workers copy each result into its rows instead of having NumPy allocate it
  there (:mod:`dsched.worker.result_placement`);
- ``dispatch, plain, 32,768-point chunks``: the plain call with chunks of half
  the default size (about 7 ms of J2 each): what the cost of a call weighs on
  shorter chunks;
- ``ray, put and tasks`` (only where Ray is installed): ``ray.put`` of the inputs
  once, a task per chunk on 2 Ray worker processes, results concatenated. Ray
  runs after the other rows, started for its row alone and stopped after it:
  its own processes stay busy while it is up and would slow the rows beside it;
- ``dispatch, processes``: a :class:`~dsched.WorkDispatcher` on two single-thread worker
  processes (cpu + emulated cuda:0), the cluster started beforehand; the
  inputs are private NumPy arrays, copied into shared memory by each call,
  and the outputs new;
- ``dispatch, processes, shared``: the same with the inputs made once with
  :func:`dsched.shared_copy` and ``out=`` arrays from :func:`dsched.shared_empty`
  reused call after call (how a solver that calls its model again and again
  keeps its state): nothing is copied and no page is faulted again;
- ``dispatch, processes, shared, half chunks``: the same with chunks of half
  the size: each chunk's messages cost CPU in the client and in the worker,
  and there are twice as many (why the default CPU sub-batch is not smaller);
- ``dispatch, processes, shared, tasks``: the same with device feeds off
  (``dsched.feeds: false``): one Dask task per chunk (packed where several
  wait for one thread), which is what the feeds replace;
- the job (``dsched run``'s embedded default, inputs generated in each chunk)
  in-process, against one :func:`~dsched.models.j2_chunk` call on the whole
  batch and a thread pool over the job's chunks.

Memory and traffic, from the ``dispatch, processes`` run: bytes the scheduler
holds per chunk task, and the client's peak RSS (measured in a fresh process)
against the batch's inputs plus outputs; the minor page faults and the CPU
time each row took, in the client's process (with the cluster's scheduler and
nannies, which run there) and in the worker processes (a fresh page is a fault,
for NumPy as for dsched; on two cores, CPU the client takes is taken from the
workers). Then ``dsched run --input --output`` of a large batch, Zarr store
to Zarr store, with the client's peak RSS. Finally a pass (a sum) over 128 MiB
in shared memory against one over this process's own memory, with how
``/dev/shm`` is mounted for huge pages (:func:`memory_pass`): what a
memory-bound chunk pays for reading its inputs where dsched places them.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from distributed import Client

import dsched
from dsched.apps.job import run_graph
from dsched.apps.jobfile import AUTO_BATCH_SIZE, load_graph
from dsched.models import j2_chunk, j2_update, loading_strain, write_j2_inputs
from dsched.apps.bench.scheduling import verdict

__all__ = ["run_data_benchmarks", "format_data_table", "j2_inputs"]

CAPACITY_CHUNKS = 2  # chunks in flight per device
SMALL_CHUNK = 32_768  # the plain call's chunks in a row of its own: about 7 ms of J2 each on one core
SMALL_CHUNKS_ROW = "dispatch, plain, 32,768-point chunks"
REPEATS = 5  # timed runs of each row: the best of five is steadier on a shared machine than the best of three
BYTES_IN, BYTES_OUT = 13 * 8, (6 + 6 + 1 + 36) * 8  # per point: strain, plastic strain, alpha / the outputs


def j2_inputs(n):
    """The batch every row computes: ``(strain, plastic_strain, alpha)`` for points ``0..n-1``."""
    return loading_strain(np.arange(n)), np.zeros((n, 6)), np.zeros(n)


def _j2(strain, plastic_strain, alpha, out=None):
    return j2_update(strain, plastic_strain, alpha, out=out)


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _plain_j2(strain, plastic_strain, alpha):
    """The model of the ``dispatch, plain`` row: new arrays, no ``out=``."""
    return j2_update(strain, plastic_strain, alpha)


def _usage_here(dask_worker=None) -> tuple:
    """This process's ``(minor page faults, CPU seconds)`` so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt, usage.ru_utime + usage.ru_stime


def _usage(client) -> tuple:
    """``(faults, CPU seconds)`` so far of this process (the client, and the cluster's scheduler and nannies
    when they run in it) and of the cluster's worker processes together."""
    workers = list(client.run(_usage_here).values())
    return _usage_here(), (sum(w[0] for w in workers), sum(w[1] for w in workers))


def _time_ray(inputs, chunk, repeats, procs_client, say) -> tuple:
    """The ``ray, put and tasks`` row's ``(times, usage)`` (see :func:`_repeat`), Ray started for it alone and
    stopped after it; ``({}, {})`` where Ray is not installed."""
    try:
        import ray
    except ImportError:
        return {}, {}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        return _repeat(_ray_rows(ray, inputs, chunk), repeats, procs_client, inputs[0].shape[0], say)
    finally:
        ray.shutdown()


def _ray_rows(ray, inputs, chunk):
    """``[("ray, put and tasks", run)]`` on the running Ray, warmed up."""
    task = ray.remote(num_cpus=1)(lambda s, e, a, start, stop: _j2(s[start:stop], e[start:stop], a[start:stop]))
    refs = [ray.put(a) for a in inputs]

    def run():
        n = inputs[0].shape[0]
        parts = ray.get([task.remote(*refs, start, min(start + chunk, n)) for start in range(0, n, chunk)])
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    run()  # workers started, functions shipped
    return [("ray, put and tasks", run)]


def _thread_pool(inputs, chunk):
    n = inputs[0].shape[0]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda s: _j2(*(a[s:s + chunk] for a in inputs)), range(0, n, chunk)))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _job_thread_pool(n, chunk):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        parts = list(pool.map(lambda s: j2_chunk(slice(s, min(s + chunk, n))), range(0, n, chunk)))
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _task_sizes(dask_scheduler=None):
    """Bytes the scheduler holds per chunk: each dsched task's pickled size over the chunks it carries (a pack)."""
    import re

    sizes = []
    for key, ts in dask_scheduler.tasks.items():
        if str(key).startswith("dsched-"):
            pack = re.search(r"-pack(\d+)", str(key))
            sizes.append(len(pickle.dumps(ts.run_spec, protocol=5)) / (int(pack.group(1)) if pack else 1))
    return sizes


def _processes_dispatch(client, inputs, scheduler, sizes=None, out=None):
    def record(_):
        if sizes is not None:
            sizes.extend(client.run_on_scheduler(_task_sizes))

    d = dsched.WorkDispatcher(scheduler, _J2Chunk(), join="concat", client=client, on_chunk_done=record, out=out)
    return d.run(dsched.MappingLoader({"strain": inputs[0], "plastic_strain": inputs[1], "alpha": inputs[2]}))


def _plain_call(client, inputs, chunk):
    # One scheduler per chunk size, as a program calling again keeps its own: the repeats after the first are
    # like calls, on the steady path (dsched.dispatch.steady).
    scheduler = _PLAIN_SCHEDULERS.setdefault(chunk, _hybrid_scheduler(chunk))
    return dsched.dispatch(_plain_j2, *inputs, scheduler=scheduler, client=client)


_PLAIN_SCHEDULERS = {}  # chunk size -> the plain rows' scheduler


def _with_config(settings, fn):
    """``fn`` run with the Dask config ``settings`` (``{"dsched.feeds": False}``: a task per chunk)."""
    def run(*args, **kwargs):
        import dask

        with dask.config.set(settings):
            return fn(*args, **kwargs)
    return run


def _shared_outputs(points):
    """``out=`` arrays for J2's results in shared memory (stress, plastic strain, alpha, tangent)."""
    return {"stress": dsched.shared_empty((points, 6)), "plastic_strain": dsched.shared_empty((points, 6)),
            "alpha": dsched.shared_empty(points), "tangent": dsched.shared_empty((points, 6, 6))}


class _J2Chunk:
    """``do_work`` for the dispatch rows: J2 on a chunk's mapping of inputs, into the chunk's output rows."""

    def __call__(self, work, device, out=None):
        return _j2(work["strain"], work["plastic_strain"], work["alpha"], out=out)


def _hybrid_scheduler(chunk):
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=chunk, capacities=CAPACITY_CHUNKS * chunk)


def _measure_rss(points, chunk) -> dict:
    """In a fresh process: the client's peak RSS for a processes dispatch of ``points`` (bytes)."""
    code = f"""
import json, resource, numpy as np, dsched
from distributed import Client
from dsched.bench_data import j2_inputs, _processes_dispatch, _hybrid_scheduler
def rss():
    with open("/proc/self/status") as f:
        return {{l.split(":")[0]: int(l.split()[1]) * 1024 for l in f if l.startswith(("VmRSS", "VmHWM"))}}
with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                               dashboard_address=None) as cluster, Client(cluster) as client:
    _processes_dispatch(client, j2_inputs(1000), _hybrid_scheduler(500))
    before = rss()["VmRSS"]
    inputs = j2_inputs({points})
    out = _processes_dispatch(client, inputs, _hybrid_scheduler({chunk}))
    print(json.dumps({{"before": before, "peak": rss()["VmHWM"]}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"RSS measurement failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _measure_output_run(points) -> dict:
    """``dsched run --input --output`` of ``points`` J2 points, Zarr store to Zarr store: wall and client peak RSS.

    The input store is written first (piece by piece, not timed); the run's
    workers read their rows from it and write their outputs to a new store, so
    the client never holds the batch.
    """
    with tempfile.TemporaryDirectory(prefix="dsched-bench-") as folder:
        graph = os.path.join(folder, "big.toml")
        with open(graph, "w") as f:
            f.write(f'[model]\nname = "j2"\n\n[batch]\nsize = {points}\n\n[scheduler]\ntype = "auto"\n'
                    f'devices = ["cpu"]\n')
        store = write_j2_inputs(os.path.join(folder, "in.zarr"), points)
        # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across fork and exec, so a child would report this
        # (large) benchmark process's peak as its own.
        code = ("import sys; from dsched.apps.cli import main; rc = main(sys.argv[1:]); "
                "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]; "
                "print('peak', int(hwm.split()[1]) * 1024); sys.exit(rc)")
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code, "run", graph, "--no-progress", "--input", store,
                               "--output", os.path.join(folder, "out.zarr")], capture_output=True, text=True,
                              timeout=1800)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"dsched run --input --output failed: {done.stderr[-2000:]}")
        peak = int(done.stdout.split("peak")[-1].split()[0])
        stored, read = (_folder_bytes(os.path.join(folder, name)) for name in ("out.zarr", "in.zarr"))
    return {"points": points, "wall_s": wall, "peak_rss": peak, "stored_bytes": stored, "input_bytes": read}


def _folder_bytes(folder) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def run_data_benchmarks(quick=False, *, points=None, repeats=None, output_points=None, progress=None) -> dict:
    """Time every row and measure memory and traffic; the results as a dict (see the module's docstring).

    ``points`` (default 1,000,000; 200,000 quick) is the batch of the timed rows,
    ``output_points`` (default 20,000,000; 2,000,000 quick) that of ``dsched run --output``.
    Raises if dsched's results differ from NumPy's.
    """
    say = progress or (lambda line: None)
    points = points or (200_000 if quick else 1_000_000)
    repeats = repeats or (1 if quick else REPEATS)
    chunk = AUTO_BATCH_SIZE["cpu"]
    times, sizes, usage = _time_rows(points, repeats, chunk, say)
    rates = {name: points / statistics.median(t) for name, t in times.items()}
    best = {name: points / min(t) for name, t in times.items()}
    say("data: measuring the client's peak RSS in a fresh process")
    rss = _measure_rss(points, chunk)
    big = output_points or (2_000_000 if quick else 20_000_000)
    say(f"data: dsched run --input --output of {big:,} points, Zarr to Zarr")
    output_run = _measure_output_run(big)
    batch_bytes = points * (BYTES_IN + BYTES_OUT)
    say("data: a pass over an array in shared memory and in this process's own")
    memory = memory_pass(MEMORY_PASS_BYTES)
    results = {
        "points": points, "chunk": chunk, "repeats": repeats, "items_per_s": rates, "best_items_per_s": best,
        "seconds": times,
        "page_faults": {name: {"client": c[0], "workers": w[0]} for name, (c, w) in usage.items()},
        "cpu_seconds": {name: {"client": c[1], "workers": w[1]} for name, (c, w) in usage.items()},
        "task_bytes_max": max(sizes) if sizes else None,
        "client_rss": {**rss, "batch_bytes": batch_bytes, "ratio": rss["peak"] / batch_bytes},
        "output_run": output_run,
        "memory_pass": memory,
        "emulation": "the cuda:0 worker is emulated (NumPy on the CPU): two worker processes, no GPU",
    }
    results["ratios"] = _ratios(rates, best)
    results["targets"] = _targets(results, big)
    return results


MEMORY_PASS_BYTES = 128 << 20  # far beyond a core's caches, at any --quick: a pass streams from memory


def memory_pass(nbytes, repeats=10) -> dict:
    """Seconds of a sum over ``nbytes`` of a :func:`dsched.shared_empty` array and over a NumPy array of this
    process's own (best of ``repeats``, interleaved), and how ``/dev/shm`` is mounted for huge pages: what a
    memory-bound chunk gains or loses by reading its inputs where dsched places them."""
    from dsched.dataplane.segments import shared_memory_huge_pages

    shared, own = dsched.shared_empty(nbytes // 8), np.empty(nbytes // 8)
    shared[:] = 1.0
    own[:] = 1.0
    seconds = {"shared": [], "own": []}
    for _ in range(repeats):
        for name, array in (("shared", shared), ("own", own)):
            start = time.perf_counter()
            array.sum()
            seconds[name].append(time.perf_counter() - start)
    best = {name: min(values) for name, values in seconds.items()}
    return {"bytes": nbytes, "shared_s": best["shared"], "own_s": best["own"], "shared_vs_own": best["own"] /
            best["shared"], "shm_huge_pages": shared_memory_huge_pages()}


def _time_rows(points, repeats, chunk, say) -> tuple:
    """Every row timed ``repeats`` times, interleaved: ``({row: [seconds]}, bytes per chunk task, usage)``.

    The rows run on two clusters started once: two single-thread worker
    processes (cpu and an emulated cuda:0), and an in-process one for the
    job. Raises if the dispatch's results (new arrays, or the shared ``out=``
    ones) differ from one NumPy call's.
    """
    inputs = j2_inputs(points)
    graph = load_graph(None)
    graph.batch_size = points
    sizes = []
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                   dashboard_address=None) as procs, Client(procs) as procs_client, \
            dsched.LocalHybridCluster(["cpu"], dashboard_address=None) as inproc, Client(inproc) as inproc_client:
        rows, shared_out = _warm_rows(procs_client, inproc_client, graph, inputs, points, chunk)
        times, usage = _repeat(rows, repeats, procs_client, points, say)
        ray_times, ray_usage = _time_ray(inputs, chunk, repeats, procs_client, say)
        times.update(ray_times)
        usage.update(ray_usage)
        checked = _processes_dispatch(procs_client, inputs, _hybrid_scheduler(chunk), sizes)
        plain = _plain_call(procs_client, inputs, chunk)
        reference = _j2(*inputs)
        for name, values in reference.items():
            for label, result in (("dispatch", checked), ("shared out=", shared_out), ("plain dispatch", plain)):
                if not np.array_equal(result[name], values):
                    raise AssertionError(f"{label}'s {name} differs from one NumPy call's")
    return times, sizes, usage


def _repeat(rows, repeats, procs_client, points, say) -> tuple:
    """``rows`` (``[(name, run)]``) each run ``repeats`` times, interleaved: ``({name: [seconds]}, {name: ((client
    faults, CPU s), (worker faults, CPU s))})``, the usage of the last repeat."""
    times = {name: [] for name, _ in rows if name is not None}
    usage = {name: ((0, 0.0), (0, 0.0)) for name in times}
    for _ in range(repeats):
        for name, fn in rows:
            if name is None:  # an untimed step between rows
                fn()
                continue
            before = _usage(procs_client)
            seconds, _ = _timed(fn)
            after = _usage(procs_client)
            usage[name] = tuple((a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before))
            times[name].append(seconds)
            say(f"data {name}: {points / seconds:,.0f} items/s")
    return times, usage


def _warm_rows(procs_client, inproc_client, graph, inputs, points, chunk) -> tuple:
    """The timed rows ``[(name, run)]``, each run once at full size first, untimed: imports, connections, the
    pooled segments and their pages, the workers' plans of where results go are all made in that round.

    Also returns the shared ``out=`` arrays the shared rows write into.
    """
    shared_inputs = tuple(dsched.shared_copy(a) for a in inputs)
    shared_out = _shared_outputs(points)
    rows = [
        ("numpy", lambda: _j2(*inputs)),
        ("threads", lambda: _thread_pool(inputs, chunk)),
        (None, lambda: _take_devices(procs_client, inputs)),
        ("dispatch, plain", lambda: _plain_call(procs_client, inputs, chunk)),
        ("dispatch, plain, copied", lambda: _with_config({"dsched.place-results": False}, _plain_call)(
            procs_client, inputs, chunk)),
        (SMALL_CHUNKS_ROW, lambda: _plain_call(procs_client, inputs, SMALL_CHUNK)),
        ("dispatch, processes", lambda: _processes_dispatch(procs_client, inputs, _hybrid_scheduler(chunk))),
        ("dispatch, processes, shared", lambda: _processes_dispatch(
            procs_client, shared_inputs, _hybrid_scheduler(chunk), out=shared_out)),
        ("dispatch, processes, shared, half chunks", lambda: _processes_dispatch(
            procs_client, shared_inputs, _hybrid_scheduler(chunk // 2), out=shared_out)),
        ("dispatch, processes, shared, tasks", lambda: _with_config({"dsched.feeds": False}, _processes_dispatch)(
            procs_client, shared_inputs, _hybrid_scheduler(chunk), out=shared_out)),
        ("job numpy", lambda: j2_chunk(slice(0, points))),
        ("job threads", lambda: _job_thread_pool(points, chunk)),
        ("dsched run, in-process", lambda: run_graph(graph, client=inproc_client, progress=False)),
    ]
    for _, run in rows:
        run()
    return rows, shared_out


def _take_devices(client, inputs):
    """One small untimed call before the dispatch rows of a round, so that they are timed on feeds they hold.

    The round's other rows run for seconds, longer than a parked feed waits
    (``dsched.feed-linger``), and its task row's chunks end parked feeds; a
    call that starts new feeds pays a scheduler round trip first (some 10 ms
    here). A program calling dsched again and again holds its feeds.
    """
    small = tuple(a[:2048] for a in inputs)
    dsched.dispatch(_plain_j2, *small, scheduler=dsched.StaticHybridScheduler(["cpu", "cuda:0"], [1024, 1024]),
                    client=client)


def _ratios(rates, best) -> dict:
    """The throughput ratios the targets are set on (the rows' median items/s; the plain call's, best of the repeats)."""
    ray = {"dispatch, plain / ray, put and tasks (best)": best["dispatch, plain"] / best["ray, put and tasks"]} \
        if "ray, put and tasks" in best else {}
    return {
        "dispatch, plain / numpy (best)": best["dispatch, plain"] / best["numpy"],
        "dispatch, plain, 32,768-point chunks / numpy (best)": best[SMALL_CHUNKS_ROW] / best["numpy"],
        "dispatch, processes, shared / numpy (best)": best["dispatch, processes, shared"] / best["numpy"],
        **ray,
        "placed / copied (dispatch, plain)": rates["dispatch, plain"] / rates["dispatch, plain, copied"],
        "dispatch, processes / numpy": rates["dispatch, processes"] / rates["numpy"],
        "dispatch, processes, shared / numpy": rates["dispatch, processes, shared"] / rates["numpy"],
        "chunks / half chunks (dispatch, processes, shared)":
            rates["dispatch, processes, shared"] / rates["dispatch, processes, shared, half chunks"],
        "feeds / tasks (dispatch, processes, shared)":
            rates["dispatch, processes, shared"] / rates["dispatch, processes, shared, tasks"],
        "dsched run in-process / best of job numpy, job threads":
            rates["dsched run, in-process"] / max(rates["job numpy"], rates["job threads"]),
    }


def _targets(results, big) -> dict:
    """The data plane's targets, met or not (``big``: the points of the ``dsched run --output`` row)."""
    ratios = results["ratios"]
    ray = {"the plain call >= 2 x Ray's put-and-tasks loop (best of the repeats)":
           ratios["dispatch, plain / ray, put and tasks (best)"] >= 2.0} if "dispatch, plain / ray, put and tasks (best)" \
        in ratios else {}
    return {
        "the plain call on 2 worker processes >= 1.8 x numpy (best of the repeats)":
            ratios["dispatch, plain / numpy (best)"] >= 1.8,
        "the plain call, 32,768-point chunks, >= 1.6 x numpy (best of the repeats)":
            ratios["dispatch, plain, 32,768-point chunks / numpy (best)"] >= 1.6,
        "the tuned call (shared inputs, out= reused, a model taking out=) >= 1.7 x numpy (best of the repeats)":
            ratios["dispatch, processes, shared / numpy (best)"] >= 1.7,
        **ray,
        "in-process dsched run >= 0.95 x the better peer":
            results["ratios"]["dsched run in-process / best of job numpy, job threads"] >= 0.95,
        "bytes through the scheduler per chunk <= 1 KiB": (results["task_bytes_max"] or 0) <= 1024,
        "client peak RSS <= 1.3 x inputs + outputs": results["client_rss"]["ratio"] <= 1.3,
        f"dsched run of {big:,} points, Zarr store to Zarr store, under 1 GiB client RSS":
            results["output_run"]["peak_rss"] < 2**30,
    }


def format_data_table(results) -> str:
    """The data-plane results as text (the README's table)."""
    lines = [f"J2 with tangent, {results['points']:,} points, chunks of {results['chunk']:,}; median of "
             f"{results['repeats']} run(s); {results['emulation']}", ""]
    header = (f"{'row':<43} {'items/s':>12} {'best':>12} {'faults, client':>15} {'workers':>10} "
              f"{'CPU ms, client':>15} {'workers':>8}")
    lines += [header, "-" * len(header)]
    best, faults = results.get("best_items_per_s", {}), results.get("page_faults", {})
    cpu = results.get("cpu_seconds", {})
    for name, rate in results["items_per_s"].items():
        fault, used = faults.get(name, {}), cpu.get(name)
        used = (f"{used['client'] * 1e3:>15,.0f} {used['workers'] * 1e3:>8,.0f}" if used else f"{'':>15} {'':>8}")
        lines.append(f"{name:<43} {rate:>12,.0f} {best.get(name, float('nan')):>12,.0f} "
                     f"{fault.get('client', 0):>15,} {fault.get('workers', 0):>10,} {used}")
    lines.append("")
    for name, ratio in results["ratios"].items():
        lines.append(f"ratio {name}: {ratio:.2f}")
    rss = results["client_rss"]
    lines.append(f"scheduler bytes per chunk (max over tasks, a feed's whole; a pack's over its chunks): "
                 f"{results['task_bytes_max']:.0f}")
    lines.append(f"client peak RSS {rss['peak'] / 2**20:,.0f} MiB (before the run {rss['before'] / 2**20:,.0f} MiB) "
                 f"for {rss['batch_bytes'] / 2**20:,.0f} MiB of inputs + outputs: {rss['ratio']:.2f} x")
    run = results["output_run"]
    lines.append(f"dsched run --input --output, {run['points']:,} points: {run['wall_s']:.1f} s, client peak RSS "
                 f"{run['peak_rss'] / 2**20:,.0f} MiB, {run.get('input_bytes', 0) / 2**30:.2f} GiB read, "
                 f"{run['stored_bytes'] / 2**30:.2f} GiB stored")
    memory = results.get("memory_pass")
    if memory:
        lines.append(f"a pass over {memory['bytes'] / 2**20:,.0f} MiB: shared memory at {memory['shared_vs_own']:.2f} x "
                     f"the speed of this process's own ({memory['shared_s'] * 1e3:.1f} ms against "
                     f"{memory['own_s'] * 1e3:.1f} ms; /dev/shm huge={memory['shm_huge_pages']})")
    lines.append("")
    for target, met in results["targets"].items():
        lines.append(f"target {target}: {verdict(met)}")
    return "\n".join(lines)
