"""WorkDispatcher and dispatch(): NEML2's dispatcher semantics, sync and async, on a real Dask cluster.

Ports NEML2 v2.1.6 ``tests/dispatchers/test_WorkDispatcher_*`` to this API and
adds what NEML2 could not do: dispatch order under out-of-order completion,
failures, per-worker ``thread_init``, and placement checked from inside the
chunks. Async runs use the in-process emulated ``cpu`` + ``cuda:0`` cluster of
``hybrid_client`` (emulation checks placement, never GPU speed). Work
functions live at module level so that Dask ships them by reference: the
in-process workers then share this module's globals with the test.
"""

import threading
import time

import numpy as np
import pytest

from dsched import (
    AggregateError,
    ChunkRecord,
    Device,
    DispatchError,
    MappingLoader,
    RecoverableError,
    RunReport,
    SimpleScheduler,
    SliceGenerator,
    StaticHybridScheduler,
    WorkDispatcher,
    concat_reduce,
    current_device,
    dispatch,
)
from dsched.devices import device_resource, to_device, to_host

CPU, GPU0 = Device("cpu"), Device("cuda:0")
MODES = ["sync", "async"]


def all_idle(scheduler):
    return scheduler.all_work_completed() and all(s.load == 0 for s in scheduler.status())


# --- NEML2: WorkDispatcher + SliceGenerator + SimpleScheduler ------------------------

def slice_product(work, device):
    return work.start * work.stop * (1 if work.step is None else work.step)


def shrink_slice(work, device):
    return slice(work.start + 1, work.stop - 1)


def plus_one(result):
    return result + 1


NEML2_SLICE_RESULTS = [19750, 292300, 802900, 1551550, 2538250, 3550000]


@pytest.mark.parametrize("mode", MODES)
def test_slices_without_reduce_come_back_in_dispatch_order(hybrid_client, mode):
    scheduler = SimpleScheduler("cpu", batch_size=345, capacity=800)
    dispatcher = WorkDispatcher(scheduler, slice_product, mode=mode, client=hybrid_client)
    assert dispatcher.run(SliceGenerator(50, 2000)) == NEML2_SLICE_RESULTS
    assert [r.size for r in dispatcher.last_run.records] == [345] * 5 + [225]
    assert all_idle(scheduler)


@pytest.mark.parametrize("mode", MODES)
def test_slices_with_reduce(hybrid_client, mode):
    dispatcher = WorkDispatcher(SimpleScheduler("cpu", 345, 800), slice_product, reduce=sum, mode=mode, client=hybrid_client)
    assert dispatcher.run(SliceGenerator(50, 2000)) == 8754750


@pytest.mark.parametrize("mode", MODES)
def test_slices_with_reduce_preprocess_postprocess(hybrid_client, mode):
    dispatcher = WorkDispatcher(
        SimpleScheduler("cpu", 345, 800), slice_product, reduce=sum,
        preprocess=shrink_slice, postprocess=plus_one, mode=mode, client=hybrid_client,
    )
    assert dispatcher.run(SliceGenerator(50, 2000)) == 8756700


# --- NEML2: WorkDispatcher + ValueMapLoader (axis 1) -------------------------------------

def strain_and_temperature():
    strain0 = np.broadcast_to(np.array([0.1, 0.05, -0.01, 0, 0, 0]), (5, 5, 6))
    strain1 = np.broadcast_to(np.array([0.2, 0.1, 0, 0, 0, 0]), (5, 5, 6))
    strain = np.linspace(strain0, strain1, 100, axis=1)  # (5, 100, 5, 6)
    temperature = np.full((5, 1, 5), 300.0)
    return {"strain": strain, "temperature": temperature}


def fake_stress(work, device):
    assert current_device() == device  # the chunk knows where it was placed
    return {"stress": work["strain"] * work["temperature"][..., None], "n": np.array(work["strain"].shape[1])}


def reduce_axis1(results):
    return concat_reduce(results, axis=1)


def expected_stress(x):
    return x["strain"] * x["temperature"][..., None]


@pytest.mark.parametrize("mode", MODES)
def test_value_maps_on_a_simple_scheduler(hybrid_client, mode):
    x = strain_and_temperature()
    dispatcher = WorkDispatcher(
        SimpleScheduler("cpu", 23, 55), fake_stress, reduce=reduce_axis1,
        preprocess=to_device, postprocess=to_host, mode=mode, client=hybrid_client,
    )
    y = dispatcher.run(MappingLoader(x, axis=1))
    np.testing.assert_allclose(y["stress"], expected_stress(x), rtol=1e-15)
    assert int(y["n"]) == 23  # 0-d: taken from the first chunk
    assert [r.size for r in dispatcher.last_run.records] == [23, 23, 23, 23, 8]


