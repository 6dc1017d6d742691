"""Benchmark of resident batches: J2 load steps with state carried, three ways.

Every row runs the same ``steps`` load steps of the J2 model (radial return,
linear isotropic hardening) on ``points`` material points, proportional
loading: at step ``k`` each point's strain is ``(k + 1) / steps`` times its
final strain, and the plastic strain and hardening carry from one step to the
next. Rows:

- ``numpy``: one process, each step one :func:`~dsched.models.j2_update` call
  on the whole batch;
- ``dispatch``: each step :func:`dsched.dispatch` on worker processes
  (the inputs shared by the data plane, the outputs written in place), the
  state carried on the client between steps: what dsched offered before
  resident batches;
- ``batch``: a :class:`dsched.Batch` on the same worker processes, every step
  an update that returns at once; the client waits once, at the end.

Wall time and CPU seconds (the client's process plus the workers', so a loaded
machine shows up as wall time that CPU time does not explain). Memory: the peak
of the workers' resident data (Dask's managed bytes) and RSS over steps 1-2,
against over steps 3-``steps``. Results are checked against the ``numpy``
row. The workers are CPU processes: nothing here measures a GPU.
"""

from __future__ import annotations

import threading
import time

import numpy as np

__all__ = ["j2_load_step", "final_strain", "measure_load_steps", "format_load_steps", "run_batch_benchmarks"]


def final_strain(n):
    """Each point's strain at the last step, ``(n, 6)``."""
    from .models import loading_strain

    return loading_strain(np.arange(n))


def j2_load_step(final_strain, plastic_strain, alpha, *, factor, tangent=False):
    """One load step on a chunk: the J2 update at ``factor`` times the final strain; the new state and the stress."""
    from .models import j2_update

    out = j2_update(final_strain * factor, plastic_strain, alpha, tangent=tangent)
    result = {"plastic_strain": out["plastic_strain"], "alpha": out["alpha"], "stress": out["stress"]}
    if tangent:
        result["tangent"] = out["tangent"]
    return result


def _factor(step, steps):
    return (step + 1) / steps


def run_numpy(strain, steps, tangent=False):
    """The reference: every step on the whole batch in this process."""
    plastic, alpha = np.zeros_like(strain), np.zeros(len(strain))
    for step in range(steps):
        out = j2_load_step(strain, plastic, alpha, factor=_factor(step, steps), tangent=tangent)
        plastic, alpha = out["plastic_strain"], out["alpha"]
    return out


class _Dispatched:
    """``dispatch``'s model: one step's update on a chunk (a picklable class, so worker processes can load it)."""

    def __init__(self, factor, tangent):
        self.factor, self.tangent = factor, tangent

    def __call__(self, strain, plastic, alpha):
        return j2_load_step(strain, plastic, alpha, factor=self.factor, tangent=self.tangent)


def run_dispatch(client, scheduler, strain, steps, tangent=False):
    """Every step re-dispatched: inputs out and outputs back, a barrier between steps."""
    import dsched

    plastic, alpha = np.zeros_like(strain), np.zeros(len(strain))
    for step in range(steps):
        out = dsched.dispatch(_Dispatched(_factor(step, steps), tangent), strain, plastic, alpha,
                              scheduler=scheduler, client=client)
        plastic, alpha = out["plastic_strain"], out["alpha"]
    return out


def run_batch(client, scheduler, strain, steps, tangent=False, on_step=None, lookahead=None):
    """The steps on a resident batch: pushed at once, ordered per chunk by the engine; ``get`` waits at the end."""
    import dsched

    with dsched.Batch({"final_strain": strain, "plastic_strain": np.zeros_like(strain),
                       "alpha": np.zeros(len(strain))}, scheduler, client=client,
                      **({} if lookahead is None else {"lookahead": lookahead})) as batch:
        written = ["plastic_strain", "alpha", "stress"] + (["tangent"] if tangent else [])
        for step in range(steps):
            batch.update(j2_load_step, reads=["final_strain", "plastic_strain", "alpha"],
                         writes=[f for f in written if f in batch.fields],
                         outputs=[f for f in written if f not in batch.fields], label="j2-step",
                         kwargs={"factor": _factor(step, steps), "tangent": tangent})
            if on_step is not None:
                on_step(step, batch)
        return {f: batch.get(f) for f in ("plastic_strain", "alpha", "stress")}


# --- measuring workers -------------------------------------------------------------

_sampler = {}


