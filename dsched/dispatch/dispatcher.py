"""WorkDispatcher: drive a scheduling policy over a batch, chunk by chunk (NEML2's WorkDispatcher).

The protocol is NEML2's: ask the scheduler for ``(device, n)``, take ``n``
items from the generator, send the chunk, record it with
``dispatched_work``, and ``completed_work`` when it is done. ``mode="sync"``
runs every chunk here, on the calling thread (the loop below); ``mode="async"``
runs them on the Dask workers that own their devices
(:class:`~dsched.dispatch.async_run.AsyncRun`). Observers
(:mod:`dsched.observe.hooks`) watch both.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
import weakref

from distributed import Client, default_client

from dsched.checks import check_callable, check_scheduler, setting
from dsched.cluster.local import LocalHybridCluster
from dsched.dataplane.loaders import Ranges, uncovered
from dsched.dataplane.outputs import OutputLayout
from dsched.dataplane.rundata import RunData, check_out, zarr_chunk_items
from dsched.dataplane.store import resolve_work
from dsched.devices.context import running_on
from dsched.devices.device import Device
from dsched.devices.ownership import device_owners, forget_cluster_info, recent_cluster_info, wait_for_devices
from dsched.dispatch.async_run import AsyncRun
from dsched.dispatch.completion import current_cancellation
from dsched.dispatch.replay import MISS, ReplayPlan, run_replay
from dsched.dispatch.steady import SteadyPath, SteadyRun, inputs_signature, steady_path_enabled
from dsched.errors import AggregateError, ChunkTimeoutError, note_where_defined
from dsched.observe.collect import open_collectors
from dsched.observe.dashboard.client import RunTotal
from dsched.observe.hooks import Observers, RunStart
from dsched.observe.predictions import PredictionObserver
from dsched.observe.progress import ChunkCallback
from dsched.observe.report import ChunkRecord, RunReport
from dsched.observe.trace import TraceObserver, check_trace_path
from dsched.worker.chunk import ChunkProgram, takes_out

__all__ = ["WorkDispatcher", "ChunkRecord", "RunReport"]

MODES = ("sync", "async")
STEADY_PATHS_KEPT = 4  # steady paths a dispatcher keeps, one per layout of its inputs


def _place_results() -> bool:
    """The Dask config ``dsched.place-results`` where the dispatcher is made: whether workers may allocate
    a model's new NumPy results in their output rows (:mod:`dsched.worker.result_placement`)."""
    return bool(setting("place-results", True))


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
        to this file; see :mod:`dsched.observe.trace`. Off by default, at no cost.
    observers : list of RunObserver, optional
        Watch every run (:mod:`dsched.observe.hooks`): their hooks are called as
        chunks are scheduled, dispatched and completed.
    join : {None, "concat"}
        ``"concat"``: join the results along ``axis`` in place (instead of ``reduce``).
        The outputs are allocated once and each chunk writes its own rows where it
        runs; every result is checked against its chunk first. ``run`` returns the
        joined outputs.
    axis : int
        The batch axis of the results for ``join="concat"``; a negative one counts
        from the end of each result's own shape.
    out : str, path, array or container of arrays, optional
        With ``join="concat"``: a Zarr store to create (workers write their rows to it;
        it must be reachable from every worker) or arrays to fill. Default: new arrays
        in shared memory.
    overwrite : bool
        Replace an existing Zarr store at ``out``.
    layout_probe : callable, optional
        With ``join="concat"`` and no ``output_spec``: ``layout_probe()`` returns the
        layout of a chunk's result (:class:`~dsched.dataplane.outputs.OutputLayout`),
        or ``None``. It is called once per run, on the client, when the chunks run in
        worker processes, so that even the first chunks write their rows in place
        instead of sending them back. :func:`dsched.dispatch` probes its function on
        the batch's first item this way.
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
        layout_probe=None,
        timeout=None,
        observers=(),
    ):
        if mode not in MODES:
            raise ValueError(f"mode: expected 'sync' or 'async', got {mode!r}")
        for name, fn in [("do_work", do_work), ("reduce", reduce), ("preprocess", preprocess),
                         ("postprocess", postprocess), ("thread_init", thread_init), ("on_chunk_done", on_chunk_done)]:
            if fn is not None:
                check_callable(fn, name)
        if do_work is None:
            raise ValueError("do_work: the do-work function is not set")
        check_scheduler(scheduler)
        self._check_join(join, reduce, axis, out, output_spec)
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.timeout = timeout
        self.join, self.axis, self.out, self.overwrite = join, axis, out, bool(overwrite)
        self._layout = None if output_spec is None else OutputLayout.declared(output_spec, axis)
        self._layout_probe = layout_probe
        self.trace_file = None if trace_file is None else check_trace_path(trace_file)
        self.observers = list(Observers(observers).observers)  # checked here, before any run
        self.scheduler = scheduler
        self.reduce = reduce
        self.mode = mode
        self.on_chunk_done = on_chunk_done
        self._program = ChunkProgram(uuid.uuid4().hex, do_work, preprocess, postprocess, thread_init,
                                     takes_out(do_work), place_results=_place_results())
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
        # One path per layout of the inputs, the most recently used last: a solver's first steps pass its old
        # state as scalars, then as arrays, and each layout keeps its own path (and replay) from run to run.
        # A run holds the path of its own layout as a local: runs of one dispatcher on several threads (each
        # with its own parked feeds) never take another layout's path; the lock guards the table.
        self._steady_paths = {}
        self._steady_lock = threading.Lock()

    @staticmethod
    def _check_join(join, reduce, axis, out, output_spec):
        if join not in (None, "concat"):
            raise ValueError(f"join: expected None or 'concat', got {join!r}")
        if join is not None and reduce is not None:
            raise ValueError("reduce: a reduce function cannot be combined with join='concat'")
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ValueError(f"axis: expected an integer, got {axis!r}")
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
        self._drop_all_steady()
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
                return default_client()
            except ValueError:
                pass
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
        path = self._steady_path_of(generator) if self._steady_paths else None  # this layout's (steady.py)
        if path is not None and path.replay is not None and self.mode == "async":
            replayed = run_replay(self, generator, path)  # a like run after a clean steady one (replay.py)
            if replayed is not MISS:
                return replayed
        out = None if self.join is None else check_out(self.out, generator.total, self.axis,
                                                       self.overwrite or _overwrite_out)
        self._last_generator = generator
        total = _items(generator)
        self.last_run = report = RunReport(self.mode, wall_start=time.time())
        observers = self._run_observers()
        data, ended, client, undone = None, False, None, []
        try:
            if self.mode == "sync":
                data = self._open_data(generator, out)
                self._begin(generator, observers)
                self._run_sync(data, report, observers)
            else:
                client = self.client
                steady = path if path is not None and steady_path_enabled() and path.holds(client) else None
                feeds = steady.take_feeds() if steady is not None else None
                if feeds is not None:  # like the last run, which went over fast lanes alone: its feeds again
                    data = self._open_data(generator, out, client, owners=steady.owners, layout=steady.layout)
                    if not data.writes_in_place_everywhere():  # out= arrays this run that workers cannot write
                        steady.give_back(feeds)
                        data.close(clean=True)  # nothing ran: its segments go back to the pool
                        data = feeds = None
                if feeds is not None:
                    undone = self._run_steady(client, data, report, feeds, observers, path, generator)
                else:
                    self._drop_steady(path)
                    cluster = recent_cluster_info(client, self.scheduler)  # read once: it answers every question
                    # A device whose worker is restarting is waited for (dsched.lost-device-timeout), not refused.
                    cluster = wait_for_devices(client, self.scheduler, cluster)
                    if hasattr(self.scheduler, "bind"):  # a policy that learns per host binds to the cluster
                        self.scheduler.bind(client)
                    data = self._open_data(generator, out, client, cluster["workers"])
                    self._run_async(client, data, report, cluster, observers, generator)
            ended = True
        finally:
            report.wall_stop = time.time()
            clean = ended and not undone and all(r.error is None for r in report.records)
            if data is not None:
                self._close_data(data, report, clean=clean)
            if client is not None and not clean:  # a worker may have left: the next run asks the scheduler
                forget_cluster_info(client)
            observers.run_finished(report)  # even after a failure, so a trace file stays balanced
        if undone and not any(r.error is not None for r in report.records):
            return self._run_again(generator, undone, report.output)
        return self._result(report, total)

    @staticmethod
    def _close_data(data, report, clean):
        """The run's joined output into its report, and its memory released (kept for the next call if ``clean``)."""
        if data.outputs is not None:
            if not clean:
                data.fill_undispatched(report.records)
            report.output = data.output()
        data.close(clean)

    def _result(self, report, total):
        """The run's value: its joined output, its results (reduced), or its chunks' errors raised.

        One failed chunk is re-raised as itself (NEML2's rule), with a note naming
        the chunk; several raise an :class:`~dsched.errors.AggregateError`, which is
        also an instance of the class their errors share, so one ``except`` clause
        catches the failure however many chunks it hit.
        """
        failed = [r for r in report.records if r.error is not None]
        for record in failed:
            note_where_defined(record.error, self._program.do_work)
        undispatched = total - sum(r.size for r in report.records)
        if len(failed) == 1:
            record = failed[0]
            note = (f"dsched: chunk {record.index} of {len(report.records)} dispatched ({record.device}, "
                    f"items {record.offset}-{record.offset + record.size - 1}) failed")
            if note not in getattr(record.error, "__notes__", ()):
                record.error.add_note(note)
            raise record.error
        if failed:
            raise AggregateError.of([r.error for r in failed], dispatched=len(report.records),
                                    undispatched=undispatched)
        if self.join is not None:
            return report.output
        return report.results if self.reduce is None else self.reduce(report.results)

    def _run_observers(self) -> Observers:
        """This run's observers: its total for the page, predictions (a policy that predicts), its trace, progress,
        then the dispatcher's own."""
        observers = [RunTotal()] if self.mode == "async" else []  # the dashboard's progress and ETA
        observers += [PredictionObserver()] if PredictionObserver.applies_to(self.scheduler) else []
        if self.trace_file is not None:
            observers.append(TraceObserver(self.trace_file))
        if self.on_chunk_done is not None:
            observers.append(ChunkCallback(self.on_chunk_done))
        return Observers(observers + self.observers + open_collectors())  # last: they see what the others saw

    def _begin(self, generator, observers, run_id=None, client=None):
        """Tell a policy that plans the run's tail its size, and the observers that the run starts."""
        total = _items(generator)
        begin_run = getattr(self.scheduler, "begin_run", None)
        if begin_run is not None:
            begin_run(total)
        run_id = run_id or f"dsched-{self._program.dispatcher_id[:8]}-{next(self._runs)}"
        observers.run_started(RunStart(run_id, self.mode, self.scheduler, total, client))
        return run_id

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
        undone = uncovered(todo, [(r.offset, r.offset + r.size) for r in last.records if r.error is None])
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

    def _open_data(self, generator, out, client=None, workers=None, owners=None, layout=None):
        """The run's data plane: inputs by reference (async), outputs in place (``join="concat"``)."""
        if owners is None and client is not None:
            owners = device_owners(client, self.scheduler.devices, workers)
        sizes = [s.batch_size for s in self.scheduler.status()]
        return RunData(generator, client=client, owners=owners, concat_axis=None if self.join is None else self.axis,
                       layout=self._layout or layout, out=out, chunk_items=zarr_chunk_items(sizes),
                       probe=self._layout_probe)

    def _next_chunk(self, generator, observers):
        """``(device, m, work, offset)`` for the policy's next chunk, or ``None`` when it has no room."""
        start = time.time()
        choice = self.scheduler.schedule_work()
        if observers:
            observers.work_scheduled(choice, start, time.time())
        if choice is None:
            return None
        device, n = choice
        if n < 1:
            raise RuntimeError(f"Scheduler returned a batch size of {n} for {device}")
        offset = generator.offset
        m, work = generator.next(n)
        return Device(device), m, work, offset

    def _run_sync(self, data, report, observers):
        """Every chunk on the calling thread, one after another, no load accounting (as NEML2)."""
        program, records, results, generator = self._program, report.records, report.results, data.generator
        cancellation = current_cancellation()  # a submitted call's cancel() stops it between chunks
        while generator.has_more():
            if cancellation is not None:
                cancellation.check()
            chunk = self._next_chunk(generator, observers)
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
                observers.chunk_completed(record)

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

    def _run_async(self, client, data, report, cluster, observers, generator):
        run_id = self._begin(data.generator, observers, client=client)
        run = AsyncRun(client, data, report, run_id, cluster, scheduler=self.scheduler, program=self._program,
                       next_chunk=lambda: self._next_chunk(data.generator, observers), observers=observers,
                       join=self.join is not None, timeout=self.timeout)
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
        if self.join is not None and not any(r.error is not None for r in report.records):
            # What the next like run needs to take the steady path, if this run leaves it one.
            self._keep_steady(SteadyPath.after(run, data, generator, cluster, self.timeout))

    def _run_steady(self, client, data, report, feeds, observers, path, generator) -> list:
        """A run on the steady ``path`` (:mod:`dsched.dispatch.steady`) over ``generator``; the ranges of the
        chunks it could not run."""
        run_id = self._begin(data.generator, observers, client=client)
        run = SteadyRun(client, data, report, feeds, run_id=run_id, scheduler=self.scheduler, program=self._program,
                        next_chunk=lambda: self._next_chunk(data.generator, observers), observers=observers)
        try:
            run.loop()
        except BaseException:
            run.abandon()
            self._drop_steady(path)
            raise
        finally:
            run.close()
        if not run.undone:
            if path.replay is None:  # its chunks, for the next like runs
                plan = ReplayPlan.after(path, run, self.scheduler, generator)
                with self._steady_lock:  # a run of the same layout on another thread may have left one first
                    if path.replay is None:
                        path.replay, plan = plan, None
                if plan is not None:  # that run's plan stays: this one goes
                    plan.close()
            return []
        # A lane lost: the full run (which looks at the cluster again) takes its chunks and what was not scheduled.
        self._drop_steady(path)
        generator = data.generator
        left = [(generator.offset, generator.total)] if generator.has_more() else []
        return sorted((r.offset, r.offset + r.size) for r in run.undone) + left

    @property
    def _steady(self):
        """The steady path of the layout used most recently, or ``None`` (for a look from outside: a run holds
        its own layout's path)."""
        with self._steady_lock:
            return next(reversed(self._steady_paths.values()), None)

    def _steady_path_of(self, generator):
        """The steady path a run over ``generator``'s layout left, made the most recently used; ``None`` if none."""
        signature = inputs_signature(generator)
        with self._steady_lock:
            path = self._steady_paths.pop(signature, None)
            if path is not None:
                self._steady_paths[signature] = path
        return path

    def _keep_steady(self, path):
        """Keep ``path`` for its layout's next runs (in place of one another thread's run left meanwhile); the
        least recently used beyond :data:`STEADY_PATHS_KEPT` are dropped."""
        if path is None:
            return
        dropped = []
        with self._steady_lock:
            replaced = self._steady_paths.pop(path.signature, None)
            if replaced is not None:
                dropped.append(replaced)
            self._steady_paths[path.signature] = path
            while len(self._steady_paths) > STEADY_PATHS_KEPT:
                dropped.append(self._steady_paths.pop(next(iter(self._steady_paths))))
        for old in dropped:
            _close_replay(old)

    def _drop_steady(self, path):
        """Forget ``path`` (a run's own), and its replay plan's input segment."""
        if path is None:
            return
        with self._steady_lock:
            if self._steady_paths.get(path.signature) is path:
                del self._steady_paths[path.signature]
        _close_replay(path)

    def _drop_all_steady(self):
        with self._steady_lock:
            paths, self._steady_paths = list(self._steady_paths.values()), {}
        for path in paths:
            _close_replay(path)

    def _run_again(self, generator, ranges, output):
        """The rows of ``ranges`` that the steady path could not run, through the full run, into ``output``."""
        saved = self.out
        self.out = output
        try:
            return self.run(Ranges(generator, ranges), _overwrite_out=True)
        finally:
            self.out = saved


def _close_replay(path):
    if path.replay is not None:
        path.replay.close()


def _items(generator) -> int:
    """How many items ``generator`` will hand out (a re-run's ranges, or all)."""
    if isinstance(generator, Ranges):
        return sum(stop - start for start, stop in generator.ranges)
    return generator.total - generator.offset


def _close_client_and_cluster(client, cluster):
    client.close()
    cluster.close()
