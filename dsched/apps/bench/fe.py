"""Benchmark of a finite-element solve: FElupe's Newton loop with its material alone, and through dsched.

The same solve, in the same run, four ways:

- ``FElupe alone``: FElupe's own material, called by FElupe on all points at once (one process, one thread);
- ``through dsched``: :class:`dsched.FEMaterial` around the same material: each Newton iteration is one
  dispatch, split by cells over two single-thread worker processes (``cpu`` and an emulated ``cuda:0``),
  up to four chunks per device (``scheduler_for`` of the example), each running the material's gradient
  and hessian;
- ``through dsched, one call``: the same, the material function called once per chunk for the stress,
  the state and the tangent (``OneCall`` of the example), where FElupe calls it twice;
- ``one call, tangent predicted``: the same with ``tangent="predict"``: an evaluation whose deformation
  gradient changed a hundredfold less than at the last one, Newton's convergence check, leaves the
  tangent out (``no tangent`` counts those evaluations, ``tangents_left_out`` in the JSON).

Two cases: FElupe's J2 plate with a hole (the linear solve dominates), and a cube of hexahedra
(eight quadrature points per cell) with a material of 64 J2 layers in parallel (1,234 state
variables per point: the material dominates). Each row is the best of interleaved repeats; every
dsched row is checked against FElupe alone, bit for bit. ``material share`` is the part of FElupe's
own solve spent in its material, and Amdahl's bound the ratio to FElupe alone that the solve would
reach with that part split perfectly over the two workers and the rest unchanged (a form that does
less material work than FElupe, such as one call, may pass it). A split is rarely perfect: the
material's gradient and hessian on each half of the cells, timed in this process at the last Newton
iteration's inputs, cost on average more than half of their time on all of them where each call has
a cost of its own, and the bound with that measured cost (``halves_bound``) is what the same work
split over two workers can reach. Before any solve is timed, one call on both workers opens the
cluster's feeds and has the workers import FElupe.

The FE code is FElupe (GPL-3.0), which the dsched package does not import: the solves are those of
``examples/fe_plasticity.py``, loaded from the checkout this package runs from (or, installed, from the
checkout in the current folder). The suite is skipped,
with its reason, where FElupe or the example is missing. Nothing here measures a GPU.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import numpy as np

import dsched
from dsched.apps.bench.scheduling import verdict

__all__ = ["CASES", "TARGETS", "WORKERS", "amdahl_bound", "format_fe_table", "half_cost", "load_example",
           "run_fe_benchmarks", "skip_reason"]

EXAMPLE = pathlib.PurePath("examples", "fe_plasticity.py")
#: case name -> (example case, cells per edge, quick cells per edge, J2 layers)
CASES = {"J2 plate": ("plate", 100, 20, 1), "64 J2 layers": ("hexahedra", 6, 3, 64)}
#: case name -> the ratio to FElupe alone that the best dsched row should reach
TARGETS = {"J2 plate": 1.0, "64 J2 layers": 1.5}
#: each dsched form: (the material's function run once per chunk for stress, state and tangent, FEMaterial's tangent)
DSCHED_FORMS = {"through dsched": (False, "with-gradient"), "through dsched, one call": (True, "with-gradient"),
                "one call, tangent predicted": (True, "predict")}
FORMS = ("FElupe alone", *DSCHED_FORMS)
WORKERS = 2  # the worker processes the material is split over (cpu and the emulated cuda:0)
#: how the table names an example case's mesh, given its cells
MESHES = {"plate": "a plate with a hole of {cells:,} quadrilaterals", "hexahedra": "a cube of {cells:,} hexahedra"}


def amdahl_bound(share, workers=WORKERS, part=None) -> float:
    """The ratio to the solve alone with its material (``share`` of it) split over ``workers``, each worker's part
    costing ``part`` of the whole material's time (``1 / workers``, a perfect split, unless given)."""
    return 1.0 / ((1.0 - share) + share * (1.0 / workers if part is None else part))


