"""dsched.submit: a dispatch that returns a future at once; overlap, order, errors, cancel. On worker processes."""

import os
import time
from concurrent.futures import CancelledError

import numpy as np
import pytest

import dsched
from dsched import SimpleScheduler, StaticHybridScheduler
from dsched.errors import DispatchError

WAIT_LIMIT = 60.0  # a chunk waiting for the caller gives up after this (the test then fails, it never hangs)


def wait_for_file(x, path):
    """Per item: 1.0 if ``path`` appeared while the chunk waited for it (the caller made it meanwhile).
    Says it started by making ``path.started``."""
    open(path + ".started", "w").close()
    deadline = time.monotonic() + WAIT_LIMIT
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    return np.full(x.shape[0], float(os.path.exists(path)))


@pytest.fixture(scope="module")
def scheduler():
    return StaticHybridScheduler(["cpu", "cuda:0"], [3, 4])


def test_the_result_is_dispatchs_and_the_call_returns_before_its_chunks_run(process_client, scheduler, tmp_path):
    """The caller's own work (making the file) runs while the chunks are in flight: they wait for it, so a
    submit that blocked until they finished would leave them to give up, and the result would hold zeros."""
    flag = str(tmp_path / "caller-was-here")
    future = dsched.submit(wait_for_file, np.zeros(10), scheduler=scheduler, client=process_client, path=flag)
    assert not future.done()
    open(flag, "w").close()  # the caller's work, overlapping the devices'
    assert future.result(timeout=WAIT_LIMIT).tolist() == [1.0] * 10
    assert future.done() and not future.cancelled() and future.exception() is None


def affine(x, a):
    return a * x + 1


def test_several_calls_in_flight_on_one_scheduler_run_in_order_with_exact_loads(process_client, scheduler):
    x = np.arange(20.0)
    futures = [dsched.submit(affine, x, k, scheduler=scheduler, client=process_client) for k in range(5)]
    for k, future in enumerate(futures):
        np.testing.assert_array_equal(future.result(timeout=60), k * x + 1)
    assert all(s.load == 0 for s in scheduler.status())


def fails_on_negative(x):
    if (x < 0).any():
        raise ValueError("negative input")
    return x


def test_a_failure_arrives_at_result_with_the_type_dispatch_raises(process_client, scheduler):
    x = np.arange(10.0) - 5
    with pytest.raises(Exception) as direct:
        dsched.dispatch(fails_on_negative, x, scheduler=scheduler, client=process_client)
    future = dsched.submit(fails_on_negative, x, scheduler=scheduler, client=process_client)
    with pytest.raises(type(direct.value)) as later:
        future.result(timeout=60)
    assert isinstance(later.value, DispatchError) and str(later.value) == str(direct.value)
    assert isinstance(future.exception(), type(direct.value))


def test_a_mistake_in_the_call_raises_at_submit_before_any_work(process_client, scheduler):
    with pytest.raises(ValueError, match=r"^args\[1\] \('a' of affine\): size 3 along axis 0 is not compatible; "
                                         r"expected 1 or 10$"):
        dsched.submit(affine, np.zeros(10), np.zeros(3), scheduler=scheduler, client=process_client)
    with pytest.raises(TypeError, match=r"^clinet: not a keyword of dispatch, .*did you mean client=\?$"):
        dsched.submit(affine, np.zeros(10), 1.0, scheduler=scheduler, clinet=process_client)


def test_cancel_stops_a_running_call_and_one_waiting_behind_it(process_client, scheduler, tmp_path):
    flag = str(tmp_path / "release")
    running = dsched.submit(wait_for_file, np.zeros(10), scheduler=scheduler, client=process_client, path=flag)
    waiting = dsched.submit(affine, np.zeros(10), 2.0, scheduler=scheduler, client=process_client)
    assert waiting.cancel() and waiting.cancelled()
    deadline = time.monotonic() + WAIT_LIMIT
    while not os.path.exists(flag + ".started") and time.monotonic() < deadline:
        time.sleep(0.005)  # until a chunk of the first call runs on a worker
    assert not running.done()
    started = time.monotonic()
    assert running.cancel()
    with pytest.raises(CancelledError):
        running.result(timeout=WAIT_LIMIT)
    assert time.monotonic() - started < WAIT_LIMIT / 2  # it did not wait for its chunks to give up
    assert running.cancelled() and not running.cancel()  # ended: nothing more to cancel
    with pytest.raises(CancelledError):
        waiting.result(timeout=1)
    open(flag, "w").close()  # lets the abandoned chunks end on their workers
    # The loads were given back, and the devices run the next call.
    assert all(s.load == 0 for s in scheduler.status())
    np.testing.assert_array_equal(dsched.submit(affine, np.ones(10), 3.0, scheduler=scheduler,
                                                client=process_client).result(timeout=60), np.full(10, 4.0))


def test_calls_with_different_schedulers_run_at_the_same_time(process_client, tmp_path):
    """The second call's chunk makes the file the first call's chunk waits for: only at the same time can both end."""
    flag = str(tmp_path / "from-the-other-call")
    first = dsched.submit(wait_for_file, np.zeros(2), scheduler=SimpleScheduler("cpu", 2), client=process_client,
                          path=flag)
    second = dsched.submit(lambda x: (open(flag, "w").close(), x)[1], np.zeros(2),
                           scheduler=SimpleScheduler("cuda:0", 2), client=process_client)
    assert second.result(timeout=WAIT_LIMIT).tolist() == [0.0, 0.0]
    assert first.result(timeout=WAIT_LIMIT).tolist() == [1.0, 1.0]


def test_sync_mode_and_a_done_callback():
    seen = []
    future = dsched.submit(np.sqrt, np.array([4.0, 9.0]), scheduler=SimpleScheduler("cpu", 1), mode="sync")
    future.add_done_callback(lambda f: seen.append(f.result().tolist()))
    assert future.result(timeout=30).tolist() == [2.0, 3.0]
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [[2.0, 3.0]]
