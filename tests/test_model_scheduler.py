"""PerformanceModelScheduler: sizes, earliest finish, the tail, idle devices, learning, plan, graphs, real clusters.

The policy tests drive the scheduler through the dispatcher's protocol in
simulated time (a virtual clock; each device runs its chunks one after
another in ``t0 + n / rate`` seconds, and every chunk takes 1 ms to reach its
device and 1 ms to be seen done): the decisions are exact and repeatable.
The cluster tests run it through ``WorkDispatcher`` on emulated devices
(workers that claim a CUDA device and compute with NumPy: placement only).
"""

import heapq
import json
import socket

import numpy as np
import pytest

import dsched
from dsched import Device, PerformanceModelScheduler, SliceGenerator, WorkDispatcher
from dsched.costmodel import SaturationFit, costs_path, load_costs
from dsched.graph import GraphError, parse_graph
from dsched.schedulers.model import wait_for_saves

LATENCY = 0.001


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def simulate(scheduler, clock, speeds, total, *, observe=True):
    """Dispatch ``total`` items through the protocol; (wall seconds, {device: items}, [(device, n, start, end)])."""
    scheduler.begin_run(total)
    free = {d: clock.now for d in speeds}
    events, chunks, left, order = [], [], total, 0
    start = clock.now
    while left > 0 or events:
        while left > 0:
            choice = scheduler.schedule_work()
            if choice is None:
                break
            device, n = str(choice[0]), min(choice[1], left)
            scheduler.dispatched_work(device, n)
            left -= n
            t0, rate = speeds[device]
            begin = max(free[device], clock.now + LATENCY)
            free[device] = begin + t0 + n / rate
            chunks.append((device, n, begin, free[device]))
            heapq.heappush(events, (free[device] + LATENCY, order, device, n, t0 + n / rate))
            order += 1
        assert events, "no room and nothing in flight"
        clock.now, _, device, n, seconds = heapq.heappop(events)
        scheduler.completed_work(device, n)
        if observe:
            scheduler.observe(device, n, seconds)
    split = {}
    for device, n, _, _ in chunks:
        split[device] = split.get(device, 0) + n
    return clock.now - start, split, chunks


HYBRID = {"cpu": (0.001, 200_000.0), "cuda:0": (0.001, 1_000_000.0), "cuda:1": (0.001, 1_000_000.0)}
SECONDS = [0.01, 0.02, 0.02]


def ideal(speeds, seconds):
    return sum(r * s / (t0 + s) for (t0, r), s in zip(speeds.values(), seconds))


def known(speeds):
    return {d: SaturationFit(t0, t0 * r, 0.0, True) for d, (t0, r) in speeds.items()}  # t0 + n/r, near enough


def test_sizes_follow_the_model():
    s = PerformanceModelScheduler(["cpu", "cuda:0"], chunk_seconds=[0.008, 0.02],
                                  costs={"cpu": SaturationFit(0.002, 400.0, 0, True),
                                         "cuda:0": {"t0": 0.001, "n_star": 1000.0}})
    assert [(str(r.device), r.batch_size, r.capacity) for r in s.status()] == [
        ("cpu", 1600, 3200), ("cuda:0", 20000, 40000)]  # N* * chunk_seconds / t0, two chunks of room
    assert s.status()[1].priority == pytest.approx(1_000_000)  # the model's speed, items/s
    # Without begin_run the batch is endless: every device takes full chunks, earliest finish first.
    order = []
    while (choice := s.schedule_work()) is not None:
        s.dispatched_work(*choice)
        order.append((str(choice[0]), choice[1]))
    # cpu ends at 8 ms, then 16 ms; cuda:0 at 20 ms, then 40 ms; then two chunks each: no room.
    assert order == [("cpu", 1600), ("cpu", 1600), ("cuda:0", 20000), ("cuda:0", 20000)]
    s.completed_work("cpu", 1600)
    assert s.schedule_work() == (Device("cpu"), 1600)


