"""NEML2's benchmark scenarios through dsched: every form equals NEML2's own driver run on the same chunks.

Small sizes (a few hundred points, 3 steps) of the four scenarios of
``dsched bench --only neml2``, on two single-thread worker processes (cpu and
an emulated cuda:0), each given one half of the points, as in the bench. The
reference is NEML2's ``TransientDriver`` on the same two halves, one after the
other: dsched must give the same numbers bit for bit. Skipped where neml2 is
not installed.
"""

import dataclasses
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import dsched
from dsched.apps.bench.neml2 import (
    dispatch_steps,
    driver_steps,
    format_neml2_table,
    lockstep_penalty,
    measure_scenario,
    options,
    paced_bounds,
    verdicts,
)
from dsched.models.neml2_scenarios import (
    MAX_STRAIN,
    SCENARIOS,
    TIGHT_NEWTON,
    checkout_scenario,
    run_neml2_driver,
)

neml2 = pytest.importorskip("neml2", reason="neml2 is not installed (pip install 'dsched[neml2]')")
torch = pytest.importorskip("torch")

from dsched.models import NEML2Model  # noqa: E402  (after the skip: importing it is fine, using it needs neml2)

SMALL = {"elasticity": 300, "radret": 200, "isoharden": 120, "chaboche2": 60}
STEPS = 3


def _setup(name, points=None, overrides=None, allocate=dsched.shared_empty):
    scenario = SCENARIOS[name]
    if overrides is not None:
        scenario = dataclasses.replace(scenario, overrides=tuple(overrides))
    histories = scenario.histories(points or SMALL[name], STEPS, allocate=allocate)
    n = histories.points
    halves = [(n + 1) // 2, n // 2]
    model = NEML2Model(scenario.input, scenario.model, overrides=scenario.overrides)
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], halves)
    return scenario, histories, {"t": histories.time, **histories.prescribed}, model, scheduler, halves


def _assert_equal(result, reference):
    assert sorted(result) == sorted(reference)
    for name, value in reference.items():
        np.testing.assert_array_equal(np.asarray(result[name]), value, err_msg=name)


def test_histories_are_nemls():
    """NEML2's [Tensors]: t = logspace(lo, hi, n) x linspace(0, 1, 100), strain = linspace(0, 1, 100) x FillSR2."""
    h = SCENARIOS["radret"].histories(5, 4)
    fraction = torch.linspace(0.0, 1.0, 100, dtype=torch.float64)[:5]
    end = torch.logspace(-1.0, 5.0, 5, dtype=torch.float64)
    np.testing.assert_array_equal(h.time, (end.unsqueeze(0) * fraction.unsqueeze(-1)).numpy())
    fill = neml2.types.SR2.fill(0.1, -0.05, -0.05)  # float32, as in NEML2's files
    np.testing.assert_array_equal(fill.data.numpy(), np.float32(MAX_STRAIN))
    strain = fill.data.unsqueeze(0).unsqueeze(0) * fraction.reshape(5, 1, 1)
    np.testing.assert_array_equal(h.prescribed["strain"], strain.expand(5, 5, 6).numpy())
    assert h.steps == 4 and h.points == 5
    with pytest.raises(ValueError, match=r"steps: expected 1 to 99 steps, got 100"):
        SCENARIOS["radret"].histories(5, 100)
    with pytest.raises(ValueError, match=r"points: expected a positive number of points, got 0"):
        SCENARIOS["radret"].histories(0, 2)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_form_equals_neml2_on_the_same_chunks(name, process_client):
    scenario, histories, prescribed, model, scheduler, halves = _setup(name)
    reference, _ = run_neml2_driver(scenario, histories, chunks=halves)
    _assert_equal(dispatch_steps(model, prescribed, scheduler, process_client), reference)
    _assert_equal(dispatch_steps(model, prescribed, scheduler, process_client, typed=True), reference)
    _assert_equal(driver_steps(model, prescribed, scheduler, process_client, steps_per_update=1), reference)
    _assert_equal(driver_steps(model, prescribed, scheduler, process_client), reference)


def test_radret_at_nemls_default_tolerance_equals_the_same_chunks(process_client):
    """NEML2's Newton tests convergence over the batch it is given: same chunks, same numbers."""
    scenario, histories, prescribed, model, scheduler, halves = _setup("radret", overrides=())
    assert not any(o in model.overrides for o in TIGHT_NEWTON)
    reference, _ = run_neml2_driver(scenario, histories, chunks=halves)
    _assert_equal(driver_steps(model, prescribed, scheduler, process_client), reference)
    whole, _ = run_neml2_driver(scenario, histories)
    np.testing.assert_allclose(driver_steps(model, prescribed, scheduler, process_client)["stress"],
                               whole["stress"], rtol=1e-8, atol=1e-9)