class PeakMemoryPlugin:
    """A worker plugin keeping the exact peak of the worker's managed bytes, from every task transition.

    Sampling would miss the instant at which a step's output exists next to its input; counting
    transitions into and out of memory does not.
    """

    name = "dsched-bench-peak-memory"

    def setup(self, worker):
        self.worker, self.current, self.peak, self.sizes = worker, 0, 0, {}
        _sampler["plugin"] = self

    def transition(self, key, start, finish, **kwargs):
        if finish == "memory":
            ts = self.worker.state.tasks.get(key)
            self.sizes[key] = ts.nbytes if ts is not None and ts.nbytes is not None else 0
            self.current += self.sizes[key]
            self.peak = max(self.peak, self.current)
        elif start == "memory":  # the task may be gone from the worker's table by now: use what it held
            self.current -= self.sizes.pop(key, 0)


def _plugin():
    from distributed import WorkerPlugin

    return type("PeakMemory", (PeakMemoryPlugin, WorkerPlugin), {})()


def _start_sampler(dask_worker=None, interval=0.01):
    """On a worker: a thread keeping the peak RSS since the last reset."""
    import psutil

    if _sampler.get("thread") is not None:
        return
    process = psutil.Process()
    _sampler.update(peak_rss=0, stop=False)

    def sample():
        while not _sampler["stop"]:
            _sampler["peak_rss"] = max(_sampler["peak_rss"], process.memory_info().rss)
            time.sleep(interval)

    _sampler["thread"] = threading.Thread(target=sample, daemon=True, name="dsched-bench-sampler")
    _sampler["thread"].start()


def _read_sampler(reset=True):
    plugin = _sampler.get("plugin")
    peaks = {"data": plugin.peak if plugin is not None else 0, "rss": _sampler.get("peak_rss", 0)}
    if reset:
        _sampler["peak_rss"] = 0
        if plugin is not None:
            plugin.peak = plugin.current
    return peaks


def _stop_sampler():
    _sampler["stop"] = True
    thread = _sampler.pop("thread", None)
    if thread is not None:
        thread.join()


def _worker_cpu():
    import psutil

    times = psutil.Process().cpu_times()
    return times.user + times.system


def _cpu_seconds(client):
    """CPU seconds so far of this process and every worker process."""
    own = time.process_time()
    return own + sum(client.run(_worker_cpu).values())


def _timed(client, fn):
    cpu, wall = _cpu_seconds(client), time.perf_counter()
    out = fn()
    return time.perf_counter() - wall, _cpu_seconds(client) - cpu, out


# --- the benchmark ---------------------------------------------------------------

def measure_load_steps(points=1_000_000, steps=100, *, batch_size=131072, tangent=False, client=None,
                       lookahead=None, progress=None) -> dict:
    """Time ``steps`` J2 load steps on ``points`` points: NumPy, re-dispatching, a resident batch.

    Starts a ``LocalHybridCluster(["cpu"], processes=True)`` (one CPU worker
    process with two threads) unless ``client`` is given. Returns a dict with
    per row ``wall_s``, ``cpu_s``, and for the batch the memory peaks
    (``after_2`` and ``after_all``: the workers' managed bytes and RSS) and the
    largest difference from the NumPy result.
    """
    import dsched

    say = progress or (lambda message: None)
    strain = final_strain(points)
    own = None
    if client is None:
        from distributed import Client

        own = dsched.LocalHybridCluster(["cpu"], processes=True, dashboard_address=None)
        client = Client(own)
    try:
        scheduler = dsched.SimpleScheduler("cpu", batch_size, capacity=2 * batch_size)
        say("numpy")
        start_cpu, start = time.process_time(), time.perf_counter()
        reference = run_numpy(strain, steps, tangent)
        rows = {"numpy": {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - start_cpu}}
        run_dispatch(client, scheduler, strain[:batch_size], 1, tangent)  # warm up the workers
        say("dispatch")
        wall, cpu, out = _timed(client, lambda: run_dispatch(client, scheduler, strain, steps, tangent))
        rows["dispatch"] = {"wall_s": wall, "cpu_s": cpu, "max_abs_diff": _diff(out, reference)}
        say("batch")
        client.register_plugin(_plugin())
        client.run(_start_sampler)
        peaks = {}

        def on_step(step, batch):
            # Peaks over steps 1-2, 3-10 and 11-end: whether the peak grows with the steps run.
            if step in (1, 9) and step < steps - 1:
                batch.wait()
                peaks["after_2" if step == 1 else "steps_3_10"] = _sum_peaks(client.run(_read_sampler))

        wall, cpu, out = _timed(client, lambda: run_batch(client, scheduler, strain, steps, tangent, on_step,
                                                                  lookahead))
        peaks["after_all"] = _sum_peaks(client.run(_read_sampler))
        client.run(_stop_sampler)
        rows["batch"] = {"wall_s": wall, "cpu_s": cpu, "max_abs_diff": _diff(out, reference), "memory": peaks}
    finally:
        if own is not None:
            client.close()
            own.close()
    batch, dispatch, numpy_row = rows["batch"], rows["dispatch"], rows["numpy"]
    last = peaks.get("steps_3_10")
    return {
        "growth_after_10": (peaks["after_all"]["data"] / last["data"]) if last and last["data"] else None,
        "points": points, "steps": steps, "batch_size": batch_size, "tangent": tangent, "rows": rows,
        "batch_vs_dispatch": dispatch["wall_s"] / batch["wall_s"],
        "batch_vs_numpy": numpy_row["wall_s"] / batch["wall_s"],
        "memory_ratio": (peaks["after_all"]["data"] / peaks["after_2"]["data"]) if peaks["after_2"]["data"] else None,
    }


