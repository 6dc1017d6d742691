"""Batched submission: chunks admitted beyond a device's threads travel as one task (a pack), and
each chunk's completion, failure, progress and timing stay its own."""

import threading

import numpy as np
import pytest

import dsched

FIRST_SEEN = threading.Event()  # set by the test when the first chunk's completion reached the client


def waits_for_the_first_to_be_seen(work, device):
    if work[0] > 0:
        assert FIRST_SEEN.wait(30), "the first chunk's completion never reached the client"
    return work * 2


def fails_at_300(work, device):
    if work[0] == 300:
        raise dsched.RecoverableError("no convergence at 300")
    return work * 2


@pytest.fixture(autouse=True, scope="module")
def no_feeds():
    """Packs are how chunks travel where there are no device feeds (dsched.feeds off, remote workers)."""
    import dask

    with dask.config.set({"dsched.feeds": False}):
        yield


@pytest.fixture(scope="module")
def one_thread_client():
    """One CPU worker with one thread: every chunk admitted beyond the first is packed."""
    from distributed import Client

    with dsched.LocalHybridCluster(["cpu"], threads_per_worker=1, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield client


def pack_keys(client):
    return client.run_on_scheduler(
        lambda dask_scheduler: sorted(str(k) for k in dask_scheduler.tasks if "-pack" in str(k)))


def test_chunks_beyond_the_threads_travel_as_packs_and_report_one_by_one(one_thread_client):
    FIRST_SEEN.clear()
    seen, packs = [], []

    def progress(record):
        if not seen:
            packs.extend(pack_keys(one_thread_client))
        seen.append(record.index)
        FIRST_SEEN.set()

    scheduler = dsched.SimpleScheduler("cpu", 100, capacity=1000)
    x = np.arange(1000.0)
    # Declared outputs: every chunk writes in place, so all ten are packed into one task.
    d = dsched.WorkDispatcher(scheduler, lambda w, dev: {"y": waits_for_the_first_to_be_seen(w, dev)},
                              join="concat", client=one_thread_client, on_chunk_done=progress,
                              output_spec={"y": ((), "f8")})
    out = d.run(dsched.ArrayLoader(x))
    np.testing.assert_array_equal(out["y"], x * 2)
    assert sorted(seen) == list(range(10))  # every chunk reported, the first while its pack still ran
    assert len(packs) == 1 and packs[0].endswith("-0-pack10")  # all ten in one task
    records = d.last_run.records
    assert all(r.worker is not None and r.start <= r.stop for r in records)
    assert [r.offset for r in records] == list(range(0, 1000, 100))
    assert records[0].stop <= records[1].start  # one after another in the pack
    assert [s.load for s in scheduler.status()] == [0]


def test_a_failure_inside_a_pack_loses_only_that_chunk(one_thread_client):
    scheduler = dsched.SimpleScheduler("cpu", 100, capacity=1000)
    d = dsched.WorkDispatcher(scheduler, lambda w, dev: {"y": fails_at_300(w, dev)}, join="concat",
                              client=one_thread_client, output_spec={"y": ((), "f8")})
    x = np.arange(1000.0)
    with pytest.raises(dsched.RecoverableError, match="no convergence at 300"):
        d.run(dsched.ArrayLoader(x))
    records = d.last_run.records
    assert [r.index for r in records if r.error is not None] == [3]
    out = d.last_run.output["y"]
    assert np.isnan(out[300:400]).all()
    kept = np.r_[0:300, 400:1000]
    np.testing.assert_array_equal(out[kept], x[kept] * 2)  # the pack's other chunks were written
    assert [s.load for s in scheduler.status()] == [0]


def test_results_without_a_join_come_back_in_order_from_packs(one_thread_client):
    scheduler = dsched.SimpleScheduler("cpu", 7, capacity=70)
    d = dsched.WorkDispatcher(scheduler, lambda w, dev: (w.start, w.stop), client=one_thread_client)
    assert d.run(dsched.SliceGenerator(0, 50)) == [(i, min(i + 7, 50)) for i in range(0, 50, 7)]


class LearningScheduler(dsched.SimpleScheduler):
    """A SimpleScheduler that records what the dispatcher tells it of each chunk's time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.observed = []

    def observe(self, device, n, seconds):
        self.observed.append((str(device), n, seconds))


def test_a_policy_that_learns_is_told_each_chunks_time(one_thread_client):
    scheduler = LearningScheduler("cpu", 100, capacity=300)
    d = dsched.WorkDispatcher(scheduler, lambda w, dev: w + 1, join="concat", client=one_thread_client)
    d.run(dsched.ArrayLoader(np.arange(1000.0)))
    assert sorted(n for _, n, _ in scheduler.observed) == [100] * 10
    assert all(device == "cpu" and seconds > 0 for device, _, seconds in scheduler.observed)


def test_batched_submission_can_be_turned_off(one_thread_client):
    from dask import config

    scheduler = dsched.SimpleScheduler("cpu", 100, capacity=1000)
    with config.set({"dsched.batched-submission": False}):
        keys = []
        # This run's packs only: an earlier test's may still be on the scheduler, released but not yet forgotten.
        d = dsched.WorkDispatcher(scheduler, lambda w, dev: {"y": w}, join="concat", client=one_thread_client,
                                  on_chunk_done=lambda r: keys.extend(
                                      k for k in pack_keys(one_thread_client)
                                      if k.startswith(f"dsched-{d._program.dispatcher_id[:8]}-")),
                                  output_spec={"y": ((), "f8")})
        d.run(dsched.ArrayLoader(np.arange(1000.0)))
    assert keys == []
