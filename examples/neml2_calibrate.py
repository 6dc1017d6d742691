"""Calibrating a NEML2 model across devices: fit a parameter to data with torch.optim, gradients from param_vjp.

    pip install ".[neml2]"
    python examples/neml2_calibrate.py [--points 2000] [--iterations 10]

The data: the stress of dsched's Perzyna viscoplastic model (an implicit
update, NEML2's own Newton solve) on ``--points`` material points after one
step of 1 s from rest, computed with a yield stress of 180 (the file says
150). The fit starts from the file's value and recovers 180 by minimising the
mean squared stress error with L-BFGS (``torch.optim``). Each evaluation of
the loss, across a CPU worker and a GPU worker (an emulated one without a
GPU):

- ``model.dispatch`` evaluates the stress, chunk by chunk;
- ``model.param_vjp`` gives the loss's gradient with respect to the yield
  stress (NEML2's ``param_vjp`` per chunk, the chunks' gradients summed in
  chunk order: the same bits whatever order they finish in);
- ``model.set_parameter`` sets the optimizer's value, which reaches every
  worker's copy before the next call.

The same fit then runs in one NEML2 process (NEML2's ``call_by_name`` and
``param_vjp`` on all the points), and the two fits are compared.
"""

import argparse
import time

import numpy as np
from distributed import Client

import dsched
from dsched.models import NEML2Model
from dsched.models.neml2_scenarios import VISCOPLASTIC_INPUT

YIELD = "implicit_rate.normality.flow.yield_surface.sy"  # NEML2's name of the yield stress (named_parameters)
TRUE_YIELD = 180.0
# NEML2's Newton stops on the residual over the batch it is given: tightened, a chunk's solve and the whole
# batch's agree to round-off, so the fit through dsched can be compared with the one in one process.
TIGHT = ("Solvers/newton/rel_tol:=1e-12", "Solvers/newton/abs_tol:=1e-12")


def step_inputs(n, seed=0):
    """One step of 1 s from rest; unbatched tensors carry a batch axis of 1 (they go whole to every chunk)."""
    strain = np.random.default_rng(seed).uniform(-4e-3, 4e-3, size=(n, 6))
    return {"E": strain, "E~1": np.zeros((1, 6)), "t": 1.0, "t~1": 0.0,
            "stress~1": np.zeros((1, 6)), "equivalent_plastic_strain~1": 0.0}


def fit(stress_of, gradient_of, target, start, iterations):
    """L-BFGS (``torch.optim.LBFGS``, strong Wolfe line search) on ``loss = mean((stress - target)^2)`` over one
    parameter; the parameter at each evaluation of the loss.

    ``stress_of(value)`` evaluates the model with the parameter at ``value``;
    ``gradient_of(cotangent)`` is ``d<cotangent, stress>/dparameter`` at that
    same value (a parameter VJP).
    """
    import torch

    value = torch.nn.Parameter(torch.tensor(float(start), dtype=torch.float64))
    optimizer = torch.optim.LBFGS([value], lr=1.0, max_iter=iterations, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-12, tolerance_change=1e-12)
    path = []

    def closure():
        optimizer.zero_grad()
        path.append(value.item())
        stress = stress_of(path[-1])
        residual = stress - target
        value.grad = torch.tensor(float(gradient_of(2.0 * residual / residual.size)), dtype=torch.float64)
        return torch.tensor(float(np.mean(residual**2)), dtype=torch.float64)

    optimizer.step(closure)
    path.append(value.item())
    return path


def fit_with_dsched(model, inputs, target, scheduler, client, start, iterations):
    """The fit with every evaluation and gradient spread over the scheduler's devices."""
    def stress_of(value):
        model.set_parameter(YIELD, value)  # every worker's copy has it at the next call
        return model.dispatch(inputs, scheduler=scheduler, client=client)["stress"]

    def gradient_of(cotangent):
        return model.param_vjp(inputs, {"stress": cotangent}, [YIELD], scheduler=scheduler, client=client)[YIELD]

    return fit(stress_of, gradient_of, target, start, iterations)


def fit_in_one_process(inputs, target, start, iterations, overrides=TIGHT):
    """The same fit with NEML2 alone, on all the points at once."""
    import neml2
    import torch

    model = neml2.load_input(str(VISCOPLASTIC_INPUT), additional_args=list(overrides)).get_model("model")
    state = {name: torch.as_tensor(np.asarray(value, dtype=np.float64)) for name, value in inputs.items()}

    def stress_of(value):
        model.set_parameter(YIELD, value)
        return model.call_by_name(state)["stress"].data.detach().numpy()

    def gradient_of(cotangent):
        zero = torch.zeros((), dtype=torch.float64)
        return model.param_vjp(state, {"stress": torch.as_tensor(cotangent), "equivalent_plastic_strain": zero},
                               [YIELD])[YIELD]

    return fit(stress_of, gradient_of, target, start, iterations)


def synthetic_target(inputs, overrides=TIGHT):
    """The data: the model's stress with the yield stress at TRUE_YIELD."""
    model = NEML2Model(VISCOPLASTIC_INPUT, "model", overrides=overrides)
    model.set_parameter(YIELD, TRUE_YIELD)
    return model.dispatch(inputs, scheduler=dsched.SimpleScheduler("cpu", len(inputs["E"])), mode="sync")["stress"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=2_000)
    parser.add_argument("--iterations", type=int, default=10, help="L-BFGS iterations at most")
    args = parser.parse_args()

    gpus = dsched.visible_gpus()
    devices = ["cpu", *map(str, gpus)] if gpus else ["cpu", "cuda:0"]
    share = args.points // len(devices)  # one chunk per device: NEML2's cost per call paid once on each
    scheduler = dsched.StaticHybridScheduler(devices, [share] * (len(devices) - 1)
                                             + [args.points - share * (len(devices) - 1)])
    inputs = step_inputs(args.points)
    target = synthetic_target(inputs)
    model = NEML2Model(VISCOPLASTIC_INPUT, "model", overrides=TIGHT)
    start = float(model.named_parameters()[YIELD])
    with dsched.LocalHybridCluster(devices, emulate=not gpus, threads_per_worker=1, processes=True,
                                   dashboard_address=None) as cluster, Client(cluster) as client:
        began = time.perf_counter()
        across = fit_with_dsched(model, inputs, target, scheduler, client, start, args.iterations)
        wall = time.perf_counter() - began
    alone = fit_in_one_process(inputs, target, start, args.iterations)
    emulated = "" if gpus else " (cuda:0 emulated on the CPU)"
    print(f"yield stress: {start:g} -> {across[-1]:.6f} in {len(across) - 1} evaluations on {', '.join(devices)}"
          f"{emulated}, {wall:.1f} s; the truth is {TRUE_YIELD:g}")
    difference = max(abs(a - b) / abs(b) for a, b in zip(across, alone))
    print(f"the same fit in one NEML2 process: {alone[-1]:.6f}; largest relative difference along the path "
          f"{difference:.1e}")


if __name__ == "__main__":
    main()