def test_known_speeds_efficiency_and_a_tail_within_one_fast_chunk():
    clock = Clock()
    s = PerformanceModelScheduler(list(HYBRID), chunk_seconds=SECONDS, costs=known(HYBRID), clock=clock)
    wall, split, chunks = simulate(s, clock, HYBRID, 4_000_000)
    assert 4_000_000 / wall / ideal(HYBRID, SECONDS) >= 0.98
    ends = {d: max(end for dev, _, _, end in chunks if dev == d) for d in HYBRID}
    assert max(ends.values()) - min(ends.values()) <= 0.021  # one fast-device chunk (20 ms)
    assert sum(split.values()) == 4_000_000
    assert all(n >= 1 for _, n, _, _ in chunks)


def test_a_device_150_times_slower_never_slows_the_fast_one():
    pair = {"cpu": (0.001, 10_000.0), "cuda:0": (0.001, 1_500_000.0)}
    clock = Clock()
    alone = PerformanceModelScheduler(["cuda:0"], costs=known({"cuda:0": pair["cuda:0"]}), clock=clock)
    wall_alone, _, _ = simulate(alone, clock, {"cuda:0": pair["cuda:0"]}, 4_000_000)
    # The CPU would do 1/151 of the work: under min_share (1 %), it stays idle.
    both = PerformanceModelScheduler(list(pair), costs=known(pair), clock=clock)
    wall, split, _ = simulate(both, clock, pair, 4_000_000)
    assert split == {"cuda:0": 4_000_000} and wall == pytest.approx(wall_alone, rel=1e-9)
    # Asked to use it anyway (min_share=0), the CPU helps a little and never ends after the GPU.
    both = PerformanceModelScheduler(list(pair), costs=known(pair), clock=clock, min_share=0)
    wall, split, chunks = simulate(both, clock, pair, 4_000_000)
    assert wall <= wall_alone
    assert 0 < split["cpu"] < 0.01 * 4_000_000
    cpu_end = max(end for d, _, _, end in chunks if d == "cpu")
    assert cpu_end <= max(end for d, _, _, end in chunks if d == "cuda:0")
    # A batch the fast device finishes before the CPU's smallest chunk (10 ms) could: the CPU stays idle.
    pair["cpu"] = (0.01, 10_000.0)
    clock2 = Clock()
    small = PerformanceModelScheduler(list(pair), costs=known(pair), clock=clock2, min_share=0)
    _, split, _ = simulate(small, clock2, pair, 6_000)
    assert split == {"cuda:0": 6_000}
    _, split, _ = simulate(small, clock2, pair, 60_000)  # 40 ms of work: now a CPU chunk ends in time
    assert 0 < split["cpu"] < 600


def test_unknown_speeds_first_and_second_run(tmp_path):
    clock = Clock()
    first = PerformanceModelScheduler(list(HYBRID), chunk_seconds=SECONDS, model="sim", profile_dir=tmp_path,
                                      clock=clock)
    assert all(fit is None for fit in first.estimates().values())
    wall, _, chunks = simulate(first, clock, HYBRID, 4_000_000)
    assert 4_000_000 / wall / ideal(HYBRID, SECONDS) >= 0.95
    # Exploration: each device starts at start_batch and doubles as samples come in.
    assert [n for d, n, _, _ in chunks if d == "cuda:0"][:4] == [1024, 1024, 2048, 4096]
    wait_for_saves()  # written off the dispatcher's thread when the run ended
    saved = load_costs("sim", socket.gethostname(), tmp_path)
    assert sorted(saved) == sorted(first.identities[Device(d)].key for d in HYBRID)
    assert all(entry["samples"] >= 10 for entry in saved.values())
    second = PerformanceModelScheduler(list(HYBRID), chunk_seconds=SECONDS, model="sim", profile_dir=tmp_path,
                                       clock=clock)
    for device, (t0, rate) in HYBRID.items():  # the saved models, before any chunk of the second run
        fit = second.estimates()[Device(device)]
        assert fit.seconds(20_000) == pytest.approx(t0 + 20_000 / rate, rel=0.15)
    wall, _, _ = simulate(second, clock, HYBRID, 4_000_000)
    assert 4_000_000 / wall / ideal(HYBRID, SECONDS) >= 0.97