def test_value_maps_on_a_hybrid_scheduler_async(hybrid_client):
    x = strain_and_temperature()
    scheduler = StaticHybridScheduler(["cuda:0", "cpu"], batch_sizes=[23, 17], capacities=[55, 18], priorities=[1, 2])
    dispatcher = WorkDispatcher(scheduler, fake_stress, reduce=reduce_axis1, client=hybrid_client)
    y = dispatcher.run(MappingLoader(x, axis=1))
    np.testing.assert_allclose(y["stress"], expected_stress(x), rtol=1e-15)
    records = dispatcher.last_run.records
    # The first wave is dispatched before any completion: the CPU (priority 2, room for one
    # chunk of 17), then cuda:0 twice (23 + 23 <= 55).
    assert [(r.device, r.size) for r in records[:3]] == [(CPU, 17), (GPU0, 23), (GPU0, 23)]
    assert sum(r.size for r in records) == 100
    assert all(r.size <= {CPU: 17, GPU0: 23}[r.device] for r in records)
    assert all_idle(scheduler)


def test_value_maps_on_a_hybrid_scheduler_sync_use_the_zero_load_choice_only():
    x = strain_and_temperature()
    scheduler = StaticHybridScheduler(["cuda:0", "cpu"], batch_sizes=[23, 17], capacities=[55, 18], priorities=[1, 2])
    dispatcher = WorkDispatcher(scheduler, fake_stress, reduce=reduce_axis1, mode="sync")
    y = dispatcher.run(MappingLoader(x, axis=1))
    np.testing.assert_allclose(y["stress"], expected_stress(x), rtol=1e-15)
    assert [(r.device, r.size) for r in dispatcher.last_run.records] == [(CPU, 17)] * 5 + [(CPU, 15)]


# --- sync mode -------------------------------------------------------------------------

class SyncProbe:
    """do_work and thread_init for sync runs: records thread, device and the scheduler's loads."""

    def __init__(self, scheduler):
        self.scheduler, self.events = scheduler, []

    def init(self, device):
        self.events.append(("init", device, current_device(), threading.get_ident()))

    def work(self, work, device):
        loads = [s.load for s in self.scheduler.status()]
        self.events.append(("work", device, current_device(), threading.get_ident(), loads))
        return work.stop - work.start


def test_sync_runs_on_the_calling_thread_without_load_accounting():
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 8], capacities=[4, 16], priorities=[1, 3])
    probe = SyncProbe(scheduler)
    dispatcher = WorkDispatcher(scheduler, probe.work, thread_init=probe.init, mode="sync")
    assert dispatcher.run(SliceGenerator(0, 50)) == [8] * 6 + [2]
    me = threading.get_ident()
    init, *works = probe.events
    assert init == ("init", GPU0, GPU0, me)  # once, on the calling thread, before the first chunk
    assert all(e[:4] == ("work", GPU0, GPU0, me) for e in works) and len(works) == 7
    assert all(e[4] == [0, 0] for e in works)  # no load accounting, ever
    assert all(r.worker is None and r.device == GPU0 for r in dispatcher.last_run.records)

    probe.events.clear()
    dispatcher.run(SliceGenerator(0, 10))  # once per dispatcher: no second init
    assert [e[0] for e in probe.events] == ["work", "work"]
    assert all_idle(scheduler)


# --- async: dispatch order, placement, identity with sync ----------------------------------

OTHERS_DONE = threading.Condition()  # shared with the in-process workers (same module)
OTHERS_STATE = {"done": 0}


def first_chunk_finishes_last(work, device):
    """Chunk 0 waits until the 7 other chunks have returned, so it completes after all of them."""
    if work.start == 0:
        with OTHERS_DONE:
            if not OTHERS_DONE.wait_for(lambda: OTHERS_STATE["done"] == 7, timeout=20):
                raise TimeoutError("the other chunks never finished")
        time.sleep(0.05)  # margin over the others' own stop stamps, taken just after they return
    else:
        with OTHERS_DONE:
            OTHERS_STATE["done"] += 1
            OTHERS_DONE.notify_all()
    return list(range(work.start, work.stop))


