"""NEML2's own benchmark scenarios through dsched, against NEML2's driver and the two-worker limit, in one run.

``dsched bench --only neml2 [--quick] [--neml2-benchmarks PATH] [--neml2-scenarios a,b]``
(or ``python -m dsched.apps.bench.neml2``) runs four of NEML2's benchmark
scenarios (:data:`dsched.models.neml2_scenarios.SCENARIOS`: elasticity on
500,000 points, radret on 10,000, isoharden on 4,000, chaboche2 on 1,000),
the first ``--neml2-steps`` (10) of their 100 strain steps, the old state carried
from step to step as NEML2's ``TransientDriver`` carries it. The models are
dsched's copies of NEML2's files (``dsched/models/scenarios``), or NEML2's
own files and histories with ``--neml2-benchmarks`` (a checkout's
``benchmark/`` folder). The histories are built once, in shared memory.
``--neml2-points N`` runs every scenario on ``N`` points; ``--neml2-block``
sets the dsched forms' :class:`NEML2Model` ``block`` (``none``: one NEML2
call per chunk).

Rows, in points x steps per second (the best of ``--neml2-repeats`` rounds, 5, after a
warm-up round; the rows of a round run one after another):

- **NEML2, 1 thread / 2 threads**: NEML2's ``TransientDriver`` on the whole
  batch, in this process, with one or two torch threads. The reference.
- **limit**: NEML2's driver on each half of the points, one thread, one half
  after the other; two such halves side by side are what two single-thread
  workers can reach: ``points x steps / slower half``. NEML2 is called on
  each whole half, as a user calling it directly would; dsched calls it on
  blocks of a half where the model solves (:mod:`dsched.models.row_blocks`;
  radret's 5,000 points in one, a larger batch in blocks of 25,000), which
  can be faster per point: a form may pass the limit.
- **lockstep**: the limit when every step waits for its slower half, as a
  form that returns to the client after each step must: the halves' step
  times (measured in the limit's run) differ from step to step as their
  Newton solves do, so ``sum(max(a, b))`` over the steps exceeds
  ``max(sum(a), sum(b))``.
- **side by side**: the same two halves run at once, one in each worker
  process: what the hardware gives two single-thread workers (they share
  caches and memory bandwidth: a memory-bound model such as elasticity does
  not double), measured rather than assumed.
- **paced side by side**: the same, every step of both halves released by a
  message from the bench's thread and answered by one, the next step
  released once both answered (:func:`~dsched.apps.bench.neml2_forms.side_by_side_paced`):
  NEML2's own steps on data that never moves, with nothing between them but
  a message each way. What a form that returns to its caller after every
  step (the two dispatch forms) can reach at best on these workers.
- **dispatch, NumPy**: :meth:`NEML2Model.dispatch` once per step on NumPy
  inputs, the state carried on the client (what a user writes by hand).
- **dispatch, typed**: the same on NEML2's typed tensors (``SR2``, ``Scalar``).
- **Batch**: a :class:`dsched.Batch` with one update per step, whose function
  calls the model where the chunk lives (:class:`~dsched.resident.driver.TransientDriver`
  with ``steps_per_update=1``, ``memory="device"``): the state stays on the
  workers as torch tensors, and a chunk steps on without waiting for the other.
- **driver**: :class:`~dsched.resident.driver.TransientDriver` with every step
  in one update of each chunk, on its default ``memory="auto"``: here, the
  state in host memory and the update one call over the fast lanes.

The dsched rows run on two single-thread worker processes, ``cpu`` and an
emulated ``cuda:0`` (a second CPU worker: placement only, not a GPU), each
given one half of the points (a ``StaticHybridScheduler`` of two halves).
Every dsched result is compared with NEML2's driver run on the same chunks
(the two halves, each in :class:`NEML2Model`'s blocks of at most 25,000
points on a CPU where the model solves, :mod:`dsched.models.row_blocks`:
equal, bit for bit where the arithmetic is the same) and with the whole
batch (radret's Newton tolerance is tightened on both sides: at NEML2's
default, its convergence test over the whole batch makes the two differ).

Targets (ratios within the run): every scenario and form >= 0.8 x the limit;
the median of all forms and scenarios >= 1.0 x NEML2 on 2 threads; the typed
form within 1.2 x the NumPy form's time; a resident Batch at least as fast
as dispatching every step.

``--neml2-compile [MODE]`` and ``--neml2-aoti DIR`` add compiled and AOTI
rows, and their targets (:mod:`dsched.apps.bench.neml2_compiled`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time

import dsched
from dsched.apps.bench.neml2_forms import (  # noqa: F401  (dispatch_steps, driver_steps: their old home)
    FORM_TITLES,
    FORMS,
    STEPPED,
    dispatch_steps,
    driver_steps,
    errors,
    forms as _forms,
    halves as _halves,
    side_by_side,
    side_by_side_paced,
    take_devices,
)
from dsched.apps.bench.neml2_compiled import compile_options, compiled_verdicts, format_compiled, measure_compiled
from dsched.apps.bench.scheduling import verdict
from dsched.models.neml2 import NEML2Model
from dsched.models.neml2_scenarios import SCENARIOS, checkout_scenario, model_overrides, run_neml2_driver
from dsched.models.row_blocks import BLOCK, spans

__all__ = ["FORMS", "TARGETS", "run_neml2_benchmarks", "measure_scenario", "lockstep_penalty", "format_neml2_table",
           "main", "dispatch_steps", "driver_steps"]

TARGETS = {"limit": 0.8, "side_by_side": 0.9, "median_vs_neml2_2": 1.1, "typed_vs_numpy": 1.2,
           "batch_vs_numpy": 1.0}
QUICK_DIVISOR = 10  # --quick: a tenth of the points
REPEATS = 5  # measured rounds: the machine's noise is a tenth of a row's time, and every row takes its best


# --- one scenario ----------------------------------------------------------------


def measure_scenario(scenario, client, *, points=None, steps=10, repeats=REPEATS, forms=FORMS, progress=None,
                     block="auto", compile=None, aoti=None) -> dict:
    """Every row of one scenario: ``{"rate": {row: points x steps / s}, "seconds", "error", ...}``.

    ``block``: the dsched forms' :class:`NEML2Model` ``block`` (points per NEML2 call on a CPU). ``compile``
    (``neml2.compile`` options) and ``aoti`` (a folder of artifact roots) add the compiled and AOTI rows
    (:mod:`dsched.apps.bench.neml2_compiled`) under ``"compiled"`` and ``"aoti"``.
    """
    say = progress or (lambda line: None)
    histories = scenario.histories(points, steps, allocate=dsched.shared_empty)
    n = histories.points
    prescribed = {"t": histories.time, **histories.prescribed}
    model = NEML2Model(scenario.input, scenario.model, overrides=model_overrides(scenario, n), block=block)
    halves = _halves(n)
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], halves)
    runs = _forms(model, prescribed, scheduler, client)
    runs = {form: runs[form] for form in forms}
    seconds = {row: [] for row in ("neml2_1", "neml2_2", "limit", "lockstep", "side_by_side", "paced", *runs)}
    results, whole, halved = {}, None, None
    for round_ in range(repeats + 1):  # round 0 warms up: imports, model loads, first calls
        whole, [t1] = run_neml2_driver(scenario, histories, threads=1)
        _, [t2] = run_neml2_driver(scenario, histories, threads=2)
        halved, per_half, per_step = run_neml2_driver(scenario, histories, chunks=halves, threads=1, per_step=True)
        side = side_by_side(client, scenario, n, steps, halves)
        paced = side_by_side_paced(client, scenario, n, steps, halves)
        take_devices(model, histories, scheduler, client)
        if round_:
            seconds["neml2_1"].append(t1)
            seconds["neml2_2"].append(t2)
            seconds["limit"].append(max(per_half))
            seconds["lockstep"].append(max(per_half) + lockstep_penalty(per_step))
            seconds["side_by_side"].append(side)
            seconds["paced"].append(paced)
        for form, run in runs.items():
            start = time.perf_counter()
            results[form] = run()
            if round_:
                seconds[form].append(time.perf_counter() - start)
        say(f"neml2 {scenario.name}: round {round_}/{repeats} done" + (" (warm-up)" if not round_ else ""))
    blocks = _blocks(halves, model.block)
    if blocks != halves:  # NEML2 on the blocks dsched calls it on: the reference of "same chunks" (not timed)
        halved, _ = run_neml2_driver(scenario, histories, chunks=blocks, threads=1)
    best = {row: min(values) for row, values in seconds.items()}
    rate = {row: n * steps / s for row, s in best.items()}
    extra = measure_compiled(scenario, client, histories, halves, compile=compile, aoti=aoti, repeats=repeats,
                             block=block, progress=progress)
    return {**extra, "scenario": scenario.name, "source": scenario.source, "points": n, "steps": steps, "repeats": repeats,
            "halves": halves, "block": model.block, "seconds": best, "rate": rate,
            "efficiency": {form: rate[form] / rate["limit"] for form in runs},
            "vs_side_by_side": {form: rate[form] / rate["side_by_side"] for form in runs},
            "vs_lockstep": {form: rate[form] / rate["lockstep"] for form in runs},
            "vs_paced": {form: rate[form] / rate["paced"] for form in runs if form in STEPPED},
            "vs_neml2_2": {form: rate[form] / rate["neml2_2"] for form in runs},
            "error": {form: errors(results[form], halved, whole) for form in runs}}


def _blocks(halves, block) -> list:
    """The point counts of NEML2's calls on the halves: each half in :mod:`~dsched.models.row_blocks`' blocks."""
    return [stop - start for half in halves for start, stop in spans(half, block)]


def lockstep_penalty(per_step) -> float:
    """Seconds every step waiting for its slower chunk adds to the slower chunk's total.

    Examples
    --------
    >>> round(lockstep_penalty([[3.0, 1.0], [1.0, 2.0]]), 6)  # max per step 3 + 2 = 5; slower total 4
    1.0
    """
    return sum(map(max, zip(*per_step))) - max(map(sum, per_step))


# --- the suite ---------------------------------------------------------------------

def _scenarios(names, benchmarks, quick, points=None):
    chosen = []
    for name in names:
        scenario = checkout_scenario(benchmarks, name) if benchmarks else SCENARIOS.get(name)
        if scenario is None:
            raise ValueError(f"neml2_scenarios: no scenario {name!r} (there are {', '.join(SCENARIOS)})")
        if points is not None:
            scenario = dataclasses.replace(scenario, points=points)
        if quick:
            scenario = dataclasses.replace(scenario, points=max(8, scenario.points // QUICK_DIVISOR))
        chosen.append(scenario)
    return chosen


def run_neml2_benchmarks(*, quick=False, steps=10, repeats=None, scenarios=None, benchmarks=None,
                         forms=FORMS, progress=None, block="auto", points=None, compile=None, aoti=None) -> dict:
    """Every scenario on one cluster (two single-thread worker processes); the results and the targets' verdicts."""
    import torch
    from distributed import Client

    repeats = (1 if quick else REPEATS) if repeats is None else repeats
    chosen = _scenarios(scenarios or list(SCENARIOS), benchmarks, quick, points)
    threads = torch.get_num_threads()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    measured = []
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                   dashboard_address=None) as cluster, Client(cluster) as client:
        for scenario in chosen:
            measured.append(measure_scenario(scenario, client, steps=steps, repeats=repeats, forms=forms,
                                             progress=progress, block=block, compile=compile, aoti=aoti))
    torch.set_num_threads(threads)
    return {"scenarios": measured, "steps": steps, "repeats": repeats, "quick": quick,
            "benchmarks": str(benchmarks) if benchmarks else None, "forms": list(forms),
            "block": block,
            "compile": compile, "aoti": str(aoti) if aoti else None,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load": {"before": load, "after": os.getloadavg() if load is not None else None},
            "targets": verdicts(measured, forms)}


