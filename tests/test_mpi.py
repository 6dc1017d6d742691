"""SimpleMPIScheduler and dsched.mpi under a real mpiexec (the mpich wheel), each run with a wall-clock timeout.

Run as a script, this file is the rank program of the scheduler tests:
``mpiexec -n 2 python tests/test_mpi.py OUT cpu,cuda:0 8,64`` writes one JSON
file per rank into the folder OUT with the device it took, or the error it
raised (files, since the ranks' standard outputs interleave).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def _probe(argv) -> int:
    """One rank: build a SimpleMPIScheduler and report what it chose."""
    sys.path.insert(0, str(ROOT))
    from mpi4py import MPI

    from dsched import SimpleMPIScheduler

    out, devices, sizes = Path(argv[0]), argv[1].split(","), [int(b) for b in argv[2].split(",")]
    options = {"allow_shared": "--allow-shared" in argv}
    if "--comm-self" in argv:
        options["comm"] = MPI.COMM_SELF
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        s = SimpleMPIScheduler(devices, sizes, **options)
    except ValueError as err:
        report = {"rank": rank, "error": str(err)}
    else:
        device, n = s.schedule_work()
        s.dispatched_work(device, n)
        report = {
            "rank": rank, "host": s.host, "local_rank": s.local_rank, "local_size": s.local_size,
            "device": str(s.device), "next": [str(device), n], "room_after_one": s.schedule_work() is not None,
        }
    (out / f"{rank}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(_probe(sys.argv[1:]))


import urllib.request  # noqa: E402  (the rank program above needs none of this)

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402

from dsched import Device, SimpleMPIScheduler  # noqa: E402

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed (pip install mpich)")


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _mpiexec(args, timeout=60) -> subprocess.CompletedProcess:
    """``mpiexec ARGS`` with a wall-clock timeout (a dask-mpi rank can hang on exit)."""
    return subprocess.run([MPIEXEC, *args], env=_env(), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture(autouse=True)
def _no_mpich_files_left():
    """A job ended by MPI_Abort leaves MPICH's shared-memory files in /dev/shm (MPICH's own; nothing runs after
    the abort to remove them): those a test's jobs left are removed, so the suite leaves the machine as it was."""
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    yield
    for path in set(glob.glob("/dev/shm/mpich_shm_*")) - before:
        with contextlib.suppress(OSError):
            os.unlink(path)


@pytest.fixture
def probe(tmp_path):
    """Run the rank program under ``mpiexec ARGS`` (``{probe}`` stands for its command); the ranks' reports."""
    def run(args, timeout=30) -> list[dict]:
        command = []
        for a in args:
            command += [sys.executable, __file__, str(tmp_path)] if a == "{probe}" else [a]
        done = _mpiexec(command, timeout)
        assert done.returncode == 0, done.stdout + done.stderr
        reports = [json.loads(f.read_text()) for f in tmp_path.glob("*.json")]
        return sorted(reports, key=lambda r: r["rank"])

    return run


def _probe_args(n, devices, sizes, *extra):
    return ["-n", str(n), "{probe}", devices, sizes, *extra]


# --- SimpleMPIScheduler in this process (one rank) -----------------------------------

def test_outside_mpiexec_one_rank_takes_the_first_device_without_initialising_mpi():
    code = (
        "import sys, dsched; s = dsched.SimpleMPIScheduler(['cuda:1', 'cpu'], [64, 8], [128]);"
        "print(s.device, s.local_rank, s.local_size, s.schedule_work(), 'mpi4py.MPI' in sys.modules)"
    )
    from dsched.schedulers.mpi import _LAUNCHER_VARIABLES

    env = {k: v for k, v in _env().items() if k not in _LAUNCHER_VARIABLES}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["cuda:1", "0", "1", "(Device('cuda:1'),", "64)", "False"], done.stderr


