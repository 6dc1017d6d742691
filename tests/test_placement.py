"""Placement plugins on real process clusters: the command line with the preload modules, a worker
killed mid-compute, and devices claimed by workers that start without one."""

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import dask
import numpy as np
import pytest

import dsched
from dsched import PlacementWarning, StaticHybridScheduler, as_batched, current_device, map_blocks, plan

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

DEVICE_CODE = {"cpu": 0.0, "cuda:0": 1.0}


def hybrid():
    return StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 8], priorities=[1, 2])


def batched(x, scheduler):
    """``x`` as a Dask array cut by the scheduler's plan (its blocks are then the planned chunks)."""
    return as_batched(x, scheduler)[0]


def per_item(chunks):
    return np.repeat([str(d) for d, _ in chunks], [m for _, m in chunks])


def label(a):
    """Each item's device and worker, as the block saw them."""
    from distributed import get_worker

    return np.array([f"{current_device()}@{get_worker().name}"] * len(a), dtype=object)


def wait_for(condition, timeout, what):
    """Poll ``condition`` until true, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


# --- a command-line cluster ---------------------------------------------------------------

def _dask(*args, log):
    # The scheduler and workers import dsched, and this module for the functions its blocks run.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "dask", *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )


@pytest.fixture(scope="module")
def cli_client(tmp_path_factory):
    """``dask scheduler`` and two ``dask worker`` processes on loopback, with dsched's preload modules:
    a CPU worker owning its device through ``--resources``, an emulated cuda:0 through ``--dsched-device``."""
    from distributed import Client

    tmp = tmp_path_factory.mktemp("cli-cluster")
    scheduler_file = tmp / "scheduler.json"
    logs = [open(tmp / f"{name}.log", "w") for name in ("scheduler", "cpu", "gpu")]
    processes = [
        _dask("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
              "--scheduler-file", str(scheduler_file), "--preload", "plugins/dsched_scheduler.py", log=logs[0])
    ]
    try:
        wait_for(scheduler_file.exists, 60, "the scheduler file")
        import json

        wait_for(lambda: json.loads(scheduler_file.read_text() or "{}").get("address"), 10, "the address")
        address = json.loads(scheduler_file.read_text())["address"]
        common = ["--host", "127.0.0.1", "--nthreads", "2", "--no-dashboard", "--preload", "plugins/dsched_worker.py"]
        processes.append(_dask("worker", address, "--name", "cpu", *common, "--resources", "dsched-cpu=1000000",
                               log=logs[1]))
        processes.append(_dask("worker", address, "--name", "cuda:0", *common, "--dsched-device", "cuda:0",
                               "--dsched-emulate", "--dsched-capacity", "64", log=logs[2]))
        # The config set around the client is restored after it: a client that shut its cluster down leaves
        # Dask's default scheduler at "dask.distributed" in the oldest distributed we support, and a later
        # module's compute() would then look for a client that is gone.
        with dask.config.set(scheduler=None), Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            yield client
            client.shutdown()  # the scheduler closes, and its workers with it
    finally:
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
        for log in logs:
            log.close()


def test_cli_workers_own_their_devices(cli_client):
    resources = {w["name"]: w["resources"] for w in cli_client.scheduler_info(n_workers=-1)["workers"].values()}
    assert resources == {"cpu": {"dsched-cpu": 1e6}, "cuda:0": {"dsched-cuda:0": 64, "dsched-emulated": 1}}
    plugins = cli_client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.plugins))
    assert "dsched-placement" in plugins
    # Outside any block, a task on a device's worker runs on that device.
    for address, worker in cli_client.scheduler_info(n_workers=-1)["workers"].items():
        seen = cli_client.submit(lambda: str(current_device()), workers=[address], pure=False).result(timeout=30)
        assert seen == worker["name"]


def test_cli_cluster_runs_map_blocks_as_planned(cli_client):
    s = hybrid()
    x = np.arange(40.0)
    out = map_blocks(label, batched(x, s), scheduler=s, dtype=object).compute()
    assert list(out) == [f"{d}@{d}" for d in per_item(plan(40, s))]
    codes = (map_blocks(device_code, batched(x, s), scheduler=s, dtype=float) + 1).sum().compute()
    assert codes == sum(DEVICE_CODE[d] + 1 for d in per_item(plan(40, s)))
    dsched.register(cli_client)  # harmless on a cluster the preloads set up
    out = map_blocks(label, batched(x + 1, s), scheduler=s, dtype=object).persist().compute()
    assert list(out) == [f"{d}@{d}" for d in per_item(plan(40, s))]


def device_code(a):
    return np.full(len(a), DEVICE_CODE[str(current_device())])


@pytest.mark.parametrize(
    "options, message",
    [
        (["--dsched-device", "gpu"], "device: 'gpu' is not a device"),
        (["--dsched-device", "cuda:0"], "cuda:0 is not visible here"),
        (["--dsched-device", "cpu", "--dsched-capacity", "0"], "--dsched-capacity"),
    ],
)
def test_cli_worker_rejects_a_bad_device_before_starting(options, message):
    if "cuda:0 is not visible" in message and dsched.visible_gpus():
        pytest.skip("this machine has a GPU")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "dask", "worker", "tcp://127.0.0.1:9", "--preload", "plugins/dsched_worker.py", *options],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0
    assert message in done.stderr


# --- a worker killed mid-compute ------------------------------------------------------------

def slow_code(a, event_name):
    """Waits for the test's go, then returns [2a, device code] per item (``a`` is (m, 1)).

    It waits seceded, holding no worker thread: under Dask's expression engine the blocks' input chunks are
    tasks of their own (not fused into the blocks), and blocks waiting on their threads (and on the
    scheduler's queuing slots) would leave a chunk a cuda:0 block needs unrun until the go, which waits for
    every cuda:0 block to be processing."""
    from distributed import Event, secede

    secede()
    Event(event_name).wait(timeout=60)
    return np.concatenate([2 * a, np.full((len(a), 1), DEVICE_CODE[str(current_device())])], axis=1)


@pytest.fixture(scope="module")
def process_client():
    """A LocalHybridCluster of worker processes under nannies (cpu + emulated cuda:0), without work
    stealing so that where each block ends up running is deterministic."""
    from distributed import Client

    with dask.config.set({"distributed.scheduler.work-stealing": False}):
        cluster = dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, dashboard_address=None)
    with cluster, Client(cluster) as client:
        dsched.register(client)
        yield client


def worker_addresses(client):
    return {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}


def kill_worker(client, name):
    """SIGKILL the process of the worker ``name``; returns its address."""
    address = worker_addresses(client)[name]
    os.kill(client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
    return address


def wait_for_worker_back(client, name, old_address):
    wait_for(lambda: worker_addresses(client).get(name) not in (None, old_address), 60, f"{name} to come back")


def placement_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]


def test_blocks_of_a_killed_worker_rerun_elsewhere_complete_and_correct(process_client):
    from distributed import Event

    client = process_client
    s = hybrid()
    x = np.arange(40.0)
    chunks = plan(40, s)
    planned_on_gpu = sum(1 for d, _ in chunks if str(d) == "cuda:0")
    gpu = worker_addresses(client)["cuda:0"]
    go = Event("dsched-test-go", client=client)
    xb = batched(x[:, None], s)
    y = map_blocks(slow_code, xb, "dsched-test-go", scheduler=s, chunks=(xb.chunks[0], (2,)), meta=np.empty((0, 0)))
    future = client.compute(y)
    # The blocks only (an input chunk computing on cuda:0 is not one); the classic engine fuses the input in.
    wait_for(lambda: sum("slow_code" in str(k) for k in client.processing(workers=[gpu])[gpu]) == planned_on_gpu,
             30, "the cuda:0 blocks to reach their worker")
    events_before = len(client.get_events("dsched-placement"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kill_worker(client, "cuda:0")
        wait_for(lambda: placement_warnings(caught), 30, "the placement warning")
        go.set()
        out = future.result(timeout=60)
    # Complete and correct, and the dead worker's blocks ran on the CPU worker.
    np.testing.assert_array_equal(out[:, 0], 2 * x)
    np.testing.assert_array_equal(out[:, 1], np.zeros(40))
    assert placement_warnings(caught) == [
        f"dsched placement: {planned_on_gpu} block(s) planned for cuda:0 will run on any worker: "
        f"worker {gpu} left the cluster"
    ]
    events = [e for _, e in client.get_events("dsched-placement")][events_before:]
    assert [(e["action"], e["device"], e["target"], e["blocks"]) for e in events] == [
        ("relaxed", "cuda:0", "any worker", planned_on_gpu)
    ]
    # The nanny brings cuda:0 back; new work is pinned to it again.
    wait_for_worker_back(client, "cuda:0", gpu)
    labels = map_blocks(label, batched(x, s), scheduler=s, dtype=object).compute()
    assert list(labels) == [f"{d}@{d}" for d in per_item(chunks)]


def gated_copy(a, event_name):
    from distributed import Event

    Event(event_name).wait(timeout=60)
    return a.copy()


def test_waiting_blocks_are_pinned_again_when_their_device_comes_back(process_client):
    from distributed import Event

    client = process_client
    s = hybrid()
    x = np.arange(40.0)
    wait_for(lambda: "cuda:0" in worker_addresses(client), 60, "cuda:0")
    go = Event("dsched-test-go-2", client=client)
    # The planned blocks wait for one gated CPU block upstream, so they are still waiting when cuda:0 dies.
    one_cpu_block = dsched.SimpleScheduler("cpu", 40)
    upstream = map_blocks(gated_copy, batched(x, one_cpu_block), "dsched-test-go-2", scheduler=one_cpu_block,
                          meta=np.empty((0,)))
    # The planned blocks re-cut that single block by the plan (rechunk=True).
    future = client.compute(map_blocks(label, upstream, scheduler=s, rechunk=True, dtype=object))
    cpu = worker_addresses(client)["cpu"]
    wait_for(lambda: client.processing(workers=[cpu])[cpu], 30, "the gated block to start")
    events_before = len(client.get_events("dsched-placement"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = kill_worker(client, "cuda:0")
        wait_for(lambda: placement_warnings(caught), 30, "the placement warning")
        wait_for_worker_back(client, "cuda:0", old)
        go.set()
        labels = future.result(timeout=60)
    assert list(labels) == [f"{d}@{d}" for d in per_item(plan(40, s))]
    events = [e for _, e in client.get_events("dsched-placement")][events_before:]
    assert [(e["device"], e["target"]) for e in events] == [("cuda:0", "any worker")]


# --- workers that start without a device ------------------------------------------------------

def test_register_lets_plain_workers_claim_a_device():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        assert all(not w["resources"] for w in client.scheduler_info()["workers"].values())
        dsched.register(client)
        dsched.register(client)
        resources = [w["resources"] for w in client.scheduler_info()["workers"].values()]
        assert resources == [{"dsched-cpu": dsched.devices.UNLIMITED_CAPACITY}] * 2
        s = dsched.SimpleScheduler("cpu", 4)
        out = map_blocks(lambda a: np.array([str(current_device())] * len(a), dtype=object),
                         batched(np.zeros(10), s), scheduler=s, dtype=object).compute()
        assert set(out) == {"cpu"}


def test_worker_plugin_rejects_a_missing_gpu_unless_emulated():
    from dsched.placement import DeviceWorkerPlugin

    if dsched.visible_gpus():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"dsched-device: cuda:1 is not visible to this worker \(visible GPUs: none\)"):
        DeviceWorkerPlugin("cuda:1")._device_for(worker=None)
    assert DeviceWorkerPlugin("cuda:1", emulate=True)._device_for(worker=None) == (dsched.Device("cuda:1"), True)
    with pytest.raises(ValueError, match="capacity: expected an integer >= 1, got 0"):
        DeviceWorkerPlugin("cpu", capacity=0)


# --- the examples run as a user would run them ---------------------------------------------

@pytest.mark.parametrize(
    "script, args, expected",
    [
        ("examples/map_blocks_j2.py", ["--points", "20000", "--batch-sizes", "1000", "4000"],
         ["cuda:0 (emulated: NumPy on the CPU): 4 blocks, 16000 points", "whole-batch NumPy reference"]),
        ("examples/workstation_cuda.py", ["--points", "20000", "--batch-sizes", "1000", "4000"],
         ["matches the whole-batch NumPy reference"]),
    ],
)
def test_examples_run(script, args, expected):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in expected:
        assert line in done.stdout
    if "workstation" in script and not dsched.visible_gpus():
        assert "the GPU is EMULATED with NumPy on the CPU" in done.stdout


def test_workstation_example_exits_cleanly_without_dask_cuda_when_asked():
    try:
        import dask_cuda  # noqa: F401
        pytest.skip("dask-cuda is installed")
    except ImportError:
        pass
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "examples/workstation_cuda.py", "--no-fallback"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    assert "dask-cuda or a GPU is not available here" in done.stdout and "nothing to run" in done.stdout


# --- which GPU a pinned worker owns: CUDA_VISIBLE_DEVICES ----------------------------------------

# Two GPUs as NVML lists them: (physical index, GPU UUID, MIG instance UUIDs). Data, not a stand-in for
# NVML: the matching below is pure; reading NVML itself is covered by the gpu-marked test.
INVENTORY = [
    (0, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", []),
    (1, "GPU-b2a7c0a1-1111-2222-3333-444455556666",
     ["MIG-4b0e5b6a-5a0c-5f7e-8a9b-0c1d2e3f4a5b", "MIG-77aa88bb-99cc-5dd0-8ee1-ff2233445566"]),
]


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, None),  # unset: every GPU visible
        ("", []),
        ("-1", []),
        ("1,0", [("index", 1), ("index", 0)]),
        (" 2 , 3", [("index", 2), ("index", 3)]),
        ("0,bad,1", [("index", 0)]),  # CUDA stops at the first entry it cannot read
        ("GPU-b2a7c0a1", [("gpu", "GPU-b2a7c0a1")]),
        ("MIG-4b0e5b6a-5a0c-5f7e-8a9b-0c1d2e3f4a5b,0", [("mig", "MIG-4b0e5b6a-5a0c-5f7e-8a9b-0c1d2e3f4a5b"),
                                                        ("index", 0)]),
        ("MIG-GPU-b2a7c0a1-1111-2222-3333-444455556666/1/0",
         [("mig", "MIG-GPU-b2a7c0a1-1111-2222-3333-444455556666/1/0")]),
    ],
)
def test_cuda_visible_devices_parse_as_cuda_reads_them(value, expected):
    assert dsched.devices.parse_visible_devices(value) == expected


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1,0", [1, 0]),
        ("GPU-b2a7c0a1-1111-2222-3333-444455556666,GPU-8932f937", [1, 0]),  # full UUID, unique prefix
        ("gpu-B2A7", []),  # CUDA's prefix is "GPU-": not an entry it reads
        ("MIG-77aa88bb-99cc-5dd0-8ee1-ff2233445566", [1]),  # a MIG instance: the GPU holding it
        ("MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/2/0", [0]),  # the legacy MIG form names its GPU
        ("GPU-", []),  # a prefix matching both GPUs resolves to neither
        ("GPU-deadbeef,0", []),  # an unknown UUID ends the list, as in CUDA
    ],
)
def test_gpu_and_mig_uuids_resolve_to_their_physical_gpu(value, expected):
    assert dsched.devices.visible_physical_indices(value, inventory=INVENTORY) == expected


def test_a_pinned_worker_owns_the_gpu_its_first_entry_names(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0,1")
    assert dsched.devices.first_visible_gpu() == dsched.Device("cuda:3")
    assert dsched.devices.cuda_local_ordinal("cuda:0") == 1  # what CuPy calls it in that process
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert dsched.devices.first_visible_gpu() is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert dsched.devices.first_visible_gpu() is None


@pytest.mark.gpu
def test_real_gpu_uuids_resolve_through_nvml():
    import pynvml

    pynvml.nvmlInit()
    try:
        uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
    finally:
        pynvml.nvmlShutdown()
    uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
    last = len(uuids) - 1
    assert dsched.devices.visible_physical_indices(f"{uuids[last]},0") == [last, 0]
