"""FEMaterial: a finite-element material (FElupe's gradient/hessian protocol) evaluated through dispatch.

Against FElupe's own materials on a small mesh, on worker processes (a CPU and an emulated cuda:0), with
results compared to the last bit: the same NumPy function computes both sides. Tests that need FElupe skip
without it (pip install "dsched[fe]"); the adapter's own checks run everywhere.
"""

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import dsched
from dsched import FEMaterial, SimpleScheduler, StaticHybridScheduler
from dsched.models import fe_material

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fe_plasticity.py"
needs_felupe = pytest.mark.skipif(importlib.util.find_spec("felupe") is None,
                                  reason="felupe is not installed (pip install 'dsched[fe]')")


@pytest.fixture(scope="module")
def example():
    """examples/fe_plasticity.py as a module (its materials and meshes), pickled by value for the workers."""
    from dsched.apps.bench.fe import load_example

    return load_example(EXAMPLE)


@pytest.fixture(scope="module")
def hybrid():
    """Several chunks per device: 40 cells in chunks of 7 (cpu) and 5 (cuda:0)."""
    return StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[7, 5])


@pytest.fixture
def dispatches(monkeypatch):
    """The calls FEMaterial makes to dsched.dispatch, counted (each still runs for real)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].what)
        return dispatch(*args, **kwargs)

    dispatch = fe_material.dispatch
    monkeypatch.setattr(fe_material, "dispatch", counted)
    return calls


def plastic_inputs(umat, cells=40, points=4, seed=3):
    """[F, state] of a J2 material, strained so that about half the points yield."""
    rng = np.random.default_rng(seed)
    F = np.eye(3)[:, :, None, None] + rng.normal(scale=0.0008, size=(3, 3, points, cells))
    return [F, np.zeros((*umat.x[-1].shape, points, cells))]


def assert_lists_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)  # to the last bit: the same arithmetic on the same values


# --- against FElupe's own materials ---------------------------------------------------------------------------

@needs_felupe
def test_gradient_and_hessian_equal_felupes_to_the_last_bit(process_client, example, hybrid):
    j2 = example.material()
    x = plastic_inputs(j2)
    umat = FEMaterial(j2, scheduler=hybrid, client=process_client)
    want_gradient, want_hessian = j2.gradient(x), j2.hessian(x)
    assert 0.2 < (want_gradient[1][0] > 0).mean() < 0.8  # some points yield, some do not
    assert_lists_equal(umat.gradient(x), want_gradient)
    assert_lists_equal(umat.hessian(x), want_hessian)
    assert umat.x is j2.x  # a solid sizes its state variables from x[-1]


@needs_felupe
def test_hessian_after_gradient_at_the_same_x_does_not_dispatch_again(process_client, example, hybrid, dispatches):
    j2 = example.material()
    x = plastic_inputs(j2)
    umat = FEMaterial(j2, scheduler=hybrid, client=process_client)
    umat.gradient(x)
    tangent = umat.hessian(x)[0]
    assert dispatches == ["both"] and umat.evaluations == 1
    # FElupe updates F in place between iterations: the same array with new values is a new evaluation.
    x[0][0, 0] += 1e-3
    umat.hessian(x)
    assert dispatches == ["both", "both"]
    np.testing.assert_array_equal(umat.gradient(x)[0], j2.gradient(x)[0])
    assert dispatches == ["both", "both"] and not np.array_equal(umat.hessian(x)[0], tangent)
    umat.clear()
    umat.gradient(x)
    assert dispatches == ["both", "both", "both"]


@needs_felupe
def test_the_new_state_goes_back_by_reference_and_read_only(process_client, example, hybrid, dispatches):
    """A step's new state, handed back as the next step's old state (FElupe's commit), is neither copied nor
    compared: it lies in shared memory already and is read-only, so it cannot have changed."""
    from dsched.dataplane.store import find_shared

    layered = example.material(3)
    x = plastic_inputs(layered)
    umat = FEMaterial(layered, scheduler=hybrid, client=process_client)
    _, state = umat.gradient(x)
    assert find_shared(state) is not None  # where the workers wrote it
    with pytest.raises(ValueError, match="read-only"):
        state[0, 0, 0] = 1.0
    F = x[0] + 1e-4  # the next load step: a new F, the committed state
    assert_lists_equal(umat.gradient([F, state]), layered.gradient([F, np.array(state)]))
    assert umat._inputs[1] is state  # passed to the workers as it lies, not copied into a buffer
    assert_lists_equal(umat.hessian([F, state]), layered.hessian([F, np.array(state)]))
    assert dispatches == ["both", "both"]  # the hessian at the same x: no dispatch
    # The same values in another array: compared by value, equal, no dispatch; a changed one, a dispatch.
    umat.hessian([F.copy(), np.array(state)])
    assert dispatches == ["both", "both"]
    changed = np.array(state)
    changed[0, 0, 0] += 1.0
    umat.hessian([F, changed])
    assert dispatches == ["both", "both", "both"]


@needs_felupe
def test_apart_dispatches_the_gradient_and_the_hessian_each_when_asked(process_client, example, hybrid, dispatches):
    j2 = example.material()
    x = plastic_inputs(j2)
    umat = FEMaterial(j2, scheduler=hybrid, client=process_client, tangent="apart")
    assert_lists_equal(umat.gradient(x), j2.gradient(x))
    assert_lists_equal(umat.hessian(x), j2.hessian(x))
    assert dispatches == ["gradient", "hessian"]


@needs_felupe
def test_predict_leaves_the_tangent_out_where_newton_converges_and_adds_it_if_asked(process_client, example, hybrid,
                                                                                   dispatches):
    """Newton's iterates: F changes by 1e-3, then by 1e-6 (a thousandfold less: the convergence check, no tangent),
    then the tangent is asked at that x after all (one dispatch of the tangent alone, the gradient kept); a new
    state starts over. Every list equals FElupe's to the last bit."""
    j2 = example.material()
    F, state = plastic_inputs(j2)
    umat = FEMaterial(j2, scheduler=hybrid, client=process_client, tangent="predict")
    for change, want in ((0.0, ["both"]), (1e-3, ["both"]), (1e-6, ["gradient"])):
        F = F + change
        assert_lists_equal(umat.gradient([F, state]), j2.gradient([F, state]))
        assert dispatches[-len(want):] == want
    assert umat.tangents_left_out == 1 and umat.evaluations == 3
    assert_lists_equal(umat.hessian([F, state]), j2.hessian([F, state]))
    assert dispatches[3:] == ["hessian"]
    assert_lists_equal(umat.gradient([F, state]), j2.gradient([F, state]))  # kept: no dispatch
    assert dispatches[4:] == []
    # The next load step: a new state, then Newton's first change. Neither is a convergence check.
    _, state = umat.gradient([F, state])
    for F in (F, F + 1e-3, F + 1e-3 + 2e-5):  # a fiftyfold shrink: not under the default contraction of 0.01
        assert_lists_equal(umat.gradient([F, state]), j2.gradient([F, np.array(state)]))
    assert dispatches[4:] == ["both", "both", "both"] and umat.tangents_left_out == 1


def with_flag(x, tangent=True):
    """A one-call material that can skip its tangent; its second gradient item says whether it was asked for."""
    flag = np.full((1, *x[0].shape[2:]), float(tangent))
    return [x[0], flag], ([3.0 * x[0]] if tangent else None)


def test_predict_calls_a_one_call_function_with_tangent_false_when_it_can_take_it(process_client, dispatches):
    F, state = np.ones((3, 3, 1, 4)), np.zeros((1, 1, 4))
    asked = []
    for material in (with_flag, both_at_once):
        umat = FEMaterial(material, x=[np.eye(3), np.zeros(1)], scheduler=SimpleScheduler("cpu", 4),
                          client=process_client, tangent="predict", contraction=0.5)
        for step in (0.0, 0.2, 0.1):  # 0.1 is half of 0.2: converging, at contraction 0.5
            stress, flag = umat.gradient([F + step, state])
            asked.append(None if flag is None else flag.tolist())
        np.testing.assert_array_equal(stress, F + 0.1)
        assert umat.tangents_left_out == 1
    assert asked[:3] == [[[[1.0] * 4]], [[[1.0] * 4]], [[[0.0] * 4]]]  # tangent=False at the convergence check
    assert asked[3:] == [None] * 3  # both_at_once has no tangent parameter: called as it is, its tangent dropped
    assert dispatches == ["both", "both", "gradient"] * 2


def test_predict_stops_guessing_once_more_than_half_of_its_guesses_were_wrong():
    """A right guess (the next call is at a new x), a wrong one (the tangent asked for at its x: a second dispatch)
    keeps guessing at one wrong of two; a second wrong one, two of three, stops it for good."""
    umat = FEMaterial(keyword_tangent, x=[np.eye(3)], scheduler=SimpleScheduler("cpu", 2), mode="sync",
                      tangent="predict")
    F = np.ones((3, 3, 1, 2))

    def newton(ask_tangent_at_the_end):
        for step in (0.0, 1e-2, 1e-2 + 1e-6):  # the last change a ten-thousandth of the one before: a guess
            umat.gradient([F + step])
        if ask_tangent_at_the_end:
            np.testing.assert_array_equal(umat.hessian([F + 1e-2 + 1e-6])[0], np.ones_like(F))

    newton(False)
    assert (umat.tangents_left_out, umat.tangents_asked_after_all, umat.evaluations) == (1, 0, 3)
    newton(True)
    assert (umat.tangents_left_out, umat.tangents_asked_after_all, umat.evaluations) == (2, 1, 7)
    newton(True)
    assert (umat.tangents_left_out, umat.tangents_asked_after_all, umat.evaluations) == (3, 2, 11)
    newton(True)  # no more guesses: the tangent comes with the gradient, and the hessian costs nothing
    assert (umat.tangents_left_out, umat.tangents_asked_after_all, umat.evaluations) == (3, 2, 14)


def keyword_tangent(x, *, tangent):
    """A one-call material whose tangent parameter has no default: told it in every call."""
    return [2.0 * x[0]], ([np.full_like(x[0], float(tangent))] if tangent else None)


@pytest.mark.parametrize("tangent", ["with-gradient", "apart", "predict"])
def test_a_function_whose_tangent_parameter_has_no_default_is_told_it_in_every_mode(tangent):
    umat = FEMaterial(keyword_tangent, x=[np.eye(3)], scheduler=SimpleScheduler("cpu", 2), mode="sync",
                      tangent=tangent)
    F = np.ones((3, 3, 1, 3))
    np.testing.assert_array_equal(umat.gradient([F])[0], 2.0 * F)
    np.testing.assert_array_equal(umat.hessian([F])[0], np.ones_like(F))


@pytest.mark.parametrize("first", ["gradient", "hessian"])
def test_apart_keeps_what_it_has_when_the_other_is_asked_at_the_same_x(first):
    umat = FEMaterial(keyword_tangent, x=[np.eye(3)], scheduler=SimpleScheduler("cpu", 2), mode="sync",
                      tangent="apart")
    F = np.ones((3, 3, 1, 3))
    second = "hessian" if first == "gradient" else "gradient"
    for _ in range(2):
        getattr(umat, first)([F])
        getattr(umat, second)([F])
    assert umat.evaluations == 2
    np.testing.assert_array_equal(umat.gradient([F])[0], 2.0 * F)
    np.testing.assert_array_equal(umat.hessian([F])[0], np.ones_like(F))
    assert umat.evaluations == 2


def test_predict_tells_no_change_of_inputs_it_cannot_measure_and_never_counts_a_failed_evaluation():
    """Booleans, other keyword arguments and NaN give no prediction (every gradient with its tangent); a gradient
    that fails is not counted as left out."""
    def material(x, flag=0.0, tangent=True):
        if not tangent and x[0].flat[0] > 500:  # fails where it is asked for the stress alone
            raise dsched.RecoverableError("no stress alone out here")
        return [x[0] + flag, x[1]], ([x[0]] if tangent else None)

    umat = FEMaterial(material, x=[np.eye(3), np.zeros(1)], scheduler=SimpleScheduler("cpu", 2), mode="sync",
                      tangent="predict")
    F, mask = np.ones((3, 3, 1, 2)), np.zeros((1, 1, 2), dtype=bool)
    for step, flip in ((0.0, False), (1e-2, True), (1e-6, False), (1e-8, True)):
        mask = mask ^ flip
        umat.gradient([F + step, mask])  # the mask changes where F converges: no size of its change, no prediction
    assert umat.tangents_left_out == 0 and umat.evaluations == 4
    for step, flag in ((0.0, 0.0), (1e-2, 1.0), (1e-6, 2.0)):  # other keyword arguments each time
        umat.gradient([F + step, mask], flag=flag)
    assert umat.tangents_left_out == 0
    nan = F.copy()
    nan[0, 0] = np.nan
    for step in (0.0, 1e-2, 1e-6):
        umat.gradient([nan + step, mask])
    assert umat.tangents_left_out == 0
    far = F + 1000.0
    for step in (0.0, 1e-2):
        umat.gradient([far + step, mask])
    with pytest.raises(dsched.RecoverableError, match="no stress alone out here"):  # a convergence check, failed
        umat.gradient([far + 1e-2 + 1e-6, mask])
    assert umat.tangents_left_out == 0
    umat.gradient([F, mask])  # the next one is told apart from the failed one's inputs: no prediction
    assert umat.tangents_left_out == 0


def test_the_size_of_a_change_is_the_largest_difference_over_every_slab_of_a_large_input():
    """The change is measured slab by slab: the largest difference wherever it lies, equal infinities unchanged,
    a NaN in a later slab no size at all, integers without wrap-around, any layout."""
    items = fe_material._SLAB // 8
    before = np.zeros(3 * items + 5)
    after = before.copy()
    after[2 * items + 3] = -0.25  # in the third slab
    after[7] = 0.125
    assert fe_material._change(after, before) == 0.25
    before[[10, items + 1]] = after[[10, items + 1]] = [np.inf, -np.inf]  # unchanged infinities, two slabs
    assert fe_material._change(after, before) == 0.25
    after[3 * items + 4] = np.nan  # the last, short slab
    assert np.isnan(fe_material._change(after, before))
    assert fe_material._change(np.array([3, 1], np.uint8), np.array([1, 3], np.uint8)) == 2.0
    columns = np.arange(6.0).reshape(2, 3).T  # not contiguous
    assert fe_material._change(columns + 0.5, columns) == 0.5
    assert fe_material._change(np.zeros(0), np.zeros(0)) == 0.0


def test_an_input_that_is_not_a_shared_array_is_kept_as_a_copy_so_a_change_in_place_is_seen():
    umat = FEMaterial(both_at_once, x=[np.eye(3), np.zeros(1)], scheduler=SimpleScheduler("cpu", 2), mode="sync")
    F, state, scale = np.ones((3, 3, 1, 2)), np.zeros((1, 1, 2)), np.array(2.0)
    np.testing.assert_array_equal(umat.gradient([F, state], scale=scale)[0], 2.0 * F)
    scale[...] = 3.0  # the 0-d keyword argument changed in place: a new evaluation
    np.testing.assert_array_equal(umat.gradient([F, state], scale=scale)[0], 3.0 * F)
    assert umat.evaluations == 2


@needs_felupe
def test_one_call_gives_felupes_gradient_and_hessian(process_client, example, hybrid):
    j2 = example.material()
    x = plastic_inputs(j2)
    umat = FEMaterial(example.OneCall(j2), scheduler=hybrid, client=process_client)
    assert_lists_equal(umat.gradient(x), j2.gradient(x))
    assert_lists_equal(umat.hessian(x), j2.hessian(x))
    assert umat.evaluations == 1


@needs_felupe
def test_a_tangent_the_same_for_every_cell_comes_back_broadcast(process_client, hybrid):
    import felupe as fem

    elastic = fem.LinearElastic(E=210000.0, nu=0.3)  # no state variables (shape (0,)), a constant tangent
    x = plastic_inputs(elastic)
    umat = FEMaterial(elastic, scheduler=hybrid, client=process_client)
    stress, state = umat.gradient(x)
    (tangent,) = umat.hessian(x)
    assert_lists_equal([stress, state], elastic.gradient(x))
    (constant,) = elastic.hessian(x)
    assert constant.shape == (3, 3, 3, 3, 1, 1) and tangent.shape == (3, 3, 3, 3, 1, 40)
    np.testing.assert_array_equal(tangent, np.broadcast_to(constant, tangent.shape))


@needs_felupe
@pytest.mark.parametrize("layers, tangent", [(1, "with-gradient"), (3, "with-gradient"), (3, "predict")])
def test_a_felupe_solve_through_dsched_equals_felupes_own(process_client, example, layers, tangent):
    """The whole Newton loop: displacements and state variables bit-identical, one dispatch per iteration."""
    _, u, state = example.solve("plate", 3, example.material(layers), steps=3)
    umat = FEMaterial(example.material(layers), scheduler=StaticHybridScheduler(["cpu", "cuda:0"], [4, 3]),
                      client=process_client, tangent=tangent)  # 18 cells in five chunks
    counted = _Counted(umat)
    _, u_dsched, state_dsched = example.solve("plate", 3, counted, steps=3)
    np.testing.assert_array_equal(u_dsched, u)
    np.testing.assert_array_equal(state_dsched, state)
    assert np.abs(state[0]).max() > 0  # it did yield
    # FElupe asks for the hessian at the x of the gradient before it: no dispatch of its own.
    assert counted.calls["hessian"] > 0 and counted.dispatched["hessian"] == 0
    assert 0 < umat.evaluations == counted.dispatched["gradient"] <= counted.calls["gradient"]
    if tangent == "predict":  # the load steps' last iterations: the stress alone
        assert umat.tangents_left_out > 0


class _Counted:
    """An FEMaterial's gradient and hessian calls counted on the way to it, and the dispatches each made."""

    def __init__(self, umat):
        self.umat, self.x = umat, umat.x
        self.calls, self.dispatched = {"gradient": 0, "hessian": 0}, {"gradient": 0, "hessian": 0}

    def _call(self, method, x):
        before = self.umat.evaluations
        self.calls[method] += 1
        try:
            return getattr(self.umat, method)(x)
        finally:
            self.dispatched[method] += self.umat.evaluations - before

    def gradient(self, x):
        return self._call("gradient", x)

    def hessian(self, x):
        return self._call("hessian", x)


@needs_felupe
def test_the_example_checks_itself():
    done = subprocess.run([sys.executable, str(EXAMPLE), "--size", "3", "--steps", "2"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "bit-identical to FElupe's own: True" in done.stdout


@needs_felupe
def test_the_fe_bench_times_every_form_and_checks_the_bits(process_client):
    from dsched.apps.bench.fe import FORMS, amdahl_bound, format_fe_table, run_fe_benchmarks
    from dsched.apps.bench.figures import blocks

    results = run_fe_benchmarks(client=process_client, repeats=1, sizes={"64 J2 layers": 2}, steps=2)
    (case,) = results["cases"].values()
    assert list(case["rows"]) == list(FORMS) and case["layers"] == 64 and case["case"] == "hexahedra"
    alone = case["rows"]["FElupe alone"]
    assert alone["cells"] == 8 and alone["points"] == 64 and alone["state_variables"] == 64 * 19 + 18
    share = alone["material_share"]
    assert 0 < share < 1 and case["workers"] == 2 and case["amdahl_bound"] == 1 / ((1 - share) + share / 2)
    assert amdahl_bound(0.74) == pytest.approx(1.5873, abs=1e-4) and amdahl_bound(1.0, workers=4) == 4.0
    assert amdahl_bound(0.5, part=0.75) == pytest.approx(1 / 0.875)
    half = alone["half_cost"]  # four cells of eight: never free, never dearer than all of them by much
    assert 0.3 < half < 1.5 and case["halves_bound"] == amdahl_bound(share, part=half)
    for form in FORMS[1:]:
        row = case["rows"][form]
        assert row["identical"] is True and 0 < row["dispatches"] <= alone["iterations"] + 2 * case["steps"]
        assert row["ratio"] == pytest.approx(alone["best"] / row["best"])
    value, bound, _ = results["targets"]["64 J2 layers >= 1.5 x FElupe alone"]
    assert bound == 1.5 and value == max(case["rows"][form]["ratio"] for form in FORMS[1:])
    assert results["targets"]["bit-identical to FElupe"] is True
    table = format_fe_table(results)
    assert ("64 J2 layers: a cube of 8 hexahedra, 64 points, 1,234 state variables per point, 2 load steps, "
            f"{alone['iterations']} Newton iterations; material {share:.0%} of FElupe's solve: Amdahl's bound on 2 "
            f"workers {case['amdahl_bound']:.2f} x") in table
    assert (f"  each half of the cells costs on average {half:.0%} of the material's time on all of them: bound with "
            f"that split {case['halves_bound']:.2f} x") in table
    assert (f"({value:.2f} x; Amdahl's bound {case['amdahl_bound']:.2f} x, {case['halves_bound']:.2f} x with the "
            "halves' cost)") in table
    assert "through dsched, one call" in table and "cuda:0 is emulated" in table
    assert blocks({"fe": results})["fe"].endswith(table + "\n```")


def test_the_fe_table_of_a_run_without_amdahl_s_bound_computes_it_from_the_share():
    """A JSON written before the bound was recorded renders the same bound, from the material's share."""
    from dsched.apps.bench.fe import format_fe_table

    rows = {"FElupe alone": {"best": 6.0, "ratio": 1.0, "material_share": 0.75, "iterations": 35, "cells": 3200,
                             "points": 12800, "state_variables": 322},
            "through dsched": {"best": 5.0, "ratio": 1.2, "dispatches": 44, "identical": True}}
    results = {"cases": {"16 J2 layers": {"case": "plate", "steps": 10, "repeats": 2, "rows": rows}},
               "targets": {"16 J2 layers >= 1.5 x FElupe alone": [1.2, 1.5, False]}}
    table = format_fe_table(results)
    assert table.splitlines()[0] == ("16 J2 layers: a plate with a hole of 3,200 quadrilaterals, 12,800 points, 322 "
                                     "state variables per point, 10 load steps, 35 Newton iterations; material 75% "
                                     "of FElupe's solve: Amdahl's bound on 2 workers 1.60 x")
    assert ("target 16 J2 layers >= 1.5 x FElupe alone: not reached on this run (1.20 x; Amdahl's bound 1.60 x)"
            in table)
    from dsched.apps.bench.figures import blocks  # the docs' block: the suite's own command, else the file's

    merged = {"command": "dsched bench --only SUITE, for each of fe, ...", "fe": results}
    assert blocks(merged)["fe"].startswith("```text\n$ dsched bench --only SUITE, for each of fe, ...\n16 J2 layers")
    merged["fe"] = {**results, "bench_command": "dsched bench --only fe --processes"}
    assert blocks(merged)["fe"].startswith("```text\n$ dsched bench --only fe --processes\n16 J2 layers")
    results["targets"]["16 J2 layers >= 1.5 x FElupe alone"] = [1.4963, 1.5, False]  # a miss that rounds up to 1.50
    assert "not reached on this run (1.496 x; Amdahl's bound 1.60 x)" in format_fe_table(results)
    results["targets"]["16 J2 layers >= 1.5 x FElupe alone"] = [1.4949, 1.5, False]
    assert "not reached on this run (1.49 x; Amdahl's bound 1.60 x)" in format_fe_table(results)


def test_the_fe_bench_says_why_it_cannot_run():
    from dsched.apps.bench.fe import format_fe_table, skip_reason

    missing = ROOT / "examples" / "missing.py"
    reason = skip_reason(missing)
    if importlib.util.find_spec("felupe") is None:
        assert reason == "felupe is not installed (pip install 'dsched[fe]')"
    else:
        assert reason == f"{missing} is missing (run dsched bench from a checkout of dsched)"
    assert format_fe_table({"skipped": reason}) == f"fe suite skipped: {reason}"


@needs_felupe
def test_the_fe_bench_refuses_an_unknown_case_before_any_work():
    from dsched.apps.bench.fe import run_fe_benchmarks

    with pytest.raises(ValueError, match=r"^sizes: no case 'hex' \(cases: 'J2 plate', '64 J2 layers'\)$"):
        run_fe_benchmarks(sizes={"hex": 2})


def _guide_blocks():
    import re

    return re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "solvers.md").read_text(), re.S | re.M)


@pytest.mark.parametrize("index", range(len(_guide_blocks())))
def test_the_guides_code_runs_as_written(index, tmp_path):
    code = _guide_blocks()[index]
    if "felupe" in code and importlib.util.find_spec("felupe") is None:
        pytest.skip("felupe is not installed (pip install 'dsched[fe]')")
    script = tmp_path / "guide.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the guide's code prints its result"


# --- the adapter alone (no FElupe) ------------------------------------------------------------------------------

def both_at_once(x, scale=1.0):
    """A material given as one function: (gradient list, hessian list); the state passes through as None."""
    F, state = x
    return [scale * F, None], [np.einsum("ij...,kl...->ijkl...", F, F), None]


def test_a_one_call_function_and_its_none_items(process_client):
    F = np.random.default_rng(0).normal(size=(3, 3, 2, 9))
    x = [F, np.zeros((1, 2, 9))]
    umat = FEMaterial(both_at_once, x=[np.eye(3), np.zeros(1)], scheduler=SimpleScheduler("cuda:0", 4),
                      client=process_client)
    stress, state = umat.gradient(x, scale=2.0)
    tangent, nothing = umat.hessian(x, scale=2.0)
    np.testing.assert_array_equal(stress, 2.0 * F)
    np.testing.assert_array_equal(tangent, np.einsum("ij...,kl...->ijkl...", F, F))
    assert state is None and nothing is None and umat.evaluations == 1
    umat.gradient(x, scale=3.0)  # other keyword arguments: another evaluation
    assert umat.evaluations == 2


def array_kinds(x):
    """Per cell: 1 where the chunk's F arrived as a NumPy array, 0 where as a device array."""
    return [np.full(x[0].shape[-1], float(isinstance(x[0], np.ndarray)))], []


@pytest.mark.gpu
@pytest.mark.parametrize("host_arrays, numpy", [(True, 1.0), (False, 0.0)])
def test_host_arrays_decide_whether_a_gpu_chunk_arrives_as_numpy(host_arrays, numpy):
    from distributed import Client

    with dsched.LocalHybridCluster(["cuda:0"], dashboard_address=None) as cluster, Client(cluster) as client:
        umat = FEMaterial(array_kinds, x=[np.eye(3)], scheduler=SimpleScheduler("cuda:0", 3), client=client,
                          host_arrays=host_arrays)
        assert umat.gradient([np.ones((3, 3, 1, 7))])[0].tolist() == [numpy] * 7


@pytest.mark.parametrize("kwargs, message", [
    (dict(material=object()), "material: expected an object with gradient(x) and hessian(x), or a function"),
    (dict(material=both_at_once), "x: a material given as a function needs x="),
    (dict(material=both_at_once, x=[], tangent="lazy"),
     "tangent: expected one of 'with-gradient', 'apart', 'predict', got 'lazy'"),
    (dict(material=both_at_once, x=[], contraction=1.0), "contraction: expected a number in [0, 1), got 1.0"),
    (dict(material=both_at_once, x=[], axis=None), "axis: expected an integer (the cell axis), got None"),
    (dict(material=both_at_once, x=[], out="r.zarr"), "out: not an option of FEMaterial"),
])
def test_bad_arguments_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        FEMaterial(scheduler=SimpleScheduler("cpu", 2), **kwargs)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("scheduler", [None, "cpu"])
def test_a_scheduler_that_is_not_one_is_refused_at_construction(scheduler):
    with pytest.raises(ValueError, match=rf"^scheduler: {scheduler!r} is not a scheduler \(it lacks schedule_work"):
        FEMaterial(both_at_once, x=[], scheduler=scheduler)


def test_x_must_be_a_list():
    umat = FEMaterial(both_at_once, x=[], scheduler=SimpleScheduler("cpu", 2), mode="sync")
    with pytest.raises(ValueError, match=r"^x: expected a list of arrays, such as \[F, state\], got ndarray$"):
        umat.gradient(np.zeros((3, 3, 1, 2)))


@pytest.mark.parametrize("x, message", [
    ([np.zeros((3, 3, 4, 100)), np.zeros((5, 4, 90))],
     "x[1]: 90 cells along axis -1 (shape (5, 4, 90)), but x[0] has 100; every input has the same cells, or one"),
    ([np.zeros((3, 3, 4, 1)), np.zeros((5, 4, 90)), np.zeros((2, 7))],
     "x[2]: 7 cells along axis -1 (shape (2, 7)), but x[1] has 90; every input has the same cells, or one"),
])
def test_inputs_of_other_cell_counts_are_refused_naming_the_input(x, message):
    """Named by its place in x, before any work: dispatch, which the user never called, would name args[1]."""
    umat = FEMaterial(both_at_once, x=[], scheduler=SimpleScheduler("cpu", 2), mode="sync")
    with pytest.raises(ValueError) as err:
        umat.gradient(x)
    assert str(err.value) == message and umat.evaluations == 0


def test_a_failed_evaluation_leaves_nothing_to_reuse():
    calls = []

    def fails_once(x):
        calls.append(1)
        if len(calls) == 1:
            raise dsched.RecoverableError("local Newton did not converge")
        return [x[0]], [x[0]]

    umat = FEMaterial(fails_once, x=[np.eye(3)], scheduler=SimpleScheduler("cpu", 8), mode="sync")
    x = [np.ones((3, 3, 1, 4))]
    with pytest.raises(dsched.RecoverableError, match="did not converge"):
        umat.gradient(x)
    np.testing.assert_array_equal(umat.hessian(x)[0], x[0])
    assert umat.evaluations == 1