def test_schedules_like_simple_scheduler_on_its_device():
    s = SimpleMPIScheduler(["cpu", "cuda:0"], batch_sizes=[4, 64], capacities=[8, 64])
    assert (s.device, s.batch_size, s.capacity, s.local_rank, s.local_size) == (Device("cpu"), 4, 8, 0, 1)
    assert s.devices == [Device("cpu")]
    assert s.schedule_work() == (Device("cpu"), 4)
    s.dispatched_work("cpu", 4)
    assert s.schedule_work() == (Device("cpu"), 4)
    s.dispatched_work("cpu", 3)  # a short last chunk
    assert s.schedule_work() is None
    with pytest.raises(RuntimeError, match="Device not found: cuda:0"):
        s.dispatched_work("cuda:0", 1)  # listed, but not this rank's device
    with pytest.raises(RuntimeError, match="Device oversubscribed"):
        s.dispatched_work("cpu", 2)
    s.completed_work("cpu", 7)
    assert s.all_work_completed()


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": ["cpu", "cpu"], "batch_sizes": 4}, "devices: duplicate device cpu"),
    ({"devices": ["cuda", "cuda:0"], "batch_sizes": 4}, "devices: a bare 'cuda' next to cuda:0"),
    ({"devices": ["gpu"], "batch_sizes": 4}, "devices: 'gpu' is not a device"),
    ({"devices": [], "batch_sizes": 4}, "devices: at least one device"),
    ({"devices": ["cpu", "cuda:0"], "batch_sizes": [4, 8, 16]}, "batch_sizes: expected 1 or 2 values"),
    ({"devices": ["cpu", "cuda:0"], "batch_sizes": [4, 0]}, r"batch_sizes\[1\]: must be >= 1, got 0"),
    ({"devices": ["cpu"], "batch_sizes": 8, "capacities": 4}, r"capacities\[0\]: 4 is below the batch size 8"),
    ({"devices": ["cpu"], "batch_sizes": 8, "allow_shared": "yes"}, "allow_shared: expected True or False"),
    ({"devices": ["cpu"], "batch_sizes": 8, "comm": object()}, "comm: expected an mpi4py communicator"),
])
def test_bad_configuration_is_a_value_error_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimpleMPIScheduler(**kwargs)


# --- SimpleMPIScheduler under mpiexec ----------------------------------------------

def test_two_ranks_take_two_devices_by_local_rank(probe):
    ranks = probe(_probe_args(2, "cpu,cuda:0", "8,64"))
    assert [(r["rank"], r["local_rank"], r["local_size"], r["device"], r["next"]) for r in ranks] == [
        (0, 0, 2, "cpu", ["cpu", 8]),
        (1, 1, 2, "cuda:0", ["cuda:0", 64]),
    ]
    assert not any(r["room_after_one"] for r in ranks)  # capacity defaults to the batch size


def test_more_ranks_on_a_node_than_devices_is_a_value_error_on_every_rank(probe):
    ranks = probe(_probe_args(3, "cpu,cuda:0", "8"))
    host = ranks[0]["error"].split("'")[1]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    for r in ranks:
        assert r["error"].startswith(f"devices: host '{host}' runs 3 MPI ranks but only 2 devices are listed (cpu, cuda:0)")
        assert "allow_shared=True" in r["error"]


def test_allow_shared_assigns_devices_round_robin(probe):
    ranks = probe(_probe_args(3, "cpu,cuda:0", "8,64", "--allow-shared"))
    assert [(r["local_rank"], r["device"], r["next"][1]) for r in ranks] == [(0, "cpu", 8), (1, "cuda:0", 64), (2, "cpu", 8)]


def test_ranks_are_grouped_by_node_and_a_node_may_leave_devices_idle(probe):
    # Two "nodes" on this machine (DSCHED_NODE_NAME), two ranks each, three devices listed.
    args = ["-n", "2", "-env", "DSCHED_NODE_NAME", "node-a", "{probe}", "cuda:0,cuda:1,cpu", "16", ":",
            "-n", "2", "-env", "DSCHED_NODE_NAME", "node-b", "{probe}", "cuda:0,cuda:1,cpu", "16"]
    ranks = probe(args)
    assert [(r["host"], r["local_rank"], r["local_size"], r["device"]) for r in ranks] == [
        ("node-a", 0, 2, "cuda:0"), ("node-a", 1, 2, "cuda:1"),
        ("node-b", 0, 2, "cuda:0"), ("node-b", 1, 2, "cuda:1"),
    ]


def test_comm_argument_replaces_comm_world(probe):
    ranks = probe(_probe_args(2, "cpu,cuda:0", "8", "--comm-self"))
    assert [(r["local_rank"], r["local_size"], r["device"]) for r in ranks] == [(0, 1, "cpu"), (0, 1, "cpu")]


# --- MPI host application (examples/mpi_host_app.py) --------------------------------

