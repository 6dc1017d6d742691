"""A batch's job queue: push order, the caller that runs its own step, and the thread left asleep for a solver."""

import threading
from concurrent.futures import CancelledError

import pytest

from dsched.resident.jobs import Job, JobQueue


class _CountingCondition:
    """A condition that counts its notifications (how often a push woke the queue's thread)."""

    def __init__(self):
        self._cond = threading.Condition()
        self.notified = 0

    def notify_all(self):
        self.notified += 1
        self._cond.notify_all()

    def __getattr__(self, name):
        return getattr(self._cond, name)

    def __enter__(self):
        return self._cond.__enter__()

    def __exit__(self, *exc):
        return self._cond.__exit__(*exc)


def _queue():
    queue = JobQueue(name="test-batch")
    queue._cond = _CountingCondition()
    return queue


def _job(label, ran):
    return Job(label, (), (), lambda job: ran.append((label, threading.current_thread().name)))


@pytest.fixture
def solver_queue():
    """A queue whose caller ran its last job at once, as a solver's update then get does."""
    queue, ran = _queue(), []
    for _ in range(100):  # a caller that came within HAND_OFF_SECONDS: on a loaded machine, not always the first
        first = _job("first", ran)
        queue.push(first)
        queue.help(first)
        if first.awaited:
            break
    assert first.done and first.awaited
    del ran[:-1]  # the tests read what ran after the first job
    yield queue, ran
    queue.stop(timeout=10, cancel=True)


def test_a_solvers_steps_leave_the_thread_asleep_and_run_on_the_callers_thread(solver_queue):
    queue, ran = solver_queue
    notified = queue._cond.notified
    for i in range(100):  # update, then get at once: a Newton loop's steps
        step = _job(f"step{i}", ran)
        queue.push(step)
        queue.help(step)
    # Each push woke the thread before; now at most its first (the thread may have slept through the first step),
    # and one more for each time it slept between two pushes (a stall of IDLE_LOOKS looks).
    assert queue._cond.notified - notified <= 5
    assert sum(name == threading.current_thread().name for _, name in ran[1:]) >= 95


def test_an_update_no_caller_comes_for_still_runs_and_the_queue_wakes_its_thread_again(solver_queue):
    queue, ran = solver_queue
    overlapped = _job("overlapped", ran)
    queue.push(overlapped)
    assert overlapped.wait(10)  # a bound on a hang: the thread takes it within HAND_OFF_SECONDS
    assert overlapped.done and ran[-1] == ("overlapped", "test-batch")
    assert not queue._solver
    notified = queue._cond.notified
    queue.push(_job("next", ran))
    assert queue._cond.notified == notified + 1  # no longer a solver's queue: each push wakes the thread


def test_jobs_run_in_push_order_whoever_runs_them(solver_queue):
    queue, ran = solver_queue
    jobs = [_job(f"u{i}", ran) for i in range(5)]
    for job in jobs:
        queue.push(job)
    queue.help(jobs[2])  # runs u0..u2 here (or waits for the one the thread took)
    assert jobs[4].wait(10)
    assert [label for label, _ in ran[1:]] == ["u0", "u1", "u2", "u3", "u4"]


def test_closing_a_solvers_queue_cancels_what_is_pending_at_once(solver_queue):
    queue, ran = solver_queue
    gate, started = threading.Event(), threading.Event()

    def blocked(job):
        started.set()
        gate.wait(10)

    running = Job("running", (), (), blocked)
    pending = _job("pending", ran)
    queue.push(running)
    helper = threading.Thread(target=queue.help, args=(running,))
    helper.start()
    started.wait(10)
    queue.push(pending)
    gate.set()
    queue.stop(timeout=10, cancel=True)
    helper.join(10)
    assert pending.done and isinstance(pending.error, CancelledError)
    assert ("pending", "test-batch") not in ran
    assert queue._served.is_set()  # its thread has left it (to wait for the next queue a while)


def test_the_next_queue_takes_on_the_thread_of_a_stopped_one():
    """A batch opened after another closed runs its updates on the same thread: the feeds its dispatches parked
    (kept per calling thread) serve the next batch's."""
    ran = []
    first, second = JobQueue(name="first"), JobQueue(name="second")
    first.push(_job("a", ran))
    first.stop(timeout=10)
    second.push(_job("b", ran))
    second.stop(timeout=10)
    assert [label for label, _ in ran] == ["a", "b"] and [name for _, name in ran] == ["first", "second"]
    assert first._thread is second._thread


def test_a_stop_while_a_caller_runs_the_last_job_ends_once_that_job_ends():
    # The queue's thread asleep (a solver's queue, no push for a while) while the caller runs the last job itself:
    # that job's end must wake the thread to leave, or stop() waits for it forever. The caller must claim the job
    # within HAND_OFF_SECONDS (2 ms), else the queue's thread runs it: on a loaded machine, tried again.
    for _ in range(10):
        queue, go, started = JobQueue(name="test-batch"), threading.Event(), []
        queue._solver = True  # the caller runs its own job; the thread only looks
        job = Job("last", (), (), lambda job: (started.append(threading.current_thread()), go.wait(10)))
        queue.push(job)
        helper = threading.Thread(target=queue.help, args=(job,))
        helper.start()
        for _ in range(1000):  # the thread, past its looks, asleep until the next push
            if queue._asleep and queue._running is job or started and started[0] is not helper:
                break
            threading.Event().wait(0.01)
        for _ in range(1000):  # claimed: its run starts at once
            if started:
                break
            threading.Event().wait(0.01)
        if started and started[0] is helper:
            break
        go.set()  # the queue's thread took the job: not the case under test
        queue.stop(timeout=10)
        helper.join(10)
    assert started and started[0] is helper, "the caller never claimed its job within the hand-off"
    assert queue._asleep and queue._running is job
    stopping = threading.Thread(target=queue.stop)
    stopping.start()
    go.set()
    helper.join(10)
    stopping.join(10)
    assert not stopping.is_alive() and queue._served.is_set()
