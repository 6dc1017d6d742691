"""Every result works: Python objects and strings travel back by value, the other outputs stay in place;
empty batches return empty outputs or say the batch is empty."""

import os
import threading

import numpy as np
import pytest

import dsched
from dsched.dataplane.store import SHM_DIR


def labelled(x):
    """A label object per point, and a number per point."""
    labels = np.empty(len(x), dtype=object)
    for i, v in enumerate(x):
        labels[i] = ("big" if v > 10 else "small", int(v))
    return {"label": labels, "twice": x * 2}


def named(x):
    """Strings whose width differs from chunk to chunk ('p9' then 'p10')."""
    return np.array([f"p{int(v)}" for v in x]), x + 1


def _expected_labels(x):
    return [("big" if v > 10 else "small", int(v)) for v in x]


@pytest.fixture(params=["sync", "in-process", "processes"])
def run(request, hybrid_client, process_client):
    client = {"sync": None, "in-process": hybrid_client, "processes": process_client}[request.param]
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 4])
    mode = "sync" if client is None else "async"
    return lambda fn, *args, **kw: dsched.dispatch(fn, *args, scheduler=scheduler, client=client, mode=mode, **kw)


def test_object_outputs_travel_by_value_and_the_others_stay_numbers(run):
    x = np.arange(23.0)
    out = run(labelled, x)
    assert out["label"].dtype == object
    assert out["label"].tolist() == _expected_labels(x)
    np.testing.assert_array_equal(out["twice"], x * 2)


def test_string_outputs_of_varying_width_are_joined_at_the_widest(run):
    x = np.arange(23.0)
    names, plus_one = run(named, x)
    assert names.dtype == np.dtype("<U3")
    assert names.tolist() == [f"p{i}" for i in range(23)]
    np.testing.assert_array_equal(plus_one, x + 1)


def test_a_string_where_a_number_was_is_still_an_error_naming_the_chunk(run):
    def changes_kind(x):
        return np.array([f"p{int(v)}" for v in x]) if x[0] > 5 else x

    with pytest.raises(dsched.ChunkResultError, match=r"dtype <U\d+; expected \(\) and float64"):
        run(changes_kind, np.arange(23.0))


def test_an_empty_batch_returns_the_out_arrays_it_was_given(run):
    out = np.empty((0, 3))
    assert run(np.sqrt, np.zeros((0, 3)), out=out) is out


def test_an_empty_batch_without_out_is_a_one_line_error(run):
    with pytest.raises(ValueError, match=r"^args: the batch is empty \(0 items along axis 0\)") as info:
        run(np.sqrt, np.zeros((0, 3)))
    assert "\n" not in str(info.value)


def _segments():
    """This process's segments (other processes on the host, tests run beside these ones, make their own)."""
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(f"dsched-{os.getpid()}-"))


def test_thirty_calls_with_object_outputs_reuse_their_segments_and_leak_none(process_client):
    from dsched.dataplane.segments import release_pool

    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[300, 400])
    release_pool()
    before = _segments()
    x = np.arange(5000.0)
    out = dsched.dispatch(labelled, x, scheduler=scheduler, client=process_client)
    first = _segments()
    for _ in range(29):
        del out
        out = dsched.dispatch(labelled, x, scheduler=scheduler, client=process_client)
    assert out["label"][4999] == ("big", 4999)
    assert _segments() == first  # the same segments, call after call: nothing new, nothing leaked
    del out
    release_pool()
    assert _segments() == before


_PROBE_GATE = threading.Event()  # held closed: a probe of blocking() waits on it (each process has its own)
_PROBE_THREADS = []  # the threads this process probed a model on


def blocking(x):
    """Twice ``x``; a one-item call (the layout probe: the chunks have 4 items) waits for the gate first."""
    if len(x) == 1:
        _PROBE_THREADS.append(threading.get_native_id())  # (an ident may be reused; a TID is not soon)
        _PROBE_GATE.wait(30)
    return x * 2


def counted(x):
    """``x + 1``; one-item calls (probes) note their thread."""
    if len(x) == 1:
        _PROBE_THREADS.append(threading.get_native_id())  # (an ident may be reused; a TID is not soon)
    return x + 1


def test_a_model_whose_first_item_blocks_does_not_hold_the_run_and_the_next_probe_still_runs(process_client):
    """The layout probe (the model on the first item, on the client) gives up after ``dsched.probe-timeout``:
    the run goes on, its results correct, and a probe left running does not stop the next call's."""
    import dask

    _PROBE_THREADS.clear()
    scheduler = dsched.SimpleScheduler("cpu", 4)
    try:  # (off the steady path, which knows the layout from the first call's results and probes no more)
        with dask.config.set({"dsched.probe-timeout": 0.1, "dsched.steady-path": False}):
            first = dsched.dispatch(blocking, np.arange(8.0), scheduler=scheduler, client=process_client)
            second = dsched.dispatch(blocking, np.arange(8.0), scheduler=scheduler, client=process_client)
    finally:
        _PROBE_GATE.set()
    assert first.tolist() == second.tolist() == (np.arange(8.0) * 2).tolist()
    assert len(_PROBE_THREADS) == 2 and _PROBE_THREADS[0] != _PROBE_THREADS[1]  # the first was still busy


def test_consecutive_probes_run_on_one_thread_kept_for_them(process_client):
    """(The probe runs where the outputs live in shared memory: on worker processes.)"""
    scheduler = dsched.SimpleScheduler("cpu", 4)
    dsched.dispatch(counted, np.arange(8.0), scheduler=scheduler, client=process_client)
    _PROBE_THREADS.clear()
    for _ in range(3):  # a scheduler of its own each: a call like the one before would reuse its probed layout
        scheduler = dsched.SimpleScheduler("cpu", 4)
        assert dsched.dispatch(counted, np.arange(8.0), scheduler=scheduler, client=process_client).tolist() == \
            list(range(1, 9))
    assert len(_PROBE_THREADS) == 3 and len(set(_PROBE_THREADS)) == 1
    assert threading.get_native_id() not in _PROBE_THREADS


class _Scaled:
    """A model object (a weak reference tells whether anything still holds it)."""

    def __call__(self, x):
        return 3.0 * x


def test_the_kept_probe_thread_does_not_keep_the_last_model_alive(process_client):
    import gc
    import weakref

    model = _Scaled()
    out = dsched.dispatch(model, np.arange(8.0), scheduler=dsched.SimpleScheduler("cpu", 4), client=process_client)
    assert out.tolist() == (3.0 * np.arange(8.0)).tolist()
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None
