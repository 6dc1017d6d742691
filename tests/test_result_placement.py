"""A model's results allocated in their output rows: NumPy's allocations placed where a plan says
(dsched.dataplane.numpy_handler), the plan learned on a worker's first chunk and checked at every one
(dsched.worker.result_placement)."""

import dask
import numpy as np
import pytest

import dsched
from dsched.dataplane.numpy_handler import available, live_placements, placing

pytestmark = pytest.mark.skipif(not available(), reason="NumPy's memory handler API (NEP 49) is not available")


def _address(array):
    return array.__array_interface__["data"][0]


# --- the handler ---------------------------------------------------------------------

def test_the_planned_allocation_lies_in_the_given_memory_and_the_others_do_not():
    rows = np.full(6, -1.0)
    with placing({1: (_address(rows), rows.nbytes, rows)}) as call:
        a = np.arange(6.0)  # allocation 0
        b = a + a  # allocation 1: placed
        c = b * b  # allocation 2
    assert call.placed == 1 and call.addresses == [_address(rows)]
    assert _address(b) == _address(rows) and _address(a) != _address(rows) and _address(c) != _address(rows)
    assert rows.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    np.testing.assert_array_equal(c, (np.arange(6.0) * 2) ** 2)


def test_an_allocation_of_another_size_is_not_placed():
    rows = np.zeros(6)
    with placing({0: (_address(rows), rows.nbytes, rows)}) as call:
        a = np.arange(5.0)
    assert call.placed == 0 and _address(a) != _address(rows)


def test_zeros_placed_are_zeros_even_over_old_values():
    rows = np.full(8, 7.0)
    with placing({0: (_address(rows), rows.nbytes, rows)}):
        z = np.zeros(8)
    assert _address(z) == _address(rows) and rows.tolist() == [0.0] * 8


def test_a_placed_array_is_live_until_it_is_gone_and_an_address_is_never_given_twice():
    rows = np.zeros(4)
    target = {0: (_address(rows), rows.nbytes, rows)}
    with placing(target):
        a = np.ones(4)
    assert live_placements([_address(rows)]) == [_address(rows)]
    with placing(target) as again:
        b = np.ones(4)  # a is still there: b gets memory of its own
    assert again.placed == 0 and _address(b) != _address(a)
    del a
    assert live_placements([_address(rows)]) == []
    with placing(target) as third:
        c = np.ones(4)
    assert third.placed == 1 and _address(c) == _address(rows)


def test_a_placed_array_that_grows_moves_out_of_the_given_memory():
    rows = np.zeros(4)
    with placing({0: (_address(rows), rows.nbytes, rows)}):
        a = np.arange(4.0)
    a.resize(1000, refcheck=False)  # NumPy reallocates: the array leaves the rows
    a[:] = 5.0
    assert _address(a) != _address(rows) and rows.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert live_placements([_address(rows)]) == []


def test_learning_logs_each_allocation_position_address_and_size():
    with placing({}, learn=True) as call:
        a = np.arange(3.0)
        b = np.zeros((2, 5))
    assert [(position, size) for position, _, size in call.log][:2] == [(0, 24), (1, 80)]
    assert call.log[0][1] == _address(a) and call.log[1][1] == _address(b)


def test_outside_the_block_nothing_is_placed_in_this_thread():
    rows = np.zeros(4)
    with placing({0: (_address(rows), rows.nbytes, rows)}):
        pass
    a = np.ones(4)
    assert _address(a) != _address(rows)


# --- the policy, on real workers -----------------------------------------------------

def fresh(x, y):
    """A model that returns new arrays: two outputs of the same size, one of another."""
    t = x * y
    return {"sum": x + t, "product": t * 2.0, "norm": np.sqrt(np.abs(x))}


def one_view_of_another(x):
    """Two outputs of which one is a view of the other's memory, reversed."""
    full = np.stack([x, -x], axis=1)
    return {"a": full, "b": full[::-1].copy() if x.size == 0 else full[:, ::-1]}


_kept = []


def keeps_its_result(x):
    """A model that keeps the array it returns (and would write into it later)."""
    out = x * 3.0
    _kept.append(out)
    del _kept[:-2]
    return out


def branches(x):
    """Allocations that depend on the values: an extra temporary when the first value is odd."""
    if int(x[0]) % 2:
        _ = np.empty_like(x)
    return x + 1.0


def _counts(client):
    from dsched.worker.result_placement import placement_counts

    def counts():
        import os

        return os.getpid(), placement_counts()

    per_process = dict(client.run(counts).values())  # in-process workers share one process's counts
    return {name: sum(c[name] for c in per_process.values()) for name in ("watched", "placed", "missed", "kept")}