def verdicts(measured, forms=FORMS) -> dict:
    """The issue's targets over the measured scenarios: ``{target: (value, threshold, met)}``."""
    out = {}
    lowest = min(s["efficiency"][f] for s in measured for f in forms)
    out["every form >= 0.8 x the limit"] = (lowest, TARGETS["limit"], lowest >= TARGETS["limit"])
    side = min((s["vs_side_by_side"][f] for s in measured for f in forms if f != "driver"), default=None)
    if side is not None:
        out["every dispatch and Batch form >= 0.9 x side by side"] = (side, TARGETS["side_by_side"],
                                                                      side >= TARGETS["side_by_side"])
    median = statistics.median(s["vs_neml2_2"][f] for s in measured for f in forms)
    out["median >= 1.1 x NEML2 on 2 threads"] = (median, TARGETS["median_vs_neml2_2"],
                                                  median >= TARGETS["median_vs_neml2_2"])
    if {"numpy", "typed"} <= set(forms):
        worst = max(s["seconds"]["typed"] / s["seconds"]["numpy"] for s in measured)
        out["typed within 1.2 x NumPy (time)"] = (worst, TARGETS["typed_vs_numpy"], worst <= TARGETS["typed_vs_numpy"])
    if "numpy" in forms:
        for form in ("batch", "driver"):
            if form in forms:
                worst = min(s["rate"][form] / s["rate"]["numpy"] for s in measured)
                out[f"{FORM_TITLES[form]} >= dispatch every step"] = (worst, TARGETS["batch_vs_numpy"],
                                                                       worst >= TARGETS["batch_vs_numpy"])
    out.update(compiled_verdicts(measured))
    return out


