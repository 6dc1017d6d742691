"""A resident batch in host memory (``Batch(memory="host")``) on worker processes: what its backend adds.

Each field is one array in shared memory that the workers map, and each update one run over the batch's own
chunks (the plan's), on a dispatcher the batch keeps per update program. Here: results equal the task engine's bit for bit on exactly the plan's chunks;
a failed chunk keeps its rows while the chunks after it still run; a worker killed mid-update has its chunks run
again; ``/dev/shm`` flat over many steps; every segment unlinked at close, after an exception and after a Ctrl-C;
where host memory cannot be chosen. What both backends promise is in ``tests/test_batch.py``.

``cuda:0`` is emulated (a CPU process claiming the device): nothing here measures a GPU.
"""

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import CancelledError

import numpy as np
import pytest

import dsched
from dsched import Batch, StaticHybridScheduler
from dsched.apps.bench.batch import final_strain, j2_load_step, run_batch
from dsched.dataplane.segments import POOL, release_pool
from dsched.dataplane.store import find_shared
from dsched.devices.device import Device
from dsched.names import EMULATED_RESOURCE
from dsched.resident.batch import _memory_for


def hybrid(small=10, large=20):
    return StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[small, large], priorities=[1, 2])


def _segments():
    """This process's segments in /dev/shm."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(f"dsched-{os.getpid()}-")}


def _shm_bytes():
    return sum(os.path.getsize(os.path.join("/dev/shm", name)) for name in _segments())


def _where(x):
    """Each item's chunk size and device (0: cpu, 1: cuda:0), as the chunk's function sees them."""
    return {"size": np.full(len(x), len(x)), "device": np.full(len(x), int(dsched.current_device().is_cuda))}


def test_results_equal_the_task_engines_bit_for_bit_on_the_plans_chunks(process_client):
    strain = final_strain(170) * 3.0  # most points yield: the state carried matters
    scheduler = hybrid()
    results = {memory: run_batch(process_client, scheduler, strain, 4, tangent=True, memory=memory)
               for memory in ("host", "device")}
    for field in results["device"]:
        np.testing.assert_array_equal(results["host"][field], results["device"][field], err_msg=field)
    planned = dsched.plan(170, scheduler)
    sizes = np.concatenate([np.full(size, size) for _, size in planned])
    devices = np.concatenate([np.full(size, int(device.is_cuda)) for device, size in planned])
    with Batch({"x": np.zeros(170)}, scheduler, client=process_client, memory="host") as batch:
        assert [(c.device, c.size) for c in batch.chunks] == planned and len(planned) > 5
        batch.update(_where, reads=["x"], outputs=["size", "device"])
        for _ in range(3):  # the fields exist now: the chunks write in place, the same chunks each time
            batch.update(_where, reads=["x"], writes=["size", "device"])
            np.testing.assert_array_equal(batch.get("size"), sizes)
            np.testing.assert_array_equal(batch.get("device"), devices)


def _fail_at(x, *, start, add):
    if x[0] == start:  # x holds each item's index: the chunk that starts there fails
        raise ValueError(f"chunk at {start} fails")
    return {"y": x + add}


def _fail_in_place(x, y, *, start):
    y += 100.0  # in place: the chunk's own copy of its rows
    if x[0] == start:
        raise ValueError(f"chunk at {start} fails")
    return {"y": y}


def test_a_failed_chunk_keeps_its_rows_and_the_chunks_after_it_still_run(process_client):
    n = 100
    scheduler = hybrid(5, 10)  # 13 chunks: a failure stops a run's dispatching long before its last chunk
    with Batch({"x": np.arange(float(n)), "y": np.zeros(n)}, scheduler, client=process_client,
               memory="host") as batch:
        failing = batch.chunks[1]
        # Raised once (the chunk did not run again with the chunks after it), noting the batch's chunk.
        message = re.escape(f"chunk at {failing.start} fails\ndsched: update '_fail_at' failed on {failing}")
        with pytest.raises(ValueError, match=f"^{message}$"):
            batch.update(_fail_at, reads=["x"], writes=["y"], kwargs={"start": failing.start, "add": 1.0}).wait()
        expected = np.arange(float(n)) + 1
        expected[failing.start:failing.stop] = 0.0  # its previous values
        np.testing.assert_array_equal(batch.get("y"), expected)
        # In place: fn changed its chunk's copy, so the failed chunk's rows keep their values here too.
        update = batch.update(_fail_in_place, reads=["x", "y"], writes=["y"], inplace=True,
                              kwargs={"start": failing.start})
        with pytest.raises(ValueError, match=f"^chunk at {failing.start} fails\n"):
            batch.wait()  # the failure is raised once, by the first wait, get or reduce that meets it
        batch.wait()
        with pytest.raises(ValueError, match=f"^chunk at {failing.start} fails\n"):
            update.wait()  # its own handle raises it whenever asked
        expected[:failing.start] += 100.0
        expected[failing.stop:] += 100.0
        np.testing.assert_array_equal(batch.get("y"), expected)


def _held_on_cuda(x, *, started):
    """On cuda:0, the first time: say so in a file and hang (the test kills the worker); afterwards, compute."""
    if dsched.current_device().is_cuda and not os.path.exists(started):
        with open(started, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    return {"x": x + 1}


def test_a_worker_killed_mid_update_has_its_chunks_run_again(process_client, tmp_path):
    started = str(tmp_path / "started")
    n = 60
    with Batch({"x": np.arange(float(n))}, hybrid(), client=process_client, memory="host") as batch:
        batch.update(_held_on_cuda, reads=["x"], writes=["x"], kwargs={"started": started})
        update = batch.update(_held_on_cuda, reads=["x"], writes=["x"], kwargs={"started": started})
        deadline = time.monotonic() + 60
        while not os.path.exists(started) or not open(started).read():  # the first update's chunk is held
            assert time.monotonic() < deadline, "the cuda:0 chunk never started"
            time.sleep(0.01)
        pid = int(open(started).read())
        os.kill(pid, signal.SIGKILL)  # mid-update: its chunk runs again on the restarted worker
        update.wait()
        np.testing.assert_array_equal(batch.get("x"), np.arange(float(n)) + 2)  # each update once, no more
        owner = dsched.ownership.device_owners(process_client, ["cuda:0"])[Device("cuda:0")][0]
        assert process_client.run(os.getpid, workers=[owner])[owner] != pid


def _held_until(x, *, go):
    """Holds its chunk until the test creates the file ``go`` (so that the next update waits behind it)."""
    deadline = time.monotonic() + 60
    while not os.path.exists(go):
        assert time.monotonic() < deadline, "never told to go"
        time.sleep(0.005)
    return {"x": x}


def _add_load(x, load):
    return {"x": x + load}


def test_an_updates_inputs_are_read_as_they_were_when_it_was_pushed(process_client, tmp_path):
    go = str(tmp_path / "go")
    with Batch({"x": np.zeros(30)}, hybrid(), client=process_client, memory="host") as batch:
        batch.update(_held_until, reads=["x"], writes=["x"], kwargs={"go": go})
        load = np.ones(30)
        added = batch.update(_add_load, reads=["x"], writes=["x"], inputs={"load": load})
        load[:] = 7.0  # the caller's array changes before the update runs: the update read it when pushed
        assert not added.done()
        open(go, "w").close()
        np.testing.assert_array_equal(batch.get("x"), np.ones(30))


def _step(x, strain):
    return {"x": x + strain}


def test_dev_shm_stays_flat_over_updates_gets_and_sets(process_client):
    n = 5000
    with Batch({"x": np.zeros((n, 6))}, hybrid(1000, 2000), client=process_client, memory="host") as batch:
        batch.set("strain", np.zeros((n, 6)))
        batch.update(_step, reads=["x", "strain"], writes=["x"])
        batch.get("x")
        before = _shm_bytes()
        for step in range(200):
            batch.set("strain", np.full((n, 6), 1.0))
            batch.update(_step, reads=["x", "strain"], writes=["x"])
            if step % 10 == 0:
                batch.get("x")
        np.testing.assert_array_equal(batch.get("x"), np.full((n, 6), 200.0))
        assert _shm_bytes() == before


def test_every_segment_goes_back_to_the_pool_at_close_and_after_an_exception(process_client):
    release_pool()  # segments kept from other calls are not the batch's
    before = _segments()
    batch = Batch({"x": np.arange(40.0)}, hybrid(), client=process_client, memory="host")
    batch.update(lambda x: {"x": x + 1, "y": 2 * x}, reads=["x"], writes=["x"], outputs=["y"])  # a new field
    batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])
    batch.set("z", np.ones((40, 3)))
    np.testing.assert_array_equal(batch.get("x"), np.arange(40.0) + 2)
    made = _segments() - before
    assert len(made) >= 5  # x (two arrays), y, z, and each item's chunk
    rows = find_shared(batch._backend._rows).token
    batch.close()
    pooled = _segments() - before
    assert pooled <= made and made - pooled <= {rows}  # kept for the next batch, but the rows the batch holds
    assert POOL.held() > 0
    with pytest.raises(RuntimeError, match="this Batch is closed"):
        batch.get("x")
    del batch
    release_pool()
    assert _segments() - before == set()
    with pytest.raises(ZeroDivisionError):
        with Batch({"x": np.arange(40.0)}, hybrid(), client=process_client, memory="host") as batch:
            batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"])
            1 / 0
    del batch
    release_pool()
    assert _segments() - before == set()


def test_a_new_batch_reuses_the_segments_a_closed_one_gave_back(process_client):
    """A driver per history: the second batch's fields lie in the first one's segments (no new pages to fault)."""
    release_pool()
    with Batch({"x": np.arange(40.0)}, hybrid(), client=process_client, memory="host") as batch:
        batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"]).wait()
        first = _segments()
    del batch  # (it holds each item's chunk)
    with Batch({"x": np.arange(40.0)}, hybrid(), client=process_client, memory="host") as batch:
        batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"]).wait()
        assert _segments() == first
        np.testing.assert_array_equal(batch.get("x"), np.arange(40.0) + 1)


_CTRL_C_CLIENT = """
    import os, sys, threading, time
    import numpy as np
    from distributed import Client
    import dsched

    def hang(x):
        if x[0] >= 20:
            sys.stdout.write("HANG\\n")  # one write each: the workers share the client's stdout
            sys.stdout.flush()
            threading.Event().wait(600)
        return {"x": x + 1}

    if __name__ == "__main__":
        scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=10)
        with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                       dashboard_address=None) as cluster, Client(cluster) as client:
            try:
                with dsched.Batch({"x": np.arange(40.0)}, scheduler, client=client, memory="host") as batch:
                    batch.update(hang, reads=["x"], writes=["x"])
                    batch.get("x")
            except KeyboardInterrupt:
                left = [n for n in os.listdir("/dev/shm") if n.startswith(f"dsched-{os.getpid()}-")]
                sys.stdout.write(f"LEFT {left}\\n")
                sys.stdout.flush()
