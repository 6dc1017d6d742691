"""MPI host application: every rank evaluates its own share of a batch on its own device.

The pattern of an MPI simulation code that calls a material model: rank r
owns a contiguous block of the material points, ``SimpleMPIScheduler`` gives
it one device of its node (the k-th rank of a node takes the k-th device),
and a ``WorkDispatcher`` in the rank's own process runs the block on that
device. Rank 0 gathers the blocks and checks them against a direct
evaluation::

    mpiexec -n 2 python examples/mpi_host_app.py --devices cuda:0,cuda:1
    mpiexec -n 2 python examples/mpi_host_app.py        # no GPU here: cuda:0 is emulated, and marked so

``--mode async`` (the default) starts a one-device Dask cluster inside each
rank (workers in-process; a real GPU gets its pinned worker process);
``--mode sync`` runs every chunk on the rank's own thread. Emulated devices
compute with NumPy on the CPU and are marked so; their timings are not GPU
measurements.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows this module's docstring as written and every option's default."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    parser.add_argument("--devices", default="cpu,cuda:0", help="devices of each node, in the order local ranks take them")
    parser.add_argument("--batch-sizes", default="1000", help="per-device batch sizes (one, or one per device)")
    parser.add_argument("--points", type=int, default=40_000, help="material points over all ranks")
    parser.add_argument("--mode", choices=("async", "sync"), default="async",
                        help="async: a one-device Dask cluster in each rank; sync: chunks on the rank's own thread")
    parser.add_argument("--emulate", action="store_true", help="emulate CUDA devices this machine lacks")
    parser.add_argument("--allow-shared", action="store_true", help="more ranks than devices share them round-robin")
    args = parser.parse_args(argv)
    if args.emulate and args.mode == "sync":
        # An emulated device is a Dask worker claiming it; sync mode has no workers.
        parser.error("--emulate needs --mode async (emulated devices are Dask workers)")
    return args


def share(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous block ``[start, stop)`` of ``n`` points (sizes differ by at most one)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def main(argv=None) -> int:
    args = parse_args(argv)  # errors here happen on every rank alike
    from mpi4py import MPI

    try:
        return run_rank(args, MPI.COMM_WORLD)
    except BaseException:
        # One failed rank would leave the others waiting in gather() forever: end the whole job.
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def run_rank(args, comm) -> int:
    """This rank's share of the batch on its device; rank 0 gathers and checks everything."""

    from dsched import SimpleMPIScheduler, SliceGenerator, WorkDispatcher, concat_reduce, visible_gpus
    from dsched.models import j2_chunk

    rank, size = comm.Get_rank(), comm.Get_size()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    scheduler = SimpleMPIScheduler(args.devices.split(","), batch_sizes, comm=comm, allow_shared=args.allow_shared)
    start, stop = share(args.points, rank, size)

    # An emulated device is a CUDA device this node lacks, run with NumPy on the CPU. In async mode this
    # example emulates one by itself, so that it runs anywhere; its table says which ranks did.
    emulated = scheduler.device.is_cuda and scheduler.device.ordinal not in [d.ordinal for d in visible_gpus()]
    cluster_options = {"emulate": args.emulate or (emulated and args.mode == "async"), "dashboard_address": None}
    t0 = time.perf_counter()
    with WorkDispatcher(scheduler, j2_chunk, reduce=concat_reduce, mode=args.mode,
                        cluster_options=cluster_options) as dispatcher:
        block = dispatcher.run(SliceGenerator(start, stop)) if stop > start else None
    seconds = time.perf_counter() - t0

    row = (rank, scheduler.host, scheduler.local_rank, str(scheduler.device), emulated, start, stop, seconds)
    rows = comm.gather(row, root=0)
    blocks = comm.gather(block, root=0)
    if rank != 0:
        return 0
    print("rank  host  local  device   points           seconds")
    for r, host, local, device, emu, a, b, s in rows:
        flag = "  (emulated)" if emu else ""
        print(f"{r:4}  {host}  {local:5}  {device:7}  [{a}, {b})  {s:8.3f}{flag}")
    result = {key: np.concatenate([b[key] for b in blocks if b is not None]) for key in blocks[0]}
    reference = j2_chunk(slice(0, args.points))
    for key, value in reference.items():
        np.testing.assert_allclose(result[key], value, rtol=1e-12, atol=0, err_msg=key)
    print(f"rank 0 gathered {args.points} points from {size} ranks: result matches the direct evaluation", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
