"""The scheduling policies: NEML2's protocol, greedy order, load accounting and validation.

Ports NEML2 v2.1.6 ``tests/dispatchers/test_StaticHybridScheduler.cxx`` and HEAD
``tests/cpp/test_static_hybrid_scheduler.cpp`` to this API, plus every
validation error of the contract.
"""

import re
import threading

import numpy as np
import pytest

from dsched import Device, DeviceStatus, SimpleScheduler, StaticHybridScheduler, WorkScheduler

CPU, GPU0, GPU1 = Device("cpu"), Device("cuda:0"), Device("cuda:1")


def loads(scheduler):
    return [s.load for s in scheduler.status()]


# --- SimpleScheduler ---------------------------------------------------------

def test_simple_scheduler_defaults_capacity_to_batch_size():
    s = SimpleScheduler("cpu", 8)
    assert isinstance(s, WorkScheduler)
    assert s.devices == [CPU] and s.device == CPU
    assert (s.batch_size, s.capacity) == (8, 8)
    assert s.schedule_work() == (CPU, 8)
    s.dispatched_work("cpu", 8)
    assert s.schedule_work() is None  # full: one chunk in flight
    s.completed_work(CPU, 8)
    assert s.schedule_work() == (CPU, 8)
    assert s.all_work_completed()


def test_simple_scheduler_capacity_holds_several_chunks():
    s = SimpleScheduler("cuda:0", batch_size=345, capacity=800)
    assert s.schedule_work() == (GPU0, 345)
    s.dispatched_work(GPU0, 345)
    assert s.schedule_work() == (GPU0, 345)
    s.dispatched_work(GPU0, 345)
    assert s.schedule_work() is None  # 690 + 345 > 800
    s.dispatched_work(GPU0, 110)  # a short last chunk still fits
    assert loads(s) == [800]
    assert not s.all_work_completed()
    s.completed_work(GPU0, 110)
    assert s.schedule_work() is None  # 690 + 345 > 800
    s.completed_work(GPU0, 345)
    assert s.schedule_work() == (GPU0, 345)  # 345 + 345 <= 800


def test_simple_scheduler_status_record():
    s = SimpleScheduler(Device("cuda:1"), 4, 12)
    [status] = s.status()
    assert isinstance(status, DeviceStatus)
    assert (status.device, status.batch_size, status.capacity, status.priority, status.load) == (GPU1, 4, 12, 1.0, 0)
    assert "SimpleScheduler(cuda:1(batch=4, capacity=12, load=0))" == repr(s)


@pytest.mark.parametrize("batch_size", [0, -3])
def test_simple_scheduler_batch_size_below_one(batch_size):
    with pytest.raises(ValueError, match=rf"batch_size: must be >= 1, got {batch_size}"):
        SimpleScheduler("cpu", batch_size)


@pytest.mark.parametrize("batch_size", [2.5, "8", True, None, 8.0])
def test_simple_scheduler_batch_size_not_an_int(batch_size):
    with pytest.raises(ValueError, match=r"batch_size: expected an integer >= 1, got"):
        SimpleScheduler("cpu", batch_size)


def test_simple_scheduler_accepts_numpy_integers():
    s = SimpleScheduler("cpu", np.int64(4), np.int32(8))
    assert (s.batch_size, s.capacity) == (4, 8) and type(s.batch_size) is int


def test_simple_scheduler_capacity_below_batch_size():
    with pytest.raises(ValueError, match=r"capacity: 4 is below batch_size 8"):
        SimpleScheduler("cpu", 8, 4)


@pytest.mark.parametrize("capacity", [0, 1.5, "16"])
def test_simple_scheduler_bad_capacity(capacity):
    with pytest.raises(ValueError, match=r"capacity: "):
        SimpleScheduler("cpu", 1, capacity)


def test_simple_scheduler_bad_device():
    with pytest.raises(ValueError, match=r"^device: 'gpu' is not a device"):
        SimpleScheduler("gpu", 4)
    with pytest.raises(ValueError, match=r"device: SimpleScheduler takes one device, got \['cpu', 'cuda:0'\]"):
        SimpleScheduler(["cpu", "cuda:0"], 4)


# --- StaticHybridScheduler: upstream v2.1.6 ------------------------------------

def test_hybrid_single_device_status():
    s = StaticHybridScheduler([CPU], batch_sizes=[2], capacities=[3], priorities=[1])
    [status] = s.status()
    assert (status.device, status.batch_size, status.capacity, status.priority, status.load) == (CPU, 2, 3, 1.0, 0)
    s.dispatched_work(CPU, 1)
    assert loads(s) == [1]
    s.dispatched_work(CPU, 2)
    assert loads(s) == [3]
    s.completed_work(CPU, 1)
    assert loads(s) == [2]