"""


def test_ctrl_c_while_waiting_leaves_no_segment_and_ends_at_once(tmp_path):
    script = tmp_path / "ctrl_c_client.py"
    script.write_text(textwrap.dedent(_CTRL_C_CLIENT))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, cwd=tmp_path)
    try:
        for line in child.stdout:
            if line.startswith("HANG"):
                break
        else:
            pytest.fail("the client ended before its update hung")
        child.send_signal(signal.SIGINT)
        start = time.monotonic()
        rest = child.stdout.read()
        child.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        child.kill()
    assert "LEFT []" in rest, rest
    assert took < 15, f"the process ended {took:.1f} s after the Ctrl-C"


def test_memory_host_is_refused_where_a_device_is_a_real_gpu():
    """Where it cannot work, host memory is a one-line error naming the field (the choice itself, from what the
    cluster's workers say of their devices: a real GPU here needs no GPU)."""
    cpu, gpu = Device("cpu"), Device("cuda:0")
    owners = {cpu: ["tcp://a"], gpu: ["tcp://b"]}
    real = {"tcp://a": {"resources": {"dsched-cpu": 10}}, "tcp://b": {"resources": {"dsched-cuda:0": 10}}}
    emulated = {**real, "tcp://b": {"resources": {"dsched-cuda:0": 10, EMULATED_RESOURCE: 1}}}
    assert _memory_for("auto", [cpu, gpu], owners, emulated) == "host"
    assert _memory_for("auto", [cpu, gpu], owners, real) == "device"
    assert _memory_for("device", [cpu, gpu], owners, emulated) == "device"
    with pytest.raises(ValueError, match=r"^memory: 'host' keeps the fields in this host's memory, but cuda:0 is a "
                                         r"real GPU, whose chunks keep their fields in its memory \(memory='device', "
                                         r"or 'auto'\)$"):
        _memory_for("host", [cpu, gpu], owners, real)


def test_an_out_array_that_workers_cannot_write_is_refused_before_any_work(process_client):
    with Batch({"x": np.zeros(30)}, hybrid(), client=process_client, memory="host") as batch:
        with pytest.raises(ValueError, match=r"^out\['y'\]: worker processes write only into shared memory"):
            batch.update(lambda x, y: {"x": x}, reads=["x"], writes=["x"], out={"y": np.zeros(30)})
        with pytest.raises(ValueError, match=r"^out\['y'\]: shape \(29,\) has no 30 items along axis 0$"):
            batch.update(lambda x, y: {"x": x}, reads=["x"], writes=["x"], out={"y": dsched.shared_empty(29)})
        np.testing.assert_array_equal(batch.get("x"), np.zeros(30))


def test_load_steps_equal_numpy_when_a_step_is_a_new_function(process_client):
    """j2_load_step with a new factor every step: a new program each update, the same results."""
    strain = final_strain(80) * 2.0
    with Batch({"s": strain, "p": np.zeros_like(strain), "a": np.zeros(80)}, hybrid(), client=process_client,
               memory="host") as batch:
        state = {"plastic_strain": np.zeros_like(strain), "alpha": np.zeros(80)}
        for step in range(3):
            factor = (step + 1) / 3
            batch.update(lambda s, p, a, factor=factor: _renamed(j2_load_step(s, p, a, factor=factor)),
                         reads=["s", "p", "a"], writes=["p", "a"])
            state = j2_load_step(strain, state["plastic_strain"], state["alpha"], factor=factor)
        np.testing.assert_array_equal(batch.get("p"), state["plastic_strain"])
        np.testing.assert_array_equal(batch.get("a"), state["alpha"])


def _plus_one(x):
    return {"x": x + 1.0}


def test_like_updates_run_on_the_batchs_own_dispatcher_and_replay_from_the_third_step(process_client, monkeypatch):
    """A solver's step: the update's program and its dispatcher are kept by the batch (dispatch() is not called),
    the second step leaves a replay plan and every later one replays it, the fields swapping between two arrays."""
    from chunk_models import runs_taking
    from dsched.dispatch import replay
    from dsched.resident import host_batch

    def no_dispatch(*args, **kwargs):
        raise AssertionError("a like update went through dispatch()")

    replays = runs_taking(monkeypatch, replay.ReplayRun)
    with Batch({"x": np.zeros(30)}, hybrid(), client=process_client, memory="host") as batch:
        batch.update(_plus_one, reads=["x"], writes=["x"]).wait()
        monkeypatch.setattr(host_batch, "dispatch", no_dispatch)
        for _ in range(5):
            batch.update(_plus_one, reads=["x"], writes=["x"])
            batch.get("x")
        np.testing.assert_array_equal(batch.get("x"), np.full(30, 6.0))
        [runner] = batch._backend._runners.values()
        assert len(replays) == 4  # steps 3 to 6
        planned, start = [], 0
        for device, size in dsched.plan(30, hybrid()):
            planned, start = planned + [(str(device), start, size)], start + size
        assert [(str(r.device), r.offset, r.size) for r in replays[-1].report.records] == planned
    assert not batch._backend._runners and runner.dispatcher._steady_paths == {}  # closed with the batch


def _renamed(out):
    return {"p": out["plastic_strain"], "a": out["alpha"]}


def _into_rows(x, y, total):
    """An update that writes its out= rows (``total``) and changes ``y`` in place; returns whether each array it
    got owns its memory (a private copy) or is a view (the batch's rows themselves)."""
    total[:] = x + y
    y += 1.0
    return {"y": y, "copies": np.full(len(x), 2 * total.flags.owndata + y.flags.owndata, dtype=np.int8)}


def test_an_update_in_place_gets_its_out_rows_and_spare_rows_without_a_copy(process_client):
    n = 30
    total = dsched.shared_empty(n)
    with Batch({"x": np.arange(float(n)), "y": np.zeros(n), "copies": np.full(n, -1, np.int8)}, hybrid(),
               client=process_client, memory="host") as batch:
        for step in range(3):
            batch.update(_into_rows, reads=["x", "y"], writes=["y", "copies"], inplace=True,
                         out={"total": total}).wait()
            np.testing.assert_array_equal(total, np.arange(float(n)) + step)
        np.testing.assert_array_equal(batch.get("y"), np.full(n, 3.0))
        # Neither the out= rows nor the field changed in place were copies of the chunk's own.
        np.testing.assert_array_equal(batch.get("copies"), np.zeros(n, np.int8))


def _make_z(x, *, name="z", wrong=False, fail_at=None):
    if fail_at is not None and x[0] == fail_at:
        raise ValueError(f"chunk at {fail_at} fails")
    return {name: np.stack([x, 2 * x], axis=1).astype(np.float32 if wrong else np.float64)}


def test_declared_layouts_make_new_fields_in_place_and_a_failed_chunk_makes_none(process_client, monkeypatch):
    n = 30
    with Batch({"x": np.arange(float(n))}, hybrid(), client=process_client, memory="host") as batch:
        learned = []
        learn = batch._backend._run_learning
        monkeypatch.setattr(batch._backend, "_run_learning", lambda *a: learned.append(a) or learn(*a))
        batch.update(_make_z, reads=["x"], outputs=["z"], layouts={"z": ((2,), "f8")}).wait()
        assert learned == []  # allocated first, written in place
        np.testing.assert_array_equal(batch.get("z"), np.stack([np.arange(n), 2 * np.arange(n)], axis=1))
        # Declared wrong: learned after all, with the layout the chunks gave.
        batch.update(_make_z, reads=["x"], outputs=["w"], layouts={"w": ((3,), "f8")},
                     kwargs={"name": "w", "wrong": True}).wait()
        assert len(learned) == 1 and batch.get("w").dtype == np.float32
        # A chunk that fails: the new field is made by none.
        failing = batch.chunks[1]
        with pytest.raises(ValueError, match=f"^chunk at {failing.start}.0 fails"):
            batch.update(_make_z, reads=["x"], outputs=["v"], layouts={"v": ((2,), "f8")},
                         kwargs={"name": "v", "fail_at": float(failing.start)}).wait()
        assert "v" not in batch.fields
        with pytest.raises(ValueError, match="no field 'v'"):
            batch.get("v")


@pytest.mark.parametrize("layouts, message", [
    ({"q": ((2,), "f8")}, "layouts: 'q' is not a field this update writes (it writes ['z'])"),
    ({"z": (2, "f8")}, "layouts['z']: expected (item shape, dtype) such as ((6,), 'f8'), got (2, 'f8')"),
    ({"z": ((2,), "no-such-type")}, "layouts['z']: expected (item shape, dtype) such as ((6,), 'f8'), got "
                                    "((2,), 'no-such-type')"),
    ([("z", ((2,), "f8"))], "layouts: expected a dict of field -> (item shape, dtype), got list"),
])
def test_declared_layouts_errors_name_the_entry(process_client, layouts, message):
    with Batch({"x": np.arange(4.0)}, hybrid(2, 2), client=process_client, memory="host") as batch:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            batch.update(_make_z, reads=["x"], outputs=["z"], layouts=layouts)


def _held(x, *, started, gate):
    """Says it started (a file), then waits for the test to open ``gate`` (a file) before it returns."""
    open(started, "a").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.002)
    return {"x": x + 1}


