"""The dask.array path: plan, as_batched, map_blocks, and placement on an in-process cluster."""

import os
import threading

import dask
import dask.array as da
import numpy as np
import pytest

import dsched
from dsched import Device, SimpleScheduler, StaticHybridScheduler, as_batched, current_device, map_blocks, plan
from dsched.blocks.engines import expression_engine_enabled
from dsched.models.j2 import j2_update, loading_strain
from dsched.placement import planned_block_of

CPU, GPU = Device("cpu"), Device("cuda:0")
# Dask's expression engine (array.query-planning), fixed when dask.array was first imported: CI runs this
# module under both settings (.ci/run).
EXPRESSIONS = expression_engine_enabled()


@pytest.fixture(autouse=True)
def no_measured_profile(tmp_path_factory, monkeypatch):
    """Plans from priorities: no profile of this host is in effect (an empty profile directory)."""
    monkeypatch.setenv("DSCHED_PROFILE_DIR", str(tmp_path_factory.mktemp("no-profiles")))


def hybrid(**kwargs):
    options = dict(batch_sizes=[3, 8], priorities=[1, 2])
    options.update(kwargs)
    return StaticHybridScheduler(["cpu", "cuda:0"], **options)


def as_pairs(chunks):
    return [(str(d), m) for d, m in chunks]


def per_item(chunks):
    """The planned device of every item, in batch order."""
    return np.repeat([str(d) for d, _ in chunks], [m for _, m in chunks])


# --- plan -------------------------------------------------------------------------

def test_plan_simple_scheduler_is_uniform_with_a_short_last_chunk():
    assert as_pairs(plan(10, SimpleScheduler("cpu", 4))) == [("cpu", 4), ("cpu", 4), ("cpu", 2)]
    assert as_pairs(plan(8, SimpleScheduler("cuda", 4, capacity=8))) == [("cuda:0", 4), ("cuda:0", 4)]
    assert as_pairs(plan(1, SimpleScheduler("cpu", 4))) == [("cpu", 1)]


def test_plan_hybrid_replays_the_greedy_policy_in_simulated_time():
    # Speeds from priorities: cuda:0 does 2 items/s, the CPU 1. cuda:0 takes 8
    # (busy until 4), the CPU 3 (until 3); at 3 the CPU takes 3 more (until 6),
    # at 4 cuda:0 takes 8 (until 8), at 6 the CPU (until 9), at 8 cuda:0 (until
    # 12), at 9 the CPU, at 12 cuda:0 takes the 4 left.
    assert as_pairs(plan(40, hybrid())) == [
        ("cuda:0", 8), ("cpu", 3), ("cpu", 3), ("cuda:0", 8), ("cpu", 3), ("cuda:0", 8), ("cpu", 3), ("cuda:0", 4),
    ]


def test_plan_capacity_above_the_batch_size_takes_several_chunks_at_once():
    s = hybrid(capacities=[3, 16])
    # cuda:0 holds two chunks from the start (queued one after the other: done at 4 and 8).
    assert as_pairs(plan(30, s)) == [
        ("cuda:0", 8), ("cuda:0", 8), ("cpu", 3), ("cpu", 3), ("cuda:0", 8),
    ]


def test_plan_equal_priorities_first_listed_wins_ties():
    s = StaticHybridScheduler(["cuda:0", "cpu"], batch_sizes=4)
    assert as_pairs(plan(12, s)) == [("cuda:0", 4), ("cpu", 4), ("cuda:0", 4)]


def test_plan_speeds_balance_the_finish_times():
    s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=10)
    chunks = plan(1100, s, speeds={"cpu": 1.0, "cuda:0": 10.0})
    items = {d: sum(m for dd, m in chunks if dd == d) for d in (CPU, GPU)}
    assert items[CPU] + items[GPU] == 1100
    # Proportional to speed, within one chunk: both finish within 10 items of each other's time.
    assert abs(items[GPU] - 1000) <= 10 and abs(items[CPU] - 100) <= 10
    assert abs(items[GPU] / 10.0 - items[CPU] / 1.0) <= 10


def test_plan_is_pure_and_ignores_the_current_load():
    s = hybrid()
    first = plan(40, s)
    s.dispatched_work("cuda:0", 8)
    assert plan(40, s) == first
    assert [st.load for st in s.status()] == [0, 8]
    assert sum(m for _, m in first) == 40