def blocks_said(scenarios) -> str:
    """How the dsched forms called NEML2 on each scenario's chunks (each scenario's ``block``), for the table's head.

    Examples
    --------
    >>> blocks_said([{"scenario": "a", "block": 7}, {"scenario": "b", "block": 7}])
    '; dsched calls NEML2 on blocks of at most 7 points'
    >>> blocks_said([{"scenario": "a", "block": 7}, {"scenario": "b", "block": None}])
    '; dsched calls NEML2 on blocks of at most 7 points (a), once per chunk (b)'
    """
    said = {}
    for s in scenarios:
        block = s.get("block")
        how = f"on blocks of at most {block:,} points" if block else "once per chunk"
        said.setdefault(how, []).append(s["scenario"])
    if len(said) == 1:
        return f"; dsched calls NEML2 {next(iter(said))}"
    return "; dsched calls NEML2 " + ", ".join(f"{how} ({', '.join(names)})" for how, names in said.items())


def _rate(value) -> str:
    return f"{value / 1e6:.2f} M" if value >= 1e6 else f"{value / 1e3:.1f} k"


def format_neml2_table(results) -> str:
    """The table of the issue: rates per row, efficiency vs the limit, and the targets."""
    forms = results["forms"]
    load = results["load"]
    head = (f"NEML2 scenarios, {results['steps']} steps, best of {results['repeats']}; {results['machine']}; load "
            f"average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after; cuda:0 is emulated (a CPU worker)"
            if load and load["before"] else f"NEML2 scenarios, {results['steps']} steps")
    if results.get("benchmarks"):
        head += f"; NEML2's files from {results['benchmarks']}"
    head += blocks_said(results["scenarios"])
    stepped = [f for f in forms if f in STEPPED]  # the forms that wait for every step's slower half
    columns = ["NEML2 1 thr", "NEML2 2 thr", "limit", "lockstep", "side by side", "paced"] + [
        FORM_TITLES[f] for f in forms]
    lines = [head, f"{'scenario (points)':<22}" + "".join(f"{c:>16}" for c in columns)
             + "  efficiency vs limit / vs side by side (" + " / ".join(FORM_TITLES[f] for f in forms) + ")"
             + (" | vs lockstep, vs paced (" + " / ".join(FORM_TITLES[f] for f in stepped) + ")" if stepped else "")]
    for s in results["scenarios"]:
        rows = ["neml2_1", "neml2_2", "limit", "lockstep", "side_by_side", "paced", *forms]
        lines.append(f"{s['scenario'] + ' (' + format(s['points'], ',') + ')':<22}"
                     + "".join(f"{_rate(s['rate'][r]):>16}" for r in rows)
                     + "  " + " / ".join(f"{s['efficiency'][f]:.2f}" for f in forms)
                     + "  |  " + " / ".join(f"{s['vs_side_by_side'][f]:.2f}" for f in forms)
                     + ("  |  " + " / ".join(f"{s['vs_lockstep'][f]:.2f}" for f in stepped) + ", "
                        + " / ".join(f"{s['vs_paced'][f]:.2f}" for f in stepped) if stepped else ""))
    lines.append("points x steps per second. Largest difference from NEML2 on the same chunks (halves, in blocks): "
                 + ", ".join(f"{s['scenario']} {max(e['same_chunks'] for e in s['error'].values()):.1e}"
                             for s in results["scenarios"])
                 + "; from the whole batch (relative): "
                 + ", ".join(f"{s['scenario']} {max(e['whole_batch_relative'] for e in s['error'].values()):.1e}"
                             for s in results["scenarios"]))
    lines.extend(format_compiled(results, _rate))
    for name, (value, threshold, met) in results["targets"].items():
        shown = f"{value:.2f}" if value == 0 or abs(value) >= 0.01 else f"{value:.1e}"
        lines.append(f"target {name}: {shown} (threshold {threshold}): {verdict(met)}")
    bounds = paced_bounds(results["scenarios"])
    if bounds and stepped:
        lines.append("a call per step reaches at most the paced halves: the lowest paced / side by side is "
                     + ", ".join(f"{value:.2f} ({scenario}, {kind})" for kind, (value, scenario) in bounds.items()))
    return "\n".join(lines)


