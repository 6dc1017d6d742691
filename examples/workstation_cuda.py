"""A workstation: dask-cuda's ``LocalCUDACluster`` (one worker per GPU) plus a CPU worker, running
``dsched.map_blocks`` over both.

``dsched.register(client)`` installs the placement plugins: each GPU worker
claims the GPU dask-cuda pinned it to (the first entry of its
``CUDA_VISIBLE_DEVICES``), the CPU worker owns the CPU through its resource,
and every block runs on the device planned for it.

    python examples/workstation_cuda.py
    python examples/workstation_cuda.py --points 2000000 --batch-sizes 20000 500000

Without dask-cuda or without a GPU it says so and, unless ``--no-fallback``
is given (then it exits 0), runs the same thing on
``LocalHybridCluster(emulate=True)``: the GPUs are then emulated by NumPy on the
CPU, which tests placement, never GPU speed.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np


def j2_stress(strain, plastic_strain, alpha):
    """J2's stress for a block of points: CuPy arrays on a GPU worker, NumPy on the CPU worker."""
    from dsched.models.j2 import j2_update

    # alpha comes as a column (m, 1) from Dask (it aligns inputs on their last axes), or flat.
    return j2_update(strain, plastic_strain, alpha.reshape(-1), tangent=False)["stress"]


def start_cuda_cluster(stack):
    """``(client, description, gpus)`` on LocalCUDACluster plus a CPU worker, or raise why not."""
    from dask_cuda import LocalCUDACluster  # ImportError without dask-cuda
    from distributed import Client, Worker

    import dsched
    from dsched.devices import UNLIMITED_CAPACITY

    # NVML errors (no driver, no GPU) surface here; the caller reports them.
    cluster = stack.enter_context(LocalCUDACluster(host="127.0.0.1", dashboard_address=None))
    client = stack.enter_context(Client(cluster))
    dsched.register(client)  # GPU workers claim the GPU they are pinned to

    async def cpu_worker():
        # The CPU worker lives in this process; it owns the CPU through its resource.
        return await Worker(cluster.scheduler_address, name="cpu", nthreads=2,
                            resources={"dsched-cpu": UNLIMITED_CAPACITY}, host="127.0.0.1")

    worker = client.sync(cpu_worker)
    stack.callback(lambda: client.sync(worker.close))
    client.wait_for_workers(len(cluster.workers) + 1, timeout=60)
    owned = sorted(
        name for w in client.scheduler_info(n_workers=-1)["workers"].values() for name in w["resources"]
        if name.startswith("dsched-cuda")
    )
    gpus = [name[len("dsched-"):] for name in owned]
    return client, f"LocalCUDACluster ({', '.join(gpus)}) + a CPU worker", gpus


def start_emulated_cluster(stack):
    from distributed import Client

    import dsched

    cluster = stack.enter_context(dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, dashboard_address=None))
    client = stack.enter_context(Client(cluster))
    return client, f"{cluster!r}", ["cuda:0"]


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows this module's docstring as written and every option's default."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--points", type=int, default=400_000, help="material points to evaluate")
    parser.add_argument("--batch-sizes", type=int, nargs=2, default=[10_000, 100_000], metavar=("CPU", "GPU"),
                        help="sub-batch size of the CPU and of each GPU")
    parser.add_argument("--no-fallback", action="store_true",
                        help="exit 0 with a message when dask-cuda or a GPU is missing, instead of emulating")
    args = parser.parse_args(argv)

    import dask.array as da

    import dsched
    from dsched.models.j2 import loading_strain

    with contextlib.ExitStack() as stack:
        try:
            client, description, gpus = start_cuda_cluster(stack)
        except Exception as err:  # ImportError, NVML "library not found", no GPU visible...
            stack.close()
            reason = f"{type(err).__name__}: {err}".strip()
            if args.no_fallback:
                print(f"dask-cuda or a GPU is not available here ({reason}); nothing to run.")
                return 0
            print(f"dask-cuda or a GPU is not available here ({reason});\n"
                  "falling back to LocalHybridCluster(emulate=True): the GPU is EMULATED with NumPy on the CPU "
                  "(placement only, not GPU speed).")
            client, description, gpus = start_emulated_cluster(stack)
        print(description)

        scheduler = dsched.StaticHybridScheduler(
            ["cpu", *gpus], batch_sizes=[args.batch_sizes[0]] + [args.batch_sizes[1]] * len(gpus),
            priorities=[1] + [4] * len(gpus),
        )
        n = args.points
        index = da.arange(n, chunks=50_000)
        strain = index.map_blocks(loading_strain, new_axis=1, chunks=(index.chunks[0], (6,)), dtype=float)
        stress = dsched.map_blocks(
            j2_stress, strain, da.zeros((n, 6), chunks=(50_000, 6)), da.zeros((n, 1), chunks=(50_000, 1)),
            scheduler=scheduler, rechunk=True, dtype=float,
        )
        t0 = time.perf_counter()
        result = stress.compute()
        elapsed = time.perf_counter() - t0
        for device in scheduler.devices:
            items = sum(m for d, m in dsched.plan(n, scheduler) if d == device)
            print(f"{device}: {items} points planned")
        print(f"{n} points in {elapsed:.2f} s")

    reference = j2_stress(loading_strain(np.arange(n)), np.zeros((n, 6)), np.zeros(n))
    np.testing.assert_allclose(result, reference, rtol=1e-12, atol=1e-9)
    print("matches the whole-batch NumPy reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
