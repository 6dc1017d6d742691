"""Replays: a like call's chunks sent again as they were, with nothing decided or described again.

A run on the steady path (:mod:`dsched.dispatch.steady`) still asks its policy for
every chunk, places its inputs, and describes each chunk to its feed. Where the
policy's chunks depend on nothing but its own records (:meth:`WorkScheduler.plan_key
<dsched.schedulers.base.WorkScheduler.plan_key>`: :class:`~dsched.SimpleScheduler`,
:class:`~dsched.StaticHybridScheduler`, a ``Batch``'s planned chunks) and the whole batch was cut before any chunk
came back, the next like run cuts it the same way. So a clean steady run leaves a
:class:`ReplayPlan`, and the dispatcher's next run over inputs of the same shapes
*replays* it:

- the inputs are copied into the plan's own input segment (or, already in shared
  memory, referenced where they lie, as the chunks the feeds keep name them); the
  values every chunk holds whole (a model's parameters) must be those kept, or the
  chunks are sent again;
- the outputs are allocated as on any run;
- each feed gets one small message, :data:`~dsched.worker.lane.AGAIN`: the plan's id
  and this call's output segments. The feeds keep the plan's chunks, their inputs
  mapped (:mod:`dsched.worker.kept`), from the first replay, which sends them with
  :data:`~dsched.worker.lane.KEEP`;
- the replies are read as on the steady path, which also handles what is out of the
  ordinary (a lost lane's chunks run the full way, a failed chunk's rows are NaN,
  Ctrl-C and ``cancel()``).

The policy is not asked (its loads stay at zero), and no observer is told: a run
with observers (a trace, progress, callbacks, collectors, a policy that predicts,
the dashboard) takes the steady path instead. A policy whose plan key holds while
it learns from chunk timings (:class:`~dsched.BalancedScheduler`) is told the run's
size and each chunk's time; once they move its cuts, its key changes and the next
call runs the full way. Dask config ``dsched.replay: false``
turns replays off.
"""

from __future__ import annotations

import collections
import math
import pickle
import secrets
import threading
import time
import weakref

import numpy as np

from dsched.checks import setting
from dsched.dataplane.loaders import ArrayLoader, MappingLoader, memoized
from dsched.dataplane.rundata import RunData, check_out
from dsched.dataplane.segments import kept_until_released
from dsched.dataplane.store import RunStore, share_generator, shared_location
from dsched.devices.ownership import cluster_generation, forget_cluster_info, has_dashboard
from dsched.dispatch.lanes import program_to_send
from dsched.dispatch.steady import SteadyRun, plan_key
from dsched.observe.collect import open_collectors
from dsched.observe.report import ChunkRecord, RunReport
from dsched.worker import lane as wire

__all__ = ["ReplayPlan", "replay_enabled", "MISS"]

MISS = object()  # what run_replay returns when the call cannot be a replay: the dispatcher runs it the usual way
BLOBS_KEPT = 8  # output targets kept pickled per plan (the segment pool lends a few in turn)
# Placements of a plan's inputs kept, each its own plan id on the feeds. A feed keeps dsched.worker.kept.PLANS_KEPT
# plan ids, of every dispatcher and layout of its caller's thread: one it let go of is answered 'forgotten' and
# its chunks are sent again in full (a round trip more), so many layouts in turn cost more than a few.
INPUTS_KEPT = 3
#: seconds: a replay whose last call waited longer for its replies does not look for them before it sleeps
LONG_WAIT = 1e-3


def replay_enabled() -> bool:
    """Dask config ``dsched.replay`` (default true): like runs after a clean steady run replay its chunks."""
    return bool(setting("replay", True))