def paced_bounds(scenarios) -> dict:
    """``{"eager" | "compiled": (lowest paced / side-by-side rate, its scenario)}``: what the forms that return to
    their caller after every step can reach at most, on the scenarios measured with a paced row."""
    tables = {"eager": [(s["scenario"], s["rate"]) for s in scenarios],
              "compiled": [(s["scenario"], s["compiled"]["rate"]) for s in scenarios if "compiled" in s]}
    bounds = {}
    for kind, rows in tables.items():
        measured = [(rate["paced"] / rate["side_by_side"], name) for name, rate in rows
                    if "paced" in rate and "side_by_side" in rate]
        if measured:
            bounds[kind] = min(measured)
    return bounds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="a tenth of the points, one round")
    args = parser.parse_args(argv)
    print(format_neml2_table(run_neml2_benchmarks(**options(args), progress=print)))


def add_arguments(parser):
    """The suite's options (``dsched bench`` adds them too)."""
    parser.add_argument("--neml2-benchmarks", metavar="PATH",
                        help="neml2 suite: a NEML2 checkout's benchmark/ folder (its model.i files and histories)")
    parser.add_argument("--neml2-scenarios", metavar="NAMES",
                        help=f"neml2 suite: comma-separated scenarios (default {','.join(SCENARIOS)})")
    parser.add_argument("--neml2-steps", type=int, default=10, help="neml2 suite: steps of each scenario (default 10)")
    parser.add_argument("--neml2-repeats", type=int, help=f"neml2 suite: measured rounds (default {REPEATS}, 1 with --quick)")
    parser.add_argument("--neml2-points", type=int, metavar="N",
                        help="neml2 suite: points of every scenario (default: each scenario's own)")
    parser.add_argument("--neml2-block", metavar="POINTS",
                        help=f"neml2 suite: points per NEML2 call on a CPU in the dsched forms (default NEML2Model's: "
                             f"{BLOCK} for a model with a Newton solve, else and in compiled rows one call per "
                             "chunk; 'none': one call per chunk)")
    parser.add_argument("--neml2-compile", metavar="MODE", nargs="?", const="default",
                        help="neml2 suite: add compiled rows (neml2.compile with torch.compile's MODE, 'default' "
                             "when none is given, or backend=NAME): NEML2 compiled against dsched's forms with "
                             "compile=True")
    parser.add_argument("--neml2-aoti", metavar="DIR",
                        help="neml2 suite: add AOTI rows from the artifact roots DIR/<scenario> (exported there "
                             "with neml2.export_model_for_aoti when missing: minutes per scenario)")


