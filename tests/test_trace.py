"""Chrome trace files: NEML2's events, balanced and in time order, after success, failure and a crash."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dsched import SimpleScheduler, SliceGenerator, StaticHybridScheduler, WorkDispatcher, dispatch
from dsched.trace import (
    COMPLETED_WORK,
    DISPATCH_WORK,
    RUN,
    SCHEDULE_WORK,
    TASK,
    TRACE_WRITER,
    acquire_writer,
    check_balanced,
    read_trace,
    release_writer,
    trace_writer,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(events):
    return [e for e in events if e["ph"] != "M"]


def assert_well_formed(path):
    """Finished file: a closed JSON array, balanced per track, in time order, writer span outermost."""
    with open(path) as f:
        text = f.read()
    events = json.loads(text)  # a plain JSON array once the writer closed
    assert text.rstrip().endswith("]")
    check_balanced(events)
    stamps = [e["ts"] for e in timed(events)]
    assert stamps == sorted(stamps)
    body = timed(events)
    assert (body[0]["name"], body[0]["ph"]) == (TRACE_WRITER, "B")
    assert (body[-1]["name"], body[-1]["ph"]) == (TRACE_WRITER, "E")
    return events


def names(events, name, ph=None):
    return [e for e in events if e["name"] == name and (ph is None or e["ph"] == ph)]


def test_sync_run_writes_neml2_events_per_chunk(tmp_path):
    path = tmp_path / "sync.trace.json"
    out = dispatch(np.square, np.arange(10.0), scheduler=SimpleScheduler("cpu", 4), mode="sync", trace_file=path)
    np.testing.assert_array_equal(out, np.arange(10.0) ** 2)
    events = assert_well_formed(path)
    tasks = names(events, TASK, "B")
    assert [(e["args"]["device"], e["args"]["batch size"]) for e in tasks] == [("cpu", 4), ("cpu", 4), ("cpu", 2)]
    assert len(names(events, TASK, "E")) == 3
    assert [e["args"]["batch size"] for e in names(events, SCHEDULE_WORK, "E")] == [4, 4, 4]
    assert [e["args"]["batch size"] for e in names(events, COMPLETED_WORK)] == [4, 4, 2]
    assert names(events, DISPATCH_WORK) == []  # sync mode keeps no load accounting, as NEML2
    assert len(names(events, RUN, "B")) == len(names(events, RUN, "E")) == 1
    assert names(events, RUN, "E")[0]["args"] == {"chunks": 3, "mode": "sync"}


def test_async_run_traces_every_chunk_on_its_device_track(tmp_path, hybrid_client):
    path = tmp_path / "async.trace.json"
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 7], capacities=[6, 14], priorities=[1, 2])
    dispatcher = WorkDispatcher(scheduler, lambda w, d: w.stop - w.start, client=hybrid_client, trace_file=path)
    assert sum(dispatcher.run(SliceGenerator(0, 100))) == 100
    records = dispatcher.last_run.records
    events = assert_well_formed(path)

    dispatched = [(e["args"]["device"], e["args"]["batch size"]) for e in names(events, DISPATCH_WORK, "E")]
    assert dispatched == [(str(r.device), r.size) for r in records]  # dispatch order
    tasks = sorted(names(events, TASK, "B"), key=lambda e: e["args"]["chunk"])
    assert [(e["args"]["device"], e["args"]["batch size"], e["args"]["worker"]) for e in tasks] == [
        (str(r.device), r.size, r.worker) for r in records
    ]
    # Worker-side times, relative to the file's origin, in microseconds.
    origin = names(events, TRACE_WRITER, "B")[0]["args"]["origin"]
    for e, r in zip(tasks, records):
        assert e["ts"] == pytest.approx((r.start - origin) * 1e6, abs=1e-2)
    assert sorted((e["args"]["device"], e["args"]["batch size"]) for e in names(events, COMPLETED_WORK)) == sorted(
        (str(r.device), r.size) for r in records
    )
    # Track names say which device is emulated.
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    cuda_tids = {e["tid"] for e in tasks if e["args"]["device"] == "cuda:0"}
    assert all(lanes[t].startswith("cuda:0 (emulated) #") for t in cuda_tids)
    cpu_tids = {e["tid"] for e in tasks if e["args"]["device"] == "cpu"}
    assert all(lanes[t].startswith("cpu #") for t in cpu_tids)
    assert not cpu_tids & cuda_tids
    assert len(names(events, "all work completed")) == 1


class Boom(RuntimeError):
    pass


def _fail_at_40(work, device):
    if work.start <= 40 < work.stop:
        raise Boom(f"chunk at {work.start} failed")
    return work.stop - work.start


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trace_is_balanced_and_closed_after_a_run_that_raised(tmp_path, hybrid_client, mode):
    path = tmp_path / f"raised-{mode}.trace.json"
    dispatcher = WorkDispatcher(
        SimpleScheduler("cpu", 10, 20), _fail_at_40, mode=mode, client=hybrid_client, trace_file=path
    )
    with pytest.raises(Boom, match="chunk at 40 failed"):
        dispatcher.run(SliceGenerator(0, 100))
    events = assert_well_formed(path)
    assert len(names(events, RUN, "B")) == len(names(events, RUN, "E")) == 1
    ran = {e["args"]["chunk"] for e in names(events, TASK, "B")}
    failed = [r.index for r in dispatcher.last_run.records if r.error is not None]
    assert failed == [4]
    # The failed chunk ran, and is marked: on the calling thread (sync), or on its device feed, whose reply
    # carries a failed chunk's worker times too (async).
    bad = [e for e in names(events, TASK, "B") if e["args"]["chunk"] == 4]
    assert bad and bad[0]["args"]["error"] == "Boom: chunk at 40 failed"
    assert {0, 1, 2, 3, 4} <= ran


def test_a_crashed_process_leaves_a_readable_partial_trace(tmp_path):
    path = tmp_path / "crash.trace.json"
    script = textwrap.dedent(
        f"""
        import os
        from dsched.trace import acquire_writer
        w = acquire_writer({str(path)!r})
        w.begin("run", "demo", {{"device": "cpu"}})
        w.instant("completed work", "demo", {{"device": "cpu", "batch size": 8}})
        w._file.write('{{"name": "torn')  # a line cut short by the crash
        w._file.flush()
        os._exit(3)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": REPO}, timeout=60)
    assert proc.returncode == 3
    text = path.read_text()
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)  # unterminated: no closing bracket
    events = timed(read_trace(path))
    assert [(e["name"], e["ph"]) for e in events] == [(TRACE_WRITER, "B"), ("run", "B"), ("completed work", "i")]
    assert events[2]["args"] == {"device": "cpu", "batch size": 8}


