"""WorkDispatcher and ``dispatch()``: drive a scheduling policy over a batch.

The protocol is NEML2's: ask the scheduler for ``(device, n)``, take ``n``
items from the generator, send the chunk, record it with
``dispatched_work``, and ``completed_work`` when it is done. In async mode
the chunks run on the Dask workers that own their devices; the client keeps
the load accounting, because Dask resources only limit execution on a
worker, not assignment to it.
"""

from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
import uuid
import weakref
from collections import defaultdict

import dask
from dataclasses import dataclass

from dsched.devices import backends
from dsched.worker.chunk import ITEMS_ANNOTATION, ChunkProgram, InFlight, PackError, run_chunk, run_pack, takes_out
from dsched.dispatch.completion import DeviceWatch, notify_when_done, wait_for_one
from dsched.dataplane.rundata import RunData, check_out, direct_to_workers, zarr_chunk_items
from dsched.devices.device import Device, device_resource, placement_device
from dsched.devices.context import running_on
from dsched.errors import AggregateError, ChunkTimeoutError
from dsched.worker.feed import FeedOutcome, Feeds, FeedTicket, is_feed_key
from dsched.dataplane.outputs import OutputLayout
from dsched.devices.ownership import check_devices_owned, cluster_info, device_owners, device_threads
from dsched.dispatch.reduce import concat_reduce
from dsched.observe.report import ChunkRecord, RunReport
from dsched.dataplane.store import resolve_work
from dsched.observe.trace import DispatchTracer, check_trace_path
from dsched.dataplane.loaders import MappingLoader, Ranges

__all__ = ["WorkDispatcher", "dispatch", "ChunkRecord", "RunReport"]

MODES = ("sync", "async")
TICK_SECONDS = 1.0  # how often an async run looks for chunks past their timeout and devices without workers