def options(args) -> dict:
    """``run_neml2_benchmarks`` keywords from parsed arguments; a ValueError naming the option."""
    benchmarks = args.neml2_benchmarks
    if benchmarks is not None and not os.path.isdir(benchmarks):
        raise ValueError(f"--neml2-benchmarks: {benchmarks} is not a folder")
    names = args.neml2_scenarios.split(",") if args.neml2_scenarios else None
    if args.neml2_steps < 1:
        raise ValueError(f"--neml2-steps: expected a positive number of steps, got {args.neml2_steps}")
    if args.neml2_points is not None and args.neml2_points < 2:
        raise ValueError(f"--neml2-points: expected at least 2 points (two halves), got {args.neml2_points}")
    if args.neml2_repeats is not None and args.neml2_repeats < 1:
        raise ValueError(f"--neml2-repeats: expected at least 1 round, got {args.neml2_repeats}")
    aoti = args.neml2_aoti
    if aoti is not None and not os.path.isdir(os.path.dirname(os.path.abspath(aoti))):
        raise ValueError(f"--neml2-aoti: the folder holding {aoti} does not exist")
    return {"quick": args.quick, "steps": args.neml2_steps, "repeats": args.neml2_repeats, "scenarios": names,
            "benchmarks": benchmarks, "block": _block(args.neml2_block), "points": args.neml2_points,
            "compile": compile_options(args.neml2_compile), "aoti": aoti}


def _block(text):
    if text is None:
        return "auto"  # NEML2Model's own: BLOCK for eager models that solve, one call per chunk for the others
    if str(text).lower() == "none":
        return None
    try:
        block = int(text)
    except ValueError:
        block = 0
    if block < 1:
        raise ValueError(f"--neml2-block: expected a number of points >= 1 or 'none', got {text!r}")
    return block


if __name__ == "__main__":
    main()
