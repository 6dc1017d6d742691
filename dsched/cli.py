"""The ``dsched`` command: run workload graphs (and tune and benchmark them)."""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _add_run(subparsers):
    run = subparsers.add_parser(
        "run",
        help="run a workload graph (default: the J2 update of 1,000,000 points on every device present)",
        description=(
            "Run a workload graph (a TOML file: model, batch, devices, scheduler, options) and print a "
            "per-device table and the total throughput. Without GRAPH it runs the embedded default: the J2 "
            "plasticity update of 1,000,000 points over the CPU and every visible GPU. A malformed graph exits "
            "with status 2 before any cluster starts."
        ),
    )
    run.add_argument("graph", nargs="?", help="graph file (TOML); omit for the embedded default")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--scheduler-address", help="run on an existing Dask cluster at this address")
    where.add_argument("--scheduler-file", help="run on the Dask cluster described by this scheduler file (dask-mpi)")
    run.add_argument("--emulate", action="store_true", help="emulate CUDA devices that are not present (testing only)")
    run.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    run.add_argument("--trace-file", help="write a Chrome trace of the run (open it in Perfetto); overrides the graph's")
    run.add_argument("--performance-report", help="write Dask's performance report (HTML); overrides the graph's")
    run.set_defaults(handler=_run)


def _run(args) -> int:
    from .graph import load_graph
    from .job import format_report, run_graph

    graph = load_graph(args.graph)  # GraphError → status 2 in main, before any cluster starts
    if args.emulate:
        graph.options["emulate"] = True
    for option in ("trace_file", "performance_report"):
        if getattr(args, option, None):
            graph.options[option] = getattr(args, option)
    client = None
    if args.scheduler_address or args.scheduler_file:
        from distributed import Client

        client = Client(address=args.scheduler_address, scheduler_file=args.scheduler_file)
    try:
        result = run_graph(graph, client=client, progress=not args.no_progress)
    finally:
        if client is not None:
            client.close()
    print(f"graph: {graph.source}  model: {graph.model}  batch: {graph.batch_size:,}")
    print(format_report(result))
    return 0


def _add_tune(subparsers):
    tune = subparsers.add_parser(
        "tune",
        help="measure each device's sub-batch size and save a speed profile",
        description=(
            "Sweep each device's sub-batch size by doubling (a SimpleScheduler per device), fit NEML2's "
            "saturation model t(N) = t0 (<N - N*>/N* + 1), print the recommended batch size and capacity per "
            "device, save a profile for this host and model (used by plan() and the graph files) and draw "
            "throughput against sub-batch size."
        ),
    )
    tune.add_argument("graph", nargs="?", help="graph file (TOML) naming the model and devices; omit for the default")
    tune.add_argument("--devices", help="comma-separated devices (default: the graph's)")
    tune.add_argument("--emulate", action="store_true", help="emulate CUDA devices that are not present (testing only)")
    tune.add_argument("--mode", choices=["async", "sync"], default="async", help="time chunks on a cluster or here")
    tune.add_argument("--start", type=int, default=64, help="first sub-batch size (default 64)")
    tune.add_argument("--max-batch", type=int, default=2**22, help="largest sub-batch size (default 4194304)")
    tune.add_argument("--max-time", type=float, default=2.0, help="stop once a chunk takes this many seconds")
    tune.add_argument("--min-time", type=float, default=0.2, help="seconds of chunks to time per size (at least 3)")
    tune.add_argument("--png", default="dsched-tune.png", help="plot file (default dsched-tune.png)")
    tune.add_argument("--profile-dir", help="profile folder (default $DSCHED_PROFILE_DIR or ~/.cache/dsched/profiles)")
    tune.add_argument("--no-save", action="store_true", help="do not save the profile")
    tune.set_defaults(handler=_tune)


def _tune(args) -> int:
    from .graph import load_graph
    from .tuning import format_tuning, run_tuning

    graph = load_graph(args.graph)
    devices = args.devices.split(",") if args.devices else None
    try:
        result = run_tuning(
            graph, devices, emulate=args.emulate or graph.emulate, mode=args.mode, start=args.start,
            max_batch=args.max_batch, max_time=args.max_time, min_time=args.min_time, png_path=args.png,
            profile_dir=args.profile_dir, save=not args.no_save,
            on_point=lambda device, p: print(f"{device}: N={p.batch_size:<9} t={p.seconds * 1e3:9.3f} ms  "
                                             f"{p.items_per_s:14,.0f} items/s", flush=True),
        )
    except ValueError as err:  # every option is checked before a cluster starts
        print(f"dsched: error: {err}", file=sys.stderr)
        return 2
    print(format_tuning(result))
    return 0


def _add_bench(subparsers):
    bench = subparsers.add_parser(
        "bench",
        help="benchmark hybrid efficiency and dispatch overhead against plain Dask (emulated devices)",
        description=(
            "Emulated devices of known speed (each serial, sleeping t0 + n/rate per chunk): hybrid efficiency "
            "of StaticHybridScheduler against plain client.map and a thread-per-device loop, and dispatch "
            "overhead per chunk (sync, async) against client.map per task. Prints a table; --json writes "
            "the numbers. Sleeping emulates the devices: this measures scheduling, not a GPU."
        ),
    )
    bench.add_argument("--quick", action="store_true", help="small sizes (under a minute)")
    bench.add_argument("--json", help="write the results to this JSON file")
    bench.add_argument("--processes", action="store_true", help="device workers in their own processes")
    bench.set_defaults(handler=_bench)


def _bench(args) -> int:
    from .bench import format_table, run_benchmarks

    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        print(f"dsched: error: --json: the folder of {args.json} does not exist", file=sys.stderr)
        return 2
    results = run_benchmarks(None, quick=args.quick, processes=args.processes,
                             progress=lambda line: print(line, file=sys.stderr, flush=True))
    results["command"] = " ".join(["dsched bench", *(["--quick"] if args.quick else []),
                                   *(["--processes"] if args.processes else [])])
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print(format_table(results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsched",
        description=(
            "Spread one large batch of independent model evaluations over the CPU and CUDA GPUs of a "
            "workstation or a supercomputer, on Dask (NEML2's work schedulers and dispatcher)."
        ),
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_run(subparsers)
    _add_tune(subparsers)
    _add_bench(subparsers)
    return parser


def main(argv=None) -> int:
    from .graph import GraphError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except GraphError as err:
        print(f"dsched: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
