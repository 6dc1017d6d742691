"""TransientDriver (NEML2's driver over a resident Batch) and the Batch features it stands on.

The driver against NEML2's own ``TransientDriver`` on the same chunks (the
isoharden and radret scenarios, a few dozen points): continuing runs, steps
per update, recorded outputs, initial conditions, and errors that name their
field. Then the Batch features, on any model: per-update ``inputs`` (a
history, time leading), ``out`` arrays written where the client reads them,
``get_many``, torch tensors kept as versions (in device memory), and versions
that read shared memory without a copy until an in-place update writes them.
Tests that take the ``memory`` fixture run with the state in host memory and in
device memory.
"""

import dataclasses
import os
import time
import uuid

import numpy as np
import pytest

import dsched
from dsched.models.neml2_scenarios import SCENARIOS, run_neml2_driver
from dsched.resident.driver import TransientDriver, neml2_feedback

neml2 = pytest.importorskip("neml2", reason="neml2 is not installed (pip install 'dsched[neml2]')")
torch = pytest.importorskip("torch")

from dsched.models import NEML2Model  # noqa: E402


def _scenario(name, points, steps):
    scenario = dataclasses.replace(SCENARIOS[name], points=points)
    histories = scenario.histories(steps=steps, allocate=dsched.shared_empty)
    halves = [(points + 1) // 2, points // 2]
    model = NEML2Model(scenario.input, scenario.model, overrides=scenario.overrides)
    return scenario, histories, model, dsched.StaticHybridScheduler(["cpu", "cuda:0"], halves), halves


def _prescribed(histories, start=0, stop=None):
    return {"t": histories.time[start:stop], **{k: v[start:stop] for k, v in histories.prescribed.items()}}


def test_nemls_feedback_rule():
    assert neml2_feedback(["strain", "strain~1", "t", "t~1", "t~2", "gamma~2", "stress~1"], ["stress", "gamma"]) \
        == {"strain~1": "strain", "t~1": "t", "t~2": "t~1", "gamma~2": "gamma~1", "stress~1": "stress"}


@pytest.fixture(params=["host", "device"])
def memory(request):
    """Where the driver's batch keeps the state: each test that takes it runs once per place."""
    return request.param


def test_runs_continue_and_steps_per_update_change_nothing(process_client, memory):
    scenario, histories, model, scheduler, halves = _scenario("radret", 40, 4)  # gamma~2, t~2: lags of two
    reference, _ = run_neml2_driver(scenario, histories, chunks=halves)
    with TransientDriver(model, scheduler, client=process_client, memory=memory) as driver:
        assert driver.memory == memory
        driver.run(_prescribed(histories, 0, 3))  # steps 1-2
        driver.run(_prescribed(histories, 2), steps_per_update=1)  # steps 3-4, from entry 2
        assert driver.steps_done == 4
        for name, value in driver.get_many().items():
            np.testing.assert_array_equal(value, reference[name], err_msg=name)
    with TransientDriver(model, scheduler, client=process_client, memory=memory) as driver:
        driver.run(_prescribed(histories), steps_per_update=3)
        np.testing.assert_array_equal(driver.get("gamma"), reference["gamma"])
        if memory == "device":  # no initial values: nothing was loaded before the first steps
            assert driver.batch.memory == "device" and driver.batch.fields == sorted(driver.keep)
        else:  # no batch: each update is one call, the state in arrays of this host's memory
            assert driver.batch is None and sorted(driver._host.state) == sorted(driver.keep)


def test_the_state_in_host_memory_is_the_default_here_and_results_stay_as_returned(process_client):
    """On worker processes of this host (cuda:0 emulated), ``memory="auto"`` keeps the state in host memory. The
    values returned are read-only (the next run starts from them) and a later run never changes them."""
    scenario, histories, model, scheduler, halves = _scenario("radret", 40, 4)
    first, _ = run_neml2_driver(scenario, dataclasses.replace(
        histories, time=histories.time[:3], prescribed={k: v[:3] for k, v in histories.prescribed.items()}),
        chunks=halves)
    reference, _ = run_neml2_driver(scenario, histories, chunks=halves)
    with TransientDriver(model, scheduler, client=process_client, record=["stress"]) as driver:
        assert driver.memory == "auto"
        driver.run(_prescribed(histories, 0, 3))
        assert driver.memory == "host"
        after_two = driver.get_many()
        with pytest.raises(ValueError, match="read-only"):
            after_two["stress"][0, 0] = 1.0
        driver.run(_prescribed(histories, 2), steps_per_update=1)
        np.testing.assert_array_equal(driver.get("gamma"), reference["gamma"])
        three, _ = run_neml2_driver(scenario, dataclasses.replace(
            histories, time=histories.time[:4], prescribed={k: v[:4] for k, v in histories.prescribed.items()}),
            chunks=halves)
        np.testing.assert_array_equal(driver.get("gamma~1"), three["gamma"])  # a source: gamma of the step before
        for name, value in after_two.items():
            np.testing.assert_array_equal(value, first[name], err_msg=name)
        history = driver.history("stress")  # the two runs' columns, the second's written by two updates
        assert history.shape == (4, 40, 6)
        for step, expected in ((2, first), (3, three), (4, reference)):
            np.testing.assert_array_equal(history[step - 1], expected["stress"], err_msg=f"step {step}")
    with TransientDriver(model, scheduler, client=process_client) as driver:  # four updates: two sets in turn
        driver.run(_prescribed(histories), steps_per_update=1)
        for name, value in driver.get_many().items():
            np.testing.assert_array_equal(value, reference[name], err_msg=name)


def test_a_compiled_model_in_host_memory_computes_its_steps_into_rows_and_equals_nemls(process_client):
    """A compiled model without autograd computes each step's values into rows (kept scratch rows, then the new
    state's): the results are NEML2 compiled's on the same chunks, over two runs of one driver. (An eager model
    with blocks takes rows too: radret above, whose lags of two make a step read the rows of two steps back.)"""
    scenario, histories, _, scheduler, halves = _scenario("elasticity", 40, 4)
    aot = {"backend": "aot_eager"}  # torch.compile's graphs without inductor's code generation: seconds, not minutes
    model = NEML2Model(scenario.input, scenario.model, overrides=scenario.overrides, compile=aot, autograd=False)
    reference, _ = run_neml2_driver(scenario, histories, chunks=halves, compile=aot, grad=False)
    with TransientDriver(model, scheduler, client=process_client) as driver:
        driver.run(_prescribed(histories, 0, 3))
        driver.run(_prescribed(histories, 2))
        for name, value in driver.get_many().items():
            np.testing.assert_allclose(value, reference[name], rtol=1e-12, atol=1e-12, err_msg=name)


def test_in_host_memory_a_parameter_changed_between_runs_reaches_the_workers(process_client):
    """A driver per history of one model, in a loop, runs on the dispatcher of the one before; a parameter set in
    between is sent with the next run (as in device memory, where each task carries the model)."""
    scenario, histories, model, scheduler, halves = _scenario("isoharden", 20, 2)
    name = "implicit_rate.elasticity.E"
    stiff = NEML2Model(scenario.input, scenario.model, overrides=scenario.overrides)
    stiff.set_parameter(name, 2e5)
    with TransientDriver(stiff, scheduler, client=process_client, memory="device") as driver:
        driver.run(_prescribed(histories))
        expected = driver.get("stress")
    results = []
    for value in (1e5, 2e5, 2e5, 1e5):
        model.set_parameter(name, value)
        with TransientDriver(model, scheduler, client=process_client) as driver:
            driver.run(_prescribed(histories))
            results.append(driver.get("stress"))
    np.testing.assert_array_equal(results[1], expected)
    np.testing.assert_array_equal(results[2], expected)
    np.testing.assert_array_equal(results[3], results[0])
    assert not np.array_equal(results[0], expected)


def test_in_host_memory_outputs_left_out_of_the_model_and_a_closed_driver(process_client):
    """A model that keeps only the outputs fed back (radret without stress) steps as the full one; a closed driver
    says so."""
    scenario, histories, model, scheduler, halves = _scenario("radret", 40, 3)
    fed_back = ["equivalent_plastic_strain", "kinematic_plastic_strain", "gamma", "plastic_strain"]
    fewer = NEML2Model(scenario.input, scenario.model, overrides=scenario.overrides, outputs=fed_back)
    reference, _ = run_neml2_driver(scenario, histories, chunks=halves)
    driver = TransientDriver(fewer, scheduler, client=process_client)
    with driver:
        driver.run(_prescribed(histories))
        assert driver.memory == "host"
        for name, value in driver.get_many().items():
            np.testing.assert_array_equal(value, reference[name], err_msg=name)
    with pytest.raises(RuntimeError, match="this driver is closed"):
        driver.get("gamma")
    with pytest.raises(RuntimeError, match="this driver is closed"):
        driver.run(_prescribed(histories))


def test_in_host_memory_a_failed_update_fails_the_later_ones_and_the_next_run(process_client):
    """An update that fails leaves the state of the updates after it unwritten: they are cancelled, every result
    raises the failure, and so does the next run, before any work."""
    scenario, histories, _, scheduler, _ = _scenario("isoharden", 10, 3)
    failing = NEML2Model(scenario.input, "model", overrides=["Solvers/newton/max_its:=1"])
    from dsched.models import NEML2ConvergenceError

    with TransientDriver(failing, scheduler, client=process_client) as driver:
        driver.run(_prescribed(histories), steps_per_update=1)  # three updates: the first fails
        for get in (lambda: driver.get("stress"), lambda: driver.get("strain")):
            with pytest.raises((NEML2ConvergenceError, dsched.AggregateError)) as info:
                get()
            assert info.value.recoverable
        with pytest.raises((NEML2ConvergenceError, dsched.AggregateError)):
            driver.run(_prescribed(histories))
        assert driver.steps_done == 3


def _segments():
    import os

    return {name for name in os.listdir("/dev/shm") if name.startswith(f"dsched-{os.getpid()}-")}


def test_a_long_lived_driver_and_a_driver_per_history_keep_dev_shm_flat(process_client, memory):
    """A run's outputs go back to the pool once a later run's are asked for, and a closed driver's state too:
    the next runs (and drivers) reuse those segments."""
    scenario, histories, model, scheduler, halves = _scenario("radret", 40, 2)
    reference, _ = run_neml2_driver(scenario, histories, chunks=halves)
    with TransientDriver(model, scheduler, client=process_client, memory=memory) as driver:
        for run in range(6):
            driver.run(_prescribed(histories))
            driver.get_many()
            if run == 1:
                steady = _segments()
        assert _segments() == steady
    for run in range(4):
        with TransientDriver(model, scheduler, client=process_client, memory=memory) as driver:
            driver.run(_prescribed(histories))
            values = driver.get_many()
        for name, value in values.items():
            np.testing.assert_array_equal(value, reference[name], err_msg=name)
        del values
        if run == 1:
            steady = _segments()
    assert _segments() == steady


def test_recorded_outputs_are_nemls_every_step(process_client):
    scenario, histories, model, scheduler, halves = _scenario("isoharden", 30, 3)
    drivers = []
    for a, b in zip([0, halves[0]], [halves[0], 30]):
        part = dataclasses.replace(histories, time=histories.time[:, a:b],
                                   prescribed={"strain": histories.prescribed["strain"][:, a:b]})
        drivers.append(_nemls_driver(scenario, part))
    with TransientDriver(model, scheduler, client=process_client, record=["stress"]) as driver:
        driver.run(_prescribed(histories, 0, 3))
        driver.run(_prescribed(histories, 2))
        history = driver.history("stress")
    assert history.shape == (3, 30, 6)
    for step in range(1, 4):
        expected = np.concatenate([np.broadcast_to(d.result_out[step]["stress"].data.detach().numpy(), (n, 6))
                                   for d, n in zip(drivers, halves)])
        np.testing.assert_array_equal(history[step - 1], expected)


def _nemls_driver(scenario, histories, ics=None):
    model = neml2.load_model(str(scenario.input), scenario.model)
    driver = neml2.TransientDriver(model, neml2.types.Scalar(torch.from_numpy(np.ascontiguousarray(histories.time))),
                                   "t", {"strain": neml2.types.SR2(torch.from_numpy(
                                       np.ascontiguousarray(histories.prescribed["strain"])))}, ics or {})
    driver.run()
    return driver


def test_initial_conditions_are_nemls(process_client):
    scenario, histories, model, scheduler, halves = _scenario("isoharden", 20, 2)
    stress0 = np.random.default_rng(1).uniform(-3.0, 3.0, (20, 6))
    with TransientDriver(model, scheduler, client=process_client, initial={"stress": stress0}) as driver:
        driver.run(_prescribed(histories))
        stress = driver.get("stress")
    expected = []
    for a, b in zip([0, halves[0]], [halves[0], 20]):
        part = dataclasses.replace(histories, time=histories.time[:, a:b],
                                   prescribed={"strain": histories.prescribed["strain"][:, a:b]})
        ics = {"stress": neml2.types.SR2(torch.from_numpy(stress0[a:b].copy()))}
        expected.append(_nemls_driver(scenario, part, ics).result_out[-1]["stress"].data.detach().numpy())
    np.testing.assert_array_equal(stress, np.concatenate(expected))


def test_driver_errors_name_the_field(process_client):
    scenario, histories, model, scheduler, _ = _scenario("isoharden", 10, 2)
    with pytest.raises(ValueError, match=r"feedback: 'stress' is not an input of 'model'"):
        TransientDriver(model, scheduler, feedback={"stress": "stress~1"})
    with pytest.raises(ValueError, match=r"feedback\['stress~1'\]: 'sigma' is neither an input nor an output"):
        TransientDriver(model, scheduler, feedback={"stress~1": "sigma"})
    with pytest.raises(ValueError, match=r"record: \['gamma'\] are not outputs kept by the model"):
        TransientDriver(model, scheduler, record=["gamma"])
    with pytest.raises(ValueError, match=r"initial: 'gamma' is not one of"):
        TransientDriver(model, scheduler, initial={"gamma": 0.0})
    with pytest.raises(ValueError, match=r"constants\['t'\]: expected a number, got 'x'"):
        TransientDriver(model, scheduler, constants={"t": "x"})
    with pytest.raises(ValueError, match=r"^memory: expected 'auto', 'host' or 'device', got 'gpu'$"):
        TransientDriver(model, scheduler, memory="gpu")
    driver = TransientDriver(model, scheduler, client=process_client)
    with pytest.raises(RuntimeError, match=r"has run no step yet"):
        driver.get("stress")
    with pytest.raises(ValueError, match=r"prescribed\['strain'\]: expected \(steps \+ 1, points, \*\(6,\)\)"):
        driver.run({"t": histories.time, "strain": histories.prescribed["strain"][:, :, :3]})
    with pytest.raises(ValueError, match=r"prescribed: 'E' is not an input of 'model'"):
        driver.run({"E": histories.prescribed["strain"]})
    with pytest.raises(ValueError, match=r"steps_per_update: expected a positive number of steps, got 0"):
        driver.run(_prescribed(histories), steps_per_update=0)
    with driver:
        driver.run(_prescribed(histories))
        with pytest.raises(ValueError, match=r"names: \['gamma'\] are not kept by this driver"):
            driver.get("gamma")
        with pytest.raises(ValueError, match=r"prescribed: 4 points; this driver's batch has 10"):
            driver.run(_prescribed(dataclasses.replace(histories, time=histories.time[:, :4], prescribed={
                "strain": histories.prescribed["strain"][:, :4]})))


def test_no_feedback_is_zero_like_nemls_default(process_client):
    """A source of None feeds nothing back: stress~1 is zero at every step, the rest is fed back as NEML2 does."""
    scenario, histories, model, scheduler, halves = _scenario("isoharden", 12, 2)
    driver = TransientDriver(model, scheduler, client=process_client, feedback={"stress~1": None})
    assert "stress~1" not in driver.feedback.values() and driver.feedback["stress~1"] is None
    with driver:
        driver.run(_prescribed(histories))
        stress = driver.get("stress")
    expected = []
    for a, b in zip([0, halves[0]], [halves[0], 12]):  # the same chunks, by hand (on copies: NEML2's model
        t, e = histories.time[:, a:b].copy(), histories.prescribed["strain"][:, a:b].copy()  # keeps its inputs)
        first = model({"strain": e[1], "strain~1": e[0], "t": t[1], "t~1": t[0], "stress~1": 0.0,
                       "equivalent_plastic_strain~1": 0.0})
        second = model({"strain": e[2], "strain~1": e[1], "t": t[2], "t~1": t[1], "stress~1": 0.0,
                        "equivalent_plastic_strain~1": first["equivalent_plastic_strain"]})
        expected.append(second["stress"])
    np.testing.assert_array_equal(stress, np.concatenate(expected))


# --- the Batch features the driver stands on ------------------------------------------


def _accumulate(total, history, *, step):
    """total += history[step], as torch: the version stays a tensor on the worker."""
    total = total if isinstance(total, torch.Tensor) else torch.tensor(total)
    return {"total": total + torch.tensor(history[step])}


def _is_tensor(total):
    return {"kind": np.full(len(total), isinstance(total, torch.Tensor))}


@pytest.mark.parametrize("client_name", ["process_client", "hybrid_client"])
def test_batch_inputs_out_get_many_and_tensor_versions(client_name, memory, request):
    client = request.getfixturevalue(client_name)
    n, steps = 10, 4
    history = dsched.shared_empty((steps, n))
    history[:] = np.arange(steps * n, dtype=float).reshape(steps, n)
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [6, 4])
    out = dsched.shared_empty((n,))
    with dsched.Batch({"total": np.zeros(n)}, scheduler, client=client, memory=memory) as batch:
        for step in range(steps):
            batch.update(_accumulate, reads=["total"], writes=["total"], inputs={"history": history}, axis=1,
                         kwargs={"step": step})
        batch.update(_is_tensor, reads=["total"], outputs=["kind"])
        batch.update(lambda total, done: {"copy": np.asarray(total) * 1.0, "done": done.__setitem__(
            slice(None), np.asarray(total)) or np.asarray(total)}, reads=["total"], outputs=["copy", "done"],
            out={"done": out}).wait()
        got = batch.get_many(["total", "kind"], layouts={"total": ((), "f8")})
    np.testing.assert_array_equal(got["total"], history.sum(axis=0))
    # In device memory the versions stay torch tensors between updates; in host memory a field is a NumPy array.
    assert got["kind"].all() if memory == "device" else not got["kind"].any()
    np.testing.assert_array_equal(out, history.sum(axis=0))  # written straight into the client's array


