"""The steady path (dsched.dispatch.steady): a dispatcher's next run after one that went over fast lanes alone.

On worker processes (cpu and an emulated cuda:0, a CPU process claiming the device), without the dashboard so
that runs park their feeds. Each test first runs a call the full way, then checks what the next like call does
on the steady path: the same chunks and results, a failed chunk, a worker killed mid-run, Ctrl-C, a cancel, and
the cases that send a run back the full way; with the dashboard on, the page counting every steady call.
"""

import os
import signal
import time
from concurrent.futures import CancelledError

import numpy as np
import pytest
from distributed import Client

import dsched
from chunk_models import chunks_of, fail_on_negatives, runs_taking, triple
from dsched.devices.ownership import cluster_info
from dsched.dispatch import steady
from dsched.dispatch.parking import release_parked

WAIT_LIMIT = 60


@pytest.fixture
def client(process_client):
    """The module's worker processes (conftest's ``process_client``)."""
    return process_client


@pytest.fixture
def steady_runs(monkeypatch):
    """The runs that took the steady path."""
    return runs_taking(monkeypatch, steady.SteadyRun)


def scheduler():
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[100, 300], capacities=[200, 600])


def test_a_like_run_takes_the_steady_path_with_the_same_chunks_and_results(client, steady_runs):
    d = dsched.WorkDispatcher(scheduler(), triple, join="concat", client=client)
    x = np.arange(2000.0)
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 3 * x)
    assert d._steady is not None and steady_runs == []
    for k in range(3):
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x + k)), 3 * (x + k))
        chunks = chunks_of(d.last_run)  # which device takes which chunk follows the completions: sizes do not
        assert [offset for _, offset, _ in chunks] == list(np.cumsum([0] + [n for *_, n in chunks[:-1]]))
        assert sum(n for *_, n in chunks) == 2000
        assert {(device, n) for device, _, n in chunks[:-1]} <= {("cpu", 100), ("cuda:0", 300)}
    assert len(steady_runs) == 3
    assert [s.load for s in d.scheduler.status()] == [0, 0]


def test_dispatch_calls_in_a_loop_ride_the_steady_path(client, steady_runs):
    s = scheduler()
    state = np.arange(1000.0)
    for _ in range(4):
        state = dsched.dispatch(lambda v: v + 1.0, state, scheduler=s, client=client)
    assert len(steady_runs) == 0  # a lambda made anew each iteration is a new function: never alike
    step = lambda v: v + 1.0  # noqa: E731
    for _ in range(4):
        state = dsched.dispatch(step, state, scheduler=s, client=client)
    np.testing.assert_array_equal(state, np.arange(1000.0) + 8)
    assert len(steady_runs) == 3  # every call after the first


def test_a_larger_batch_after_one_that_used_one_device_starts_the_other_the_full_way(client, steady_runs):
    # The first run's 80 items are one cpu chunk: its path has a feed on cpu alone. The next run's policy also
    # picks cuda:0, which that path has no feed for: the steady run sends what it can, the full way runs the rest
    # (and leaves no path: the run after goes the full way and leaves one over both devices).
    step = lambda v: v + 1.0  # noqa: E731
    s = scheduler()
    np.testing.assert_array_equal(dsched.dispatch(step, np.arange(80.0), scheduler=s, client=client),
                                  np.arange(80.0) + 1)
    x = np.arange(1000.0)
    for _ in range(3):
        np.testing.assert_array_equal(dsched.dispatch(step, x, scheduler=s, client=client), x + 1)
    assert len(steady_runs) == 2  # the second call's (cuda:0's chunks left to the full way) and the fourth's
    assert {device for device, *_ in chunks_of(steady_runs[0].report)} == {"cpu"}
    assert {device for device, *_ in chunks_of(steady_runs[-1].report)} == {"cpu", "cuda:0"}
    assert [s.load for s in s.status()] == [0, 0]


def test_a_failed_chunk_keeps_the_others_and_the_path_comes_back(client, steady_runs):
    d = dsched.WorkDispatcher(scheduler(), fail_on_negatives, join="concat", client=client)
    x = np.arange(1000.0)
    d.run(dsched.ArrayLoader(x))
    bad = x.copy()
    bad[450] = -1.0
    with pytest.raises(ValueError, match="negative items at") as caught:
        d.run(dsched.ArrayLoader(bad))
    [failed] = [r for r in d.last_run.records if r.error is not None]
    assert failed.offset <= 450 < failed.offset + failed.size
    assert str(caught.value).startswith(f"negative items at {450 - failed.offset}")
    assert any(f"items {failed.offset}-{failed.offset + failed.size - 1}) failed" in note
               for note in caught.value.__notes__)
    out = d.last_run.output
    for r in d.last_run.records:  # the failed chunk's rows are NaN, the others' results are kept
        rows = out[r.offset:r.offset + r.size]
        assert np.isnan(rows).all() if r is failed else np.array_equal(rows, 2 * x[r.offset:r.offset + r.size])
    # A failed run has the next look at the cluster again (a worker may have left): the full way, then steady.
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 2 * x)
    assert len(steady_runs) == 1
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 2 * x)
    assert len(steady_runs) == 2 and [s.load for s in d.scheduler.status()] == [0, 0]


def test_released_feeds_send_the_next_run_the_full_way(client, steady_runs):
    d = dsched.WorkDispatcher(scheduler(), triple, join="concat", client=client)
    x = np.arange(1000.0)
    d.run(dsched.ArrayLoader(x))
    release_parked(client)  # the feeds the path names are gone
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 3 * x)
    assert steady_runs == [] and d._steady is not None  # a full run, which left a path again
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 3 * x)
    assert len(steady_runs) == 1


