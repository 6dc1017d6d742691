"""The data plane: inputs by reference, outputs in place, results on disk, and nothing left in /dev/shm.

Worker processes are used throughout (in-process clusters are checked too): they are
where copies and leaks hide. The CUDA device is emulated (a worker that claims
cuda:0 and computes with NumPy); these tests check data movement, not a GPU.
"""

import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dsched
from dsched.dataplane.segments import release_pool
from dsched.outputs import ChunkResultError
from dsched.store import SHM_DIR


def shm_entries(pid=None):
    """This process's segments (or ``pid``'s) beyond those kept for later calls (the segment pool), which
    are released first: other test runs on the machine have their own."""
    if pid is None:
        release_pool()
    prefix = f"dsched-{os.getpid() if pid is None else pid}-"
    return {name for name in os.listdir(SHM_DIR) if name.startswith(prefix)}


def hybrid(batch=100, capacity=None):
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=batch, capacities=capacity or batch)


def affine(x, params):
    return {"y": 2.0 * x + params["b"], "n": np.linalg.norm(x, axis=1)}


def test_processes_results_equal_numpy_and_leave_no_segment(process_client):
    rng = np.random.default_rng(0)
    x, b = rng.normal(size=(1000, 3)), rng.normal(size=(1000, 3))
    before = shm_entries()
    out = dsched.dispatch(affine, x, {"b": b}, scheduler=hybrid(128, 256), client=process_client)
    assert out["y"].shape == (1000, 3) and out["n"].shape == (1000,)
    np.testing.assert_array_equal(out["y"], 2.0 * x + b)
    np.testing.assert_array_equal(out["n"], np.linalg.norm(x, axis=1))
    # The input segment went to the pool at the end; the output's stays while its arrays live, then joins it.
    assert len(shm_entries() - before) == 1
    out["y"][0] = 1.0  # and writable, like any result
    del out
    assert shm_entries() == before


@pytest.mark.parametrize("feeds", [True, False])
@pytest.mark.parametrize("batch", [1_000, 100_000])
def test_task_size_does_not_grow_with_the_chunk(process_client, batch, feeds):
    """Each chunk's task (what the scheduler holds and forwards) is a small descriptor. With device feeds the
    scheduler holds one task per device thread (the two feeds), whatever the chunks; without, one per chunk."""
    import dask
    from distributed.diagnostics.plugin import SchedulerPlugin

    sizes = []

    class TaskSizes(SchedulerPlugin):
        def update_graph(self, scheduler, *, tasks, **kwargs):
            for key in tasks:
                ts = scheduler.tasks.get(key)
                if ts is not None and str(key).startswith("dsched-"):
                    sizes.append(len(pickle.dumps(ts.run_spec, protocol=5)))

    from dsched.feed import release_parked

    release_parked(process_client)  # the run starts its own feeds rather than take the last run's
    scheduler = process_client.cluster.scheduler
    plugin = TaskSizes()
    scheduler.add_plugin(plugin, name="task-sizes")
    try:
        x = np.ones((4 * batch, 6))
        with dask.config.set({"dsched.feeds": feeds, "dsched.batched-submission": False}):
            out = dsched.dispatch(np.negative, x, scheduler=hybrid(batch), client=process_client)
    finally:
        scheduler.remove_plugin(name="task-sizes")
    np.testing.assert_array_equal(out, -x)
    assert len(sizes) == (2 if feeds else 4)
    assert max(sizes) <= 1024, sizes


def test_in_process_cluster_shares_without_copy(hybrid_client):
    """In-process workers read the client's arrays as they are: no segment is created."""
    seen = []
    x = np.arange(4000.0).reshape(1000, 4)
    out = dsched.dispatch(lambda a: a * 3, x, scheduler=hybrid(100), client=hybrid_client)
    np.testing.assert_array_equal(out, x * 3)

    def record(_):
        seen.append(shm_entries())

    d = dsched.WorkDispatcher(hybrid(100), lambda w, dev: w + 1, join="concat", client=hybrid_client,
                              on_chunk_done=record)
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), x + 1)
    assert seen and all(not entries for entries in seen)