def test_samples_are_the_worker_seconds_even_when_two_ends_are_heard_at_once():
    clock = Clock()
    s = PerformanceModelScheduler(["cuda:0"], costs={"cuda:0": SaturationFit(0.01, 10000.0, 0, True)}, clock=clock)
    s.begin_run(100_000)
    device, n = s.schedule_work()
    s.dispatched_work(device, n)
    clock.now += 0.020
    s.completed_work("cuda:0", n)
    s.observe("cuda:0", n, 0.020)  # a first sample: discarded (it pays for imports and caches)
    for _ in range(2):
        device, n = s.schedule_work()
        s.dispatched_work(device, n)
    clock.now += 0.040  # the client was busy: it reads both replies at once, 0.1 ms apart
    for _ in range(2):
        s.completed_work("cuda:0", 20000)
        s.observe("cuda:0", 20000, 0.020)  # each took 20 ms on the device (the dispatcher's service_seconds)
        clock.now += 0.0001
    calibration = s.calibration("cuda:0")
    assert calibration.seen == 3 and calibration.samples == 2  # the first is discarded
    assert list(calibration._by_size[20000.0]) == [pytest.approx(0.020)] * 2  # not the 0.1 ms between the ends


def test_without_the_hook_the_intervals_between_completions_are_the_samples():
    clock = Clock()
    s = PerformanceModelScheduler(["cuda:0"], costs={"cuda:0": SaturationFit(0.01, 10000.0, 0, True)}, clock=clock)
    s.begin_run(100_000)
    for _ in range(3):
        device, n = s.schedule_work()
        s.dispatched_work(device, n)
        clock.now += 0.020
        s.completed_work("cuda:0", n)
    assert list(s.calibration("cuda:0")._by_size[20000.0]) == [pytest.approx(0.020)]  # first discarded, last pending


def test_plan_is_the_policy_in_predicted_time():
    s = PerformanceModelScheduler(list(HYBRID), chunk_seconds=SECONDS, costs=known(HYBRID))
    chunks = dsched.plan(1_000_000, s)
    assert chunks == s.plan(1_000_000)  # a pure function of n and the models
    assert sum(n for _, n in chunks) == 1_000_000
    assert {str(d) for d, _ in chunks} == set(HYBRID)
    assert max(n for d, n in chunks if d == Device("cuda:0")) == s.status()[1].batch_size
    # A device no run has measured: its guess (batch_sizes in chunk_seconds).
    guess = PerformanceModelScheduler(["cpu", "cuda:0"], batch_sizes=[100, 1000])
    assert guess.plan(2200)[:2] == [(Device("cpu"), 100), (Device("cuda:0"), 1000)]
    assert sum(n for _, n in guess.plan(2200)) == 2200
    with pytest.raises(ValueError, match=r"n: 1000000000000 items make at least 50000000000 chunks of at most 20"):
        PerformanceModelScheduler(["cpu"], costs={"cpu": {"t0": 0.01, "n_star": 10.0}}).plan(10**12)


@pytest.mark.parametrize("kwargs, message", [
    ({"chunk_seconds": 0}, r"chunk_seconds\[0\]: expected a positive number of seconds, got 0"),
    ({"chunk_seconds": [0.01, 0.02, 0.03]}, "chunk_seconds: expected 1 or 2 values"),
    ({"capacity_chunks": 0}, "capacity_chunks: must be >= 1, got 0"),
    ({"min_share": 1}, r"min_share: expected a fraction in \[0, 1\), got 1"),
    ({"start_batch": 1.5}, "start_batch: expected an integer >= 1, got 1.5"),
    ({"model": "../x"}, "model: expected a plain name for the cost files, got '../x'"),
    ({"costs": {"cuda:3": {"t0": 1, "n_star": 2}}}, r"costs\['cuda:3'\]: not one of the scheduler's devices"),
    ({"costs": {"cpu": {"t0": 0}}}, r"costs\['cpu'\]: expected a SaturationFit"),
])
def test_bad_configuration_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PerformanceModelScheduler(["cpu", "cuda:0"], **kwargs)


