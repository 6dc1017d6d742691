"""Benchmark of the cost of one call: what a solver pays per Newton iteration, whatever its model costs.

Every row times one call of a model that does nothing, over two chunks, one
on each of two single-thread worker processes (the cluster without the
dashboard but for the row that says so) (``cpu`` and an **emulated**
``cuda:0``: a CPU process claiming the device), in the same run:

- ``pipe round trip`` (the limit): two bare ``multiprocessing`` processes, a
  ``Pipe`` each; send each a small descriptor, receive each a small reply.
  What a same-host message costs in Python, with no framework at all;
- ``dsched.dispatch``: the one-call form on a no-op, inputs and outputs of 2
  x 100 rows through the data plane;
- ``dsched.dispatch, no lane spin``: the same with ``dsched.lane-spin`` at 0, the run
  sleeping in ``poll`` at once while it waits for the replies (what the look before
  sleeping saves: :mod:`dsched.dispatch.steady`);
- ``dsched.dispatch, steps of a shared history``: the one-call form over step ``k``
  of a history the caller keeps in shared memory, ``k`` one further at every call
  (a solver's loading history): the replay reads each step where it lies;
- ``WorkDispatcher.run``: the same through one dispatcher kept across calls (its
  runs, like the one-call form's, are replays: :mod:`dsched.dispatch.replay`), with
  the timeline of such a call from its report (:func:`_phases`), and of a
  run on the steady path from its hooks (:class:`Timeline`: a run with an
  observer does not replay);
- ``dsched.dispatch, dashboard on``: the one-call form on a cluster whose
  scheduler serves dsched's dashboard page (``LocalHybridCluster``'s default):
  the page hears of each call's chunks before it returns, one more message to
  the scheduler per call;
- ``Batch update + get``: a resident batch's step, an update of a no-op on its
  field, then ``get`` of the field (the fields in host memory, ``Batch``'s
  choice on these workers);
- ``TrialState trial + commit``: a Newton loop's step with resident state
  (:class:`dsched.TrialState`), a trial of a no-op from the committed state,
  then its commit;
- ``dsched.submit + result``: the call that does not wait, then its result;
- ``dask submit + gather``: plain Dask, two no-op tasks pinned to the two
  workers, then ``gather``;
- ``ray tasks + get`` (only where Ray is installed): two no-op tasks, then
  ``ray.get``.

Beside them, the overlap a future gives (:func:`overlap_with_a_future`: the
caller's own work while a submitted call's chunks run, from the run's report,
written with it to one Chrome trace), and ``/dev/shm`` over many ``Batch.set`` calls of a 5.5 MiB field (each
followed by an update that reads it), which must stay flat.

Medians over many calls after a warm-up; the ratio is to the pipe round trip.
The pipe's two processes live for the whole run, beside the cluster, and the
rows with a target (``dsched.dispatch``, ``Batch update + get``) are timed in
:data:`ROUNDS` rounds with the pipe, in turn (:func:`timed_in_rounds`): their
ratio is the median of the rounds' ratios, each comparing calls made under the
same conditions (on a small machine a median moves by half from one minute to
the next). Nothing here measures a GPU.
"""

from __future__ import annotations

import itertools
import statistics
import time
from multiprocessing import get_context

import dask
import numpy as np
from distributed import Client

import dsched
from dsched.apps.bench.scheduling import verdict

__all__ = ["run_percall_benchmarks", "format_percall", "TARGETS"]

#: the issue's targets, as multiples of the pipe round trip
TARGETS = {"dsched.dispatch": 5.0, "Batch update + get": 5.0}
ROWS = 100  # rows per chunk
HISTORY_STEPS = 1000  # steps of the shared history the history row walks through
ROUNDS = 5  # rounds of the pipe and the rows with a target, timed in turn


def _echo(x):
    return x


def _noop(*args):
    return None


def _step(x):
    return {"x": x}


def _trial(x, state):
    return x, {"x": state["x"]}


def _pipe_server(connection):
    while True:
        message = connection.recv_bytes()
        if message == b"stop":
            return
        connection.send_bytes(b"r" * 64)


