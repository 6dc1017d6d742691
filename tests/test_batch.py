"""Resident batches on real Dask clusters: in-process (cpu + emulated cuda:0) and worker processes.

What a batch promises holds wherever its fields live: the tests that take the ``memory`` fixture run in host
memory (one array per field, an update one dispatch) and in device memory (the task engine). The task engine's
own (lineage rebuilt after a lost worker, the workers' memory per version, set() segments per field) run on
``memory="device"``; the host backend's own are in ``tests/test_host_batch.py``.

Emulated CUDA workers compute with NumPy: these tests check placement, ordering,
errors and faults, never GPU behaviour.
"""

import contextlib
import os
import signal
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsched
from dsched.dataplane.segments import release_pool
from dsched.dataplane.store import RunStore
from dsched.resident.tasks import _wait_tasks
from dsched import Batch, ChunkResultError, StaticHybridScheduler
from dsched.bench_batch import final_strain, j2_load_step, run_batch, run_numpy


@pytest.fixture(params=["host", "device"])
def memory(request):
    """Where the batch keeps its fields: each test that takes it runs once per place."""
    return request.param


def hybrid_scheduler(small=3, large=5):
    return StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[small, large], priorities=[1, 2])


def where_am_i(x):
    """Each item's device, as the chunk's task sees it: 0 for the CPU, 1 for cuda:0."""
    return {"where": np.full(len(x), 0 if dsched.current_device().type == "cpu" else 1)}


def test_chunks_live_on_their_planned_devices(hybrid_client, memory):
    scheduler = hybrid_scheduler()
    with Batch({"x": np.arange(20.0)}, scheduler, client=hybrid_client, memory=memory) as batch:
        assert batch.memory == memory
        planned = dsched.plan(20, scheduler)
        assert [(c.device, c.size) for c in batch.chunks] == planned
        batch.update(where_am_i, reads=["x"], outputs=["where"])
        expected = np.concatenate([np.full(size, 0 if device.type == "cpu" else 1) for device, size in planned])
        np.testing.assert_array_equal(batch.get("where"), expected)


def test_updates_carry_state_and_reduce_syncs(hybrid_client, memory):
    x = np.arange(23.0)
    with Batch({"x": x, "acc": np.zeros((23, 2))}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        handles = []
        for step in range(1, 6):
            handles.append(batch.update(lambda x, acc, k: {"acc": acc + k * x[:, None]}, reads=["x", "acc"],
                                        writes=["acc"], kwargs={"k": step}))
        assert batch.reduce(lambda a: a[:, 0].sum(), "acc") == pytest.approx(15 * x.sum())
        assert all(h.done() for h in handles)
        np.testing.assert_array_equal(batch.get("acc"), np.repeat(15 * x[:, None], 2, axis=1))
        np.testing.assert_array_equal(batch.get("x"), x)
        assert batch.reduce(np.max, "x", combine=max) == 22.0
        assert batch.reduce(len, "x", combine=list) == [5, 3, 5, 3, 5, 2]  # dispatch order


def test_set_streams_host_values(hybrid_client, memory):
    with Batch({"x": np.zeros(12)}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])
        batch.set("x", np.arange(12.0)).wait()
        batch.update(lambda x: {"x": 2 * x}, reads=["x"], writes=["x"])
        np.testing.assert_array_equal(batch.get("x"), 2 * np.arange(12.0))
        batch.set("y", np.ones((12, 3)))
        assert batch.fields == ["x", "y"]
        np.testing.assert_array_equal(batch.get("y"), np.ones((12, 3)))