def test_results_in_dispatch_order_when_chunks_finish_out_of_order(hybrid_client):
    OTHERS_STATE["done"] = 0
    # Two chunks in flight per device: chunk 0 holds one CPU slot while the rest pass it.
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=2, capacities=4)
    dispatcher = WorkDispatcher(scheduler, first_chunk_finishes_last, client=hybrid_client)
    results = dispatcher.run(SliceGenerator(0, 16))
    assert results == [[2 * i, 2 * i + 1] for i in range(8)]
    records = dispatcher.last_run.records
    assert [r.index for r in records] == list(range(8))
    completion_order = [r.index for r in sorted(records, key=lambda r: r.stop)]
    assert completion_order[-1] == 0 and completion_order != list(range(8))
    assert records[0].stop > max(r.stop for r in records[1:])
    assert all(r.start <= r.stop for r in records)
    assert all_idle(scheduler)


def where_am_i(work, device):
    from distributed import get_worker

    worker = get_worker()
    return {"device": current_device(), "argument": device, "worker": worker.name, "address": worker.address}


def test_every_chunk_runs_on_the_worker_owning_its_device(hybrid_client):
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 5], capacities=[6, 10])
    dispatcher = WorkDispatcher(scheduler, where_am_i, client=hybrid_client)
    seen = dispatcher.run(SliceGenerator(0, 80))
    workers = hybrid_client.scheduler_info(n_workers=-1)["workers"]
    assert {r.device for r in dispatcher.last_run.records} == {CPU, GPU0}
    for record, inside in zip(dispatcher.last_run.records, seen):
        assert inside["device"] == inside["argument"] == record.device
        assert inside["worker"] == str(record.device)  # LocalHybridCluster names workers after devices
        assert inside["address"] == record.worker
        assert device_resource(record.device) in workers[record.worker]["resources"]


def test_bare_cuda_is_placed_on_cuda_0(hybrid_client):
    dispatcher = WorkDispatcher(SimpleScheduler("cuda", 4), where_am_i, client=hybrid_client)
    seen = dispatcher.run(SliceGenerator(0, 10))
    assert [s["worker"] for s in seen] == ["cuda:0"] * 3


def test_current_device_in_plain_tasks(hybrid_client):
    assert current_device() is None  # the test's own thread is in no worker
    on_gpu = hybrid_client.submit(current_device, workers=["cuda:0"], pure=False).result()
    on_cpu = hybrid_client.submit(current_device, workers=["cpu"], pure=False).result()
    assert (on_gpu, on_cpu) == (GPU0, CPU)


def scaled(work, device):
    return {"y": 2.0 * work["x"] + work["b"], "rows": np.full(work["x"].shape[0], work["x"].shape[0])}


def test_sync_and_async_agree(hybrid_client):
    rng = np.random.default_rng(3)
    data = {"x": rng.normal(size=(203, 4)), "b": rng.normal(size=(1, 4))}
    outputs = {}
    for mode in MODES:
        scheduler = StaticHybridScheduler(["cpu", "cuda:0"], [16, 24], [32, 48], [1, 1])
        dispatcher = WorkDispatcher(scheduler, scaled, reduce=concat_reduce, mode=mode, client=hybrid_client)
        outputs[mode] = dispatcher.run(MappingLoader(data))
    np.testing.assert_array_equal(outputs["sync"]["y"], outputs["async"]["y"])
    np.testing.assert_array_equal(outputs["sync"]["y"], 2.0 * data["x"] + data["b"])
    # Same values, different chunking: sync used the CPU alone (16 per chunk).
    assert set(outputs["sync"]["rows"]) == {16, 11}
    assert {16, 24} <= set(outputs["async"]["rows"])


def test_run_report(hybrid_client):
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], 5, 10)
    seen = []
    dispatcher = WorkDispatcher(scheduler, slice_product, client=hybrid_client,
                                on_chunk_done=lambda r: seen.append((r.index, threading.get_ident())))
    dispatcher.run(SliceGenerator(0, 42))
    report = dispatcher.last_run
    assert isinstance(report, RunReport) and report.mode == "async"
    assert all(isinstance(r, ChunkRecord) for r in report.records)
    assert report.items == 42 and report.wall_time > 0
    table = report.by_device()
    assert sum(row["chunks"] for row in table.values()) == 9
    assert sum(row["items"] for row in table.values()) == 42
    assert sorted(i for i, _ in seen) == list(range(9))  # each chunk reported once
    assert {t for _, t in seen} == {threading.get_ident()}  # on the calling thread


