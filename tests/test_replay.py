"""Replays (dsched.dispatch.replay): a like run after a clean steady one sends each feed one small message.

On worker processes (cpu and an emulated cuda:0, a CPU process claiming the device), without the dashboard.
The scheduler cuts each batch in one wave (a chunk per device), so the policy's chunks repeat: the first call
runs the full way, the second on the steady path (which leaves the plan), the next ones replay it. Checked:
the chunks and results, the kept chunks on the feeds, inputs and outputs in shared memory, a failed chunk, a
worker killed during a replay, Ctrl-C, and what never replays.
"""

import os
import signal
import threading
import time

import dask
import numpy as np
import pytest

import dsched
from chunk_models import chunks_of, fail_on_negatives, runs_taking, slow_triple, triple
from dsched.checks import setting
from dsched.devices.ownership import cluster_info
from dsched.dispatch import replay, steady
from dsched.schedulers import PerformanceModelScheduler

WAIT_LIMIT = 60


@pytest.fixture
def client(process_client):
    """The module's worker processes (conftest's ``process_client``), checked for what would keep every run from
    replaying, so that a test that fails for it says which (a state left by an earlier module, not the test)."""
    from dsched.devices.ownership import has_dashboard
    from dsched.observe.collect import open_collectors

    assert not has_dashboard(process_client), f"{process_client.scheduler.address}: believed to have the dashboard"
    assert not open_collectors(), f"run_reports blocks left open: {open_collectors()}"
    assert setting("replay", True), dask.config.get("dsched", {})
    return process_client


@pytest.fixture
def runs(monkeypatch):
    """``{"steady": [...], "replay": [...]}``: the runs that took each way."""
    return {"steady": runs_taking(monkeypatch, steady.SteadyRun), "replay": runs_taking(monkeypatch, replay.ReplayRun)}


def one_wave():
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[100, 300])


def test_like_runs_replay_the_plan_with_the_same_chunks_and_results(client, runs):
    d = dsched.WorkDispatcher(one_wave(), triple, join="concat", client=client)
    x = np.arange(400.0)
    for k in range(5):
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x + k)), 3 * (x + k))
        assert chunks_of(d.last_run) == [("cpu", 0, 100), ("cuda:0", 100, 300)]
    assert (len(runs["steady"]), len(runs["replay"])) == (1, 3)
    plan = d._steady.replay
    assert len(plan.current.kept_by) == 2  # each feed keeps the plan's chunks: the first replay sent them, the next not
    assert [s.load for s in d.scheduler.status()] == [0, 0]  # never asked, never loaded
    assert all(r.worker is not None and r.stop >= r.start > 0 for r in d.last_run.records)


def test_dispatch_in_a_solver_loop_replays_with_its_outputs_fed_back(client, runs):
    """The state each call returns (in shared memory) is the next call's input: referenced or copied, the
    results are those of NumPy."""
    s = one_wave()
    step = lambda v, w: (v + w, 2.0 * w)  # noqa: E731
    state, weight = np.arange(400.0), np.ones(400)
    for _ in range(8):
        state, weight = dsched.dispatch(step, state, weight, scheduler=s, client=client)
    expected, w = np.arange(400.0), np.ones(400)
    for _ in range(8):
        expected, w = expected + w, 2.0 * w
    np.testing.assert_array_equal(state, expected)
    np.testing.assert_array_equal(weight, w)
    assert len(runs["replay"]) == 6
    # The state each call returned lies in another output segment: read there, with a kept placement's chunks.
    assert len(runs["replay"][-1].plan.inputs_kept) == replay.INPUTS_KEPT