def test_protocol_misuse_is_a_runtime_error():
    s = PerformanceModelScheduler(["cpu"], costs={"cpu": SaturationFit(0.01, 100.0, 0, True)})
    with pytest.raises(RuntimeError, match="Device not found: cuda:0"):
        s.dispatched_work("cuda:0", 1)
    with pytest.raises(RuntimeError, match="Device load underflow"):
        s.completed_work("cpu", 5)
    assert s.all_work_completed()


def _sum_of_slice(work, device):
    return int(np.arange(work.start, work.stop).sum())


def _sleep_per_item(work, device):
    """A device of about 1M items/s: chunk sizes stay moderate, so each device runs many."""
    import time

    time.sleep((work.stop - work.start) / 1e6)
    return work.stop - work.start


def test_dispatcher_on_emulated_cluster(hybrid_client, tmp_path):
    """Through WorkDispatcher on an in-process cluster (emulated cuda:0): every item once, models calibrated."""
    s = PerformanceModelScheduler(["cpu", "cuda:0"], model="cluster", profile_dir=tmp_path, start_batch=256,
                                  client=hybrid_client)
    dispatcher = WorkDispatcher(s, _sum_of_slice, reduce=sum, client=hybrid_client)
    total = 40_000
    s.begin_run(total)
    assert dispatcher.run(SliceGenerator(0, total)) == total * (total - 1) // 2
    records = dispatcher.last_run.records
    assert sum(r.size for r in records) == total and s.all_work_completed()
    assert {str(r.device) for r in records} == {"cpu", "cuda:0"}
    assert sum(s.calibration(d).seen for d in ("cpu", "cuda:0")) == len(records)
    assert s.identities[Device("cuda:0")].key == "emulated cuda:0"


def test_worker_processes_save_costs_under_the_workers_host_and_reuse_them(tmp_path):
    from distributed import Client

    from dsched import LocalHybridCluster

    with LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        s = PerformanceModelScheduler(["cpu", "cuda:0"], model="proc", profile_dir=tmp_path, start_batch=64,
                                      min_samples=3, chunk_seconds=0.005, client=client)
        s.begin_run(300_000)
        assert WorkDispatcher(s, _sleep_per_item, reduce=sum, client=client).run(SliceGenerator(0, 300_000)) == 300_000
        assert s.calibration("cpu").calibrated and s.calibration("cuda:0").calibrated
        wait_for_saves()
        data = json.loads(costs_path("proc", socket.gethostname(), tmp_path).read_text())
        assert "emulated cuda:0" in data["devices"]
        assert data["devices"]["emulated cuda:0"]["device"] == "cuda:0"
        again = PerformanceModelScheduler(["cpu", "cuda:0"], model="proc", profile_dir=tmp_path, client=client)
        saved = data["devices"]["emulated cuda:0"]
        assert again.estimates()[Device("cuda:0")] == SaturationFit(saved["t0"], saved["n_star"],
                                                                    saved["rms_log_error"], saved["saturated"])


GRAPH = {"model": {"name": "j2"}, "batch": {"size": 1000},
         "scheduler": {"devices": ["cpu", "cuda:0"]}, "options": {"emulate": True}}