def test_plan_uses_the_measured_profile_of_this_host(tmp_path, monkeypatch):
    import json

    from dsched import tuning

    s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=10)
    monkeypatch.setenv("DSCHED_PROFILE_DIR", str(tmp_path))
    path = tuning.profile_path("j2")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"devices": {"cpu": {"items_per_s": 1.0}, "cuda:0": {"items_per_s": 10.0}}}))
    assert dsched.array.default_speeds(s) == ({CPU: 1.0, GPU: 10.0}, "profile")
    assert plan(1100, s) == plan(1100, s, speeds={"cpu": 1.0, "cuda:0": 10.0})
    # A profile lacking one of the devices is not used: the priorities are.
    path.write_text(json.dumps({"devices": {"cpu": {"items_per_s": 1.0}}}))
    os.utime(path, ns=(path.stat().st_mtime_ns + 10**9,) * 2)  # a new stamp, so the profile is re-read
    assert dsched.array.default_speeds(s) == ({CPU: 1.0, GPU: 1.0}, "priorities")


def test_plan_nonpositive_priorities_count_as_the_smallest_positive_one():
    s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=4, priorities=[0, 3])
    assert dsched.array.default_speeds(s)[0] == {CPU: 3.0, GPU: 3.0}


@pytest.mark.parametrize(
    "n, kwargs, message",
    [
        (0, {}, "n: expected an integer number of items >= 1, got 0"),
        (-3, {}, "n: expected an integer number of items >= 1, got -3"),
        (2.5, {}, "n: expected an integer number of items >= 1, got 2.5"),
        (True, {}, "n: expected an integer number of items >= 1, got True"),
        (10, {"speeds": {"cpu": 1.0}}, "speeds: no speed for cuda:0"),
        (10, {"speeds": {"cpu": 1.0, "cuda:0": -2}}, "speeds['cuda:0']: expected a finite number of items per second > 0, got -2"),
        (10, {"speeds": {"cpu": 1.0, "cuda:0": float("nan")}}, "speeds['cuda:0']: expected a finite number"),
        (10, {"speeds": {"cpu": 1, "cuda:0": 1, "cuda:1": 1}}, "speeds: cuda:1 is not one of the scheduler's devices"),
        (10, {"speeds": {"gpu": 1}}, "speeds: 'gpu' is not a device"),
        (10, {"speeds": [1, 2]}, "speeds: expected a mapping"),
    ],
)
def test_plan_rejects_bad_input_naming_the_field(n, kwargs, message):
    with pytest.raises(ValueError) as err:
        plan(n, hybrid(), **kwargs)
    assert message in str(err.value)


def test_plan_rejects_a_non_scheduler():
    with pytest.raises(ValueError, match="scheduler: expected a WorkScheduler"):
        plan(10, "cpu")


# --- as_batched -----------------------------------------------------------------------

def test_as_batched_numpy_and_dask_inputs_take_the_plan_along_axis_0_only():
    s = hybrid()
    x = np.arange(40 * 6.0).reshape(40, 6)
    xb, chunks = as_batched(x, s)
    assert chunks == plan(40, s)
    assert xb.chunks == (tuple(m for _, m in chunks), (6,))
    np.testing.assert_array_equal(xb.compute(scheduler="sync"), x)
    xd = da.from_array(x, chunks=(7, 2))
    xdb, chunks_d = as_batched(xd, s)
    assert chunks_d == chunks and xdb.chunks == xb.chunks
    np.testing.assert_array_equal(xdb.compute(scheduler="sync"), x)


def test_as_batched_rejects_what_is_not_a_batch():
    with pytest.raises(ValueError, match="x: expected a NumPy or Dask array, got list"):
        as_batched([1, 2, 3], hybrid())
    with pytest.raises(ValueError, match="x: a 0-d array has no batch axis"):
        as_batched(np.array(3.0), hybrid())
    with pytest.raises(ValueError, match=r"x: the batch is empty \(length 0 along axis 0\)"):
        as_batched(np.zeros((0, 6)), hybrid())


# --- map_blocks: Dask's semantics (local scheduler) ------------------------------------------

def j2_stress(strain, plastic_strain, alpha):
    """A user model: the J2 update's stress only."""
    return j2_update(strain, plastic_strain, alpha, tangent=False)["stress"]


def j2_stress_columns(strain, plastic_strain, alpha):
    """The model with ``alpha`` as an (m, 1) column, as Dask's alignment wants it."""
    return j2_stress(strain, plastic_strain, alpha[:, 0])


