"""Faults inside a run: chunks over their timeout, devices that lose every worker, and re-running what failed.

The CUDA device is emulated (a worker claiming cuda:0 that computes with NumPy): these tests check
the dispatcher's handling of faults, not a GPU.
"""

import threading
import time
import warnings

import numpy as np
import pytest

import dsched
from dsched import ChunkTimeoutError
from dsched.placement import PlacementWarning

released = threading.Event()  # blocked models wait on it; set by the test once the run has returned


def block_on_item_300(work, device):
    if work[0] == 300:
        released.wait(60)
    return work * 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_chunk_over_its_timeout_fails_recoverably_and_gives_its_load_back(hybrid_client, mode):
    released.clear()
    scheduler = dsched.SimpleScheduler("cpu", 100, capacity=200)
    d = dsched.WorkDispatcher(scheduler, block_on_item_300, join="concat", client=hybrid_client, mode=mode,
                              timeout=0.5)
    try:
        with pytest.raises(ChunkTimeoutError, match=r"chunk 3 on cpu ran over its timeout of 0.5 s") as info:
            d.run(dsched.ArrayLoader(np.arange(1000.0)))
        assert not released.is_set()  # the run returned while the model was still blocked
    finally:
        released.set()
    assert info.value.recoverable
    assert [s.load for s in scheduler.status()] == [0]
    output = d.last_run.output
    assert np.isnan(output[300:400]).all()
    np.testing.assert_array_equal(output[:300], np.arange(300.0) * 2)


def test_timeout_is_validated():
    with pytest.raises(ValueError, match=r"timeout: expected a positive number of seconds, got -1"):
        dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 1), lambda w, d: w, timeout=-1)


FAILED_ONCE = set()  # module state: in-process workers call these module functions by reference


def fail_once_at_200(work, device):
    if work[0] == 200 and 200 not in FAILED_ONCE:
        FAILED_ONCE.add(200)
        raise dsched.RecoverableError("no convergence at 200")
    return work + 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_run_failed_reruns_only_what_was_left_undone(hybrid_client, mode):
    FAILED_ONCE.clear()
    x = np.arange(1000.0)
    d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 100), fail_once_at_200, join="concat",
                              client=hybrid_client, mode=mode)
    with pytest.raises(dsched.RecoverableError):
        d.run(dsched.ArrayLoader(x))
    succeeded = {r.offset for r in d.last_run.records if r.error is None}
    out = d.run_failed()
    np.testing.assert_array_equal(out, x + 1)
    # The chunks that succeeded did not run again; the failed one and those never dispatched did.
    rerun = [r.offset for r in d.last_run.records]
    assert sorted(rerun) == sorted(set(range(0, 1000, 100)) - succeeded)
    assert 200 in rerun
    assert d.run_failed() is out  # nothing left undone


def test_run_failed_without_a_join_returns_the_new_results(hybrid_client):
    FAILED_ONCE.clear()
    d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 100), fail_once_at_200, client=hybrid_client,
                              mode="sync")
    with pytest.raises(dsched.RecoverableError):
        d.run(dsched.ArrayLoader(np.arange(300.0)))
    again = d.run_failed()
    assert [a[0] for a in again] == [201.0]


def test_run_failed_before_any_run():
    with pytest.raises(RuntimeError, match="run_failed: this dispatcher has not run yet"):
        dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 1), lambda w, d: w).run_failed()


def slow_double(work, device):
    time.sleep(0.05)
    return work * 2


def test_a_lost_device_runs_its_chunks_elsewhere(monkeypatch):
    """The emulated cuda:0's only worker is closed mid-run: its chunks move to the CPU, with a warning."""
    from dask import config
    from distributed import Client

    with config.set({"dsched.lost-device-timeout": 0.3}):
        with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                       dashboard_address=None) as cluster, Client(cluster) as client:
            gpu_nanny = next(w for name, w in cluster.workers.items() if "cuda" in str(name))
            closed = []

            def close_gpu_worker(record):
                if not closed and str(record.device) == "cuda:0":
                    closed.append(record.index)
                    cluster.sync(gpu_nanny.close)

            scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[20, 50],
                                                     capacities=[40, 100], priorities=[1, 2])
            d = dsched.WorkDispatcher(scheduler, slow_double, join="concat", client=client,
                                      on_chunk_done=close_gpu_worker)
            x = np.arange(2000.0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = d.run(dsched.ArrayLoader(x))
            np.testing.assert_array_equal(out, x * 2)
            assert closed
            messages = [str(w.message) for w in caught if issubclass(w.category, PlacementWarning)]
            assert messages == ["no worker has owned cuda:0 for 0.3 s: its chunks run on cpu until one does"]
            cpu = next(a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w["name"] == "cpu")
            late = [r for r in d.last_run.records if r.index > closed[0] + 2 and str(r.device) == "cuda:0"]
            assert late and all(r.worker == cpu for r in late)  # scheduled on cuda:0, ran on the CPU worker
            assert [s.load for s in scheduler.status()] == [0, 0]


def block_after_the_first_chunk(work, device):
    if work[0] >= 100:
        released.wait(60)
    return work


def test_interrupt_cancels_everything_in_one_call(hybrid_client):
    """Ctrl-C inside a run: every chunk out is cancelled at once and the loads come back."""
    released.clear()
    scheduler = dsched.SimpleScheduler("cpu", 100, capacity=1000)

    def interrupt(record):
        raise KeyboardInterrupt

    d = dsched.WorkDispatcher(scheduler, block_after_the_first_chunk, join="concat", client=hybrid_client, on_chunk_done=interrupt)
    try:
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            d.run(dsched.ArrayLoader(np.arange(1000.0)))
        assert time.monotonic() - start < 30  # not waiting on the blocked chunks (they block for 60 s)
    finally:
        released.set()
    assert [s.load for s in scheduler.status()] == [0]
