"""dsched's families on Prometheus: the scheduler's real ``/metrics`` after dispatches, parsed with prometheus_client's parser.

Also the performance model's predicted against measured chunk times: in the
run report, the ``dsched run`` table, the JSON route and ``/metrics``; and the
worker side (a GPU's memory through NVML), faked where there is no GPU.
"""

from __future__ import annotations

import json
import statistics
import time
import types
import urllib.request

import pytest
from distributed import Client

from dsched import (
    Device,
    LocalHybridCluster,
    PerformanceModelScheduler,
    SliceGenerator,
    StaticHybridScheduler,
    WorkDispatcher,
)
from dsched.observe.dashboard import JSON_ROUTE, flush_page
from dsched.observe.report import ChunkRecord, RunReport

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

CAPACITY = {"cpu": 4000, "cuda:0": 8000}  # items each worker may run at once
DEVICES = {"cpu", "cuda:0"}
RATE = 200_000.0  # items/s of the sleeping chunks below
COSTS = {"cpu": {"t0": 0.001, "n_star": 200}, "cuda:0": {"t0": 0.001, "n_star": 200}}  # RATE, from 200 items


@pytest.fixture(scope="module")
def metrics_cluster():
    """An in-process cpu + emulated cuda:0 cluster with its dashboard (and so ``/metrics``) on a free loopback port."""
    with LocalHybridCluster(["cpu", "cuda:0"], emulate=True, capacities=CAPACITY,
                            dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        port = client.scheduler_info()["services"]["dashboard"]
        yield client, f"http://127.0.0.1:{port}"


def scrape(base) -> dict:
    """``{family name: Metric}`` of the scheduler's ``/metrics``, as prometheus_client parses the text."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def values(families, name, sample=None) -> dict:
    """``{device: value}`` of one family's samples named ``sample`` (default: the family's name)."""
    family = families.get(name)
    if family is None:
        return {}
    sample = sample or name
    return {s.labels["device"]: s.value for s in family.samples if s.name == sample}


def _sizes(work, device):
    return work.stop - work.start


def _sleep_in_proportion(work, device):
    """A chunk that takes its size over RATE seconds, so the model's predictions can be right."""
    time.sleep((work.stop - work.start) / RATE)
    return work.stop - work.start


def test_after_a_dispatch_every_device_has_its_families_and_counts(metrics_cluster):
    client, base = metrics_cluster
    flush_page(client)  # earlier tests' chunks counted before this one's
    before = scrape(base)
    dispatcher = WorkDispatcher(StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 8], capacities=[8, 16]),
                                _sizes, reduce=sum, client=client)
    assert dispatcher.run(SliceGenerator(0, 300)) == 300
    flush_page(client)  # the lanes' chunk events reach the scheduler off the call's path
    after = scrape(base)
    report = dispatcher.last_run
    rows = {str(key.device): row for key, row in report.by_device().items()}
    assert set(rows) == DEVICES

    dsched = {name: family for name, family in after.items() if name.startswith("dsched_")}
    labelled = [name for name, family in dsched.items() if {s.labels.get("device") for s in family.samples} == DEVICES]
    assert len(labelled) >= 4, sorted(dsched)
    for family in dsched.values():  # labelled by device and host, as the page's rows (le: a bucket's bound)
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == {"device", "host"}, sample
    hosts = {s.labels["host"] for s in dsched["dsched_items_completed"].samples}
    assert hosts == {row["host"] for row in rows.values()}

    types_ = {name: dsched[name].type for name in dsched}
    assert {k: types_[k] for k in ("dsched_items_completed", "dsched_chunks_completed", "dsched_busy_seconds",
                                   "dsched_load_items", "dsched_capacity_items", "dsched_chunk_duration_seconds")} == {
        "dsched_items_completed": "counter", "dsched_chunks_completed": "counter", "dsched_busy_seconds": "counter",
        "dsched_load_items": "gauge", "dsched_capacity_items": "gauge", "dsched_chunk_duration_seconds": "histogram"}

    def delta(name, sample=None):
        new, old = values(after, name, sample), values(before, name, sample)
        return {device: new[device] - old.get(device, 0.0) for device in new}

    assert delta("dsched_items_completed", "dsched_items_completed_total") == {
        d: float(rows[d]["items"]) for d in DEVICES}
    assert sum(delta("dsched_items_completed", "dsched_items_completed_total").values()) == 300
    assert delta("dsched_chunks_completed", "dsched_chunks_completed_total") == {
        d: float(rows[d]["chunks"]) for d in DEVICES}
    busy = delta("dsched_busy_seconds", "dsched_busy_seconds_total")
    assert all(0 < busy[d] <= report.wall_time for d in DEVICES), busy
    assert values(after, "dsched_load_items") == {"cpu": 0.0, "cuda:0": 0.0}
    assert values(after, "dsched_chunks_in_flight") == {"cpu": 0.0, "cuda:0": 0.0}
    assert values(after, "dsched_capacity_items") == {"cpu": 4000.0, "cuda:0": 8000.0}
    assert values(after, "dsched_workers") == {"cpu": 1.0, "cuda:0": 1.0}
    assert values(after, "dsched_device_emulated") == {"cpu": 0.0, "cuda:0": 1.0}

    # The chunk-duration histogram: one observation per chunk, cumulative buckets ending at the count.
    assert delta("dsched_chunk_duration_seconds", "dsched_chunk_duration_seconds_count") == {
        d: float(rows[d]["chunks"]) for d in DEVICES}
    for device in DEVICES:
        buckets = [(s.labels["le"], s.value) for s in after["dsched_chunk_duration_seconds"].samples
                   if s.name.endswith("_bucket") and s.labels["device"] == device]
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and buckets[-1] == ("+Inf", values(
            after, "dsched_chunk_duration_seconds", "dsched_chunk_duration_seconds_count")[device])

    # No prediction in this run: no record has one, and the model's families did not move.
    assert report.prediction_error is None and all(r.predicted is None for r in report.records)
    assert delta("dsched_prediction_relative_error", "dsched_prediction_relative_error_count") in (
        {}, {"cpu": 0.0, "cuda:0": 0.0})
    # The worker side: registered on every worker, but no GPU family without NVML or a real GPU.
    assert all(client.run(lambda dask_worker: "dsched-metrics" in dask_worker.plugins).values())
    assert "dsched_gpu_memory_used_bytes" not in after