def j2_inputs(n):
    strain = loading_strain(np.arange(n))
    return strain, np.zeros((n, 6)), np.zeros(n)


def sizes_of(chunks):
    return tuple(m for _, m in chunks)


def test_map_blocks_j2_equals_the_whole_batch_in_numpy():
    strain, plastic, alpha = j2_inputs(100)
    reference = j2_stress(strain, plastic, alpha)
    # Dask aligns inputs on their last axes: the per-item alpha goes in as a column.
    inputs = [da.from_array(strain, chunks=(30, 6)), da.from_array(plastic, chunks=(33, 6)),
              da.from_array(alpha[:, None], chunks=(25, 1))]
    # rechunk=True: every batch input is cut by the plan first.
    y = map_blocks(j2_stress_columns, *inputs, scheduler=hybrid(), rechunk=True, dtype=float)
    assert y.chunks == (sizes_of(plan(100, hybrid())), (6,))
    np.testing.assert_array_equal(y.compute(scheduler="sync"), reference)
    # Inputs already cut by the plan (as_batched) give the same blocks without it.
    batched = [as_batched(x, hybrid())[0] for x in (strain, plastic, alpha[:, None])]
    z = map_blocks(j2_stress_columns, *batched, scheduler=hybrid(), dtype=float)
    assert z.chunks == y.chunks
    assert z.name == map_blocks(j2_stress_columns, *batched, scheduler=hybrid(), dtype=float).name
    np.testing.assert_array_equal(z.compute(scheduler="sync"), reference)


def test_map_blocks_keeps_the_inputs_chunks_on_every_axis():
    x = da.from_array(np.arange(20.0 * 10).reshape(20, 10), chunks=(7, 4))
    y = map_blocks(lambda b: b + 1, x, scheduler=hybrid())
    assert y.chunks == x.chunks
    same = map_blocks(lambda b: b * 2, x, scheduler=hybrid(), chunks=x.chunks)
    assert same.chunks == x.chunks
    np.testing.assert_array_equal(same.compute(scheduler="sync"), 2 * x.compute())


def test_map_blocks_numpy_arrays_and_constants_pass_whole_as_in_dask():
    x = da.arange(20.0, chunks=6)
    table = np.arange(3.0)
    y = map_blocks(lambda a, t, c, *, scale: (a + t.sum() + c) * scale, x, table, 5.0, scale=2.0,
                   scheduler=SimpleScheduler("cpu", 6))
    np.testing.assert_array_equal(y.compute(scheduler="sync"), (np.arange(20.0) + 3.0 + 5.0) * 2.0)


def test_map_blocks_a_length_changing_function_follows_dask_never_a_wrong_shape():
    x = da.arange(10, chunks=5)
    # Dask's answer: one maximum per input block, whatever the plan would have cut.
    peaks = map_blocks(lambda b: b.max(axis=0, keepdims=True), x, chunks=(1,), scheduler=hybrid())
    assert peaks.shape == (2,)
    np.testing.assert_array_equal(peaks.compute(scheduler="sync"), [4, 9])
    halves = map_blocks(lambda b: b[::2], da.ones((20, 10), chunks=(10, 5)), chunks=(5, 5), scheduler=hybrid())
    assert halves.shape == (10, 10)
    np.testing.assert_array_equal(halves.compute(scheduler="sync"), np.ones((10, 10)))
    # Declared wrongly: an error naming the block and both shapes, at compute time.
    wrong = map_blocks(lambda b: b[::2], da.ones((20, 10), chunks=(10, 5)), scheduler=hybrid())
    with pytest.raises(ValueError, match=r"block \([01], [01]\) of 'lambda-[0-9a-f]+' has shape \(5, 5\), "
                                         r"but the array declares \(10, 5\) for it"):
        wrong.compute(scheduler="sync")


def test_map_blocks_rechunk_true_keeps_the_blocks_a_length_changing_function_declares(caplog):
    x = da.arange(10, chunks=5)
    with caplog.at_level("WARNING", logger="dsched.array"):
        peaks = map_blocks(lambda b: b.max(keepdims=True), x, chunks=(1,), scheduler=hybrid(), rechunk=True)
    np.testing.assert_array_equal(peaks.compute(scheduler="sync"), [4, 9])
    assert "rechunk=True: chunks= declares 1 along the batch axis, so the input's blocks (5, 5) are kept" in caplog.text