class WorkDispatcher:
    """Run ``do_work`` over a batch, chunk by chunk, on the scheduler's devices.

    Parameters
    ----------
    scheduler : WorkScheduler
        The policy choosing each chunk's device and size.
    do_work : callable
        ``do_work(work, device) -> result``.
    reduce : callable, optional
        ``reduce(list_of_results)``; without it ``run`` returns the list in dispatch order.
    preprocess, postprocess : callable, optional
        ``preprocess(work, device) -> work`` and ``postprocess(result) -> result``; they run
        where the chunk runs (copy to the GPU and back, say).
    thread_init : callable, optional
        ``thread_init(device)``, run once per device before its first chunk.
    mode : {"async", "sync"}
        ``"sync"`` runs every chunk on the calling thread without load accounting (as NEML2);
        ``"async"`` keeps each device at its capacity on a Dask cluster.
    client : distributed.Client, optional
        Defaults to the current client; with none, a :class:`LocalHybridCluster` over the
        scheduler's devices starts on the first async run and closes with the dispatcher.
    cluster_options : dict, optional
        Keyword arguments for that cluster (``emulate=True``, say).
    on_chunk_done : callable, optional
        Called on the calling thread with each finished :class:`ChunkRecord` (progress bars).
    trace_file : str or path, optional
        Write a Chrome trace (NEML2's events; open it in Perfetto) of every run
        to this file; see :mod:`dsched.trace`. Off by default, at no cost.
    join : {None, "concat"}
        ``"concat"``: join the results along ``axis`` in place (instead of ``reduce``).
        The outputs are allocated once and each chunk writes its own rows where it
        runs; every result is checked against its chunk first. ``run`` returns the
        joined outputs.
    axis : int
        The batch axis of the results for ``join="concat"``.
    out : str, path, array or container of arrays, optional
        With ``join="concat"``: a Zarr store to create (workers write their rows to it;
        it must be reachable from every worker) or arrays to fill. Default: new arrays
        in shared memory.
    overwrite : bool
        Replace an existing Zarr store at ``out``.
    output_spec : dict, optional
        ``{name: (item_shape, dtype)}``: the declared result of a chunk (a dict of arrays),
        so that outputs are allocated before the first chunk returns.
    timeout : float, optional
        Seconds a chunk may take from its dispatch (queueing on its device included).
        A chunk over it fails with :class:`ChunkTimeoutError` (recoverable): it is
        cancelled and its load given back. A model that never returns keeps its
        worker thread busy, since Python cannot stop a thread; restart that worker
        to reclaim it.

    Examples
    --------
    >>> from dsched import SimpleScheduler, SliceGenerator
    >>> d = WorkDispatcher(SimpleScheduler("cpu", 4), lambda w, dev: w.stop - w.start, mode="sync")
    >>> d.run(SliceGenerator(0, 10))
    [4, 4, 2]
    """

    def __init__(
        self,
        scheduler,
        do_work,
        *,
        reduce=None,
        preprocess=None,
        postprocess=None,
        thread_init=None,
        mode="async",
        client=None,
        cluster_options=None,
        on_chunk_done=None,
        trace_file=None,
        join=None,
        axis=0,
        out=None,
        overwrite=False,
        output_spec=None,
        timeout=None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode: expected 'sync' or 'async', got {mode!r}")
        for name, fn in [("do_work", do_work), ("reduce", reduce), ("preprocess", preprocess),
                         ("postprocess", postprocess), ("thread_init", thread_init), ("on_chunk_done", on_chunk_done)]:
            if fn is not None and not callable(fn):
                raise ValueError(f"{name}: expected a callable, got {fn!r}")
        if do_work is None:
            raise ValueError("do_work: the do-work function is not set")
        missing = [m for m in ("schedule_work", "dispatched_work", "completed_work", "devices", "status")
                   if not hasattr(scheduler, m)]
        if missing:
            raise ValueError(f"scheduler: {scheduler!r} is not a scheduler (it lacks {', '.join(missing)})")
        self._check_join(join, reduce, axis, out, output_spec)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.timeout = timeout
        self.join, self.axis, self.out, self.overwrite = join, axis, out, bool(overwrite)
        self._layout = None if output_spec is None else OutputLayout.declared(output_spec, axis)
        self.trace_file = None if trace_file is None else check_trace_path(trace_file)
        self._tracer = None  # a DispatchTracer while a traced run is on
        self.scheduler = scheduler
        self.reduce = reduce
        self.mode = mode
        self.on_chunk_done = on_chunk_done
        self._program = ChunkProgram(uuid.uuid4().hex, do_work, preprocess, postprocess, thread_init,
                                     takes_out(do_work))
        self._client = client
        self._cluster_options = dict(cluster_options or {})
        self._own_cluster = None
        self._own_client = None
        self._closer = None  # closes the own client and cluster, at close() or at exit
        self._client_lock = threading.Lock()
        self._runs = itertools.count()
        self._initialised_sync = set()
        self.last_run: RunReport | None = None
        self._last_generator = None  # for run_failed

    @staticmethod
    def _check_join(join, reduce, axis, out, output_spec):
        if join not in (None, "concat"):
            raise ValueError(f"join: expected None or 'concat', got {join!r}")
        if join is not None and reduce is not None:
            raise ValueError("reduce: a reduce function cannot be combined with join='concat'")
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
            raise ValueError(f"axis: expected an integer >= 0, got {axis!r}")
        for name, value in (("out", out), ("output_spec", output_spec)):
            if value is not None and join is None:
                raise ValueError(f"{name}: only meaningful with join='concat'")

    # --- lifecycle -----------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close the cluster this dispatcher started, if any."""
        with self._client_lock:
            closer, self._closer = self._closer, None
            self._own_client = self._own_cluster = None
        if closer is not None:
            closer()

    @property
    def client(self):
        """The Dask client async runs use (started on first use if there is none)."""
        if self._client is not None:
            return self._client
        with self._client_lock:  # two threads running at once must not start two clusters
            if self._own_client is not None:
                return self._own_client
            try:
                from distributed import default_client

                return default_client()
            except ValueError:
                pass
            from distributed import Client

            from dsched.cluster.local import LocalHybridCluster

            cluster = LocalHybridCluster(self.scheduler.devices, **self._cluster_options)
            # Not the default client: another dispatcher must start a cluster over its own devices.
            client = Client(cluster, set_as_default=False)
            self._own_cluster, self._own_client = cluster, client
            # Runs at close(), or at exit (or collection) for a dispatcher never closed.
            self._closer = weakref.finalize(self, _close_client_and_cluster, client, cluster)
            return client

    # --- running -------------------------------------------------------------

    def run(self, generator, *, _overwrite_out=False):
        """Dispatch every item of ``generator``; the results in dispatch order, or ``reduce`` of them."""
        out = None if self.join is None else check_out(self.out, generator.total, self.axis,
                                                       self.overwrite or _overwrite_out)
        self._last_generator = generator
        self.last_run = report = RunReport(self.mode, wall_start=time.time())
        self._tracer = None if self.trace_file is None else DispatchTracer(self.trace_file)
        data = None
        # A policy that plans the run's tail is told its size; one that learns per host binds to the cluster.
        begin_run = getattr(self.scheduler, "begin_run", None)
        try:
            if self.mode == "sync":
                data = self._open_data(generator, out)
                if begin_run is not None:
                    begin_run(_items(generator))
                self._run_sync(data, report)
            else:
                client = self.client
                cluster = cluster_info(client)  # read once: every question below is answered from it
                check_devices_owned(client, self.scheduler, cluster["workers"])
                if hasattr(self.scheduler, "bind"):
                    self.scheduler.bind(client)
                data = self._open_data(generator, out, client, cluster["workers"])
                if begin_run is not None:
                    begin_run(_items(generator))
                self._run_async(client, data, report, cluster)
        finally:
            report.wall_stop = time.time()
            if data is not None:
                if data.outputs is not None:
                    report.output = data.output()
                data.close()
            if self._tracer is not None:  # even after a failure, so the file stays balanced
                tracer, self._tracer = self._tracer, None
                tracer.finish(report, self.scheduler)
        errors = [r.error for r in report.records if r.error is not None]
        if len(errors) == 1:
            raise errors[0]
        if errors:
            raise AggregateError(errors)
        if self.join is not None:
            return report.output
        return report.results if self.reduce is None else self.reduce(report.results)

    def run_failed(self):
        """Run again what the last run left undone: its failed chunks and the items it never dispatched.

        With ``join="concat"`` their rows of the last run's output are written in
        place and that output is returned; otherwise the results of the chunks run
        now, in dispatch order (``reduce`` applied to them).

        Examples
        --------
        >>> try:                                        # doctest: +SKIP
        ...     out = dispatcher.run(loader)
        ... except dsched.RecoverableError:
        ...     out = dispatcher.run_failed()           # only the failed chunks again
        """
        last, source = self.last_run, self._last_generator
        if last is None or source is None:
            raise RuntimeError("run_failed: this dispatcher has not run yet")
        todo = source.ranges if isinstance(source, Ranges) else [(0, source.total)]
        undone = _subtract(todo, [(r.offset, r.offset + r.size) for r in last.records if r.error is None])
        source = source.source if isinstance(source, Ranges) else source
        if not undone:
            return last.output if self.join is not None else last.results
        saved = self.out
        if self.join is not None:
            self.out = last.output  # the rows the last run wrote stay; the others are written now
        try:
            return self.run(Ranges(source, undone), _overwrite_out=True)
        finally:
            self.out = saved

    def _open_data(self, generator, out, client=None, workers=None):
        """The run's data plane: inputs by reference (async), outputs in place (``join="concat"``)."""
        owners = None if client is None else device_owners(client, self.scheduler.devices, workers)
        sizes = [s.batch_size for s in self.scheduler.status()]
        return RunData(generator, client=client, owners=owners, concat_axis=None if self.join is None else self.axis,
                       layout=self._layout, out=out, chunk_items=zarr_chunk_items(sizes))

    def _next_chunk(self, generator):
        if self._tracer is None:
            choice = self.scheduler.schedule_work()
        else:
            choice = self._tracer.schedule(self.scheduler)
        if choice is None:
            return None
        device, n = choice
        if n < 1:
            raise RuntimeError(f"Scheduler returned a batch size of {n} for {device}")
        offset = generator.offset
        m, work = generator.next(n)
        return Device(device), m, work, offset

    def _run_sync(self, data, report):
        program, records, results, generator = self._program, report.records, report.results, data.generator
        while generator.has_more():
            chunk = self._next_chunk(generator)
            if chunk is None:  # unreachable with validated schedulers: zero load always has room
                raise RuntimeError(f"{self.scheduler!r} has no room at zero load")
            device, m, work, offset = chunk
            if program.thread_init is not None and device not in self._initialised_sync:
                with running_on(device):
                    program.thread_init(device)
                self._initialised_sync.add(device)
            record = ChunkRecord(len(records), device, m, None, time.time(), offset=offset)
            records.append(record)
            results.append(None)
            try:
                result = self._run_sync_chunk(record, work)
                if self.join is not None:
                    data.accept(record, result)
                else:
                    results[-1] = result
            except Exception as err:
                record.error = err
                data.failed(record)
                break
            finally:
                record.stop = time.time()
                if self._tracer is not None:
                    self._tracer.completed(device, m)
            if self.on_chunk_done is not None:
                self.on_chunk_done(record)

    def _run_sync_chunk(self, record, work):
        """One chunk on the calling thread; with a timeout, on a helper thread that is abandoned if it runs over."""
        call = lambda: self._program.run(record.device, resolve_work(work))  # noqa: E731
        if self.timeout is None:
            return call()
        box = {}

        def target():
            try:
                box["result"] = call()
            except BaseException as err:  # handed to the calling thread
                box["error"] = err

        thread = threading.Thread(target=target, name=f"dsched-chunk-{record.index}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise ChunkTimeoutError(f"chunk {record.index} on {record.device} ran over its timeout of "
                                    f"{self.timeout:g} s (its thread is left to finish)")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _run_async(self, client, data, report, cluster):
        if self._tracer is not None:
            self._tracer.note_cluster(client)
        run_id = f"dsched-{self._program.dispatcher_id[:8]}-{next(self._runs)}"
        run = _AsyncRun(self, client, data, report, run_id, cluster)
        try:
            run.loop()
            run.gather()
        except BaseException:
            # Interrupted (or the generator, scheduler or submission failed): nothing
            # more will be collected, so cancel what was sent and give the loads back.
            run.abandon()
            raise
        finally:
            run.close()

    def _account_completed(self, record):
        self.scheduler.completed_work(record.device, record.size)
        if self._tracer is not None:
            self._tracer.completed(record.device, record.size)


def _distinct(futures) -> list:
    """``futures`` without repeats (the chunks of a pack share one) or ``None``s, in order."""
    return list({f.key: f for f in futures if f is not None}.values())


def _items(generator) -> int:
    """How many items ``generator`` will hand out (a re-run's ranges, or all)."""
    if isinstance(generator, Ranges):
        return sum(stop - start for start, stop in generator.ranges)
    return generator.total - generator.offset


def _subtract(ranges, done):
    """The parts of ``ranges`` (sorted, disjoint ``(start, stop)``) not covered by ``done``."""
    left = []
    done = sorted(done)
    for start, stop in ranges:
        position = start
        for a, b in done:
            if b <= position or a >= stop:
                continue
            if a > position:
                left.append((position, a))
            position = max(position, b)
        if position < stop:
            left.append((position, stop))
    return left


class _AsyncRun:
    """The state of one async run: chunks in flight, their futures, timeouts and lost devices.

    The loop is NEML2's: schedule while the scheduler has room, submit, wait
    for one completion (or a tick), account for it, repeat; after a failure,
    stop scheduling and wait for what is in flight.

    Device feeds: chunks for devices whose workers share this process or host go
    to the run's feeds (:mod:`dsched.feed`), one direct message each, and their
    replies are the completions; no task per chunk.

    Batched submission (devices without feeds): chunks of one device chosen in
    the same round travel as one task (a *pack*, :func:`~dsched.chunk.run_pack`)
    when there are several; the worker runs them one after another and publishes each chunk's
    completion as it happens, so accounting, progress, traces and failures stay
    per chunk while Dask's per-task cost is paid once per pack.
    """

    def __init__(self, dispatcher, client, data, report, run_id, cluster):
        self.dispatcher, self.client, self.data, self.report, self.run_id = dispatcher, client, data, report, run_id
        self.scheduler = dispatcher.scheduler
        # Futures, (key, i, ok, start, stop) pack events and FeedOutcomes, from the event loop.
        self.done = queue.Queue()
        self.in_flight = {}  # record index -> InFlight, until the chunk is accounted for
        self.members = {}  # task key -> record indexes of its chunks
        self.outstanding = {}  # record index -> record dispatched and not yet completed
        self.futures = []  # per record, the (last) future of its task
        self.failed = False
        self.watch = DeviceWatch(client, workers=cluster["workers"])
        self.retries = itertools.count(1)
        self.observe = getattr(self.scheduler, "observe", None)  # a policy that learns from chunk timings
        self.pack = bool(dask.config.get("dsched.batched-submission", True))
        self.packs = set()  # keys of tasks that are packs
        self.threads = device_threads(client, cluster["workers"])  # chunks of a device that can run at once
        self.topic = f"{run_id}-chunks"
        self.subscribed = False  # to the packs' events, at the first pack
        self.feeds = self._feeds(cluster)
        self.next_tick = time.monotonic() + TICK_SECONDS  # when to look for timeouts and lost devices

    def _feeds(self, cluster):
        """The run's device feeds (:mod:`dsched.feed`) for devices whose workers map its store, if enabled.

        A run with a timeout sends its chunks as tasks, which Dask can cancel one by one.
        """
        if not dask.config.get("dsched.feeds", True) or self.dispatcher.timeout is not None:
            return None
        local = {d: a for d, a in self.data.owners.items() if d not in self.data.remote and a}
        if not local:
            return None
        sizes = {Device(s.device): s.batch_size for s in self.scheduler.status()}
        return Feeds(self.client, self.dispatcher._program, self.run_id, local, self.done.put, cluster, sizes)

    def close(self):
        if self.feeds is not None:
            self.feeds.close()
        if self.subscribed:
            self.client.unsubscribe_topic(self.topic)
            # distributed's unsubscribe_topic tells the scheduler but keeps the handler (2026.8): drop it, or
            # every run's handler would stay in the client for good.
            getattr(self.client, "_event_handlers", {}).pop(self.topic, None)

    def _subscribe(self):
        """Hear the packs' per-chunk events. Not before a pack is sent: a run whose chunks all go to feeds
        sends no message before its feeds' tasks, which the client's batched stream would otherwise hold
        back for its interval (10 ms)."""
        if not self.subscribed:
            done = self.done  # the handler holds the queue only, never the run and its outputs
            self.client.subscribe_topic(self.topic, lambda event: done.put(event[1]))  # on the client's event loop
            self.subscribed = True

    def loop(self):
        generator = self.data.generator
        while True:
            groups = defaultdict(list)
            while not self.failed and generator.has_more():
                chunk = self.dispatcher._next_chunk(generator)
                if chunk is None:
                    break
                record, work = self._dispatched(*chunk)
                groups[self.watch.where(record.device)].append((record, work))
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
            item = wait_for_one(self.done, self._tick_seconds())
            while item is not None:
                self.failed |= self._handle(item)
                item = wait_for_one(self.done, 0) if not self.done.empty() else None
            if time.monotonic() >= self.next_tick:  # also while other chunks keep finishing
                self._tick()

    def _handle(self, item) -> bool:
        """One completion notice: a feed's reply, a pack's chunk event, or a finished task; whether it failed."""
        if isinstance(item, FeedOutcome):
            return self._fed(item)
        if isinstance(item, tuple):
            return self._event(item)
        if is_feed_key(item.key):
            self.feeds.ended(item)
            return False
        return self._complete(item)

    def _dispatched(self, device, m, work, offset):
        if self.dispatcher._tracer is None:
            self.scheduler.dispatched_work(device, m)
        else:
            self.dispatcher._tracer.dispatched(self.scheduler, device, m)
        record = ChunkRecord(len(self.report.records), device, m, offset=offset)
        self.outstanding[record.index] = record
        self.report.records.append(record)
        self.report.results.append(None)
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
        packable = self.dispatcher.join is None or self.data.writes_in_place(device)
        if self.pack and packable and len(chunks) > lanes:
            for lane in range(lanes):
                self._send(device, chunks[lane::lanes], retry)
        else:
            for chunk in chunks:
                self._send(device, [chunk], retry)

    def _send(self, device, chunks, retry):
        """One task for ``chunks``: a pack if there are several (or the policy learns from timings)."""
        timeout = self.dispatcher.timeout
        deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        suffix = f"-retry{next(self.retries)}" if retry else ""
        slots = [self.data.slot(device, r.offset, r.offset + r.size, r.index) for r, _ in chunks]
        works = [self.data.task_work(device, work) for _, work in chunks]
        resource = device_resource(device)
        # A policy that learns needs each chunk's time as it finishes: packs (even of one) publish it.
        if len(chunks) > 1 or (self.pack and self.observe is not None):
            # The pack requests its items (the scheduler admitted them all), capped by what the
            # worker holds: its chunks run one after another.
            items = sum(r.size for r, _ in chunks)
            self._subscribe()  # sent before the pack, on the same stream: no event can come before it
            with dask.annotate(**{ITEMS_ANNOTATION: items}):  # for observers: the request may be capped
                [future] = self.client.map(
                    run_pack, [self.dispatcher._program], [device], [works], [slots], [self.topic],
                    key=[f"{self.run_id}-{chunks[0][0].index}-pack{len(chunks)}{suffix}"],
                    resources={resource: self.watch.request(device, items)}, pure=False)
            futures = [future] * len(chunks)
            self.packs.add(future.key)
        else:
            # One client.map per chunk size: a chunk requests as much of its device's
            # resource as it has items, which is how the worker bounds items in flight.
            futures = [None] * len(chunks)
            by_size = defaultdict(list)
            for position, (record, _) in enumerate(chunks):
                by_size[record.size].append(position)
            for size, positions in by_size.items():
                request = self.watch.request(device, size)
                annotations = {ITEMS_ANNOTATION: size} if request != size else {}
                with dask.annotate(**annotations):
                    mapped = self.client.map(
                        run_chunk, [self.dispatcher._program] * len(positions), [device] * len(positions),
                        [works[p] for p in positions], [slots[p] for p in positions],
                        key=[f"{self.run_id}-{chunks[p][0].index}{suffix}" for p in positions],
                        resources={resource: request}, pure=False)
                for p, future in zip(positions, mapped):
                    futures[p] = future
        for (record, work), slot, future in zip(chunks, slots, futures):
            self.in_flight[record.index] = InFlight(record, work, future, slot is not None, deadline)
            self.members.setdefault(future.key, []).append(record.index)
            self.futures[record.index] = future
        notify_when_done(self.client, _distinct(futures), self.done.put)

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
        if entry is None or (not entry.in_place and self.dispatcher.join is not None):
            return False  # already accounted for, or its result is written from the pack's outcomes
        entry.record.start, entry.record.stop = start, stop
        return self._done(entry)

    def _done(self, entry, error=None) -> bool:
        """Account for one chunk (load, trace, observation, progress); whether it failed."""
        record = entry.record
        del self.in_flight[record.index]
        del self.outstanding[record.index]
        self.dispatcher._account_completed(record)
        if error is not None:
            return self._fail(record, error)
        if self.observe is not None and record.stop > record.start:
            self.observe(record.device, record.size, record.stop - record.start)
        if self.dispatcher.on_chunk_done is not None:
            self.dispatcher.on_chunk_done(record)
        return False

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
            if self.dispatcher.join is None or all(e.in_place for e in entries):
                # Nothing to do with its outcome now: timings (and results) come with the final gather.
                return any([self._done(entry) for entry in entries])
            try:
                address, outcomes = self._outcomes(future, self.data.fetch(future))
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

    def _outcomes(self, future, value):
        """``(worker address, [(ok, value, start, stop)] per chunk)`` of a task's value."""
        if future.key in self.packs:
            return value
        result, address, start, stop = value
        return address, [(True, result, start, stop)]

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
            failed |= self._done(entry)
        return failed

    def _keep(self, record, result):
        if self.dispatcher.join is not None:
            self.data.accept(record, result)  # written in place here, so the client holds one chunk at a time
        else:
            self.report.results[record.index] = result

    def _fail(self, record, error) -> bool:
        record.error = error
        self.data.failed(record)
        return True

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
                    f"{self.dispatcher.timeout:g} s and was cancelled"))
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
        tasks = [f for f in _distinct(futures) if not isinstance(f, FeedTicket)]
        if tasks:
            self.client.cancel(tasks)

    def gather(self):
        """Timings (and results, without an in-place join) of the chunks not collected yet, one call for all."""
        report = self.report
        # A chunk whose worker died after it wrote its rows lost only its timings: not gathered. A pack
        # whose chunks were all accounted for by their events may not have finished here yet: waited for.
        wanted = [i for i, r in enumerate(report.records)
                  if r.error is None and r.worker is None and self.futures[i].status in ("finished", "pending")]
        futures = _distinct(self.futures[i] for i in wanted)
        # Straight from the workers, not relayed by the scheduler (dsched.direct-to-workers).
        values = self.client.gather(futures, direct=direct_to_workers()) if futures else []
        for future, value in zip(futures, values):
            address, outcomes = self._outcomes(future, value)
            for index, (_, result, start, stop) in zip(self.members_of(future), outcomes):
                record = report.records[index]
                if record.worker is None:
                    record.worker, record.start, record.stop = address, start, stop
                    if self.dispatcher.join is None:
                        report.results[index] = result
        for future in _distinct(self.futures):
            future.release()

    def members_of(self, future):
        """The record indexes of a task's chunks, in its order."""
        return self.members[future.key]


