"""Device feeds: one task per device thread and run, each chunk a direct message to its worker.

On worker processes (what users with GPUs and every multi-node user run) and
in-process, against the per-chunk tasks of ``dsched.feeds: false``.
"""

import collections
import os
import queue
import time

import dask
import numpy as np
import pytest
from distributed.diagnostics.plugin import SchedulerPlugin

import dsched
from dsched import SliceGenerator
from dsched.names import is_feed_key
from dsched.worker.chunk import PROGRAMS_KEPT, ChunkProgram, ProgramRef
from dsched.worker.feed import _Inbox, _failure


class KeysSeen(SchedulerPlugin):
    """Every task key the scheduler was given."""

    name = "test-keys-seen"

    def __init__(self):
        self.keys = []

    def start(self, scheduler):
        self.scheduler = scheduler

    def update_graph(self, scheduler, *, keys, **kwargs):
        self.keys.extend(str(k) for k in keys)


def _keys_seen(dask_scheduler=None):
    return list(dask_scheduler.plugins["test-keys-seen"].keys)


def _forget_keys(dask_scheduler=None):
    dask_scheduler.plugins["test-keys-seen"].keys.clear()


@pytest.fixture(scope="module")
def client(process_client):
    process_client.register_plugin(KeysSeen())
    return process_client


def j2_like(work, device):
    x = work["x"]
    return {"y": 2.0 * x, "n": np.full(x.shape[0], 1, dtype=np.int64)}


def scheduler(batch=100):
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=batch, capacities=2 * batch)


def test_a_run_on_worker_processes_is_one_feed_task_per_device_thread(client):
    client.run_on_scheduler(_forget_keys)
    x = np.arange(1000.0)
    d = dsched.WorkDispatcher(scheduler(), j2_like, join="concat", client=client)
    out = d.run(dsched.MappingLoader({"x": x}))
    np.testing.assert_array_equal(out["y"], 2 * x)
    np.testing.assert_array_equal(out["n"], np.ones(1000, dtype=np.int64))
    keys = client.run_on_scheduler(_keys_seen)
    # Ten chunks, two single-thread device workers: two tasks in all, both feeds.
    assert len(keys) == 2 and all(is_feed_key(k) for k in keys), keys
    records = d.last_run.records
    assert [r.offset for r in records] == list(range(0, 1000, 100))
    assert {str(r.device) for r in records} == {"cpu", "cuda:0"}
    assert all(r.worker.startswith("tcp://") and r.stop >= r.start > 0 for r in records)


def test_feeds_off_sends_a_task_per_chunk(client):
    client.run_on_scheduler(_forget_keys)
    x = np.arange(1000.0)
    with dask.config.set({"dsched.feeds": False, "dsched.batched-submission": False}):
        out = dsched.dispatch(lambda a: 2 * a, x, scheduler=scheduler(), client=client)
    np.testing.assert_array_equal(out, 2 * x)
    keys = client.run_on_scheduler(_keys_seen)
    assert len(keys) == 10 and not any(is_feed_key(k) for k in keys), keys


def test_a_run_with_a_timeout_sends_tasks_that_dask_can_cancel(client):
    client.run_on_scheduler(_forget_keys)
    x = np.arange(400.0)
    out = dsched.dispatch(lambda a: a + 1, x, scheduler=scheduler(), client=client, timeout=60)
    np.testing.assert_array_equal(out, x + 1)
    assert not any(is_feed_key(k) for k in client.run_on_scheduler(_keys_seen))


def fails_once_at_300(marker):
    def run(work, device):
        if work["x"][0] == 300 and not os.path.exists(marker):
            open(marker, "w").close()
            raise dsched.RecoverableError("no convergence at 300")
        return {"y": work["x"] * 2}
    return run