def test_map_blocks_broadcasts_length_1_and_lower_dimensional_inputs():
    x = da.from_array(np.arange(12.0).reshape(6, 2), chunks=(2, 2))
    row = da.from_array(np.array([[10.0, 20.0]]), chunks=(1, 2))  # length 1 along axis 0
    col = da.from_array(np.array([100.0, 200.0]), chunks=2)  # one axis: aligned on the last, as NumPy
    y = map_blocks(lambda a, r, c: a + r + c, x, row, col, scheduler=hybrid())
    np.testing.assert_array_equal(y.compute(scheduler="sync"), x.compute() + [[110.0, 220.0]])


def test_map_blocks_block_info_of_a_1d_input_beside_a_2d_one_is_dasks():
    x = da.ones((4, 6), chunks=(2, 3))
    v = da.ones(6, chunks=3)

    def info(a, b, block_info=None):
        return np.full(a.shape, block_info[1]["array-location"][0][0] * 10 + block_info[1]["chunk-location"][0])

    got = map_blocks(info, x, v, scheduler=hybrid(), dtype=int).compute(scheduler="sync")
    # np.dtype: Dask's own expression engine keeps dtype=int as the Python type and fails on it.
    expected = da.map_blocks(info, x, v, dtype=np.dtype(int)).compute(scheduler="sync")
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got[0], [0, 0, 0, 31, 31, 31])


def test_map_blocks_drop_axis_0_follows_dask_and_is_not_placed(caplog):
    x = da.from_array(np.arange(12.0).reshape(4, 3), chunks=(2, 3))
    for axis in (0, -2):  # -2 is axis 0 of a 2-D input
        with caplog.at_level("WARNING", logger="dsched.array"):
            y = map_blocks(lambda a: a.sum(axis=0), x, drop_axis=axis, scheduler=hybrid())
        np.testing.assert_array_equal(y.compute(scheduler="sync"), x.compute().sum(axis=0))
        blocks = [planned_block_of(t) for t in dict(y.__dask_graph__()).values()]
        assert [b for b in blocks if b is not None] == []
        assert "drop_axis drops the batch axis (axis 0)" in caplog.text


def test_map_blocks_without_an_array_argument_is_one_unplaced_block():
    y = map_blocks(lambda: np.arange(3), chunks=((3,),), dtype=int, scheduler=hybrid())
    np.testing.assert_array_equal(y.compute(scheduler="sync"), [0, 1, 2])


def test_map_blocks_dtype_new_axis_drop_axis_and_meta():
    xb, chunks = as_batched(np.arange(30.0).reshape(10, 3), SimpleScheduler("cpu", 4))
    x, s = xb.compute(), SimpleScheduler("cpu", 4)
    summed = map_blocks(lambda a: a.sum(axis=1), xb, scheduler=s, drop_axis=1, dtype=float)
    assert summed.chunks == ((4, 4, 2),)
    np.testing.assert_array_equal(summed.compute(scheduler="sync"), x.sum(axis=1))
    widened = map_blocks(lambda a: np.concatenate([a, a], axis=1), xb, scheduler=s, chunks=(xb.chunks[0], (6,)))
    assert widened.chunks == ((4, 4, 2), (6,))
    np.testing.assert_array_equal(widened.compute(scheduler="sync"), np.concatenate([x, x], axis=1))
    expanded = map_blocks(lambda a: a[:, :, None], xb, scheduler=s, new_axis=2)
    assert expanded.chunks == ((4, 4, 2), (3,), (1,))
    np.testing.assert_array_equal(expanded.compute(scheduler="sync"), x[:, :, None])
    as_int = map_blocks(lambda a: a.astype(np.int32), xb, scheduler=s, meta=np.empty((0, 0), dtype=np.int32))
    assert as_int.dtype == np.int32
    np.testing.assert_array_equal(as_int.compute(scheduler="sync"), x.astype(np.int32))


def test_map_blocks_block_info_sees_the_planned_blocks():
    def where(a, block_info=None):
        start, stop = block_info[0]["array-location"][0]
        return np.full(len(a), start * 1000 + stop)

    x = da.zeros(10, chunks=10)
    y = map_blocks(where, x, scheduler=SimpleScheduler("cpu", 4), rechunk=True, dtype=int)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), [4] * 4 + [4008] * 4 + [8010] * 2)