# --- async thread_init -------------------------------------------------------------------

INIT_LOG = []  # (tag, device, worker name), appended on the workers (same process)


class RecordInit:
    def __init__(self, tag, delay=0.0):
        self.tag, self.delay = tag, delay

    def __call__(self, device):
        from distributed import get_worker

        time.sleep(self.delay)  # a slow init: concurrent first chunks must wait for it
        INIT_LOG.append((self.tag, str(device), get_worker().name, str(current_device())))


class CountInits:
    def __init__(self, tag):
        self.tag = tag

    def __call__(self, work, device):
        return sum(1 for entry in INIT_LOG if entry[:2] == (self.tag, str(device)))


def test_thread_init_once_per_device_per_dispatcher_per_worker(hybrid_client):
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], 2, 8)  # four chunks in flight per device
    first = WorkDispatcher(scheduler, CountInits("first"), thread_init=RecordInit("first", 0.2), client=hybrid_client)
    assert first.run(SliceGenerator(0, 40)) == [1] * 20  # every chunk ran after its device's init
    ours = sorted(e for e in INIT_LOG if e[0] == "first")
    assert ours == [("first", "cpu", "cpu", "cpu"), ("first", "cuda:0", "cuda:0", "cuda:0")]

    assert first.run(SliceGenerator(0, 40)) == [1] * 20  # a second run initialises nothing
    assert sorted(e for e in INIT_LOG if e[0] == "first") == ours

    second = WorkDispatcher(scheduler, CountInits("second"), thread_init=RecordInit("second"), client=hybrid_client)
    assert second.run(SliceGenerator(0, 12)) == [1] * 6  # another dispatcher initialises again
    assert sorted(e[1] for e in INIT_LOG if e[0] == "second") == ["cpu", "cuda:0"]
    remote = hybrid_client.run(lambda: sum(1 for e in __import__("test_dispatch").INIT_LOG if e[0] == "first"))
    assert set(remote.values()) == {2}  # the workers saw the same log: in-process, one module


def failing_init(device):
    raise RuntimeError(f"cannot initialise {device}")


def test_a_failing_thread_init_fails_the_run(hybrid_client):
    scheduler = SimpleScheduler("cuda:0", 4)
    dispatcher = WorkDispatcher(scheduler, slice_product, thread_init=failing_init, client=hybrid_client)
    with pytest.raises(RuntimeError, match=r"cannot initialise cuda:0"):
        dispatcher.run(SliceGenerator(0, 20))
    assert all_idle(scheduler)


# --- failures --------------------------------------------------------------------------

POISONED = range(0, 16)  # items whose chunks fail


class NotConverged(RecoverableError):
    pass


def fail_in_poisoned(work, device):
    if work.start in POISONED:
        if work.start == 6:
            raise ValueError(f"fatal at {work.start}")
        raise NotConverged(f"no convergence at {work.start}")
    return work.start


def fail_at_8(work, device):
    if work.start == 8:
        raise KeyError(f"chunk at {work.start}")
    return work.start


@pytest.mark.parametrize("mode", MODES)
def test_one_failure_is_reraised_as_itself(hybrid_client, mode):
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], 4, 8)
    dispatcher = WorkDispatcher(scheduler, fail_at_8, mode=mode, client=hybrid_client)
    with pytest.raises(KeyError, match=r"chunk at 8"):
        dispatcher.run(SliceGenerator(0, 40))
    report = dispatcher.last_run
    failed = [r for r in report.records if r.error is not None]
    assert [r.index for r in failed] == [2] and isinstance(failed[0].error, KeyError)
    # Finished work is kept: every other chunk that ran has its result in its slot.
    for record, result in zip(report.records, report.results):
        assert result == (None if record.error else 4 * record.index)
    if mode == "async":
        assert len(report.records) >= 4  # the first wave (two chunks per device) was in flight
    else:
        assert len(report.records) == 3  # sync stops right at the failure
    assert all_idle(scheduler)
    assert dispatcher.run(SliceGenerator(20, 40)) == list(range(20, 40, 4))  # usable again
    assert all_idle(scheduler)