def test_performance_model_predictions_reach_the_report_the_page_data_and_metrics(metrics_cluster):
    client, base = metrics_cluster
    flush_page(client)  # earlier tests' chunks counted before this one's
    before = scrape(base)
    scheduler = PerformanceModelScheduler(["cpu", "cuda:0"], costs=COSTS, chunk_seconds=0.005, client=False)
    dispatcher = WorkDispatcher(scheduler, _sleep_in_proportion, reduce=sum, client=client)
    total = 20_000
    assert dispatcher.run(SliceGenerator(0, total)) == total
    flush_page(client)
    after = scrape(base)
    status = json.load(urllib.request.urlopen(base + JSON_ROUTE, timeout=10))

    report = dispatcher.last_run
    records = report.records
    # Every chunk is predicted (each device has a model from the start) and measured on its worker.
    assert all(r.predicted is not None and r.predicted > 0 and r.duration > 0 for r in records)
    errors = [abs(r.predicted - r.duration) / r.duration for r in records]
    assert report.prediction_error == pytest.approx(statistics.median(errors), rel=1e-12)
    rows = {str(key.device): row for key, row in report.by_device().items()}
    for device in DEVICES:
        mine = [e for r, e in zip(records, errors) if str(r.device) == device]
        assert rows[device]["prediction_error"] == pytest.approx(statistics.median(mine), rel=1e-12)

    def delta(name, sample):
        new, old = values(after, name, sample), values(before, name, sample)
        return {device: new[device] - old.get(device, 0.0) for device in new}

    assert delta("dsched_prediction_relative_error", "dsched_prediction_relative_error_count") == {
        d: float(sum(str(r.device) == d for r in records)) for d in DEVICES}
    predicted = delta("dsched_predicted_chunk_seconds", "dsched_predicted_chunk_seconds_total")
    measured = delta("dsched_measured_chunk_seconds", "dsched_measured_chunk_seconds_total")
    for device in DEVICES:
        mine = [r for r in records if str(r.device) == device]
        assert predicted[device] == pytest.approx(sum(r.predicted for r in mine), rel=1e-9)
        assert measured[device] == pytest.approx(sum(r.duration for r in mine), rel=1e-9)
    for family in ("dsched_predicted_chunk_seconds", "dsched_measured_chunk_seconds",
                   "dsched_prediction_relative_error", "dsched_prediction_median_relative_error"):
        assert {s.labels["device"] for s in after[family].samples} == DEVICES, family
    if not before.get("dsched_prediction_relative_error"):  # this run's chunks are the only ones predicted
        medians = values(after, "dsched_prediction_median_relative_error")
        assert medians == pytest.approx({d: rows[d]["prediction_error"] for d in DEVICES}, rel=1e-9)

    run = next(r for r in status["runs"] if r["items_done"] == total and r["predicted_chunks"])
    assert run["predicted_chunks"] == len(records)
    assert run["prediction_error"] == pytest.approx(report.prediction_error, rel=1e-9)


