"""The ``dsched`` command: run workload graphs (and tune and benchmark them)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from dsched.apps.bench.batch import format_load_steps, run_batch_benchmarks
from dsched.apps.bench.data import format_data_table, run_data_benchmarks
from dsched.apps.bench.figures import machine_info
from dsched.apps.bench.neml2 import add_arguments as add_neml2_arguments
from dsched.apps.bench.neml2 import format_neml2_table, run_neml2_benchmarks
from dsched.apps.bench.neml2 import options as neml2_options
from dsched.apps.bench.policy import format_policy_table, run_policy_benchmarks
from dsched.apps.bench.scheduling import format_table, run_benchmarks
from dsched.apps.job import format_report, graph_cluster, run_graph
from dsched.apps.jobfile import GraphError, load_graph
from dsched.apps.tune import format_tuning, run_tuning
from dsched.cluster.logs import apply_log_level
from dsched.dataplane.outputs import check_out_path
from dsched.devices.cuda import visible_gpus
from dsched.devices.device import parse_devices
from dsched.devices.ownership import emulated_devices
from dsched.errors import DispatchError
from dsched.observe import dashboard
from dsched.observe.dashboard.client import flush_page

__all__ = ["main"]

DEFAULT_DASHBOARD = "127.0.0.1:8787"  # `dsched run --dashboard`: loopback unless an address is given
DEFAULT_CONNECT_TIMEOUT = 30.0  # seconds to wait for a scheduler file to appear, then for the scheduler to answer


class UsageError(ValueError):
    """A user's mistake found by the command line: one line, exit status 2."""


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
    run.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT, metavar="SECONDS",
                     help="how long to wait for the scheduler file to appear and the scheduler to answer (default 30)")
    run.add_argument("--emulate", action="store_true", help="emulate CUDA devices that are not present (testing only)")
    run.add_argument("-v", "--verbose", action="count", default=0,
                     help="show Dask's logs (-v: INFO, -vv: DEBUG); quiet by default")
    run.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    run.add_argument("--trace-file", help="write a Chrome trace of the run (open it in Perfetto); overrides the graph's")
    run.add_argument("--performance-report", help="write Dask's performance report (HTML); overrides the graph's")
    run.add_argument("--input", metavar="STORE.zarr",
                     help="read the model's inputs from this Zarr store (its length is the batch size); workers "
                          "read each chunk's rows from it")
    run.add_argument("--output", metavar="STORE.zarr",
                     help="keep the outputs: workers write them to this new Zarr store (on disk, beyond memory)")
    run.add_argument("--overwrite", action="store_true", help="replace an existing --output store")
    run.add_argument("--chunk-timeout", type=float, metavar="SECONDS",
                     help="fail a chunk (recoverably) that runs longer than this; overrides the graph's")
    run.add_argument("--dashboard", nargs="?", const=DEFAULT_DASHBOARD, metavar="HOST:PORT",
                     help=f"serve the Dask dashboard (default {DEFAULT_DASHBOARD}, loopback) and print the link to "
                          "its dsched page; on --scheduler-address/--scheduler-file, print that cluster's link")
    run.add_argument("--dashboard-linger", type=float, metavar="SECONDS",
                     help="with --dashboard, keep serving the page this long after the run (default: until Ctrl-C "
                          "at a terminal, not at all otherwise)")
    run.set_defaults(handler=_run)