def test_several_failures_aggregate_in_dispatch_order(hybrid_client):
    # Capacity 8 with batch 2: four chunks in flight per device, and the whole first wave
    # (items 0-15, eight chunks) fails; scheduling stops, so nothing else is dispatched.
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], 2, 8)
    dispatcher = WorkDispatcher(scheduler, fail_in_poisoned, client=hybrid_client)
    with pytest.raises(AggregateError) as info:
        dispatcher.run(SliceGenerator(0, 40))
    err = info.value
    assert isinstance(err, DispatchError)
    assert [str(e) for e in err.errors] == [
        ("fatal at 6" if s == 6 else f"no convergence at {s}") for s in range(0, 16, 2)
    ]
    assert isinstance(err.errors[3], ValueError) and isinstance(err.errors[0], NotConverged)
    assert err.recoverable is False  # one fatal error among them
    assert str(err).startswith("8 of 8 chunks failed:")
    assert str(err).endswith("(the run stopped at the first failure: 24 items were never dispatched)")
    assert "[3] (fatal) ValueError: fatal at 6" in str(err)
    assert "[0] (recoverable) NotConverged: no convergence at 0" in str(err)
    assert len(dispatcher.last_run.records) == 8
    assert [r.error for r in dispatcher.last_run.records] == err.errors
    assert all_idle(scheduler)
    assert dispatcher.run(SliceGenerator(16, 30)) == list(range(16, 30, 2))
    assert all_idle(scheduler)


def test_chunks_that_fail_alike_read_as_one_line_with_their_indexes():
    """A model that fails the same way in a hundred chunks: one line, not a hundred."""
    errors = [TypeError("step() got an unexpected keyword argument 'a'")] * 100
    errors[5] = ValueError("bad row 5")
    err = AggregateError.of(errors, dispatched=100)
    assert str(err).splitlines() == [
        "100 of 100 chunks failed:",
        "[0-4, 6-99] (fatal) TypeError: step() got an unexpected keyword argument 'a'",
        "[5] (fatal) ValueError: bad row 5",
    ]
    assert len(err.errors) == 100  # each chunk's error is still there, in dispatch order


def test_a_failure_in_a_scripts_function_names_the_script_where_the_worker_says_dynamic_code(tmp_path):
    """A function of the user's script reaches worker processes by value, and their tracebacks name its file
    "<dynamic-code>" (cloudpickle's choice): a note gives the script's path."""
    import subprocess
    import sys

    script = tmp_path / "model.py"
    script.write_text("""import numpy as np, dsched
from distributed import Client

def boom(x):
    raise ValueError("bad input")

if __name__ == "__main__":
    with dsched.LocalHybridCluster(["cpu"], processes=True, threads_per_worker=1, dashboard_address=None) as c, \\
            Client(c) as client:
        dsched.dispatch(boom, np.ones((10, 3)), scheduler=dsched.SimpleScheduler("cpu", 10), client=client)
""")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1 and 'File "<dynamic-code>", line 5, in boom' in done.stderr
    assert (f'dsched: File "<dynamic-code>" above is {script} (sent to the workers by value), where boom is '
            "defined at line 4") in done.stderr


def all_recoverable(work, device):
    if work.start < 16:
        raise NotConverged(f"no convergence at {work.start}")
    return work.start


def test_aggregate_of_recoverable_errors_is_recoverable(hybrid_client):
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], 2, 8)
    dispatcher = WorkDispatcher(scheduler, all_recoverable, client=hybrid_client)
    with pytest.raises(AggregateError) as info:
        dispatcher.run(SliceGenerator(0, 16))
    assert len(info.value.errors) == 8 and info.value.recoverable is True
    assert all(isinstance(e, NotConverged) for e in info.value.errors)
    assert all_idle(scheduler)


# --- validation --------------------------------------------------------------------------

def test_bad_mode():
    with pytest.raises(ValueError, match=r"mode: expected 'sync' or 'async', got 'parallel'"):
        WorkDispatcher(SimpleScheduler("cpu", 1), slice_product, mode="parallel")


@pytest.mark.parametrize("name", ["do_work", "reduce", "preprocess", "postprocess", "thread_init", "on_chunk_done"])
def test_non_callables(name):
    kwargs = {"do_work": slice_product, name: 42}
    do_work = kwargs.pop("do_work")
    with pytest.raises(ValueError, match=rf"{name}: expected a callable, got 42"):
        WorkDispatcher(SimpleScheduler("cpu", 1), do_work, **kwargs)