def median_us(call, calls, warmup) -> float:
    """Median microseconds of ``call()`` over ``calls`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


class PipePeer:
    """Two bare processes, a ``Pipe`` each (the limit): :meth:`round_trip` sends each a small descriptor and reads
    each a small reply. Kept for a whole run, so that it is timed beside the cluster, as the rows are."""

    def __init__(self):
        context = get_context("spawn")
        self.ends, self.processes = [], []
        for _ in range(2):
            here, there = context.Pipe()
            process = context.Process(target=_pipe_server, args=(there,), daemon=True)
            process.start()
            self.ends.append(here)
            self.processes.append(process)
        self.descriptor = b"d" * 200

    def round_trip(self):
        for end in self.ends:
            end.send_bytes(self.descriptor)
        for end in self.ends:
            end.recv_bytes()

    def close(self):
        for end in self.ends:
            end.send_bytes(b"stop")
        for process in self.processes:
            process.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def timed_in_rounds(calls_by_name, pipe, calls, warmup, rounds=ROUNDS) -> tuple:
    """``(medians, ratios)``: each call of ``calls_by_name`` and the pipe's round trip timed in turn, ``rounds``
    times (``calls`` calls each in all); medians in microseconds over the rounds' medians, and each call's ratio to
    the pipe as the median of the rounds' ratios."""
    per_round = {name: [] for name in ("pipe round trip", *calls_by_name)}
    n, warm = max(10, calls // rounds), max(2, warmup // rounds)
    for _ in range(rounds):
        per_round["pipe round trip"].append(median_us(pipe.round_trip, n, warm))
        for name, call in calls_by_name.items():
            per_round[name].append(median_us(call, n, warm))
    pipe_us = per_round["pipe round trip"]
    medians = {name: statistics.median(us) for name, us in per_round.items()}
    ratios = {name: statistics.median(a / b for a, b in zip(us, pipe_us)) for name, us in per_round.items()}
    return medians, ratios


def time_dsched(client, calls, warmup, pipe) -> dict:
    """Median microseconds per call of each dsched form, on ``client``'s two device workers; the rows with a
    target, and the ``pipe``'s round trip, in rounds (:func:`timed_in_rounds`), their ratios under ``"ratios"``."""
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=ROWS)
    x = np.zeros((2 * ROWS, 3))
    out = {}
    with dask.config.set({"dsched.lane-spin": 0}):  # the run sleeps in poll at once: what the look saves
        out["dsched.dispatch, no lane spin"] = median_us(
            lambda: dsched.dispatch(_echo, x, scheduler=scheduler, client=client), calls, warmup)
    history, steps = dsched.shared_empty((HISTORY_STEPS, 2 * ROWS, 3)), itertools.count()
    out["dsched.dispatch, steps of a shared history"] = median_us(
        lambda: dsched.dispatch(_echo, history[next(steps) % HISTORY_STEPS], scheduler=scheduler, client=client),
        calls, warmup)
    from dsched.dataplane.loaders import MappingLoader

    dispatcher = dsched.WorkDispatcher(scheduler, lambda work, device: {"x": work["x"]}, join="concat",
                                       output_spec={"x": ((3,), "f8")}, client=client)
    replays = []

    def replayed():
        dispatcher.run(MappingLoader({"x": x}))
        replays.append(_phases(dispatcher.last_run))  # not the report: it holds the outputs, which go back

    out["WorkDispatcher.run"] = median_us(replayed, calls, warmup)
    out["replay timeline"] = replay_timeline(replays[warmup:])
    timeline = Timeline()
    watched = dsched.WorkDispatcher(scheduler, lambda work, device: {"x": work["x"]}, join="concat",
                                    output_spec={"x": ((3,), "f8")}, client=client, observers=[timeline])
    median_us(lambda: watched.run(MappingLoader({"x": x})), calls, warmup)
    out["timeline"] = timeline.medians()
    out["dsched.submit + result"] = median_us(
        lambda: dsched.submit(_echo, x, scheduler=scheduler, client=client).result(), calls, warmup)
    state = dsched.TrialState({"x": x})

    def newton_step():
        state.trial(_trial, x, scheduler=scheduler, client=client)
        state.commit()

    out["TrialState trial + commit"] = median_us(newton_step, calls, warmup)
    batch = dsched.Batch({"x": x}, scheduler, client=client)
    try:
        def step():
            batch.update(_step, reads=["x"], writes=["x"])
            batch.get("x")

        medians, ratios = timed_in_rounds(
            {"dsched.dispatch": lambda: dsched.dispatch(_echo, x, scheduler=scheduler, client=client),
             "Batch update + get": step}, pipe, calls, warmup)
    finally:
        batch.close()
    order = ("pipe round trip", "dsched.dispatch", "dsched.dispatch, no lane spin",
             "dsched.dispatch, steps of a shared history", "WorkDispatcher.run",
             "dsched.submit + result", "TrialState trial + commit", "Batch update + get")
    rows = {**medians, **out}
    return {**{name: rows.pop(name) for name in order}, **rows, "ratios": ratios}