class ReplayPlan:
    """What a clean steady run of a dispatcher left for its next like runs: its chunks, and the inputs they read.

    Parameters
    ----------
    path : SteadyPath
        The dispatcher's steady path (its feeds, owners, layout and cluster identity).
    chunks : list
        ``(device, feed position, offset, items)`` in the order the run sent them.
    key
        The policy's :meth:`~dsched.schedulers.base.WorkScheduler.plan_key` at that run.
    generator
        That run's loader: the shapes and types its inputs must keep.
    """

    def __init__(self, path, chunks, key, generator):
        self.path, self.chunks, self.key = path, chunks, key
        self.total = generator.total
        self.kind = _inputs_of(generator)[0]
        self.shapes = _shapes(generator)
        self.inputs_kept = collections.OrderedDict()  # where the shared inputs lay when placed -> _Inputs (recent last)
        self.current = None  # this run's _Inputs
        self.moves = None  # where this run's referenced inputs lie, for those self.current's chunks read elsewhere
        self.waiting = None  # (lanes' descriptors, bell, poll) of its runs (ReplayRun._waiting)
        self.lock = threading.Lock()  # held by the run that replays it (one at a time: one input segment)
        self.closing = False  # dropped while a run replayed it: closed as that run ends
        self.blobs = {}  # the output targets of recent calls, pickled (targets_blob)
        self.agains = {}  # (inputs' id, targets' blob) -> the AGAIN message, pickled (_again)
        self.waited = None  # seconds its last replay waited from its sends to its last reply
        self.spare = None  # ReplayData: outputs allocated while the last replay waited, for the next one
        kept_until_released(self)

    @classmethod
    def after(cls, path, run, scheduler, generator):
        """The plan a clean steady run leaves, or ``None``: its policy's chunks depend on more than its records,
        a chunk came back before the batch was cut, or its inputs are not NumPy arrays."""
        if run.overlapped or run.failed or run.undone or not replay_enabled():
            return None
        key = run.plan_key  # as the run started (a policy that counts its chunks has moved on since)
        if key is None or _shapes(generator) is None or _whole_entries(generator) is None:
            return None
        positions = {id(f): i for fs in run.feeds.values() for i, f in enumerate(fs)}
        return cls(path, [(device, positions[id(feed)], offset, items) for device, feed, offset, items in run.sent],
                   key, generator)

    def applies(self, dispatcher, generator) -> bool:
        """Whether this run may replay: the same client and cluster, no observer, a policy with the same plan
        key, inputs of the same shapes and types."""
        path = self.path
        if not (type(generator) is self.kind and generator.offset == 0 and _shapes(generator) == self.shapes):
            return False
        client = dispatcher.client
        return (client is path.client and client.status == "running" and cluster_generation(client) is path.generation
                and dispatcher.timeout is None and dispatcher.trace_file is None
                and dispatcher.on_chunk_done is None and not dispatcher.observers
                and plan_key(dispatcher.scheduler) == self.key and not open_collectors()
                and not has_dashboard(client) and replay_enabled())

    def inputs(self, generator):
        """Place this run's inputs: copied into a segment of the plan's, or referenced where they lie in shared
        memory, as the chunks the feeds keep read them. A placement's chunks are kept under an id of their own:
        a solver that swaps two states from step to step has two, each replayed exactly. Once
        :data:`INPUTS_KEPT` are kept, inputs referenced elsewhere than any of them (a solver's step ``k`` of a
        history in shared memory, or the state its last call returned) take the latest placement that references
        the same inputs: the feeds read them where they lie now (:attr:`moves`), and nothing is placed or sent
        again."""
        _, keys, arrays, _ = _inputs_of(generator)
        where = tuple(map(shared_location, arrays))
        kept = self.inputs_kept.get(where)
        if kept is None and len(self.inputs_kept) >= INPUTS_KEPT:
            referenced = tuple(w is not None for w in where)
            kept = next((k for k in reversed(self.inputs_kept.values()) if k.referenced == referenced), None)
        if kept is not None and not kept.same_whole(generator):  # a value passed whole changed (a parameter)
            self.inputs_kept.pop(kept.where).close()
            kept = None
        if kept is None:
            kept = self.inputs_kept[where] = _Inputs(generator, [items for *_, items in self.chunks], where)
            while len(self.inputs_kept) > INPUTS_KEPT:
                self.inputs_kept.popitem(last=False)[1].close()
        else:
            self.inputs_kept.move_to_end(kept.where)
            kept.copy(arrays)
        self.current, self.moves = kept, kept.moves_to(where, keys)

    def release_kept(self):
        """:func:`dsched.release_pool`: the input segments and spare outputs go back (the next replay places the
        inputs anew), unless a run replays the plan now."""
        if self.lock.acquire(blocking=False):
            try:
                self.close_inputs()
            finally:
                self.lock.release()

    def prepare_spare(self, data):
        """Allocate the next replay's outputs now, while this one's chunks run: ``data``'s layout, size and axis,
        in shared memory. A solver's next call takes them (:meth:`take_spare`) instead of allocating its own
        between its call and its messages, where the workers wait for it. The run took the last spare as it
        began (:meth:`take_spare`), so there is none to replace."""
        self.spare = ReplayData(data.generator, data.layout, data.axis, None)
        self.spare.generator = None  # this call's inputs are not kept past it (the next call's are its own)

    def take_spare(self, generator, layout, axis, out):
        """The outputs :meth:`prepare_spare` allocated, for a run of ``generator`` without ``out`` and with the
        same layout and axis; ``None`` otherwise (and the spare goes back)."""
        spare, self.spare = self.spare, None
        if spare is None:
            return None
        if out is not None or spare.layout is not layout or spare.axis != axis or spare.total != generator.total:
            spare.close(clean=True)
            return None
        spare.generator = generator
        return spare

    def drop_spare(self):
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.close(clean=True)  # its outputs go back to the pool with their arrays, unused

    def message(self, feed, chunks, data, program) -> tuple:
        """``feed``'s message for this run: its chunks to keep (the first time) or the kept ones again."""
        rearm = None
        if feed.rearm:  # its first message of the run takes it on, with the program if it holds another
            rearm, feed.rearm = (program_to_send(feed, program), feed.epoch), False
        kept, moved = self.current, (self.moves,) if self.moves else ()  # where inputs moved to, if any did
        if feed.id in kept.kept_by:
            blob = self.targets_blob(data.targets)
            if rearm is not None or moved:
                return (wire.AGAIN, rearm, kept.id, blob, *moved)
            return self._again(kept.id, blob)
        kept.kept_by.add(feed.id)
        return (wire.KEEP, rearm, kept.id,
                [(r.index, kept.works[i], data.slot(r.device, r.offset, r.offset + r.size, r.index)) for i, r in chunks],
                *moved)

    def forget_feed(self, feed):
        """``feed`` no longer keeps this run's chunks (its lane ended, or it refused them)."""
        if self.current is not None:
            self.current.kept_by.discard(feed.id)

    def targets_blob(self, targets) -> bytes:
        """``targets`` pickled: the same bytes for the same output segments, which a feed then reads once."""
        key = tuple((t.token, t.offset) for t in targets)
        blob = self.blobs.get(key)
        if blob is None:
            blob = self.blobs[key] = pickle.dumps(targets, protocol=5)
            while len(self.blobs) > BLOBS_KEPT:
                del self.blobs[next(iter(self.blobs))]
        return blob

    def _again(self, kept_id, blob) -> bytes:
        """The message of a feed that keeps the chunks and runs the program already, pickled once per placement of
        the inputs and outputs (:meth:`~dsched.dispatch.lanes.Lane.send` sends bytes as they are)."""
        key = (kept_id, blob)
        data = self.agains.get(key)
        if data is None:
            data = self.agains[key] = wire.dumps((wire.AGAIN, None, kept_id, blob))
            while len(self.agains) > BLOBS_KEPT * INPUTS_KEPT:
                del self.agains[next(iter(self.agains))]
        return data

    def close(self):
        """Give the input segments back (the pool keeps them for later calls of their sizes) and close the bell;
        a plan that a run replays now (on another thread) is closed as that run ends."""
        if not self.lock.acquire(blocking=False):
            self.closing = True
            return
        try:
            self.close_inputs()
            self.close_waiting()
        finally:
            self.lock.release()

    def close_inputs(self):
        while self.inputs_kept:
            self.inputs_kept.popitem()[1].close()
        self.current = None
        self.drop_spare()

    def close_waiting(self):
        if self.waiting is not None:
            self.waiting[1].close()
            self.waiting = None