def test_typed_chunks_carry_their_rows_only(process_client):
    """A step of a typed history is a view of the whole history: its chunks must not pickle the history."""
    from dsched.dataplane.loaders import MappingLoader
    from dsched.dataplane.store import RunStore, share_generator

    history = neml2.types.SR2(torch.zeros(50, 1000, 6, dtype=torch.float64))
    step = neml2.types.SR2(history.data[3])
    with RunStore(shared=True) as store:
        shared = share_generator(MappingLoader({"strain": step, "t": 1.0}), store)
        _, work = shared.next(10)
        assert len(pickle.dumps(work)) < 2_000  # a reference and an empty template, not 2.4 MB of history
        rows = work.resolve()["strain"]
        assert type(rows) is neml2.types.SR2 and rows.shape == (10, 6)
    assert len(pickle.dumps(dsched.devices.backends.template(step.data))) < 1_000


def test_the_probe_calls_the_model_once_per_kind_and_shapes(monkeypatch):
    """dispatch() learns the outputs' layout on the client: NEML2's floor is paid once, not every step."""
    # In this process: NEML2's model keeps its last inputs, so they must not be shared memory of the test's.
    scenario, histories, prescribed, model, scheduler, halves = _setup("isoharden", points=8, allocate=np.empty)
    calls = []
    original = NEML2Model._evaluate_entries
    monkeypatch.setattr(NEML2Model, "_evaluate_entries",
                        lambda self, *args, **kwargs: calls.append(kwargs) or original(self, *args, **kwargs))
    inputs = {name: 0.0 for name in model.input_names}
    inputs.update(strain=histories.prescribed["strain"][1], t=histories.time[1])
    first = model.probe_outputs(inputs)
    again = model.probe_outputs({**inputs, "t": histories.time[2]})
    assert len(calls) == 1 and again is first
    assert sorted(first) == ["equivalent_plastic_strain", "stress"] and first["stress"].shape == (8, 6)
    model.probe_outputs({**inputs, "t": torch.from_numpy(histories.time[1])})  # another kind: learned again
    assert len(calls) == 2 and all(call["probe"] for call in calls)  # eager, on the client (never compiled there)


def test_a_checkout_scenario_runs_nemls_own_file(tmp_path):
    """--neml2-benchmarks: NEML2's model.i and its driver's histories (here a stand-in with NEML2's layout)."""
    folder = tmp_path / "benchmark" / "elasticity"
    folder.mkdir(parents=True)
    (folder / "model.i").write_text(_CHECKOUT_ELASTICITY)
    scenario = checkout_scenario(tmp_path / "benchmark", "elasticity", points=6)
    assert scenario.source == str((tmp_path / "benchmark").resolve()) and scenario.points == 6
    histories = scenario.histories(steps=2)
    own = SCENARIOS["elasticity"].histories(6, 2)
    np.testing.assert_array_equal(histories.time, own.time)
    np.testing.assert_array_equal(histories.prescribed["strain"], own.prescribed["strain"])
    out, seconds = run_neml2_driver(scenario, histories)
    assert out["stress"].shape == (6, 6) and len(seconds) == 1
    with pytest.raises(ValueError, match=r"neml2_benchmarks: no radret/model.i in"):
        checkout_scenario(tmp_path / "benchmark", "radret")


@pytest.mark.skipif(not os.environ.get("NEML2_BENCHMARKS"), reason="set NEML2_BENCHMARKS to a NEML2 checkout's "
                    "benchmark/ folder to compare dsched's scenario files with NEML2's")
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_dscheds_scenarios_are_nemls(name):
    ours = SCENARIOS[name]
    theirs = checkout_scenario(os.environ["NEML2_BENCHMARKS"], name, points=7)
    h_ours, h_theirs = ours.histories(7, 3), theirs.histories(steps=3)
    np.testing.assert_array_equal(h_ours.time, h_theirs.time)
    np.testing.assert_array_equal(h_ours.prescribed["strain"], h_theirs.prescribed["strain"])
    a, _ = run_neml2_driver(ours, h_ours)
    b, _ = run_neml2_driver(theirs, h_theirs)
    _assert_equal(a, b)


