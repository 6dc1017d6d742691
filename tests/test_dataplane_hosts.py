"""The data plane across hosts, for real: a worker on a second "host" (its own network namespace on a
bridge, and its own /dev/shm) cannot map the client's memory, so its chunks get their slices straight
from the client and send their results straight back, never through the scheduler.

Needs root and iproute2 (skipped otherwise). The remote worker claims an emulated cuda:0 (NumPy on
the CPU): this tests data movement between hosts, not a GPU.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dsched
from dsched.store import classify_workers

ROOT = Path(__file__).resolve().parents[1]
BRIDGE, NAMESPACE, VETH = "dsdp-br", "dsdp-n1", "dsdp-v1"
HOST_IP, NODE_IP = "10.213.47.1", "10.213.47.11"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
    reason="needs root, iproute2 and unshare to make a second host",
)


def sh(*commands):
    for command in commands:
        subprocess.run(command, shell=True, check=True, capture_output=True)


def teardown_network():
    for command in (f"ip netns del {NAMESPACE}", f"ip link del {VETH}", f"ip link del {BRIDGE}"):
        subprocess.run(command, shell=True, capture_output=True)


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_host_client(tmp_path_factory):
    """A scheduler and a CPU worker on this host; an emulated cuda:0 worker on a second host."""
    from distributed import Client

    teardown_network()
    sh(f"ip link add {BRIDGE} type bridge", f"ip addr add {HOST_IP}/24 dev {BRIDGE}", f"ip link set {BRIDGE} up",
       f"ip netns add {NAMESPACE}", f"ip link add {VETH} type veth peer name {VETH}p",
       f"ip link set {VETH}p netns {NAMESPACE}", f"ip link set {VETH} master {BRIDGE}", f"ip link set {VETH} up",
       f"ip netns exec {NAMESPACE} ip addr add {NODE_IP}/24 dev {VETH}p",
       f"ip netns exec {NAMESPACE} ip link set {VETH}p up", f"ip netns exec {NAMESPACE} ip link set lo up")
    tmp = tmp_path_factory.mktemp("two-hosts")
    scheduler_file = tmp / "scheduler.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    log = open(tmp / "cluster.log", "w")
    dask = [sys.executable, "-m", "dask"]
    processes = []
    try:
        processes.append(subprocess.Popen(
            dask + ["scheduler", "--host", HOST_IP, "--port", "0", "--no-dashboard", "--scheduler-file",
                    str(scheduler_file), "--preload", "plugins/dsched_scheduler.py"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        wait_for(lambda: scheduler_file.exists() and json.loads(scheduler_file.read_text() or "{}").get("address"),
                 60, "the scheduler")
        address = json.loads(scheduler_file.read_text())["address"]
        common = ["--nthreads", "1", "--no-dashboard", "--preload", "plugins/dsched_worker.py"]
        processes.append(subprocess.Popen(
            dask + ["worker", address, "--host", HOST_IP, "--name", "cpu", "--resources", "dsched-cpu=1000000",
                    *common], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        remote = " ".join(dask + ["worker", address, "--host", NODE_IP, "--name", "cuda:0", "--dsched-device",
                                  "cuda:0", "--dsched-emulate", "--dsched-capacity", "100000", *common])
        # Its own mount namespace with a private /dev/shm: it shares neither network nor memory with us.
        processes.append(subprocess.Popen(
            ["ip", "netns", "exec", NAMESPACE, "unshare", "-m", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs none /dev/shm && exec {remote}"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        with Client(address, timeout=30) as client:
            client.wait_for_workers(2, timeout=60)
            yield client
            client.shutdown()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        log.close()
        teardown_network()


def test_workers_are_classified_by_what_they_can_map(two_host_client):
    workers = two_host_client.scheduler_info(n_workers=-1)["workers"]
    kinds = classify_workers(two_host_client, list(workers))
    assert {workers[a]["name"]: kind for a, kind in kinds.items()} == {"cpu": "host", "cuda:0": "remote"}


def test_remote_chunks_travel_straight_from_the_client(two_host_client):
    rng = np.random.default_rng(3)
    x, b = rng.normal(size=(20_000, 3)), rng.normal(size=(20_000, 3))
    sizes = {}

    def record_task_sizes(_):
        sizes.update(two_host_client.run_on_scheduler(_dsched_task_sizes))

    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[2000, 5000], capacities=[4000, 10000])
    layout_args = (x, {"b": b})
    d = dsched.WorkDispatcher(scheduler, _affine_chunk, join="concat", client=two_host_client,
                              on_chunk_done=record_task_sizes)
    out = d.run(dsched.MappingLoader({"x": layout_args[0], "b": layout_args[1]["b"]}))
    np.testing.assert_array_equal(out["y"], 2.0 * x + b)
    devices = {str(r.device) for r in d.last_run.records}
    assert devices == {"cpu", "cuda:0"}  # both hosts took part
    assert sizes and max(sizes.values()) <= 1024, sizes  # the scheduler never held a slice


def _affine_chunk(work, device):
    return {"y": 2.0 * work["x"] + work["b"]}


def _dsched_task_sizes(dask_scheduler):
    return {str(k): len(pickle.dumps(ts.run_spec, protocol=5))
            for k, ts in dask_scheduler.tasks.items() if str(k).startswith("dsched-")}