def _run(args) -> int:
    import contextlib

    graph = load_graph(args.graph)  # GraphError → status 2 in main, before any cluster starts
    if args.emulate:
        graph.options["emulate"] = True
    if args.output:
        try:
            check_out_path(args.output, args.overwrite, "--output")
        except ValueError as err:
            raise UsageError(str(err)) from None
    if args.chunk_timeout is not None and not args.chunk_timeout > 0:
        raise UsageError(f"--chunk-timeout: must be a positive number of seconds, got {args.chunk_timeout:g}")
    for option in ("trace_file", "performance_report", "input", "output", "overwrite", "chunk_timeout"):
        if getattr(args, option, None):
            graph.options[option] = getattr(args, option)
    graph.input_loader()  # a bad store is refused here; its length becomes batch.size
    _set_verbosity(args.verbose)
    remote = bool(args.scheduler_address or args.scheduler_file)
    if remote and graph.mode == "sync":
        field = "--scheduler-file" if args.scheduler_file else "--scheduler-address"
        raise UsageError(f"{field}: options.mode is 'sync' in {graph.source}: every chunk runs on this thread, not on "
                         "a cluster; drop the option or set mode = 'async'")
    dashboard = _dashboard_option(args.dashboard, graph)
    if not remote:  # devices of this machine; a remote cluster's are checked once connected
        graph.check_devices_present()
    graph.check_memory()  # run_graph checks too; here before any dashboard cluster starts
    client = None
    with contextlib.ExitStack() as stack:
        if remote and graph.mode == "async":
            client = _connect(args.scheduler_address, args.scheduler_file, args.connect_timeout)
            stack.callback(client.close)
            _check_cluster_devices(client, graph, "--scheduler-file" if args.scheduler_file else "--scheduler-address")
        elif dashboard is not None and graph.mode == "async":
            client = graph_cluster(stack, graph, dashboard_address=dashboard)
        if dashboard is not None and client is not None:
            _show_dashboard(stack, client, graph)
        result = run_graph(graph, client=client, progress=not args.no_progress)
        if dashboard is not None and client is not None:
            flush_page(client)  # the page counts the whole run before the report says it is over
        print(f"graph: {graph.source}  model: {graph.model}  batch: {graph.batch_size:,}")
        print(format_report(result), flush=True)
        if dashboard is not None and client is not None and not remote:
            _linger(args.dashboard_linger)  # the cluster (and its page) closes when this block does
    return 0


def _linger(seconds):
    """Keep the dashboard of a cluster ``dsched run`` started serving: ``seconds``, or until Ctrl-C.

    By default, until Ctrl-C where a person is at the terminal, not at all otherwise (a script, a test).
    """
    import time

    if seconds is None:
        seconds = float("inf") if sys.stdin.isatty() else 0.0
    if seconds <= 0:
        return
    until = "Ctrl-C" if seconds == float("inf") else f"{seconds:g} s or Ctrl-C"
    print(f"dashboard: the run is over; the page keeps serving until {until}", flush=True)
    try:
        time.sleep(seconds if seconds != float("inf") else 10**9)
    except KeyboardInterrupt:
        pass


def _dashboard_option(value, graph) -> str | None:
    """The dashboard address of ``--dashboard`` or ``options.dashboard``; None for none; UsageError if unusable."""
    if value is None and graph.options.get("dashboard", False):
        value = DEFAULT_DASHBOARD
    if value is None:
        return None
    if graph.mode == "sync":
        raise UsageError("--dashboard: a sync run (options.mode = 'sync') starts no cluster, so it has no dashboard")
    host, _, port = str(value).rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--dashboard: expected HOST:PORT such as {DEFAULT_DASHBOARD}, got {value!r}")
    return value


def _show_dashboard(stack, client, graph):
    """Print the link to the dsched page, and tell the page the run's total (for its progress and ETA)."""
    link = dashboard.dashboard_link(client)
    if link is None:
        print("dashboard: the cluster serves no dashboard", flush=True)
        return
    print(f"dashboard: {link} (open it while the run goes on; a cluster dsched run started serves it after the "
          "run until Ctrl-C, or --dashboard-linger SECONDS)",
          flush=True)
    stack.enter_context(dashboard.track_run(client, graph.batch_size, name=f"{graph.model} ({graph.source})"))