def _close_client_and_cluster(client, cluster):
    client.close()
    cluster.close()


# --- the one-call form ------------------------------------------------------

def _is_array(x, field="args") -> bool:
    """Whether ``x`` is an array of a known backend; a ValueError naming ``field`` for look-alikes."""
    try:
        return backends.is_array(x)
    except backends.UnsupportedArrayError as err:
        raise backends.UnsupportedArrayError(f"{field}: {err}") from None


def _is_mapping_of_arrays(x, field="args") -> bool:
    """A dict holding at least one array: split like a MappingLoader (non-arrays go whole)."""
    return isinstance(x, dict) and any([_is_array(v, f"{field}[{k!r}]") for k, v in x.items()])


def _keep_grad(keep_grad) -> bool:
    """``keep_grad`` if given, else the Dask config ``dsched.keep-grad`` (read on the client)."""
    if keep_grad is None:
        from dask import config

        keep_grad = config.get("dsched.keep-grad", False)
    return bool(keep_grad)


class _ArgsLayout:
    """Flattens ``args`` into a mapping of batched entries and rebuilds them per chunk.

    Inputs keep their type (torch and NEML2 tensors stay tensors). Their
    autograd history is dropped (``detach``, no copy) unless ``keep_grad``:
    a graph cannot cross to a worker process, and slicing it per chunk
    would only grow it.
    """

    def __init__(self, args, keep_grad=None):
        # Per argument: _BATCHED, the keys of a mapping, or the argument itself. Never the
        # arrays: the layout travels with every chunk's task, the batch must not.
        self.skeleton = []
        self.mapping = {}
        prepare = (lambda v: v) if _keep_grad(keep_grad) else backends.detach
        for i, arg in enumerate(args):
            if _is_array(arg, f"args[{i}]"):
                self.mapping[f"args[{i}]"] = prepare(arg)
                self.skeleton.append(_BATCHED)
            elif _is_mapping_of_arrays(arg, f"args[{i}]"):
                for k, v in arg.items():
                    self.mapping[f"args[{i}][{k!r}]"] = prepare(v)
                self.skeleton.append(_MappingKeys(tuple(arg)))
            else:
                self.skeleton.append(arg)

    def __getstate__(self):
        return {"skeleton": self.skeleton, "mapping": {}}  # the worker rebuilds from the chunk alone

    def rebuild(self, chunk):
        out = []
        for i, arg in enumerate(self.skeleton):
            if isinstance(arg, _Batched):
                out.append(chunk[f"args[{i}]"])
            elif isinstance(arg, _MappingKeys):
                out.append({k: chunk[f"args[{i}][{k!r}]"] for k in arg.keys})
            else:
                out.append(arg)
        return out