def test_a_failed_chunk_on_a_feed_keeps_the_others_results(client, tmp_path):
    x = np.arange(1000.0)
    d = dsched.WorkDispatcher(scheduler(), fails_once_at_300(str(tmp_path / "failed")), join="concat",
                              client=client, output_spec={"y": ((), "f8")})
    with pytest.raises(dsched.RecoverableError, match="no convergence at 300"):
        d.run(dsched.MappingLoader({"x": x}))
    y = d.last_run.output["y"]
    assert np.isnan(y[300:400]).all()
    done = [r for r in d.last_run.records if r.error is None]
    assert len(done) >= 3  # the chunks before it, and those in flight with it (scheduling stops at a failure)
    for r in done:
        np.testing.assert_array_equal(y[r.offset:r.offset + r.size], 2 * x[r.offset:r.offset + r.size])
    # And only what was left undone runs again.
    out = d.run_failed()
    np.testing.assert_array_equal(out["y"], 2 * x)


def exits_once(marker):
    def run(work):
        if str(dsched.current_device()) == "cuda:0" and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)  # the worker process dies with the chunk (and its feed) on it
        return work * 3
    return run


def test_a_chunk_whose_worker_died_runs_again_as_a_task(client, tmp_path):
    x = np.arange(1000.0)
    with dask.config.set({"dsched.lost-device-timeout": 60}):
        out = dsched.dispatch(exits_once(str(tmp_path / "died")), x, scheduler=scheduler(), client=client)
    np.testing.assert_array_equal(out, 3 * x)
    assert (tmp_path / "died").exists()
    client.wait_for_workers(2, timeout=60)


def test_a_cancelled_feed_gives_its_thread_back(client):
    from dsched.chunk import ChunkProgram
    from dsched.devices import Device
    from dsched.feed import run_feed

    [cpu_worker] = [a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
                    if "dsched-cpu" in w["resources"]]
    program = ChunkProgram("test-cancelled-feed", lambda w, d: w)
    feed = client.submit(run_feed, program, Device("cpu"), "test-cancel-feed-0", key="test-cancel-feed-0",
                         workers=[cpu_worker], pure=False)
    deadline = time.monotonic() + 30
    while client.run(lambda dask_worker: len(dask_worker.state.executing), workers=[cpu_worker])[cpu_worker] == 0:
        assert time.monotonic() < deadline, "the feed never started"
        time.sleep(0.05)
    feed.cancel()
    # The worker has one thread: this runs only once the feed has noticed and returned.
    assert client.submit(lambda: 42, workers=[cpu_worker], pure=False).result(timeout=30) == 42


def test_a_closed_inbox_refuses_chunks_and_fails_those_still_waiting():
    import asyncio

    async def check():
        loop = asyncio.get_running_loop()
        inbox = _Inbox()
        waiting = loop.create_future()
        assert inbox.put_many([(0, None, None, None, loop, waiting)])
        inbox.close(RuntimeError("feed f has ended"))
        assert not inbox.put_many([(1, None, None, None, loop, loop.create_future())])
        reply = await asyncio.wait_for(waiting, 10)
        assert reply["ok"] is False and str(reply["value"].data) == "feed f has ended"
        with pytest.raises(queue.Empty):
            inbox.queue.get_nowait()

    asyncio.run(check())
    assert _failure(ValueError("x"))["ok"] is False


def test_in_process_workers_use_feeds_too(hybrid_client):
    x = np.arange(777.0)
    d = dsched.WorkDispatcher(scheduler(), j2_like, join="concat", client=hybrid_client)
    out = d.run(dsched.MappingLoader({"x": x}))
    np.testing.assert_array_equal(out["y"], 2 * x)
    assert [r.size for r in d.last_run.records] == [100] * 7 + [77]