def _set_verbosity(verbose: int) -> None:
    """Dask's logs: WARNING and above by default, INFO with -v, DEBUG with -vv (here and in worker processes)."""
    import dask

    level = ("warning", "info", "debug")[min(verbose, 2)]
    dask.config.set({"dsched.log-level": level})
    apply_log_level(level)


def _connect(address, scheduler_file, timeout):
    """A client of the cluster at ``address`` or in ``scheduler_file``; UsageError naming the option otherwise."""
    from distributed import Client

    field = "--scheduler-file" if scheduler_file else "--scheduler-address"
    if timeout <= 0:
        raise UsageError(f"--connect-timeout: must be > 0 seconds, got {timeout:g}")
    if scheduler_file:
        address = _read_scheduler_file(scheduler_file, timeout)
    _check_address(field, address)
    if address.startswith("tls://"):
        import dask

        if not dask.config.get("distributed.comm.tls.ca-file", None):
            raise UsageError(f"{field}: the scheduler at {address} requires TLS; set Dask's TLS config "
                             "(distributed.comm.tls.ca-file, .client.cert, .client.key, e.g. "
                             "DASK_DISTRIBUTED__COMM__TLS__CA_FILE)")
    try:
        return Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError) as err:
        raise UsageError(f"{field}: no Dask scheduler answered at {address} within {timeout:g} s ({_first_line(err)})") from None
    except (ValueError, TypeError) as err:
        raise UsageError(f"{field}: {address!r} is not a usable scheduler address: {_first_line(err)}") from None