def test_a_sync_run_predicts_each_chunk_and_a_static_policy_none():
    scheduler = PerformanceModelScheduler(["cpu"], costs={"cpu": COSTS["cpu"]}, chunk_seconds=0.002, client=False)
    dispatcher = WorkDispatcher(scheduler, _sleep_in_proportion, reduce=sum, mode="sync")
    assert dispatcher.run(SliceGenerator(0, 4000)) == 4000
    report = dispatcher.last_run
    fit = scheduler.estimates()[Device("cpu")]
    assert all(r.predicted == pytest.approx(fit.seconds(r.size)) for r in report.records)  # no sample in a sync run
    assert report.prediction_error is not None
    static = WorkDispatcher(StaticHybridScheduler(["cpu"], 500), _sizes, reduce=sum, mode="sync")
    assert static.run(SliceGenerator(0, 2000)) == 2000
    assert static.last_run.prediction_error is None


def test_run_table_has_the_model_error_column_and_line():
    from dsched.apps.job import JobResult, format_report

    cpu, gpu = Device("cpu"), Device("cuda:0")
    records = [ChunkRecord(0, cpu, 100, "tcp://10.0.0.3:1", 0.0, 1.0, predicted=0.9),   # 10 % off
               ChunkRecord(1, cpu, 100, "tcp://10.0.0.3:1", 1.0, 2.0, predicted=1.3),   # 30 %
               ChunkRecord(2, gpu, 400, "tcp://10.0.0.3:2", 0.0, 2.0, predicted=3.0),   # 50 %
               ChunkRecord(3, gpu, 400, "tcp://10.0.0.3:2", 2.0, 3.0)]                  # explored: no prediction
    report = RunReport("async", records, [None] * 4, wall_start=0.0, wall_stop=3.0)
    assert report.prediction_error == pytest.approx(0.3)
    text = format_report(JobResult({}, report, {cpu: False, gpu: True}))
    lines = text.splitlines()
    assert lines[0].split()[-2:] == ["model", "err"]
    assert [line.split() for line in lines[2:4]] == [
        ["cpu", "no", "2", "200", "2.000", "100", "20.0", "%"],
        ["cuda:0", "yes", "2", "800", "3.000", "267", "50.0", "%"]]
    assert "performance model: median relative error of predicted chunk times 30.0 % over 3 chunks" in text
    plain = RunReport("async", [ChunkRecord(0, cpu, 100, "tcp://10.0.0.3:1", 0.0, 1.0)], [None], 0.0, 1.0)
    text = format_report(JobResult({}, plain, {cpu: False}))
    assert "model err" not in text and "performance model" not in text


def test_without_prometheus_client_the_metrics_are_quietly_off_as_dask_s_and_the_rest_goes_on(monkeypatch, caplog):
    import logging
    import sys
    import warnings

    from dsched.observe.dashboard import DashboardPlugin, metrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client raises ImportError
    monkeypatch.setattr(metrics, "_state", {"registered": False, "missing": False})
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger=metrics.__name__):
        warnings.simplefilter("always")
        assert metrics.export(DashboardPlugin()) is False
        assert metrics.export(DashboardPlugin()) is False
    assert [str(w.message) for w in caught] == []  # the README's hello world prints nothing it does not promise
    assert [(r.levelno, r.getMessage().split(",")[0]) for r in caplog.records if r.name == metrics.__name__] == [
        (logging.DEBUG, "dsched: prometheus_client is not installed")]
    plugin = DashboardPlugin()  # and everything else works: the plugin hears predictions, the rows have them
    plugin.predictions_heard("dsched-0123abcd-0", "client", [("cpu", "tcp://10.0.0.3:1", 0.5, 1.0)])
    [row] = plugin.metric_rows()
    assert (row["device"], row["host"], row["predictions"].chunks, row["prediction_error"]) == (
        "cpu", "10.0.0.3", 1, 0.5)
    assert plugin.snapshot()["runs"][0]["prediction_error"] == 0.5


