"""The fast lane: a feed's chunks go from the dispatching thread straight into a private Unix socket that the
feed's own thread reads, and the replies come straight back (dsched.worker.lane, dsched.dispatch.lanes).

On worker processes, against the same runs over Dask's comms (``dsched.fast-lane: false``).
"""

import gc
import os
import stat
import weakref
from multiprocessing.connection import AuthenticationError
from multiprocessing.connection import Client as connect_to

import dask
import numpy as np
import pytest
from distributed import Client

import dsched
from dsched.dispatch import front
from dsched.dispatch.feeds import Feeds
from dsched.dispatch.lanes import Lane
from dsched.worker import lane as wire
from dsched.worker.chunk import PROGRAMS_KEPT, ChunkProgram, ProgramRef


@pytest.fixture(scope="module")
def client():
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                                   dashboard_address=None) as cluster, Client(cluster) as c:
        yield c


def scheduler():
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[100, 300], capacities=[200, 600])


def triple(x):
    return 3.0 * x


def scale(x, factor):
    return factor * x


@pytest.fixture
def sent(monkeypatch):
    """Chunks sent per path: ``lane`` (the fast lane) and ``comms`` (Dask's comms), and each lane message's
    rearm."""
    seen = {"lane": 0, "comms": 0, "rearms": []}
    lane_send, comms_send = Lane.send, Feeds._call_all

    def on_lane(self, message):  # a full run's, a steady run's and a replay's messages alike
        if message[0] == wire.CHUNKS:
            seen["lane"] += len(message[2])
        if message[0] in (wire.CHUNKS, wire.KEEP, wire.AGAIN) and message[1] is not None:
            seen["rearms"].append(message[1][0])  # the program, its ProgramRef, or None where the feed runs it
        return lane_send(self, message)

    def on_comms(self, calls):
        seen["comms"] += len(calls)
        return comms_send(self, calls)

    monkeypatch.setattr(Lane, "send", on_lane)
    monkeypatch.setattr(Feeds, "_call_all", on_comms)
    return seen


def _run(client, x):
    d = dsched.WorkDispatcher(scheduler(), lambda w, dev: triple(w), join="concat", client=client)
    out = d.run(dsched.ArrayLoader(x))
    return out, len(d.last_run.records)


def test_every_chunk_of_a_run_on_worker_processes_travels_on_a_lane(client, sent):
    x = np.arange(4000.0).reshape(2000, 2)
    out, chunks = _run(client, x)
    np.testing.assert_array_equal(out, 3 * x)
    assert (sent["lane"], sent["comms"]) == (chunks, 0)


def test_fast_lane_off_sends_the_same_chunks_over_dasks_comms(client, sent):
    from dsched.dispatch.parking import release_parked

    x = np.arange(2000.0)
    release_parked(client)  # parked feeds keep their lanes: the run gets new feeds, without one
    try:
        with dask.config.set({"dsched.fast-lane": False}):
            out, chunks = _run(client, x)
    finally:
        release_parked(client)
    np.testing.assert_array_equal(out, 3 * x)
    assert (sent["lane"], sent["comms"]) == (0, chunks)


def test_a_failed_chunk_on_a_lane_keeps_the_others_results(client):
    def fragile(x):
        if x[0] <= 300 < x[0] + len(x):
            raise ValueError("the chunk of item 300 failed")
        return x + 1

    x = np.arange(2000.0)
    d = dsched.WorkDispatcher(scheduler(), lambda w, dev: fragile(w), join="concat", client=client)
    with pytest.raises(ValueError, match="the chunk of item 300 failed"):
        d.run(dsched.ArrayLoader(x))
    out = d.last_run.output
    failed = [r for r in d.last_run.records if r.error is not None]
    assert len(failed) == 1 and failed[0].offset <= 300 < failed[0].offset + failed[0].size
    assert np.isnan(out[failed[0].offset:failed[0].offset + failed[0].size]).all()
    done = [r for r in d.last_run.records if r.error is None]
    assert done, "no other chunk ran"
    for r in done:  # every chunk dispatched besides the failed one wrote its rows
        np.testing.assert_array_equal(out[r.offset:r.offset + r.size], x[r.offset:r.offset + r.size] + 1)