def shm_growth(client, sets) -> dict:
    """``/dev/shm`` over ``sets`` calls of ``Batch.set`` of a 5.5 MiB field (120,000 x 6 float64), each followed by
    an update that reads it: the bytes of this process's segments before and after, and the field's size."""
    import os

    def shm_bytes():
        prefix = f"dsched-{os.getpid()}-"
        return sum(os.path.getsize(os.path.join("/dev/shm", name)) for name in os.listdir("/dev/shm")
                   if name.startswith(prefix))

    n = 120_000
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=n // 2)
    values = np.zeros((n, 6))
    with dsched.Batch({"x": values}, scheduler, client=client) as batch:
        batch.set("strain", values)
        batch.update(_accumulate, reads=["strain", "x"], writes=["x"])
        batch.get("x")
        before = shm_bytes()
        for step in range(sets):
            values[0, 0] = step
            batch.set("strain", values)
            batch.update(_accumulate, reads=["strain", "x"], writes=["x"])
        batch.get("x")
        after = shm_bytes()
    return {"sets": sets, "field_bytes": values.nbytes, "before": before, "after": after}


def _accumulate(strain, x):
    return {"x": x + strain}


class Timeline(dsched.RunObserver):
    """Where one call's time goes, from the hooks of a run (the client's clock and the workers', one host):
    ``set-up`` (the call until its first chunk is dispatched), ``to the worker`` (a chunk's dispatch until its
    worker starts it), ``on the worker`` (the chunk's run there), ``back`` (its end there until the client
    accounts for it), ``end of the call`` (the last accounted chunk until the run returns)."""

    PHASES = ("set-up", "to the worker", "on the worker", "back", "end of the call", "whole call")

    def __init__(self):
        self.runs = []
        self._dispatched, self._done = [], []

    def work_dispatched(self, device, n, start, stop):
        self._dispatched.append(stop)

    def chunk_completed(self, record):
        self._done.append((record.index, record.start, record.stop, time.time()))

    def run_finished(self, report):
        dispatched, done, self._dispatched, self._done = self._dispatched, self._done, [], []
        if not dispatched or len(done) != len(dispatched):
            return
        chunks = [(dispatched[index], start, stop, heard) for index, start, stop, heard in done]
        self.runs.append({
            "set-up": dispatched[0] - report.wall_start,
            "to the worker": statistics.median(start - sent for sent, start, _, _ in chunks),
            "on the worker": statistics.median(stop - start for _, start, stop, _ in chunks),
            "back": statistics.median(heard - stop for _, _, stop, heard in chunks),
            "end of the call": report.wall_stop - max(heard for *_, heard in chunks),
            "whole call": report.wall_stop - report.wall_start,
        })

    def medians(self) -> dict:
        """Microseconds per phase, medians over the calls watched."""
        return {phase: statistics.median(run[phase] for run in self.runs) * 1e6 for phase in self.PHASES} \
            if self.runs else {}


def _phases(report):
    """A replayed run's :class:`Timeline` phases in seconds, from its report alone (a replay tells no observer):
    ``set-up`` until its last message went; ``None`` for a run that was not a replay."""
    records = report.records
    if not report.sent or not records or not all(r.heard for r in records):
        return None
    return {
        "set-up": report.sent - report.wall_start,
        "to the worker": statistics.median(r.start - report.sent for r in records),
        "on the worker": statistics.median(r.stop - r.start for r in records),
        "back": statistics.median(r.heard - r.stop for r in records),
        "end of the call": report.wall_stop - max(r.heard for r in records),
        "whole call": report.wall_stop - report.wall_start,
    }


