"""The observer interface: every hook of dsched.observe.RunObserver, in order, on sync and async runs."""

import numpy as np
import pytest

import dsched
from dsched.observe.hooks import Observers, RunObserver, RunStart


class Recorder(RunObserver):
    """Writes down every hook call, with what it was given."""

    def __init__(self):
        self.calls = []

    def run_started(self, run):
        self.calls.append(("run_started", run))

    def work_scheduled(self, choice, start, stop):
        assert start <= stop
        self.calls.append(("work_scheduled", None if choice is None else (str(choice[0]), choice[1])))

    def work_dispatched(self, device, n, start, stop):
        assert start <= stop
        self.calls.append(("work_dispatched", (str(device), n)))

    def chunk_completed(self, record):
        self.calls.append(("chunk_completed", (record.index, record.size, record.error is None)))

    def run_finished(self, report):
        self.calls.append(("run_finished", len(report.records)))

    def names(self):
        return [name for name, _ in self.calls]


def _sizes(work, device):
    return work.stop - work.start


def test_a_sync_run_calls_each_hook_in_order():
    recorder = Recorder()
    d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 4), _sizes, mode="sync", observers=[recorder])
    assert d.run(dsched.SliceGenerator(0, 10)) == [4, 4, 2]
    name, start = recorder.calls[0]
    assert name == "run_started" and isinstance(start, RunStart)
    assert (start.mode, start.total, start.client) == ("sync", 10, None)
    assert start.run_id.startswith("dsched-")
    # sync mode does no load accounting, so nothing is dispatched to the policy
    assert recorder.calls[1:] == [
        ("work_scheduled", ("cpu", 4)), ("chunk_completed", (0, 4, True)),
        ("work_scheduled", ("cpu", 4)), ("chunk_completed", (1, 4, True)),
        ("work_scheduled", ("cpu", 4)), ("chunk_completed", (2, 2, True)),
        ("run_finished", 3),
    ]


def test_an_async_run_tells_every_chunk_once_and_its_client(hybrid_client):
    recorder = Recorder()
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 5])
    d = dsched.WorkDispatcher(s, _sizes, client=hybrid_client, observers=[recorder])
    results = d.run(dsched.SliceGenerator(0, 40))
    assert sum(results) == 40
    start = recorder.calls[0][1]
    assert (start.mode, start.total, start.client) == ("async", 40, hybrid_client)
    dispatched = [args for name, args in recorder.calls if name == "work_dispatched"]
    completed = sorted(args for name, args in recorder.calls if name == "chunk_completed")
    assert dispatched == [(str(r.device), r.size) for r in d.last_run.records]
    assert completed == [(r.index, r.size, True) for r in d.last_run.records]
    # every choice the policy made was dispatched (the last chunk may be short); a None is a round with no room
    choices = [args for name, args in recorder.calls if name == "work_scheduled" and args is not None]
    assert [device for device, _ in choices] == [device for device, _ in dispatched]
    assert all(n >= m for (_, n), (_, m) in zip(choices, dispatched))
    assert recorder.names()[-1] == "run_finished"


def _fail_the_second(work, device):
    if work.start == 4:
        raise ValueError("chunk 1 fails")
    return work.stop - work.start


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_chunk_is_completed_with_its_error_and_the_run_still_finishes(mode, hybrid_client):
    recorder = Recorder()
    d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 4), _fail_the_second, mode=mode,
                              client=hybrid_client if mode == "async" else None, observers=[recorder])
    with pytest.raises(ValueError, match="chunk 1 fails"):
        d.run(dsched.SliceGenerator(0, 12))
    completed = {args[0]: args[2] for name, args in recorder.calls if name == "chunk_completed"}
    assert completed[1] is False
    assert recorder.names()[-1] == "run_finished"


def test_progress_callbacks_hear_only_chunks_that_succeeded():
    seen = []
    d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 4), _fail_the_second, mode="sync",
                              on_chunk_done=lambda record: seen.append(record.index))
    with pytest.raises(ValueError):
        d.run(dsched.SliceGenerator(0, 12))
    assert seen == [0]


def test_dispatch_accepts_observers_through_its_dispatcher():
    recorder = Recorder()
    d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 5), lambda w, dev: np.ones(w.stop - w.start),
                              mode="sync", join="concat", observers=[recorder])
    out = d.run(dsched.SliceGenerator(0, 12))
    assert out.tolist() == [1.0] * 12
    assert [a for n, a in recorder.calls if n == "chunk_completed"] == [(0, 5, True), (1, 5, True), (2, 2, True)]


def test_an_observer_that_is_not_one_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"observers\[1\]: expected a dsched.observe.RunObserver, got 'trace'"):
        dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 4), _sizes, observers=[RunObserver(), "trace"])


def test_every_observer_hears_the_end_even_if_one_fails():
    class Broken(RunObserver):
        def run_finished(self, report):
            raise RuntimeError("broken observer")

    recorder = Recorder()
    observers = Observers([Broken(), recorder])
    with pytest.raises(RuntimeError, match="broken observer"):
        observers.run_finished(dsched.RunReport("sync"))
    assert recorder.calls == [("run_finished", 0)]


def test_the_base_class_hooks_do_nothing():
    observer = RunObserver()
    assert observer.run_started(None) is None
    assert observer.chunk_completed(None) is None
    assert not Observers()


def halve_or_fail_on_seven(x):
    if (x == 7.0).any():
        raise ValueError("seven")
    return x / 2


def test_run_reports_collects_what_each_dispatch_in_the_block_did(hybrid_client):
    """dispatch returns its outputs alone; ``with dsched.run_reports()`` gives each call's report, as Dask's
    get_task_stream gives its tasks: a plain call, a second call like it (which reuses the first's dispatcher), a
    failed one, and none after the block."""
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 5])
    x = np.arange(20.0) + 20  # no seven: x - 20 has one, at item 7
    with dsched.run_reports() as reports:
        first = dsched.dispatch(halve_or_fail_on_seven, x, scheduler=scheduler, client=hybrid_client)
        dsched.dispatch(halve_or_fail_on_seven, x + 10, scheduler=scheduler, client=hybrid_client)
        with pytest.raises(ValueError, match="seven"):
            dsched.dispatch(halve_or_fail_on_seven, x - 20, scheduler=scheduler, client=hybrid_client)
    dsched.dispatch(halve_or_fail_on_seven, x, scheduler=scheduler, client=hybrid_client)
    np.testing.assert_array_equal(first, x / 2)
    assert len(reports) == 3 and [r.mode for r in reports] == ["async"] * 3
    for report in reports[:2]:
        assert report.items == 20 and report.output is None and report.results == []
        assert sorted((r.offset, r.size) for r in report.records) == [
            (r.offset, r.size) for r in sorted(report.records, key=lambda r: r.offset)]
        assert {str(r.device) for r in report.records} <= {"cpu", "cuda:0"}
        assert sum(row["items"] for row in report.by_device().values()) == 20 and report.wall_time > 0
    [failed] = [r for r in reports[2].records if r.error is not None]
    assert failed.offset <= 7 < failed.offset + failed.size and failed.device in (dsched.Device("cpu"),
                                                                                 dsched.Device("cuda:0"))
    assert reports[2].items == sum(r.size for r in reports[2].records if r.error is None) < 20  # it stopped there