def test_out_arrays_declare_the_layout_so_every_chunk_writes_in_place(client):
    x = dsched.shared_copy(np.arange(1000.0))
    out = {"y": dsched.shared_empty(1000), "n": dsched.shared_empty(1000, np.int64)}
    d = dsched.WorkDispatcher(scheduler(), j2_like, join="concat", client=client, out=out)
    result = d.run(dsched.MappingLoader({"x": x}))
    assert result["y"] is out["y"] or np.shares_memory(result["y"], out["y"])
    np.testing.assert_array_equal(out["y"], 2 * np.arange(1000.0))
    # A result that does not fit the out= arrays is refused, naming the chunk.
    bad = dsched.WorkDispatcher(scheduler(), lambda w, d: {"y": w["x"], "n": w["x"]}, join="concat",
                                client=client, out=out)
    with pytest.raises(Exception, match="chunk 0 on .*dtype float64; expected \\(\\) and int64"):
        bad.run(dsched.MappingLoader({"x": x}))


# --- parked feeds: a client's next run takes its last run's feeds ---------------------------

_inits = {}  # on each worker: how often thread_init ran per device


def _count_init(device):
    _inits[str(device)] = _inits.get(str(device), 0) + 1


def triple_with_inits(work, device):
    x = work["x"]
    return {"y": 3.0 * x, "inits": np.full(x.shape[0], _inits.get(str(device), 0), dtype=np.int64)}


def double(x):
    return 2.0 * x


def _parked_futures(client):
    return [f.future for fs in client.__dict__.get("_dsched_parked_feeds", {}).values() for f in fs]


def _worker_of(client, device):
    [address] = [a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()
                 if f"dsched-{device}" in w["resources"]]
    return address


def test_the_next_run_takes_the_parked_feeds_with_its_own_program(client):
    x = np.arange(1000.0)
    with dask.config.set({"dsched.feed-linger": 60}):
        dsched.WorkDispatcher(scheduler(), j2_like, join="concat", client=client).run(dsched.MappingLoader({"x": x}))
        assert len(_parked_futures(client)) == 2  # one per single-thread device worker
        client.run_on_scheduler(_forget_keys)
        # Another dispatcher, another model and a thread_init: it reaches the parked feeds before any chunk.
        d = dsched.WorkDispatcher(scheduler(), triple_with_inits, join="concat", client=client,
                                  thread_init=_count_init)
        out = d.run(dsched.MappingLoader({"x": x}))
    np.testing.assert_array_equal(out["y"], 3 * x)
    np.testing.assert_array_equal(out["inits"], np.ones(1000, dtype=np.int64))  # once per device worker
    assert client.run_on_scheduler(_keys_seen) == []  # no task at all: the run's chunks went to the parked feeds
    assert {str(r.device) for r in d.last_run.records} == {"cpu", "cuda:0"}


def test_a_parked_feed_gives_its_worker_to_any_task_that_waits(client):
    with dask.config.set({"dsched.feed-linger": 60}):
        dsched.dispatch(double, np.arange(400.0), scheduler=scheduler(), client=client)
    assert _parked_futures(client)
    # The worker has one thread, which the parked feed holds: this runs once it gives way, not in 60 s.
    cpu = _worker_of(client, "cpu")
    assert client.submit(os.getpid, workers=[cpu], pure=False).result(timeout=20) > 0


def _set_poll(seconds, dask_worker=None):
    import dsched.worker.feed as feed

    before, feed._POLL = feed._POLL, seconds
    return before


def test_a_task_given_to_a_parked_feeds_worker_wakes_the_feed_at_once(client):
    """Not at the feed's next poll: with polls 60 s apart, the task still runs at once."""
    cpu = _worker_of(client, "cpu")
    before = client.run(_set_poll, 60.0, workers=[cpu])[cpu]
    try:
        with dask.config.set({"dsched.feed-linger": 120}):
            dsched.dispatch(double, np.arange(400.0), scheduler=scheduler(), client=client)
        assert _parked_futures(client)
        assert client.submit(os.getpid, workers=[cpu], pure=False).result(timeout=20) > 0
    finally:
        client.run(_set_poll, before, workers=[cpu])


