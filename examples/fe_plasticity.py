"""J2 plasticity in FElupe, with its material evaluated through dsched, checked against FElupe's own.

A quarter plate with a hole (plane strain, four quadrature points per cell) is
pulled in 10 load steps. FElupe's Newton loop calls its material at every
iteration on all points at once; here the material is
:class:`dsched.FEMaterial` around FElupe's own J2 material
(``LinearElasticPlasticIsotropicHardening``): each call is split by cells over
a CPU and an emulated ``cuda:0`` worker process, and one call gives the stress,
the new state and the tangent. The same solve with FElupe's material alone
runs first, and the two must agree to the last bit (the same NumPy function
computes both).

    pip install ".[fe]"                            # from the checkout: FElupe (GPL-3.0) from PyPI
    python examples/fe_plasticity.py               # 2 x 12 x 12 cells: a few seconds
    python examples/fe_plasticity.py --size 100    # 20,000 cells, 80,000 points
    python examples/fe_plasticity.py --case hexahedra --size 6 --layers 64 --one-call
    python examples/fe_plasticity.py --scheduler-file sf.json   # a running cluster

``--case hexahedra`` is a cube of ``size^3`` hexahedra (eight points per cell)
pulled along x, and ``--layers N`` makes the material N J2 layers in parallel
(an overlay model: N times the work and 19 N + 18 state variables per point).
The two together are a solve where the material dominates: with 64 layers on
216 hexahedra it takes about 85 % of FElupe's own solve. ``--one-call`` runs the
material's function once per chunk for the stress, the state and the tangent
(FElupe runs it twice per iteration); ``--tangent apart`` dispatches the stress
and the tangent each when FElupe asks for it, and ``--tangent predict`` leaves
the tangent out where Newton's iterates say FElupe only tests convergence.
``dsched bench --only fe`` times these solves.
"""

import argparse
import collections
import copy
import importlib
import time

import numpy as np

#: the J2 material of both cases: steel-like constants (MPa)
J2 = dict(E=210000.0, nu=0.3, sy=355.0, K=800.0)


def plate_with_hole(n, radius=0.3, length=1.0):
    """A quarter plate with a hole: ``2 n * n`` quadrilaterals between the hole's arc and the plate's edges."""
    import felupe as fem

    grid = fem.Rectangle(n=(n + 1, 2 * n + 1))  # (radial, around the hole), mapped below
    s, t = grid.points[:, 0], grid.points[:, 1]
    ray = np.stack([np.cos(t * np.pi / 2), np.sin(t * np.pi / 2)], axis=1)
    inner, outer = radius * ray, length * ray / ray.max(axis=1, keepdims=True)
    return fem.Mesh(inner + s[:, None] * (outer - inner), grid.cells, grid.cell_type)


def overlay(dε, εn, σn, ζn, λ, μ, weights, yield_stresses, hardening, **kwargs):
    """Layers of FElupe's J2 material in parallel, each with its own yield stress and state (an overlay model).

    The stress and the tangent are the layers' weighted sums; each layer keeps
    its hardening variable, plastic strain and stress as state variables.
    """
    from felupe import linear_elastic_plastic_isotropic_hardening as j2

    tangent, stress, state = None, 0.0, []
    for i, (weight, sy, K) in enumerate(zip(weights, yield_stresses, hardening)):
        alpha, plastic, layer_stress = ζn[3 * i:3 * i + 3]
        dσdε, σ, (alpha, plastic) = j2(dε, εn, layer_stress, [alpha, plastic], λ, μ, sy, K, **kwargs)
        stress = stress + weight * σ
        if kwargs["tangent"]:
            tangent = weight * dσdε if tangent is None else tangent + weight * dσdε
        state += [alpha, plastic, σ]
    return tangent, stress, state


def material(layers=1):
    """FElupe's J2 material, or ``layers`` of it in parallel (multilinear hardening, 19 state variables each)."""
    import felupe as fem

    if layers == 1:
        return fem.LinearElasticPlasticIsotropicHardening(**J2)
    lmbda, mu = fem.constitution.lame_converter(J2["E"], J2["nu"])
    return fem.MaterialStrain(
        material=overlay, λ=lmbda, μ=mu, weights=[1.0 / layers] * layers,
        yield_stresses=list(np.linspace(0.6, 1.6, layers) * J2["sy"]), hardening=[J2["K"]] * layers,
        statevars=((1,), (3, 3), (3, 3)) * layers)


class OneCall:
    """A FElupe strain-based material (``MaterialStrain``) as one function giving its gradient and hessian lists.

    FElupe calls the material function twice per Newton iteration: for the
    stress (``tangent=False``) and again for the tangent. Here its gradient
    runs the function once per chunk of cells with the tangent, and its hessian
    takes those results in the same order (FElupe evaluates both over the same
    chunks, one after the other): the stress and the state are the function's
    own, so the results are FElupe's to the last bit, from one call. Told
    ``tangent=False`` (``FEMaterial``'s ``"predict"`` and ``"apart"``), it gives
    FElupe's gradient alone and no hessian.
    """

    def __init__(self, umat):
        self.umat, self.x = umat, umat.x

    def __call__(self, x, tangent=True):
        if not tangent:  # FEMaterial asks for the stress and state alone (tangent="predict" or "apart")
            return self.umat.gradient(x), None
        umat, function, results = copy.copy(self.umat), self.umat.material, collections.deque()

        def with_tangent(*args, tangent, **kwargs):
            results.append(function(*args, tangent=True, **kwargs))
            return results[-1]

        umat.material = with_tangent
        gradient = umat.gradient(x)
        umat.material = lambda *args, **kwargs: results.popleft()
        return gradient, umat.hessian(x)


