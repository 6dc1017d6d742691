"""A batch's updates, run one after another in the order they were pushed, on a thread of their own.

:meth:`Batch.update <dsched.Batch.update>` returns at once. In host memory
(:class:`~dsched.resident.host_batch.HostBatch`) an update is a :class:`Job`:
one :func:`dsched.dispatch` over the batch (or a few, should a chunk fail), and
the swap of the fields' arrays after it. The :class:`JobQueue` runs the jobs in
push order, each after the one before has ended, so every update sees the fields
as the updates pushed before it left them; a job can be cancelled, before it
starts or while its dispatch runs (:class:`~dsched.dispatch.completion.Cancellation`,
as :meth:`dsched.DispatchFuture.cancel` does).

A caller that waits for a job the queue's thread has not started runs it itself
(:meth:`JobQueue.help`): a solver's ``update`` then ``get`` costs one call, with no
hand-off to another thread and back.

Nor a wake-up of the queue's thread. On a busy node, waking a thread that then
finds nothing to do costs as much as the step itself (it takes a core from the
caller and the workers). So once a caller came for a job within
:data:`HAND_OFF_SECONDS` of its push, the queue takes its caller for a solver: a
push no longer wakes the thread, which looks every :data:`HAND_OFF_SECONDS` and runs
only a job no caller came for in that time. A job that waited so (an update
overlapped with the caller's own work) puts the queue back to waking its thread on
every push: an overlapped update starts late at most once, by that much.

A queue's thread outlives its queue for a while (:data:`THREAD_KEPT_SECONDS`): the
next queue, a batch opened after this one closed (a driver per history), takes it
on. Its dispatches then find the feeds the last batch's runs parked on the
workers, which are kept per calling thread: no new feed task, a scheduler round
trip, per batch.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import CancelledError

from dsched.dispatch.completion import Cancellation, cancellable

__all__ = ["Job", "JobQueue", "HAND_OFF_SECONDS", "THREAD_KEPT_SECONDS"]

HAND_OFF_SECONDS = 0.002  # a solver's queue: how long a pushed job waits for its caller before the thread runs it
IDLE_LOOKS = 25  # looks of a solver's queue's thread with no push between, before it sleeps until the next push
THREAD_KEPT_SECONDS = 5.0  # how long a queue's thread, its queue stopped, waits for a new queue to take it on


class Job:
    """One pushed operation: what it reads and writes, the work that does it, and how it ended.

    ``work(job)`` runs once, on the queue's thread or on a thread that waits for it; whatever it raises is kept in
    ``error`` (a Ctrl-C is kept as a ``CancelledError`` and raised on). ``reported``: the error was raised to the
    caller once already (by a ``get``, ``reduce`` or ``wait`` of the batch).
    """

    def __init__(self, label, reads, writes, work):
        self.label, self.reads, self.writes, self.work = label, tuple(reads), tuple(writes), work
        self.error = None
        self.reported = False
        self.pushed = 0.0  # time.monotonic() of its push
        self.awaited = False  # a caller came for it within HAND_OFF_SECONDS of its push
        self.cancellation = Cancellation()
        self._ended = threading.Lock()  # held until the job has ended (cheaper to make than an Event, per step)
        self._ended.acquire()

    @property
    def done(self) -> bool:
        return not self._ended.locked()

    def wait(self, timeout=None) -> bool:
        """Wait until the job has ended, at most ``timeout`` seconds (a Ctrl-C interrupts the wait, not the job);
        whether it has."""
        if not self._ended.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._ended.release()
        return True

    def cancel(self):
        """A job not started never runs; a running one stops its dispatch where it waits next."""
        self.cancellation.cancel()

    def run(self):
        try:
            self.cancellation.check()
            with cancellable(self.cancellation):
                self.work(self)
        except Exception as err:  # noqa: BLE001  kept for the caller, raised where it waits
            self.error = err
        except BaseException as err:  # a Ctrl-C on the thread that helps: the job is over, the interrupt goes on
            self.error = CancelledError(f"update {self.label!r}: {type(err).__name__}")
            raise
        finally:
            self.work = None  # the update's inputs and out arrays are not kept once it ran
            self._ended.release()

    def __repr__(self):
        state = "failed" if self.error is not None else "done" if self.done else "pending"
        return f"<Job {self.label!r} {state}>"


class JobQueue:
    """Runs :class:`Job` objects one at a time, in the order :meth:`push` gave them, on a thread started by the
    first push, or on a thread that waits for one (:meth:`help`)."""

    def __init__(self, name="dsched-batch"):
        self.name = name
        self._pending = collections.deque()  # pushed and not ended, in order; the first may be running
        self._running = None  # the job some thread runs now
        self._cond = threading.Condition()
        self._thread = None
        self._served = threading.Event()  # the thread has left this queue (stopped, every job ended)
        self._stopped = False
        self._solver = False  # the last job's caller came for it at once: pushes leave the thread be
        self._pushes = 0
        self._asleep = False  # the thread waits for a push with no time limit: the next push must wake it

    def push(self, job):
        with self._cond:
            if self._stopped:
                raise RuntimeError("this Batch is closed")
            job.pushed = time.monotonic()
            self._pending.append(job)
            self._pushes += 1
            if self._thread is None:
                self._thread = _QueueThread.serve(self)
            if self._asleep or not self._solver:  # a solver's queue: its thread looks by itself (module docs)
                self._asleep = False  # woken now, whenever it next runs
                self._cond.notify_all()

    def help(self, job):
        """Until ``job`` has ended: run on this thread the jobs up to it that no thread has started, in order;
        wait for those another thread runs."""
        if not job.awaited and time.monotonic() - job.pushed < HAND_OFF_SECONDS:
            job.awaited = True
        while not job.done:
            head = self._claim(until=job)
            if head is None:
                job.wait()
                return
            try:
                head.run()
            finally:
                self._release(head)

    def stop(self, timeout=None, cancel=False):
        """No more jobs; wait (at most ``timeout`` seconds) for the thread to end the ones pushed (``cancel``: each
        is cancelled first, so they end at once)."""
        with self._cond:
            self._stopped, thread = True, self._thread
            if cancel:
                for job in self._pending:
                    job.cancel()
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            self._served.wait(timeout)

    def _claim(self, until=None):
        """The first pending job, now marked running, if no thread runs one (and it is ``until`` or before it)."""
        with self._cond:
            if self._running is not None or not self._pending or (until is not None and until not in self._pending):
                return None
            self._running = self._pending[0]
            return self._running

    def _release(self, job):
        with self._cond:
            self._pending.popleft()
            self._running = None
            self._solver = job.awaited
            if self._pending or self._stopped:  # the next one may be the thread's to run, or the thread may leave
                self._cond.notify_all()

    def _serve(self):
        while True:
            with self._cond:
                job = self._next_for_thread()
                if job is None:
                    return
            try:
                job.run()
            finally:
                self._release(job)
                job = None  # an idle lane keeps no job (nor its arrays) alive

    def _next_for_thread(self):
        """(Under the lock) the job the thread runs next, once there is one for it; ``None`` once stopped and
        done. A solver's queue leaves each job to its caller for :data:`HAND_OFF_SECONDS`."""
        idle, pushes = 0, self._pushes
        while True:
            if pushes != self._pushes:
                idle, pushes = 0, self._pushes
            if self._running is None and self._pending:
                head = self._pending[0]
                wait = 0.0 if self._stopped or not self._solver else head.pushed + HAND_OFF_SECONDS - time.monotonic()
                if wait <= 0:
                    self._running = head
                    return head
                self._cond.wait(wait)
            elif self._stopped and not self._pending:
                return None
            elif self._solver and idle < IDLE_LOOKS:  # a solver between steps: look again soon, unasked
                idle += 1
                self._cond.wait(HAND_OFF_SECONDS)
            else:
                self._asleep = True
                self._cond.wait()
                self._asleep = False


