"""Predicted against measured chunk times: the run observer that takes a policy's predictions to the report and the scheduler.

How predictions travel
----------------------
The policy predicts on the client:
:class:`~dsched.schedulers.PerformanceModelScheduler` plans each chunk with
its device's cost model when the dispatcher calls ``dispatched_work(device, n)``,
and tells what it predicted through ``predicted_seconds(device, n)``. The
measured time is the chunk's compute interval on its worker, which reaches
the client in the chunk's :class:`~dsched.observe.report.ChunkRecord`. Both are
on the client, so they are paired there, by this observer, with no change to
the policy's protocol, the transports or the tasks:

1. ``work_dispatched`` (right after ``dispatched_work``, before the chunk's
   record exists): the observer asks the policy for its prediction and keeps
   it under the chunk's index (the n-th chunk dispatched in a run is record n).
2. ``chunk_completed``: the prediction goes into ``record.predicted``, so
   :attr:`RunReport.prediction_error <dsched.observe.report.RunReport.prediction_error>`
   (the median relative error) and ``dsched run``'s table have it. Once the
   record has its worker and its measured times, the pair
   ``(device, worker, predicted, measured)`` is queued for the scheduler;
   records that get their times only from the run's final gather are queued
   at ``run_finished``.
3. The queue joins the run's page events (:func:`~dsched.observe.dashboard.client.tell_page`,
   as ``(PREDICTIONS, run id, client id, pairs)``), at most every
   :data:`FLUSH_SECONDS` while the run goes on and once at its end: a timer on
   the client's event loop sends them to the scheduler, so the dispatching
   thread never waits for it (a message answered through the event loop costs
   a millisecond or more, in which no chunk is sent). The dsched dashboard
   plugin hears them in its ``log_event`` hook, as it hears the feeds' chunk
   events, and keeps them per device and host (the ``/metrics`` families) and
   per run (the page's "predicted against measured" plot);
   :func:`~dsched.observe.dashboard.client.flush_page` returns once it has.

Not chosen: a task annotation (a feed's chunks are no tasks, and the scheduler
would still miss the measured time), and the policy sending the pairs itself
(policies do not know the cluster: a contract of ``pyproject.toml``).

In a sync run (no cluster, no ``dispatched_work``) a chunk runs on the
dispatching thread and the policy learns nothing between its choice and its
end, so the prediction is asked at ``chunk_completed``; nothing is sent.

The dispatcher adds a :class:`PredictionObserver` to every run whose policy
predicts (:meth:`PredictionObserver.applies_to`).
"""

from __future__ import annotations

import time

from dsched.devices.device import Device
from dsched.names import PREDICTIONS
from dsched.observe.dashboard.client import tell_page
from dsched.observe.hooks import RunObserver

__all__ = ["PredictionObserver", "PREDICTIONS", "FLUSH_SECONDS"]

#: the least seconds between two events of one run
FLUSH_SECONDS = 0.5


class PredictionObserver(RunObserver):
    """Pairs each chunk's predicted seconds with its measured ones: into its record, and to the scheduler.

    Parameters
    ----------
    flush_seconds : float
        The least seconds between two events sent to the scheduler during a run.
    """

    def __init__(self, flush_seconds: float = FLUSH_SECONDS):
        self.flush_seconds = flush_seconds
        self.run = None
        self._start(None)

    @staticmethod
    def applies_to(scheduler) -> bool:
        """Whether ``scheduler`` predicts chunk times (has ``predicted_seconds(device, n)``)."""
        return callable(getattr(scheduler, "predicted_seconds", None))

    def _start(self, run):
        self.run = run
        self._predict = getattr(run.scheduler, "predicted_seconds", None) if run is not None else None
        self._dispatched = 0
        self._predicted = {}  # record index -> (Device, n, predicted seconds)
        self._untimed = {}  # record index -> record predicted, waiting for its worker and times
        self._queue = []
        self._last_flush = time.monotonic()

    def run_started(self, run):
        self._start(run)

    def work_dispatched(self, device, n, start, stop):
        index = self._dispatched
        self._dispatched += 1
        if self._predict is not None:
            seconds = self._predict(device, n)
            if seconds is not None:
                self._predicted[index] = (Device(device), int(n), float(seconds))

    def chunk_completed(self, record):
        if self._predict is None:
            return
        kept = self._predicted.pop(record.index, None)
        if kept is not None and kept[:2] == (record.device, record.size):
            record.predicted = kept[2]
        elif self.run.mode == "sync":
            seconds = self._predict(record.device, record.size)
            record.predicted = None if seconds is None else float(seconds)
        if record.predicted is None or record.error is not None or self.run.client is None:
            return
        if not self._queued(record):
            self._untimed[record.index] = record
        if self._queue and time.monotonic() - self._last_flush >= self.flush_seconds:
            self._flush()

    def run_finished(self, report):
        if self.run is None or self.run.client is None:
            return
        for record in self._untimed.values():  # their times came with the final gather
            self._queued(record)
        self._untimed.clear()
        self._flush()

    def _queued(self, record) -> bool:
        """Queue the record's pair for the scheduler, if it has its worker and times."""
        if record.worker is None or not record.stop > record.start:
            return False
        self._queue.append((str(record.device), str(record.worker), record.predicted, record.duration))
        return True

    def _flush(self):
        self._last_flush = time.monotonic()
        if not self._queue:
            return
        pairs, self._queue = self._queue, []
        client = self.run.client
        tell_page(client, [(PREDICTIONS, self.run.run_id, client.id, pairs)])