def test_a_replay_whose_last_call_waited_long_sleeps_at_once_rather_than_look_for_its_replies(client, runs):
    """Looking for replies before sleeping takes a core; a replay after one that waited more than
    ``LONG_WAIT`` (chunks of 5 ms here) sleeps at once, where the first replay, with no wait known, looks."""
    d = dsched.WorkDispatcher(one_wave(), slow_triple, join="concat", client=client)
    x = np.arange(400.0)
    for k in range(4):
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x + k)), 3 * (x + k))
    first, *later = runs["replay"]
    assert len(later) == 1 and first.plan is later[0].plan
    assert first.spin == float(setting("lane-spin", steady.SPIN)) and later[0].spin == 0.0
    assert first.plan.waited > 0.005 > replay.LONG_WAIT
    # While it waited, it allocated the next call's outputs: the next call returns them, and makes the next.
    spare = first.plan.spare
    assert spare is not None and spare.generator is None
    result = d.run(dsched.ArrayLoader(x + 4))
    np.testing.assert_array_equal(result, 3 * (x + 4))
    assert result is spare.outputs[0] and first.plan.spare not in (None, spare)
    # A call with its own out= drops the spare and writes where it is told.
    out = dsched.shared_empty(400)
    d.out = out
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x + 5)), 3 * (x + 5))
    np.testing.assert_array_equal(out, 3 * (x + 5))
    assert len(runs["replay"]) == 4 and first.plan.spare is None


def test_no_room_for_the_next_call_s_outputs_costs_this_call_nothing(client, runs, monkeypatch):
    """The outputs a replay allocates for the next call while it waits are a bet: shared memory full then
    (``ENOSPC``) fails neither this call nor the next, which allocates its own."""
    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(replay.ReplayPlan, "prepare_spare", full)
    d = dsched.WorkDispatcher(one_wave(), slow_triple, join="concat", client=client)
    x = np.arange(400.0)
    for k in range(5):
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x + k)), 3 * (x + k))
    assert len(runs["replay"]) == 3 and runs["replay"][-1].long_wait and runs["replay"][-1].plan.spare is None


def test_inputs_of_alternating_layouts_each_keep_their_path_and_replay(client, runs):
    """A solver's first steps pass its old state as scalars, the next ones as arrays: each layout of the inputs
    keeps its own steady path and replay, so alternating between them never falls back to the full way."""
    d = dsched.WorkDispatcher(one_wave(), triple, join="concat", client=client)
    flat, pairs = np.arange(400.0), np.arange(800.0).reshape(400, 2)
    for k in range(5):
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(flat + k)), 3 * (flat + k))
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(pairs + k)), 3 * (pairs + k))
    assert (len(runs["steady"]), len(runs["replay"])) == (2, 6)
    assert len(d._steady_paths) == 2
    d.close()
    assert d._steady_paths == {}


def test_out_arrays_in_shared_memory_are_written_in_place_by_replays(client, runs):
    out = dsched.shared_empty(400)
    d = dsched.WorkDispatcher(one_wave(), triple, join="concat", client=client, out=out)
    x = np.arange(400.0)
    for k in range(4):
        assert d.run(dsched.ArrayLoader(x + k)) is out
        np.testing.assert_array_equal(out, 3 * (x + k))
    assert len(runs["replay"]) == 2
    private = np.empty(400)  # private memory: the full way writes it, every time
    d.out = private
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 3 * x)
    assert private is d.last_run.output and len(runs["replay"]) == 2


def test_a_failed_chunk_in_a_replay_keeps_the_others(client, runs):
    d = dsched.WorkDispatcher(one_wave(), fail_on_negatives, join="concat", client=client)
    x = np.arange(400.0)
    for _ in range(3):
        d.run(dsched.ArrayLoader(x))
    bad = x.copy()
    bad[250] = -1.0
    with pytest.raises(ValueError, match="negative items at 150") as caught:
        d.run(dsched.ArrayLoader(bad))
    assert len(runs["replay"]) == 2
    assert any("(cuda:0, items 100-399) failed" in note for note in caught.value.__notes__)
    out = d.last_run.output
    assert np.isnan(out[100:]).all()
    np.testing.assert_array_equal(out[:100], 2 * x[:100])
    # The failed run forgot the path: the full way, the steady path, then replays again.
    for _ in range(3):
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 2 * x)
    assert len(runs["replay"]) == 3


def sleepy_double(work, device):
    time.sleep(0.5 if str(device) == "cuda:0" and work[0] >= 1_000_000 else 0.0)
    return 2.0 * work