def _since(after, before):
    return {name: after[name] - before[name] for name in after}


@pytest.fixture(scope="module")
def scheduler():
    """Chunks of 20,000 and 30,000 rows: large enough outputs to be placed (BYTES_PER_ALLOCATION)."""
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[20_000, 30_000])


@pytest.mark.parametrize("cluster", ["in-process", "processes"])
def test_a_model_returning_new_arrays_is_placed_after_its_first_chunk_and_its_results_are_right(
        cluster, hybrid_client, process_client):
    client = {"in-process": hybrid_client, "processes": process_client}[cluster]
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[20_000, 20_000])
    x, y = np.linspace(-3, 3, 400_000), np.linspace(1, 2, 400_000)
    before = _counts(client)
    for _ in range(3):
        out = dsched.dispatch(fresh, x, y, scheduler=scheduler, client=client)
        for name, expected in fresh(x, y).items():
            np.testing.assert_array_equal(out[name], expected)
    seen = _since(_counts(client), before)
    # 20 chunks of 20,000 rows a call (in-process, the first on each device comes back by value: the layout is
    # learned from it): the first written in place on each worker (or thread) is watched, every other one placed
    written = 3 * (20 if cluster == "processes" else 18)
    assert seen["missed"] == 0 and seen["kept"] == 0
    assert 1 <= seen["watched"] <= 4 and seen["placed"] == written - seen["watched"]


def test_an_output_that_is_a_view_of_another_is_right(scheduler, process_client):
    x = np.arange(150_000.0)
    for _ in range(3):
        out = dsched.dispatch(one_view_of_another, x, scheduler=scheduler, client=process_client)
        np.testing.assert_array_equal(out["a"], np.stack([x, -x], axis=1))
        np.testing.assert_array_equal(out["b"], np.stack([-x, x], axis=1))


def test_a_model_that_keeps_its_result_is_noticed_and_no_longer_placed(scheduler, process_client):
    x = np.arange(150_000.0)
    before = _counts(process_client)
    for _ in range(4):
        np.testing.assert_array_equal(
            dsched.dispatch(keeps_its_result, x, scheduler=scheduler, client=process_client), x * 3.0)
    seen = _since(_counts(process_client), before)
    assert seen["kept"] >= 1
    after = _counts(process_client)
    for _ in range(2):
        dsched.dispatch(keeps_its_result, x, scheduler=scheduler, client=process_client)
    assert _since(_counts(process_client), after)["placed"] == 0


def test_allocations_that_vary_cost_a_copy_not_a_wrong_value(scheduler, process_client):
    before = _counts(process_client)
    for start in range(6):
        x = np.arange(start, start + 150_000.0)
        np.testing.assert_array_equal(dsched.dispatch(branches, x, scheduler=scheduler, client=process_client), x + 1)
    assert _since(_counts(process_client), before)["missed"] >= 1


def test_placing_is_off_with_the_config(scheduler, hybrid_client):
    x, y = np.arange(150_000.0), np.ones(150_000)
    before = _counts(hybrid_client)
    with dask.config.set({"dsched.place-results": False}):
        out = dsched.dispatch(fresh, x, y, scheduler=scheduler, client=hybrid_client)
    np.testing.assert_array_equal(out["sum"], x + x)
    assert _since(_counts(hybrid_client), before) == {"watched": 0, "placed": 0, "missed": 0, "kept": 0}


def test_thirty_calls_leave_no_placed_array_alive(scheduler, process_client):
    def alive():
        from dsched.dataplane import numpy_handler

        return len(numpy_handler._live)

    before = process_client.run(alive)  # a model kept by an earlier test may hold one
    x, y = np.arange(100_000.0), np.ones(100_000)
    for _ in range(30):
        dsched.dispatch(fresh, x, y, scheduler=scheduler, client=process_client)
    assert process_client.run(alive) == before


def point_by_point(x):
    """A loop over the points: many small allocations, each costing the handler more than it saves."""
    return np.array([float(np.sum(np.full(2, v))) for v in x])


def test_a_model_of_many_small_allocations_is_not_placed(process_client):
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[5_000, 5_000])
    x = np.arange(20_000.0)
    before = _counts(process_client)
    for _ in range(3):
        np.testing.assert_array_equal(dsched.dispatch(point_by_point, x, scheduler=scheduler, client=process_client),
                                      2 * x)
    seen = _since(_counts(process_client), before)
    assert seen["watched"] >= 1 and seen["placed"] == 0