def test_ctrl_c_in_a_steady_run_cancels_and_gives_the_loads_back(client, steady_runs, tmp_path):
    flag = str(tmp_path / "release")

    def wait_past_the_first_chunk(work, device):
        if work[0] >= 100:
            deadline = time.monotonic() + WAIT_LIMIT
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.005)
        return work

    interrupt = []

    def interrupt_when_asked(record):
        if interrupt:
            raise KeyboardInterrupt

    s = dsched.SimpleScheduler("cpu", 100, capacity=1000)
    d = dsched.WorkDispatcher(s, wait_past_the_first_chunk, join="concat", client=client,
                              on_chunk_done=interrupt_when_asked)
    x = np.arange(1000.0)
    open(flag, "w").close()
    d.run(dsched.ArrayLoader(x))  # the full way, every chunk released
    os.remove(flag)
    interrupt.append(True)
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            d.run(dsched.ArrayLoader(x))
        assert time.monotonic() - start < WAIT_LIMIT / 2  # not waiting on the blocked chunks
    finally:
        open(flag, "w").close()
    assert len(steady_runs) == 1 and d._steady is None
    assert [st.load for st in s.status()] == [0]
    interrupt.clear()
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), x)  # the devices run the next call


def test_cancel_of_a_submitted_steady_call(client, steady_runs, tmp_path):
    flag = str(tmp_path / "release")
    s = dsched.SimpleScheduler("cpu", 5)

    def wait_for_file(x, path):
        open(path + ".started", "w").close()
        deadline = time.monotonic() + WAIT_LIMIT
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.005)
        return x + 1.0

    open(flag, "w").close()  # the first call the full way, on the scheduler's thread, as the next
    np.testing.assert_array_equal(dsched.submit(wait_for_file, np.zeros(10), scheduler=s, client=client,
                                                path=flag).result(timeout=WAIT_LIMIT), np.ones(10))
    os.remove(flag)
    os.remove(flag + ".started")
    running = dsched.submit(wait_for_file, np.zeros(10), scheduler=s, client=client, path=flag)
    deadline = time.monotonic() + WAIT_LIMIT
    while not os.path.exists(flag + ".started") and time.monotonic() < deadline:
        time.sleep(0.005)
    assert running.cancel()
    with pytest.raises(CancelledError):
        running.result(timeout=WAIT_LIMIT)
    open(flag, "w").close()
    assert len(steady_runs) == 1 and s.status()[0].load == 0
    np.testing.assert_array_equal(dsched.submit(wait_for_file, np.zeros(10), scheduler=s, client=client,
                                                path=flag).result(timeout=WAIT_LIMIT), np.ones(10))


def sleepy_double(work, device):
    time.sleep(work.shape[0] * 2e-5)
    return 2.0 * work


def _kill(client, device) -> str:
    [address] = [a for a, w in cluster_info(client)["workers"].items() if f"dsched-{device}" in w["resources"]]
    os.kill(client.run(os.getpid, workers=[address])[address], signal.SIGKILL)
    return address


def test_a_worker_killed_in_a_steady_run_costs_only_its_chunks(client, steady_runs):
    """Its lane breaks: the chunks it held run again the full way, into the same outputs."""
    killed = []

    def kill_once(record):
        if steady_runs and not killed and str(record.device) == "cpu" and record.index > 10:
            killed.append(_kill(client, "cuda:0"))

    d = dsched.WorkDispatcher(dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=100, capacities=200),
                              sleepy_double, join="concat", client=client, on_chunk_done=kill_once)
    x = np.arange(20_000.0)
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 2 * x)
    out = d.run(dsched.ArrayLoader(x + 1))  # the parked feeds are this thread's: the run stays on it
    assert killed and len(steady_runs) == 1
    np.testing.assert_array_equal(out, 2 * (x + 1))
    assert d._steady is None or d._steady.generation is not steady_runs[0]  # dropped: a lane was lost
    assert [s.load for s in d.scheduler.status()] == [0, 0]


@pytest.fixture(scope="module")
def dashboard_client():
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                   dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as c:
        yield c


def _page(client) -> dict:
    import json
    import urllib.request

    from dsched.dashboard import JSON_ROUTE

    port = client.scheduler_info()["services"]["dashboard"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{JSON_ROUTE}", timeout=10) as response:
        return json.load(response)


def test_with_the_dashboard_on_the_page_counts_every_steady_call(dashboard_client, steady_runs):
    """The page hears of each call's chunks and total off the call's path; flush_page waits until it has."""
    from dsched.dashboard import flush_page

    client = dashboard_client
    s = scheduler()
    step = lambda v: v + 1.0  # noqa: E731
    state = np.arange(1000.0)
    flush_page(client)
    before = {row["device"]: row["items_done"] for row in _page(client)["devices"]}
    for _ in range(5):
        state = dsched.dispatch(step, state, scheduler=s, client=client)
    np.testing.assert_array_equal(state, np.arange(1000.0) + 5)
    assert len(steady_runs) == 4
    flush_page(client)
    page = _page(client)
    done = {row["device"]: row["items_done"] - before[row["device"]] for row in page["devices"]}
    assert sum(done.values()) == 5000 and all(row["chunks_in_flight"] == 0 for row in page["devices"])
    assert (page["run"]["total"], page["run"]["items_done"]) == (1000, 1000)  # the last call's, its own total


def test_the_steady_path_can_be_turned_off(client, steady_runs):
    import dask

    d = dsched.WorkDispatcher(scheduler(), triple, join="concat", client=client)
    x = np.arange(1000.0)
    with dask.config.set({"dsched.steady-path": False}):
        for _ in range(3):
            np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 3 * x)
    assert steady_runs == []
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 3 * x)
    assert len(steady_runs) == 1
