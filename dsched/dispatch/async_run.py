"""One async run: NEML2's dispatch loop over a Dask cluster, with each device kept at its capacity.

The loop: schedule while the policy has room, send the chunks, wait for one
completion (or a tick), account for it, repeat; after a failure, stop
scheduling and wait for what is in flight. The client keeps the load
accounting, because Dask resources only limit execution on a worker, not
assignment to it. Ticks look for chunks past their timeout and for devices
that lost their workers.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import dask

from dsched.dataplane.rundata import direct_to_workers
from dsched.devices.device import Device, device_resource, placement_device
from dsched.devices.ownership import device_threads
from dsched.dispatch.completion import DeviceWatch, Mailbox, current_cancellation, notify_when_done
from dsched.dispatch.feeds import FeedOutcome, Feeds, FeedTicket, LaneLost
from dsched.errors import ChunkTimeoutError
from dsched.names import ITEMS_ANNOTATION, is_feed_key
from dsched.observe.report import ChunkRecord, service_seconds
from dsched.worker.chunk import InFlight, PackError, run_chunk, run_pack

__all__ = ["AsyncRun", "TICK_SECONDS", "TaskSender", "distinct", "record_dispatch"]

_CANCEL = object()  # the mailbox notice of a cancel() from another thread
TICK_SECONDS = 1.0  # how often an async run looks for chunks past their timeout and devices without workers


class AsyncRun:
    """The state of one async run: chunks in flight, their futures, timeouts and lost devices.

    The loop is NEML2's: schedule while the scheduler has room, submit, wait
    for one completion (or a tick), account for it, repeat; after a failure,
    stop scheduling and wait for what is in flight.

    Chunks travel by one of two transports: the run's device feeds
    (:mod:`dsched.dispatch.feeds`) for devices whose workers share this process or
    host, one direct message per chunk (or per batch of short ones), whose replies are
    the completions; or tasks and
    packs (:class:`TaskSender`) for the others. Whatever watches the run
    (traces, progress, the dashboard) hangs off ``observers``
    (:mod:`dsched.observe.hooks`), not off branches in this loop.

    Parameters
    ----------
    client, data, report, run_id, cluster
        The run's Dask client, data plane (:class:`~dsched.dataplane.RunData`),
        report being filled, key prefix, and the cluster's identity (read once).
    scheduler : WorkScheduler
        The policy; the run calls ``dispatched_work`` and ``completed_work``.
    program : ChunkProgram
        What runs on the worker for each chunk.
    next_chunk : callable
        ``next_chunk()`` -> ``(device, m, work, offset)``, or ``None`` when the policy has no room.
    observers : Observers
        The run's observers.
    join : bool
        Whether results are joined in place (``join="concat"``) rather than kept per chunk.
    timeout : float or None
        Seconds a chunk may take from its dispatch.
    """

    def __init__(self, client, data, report, run_id, cluster, *, scheduler, program, next_chunk, observers,
                 join=False, timeout=None):
        self.client, self.data, self.report, self.run_id = client, data, report, run_id
        self.scheduler, self.program, self.next_chunk, self.observers = scheduler, program, next_chunk, observers
        self.join, self.timeout = join, timeout
        # Futures, (key, i, ok, start, stop) pack events and FeedOutcomes, from the event loop (and lanes' lost
        # chunks, from this thread); the run waits on it and on its fast lanes at once.
        self.done = Mailbox()
        self.in_flight = {}  # record index -> InFlight, until the chunk is accounted for
        self.members = {}  # task key -> record indexes of its chunks
        self.outstanding = {}  # record index -> record dispatched and not yet completed
        self.futures = []  # per record, the (last) future of its task
        self.failed = False
        self.watch = DeviceWatch(client, workers=cluster["workers"])
        self.observe = getattr(self.scheduler, "observe", None)  # a policy that learns from chunk timings
        self.last_stops = {}  # (worker, device) -> its latest chunk's end: what service_seconds reads
        self.tasks = TaskSender(client, program, run_id, self.watch, self.done.put, learns=self.observe is not None)
        self.threads = device_threads(client, cluster["workers"])  # chunks of a device that can run at once
        self.feeds = self._feeds(cluster)
        self.next_tick = time.monotonic() + TICK_SECONDS  # when to look for timeouts and lost devices
        # A submitted call's cancel() wakes the loop, which then raises where it waits (see _handle).
        self.cancellation = current_cancellation()
        if self.cancellation is not None:
            self.cancellation.bind(lambda: self.done.put(_CANCEL))

    def _feeds(self, cluster):
        """The run's device feeds (:mod:`dsched.dispatch.feeds`) for devices whose workers map its store, if enabled.

        A run with a timeout sends its chunks as tasks, which Dask can cancel one by one; so does a run
        over a Dask array, whose rows travel as futures (only a task's arguments resolve them).
        """
        if not dask.config.get("dsched.feeds", True) or self.timeout is not None or self.data.streams_dask:
            return None
        local = {d: a for d, a in self.data.owners.items() if d not in self.data.remote and a}
        if not local:
            return None
        sizes = {Device(s.device): s.batch_size for s in self.scheduler.status()}
        return Feeds(self.client, self.program, self.run_id, local, self.done.put, cluster, sizes)

    def close(self):
        if self.cancellation is not None:
            self.cancellation.bind(None)
        if self.feeds is not None:
            self.feeds.close()
        self.tasks.close()
        self.done.close()

    def loop(self):
        generator = self.data.generator
        while True:
            groups = defaultdict(list)
            while not self.failed and generator.has_more():
                chunk = self.next_chunk()
                if chunk is None:
                    break
                record, work = self._dispatched(*chunk)
                device = self.watch.where(record.device)
                if self.feeds is not None and self.feeds.started(device) and self.feeds.serves(device) \
                        and self.feeds.on_lane(device):
                    self._feed(device, [(record, work)])  # at once: its worker starts while the next is scheduled
                else:
                    groups[device].append((record, work))
            if self.feeds is not None:  # every new device's feeds at once: their tasks and lanes start together
                self.feeds.start(list(groups))
            for device, chunks in groups.items():
                self._submit(device, chunks)
            if not self.in_flight:
                if not self.failed and generator.has_more():
                    # Nothing of ours is running, so no completion of ours can make room:
                    # the load is another run's (a scheduler shared by concurrent dispatchers).
                    raise RuntimeError(
                        f"{self.scheduler!r} has no room for the next chunk and this run has none in flight; "
                        "a scheduler cannot be shared by dispatchers running at the same time"
                    )
                return
            for item in self._next_notices(self._tick_seconds()):
                self.failed |= self._handle(item)
            if time.monotonic() >= self.next_tick:  # also while other chunks keep finishing
                self._tick()

    def _next_notices(self, timeout) -> list:
        """Wait at most ``timeout`` seconds for completion notices: replies read from the fast lanes that ready
        first, then whatever the event loop queued."""
        lanes = self.feeds.waiting_lanes() if self.feeds is not None else {}
        # Replies read while a send waited for room (Lane.pending) are no longer in the socket: taken first.
        ready = [c for c, feed in lanes.items() if feed.lane.pending] or self.done.wait(list(lanes), timeout)
        notices = [outcome for connection in ready for outcome in self.feeds.receive(lanes[connection])]
        return notices + self.done.drain()

    def _handle(self, item) -> bool:
        """One completion notice: a feed's reply, a pack's chunk event, or a finished task; whether it failed."""
        if item is _CANCEL:
            self.cancellation.check()
            return False
        if isinstance(item, FeedOutcome):
            return self._fed(item)
        if isinstance(item, LaneLost):  # its chunks' outcomes come next, through the mailbox
            self.feeds.lane_lost(item.feed)
            return False
        if isinstance(item, tuple):
            return self._event(item)
        if is_feed_key(item.key):
            self.feeds.ended(item)
            return False
        return self._complete(item)

    def _dispatched(self, device, m, work, offset):
        record = record_dispatch(self.scheduler, self.observers, self.report, device, m, offset)
        self.outstanding[record.index] = record
        self.futures.append(None)
        return record, work

    # --- submission -------------------------------------------------------------

    def _submit(self, device, chunks, retry=False):
        """Send ``chunks`` (``(record, work)``) to ``device``'s workers, as packs or one task per chunk.

        Chunks beyond the device's threads would only queue on its workers: they are
        packed, as many packs as the device has threads, so that its threads stay busy.
        """
        if self.feeds is not None and self.feeds.serves(device):
            self._feed(device, chunks)
            return
        lanes = max(1, self.threads.get(placement_device(device), 1))
        # A result that travels back by value is available only when its whole pack ends: such chunks
        # (before the output layout is known, or for a remote device) are not packed.
        packable = not self.join or self.data.writes_in_place(device)
        if self.tasks.packs_chunks(len(chunks), lanes, packable):
            for lane in range(lanes):
                self._send(device, chunks[lane::lanes], retry)
        else:
            for chunk in chunks:
                self._send(device, [chunk], retry)

    def _send(self, device, chunks, retry):
        """One task for ``chunks`` (:class:`TaskSender`), and their entries in flight."""
        deadline = time.monotonic() + self.timeout if self.timeout is not None else float("inf")
        records = [record for record, _ in chunks]
        slots = [self.data.slot(device, r.offset, r.offset + r.size, r.index) for r in records]
        works = [self.data.task_work(device, work) for _, work in chunks]
        futures = self.tasks.send(device, records, works, slots, retry)
        for (record, work), slot, future in zip(chunks, slots, futures):
            self.in_flight[record.index] = InFlight(record, work, future, slot is not None, deadline)
            self.members.setdefault(future.key, []).append(record.index)
            self.futures[record.index] = future
        notify_when_done(self.client, distinct(futures), self.done.put)

    def _feed(self, device, chunks):
        """Send ``chunks`` to ``device``'s feeds, one message each (no task per chunk)."""
        slots = [self.data.slot(device, r.offset, r.offset + r.size, r.index) for r, _ in chunks]
        tickets = self.feeds.send(device, [(r.index, r.size, work, slot) for (r, work), slot in zip(chunks, slots)])
        for (record, work), slot, ticket in zip(chunks, slots, tickets):
            self.in_flight[record.index] = InFlight(record, work, ticket, slot is not None, float("inf"))
            self.members[ticket.key] = [record.index]
            self.futures[record.index] = ticket

    # --- completion ------------------------------------------------------------

    def _fed(self, outcome) -> bool:
        """A feed replied for a chunk; a chunk whose worker could not be reached runs again, as a task."""
        entry = self.in_flight.get(outcome.index)
        if entry is None or entry.future is not outcome.ticket:
            return False  # moved elsewhere meanwhile (a lost device)
        if outcome.lost:  # its feed is marked lost: the device's chunks now go as tasks
            del self.in_flight[outcome.index]
            self._submit(self.watch.where(entry.record.device), [(entry.record, entry.work)], retry=True)
            return False
        return self._settle([outcome.index], {outcome.index: entry}, outcome.address,
                            [(outcome.ok, outcome.value, outcome.start, outcome.stop)])

    def _event(self, event) -> bool:
        """A pack's chunk finished: account for it now if it succeeded and needs nothing from its outcome."""
        key, position, ok, start, stop = event
        indexes = self.members.get(key)
        if not ok or indexes is None or position >= len(indexes):
            return False  # a failure is reported with the pack's outcomes
        entry = self.in_flight.get(indexes[position])
        if entry is None or (not entry.in_place and self.join):
            return False  # already accounted for, or its result is written from the pack's outcomes
        entry.record.start, entry.record.stop = start, stop
        return self._done(entry)

    def _done(self, entry, error=None) -> bool:
        """Account for one chunk (load, trace, observation, progress); whether it failed."""
        record = entry.record
        del self.in_flight[record.index]
        del self.outstanding[record.index]
        self.scheduler.completed_work(record.device, record.size)
        if error is not None:
            record.error = error
            self.data.failed(record)
        elif self.observe is not None and record.stop > record.start:
            self.observe(record.device, record.size, service_seconds(record, self.last_stops))
        self.observers.chunk_completed(record)
        return error is not None

    def _complete(self, future) -> bool:
        """A task finished (or failed, or was cancelled): account for its chunks not yet accounted for."""
        indexes = self.members.get(future.key, [])
        pending = {i: self.in_flight[i] for i in indexes
                   if i in self.in_flight and self.in_flight[i].future is future}
        if not pending:
            return False  # accounted for by events, cancelled by a timeout, or resubmitted elsewhere
        entries = list(pending.values())
        if future.status == "lost":
            # It finished, then its worker died holding its outcome: run what is not accounted for again.
            for entry in entries:
                del self.in_flight[entry.record.index]
            self._submit(self.watch.where(entries[0].record.device), [(e.record, e.work) for e in entries],
                         retry=True)
            return False
        if future.status == "finished":
            if not self.join or all(e.in_place for e in entries):
                # Nothing to do with its outcome now: timings (and results) come with the final gather.
                return any([self._done(entry) for entry in entries])
            try:
                address, outcomes = self.tasks.outcomes(future, self.data.fetch(future))
            except Exception as err:
                return any([self._done(entry, err) for entry in entries])
            return self._settle(indexes, pending, address, outcomes)
        try:
            error = future.exception()
        except BaseException as err:  # a cancelled future raises instead of returning
            error = err
        if isinstance(error, PackError):
            return self._settle(indexes, pending, None, error.outcomes)
        error = error or RuntimeError(f"{future.key} ended as {future.status}")
        return any([self._done(entry, error) for entry in entries])

    def _settle(self, indexes, pending, address, outcomes) -> bool:
        """Account for a task's chunks from its outcomes (one per chunk, in the task's order)."""
        failed = False
        for index, (ok, value, start, stop) in zip(indexes, outcomes):
            entry = pending.get(index)
            if entry is None:
                continue
            record = entry.record
            record.start, record.stop = start, stop
            record.worker = address or record.worker
            if not ok:
                failed |= self._done(entry, value)
                continue
            if not entry.in_place:
                try:
                    self._keep(record, value)
                except Exception as err:  # the result does not fit its chunk
                    failed |= self._done(entry, err)
                    continue
            elif self.join:
                self.data.accept_leftover(record, value)  # outputs that travel by value, if any
            failed |= self._done(entry)
        return failed

    def _keep(self, record, result):
        if self.join:
            self.data.accept(record, result)  # written in place here, so the client holds one chunk at a time
        else:
            self.report.results[record.index] = result

    # --- ticks: timeouts and lost devices ---------------------------------------

    def _tick_seconds(self):
        nearest = min((e.deadline for e in self.in_flight.values()), default=float("inf"))
        return max(0.0, min(self.next_tick, nearest) - time.monotonic())

    def _tick(self):
        now = time.monotonic()
        self.next_tick = now + TICK_SECONDS
        expired = [e for e in self.in_flight.values() if e.deadline <= now]
        if expired:
            keys = {e.future.key for e in expired}
            self._cancel(e.future for e in expired)
            # A pack's other chunks are cancelled with it: they waited behind the one that ran over.
            for entry in [e for e in self.in_flight.values() if e.future.key in keys]:
                record = entry.record
                self._done(entry, ChunkTimeoutError(
                    f"chunk {record.index} on {record.device} ran over its timeout of "
                    f"{self.timeout:g} s and was cancelled"))
            self.failed = True
        busy = {self.watch.where(e.record.device) for e in self.in_flight.values()}
        for lost, fallback in self.watch.check(busy).items():
            if self.feeds is not None:
                self.feeds.refuse(lost)
            moved = [e for e in self.in_flight.values() if e.record.device == lost]
            if moved:
                self._cancel(e.future for e in moved)
                for entry in moved:
                    del self.in_flight[entry.record.index]
                self._submit(fallback, [(e.record, e.work) for e in moved], retry=True)
        if self.feeds is not None:  # feeds on workers that left are lost; a restarted worker gets new ones
            self.feeds.follow(self.watch.workers)
            self.feeds.flush_events()  # the page's view of lane chunks, once a tick

    def abandon(self):
        """Cancel every chunk still out, in one call, and give its load back."""
        self._cancel(self.futures[r.index] for r in self.outstanding.values())
        if self.feeds is not None:
            self.feeds.cancel()
        for record in self.outstanding.values():
            self.scheduler.completed_work(record.device, record.size)
        self.outstanding.clear()

    def _cancel(self, futures):
        """Cancel the tasks of ``futures`` (a chunk on a feed has none: its feed is cancelled with the run)."""
        tasks = [f for f in distinct(futures) if not isinstance(f, FeedTicket)]
        if tasks:
            self.client.cancel(tasks)

    def gather(self):
        """Timings (and results, without an in-place join) of the chunks not collected yet, one call for all."""
        report = self.report
        # A chunk whose worker died after it wrote its rows lost only its timings: not gathered. A pack
        # whose chunks were all accounted for by their events may not have finished here yet: waited for.
        wanted = [i for i, r in enumerate(report.records)
                  if r.error is None and r.worker is None and self.futures[i].status in ("finished", "pending")]
        futures = distinct(self.futures[i] for i in wanted)
        # Straight from the workers, not relayed by the scheduler (dsched.direct-to-workers).
        values = self.client.gather(futures, direct=direct_to_workers()) if futures else []
        for future, value in zip(futures, values):
            address, outcomes = self.tasks.outcomes(future, value)
            for index, (_, result, start, stop) in zip(self.members_of(future), outcomes):
                record = report.records[index]
                if record.worker is None:
                    record.worker, record.start, record.stop = address, start, stop
                    if not self.join:
                        report.results[index] = result
                    else:
                        self.data.accept_leftover(record, result)  # outputs that travel by value, if any
        for future in distinct(self.futures):
            future.release()

    def members_of(self, future):
        """The record indexes of a task's chunks, in its order."""
        return self.members[future.key]


def record_dispatch(scheduler, observers, report, device, m, offset) -> ChunkRecord:
    """A chunk of ``m`` items at ``offset`` is sent to ``device``: the policy's ``dispatched_work``, the observers'
    ``work_dispatched``, and its record at the end of the run's report."""
    start = time.time()
    scheduler.dispatched_work(device, m)
    if observers:
        observers.work_dispatched(device, m, start, time.time())
    record = ChunkRecord(len(report.records), device, m, offset=offset)
    report.records.append(record)
    report.results.append(None)
    return record


# --- chunks as Dask tasks ------------------------------------------------------------
# The transport for devices without a feed (dsched.dispatch.feeds): remote devices, runs with a timeout (Dask
# cancels tasks one by one), clusters with feeds turned off. A chunk requests as much of its device's Dask resource
# as it has items, which is how the worker bounds the items in flight. Chunks of one device chosen in the same
# round travel as one pack (dsched.worker.chunk.run_pack) when there are more of them than the device has threads:
# the worker runs them in turn and publishes each chunk's completion on the run's event topic, so accounting,
# progress, traces and failures stay per chunk while Dask's per-task cost is paid once per pack.

def distinct(futures) -> list:
    """``futures`` without repeats (the chunks of a pack share one) or ``None``s, in order."""
    return list({f.key: f for f in futures if f is not None}.values())


class TaskSender:
    """Sends one run's chunks to the cluster as tasks and packs, and reads their outcomes back.

    Parameters
    ----------
    client : distributed.Client
    program : ChunkProgram
        What runs on the worker for each chunk.
    run_id : str
        The run's key prefix: task keys are ``<run_id>-<first chunk>[-pack<n>][-retry<k>]``.
    watch : DeviceWatch
        Caps a task's resource request at what the device's workers hold.
    notify : callable
        ``notify((key, position, ok, start, stop))`` for each chunk event of a pack,
        called on the client's event loop.
    learns : bool
        Whether the policy learns from chunk timings: then even a single chunk goes
        as a pack, which publishes its time as it finishes.
    """

    def __init__(self, client, program, run_id, watch, notify, learns=False):
        self.client, self.program, self.run_id, self.watch, self.notify = client, program, run_id, watch, notify
        self.pack = bool(dask.config.get("dsched.batched-submission", True))
        self.learns = learns
        self.packs = set()  # keys of tasks that are packs
        self.topic = f"{run_id}-chunks"
        self.subscribed = False  # to the packs' events, at the first pack
        self.retries = itertools.count(1)

    def packs_chunks(self, n_chunks, lanes, packable) -> bool:
        """Whether ``n_chunks`` chunks for a device with ``lanes`` threads go as packs (one per lane)."""
        return self.pack and packable and n_chunks > lanes

    def send(self, device, records, works, slots, retry=False) -> list:
        """One task for the chunks ``records``: a pack if there are several (or the policy learns); a future per chunk."""
        suffix = f"-retry{next(self.retries)}" if retry else ""
        if len(records) > 1 or (self.pack and self.learns):
            return self._send_pack(device, records, works, slots, suffix)
        return self._send_each(device, records, works, slots, suffix)

    def _send_pack(self, device, records, works, slots, suffix) -> list:
        # The pack requests its items (the scheduler admitted them all), capped by what the
        # worker holds: its chunks run one after another.
        items = sum(r.size for r in records)
        self._subscribe()  # sent before the pack, on the same stream: no event can come before it
        with dask.annotate(**{ITEMS_ANNOTATION: items}):  # for observers: the request may be capped
            [future] = self.client.map(
                run_pack, [self.program], [device], [works], [slots], [self.topic],
                key=[f"{self.run_id}-{records[0].index}-pack{len(records)}{suffix}"],
                resources={device_resource(device): self.watch.request(device, items)}, pure=False)
        self.packs.add(future.key)
        return [future] * len(records)

    def _send_each(self, device, records, works, slots, suffix) -> list:
        # One client.map per chunk size: a chunk requests as much of its device's
        # resource as it has items, which is how the worker bounds items in flight.
        futures = [None] * len(records)
        by_size = defaultdict(list)
        for position, record in enumerate(records):
            by_size[record.size].append(position)
        for size, positions in by_size.items():
            request = self.watch.request(device, size)
            annotations = {ITEMS_ANNOTATION: size} if request != size else {}
            with dask.annotate(**annotations):
                mapped = self.client.map(
                    run_chunk, [self.program] * len(positions), [device] * len(positions),
                    [works[p] for p in positions], [slots[p] for p in positions],
                    key=[f"{self.run_id}-{records[p].index}{suffix}" for p in positions],
                    resources={device_resource(device): request}, pure=False)
            for p, future in zip(positions, mapped):
                futures[p] = future
        return futures

    def outcomes(self, future, value):
        """``(worker address, [(ok, value, start, stop)] per chunk)`` of a task's value."""
        if future.key in self.packs:
            return value
        result, address, start, stop = value
        return address, [(True, result, start, stop)]

    def _subscribe(self):
        """Hear the packs' per-chunk events. Not before a pack is sent: a run whose chunks all go to feeds
        sends no message before its feeds' tasks, which the client's batched stream would otherwise hold
        back for its interval (10 ms)."""
        if not self.subscribed:
            notify = self.notify  # the handler holds the callback only, never the run and its outputs
            self.client.subscribe_topic(self.topic, lambda event: notify(event[1]))  # on the client's event loop
            self.subscribed = True

    def close(self):
        if self.subscribed:
            self.client.unsubscribe_topic(self.topic)
            # distributed's unsubscribe_topic tells the scheduler but keeps the handler (2026.8): drop it, or
            # every run's handler would stay in the client for good.
            getattr(self.client, "_event_handlers", {}).pop(self.topic, None)