def optimized_graph(collection) -> tuple:
    """The graph ``compute`` sends for ``collection`` (optimized, and fused on the classic engine), and the name
    of its output keys."""
    (optimized,) = dask.optimize(collection)
    return dict(optimized.__dask_graph__()), optimized.name


def test_map_blocks_layer_fuses_with_its_neighbours_and_keeps_each_plan():
    s = hybrid()
    y = map_blocks(lambda a: a * 2, as_batched(np.arange(40.0), s)[0], scheduler=s)
    z = -(y + 1)
    graph, output = optimized_graph(z)
    planned = {key: planned_block_of(t) for key, t in graph.items() if planned_block_of(t) is not None}
    # One task per block carrying its block's plan, in block order.
    assert [(str(b.device), b.size) for _, b in sorted(planned.items(), key=lambda kb: kb[0][1:])] == \
        as_pairs(plan(40, s))
    if EXPRESSIONS:
        # No low-level fusion on the expression engine: the planned tasks are the map's own, the
        # neighbours separate tasks.
        assert {key[0] for key in planned} == {y.name}
        assert len([key for key in graph if key[0] == output]) == len(plan(40, s))
    else:
        from dask.layers import Blockwise

        assert isinstance(y.dask.layers[y.name], Blockwise)
        from dask._task_spec import Alias

        # The source, the map and both neighbours fused into one task per block (named after the chain,
        # the output keys aliases of them).
        assert all(key[0].endswith(output) for key in planned)
        assert len([t for t in graph.values() if not isinstance(t, Alias)]) == len(plan(40, s))


def test_map_blocks_places_blocks_of_any_chunking_by_the_policy():
    s = hybrid()
    x = da.zeros(40, chunks=10)  # not the plan's sizes: kept, each block given a device by the policy
    y = map_blocks(np.negative, x, scheduler=s)
    assert y.chunks == x.chunks
    layer = {key: t for key, t in dict(y.__dask_graph__()).items() if key[0] == y.name}
    planned = [planned_block_of(layer[key]) for key in sorted(layer)]
    assert [str(b.device) for b in planned] == [str(d) for d in dsched.array.plan_blocks([10] * 4, s)]
    assert [str(d) for d in dsched.array.plan_blocks([10] * 4, s)] == ["cuda:0", "cpu", "cuda:0", "cpu"]


def test_map_blocks_without_a_worker_runs_every_block_here():
    # A local scheduler: the CPU plan is kept; an absent GPU falls back to the CPU.
    devices = map_blocks(label, as_batched(np.zeros(40), hybrid())[0], scheduler=hybrid(),
                         dtype=object).compute(scheduler="sync")
    assert set(devices) == {"cpu@-"}


def test_map_blocks_rejects_bad_input_before_any_work():
    with pytest.raises(TypeError, match="fn: expected a callable, got 3"):
        map_blocks(3, da.zeros(4), scheduler=hybrid())
    with pytest.raises(ValueError, match="scheduler: expected a WorkScheduler, got 'cpu'"):
        map_blocks(np.negative, da.zeros(4), scheduler="cpu")
    with pytest.raises(ValueError, match=r"drop_axis out of range \(drop_axis=\[2\], but output is 2d\)"):
        map_blocks(np.negative, da.zeros((4, 2)), drop_axis=2, scheduler=hybrid())


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((da.zeros((4, 4), chunks=2),), {"drop_axis": 3}),
        ((da.zeros((4, 4), chunks=2),), {"chunks": (2,)}),
        ((da.zeros((4, 4), chunks=2),), {"chunks": ((4,), (1,), (1,))}),
        ((), {"drop_axis": 0}),
    ],
)
def test_map_blocks_raises_dasks_own_errors_before_any_work(args, kwargs):
    with pytest.raises(ValueError) as expected:
        da.map_blocks(np.negative, *args, **kwargs)
    with pytest.raises(ValueError) as got:
        map_blocks(np.negative, *args, scheduler=hybrid(), **kwargs)
    assert str(got.value) == str(expected.value)