class _Inputs:
    """One placement of a plan's inputs: a segment for those copied, the chunks' work that reads them (the feeds
    keep it under :attr:`id`), and which feeds keep it."""

    def __init__(self, generator, sizes, where):
        self.where = where  # each input's (segment, offset) in shared memory as it was placed, else None
        self.referenced = tuple(w is not None for w in where)
        self.store = RunStore(shared=True)
        loader = share_generator(generator, self.store)
        self.works = [loader.next(items)[1] for items in sizes]  # copies each chunk's rows
        self.views = [p.view for p in loader.placements]  # None where an input is referenced where it lies
        self.whole = _whole_entries(generator)  # the entries every chunk holds by value, as the feeds keep them
        for placement in loader.placements:
            placement.source = None  # the caller's array is not kept past its call
        self.id, self.kept_by = secrets.token_hex(8), set()
        self._closer = weakref.finalize(self, self.store.close, True)

    def same_whole(self, generator) -> bool:
        """Whether the entries passed whole to every chunk hold the values the kept chunks hold."""
        if self.whole is None:  # values that cannot be compared: placed anew on every call
            return False
        for key, kept in self.whole.items():
            value = generator.mapping[key]
            if type(kept) is np.ndarray:
                if type(value) is not np.ndarray or value.shape != kept.shape or value.dtype != kept.dtype or \
                        not np.array_equal(value, kept, equal_nan=kept.dtype.kind in "fc") or \
                        kept.dtype.kind == "f" and not np.array_equal(np.signbit(value), np.signbit(kept)):
                    return False
            elif type(value) is not type(kept) or not value == kept or _other_zero(value, kept):
                return False
        return True

    def copy(self, arrays):
        for view, array in zip(self.views, arrays):
            if view is not None:
                np.copyto(view, array)

    def moves_to(self, where, keys):
        """``{key: (segment, offset)}`` of each input this placement referenced (``keys``: the mapping's, ``None``
        for an array loader) that lies elsewhere now; ``None`` where none does."""
        keys = [None] if keys is None else keys
        moves = {key: now for key, now, then, view in zip(keys, where, self.where, self.views)
                 if view is None and now is not None and now != then}
        return moves or None

    def close(self):
        self._closer()