def test_the_bench_measures_a_scenario_and_judges_the_targets(process_client):
    small = dataclasses.replace(SCENARIOS["isoharden"], points=40)
    # Halves of 20 points, each in NEML2 calls of 7, 7 and 6: the results equal NEML2 on those blocks.
    result = measure_scenario(small, process_client, steps=2, repeats=1, block=7)
    assert result["block"] == 7
    assert set(result["rate"]) == {"neml2_1", "neml2_2", "limit", "lockstep", "side_by_side", "paced", "numpy",
                                   "typed", "batch", "driver"}
    assert set(result["vs_paced"]) == {"numpy", "typed"}  # the forms that return after every step
    assert result["seconds"]["lockstep"] >= result["seconds"]["limit"]  # every step waits for its slower half
    assert all(e["same_chunks"] == 0.0 for e in result["error"].values())
    targets = verdicts([result])
    assert set(targets) == {"every form >= 0.8 x the limit", "median >= 1.1 x NEML2 on 2 threads",
                            "every dispatch and Batch form >= 0.9 x side by side",
                            "typed within 1.2 x NumPy (time)", "Batch >= dispatch every step",
                            "driver >= dispatch every step"}
    table = format_neml2_table({"scenarios": [result], "forms": ["numpy", "typed", "batch", "driver"], "steps": 2,
                                "repeats": 1, "machine": "test", "load": None, "targets": targets, "block": 7})
    assert "isoharden (40)" in table and "target every form >= 0.8 x the limit" in table
    assert "dsched calls NEML2 on blocks of at most 7 points" in table.splitlines()[0]
    assert "vs lockstep, vs paced (dispatch, NumPy / dispatch, typed)" in table
    bound = result["rate"]["paced"] / result["rate"]["side_by_side"]
    assert table.splitlines()[-1] == ("a call per step reaches at most the paced halves: the lowest paced / side by "
                                      f"side is {bound:.2f} (isoharden, eager)")


def test_the_per_step_bound_is_the_lowest_paced_row_of_each_table():
    scenarios = [{"scenario": "a", "rate": {"paced": 8.0, "side_by_side": 10.0},
                  "compiled": {"rate": {"paced": 9.0, "side_by_side": 10.0}}},
                 {"scenario": "b", "rate": {"paced": 9.5, "side_by_side": 10.0},
                  "compiled": {"rate": {"paced": 7.0, "side_by_side": 10.0}}},
                 {"scenario": "c", "rate": {"side_by_side": 1.0}}]  # measured without a paced row: not counted
    assert paced_bounds(scenarios) == {"eager": (0.8, "a"), "compiled": (0.7, "b")}
    assert paced_bounds([{"scenario": "c", "rate": {"side_by_side": 1.0}}]) == {}


def test_a_paced_driver_runs_each_step_on_a_release_and_answers_it():
    """NEML2's driver paced over a real pipe: one release per step, an answer after each, the results unchanged."""
    import threading
    from multiprocessing import Pipe

    scenario = SCENARIOS["isoharden"]
    histories = scenario.histories(10, 3)
    ours, theirs = Pipe()
    heard = []

    def pace():
        heard.append(ours.recv_bytes())  # ready, once the driver is built
        for _ in range(3):
            ours.send_bytes(b"go")
            heard.append(ours.recv_bytes())

    caller = threading.Thread(target=pace)
    caller.start()
    out, _ = run_neml2_driver(scenario, histories, paced=theirs)
    caller.join(60)
    assert heard == [b"ready", b"done", b"done", b"done"]
    _assert_equal(out, run_neml2_driver(scenario, histories)[0])


def test_paced_halves_are_released_together_until_both_end_and_timed_to_the_last_answer():
    import threading
    from multiprocessing import Pipe

    from dsched.apps.bench.neml2_forms import _pace

    releases = {0: 0, 1: 0}
    pairs = [Pipe() for _ in range(2)]

    def half(i, end, steps):
        for _ in range(steps):
            end.recv_bytes()
            releases[i] += 1
            end.send_bytes(b"done")
        end.recv_bytes()  # the release after its last step
        end.send_bytes(b"end")

    threads = [threading.Thread(target=half, args=(i, pair[1], steps)) for i, (pair, steps) in
               enumerate(zip(pairs, [3, 2]))]
    for t in threads:
        t.start()
    seconds = _pace([pair[0] for pair in pairs])
    for t in threads:
        t.join(60)
    assert releases == {0: 3, 1: 2} and seconds > 0


