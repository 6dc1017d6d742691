"""A dask-mpi job: every worker rank owns one device of its node; the client dispatches over all of them.

Run it with at least 3 ranks (rank 0 the Dask scheduler, rank 1 this script's
client, ranks >= 2 one device worker each)::

    mpiexec -n 5 python examples/dask_mpi_job.py --devices cpu,cuda:0,cuda:1
    mpiexec -n 4 python examples/dask_mpi_job.py --devices cpu,cuda:0 --emulate   # no GPU here

The client evaluates J2 plasticity over ``--points`` material points with a
StaticHybridScheduler over the devices the workers own, checks the result
against a direct evaluation, prints where the chunks ran, and leaves; the
cluster then shuts down with it. Emulated devices compute with NumPy on the
CPU: the table says so, and their numbers are not GPU measurements.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows this module's docstring as written and every option's default."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--devices", default="cpu,cuda:0", help="devices of each node, in the order worker ranks take them")
    parser.add_argument("--emulate", action="store_true", help="emulate CUDA devices this machine lacks")
    parser.add_argument("--points", type=int, default=20_000, help="material points to evaluate")
    parser.add_argument("--cpu-batch", type=int, default=500, help="batch size of the CPU")
    parser.add_argument("--gpu-batch", type=int, default=2000, help="batch size of each GPU")
    parser.add_argument("--interface", default="lo", help="network interface (lo; ib0 across nodes)")
    parser.add_argument("--no-dashboard", action="store_true", help="start the cluster without its dashboard")
    return parser.parse_args(argv)


def run_client(args) -> int:
    from distributed import Client

    from dsched import SliceGenerator, StaticHybridScheduler, WorkDispatcher, dispatch
    from dsched.models import j2_chunk, j2_update, loading_strain
    from dsched.dataplane.store import classify_workers
    from dsched.mpi import cluster_layout, format_layout

    with Client() as client:  # dsched.mpi.initialize pointed the default client at rank 0
        layout = cluster_layout(client)
        print(f"client sees {len(layout)} device workers:\n{format_layout(layout)}", flush=True)
        # One scheduler device per device name; with several nodes each name has several
        # workers, and the capacity below is per name (see docs/mpi.md).
        devices = list(dict.fromkeys(p.device for p in layout))
        emulated = {p.device for p in layout if p.emulated}
        batch_sizes = [args.gpu_batch if d.startswith("cuda") else args.cpu_batch for d in devices]
        # Two chunks in flight per worker (one computes while the other's data moves),
        # times the number of nodes whose worker owns that device name.
        owners = {d: sum(p.device == d for p in layout) for d in devices}
        capacities = [2 * b * owners[d] for b, d in zip(batch_sizes, devices)]
        priorities = [2 if d.startswith("cuda") else 1 for d in devices]  # GPUs first, the CPU takes the rest
        scheduler = StaticHybridScheduler(devices, batch_sizes, capacities, priorities)
        # Outputs written in place by the workers (shared memory on this node, sent back from others).
        dispatcher = WorkDispatcher(scheduler, j2_chunk, join="concat", client=client)
        result = dispatcher.run(SliceGenerator(0, args.points))
        reference = j2_chunk(slice(0, args.points))
        for key, value in reference.items():
            np.testing.assert_allclose(result[key], value, rtol=1e-12, atol=0, err_msg=key)
        print(f"J2 over {args.points} points: result matches the direct evaluation", flush=True)
        # Inputs by reference: ranks on this node map the client's shared-memory copy of the batch.
        strain, state = loading_strain(np.arange(args.points)), np.zeros((args.points, 6))
        stress = dispatch(lambda e, p: j2_update(e, p, np.zeros(len(e)))["stress"], strain, state,
                          scheduler=scheduler, client=client)
        np.testing.assert_allclose(stress, reference["stress"], rtol=1e-12, atol=0)
        kinds = classify_workers(client, list(client.scheduler_info(n_workers=-1)["workers"]))
        print(f"dispatch with inputs by reference matches; workers: {sorted(set(kinds.values()))}", flush=True)
        print(f"{'device@host':<24}  chunks  items   worker", flush=True)
        for device, row in dispatcher.last_run.by_device().items():
            flag = " (emulated)" if str(device.device) in emulated else ""  # rows are per device and host
            print(f"{str(device):<24}  {row['chunks']:6}  {row['items']:6}  {row['worker']}{flag}", flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import dsched.mpi

    is_client = dsched.mpi.initialize(
        devices=args.devices.split(","),
        emulate=args.emulate,
        interface=args.interface,
        dashboard_address=None if args.no_dashboard else ":8787",
    )
    if not is_client:  # only reached with exit=False; the default ends other ranks inside initialize
        return 0
    return run_client(args)


if __name__ == "__main__":
    sys.exit(main())