def test_a_feed_parked_past_its_time_ends_and_the_next_run_starts_new_ones(client):
    x = np.arange(600.0)
    with dask.config.set({"dsched.feed-linger": 0.6}):
        dsched.dispatch(double, x, scheduler=scheduler(), client=client)
        parked = _parked_futures(client)
        assert parked
        for future in parked:  # on its own client's loop (distributed.wait would take the default client's)
            future.result(timeout=20)  # they end by themselves, their time up
        client.run_on_scheduler(_forget_keys)
        out = dsched.dispatch(double, x, scheduler=scheduler(), client=client)
    np.testing.assert_array_equal(out, 2 * x)
    keys = client.run_on_scheduler(_keys_seen)
    assert len(keys) == 2 and all(is_feed_key(k) for k in keys), keys


def test_no_feed_is_parked_with_linger_zero(client):
    with dask.config.set({"dsched.feed-linger": 0}):
        before = len(_parked_futures(client))
        dsched.dispatch(double, np.arange(300.0), scheduler=scheduler(), client=client)
    assert len(_parked_futures(client)) <= before  # the run may take parked feeds, and parks none


def _close_inboxes(names, dask_worker=None):
    from dsched.worker import feed

    closed = [name for name, inbox in list(feed._inboxes.items()) if name in names and not inbox.closed]
    for name in closed:
        feed._inboxes[name].close(RuntimeError("closed by the test"))
    return closed


def test_a_parked_feed_that_ended_unnoticed_is_replaced_by_a_new_one(client):
    # A parked feed whose worker-side inbox closed while its task still shows as running: the next run's
    # rearm is refused, and the run starts a new feed in its place rather than failing or falling back.
    x = np.arange(800.0)
    with dask.config.set({"dsched.feed-linger": 60}):
        dsched.dispatch(double, x, scheduler=scheduler(), client=client)
        parked = _parked_futures(client)
        assert len(parked) == 2
        closed = client.run(_close_inboxes, [future.key for future in parked])
        assert sum(len(c) for c in closed.values()) == 2
        client.run_on_scheduler(_forget_keys)
        d = dsched.WorkDispatcher(scheduler(), j2_like, join="concat", client=client)
        out = d.run(dsched.MappingLoader({"x": x}))
    np.testing.assert_array_equal(out["y"], 2 * x)
    keys = client.run_on_scheduler(_keys_seen)
    assert len(keys) == 2 and all(is_feed_key(k) for k in keys), keys  # two new feeds, no task per chunk
    assert {str(r.device) for r in d.last_run.records} == {"cpu", "cuda:0"}


def test_a_feed_reused_by_many_runs_has_one_completion_watcher(client):
    # A solver's loop reuses one feed per device thread for every call: the client must not keep a watcher
    # (and the finished run it reports to) per call.
    from dsched.completion import _watchers

    x = np.arange(400.0)
    with dask.config.set({"dsched.feed-linger": 60}):
        dsched.dispatch(double, x, scheduler=scheduler(), client=client)
        watching = len(_watchers)
        for _ in range(5):
            np.testing.assert_array_equal(dsched.dispatch(double, x, scheduler=scheduler(), client=client), 2 * x)
    assert len(_watchers) <= watching


def _program(name):
    """A run's program as an inbox sees it: what matters here is its dispatcher's id."""
    return ChunkProgram(name, do_work=None)


def test_a_closed_inbox_lets_go_of_its_programs():
    inbox = _Inbox()
    inbox.attach(_program("a"))
    assert inbox.program is not None
    inbox.close(RuntimeError("ended"))
    assert inbox.program is None and not inbox.programs and not inbox.rearm(_program("b"), 5)


