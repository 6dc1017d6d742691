"""A model's results allocated in their output rows: NumPy's allocations placed where a plan says
(dsched.dataplane.numpy_handler), the plan learned on a worker's first chunk and checked at every one
(dsched.worker.result_placement)."""

import threading

import dask
import numpy as np
import pytest

import dsched
from dsched.dataplane.numpy_handler import available, live_placements, placing

pytestmark = pytest.mark.skipif(not available(), reason="NumPy's memory handler API (NEP 49) is not available")


def _address(array):
    return array.__array_interface__["data"][0]


def on_a_thread(fn):
    """Run ``fn`` on a thread of its own, as a worker runs a chunk (nothing is placed on the main thread)."""
    def run():
        outcome = {}

        def target():
            try:
                outcome["value"] = fn()
            except BaseException as err:  # noqa: BLE001  re-raised on the test's thread
                outcome["error"] = err

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
    run.__name__ = fn.__name__
    return run


# --- the handler ---------------------------------------------------------------------

@on_a_thread
def test_the_planned_allocation_lies_in_the_given_memory_and_the_others_do_not():
    rows = np.full(6, -1.0)
    with placing({1: (_address(rows), rows.nbytes, rows)}) as call:
        a = np.arange(6.0)  # allocation 0
        b = a + a  # allocation 1: placed
        c = b * b  # allocation 2
    assert call.placed == 1 and [address for address, _ in call.addresses] == [_address(rows)]
    assert _address(b) == _address(rows) and _address(a) != _address(rows) and _address(c) != _address(rows)
    assert rows.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    np.testing.assert_array_equal(c, (np.arange(6.0) * 2) ** 2)


def _first_allocation(rows, make):
    """``make()`` under a plan that places the call's first allocation in ``rows``: (placed count, what it made)."""
    with placing({0: (_address(rows), rows.nbytes, rows)}) as call:
        made = make()
    return call.placed, made


@on_a_thread
def test_an_allocation_of_another_size_is_not_placed():
    rows = np.zeros(6)
    placed, a = _first_allocation(rows, lambda: np.arange(5.0))
    assert placed == 0 and _address(a) != _address(rows)


@on_a_thread
def test_zeroed_allocations_are_never_placed_so_object_arrays_never_lie_in_the_rows():
    rows = np.full(8, 7.0)
    with placing({0: (_address(rows), rows.nbytes, rows), 1: (_address(rows), rows.nbytes, rows)}) as call:
        objects = np.empty(8, dtype=object)  # NumPy zeroes it (calloc): its pointers must never be written over
        zeros = np.zeros(8)
    assert call.placed == 0 and _address(objects) != _address(rows) and _address(zeros) != _address(rows)
    assert rows.tolist() == [7.0] * 8


@on_a_thread
def test_memory_overlapping_a_live_placed_array_is_not_given():
    rows = np.zeros(8)
    with placing({0: (_address(rows), 64, rows)}):
        a = np.ones(8)
    with placing({0: (_address(rows) + 16, 32, rows)}) as again:
        b = np.ones(4)  # would overlap a's last six items
    assert again.placed == 0 and _address(b) != _address(rows) + 16
    assert a.tolist() == [1.0] * 8


def test_nothing_is_placed_on_the_main_thread():
    rows = np.zeros(4)
    placed, a = _first_allocation(rows, lambda: np.ones(4))
    assert placed == 0 and _address(a) != _address(rows)


@on_a_thread
def test_an_error_in_the_block_restores_numpy_s_handler():
    try:
        from numpy._core.multiarray import get_handler_name
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import get_handler_name

    rows = np.zeros(4)
    with pytest.raises(ZeroDivisionError):
        with placing({0: (_address(rows), rows.nbytes, rows)}):
            assert get_handler_name() == "dsched_placing"
            1 / 0
    assert get_handler_name() == "default_allocator"


@on_a_thread
def test_an_error_raised_while_arrays_of_the_block_are_freed_stays_itself():
    # Unwinding an error frees the arrays the failing code made; the handler frees them with the error pending
    # and must leave it so: else NumPy's ufunc returns NULL without an exception (a SystemError for the model's
    # own ValueError).
    def mutate(x):
        temporary = np.arange(300.0)  # freed as the error leaves this frame
        x += temporary[:4]  # read-only: ValueError
        return x

    x = np.zeros(4)
    x.flags.writeable = False
    for learn in (False, True):
        with pytest.raises(ValueError, match="read-only"):
            with placing({}, learn=learn):
                mutate(x)
        with pytest.raises(ValueError, match="read-only"):
            with placing({}, learn=learn):
                np.add(x, np.arange(4.0) + 1, out=x)


@on_a_thread
def test_an_error_the_block_handled_does_not_stand_for_a_later_one():
    def fails(x, kind):
        temporary = np.arange(300.0)  # freed as the error leaves this frame, the error pending
        if kind is ValueError:
            x += temporary[:4]  # read-only: NumPy's ValueError
        raise kind("later")

    x = np.zeros(4)
    x.flags.writeable = False
    for later in (KeyError, SystemError):  # a genuine SystemError stays itself too
        with pytest.raises(later, match="later"):
            with placing({}, learn=True):
                try:
                    fails(x, ValueError)
                except Exception:  # noqa: BLE001  handled by the block's own code
                    pass
                fails(x, later)


