"""Properties of scheduling, for random configurations and batch sizes (hypothesis).

For any SimpleScheduler or StaticHybridScheduler configuration and any batch,
both a sync run and the async protocol (driven by hand, completing random
in-flight chunks) hand out ``range(n)`` exactly once, in order, in chunks no
larger than their device's batch size; loads never exceed capacity and end at
zero; and every choice is the greedy one.
"""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dsched import (
    ArrayLoader,
    Device,
    MappingLoader,
    SimpleScheduler,
    SliceGenerator,
    StaticHybridScheduler,
    WorkDispatcher,
    concat_reduce,
)

DEVICE_POOL = ["cpu", "cuda:0", "cuda:1", "cuda:2"]


@st.composite
def schedulers(draw):
    """A SimpleScheduler, or a StaticHybridScheduler over 1-3 distinct devices."""
    if draw(st.booleans()):
        batch = draw(st.integers(1, 50))
        capacity = draw(st.one_of(st.none(), st.integers(batch, 4 * batch)))
        return SimpleScheduler(draw(st.sampled_from(DEVICE_POOL)), batch, capacity)
    devices = draw(st.lists(st.sampled_from(DEVICE_POOL), min_size=1, max_size=3, unique=True))
    batches = [draw(st.integers(1, 50)) for _ in devices]
    capacities = [draw(st.integers(b, 4 * b)) for b in batches]
    priorities = [draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])) for _ in devices]
    return StaticHybridScheduler(devices, batches, capacities, priorities)


def greedy_choice(status):
    """The contract's rule, written independently: highest priority with room, first on ties."""
    best = None
    for s in status:
        if s.load + s.batch_size <= s.capacity and (best is None or s.priority > best.priority):
            best = s
    return None if best is None else (best.device, best.batch_size)


def check_chunks(chunks, n, batch_of):
    """``chunks`` of ``(device, slice)`` cover range(n) once, in order, each within its batch size."""
    position = 0
    for device, work in chunks:
        assert work.start == position and work.stop > work.start
        assert work.stop - work.start <= batch_of[device]
        position = work.stop
    assert position == n
    # Every chunk but the last is exactly its device's batch size.
    assert all(w.stop - w.start == batch_of[d] for d, w in chunks[:-1])


def slice_and_device(work, device):
    return device, work


@settings(max_examples=150, deadline=None)
@given(scheduler=schedulers(), n=st.integers(1, 2000))
def test_sync_run_covers_the_batch_on_the_zero_load_choice(scheduler, n):
    batch_of = {s.device: s.batch_size for s in scheduler.status()}
    first = greedy_choice(scheduler.status())
    chunks = WorkDispatcher(scheduler, slice_and_device, mode="sync").run(SliceGenerator(0, n))
    check_chunks(chunks, n, batch_of)
    assert {device for device, _ in chunks} == {first[0]}
    assert scheduler.all_work_completed()


@settings(max_examples=150, deadline=None)
@given(scheduler=schedulers(), n=st.integers(1, 2000), data=st.data())
def test_async_protocol_covers_the_batch_within_capacity(scheduler, n, data):
    batch_of = {s.device: s.batch_size for s in scheduler.status()}
    capacity_of = {s.device: s.capacity for s in scheduler.status()}
    generator = SliceGenerator(0, n)
    in_flight, chunks = [], []
    while generator.has_more() or in_flight:
        status = scheduler.status()
        choice = scheduler.schedule_work() if generator.has_more() else None
        assert choice == (greedy_choice(status) if generator.has_more() else None)
        # Dispatch when a device has room, unless hypothesis chooses to complete a chunk first.
        if choice is not None and not (in_flight and data.draw(st.booleans(), label="complete first")):
            device, size = choice
            m, work = generator.next(size)
            scheduler.dispatched_work(device, m)
            in_flight.append((device, m))
            chunks.append((device, work))
        else:
            assert in_flight, "no device has room and nothing is in flight: a deadlock"
            i = data.draw(st.integers(0, len(in_flight) - 1), label="completes")
            device, m = in_flight.pop(i)
            scheduler.completed_work(device, m)
        for s in scheduler.status():
            assert 0 <= s.load <= capacity_of[s.device]
        assert scheduler.all_work_completed() == (not in_flight)
    check_chunks(chunks, n, batch_of)
    assert all(s.load == 0 for s in scheduler.status())


@settings(max_examples=100, deadline=None)
@given(
    shape=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    axis_seed=st.integers(0, 10),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=20),
)
def test_loaders_round_trip_through_concat_reduce(shape, axis_seed, sizes):
    axis = axis_seed % len(shape)
    x = np.arange(int(np.prod(shape)), dtype=float).reshape(shape)
    whole = np.full([1] * len(shape), 7.0)  # size 1 along every axis: passed whole
    for loader in (ArrayLoader(x, axis=axis), MappingLoader({"x": x, "w": whole}, axis=axis)):
        pieces, i = [], 0
        while loader.has_more():
            n = sizes[i % len(sizes)]
            m, work = loader.next(n)
            assert 1 <= m <= n
            pieces.append(work)
            i += 1
        assert loader.offset == loader.total == x.shape[axis]
        joined = concat_reduce(pieces, axis=axis)
        np.testing.assert_array_equal(joined["x"] if isinstance(joined, dict) else joined, x)


@settings(max_examples=100, deadline=None)
@given(scheduler=schedulers())
def test_status_lists_devices_in_order_at_zero_load(scheduler):
    status = scheduler.status()
    assert [s.device for s in status] == scheduler.devices
    assert all(isinstance(s.device, Device) and s.load == 0 and s.capacity >= s.batch_size >= 1 for s in status)