def test_an_inbox_keeps_its_last_programs_and_a_rearm_may_name_one_it_keeps():
    """A solver's calls that take turns between models rearm a parked feed with a program it ran before: named by
    its dispatcher (ProgramRef), the inbox's own copy runs again (no second copy unpickled, nothing run cold)."""
    inbox = _Inbox()
    first, second = _program("a"), _program("b")
    inbox.attach(first)
    assert inbox.rearm(second, 1) and inbox.program is second
    assert inbox.rearm(ProgramRef("a"), 2) and inbox.program is first
    assert inbox.rearm(None, 3) and inbox.program is first  # None: the program it runs now
    others = [_program(f"other-{i}") for i in range(PROGRAMS_KEPT - 1)]
    for epoch, program in enumerate(others, start=4):
        assert inbox.rearm(program, epoch) and inbox.program is program
    assert list(inbox.programs) == ["a", *(p.dispatcher_id for p in others)]  # "b", the least recently used: gone
    epoch = 4 + len(others)
    assert not inbox.rearm(ProgramRef("b"), epoch)  # refused, as an ended feed's: the run sends its chunks elsewhere
    assert inbox.program is others[-1] and inbox.epoch == epoch - 1  # and nothing of it applied
    assert inbox.rearm(ProgramRef("a"), epoch) and inbox.program is first
    # A successor's task that starts after a newer run's rearm: its program is kept as the first to go, not run.
    inbox = _Inbox()
    inbox.attach(first)
    assert inbox.rearm(second, 1)
    inbox.attach(_program("successor's"))
    assert inbox.program is second and list(inbox.programs) == ["successor's", "a", "b"]


def test_a_client_names_a_program_its_feed_keeps_and_forgets_as_the_inbox_does():
    from types import SimpleNamespace

    from dsched.dispatch.lanes import program_to_send

    feed = SimpleNamespace(programs=collections.OrderedDict())
    first, second = _program("a"), _program("b")
    assert program_to_send(feed, first) is first and program_to_send(feed, first) is None
    assert program_to_send(feed, second) is second and program_to_send(feed, first) == ProgramRef("a")
    for i in range(PROGRAMS_KEPT):
        program_to_send(feed, _program(f"other-{i}"))
    assert program_to_send(feed, second) is second  # let go of by the inbox too: sent again in full


def test_a_rearm_sent_with_several_chunks_applies_once_and_a_late_park_is_ignored():
    inbox = _Inbox()
    inbox.attach(_program("old"))
    inbox.park(60, 1)
    first, second = _program("first"), _program("second")
    assert inbox.rearm(first, 2) and inbox.program is first and inbox.park_until is None
    assert inbox.rearm(second, 2) and inbox.program is first  # another chunk of the same run: not re-initialised
    inbox.park(60, 1)  # the run before's park, arriving late: the feed stays the new run's
    assert inbox.park_until is None
    inbox.park(60, 3)
    assert inbox.rearm(second, 4) and inbox.program is second  # the next run's


def test_parked_feeds_of_another_thread_are_kept_apart_and_swept_once_ended(client):
    import threading

    from dsched.dispatch.parking import _parked

    x = np.arange(300.0)
    with dask.config.set({"dsched.feed-linger": 0.6}):
        other = threading.Thread(target=dsched.dispatch, args=(double, x), kwargs={"scheduler": scheduler(),
                                                                                   "client": client})
        other.start()
        other.join(60)
        theirs = [f for key, fs in _parked(client).items() if key[0] == other.ident for f in fs]
        assert len(theirs) == 2  # parked for that thread's next run, not this one's
        for feed in theirs:
            feed.future.result(timeout=20)  # they end by themselves, their time up
        dsched.dispatch(double, x, scheduler=scheduler(), client=client)  # looks at the pool: ended ones go
    assert not [key for key in _parked(client) if key[0] == other.ident]


