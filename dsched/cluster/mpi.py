"""A Dask cluster started by ``mpiexec`` in which every worker rank owns one device of its node.

Two ways to start one (both need mpi4py and dask-mpi: ``pip install dsched[mpi]``):

* in a script, with :func:`initialize` (dask-mpi's layout): rank 0 runs the
  Dask scheduler, rank 1 goes on with the script as the client, and every
  other rank is a device worker::

      mpiexec -n 4 python job.py          # job.py calls dsched.mpi.initialize(devices=...)

* from the command line, a cluster with no client in it, which clients join
  through the scheduler file (written once every worker has joined)::

      mpiexec -n 3 python -m dsched.mpi --devices cpu,cuda:0 --scheduler-file sf.json

Worker ranks are grouped by node (MPI's processor name, or
``$DSCHED_NODE_NAME``); the k-th worker rank of a node owns ``devices[k]`` of
that node (NEML2's MPI-exclusive placement), advertising the resource
``dsched-<device>`` with the device's capacity in items. A node with more
worker ranks than devices is a ValueError on every rank before anything
starts. Several nodes each own their ``cuda:0``: a client's ``cuda:0`` then
means "the cuda:0 of any node", and each chunk runs on one of them (see
``docs/mpi.md``). Everything binds to the loopback interface unless
``interface`` names another (``ib0`` for a real multi-node job): a job whose
ranks span hosts on loopback is refused on every rank, and workers that have
not joined within ``join_timeout`` end the job with a message naming
``--interface``. With TLS configured (Dask's ``distributed.comm.tls.*``
settings, or ``--tls-ca-file/--tls-cert/--tls-key``), every connection of the
cluster is TLS and clients need the same settings.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
import warnings

from dsched.checks import check_positive_int
from dsched.cluster.logs import apply_log_level
from dsched.cluster.mpi_layout import (
    WorkerPlacement,
    _check_devices,
    _default_devices,
    _is_loopback,
    _plan,
    _worker_options,
    cluster_layout,
    format_layout,
)
from dsched.devices.device import check_capacities
from dsched.devices.ownership import cluster_info

__all__ = ["initialize", "serve", "main", "WorkerPlacement", "WorkersMissing", "cluster_layout", "format_layout",
           "use_tls"]

SCHEDULER_RANK = 0
CLIENT_RANK = 1  # in initialize(); serve() has no client rank


def _comm(comm):
    if comm is not None:
        return comm
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _http_address(dashboard_address, interface):
    """Where the scheduler's HTTP server listens: on the interface, never on every interface.

    A host-less address (``":8787"``) gets the interface's IP. Without a
    dashboard the scheduler still serves /health and /metrics, by default
    on port 8787 of every interface; a random port on the interface instead.
    """
    if interface is None:
        return dashboard_address
    from distributed.utils import get_ip_interface

    if dashboard_address is None:
        return f"{get_ip_interface(interface)}:0"
    host, _, port = str(dashboard_address).rpartition(":")
    return dashboard_address if host else f"{get_ip_interface(interface)}:{port}"


def _list_dashboard_page(dashboard: bool) -> None:
    """List dsched's dashboard page, where this checkout has ``dsched.dashboard``.

    Dask builds the dashboard's pages when the scheduler starts, so this runs
    in the scheduler's process before it starts; the plugin that feeds the
    page is installed afterwards through a client (:func:`install_plugins`).
    """
    if not dashboard:
        return
    try:
        from dsched.observe.dashboard import register_page
    except ImportError:  # no dsched.dashboard, or no Bokeh
        return
    register_page()


def install_plugins(client) -> list[str]:
    """Install dsched's plugins through ``client.register_plugin``; the dsched plugins the scheduler then runs.

    ``dsched.placement`` pins ``dsched.map_blocks`` blocks to their devices;
    ``dsched.dashboard`` serves ``/dsched/status.json`` and feeds the
    ``/individual-dsched`` page. A module that is missing is skipped; one
    that fails to install is a RuntimeWarning, not a failed cluster:
    dispatching needs neither.
    """
    for module_name, path in (("placement", "dsched.cluster.placement"), ("dashboard", "dsched.observe.dashboard")):
        try:
            module = importlib.import_module(path)
        except ImportError:
            continue
        if not hasattr(module, "register"):
            continue
        try:
            module.register(client)
        except Exception as err:
            warnings.warn(f"dsched.mpi: dsched.{module_name} could not be installed: {err!r}", RuntimeWarning,
                          stacklevel=2)
    names = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.plugins))
    return [name for name in names if name.startswith("dsched")]


# --- initialize(): dask-mpi's layout, the script goes on as the client on rank 1 ---

def initialize(
    devices=None,
    *,
    capacities=None,
    emulate=False,
    nthreads=2,
    interface="lo",
    dashboard_address=":8787",
    memory_limit="auto",
    local_directory=None,
    worker_class="distributed.Worker",
    comm=None,
    exit=True,
    verbose=True,
    log_level="warning",
):
    """Start a Dask cluster with dask-mpi in which each worker rank owns one device of its node.

    Call it at the top of a script run by ``mpiexec -n N`` (N >= 3): rank 0
    becomes the scheduler, rank 1 returns ``True`` and runs the rest of the
    script as the client (``Client()`` needs no address), ranks >= 2 are
    device workers. The k-th worker rank of a node owns ``devices[k]``.

    Parameters
    ----------
    devices : list of str or Device, optional
        The devices of each node, in the order worker ranks take them;
        defaults to the CPU plus the node's visible GPUs.
    capacities : dict, optional
        ``{device: items}`` a device may execute at once, across all clients;
        unlimited by default.
    emulate : bool
        Let a worker claim a CUDA device its node lacks (computing with NumPy,
        marked ``dsched-emulated``); otherwise that is a ValueError.
    nthreads : int
        Chunks a device worker runs at once.
    interface : str or None
        Network interface to bind: loopback by default; ``"ib0"`` or
        ``"eth0"`` across nodes.
    dashboard_address : str or None
        ``":8787"`` serves the dashboard on the interface; ``None`` turns it off.
    memory_limit, local_directory, worker_class :
        Passed to the workers, as in ``dask_mpi.initialize``.
    comm : mpi4py communicator, optional
        Defaults to ``MPI.COMM_WORLD``.
    exit : bool
        As in dask-mpi: with True the scheduler and worker ranks exit when
        the cluster closes (the client closes it at exit); with False they
        return ``False`` and the client must call
        ``dask_mpi.send_close_signal()``.
    verbose : bool
        Rank 0 prints the layout (host, rank, role, device).
    log_level : str or None
        Level of Dask's ``distributed`` logger on every rank; ``"warning"``
        hides the routine INFO lines and the harmless ``CommClosedError``
        tracebacks of shutdown; ``None`` leaves logging alone.

    Returns
    -------
    bool
        ``True`` on the client rank (once every worker has joined and the
        plugins are installed).

    Examples
    --------
    >>> import dsched.mpi  # doctest: +SKIP
    >>> dsched.mpi.initialize(devices=["cpu", "cuda:0", "cuda:1"])  # doctest: +SKIP
    >>> from distributed import Client; client = Client()  # doctest: +SKIP
    """
    import dask_mpi

    comm = _comm(comm)
    nthreads, layout, mine = _prepare_ranks(comm, devices, capacities, emulate, nthreads, interface, dashboard_address,
                                            verbose, log_level)
    is_client = dask_mpi.initialize(**_dask_mpi_options(comm, mine, nthreads, interface, dashboard_address,
                                                        memory_limit, local_directory, worker_class, exit))
    if is_client:
        _join_as_client(comm, layout, interface, dashboard_address, verbose)
    return is_client


def _prepare_ranks(comm, devices, capacities, emulate, nthreads, interface, dashboard_address, verbose, log_level):
    """Collective, for :func:`initialize`: the checked ``nthreads``, every rank's placement, and this rank's.

    Checks the arguments (the same error on every rank), plans which rank
    owns which device, prints the layout on rank 0 and lists the dashboard
    page on the scheduler rank (before dask-mpi starts the scheduler).
    """
    nthreads = _check_nthreads(nthreads)
    _set_log_level(log_level)
    size = comm.Get_size()
    if size < 3:
        raise ValueError(
            f"mpiexec -n: dsched.mpi.initialize needs at least 3 ranks (scheduler, client, one worker), got {size}"
        )
    devices = _check_devices(_default_devices() if devices is None else devices)
    capacities = check_capacities(capacities, devices)

    def roles(rank):
        return {SCHEDULER_RANK: "scheduler", CLIENT_RANK: "client"}.get(rank, "worker")

    layout, mine = _plan(comm, roles, devices, capacities, emulate, interface)
    if verbose and comm.Get_rank() == SCHEDULER_RANK:
        print(f"dsched.mpi cluster (dask-mpi, interface {interface}):\n{format_layout(layout, devices)}", flush=True)
    if mine.role == "scheduler":
        _list_dashboard_page(dashboard_address is not None)
    return nthreads, layout, mine


def _dask_mpi_options(comm, mine, nthreads, interface, dashboard_address, memory_limit, local_directory,
                      worker_class, exit) -> dict:
    """The arguments of ``dask_mpi.initialize`` for this rank (a worker rank's resources and name included)."""
    options = _worker_options(mine, nthreads) if mine.role == "worker" else {}
    options.pop("nthreads", None)
    return dict(
        interface=interface,
        nthreads=nthreads,
        local_directory=local_directory,
        memory_limit=memory_limit,
        dashboard=dashboard_address is not None,
        dashboard_address=_http_address(dashboard_address, interface),
        worker_class=worker_class,
        worker_options=options,
        comm=comm,
        exit=exit,
        protocol=_protocol(),
    )


def _join_as_client(comm, layout, interface, dashboard_address, verbose) -> None:
    """On the client rank of :func:`initialize`: wait for every worker rank and install the plugins.

    Worker ranks missing after the timeout end the whole job (``comm.Abort``).
    """
    import dask

    address = dask.config.get("scheduler_address")
    try:
        plugins = _prepare_cluster(address, sum(p.role == "worker" for p in layout), layout=layout,
                                   interface=interface)
    except WorkersMissing as err:
        # The scheduler and worker ranks would wait forever: say why, and end the whole job.
        print(f"dsched.mpi: error: {err}", file=sys.stderr, flush=True)
        _abort(comm, 2)
    if verbose:
        print(f"dsched.mpi cluster ready at {address} (plugins: {', '.join(plugins) or 'none'})", flush=True)
        if dashboard_address is not None:
            _print_page_link(address)


# How long a rank that ends the job waits for the launcher to forward what it printed.
ABORT_GRACE_S = 1.0


def _abort(comm, code: int) -> None:
    """End every rank of the job, once the launcher had time to forward this rank's last words.

    ``MPI_Abort`` makes the launcher kill every process at once; the line the rank printed just
    before can still sit in the pipe to its launcher proxy and be lost with it.
    """
    time.sleep(ABORT_GRACE_S)
    comm.Abort(code)


class WorkersMissing(RuntimeError):
    """Worker ranks did not join the scheduler in time: the job cannot start."""


def _prepare_cluster(address, n_workers, timeout=120, layout=None, interface=None) -> list[str]:
    """Wait until every worker rank has joined, then install the plugins; their names.

    Raises :class:`WorkersMissing`, naming the missing ranks and the likely
    cause, when they have not all joined within ``timeout`` seconds.
    """
    from distributed import Client

    with Client(address, timeout=timeout, security=_security()) as client:
        try:
            client.wait_for_workers(n_workers, timeout=timeout)
        except TimeoutError:
            joined = {str(info.get("name")) for info in cluster_info(client)["workers"].values()}
            raise WorkersMissing(_missing_workers_message(address, n_workers, joined, timeout, layout, interface)) from None
        return install_plugins(client)


def _missing_workers_message(address, n_workers, joined, timeout, layout, interface) -> str:
    missing = [p for p in layout or () if p.role == "worker" and p.name not in joined]
    shown = "; missing: " + ", ".join(f"rank {p.rank} ({p.device} on {p.host})" for p in missing) if missing else ""
    head = f"only {len(joined)} of {n_workers} worker ranks joined the scheduler at {address} within {timeout:g} s{shown}"
    if interface is not None and _is_loopback(interface):
        return (f"{head}. --interface {interface} is loopback: ranks on other hosts cannot reach it; the likely cause. "
                "Pass the interface that connects the hosts (--interface eth0, ib0, ...)")
    return (f"{head}. Check that every host reaches {address} through --interface {interface} "
            "(firewall, a wrong interface, or TLS settings that differ between ranks)")


def _print_page_link(address=None, scheduler=None):
    """Print the link to the dsched dashboard page (the scheduler's, or the one at ``address``)."""
    try:
        from dsched.observe.dashboard import dashboard_link, scheduler_page_link
    except ImportError:  # a checkout without dsched.dashboard
        return
    if scheduler is not None:
        link = scheduler_page_link(scheduler)
    else:
        from distributed import Client

        with Client(address, timeout=30) as client:
            link = dashboard_link(client)
    if link is not None:
        print(f"dsched.mpi dashboard: {link}", flush=True)


def _set_log_level(level):
    """Dask's logs on this rank at ``level``; above INFO without a failed task's "Compute Failed" (see dsched.logs)."""
    if level is None:
        return
    apply_log_level(str(level))


def _protocol():
    """``"tls://"`` when Dask's config asks for TLS (a CA file, or required encryption), else Dask's default."""
    import dask

    wanted = dask.config.get("distributed.comm.tls.ca-file", None) or dask.config.get(
        "distributed.comm.require-encryption", False)
    return "tls://" if wanted else None


def _security():
    """Dask's security settings (``distributed.comm.tls.*``): TLS for every connection when a CA is set."""
    from distributed import Security

    return Security()


def use_tls(ca_file, cert, key=None) -> dict:
    """Dask config that makes every connection of this process TLS with ``cert`` signed by ``ca_file``.

    The same certificate serves the scheduler, the workers and the internal
    client; a client outside the job needs ``distributed.comm.tls.ca-file``,
    ``.client.cert`` and ``.client.key`` (for example through
    ``DASK_DISTRIBUTED__COMM__TLS__CA_FILE`` and friends).
    """
    for field, path in (("--tls-ca-file", ca_file), ("--tls-cert", cert), ("--tls-key", key)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{field}: {path} is not a readable file")
    config = {"distributed.comm.tls.ca-file": ca_file, "distributed.comm.require-encryption": True}
    for role in ("scheduler", "worker", "client"):
        config[f"distributed.comm.tls.{role}.cert"] = cert
        config[f"distributed.comm.tls.{role}.key"] = key
    return config


def _check_nthreads(nthreads) -> int:
    check_positive_int(nthreads, "nthreads", integers=int, below=None)
    return nthreads


# --- serve(): a cluster with no client in it, joined through a scheduler file ---

def serve(
    devices=None,
    *,
    scheduler_file,
    capacities=None,
    emulate=False,
    nthreads=2,
    interface="lo",
    scheduler_port=0,
    dashboard_address=":8787",
    memory_limit="auto",
    local_directory=None,
    comm=None,
    verbose=True,
    log_level="warning",
    join_timeout=120.0,
) -> None:
    """Run a device cluster under ``mpiexec`` until a client shuts it down (``client.shutdown()``).

    Rank 0 runs the scheduler; every other rank is a device worker, the
    k-th worker rank of a node owning ``devices[k]``. ``scheduler_file`` is
    written once every worker has joined and the plugins are installed, so
    a client that finds it finds the whole cluster. Worker ranks that have
    not joined within ``join_timeout`` seconds raise :class:`WorkersMissing`
    on rank 0 (``python -m dsched.mpi`` then ends the job). TLS follows
    Dask's security config (see :func:`use_tls`). Other arguments as for
    :func:`initialize`.
    """
    comm = _comm(comm)
    nthreads = _check_nthreads(nthreads)
    _set_log_level(log_level)
    if comm.Get_size() < 2:
        raise ValueError(f"mpiexec -n: python -m dsched.mpi needs at least 2 ranks (scheduler, one worker), got {comm.Get_size()}")
    if not scheduler_file:
        raise ValueError("scheduler_file: a path is required (clients find the cluster through it)")
    devices = _check_devices(_default_devices() if devices is None else devices)
    capacities = check_capacities(capacities, devices)

    def roles(rank):
        return "scheduler" if rank == SCHEDULER_RANK else "worker"

    layout, mine = _plan(comm, roles, devices, capacities, emulate, interface)
    if mine.role == "scheduler":
        if os.path.exists(scheduler_file):
            os.remove(scheduler_file)  # a stale file would send clients to a dead scheduler
        asyncio.run(_run_scheduler(comm, layout, devices, scheduler_file, interface, scheduler_port,
                                   dashboard_address, _http_address(dashboard_address, interface), verbose,
                                   join_timeout))
    else:
        asyncio.run(_run_worker(comm, _worker_options(mine, nthreads), interface, memory_limit, local_directory))


async def _run_scheduler(comm, layout, devices, scheduler_file, interface, port, dashboard_address, http_address,
                         verbose, join_timeout=120.0):
    from distributed import Scheduler

    _list_dashboard_page(dashboard_address is not None)
    security = _security()
    async with Scheduler(interface=interface, port=port, dashboard=dashboard_address is not None,
                         dashboard_address=http_address, security=security,
                         protocol=_protocol()) as scheduler:
        comm.bcast(scheduler.address, root=SCHEDULER_RANK)
        # A synchronous client in a thread, so plugin installers need not be async-aware.
        plugins = await asyncio.to_thread(_prepare_cluster, scheduler.address, sum(p.role == "worker" for p in layout),
                                          join_timeout, layout, interface)
        partial = f"{scheduler_file}.partial"
        with open(partial, "w") as f:
            json.dump(scheduler.identity(), f, indent=2)
        os.replace(partial, scheduler_file)  # atomic: a client never reads half a file
        if verbose:
            print(
                f"dsched.mpi cluster ready at {scheduler.address} (scheduler file {scheduler_file}; "
                f"plugins: {', '.join(plugins) or 'none'}):\n{format_layout(layout, devices)}",
                flush=True,
            )
            if dashboard_address is not None:
                _print_page_link(scheduler=scheduler)
        await scheduler.finished()


async def _run_worker(comm, options, interface, memory_limit, local_directory):
    from distributed import Worker

    address = comm.bcast(None, root=SCHEDULER_RANK)
    security = _security()
    async with Worker(address, interface=interface, memory_limit=memory_limit, local_directory=local_directory,
                      security=security, protocol=_protocol(),
                      **options) as worker:
        await worker.finished()


# --- python -m dsched.mpi ------------------------------------------------------

def _parse_capacities(text):
    capacities = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        device, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--capacities: expected DEVICE=ITEMS, got {part!r}")
        try:
            capacities[device.strip()] = int(value)
        except ValueError:
            raise ValueError(f"--capacities: {value!r} for {device.strip()} is not an integer") from None
    return capacities


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dsched.mpi",
        description="Under mpiexec: a Dask cluster in which rank 0 is the scheduler and every other rank a worker "
        "owning one device of its node (the k-th worker rank of a node takes the k-th device).",
        epilog="example: mpiexec -n 6 python -m dsched.mpi --devices cpu,cuda:0,cuda:1 --scheduler-file sf.json",
    )
    parser.add_argument("--devices", help="comma-separated devices of each node (default: cpu plus the visible GPUs)")
    parser.add_argument("--scheduler-file", required=True, help="JSON file clients connect with, written once all workers joined")
    parser.add_argument("--capacities", help="items a device may execute at once, e.g. cuda:0=4096,cpu=64 (default unlimited)")
    parser.add_argument("--emulate", action="store_true", help="let workers claim CUDA devices their node lacks (NumPy; tests only)")
    parser.add_argument("--nthreads", type=int, default=2, help="chunks a device worker runs at once (default 2)")
    parser.add_argument("--interface", default="lo", help="network interface to bind (default lo; ib0/eth0 across nodes)")
    parser.add_argument("--scheduler-port", type=int, default=0, help="scheduler port (default random)")
    parser.add_argument("--dashboard-address", default=":8787", help="dashboard address (default :8787 on the interface)")
    parser.add_argument("--no-dashboard", action="store_true", help="do not serve the dashboard")
    parser.add_argument("--memory-limit", default="auto", help="worker memory limit (default auto)")
    parser.add_argument("--local-directory", default=None, help="directory for worker files")
    parser.add_argument("--quiet", action="store_true", help="do not print the layout")
    parser.add_argument("--log-level", default="warning", help="level of Dask's logs (default warning; info shows them all)")
    parser.add_argument("--join-timeout", type=float, default=120.0,
                        help="seconds for every worker rank to join the scheduler before the job ends (default 120)")
    parser.add_argument("--tls-ca-file", help="TLS for every connection: the CA that signed the certificates "
                        "(or set Dask's distributed.comm.tls.* config)")
    parser.add_argument("--tls-cert", help="TLS certificate of the scheduler and workers (PEM; may include the key)")
    parser.add_argument("--tls-key", help="TLS private key, if not in --tls-cert")
    args = parser.parse_args(argv)
    devices = [d for d in (args.devices or "").split(",") if d.strip()] or None
    comm = _comm(None)
    try:
        if bool(args.tls_ca_file) != bool(args.tls_cert):
            raise ValueError("--tls-ca-file and --tls-cert: give both (or neither, to use Dask's TLS config)")
        import dask

        with dask.config.set(use_tls(args.tls_ca_file, args.tls_cert, args.tls_key) if args.tls_ca_file else {}):
            _serve_from_args(devices, args)
    except ValueError as err:
        # Every rank raises the same error: print it once, not once per rank.
        if comm.Get_rank() == SCHEDULER_RANK:
            print(f"python -m dsched.mpi: error: {err}", file=sys.stderr, flush=True)
        return 2
    except WorkersMissing as err:
        # Only rank 0 knows; the worker ranks would retry forever: end the whole job.
        print(f"python -m dsched.mpi: error: {err}", file=sys.stderr, flush=True)
        _abort(comm, 2)
    except Exception:
        # A failure on one rank leaves the others waiting on it: show it, then end the whole job.
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        _abort(comm, 1)
    return 0


def _serve_from_args(devices, args):
    serve(
        devices,
        scheduler_file=args.scheduler_file,
        capacities=_parse_capacities(args.capacities),
        emulate=args.emulate,
        nthreads=args.nthreads,
        interface=args.interface,
        scheduler_port=args.scheduler_port,
        dashboard_address=None if args.no_dashboard else args.dashboard_address,
        memory_limit=args.memory_limit,
        local_directory=args.local_directory,
        verbose=not args.quiet,
        log_level=args.log_level,
        join_timeout=args.join_timeout,
    )


if __name__ == "__main__":
    sys.exit(main())
