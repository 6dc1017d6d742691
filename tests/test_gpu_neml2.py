"""NEML2 models on a real cuda:0 against NEML2 on the CPU: NEML2Model.dispatch, alone on the GPU and beside the
CPU, and TransientDriver keeping its state on the GPU as torch tensors.

The GPU's arithmetic differs from the CPU's in the last bits, and NEML2's Newton stops on a tolerance, so
results agree to a tolerance, not bit for bit. Marked ``gpu``: skipped without a CUDA GPU and CuPy, and
without NEML2; ``scripts/gpu-check`` runs them on a GPU machine (docs/gpu.md).
"""

import dataclasses

import numpy as np
import pytest

import dsched
from dsched.models.neml2_scenarios import SCENARIOS, VISCOPLASTIC_INPUT, run_neml2_driver

pytestmark = pytest.mark.gpu

neml2 = pytest.importorskip("neml2", reason="neml2 is not installed (pip install 'dsched[neml2]')")
torch = pytest.importorskip("torch")

from dsched.models import NEML2Model  # noqa: E402
from dsched.resident.driver import TransientDriver  # noqa: E402

# NEML2's Newton on a chunk may stop an iteration apart from the whole batch's (tests/test_neml2.py).
NEWTON = {"rtol": 1e-8, "atol": 1e-9}


@pytest.fixture(scope="module")
def gpu_client():
    from distributed import Client

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        yield client


def viscoplastic_inputs(n, seed=0):
    strain = np.random.default_rng(seed).uniform(-4e-3, 4e-3, size=(n, 6))
    return {"E": strain, "E~1": np.zeros((1, 6)), "t": 1.0, "t~1": 0.0, "stress~1": np.zeros((1, 6)),
            "equivalent_plastic_strain~1": 0.0}


def on_the_cpu(inputs):
    """NEML2 called directly on the CPU on all the points at once, as a NEML2 user would."""
    model = neml2.load_model(str(VISCOPLASTIC_INPUT), "model")
    state = {k: torch.as_tensor(np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}
    return {k: v.data.detach().numpy() for k, v in model.call_by_name(state).items()}


SCHEDULERS = {  # cuda:0 alone, and beside the CPU (the GPU first: priority 2)
    "cuda:0": lambda: dsched.SimpleScheduler("cuda:0", 5_000, capacity=10_000),
    "cpu + cuda:0": lambda: dsched.StaticHybridScheduler(["cpu", "cuda:0"], [1_000, 5_000], priorities=[1, 2]),
}


@pytest.mark.parametrize("devices", list(SCHEDULERS))
def test_an_implicit_model_on_cuda0_matches_neml2_on_the_cpu(gpu_client, devices):
    inputs = viscoplastic_inputs(20_000)
    out = NEML2Model(VISCOPLASTIC_INPUT, "model").dispatch(inputs, scheduler=SCHEDULERS[devices](),
                                                           client=gpu_client)
    reference = on_the_cpu(inputs)
    assert (reference["equivalent_plastic_strain"] > 0).sum() > 5_000  # the points yield: Newton has work
    assert sorted(out) == sorted(reference)
    for name in out:
        assert isinstance(out[name], np.ndarray)
        np.testing.assert_allclose(out[name], reference[name], err_msg=name, **NEWTON)


def test_typed_cuda_inputs_come_back_typed_and_equal_to_the_cpu(gpu_client):
    inputs = viscoplastic_inputs(10_000, seed=1)
    typed = {**inputs, "E": neml2.types.SR2(torch.as_tensor(inputs["E"], device="cuda:0"))}
    out = NEML2Model(VISCOPLASTIC_INPUT, "model").dispatch(typed, scheduler=SCHEDULERS["cuda:0"](),
                                                           client=gpu_client)
    reference = on_the_cpu(inputs)
    assert type(out["stress"]) is neml2.types.SR2  # NEML2's typed tensors come back typed
    for name, value in out.items():
        np.testing.assert_allclose(value.data.detach().cpu().numpy(), reference[name], err_msg=name, **NEWTON)


def test_transient_driver_keeps_radrets_state_on_cuda0_and_matches_nemls_driver_on_the_cpu(gpu_client):
    points, steps = 2_000, 4
    scenario = dataclasses.replace(SCENARIOS["radret"], points=points)
    histories = scenario.histories(steps=steps, allocate=dsched.shared_empty)
    halves = [points // 2, points - points // 2]
    model = NEML2Model(scenario.input, scenario.model, overrides=scenario.overrides)
    reference, _ = run_neml2_driver(scenario, histories, chunks=halves)  # NEML2's driver on the CPU
    prescribed = {"t": histories.time, **histories.prescribed}
    scheduler = dsched.StaticHybridScheduler(["cuda:0", "cpu"], halves)
    with TransientDriver(model, scheduler, client=gpu_client) as driver:
        driver.run(prescribed, steps_per_update=2)
        kinds = driver.batch.reduce(lambda v: v.device.type if hasattr(v, "device") else type(v).__name__,
                                    "gamma", combine=set)
        got = driver.get_many()
    assert "cuda" in kinds  # the GPU chunk's state stayed on the GPU between updates
    assert (np.abs(reference["gamma"]) > 0).mean() > 0.5
    for name, value in got.items():
        scale = float(np.abs(reference[name]).max()) or 1.0
        np.testing.assert_allclose(value, reference[name], rtol=1e-9, atol=1e-9 * scale, err_msg=name)
