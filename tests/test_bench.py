"""A tiny run of the benchmark machinery: structure, item accounting and the emulated devices' honesty, not speed."""

import json
import os
import threading
import time
import types

import pytest

from dsched.bench import EmulatedDevice, emulated_chunk, format_table, ideal_items_per_s, run_benchmarks

DEVICES = (EmulatedDevice("cpu", 1_000_000.0, 0.0005), EmulatedDevice("cuda:0", 4_000_000.0, 0.0005))


@pytest.fixture(scope="module")
def results(hybrid_client, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    lines = []
    out = run_benchmarks(path, devices=DEVICES, total=40_000, chunk_seconds=0.002, map_chunks=8,
                         overhead_chunks=40, repeats=1, client=hybrid_client, progress=lines.append)
    return out, path, lines


def test_every_way_processes_every_item_on_the_device_workers(results):
    out, _, _ = results
    assert list(out["hybrid"]) == ["dsched", "client.map", "threads"]
    for name, row in out["hybrid"].items():
        assert sum(row["items_per_device"].values()) == 40_000, name
        assert set(row["items_per_device"]) <= {"cpu", "cuda:0"}, name
        assert row["items_per_s"] == pytest.approx(40_000 / row["wall_s"])
        assert row["efficiency"] == pytest.approx(row["items_per_s"] / row["ideal_items_per_s"])
        assert 0 < row["efficiency_vs_sum_of_rates"] < row["efficiency"]  # t0 > 0 makes the strict bound lower
    # Batch sizes proportional to speed: 2 ms of work per chunk.
    assert out["config"]["dsched_batch_sizes"] == {"cpu": 2000, "cuda:0": 8000}
    assert out["config"]["dsched_capacities"] == {"cpu": 4000, "cuda:0": 16000}
    assert out["config"]["client_map_chunk"] == 5000
    assert out["hybrid"]["dsched"]["ideal_items_per_s"] == pytest.approx(
        2000 / (0.0005 + 2000 / 1e6) + 8000 / (0.0005 + 8000 / 4e6))


def test_overheads_and_targets_are_reported(results):
    out, _, lines = results
    assert list(out["overhead"]) == ["sync", "client.map + gather", "client.map + wait", "chunk tasks, no dispatcher",
                                     "async, all in flight", "async, 2 chunks/device"]
    for row in out["overhead"].values():
        assert row["s_per_chunk"] > 0 and row["chunks"] >= 40
    assert out["overhead"]["async, all in flight"]["description"].endswith("capacity 20 per device")
    assert set(out["targets"]) == {"dsched hybrid efficiency >= 0.95",
                                   "async overhead per chunk <= client.map (+ gather) per task",
                                   "async overhead per chunk, all in flight, <= 0.25 x client.map (+ gather) per task",
                                   "sync overhead < 50 us per chunk"}
    assert all(isinstance(v, bool) for v in out["targets"].values())
    assert len(lines) == 3 + 6 and lines[0].startswith("hybrid dsched: ")


def test_json_and_table(results):
    out, path, _ = results
    assert json.loads(path.read_text()) == json.loads(json.dumps(out))
    table = format_table(out)
    assert "not a GPU measurement" in table
    for name in ["dsched", "client.map", "threads", "sync", "async, all in flight"]:
        assert f"\n{name} " in table
    assert "target dsched hybrid efficiency >= 0.95: " in table


def test_an_emulated_device_runs_one_chunk_at_a_time(hybrid_client):
    """Four chunks of 50 ms on one device take 200 ms, whatever the worker's two threads."""
    workers = {info["name"]: a for a, info in hybrid_client.scheduler_info(n_workers=-1)["workers"].items()}
    speeds = {"cpu": (0.05, 1e12)}
    start = time.perf_counter()
    futures = hybrid_client.map(emulated_chunk, [1, 2, 3, 4], ["cpu"] * 4, [speeds] * 4, workers=[workers["cpu"]],
                                pure=False)
    assert hybrid_client.gather(futures) == [1, 2, 3, 4]
    assert time.perf_counter() - start >= 0.2


def test_ideal_formula():
    assert ideal_items_per_s(DEVICES, [1000, 4000]) == pytest.approx(
        1000 / (0.0005 + 0.001) + 4000 / (0.0005 + 0.001))


@pytest.mark.parametrize("kwargs, message", [
    ({"devices": ()}, "devices: at least one emulated device is required"),
    ({"devices": ("cpu",)}, r"devices\[0\]: expected an EmulatedDevice, got 'cpu'"),
    ({"devices": (EmulatedDevice("cpu", 0.0),)}, r"devices\[0\]: rate must be > 0"),
    ({"devices": (EmulatedDevice("gpu", 1.0),)}, r"^devices\[0\]: 'gpu' is not a device"),
    ({"total": 0}, "total: expected an integer >= 1, got 0"),
    ({"chunk_seconds": 0}, "chunk_seconds: expected a positive number of seconds, got 0"),
    ({"json_path": "/no/such/folder/b.json"}, "json_path: the folder /no/such/folder does not exist"),
])
def test_bad_options_are_value_errors_before_any_cluster(kwargs, message):
    before = threading.active_count()
    with pytest.raises(ValueError, match=message):
        run_benchmarks(**kwargs)
    assert threading.active_count() == before  # nothing was started


def test_dsched_bench_command_checks_its_json_path_first(capsys):
    from dsched.cli import main

    assert main(["bench", "--quick", "--json", "/no/such/folder/b.json"]) == 2
    assert "--json: the folder of /no/such/folder/b.json does not exist" in capsys.readouterr().err


def test_data_benchmarks_structure_and_honesty():
    """A tiny run of the data-plane suite: every row, the checks of results against NumPy, the targets named."""
    from dsched.bench_data import format_data_table, run_data_benchmarks

    out = run_data_benchmarks(points=40_000, repeats=1, output_points=50_000)
    ray = {"ray, put and tasks"} & set(out["items_per_s"])  # an optional peer, where Ray is installed
    assert set(out["items_per_s"]) - ray == {"numpy", "threads", "dispatch, plain", "dispatch, plain, copied",
                                             "dispatch, plain, 32,768-point chunks", "dispatch, processes",
                                             "dispatch, processes, shared", "dispatch, processes, shared, tasks",
                                             "dispatch, processes, shared, half chunks",
                                             "job numpy", "job threads", "dsched run, in-process"}
    assert set(out["ratios"]) - {"dispatch, plain / ray, put and tasks (best)"} == {
        "dispatch, plain / numpy (best)", "dispatch, plain, 32,768-point chunks / numpy (best)",
        "dispatch, processes, shared / numpy (best)", "placed / copied (dispatch, plain)", "dispatch, processes / numpy", "dispatch, processes, shared / numpy",
        "feeds / tasks (dispatch, processes, shared)", "chunks / half chunks (dispatch, processes, shared)",
        "dsched run in-process / best of job numpy, job threads"}
    assert set(out["page_faults"]) == set(out["items_per_s"])
    assert all(set(faults) == {"client", "workers"} for faults in out["page_faults"].values())
    assert set(out["cpu_seconds"]) == set(out["items_per_s"])
    # The dispatch rows compute in the worker processes, the NumPy row in the client's.
    assert out["cpu_seconds"]["dispatch, processes, shared"]["workers"] > 0
    assert out["cpu_seconds"]["numpy"]["client"] > 0
    assert all(rate > 0 for rate in out["items_per_s"].values())
    assert 0 < out["task_bytes_max"] <= 1024
    assert out["output_run"]["points"] == 50_000 and out["output_run"]["stored_bytes"] >= 50_000 * 392
    assert out["client_rss"]["peak"] >= out["client_rss"]["before"] > 0
    memory = out["memory_pass"]  # 128 MiB each way
    assert memory["bytes"] == 128 << 20 and memory["shared_s"] > 0 and memory["own_s"] > 0
    assert memory["shared_vs_own"] == pytest.approx(memory["own_s"] / memory["shared_s"])
    table = format_data_table(out)
    assert "emulated" in table and "target bytes through the scheduler per chunk <= 1 KiB: reached" in table
    assert f"a pass over 128 MiB: shared memory at {memory['shared_vs_own']:.2f} x the speed of this process's own" \
        f" ({memory['shared_s'] * 1e3:.1f} ms against {memory['own_s'] * 1e3:.1f} ms; " \
        f"/dev/shm huge={memory['shm_huge_pages']})" in table


def test_percall_benchmarks_time_every_form_against_the_pipe_round_trip():
    """A tiny run of the percall suite: every row, ratios to the pipe, the targets named."""
    from dsched.apps.bench.percall import format_percall, run_percall_benchmarks

    out = run_percall_benchmarks(calls=20, sets=20, say=lambda line: None)
    ray = {"ray tasks + get"} & set(out["rows"])  # an optional peer, where Ray is installed
    assert set(out["rows"]) - ray == {"pipe round trip", "dsched.dispatch", "dsched.dispatch, no lane spin",
                                      "dsched.dispatch, steps of a shared history", "WorkDispatcher.run",
                                      "dsched.dispatch, dashboard on", "Batch update + get", "dask submit + gather",
                                      "dsched.submit + result", "TrialState trial + commit"}
    assert all(us > 0 for us in out["rows"].values()) and out["ratios"]["pipe round trip"] == 1.0
    assert set(out["targets"]) == {"dsched.dispatch <= 5 x the pipe round trip",
                                   "Batch update + get <= 5 x the pipe round trip",
                                   "/dev/shm flat over 20 Batch.set calls"}
    assert out["targets"]["/dev/shm flat over 20 Batch.set calls"], out["shm"]
    # The overlap of a future with the caller's work, read from the one trace of both.
    assert 0.0 <= out["overlap"]["overlap"] <= 1.0 and os.path.exists(out["overlap"]["trace"])
    table = format_percall(out)
    assert "emulated" in table and "dsched.dispatch" in table and "a future: the caller's" in table


def test_the_rows_with_a_target_and_the_pipe_are_timed_in_turn_round_after_round():
    """Each round times the pipe, then each row: a row's ratio is the median of its rounds' ratios to the pipe."""
    from types import SimpleNamespace

    from dsched.apps.bench.percall import timed_in_rounds

    calls = []
    pipe = SimpleNamespace(round_trip=lambda: calls.append("pipe"))
    medians, ratios = timed_in_rounds({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, pipe,
                                      calls=30, warmup=6, rounds=3)
    per_round = ["pipe"] * 12 + ["a"] * 12 + ["b"] * 12  # 10 timed calls after 2 warm-up ones, each in turn
    assert calls == per_round * 3
    assert set(medians) == set(ratios) == {"pipe round trip", "a", "b"} and ratios["pipe round trip"] == 1.0
    assert all(us > 0 for us in medians.values()) and all(r > 0 for r in ratios.values())


def _suites(monkeypatch, **outcomes):
    """Replace dsched bench's suites by ones that return a table or raise, as ``outcomes`` says."""
    from dsched.apps import cli

    def suite(name, outcome):
        def run(args, say):
            if isinstance(outcome, BaseException):
                raise outcome
            return {"value": outcome}, f"{name} table"
        return run

    monkeypatch.setattr(cli, "_BENCH_SUITES", {name: suite(name, outcome) for name, outcome in outcomes.items()})
    monkeypatch.setattr(cli, "SUITES", tuple(outcomes))


def test_a_suite_missing_its_optional_dependency_is_skipped_in_one_line_and_the_others_print(
        monkeypatch, capsys, tmp_path):
    from dsched.apps.cli import main

    missing = ModuleNotFoundError("No module named 'torch'", name="torch")
    _suites(monkeypatch, percall=1.0, neml2=missing, batch=2.0)
    assert main(["bench", "--json", str(tmp_path / "r.json")]) == 0
    out, err = capsys.readouterr()
    assert "percall table" in out and "batch table" in out
    assert "neml2 suite skipped: torch is not installed (pip install 'dsched[neml2]')" in out
    assert err.splitlines() == ["neml2: skipped: torch is not installed (pip install 'dsched[neml2]')"]
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["neml2"] == {"skipped": "torch is not installed (pip install 'dsched[neml2]')"}
    assert results["percall"]["bench_command"] == "dsched bench --only percall"  # what reruns that suite alone
    from dsched.apps.bench.figures import blocks

    assert "neml2" not in blocks({"neml2": results["neml2"]})  # a skipped suite leaves its figures in the docs as they were


def test_a_suite_that_fails_is_one_line_the_others_print_and_the_status_is_1(monkeypatch, capsys, tmp_path):
    from dsched.apps.cli import main

    _suites(monkeypatch, percall=1.0, data=OSError("No space left on device\nmore"), batch=2.0)
    assert main(["bench", "--json", str(tmp_path / "r.json")]) == 1
    out, err = capsys.readouterr()
    assert "percall table" in out and "batch table" in out and "Traceback" not in out + err
    assert err.splitlines() == ["data: failed: OSError: No space left on device",
                                "dsched: error: bench: the data suite(s) failed (above); the others' tables are "
                                "complete"]
    assert json.loads((tmp_path / "r.json").read_text())["data"] == {"failed": "OSError: No space left on device"}


def test_zarr_is_a_core_dependency_so_the_data_suite_s_store_run_needs_no_extra():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert "zarr>=3" in project["dependencies"]


def test_an_emulated_device_fed_by_one_thread_runs_at_its_rate_whatever_sleep_overshoots(monkeypatch):
    """A fake clock whose sleeps overshoot by 0.2 ms: chunks that follow one another on one thread end at the
    device's rate (the overshoot is not the device's), and one that comes 1 ms after the last ended starts
    then, less that chunk's overshoot."""
    import dsched.apps.bench.scheduling as scheduling

    now = [100.0]

    def sleep(seconds):
        now[0] += seconds + 0.0002

    monkeypatch.setattr(scheduling, "time", types.SimpleNamespace(perf_counter=lambda: now[0], sleep=sleep))
    clock = scheduling._DeviceClock()
    for _ in range(3):
        clock.run(0.01)
    assert clock.due == pytest.approx(100.03, abs=1e-12) and now[0] == pytest.approx(100.0302, abs=1e-12)
    now[0] += 0.001  # the dispatch's gap: the device idles it
    clock.run(0.01)
    assert clock.due == pytest.approx(100.041, abs=1e-12)