def _pid(client, device) -> int:
    [address] = [a for a, w in cluster_info(client)["workers"].items() if f"dsched-{device}" in w["resources"]]
    return client.run(os.getpid, workers=[address])[address]


def test_a_worker_killed_during_a_replay_costs_only_its_chunk(client, runs):
    """Its lane breaks: its chunk runs again the full way (on the restarted worker), into the same outputs."""
    d = dsched.WorkDispatcher(one_wave(), sleepy_double, join="concat", client=client)
    x = np.arange(400.0)
    for _ in range(3):
        d.run(dsched.ArrayLoader(x))
    pid = _pid(client, "cuda:0")
    killer = threading.Timer(0.2, os.kill, (pid, signal.SIGKILL))
    killer.start()
    slow = x + 1_000_000  # its chunk on cuda:0 sleeps: killed meanwhile
    try:
        out = d.run(dsched.ArrayLoader(slow))
    finally:
        killer.join()
    assert len(runs["replay"]) == 2
    np.testing.assert_array_equal(out, 2 * slow)
    assert d._steady is None or d._steady.replay is None  # dropped with the lane
    assert [s.load for s in d.scheduler.status()] == [0, 0]


def test_ctrl_c_in_a_replay_drops_the_plan_and_the_next_call_runs(client, runs):
    d = dsched.WorkDispatcher(one_wave(), sleepy_double, join="concat", client=client)
    x = np.arange(400.0)
    for _ in range(3):
        d.run(dsched.ArrayLoader(x))
    interrupter = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    interrupter.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            d.run(dsched.ArrayLoader(x + 1_000_000))
    finally:
        interrupter.join()
    assert time.monotonic() - start < WAIT_LIMIT / 2
    assert len(runs["replay"]) == 2 and d._steady is None
    np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x)), 2 * x)


def test_what_never_replays(client, runs):
    x = np.arange(400.0)
    with dask.config.set({"dsched.replay": False}):  # turned off
        d = dsched.WorkDispatcher(one_wave(), triple, join="concat", client=client)
        for _ in range(4):
            d.run(dsched.ArrayLoader(x))
    watched = dsched.WorkDispatcher(one_wave(), triple, join="concat", client=client,
                                    on_chunk_done=lambda record: None)  # an observer is told of every chunk
    for _ in range(4):
        watched.run(dsched.ArrayLoader(x))
    waves = dsched.WorkDispatcher(dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[10, 30]), triple,
                                  join="concat", client=client)  # chunks cut as devices finish: not repeatable
    for _ in range(4):
        np.testing.assert_array_equal(waves.run(dsched.ArrayLoader(x)), 3 * x)
    assert runs["replay"] == [] and len(runs["steady"]) == 3 * 3


def test_only_a_policy_that_chooses_by_its_records_has_a_plan_key():
    assert one_wave().plan_key() == ((dsched.Device("cpu"), 100, 100, 1.0), (dsched.Device("cuda:0"), 300, 300, 1.0))
    assert dsched.SimpleScheduler("cpu", 4).plan_key() == ((dsched.Device("cpu"), 4, 4, 1.0),)
    assert PerformanceModelScheduler(["cpu", "cuda:0"]).plan_key() is None

    class LastListed(dsched.StaticHybridScheduler):
        def _pick(self, available):
            return available[-1]

    assert LastListed(["cpu", "cuda:0"], batch_sizes=4).plan_key() is None
    loaded = one_wave()
    loaded.dispatched_work("cpu", 100)
    assert loaded.plan_key() is None  # chunks in flight: its next choices are not a fresh batch's


def scaled(work, device):
    return work["x"] * work["scale"]


def test_a_value_passed_whole_that_changes_is_sent_again(client, runs):
    """A model's parameter (an entry of size 1, which every chunk holds by value) changes between calls: the kept
    chunks hold the old one, so the call sends its chunks again."""
    d = dsched.WorkDispatcher(one_wave(), scaled, join="concat", client=client)
    x = np.arange(400.0)
    for scale in (1.0, 1.0, 1.0, 2.0, 2.0, 3.0):
        out = d.run(dsched.MappingLoader({"x": x, "scale": np.array([scale])}))
        np.testing.assert_array_equal(out, scale * x)
    assert len(runs["replay"]) == 4
    assert len(d._steady.replay.inputs_kept) == 1  # the changed value replaced the kept chunks


