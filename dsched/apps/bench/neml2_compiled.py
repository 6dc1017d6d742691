"""The NEML2 bench's compiled and AOTI rows: dsched on compiled models against NEML2 compiled the same way.

NEML2's users run their models fast in two ways, and each gets rows of its
own in ``dsched bench --only neml2``, on the same two single-thread workers
and halves as the eager rows:

``--neml2-compile [MODE]`` (``torch.compile`` through ``neml2.compile``; a
mode such as ``max-autotune``, ``default``, or ``backend=NAME``):

- **NEML2 compiled**: NEML2's driver on the whole batch in the bench's process,
  its model compiled, the better of 1 and 2 torch threads (a compiled model
  can run slower on two);
- **compiled halves side by side**: the same on each half of the points, in
  the two workers at once; **paced**: the same with every step released by a
  message and answered by one, as the eager rows' paced side by side;
- **dispatch, NumPy / driver**: the dsched forms with
  ``NEML2Model(..., compile=..., autograd=False)``.

Both sides evaluate values alone, as a user running a compiled model for
speed does: NEML2's driver under ``torch.no_grad()``, dsched's model with
``autograd=False`` (whose compiled values are computed straight into each
chunk's output rows, :class:`~dsched.models.neml2_engines.ValuesInto`).

``--neml2-aoti DIR`` (NEML2's AOTI artifacts; ``DIR/<scenario>`` is each
scenario's artifact root, exported there with ``neml2.export_model_for_aoti``
when missing, which takes minutes): NEML2's driver over the artifact's
``cpu/float64`` leaf (``neml2.aoti.AOTIModel``) on the whole batch (better
of 1 and 2 threads) and in halves side by side, and the driver form with
``NEML2Model.from_artifacts``.

Compilation happens in the warm-up round. The graphs ``torch.compile`` has
built in the workers are counted after it and after the measured rounds:
the difference (recompilations with a fixed batch) must be zero. Compiled
results are compared with NEML2 compiled on the same pieces of the halves (a
compiled ``NEML2Model`` evaluates each chunk in one call by default, or in
fixed pieces of ``--neml2-block`` rows, a short one padded) and on the whole
batch, both relative to the largest output.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import dsched
from dsched.apps.bench.neml2_forms import (
    FORM_TITLES,
    STEPPED,
    errors,
    first_step_inputs,
    forms,
    side_by_side,
    side_by_side_paced,
    take_devices,
)
from dsched.models.neml2 import NEML2Model, compiled_graphs
from dsched.models.neml2_scenarios import model_overrides, run_neml2_driver
from dsched.models.row_blocks import pieces, spans

__all__ = ["COMPILED_FORMS", "AOTI_FORMS", "COMPILED_TARGETS", "measure_compiled", "compiled_verdicts",
           "format_compiled", "compile_options", "param_vjp_error"]

COMPILED_FORMS = ("numpy", "driver")
AOTI_FORMS = ("driver",)
SMALLEST = 1e-6  # param_vjp_error: gradients below this fraction of the largest are compared at it
COMPILED_TARGETS = {"median_vs_neml2": 1.2, "side_by_side": 0.8, "recompilations": 0, "param_vjp": 1e-10}


def compile_options(text):
    """``NEML2Model``'s ``compile`` for ``--neml2-compile``: ``None`` (absent), ``{}`` (``default``), a backend
    (``backend=aot_eager``: torch.compile's graphs without inductor's code generation) or a mode."""
    if text is None:
        return None
    if str(text).startswith("backend="):
        return {"backend": str(text)[len("backend="):]}
    return {} if text == "default" else {"mode": str(text)}


def measure_compiled(scenario, client, histories, halves, *, compile=None, aoti=None, repeats, block,
                     progress=None) -> dict:
    """The compiled rows (``compile``: ``neml2.compile`` options) and the AOTI rows (``aoti``: a folder of
    artifact roots) of one scenario; ``{}`` with neither."""
    out = {}
    if compile is not None:
        model = NEML2Model(scenario.input, scenario.model, overrides=model_overrides(scenario, histories.points),
                           block=block, compile=compile, autograd=False)
        out["compiled"] = _rows(scenario, client, histories, halves, model, COMPILED_FORMS,
                                {"compile": compile, "grad": False}, repeats, progress, "compiled")
        out["compiled"]["options"] = compile
        out["compiled"]["param_vjp"] = param_vjp_error(model, scenario, histories, halves, client)
        out["compiled"]["block"] = model.block  # None: one NEML2 call per chunk (NEML2Model's default compiled)
        bounds = [n for half in halves for a, b in pieces(half, model.block) for n in [b - a]]
        same, _ = run_neml2_driver(scenario, histories, chunks=bounds, threads=1, compile=compile, grad=False)
        whole, results = out["compiled"].pop("whole"), out["compiled"].pop("results")
        out["compiled"]["error"] = {form: errors(result, same, whole) for form, result in results.items()}
    if aoti is not None:
        root = _artifact(scenario, Path(aoti) / scenario.name, histories.points, progress)
        model = NEML2Model.from_artifacts(root, block=block)
        out["aoti"] = _rows(scenario, client, histories, halves, model, AOTI_FORMS, {"artifacts": root}, repeats,
                            progress, "AOTI")
        out["aoti"]["root"] = str(root)
        blocks = [b - a for half in halves for a, b in spans(half, model.block)]  # as the eager forms cut halves
        halved, _ = run_neml2_driver(scenario, histories, chunks=blocks, threads=1, artifacts=root)
        whole, results = out["aoti"].pop("whole"), out["aoti"].pop("results")
        out["aoti"]["error"] = {form: errors(result, halved, whole) for form, result in results.items()}
    return out


def param_vjp_error(model, scenario, histories, halves, client) -> dict:
    """``param_vjp`` at the first step through dsched against NEML2's on the whole batch in this process (eager):
    ``{"relative": the worst parameter's |difference| / max(|NEML2's|, SMALLEST x the largest), "parameters": n}``.

    A gradient under a millionth of the largest (a round-off zero: radret's flow directions do not depend
    on some weights, whose gradients come out as 1e-13 where the largest is 1e6) is compared at that
    millionth: the round-off of a sum over points is relative to its terms, not to a sum that cancels.
    """
    import numpy as np
    import torch

    from dsched.models.neml2 import _load
    from dsched.models.neml2_evaluate import as_neml2_value

    inputs = first_step_inputs(model, histories)
    rng = np.random.default_rng(0)
    cotangents = {name: rng.normal(size=(histories.points, *model.base_shapes[name])) for name in model.all_output_names}
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], halves)
    ours = model.param_vjp(inputs, cotangents, scheduler=scheduler, client=client)
    reference = _load(model.input, model.model, model.overrides)
    cpu = torch.device("cpu")
    state = {name: as_neml2_value(value, reference.input_spec[name], cpu, torch) for name, value in inputs.items()}
    theirs = {name: grad.detach().numpy() for name, grad in reference.param_vjp(
        state, {name: torch.as_tensor(value) for name, value in cotangents.items()}).items()}
    floor = SMALLEST * max((float(np.max(np.abs(g))) for g in theirs.values()), default=0.0)
    worst = max((float(np.max(np.abs(np.asarray(ours[name]) - g) / np.maximum(np.abs(g), floor or 1e-300)))
                 for name, g in theirs.items()), default=0.0)
    return {"relative": worst, "parameters": len(theirs)}


def _worker_graphs(client) -> int:
    return sum(client.run(compiled_graphs).values())


def _rows(scenario, client, histories, halves, model, form_names, reference, repeats, progress, what) -> dict:
    """NEML2 (``reference``: ``run_neml2_driver``'s ``compile`` or ``artifacts``) on the whole batch with 1 and 2
    threads and in halves side by side, and the dsched forms of ``model``: rates, seconds, graphs compiled."""
    say = progress or (lambda line: None)
    n, steps = histories.points, histories.steps
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], halves)
    runs = forms(model, {"t": histories.time, **histories.prescribed}, scheduler, client)
    runs = {form: runs[form] for form in form_names}
    stepped = [form for form in runs if form in STEPPED]
    seconds = {row: [] for row in ("neml2_1", "neml2_2", "side_by_side", *(["paced"] if stepped else []), *runs)}
    results, whole, graphs = {}, None, {}
    for round_ in range(repeats + 1):  # round 0 warms up: compiles, loads
        if round_ == 1:
            graphs["warm_up"] = _worker_graphs(client)
        started = time.perf_counter()
        whole, [t1] = run_neml2_driver(scenario, histories, threads=1, **reference)
        _, [t2] = run_neml2_driver(scenario, histories, threads=2, **reference)
        side = side_by_side(client, scenario, n, steps, halves, **reference)
        paced = side_by_side_paced(client, scenario, n, steps, halves, **reference) if stepped else None
        take_devices(model, histories, scheduler, client)
        for form, run in runs.items():
            start = time.perf_counter()
            results[form] = run()
            if round_:
                seconds[form].append(time.perf_counter() - start)
        if round_:
            seconds["neml2_1"].append(t1)
            seconds["neml2_2"].append(t2)
            seconds["side_by_side"].append(side)
            if stepped:
                seconds["paced"].append(paced)
        say(f"neml2 {scenario.name}, {what}: round {round_}/{repeats} done in {time.perf_counter() - started:.0f} s"
            + (" (warm-up)" if not round_ else ""))
    graphs["after"] = _worker_graphs(client)
    best = {row: min(values) for row, values in seconds.items()}
    best["neml2"], threads = min((best["neml2_1"], 1), (best["neml2_2"], 2))
    rate = {row: n * steps / s for row, s in best.items()}
    return {"seconds": best, "rate": rate, "neml2_threads": threads,
            "vs_neml2": {form: rate[form] / rate["neml2"] for form in runs},
            "vs_side_by_side": {form: rate[form] / rate["side_by_side"] for form in runs},
            "vs_paced": {form: rate[form] / rate["paced"] for form in stepped},
            "graphs": {**graphs, "recompilations": graphs["after"] - graphs["warm_up"]},
            "forms": list(runs), "results": results, "whole": whole}


def _artifact(scenario, root, points, progress):
    """The scenario's artifact root, exported first if it holds none."""
    if (root / "metadata.json").is_file():
        return root
    import neml2

    (progress or (lambda line: None))(f"neml2 {scenario.name}: exporting its AOTI artifact to {root} (minutes)")
    pre = (f"nbatch={points}",) if scenario.source != "dsched" else ()
    neml2.export_model_for_aoti(str(scenario.input), scenario.model, str(root), pre=pre,
                                additional_args=tuple(scenario.overrides))
    return root


def compiled_verdicts(measured) -> dict:
    """The issue's compiled targets over the measured scenarios: ``{target: (value, threshold, met)}``."""
    rows = [s["compiled"] for s in measured if "compiled" in s]
    if not rows:
        return {}
    median = statistics.median(r["vs_neml2"][f] for r in rows for f in r["forms"])
    side = min(r["vs_side_by_side"][f] for r in rows for f in r["forms"])
    again = sum(r["graphs"]["recompilations"] for r in rows)
    t = COMPILED_TARGETS
    out = {"compiled: median >= 1.2 x NEML2 compiled": (median, t["median_vs_neml2"], median >= t["median_vs_neml2"]),
           "compiled: every form >= 0.8 x compiled halves side by side": (side, t["side_by_side"],
                                                                         side >= t["side_by_side"]),
           "compiled: no recompilation after the warm-up (graphs)": (again, t["recompilations"],
                                                                    again <= t["recompilations"])}
    vjp = [r["param_vjp"]["relative"] for r in rows if r.get("param_vjp", {}).get("parameters")]  # with parameters
    if vjp:
        out["compiled: param_vjp equals NEML2's to 1e-10 relative"] = (max(vjp), t["param_vjp"],
                                                                       max(vjp) <= t["param_vjp"])
    return out


def format_compiled(results, rate) -> list:
    """Lines of the compiled and AOTI rows (``rate``: how a rate prints)."""
    lines = []
    for kind, title in (("compiled", "compiled (neml2.compile)"), ("aoti", "AOTI (neml2.aoti.AOTIModel, cpu leaf)")):
        scenarios = [s for s in results["scenarios"] if kind in s]
        if not scenarios:
            continue
        form_names = scenarios[0][kind]["forms"]
        paced = [f for f in form_names if f in scenarios[0][kind].get("vs_paced", {})]
        rows = ("side_by_side", *(["paced"] if paced else []), *form_names)
        columns = ["NEML2", "side by side", *(["paced"] if paced else [])] + [FORM_TITLES[f] for f in form_names]
        lines.append(f"{title}: NEML2's driver, the better of 1 and 2 threads; halves side by side in the workers"
                     + (", and paced" if paced else "") + "; dsched forms")
        lines.append(f"{'scenario (points)':<22}" + "".join(f"{c:>16}" for c in columns)
                     + "  vs NEML2 / vs side by side (" + " / ".join(FORM_TITLES[f] for f in form_names) + ")"
                     + (" / vs paced (" + " / ".join(FORM_TITLES[f] for f in paced) + ")" if paced else "")
                     + ("  graphs (warm-up, recompiled after)" if kind == "compiled" else ""))
        for s in scenarios:
            r = s[kind]
            lines.append(
                f"{s['scenario'] + ' (' + format(s['points'], ',') + ')':<22}"
                + f"{rate(r['rate']['neml2']) + ' (' + str(r['neml2_threads']) + ')':>16}"
                + "".join(f"{rate(r['rate'][row]):>16}" for row in rows)
                + "  " + " / ".join(f"{r['vs_neml2'][f]:.2f}" for f in form_names)
                + "  |  " + " / ".join(f"{r['vs_side_by_side'][f]:.2f}" for f in form_names)
                + ("  |  " + " / ".join(f"{r['vs_paced'][f]:.2f}" for f in paced) if paced else "")
                + (f"  {r['graphs']['warm_up']}, {r['graphs']['recompilations']}" if kind == "compiled" else ""))
        checked = [s for s in scenarios if s[kind].get("param_vjp", {}).get("parameters")]
        if checked:
            lines.append("param_vjp at the first step against NEML2's (eager, whole batch), worst parameter, relative: "
                         + ", ".join(f"{s['scenario']} {s[kind]['param_vjp']['relative']:.1e}" for s in checked))
        lines.append("Largest difference from NEML2 on the same chunks / the whole batch, relative to the largest "
                     "output: " + ", ".join(
                         f"{s['scenario']} {max(e['same_chunks_relative'] for e in s[kind]['error'].values()):.1e}"
                         f" / {max(e['whole_batch_relative'] for e in s[kind]['error'].values()):.1e}"
                         for s in scenarios))
    return lines
