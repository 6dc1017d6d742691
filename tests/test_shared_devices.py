"""Several client processes share one set of device workers (examples/shared_devices.py's clients).

The workers' capacities (cpu 4 items, cuda:0 8 items) are below what the
clients together keep in flight (each client: 8 and 16), and the workers
have threads for more, so only the device resource can hold the items
executing on a device at the capacity. The concurrency is computed from the
recorded start and stop of every chunk of every client.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from distributed import Event

from dsched import LocalHybridCluster, StaticHybridScheduler, WorkDispatcher, concat_reduce
from dsched.devices import device_of_resources
from dsched.models import j2_chunk
from dsched.work import SliceGenerator

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "shared_devices.py"
CAPACITIES = {"cpu": 4, "cuda:0": 8}
CHUNK_SECONDS = 0.02


def _load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shared_devices_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The example's sweep: the tests check it (below) and then use it on every client's records.
peak_items = _load_example().peak_items_in_flight


def test_peak_items_counts_overlaps_and_not_touching_intervals():
    records = [
        {"worker": "w", "size": 2, "start": 0.0, "stop": 1.0},
        {"worker": "w", "size": 3, "start": 0.5, "stop": 2.0},
        {"worker": "w", "size": 4, "start": 1.0, "stop": 1.5},  # starts as the first stops
        {"worker": "v", "size": 1, "start": 0.0, "stop": 1.0},
        {"worker": "v", "size": 1, "start": 1.0, "stop": 2.0},
    ]
    assert peak_items(records) == {"w": 7, "v": 1}


@pytest.fixture(scope="module")
def shared_cluster():
    """cpu + emulated cuda:0 with worker capacities below the clients' demand; tcp so other processes connect."""
    from distributed import Client

    with LocalHybridCluster(["cpu", "cuda:0"], emulate=True, capacities=CAPACITIES, threads_per_worker=4,
                            protocol="tcp://", dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield cluster, client


def _client(cluster, first, points, out, start_on=None):
    command = [sys.executable, str(EXAMPLE), "client", "--scheduler", cluster.scheduler_address,
               "--first", str(first), "--points", str(points), "--chunk-seconds", str(CHUNK_SECONDS),
               "--devices", "cpu,cuda:0", "--batch-sizes", "2,4", "--client-capacities", "8,16", "--out", str(out)]
    command += ["--start-on", start_on] if start_on else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _owners(client) -> dict:
    """``{worker address: device}`` from the workers' resources."""
    return {a: str(device_of_resources(w["resources"])) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}


def _check_client_output(out, first, points, owners) -> list:
    """The client's records; asserts its result is exactly its own points' and every chunk ran on its device's worker."""
    with open(f"{out}.json") as f:
        report = json.load(f)
    records = report["records"]
    assert [r["index"] for r in records] == list(range(len(records)))
    assert sum(r["size"] for r in records) == points
    for r in records:
        assert owners[r["worker"]] == r["device"], r
        assert r["stop"] >= r["start"] > 0
    want = j2_chunk(slice(first, first + points))
    with np.load(f"{out}.npz") as got:
        assert sorted(got.files) == sorted(want)
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-12, atol=0, err_msg=key)
    return records


@pytest.fixture
def clients():
    """Starts client processes; kills any still running when the test ends (passed or failed)."""
    started = []

    def start(cluster, first, points, out, start_on=None):
        proc = _client(cluster, first, points, out, start_on)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def _wait(procs, timeout=120):
    outputs = []
    for proc in procs:
        output, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, output
        outputs.append(output)
    return outputs


def test_three_clients_share_devices_within_capacity(shared_cluster, clients, tmp_path):
    cluster, client = shared_cluster
    owners = _owners(client)
    points = 300
    outs = [tmp_path / f"client{i}" for i in range(3)]
    # The clients start their runs together, once all three are connected: a process that starts
    # late (imports on a loaded machine) must not find the others done.
    go = f"test-go-{uuid.uuid4().hex}"
    procs = [clients(cluster, i * points, points, outs[i], start_on=go) for i in range(3)]
    for proc in procs:
        for line in proc.stdout:
            if line.startswith("waiting for"):
                break
        else:
            pytest.fail(f"client {proc.pid} ended before it was ready")
    Event(go, client=client).set()
    _wait(procs)
    per_client = [_check_client_output(out, i * points, points, owners) for i, out in enumerate(outs)]
    records = [r for mine in per_client for r in mine]
    assert {r["device"] for r in records} == {"cpu", "cuda:0"}
    peaks = {owners[w]: peak for w, peak in peak_items(records).items()}
    # Never above the worker's capacity, and the workers were saturated (demand was far above it).
    assert peaks == CAPACITIES
    # The clients really overlapped: each one's run intersects the others'.
    spans = [(min(r["start"] for r in mine), max(r["stop"] for r in mine)) for mine in per_client]
    assert max(start for start, _ in spans) < min(stop for _, stop in spans)


def _lines(proc, sink):
    for line in proc.stdout:
        sink.put((proc.pid, line))


def test_a_client_killed_mid_run_loses_nothing_for_the_others(shared_cluster, clients, tmp_path):
    cluster, client = shared_cluster
    owners = _owners(client)
    victim = clients(cluster, 10_000, 5_000, tmp_path / "victim")  # far more work than the test waits for
    survivors = [clients(cluster, i * 600, 600, tmp_path / f"survivor{i}") for i in range(2)]
    lines = queue.Queue()
    readers = [threading.Thread(target=_lines, args=(p, lines), daemon=True) for p in [victim, *survivors]]
    for t in readers:
        t.start()
    started, deadline = set(), time.monotonic() + 60
    while started != {p.pid for p in [victim, *survivors]}:  # every client has finished a chunk
        try:
            pid, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            pytest.fail("the clients did not all start within 60 s")
        if line.startswith("first chunk done"):
            started.add(pid)
    victim.kill()
    killed_at = time.time()
    victim.wait(timeout=10)
    for proc in survivors:
        assert proc.wait(timeout=120) == 0
    for t in readers:
        t.join(timeout=10)

    records = []
    for i in range(2):
        mine = _check_client_output(tmp_path / f"survivor{i}", i * 600, 600, owners)
        assert max(r["stop"] for r in mine) > killed_at  # it was still running when the victim died
        records += mine
    assert all(peak <= CAPACITIES[owners[w]] for w, peak in peak_items(records).items())
    assert not (tmp_path / "victim.json").exists()

    # The scheduler forgets the dead client and its tasks, and every worker gets its whole device back.
    def settled():
        tasks = client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks))
        resources = client.run(lambda dask_worker: (dict(dask_worker.state.available_resources),
                                                    dict(dask_worker.state.total_resources)))
        return tasks == 0 and all(free == total for free, total in resources.values())

    deadline = time.monotonic() + 60
    while not settled():
        assert time.monotonic() < deadline, "the victim's chunks were never released"
        time.sleep(0.2)

    # And it keeps serving.
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], [2, 4], [4, 8], [1, 2])
    result = WorkDispatcher(scheduler, j2_chunk, reduce=concat_reduce, client=client).run(SliceGenerator(0, 200))
    np.testing.assert_allclose(result["stress"], j2_chunk(slice(0, 200))["stress"], rtol=1e-12, atol=0)