def test_inputs_arrive_read_only(process_client, hybrid_client):
    def mutate(a):
        a += 1
        return a

    for client in (process_client, hybrid_client):
        x = np.zeros((10, 2))
        with pytest.raises(ValueError, match="read-only"):
            dsched.dispatch(mutate, x, scheduler=dsched.SimpleScheduler("cpu", 10), client=client)
        assert not x.any()  # the caller's batch is untouched


@pytest.mark.parametrize("model, message", [
    (lambda a: a[:-1], r"returned result of shape \(\d+, 2\); expected \d+ items along axis 0"),
    (lambda a: np.zeros(3), r"returned result of shape \(3,\); expected \d+ items along axis 0"),
    (lambda a: None, r"returned result = NoneType None; expected an array"),
    (lambda a: float(a.sum()), r"returned result = float .*; expected an array"),
])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_results_that_do_not_fit_their_chunk_are_errors(hybrid_client, model, message, mode):
    x = np.ones((1000, 2))
    with pytest.raises((ChunkResultError, dsched.AggregateError)) as info:
        dsched.dispatch(model, x, scheduler=hybrid(100), client=hybrid_client, mode=mode)
    err = info.value
    first = err.errors[0] if isinstance(err, dsched.AggregateError) else err
    assert isinstance(first, ChunkResultError)
    assert re.search(r"chunk \d+ on (cpu|cuda:0) " + message, str(first)), str(first)


def test_a_later_chunk_with_another_dtype_is_an_error(process_client):
    def flaky_dtype(a):
        return a.astype(np.float32) if a[0, 0] >= 500 else a

    x = np.arange(2000.0).reshape(1000, 2)
    with pytest.raises(ChunkResultError, match=r"dtype float32; expected \(2,\) and float64"):
        dsched.dispatch(flaky_dtype, x, scheduler=dsched.SimpleScheduler("cpu", 100), client=process_client)


def test_failed_chunk_rows_are_nan_and_others_are_kept(process_client):
    def fails_in_the_middle(a):
        if a[0, 0] == 300:
            raise dsched.RecoverableError("no convergence")
        return a * 2

    x = np.arange(1000.0)[:, None].repeat(2, axis=1)
    d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 100, capacity=200),
                              lambda w, dev: fails_in_the_middle(w), join="concat", client=process_client)
    with pytest.raises(dsched.RecoverableError):
        d.run(dsched.ArrayLoader(x))
    output = d.last_run.output
    assert np.isnan(output[300:400]).all()
    np.testing.assert_array_equal(output[:300], x[:300] * 2)
    # Chunks dispatched before the failure was seen finished and were written.
    done = [r for r in d.last_run.records if r.error is None]
    for r in done:
        np.testing.assert_array_equal(output[r.offset:r.offset + r.size], x[r.offset:r.offset + r.size] * 2)


def test_declared_outputs_are_written_in_place_from_the_first_chunk(process_client):
    spec = {"y": ((2,), "f8")}
    d = dsched.WorkDispatcher(hybrid(100), lambda w, dev: {"y": w * 5}, join="concat", client=process_client,
                              output_spec=spec)
    x = np.arange(600.0).reshape(300, 2)
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x))["y"], x * 5)


def test_out_zarr_store(process_client, tmp_path):
    import zarr

    x = np.random.default_rng(1).normal(size=(1000, 3))
    path = tmp_path / "results.zarr"
    out = dsched.dispatch(affine, x, {"b": np.ones((1, 3))}, scheduler=hybrid(128, 256), client=process_client,
                          out=str(path))
    stored = zarr.open_group(str(path), mode="r")
    np.testing.assert_array_equal(stored["y"][:], 2.0 * x + 1.0)
    np.testing.assert_array_equal(stored["n"][:], np.linalg.norm(x, axis=1))
    assert stored["y"].chunks == (128, 3)  # one Zarr chunk per dispatch-chunk boundary: writers never share one
    np.testing.assert_array_equal(out["y"][:], 2.0 * x + 1.0)