def run_replay(dispatcher, generator, steady):
    """Run ``generator`` as a replay of the plan of the dispatcher's ``steady`` path (that of its layout); its
    value, or :data:`MISS` where it may not be one."""
    start = time.time()
    plan = steady.replay
    if plan is None:  # dropped since, by a run on another thread
        return MISS
    if not plan.applies(dispatcher, generator):
        return MISS
    if not plan.lock.acquire(blocking=False):  # another thread replays it now: its inputs' segment is in use
        return MISS
    try:
        return _replay(dispatcher, generator, steady, plan, start)
    finally:
        plan.lock.release()
        if plan.closing:  # dropped while it ran (by this run, or by a run on another thread)
            plan.close()


def _replay(dispatcher, generator, steady, plan, start):
    out = check_out(dispatcher.out, generator.total, dispatcher.axis, dispatcher.overwrite)
    data = plan.take_spare(generator, steady.layout, dispatcher.axis, out) or \
        ReplayData(generator, steady.layout, dispatcher.axis, out)
    if not data.writes_in_place_everywhere():  # an out= array in this process's memory: the full path writes it
        data.close(clean=True)  # nothing ran: its segments go back to the pool
        return MISS
    feeds = steady.take_feeds()
    if feeds is None:  # a feed ended since: the full run, without the path
        data.close(clean=True)
        dispatcher._drop_steady(steady)
        return MISS
    dispatcher._last_generator = generator
    dispatcher.last_run = report = RunReport(dispatcher.mode, wall_start=start)
    run, ended = None, False
    try:
        plan.inputs(generator)
        begin_run = getattr(dispatcher.scheduler, "begin_run", None)
        if begin_run is not None:  # a policy that learns from the replay's timings (BalancedScheduler)
            begin_run(generator.total)
        run = ReplayRun(steady.client, data, report, feeds, plan, dispatcher)
        run.loop()
        ended = True
        getattr(dispatcher.scheduler, "replayed", _nothing)(len(plan.chunks))
    except BaseException:
        if run is None:
            steady.give_back(feeds)
        else:
            run.abandon()
        dispatcher._drop_steady(steady)
        raise
    finally:
        if run is not None:
            run.close()
        report.wall_stop = time.time()
        clean = ended and not run.undone and not run.failed
        dispatcher._close_data(data, report, clean=clean)
        if not clean:
            forget_cluster_info(steady.client)
    if run.undone:  # a lane lost: its rows the full way, into the same outputs
        dispatcher._drop_steady(steady)
        if not run.failed:
            return dispatcher._run_again(generator, sorted((r.offset, r.offset + r.size) for r in run.undone),
                                         report.output)
    return dispatcher._result(report, plan.total)