def test_batch_input_and_out_errors_name_the_entry(process_client, memory):
    scheduler = dsched.SimpleScheduler("cpu", 5)
    with dsched.Batch({"x": np.zeros(5)}, scheduler, client=process_client, memory=memory) as batch:
        with pytest.raises(ValueError, match=r"inputs\['h'\]: shape \(3, 4\) has no 5 items along axis 1"):
            batch.update(lambda x, h: {"x": x}, reads=["x"], writes=["x"], inputs={"h": np.zeros((3, 4))}, axis=1)
        with pytest.raises(ValueError, match=r"inputs: 'x' is not a name of its own"):
            batch.update(lambda x: {"x": x}, reads=["x"], writes=["x"], inputs={"x": np.zeros(5)})
        with pytest.raises(ValueError, match=r"out\['y'\]: worker processes write only into shared memory"):
            batch.update(lambda x, y: {"x": x}, reads=["x"], writes=["x"], out={"y": np.zeros(5)})


def _add_in_place(x):
    x += 1.0
    return {"x": x}


def test_loaded_versions_read_shared_memory_and_copy_on_their_first_write(process_client, memory):
    values = dsched.shared_empty((8,))
    values[:] = 1.0
    with dsched.Batch({"x": values}, dsched.StaticHybridScheduler(["cpu", "cuda:0"], [4, 4]),
                      client=process_client, memory=memory) as batch:
        batch.update(_add_in_place, reads=["x"], writes=["x"], inplace=True)
        np.testing.assert_array_equal(batch.get("x"), 2.0)
    np.testing.assert_array_equal(values, 1.0)  # the caller's array (the lineage) is untouched