def test_hybrid_multiple_devices_status():
    s = StaticHybridScheduler(["cpu", "cuda:0", "cuda:1"], [2, 3, 4], [3, 4, 5], [3, 2, 1])
    status = s.status()
    assert [(r.device, r.batch_size, r.capacity, r.priority, r.load) for r in status] == [
        (CPU, 2, 3, 3.0, 0),
        (GPU0, 3, 4, 2.0, 0),
        (GPU1, 4, 5, 1.0, 0),
    ]
    s.dispatched_work(CPU, 1)
    s.dispatched_work(GPU0, 2)
    s.dispatched_work(GPU1, 3)
    assert loads(s) == [1, 2, 3]
    s.completed_work(CPU, 1)
    s.completed_work(GPU0, 2)
    s.completed_work(GPU1, 3)
    assert loads(s) == [0, 0, 0]
    assert s.all_work_completed()


def test_status_returns_copies():
    s = StaticHybridScheduler(["cpu"], 2)
    s.status()[0].load = 99
    assert loads(s) == [0]


# --- StaticHybridScheduler: greedy order (HEAD) -------------------------------

def test_greedy_highest_priority_with_room_wins():
    s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 4], capacities=[4, 8], priorities=[1.0, 2.0])
    assert s.devices == [CPU, GPU0]
    assert s.schedule_work() == (GPU0, 4)  # both free: cuda:0 on priority
    s.dispatched_work(GPU0, 4)
    assert s.schedule_work() == (GPU0, 4)  # 4 + 4 <= 8: still room
    s.dispatched_work(GPU0, 4)
    assert s.schedule_work() == (CPU, 4)  # cuda:0 full: the CPU
    s.dispatched_work(CPU, 4)
    assert s.schedule_work() is None  # both full
    s.completed_work("cuda:0", 8)
    s.completed_work("cpu", 4)
    assert s.all_work_completed()
    assert s.schedule_work() == (GPU0, 4)  # drained: the highest priority again


def test_greedy_prefers_a_higher_priority_listed_first():
    # NEML2 v2.1.6 returned the *last* available device; the documented rule picks cpu here.
    s = StaticHybridScheduler(["cpu", "cuda:0", "cuda:1"], [1, 2, 3], priorities=[5, 1, 1])
    assert s.schedule_work() == (CPU, 1)


@pytest.mark.parametrize("devices", [["cpu", "cuda:0"], ["cuda:0", "cpu"], ["cuda:1", "cuda:0", "cpu"]])
def test_greedy_ties_go_to_the_first_listed(devices):
    s = StaticHybridScheduler(devices, batch_sizes=2)
    first = Device(devices[0])
    assert s.schedule_work() == (first, 2)
    s.dispatched_work(first, 2)
    assert s.schedule_work() == (Device(devices[1]), 2)


def test_greedy_skips_a_device_whose_batch_does_not_fit():
    # cuda:0 has load 1 of capacity 8 with batch 8: no room, although not full.
    s = StaticHybridScheduler(["cpu", "cuda:0"], [2, 8], [2, 8], [1, 2])
    s.dispatched_work(GPU0, 1)
    assert s.schedule_work() == (CPU, 2)


# --- StaticHybridScheduler: validation ------------------------------------------

def test_broadcast_of_scalars_and_single_entry_lists():
    for batch_sizes in (8, [8], (8,)):
        s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes)
        assert [(r.batch_size, r.capacity, r.priority) for r in s.status()] == [(8, 8, 1.0), (8, 8, 1.0)]
    s = StaticHybridScheduler(["cpu", "cuda:0", "cuda:1"], [4], capacities=[16], priorities=[3])
    assert [(r.batch_size, r.capacity, r.priority) for r in s.status()] == [(4, 16, 3.0)] * 3
    s = StaticHybridScheduler(["cpu", "cuda:0"], [4, 8], capacities=20, priorities=2.5)
    assert [(r.batch_size, r.capacity, r.priority) for r in s.status()] == [(4, 20, 2.5), (8, 20, 2.5)]


def test_no_devices():
    with pytest.raises(ValueError, match=r"devices: at least one device is required, got none"):
        StaticHybridScheduler([], 1)


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:1", Device("cuda:1")]])
def test_duplicate_device(devices):
    with pytest.raises(ValueError, match=r"devices: duplicate device cuda:\d"):
        StaticHybridScheduler(devices, 1)


def test_two_cpus():
    with pytest.raises(ValueError, match=r"devices: duplicate device cpu"):
        StaticHybridScheduler(["cpu", "cpu"], 1)
    # NEML2's upstream case "cpu" + "cpu:0": here 'cpu:0' is not a device name at all.
    with pytest.raises(ValueError, match=r"^devices: 'cpu:0' is not a device"):
        StaticHybridScheduler(["cpu", "cpu:0"], 1)


def test_more_than_one_cpu_is_rejected_by_build_status():
    # Device parsing already rejects every second CPU spelling; the rule still guards the status list.
    from dsched.schedulers.base import build_status

    with pytest.raises(ValueError, match=r"devices: (duplicate device cpu|more than one CPU)"):
        build_status([CPU, Device("cpu")], 1, None)