async def _lane_of_a_worker(dask_worker=None):
    from dsched.worker.feed import _lane_address

    return await _lane_address()


def test_a_lane_listens_on_a_private_unix_socket_and_refuses_a_wrong_key(client):
    info = client.run(_lane_of_a_worker)
    for address, lane in info.items():
        path = lane["address"]
        directory = os.path.dirname(path)
        assert stat.S_ISSOCK(os.stat(path).st_mode), address
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700 and os.stat(directory).st_uid == os.getuid()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        with pytest.raises(AuthenticationError):
            connect_to(path, family="AF_UNIX", authkey=b"not the worker's key")
        connection = connect_to(path, family="AF_UNIX", authkey=lane["authkey"])  # the right key is let in
        connection.close()


def test_sockets_of_dead_worker_processes_are_swept(tmp_path):
    directory = wire.lane_directory()
    dead = 2 ** 22 + 12345  # above the kernel's default pid_max: no process has it
    stale = os.path.join(directory, f"lane-{dead}-abcdef.sock")
    mine = os.path.join(directory, f"lane-{os.getpid()}-abcdef.sock")
    open(stale, "w").close()
    open(mine, "w").close()
    try:
        assert os.path.basename(stale) in wire.sweep_stale_lanes()
        assert not os.path.exists(stale) and os.path.exists(mine)
    finally:
        for path in (stale, mine):
            if os.path.exists(path):
                os.unlink(path)


def test_like_calls_reuse_one_dispatcher_and_send_its_program_once(client, sent):
    s = scheduler()
    x = np.arange(1000.0)
    np.testing.assert_array_equal(dsched.dispatch(triple, x, scheduler=s, client=client), 3 * x)
    first = len(sent["rearms"])  # the program reached the feeds with the first call (task or rearm)
    for _ in range(2):
        np.testing.assert_array_equal(dsched.dispatch(triple, x, scheduler=s, client=client), 3 * x)
    kept = front._REUSED._local.calls
    assert sum(r.fn is triple and r.scheduler is s for r in kept) == 1
    # The next calls take the same parked feeds, and their rearms name no program: the feeds hold it.
    later = sent["rearms"][first:]
    assert later and all(program is None for program in later)


def test_calls_that_take_turns_between_two_functions_send_each_program_to_a_feed_once(client, sent):
    """A solver whose calls alternate two models (a stress and a tangent) on the same parked feeds: a feed gets
    each program once, and on later turns its rearm names the copy its inbox keeps (ProgramRef)."""
    s = scheduler()
    x = np.arange(1000.0)
    for turn in range(3):
        np.testing.assert_array_equal(dsched.dispatch(triple, x, scheduler=s, client=client), 3 * x)
        np.testing.assert_array_equal(dsched.dispatch(np.negative, x, scheduler=s, client=client), -x)
        if turn == 0:
            first = len(sent["rearms"])
            assert any(isinstance(r, ChunkProgram) for r in sent["rearms"])  # np.negative's, to triple's feeds
    later = sent["rearms"][first:]
    assert later and all(isinstance(r, ProgramRef) for r in later)


def _keep_programs(n):
    import dsched.worker.kept as kept

    kept.PROGRAMS_KEPT = n


def test_a_program_its_feed_no_longer_keeps_sends_the_chunks_to_a_new_feed(client, sent):
    """The client thinks a feed keeps a program its inbox let go of (here the workers keep one, the client PROGRAMS_KEPT):
    the rearm naming it is refused as an ended feed's is, and the run's chunks go to a new feed, results intact."""
    s = scheduler()
    x = np.arange(1000.0)
    client.run(_keep_programs, 1)
    try:
        for _ in range(3):
            np.testing.assert_array_equal(dsched.dispatch(triple, x, scheduler=s, client=client), 3 * x)
            np.testing.assert_array_equal(dsched.dispatch(np.negative, x, scheduler=s, client=client), -x)
    finally:
        client.run(_keep_programs, PROGRAMS_KEPT)
    assert any(isinstance(r, ProgramRef) for r in sent["rearms"])  # named, refused, and every call still right