def test_an_update_that_changes_a_fields_layout_is_followed(hybrid_client, memory):
    """An update may give a field another item shape and dtype: get follows it, not refuses it (in host memory the
    field gets a new array; in device memory get learns the new layout)."""
    x = np.arange(24.0).reshape(12, 2)
    with Batch({"x": x}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        np.testing.assert_array_equal(batch.get("x"), x)
        if memory == "device":  # a step's get reuses the layout its last get found (one round trip through Dask)
            assert batch._backend._seen_layouts["x"] == ((2,), np.dtype("f8").str)
        batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])
        np.testing.assert_array_equal(batch.get("x"), x + 1)
        batch.update(lambda x: {"x": np.concatenate([x, x[:, :1]], axis=1).astype(np.float32)}, reads=["x"],
                     writes=["x"])
        wider = np.concatenate([x + 1, x[:, :1] + 1], axis=1).astype(np.float32)
        got = batch.get("x")
        assert got.dtype == np.float32 and got.shape == (12, 3)
        np.testing.assert_array_equal(got, wider)
        if memory == "device":
            assert batch._backend._seen_layouts["x"] == ((3,), np.dtype("f4").str)
        batch.update(lambda x: {"x": 2 * x}, reads=["x"], writes=["x"])  # and the new layout is kept
        np.testing.assert_array_equal(batch.get("x"), 2 * wider)