def test_bare_cuda_next_to_indexed_cuda():
    with pytest.raises(ValueError, match=r"devices: a bare 'cuda' next to cuda:0 is ambiguous"):
        StaticHybridScheduler(["cuda", "cuda:0"], 1)


def test_invalid_device_name():
    with pytest.raises(ValueError, match=r"^devices: 'gpu' is not a device"):
        StaticHybridScheduler(["cpu", "gpu"], 1)


@pytest.mark.parametrize("batch_sizes, field, shown", [(0, r"batch_sizes\[0\]", "0"), ([4, -1], r"batch_sizes\[1\]", "-1")])
def test_batch_size_below_one(batch_sizes, field, shown):
    with pytest.raises(ValueError, match=rf"{field}: must be >= 1, got {shown}"):
        StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes)


def test_batch_size_not_an_int():
    with pytest.raises(ValueError, match=r"batch_sizes\[1\]: expected an integer >= 1, got 2.5"):
        StaticHybridScheduler(["cpu", "cuda:0"], [4, 2.5])


def test_capacity_below_batch_size():
    with pytest.raises(ValueError, match=r"capacities\[1\]: 4 is below the batch size 8 of cuda:0"):
        StaticHybridScheduler(["cpu", "cuda:0"], [2, 8], [2, 4])
    with pytest.raises(ValueError, match=r"capacities\[0\]: must be >= 1, got 0"):
        StaticHybridScheduler(["cuda:0"], 8, 0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"batch_sizes": [1, 2, 3]}, "batch_sizes"),
        ({"batch_sizes": 1, "capacities": [1, 2, 3]}, "capacities"),
        ({"batch_sizes": 1, "priorities": [1, 2, 3]}, "priorities"),
        ({"batch_sizes": [], "priorities": None}, "batch_sizes"),
    ],
)
def test_list_of_the_wrong_length(kwargs, field):
    with pytest.raises(ValueError, match=rf"{field}: expected 1 or 2 values \(one per device\), got \d"):
        StaticHybridScheduler(["cpu", "cuda:0"], **kwargs)


def test_priority_not_a_number():
    with pytest.raises(ValueError, match=r"priorities\[1\]: expected a number, got 'high'"):
        StaticHybridScheduler(["cpu", "cuda:0"], 1, priorities=[1, "high"])


# --- protocol misuse -----------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: SimpleScheduler("cuda:0", 4, 8), lambda: StaticHybridScheduler(["cpu", "cuda:0"], 4, 8)])
def test_oversubscription(make):
    s = make()
    s.dispatched_work("cuda:0", 8)
    with pytest.raises(RuntimeError, match=r"Device oversubscribed: cuda:0 would carry 9 items, capacity 8"):
        s.dispatched_work("cuda:0", 1)
    assert s.status()[-1].load == 8  # a rejected dispatch changes nothing


@pytest.mark.parametrize("device", ["cuda:3", "gpu", Device("cuda")])
def test_unknown_device(device):
    s = StaticHybridScheduler(["cpu", "cuda:0"], 4)
    with pytest.raises(RuntimeError, match=rf"Device not found: {device}"):
        s.dispatched_work(device, 1)
    with pytest.raises(RuntimeError, match=rf"Device not found: {device}"):
        s.completed_work(device, 1)


def test_load_underflow():
    s = StaticHybridScheduler(["cpu", "cuda:0"], 4)
    s.dispatched_work("cpu", 3)
    with pytest.raises(RuntimeError, match=r"Device load underflow: cpu completed 4 items, load 3"):
        s.completed_work("cpu", 4)
    assert loads(s) == [3, 0]
    with pytest.raises(RuntimeError, match=r"underflow"):
        SimpleScheduler("cpu", 2).completed_work("cpu", 1)


def test_load_accounting_is_thread_safe():
    s = StaticHybridScheduler(["cpu", "cuda:0"], 1, capacities=10**9)

    def hammer():
        for _ in range(2000):
            s.dispatched_work("cuda:0", 1)
            s.completed_work("cuda:0", 1)
            s.dispatched_work("cpu", 2)
        for _ in range(2000):
            s.completed_work("cpu", 2)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.all_work_completed()


@pytest.mark.parametrize("n", [0, -5, 1.5, True, "3"])
def test_load_accounting_rejects_item_counts_that_are_not_positive_integers(n):
    s = StaticHybridScheduler(["cpu", "cuda:0"], [4, 8], [8, 16])
    with pytest.raises(RuntimeError, match=re.escape(f"Invalid item count {n!r} for cpu")):
        s.dispatched_work("cpu", n)
    s.dispatched_work("cpu", 4)
    with pytest.raises(RuntimeError, match="Invalid item count"):
        s.completed_work("cpu", n)
    assert [st.load for st in s.status()] == [4, 0]


def test_priorities_must_be_finite():
    with pytest.raises(ValueError, match=r"priorities\[1\]: expected a finite number, got nan"):
        StaticHybridScheduler(["cpu", "cuda:0"], 4, priorities=[1.0, float("nan")])