def test_the_driver_times_each_step_of_each_chunk():
    scenario = SCENARIOS["isoharden"]
    histories = scenario.histories(10, 3)
    out, seconds, per_step = run_neml2_driver(scenario, histories, chunks=[6, 4], per_step=True)
    plain, _ = run_neml2_driver(scenario, histories, chunks=[6, 4])
    _assert_equal(out, plain)  # the timing changes nothing
    assert len(seconds) == 2 and [len(steps) for steps in per_step] == [3, 3]  # the model runs once per step
    assert all(0 < sum(steps) <= total for steps, total in zip(per_step, seconds))


def test_lockstep_penalty_is_the_wait_for_each_steps_slower_chunk():
    assert lockstep_penalty([[3.0, 1.0], [1.0, 2.0]]) == pytest.approx(1.0)  # 3 + 2 against 4
    assert lockstep_penalty([[1.0, 1.0], [2.0, 2.0]]) == 0.0  # one chunk slower at every step: no wait


def test_the_reference_runs_neml2_on_the_blocks_of_each_half():
    from dsched.apps.bench.neml2 import _blocks

    assert _blocks([20, 20], 7) == [7, 7, 6, 7, 7, 6]
    assert _blocks([250_000, 250_000], 25_000) == [25_000] * 20
    assert _blocks([5_000, 5_000], 25_000) == [5_000, 5_000] and _blocks([3, 2], None) == [3, 2]


def test_bench_options_name_the_option(tmp_path):
    import argparse

    from dsched.apps.bench.neml2 import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true")
    with pytest.raises(ValueError, match=r"--neml2-benchmarks: .*nowhere is not a folder"):
        options(parser.parse_args(["--neml2-benchmarks", str(tmp_path / "nowhere")]))
    with pytest.raises(ValueError, match=r"--neml2-steps: expected a positive number of steps, got 0"):
        options(parser.parse_args(["--neml2-steps", "0"]))
    with pytest.raises(ValueError, match=r"--neml2-block: expected a number of points >= 1 or 'none', got 'x'"):
        options(parser.parse_args(["--neml2-block", "x"]))
    with pytest.raises(ValueError, match=r"--neml2-points: expected at least 2 points \(two halves\), got 1"):
        options(parser.parse_args(["--neml2-points", "1"]))
    parsed = options(parser.parse_args(["--neml2-scenarios", "radret,chaboche2", "--quick"]))
    assert parsed["scenarios"] == ["radret", "chaboche2"] and parsed["quick"]
    assert parsed["block"] == "auto" and parsed["points"] is None  # NEML2Model's default blocks, each scenario's size
    parsed = options(parser.parse_args(["--neml2-block", "none", "--neml2-points", "100000"]))
    assert parsed["block"] is None and parsed["points"] == 100_000


def test_scenario_files_are_package_data():
    """The inputs are where the installed package is (an install from a wheel or sdist included)."""
    root = Path(dsched.__file__).parent
    for name in [*SCENARIOS, "viscoplastic"]:
        assert (root / "models" / "scenarios" / f"{name}.i").is_file()


# NEML2's layout of a benchmark file: [Tensors] in Python, a TransientDriver, the model. A stand-in written
# here (the same histories as NEML2's elasticity scenario), so the test needs no NEML2 checkout.
_CHECKOUT_ELASTICITY = """
[Tensors]
  [n]
    type = Python
    expr = '${nbatch}'
  []
  [times]
    type = Python
    expr = '''
      Scalar(torch.logspace(5.0, 5.0, n, dtype=torch.float64).unsqueeze(0)
             * torch.linspace(0.0, 1.0, 100, dtype=torch.float64).unsqueeze(-1))
    '''
  []
  [strains]
    type = Python
    expr = '''
      SR2(SR2.fill(0.1, -0.05, -0.05).dynamic_batch.expand(n).data.unsqueeze(0)
          * torch.linspace(0.0, 1.0, 100, dtype=torch.float64).reshape(100, 1, 1))
    '''
  []
[]
[Drivers]
  [driver]
    type = TransientDriver
    model = 'model'
    prescribed_time = 'times'
    prescribed_SR2_names = 'strain'
    prescribed_SR2_values = 'strains'
  []
[]
[Models]
  [model]
    type = LinearIsotropicElasticity
    coefficients = '1e3 0.3'
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
  []
[]
"""


def test_dsched_bench_names_a_bad_neml2_option(capsys, tmp_path):
    from dsched.apps.cli import main

    assert main(["bench", "--only", "neml2", "--neml2-benchmarks", str(tmp_path / "nowhere")]) == 2
    assert "dsched: error: --neml2-benchmarks: " in capsys.readouterr().err