def _forget_kept_plans():
    from dsched.worker import feed

    with feed._inboxes_lock:
        inboxes = list(feed._inboxes.values())
    for inbox in inboxes:
        inbox.kept.clear()
    return len(inboxes)


def test_a_feed_that_let_go_of_the_plan_is_sent_its_chunks_again_on_the_same_lane(client, runs):
    """A feed answers ``again`` for a plan it no longer keeps (it keeps a few) with ``forgotten``: the replay
    sends that feed its chunks in full, on the same lane, and the call stays a replay, with its feeds."""
    d = dsched.WorkDispatcher(one_wave(), triple, join="concat", client=client)
    x = np.arange(400.0)
    for _ in range(3):
        d.run(dsched.ArrayLoader(x))
    feeds_before = set(d._steady.replay.current.kept_by)
    assert len(feeds_before) == 2
    assert all(client.run(_forget_kept_plans).values())
    for k in range(1, 4):
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x + k)), 3 * (x + k))
    assert len(runs["replay"]) == 4 and d._steady.replay.current.kept_by == feeds_before
    assert [s.load for s in d.scheduler.status()] == [0, 0]


def test_steps_of_a_history_in_shared_memory_replay_one_placement_read_further_along(client, runs):
    """A solver's step ``k`` and step ``k - 1`` of a history it keeps in shared memory, both views of one segment:
    once the plan keeps its few placements, every call replays the latest, its inputs read where they lie now
    (no new placement, no chunks sent again), and the results are those of NumPy at every step."""
    history = dsched.shared_empty((12, 400, 2))
    history[...] = np.arange(12 * 800.0).reshape(12, 400, 2) ** 1.5
    s = one_wave()
    for k in range(1, 12):
        out = dsched.dispatch(np.subtract, history[k], history[k - 1], scheduler=s, client=client)
        np.testing.assert_array_equal(out, history[k] - history[k - 1])
    assert (len(runs["steady"]), len(runs["replay"])) == (1, 9)
    plan = runs["replay"][0].plan
    assert all(r.plan is plan for r in runs["replay"]) and len(plan.inputs_kept) == replay.INPUTS_KEPT
    token, start = plan.current.where[0]
    step = 400 * 2 * 8  # bytes between two steps of the history
    # The placements of steps 3, 4 and 5 (the first replays'); the last call, step 11, read in the latest.
    assert plan.moves == {"args[0]": (token, start + 6 * step), "args[1]": (token, start + 5 * step)}


def test_a_feed_that_forgot_the_plan_is_sent_it_with_where_this_call_s_inputs_lie(client, runs):
    """A feed that let go of the plan is sent its kept chunks in full, with where this call's inputs lie."""
    history = dsched.shared_empty((6, 400))
    history[...] = np.arange(6 * 400.0).reshape(6, 400)
    d = dsched.WorkDispatcher(one_wave(), triple, join="concat", client=client)
    for k in range(3):
        d.run(dsched.ArrayLoader(history[k]))
    assert all(client.run(_forget_kept_plans).values())
    for k in range(3, 6):
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(history[k])), 3 * history[k])
    assert len(runs["replay"]) == 4 and len(d._steady.replay.inputs_kept) == replay.INPUTS_KEPT
    assert d._steady.replay.moves is not None  # the last call read its input where it lies, in a kept placement