def test_a_rearming_run_s_chunks_for_a_feed_that_ended_since_its_rearm_are_sent_back_not_failed(monkeypatch):
    """The old run's feed failed (its thread_init) and closed between the new run's rearm and its chunks: they come
    back ENDED (the client gives them to a new feed), never with the old run's error."""
    import asyncio

    from dsched.worker import feed as feed_module

    class NoWorker:
        def log_event(self, *args):
            pass

    async def check():
        name = "dsched-feed-test-rearm-race-1"
        inbox = feed_module._inbox(name)
        inbox.attach(_program("the old run's"))
        inbox.park(60.0, epoch=1)
        assert inbox.rearm(_program("the new run's"), 2)  # the rearm applies: the inbox is still open
        inbox.close(RuntimeError("cannot initialise cuda:0"))  # then the old run's failure closes it
        monkeypatch.setattr(feed_module, "_rearmed", lambda feed, rearm: True)  # as it answered before the close
        receive_chunk = feed_module._chunk_handler(NoWorker())
        receive_chunks = feed_module._chunks_handler(NoWorker())
        rearm = (_program("the new run's"), 2)
        assert await receive_chunk(feed=name, index=0, work=None, slot=None, rearm=rearm) == feed_module.ENDED
        assert await receive_chunks(feed=name, chunks=[(1, None, None, None)], rearm=rearm) == feed_module.ENDED
        refused = await receive_chunks(feed=name, chunks=[(2, None, None, None)])  # no rearm: the chunks fail
        assert [r["ok"] for r in refused] == [False] and "cannot initialise" in str(refused[0]["value"].data)

    asyncio.run(check())


@pytest.mark.parametrize("fast_lane", [True, False])
def test_a_failing_thread_init_closes_the_feed_before_its_chunk_fails(hybrid_client, fast_lane):
    """What a run learns its chunk failed from comes after the feed's inbox closed: the next run's rearm finds the
    feed ended, and never gets the old run's error. On the fast lane as over Dask's comms."""
    import dask

    from dsched import SimpleScheduler, WorkDispatcher
    from dsched.worker import feed as feed_module
    from dsched.worker import lane as wire

    seen = []

    def failing_init(device):
        raise RuntimeError(f"cannot initialise {device}")

    def chunk(work, device):
        return 1

    def closed_with(error):
        return [inbox.closed for inbox in list(feed_module._inboxes.values()) if inbox.error is error]

    original_resolve, original_reply = feed_module._resolve, feed_module._Inbox.reply

    def resolve(loop, future, reply):  # at the failing chunk's reply: is its inbox closed already?
        if reply.get("ok") is False:
            seen.extend(closed_with(reply["value"].data))
        original_resolve(loop, future, reply)

    def reply(inbox, message):  # the same on the lane, for the chunk whose thread_init failed
        if message[0] == wire.DONE and message[2] is False and not seen:
            seen.extend(closed_with(message[3]))
        original_reply(inbox, message)

    feed_module._resolve, feed_module._Inbox.reply = resolve, reply
    try:
        with dask.config.set({"dsched.fast-lane": fast_lane}), \
                pytest.raises(RuntimeError, match="cannot initialise cuda:0"):
            WorkDispatcher(SimpleScheduler("cuda:0", 4), chunk, thread_init=failing_init,
                           client=hybrid_client).run(SliceGenerator(0, 8))
    finally:
        feed_module._resolve, feed_module._Inbox.reply = original_resolve, original_reply
    assert seen == [True]