def test_map_blocks_builds_with_the_engine_of_its_arrays():
    from dask.array.core import from_array as classic_from_array

    from dsched.blocks.engines import engine_of

    s = SimpleScheduler("cpu", 4)
    # Classic arrays (dask.array.core) under either setting: built with the classic engine.
    y = map_blocks(np.negative, classic_from_array(np.arange(10.0), chunks=5), scheduler=s, rechunk=True)
    assert type(y).__module__ == "dask.array.core" and y.chunks == ((4, 4, 2),)
    np.testing.assert_array_equal(y.compute(scheduler="sync"), -np.arange(10.0))
    z = map_blocks(np.negative, da.arange(10.0, chunks=5), scheduler=s)
    assert type(z) is da.Array and engine_of([z]).expression == EXPRESSIONS == engine_of([]).expression
    if EXPRESSIONS:  # neither engine's map_blocks takes the other's arrays
        with pytest.raises(ValueError, match=r"^args: mixes Dask arrays of the classic and the expression engine"):
            map_blocks(np.add, classic_from_array(np.arange(4.0), chunks=2), da.arange(4.0, chunks=2), scheduler=s)


def test_plan_of_a_huge_batch_is_refused_at_once():
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"n: 1000000000000000000 items make at least 125000000000000000 chunks "
                                         r"of at most 8 items, more than a plan holds \(1000000\)"):
        plan(10**18, hybrid())
    assert time.perf_counter() - start < 1.0
    # A batch size that makes few chunks plans instantly, however large the batch.
    assert plan(10**18, SimpleScheduler("cpu", 10**17)) == [(CPU, 10**17)] * 10


def test_plan_blocks_replays_the_policy_over_given_blocks():
    s = hybrid()
    assert dsched.array.plan_blocks(sizes_of(plan(40, s)), s) == [d for d, _ in plan(40, s)]
    with pytest.raises(ValueError, match=r"sizes: expected block sizes >= 0"):
        dsched.array.plan_blocks([3, -1], s)


# --- placement on a cluster (cpu + emulated cuda:0, in-process) ------------------------------

def batched(x, scheduler):
    """``x`` as a Dask array cut by the scheduler's plan (its blocks are then the planned chunks)."""
    return as_batched(x, scheduler)[0]


RECORDS = []
_records_lock = threading.Lock()


def label(a):
    """Each item's device and worker, as the block saw them."""
    from distributed import get_worker

    try:
        worker = get_worker().name
    except ValueError:
        worker = "-"
    return np.array([f"{current_device()}@{worker}"] * len(a), dtype=object)


def recorded_double(a, block_info=None):
    """Doubles the block and records where it ran (in-process workers share this list)."""
    from distributed import get_worker

    with _records_lock:
        RECORDS.append((block_info[0]["array-location"][0], str(current_device()), get_worker().name, len(a)))
    return a * 2.0


def expected_records(chunks):
    out, start = [], 0
    for device, m in chunks:
        out.append(((start, start + m), str(device), str(device), m))
        start += m
    return out


@pytest.fixture
def records():
    with _records_lock:
        RECORDS.clear()
    yield RECORDS


def test_defaults_are_in_effect():
    # Placement must hold under Dask's defaults, where fusion drops annotations (on the classic engine)
    # and the expression engine keeps none (dask/dask#10937).
    assert dask.config.get("optimization.fuse.active", None) is not False
    assert EXPRESSIONS == (dask.config.get("array.query-planning", None) is True)
    assert type(da.zeros(3)).__module__ == ("dask.array._array_expr._collection" if EXPRESSIONS else "dask.array.core")


def test_every_block_runs_on_its_planned_device(hybrid_client):
    s = hybrid()
    out = map_blocks(label, batched(np.zeros(40), s), scheduler=s, dtype=object).compute()
    assert list(out) == [f"{d}@{d}" for d in per_item(plan(40, s))]


def label_with(a, bias):
    return label(a)


def test_blocks_of_any_chunking_run_where_the_policy_places_them(hybrid_client):
    s = hybrid()
    x = da.zeros(40, chunks=10)  # not the plan's sizes: Dask's blocks are kept
    bias = da.ones(1, chunks=1)  # length 1 along axis 0: broadcast to every block, as in Dask
    out = map_blocks(label_with, x, bias, scheduler=s, dtype=object).compute()
    devices = [str(d) for d in dsched.array.plan_blocks([10] * 4, s)]
    assert devices == ["cuda:0", "cpu", "cuda:0", "cpu"]
    assert list(out) == [f"{d}@{d}" for d in np.repeat(devices, 10)]


def test_placement_holds_through_fusion_and_reductions(hybrid_client, records):
    s = hybrid()
    x = np.arange(40.0)
    total = (map_blocks(recorded_double, batched(x, s), scheduler=s, dtype=float) + 1).sum().compute()
    assert total == (2 * x + 1).sum()
    assert sorted(records) == expected_records(plan(40, s))