def test_inplace_update_mutates_after_earlier_reads(hybrid_client, memory):
    def mutate(x):
        x *= 3  # in place: allowed only because the engine ran the earlier reads first
        return {"x": x}

    with Batch({"x": np.arange(10.0)}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        batch.update(lambda x: {"before": x.copy()}, reads=["x"], outputs=["before"])
        batch.update(mutate, reads=["x"], writes=["x"], inplace=True)
        np.testing.assert_array_equal(batch.get("before"), np.arange(10.0))
        np.testing.assert_array_equal(batch.get("x"), 3 * np.arange(10.0))


def test_read_only_unless_inplace(hybrid_client, memory):
    def mutate(x):
        x += 1
        return {"x": x}

    with Batch({"x": np.arange(10.0)}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        with pytest.raises(ValueError, match="read-only"):
            batch.update(mutate, reads=["x"], writes=["x"]).wait()
        np.testing.assert_array_equal(batch.get("x"), np.arange(10.0))


def test_bad_names_are_refused_before_any_work(hybrid_client, memory):
    with Batch({"x": np.arange(10.0)}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        with pytest.raises(ValueError, match=r"reads: no field 'strian' in this batch \(fields: x\)"):
            batch.update(lambda strian: {"x": strian}, reads=["strian"], writes=["x"])
        with pytest.raises(ValueError, match=r"writes: no field 'y' in this batch \(fields: x\)"):
            batch.update(lambda x: {"y": x}, reads=["x"], writes=["y"])
        with pytest.raises(ValueError, match=r"field: no field 'z' in this batch"):
            batch.get("z")

        def step(x, state):
            return {"x": x + state}

        # fn cannot take what each chunk would call it with: said once, naming what it misses, before any chunk ran
        with pytest.raises(ValueError, match=r"^fn: step\(\) missing a required argument: 'state' \(each chunk "
                                             r"calls it with the keywords x, scale: the fields it reads, its inputs, "
                                             r"out= arrays and kwargs\)$"):
            batch.update(step, reads="x", writes=["x"], kwargs={"scale": 2.0})
        with pytest.raises(ValueError, match=r"^fn: step\(\) got an unexpected keyword argument 'rate'"):
            batch.update(step, reads=["x"], writes=["x"], inputs={"state": np.ones(10), "rate": np.ones(10)})
        batch.update(step, reads=["x"], writes=["x"], inputs={"state": np.ones(10)})
        np.testing.assert_array_equal(batch.get("x"), np.arange(10.0) + 1)
        with pytest.raises(ValueError, match=r"fields\['x'\]: 9 items along axis 0; the batch has 10"):
            batch.set("x", np.zeros(9))
    with pytest.raises(ValueError, match=r"fields\['b'\]: 3 items along axis 0; the batch has 2"):
        Batch({"a": np.zeros(2), "b": np.zeros(3)}, hybrid_scheduler(), client=hybrid_client)
    with pytest.raises(ValueError, match=r"lookahead: expected an integer >= 1, got 0"):
        Batch({"a": np.zeros(2)}, hybrid_scheduler(), client=hybrid_client, lookahead=0)
    with pytest.raises(ValueError, match=r"fields: expected a non-empty dict of name -> array \(or n=, the number "
                                         r"of items, for a batch whose updates make its fields\), got dict"):
        Batch({}, hybrid_scheduler(), client=hybrid_client)
    with pytest.raises(ValueError, match=r"fields\['a'\]: 3 items along axis 0; the batch has 4"):
        Batch({"a": np.zeros(3)}, hybrid_scheduler(), n=4, client=hybrid_client)
    with pytest.raises(ValueError, match=r"n: must be >= 1, got 0"):
        Batch({}, hybrid_scheduler(), n=0, client=hybrid_client)
    for bad in ("shared", "Host", None, 1):
        with pytest.raises(ValueError, match=rf"^memory: expected 'auto', 'host' or 'device', got {bad!r}$"):
            Batch({"a": np.zeros(2)}, hybrid_scheduler(), client=hybrid_client, memory=bad)


def test_a_batch_without_fields_takes_them_from_its_updates(hybrid_client, memory):
    t = np.arange(40.0).reshape(2, 20)  # a history of 2 entries for 20 items, items on axis 1
    with Batch({}, hybrid_scheduler(), n=20, client=hybrid_client, memory=memory) as batch:
        assert batch.fields == [] and batch.n == 20
        batch.update(lambda t: {"y": t[0] + t[1]}, outputs=["y"], inputs={"t": t}, axis=1)
        assert batch.fields == ["y"]
        batch.update(lambda y: {"y": 2 * y}, reads=["y"], writes=["y"])
        np.testing.assert_array_equal(batch.get("y"), 2 * (t[0] + t[1]))


@pytest.mark.parametrize("fn, message", [
    (lambda x: {"y": x}, r"update 'bad': chunk 0 on cuda:0 \(items 0:5\) returned no field 'x' \(it writes: x\)"),
    (lambda x: {"x": x[:-1]}, r"update 'bad': chunk 0 on cuda:0 \(items 0:5\): field 'x' has 4 items \(shape "
                              r"\(4,\)\); expected 5 items along axis 0 \(the chunk's size\)"),
    (lambda x: x, r"update 'bad': chunk 0 on cuda:0 \(items 0:5\) returned ndarray; expected a dict"),
    (lambda x: {"x": np.array(1.0)}, r"update 'bad': chunk 0 on cuda:0 \(items 0:5\): field 'x' has no batch axis; "
                                     r"expected 5 items along axis 0"),
])
def test_bad_results_name_the_field_and_chunk_and_the_batch_stays_usable(hybrid_client, memory, fn, message):
    with Batch({"x": np.arange(8.0)}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])
        with pytest.raises(ChunkResultError, match=message):
            # Only chunk 0 fails: the others return what they should.
            batch.update(lambda x: fn(x) if x[0] == 1 else {"x": x}, reads=["x"], writes=["x"], label="bad").wait()
        np.testing.assert_array_equal(batch.get("x"), np.arange(8.0) + 1)  # back at the last good version
        batch.update(lambda x: {"x": x * 2}, reads=["x"], writes=["x"])
        np.testing.assert_array_equal(batch.get("x"), 2 * (np.arange(8.0) + 1))


def test_a_chunks_tasks_reach_dask_in_program_order_when_two_threads_hand_them_over(hybrid_client):
    # The client's thread and a finished task's callback may hand one chunk's queue to Dask at once. A get queued
    # behind an update names the update's future: handed over first, it found none and read None (a flaky
    # TypeError after a rollback). Here a second thread pumps chunk 0 while the update's task is being submitted.
    with Batch({"x": np.arange(8.0)}, hybrid_scheduler(), client=hybrid_client, memory="device") as batch:
        backend = batch._backend
        batch.get("x")
        layout = backend._seen_layouts["x"]  # what that get found: the next get's layout, known
        backend.lookahead = 10  # the slots the earlier tasks free do not matter here
        backend._held, backend._flush = True, lambda everywhere=False: None  # pushed operations stay queued
        batch.update(lambda x: {"x": x * 2}, reads=["x"], writes=["x"])
        with RunStore(shared=False) as store:
            _, tasks, view = backend._write_out("x", store.allocate, layout)
            chunk, submit, other = backend.chunks[0], backend._submit_now, []

            def submit_while_another_thread_pumps(*args, **kwargs):
                if not other:
                    other.append(threading.Thread(target=backend._pump, args=(chunk,)))
                    other[0].start()
                    other[0].join(timeout=0.5)  # in order, it waits for this submit
                return submit(*args, **kwargs)

            backend._submit_now = submit_while_another_thread_pumps
            backend._pump(chunk)
            other[0].join()
            del backend._submit_now, backend._flush
            backend._held = False
            for rest in backend.chunks[1:]:
                backend._pump(rest)
            _wait_tasks(tasks)
            np.testing.assert_array_equal(view, 2 * np.arange(8.0))


def _tasks_per_chunk(updates):
    """Per chunk, the distinct Dask tasks that ran its updates (fused updates share one)."""
    return [len({future.key for future in chunk}) for chunk in zip(*(update.futures for update in updates))]


@pytest.mark.parametrize("together", [False, True], ids=["one by one", "together"])
def test_updates_pushed_together_go_as_one_task_per_chunk(process_client, together):
    # Device memory on worker processes: one by one, the first update goes alone (the batch's first values are
    # loading: lookahead 2) and those pushed meanwhile as one task; in a together() block every chunk's four go as
    # one. The values are the same either way.
    with Batch({"x": np.arange(8.0)}, hybrid_scheduler(), client=process_client, memory="device") as batch:
        block = batch.together() if together else contextlib.nullcontext()
        with block:
            updates = [batch.update(lambda x, k=k: {"x": x * 2 + k}, reads=["x"], writes=["x"]) for k in range(4)]
            if together:
                assert not any(t.submitted.is_set() for u in updates for t in u._tasks)  # held until the block ends
        np.testing.assert_array_equal(batch.get("x"), ((((np.arange(8.0) * 2) * 2 + 1) * 2 + 2) * 2 + 3))
        per_chunk = _tasks_per_chunk(updates)
        assert per_chunk == [1] * len(batch.chunks) if together else min(per_chunk) >= 2


def test_a_get_inside_a_together_block_hands_the_held_updates_over_first(hybrid_client, memory):
    with Batch({"x": np.arange(8.0)}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        with batch.together():
            batch.update(lambda x: {"x": x + 1.0}, reads=["x"], writes=["x"])
            np.testing.assert_array_equal(batch.get("x"), np.arange(8.0) + 1.0)  # not a wait for ever
            batch.update(lambda x: {"x": x * 3.0}, reads=["x"], writes=["x"])
        np.testing.assert_array_equal(batch.get("x"), (np.arange(8.0) + 1.0) * 3.0)


def test_an_update_whose_fn_does_not_pickle_fails_saying_why_and_the_batch_stays_usable(process_client, memory):
    # Worker processes: the fn travels pickled. In device memory its tasks were lost on the way, and the next
    # get waited for them forever.
    # In host memory the update is a dispatch, which refuses the fn once, as dispatch() does, before any chunk
    # runs; in device memory each chunk's task fails with the reason.
    lock = threading.Lock()
    error = TypeError if memory == "host" else dsched.AggregateError
    with Batch({"x": np.arange(8.0)}, hybrid_scheduler(), client=process_client, memory=memory) as batch:
        with pytest.raises(error, match=r"fn: cannot be sent to the workers \(TypeError: cannot "
                                        r"pickle '_thread.lock' object\)"):
            batch.update(lambda x: {"x": x + (lock is None)}, reads=["x"], writes=["x"]).wait()
        np.testing.assert_array_equal(batch.get("x"), np.arange(8.0))
        batch.update(_add_load, reads=["x"], writes=["x"], kwargs={"load": 1.0})
        np.testing.assert_array_equal(batch.get("x"), np.arange(8.0) + 1)


def test_to_zarr_streams_every_field(hybrid_client, tmp_path, memory):
    import zarr

    fields = {"x": np.arange(12.0), "v": np.ones((12, 2), np.float32)}
    with Batch(fields, hybrid_scheduler(), client=hybrid_client, memory=memory) as b:
        b.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])
        path = b.to_zarr(tmp_path / "state.zarr")
        with pytest.raises(ValueError, match="already exists"):
            b.to_zarr(tmp_path / "state.zarr")
    group = zarr.open_group(path, mode="r")
    np.testing.assert_array_equal(group["x"][:], np.arange(12.0) + 1)
    assert group["v"].dtype == np.float32 and group["v"].shape == (12, 2)


operations = st.lists(st.tuples(st.frozensets(st.sampled_from("abc"), min_size=1),
                                st.frozensets(st.sampled_from("abc"), min_size=1)), min_size=1, max_size=6)


def _apply(index, reads, writes, arrays):
    """What every example's update computes: each written field from the op's index and the fields it read."""
    total = sum(arrays[f] for f in sorted(reads))
    return {f: total * 0.5 + index + ord(f) for f in writes}


class _Op:
    """One example's update, picklable."""

    def __init__(self, index, reads, writes):
        self.index, self.reads, self.writes = index, reads, writes

    def __call__(self, **arrays):
        result = _apply(self.index, self.reads, self.writes, arrays)
        for field, value in result.items():
            if field in arrays and arrays[field].flags.writeable:  # in place: a reader still running would see it
                arrays[field][...] = value
                result[field] = arrays[field]
        return result


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, inplace=st.booleans())
def test_random_update_sequences_equal_program_order(hybrid_client, memory, ops, inplace):
    # The engine's own property test (tests/test_engine.py) tries many schedules; this one runs on Dask.
    start = {f: np.arange(11.0) * (i + 1) for i, f in enumerate("abc")}
    expected = dict(start)
    for index, (reads, writes) in enumerate(ops):
        expected.update(_apply(index, reads, writes, expected))
    with Batch(start, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        for index, (reads, writes) in enumerate(ops):
            batch.update(_Op(index, reads, writes), reads=sorted(reads), writes=sorted(writes), inplace=inplace)
        for field in "abc":
            np.testing.assert_array_equal(batch.get(field), expected[field], err_msg=field)


class _SlowStep:
    """A load step that takes a while, so that a worker can be killed while later steps are pending."""

    def __init__(self, factor, delay):
        self.factor, self.delay = factor, delay

    def __call__(self, final_strain, plastic_strain, alpha):
        time.sleep(self.delay)
        return j2_load_step(final_strain, plastic_strain, alpha, factor=self.factor)


def _steps(batch, first, last, steps, delay=0.0):
    handles = []
    for step in range(first, last):
        handles.append(batch.update(_SlowStep((step + 1) / steps, delay),
                                    reads=["final_strain", "plastic_strain", "alpha"],
                                    writes=["plastic_strain", "alpha", "stress"][: 3 if step else 2],
                                    outputs=[] if step else ["stress"], label="j2-step"))
    return handles


def test_a_killed_worker_process_loses_nothing(process_client):
    """Device memory: the chunks of a killed worker are rebuilt from their lineage (tests/test_host_batch.py kills
    one in host memory, where dispatch runs its chunks again)."""
    n, steps = 60, 8
    strain = final_strain(n)
    reference = run_numpy(strain, steps)
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[10, 20], priorities=[1, 2])
    cuda_worker = dsched.ownership.device_owners(process_client, ["cuda:0"])[dsched.Device("cuda:0")][0]
    pid = process_client.run(os.getpid, workers=[cuda_worker])[cuda_worker]
    with Batch({"final_strain": strain, "plastic_strain": np.zeros((n, 6)), "alpha": np.zeros(n)}, scheduler,
               client=process_client, memory="device") as batch:
        handles = _steps(batch, 0, 3, steps, delay=0.05)
        handles[0].wait()
        # set() values travel through shared memory too: they are part of the lineage to rebuild.
        batch.set("final_strain", strain.copy())
        handles += _steps(batch, 3, steps, steps, delay=0.05)
        assert not handles[-1].done()
        os.kill(pid, signal.SIGKILL)  # mid-sequence: steps 2..8 of cuda:0's chunks still pending or held there
        result = {f: batch.get(f) for f in ("plastic_strain", "alpha", "stress")}
    owners = dsched.ownership.device_owners(process_client, ["cuda:0"])[dsched.Device("cuda:0")]
    assert len(owners) == 1 and process_client.run(os.getpid, workers=owners)[owners[0]] != pid  # replaced
    for field in result:
        np.testing.assert_array_equal(result[field], reference[field], err_msg=field)
    assert reference["alpha"].max() > 0  # the points did yield: the state carried matters