def test_missing_do_work():
    with pytest.raises(ValueError, match=r"do_work: the do-work function is not set"):
        WorkDispatcher(SimpleScheduler("cpu", 1), None)


RAN = []


def record_and_return(work, device):
    RAN.append(work)
    return 0


def test_async_device_without_owner_fails_before_any_work(hybrid_client):
    RAN.clear()
    scheduler = StaticHybridScheduler(["cpu", "cuda:1"], 4)
    dispatcher = WorkDispatcher(scheduler, record_and_return, client=hybrid_client)
    generator = SliceGenerator(0, 10)
    with pytest.raises(ValueError, match=r"devices: no worker of the cluster owns cuda:1 \(owned devices: cpu, cuda:0\)"):
        dispatcher.run(generator)
    assert RAN == [] and generator.offset == 0 and dispatcher.last_run.records == []
    assert all_idle(scheduler)


# --- dispatch() ----------------------------------------------------------------------------

def affine(x, params, scale, *, shift):
    return scale * x * params["w"] + params["b"] + shift


def two_outputs(x):
    return x.sum(axis=1), {"double": 2 * x, "rows": np.full(x.shape[0], x.shape[0])}


def along_axis1(x, y):
    assert x.shape[1] <= 7 and y.shape == (3, 1)
    return x + y, {"s": x.sum(axis=0, keepdims=True)}


def per_chunk_total(x, y):
    # "total" is 1-d, so it has no axis 1: joining it would keep only one chunk's value.
    return x + y, {"total": x.sum(axis=0)}


@pytest.mark.parametrize("mode", MODES)
def test_dispatch_along_axis_one(hybrid_client, mode):
    x = np.arange(60.0).reshape(3, 20)
    y = np.array([[1.0], [2.0], [3.0]])  # size 1 along axis 1: whole in every chunk
    # Sync runs on the calling thread, which cannot emulate a GPU: the CPU there.
    device = "cuda:0" if mode == "async" else "cpu"
    joined, parts = dispatch(along_axis1, x, y, scheduler=SimpleScheduler(device, 7), client=hybrid_client,
                             mode=mode, axis=1)
    np.testing.assert_array_equal(joined, x + y)
    np.testing.assert_array_equal(parts["s"], x.sum(axis=0, keepdims=True))


@pytest.mark.parametrize("mode", MODES)
def test_dispatch_refuses_a_result_without_the_batch_axis(hybrid_client, mode):
    from dsched.outputs import ChunkResultError

    x, y = np.arange(60.0).reshape(3, 20), np.ones((3, 1))
    with pytest.raises((ChunkResultError, AggregateError), match=r"returned result\[1\]\['total'\] of shape \(7,\); "
                       r"expected 7 items along axis 1"):
        dispatch(per_chunk_total, x, y, scheduler=SimpleScheduler("cpu", 7), client=hybrid_client, mode=mode, axis=1)


def test_dispatch_names_the_argument_whose_size_disagrees_as_the_user_wrote_it():
    with pytest.raises(ValueError) as err:
        dispatch(affine, np.zeros(5), {"w": np.zeros(5), "b": np.zeros(3)}, 1.0, shift=0.0,
                 scheduler=SimpleScheduler("cpu", 2), mode="sync")
    assert str(err.value) == "args[1]['b'] ('params' of affine): size 3 along axis 0 is not compatible; expected 1 or 5"
    with pytest.raises(ValueError) as err:  # a ufunc's signature too
        dispatch(np.add, np.zeros(5), np.zeros(4), scheduler=SimpleScheduler("cpu", 2), mode="sync")
    assert str(err.value) == "args[1] ('x2' of add): size 4 along axis 0 is not compatible; expected 1 or 5"


calls_of_norm = []


def norm(x, order=2):
    calls_of_norm.append(len(x))
    return np.linalg.norm(x, ord=order, axis=1)


def takes_any_keyword(x, **options):
    return x * options["scale"]