def test_writers_are_shared_by_absolute_path_and_later_opens_append(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = acquire_writer("shared.trace.json")
    second = acquire_writer(tmp_path / "shared.trace.json")
    assert first is second
    first.begin("a", "one")
    second.begin("b", "two", tid=99)
    first.end("a", "one")
    release_writer(first)
    assert not second.closed  # still held
    second.end("b", "two", tid=99)
    release_writer(second)
    assert second.closed
    with trace_writer(tmp_path / "shared.trace.json") as again:  # same process: appends
        again.instant("c", "three")
    events = assert_well_formed(tmp_path / "shared.trace.json")
    assert [(e["name"], e["ph"]) for e in timed(events)] == [
        (TRACE_WRITER, "B"), ("a", "B"), ("b", "B"), ("a", "E"), ("b", "E"), ("c", "i"), (TRACE_WRITER, "E"),
    ]


def test_bad_trace_file_is_a_value_error_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"trace_file: expected a file path, got 42"):
        WorkDispatcher(SimpleScheduler("cpu", 2), lambda w, d: 0, mode="sync", trace_file=42)
    missing = tmp_path / "no-such-folder" / "t.json"
    with pytest.raises(ValueError, match=r"trace_file: the folder .*no-such-folder of .* does not exist"):
        dispatch(np.square, np.arange(4.0), scheduler=SimpleScheduler("cpu", 2), mode="sync", trace_file=missing)
    with pytest.raises(ValueError, match=r"trace_file: .* is a folder"):
        WorkDispatcher(SimpleScheduler("cpu", 2), lambda w, d: 0, mode="sync", trace_file=tmp_path)


GRAPH = """
[model]
name = "j2"
tangent = false
[batch]
size = 3000
[scheduler]
type = "StaticHybridScheduler"
devices = ["cpu", "cuda:0"]
batch_sizes = [500, 1000]
[options]
mode = "async"
emulate = true
"""


def test_dsched_run_writes_the_trace_and_the_performance_report(tmp_path, capsys):
    from dsched.cli import main

    graph = tmp_path / "g.toml"
    graph.write_text(GRAPH)
    trace, report = tmp_path / "run.trace.json", tmp_path / "report.html"
    assert main(["run", str(graph), "--no-progress", "--trace-file", str(trace),
                 "--performance-report", str(report)]) == 0
    events = assert_well_formed(trace)
    assert sum(e["args"]["batch size"] for e in names(events, TASK, "B")) == 3000
    html = report.read_text()
    assert html.startswith("<!DOCTYPE html>") and "Dask Performance Report" in html
    # A graph option does the same; a bad path exits 2 before any cluster starts.
    graph.write_text(GRAPH + f'trace_file = "{tmp_path / "no-such" / "t.json"}"\n')
    assert main(["run", str(graph), "--no-progress"]) == 2
    assert "options.trace_file: the folder" in capsys.readouterr().err