@pytest.mark.parametrize("in_place", [False, True], ids=["new versions", "in place"])
def test_load_steps_on_worker_processes_equal_numpy(process_client, memory, in_place):
    strain = final_strain(50) * 3.0  # most points yield
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[10, 20], priorities=[1, 2])
    reference = run_numpy(strain, 5)
    result = run_batch(process_client, scheduler, strain, 5, in_place=in_place, memory=memory)
    for field in result:
        np.testing.assert_array_equal(result[field], reference[field], err_msg=field)
    assert (reference["alpha"] > 0).mean() > 0.5


def test_peak_memory_counts_a_buffer_two_versions_share_once():
    from dsched.bench_batch import _owned_buffers

    state = np.zeros((100, 6))
    version_1 = {"plastic_strain": state, "alpha": np.zeros(100)}
    version_2 = {"plastic_strain": state[10:], "alpha": version_1["alpha"].view()}  # views of the same memory
    one, two = _owned_buffers(version_1), _owned_buffers(version_2)
    assert one == two and sum(one.values()) == state.nbytes + 800
    assert sum(_owned_buffers({"x": np.zeros(100)}).values()) == 800 and _owned_buffers(np.ones(3)) != one
    # A fused task's result, {member: {field: array}}, holds the very buffers the chunk's next version updates.
    assert _owned_buffers({1: version_2}) == one