def test_placement_holds_for_a_chain_of_planned_maps_and_dask_inputs(hybrid_client, records):
    s = hybrid()
    x = da.arange(40.0, chunks=13)
    y = map_blocks(recorded_double, map_blocks(recorded_double, x, scheduler=s, rechunk=True, dtype=float), scheduler=s,
                   dtype=float)
    np.testing.assert_array_equal((-y).compute(), -4 * np.arange(40.0))
    assert sorted(records) == sorted(expected_records(plan(40, s)) * 2)


def test_persisted_fused_tasks_are_pinned_and_live_on_their_device(hybrid_client, records):
    s = hybrid()
    x = np.arange(40.0)
    mapped = map_blocks(recorded_double, batched(x, s), scheduler=s, dtype=float)
    z = (mapped * 3 + 1).persist()
    dsched_wait(hybrid_client, z)

    keys = held_keys(z)
    seen = hybrid_client.run_on_scheduler(pinning, keys=keys)
    chunks = plan(40, s)
    for (device, m), key in zip(chunks, keys):
        computed_by, planned_task, pin, planned_pin = seen[str(key)]
        assert planned_pin == (str(device), {f"dsched-{device}": m})
        if EXPRESSIONS:
            # No low-level fusion: the planned task is the map's own, pinned; the add after it is Dask's.
            assert planned_task.startswith(f"('{mapped.name}'") and pin[:2] == (None, {}), (computed_by, pin)
        else:
            # The task that computed the block is the fused multiply-add: the plan survived fusion.
            assert "-add-" in computed_by and planned_task == computed_by, computed_by
            assert pin == (str(device), {f"dsched-{device}": m}, [str(device)])
    assert sorted(records) == expected_records(chunks)
    np.testing.assert_array_equal(z.compute(), 6 * x + 1)
    # Composing on the persisted array adds unplanned tasks, which keep Dask's placement.
    unplanned = (z - 1).persist()
    dsched_wait(hybrid_client, unplanned)
    for key, (_, _, pin, _) in hybrid_client.run_on_scheduler(pinning, keys=held_keys(unplanned)).items():
        assert pin[0] is None and pin[1] == {}, key
    assert len(records) == len(chunks)  # persisted blocks did not run again


def held_keys(collection) -> list:
    """The keys a persisted ``collection`` holds on the cluster, in block order.

    (The expression engine gives a persisted array new names, aliases of these keys.)
    """
    from distributed import futures_of

    return [f.key for f in sorted(futures_of(collection), key=lambda f: f.key[1:])]


def pinning(dask_scheduler, keys):
    """Per key: the key of the task that computed it (aliases followed), the key of the nearest planned task it
    came from (itself when fused), that task's planned device and resource restrictions with the workers
    holding the key, and the planned task's device and restrictions."""
    from dask._task_spec import Alias

    def pin(ts):
        return (ts.annotations or {}).get("dsched-device"), dict(ts.resource_restrictions or {})

    out = {}
    for key in keys:
        held = sorted(ws.name for ws in dask_scheduler.tasks[key].who_has or ())
        ts = dask_scheduler.tasks[key]
        while isinstance(ts.run_spec, Alias):
            ts = dask_scheduler.tasks[ts.run_spec.target]
        planned, todo = None, [ts]
        while todo and planned is None:  # breadth first: the nearest task carrying a plan
            candidate = todo.pop(0)
            if candidate.run_spec is not None and planned_block_of(candidate.run_spec) is not None:
                planned = candidate
            todo.extend(sorted(candidate.dependencies, key=lambda d: str(d.key)))
        out[str(key)] = (str(ts.key), None if planned is None else str(planned.key), (*pin(ts), held),
                         None if planned is None else pin(planned))
    return out


def test_keys_seen_before_stay_pinned(hybrid_client, records):
    s = hybrid()
    x = np.arange(40.0)
    built = map_blocks(recorded_double, batched(x, s), scheduler=s, dtype=float)
    first = built.persist()
    dsched_wait(hybrid_client, first)
    # The same call again builds the same keys: the scheduler already holds them.
    again = map_blocks(recorded_double, batched(x, s), scheduler=s, dtype=float)
    assert again.name == built.name and {key[0] for key in held_keys(first)} == {again.name}
    np.testing.assert_array_equal((again + 1).compute(), 2 * x + 1)
    records.clear()
    keys = held_keys(first)
    del first  # released: computing the same keys again must place them again
    wait_until_forgotten(hybrid_client, keys)
    np.testing.assert_array_equal(again.sum().compute(), (2 * x).sum())
    assert sorted(records) == expected_records(plan(40, s))