def half_cost(material, x, repeats=5) -> float:
    """The two halves of the cells' ``gradient`` and ``hessian``, on average, as a share of all the cells' (each
    the best of ``repeats``, in this process): what splitting the cells costs, apart from how evenly their cost is
    spread (a plastic zone in one half is the scheduler's to balance, with several chunks per device). 0.5 for a
    material whose cost is its arithmetic; more where each call has a cost of its own (Python around arrays too
    small to pay for it)."""
    def seconds(part):
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            material.gradient(part)
            material.hessian(part)
            best = min(best, time.perf_counter() - start)
        return best

    cells = x[0].shape[-1]
    halves = [[np.ascontiguousarray(a[..., cut]) for a in x] for cut in (slice(0, cells // 2), slice(cells // 2, None))]
    return sum(seconds(half) for half in halves) / 2 / seconds(x)


def find_example() -> pathlib.Path:
    """``examples/fe_plasticity.py`` of the checkout this package runs from (an editable install), else of the
    checkout in the current folder (an installed package run from its checkout)."""
    beside = pathlib.Path(__file__).resolve().parents[3] / EXAMPLE
    here = pathlib.Path.cwd() / EXAMPLE
    return here if here.is_file() and not beside.is_file() else beside


def skip_reason(example=None):
    """Why the suite cannot run here (FElupe or the example missing), or ``None``."""
    example = example or find_example()
    if importlib.util.find_spec("felupe") is None:
        return "felupe is not installed (pip install 'dsched[fe]')"
    if not pathlib.Path(example).is_file():
        return f"{example} is missing (run dsched bench from a checkout of dsched)"
    return None


def load_example(path=None):
    """``examples/fe_plasticity.py`` as a module, pickled by value (worker processes cannot import it by name)."""
    import cloudpickle

    path = path or find_example()
    name = "dsched_fe_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        cloudpickle.register_pickle_by_value(module)
    return sys.modules[name]


class _Timed:
    """A material whose calls are timed and counted on their way (FElupe alone: its material's share)."""

    def __init__(self, material):
        self.material, self.x, self.seconds, self.iterations = material, material.x, 0.0, 0
        self.last_x = None  # the last Newton iteration's inputs (hessian's), where the halves' cost is measured

    def gradient(self, x):
        start = time.perf_counter()
        try:
            return self.material.gradient(x)
        finally:
            self.seconds += time.perf_counter() - start

    def hessian(self, x):
        start = time.perf_counter()
        self.iterations += 1  # FElupe asks for one tangent per Newton iteration
        self.last_x = x
        try:
            return self.material.hessian(x)
        finally:
            self.seconds += time.perf_counter() - start


def measure_case(example, client, case, size, layers, repeats=2, steps=10, progress=None) -> dict:
    """One case, every form, ``repeats`` interleaved rounds; seconds per form (best and all) and the checks."""
    say = progress or (lambda line: None)
    rows = {form: {"seconds": []} for form in FORMS}
    reference, (cells, points) = None, _cells(example, case, size)
    for round_ in range(repeats):
        for form in FORMS:
            material = example.material(layers)
            if form == "FElupe alone":
                umat = _Timed(material)
            else:
                one_call, tangent = DSCHED_FORMS[form]
                umat = dsched.FEMaterial(example.OneCall(material) if one_call else material,
                                         scheduler=example.scheduler_for(cells, points), client=client, tangent=tangent)
            say(f"fe: {case} ({size} cells per edge, {layers} layer{'s' * (layers > 1)}), {form}, "
                f"round {round_ + 1} of {repeats}")
            seconds, u, state = example.solve(case, size, umat, steps)
            row = rows[form]
            row["seconds"].append(seconds)
            if form == "FElupe alone":
                reference = (u, state)
                row.setdefault("material_shares", []).append(umat.seconds / seconds)
                row["iterations"] = umat.iterations
                row.update(cells=state.shape[-1], points=state.shape[-1] * state.shape[-2],
                           state_variables=state.shape[0])
                if "half_cost" not in row:
                    row["half_cost"] = half_cost(example.material(layers), umat.last_x)
            else:
                same = bool(np.array_equal(u, reference[0]) and np.array_equal(state, reference[1]))
                row["identical"] = row.get("identical", True) and same
                row["dispatches"] = umat.evaluations
                row["tangents_left_out"] = umat.tangents_left_out
    alone = min(rows["FElupe alone"]["seconds"])
    for form, row in rows.items():
        row["best"] = min(row["seconds"])
        row["ratio"] = alone / row["best"]
    plain = rows["FElupe alone"]  # the share (and the bound) of its best round
    share = plain["material_share"] = plain["material_shares"][plain["seconds"].index(plain["best"])]
    return {"case": case, "size": size, "layers": layers, "steps": steps, "repeats": repeats, "rows": rows,
            "workers": WORKERS, "amdahl_bound": amdahl_bound(share),
            "halves_bound": amdahl_bound(share, part=plain["half_cost"])}


def _cells(example, case, size) -> tuple:
    """The case's cells and quadrature points per cell."""
    solid, _ = example.problem(case, size, example.material(1), steps=1)
    points, cells = solid.results.statevars.shape[-2:]
    return cells, points


def run_fe_benchmarks(*, quick=False, repeats=None, client=None, progress=None, sizes=None, steps=10) -> dict:
    """Both cases (``quick``: small meshes); ``{"cases": {name: measure_case(...)}, "targets": {...}}``.

    Each form's best of ``repeats`` interleaved rounds (3; 2 when ``quick``): a solve of a few seconds on a shared
    machine varies by a third from one round to the next, and the best round is the least disturbed.

    ``sizes`` maps a case's name to its cells per edge instead (a subset runs those cases only). Runs on
    ``client``, else on a cluster of two single-thread worker processes (``cpu`` and an emulated ``cuda:0``)
    started here. Raises ``RuntimeError`` with the reason where FElupe or the example is missing.
    """
    reason = skip_reason()
    if reason is not None:
        raise RuntimeError(reason)
    from distributed import Client

    repeats = repeats or (2 if quick else 3)

    if sizes is None:
        sizes = {name: quick_size if quick else size for name, (_, size, quick_size, _) in CASES.items()}
    unknown = sorted(set(sizes) - set(CASES))
    if unknown:
        raise ValueError(f"sizes: no case {unknown[0]!r} (cases: {', '.join(map(repr, CASES))})")
    example = load_example()
    cluster = None
    if client is None:
        cluster = dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                            dashboard_address=None)
    try:
        with (Client(cluster, set_as_default=False) if cluster is not None else _Kept(client)) as on:
            _warm_up(example, on)
            cases = {name: measure_case(example, on, CASES[name][0], size, CASES[name][3], repeats, steps, progress)
                     for name, size in sizes.items()}
    finally:
        if cluster is not None:
            cluster.close()
    targets = {}
    for name, case in cases.items():
        best = max(case["rows"][form]["ratio"] for form in FORMS[1:])
        bound = TARGETS[name]
        targets[f"{name} >= {bound:g} x FElupe alone"] = (best, bound, best >= bound)
    targets["bit-identical to FElupe"] = all(
        case["rows"][form]["identical"] for case in cases.values() for form in FORMS[1:])
    return {"cases": cases, "targets": targets,
            "emulation": "the cuda:0 worker is emulated (a CPU process): two worker processes, no GPU"}


def _warm_up(example, client):
    """One material call on both devices before any solve is timed: a cluster's first call opens its feeds and
    lanes, and the workers import FElupe and the example (about a second): set-up, not the solve."""
    devices = ["cpu", "cuda:0"]
    umat = dsched.FEMaterial(example.material(), scheduler=dsched.StaticHybridScheduler(devices, [1, 1], [1, 1]),
                             client=client)
    umat.gradient([np.broadcast_to(np.eye(3)[..., None, None], (3, 3, 1, len(devices))),
                   np.zeros((*umat.x[-1].shape, 1, len(devices)))])


def _ratio(value, target) -> str:
    """``value`` to two decimals, or three where two would round a miss up to its ``target`` (1.4963 as 1.496)."""
    return f"{value:.3f}" if value < target <= round(value, 2) else f"{value:.2f}"


class _Kept:
    """A client given by the caller, used in a ``with`` block without being closed at its end."""

    def __init__(self, client):
        self.client = client

    def __enter__(self):
        return self.client

    def __exit__(self, *exc):
        return False


def format_fe_table(results) -> str:
    """The suite as a text table (or the line saying why it was skipped)."""
    if "skipped" in results:
        return f"fe suite skipped: {results['skipped']}"
    lines, bounds = [], {}
    for name, case in results["cases"].items():
        alone = case["rows"]["FElupe alone"]
        workers = case.get("workers", WORKERS)
        bounds[name] = case.get("amdahl_bound", amdahl_bound(alone["material_share"], workers))
        mesh = MESHES.get(case["case"], "a " + case["case"] + " of {cells:,} cells").format(cells=alone["cells"])
        lines.append(f"{name}: {mesh}, {alone['points']:,} points, {alone['state_variables']:,} state variables "
                     f"per point, {case['steps']} load steps, {alone['iterations']} Newton iterations; material "
                     f"{alone['material_share']:.0%} of FElupe's solve: Amdahl's bound on {workers} workers "
                     f"{bounds[name]:.2f} x")
        if "halves_bound" in case:  # runs before it was measured have none
            lines.append(f"  each half of the cells costs on average {alone['half_cost']:.0%} of the material's "
                         f"time on all of them: bound with that split {case['halves_bound']:.2f} x")
        lines.append(f"  {'form':<28}{'best s':>9}{'x alone':>9}{'dispatches':>12}{'no tangent':>12}  bit-identical")
        for form, row in case["rows"].items():
            extra = "" if form == "FElupe alone" else (f"{row['dispatches']:>12}{row.get('tangents_left_out', 0):>12}  "
                                                       f"{'yes' if row['identical'] else 'NO'}")
            lines.append(f"  {form:<28}{row['best']:>9.2f}{row['ratio']:>8.2f}x{extra}")
    for target, reached in results.get("targets", {}).items():
        value = ""
        if isinstance(reached, (list, tuple)):
            name = next((name for name in bounds if target.startswith(f"{name} >=")), None)
            bound = bounds.get(name)
            halves = None if name is None else results["cases"][name].get("halves_bound")
            value = (f" ({_ratio(reached[0], reached[1])} x"
                     + ("" if bound is None else f"; Amdahl's bound {bound:.2f} x")
                     + ("" if halves is None else f", {halves:.2f} x with the halves' cost") + ")")
        met = reached[-1] if isinstance(reached, (list, tuple)) else reached
        lines.append(f"target {target}: {verdict(met)}{value}")
    lines.append(f"best of {next(iter(results['cases'].values()))['repeats']} interleaved rounds; cuda:0 is "
                 "emulated (a CPU process): this measures the FE solve on two CPU workers, not a GPU.")
    return "\n".join(lines)