def test_calls_that_differ_in_a_plain_argument_get_dispatchers_of_their_own(client):
    s = scheduler()
    x = np.arange(1000.0)
    np.testing.assert_array_equal(dsched.dispatch(scale, x, 2.0, scheduler=s, client=client), 2 * x)
    np.testing.assert_array_equal(dsched.dispatch(scale, x, 5.0, scheduler=s, client=client), 5 * x)
    np.testing.assert_array_equal(dsched.dispatch(scale, x, 7.0, scheduler=s, client=client), 7 * x)
    kept = [r for r in front._REUSED._local.calls if r.fn is scale and r.scheduler is s]
    assert sorted(r.skeleton[1] for r in kept) == [2.0, 5.0, 7.0]


def test_a_call_under_another_place_results_setting_gets_a_dispatcher_of_its_own(client):
    import dask

    s = scheduler()
    x = np.arange(1000.0)
    np.testing.assert_array_equal(dsched.dispatch(triple, x, scheduler=s, client=client), 3 * x)
    with dask.config.set({"dsched.place-results": False}):
        np.testing.assert_array_equal(dsched.dispatch(triple, x, scheduler=s, client=client), 3 * x)
    kept = [r for r in front._REUSED._local.calls if r.fn is triple and r.scheduler is s]
    assert sorted(r.dispatcher._program.place_results for r in kept) == [False, True]


def test_a_call_with_an_array_kept_whole_is_not_kept(client):
    s = scheduler()
    x = np.arange(1000.0)
    factor = np.array([2.0])  # size 1 along the axis: passed whole, and not a plain value
    np.testing.assert_array_equal(dsched.dispatch(scale, x, factor=factor, scheduler=s, client=client), 2 * x)
    assert not any(r.scheduler is s for r in front._REUSED._local.calls)


def test_a_kept_dispatcher_holds_neither_the_callers_inputs_nor_its_outputs(client):
    s = scheduler()
    x = np.arange(1000.0)
    dsched.dispatch(triple, x, scheduler=s, client=client)
    x2 = np.arange(1000.0)
    inputs = weakref.ref(x2)
    out = dsched.dispatch(triple, x2, scheduler=s, client=client)
    outputs = weakref.ref(out)
    del x2, out
    gc.collect()
    assert inputs() is None and outputs() is None


def _item_count(work, device):
    return work.stop - work.start


def test_thousands_of_chunks_in_flight_on_one_lane_neither_side_blocks(client):
    """Room for every chunk at once: the lane's window keeps the descriptors going out and the replies coming
    back from filling its socket while the other side waits on it."""
    from dsched import SimpleScheduler, SliceGenerator

    total = 3000
    d = dsched.WorkDispatcher(SimpleScheduler("cpu", 1, capacity=total), _item_count, client=client)
    assert d.run(SliceGenerator(0, total)) == [1] * total


def test_a_thread_s_run_keeps_one_bell_for_its_next_and_an_ended_thread_s_is_closed():
    import threading

    from dsched.dispatch import completion

    def one_run():
        completion.Mailbox().close()

    threads = [threading.Thread(target=one_run) for _ in range(5)]
    for thread in threads:
        thread.start()
        thread.join()
    completion.Mailbox().close()  # this thread's run: the ended threads' bells go
    alive = {t.ident for t in threading.enumerate()}
    assert set(completion._idle_bells) <= alive and threading.get_ident() in completion._idle_bells


def _sevens(work, device):
    return np.full(work.stop - work.start, 7.0)


def _first_fails(work, device):
    if work.start == 0:
        raise ValueError("the first chunk failed")
    import time

    time.sleep(0.3)  # the failure is heard first, before any result gave the outputs' layout
    return np.full(work.stop - work.start, 1.0)


def test_a_chunk_failed_before_the_outputs_existed_has_nan_rows_not_a_past_calls_values(client):
    from dsched import SliceGenerator, StaticHybridScheduler

    s = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=100)
    out = dsched.WorkDispatcher(s, _sevens, join="concat", client=client).run(SliceGenerator(0, 200))
    assert (out == 7.0).all()
    del out  # its segment goes back to the pool: the next call of this size gets it, sevens and all
    gc.collect()
    d = dsched.WorkDispatcher(s, _first_fails, join="concat", client=client)
    with pytest.raises(ValueError, match="the first chunk failed"):
        d.run(SliceGenerator(0, 200))
    output = d.last_run.output
    assert np.isnan(output[:100]).all() and (output[100:] == 1.0).all()


