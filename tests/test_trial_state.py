"""TrialState: a Newton loop's trial, commit and rollback on worker processes, against the same loop in NumPy."""

import os

import numpy as np
import pytest

import dsched
from dsched import StaticHybridScheduler
from dsched.dataplane.store import SHM_DIR, find_shared

N = 40  # cells, the last axis as FE codes keep them


def plastic(F, scale, state):
    """A history-dependent toy material: the state accumulates the trace of F, the stress depends on it."""
    eps = state["eps"] + 0.1 * np.trace(F)[None]
    alpha = state["alpha"] + np.abs(eps).sum(axis=0)
    stress = scale * F * (1.0 + alpha)
    return stress, {"eps": eps, "alpha": alpha}


def loads(step, iteration):
    rng = np.random.default_rng(100 * step + iteration)
    return rng.normal(size=(3, 3, N))


@pytest.fixture(scope="module")
def scheduler():
    return StaticHybridScheduler(["cpu", "cuda:0"], [7, 9])


def newton(evaluate, commit, rollback):
    """Three load steps of three iterations; the second step is cut back once, then retried."""
    stresses = []
    for step in range(3):
        for attempt in range(2 if step == 1 else 1):
            for iteration in range(3):
                stresses.append(evaluate(loads(step, iteration + 10 * attempt)))
            if step == 1 and attempt == 0:
                rollback()
            else:
                commit()
    return stresses


def test_a_newton_loop_with_a_cut_back_matches_the_same_loop_in_numpy(process_client, scheduler):
    start = {"eps": np.zeros((2, N)), "alpha": np.zeros(N)}
    state = dsched.TrialState(start, axis=-1)
    got = newton(lambda F: state.trial(plastic, F, 2.0, scheduler=scheduler, client=process_client),
                 state.commit, state.rollback)

    box = {"committed": dict(start), "trial": None}

    def evaluate(F):
        stress, box["trial"] = plastic(F, 2.0, box["committed"])
        return stress

    want = newton(evaluate, lambda: box.update(committed=box["trial"]), lambda: None)
    assert len(got) == len(want) == 12
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    for name in start:
        np.testing.assert_array_equal(state.committed[name], box["committed"][name])


def test_states_live_in_shared_memory_and_shm_stays_flat(process_client, scheduler):
    state = dsched.TrialState({"eps": np.zeros((2, N)), "alpha": np.zeros(N)}, axis=-1)

    def segments():
        return len([n for n in os.listdir(SHM_DIR) if n.startswith(f"dsched-{os.getpid()}-")])

    for i in range(3):  # warm: the pool holds what a trial needs
        state.trial(plastic, loads(0, i), 2.0, scheduler=scheduler, client=process_client)
        state.commit()
    before = segments()
    for i in range(30):
        state.trial(plastic, loads(1, i), 2.0, scheduler=scheduler, client=process_client)
        (state.commit if i % 3 else state.rollback)()
    assert segments() <= before
    # The committed state is passed by reference: its memory is a segment the workers map.
    assert all(find_shared(np.ascontiguousarray(a)) is not None for a in state._committed.values())


def test_a_submitted_trial_overlaps_and_keeps_its_state_when_taken(process_client, scheduler):
    state = dsched.TrialState({"eps": np.zeros((2, N)), "alpha": np.zeros(N)}, axis=-1)
    future = state.submit_trial(plastic, loads(0, 0), 2.0, scheduler=scheduler, client=process_client)
    stress = future.result(timeout=60)
    want_stress, want_state = plastic(loads(0, 0), 2.0, {"eps": np.zeros((2, N)), "alpha": np.zeros(N)})
    np.testing.assert_array_equal(stress, want_stress)
    state.commit()
    np.testing.assert_array_equal(state.committed["alpha"], want_state["alpha"])


def wrong_fields(F, state):
    return F, {"eps": state["eps"]}


def test_mistakes_are_one_line_errors():
    with pytest.raises(ValueError, match=r"^fields: expected a dict of arrays"):
        dsched.TrialState([np.zeros(3)])
    with pytest.raises(ValueError, match=r"^fields\['a'\]: expected an array of numbers with a batch axis"):
        dsched.TrialState({"a": 1.0})
    state = dsched.TrialState({"eps": np.zeros((2, N)), "alpha": np.zeros(N)}, axis=-1)
    with pytest.raises(RuntimeError, match=r"^commit: no trial since the last commit or rollback$"):
        state.commit()
    s = dsched.SimpleScheduler("cpu", 8)
    with pytest.raises(ValueError, match=r"^fn: new_state has the fields \(eps\); the state has \(eps, alpha\)$"):
        state.trial(wrong_fields, np.zeros((3, 3, N)), scheduler=s, mode="sync")
    with pytest.raises(ValueError, match=r"^fn: a trial's function returns \(result, new_state\)"):
        state.trial(lambda F, st: F, np.zeros((3, 3, N)), scheduler=s, mode="sync")
    assert state.trial_state is None