def test_two_threads_running_one_dispatcher_each_get_their_own_results(client, runs):
    """One thread replays; another calls meanwhile, finds the plan in use and runs the full way, leaving the
    replay's inputs alone."""
    from concurrent.futures import ThreadPoolExecutor

    d = dsched.WorkDispatcher(one_wave(), sleepy_double, join="concat", client=client)
    x = np.arange(400.0)
    with ThreadPoolExecutor(1) as replaying:  # parked feeds are their thread's: one thread for the replays
        for _ in range(3):
            replaying.submit(d.run, dsched.ArrayLoader(x)).result(timeout=WAIT_LIMIT)
        slow = x + 1_000_000  # its chunk on cuda:0 takes 0.5 s: the other call comes meanwhile
        first = replaying.submit(d.run, dsched.ArrayLoader(slow))
        time.sleep(0.1)
        np.testing.assert_array_equal(d.run(dsched.ArrayLoader(x + 7)), 2 * (x + 7))
        np.testing.assert_array_equal(first.result(timeout=WAIT_LIMIT), 2 * slow)
    assert len(runs["replay"]) == 2 and [s.load for s in d.scheduler.status()] == [0, 0]


def weighted_state(strain, state):
    """A trial's function: a result, and a new state (a dict of the fields)."""
    return strain * state["w"], {"w": state["w"] + 1.0, "total": state["total"] + strain}


def test_calls_with_dicts_and_lists_of_arrays_skip_the_call_set_up_and_stay_exact(client, runs, monkeypatch):
    """A call whose arguments are dicts (TrialState's state) or lists of NumPy arrays is as plain as one of arrays:
    the next like call skips the checks and layout (dispatch's quick way), and its values are its own."""
    from dsched.dispatch import front

    quick = []
    original = front._LastCalls.run
    monkeypatch.setattr(front._LastCalls, "run", lambda self, *a: quick.append(1) or original(self, *a))
    s, x = one_wave(), np.arange(400.0)
    for k in range(4):
        state = {"w": np.full(400, float(k)), "total": x * k}
        result, new = dsched.dispatch(weighted_state, x + k, state, scheduler=s, client=client)
        np.testing.assert_array_equal(result, (x + k) * k)
        np.testing.assert_array_equal(new["w"], np.full(400, k + 1.0))
        np.testing.assert_array_equal(new["total"], x * k + x + k)
    assert len(quick) == 3 and len(runs["replay"]) == 2
    pair = dsched.dispatch(lambda p: (p[0] - p[1],), [x, 2 * x], scheduler=s, client=client)
    np.testing.assert_array_equal(pair[0], -x)
    other = {"w": np.ones(400), "total": x, "extra": x}  # other keys: not like the calls before
    result, new = dsched.dispatch(lambda e, st: (e + st["extra"], {k: v for k, v in st.items()}), x, other,
                                  scheduler=s, client=client)
    np.testing.assert_array_equal(result, 2 * x)
    assert len(quick) == 3


class ComparedScheduler(dsched.StaticHybridScheduler):
    """A policy that defines equality, and so (as a dataclass would) has no hash."""

    def __eq__(self, other):
        return self is other

    __hash__ = None


def test_a_policy_without_a_hash_keeps_its_quick_way(client, monkeypatch):
    """dispatch's quick way knows a policy by identity: one that cannot be hashed works, and takes it too."""
    from dsched.dispatch import front

    quick = []
    original = front._LastCalls.run
    monkeypatch.setattr(front._LastCalls, "run", lambda self, *a: quick.append(1) or original(self, *a))
    s, x = ComparedScheduler(["cpu", "cuda:0"], batch_sizes=[100, 300]), np.arange(400.0)
    for k in range(3):
        np.testing.assert_array_equal(dsched.dispatch(triple_one, x + k, scheduler=s, client=client), 3 * (x + k))
    assert len(quick) == 2


def triple_one(x):
    return 3.0 * x


def signed(inputs):
    return inputs["x"] * np.copysign(1.0, inputs["w"])


def signed_sum(x, w):
    return x * np.copysign(1.0, w).sum()


