"""100 load steps of J2 plasticity on 500,000 material points, the state staying on its devices.

A finite-element solver calls its material model at every load step on the
same points, carrying the plastic strain and the hardening variable from one
step to the next. Here the points live in a :class:`dsched.Batch`: each chunk
is placed once on the device the scheduler plans for it, every step is an
update that returns at once, and the client waits only where it asks for a
value (a reduction every ``--report-every`` steps, the stress at the end).

    python examples/load_steps.py                       # 500,000 points, 100 steps, CPU worker processes
    python examples/load_steps.py --points 1000000      # the size of dsched bench --only batch
    python examples/load_steps.py --points 2000 --steps 10 --emulate --check

``--emulate`` adds an emulated ``cuda:0`` worker (a CPU process that claims the
device and computes with NumPy: it shows placement, not GPU speed). With a real
GPU, its chunks stay in GPU memory between steps.
"""

import argparse
import time

import numpy as np
from distributed import Client

import dsched
from dsched.apps.bench.batch import final_strain, j2_load_step_in_place, run_numpy


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows this module's docstring as written and every option's default."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--points", type=int, default=500_000, help="material points")
    parser.add_argument("--steps", type=int, default=100, help="load steps")
    parser.add_argument("--report-every", type=int, default=10, help="steps between two reductions")
    parser.add_argument("--emulate", action="store_true", help="add an emulated cuda:0 worker (testing only)")
    parser.add_argument("--check", action="store_true", help="compare with the same steps in NumPy")
    args = parser.parse_args(argv)

    devices = ["cpu", "cuda:0"] if args.emulate else ["cpu"] + [str(d) for d in dsched.visible_gpus()]
    gpus = [d for d in devices if d != "cpu"]
    scheduler = dsched.StaticHybridScheduler(devices, batch_sizes=[262144] * len(devices),
                                             priorities=[1] + [2] * len(gpus))
    strain = final_strain(args.points)  # each point's strain at the last step; step k applies (k+1)/steps of it
    with dsched.LocalHybridCluster(devices, emulate=args.emulate, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        start = time.perf_counter()
        zeros = np.zeros_like(strain)
        with dsched.Batch({"final_strain": strain, "plastic_strain": zeros, "alpha": np.zeros(args.points),
                           "stress": zeros}, scheduler, client=client) as batch:
            print(batch)
            for step in range(args.steps):
                # Reads the strain, overwrites the state and the stress where they live (inplace=True: no new
                # versions, so the device memory stays what it was after the first step). The engine orders
                # it after the previous step on each chunk, and nothing waits across chunks.
                batch.update(j2_load_step_in_place, reads=["final_strain", "plastic_strain", "alpha", "stress"],
                             writes=["plastic_strain", "alpha", "stress"], inplace=True, label="j2-step",
                             kwargs={"factor": (step + 1) / args.steps})
                if (step + 1) % args.report_every == 0 or step + 1 == args.steps:
                    yielded = batch.reduce(lambda a: int((a > 0).sum()), "alpha")
                    peak = batch.reduce(lambda a: float(a.max()), "alpha", combine=max)
                    print(f"step {step + 1:4d}: {yielded:,} points yielded, max equivalent plastic strain {peak:.3e}")
            stress = batch.get("stress")
            alpha = batch.get("alpha")
        elapsed = time.perf_counter() - start
    print(f"{args.steps} steps on {args.points:,} points in {elapsed:.2f} s")
    if args.check:
        reference = run_numpy(strain, args.steps)
        np.testing.assert_array_equal(stress, reference["stress"])
        np.testing.assert_array_equal(alpha, reference["alpha"])
        print("check: equal to the same steps in NumPy")


if __name__ == "__main__":
    main()