def problem(case, size, umat, steps=10):
    """A FElupe job of ``case`` ("plate" or "hexahedra") with ``umat``; its solid body and the job."""
    import felupe as fem

    if case == "plate":
        region = fem.RegionQuad(plate_with_hole(size))
        field = fem.FieldContainer([fem.FieldPlaneStrain(region, dim=2)])
        move, end = ("fy", 0.002), 1.0
    elif case == "hexahedra":
        region = fem.RegionHexahedron(fem.Cube(n=size + 1))
        field = fem.FieldContainer([fem.Field(region, dim=3)])
        move, end = ("fx", 0.006), 1.0
    else:
        raise ValueError(f"case: expected 'plate' or 'hexahedra', got {case!r}")
    solid = fem.SolidBody(umat, field)
    boundaries = fem.dof.symmetry(field[0])
    axis, displacement = move
    pulled = fem.Boundary(field[0], **{axis: lambda x: np.isclose(x, end)},
                          skip=(0, 1, 1) if axis == "fx" else (1, 0))
    boundaries["move"] = pulled
    step = fem.Step(items=[solid], ramp={pulled: fem.math.linsteps([0, displacement], num=steps)},
                    boundaries=boundaries)
    return solid, fem.Job(steps=[step])


def solve(case, size, umat, steps=10):
    """Solve ``case`` with ``umat``; ``(seconds, displacements, state)``."""
    solid, job = problem(case, size, umat, steps)
    start = time.perf_counter()
    job.evaluate(tol=1e-6, verbose=0)
    return time.perf_counter() - start, solid.field[0].values.copy(), np.array(solid.results.statevars)


def scheduler_for(cells, points_per_cell=4, devices=("cpu", "cuda:0")):
    """Cells in up to four chunks per device (none below 2,048 points), two in flight on each.

    Plastic cells cost more than elastic ones, so equal halves would leave
    one device waiting for the other: with several chunks, a device that
    finishes early takes more, and with two in flight it never waits for its
    next one. Smaller chunks also let FElupe skip the plastic update where a
    chunk has no plastic point. Below 2,048 points a chunk's share of the
    call's fixed cost outweighs that.
    """
    import dsched

    chunks = max(1, min(4, cells * points_per_cell // (2048 * len(devices))))
    size = -(-cells // (len(devices) * chunks))
    in_flight = min(2, chunks)  # one chunk per device: one each, or the first device would take both
    return dsched.StaticHybridScheduler(list(devices), batch_sizes=size, capacities=in_flight * size)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and each option's default."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--case", choices=("plate", "hexahedra"), default="plate",
                        help="a quarter plate with a hole (quadrilaterals, plane strain) or a cube of hexahedra")
    parser.add_argument("--size", type=int, default=12,
                        help="cells per edge (the plate has 2 size^2 cells, the cube size^3)")
    parser.add_argument("--layers", type=int, default=1, help="J2 layers of the material (1: FElupe's J2)")
    parser.add_argument("--steps", type=int, default=10, help="load steps")
    parser.add_argument("--one-call", action="store_true",
                        help="call the material function once per chunk for stress, state and tangent (OneCall)")
    parser.add_argument("--tangent", choices=("with-gradient", "apart", "predict"), default="with-gradient",
                        help="FEMaterial's tangent: with each stress evaluation (one dispatch per Newton iteration), "
                             "apart (when FElupe asks for it), or predict (with each stress but "
                             "Newton's convergence checks)")
    parser.add_argument("--scheduler-file", help="a running Dask cluster's scheduler file (else a local one)")
    args = parser.parse_args(argv)
    for name in ("size", "layers", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected at least 1, got {getattr(args, name)}")

    from distributed import Client

    import dsched

    seconds, u, state = solve(args.case, args.size, material(args.layers), args.steps)
    print(f"FElupe alone:            {seconds:5.2f} s ({state.shape[-1]} cells, {state.shape[-2]} points each)")

    if args.scheduler_file:
        cluster, client = None, Client(scheduler_file=args.scheduler_file)
    else:  # a CPU worker and an emulated cuda:0 (NumPy on the CPU: placement, not GPU speed), one thread each
        cluster = dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                            dashboard_address=None)
        client = Client(cluster)
    try:
        client.run(importlib.import_module, "felupe")  # the workers' import (about a second) is not the solve's
        model = OneCall(material(args.layers)) if args.one_call else material(args.layers)
        umat = dsched.FEMaterial(model, scheduler=scheduler_for(state.shape[-1], state.shape[-2]), client=client,
                                 tangent=args.tangent)
        seconds_d, u_d, state_d = solve(args.case, args.size, umat, args.steps)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
    speed = seconds / seconds_d
    left_out = f", {umat.tangents_left_out} without tangent" if args.tangent == "predict" else ""
    print(f"material through dsched: {seconds_d:5.2f} s ({umat.evaluations} dispatches{left_out}), "
          f"speed {speed:.2f} x FElupe alone ({'faster' if speed > 1 else 'slower'} at this size)")
    same = np.array_equal(u, u_d) and np.array_equal(state, state_d)
    print("displacements and state variables bit-identical to FElupe's own:", same)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
