"""Several clients share one set of device workers; each device's capacity holds across all of them.

A worker owns its device through the resource ``dsched-<device>``, whose
amount is the device's capacity in items, and every chunk requests as much of
it as it has items. So however many clients (processes, MPI ranks, notebooks)
dispatch to the same workers at once, the items executing on a device never
exceed its capacity; each client's own scheduler only bounds what *it* keeps
in flight.

Run the demonstration (a cluster, three client processes, then the peak of
items executing on each device computed from every chunk's start and stop)::

    python examples/shared_devices.py                   # CPU + cuda:0 (emulated without a GPU)
    python examples/shared_devices.py --clients 4 --capacities cpu=4,cuda:0=8

or start the clients yourself against any dsched cluster::

    python examples/shared_devices.py client --scheduler tcp://127.0.0.1:8786 --first 0 --points 2000
    python examples/shared_devices.py client --scheduler-file sf.json --first 2000 --points 2000

``--chunk-seconds`` makes every chunk last at least that long, so chunks of
different clients overlap visibly. ``--start-on EVENT`` holds a client, once
connected, until the cluster's Dask event ``EVENT`` is set
(``distributed.Event(EVENT).set()``), so that several start their runs
together. Emulated devices compute with NumPy on the CPU: they test placement
and capacity, not GPU speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def slow_j2(work, device, seconds=0.0):
    """J2 plasticity on the points ``work`` (a slice), lasting at least ``seconds``."""
    from dsched.models import j2_chunk

    t0 = time.perf_counter()
    result = j2_chunk(work, device)
    time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
    return result


def peak_items_in_flight(records) -> dict:
    """``{worker: largest number of items executing on it at one instant}`` from chunk records.

    A chunk executes over ``[start, stop)``; at equal times a stop is counted
    before a start, since the worker frees a chunk's share of the device
    before the next chunk takes it.
    """
    events = {}
    for r in records:
        events.setdefault(r["worker"], []).extend([(r["start"], 1, r["size"]), (r["stop"], 0, -r["size"])])
    peaks = {}
    for worker, points in events.items():
        level = peak = 0
        for _, _, delta in sorted(points):
            level += delta
            peak = max(peak, level)
        peaks[worker] = peak
    return peaks


# --- one client ------------------------------------------------------------------

def run_client(args) -> int:
    """Dispatch points ``[first, first + points)`` and save the result and chunk records."""
    from functools import partial

    from distributed import Client

    from dsched import SliceGenerator, StaticHybridScheduler, WorkDispatcher, concat_reduce

    devices = args.devices.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    capacities = [int(c) for c in args.client_capacities.split(",")]
    priorities = [2 if d.startswith("cuda") else 1 for d in devices]
    connect = {"scheduler_file": args.scheduler_file} if args.scheduler_file else {"address": args.scheduler}
    with Client(**connect) as client:
        scheduler = StaticHybridScheduler(devices, batch_sizes, capacities, priorities)
        done = []
        if args.start_on:
            from distributed import Event

            print(f"waiting for {args.start_on}", flush=True)
            if not Event(args.start_on, client=client).wait(timeout=120):
                raise SystemExit(f"--start-on: event {args.start_on!r} was not set within 120 s")

        def progress(record):
            done.append(record)
            if len(done) == 1:
                print("first chunk done", flush=True)  # lets a supervisor act mid-run

        dispatcher = WorkDispatcher(scheduler, partial(slow_j2, seconds=args.chunk_seconds), reduce=concat_reduce,
                                    client=client, on_chunk_done=progress)
        result = dispatcher.run(SliceGenerator(args.first, args.first + args.points))
        records = [
            {"index": r.index, "device": str(r.device), "size": r.size, "worker": r.worker, "start": r.start, "stop": r.stop}
            for r in dispatcher.last_run.records
        ]
    if args.out:
        np.savez(args.out + ".npz", **result)
        with open(args.out + ".json", "w") as f:
            json.dump({"first": args.first, "points": args.points, "records": records}, f)
    print(f"client [{args.first}, {args.first + args.points}): {len(records)} chunks", flush=True)
    return 0


def client_command(scheduler, first, points, out=None, *, chunk_seconds=0.02, devices="cpu,cuda:0",
                   batch_sizes="2,4", client_capacities="8,16") -> list[str]:
    """The command line that runs one client of this example against ``scheduler``."""
    command = [sys.executable, os.path.abspath(__file__), "client", "--scheduler", scheduler,
               "--first", str(first), "--points", str(points), "--chunk-seconds", str(chunk_seconds),
               "--devices", devices, "--batch-sizes", batch_sizes, "--client-capacities", client_capacities]
    return command + (["--out", out] if out else [])


# --- the demonstration -----------------------------------------------------------

def run_demo(args) -> int:
    import tempfile

    from distributed import Client

    from dsched import LocalHybridCluster, visible_gpus
    from dsched.models import j2_chunk
    from dsched.mpi import cluster_layout, format_layout

    devices = args.devices.split(",")
    capacities = {k: int(v) for k, v in (p.split("=") for p in args.capacities.split(","))}
    emulate = any(d.startswith("cuda") for d in devices) and not visible_gpus()
    # tcp, not inproc: the clients are other processes.
    with LocalHybridCluster(devices, emulate=emulate, capacities=capacities, threads_per_worker=4,
                            protocol="tcp://", dashboard_address=None) as cluster, Client(cluster) as client, \
            tempfile.TemporaryDirectory() as tmp:
        layout = cluster_layout(client)
        print(format_layout(layout), flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")])))
        outs = [os.path.join(tmp, f"client{i}") for i in range(args.clients)]
        procs = [
            subprocess.Popen(client_command(cluster.scheduler_address, i * args.points, args.points, outs[i],
                                            chunk_seconds=args.chunk_seconds, devices=args.devices), env=env)
            for i in range(args.clients)
        ]
        for proc in procs:
            if proc.wait(timeout=300) != 0:
                raise SystemExit(f"a client failed with exit status {proc.returncode}")
        records = []
        for i, out in enumerate(outs):
            with open(out + ".json") as f:
                records.extend(json.load(f)["records"])
            with np.load(out + ".npz") as got:
                want = j2_chunk(slice(i * args.points, (i + 1) * args.points))
                assert all(np.allclose(got[k], want[k], rtol=1e-12, atol=0) for k in want), f"client {i} is wrong"
        print(f"{args.clients} clients: every result matches its direct evaluation")
        device_of = {r["worker"]: r["device"] for r in records}
        worker_capacity = {p.device: p.capacity for p in layout}
        emulated = {p.device for p in layout if p.emulated}
        print("device   worker capacity  peak items executing (all clients)")
        for worker, peak in sorted(peak_items_in_flight(records).items(), key=lambda kv: device_of[kv[0]]):
            device = device_of[worker]
            flag = "  (emulated)" if device in emulated else ""
            print(f"{device:7}  {worker_capacity[device]:17}  {peak}{flag}")
    return 0


def _repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows this module's docstring as written and every option's default."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    sub = parser.add_subparsers(dest="command")
    demo = parser
    demo.add_argument("--clients", type=int, default=3, help="client processes to start")
    demo.add_argument("--points", type=int, default=400,
                      help="points per client; each chunk holds 2 or 4 points and lasts --chunk-seconds, so the "
                           "run's time grows with points per client")
    demo.add_argument("--capacities", default="cpu=4,cuda:0=8",
                      help="items each device may execute at once, all clients together")
    demo.add_argument("--devices", default="cpu,cuda:0", help="the cluster's devices (CUDA ones emulated without a GPU)")
    demo.add_argument("--chunk-seconds", type=float, default=0.02,
                      help="every chunk lasts at least this long, so chunks of different clients overlap")
    client = sub.add_parser("client", help="run one client against a running cluster", formatter_class=_Help,
                            description="Run one client against a running dsched cluster: dispatch points "
                                        "[first, first + points) and print how many chunks it sent.")
    where = client.add_mutually_exclusive_group(required=True)
    where.add_argument("--scheduler", help="scheduler address")
    where.add_argument("--scheduler-file", help="scheduler file (python -m dsched.mpi writes one)")
    client.add_argument("--first", type=int, default=0, help="first point index")
    client.add_argument("--points", type=int, default=400, help="points to dispatch")
    client.add_argument("--devices", default="cpu,cuda:0", help="devices this client's scheduler uses")
    client.add_argument("--batch-sizes", default="2,4", help="sub-batch size per device")
    client.add_argument("--client-capacities", default="8,16", help="items this client keeps in flight per device")
    client.add_argument("--chunk-seconds", type=float, default=0.02, help="every chunk lasts at least this long")
    client.add_argument("--out", help="save the result to OUT.npz and the chunk records to OUT.json")
    client.add_argument("--start-on", metavar="EVENT",
                        help="wait for the cluster's Dask event EVENT before dispatching (a supervisor starts "
                             "several clients at once by setting it)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_client(args) if args.command == "client" else run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