def test_in_place_steps_hold_the_memory_of_the_first_two(process_client):
    from dsched.bench_batch import PeakMemoryPlugin, _plugin, _read_sampler, _sum_peaks

    peaks = {}

    def on_step(step, batch):
        if step == 1:
            batch.wait()
            peaks["after_2"] = _sum_peaks(process_client.run(_read_sampler, reset=True))["distinct"]

    process_client.register_plugin(_plugin())
    try:
        run_batch(process_client, hybrid_scheduler(10, 20), final_strain(200), 20, on_step=on_step, in_place=True,
                  memory="device")
        after_all = _sum_peaks(process_client.run(_read_sampler))["distinct"]
    finally:
        process_client.unregister_worker_plugin(PeakMemoryPlugin.name)
    # The steps after the second (fused or not) overwrite the same buffers: nothing new, nothing counted twice.
    # (At most get()'s few small results on top.)
    assert peaks["after_2"] > 200 * 19 * 8 and after_all - peaks["after_2"] < 1000


def test_shared_memory_is_released_at_close(process_client):
    release_pool()  # segments kept from other calls (a batch in host memory's, closed) are not this batch's
    before = {e for e in os.listdir("/dev/shm") if e.startswith(f"dsched-{os.getpid()}-")}
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[10, 20], priorities=[1, 2])
    batch = Batch({"x": np.arange(40.0)}, scheduler, client=process_client, memory="device")
    batch.set("x", np.ones(40))
    assert len({e for e in os.listdir("/dev/shm") if e.startswith(f"dsched-{os.getpid()}-")} - before) == 2
    np.testing.assert_array_equal(batch.get("x"), np.ones(40))
    batch.close()
    assert {e for e in os.listdir("/dev/shm") if e.startswith(f"dsched-{os.getpid()}-")} == before
    with pytest.raises(RuntimeError, match="closed"):
        batch.get("x")