def test_graph_type_and_auto(tmp_path, monkeypatch):
    monkeypatch.setenv("DSCHED_PROFILE_DIR", str(tmp_path))
    graph = parse_graph({**GRAPH, "scheduler": {**GRAPH["scheduler"], "type": "PerformanceModelScheduler",
                                                "chunk_seconds": [0.01, 0.02]}})
    s = graph.build_scheduler()
    assert isinstance(s, PerformanceModelScheduler) and s.model == "j2"
    assert type(parse_graph(GRAPH).build_scheduler()).__name__ == "StaticHybridScheduler"  # nothing saved yet
    for device in ("cpu", "cuda:0"):
        s.calibration(device).add(1, 1.0)
        for n in range(100, 1200, 100):
            s.calibration(device).add(n, n / 1e5)
    s.save_costs()
    assert isinstance(parse_graph(GRAPH).build_scheduler(), PerformanceModelScheduler)  # auto: the saved models
    with pytest.raises(GraphError, match="scheduler.chunk_seconds: only for type = 'PerformanceModelScheduler'"):
        parse_graph({**GRAPH, "scheduler": {"type": "StaticHybridScheduler", "chunk_seconds": 0.01}})
    with pytest.raises(GraphError, match="scheduler.capacities: not a setting of PerformanceModelScheduler"):
        parse_graph({**GRAPH, "scheduler": {"type": "PerformanceModelScheduler", "capacities": [4, 8]}})


def test_bind_reads_the_models_of_the_workers_hosts(hybrid_client, tmp_path):
    from dsched.costmodel import DeviceIdentity, save_costs

    here = socket.gethostname()
    save_costs("bound", DeviceIdentity(here, "cuda:0", True), "cuda:0", {"t0": 0.003, "n_star": 3000.0}, tmp_path)
    s = PerformanceModelScheduler(["cpu", "cuda:0"], model="bound", profile_dir=tmp_path, client=False)
    s.bind(hybrid_client)  # the worker that owns cuda:0 says it is emulated: its entry is found
    assert s.identities[Device("cuda:0")] == DeviceIdentity(here, "cuda:0", True)
    assert s.estimates()[Device("cuda:0")] == SaturationFit(0.003, 3000.0, 0.0, True)
    assert s.estimates()[Device("cpu")] is None
    # Every run binds its policy: on the cluster it is bound to, it asks the workers nothing and reads no file again.
    save_costs("bound", DeviceIdentity(here, "cuda:0", True), "cuda:0", {"t0": 0.005, "n_star": 3000.0}, tmp_path)
    s.bind(hybrid_client)
    assert s.estimates()[Device("cuda:0")] == SaturationFit(0.003, 3000.0, 0.0, True)
    # A device no worker owns yet (cuda:1 here) is identified here, and every bind asks again (it may join).
    wider = PerformanceModelScheduler(["cpu", "cuda:0", "cuda:1"], model="bound", profile_dir=tmp_path, client=False)
    wider.bind(hybrid_client)
    save_costs("bound", DeviceIdentity(here, "cuda:0", True), "cuda:0", {"t0": 0.007, "n_star": 3000.0}, tmp_path)
    wider.bind(hybrid_client)
    assert wider.estimates()[Device("cuda:0")] == SaturationFit(0.007, 3000.0, 0.0, True)


def test_runs_without_begin_run_and_one_after_another(hybrid_client):
    """A dispatcher that never calls begin_run: full chunks throughout, and the scheduler reusable."""
    s = PerformanceModelScheduler(["cpu", "cuda:0"], costs={"cpu": {"t0": 0.001, "n_star": 100.0},
                                                            "cuda:0": {"t0": 0.001, "n_star": 400.0}},
                                  chunk_seconds=0.01)
    dispatcher = WorkDispatcher(s, _sum_of_slice, reduce=sum, client=hybrid_client)
    for total in (10_000, 7_000):
        assert dispatcher.run(SliceGenerator(0, total)) == total * (total - 1) // 2
        assert s.all_work_completed()
    s.begin_run(5_000)
    assert dispatcher.run(SliceGenerator(0, 5_000)) == 5_000 * 4_999 // 2
    assert dispatcher.run(SliceGenerator(0, 3_000)) == 3_000 * 2_999 // 2  # announced run over: unknown again