def _step(x, *, k, fail_at=None, gate=None):
    if gate is not None:  # the chunk stays busy until the next updates are pushed: they queue behind it
        deadline = time.monotonic() + 30
        while not os.path.exists(gate):  # the test makes the file once every update is pushed
            assert time.monotonic() < deadline, "the test never opened the gate"
            time.sleep(0.002)
    if k == fail_at:
        raise ValueError(f"step {k} fails")
    return {"x": x + k}


def _burst(batch, steps, folder, **kwargs):
    """Updates ``steps`` pushed while the first one's chunks wait at a gate (a file in ``folder``), opened once
    all are pushed."""
    gate = os.path.join(folder, f"gate-{uuid.uuid4().hex}")
    handles = [batch.update(_step, reads=["x"], writes=["x"],
                            kwargs={"k": k, "gate": gate if k == steps[0] else None, **kwargs}) for k in steps]
    open(gate, "w").close()
    return handles


def test_updates_pushed_in_a_burst_run_as_one_task_per_chunk(process_client, tmp_path):
    """Updates queued behind the lookahead go to Dask together: one round trip per burst, the same results;
    a failure fails (and rolls back) the updates fused with it, and the batch stays usable."""
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [3, 3])
    with dsched.Batch({"x": np.zeros(6)}, scheduler, client=process_client, lookahead=1, memory="device") as batch:
        handles = _burst(batch, range(1, 11), tmp_path)
        np.testing.assert_array_equal(batch.get("x"), 55.0)
        keys = {f.key for h in handles for f in h.futures}
        assert len(keys) < 2 * len(handles) and any("-fused-" in key for key in keys)
        batch.update(_step, reads=["x"], writes=["x"], kwargs={"k": 100}).wait()  # 155 from here
        burst = _burst(batch, range(1, 6), tmp_path, fail_at=3)
        with pytest.raises(ValueError, match="step 3 fails"):
            burst[-1].wait()
        # The steps queued behind the first went as one task, which failed at step 3: they roll back together, to
        # the version before that task. (Where the task starts depends on when the chunk heard that its task
        # before the burst ended: steps 2-5, or 1-5, or 3-5 after a task of 1-2.)
        after = batch.get("x")
        for c, chunk in enumerate(batch.chunks):
            failed = burst[2].futures[c].key
            first = min(k for k, handle in zip(range(1, 6), burst) if handle.futures[c].key == failed)
            assert first <= 3 and burst[4].futures[c].key == failed  # one task, to the burst's end
            np.testing.assert_array_equal(after[chunk.start:chunk.stop], 155.0 + sum(range(1, first)))
        batch.update(_step, reads=["x"], writes=["x"], kwargs={"k": 1000})
        np.testing.assert_array_equal(batch.get("x"), after + 1000)


def test_a_failed_newton_solve_fails_the_run_where_its_results_are_asked_for(process_client, memory):
    scenario, histories, model, scheduler, _ = _scenario("isoharden", 10, 2)
    failing = NEML2Model(scenario.input, "model", overrides=["Solvers/newton/max_its:=1"])
    from dsched.models import NEML2ConvergenceError

    with TransientDriver(failing, scheduler, client=process_client, memory=memory) as driver:
        driver.run(_prescribed(histories))
        for _ in range(2):  # every time
            with pytest.raises((NEML2ConvergenceError, dsched.AggregateError)) as info:
                driver.get("stress")
            assert info.value.recoverable