def _keys_of(dask_worker, prefix):
    return sorted(str(k) for k in dask_worker.data if str(k).startswith(prefix))


def test_a_long_batch_keeps_one_version_per_chunk_on_the_workers(process_client):
    """Superseded versions leave the workers as the batch goes: 40 updates leave one version per chunk."""
    with Batch({"x": np.arange(30.0)}, hybrid_scheduler(10, 20), client=process_client, memory="device") as batch:
        for _ in range(40):
            batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])
        batch.wait()
        prefix = batch._backend._id
        deadline = time.monotonic() + 10  # releases reach the workers through the scheduler
        while sum(map(len, process_client.run(_keys_of, prefix=prefix).values())) > 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(len(keys) for keys in process_client.run(_keys_of, prefix=prefix).values()) == [1, 1]
        np.testing.assert_array_equal(batch.get("x"), np.arange(30.0) + 40)


def test_close_frees_every_version_on_the_workers_while_updates_are_still_referenced(process_client):
    """An Update handle kept after close() (a driver keeps its last run's) must not keep its chunks' fields in
    the workers' memory until a garbage collection: close() releases every version at once."""
    batch = Batch({"x": np.arange(30.0)}, hybrid_scheduler(10, 20), client=process_client, memory="device")
    kept = batch.update(lambda x: {"y": 2 * x}, reads=["x"], outputs=["y"])
    kept.wait()
    prefix = batch._backend._id
    assert sum(len(keys) for keys in process_client.run(_keys_of, prefix=prefix).values()) >= 2
    batch.close()
    deadline = time.monotonic() + 10  # the release reaches the workers through the scheduler
    while any(process_client.run(_keys_of, prefix=prefix).values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process_client.run(_keys_of, prefix=prefix) == {w: [] for w in process_client.run(os.getpid)}
    assert kept.done()
    kept.wait()  # a finished update stays finished: waiting on it after close() returns at once


def _boom(x):
    raise ValueError("boom in the update")


def test_an_update_asked_after_close_tells_how_it_ended(hybrid_client):
    batch = Batch({"x": np.arange(30.0)}, hybrid_scheduler(10, 20), client=hybrid_client, memory="device")
    good = batch.update(lambda x: {"y": 2 * x}, reads=["x"], outputs=["y"])
    bad = batch.update(_boom, reads=["x"], outputs=["z"])
    with pytest.raises(ValueError, match="boom in the update"):
        bad.wait()
    batch.close()
    assert good.done() and bad.done()
    good.wait()
    with pytest.raises(ValueError, match="boom in the update"):
        bad.wait()


def test_load_steps_example_runs_and_checks_itself():
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "load_steps.py")
    done = subprocess.run([sys.executable, example, "--points", "600", "--steps", "4", "--report-every", "2",
                           "--emulate", "--check"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step    2:" in done.stdout and "check: equal to the same steps in NumPy" in done.stdout


def _twice(x):
    return 2.0 * x


def _held_until_go(x, *, event):
    """Holds the chunk's worker until the test says go (so that the next update waits behind it)."""
    from distributed import Event, secede

    secede()
    Event(event).wait(timeout=60)
    return {"x": x}


def _add_load(x, load):
    return {"x": np.asarray(x) + load}


def test_a_dispatch_output_given_as_an_update_input_is_kept_until_the_update_ran(process_client):
    """A run's outputs lie in a pooled segment, read where they lie when given as an update's inputs: dropped by
    the caller before the update ran, their memory must not go back to the pool (the next call would write it)."""
    import gc
    import uuid

    n, event = 200, f"dsched-test-go-{uuid.uuid4().hex}"
    scheduler = dsched.SimpleScheduler("cpu", 100)
    load = dsched.dispatch(_twice, np.ones(n), scheduler=scheduler, client=process_client)
    with Batch({"x": np.zeros(n)}, scheduler, client=process_client, memory="device") as batch:
        batch.update(_held_until_go, reads=["x"], writes=["x"], kwargs={"event": event})
        added = batch.update(_add_load, reads=["x"], writes=["x"], inputs={"load": load})
        del load
        gc.collect()
        # On the other worker: the held update has the cpu worker's one thread (a parked feed gives it way).
        other = dsched.dispatch(_twice, np.full(n, 7.0), scheduler=dsched.SimpleScheduler("cuda:0", 100),
                                client=process_client)
        from distributed import Event

        Event(event, client=process_client).set()
        added.wait()
        np.testing.assert_array_equal(batch.get("x"), np.full(n, 2.0))  # the load as it was, not 14 (or 7)
    np.testing.assert_array_equal(other, np.full(n, 14.0))


def _shm_bytes():
    """Bytes of this process's segments in /dev/shm."""
    prefix = f"dsched-{os.getpid()}-"
    return sum(os.path.getsize(os.path.join("/dev/shm", name)) for name in os.listdir("/dev/shm")
               if name.startswith(prefix))


def _add_strain(strain, x):
    return {"x": x + strain}


def test_set_again_and_again_keeps_dev_shm_flat(process_client, memory):
    """A solver sets a field at every step: the field's segment is written again, not a new one each time."""
    n = 4000
    field = n * 6 * 8
    with Batch({"x": np.zeros((n, 6))}, hybrid_scheduler(1000, 2000), client=process_client, memory=memory) as batch:
        batch.set("strain", np.zeros((n, 6)))
        batch.update(_add_strain, reads=["strain", "x"], writes=["x"])
        batch.get("x")
        before = _shm_bytes()
        for step in range(60):
            batch.set("strain", np.full((n, 6), float(step)))
            batch.update(_add_strain, reads=["strain", "x"], writes=["x"])
        np.testing.assert_array_equal(batch.get("x"), np.full((n, 6), float(sum(range(60)))))
        after = _shm_bytes()
    assert after - before < field, f"/dev/shm grew by {(after - before) / field:.1f} fields over 60 set() calls"


def test_a_set_load_run_again_after_its_values_were_overwritten_fails_naming_them(process_client):
    """What Dask would run to rebuild a lost chunk from values a later set() overwrote is refused, not loaded."""
    from dsched.resident.hostdata import SetSegment
    from dsched.resident.tasks import _Chunk, _load_set

    from dsched.dataplane.store import SliceRef

    kept = SetSegment(np.zeros((10, 2)))
    try:
        kept.write(np.ones((10, 2)))
        rows = {"strain": SliceRef(kept.ref, 0, 0, 5)}
        chunk = _Chunk(0, dsched.Device("cpu"), 0, 5)
        np.testing.assert_array_equal(_load_set(chunk, rows, kept.generation_ref, 1)["strain"], np.ones((5, 2)))
        kept.write(np.full((10, 2), 2.0))
        with pytest.raises(RuntimeError, match="generation 1 of strain were overwritten by generation 2"):
            _load_set(chunk, rows, kept.generation_ref, 1)
    finally:
        kept.store.close()


def square_into(x, y):
    y[:] = x * x  # writes only its out= rows: no field


def test_an_update_may_write_only_to_out_arrays(hybrid_client, memory):
    y = dsched.shared_empty(20)
    with Batch({"x": np.arange(20.0)}, hybrid_scheduler(), client=hybrid_client, memory=memory) as batch:
        batch.update(square_into, reads=["x"], out={"y": y}).wait()
        np.testing.assert_array_equal(y, np.arange(20.0) ** 2)
        assert batch.fields == ["x"]
        with pytest.raises(ValueError, match=r"^writes: an update must write at least one field or out= array"):
            batch.update(square_into, reads=["x"])