def test_rows_of_two_schedulers_in_one_process_add_up(monkeypatch):
    """The process's collector reads every live plugin: the same device and host once, summed."""
    from dsched.observe.dashboard import metrics
    from dsched.observe.dashboard.metrics import DURATION_BUCKETS, Histogram

    def plugin(items, capacity, durations):
        histogram = Histogram(DURATION_BUCKETS)
        for seconds in durations:
            histogram.observe(seconds)
        row = {"device": "cpu", "host": "h", "items_done": items, "chunks_done": len(durations), "busy_s": 1.0,
               "load": 0, "chunks_in_flight": 0, "workers": ["w"], "capacity": capacity, "emulated": False,
               "durations": histogram, "predictions": None}
        return types.SimpleNamespace(metric_rows=lambda: [dict(row)])

    plugins = [plugin(10, 4, [0.002]), plugin(5, "unlimited", [0.02, 2.0])]
    monkeypatch.setattr(metrics, "_plugins", plugins)
    families = {f.name: f for f in metrics._Collector().collect()}
    [items] = families["dsched_items_completed"].samples
    assert (items.labels, items.value) == ({"device": "cpu", "host": "h"}, 15)
    assert families["dsched_capacity_items"].samples[0].value == float("inf")
    assert families["dsched_workers"].samples[0].value == 2
    buckets = {s.labels["le"]: s.value for s in families["dsched_chunk_duration_seconds"].samples
               if s.name.endswith("_bucket")}
    assert (buckets["0.0025"], buckets["0.025"], buckets["2.5"], buckets["+Inf"]) == (1, 2, 3, 3)
    assert "dsched_prediction_relative_error" not in families


def test_the_grafana_example_queries_only_what_dsched_exports(metrics_cluster, monkeypatch):
    """Every ``dsched_`` series of ``examples/grafana-dsched.json``'s queries is on ``/metrics`` after a model run."""
    import re
    from pathlib import Path

    from dsched.observe.dashboard import gpu

    client, base = metrics_cluster
    scheduler = PerformanceModelScheduler(["cpu", "cuda:0"], costs=COSTS, chunk_seconds=0.005, client=False)
    WorkDispatcher(scheduler, _sleep_in_proportion, reduce=sum, client=client).run(SliceGenerator(0, 4000))
    exported = {s.name for family in scrape(base).values() for s in family.samples}
    monkeypatch.setitem(gpu._state, "nvml", _FakeNvml)  # the GPU families, as a GPU worker writes them
    monkeypatch.setattr(gpu, "_workers", [_worker("tcp://10.0.0.5:1", **{"dsched-cuda:0": 100})])
    exported |= {s.name for family in gpu._GpuCollector().collect() for s in family.samples}

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "examples" / "grafana-dsched.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queries.append(dashboard["templating"]["list"][1]["definition"])
    used = {name for query in queries for name in re.findall(r"\bdsched_\w+", query)}
    assert len(used) >= 9 and used <= exported, used - exported


# --- the worker side: GPU memory through NVML ------------------------------------------

class _FakeNvml:
    """Two GPUs of 80 GB, 1 and 2 GB in use."""

    @staticmethod
    def nvmlDeviceGetHandleByIndex(index):
        if index not in (0, 1):
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return index

    @staticmethod
    def nvmlDeviceGetMemoryInfo(handle):
        return types.SimpleNamespace(used=(handle + 1) * 10**9, total=80 * 10**9, free=0)


def _worker(address, **resources):
    return types.SimpleNamespace(address=address, state=types.SimpleNamespace(total_resources=resources))


def test_gpu_memory_rows_are_those_of_real_cuda_workers(monkeypatch):
    from dsched.observe.dashboard import gpu

    monkeypatch.setitem(gpu._state, "nvml", _FakeNvml)
    workers = [_worker("tcp://10.0.0.5:1", **{"dsched-cuda:1": 100}),
               _worker("tcp://10.0.0.5:2", **{"dsched-cuda:1": 50}),  # a second worker on the same GPU: one row
               _worker("tcp://10.0.0.5:3", **{"dsched-cuda:0": 100, "dsched-emulated": 1}),  # NumPy: no GPU
               _worker("tcp://10.0.0.5:4", **{"dsched-cpu": 8}),
               _worker("tcp://10.0.0.6:1", **{"dsched-cuda:7": 100})]  # NVML has no GPU 7: left out
    assert gpu.gpu_rows(workers) == {("cuda:1", "10.0.0.5"): (2 * 10**9, 80 * 10**9)}
    monkeypatch.setattr(gpu, "_workers", workers)
    families = {f.name: f for f in gpu._GpuCollector().collect()}
    assert [(s.name, s.labels, s.value) for f in families.values() for s in f.samples] == [
        ("dsched_gpu_memory_used_bytes", {"device": "cuda:1", "host": "10.0.0.5"}, 2e9),
        ("dsched_gpu_memory_total_bytes", {"device": "cuda:1", "host": "10.0.0.5"}, 80e9)]


def test_without_nvml_there_is_no_gpu_family_and_no_error(monkeypatch):
    from dsched.observe.dashboard import gpu

    monkeypatch.setitem(gpu._state, "nvml", False)  # tried, and missing
    monkeypatch.setattr(gpu, "_workers", [_worker("tcp://10.0.0.5:1", **{"dsched-cuda:0": 100})])
    assert gpu.gpu_memory(0) is None
    assert list(gpu._GpuCollector().collect()) == []