@on_a_thread
def test_a_placed_array_is_live_until_it_is_gone_and_an_address_is_never_given_twice():
    rows = np.zeros(4)
    target = {0: (_address(rows), rows.nbytes, rows)}
    with placing(target) as first:
        a = np.ones(4)
    assert live_placements(first.addresses) == first.addresses and first.addresses[0][0] == _address(rows)
    with placing(target) as again:
        b = np.ones(4)  # a is still there: b gets memory of its own
    assert again.placed == 0 and _address(b) != _address(a)
    del a
    assert live_placements(first.addresses) == []
    with placing(target) as third:
        c = np.ones(4)
    assert third.placed == 1 and _address(c) == _address(rows)
    # c lies where a lay, but it is another placement: a's is still gone (the same rows of a reused segment,
    # placed again by the next call's chunk on another thread, are not the first chunk's arrays kept)
    assert live_placements(first.addresses) == [] and live_placements(third.addresses) == third.addresses


@on_a_thread
def test_a_placed_array_that_grows_moves_out_of_the_given_memory():
    rows = np.zeros(4)
    with placing({0: (_address(rows), rows.nbytes, rows)}) as call:
        a = np.arange(4.0)
    a.resize(1000, refcheck=False)  # NumPy reallocates: the array leaves the rows
    a[:] = 5.0
    assert _address(a) != _address(rows) and rows.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert call.placed == 1 and live_placements(call.addresses) == []


@on_a_thread
def test_learning_logs_each_allocation_position_address_and_size():
    with placing({}, learn=True) as call:
        a = np.arange(3.0)
        b = np.zeros((2, 5))
        c = np.ones(2)
        del c
    assert [(position, size, zeroed) for position, _, size, zeroed in call.log][:3] == [
        (0, 24, False), (1, 80, True), (2, 16, False)]
    assert call.log[0][1] == _address(a) and call.log[1][1] == _address(b)
    assert call.survivors() == [_address(a), _address(b)]  # c was freed
    call.unfollow()
    assert call.survivors() == []


@on_a_thread
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


@pytest.fixture(scope="module", autouse=True)
def _no_statistical_profiler():
    """Dask's worker profiler holds the frames it samples a moment after a chunk ends, with the chunk's result in
    them: a passing reference dsched cannot tell from a model keeping its results (it then stops placing that
    model on that worker: an extra copy, never a wrong value). These tests count placements exactly, so their
    clusters run without it (before the module's clusters start: autouse fixtures of a scope come first)."""
    with dask.config.set({"distributed.worker.profile.enabled": False}):
        yield


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
    # learned from it): the first two written in place on each worker (or thread) are watched, the others placed.
    # In-process, the four threads share one process's plans and watch at once: two chunks watched at once on two
    # threads may disagree (their allocations lie apart), and more are watched; still, most chunks are placed.
    written = 3 * (20 if cluster == "processes" else 18)
    assert seen["missed"] == 0 and seen["kept"] == 0
    assert 2 <= seen["watched"] <= written // 3 and seen["placed"] == written - seen["watched"]


def test_an_output_that_is_a_view_of_another_is_right(scheduler, process_client):
    x = np.arange(150_000.0)
    for _ in range(3):
        out = dsched.dispatch(one_view_of_another, x, scheduler=scheduler, client=process_client)
        np.testing.assert_array_equal(out["a"], np.stack([x, -x], axis=1))
        np.testing.assert_array_equal(out["b"], np.stack([-x, x], axis=1))


def test_a_model_that_keeps_its_result_is_noticed_and_no_longer_placed(process_client):
    # One chunk size on both devices, whichever takes the last chunk: each worker learns one plan and judges it.
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[25_000, 25_000])
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


memo = {}


def memoized(x):
    """A model that keeps a memo of its results (and returns them again)."""
    key = (float(x[0]), len(x))
    if key not in memo:
        memo[key] = np.sqrt(x) * 2.0
    return memo[key]


def test_a_memoizing_model_is_never_placed_so_its_memo_never_lies_in_the_outputs(hybrid_client):
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[20_000, 20_000])
    x = np.arange(200_000.0)
    out = dsched.dispatch(memoized, x, scheduler=scheduler, client=hybrid_client)
    np.testing.assert_array_equal(out, np.sqrt(x) * 2.0)
    assert not any(np.shares_memory(out, kept) for kept in memo.values())
    out[:] = -1.0  # the caller reuses its output
    np.testing.assert_array_equal(dsched.dispatch(memoized, x, scheduler=scheduler, client=hybrid_client),
                                  np.sqrt(x) * 2.0)


