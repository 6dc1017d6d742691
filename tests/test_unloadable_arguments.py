"""An argument a worker process cannot load fails its chunks with the reason, and the workers stay.

distributed drops a worker whose message does not unpickle, with every chunk it held: a GPU run found it, when
a caller's CuPy array reached the CPU worker of a real GPU machine (which sees no GPU), the worker went, and the
call waited 30 s for it. dsched seals each chunk's work (``SealedWork``) so that it is opened by the chunk itself,
and a fast lane whose message does not load is dropped, its chunks run again as sealed tasks.
"""

import time

import numpy as np
import pytest

import dsched
from chunk_models import LoadsOnlyHere, double_x
from dsched.errors import DispatchError

REASON = "the chunk's arguments cannot be loaded on this worker: RuntimeError: this value loads only in the process"


@pytest.fixture
def client(process_client):
    return process_client


def scheduler():
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[100, 300], capacities=[200, 600])


def workers(client):
    return set(client.scheduler_info(n_workers=-1)["workers"])


def test_a_whole_argument_the_workers_cannot_load_fails_every_chunk_with_the_reason(client):
    before, x = workers(client), np.arange(1000.0)
    started = time.monotonic()
    with pytest.raises(DispatchError) as caught:
        dsched.dispatch(lambda d: 2.0 * d["x"], {"x": x, "w": LoadsOnlyHere(1.0)}, scheduler=scheduler(),
                        client=client)
    assert time.monotonic() - started < 20  # not the 30 s a lost worker is waited for
    assert REASON in str(caught.value)
    assert workers(client) == before  # no worker was dropped
    np.testing.assert_array_equal(dsched.dispatch(lambda d: 2.0 * d["x"], {"x": x, "w": 1.0}, scheduler=scheduler(),
                                                  client=client), 2.0 * x)


def test_on_the_fast_lanes_of_like_runs_too(client):
    d = dsched.WorkDispatcher(scheduler(), double_x, join="concat", client=client)
    x = np.arange(2000.0)
    for _ in range(2):  # the second run goes over the fast lanes alone (the steady path)
        np.testing.assert_array_equal(d.run(dsched.MappingLoader({"x": x, "w": 1.0})), 2.0 * x)
    assert d._steady is not None
    before = workers(client)
    with pytest.raises(DispatchError) as caught:
        d.run(dsched.MappingLoader({"x": x, "w": LoadsOnlyHere(1.0)}))
    assert REASON in str(caught.value)
    assert workers(client) == before
    np.testing.assert_array_equal(d.run(dsched.MappingLoader({"x": x, "w": 1.0})), 2.0 * x)


def test_sealed_work_keeps_a_large_whole_array_out_of_the_blob():
    """A sealed chunk's large arrays stay out of band, as Dask's own pickling keeps them: no copy per chunk."""
    import pickle

    from dsched.dataplane.store import SealedWork

    table = np.arange(1_000_000.0)
    sealed = SealedWork.of({"x": "rows", "table": table})
    assert len(sealed.blob) < 10_000 and sum(memoryview(b).nbytes for b in sealed.buffers) == table.nbytes
    frames = []
    data = pickle.dumps(sealed, protocol=5, buffer_callback=frames.append)  # as Dask sends a task's arguments
    assert len(data) < 10_000
    opened = pickle.loads(data, buffers=frames).open()
    assert opened["x"] == "rows"
    np.testing.assert_array_equal(opened["table"], table)



def test_a_fn_that_does_not_pickle_is_a_one_line_error_saying_why(client):
    import threading

    lock, x = threading.Lock(), np.arange(1000.0)
    # Feeds started for the call get fn in their task, parked ones over their lanes: either way one line with the
    # reason, not Dask's "Could not serialize object of type ..." and its graph (nor the pickler's alone).
    for _ in range(2):  # the second finds the first's feeds parked
        with pytest.raises(TypeError, match=r"^fn: cannot be sent to the workers \(TypeError: cannot pickle "
                                            r"'_thread.lock' object\); it must pickle[^\n]*$"):
            dsched.dispatch(lambda a: a + (lock is None), x, scheduler=scheduler(), client=client)
        np.testing.assert_array_equal(dsched.dispatch(np.square, x, scheduler=scheduler(), client=client), x * x)
