"""``dsched.map_blocks`` on a user model: J2 plasticity over a batch of material points.

The batch is three arrays (strain, plastic strain, equivalent plastic
strain); ``dsched.map_blocks`` cuts them along axis 0 by the scheduler's plan
and runs the model's wrapper on every block, each on the device planned for
it, as a lazy Dask array that composes with further operations (here the von
Mises stress and its maximum). The result is checked against the model run on
the whole batch at once in NumPy.

    python examples/map_blocks_j2.py                     # CPU + cuda:0 (emulated without a GPU)
    python examples/map_blocks_j2.py --points 1000000 --batch-sizes 20000 200000

Without a GPU the cuda:0 worker is emulated: it computes with NumPy on the
CPU, which tests placement, never GPU speed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def j2_stress(strain, plastic_strain, alpha):
    """The user's model wrapper: J2's stress for a block of points (NumPy or CuPy in, same out)."""
    from dsched.models.j2 import j2_update

    # alpha comes as a column (m, 1) from Dask (it aligns inputs on their last axes), or flat.
    return j2_update(strain, plastic_strain, alpha.reshape(-1), tangent=False)["stress"]


def von_mises(stress):
    """Von Mises stress of Mandel 6-vectors (works on NumPy and Dask arrays alike)."""
    pressure = (stress[:, 0] + stress[:, 1] + stress[:, 2]) / 3.0
    deviator_sq = ((stress[:, :3] - pressure[:, None]) ** 2).sum(axis=1) + (stress[:, 3:] ** 2).sum(axis=1)
    return (1.5 * deviator_sq) ** 0.5


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows this module's docstring as written and every option's default."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--points", type=int, default=200_000, help="material points to evaluate")
    parser.add_argument("--batch-sizes", type=int, nargs=2, default=[5_000, 40_000], metavar=("CPU", "GPU"),
                        help="sub-batch size of the CPU and of cuda:0")
    parser.add_argument("--priorities", type=float, nargs=2, default=[1.0, 4.0], metavar=("CPU", "GPU"),
                        help="priorities of the CPU and of cuda:0 (the plan counts priority 4 as 4 times as fast)")
    args = parser.parse_args(argv)

    import dask.array as da
    from distributed import Client

    import dsched
    from dsched.devices import placement_device
    from dsched.models.j2 import loading_strain

    emulate = not dsched.visible_gpus()
    scheduler = dsched.StaticHybridScheduler(
        ["cpu", "cuda:0"], batch_sizes=list(args.batch_sizes), priorities=list(args.priorities)
    )
    n = args.points
    # Inputs built lazily by Dask (NumPy arrays work too, but travel inside the graph);
    # dsched.map_blocks re-chunks them along axis 0 as planned.
    index = da.arange(n, chunks=50_000)
    strain = index.map_blocks(loading_strain, new_axis=1, chunks=(index.chunks[0], (6,)), dtype=float)
    plastic_strain = da.zeros((n, 6), chunks=(50_000, 6))
    alpha = da.zeros((n, 1), chunks=(50_000, 1))  # a column: Dask aligns inputs on their last axes

    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=emulate, dashboard_address=None) as cluster, \
            Client(cluster):
        print(cluster)
        chunks = dsched.plan(n, scheduler)
        speeds, source = dsched.array.default_speeds(scheduler)
        for device in scheduler.devices:
            sizes = [m for d, m in chunks if d == placement_device(device)]
            note = " (emulated: NumPy on the CPU)" if cluster.emulated[device] else ""
            print(f"plan: {device}{note}: {len(sizes)} blocks, {sum(sizes)} points "
                  f"(speed estimate {speeds[device]:g} from {source})")

        stress = dsched.map_blocks(
            j2_stress, strain, plastic_strain, alpha, scheduler=scheduler, rechunk=True, dtype=strain.dtype
        )
        t0 = time.perf_counter()
        peak = von_mises(stress).max().compute()  # composes: fused with the blocks, still pinned
        elapsed = time.perf_counter() - t0

    reference = von_mises(j2_stress(loading_strain(np.arange(n)), np.zeros((n, 6)), np.zeros(n))).max()
    print(f"max von Mises stress {peak:.6g} MPa over {n} points in {elapsed:.2f} s "
          f"(whole-batch NumPy reference {reference:.6g})")
    if not np.isclose(peak, reference, rtol=1e-12, atol=0.0):
        raise SystemExit("mismatch with the NumPy reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
