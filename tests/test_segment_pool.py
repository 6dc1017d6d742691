"""Segments kept for the next call: reused call after call, never while their arrays live, never after a
failure, and released on demand."""

import gc
import os

import dask
import numpy as np
import pytest

import dsched
from dsched.dataplane.segments import POOL, SHM_DIR, release_pool


def segments():
    return {name for name in os.listdir(SHM_DIR) if name.startswith(f"dsched-{os.getpid()}-")}


def scheduler():
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[100, 150])


def double(x):
    return {"y": 2.0 * x, "n": x.sum(axis=1)}


@pytest.fixture(autouse=True)
def empty_pool():
    gc.collect()  # arrays of earlier tests held in reference cycles: their segments come back to the pool now
    release_pool()
    yield
    gc.collect()
    release_pool()


def test_a_repeated_call_reuses_the_segments_of_the_last(process_client):
    x = np.arange(3000.0).reshape(1000, 3)
    out = dsched.dispatch(double, x, scheduler=scheduler(), client=process_client)
    first = segments()
    assert len(first) == 2  # the inputs' (now kept) and the outputs' (lent to `out`)
    del out
    gc.collect()
    assert POOL.held() > 0 and segments() == first  # both kept, none unlinked
    for _ in range(3):
        out = dsched.dispatch(double, x, scheduler=scheduler(), client=process_client)
        np.testing.assert_array_equal(out["y"], 2.0 * x)
        del out
    assert segments() == first  # the same two, call after call


def test_outputs_still_held_are_never_written_by_a_later_call(process_client):
    x = np.arange(3000.0).reshape(1000, 3)
    kept = dsched.dispatch(double, x, scheduler=scheduler(), client=process_client)
    again = dsched.dispatch(double, x + 1, scheduler=scheduler(), client=process_client)
    np.testing.assert_array_equal(kept["y"], 2.0 * x)  # unchanged by the second call
    np.testing.assert_array_equal(again["y"], 2.0 * (x + 1))
    assert not np.shares_memory(kept["y"], again["y"])


def test_a_failed_run_keeps_nothing_and_its_untouched_rows_hold_no_past_values(process_client):
    x = np.arange(3000.0).reshape(1000, 3)
    del_me = dsched.dispatch(double, x, scheduler=scheduler(), client=process_client)
    del del_me
    gc.collect()
    pooled = segments()

    def fails_late(x):
        if x[0, 0] >= 1500.0:
            raise RuntimeError("late failure")
        return {"y": -x, "n": x.sum(axis=1)}

    d = dsched.WorkDispatcher(scheduler(), lambda w, dev: fails_late(w), join="concat", client=process_client)
    with pytest.raises(RuntimeError, match="late failure"):
        d.run(dsched.ArrayLoader(x))
    output = d.last_run.output["y"]
    done = [r for r in d.last_run.records if r.error is None]
    assert done and all(np.array_equal(output[r.offset:r.offset + r.size], -x[r.offset:r.offset + r.size])
                        for r in done)
    dispatched = np.zeros(1000, bool)
    for r in d.last_run.records:
        dispatched[r.offset:r.offset + r.size] = True
    assert np.isnan(output[~dispatched]).all()  # never the 2 * x of the call before
    assert POOL.held() == 0  # the failed run took both kept segments, and kept neither
    del d, output
    gc.collect()
    assert POOL.held() == 0 and not segments() & pooled  # unlinked, not given back


def test_a_pool_of_zero_bytes_keeps_nothing(process_client):
    x = np.arange(300.0).reshape(100, 3)
    with dask.config.set({"dsched.segment-pool": 0}):
        out = dsched.dispatch(double, x, scheduler=scheduler(), client=process_client)
        del out
        gc.collect()
        assert POOL.held() == 0 and segments() == set()


def test_release_pool_unlinks_what_is_kept(process_client):
    out = dsched.dispatch(double, np.ones((500, 3)), scheduler=scheduler(), client=process_client)
    del out
    gc.collect()
    held = POOL.held()
    assert held > 0 and segments()
    assert release_pool() == held
    assert segments() == set() and POOL.held() == 0


def test_outputs_fed_back_as_inputs_travel_by_reference_step_after_step(process_client):
    """A solver's loop: each call's output is the next call's input; none of it is copied into a new segment."""
    from dsched.dataplane.store import find_shared

    x = np.arange(3000.0).reshape(1000, 3)
    state = dsched.dispatch(double, x, scheduler=scheduler(), client=process_client)["y"]
    for step in range(4):
        ref = find_shared(state)
        assert ref is not None and ref.token in segments()
        created = segments()
        new = dsched.dispatch(double, state, scheduler=scheduler(), client=process_client)["y"]
        np.testing.assert_array_equal(new, 2.0 ** (step + 2) * x)
        # The new outputs' segment is the only new one from step 1 on (the old state's comes back to the pool
        # once dropped, for the next step's outputs); no input segment was made for `state`.
        assert len(segments() - created) <= 1
        state = new
    del state, new
    gc.collect()
    assert segments() and all(find_shared(np.frombuffer(b, np.uint8)) is None for *_, b in POOL._free)