def replay_timeline(runs) -> dict:
    """Microseconds per phase (medians) of replayed runs' :func:`_phases`."""
    runs = [run for run in runs if run is not None]
    return {phase: statistics.median(run[phase] for run in runs) * 1e6 for phase in Timeline.PHASES} if runs else {}


def _busy(x, seconds):
    """About ``seconds`` of NumPy work on large arrays (which lets go of the GIL, as a solver's assembly does)."""
    work, stop = np.ones(200_000), time.perf_counter() + seconds
    while time.perf_counter() < stop:
        np.sin(work, out=work)
    return x


def overlap_with_a_future(client, seconds=0.05, path=None) -> dict:
    """A submitted call's chunks (``seconds`` of work each, one per device) and the caller's own work of as long:
    how long they ran at the same time, and the wall time against the same two one after the other. Both are
    written to one Chrome trace (``path``, default a temporary file): the chunks from the run's report, the
    caller's work as a span of its own."""
    import os
    import tempfile

    from dsched.observe.trace import trace_writer

    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=ROWS)
    x = np.zeros((2 * ROWS, 3))
    path = path or os.path.join(tempfile.mkdtemp(prefix="dsched-overlap-"), "overlap.trace.json")
    # Submitted calls run on a thread of the scheduler's, whose feeds the first one starts.
    dsched.submit(_busy, x, scheduler=scheduler, client=client, seconds=seconds).result()
    start = time.perf_counter()
    dsched.submit(_busy, x, scheduler=scheduler, client=client, seconds=seconds).result()
    _busy(x, seconds)
    one_after_the_other = time.perf_counter() - start
    with dsched.run_reports() as reports:
        start = time.perf_counter()
        future = dsched.submit(_busy, x, scheduler=scheduler, client=client, seconds=seconds)
        began = time.time()
        _busy(x, seconds)
        caller = (began, time.time())
        future.result()
        overlapped = time.perf_counter() - start
    chunks = [(record.start, record.stop, str(record.device)) for record in reports[-1].records]
    with trace_writer(path) as writer:
        writer.span("caller's own work", "solver", *caller, track="caller")
        for chunk_start, chunk_stop, device in chunks:
            writer.span("task", "WorkDispatcher", chunk_start, chunk_stop, track=device)
    together = sum(max(0.0, min(stop, caller[1]) - max(begin, caller[0]))
                   for begin, stop in _union([(a, b) for a, b, _ in chunks]))
    return {"trace": path, "work seconds": seconds, "overlap": together / (caller[1] - caller[0]),
            "one after the other": one_after_the_other, "with submit": overlapped}