class _Batched:
    """Marks an argument that is split per chunk (compared by type: it survives pickling)."""


_BATCHED = _Batched()


@dataclass(frozen=True)
class _MappingKeys:
    keys: tuple


class _CallOnChunk:
    """``do_work`` for :func:`dispatch`: calls ``fn`` on the rebuilt, device-resident arguments.

    Arrays move to the chunk's device through :mod:`dsched.backends` (torch
    tensors to the CUDA_VISIBLE_DEVICES-aware ``torch.device``; NumPy to CuPy
    on a real GPU), unless ``fn.moves_inputs`` says ``fn`` does that itself, and the
    result comes back to host memory as the type ``fn`` returned. Autograd
    is kept only with ``keep_grad`` (default: the Dask config
    ``dsched.keep-grad``), which works where chunks run in the caller's
    process (sync mode, in-process workers).
    """

    def __init__(self, fn, layout, kwargs, keep_grad=None):
        self.fn, self.layout, self.kwargs, self.keep_grad = fn, layout, kwargs, _keep_grad(keep_grad)

    def __call__(self, chunk, device):
        from dsched.devices.threads import limit_this_thread

        limit_this_thread()  # torch's thread count is per thread: give this one the worker's share
        if not getattr(self.fn, "moves_inputs", False):  # e.g. NEML2Model, which moves its inputs itself
            chunk = backends.to_device(chunk, device, keep_grad=self.keep_grad)
        args = self.layout.rebuild(chunk)
        try:
            result = self.fn(*args, **self.kwargs)
        except RuntimeError as err:
            from dsched.models.neml2 import as_recoverable

            recoverable = as_recoverable(err)  # NEML2's own solve failures, from user code calling NEML2
            if recoverable is None:
                raise
            raise recoverable from err
        return backends.to_host(result, keep_grad=self.keep_grad)


