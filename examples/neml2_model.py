"""A NEML2 model over the CPU and every GPU: the per-device loop NEML2's Python path leaves to you.

    pip install ".[neml2]"
    python examples/neml2_model.py [--points 100000] [--input model.i --model model]

Loads a NEML2 input file (by default the Perzyna viscoplastic model shipped with
dsched, an implicit update with NEML2's own Newton solve), evaluates one
time step on ``--points`` material points with dsched spreading the chunks
over the CPU and every visible GPU, then checks a sample of points against
NEML2 called directly. Without a GPU, cuda:0 is emulated: a second CPU worker
that claims the device, to show placement only (not a GPU measurement).

A chunk whose Newton solve fails raises NEML2ConvergenceError, a
RecoverableError: the run below retries it with more Newton iterations.

Then ``--steps`` steps of NEML2's own "radret" benchmark scenario run with a
TransientDriver: the histories (time, strain) go in, the old state
(``plastic_strain~1 <- plastic_strain``, ``t~1 <- t``...) is fed back where
each chunk lives, and the result is checked against NEML2's own driver run on
the same chunks (equal, bit for bit).
"""

import argparse
import time

import numpy as np
from distributed import Client

import dsched
from dsched.models import NEML2ConvergenceError, NEML2Model
from dsched.models.neml2_scenarios import SCENARIOS, VISCOPLASTIC_INPUT, run_neml2_driver
from dsched.resident.driver import TransientDriver

DEFAULT_INPUT = VISCOPLASTIC_INPUT  # installed with dsched: dsched/models/scenarios/viscoplastic.i


def step_inputs(n, seed=0):
    """One step of 1 s from rest; unbatched tensors carry a batch axis of 1 (they go whole to every chunk)."""
    strain = np.random.default_rng(seed).uniform(-4e-3, 4e-3, size=(n, 6))
    return {"E": strain, "E~1": np.zeros((1, 6)), "t": 1.0, "t~1": 0.0,
            "stress~1": np.zeros((1, 6)), "equivalent_plastic_strain~1": 0.0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--input", default=str(DEFAULT_INPUT))
    parser.add_argument("--model", default="model")
    parser.add_argument("--steps", type=int, default=10, help="steps of the radret scenario (0: none)")
    args = parser.parse_args()

    gpus = dsched.visible_gpus()
    devices = ["cpu", *map(str, gpus)] if gpus else ["cpu", "cuda:0"]
    scheduler = dsched.StaticHybridScheduler(devices, [10_000] + [100_000] * (len(devices) - 1),
                                             priorities=[1] + [2] * (len(devices) - 1))
    inputs = step_inputs(args.points)
    model = NEML2Model(args.input, args.model)  # the file is read here: wrong names fail before any work
    print(f"{args.model} from {args.input}: inputs {model.input_names}, outputs {model.output_names}")

    with dsched.LocalHybridCluster(devices, emulate=not gpus, threads_per_worker=1,
                                   processes=True, dashboard_address=None) as cluster, Client(cluster) as client:
        start = time.perf_counter()
        try:
            out = model.dispatch(inputs, scheduler=scheduler, client=client)
        except (NEML2ConvergenceError, dsched.AggregateError) as err:
            if not err.recoverable:
                raise
            print(f"recoverable failure ({err}); retrying with 50 Newton iterations")
            model = NEML2Model(args.input, args.model, overrides=["Solvers/newton/max_its:=50"])
            out = model.dispatch(inputs, scheduler=scheduler, client=client)
        wall = time.perf_counter() - start
        if args.steps:
            run_scenario(devices, args.steps, client)
    emulated = "" if gpus else " (cuda:0 emulated on the CPU: placement only, not a GPU measurement)"
    print(f"{args.points:,} points on {', '.join(devices)} in {wall:.2f} s{emulated}")

    # NEML2 called directly on a sample of the same points.
    import neml2
    import torch

    sample = np.arange(0, args.points, max(1, args.points // 1000))
    direct = neml2.load_model(args.input, args.model).call_by_name(
        {k: torch.as_tensor(v[sample] if k == "E" else np.asarray(v, dtype=np.float64)) for k, v in inputs.items()})
    for name, value in direct.items():
        np.testing.assert_allclose(out[name][sample], value.data.detach().numpy(), rtol=1e-8, atol=1e-9)
    print(f"{len(sample)} sampled points agree with NEML2 called directly; "
          f"{(out['equivalent_plastic_strain'] > 0).mean():.0%} of the points yielded")


def run_scenario(devices, steps, client, points=10_000):
    """NEML2's radret scenario, ``steps`` steps, on a TransientDriver; checked against NEML2's driver."""
    scenario = SCENARIOS["radret"]
    h = scenario.histories(points, steps, allocate=dsched.shared_empty)  # read where they lie: no copy
    chunk = points // len(devices)
    sizes = [chunk] * (len(devices) - 1) + [points - chunk * (len(devices) - 1)]
    scheduler = dsched.StaticHybridScheduler(devices, sizes)  # one chunk per device: NEML2's floor once each
    model = NEML2Model(scenario.input, "model", overrides=scenario.overrides)
    start = time.perf_counter()
    with TransientDriver(model, scheduler, client=client) as driver:
        driver.run({"t": h.time, **h.prescribed})  # the old state is fed back by NEML2's rule
        final = driver.get_many()
    wall = time.perf_counter() - start
    reference, _ = run_neml2_driver(scenario, h, chunks=sizes)
    for name, value in reference.items():
        np.testing.assert_array_equal(final[name], value)
    print(f"radret: {steps} steps of {points:,} points in {wall:.2f} s, equal to NEML2's driver on the same chunks")


if __name__ == "__main__":
    main()