class ReplayData(RunData):
    """A replay's outputs: allocated (or the caller's, in shared memory) with the plan's layout; the inputs are the
    plan's."""

    def __init__(self, generator, layout, axis, out):  # noqa: D107  (RunData's work, less what a replay knows)
        self.client, self.total, self.axis, self.out, self.chunk_items = None, generator.total, axis, out, 1
        self.owners, self.remote, self.generator, self.streams_dask = {}, set(), generator, False
        self.store = RunStore(shared=True)
        self.targets = self.outputs = None
        self._failed_early, self.pieces = [], {}
        self._allocate(layout)


class ReplayRun(SteadyRun):
    """A replay on the steady path's lanes: the plan's chunks sent as one message per feed, the replies read as on
    the steady path, the policy never asked."""

    def __init__(self, client, data, report, feeds, plan, dispatcher):
        self.plan = plan
        super().__init__(client, data, report, feeds, run_id=None, scheduler=dispatcher.scheduler,
                         program=dispatcher._program, next_chunk=None, observers=None)
        # Its replies come no sooner than the last call's did: a look for them now would only take a core from the
        # workers computing them (two workers and this thread on two cores); the time is the next call's instead.
        self.long_wait = plan.waited is not None and plan.waited > LONG_WAIT
        if self.long_wait:
            self.spin = 0.0

    def _waiting(self, feeds) -> tuple:
        """The plan's bell and poll, kept from call to call while its feeds' lanes are the same."""
        lanes = tuple(f.lane.connection.fileno() for fs in feeds.values() for f in fs)
        if self.plan.waiting is None or self.plan.waiting[0] != lanes:
            self.plan.close_waiting()
            self.plan.waiting = (lanes, *super()._waiting(feeds)[:2])
        _, bell, poller = self.plan.waiting
        return bell, poller, {f.lane.connection.fileno(): f for fs in feeds.values() for f in fs}

    def _let_bell_go(self):
        """The plan keeps its bell for its next call."""

    def _lane_ended(self, feed, lost=False):
        self.plan.forget_feed(feed)  # it no longer keeps the plan's chunks (it ended, or refused them)
        self.plan.close_waiting()  # the poll no longer watches the lane's descriptor, which a new lane may reuse
        super()._lane_ended(feed, lost)

    watch_at_start = False  # the messages go first: what watches the run is set up while the feeds work

    def loop(self):
        records, now = self.report.records, time.time()
        by_feed = {}
        for i, (device, position, offset, items) in enumerate(self.plan.chunks):
            record = ChunkRecord(i, device, items, None, now, offset=offset)
            records.append(record)
            self.report.results.append(None)
            feed = self.feeds[device][position]
            feed.sent += 1
            self.in_flight[i] = (record, feed)
            by_feed.setdefault(feed, []).append((i, record))
        self.by_feed = by_feed
        for feed in by_feed:
            self._send_plan(feed)
        self.report.sent = time.time()
        sent = time.perf_counter()
        self._watch()
        if self.long_wait and self.data.out is None:  # a long wait ahead: the next call's outputs, made now
            try:
                self.plan.prepare_spare(self.data)
            except (OSError, MemoryError):  # no room for them now: the next call allocates its own, or says why
                pass
        while self.in_flight:
            self._wait()
        self.plan.waited = time.perf_counter() - sent

    def _send_plan(self, feed) -> bool:
        """Send ``feed`` its chunks of the plan (kept, or again); whether they went (else its lane ended)."""
        if feed.lane is None or not feed.lane.send(self.plan.message(feed, self.by_feed[feed], self.data,
                                                                     self.program)):
            self._lane_ended(feed, lost=feed.lane is None)
            return False
        return True

    def _send_again(self, feed) -> bool:
        """The feed let go of the plan's chunks (it keeps a few plans): they go again in full, to be kept."""
        self.plan.forget_feed(feed)
        return self._send_plan(feed)

    def _receive(self, feed):
        answer = self._answer(feed)
        if answer is None:
            return
        record, ok, value = answer
        record.heard = time.time()
        self._settle(record, ok, value)

    def _give_back(self, record):
        """A replay took no load from the policy: nothing to give back."""