def _union(spans) -> list:
    """Disjoint spans covering the same times as ``spans``."""
    merged = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def time_dask(client, calls, warmup) -> float:
    """Median microseconds of two no-op tasks, one per worker, submitted and gathered with plain Dask."""
    workers = sorted(client.scheduler_info()["workers"])

    def call():
        futures = [client.submit(_noop, i, workers=[w], pure=False) for i, w in enumerate(workers[:2])]
        client.gather(futures)

    return median_us(call, max(10, calls // 5), max(3, warmup // 5))


def time_ray(calls, warmup):
    """Median microseconds of two no-op Ray tasks and ``ray.get``; ``None`` without Ray."""
    try:
        import ray
    except ImportError:
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        noop = ray.remote(_noop)
        return median_us(lambda: ray.get([noop.remote(i) for i in range(2)]), max(10, calls // 5),
                          max(3, warmup // 5))
    finally:
        ray.shutdown()


def run_percall_benchmarks(*, quick=False, calls=None, sets=None, say=print) -> dict:
    """Every row, in one run; ``{"calls", "rows": {name: microseconds}, "ratios": {name: x pipe}, "targets"}``.

    ``calls`` (default 2,000; 300 quick) timed calls of the cheap rows (a tenth, at least 10, of the slow ones),
    after a warm-up of a tenth as many; ``sets`` (default 1,000; 100 quick) calls of ``Batch.set``.
    """
    calls = calls or (300 if quick else 2000)
    warmup = max(5, calls // 10)
    say("percall: dsched on two worker processes (cpu, emulated cuda:0), and the pipe round trip")
    with PipePeer() as pipe, \
            dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                      dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        rows = time_dsched(client, calls, warmup, pipe)
        timeline = rows.pop("timeline")
        replay = rows.pop("replay timeline")
        in_rounds = rows.pop("ratios")
        say("percall: /dev/shm over repeated Batch.set")
        shm = shm_growth(client, sets or (100 if quick else 1000))
        say("percall: a future's overlap with the caller's work")
        overlap = overlap_with_a_future(client)
        say("percall: plain Dask")
        rows["dask submit + gather"] = time_dask(client, calls, warmup)
    say("percall: dsched.dispatch with the dashboard on the scheduler")
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                   dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster, set_as_default=False) as client:
        scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=ROWS)
        x = np.zeros((2 * ROWS, 3))
        rows["dsched.dispatch, dashboard on"] = median_us(
            lambda: dsched.dispatch(_echo, x, scheduler=scheduler, client=client), max(10, calls // 2), warmup)
    ray = time_ray(calls, warmup)
    if ray is not None:
        rows["ray tasks + get"] = ray
    limit = rows["pipe round trip"]
    ratios = {name: in_rounds.get(name, us / limit) for name, us in rows.items()}
    targets = {f"{name} <= {bound:g} x the pipe round trip": ratios[name] <= bound for name, bound in TARGETS.items()}
    targets[f"/dev/shm flat over {shm['sets']:,} Batch.set calls"] = shm["after"] - shm["before"] < shm["field_bytes"]
    return {"calls": calls, "rounds": ROUNDS, "rows": rows, "ratios": ratios, "targets": targets, "timeline": timeline,
            "replay timeline": replay, "shm": shm, "overlap": overlap,
            "emulation": "the cuda:0 worker is emulated (a CPU process): two worker processes, no GPU"}


def format_percall(results) -> str:
    lines = [f"{'per call (2 chunks, 2 worker processes)':<44}{'median':>12}{'x pipe':>9}  target"]
    for name, us in results["rows"].items():
        ratio = results["ratios"][name]
        target = TARGETS.get(name)
        mark = "" if target is None else f"<= {target:g} x: {verdict(ratio <= target)}"
        shown = f"{us:,.0f} us" if us >= 10 else f"{us:.1f} us"
        lines.append(f"{name:<44}{shown:>12}{ratio:>8.1f}x  {mark}")
    if results.get("rounds"):
        lines.append(f"rows with a target: their ratio is the median of {results['rounds']} rounds' ratios, each round "
                     "timed in turn with the pipe (not the quotient of the medians)")
    for key, what in (("replay timeline", "one WorkDispatcher.run replayed (the rows above)"),
                      ("timeline", "one WorkDispatcher.run on the steady path, watched by an observer")):
        timeline = results.get(key) or {}
        if timeline:
            lines.append("")
            lines.append(f"{what}, phase by phase (medians; 'to the worker', 'on the worker' and 'back' per chunk, "
                         "the two chunks at once):")
            lines.append("  " + ", ".join(f"{phase} {us:,.0f} us" for phase, us in timeline.items()))
    overlap = results.get("overlap")
    if overlap:
        lines.append(f"a future: the caller's {overlap['work seconds'] * 1e3:.0f} ms of work ran beside the chunks for "
                     f"{overlap['overlap']:.0%} of it; {overlap['with submit'] * 1e3:.0f} ms with submit against "
                     f"{overlap['one after the other'] * 1e3:.0f} ms one after the other (trace: {overlap['trace']})")
    shm = results.get("shm")
    if shm:
        grown = (shm["after"] - shm["before"]) / 2**20
        lines.append(f"/dev/shm over {shm['sets']:,} Batch.set calls of a {shm['field_bytes'] / 2**20:.1f} MiB field "
                     f"(each read by an update): {shm['before'] / 2**20:,.1f} MiB before, "
                     f"{shm['after'] / 2**20:,.1f} MiB after ({grown:+,.1f} MiB)")
    for target, met in results.get("targets", {}).items():
        lines.append(f"target {target}: {verdict(met)}")
    lines.append("cuda:0 is emulated (a CPU process): this measures the cost of a call, not a GPU.")
    return "\n".join(lines)
