"""The ``dsched`` command: run workload graphs (and tune and benchmark them)."""

from __future__ import annotations

import argparse
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
    run.set_defaults(handler=_run)


def _run(args) -> int:
    from .graph import load_graph
    from .job import format_report, run_graph

    graph = load_graph(args.graph)  # GraphError → status 2 in main, before any cluster starts
    if args.emulate:
        graph.options["emulate"] = True
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