class _QueueThread:
    """A thread that serves one :class:`JobQueue` after another: once its queue is stopped and done, it waits
    :data:`THREAD_KEPT_SECONDS` for the next queue (and ends if none comes)."""

    _idle = []  # threads waiting for a queue, the most recent last
    _lock = threading.Lock()

    def __init__(self):
        self._next = None
        self._given = threading.Condition(self._lock)
        self.thread = threading.Thread(target=self._loop, name="dsched-batch", daemon=True)

    @classmethod
    def serve(cls, queue) -> threading.Thread:
        """A thread serving ``queue`` from now on: an idle one, else a new one."""
        with cls._lock:
            server = cls._idle.pop() if cls._idle else None
            if server is not None:
                server._next = queue
                server._given.notify()
                return server.thread
        server = cls()
        server._next = queue
        server.thread.start()
        return server.thread

    def _loop(self):
        while True:
            with self._lock:
                queue, self._next = self._next, None
            self.thread.name = queue.name
            try:
                queue._serve()
            finally:
                with self._lock:  # idle before its queue is told: a queue made once that one is served finds it
                    self._idle.append(self)
                queue._served.set()
                queue = None  # an idle thread keeps no queue (nor its batch) alive
            with self._lock:
                self._given.wait_for(lambda: self._next is not None, THREAD_KEPT_SECONDS)
                if self._next is None:  # no queue came: this thread ends
                    self._idle.remove(self)
                    return