def run_batch_benchmarks(quick=False, *, progress=None) -> dict:
    """The issue's run for ``dsched bench``: 100 steps on 1,000,000 points (``quick``: 10 steps on 100,000).

    Adds ``targets`` to :func:`measure_load_steps`'s dict: whether the batch is
    at least 3x faster than re-dispatching, at least 0.9x one NumPy process,
    and its peak resident data within 10 % of the peak over the first two steps.
    """
    points, steps = (100_000, 10) if quick else (1_000_000, 100)
    result = measure_load_steps(points, steps, batch_size=32768 if quick else 131072, progress=progress)
    ratio = result["memory_ratio"]
    result["targets"] = {
        "batch >= 3x dispatch": result["batch_vs_dispatch"] >= 3.0,
        "batch >= 0.9x numpy": result["batch_vs_numpy"] >= 0.9,
        "memory within 10%": ratio is not None and ratio <= 1.10,  # peak over steps 3-end against 1-2
    }
    return result


def _sum_peaks(per_worker):
    return {key: sum(p[key] for p in per_worker.values()) for key in ("data", "rss")}


def _diff(out, reference):
    return max(float(np.max(np.abs(np.asarray(out[k]) - reference[k]))) for k in ("plastic_strain", "alpha", "stress"))


def format_load_steps(result) -> str:
    """The benchmark as a small text table."""
    rows = result["rows"]
    lines = [f"J2 load steps: {result['points']:,} points x {result['steps']} steps, chunks of "
             f"{result['batch_size']:,}, tangent={result['tangent']} (CPU worker process; no GPU measured)",
             f"{'row':<10}{'wall s':>10}{'CPU s':>10}{'max |diff|':>14}"]
    for name in ("numpy", "dispatch", "batch"):
        row = rows[name]
        diff = row.get("max_abs_diff")
        lines.append(f"{name:<10}{row['wall_s']:>10.2f}{row['cpu_s']:>10.2f}"
                     f"{'' if diff is None else format(diff, '.2e'):>14}")
    memory = rows["batch"]["memory"]
    lines.append(f"batch vs dispatch: {result['batch_vs_dispatch']:.2f}x; "
                 f"batch vs numpy: {result['batch_vs_numpy']:.2f}x")
    for target, met in result.get("targets", {}).items():
        lines.append(f"target {target}: {'met' if met else 'NOT met'}")
    phases = [("1-2", "after_2"), ("3-10", "steps_3_10"),
              (f"{11 if 'steps_3_10' in memory else 3}-{result['steps']}", "after_all")]
    shown = [(label, memory[key]) for label, key in phases if key in memory]
    lines.append("workers' peak resident data (Dask's managed bytes) / RSS, steps " + "; ".join(
        f"{label}: {m['data'] / 2**20:.0f} / {m['rss'] / 2**20:.0f} MiB" for label, m in shown))
    return "\n".join(lines)


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=131072)
    parser.add_argument("--tangent", action="store_true")
    parser.add_argument("--lookahead", type=int, default=None, help="Batch(lookahead=...)")
    args = parser.parse_args(argv)
    # Through the module, not __main__: worker-side helpers must be pickled by reference.
    from dsched.bench_batch import format_load_steps, measure_load_steps

    result = measure_load_steps(args.points, args.steps, batch_size=args.batch_size, tangent=args.tangent,
                                lookahead=args.lookahead, progress=lambda m: print(f"... {m}", flush=True))
    print(format_load_steps(result))


if __name__ == "__main__":
    main()