def _read_scheduler_file(path, timeout) -> str:
    """The address in a Dask scheduler file, waiting at most ``timeout`` seconds for the file to appear."""
    if not os.path.exists(path):
        print(f"dsched: waiting up to {timeout:g} s for the scheduler file {path} (written by the cluster once its "
              "workers have joined, e.g. by python -m dsched.mpi)", file=sys.stderr, flush=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise UsageError(f"--scheduler-file: {path} did not appear within {timeout:g} s; start the cluster "
                                 "first, or wait longer with --connect-timeout")
            time.sleep(0.1)  # polling a path: there is nothing to wait on
    try:
        with open(path) as f:
            address = json.load(f)["address"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"--scheduler-file: {path} is not a Dask scheduler file ({_first_line(err)})") from None
    return address


def _check_address(field, address) -> None:
    """A malformed address fails here, naming it, rather than deep inside Dask."""
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import get_backend

    try:
        scheme, location = parse_address(address)
        get_backend(scheme)
        if scheme in ("tcp", "tls"):
            parse_host_port(location)
    except (ValueError, TypeError) as err:
        raise UsageError(f"{field}: {address!r} is not a Dask scheduler address ({_first_line(err)}); "
                         "expected e.g. tcp://10.0.0.1:8786") from None


def _check_cluster_devices(client, graph, field) -> None:
    """The graph's devices must each have a dsched worker on the cluster (else the run would wait for one)."""
    owned = emulated_devices(client)
    if not owned:
        raise UsageError(
            f"{field}: the cluster at {client.scheduler.address} has no dsched device workers (workers own a device "
            "through a dsched-<device> resource: start them with python -m dsched.mpi, LocalHybridCluster, or "
            "dask worker --preload plugins/dsched_worker.py)"
        )
    wanted = graph.devices(present=list(owned))
    absent = [str(d) for d in wanted if d not in owned and not (d.index is None and any(o.is_cuda for o in owned))]
    if absent:
        raise GraphError(
            f"{graph._devices_field}: {', '.join(absent)} has no worker on the cluster at {client.scheduler.address} "
            f"(its devices: {', '.join(str(d) for d in sorted(owned, key=lambda d: (d.is_cuda, d.ordinal or 0)))}) "
            f"in {graph.source}"
        )


def _first_line(err) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


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
    tune.add_argument("--scheduler-address", help="measure on the workers of the Dask cluster at this address")
    tune.add_argument("--scheduler-file", help="measure on the workers of the Dask cluster in this scheduler file")
    tune.add_argument("--connect-timeout", type=float, default=30.0,
                      help="seconds to wait for the cluster (and its scheduler file), default 30")
    tune.set_defaults(handler=_tune)


def _tune(args) -> int:
    graph = load_graph(args.graph)
    devices = args.devices.split(",") if args.devices else None
    if args.emulate:
        graph.options["emulate"] = True
    client = None
    if args.scheduler_address or args.scheduler_file:  # measure on the cluster's workers, where they run
        field = "--scheduler-file" if args.scheduler_file else "--scheduler-address"
        if args.scheduler_address and args.scheduler_file:
            raise UsageError(f"--scheduler-address: {args.scheduler_address!r} and --scheduler-file: "
                             f"{args.scheduler_file!r} are both set; give one")
        if args.mode == "sync":
            raise UsageError(f"--mode: sync times chunks here, not on the cluster of {field}; use --mode async")
        client = _connect(args.scheduler_address, args.scheduler_file, args.connect_timeout)
        if devices is None:
            try:
                _check_cluster_devices(client, graph, field)
            except ValueError:
                client.close()
                raise
            devices = [str(d) for d in graph.devices(present=list(emulated_devices(client)))]
    elif devices is None:
        graph.check_devices_present()
    elif not graph.emulate:
        _check_listed_devices_present(devices)
    try:
        result = run_tuning(
            graph, devices, client=client, emulate=args.emulate or graph.emulate, mode=args.mode, start=args.start,
            max_batch=args.max_batch, max_time=args.max_time, min_time=args.min_time, png_path=args.png,
            profile_dir=args.profile_dir, save=not args.no_save,
            on_point=lambda device, p: print(f"{device}: N={p.batch_size:<9} t={p.seconds * 1e3:9.3f} ms  "
                                             f"{p.items_per_s:14,.0f} items/s", flush=True),
        )
    except ValueError as err:  # every option is checked before a cluster starts
        print(f"dsched: error: {err}", file=sys.stderr)
        return 2
    finally:
        if client is not None:
            client.close()
    print(format_tuning(result))
    return 0


def _check_listed_devices_present(names) -> None:
    """``--devices``: a GPU this machine lacks, without --emulate, is a UsageError naming it."""
    try:
        devices = parse_devices(names, field="--devices")
    except ValueError as err:
        raise UsageError(str(err).replace("--devices: device: ", "--devices: ", 1)) from None
    present = visible_gpus()
    for device in devices:
        if device.is_cuda and device not in present and not (device.index is None and present):
            raise UsageError(f"--devices: {device} is not present on this machine (visible GPUs: "
                             f"{', '.join(map(str, present)) or 'none'}); pass --emulate to emulate it, for testing only")


def _add_bench(subparsers):
    bench = subparsers.add_parser(
        "bench",
        help="benchmark scheduling (emulated devices) and the data plane (J2 on real arrays) against their peers",
        description=(
            "Eight suites, each measured against its peers in the same run (targets are information: set on a 2-core reference machine, not pass or fail on yours). 'percall': the cost of one call of a no-op "
            "(dispatch, a WorkDispatcher kept across calls, a Batch step) against plain Dask, Ray where installed, "
            "and a Pipe round trip to two bare processes, the limit. 'scheduling': emulated devices of known "
            "speed (each serial, sleeping t0 + n/rate per chunk): hybrid efficiency of StaticHybridScheduler "
            "against plain client.map and a thread-per-device loop, and dispatch overhead per chunk (sync, async) "
            "against client.map per task; sleeping emulates the devices, so this measures scheduling, not a GPU. "
            "'data': the J2 update with its tangent on real arrays, dsched.dispatch on two worker processes and "
            "dsched run in-process against one NumPy call and a thread pool, scheduler bytes per chunk, the "
            "client's peak memory, and dsched run --output of a large batch. 'policy': the performance-model "
            "policy against StaticHybridScheduler and plain Dask (emulated devices). 'batch': J2 load steps on a "
            "resident batch against re-dispatching every step and NumPy. 'neml2': four of NEML2's benchmark "
            "scenarios (elasticity, radret, isoharden, chaboche2) through NEML2Model.dispatch, a resident Batch and "
            "a TransientDriver, against NEML2's own driver on 1 and 2 threads and the two-worker limit (needs the "
            "neml2 extra). 'gpu': dsched on a real cuda:0 against CuPy and torch on the same GPU (J2 and NEML2's radret "
            "against one call on the whole batch, host-GPU-host bandwidth, cpu + cuda:0 against the GPU alone, the "
            "cost of a call); skipped without CuPy and a GPU. Prints tables; --json writes the numbers."
        ),
    )
    bench.add_argument("--quick", action="store_true", help="small sizes (a minute or two)")
    bench.add_argument("--only", choices=SUITES, help="run one suite (default: all; gpu is skipped without a GPU)")
    bench.add_argument("--json", help="write the results to this JSON file")
    bench.add_argument("--processes", action="store_true", help="scheduling suite: device workers in processes")
    add_neml2_arguments(bench)
    bench.set_defaults(handler=_bench)


SUITES = ("percall", "scheduling", "data", "policy", "batch", "neml2", "fe", "gpu")


def _bench(args) -> int:
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        print(f"dsched: error: --json: the folder of {args.json} does not exist", file=sys.stderr)
        return 2
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    command = _bench_command(args)
    results, tables, failed = {"command": command, "machine": machine_info()}, [], []
    for suite in SUITES:
        if args.only in (None, suite):
            results[suite], table = _bench_suite(suite, args, say)
            if not {"skipped", "failed"} & set(results[suite]):  # measured: the command that reruns it alone
                results[suite]["bench_command"] = _bench_command(args, only=suite)
            tables.append(f"$ {command}  [{suite}]\n{table}")
            if "failed" in results[suite]:
                failed.append(suite)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print("\n\n".join(tables))
    machine = results["machine"]
    print(f"\nmachine: {machine['cpus']} cores ({machine['cpu']}), {machine['memory_gib']} GiB, "
          f"{machine['gpus'] or 'no GPU (CUDA devices emulated)'}, /dev/shm huge={machine['shm_huge_pages']}, "
          f"load {machine['load_average']} at the start. "
          "Targets are information: they were set on a 2-core machine at full sizes; --quick sizes, other "
          "machines and a busy machine read differently.")
    if failed:
        print(f"dsched: error: bench: the {', '.join(failed)} suite(s) failed (above); the others' tables are "
              "complete", file=sys.stderr)
    return 1 if failed else 0


def _bench_command(args, only=None) -> str:
    """The ``dsched bench`` command line that ``args`` stand for (recorded with the results); with ``only``, the
    one that runs that suite alone."""
    only = only or args.only
    return " ".join(["dsched bench", *(["--quick"] if args.quick else []),
                     *([f"--only {only}"] if only else []), *(["--processes"] if args.processes else []),
                     *(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                       if k.startswith("neml2_") and v is not None and not (k == "neml2_steps" and v == 10)
                       and only in (None, "neml2"))])


#: the extra that brings a module a suite may need (zarr is a core dependency)
_EXTRA_OF = {"neml2": "neml2", "torch": "neml2", "cupy": "cuda12", "dask_cuda": "cuda12", "mpi4py": "mpi",
             "prometheus_client": "prometheus"}


def _bench_suite(suite, args, say):
    """One suite's ``(results, table)``. A suite whose optional dependency is missing is skipped, and one that
    fails is one line: either way the other suites still run and print (``dsched bench`` ends in no traceback)."""
    try:
        return _BENCH_SUITES[suite](args, say)
    except UsageError:
        raise
    except ModuleNotFoundError as err:
        name = (err.name or "a module").partition(".")[0]
        extra = _EXTRA_OF.get(name)
        how = f"pip install 'dsched[{extra}]'" if extra else f"pip install {name}"
        reason = f"{name} is not installed ({how})"
        say(f"{suite}: skipped: {reason}")
        return {"skipped": reason}, f"{suite} suite skipped: {reason}"
    except Exception as err:  # noqa: BLE001  a failed suite must not throw away the tables measured before it
        reason = f"{type(err).__name__}: {err}".splitlines()[0]
        say(f"{suite}: failed: {reason}")
        return {"failed": reason}, f"{suite} suite failed: {reason}"


def _bench_scheduling(args, say):
    results = run_benchmarks(None, quick=args.quick, processes=args.processes, progress=say)
    return results, format_table(results)


def _bench_data(args, say):
    results = run_data_benchmarks(quick=args.quick, progress=say)
    return results, format_data_table(results)


def _bench_policy(args, say):
    results = run_policy_benchmarks(None, quick=args.quick, processes=args.processes, progress=say)
    return results, format_policy_table(results)


def _bench_batch(args, say):
    results = run_batch_benchmarks(quick=args.quick, progress=say)
    return results, format_load_steps(results)


def _bench_neml2(args, say):
    import importlib.util

    if importlib.util.find_spec("neml2") is None:
        reason = "neml2 is not installed (pip install 'dsched[neml2]')"
        say(f"neml2: skipped: {reason}")
        return {"skipped": reason}, f"neml2 suite skipped: {reason}"
    try:
        options = neml2_options(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    results = run_neml2_benchmarks(**options, progress=say)
    return results, format_neml2_table(results)


def _bench_percall(args, say):
    from dsched.apps.bench.percall import format_percall, run_percall_benchmarks

    results = run_percall_benchmarks(quick=args.quick, say=say)
    return results, format_percall(results)


def _bench_gpu(args, say):
    from dsched.apps.bench.gpu import format_gpu_table, gpu_missing, run_gpu_benchmarks

    missing = gpu_missing()
    if missing:  # one line: the table's
        return {"skipped": missing}, f"gpu suite skipped: {missing}"
    checkpoint = None
    if args.json:  # what was measured is on disk after each section: a run cut off at its bound keeps it
        import json

        header = {"command": _bench_command(args), "machine": machine_info(), "partial": True}

        def checkpoint(so_far):
            with open(args.json, "w") as f:
                json.dump({**header, "gpu": so_far}, f, indent=2)

    results = run_gpu_benchmarks(quick=args.quick, progress=say, checkpoint=checkpoint)
    return results, format_gpu_table(results)


def _bench_fe(args, say):
    from dsched.apps.bench.fe import format_fe_table, run_fe_benchmarks, skip_reason

    reason = skip_reason()
    if reason is not None:
        say(f"fe: skipped: {reason}")
        return {"skipped": reason}, f"fe suite skipped: {reason}"
    results = run_fe_benchmarks(quick=args.quick, progress=say)
    return results, format_fe_table(results)


_BENCH_SUITES = {"percall": _bench_percall, "scheduling": _bench_scheduling, "data": _bench_data,
                 "policy": _bench_policy, "batch": _bench_batch, "neml2": _bench_neml2, "fe": _bench_fe,
                 "gpu": _bench_gpu}


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
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except (GraphError, UsageError) as err:
        print(f"dsched: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # 128 + SIGINT, as a shell reports a program Ctrl-C ended (2 is a usage error)
        print("dsched: interrupted (Ctrl-C): the run was cancelled", file=sys.stderr, flush=True)
        return 130
    except DispatchError as err:
        # A run that failed (a chunk over its time, results that do not match their chunk, errors the model
        # raised as RecoverableError): what failed, where, without a traceback; status 1, not a usage error.
        print(f"dsched: run failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