def dispatch(fn, *args, scheduler, client=None, mode="async", axis=0, trace_file=None, out=None, overwrite=False,
             timeout=None, keep_grad=None, **kwargs):
    """Evaluate ``fn`` over a batch split along ``axis`` by ``scheduler``; the joined result.

    Arrays and dicts holding arrays in ``args`` are split (entries of size 1
    along ``axis``, and a dict's non-array entries, go whole into every chunk); other arguments and ``kwargs`` pass
    unchanged. ``fn`` returns an array, a tuple or a dict of arrays, joined
    along ``axis`` in order, in place: each chunk writes its own rows of the
    outputs where it runs, after a check that its result fits its chunk. On
    worker processes the inputs are placed once in shared memory and chunks
    carry references to them. ``out`` sends the outputs to a Zarr store (a
    path; ``overwrite`` replaces an existing one) or into arrays you provide.
    On a CUDA device the chunk is moved there (CuPy) before ``fn`` and the
    result back to host memory after. ``trace_file`` writes a Chrome trace of
    the run (see :mod:`dsched.trace`). torch tensors stay torch, their autograd
    dropped unless ``keep_grad`` (default: the Dask config ``dsched.keep-grad``),
    which joins the chunks' tensors themselves (in the caller's process only).

    Examples
    --------
    >>> import numpy as np
    >>> from dsched import SimpleScheduler
    >>> dispatch(np.square, np.arange(5.0), scheduler=SimpleScheduler("cpu", 2), mode="sync").tolist()
    [0.0, 1.0, 4.0, 9.0, 16.0]
    """
    if not callable(fn):
        raise ValueError(f"fn: expected a callable, got {fn!r}")
    keep_grad = _keep_grad(keep_grad)
    if keep_grad and out is not None:
        raise ValueError("out: outputs written in place carry no autograd graph; drop out= or keep_grad")
    layout = _ArgsLayout(args, keep_grad)
    if not layout.mapping:
        raise ValueError("args: dispatch needs at least one array (or dict of arrays) to split")
    loader = MappingLoader(layout.mapping, axis=axis)
    # Kept autograd needs the tensors themselves joined (torch.cat), not their values copied in place.
    join = dict(reduce=functools.partial(concat_reduce, axis=axis)) if keep_grad else dict(
        join="concat", axis=axis, out=out, overwrite=overwrite)
    dispatcher = WorkDispatcher(
        scheduler,
        _CallOnChunk(fn, layout, kwargs, keep_grad),
        **join,
        timeout=timeout,
        mode=mode,
        client=client,
        trace_file=trace_file,
    )
    with dispatcher:
        return dispatcher.run(loader)

