"""NEML2's benchmark scenarios: the models, their prescribed histories, and NEML2's own driver over them.

NEML2 publishes a benchmark suite (``benchmark/<scenario>/model.i`` in its
repository): each file is a model and a ``TransientDriver`` that applies 100
strain steps. dsched ships its own input files of four of them
(``dsched/models/scenarios/*.i``: the same models and parameters, without the
driver) and builds the same histories here:

- time: ``t[k, i] = end_time[i] * k / 99`` for the 100 steps ``k``, with
  ``end_time = logspace(lo, hi, points)`` (each point its own strain rate);
- strain: ``strain[k, i] = (k / 99) * (0.1, -0.05, -0.05, 0, 0, 0)`` (Mandel;
  0.1 and -0.05 rounded to float32, as NEML2's ``SR2.fill`` makes them).

They are computed with torch's ``linspace`` and ``logspace``, as NEML2's
files compute them, so they are NEML2's to the last bit (NumPy's, within a
bit, where torch is not installed).

:func:`checkout_scenario` reads a NEML2 checkout's ``benchmark/`` folder
instead: the model and the histories come from NEML2's own file and driver.

>>> s = SCENARIOS["radret"]
>>> h = s.histories(points=3, steps=2)
>>> h.time.shape, h.prescribed["strain"].shape
((3, 3), (3, 3, 6))

:func:`run_neml2_driver` runs NEML2's ``TransientDriver`` (the reference),
on the whole batch or chunk by chunk.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

__all__ = ["Scenario", "Histories", "SCENARIOS", "SCENARIO_DIR", "VISCOPLASTIC_INPUT", "checkout_scenario",
           "run_neml2_driver"]

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
VISCOPLASTIC_INPUT = SCENARIO_DIR / "viscoplastic.i"  # Perzyna J2 viscoplasticity, dsched's own (tests, examples)

TOTAL_STEPS = 100  # NEML2's scenarios: 100 time steps from 0 to each point's end time
# NEML2's SR2.fill(0.1, -0.05, -0.05) (Mandel notation) makes torch's default dtype, float32: its files'
# strains are float32's 0.1 and -0.05 (0.10000000149...), then multiplied in float64. So are these.
MAX_STRAIN = tuple(float(v) for v in np.array([0.1, -0.05, -0.05, 0.0, 0.0, 0.0], dtype=np.float32))

# NEML2's Newton stops on the residual norm over the whole batch: at its default rel_tol (1e-8) a chunk
# of radret may take one iteration fewer than the whole batch (5e-10 apart). Tightened, they agree.
TIGHT_NEWTON = ("Solvers/newton/rel_tol:=1e-12", "Solvers/newton/abs_tol:=1e-14")


@dataclasses.dataclass(frozen=True)
class Histories:
    """Prescribed histories of ``steps + 1`` entries, time leading (NEML2's layout).

    ``time`` is ``(steps + 1, points)``; ``prescribed`` maps each driving
    variable (``"strain"``) to ``(steps + 1, points, *base)``. Entry 0 is the
    initial state (the driver calls the model from entry 1 on).
    """

    time: np.ndarray
    prescribed: dict

    @property
    def steps(self) -> int:
        return len(self.time) - 1

    @property
    def points(self) -> int:
        return self.time.shape[1]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One of NEML2's benchmark scenarios.

    Parameters
    ----------
    name : str
        NEML2's folder name (``benchmark/<name>/model.i``).
    input : path
        The NEML2 input file of the model.
    points : int
        Material points in ``dsched bench --only neml2`` (``--quick`` divides them).
    end_time : tuple of float
        ``(lo, hi)``: each point's end time is ``logspace(lo, hi, points)``.
    overrides : tuple of str
        HIT overrides for the model (NEML2's command-line syntax).
    model : str
        The model's name in the file.
    source : str
        Where the input file and histories come from (``"dsched"`` or a checkout).
    """

    name: str
    input: Path
    points: int
    end_time: tuple = (5.0, 5.0)
    overrides: tuple = ()
    model: str = "model"
    source: str = "dsched"

    def histories(self, points=None, steps=10, *, allocate=np.empty) -> Histories:
        """The first ``steps`` of the scenario's 100 steps on ``points`` points (default: the scenario's).

        ``allocate(shape, dtype)`` makes the arrays (``dsched.shared_empty``
        puts them in shared memory, where worker processes read them without
        a copy).
        """
        points = self.points if points is None else int(points)
        if points < 1:
            raise ValueError(f"points: expected a positive number of points, got {points}")
        if not 1 <= steps < TOTAL_STEPS:
            raise ValueError(f"steps: expected 1 to {TOTAL_STEPS - 1} steps, got {steps}")
        if self.source != "dsched":
            return _checkout_histories(self, points, steps, allocate)
        fraction, end = _spaces(self.end_time, points)
        fraction = fraction[: steps + 1]
        time = allocate((steps + 1, points), np.float64)
        np.multiply(end[None, :], fraction[:, None], out=time)
        strain = allocate((steps + 1, points, 6), np.float64)
        np.multiply(np.asarray(MAX_STRAIN)[None, None, :], fraction[:, None, None], out=strain)
        return Histories(time, {"strain": strain})

    def with_overrides(self, *overrides) -> Scenario:
        return dataclasses.replace(self, overrides=self.overrides + tuple(overrides))


def _spaces(end_time, points):
    """NEML2's ``linspace(0, 1, 100)`` and ``logspace(lo, hi, points)``: torch's, as NEML2 computes them (NumPy's
    differ in the last bit), or NumPy's where torch is not installed."""
    try:
        import torch
    except ImportError:
        return np.linspace(0.0, 1.0, TOTAL_STEPS), np.logspace(end_time[0], end_time[1], points)
    return (torch.linspace(0.0, 1.0, TOTAL_STEPS, dtype=torch.float64).numpy(),
            torch.logspace(end_time[0], end_time[1], points, dtype=torch.float64).numpy())


def _scenario(name, points, end_time, overrides=()):
    return Scenario(name, SCENARIO_DIR / f"{name}.i", points, end_time, tuple(overrides))


#: The four scenarios of the bench, at the sizes it runs them (radret's Newton tightened: see TIGHT_NEWTON).
SCENARIOS = {
    "elasticity": _scenario("elasticity", 500_000, (5.0, 5.0)),
    "radret": _scenario("radret", 10_000, (-1.0, 5.0), TIGHT_NEWTON),
    "isoharden": _scenario("isoharden", 4_000, (-1.0, 5.0)),
    "chaboche2": _scenario("chaboche2", 1_000, (5.0, 5.0)),
}


def checkout_scenario(benchmarks, name, points=None) -> Scenario:
    """Scenario ``name`` of a NEML2 checkout's ``benchmark/`` folder: NEML2's own model file and driver.

    ``points`` defaults to the size dsched's own copy runs at. The tolerance
    overrides of :data:`SCENARIOS` apply here too.
    """
    path = Path(benchmarks) / name / "model.i"
    if not path.is_file():
        raise ValueError(f"neml2_benchmarks: no {name}/model.i in {benchmarks}")
    own = SCENARIOS.get(name)
    points = int(points or (own.points if own else 1_000))
    overrides = own.overrides if own else ()
    return Scenario(name, path.resolve(), points, overrides=overrides, source=str(Path(benchmarks).resolve()))


def _checkout_histories(scenario, points, steps, allocate) -> Histories:
    """NEML2's own driver's histories (its ``[Tensors]``) at ``nbatch = points``, the first ``steps`` steps."""
    from dsched.models.neml2 import _import_neml2

    neml2 = _import_neml2()
    driver = neml2.load_input(str(scenario.input), additional_args=[f"nbatch={points}"]).get_driver("driver")

    def copy(value):
        data = value.data.detach().numpy()[: steps + 1]
        array = allocate(data.shape, np.float64)
        array[...] = data
        return array

    return Histories(copy(driver.prescribed_time), {name: copy(v) for name, v in driver.prescribed.items()})


def model_overrides(scenario, points) -> tuple:
    """The HIT overrides a scenario's model loads with (a checkout's files need their ``nbatch``)."""
    return scenario.overrides + ((f"nbatch={points}",) if scenario.source != "dsched" else ())


def run_neml2_driver(scenario, histories, *, chunks=None, threads=None, per_step=False, compile=None,
                     artifacts=None, grad=True, paced=None):
    """NEML2's ``TransientDriver`` over ``histories``: ``{output: final value}`` (NumPy) and each chunk's seconds.

    ``chunks`` (a list of point counts) runs the driver once per chunk of
    points, one after another, and joins the results: what dsched computes
    when it cuts the batch the same way (``seconds`` then lists each chunk's
    time). ``threads`` sets torch's thread count for the call (restored
    after). The drivers are built before the clock starts, as NEML2 builds
    one from its input file. With ``per_step``, a third value lists each
    chunk's seconds per step (the model's calls). ``compile`` (a dict of
    ``neml2.compile`` options) compiles the model first, as NEML2's users do
    (the first call of each chunk size compiles: warm it up before timing);
    ``artifacts`` drives an AOTI artifact root's ``cpu/float64`` leaf
    (``neml2.aoti.AOTIModel``) instead of the input file's model. ``grad``
    off runs the driver under ``torch.no_grad()``: values alone, nothing
    recorded for a backward pass (``NEML2Model(autograd=False)``'s way).
    ``paced`` (a ``multiprocessing.connection.Connection``) holds each of the
    model's calls until a message comes on it, and answers one when the call
    is done: NEML2's steps paced by a caller (:class:`_PacedModel`).
    """
    import time

    import torch

    from dsched.models.neml2 import _import_neml2

    neml2 = _import_neml2()
    if artifacts is not None:
        from neml2.aoti import AOTIModel

        model = AOTIModel(str(artifacts))
    else:
        model = neml2.load_input(str(scenario.input), additional_args=list(
            model_overrides(scenario, histories.points))).get_model(scenario.model)
    if compile is not None:
        neml2.compile(model, **compile)
    bounds = np.cumsum([0, *(chunks or [histories.points])])
    pairs = list(zip(bounds[:-1], bounds[1:]))
    drivers = [_driver(neml2, torch, model, histories, a, b) for a, b in pairs]
    for driver in drivers:
        if per_step:
            driver.model = _TimedModel(driver.model)
        if paced is not None:
            driver.model = _PacedModel(driver.model, paced)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    seconds = []
    try:
        for driver in drivers:
            start = time.perf_counter()
            with torch.set_grad_enabled(grad):
                driver.run()
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    finals = [driver.result_out[-1] for driver in drivers]
    out = {}
    for name in model.output_spec:
        pieces = [np.broadcast_to(f[name].data.detach().numpy(), (b - a, *f[name].base_shape))
                  for f, (a, b) in zip(finals, pairs)]
        out[name] = np.concatenate(pieces)
    if per_step:
        return out, seconds, [driver.model.seconds for driver in drivers]
    return out, seconds


class _TimedModel:
    """A NEML2 model that records the seconds of each call (a driver's steps); otherwise the model itself."""

    def __init__(self, model):
        self.model, self.seconds = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        import time

        start = time.perf_counter()
        try:
            return self.model(*args, **kwargs)
        finally:
            self.seconds.append(time.perf_counter() - start)


class _PacedModel:
    """A NEML2 model whose every call waits for a message on ``connection`` and answers one once done: a driver's
    steps released one by one by a caller, as a call per step releases them; otherwise the model itself. Made
    once the driver is built, it says so (``ready``): the caller's clock starts at its first release."""

    def __init__(self, model, connection):
        self.model, self.connection = model, connection
        connection.send_bytes(b"ready")

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.connection.recv_bytes()
        try:
            return self.model(*args, **kwargs)
        finally:
            self.connection.send_bytes(b"done")


def _driver(neml2, torch, model, histories, start, stop):
    """NEML2's driver over points ``start:stop``, its histories its own (copies, as NEML2 builds them itself)."""
    spec = model.input_spec
    time = neml2.types.Scalar(torch.tensor(histories.time[:, start:stop]))
    prescribed = {name: spec[name](torch.tensor(value[:, start:stop])) for name, value in histories.prescribed.items()}
    return neml2.TransientDriver(model, time, "t", prescribed, {})