def test_out_arrays_are_filled(process_client, hybrid_client):
    x = np.arange(300.0)
    for client in (process_client, hybrid_client):
        target = np.zeros(300)
        result = dsched.dispatch(np.sqrt, x, scheduler=hybrid(64), client=client, out=target)
        assert result is target
        np.testing.assert_array_equal(target, np.sqrt(x))


def test_bad_out_is_refused_before_any_work(tmp_path, hybrid_client):
    calls = []

    def model(a):
        calls.append(1)
        return a

    x = np.ones(10)
    s = dsched.SimpleScheduler("cpu", 5)
    with pytest.raises(ValueError, match=r"out: the folder .*missing of .* does not exist"):
        dsched.dispatch(model, x, scheduler=s, mode="sync", out=str(tmp_path / "missing" / "r.zarr"))
    (tmp_path / "exists.zarr").mkdir()
    with pytest.raises(ValueError, match=r"out: .*exists.zarr already exists \(pass overwrite=True"):
        dsched.dispatch(model, x, scheduler=s, mode="sync", out=str(tmp_path / "exists.zarr"))
    with pytest.raises(ValueError, match=r"out: shape \(9,\) does not hold 10 items along axis 0"):
        dsched.dispatch(model, x, scheduler=s, mode="sync", out=np.zeros(9))
    assert not calls
    with pytest.raises(ChunkResultError, match=r"chunk 0 on cpu returned result with items of shape \(\) and dtype "
                       r"float64; expected \(\) and int64 as out= holds"):
        dsched.dispatch(model, x, scheduler=s, mode="sync", out=np.zeros(10, dtype=np.int64))
    dsched.dispatch(model, x, scheduler=s, mode="sync", out=str(tmp_path / "exists.zarr"), overwrite=True)


def test_no_segment_left_after_failure_and_interrupt(process_client):
    before = shm_entries()
    x = np.ones((1000, 2))

    def boom(a):
        raise RuntimeError("model failed")

    with pytest.raises((RuntimeError, dsched.AggregateError), match="model failed"):
        dsched.dispatch(boom, x, scheduler=hybrid(100), client=process_client)
    assert shm_entries() == before

    def interrupt(record):
        raise KeyboardInterrupt

    d = dsched.WorkDispatcher(hybrid(100), lambda w, dev: w, join="concat", client=process_client,
                              on_chunk_done=interrupt)
    with pytest.raises(KeyboardInterrupt):
        d.run(dsched.ArrayLoader(x))
    assert shm_entries() == before
    # The cluster is still usable afterwards.
    np.testing.assert_array_equal(dsched.dispatch(np.negative, x, scheduler=hybrid(100), client=process_client), -x)


def test_killed_worker_loses_nothing_and_leaves_no_segment():
    """SIGKILL the CPU worker mid-run: its chunks run again on its replacement, outputs complete."""
    from distributed import Client

    before = shm_entries()
    with dsched.LocalHybridCluster(["cpu"], processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            pid = list(client.run(os.getpid).values())[0]
            killed = []

            def kill_once(record):
                if not killed:
                    killed.append(pid)
                    os.kill(pid, signal.SIGKILL)

            def slow_square(w, dev):
                time.sleep(0.05)
                return w ** 2

            x = np.arange(2000.0)
            d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 100, capacity=400), slow_square, join="concat",
                                      client=client, on_chunk_done=kill_once)
            np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), x ** 2)
            assert killed
    del d  # its last run's output (kept for run_failed) holds an output segment until then
    assert shm_entries() == before