def test_the_arrays_a_cancelled_update_writes_into_never_go_back_to_the_pool(process_client, tmp_path):
    """Its chunks may still write there: unlinked at once, so no later array can take their segment."""
    started, gate = str(tmp_path / "started"), str(tmp_path / "gate")
    batch = Batch({"x": np.zeros(30)}, hybrid(), client=process_client, memory="host")
    try:
        batch.update(lambda x: {"x": x + 1}, reads=["x"], writes=["x"]).wait()
        spare = find_shared(batch._backend._fields["x"].spare).token  # what the next update writes into
        update = batch.update(_held, reads=["x"], writes=["x"], kwargs={"started": started, "gate": gate})
        deadline = time.monotonic() + 30
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.002)
        assert os.path.exists(started)
        batch._backend._jobs[-1].cancel()  # as a Ctrl-C while waiting for the batch does
        with pytest.raises(CancelledError):
            update.wait()
        gc.collect()  # whatever still held the array it wrote into has let go of it
        assert spare not in _segments()  # unlinked, not kept for the next array of its size
        np.testing.assert_array_equal(batch.get("x"), np.ones(30))  # the cancelled update changed nothing
    finally:
        open(gate, "w").close()
        batch.close()


def test_close_unlinks_a_segment_whose_array_something_still_holds(process_client):
    """Not kept in the pool: an array still referenced (an error's traceback may hold a field) would share its
    memory with the next batch's. Its values stay readable here."""
    release_pool()
    batch = Batch({"x": np.arange(30.0)}, hybrid(), client=process_client, memory="host")
    held = batch._backend._fields["x"].current  # as a traceback's frame holds it
    token = find_shared(held).token
    batch.close()
    assert token not in _segments()
    np.testing.assert_array_equal(held, np.arange(30.0))