def test_a_zero_of_the_other_sign_passed_whole_is_not_the_kept_one(client, runs):
    """-0.0 == 0.0, yet a model may tell them apart (copysign): the replay's kept chunks hold the value they were
    sent with, so a call passing the other zero whole sends its chunks again."""
    s, x = one_wave(), np.arange(1.0, 401.0)
    for _ in range(3):  # a number in a dict, beside the array split
        np.testing.assert_array_equal(dsched.dispatch(signed, {"x": x, "w": 0.0}, scheduler=s, client=client), x)
    assert len(runs["replay"]) == 1
    np.testing.assert_array_equal(dsched.dispatch(signed, {"x": x, "w": -0.0}, scheduler=s, client=client), -x)
    for sign in (1.0, 1.0, 1.0, -1.0):  # an array passed whole: its zeros' signs count too
        got = dsched.dispatch(signed_sum, x, sign * np.zeros(3), axis=(0, None), scheduler=s, client=client)
        np.testing.assert_array_equal(got, 3 * sign * x)
    assert len(runs["replay"]) >= 2


def scaled_sum(strain, state):
    return strain * state["w"] + state["total"]


def test_calls_alternating_numbers_and_arrays_in_a_dict_each_keep_their_quick_way(client, monkeypatch):
    """NEML2's driver passes the old state as a number at its first step and as arrays after: each kind of call
    keeps its quick way from one history to the next (the number is part of what makes calls alike)."""
    from dsched.dispatch import front

    quick = []
    original = front._LastCalls.run
    monkeypatch.setattr(front._LastCalls, "run", lambda self, *a: quick.append(1) or original(self, *a))
    s, x = one_wave(), np.arange(400.0)
    for k in range(3):
        first = dsched.dispatch(scaled_sum, x + k, {"w": 0.0, "total": x}, scheduler=s, client=client)
        np.testing.assert_array_equal(first, x)
        later = dsched.dispatch(scaled_sum, x + k, {"w": np.full(400, 2.0), "total": x}, scheduler=s, client=client)
        np.testing.assert_array_equal(later, 2 * (x + k) + x)
    assert len(quick) == 4
    other = dsched.dispatch(scaled_sum, x, {"w": 3.0, "total": x}, scheduler=s, client=client)  # another number
    np.testing.assert_array_equal(other, 4 * x)
    assert len(quick) == 4


def test_two_functions_on_like_arguments_each_keep_their_quick_way(client, monkeypatch):
    """A gradient and a hessian evaluated in turn on the same inputs (an FE material's calls): neither call
    takes the other's place among the kept ones."""
    from dsched.dispatch import front

    quick = []
    original = front._LastCalls.run
    monkeypatch.setattr(front._LastCalls, "run", lambda self, *a: quick.append(1) or original(self, *a))
    s, x = one_wave(), np.arange(400.0)
    state = {"w": np.full(400, 2.0), "total": x}
    for k in range(3):
        np.testing.assert_array_equal(dsched.dispatch(scaled_sum, x + k, state, scheduler=s, client=client),
                                      2 * (x + k) + x)
        np.testing.assert_array_equal(dsched.dispatch(weighted_state, x + k, state, scheduler=s, client=client)[0],
                                      2 * (x + k))
    assert len(quick) == 4


def test_a_kept_plan_keeps_the_rows_of_five_output_segments_lent_in_turn():
    """A solver holding its last two steps' outputs while the next call's are allocated cycles through five
    output segments: the feed keeps each one's rows mapped, so the second round maps none again."""
    import pickle

    from dsched.dataplane.outputs import OutputLayout, OutputSlot
    from dsched.dataplane.store import RunStore
    from dsched.worker import kept

    n = 10
    store = RunStore(shared=False)
    layout = OutputLayout.of({"y": np.zeros(n)}, n)
    outputs = [np.zeros(n) for _ in range(5)]
    targets = [(store.register(a),) for a in outputs]
    plan = kept.KeptPlans().keep("plan", [(0, None, OutputSlot(layout, targets[0], 0, n, 0))], "cpu")
    blobs = [pickle.dumps(t, protocol=5) for t in targets]
    first = [plan.jobs(blob)[0][3] for blob in blobs]
    again = [plan.jobs(blob)[0][3] for blob in blobs]
    assert all(a is b for a, b in zip(first, again)) and len(plan.outputs) == 5 <= kept.OUTPUTS_KEPT
    first[2][0][:] = 7.0  # the rows are the segment's own
    assert (outputs[2] == 7.0).all()
    store.close()