def test_host_app_example_each_rank_dispatches_its_share_and_rank_0_gathers():
    done = _mpiexec(["-n", "2", sys.executable, "examples/mpi_host_app.py", "--devices", "cpu,cuda:0", "--emulate",
                     "--points", "3001", "--batch-sizes", "250,500"], timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "gathered 3001 points from 2 ranks: result matches the direct evaluation" in lines[-1]
    rows = [line for line in lines if line.strip()[:1].isdigit()]
    assert [row.split()[:4] for row in rows] == [["0", host_of(rows[0]), "0", "cpu"], ["1", host_of(rows[0]), "1", "cuda:0"]]
    assert "[0, 1501)" in rows[0] and "(emulated)" not in rows[0]
    assert "[1501, 3001)" in rows[1] and rows[1].endswith("(emulated)")


def test_host_app_example_in_sync_mode_with_ranks_sharing_the_cpu():
    done = _mpiexec(["-n", "2", sys.executable, "examples/mpi_host_app.py", "--devices", "cpu", "--allow-shared",
                     "--mode", "sync", "--points", "1000", "--batch-sizes", "128"], timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split()[:4] for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[2], r[3]) for r in rows] == [("0", "0", "cpu"), ("1", "1", "cpu")]
    assert "gathered 1000 points from 2 ranks: result matches the direct evaluation" in done.stdout


def host_of(row):
    return row.split()[1]


# --- dask-mpi: dsched.mpi.initialize and python -m dsched.mpi ------------------------

@pytest.mark.parametrize("call, message", [
    (lambda m: m._check_devices(["cpu", "cuda:0", "cpu"]), "devices: duplicate device"),
    (lambda m: m._check_devices([]), "devices: at least one device"),
    (lambda m: m._check_devices(["cuda", "cuda:1"]), "devices: a bare 'cuda' next to cuda:1"),
    (lambda m: m.check_capacities({"cuda:1": 8}, [Device("cpu")]), "capacities: cuda:1 is not one of the devices"),
    (lambda m: m.check_capacities({"cpu": 0}, [Device("cpu")]), r"capacities\['cpu'\]: expected an integer >= 1, got 0"),
    (lambda m: m._parse_capacities("cpu:4"), "--capacities: expected DEVICE=ITEMS, got 'cpu:4'"),
    (lambda m: m._parse_capacities("cpu=many"), "--capacities: 'many' for cpu is not an integer"),
    (lambda m: m._check_nthreads(0), "nthreads: expected an integer >= 1, got 0"),
    (lambda m: m._set_log_level("chatty"), "log_level: expected a logging level"),
])
def test_cluster_options_are_checked_before_anything_starts(call, message):
    import dsched.mpi

    with pytest.raises(ValueError, match=message):
        call(dsched.mpi)


def test_layout_table_shows_roles_devices_emulation_and_idle_devices():
    from dsched.devices import UNLIMITED_CAPACITY
    from dsched.mpi import WorkerPlacement, format_layout

    layout = [WorkerPlacement("n1", 0, "scheduler"), WorkerPlacement("n1", 1, "worker", "cuda:0", 64, True),
              WorkerPlacement("n2", 2, "worker", "cuda:0", UNLIMITED_CAPACITY), WorkerPlacement("n2", 3, "worker", "cpu", 8)]
    assert format_layout(layout, [Device("cpu"), Device("cuda:0")]).splitlines() == [
        "host  rank  role       device  capacity",
        "n1    0     scheduler  -",
        "n1    1     worker     cuda:0  64         (emulated)",
        "n2    2     worker     cuda:0  unlimited",
        "n2    3     worker     cpu     8",
        "idle on n1: cpu (no worker rank left for them)",
    ]