def test_unplanned_work_keeps_dask_placement(hybrid_client):
    y = (da.arange(40.0, chunks=10) + 1).persist()
    dsched_wait(hybrid_client, y)
    seen = hybrid_client.run_on_scheduler(pinning, keys=held_keys(y))
    assert [(pin[:2], planned) for _, planned, pin, _ in seen.values()] == [((None, {}), None)] * 4


def test_register_is_idempotent_and_harmless(hybrid_client):
    before = {a: dict(w["resources"]) for a, w in hybrid_client.scheduler_info()["workers"].items()}
    dsched.register(hybrid_client)
    dsched.register(hybrid_client)
    after = {a: dict(w["resources"]) for a, w in hybrid_client.scheduler_info()["workers"].items()}
    assert after == before
    names = hybrid_client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
    assert names.count("dsched-placement") == 1
    s = hybrid()
    out = map_blocks(label, batched(np.zeros(40), s), scheduler=s, dtype=object).compute()
    assert list(out) == [f"{d}@{d}" for d in per_item(plan(40, s))]


def test_a_block_never_requests_more_than_its_owner_holds():
    from distributed import Client

    s = hybrid()  # cuda:0 blocks of 8 items on a cuda:0 that may run 5 at once
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, capacities={"cuda:0": 5},
                                   dashboard_address=None) as cluster, Client(cluster) as client:
        y = map_blocks(label, batched(np.zeros(40), s), scheduler=s, dtype=object).persist()
        dsched_wait(client, y)
        keys = held_keys(y)
        seen = client.run_on_scheduler(pinning, keys=keys)
        asked = [seen[str(k)][3][1] for k in keys]
        assert asked == [{f"dsched-{d}": min(m, 5 if d == GPU else m)} for d, m in plan(40, s)]
        assert list(y.compute()) == [f"{d}@{d}" for d in per_item(plan(40, s))]


def dsched_wait(client, collection, timeout=60):
    from distributed import wait

    wait(collection, timeout=timeout)


def wait_until_forgotten(client, keys, timeout=10):
    """Poll the scheduler (with a deadline) until it holds none of ``keys``."""
    import time

    deadline = time.monotonic() + timeout
    held = lambda dask_scheduler, keys: [k for k in keys if k in dask_scheduler.tasks]  # noqa: E731
    while client.run_on_scheduler(held, keys=keys):
        assert time.monotonic() < deadline, "the scheduler kept released keys"
        time.sleep(0.02)


def gpu_kinds(a):
    """On a real GPU worker: the block is a CuPy array on the worker's GPU."""
    import cupy

    assert isinstance(a, cupy.ndarray), type(a)
    assert cupy.cuda.Device().id == 0  # the worker's own GPU is device 0 there (CUDA_VISIBLE_DEVICES)
    return a * 2


@pytest.mark.gpu
def test_blocks_reach_the_gpu_as_cupy_and_come_back_as_numpy():
    import cupy
    from distributed import Client

    s = StaticHybridScheduler(["cuda:0"], batch_sizes=64)
    x = np.arange(1000.0)
    with dsched.LocalHybridCluster(["cuda:0"], dashboard_address=None) as cluster, Client(cluster):
        out = map_blocks(gpu_kinds, batched(x, s), scheduler=s, dtype=float).compute()
        assert type(out) is np.ndarray
        np.testing.assert_array_equal(out, 2 * x)
        # Kept on the GPU (every task of this cluster runs on the GPU worker).
        kept = map_blocks(lambda a: a * 2, batched(x, s), scheduler=s, to_host=False, meta=cupy.empty((0,)))
        on_gpu = kept.compute()
        assert isinstance(on_gpu, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(on_gpu), 2 * x)


@pytest.mark.gpu
def test_real_gpu_and_cpu_blocks_run_where_planned():
    from distributed import Client

    s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[16, 64], priorities=[1, 4])
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], dashboard_address=None) as cluster, Client(cluster):
        labels = map_blocks(label, batched(np.zeros(1000), s), scheduler=s, dtype=object).compute()
        assert list(labels) == [f"{d}@{d}" for d in per_item(plan(1000, s))]