def test_back_to_back_runs_ask_the_scheduler_for_its_workers_once_a_second_and_again_after_a_failure(client,
                                                                                                      monkeypatch):
    from dsched.devices import ownership

    asked = []
    real = ownership.cluster_info
    monkeypatch.setattr(ownership, "cluster_info", lambda c: asked.append(1) or real(c))
    monkeypatch.setattr(ownership, "RECENT", 60.0)  # a loaded machine's runs stay "within a second"
    x = np.arange(4_000.0)
    ownership.forget_cluster_info(client)
    for _ in range(3):
        np.testing.assert_array_equal(dsched.dispatch(np.sqrt, x, scheduler=scheduler(1000), client=client), np.sqrt(x))
    assert len(asked) == 1  # the first run asked; the next two, within RECENT, took its answer
    with pytest.raises(ValueError, match="no worker of the cluster owns cuda:1"):
        dsched.dispatch(np.sqrt, x, scheduler=dsched.SimpleScheduler("cuda:1", 1000), client=client)
    assert len(asked) == 2  # a device the last answer lacks is looked for in a new one (it may have just joined)
    dsched.dispatch(np.sqrt, x, scheduler=scheduler(1000), client=client)
    assert len(asked) == 3  # the refused call forgot the answer, as a failed one does
    asked.clear()

    def fails(block):
        raise ValueError("this model fails")

    with pytest.raises(ValueError, match="this model fails"):
        dsched.dispatch(fails, x, scheduler=scheduler(1000), client=client)
    assert len(asked) == 0  # the failed run took the answer too...
    dsched.dispatch(np.sqrt, x, scheduler=scheduler(1000), client=client)
    assert len(asked) == 1  # ...and the run after it asked again (a worker may have left)
    monkeypatch.setattr(ownership, "RECENT", 0.0)
    dsched.dispatch(np.sqrt, x, scheduler=scheduler(1000), client=client)
    assert len(asked) == 2  # an answer older than RECENT is not taken


def test_a_park_that_comes_before_its_feed_started_ends_the_feed_as_it_starts():
    """A run that ends before a worker had a thread for one of its feeds parks that feed too: started later, it
    must not take a thread and wait for chunks no run sends (the next runs of its client would wait for it)."""
    import asyncio

    from dsched.worker.feed import _inbox, _receive_park

    feed = "dsched-feed-test-never-started-1"
    assert _inbox(feed, create=False) is None
    asyncio.run(_receive_park(feed=feed, linger=30.0, epoch=1))
    inbox = _inbox(feed, create=False)
    assert inbox is not None and inbox.closed and "retired" in str(inbox.error)
    assert not inbox.rearm(_program("a"), 2)  # a run that takes it finds it ended, and starts a new feed


def test_send_now_sends_new_tasks_without_waiting_for_the_clients_batch_window(client):
    """A run's new feed tasks go to the scheduler at once: here the client's window is made to last an hour, so
    the task below reaches the scheduler only because send_now sends it."""
    import threading

    from dsched.dispatch.completion import send_now

    stream, held = client.scheduler_comm, threading.Event()

    def hold_for_an_hour():
        stream.next_deadline = time.time() + 3600
        held.set()

    client.loop.add_callback(hold_for_an_hour)
    assert held.wait(10)
    try:
        future = client.submit(int, "7", pure=False)
        send_now(client)
        assert future.result(timeout=60) == 7
    finally:
        send_now(client)  # the window as Dask keeps it


def test_a_call_submitted_by_this_thread_takes_its_parked_feeds_and_parks_them_for_it(client):
    """dsched.submit runs a call on a thread of its own, for the thread that submitted it: that thread's parked
    feeds serve it (no task at all), and are parked for that thread again, so that its own calls and the ones
    it submits (a driver's updates) take turns on the same feeds rather than each ending the other's."""
    import threading

    from dsched.dispatch.parking import _parked

    from dsched.dispatch.parking import release_parked

    x = np.arange(1000.0)
    s = scheduler()
    release_parked(client)  # none left by earlier tests: those counted below are this test's
    with dask.config.set({"dsched.feed-linger": 60}):
        dsched.dispatch(double, x, scheduler=s, client=client)
        client.run_on_scheduler(_forget_keys)
        out = dsched.submit(double, x, scheduler=s, client=client).result(timeout=60)
        np.testing.assert_array_equal(out, 2 * x)
        assert client.run_on_scheduler(_keys_seen) == []  # the submitted call ran on this thread's parked feeds
        mine = [f for key, fs in _parked(client).items() if key[0] == threading.get_ident() for f in fs]
        assert len(mine) == 2  # parked again for this thread, one per single-thread device worker
        np.testing.assert_array_equal(dsched.dispatch(double, x, scheduler=s, client=client), 2 * x)
        assert client.run_on_scheduler(_keys_seen) == []