def test_command_line_outside_mpiexec_is_one_rank_and_an_error():
    done = subprocess.run([sys.executable, "-m", "dsched.mpi", "--scheduler-file", "sf.json", "--devices", "cpu"],
                          env=_env(), capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().endswith(
        "python -m dsched.mpi: error: mpiexec -n: python -m dsched.mpi needs at least 2 ranks (scheduler, one worker), got 1")


def test_dask_mpi_job_runs_a_hybrid_dispatch_end_to_end_and_shuts_down():
    started = time.monotonic()
    done = _mpiexec(["-n", "4", sys.executable, "examples/dask_mpi_job.py", "--devices", "cpu,cuda:0", "--emulate",
                     "--no-dashboard", "--points", "6000", "--cpu-batch", "500", "--gpu-batch", "1000"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    # Rank 0 printed the layout: scheduler, client, and one device per worker rank.
    layout = _layout_rows(out)
    assert [row[1:4] for row in layout] == [["0", "scheduler", "-"], ["1", "client", "-"], ["2", "worker", "cpu"],
                                            ["3", "worker", "cuda:0"]]
    assert layout[3][-1] == "(emulated)"
    plugins = out.split("(plugins: ")[1].split(")")[0].split(", ")
    assert ("dsched-placement" in plugins) == _have_module("dsched.placement")
    assert ("dsched-dashboard" in plugins) == _have_module("dsched.dashboard")
    assert "J2 over 6000 points: result matches the direct evaluation" in out
    # Rows are per device and host (cuda:0@127.0.0.1): one host here.
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("device") and "chunks" in line)
    table = {line.split()[0].split("@")[0]: line.split() for line in lines[header + 1:] if line.strip()}
    assert set(table) == {"cpu", "cuda:0"} and table["cuda:0"][-1] == "(emulated)"
    assert int(table["cpu"][2]) + int(table["cuda:0"][2]) == 6000
    assert time.monotonic() - started < 120


def _layout_rows(out) -> list[list[str]]:
    """The rows of the layout table dsched.mpi prints: host, rank, role, device, ..."""
    rows = [line.split() for line in out.splitlines()]
    return [r for r in rows if len(r) >= 4 and r[1].isdigit() and r[2] in ("scheduler", "client", "worker")]


def _have_module(name) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _serve(n, scheduler_file, *extra, node_env=None, dashboard=None):
    shown = ["--dashboard-address", dashboard] if dashboard else ["--no-dashboard"]
    args = [sys.executable, "-m", "dsched.mpi", "--scheduler-file", str(scheduler_file), *shown, *extra]
    command = [MPIEXEC, "-n", str(n), *args]
    if node_env:  # MPMD: one block of ranks per fake node
        command = [MPIEXEC]
        for i, (name, count) in enumerate(node_env):
            command += ([":"] if i else []) + ["-n", str(count), "-env", "DSCHED_NODE_NAME", name, *args]
    # A session of its own, so a failing test can end the whole job (mpiexec, proxies, ranks).
    return subprocess.Popen(command, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _end(proc):
    """End the job started by ``_serve`` (its process group): TERM, then KILL after 10 s."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def _job(proc):
    """Ends the job if the test fails before its client shut the cluster down."""
    try:
        yield
    except BaseException:
        _end(proc)
        raise


def _wait_for_file(path, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"mpiexec ended with {proc.returncode} before writing {path}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            _end(proc)
            pytest.fail(f"no scheduler file after {timeout} s")
        time.sleep(0.1)


def _finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(proc)
        raise
    assert proc.returncode == 0, out + err
    return out


def test_command_line_cluster_serves_a_client_through_the_scheduler_file(tmp_path):
    sf = tmp_path / "sf.json"
    proc = _serve(3, sf, "--devices", "cpu,cuda:0", "--emulate", "--capacities", "cuda:0=64,cpu=16",
                  dashboard=":0")
    _wait_for_file(sf, proc)
    with _job(proc):
        _check_served(sf, proc)
        out = _finish(proc)
    assert "dsched.mpi cluster ready at tcp://127.0.0.1:" in out  # loopback by default


def _dask_listeners_on_loopback(proc, client, identity):
    """Every port Dask listens on in the job (scheduler, workers, their HTTP servers) is bound to 127.0.0.1.

    MPI's own sockets (Hydra's control port, MPICH's network module) are not dsched's to bind.
    """
    info = client.scheduler_info(n_workers=-1)["workers"]
    ports = {int(identity["address"].rsplit(":", 1)[1]), identity["services"]["dashboard"]}
    ports |= {int(a.rsplit(":", 1)[1]) for a in info} | {w["services"]["dashboard"] for w in info.values()}
    ranks = psutil.Process(proc.pid).children(recursive=True)
    bound = {c.laddr.port: c.laddr.ip for p in ranks for c in p.net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN}
    assert {port: bound.get(port) for port in ports} == {port: "127.0.0.1" for port in ports}


def _check_served(sf, proc):
    from distributed import Client

    from dsched import StaticHybridScheduler, WorkDispatcher, concat_reduce
    from dsched.models import j2_chunk
    from dsched.mpi import cluster_layout
    from dsched.work import SliceGenerator

    with Client(scheduler_file=str(sf), timeout=30) as client:
        _dask_listeners_on_loopback(proc, client, json.loads(sf.read_text()))
        layout = {p.device: p for p in cluster_layout(client)}
        assert {d: (p.capacity, p.emulated, p.name) for d, p in layout.items()} == {
            "cpu": (16, False, "cpu"), "cuda:0": (64, True, "cuda:0")}
        scheduler = StaticHybridScheduler(["cpu", "cuda:0"], [8, 32], [16, 64], [1, 2])
        dispatcher = WorkDispatcher(scheduler, j2_chunk, reduce=concat_reduce, client=client)
        result = dispatcher.run(SliceGenerator(0, 1000))
        np.testing.assert_allclose(result["tangent"], j2_chunk(slice(0, 1000))["tangent"], rtol=1e-12, atol=0)
        workers = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        assert all(workers[r.worker] == str(r.device) for r in dispatcher.last_run.records)
        if _have_module("dsched.dashboard"):  # dsched's dashboard plugin was preloaded on the scheduler
            from dsched.dashboard import flush_page

            flush_page(client)  # the lanes' chunk events reach the page off the call's path
            port = json.loads(sf.read_text())["services"]["dashboard"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/dsched/status.json", timeout=10) as reply:
                status = {row["device"]: row for row in json.load(reply)["devices"]}
            assert status["cuda:0"]["emulated"] is True and status["cpu"]["emulated"] is False
            assert status["cpu"]["items_done"] + status["cuda:0"]["items_done"] == 1000
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/individual-dsched", timeout=10) as reply:
                assert reply.status == 200  # the page was listed before the scheduler started
        _check_data_plane_on_mpi_ranks(client, scheduler)
        _check_any_result_on_mpi_ranks(client, scheduler, sf.parent)
        client.shutdown()


def _check_data_plane_on_mpi_ranks(client, scheduler):
    """Worker ranks on the client's host map its shared memory (one store for the host): J2 on real arrays,
    inputs and ``out=`` shared, each chunk's rows read and written in place by the rank that runs it."""
    import dsched
    from dsched.bench_data import _J2Chunk, j2_inputs
    from dsched.models import j2_update
    from dsched.store import classify_workers

    kinds = classify_workers(client, list(client.scheduler_info(n_workers=-1)["workers"]))
    assert set(kinds.values()) == {"host"}, kinds
    inputs = j2_inputs(1000)
    shared = [dsched.shared_copy(a) for a in inputs]
    reference = j2_update(*inputs)
    out = {k: dsched.shared_empty(v.shape) for k, v in reference.items()}
    before = set(os.listdir("/dev/shm"))
    d = dsched.WorkDispatcher(scheduler, _J2Chunk(), join="concat", client=client, out=out)
    result = d.run(dsched.MappingLoader(dict(zip(("strain", "plastic_strain", "alpha"), shared))))
    assert all(result[k] is out[k] and np.array_equal(out[k], reference[k]) for k in reference)
    assert {str(r.device) for r in d.last_run.records} == {"cpu", "cuda:0"}
    assert set(os.listdir("/dev/shm")) <= before  # the run made no segment of its own: the arrays were shared


def _check_any_result_on_mpi_ranks(client, scheduler, folder):
    """On dask-mpi worker ranks too: object and string outputs come back by value beside numbers written in
    place, inputs stream from a Zarr store and from a Dask array, and an empty batch returns its out= arrays."""
    import dask.array as da
    import zarr

    import dsched

    def labelled(a):  # defined here: pickled by value, so the ranks need not import this test module
        labels = np.empty(len(a), dtype=object)
        labels[:] = [("row", int(v)) for v in a[:, 0]]
        return {"label": labels, "name": np.array([f"p{int(v)}" for v in a[:, 0]]), "twice": 2.0 * a}

    x = np.arange(3000.0).reshape(1000, 3)
    store = zarr.open_array(str(folder / "x.zarr"), mode="w", shape=x.shape, chunks=(128, 3), dtype="f8")
    store[:] = x
    for source in (x, store, da.from_array(x, chunks=(300, 3)) * 1.0):
        out = dsched.dispatch(labelled, source, scheduler=scheduler, client=client)
        assert out["label"].tolist() == [("row", int(v)) for v in x[:, 0]]
        assert out["name"].tolist() == [f"p{int(v)}" for v in x[:, 0]]
        np.testing.assert_array_equal(out["twice"], 2.0 * x)
    empty = np.empty((0, 3))
    assert dsched.dispatch(np.negative, np.zeros((0, 3)), scheduler=scheduler, client=client, out=empty) is empty


def test_command_line_cluster_over_two_nodes_names_workers_by_node(tmp_path):
    from distributed import Client

    from dsched import StaticHybridScheduler, WorkDispatcher, concat_reduce
    from dsched.models import j2_chunk
    from dsched.mpi import cluster_layout
    from dsched.work import SliceGenerator

    sf = tmp_path / "sf.json"
    # node-a: the scheduler (rank 0) and workers on cpu, cuda:0; node-b: workers on cpu, cuda:0.
    proc = _serve(None, sf, "--devices", "cpu,cuda:0", "--emulate", "--capacities", "cuda:0=8,cpu=4",
                  node_env=[("node-a", 3), ("node-b", 2)])
    _wait_for_file(sf, proc)
    with _job(proc):
        with Client(scheduler_file=str(sf), timeout=30) as client:
            names = sorted(p.name for p in cluster_layout(client))
            assert names == ["cpu@node-a", "cpu@node-b", "cuda:0@node-a", "cuda:0@node-b"]
            # One scheduler device per name, its capacity covering both nodes' workers of that name.
            scheduler = StaticHybridScheduler(["cpu", "cuda:0"], [4, 8], [8, 16])
            dispatcher = WorkDispatcher(scheduler, j2_chunk, reduce=concat_reduce, client=client)
            result = dispatcher.run(SliceGenerator(0, 500))
            np.testing.assert_allclose(result["stress"], j2_chunk(slice(0, 500))["stress"], rtol=1e-12, atol=0)
            workers = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
            assert all(workers[r.worker].split("@")[0] == str(r.device) for r in dispatcher.last_run.records)
            client.shutdown()
        out = _finish(proc)
    assert [row[:4] for row in _layout_rows(out)] == [
        ["node-a", "0", "scheduler", "-"], ["node-a", "1", "worker", "cpu"], ["node-a", "2", "worker", "cuda:0"],
        ["node-b", "3", "worker", "cpu"], ["node-b", "4", "worker", "cuda:0"],
    ]


def test_command_line_more_worker_ranks_than_devices_fails_before_starting(tmp_path):
    sf = tmp_path / "sf.json"
    done = _mpiexec(["-n", "4", sys.executable, "-m", "dsched.mpi", "--scheduler-file", str(sf),
                     "--devices", "cpu,cuda:0", "--emulate", "--no-dashboard"], timeout=60)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("python -m dsched.mpi: error:")]
    assert len(errors) == 1  # printed once, not once per rank
    assert "runs 3 Dask worker ranks but only 2 devices are listed (cpu, cuda:0)" in errors[0]
    assert not sf.exists()


def test_command_line_missing_gpu_without_emulate_is_an_error(tmp_path):
    done = _mpiexec(["-n", "3", sys.executable, "-m", "dsched.mpi", "--scheduler-file", str(tmp_path / "sf.json"),
                     "--devices", "cpu,cuda:0", "--no-dashboard"], timeout=60)
    assert done.returncode != 0
    assert "devices: cuda:0 is not present on host" in done.stderr
    assert "(rank 2; visible GPUs: none); pass emulate=True (--emulate) to emulate it" in done.stderr


# --- across hosts for real: network namespaces on a bridge --------------------------------
#
# Each "host" is a network namespace with its own address on a bridge (10.213.<n>.0/24) and,
# through ``unshare --uts``, its own host name; Hydra starts its proxies in them through a
# launcher script (its ssh launcher with ``ip netns exec`` in place of ssh), and its control
# connection runs over the bridge (``-iface``). Needs root, ``ip`` and ``unshare``.

def _can_make_namespaces() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare") is not None


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    """Two hosts on one bridge: ``{"a": "10.213.N.1", "b": "10.213.N.2"}``, the bridge, and a launcher."""
    if not _can_make_namespaces():
        pytest.skip("needs root, ip and unshare for network namespaces")
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.213.{os.getpid() % 250}"
    bridge, names = f"dsbr{tag}", {"a": f"ds{tag}a", "b": f"ds{tag}b"}

    def ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    made = []
    try:
        ip("link", "add", bridge, "type", "bridge")
        made.append(("link", "del", bridge))
        ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i, (host, ns) in enumerate(names.items(), start=1):
            ip("netns", "add", ns)
            made.append(("netns", "del", ns))
            ip("link", "add", f"{ns}v", "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", f"{ns}v", "master", bridge, "up")
            ip("-n", ns, "addr", "add", f"{subnet}.{i}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "route", "add", "default", "via", f"{subnet}.254")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        for undo in reversed(made):
            subprocess.run(["ip", *undo], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {err}")
    folder = tmp_path_factory.mktemp("hosts")
    launchers = {}
    for same_name in (False, True):
        # Hydra's ssh launcher calls: LAUNCHER [-x] HOST "COMMAND"; HOST is the namespace's address.
        cases = "\n".join(f'  {subnet}.{i}) ns={ns}; name={"vm-shared" if same_name else f"host-{host}"};;'
                          for i, (host, ns) in enumerate(names.items(), start=1))
        script = folder / f"launch{'-same-name' if same_name else ''}.sh"
        script.write_text(f'#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nhost=$1; shift\n'
                          f'case "$host" in\n{cases}\n  *) echo "unknown host $host" >&2; exit 1;;\nesac\n'
                          f'exec ip netns exec "$ns" unshare --uts bash -c "hostname $name && exec $*"\n')
        script.chmod(0o755)
        launchers[same_name] = script
    yield {"a": f"{subnet}.1", "b": f"{subnet}.2", "bridge": bridge, "launchers": launchers}
    for undo in reversed(made):
        subprocess.run(["ip", *undo], capture_output=True)


def _serve_across(hosts, layout, scheduler_file, *extra, same_name=False):
    """``python -m dsched.mpi`` over the namespaces: ``layout`` is ``[(host, ranks), ...]``, rank 0 first."""
    spec = ",".join(f"{hosts[h]}:{n}" for h, n in layout)
    command = [MPIEXEC, "-launcher", "ssh", "-launcher-exec", str(hosts["launchers"][same_name]),
               "-iface", hosts["bridge"], "-hosts", spec, "-n", str(sum(n for _, n in layout)),
               sys.executable, "-m", "dsched.mpi", "--scheduler-file", str(scheduler_file), "--no-dashboard", *extra]
    return subprocess.Popen(command, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _error_lines(err) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("python -m dsched.mpi: error:")]


def test_loopback_across_hosts_is_refused_on_every_rank_naming_interface(two_hosts, tmp_path):
    proc = _serve_across(two_hosts, [("a", 1), ("b", 1)], tmp_path / "sf.json", "--devices", "cpu")
    with _job(proc):
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, out + err
    assert _error_lines(err) == [
        "python -m dsched.mpi: error: --interface: lo is loopback, but the job's ranks run on 2 hosts (host-a, "
        "host-b), which cannot reach each other through it; pass the interface that connects them (--interface "
        "eth0, ib0, ...)"]


def test_workers_that_cannot_join_end_the_job_naming_interface(two_hosts, tmp_path):
    # Hosts that share a name (containers) pass the host check; the worker on b then cannot reach loopback on a.
    proc = _serve_across(two_hosts, [("a", 1), ("b", 1)], tmp_path / "sf.json", "--devices", "cpu",
                         "--join-timeout", "3", same_name=True)
    with _job(proc):
        out, err = proc.communicate(timeout=90)
    assert proc.returncode != 0, out + err  # MPI_Abort ended every rank
    lines = _error_lines(err)
    assert len(lines) == 1, out + err
    [line] = lines
    assert line.startswith("python -m dsched.mpi: error: only 0 of 1 worker ranks joined the scheduler at "
                           "tcp://127.0.0.1:")
    assert line.endswith(" within 3 s; missing: rank 1 (cpu on vm-shared). --interface lo is loopback: ranks on other "
                         "hosts cannot reach it; the likely cause. Pass the interface that connects the hosts "
                         "(--interface eth0, ib0, ...)")
    assert not (tmp_path / "sf.json").exists()


def _self_signed(folder) -> tuple[Path, Path]:
    """A self-signed certificate (its own CA) and its key, as Dask's TLS tests use."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dsched-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_tls_cluster_across_hosts_serves_a_tls_client_only(two_hosts, tmp_path):
    from distributed import Client, Security

    cert, key = _self_signed(tmp_path)
    sf = tmp_path / "sf.json"
    # Host a: the scheduler and a cpu worker; host b: a cpu worker (each node's first worker rank owns its cpu).
    proc = _serve_across(two_hosts, [("a", 2), ("b", 1)], sf, "--devices", "cpu",
                         "--interface", "eth0", "--tls-ca-file", str(cert), "--tls-cert", str(cert),
                         "--tls-key", str(key))
    _wait_for_file(sf, proc, timeout=90)
    with _job(proc):
        address = json.loads(sf.read_text())["address"]
        assert address.startswith(f"tls://{two_hosts['a']}:")
        graph = tmp_path / "graph.toml"
        graph.write_text("[model]\nname = 'j2'\n[batch]\nsize = 2000\n[scheduler]\ndevices = ['cpu']\n"
                         "batch_size = 250\n")
        run = [sys.executable, "-m", "dsched", "run", str(graph), "--no-progress", "--scheduler-file", str(sf)]
        # Without TLS settings a client is refused, in one line.
        plain = subprocess.run(run, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert plain.returncode == 2
        assert plain.stderr.splitlines() == [
            f"dsched: error: --scheduler-file: the scheduler at {address} requires TLS; set Dask's TLS config "
            "(distributed.comm.tls.ca-file, .client.cert, .client.key, e.g. DASK_DISTRIBUTED__COMM__TLS__CA_FILE)"]
        tls_env = dict(_env(), DASK_DISTRIBUTED__COMM__TLS__CA_FILE=str(cert),
                       DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT=str(cert),
                       DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY=str(key))
        done = subprocess.run(run, env=tls_env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "total: 2,000 items" in done.stdout
        security = Security(tls_ca_file=str(cert), tls_client_cert=str(cert), tls_client_key=str(key),
                            require_encryption=True)
        with Client(address, security=security, timeout=30) as client:
            workers = client.scheduler_info(n_workers=-1)["workers"]
            # Every worker listens with TLS on its own host's address, and runs on that host.
            hosts = {str(w["name"]): a.rsplit(":", 1)[0] for a, w in workers.items()}
            assert hosts == {"cpu@host-a": f"tls://{two_hosts['a']}", "cpu@host-b": f"tls://{two_hosts['b']}"}
            import socket

            assert sorted(client.run(socket.gethostname).values()) == ["host-a", "host-b"]
            client.shutdown()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err


def test_dask_mpi_job_with_tls_from_dasks_config(tmp_path):
    # initialize() (dask-mpi's layout) takes TLS from Dask's config alone, here through the environment.
    cert, key = _self_signed(tmp_path)
    env = {"DASK_DISTRIBUTED__COMM__TLS__CA_FILE": str(cert)}
    for role in ("SCHEDULER", "WORKER", "CLIENT"):
        env |= {f"DASK_DISTRIBUTED__COMM__TLS__{role}__CERT": str(cert), f"DASK_DISTRIBUTED__COMM__TLS__{role}__KEY": str(key)}
    done = subprocess.run([MPIEXEC, "-n", "4", sys.executable, "examples/dask_mpi_job.py", "--devices", "cpu,cuda:0",
                           "--emulate", "--no-dashboard", "--points", "3000"], env=dict(_env(), **env), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dsched.mpi cluster ready at tls://127.0.0.1:" in done.stdout
    assert "J2 over 3000 points: result matches the direct evaluation" in done.stdout


@pytest.mark.parametrize("args, line", [
    (["--tls-ca-file", "ca.pem"], "--tls-ca-file and --tls-cert: give both (or neither, to use Dask's TLS config)"),
    (["--tls-ca-file", "absent.pem", "--tls-cert", "absent.pem"], "--tls-ca-file: absent.pem is not a readable file"),
])
def test_command_line_tls_options_are_checked_before_anything_starts(tmp_path, args, line):
    done = _mpiexec(["-n", "2", sys.executable, "-m", "dsched.mpi", "--scheduler-file", str(tmp_path / "sf.json"),
                     "--devices", "cpu", "--no-dashboard", *args], timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"python -m dsched.mpi: error: {line}"]