@pytest.mark.parametrize("mode", MODES)
def test_a_keyword_the_model_does_not_take_is_a_type_error_before_any_work(hybrid_client, mode):
    del calls_of_norm[:]
    x = np.ones((10, 3))
    with pytest.raises(TypeError) as err:
        dispatch(norm, x, scheduler=SimpleScheduler("cpu", 4), mode=mode, clinet=hybrid_client)
    assert str(err.value) == ("clinet: not a keyword of dispatch, and norm(x, order=2) takes no such argument; "
                              "did you mean client=?")
    with pytest.raises(TypeError) as err:  # close to one of the model's own
        dispatch(norm, x, scheduler=SimpleScheduler("cpu", 4), mode=mode, client=hybrid_client, ordr=1)
    assert str(err.value).endswith("takes no such argument; did you mean order=?")
    with pytest.raises(TypeError) as err:  # close to nothing
        dispatch(norm, x, scheduler=SimpleScheduler("cpu", 4), mode=mode, client=hybrid_client, colour="red")
    assert str(err.value) == "colour: not a keyword of dispatch, and norm(x, order=2) takes no such argument"
    assert calls_of_norm == []  # nothing ran: not the probe, not a chunk
    np.testing.assert_allclose(dispatch(norm, x, scheduler=SimpleScheduler("cpu", 4), mode=mode,
                                        client=hybrid_client, order=1), np.full(10, 3.0))


def test_models_taking_any_keyword_get_every_keyword():  # a **kwargs function, a NumPy ufunc
    x = np.arange(6.0)
    np.testing.assert_array_equal(dispatch(takes_any_keyword, x, scheduler=SimpleScheduler("cpu", 4), mode="sync",
                                           scale=2.0), 2 * x)
    np.testing.assert_array_equal(dispatch(np.multiply, x, 3.0, scheduler=SimpleScheduler("cpu", 4), mode="sync",
                                           dtype=np.float32), 3 * x)


def test_dispatch_needs_an_array():
    with pytest.raises(ValueError, match=r"^args: dispatch needs at least one array \(or container of arrays\) to "
                                         r"split; a list of numbers is not one: np.asarray\(...\) makes one$"):
        dispatch(abs, 3.0, [1, 2], scheduler=SimpleScheduler("cpu", 2), mode="sync")
    with pytest.raises(ValueError, match=r"^args: dispatch needs at least one array \(or container of arrays\) to "
                                         r"split$"):
        dispatch(abs, 3.0, "text", scheduler=SimpleScheduler("cpu", 2), mode="sync")


def test_dispatch_reraises_a_chunk_failure(hybrid_client):
    def explode(x):
        if x[0] >= 10:
            raise ArithmeticError(f"overflow from {x[0]:g}")
        return x

    scheduler = SimpleScheduler("cpu", 5)  # one chunk at a time: exactly one failure
    with pytest.raises(ArithmeticError, match=r"overflow from 10"):
        dispatch(explode, np.arange(20.0), scheduler=scheduler, client=hybrid_client)
    assert all_idle(scheduler)


# --- found in review: each of these once gave a silent wrong answer or started work first ------

def times_k(d, y):
    return d["a"] * d["k"] + 0 * y


@pytest.mark.parametrize("mode", MODES)
def test_a_dict_with_scalars_is_split_and_its_scalars_go_whole(hybrid_client, mode):
    x = np.arange(6.0)
    out = dispatch(times_k, {"a": x, "k": 2.0}, x, scheduler=SimpleScheduler("cpu", 2), client=hybrid_client, mode=mode)
    np.testing.assert_array_equal(out, 2 * x)


def test_dispatch_needs_a_callable_and_a_scheduler_before_any_work():
    with pytest.raises(ValueError, match="fn: expected a callable, got 5"):
        dispatch(5, np.arange(4.0), scheduler=SimpleScheduler("cpu", 2))
    # Arguments given in the wrong order: the array said by its shape, not printed whole.
    with pytest.raises(ValueError, match=r"^fn: expected a callable, got ndarray of shape \(1000, 3\) and dtype "
                                         r"float64$"):
        dispatch(np.ones((1000, 3)), np.negative, scheduler=SimpleScheduler("cpu", 2))
    with pytest.raises(ValueError, match="scheduler: 'nope' is not a scheduler"):
        WorkDispatcher("nope", slice_product)


def test_a_scheduler_loaded_by_someone_else_is_an_error_not_a_truncated_result(hybrid_client):
    scheduler = SimpleScheduler("cpu", 4, 8)
    scheduler.dispatched_work("cpu", 8)  # another run's chunks
    with pytest.raises(RuntimeError, match="has no room for the next chunk and this run has none in flight"):
        WorkDispatcher(scheduler, slice_product, client=hybrid_client).run(SliceGenerator(0, 100))
    assert [s.load for s in scheduler.status()] == [8]
