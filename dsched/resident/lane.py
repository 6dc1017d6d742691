"""A batch's updates, run one after another on a thread of their own, in the order they were pushed.

:meth:`Batch.update <dsched.Batch.update>` returns at once. In host memory
(:class:`~dsched.resident.host_batch.HostBatch`) an update is a :class:`Job`:
one :func:`dsched.dispatch` over the batch (or a few, should a chunk fail), and
the swap of the fields' arrays after it. The :class:`Lane` runs the jobs in
push order, each after the one before has ended, so every update sees the fields
as the updates pushed before it left them; a job can be cancelled, before it
starts or while its dispatch runs (:class:`~dsched.dispatch.completion.Cancellation`,
as :meth:`dsched.DispatchFuture.cancel` does).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import CancelledError

from dsched.dispatch.completion import Cancellation, cancellable

__all__ = ["Job", "Lane"]


class Job:
    """One pushed operation: what it reads and writes, the work that does it, and how it ended.

    ``work(job)`` runs on the lane; whatever it raises is kept in ``error``. ``reported``: the error was raised
    to the caller once already (by a ``get``, ``reduce`` or ``wait`` of the batch).
    """

    def __init__(self, label, reads, writes, work):
        self.label, self.reads, self.writes, self.work = label, tuple(reads), tuple(writes), work
        self.error = None
        self.reported = False
        self.cancellation = Cancellation()
        self._ended = threading.Event()

    @property
    def done(self) -> bool:
        return self._ended.is_set()

    def wait(self):
        """Wait until the job has ended (a Ctrl-C interrupts the wait, not the job)."""
        self._ended.wait()

    def cancel(self):
        """A job not started never runs; a running one stops its dispatch where it waits next."""
        self.cancellation.cancel()

    def run(self):
        try:
            self.cancellation.check()
            with cancellable(self.cancellation):
                self.work(self)
        except BaseException as err:  # noqa: BLE001  kept for the caller, raised where it waits
            self.error = err if isinstance(err, Exception) else CancelledError(f"update {self.label!r}: {err!r}")
        finally:
            self.work = None  # the update's inputs and out arrays are not kept once it ran
            self._ended.set()

    def __repr__(self):
        state = "failed" if self.error is not None else "done" if self.done else "pending"
        return f"<Job {self.label!r} {state}>"


class Lane:
    """A thread that runs :class:`Job` objects in the order :meth:`push` gave them; started by the first push."""

    def __init__(self, name="dsched-batch"):
        self.name = name
        self._inbox = queue.SimpleQueue()
        self._running = [None]  # the job the thread runs now
        self._thread = None
        self._lock = threading.Lock()
        self._stopped = False

    def push(self, job):
        with self._lock:
            if self._stopped:
                raise RuntimeError("this Batch is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=_serve, args=(self._inbox, self._running), name=self.name,
                                                daemon=True)
                self._thread.start()
        self._inbox.put(job)

    def stop(self, timeout=None, cancel=False):
        """No more jobs; wait (at most ``timeout`` seconds) for the thread to end the ones it has (``cancel``: the
        one it runs is cancelled first)."""
        with self._lock:
            self._stopped, thread = True, self._thread
        running = self._running[0]
        if cancel and running is not None:
            running.cancel()
        self._inbox.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def _serve(inbox, running):
    while True:
        job = inbox.get()
        if job is None:
            return
        running[0] = job
        job.run()
        running[0] = job = None  # an idle lane keeps no job (nor its arrays) alive