def _other_zero(value, kept) -> bool:
    """Whether two equal real numbers are zeros of different signs (``-0.0 == 0.0``, yet ``copysign`` tells)."""
    return isinstance(kept, (float, np.floating)) and value == 0 and \
        math.copysign(1.0, value) != math.copysign(1.0, kept)


def _nothing(*args):
    return None


def _inputs_of(generator) -> tuple:
    """``(loader type, keys, arrays, axes)`` of the batched inputs an array or mapping loader shares."""
    if isinstance(generator, ArrayLoader):
        return ArrayLoader, None, [generator.array], [generator.axis]
    if isinstance(generator, MappingLoader):
        keys = generator.batched_keys
        return MappingLoader, keys, [generator.mapping[k] for k in keys], [generator.axes[k] for k in keys]
    return None, None, [], []


_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def _whole_entries(generator) -> dict:
    """``{key: value}`` of a mapping loader's entries passed whole to every chunk (a model's parameters), NumPy
    arrays copied; ``None`` if one is of a type whose values cannot be compared here."""
    if not isinstance(generator, MappingLoader):
        return {}
    whole = {}
    for key, value in generator.mapping.items():
        if key in generator._batched:
            continue
        if type(value) is np.ndarray and not value.dtype.hasobject:
            whole[key] = value.copy()
        elif type(value) in _PLAIN or isinstance(value, np.generic):
            whole[key] = value
        else:
            return None
    return whole


def _shapes(generator) -> tuple:
    """What the plan's chunks depend on in the inputs: each batched input's key, type, shape, dtype and axis (NumPy
    arrays only: other types' rows are rebuilt per chunk)."""
    return memoized(generator, "replay shapes", _shapes_of)  # another loader than a MappingLoader: asked each time


def _shapes_of(generator) -> tuple:
    _, keys, arrays, axes = _inputs_of(generator)
    if not arrays or not all(type(a) is np.ndarray for a in arrays):
        return None
    return (keys and tuple(keys), tuple((a.shape, a.dtype.str, axis) for a, axis in zip(arrays, axes)),
            generator.total)