@pytest.mark.timeout(30)  # a look that waited out its 60 s with a message there fails here
def test_look_returns_what_is_ready_and_nothing_once_its_time_is_up():
    """Both ends of a lane look before they sleep (dsched.lane-spin, dsched.feed-spin): a message already there is
    found at once, and a look that finds nothing gives up instead of sleeping."""
    import select

    from dsched.worker.lane import look

    read, write = os.pipe()
    try:
        poller = select.poll()
        poller.register(read, select.POLLIN)
        assert look(poller, 0.001) == []
        os.write(write, b"x")
        assert look(poller, 60.0) == [(read, select.POLLIN)]
    finally:
        os.close(read)
        os.close(write)


def scheduling_policy(x):
    """Each item: the scheduling policy of the thread that ran its chunk."""
    return np.full(x.shape, os.sched_getscheduler(0))


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_feed_threads_run_under_sched_batch_so_a_woken_one_leaves_the_caller_its_core(client):
    """A feed's thread, woken by its lane's message, must not preempt the dispatching thread before it has sent
    the other devices' chunks (dsched.worker.wakeups): on the workers its policy is SCHED_BATCH."""
    policies = dsched.dispatch(scheduling_policy, np.zeros(400), scheduler=scheduler(), client=client)
    assert set(policies.tolist()) == {os.SCHED_BATCH}


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
def test_a_feed_gives_its_pool_thread_back_under_the_policy_it_found(client):
    """The feeds' threads are their workers' pool threads: once the feeds end, the next task on the same
    (single) thread of each device worker runs under the policy the thread had before."""
    from dsched.devices.device import device_resource
    from dsched.dispatch.parking import release_parked

    dsched.dispatch(scheduling_policy, np.zeros(400), scheduler=scheduler(), client=client)
    release_parked(client)  # the parked feeds end: their tasks give back the device each holds
    after = [client.submit(os.sched_getscheduler, 0, resources={device_resource(device): 1}, pure=False)
             for device in ("cpu", "cuda:0")]  # each waits for its worker's one thread, freed as the feed ends
    assert client.gather(after) == [os.SCHED_OTHER, os.SCHED_OTHER]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.parametrize("on", [True, False])
def test_yield_on_wake_follows_its_setting(on):
    import threading

    from dsched.worker.wakeups import restore_policy, yield_on_wake

    seen = []

    def run():
        previous = yield_on_wake()
        seen.append(os.sched_getscheduler(0))
        restore_policy(previous)
        seen.append(os.sched_getscheduler(0))

    with dask.config.set({"dsched.yield-on-wake": on}):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert seen == [os.SCHED_BATCH if on else os.SCHED_OTHER, os.SCHED_OTHER]


@pytest.mark.parametrize("size", [10, 100_000, 8 << 20])
def test_a_send_the_socket_cannot_take_reads_the_replies_coming_the_other_way(size):
    """Each end writing a message larger than the socket holds before it reads: a worker blocked on its reply
    reads nothing, so a client blocked on its send would wait for ever. The client's send reads the reply
    meanwhile and the next receive returns it; the worker reads the message whole (its framing)."""
    import threading
    from multiprocessing import Pipe

    ours, theirs = Pipe()
    lane, payload = Lane(ours), b"x" * size
    reply = ("done", 0, True, b"r" * (8 << 20), 0.0, 1.0)
    read_by_worker, sent = [], []

    def worker():
        theirs.send_bytes(wire.dumps(reply))  # blocks until the client reads it
        read_by_worker.append(wire.loads(theirs.recv_bytes()))

    worker_thread = threading.Thread(target=worker, daemon=True)
    sender = threading.Thread(target=lambda: sent.append(lane.send(("chunks", None, payload))), daemon=True)
    worker_thread.start()
    sender.start()
    sender.join(60)
    assert not sender.is_alive() and sent == [True]
    assert lane.receive() == reply  # read during the send, or (a message the socket took at once) now
    worker_thread.join(60)
    assert not worker_thread.is_alive() and read_by_worker == [("chunks", None, payload)]
    lane.close()
    theirs.close()