def test_killed_client_leaves_no_segment(tmp_path):
    """A client SIGKILLed mid-run: the resource tracker unlinks its segments."""
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import numpy as np
        import dsched
        from distributed import Client

        def slow(a):
            time.sleep(0.2)
            return a

        if __name__ == "__main__":
            with dsched.LocalHybridCluster(["cpu"], processes=True, threads_per_worker=1,
                                           dashboard_address=None) as cluster, Client(cluster) as client:
                def started(record):
                    print("running", flush=True)
                d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 10), lambda w, dev: slow(w),
                                          join="concat", client=client, on_chunk_done=started)
                d.run(dsched.ArrayLoader(np.ones((1000, 4))))
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == b"running"
        assert shm_entries(proc.pid)  # the run's input segment exists while it runs
        os.kill(proc.pid, signal.SIGKILL)  # the client alone, as the OOM killer would
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while shm_entries(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # the tracker notices the dead client and unlinks
        assert not shm_entries(proc.pid)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # its orphaned workers
        except ProcessLookupError:
            pass


SMALL_GRAPH = """
[model]
name = "j2"

[batch]
size = 5000

[scheduler]
type = "SimpleScheduler"
device = "cpu"
batch_size = 1024

[options]
mode = "sync"
"""


def test_dsched_run_output_keeps_the_outputs_on_disk(tmp_path, capsys):
    import zarr

    from dsched.cli import main
    from dsched.models import j2_chunk

    graph = tmp_path / "small.toml"
    graph.write_text(SMALL_GRAPH)
    store = tmp_path / "out.zarr"
    assert main(["run", str(graph), "--no-progress", "--output", str(store)]) == 0
    stored = zarr.open_group(str(store), mode="r")
    expected = j2_chunk(slice(0, 5000))
    assert sorted(name for name, _ in stored.arrays()) == sorted(expected)
    for name, values in expected.items():
        np.testing.assert_array_equal(stored[name][:], values)
    assert stored["tangent"].chunks == (1024, 6, 6)
    # Again without --overwrite: refused before any work, one line, status 2.
    capsys.readouterr()
    assert main(["run", str(graph), "--no-progress", "--output", str(store)]) == 2
    assert capsys.readouterr().err.strip() == (f"dsched: error: --output: {store} already exists "
                                               "(pass overwrite=True, or --overwrite, to replace it)")
    assert main(["run", str(graph), "--no-progress", "--output", str(store), "--overwrite"]) == 0


@pytest.mark.parametrize("argv, line", [
    (["--output", "/nonexistent-folder/out.zarr"],
     "dsched: error: --output: the folder /nonexistent-folder of /nonexistent-folder/out.zarr does not exist"),
    (["--chunk-timeout", "0"], "dsched: error: --chunk-timeout: must be a positive number of seconds, got 0"),
])
def test_dsched_run_data_options_are_checked_first(tmp_path, capsys, argv, line):
    from dsched.cli import main

    graph = tmp_path / "small.toml"
    graph.write_text(SMALL_GRAPH)
    assert main(["run", str(graph), "--no-progress", *argv]) == 2
    assert capsys.readouterr().err.strip() == line


def test_outputs_beyond_a_memory_limit_go_to_disk(tmp_path):
    """A run whose outputs (about 780 MB) exceed the address space the process may grow by goes to disk."""
    graph = tmp_path / "big.toml"
    graph.write_text(SMALL_GRAPH.replace("size = 5000", "size = 2_000_000").replace("1024", "65536"))
    store = tmp_path / "big.zarr"
    code = textwrap.dedent(f"""
        import resource, sys
        from dsched.cli import main
        import numpy, zarr, distributed, dask.array  # imported before the limit is set
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        limit = 500 * 2**20  # far below the run's 780 MB of outputs
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (used + limit, hard))
        sys.exit(main(["run", {str(graph)!r}, "--no-progress", "--output", {str(store)!r}]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    import zarr

    stored = zarr.open_group(str(store), mode="r")
    assert stored["tangent"].shape == (2_000_000, 6, 6)
    assert not np.isnan(stored["stress"][-10:]).any()


def test_segments_of_a_dead_process_are_swept_by_the_next_run(tmp_path, monkeypatch):
    """A client killed together with its resource tracker leaves segments; the next run removes them (a process's
    runs sweep at most every ``SWEEP_INTERVAL`` seconds: this one is the first since that long)."""
    from dsched.dataplane import segments
    from dsched.store import RunStore, sweep_stale_segments

    monkeypatch.setattr(segments, "_last_sweep", [float("-inf")])

    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)
    stale = os.path.join(SHM_DIR, f"dsched-{dead}-{'0' * 24}")
    with open(stale, "wb") as f:
        f.write(b"left behind")
    alive = os.path.join(SHM_DIR, f"dsched-{os.getpid()}-{'1' * 24}")
    with open(alive, "wb") as f:
        f.write(b"mine, in use")
    try:
        with RunStore(shared=True):
            pass
        assert not os.path.exists(stale)
        assert os.path.exists(alive)  # a live process's segments are left alone
        assert sweep_stale_segments() == []
        with open(stale, "wb") as f:  # left again right after: the next run does not list /dev/shm again
            f.write(b"left behind")
        with RunStore(shared=True):
            pass
        assert os.path.exists(stale)
    finally:
        for path in (stale, alive):
            if os.path.exists(path):
                os.unlink(path)


def test_run_failed_fills_a_zarr_output(hybrid_client, tmp_path):
    """Re-running failed chunks writes their rows into the Zarr store of the first run."""
    import zarr

    from test_faults import FAILED_ONCE, fail_once_at_200

    FAILED_ONCE.clear()
    x = np.arange(1000.0)
    path = str(tmp_path / "retry.zarr")
    d = dsched.WorkDispatcher(dsched.SimpleScheduler("cpu", 100), fail_once_at_200, join="concat",
                              client=hybrid_client, out=path)
    with pytest.raises(dsched.RecoverableError):
        d.run(dsched.ArrayLoader(x))
    d.run_failed()
    np.testing.assert_array_equal(zarr.open_array(path + "/data", mode="r")[:], x + 1)


def test_run_graph_refuses_what_the_cli_refuses(tmp_path):
    """Python callers of run_graph get the CLI's checks: a missing GPU, and outputs that cannot fit."""
    from dsched.graph import GraphError, load_graph
    from dsched.job import run_graph

    graph_file = tmp_path / "gpu.toml"
    graph_file.write_text(SMALL_GRAPH.replace('device = "cpu"', 'device = "cuda:7"').replace('mode = "sync"',
                                                                                              'mode = "async"'))
    with pytest.raises(GraphError, match="cuda:7"):
        run_graph(load_graph(str(graph_file)), progress=False)
    huge = tmp_path / "huge.toml"
    huge.write_text(SMALL_GRAPH.replace("size = 5000", "size = 1_000_000_000_000"))
    with pytest.raises(GraphError, match="batch.size"):
        run_graph(load_graph(str(huge)), progress=False)


def test_a_finished_run_leaves_nothing_behind_in_the_client(process_client):
    """No event handler (holding the run and its outputs) outlives a run."""
    import gc
    import weakref

    x = np.ones((1000, 2))
    out = dsched.dispatch(np.negative, x, scheduler=hybrid(100), client=process_client)
    alive = weakref.ref(out)
    assert not [t for t in process_client._event_handlers if str(t).endswith("-chunks")]
    del out
    gc.collect()
    assert alive() is None  # the outputs' shared memory is freed with them


def test_shared_arrays_travel_without_a_copy_and_are_written_in_place(process_client):
    """Inputs made with shared_empty are referenced where they are; an out= in shared memory is written by the
    worker processes directly; no segment of the run's own is made; the array's segment goes with the array."""
    import gc

    x = dsched.shared_copy(np.arange(3000.0).reshape(1000, 3))
    out = dsched.shared_empty((1000, 3))
    own = shm_entries()
    segments_during = []

    d = dsched.WorkDispatcher(hybrid(100, 200), lambda w, dev: w * 2, join="concat", client=process_client,
                              out=out, on_chunk_done=lambda r: segments_during.append(shm_entries()))
    result = d.run(dsched.ArrayLoader(x))
    assert result is out
    np.testing.assert_array_equal(out, np.arange(3000.0).reshape(1000, 3) * 2)
    assert all(entries == own for entries in segments_during)  # nothing copied into a run segment
    assert all(r.worker is not None for r in d.last_run.records)
    # A contiguous slice of a shared array is shared too.
    half = dsched.dispatch(np.negative, x[500:], scheduler=hybrid(100), client=process_client)
    np.testing.assert_array_equal(half, -x[500:])
    del x, out, result, d, half
    gc.collect()
    assert len(shm_entries()) == len(own) - 2  # both arrays' segments unlinked with them


def test_shared_empty_checks_its_dtype():
    with pytest.raises(ValueError, match="dtype: arrays of Python objects cannot be shared, got object"):
        dsched.shared_empty(3, object)


def _into_out(work, device, out=None):
    """A model with NumPy's out= convention: it must be given the chunk's own output rows."""
    assert out is not None and out["y"].flags.writeable and out["y"].shape == work["x"].shape
    np.multiply(work["x"], 2.0, out=out["y"])
    out["n"][:] = 1
    return out


def test_a_model_that_takes_out_computes_straight_into_the_output_rows(process_client):
    from dsched.chunk import takes_out

    assert takes_out(_into_out) and not takes_out(lambda work, device: work) and not takes_out(print)
    x = dsched.shared_copy(np.arange(1000.0))
    out = {"y": dsched.shared_empty(1000), "n": dsched.shared_empty(1000, np.int64)}
    d = dsched.WorkDispatcher(hybrid(100, 200), _into_out, join="concat", client=process_client, out=out)
    result = d.run(dsched.MappingLoader({"x": x}))
    np.testing.assert_array_equal(out["y"], 2.0 * np.arange(1000.0))
    assert (out["n"] == 1).all() and result["y"] is out["y"]
    # J2 computes into given arrays bit for bit as it allocates its own.
    from dsched.bench_data import j2_inputs
    from dsched.models import j2_update

    inputs = j2_inputs(3000)
    reference = j2_update(*inputs)
    rows = {k: np.empty_like(v) for k, v in reference.items()}
    got = j2_update(*inputs, out=rows)
    assert all(got[k] is rows[k] and np.array_equal(got[k], reference[k]) for k in reference)


def test_an_array_found_in_shared_memory_is_not_found_once_its_segment_is_freed():
    """The same array passed call after call is looked up once; freeing its segment forgets where it lay."""
    from dsched.dataplane.segments import free_shared, shared_empty
    from dsched.dataplane.store import find_shared

    array = shared_empty((100, 3), np.float64)
    first = find_shared(array)
    again = find_shared(array)
    assert first is not None and again == first and find_shared(array[10:]).offset == 10 * 3 * 8
    assert free_shared(array)
    assert find_shared(array) is None


def test_a_run_closed_unclean_after_its_outputs_went_back_to_the_pool_leaves_the_pool_sound():
    """Outputs handed out and let go of go back to the pool; a store closed afterwards as unclean (its run
    failed) must not unlink what the pool holds now: the pool's next segment of that size opens by name."""
    import gc

    from dsched.dataplane.store import RunStore

    release_pool()
    store = RunStore(shared=True)
    [(ref, view)] = store.allocate_many([((1000,), np.float64)], handed_out=True)
    token = ref.token
    del view
    gc.collect()  # the arrays are gone: the segment is the pool's
    store.close(clean=False)
    assert os.path.exists(os.path.join(SHM_DIR, token))
    again = RunStore(shared=True)
    [(ref2, view2)] = again.allocate_many([((1000,), np.float64)], handed_out=True)
    assert ref2.token == token  # the pool lent it again, and it is still there to be opened
    assert os.path.exists(os.path.join(SHM_DIR, token))
    again.close(clean=True)
    del view2
    release_pool()