def test_a_miss_on_one_thread_does_not_fail_a_placed_chunk_running_on_another():
    """Two worker threads share a plan: one chunk misses (its allocations differ) while another, placed, runs."""
    from dsched.dataplane.outputs import OutputLayout, OutputSlot
    from dsched.dataplane.store import RunStore
    from dsched.worker.chunk import ChunkProgram
    from dsched.worker.result_placement import run_and_write

    n = 20_000
    b_may_run, b_done = threading.Event(), threading.Event()

    def model(x):
        if x[0] == 100:  # chunk 3, placed: waits while chunk 4 misses
            b_may_run.set()
            b_done.wait(30)
        if x[0] == 200:  # chunk 4: one more allocation first, so its result is not where the plan says
            np.empty(n)
        return x + 1.0

    out = np.zeros(5 * n)
    store = RunStore(shared=False)
    ref = store.register(out)
    layout, program = OutputLayout.of(model(np.zeros(n)), n), ChunkProgram("placement-race", model)

    def chunk(index, value):
        x = np.full(n, float(value))
        slot = OutputSlot(layout, (ref,), index * n, (index + 1) * n, index)
        return run_and_write(program, slot, slot.rows(), lambda: model(x), "cpu")

    on_a_thread(lambda: [chunk(0, 1.0), chunk(1, 2.0), chunk(2, 3.0)])()  # watched twice, then placed
    placed = threading.Thread(target=on_a_thread(lambda: chunk(3, 100.0)))
    placed.start()
    b_may_run.wait(30)
    on_a_thread(lambda: chunk(4, 200.0))()
    b_done.set()
    placed.join()
    np.testing.assert_array_equal(out, np.repeat([2.0, 3.0, 4.0, 101.0, 201.0], n))
    store.close()


def test_an_output_travelling_by_value_is_not_taken_for_an_array_the_model_keeps():
    """The README's hello world: a float output placed beside a string output, which travels back by value. The
    string array is still held (on its way to the client) when the model's next chunk starts: dsched holds it, not
    the model, so the model is placed and no warning says it keeps arrays."""
    from dsched.dataplane.outputs import BY_VALUE, Leftover, OutputLayout, OutputSlot
    from dsched.dataplane.store import RunStore
    from dsched.worker.chunk import ChunkProgram
    from dsched.worker.result_placement import placement_counts, run_and_write

    n = 20_000

    def model(x):
        return {"norm": x * 2.0, "device": np.full(len(x), "cpu")}

    out = {"norm": np.zeros(4 * n)}
    store = RunStore(shared=False)
    layout, program = OutputLayout.of(model(np.zeros(n)), n), ChunkProgram("by-value-beside-placed", model)
    targets = tuple(BY_VALUE if leaf.by_value else store.register(out[leaf.path[0]]) for leaf in layout.leaves)
    in_flight = []  # the leftovers a worker has not sent yet

    def chunk(index):
        x = np.full(n, float(index))
        slot = OutputSlot(layout, targets, index * n, (index + 1) * n, index)
        leftover = run_and_write(program, slot, slot.rows(), lambda: model(x), "cpu")
        in_flight.append(leftover)
        return leftover

    before = placement_counts()
    on_a_thread(lambda: [chunk(i) for i in range(4)])()
    seen = {name: placement_counts()[name] - before[name] for name in before}
    assert all(isinstance(leftover, Leftover) for leftover in in_flight)
    assert seen["kept"] == 0 and seen["placed"] >= 1, seen
    np.testing.assert_array_equal(out["norm"], np.repeat([0.0, 2.0, 4.0, 6.0], n))
    store.close()


def test_a_result_that_is_its_out_rows_is_taken_as_written_and_any_other_is_checked_and_copied():
    """A model that computed into the ``out=`` rows it was given and returned them is done: nothing to check or
    copy. A dict that holds another array under one name (or a name more) is no such result: it is checked and
    written as any other."""
    from dsched.dataplane.outputs import ChunkResultError, OutputLayout, OutputSlot
    from dsched.dataplane.store import RunStore

    n = 4
    out = {"a": np.zeros(2 * n), "b": np.zeros((2 * n, 3))}
    store = RunStore(shared=False)
    layout = OutputLayout.of({"a": np.zeros(n), "b": np.zeros((n, 3))}, n)
    slot = OutputSlot(layout, tuple(store.register(out[leaf.path[0]]) for leaf in layout.leaves), n, 2 * n, 1)
    rows = slot.rows()
    views = slot.views(rows)
    views["a"][:], views["b"][:] = 1.0, 2.0  # the model's own writes
    assert slot.write(views, "cpu", rows=rows) is None
    np.testing.assert_array_equal(out["a"], [0.0] * n + [1.0] * n)
    other = slot.views(rows)
    other["b"] = np.full((n, 3), 7.0)  # returned under its name instead of its rows: copied there
    assert slot.write(other, "cpu", rows=rows) is None
    np.testing.assert_array_equal(out["b"][n:], 7.0)
    with pytest.raises(ChunkResultError, match="returned"):
        slot.write({**slot.views(rows), "c": np.zeros(n)}, "cpu", rows=rows)
    store.close()
