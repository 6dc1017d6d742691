"""PerformanceModelScheduler: sizes and places chunks from each device's calibrated cost (StarPU's dmda).

Every device has a cost model ``t(N) = t0 * (<N - N*>/N* + 1)``
(:mod:`dsched.costmodel`), calibrated online from the chunks it runs and
kept per host, model and hardware between runs. From the models:

- **sub-batch sizes**: each device's chunk is the size it computes in
  ``chunk_seconds`` (long enough that Dask's per-task cost stays small, short
  enough to balance), at least its ``N*``;
- **earliest-finish placement**: of the devices with room, the chunk goes to
  the one predicted to finish it first (its queue's predicted end plus the
  chunk's time), as StarPU's ``dmda`` does;
- **a shrinking tail**: knowing the items left (``begin_run``), the policy
  solves for the time ``T`` at which the devices, each starting when its
  queue ends and running at its rate, finish exactly the rest together
  (water-filling), and gives no device more than its share of that: the
  last chunks shrink so every device ends at about ``T``, within one
  fast-device chunk of the others;
- **idle devices**: a device whose smallest chunk (``t0``) cannot end before
  ``T`` gets nothing, so a CPU next to a GPU 150 times faster never holds the
  run up at its end; and a device under ``min_share`` (1 %) of the total
  speed gets nothing at all, since its chunks would cost the client as much
  dispatching as they save.

A device with no model yet is explored: chunks of ``start_batch`` items,
doubling with every sample until a chunk takes half of ``chunk_seconds``.

Samples: ``observe(device, n, seconds)``, called by the dispatcher with the
seconds the device spent on a chunk, on its worker's clock (from the end of
the chunk before it, if it waited behind that one: two in flight on one
device; :func:`~dsched.observe.report.service_seconds`). A dispatcher
without the hook leaves the interval between the device's completions seen
here, which a client that reads two replies at once shortens to nothing:
the worker's clock is the one to trust.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import weakref

from dsched.devices.device import Device, parse_device
from dsched.schedulers.base import DeviceStatus, WorkScheduler, broadcast, build_status, check_positive_int
from dsched.schedulers.costmodel import (
    DeviceCalibration,
    SaturationFit,
    device_identities,
    fit_of,
    load_costs,
    save_costs,
)
from dsched.schedulers.profiles import load_profile

__all__ = ["PerformanceModelScheduler"]

MAX_PLAN_CHUNKS = 1_000_000  # dsched.array's bound on a plan
_SAVING: list = []  # threads writing cost files: a scheduler reading them waits for these first
SAVE_DELAY = 0.05  # seconds a run's cost files wait: the run ends and returns first (the write would slow it)


def wait_for_saves() -> None:
    """Wait until every cost file a finished run is writing is written."""
    while _SAVING:
        _SAVING.pop().join()


DEFAULT_GUESS = {"cpu": 65536, "cuda": 262144}  # sizes a plan assumes for a device no run has measured


class _Lane:
    """One device's model and prediction state."""

    def __init__(self, device, chunk_seconds, calibration, guess_batch):
        self.device = device
        self.chunk_seconds = chunk_seconds
        self.calibration = calibration
        self.guess_batch = guess_batch
        self.in_flight = collections.deque()  # (dispatch time, n, predicted seconds), oldest first
        self.free_at = 0.0  # when the device is predicted to finish what it holds
        self.last_done = -math.inf
        self.pending = collections.deque(maxlen=64)  # (n, interval) waiting for observe()
        self.completed = 0
        self.longest = 0.0  # the longest sample seen: exploration stops once it reaches chunk_seconds / 2
        self.load = 0
        self.fit = calibration.fit  # cached: refreshed with each sample, read at every decision

    def exploring(self) -> bool:
        return self.calibration.prior is None and not self.calibration.calibrated and \
            self.longest < self.chunk_seconds / 2

    def predict(self, n) -> float:
        fit = self.fit
        return fit.seconds(n) if fit is not None else 0.0


def _steady_size(fit: SaturationFit, chunk_seconds) -> int:
    return max(1, int(fit.size_for(chunk_seconds)))


def _finish_target(remaining, lanes, now):
    """Water-filling: the time ``T`` at which ``lanes`` finish ``remaining`` items together, and each one's share.

    Lane ``d`` starts at ``f_d`` (its queue's end) and does ``rate_d * (T - f_d)``
    items, or none when even its smallest chunk (``t0``) cannot end by ``T``.
    Solved exactly: lanes join in the order of ``f_d + t0_d``; between two
    joins the items done grow linearly in ``T``.
    """
    terms = sorted(((max(now, lane.free_at) + fit.t0, max(now, lane.free_at), size / fit.seconds(size), lane)
                    for lane, fit, size in lanes), key=lambda term: term[0])
    rate_sum = weighted_start = 0.0
    target = math.inf
    for i, (joins, start, rate, _lane) in enumerate(terms):
        if rate_sum > 0 and rate_sum * joins - weighted_start >= remaining:
            target = (remaining + weighted_start) / rate_sum  # done before this lane could join
            break
        rate_sum += rate
        weighted_start += rate * start
        if rate_sum * joins - weighted_start >= remaining:
            target = joins  # the lane's first chunk alone covers the rest
            break
    else:
        target = (remaining + weighted_start) / rate_sum
    return target, {lane: (rate * (target - start) if target >= joins else 0.0) for joins, start, rate, lane in terms}


class PerformanceModelScheduler(WorkScheduler):
    """Chunks sized and placed by each device's calibrated cost model (StarPU's dmda over NEML2's model).

    Parameters
    ----------
    devices : list of str or Device
        As for :class:`StaticHybridScheduler` (at most one CPU, no duplicates).
    model : str, optional
        The name the cost files are kept under (the material model, ``"j2"``):
        with it, the saved calibration of each device's host and hardware is
        loaded now and the new one saved when a run ends. Without it nothing
        is read or written; the calibration lives as long as the scheduler.
    chunk_seconds : float or list
        Seconds of work per chunk at full size (per device, or one for all).
    capacity_chunks : int
        Chunks each device holds at once (one computing, the rest queued so
        the device never waits for the client).
    start_batch : int
        The first chunk of a device with no model, doubled with every sample.
    batch_sizes : int or list, optional
        The sizes :meth:`plan` assumes for a device no run has measured
        (default 65,536 on a CPU, 262,144 on a GPU, each taking ``chunk_seconds``).
    costs : dict, optional
        ``{device: SaturationFit or {"t0": s, "n_star": n}}``: known models,
        used before (and instead of) saved ones.
    client : distributed.Client, optional
        Where to ask which host and hardware runs each device (each device's
        worker answers); default: the current client if there is one, else
        this process's host and hardware (``False``: this process's, always).
        :meth:`bind` does it again for a client known later.
    profile_dir : str or path, optional
        Where cost files live (default ``$DSCHED_PROFILE_DIR`` or ``~/.cache/dsched/profiles``).
    save : bool
        Save calibrated models (10 samples or more) when a run ends.
    min_samples : int
        Samples (after the discarded first) before a device counts as calibrated.
    min_share : float
        A device whose model speed is below this fraction of all the devices'
        together stays idle (default 1 %): it cannot shorten the run by more,
        and each of its chunks costs the client as much as a fast device's.
    clock : callable
        Seconds, monotonic (``time.monotonic``); tests pass a simulated clock.
    """

    def __init__(self, devices, *, model=None, chunk_seconds=0.02, capacity_chunks=2, start_batch=1024,
                 batch_sizes=None, costs=None, client=None, profile_dir=None, save=True, min_samples=10,
                 min_share=0.01, clock=time.monotonic):
        status = build_status(devices, 1, None)
        devices = [s.device for s in status]
        seconds = broadcast(chunk_seconds, len(devices), "chunk_seconds")
        for i, value in enumerate(seconds):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"chunk_seconds[{i}]: expected a positive number of seconds, got {value!r}")
        self.capacity_chunks = check_positive_int(capacity_chunks, "capacity_chunks")
        self.start_batch = check_positive_int(start_batch, "start_batch")
        if isinstance(min_share, bool) or not isinstance(min_share, (int, float)) or not 0 <= min_share < 1:
            raise ValueError(f"min_share: expected a fraction in [0, 1), got {min_share!r}")
        self.min_share = float(min_share)
        min_samples = check_positive_int(min_samples, "min_samples")
        guesses = broadcast(batch_sizes, len(devices), "batch_sizes")
        guesses = [DEFAULT_GUESS[d.type] if g is None else check_positive_int(g, f"batch_sizes[{i}]")
                   for i, (d, g) in enumerate(zip(devices, guesses))]
        if model is not None and (not isinstance(model, str) or not model or "/" in model or model.startswith(".")):
            raise ValueError(f"model: expected a plain name for the cost files, got {model!r}")
        given = _given_costs(costs, devices)
        self.model, self.profile_dir, self.save = model, profile_dir, bool(save)
        self._clock = clock
        self.identities, self._bound = _identities(devices, client) if model is not None else ({}, None)
        priors = dict(self._saved_priors(devices, self.identities)) if model is not None else {}
        priors.update(given)
        self._given = set(given)
        self._lanes = {d: _Lane(d, float(s), DeviceCalibration(priors.get(d), min_samples=min_samples), g)
                       for d, s, g in zip(devices, seconds, guesses)}
        self._remaining = None  # items left in the current run, when the dispatcher says
        self._hooked = False  # observe() has been called: its samples replace the intervals
        self._dirty = False
        super().__init__(status)
        self._refresh_status()

    # --- the dispatcher's protocol -----------------------------------------------

    def begin_run(self, total) -> None:
        """The dispatcher starts a run of ``total`` items: the tail is planned against them."""
        total = check_positive_int(total, "total")
        with self._lock:
            self._remaining = total
            now = self._clock()
            for lane in self._lanes.values():
                lane.free_at = max(lane.free_at, now)

    def bind(self, client) -> None:
        """Identify the devices on ``client``'s workers (host and hardware) and load their saved models.

        For a scheduler built before its cluster was known (a graph file is read
        before ``dsched run`` connects): a device's saved model is its worker's,
        not this host's. Devices already calibrated keep their calibration.
        """
        if self.model is None or (self._bound is not None and self._bound == _cluster_of(client)):  # done there
            return
        identities, self._bound = _identities(list(self._lanes), client)
        priors = dict(self._saved_priors(list(self._lanes), identities))
        with self._lock:
            self.identities = identities
            for device, lane in self._lanes.items():
                if device in priors and not lane.calibration.calibrated and device not in self._given:
                    lane.calibration.prior = priors[device]
                    lane.fit = lane.calibration.fit
            self._refresh_status()

    def schedule_work(self):
        """``(device, n)``: the earliest finish among the devices with room and a share of the rest, or ``None``."""
        with self._lock:
            # Asked for more once the run's items are all sent: a new run nobody announced
            # (begin_run), so its size is unknown.
            remaining = self._remaining or None
            choice = _choose(list(self._lanes.values()), remaining, self._clock(), self.start_batch,
                             self.capacity_chunks, self.min_share)
            if choice is None:
                return None
            self._refresh_status()
            record = self._index[choice[0]]
            record.capacity = max(record.capacity, record.load + choice[1])  # what dispatched_work checks
            return choice

    def dispatched_work(self, device, n) -> None:
        super().dispatched_work(device, n)
        with self._lock:
            lane = self._lanes[Device(device)]
            now = self._clock()
            predicted = lane.predict(n)
            lane.in_flight.append((now, int(n), predicted))
            lane.free_at = max(lane.free_at, now) + predicted
            lane.load += int(n)
            if self._remaining is not None:
                self._remaining = max(self._remaining - int(n), 0)

    def completed_work(self, device, n) -> None:
        super().completed_work(device, n)
        with self._lock:
            lane = self._lanes[Device(device)]
            now = self._clock()
            sent = lane.in_flight.popleft() if lane.in_flight else (now, int(n), 0.0)
            interval = now - max(sent[0], lane.last_done)
            lane.last_done = now
            lane.load -= int(n)
            lane.free_at = now + sum(p for _, _, p in lane.in_flight)
            if not self._hooked:
                # No observe() came for the chunks before this one: a dispatcher without the hook.
                # Their intervals between completions are the samples.
                while lane.pending:
                    self._sample(lane, *lane.pending.popleft())
            lane.pending.append((int(n), interval))
            self._maybe_save()

    def observe(self, device, n, seconds) -> None:
        """``device`` spent ``seconds`` on a chunk of ``n`` items, on its worker's clock (called after
        ``completed_work``): the sample, in place of the interval between completions seen here."""
        with self._lock:
            self._hooked = True
            lane = self._lanes.get(Device(device))
            if lane is None:
                return
            for i, (size, _interval) in enumerate(lane.pending):
                if size == n:
                    del lane.pending[i]
                    break
            self._sample(lane, int(n), float(seconds))
            self._maybe_save()

    def status(self) -> list[DeviceStatus]:
        with self._lock:
            self._refresh_status()
        return super().status()

    # --- the model -----------------------------------------------------------------

    def estimates(self) -> dict:
        """``{Device: SaturationFit or None}``: each device's model now."""
        with self._lock:
            return {d: lane.fit for d, lane in self._lanes.items()}

    def predicted_seconds(self, device, n) -> float | None:
        """The seconds the model predicts now for a chunk of ``n`` items on ``device``; ``None`` without a model.

        The value :meth:`dispatched_work` plans with: asked right after it, the
        prediction for the chunk just dispatched (the dispatcher's
        :class:`~dsched.observe.predictions.PredictionObserver` does so, to
        compare it with the chunk's measured time). ``None`` for a device no
        chunk has calibrated yet (it is explored, not predicted).
        """
        with self._lock:
            lane = self._lanes.get(Device(device))
            fit = lane.fit if lane is not None else None
            return None if fit is None else fit.seconds(int(n))

    def calibration(self, device) -> DeviceCalibration:
        """A device's :class:`DeviceCalibration` (its samples and fit)."""
        return self._lanes[Device(device)].calibration

    def save_costs(self) -> list:
        """Save every calibrated device's model to its host's cost file; the paths written."""
        if self.model is None:
            return []
        paths = []
        for device, lane in self._lanes.items():
            if lane.calibration.calibrated:
                paths.append(save_costs(self.model, self.identities[device], device, lane.calibration.to_dict(),
                                        self.profile_dir))
        return paths

    def plan(self, n) -> list:
        """The chunks ``n`` items would be cut into, ``[(Device, size)]``, by this policy in predicted time.

        A pure function of ``n`` and the models in effect (a device no run has
        measured is taken to do its ``batch_sizes`` guess in ``chunk_seconds``);
        the scheduler's own state is left alone.
        """
        n = check_positive_int(n, "n")
        with self._lock:
            lanes = []
            for lane in self._lanes.values():
                fit = lane.fit or SaturationFit(lane.chunk_seconds, float(lane.guess_batch), 0.0, False)
                lanes.append(_Lane(lane.device, lane.chunk_seconds, DeviceCalibration(fit, min_samples=2), 0))
        largest = max(_steady_size(lane.fit, lane.chunk_seconds) for lane in lanes)
        if n / largest > MAX_PLAN_CHUNKS:  # as dsched.plan refuses: minutes of planning, not a plan
            raise ValueError(f"n: {n} items make at least {math.ceil(n / largest)} chunks of at most {largest} items, "
                             f"more than a plan holds ({MAX_PLAN_CHUNKS}); raise chunk_seconds")
        return _simulate(lanes, n, self.capacity_chunks, self.min_share)

    # --- internals -------------------------------------------------------------------

    def _sample(self, lane, n, seconds):
        if seconds <= 0:
            return
        lane.calibration.add(n, seconds)
        lane.fit = lane.calibration.fit
        lane.completed += 1
        lane.longest = max(lane.longest, seconds)
        self._dirty = True

    def _maybe_save(self):
        if not (self._dirty and self.save and self.model is not None):
            return
        if not self._remaining and all(lane.load == 0 for lane in self._lanes.values()) and \
                (not self._hooked or not any(lane.pending for lane in self._lanes.values())):
            self._dirty = False
            # Off the dispatcher's thread, and after the run has returned: its end should not wait for a file,
            # nor share the interpreter with one being written.
            saving = threading.Timer(SAVE_DELAY, self.save_costs)
            saving.name = "dsched-save-costs"
            _SAVING.append(saving)
            saving.start()

    def _refresh_status(self):
        for record in self._status:
            lane = self._lanes[record.device]
            fit = lane.fit
            size = _steady_size(fit, lane.chunk_seconds) if fit is not None else lane.guess_batch
            record.batch_size = size
            record.capacity = max(self.capacity_chunks * size, record.load)
            # The priority is the model's speed, so anything reading priorities as speeds
            # (plan_blocks) sees the measured ones.
            record.priority = size / fit.seconds(size) if fit is not None else 1.0

    def _saved_priors(self, devices, identities):
        wait_for_saves()
        by_host = {}
        for device in devices:
            identity = identities[device]
            if identity.host not in by_host:
                by_host[identity.host] = load_costs(self.model, identity.host, self.profile_dir)
            fit = fit_of(by_host[identity.host].get(identity.key))
            if fit is None and not identity.emulated:
                fit = _tuned_fit(self.model, identity.host, device, self.profile_dir)
            if fit is not None:
                yield device, fit

    def __repr__(self):
        parts = []
        for lane in self._lanes.values():
            fit = lane.fit
            model = "unmeasured" if fit is None else f"t0={fit.t0 * 1e3:.3g} ms, N*={fit.n_star:,.0f}"
            parts.append(f"{lane.device}({model}, load={lane.load})")
        return f"PerformanceModelScheduler({', '.join(parts)})"


def _choose(lanes, remaining, now, start_batch, capacity_chunks, min_share=0.0):
    """The next chunk ``(device, n)`` for these lanes, or ``None``: the policy itself (pure)."""
    left = math.inf if remaining is None else remaining
    if left <= 0:
        return None
    modelled, candidates = [], []
    for lane in lanes:
        fit = lane.fit
        if fit is not None:
            modelled.append((lane, fit, _steady_size(fit, lane.chunk_seconds)))
    if min_share > 0 and len(modelled) > 1:
        # A device that would do less than min_share of the work cannot shorten the run by more,
        # and each of its chunks costs the client as much as a fast device's: it stays idle.
        rates = [size / fit.seconds(size) for _, fit, size in modelled]
        total = sum(rates)
        modelled = [m for m, rate in zip(modelled, rates) if rate >= min_share * total]
    shares = _finish_target(left, modelled, now)[1] if modelled and math.isfinite(left) else {}
    for lane, fit, size in modelled:
        n = size
        if lane.exploring():
            n = min(n, start_batch * 2 ** lane.completed)
        if shares:
            n = min(n, math.ceil(shares[lane]) if shares[lane] >= 1 else 0)
        n = min(n, left) if math.isfinite(left) else n
        # Room is counted in chunks, not items: a refit that shrinks the size by 1 % must not
        # leave a device with one chunk where it should hold two.
        if n >= 1 and len(lane.in_flight) < capacity_chunks:
            candidates.append((max(now, lane.free_at) + fit.seconds(n), lane, n))
    for lane in lanes:  # no model yet: a small chunk to learn from, first
        if lane.fit is None:
            n = start_batch * 2 ** lane.completed
            if math.isfinite(left):
                n = min(n, max(1, math.ceil(left / (64 * len(lanes)))))
            if len(lane.in_flight) < capacity_chunks:
                candidates.append((-math.inf, lane, int(n)))
    if not candidates:
        if all(lane.load == 0 for lane in lanes) and modelled:
            # Nothing in flight could free room (rounding left a few items no share covers).
            lane, fit, size = max(modelled, key=lambda m: m[2] / m[1].seconds(m[2]))
            return lane.device, int(min(size, left))
        return None
    _, lane, n = min(candidates, key=lambda c: c[0])
    return lane.device, int(n)


def _simulate(lanes, n, capacity_chunks, min_share):
    """Replay the policy in predicted time: every chunk completes when its device's model says."""
    import heapq

    chunks, events, now, left, order = [], [], 0.0, n, 0
    for lane in lanes:
        lane.free_at = 0.0
    while left > 0:
        choice = _choose(lanes, left, now, 1, capacity_chunks, min_share)
        if choice is not None:
            device, m = choice
            lane = next(x for x in lanes if x.device == device)
            lane.free_at = max(lane.free_at, now) + lane.predict(m)
            lane.load += m
            lane.in_flight.append((now, m, 0.0))
            left -= m
            chunks.append((device, m))
            heapq.heappush(events, (lane.free_at, order, lane, m))
            order += 1
            continue
        now, _, lane, m = heapq.heappop(events)
        lane.load -= m
        lane.in_flight.popleft()
    return chunks


def _given_costs(costs, devices) -> dict:
    if costs is None:
        return {}
    if not hasattr(costs, "items"):
        raise ValueError(f"costs: expected a mapping {{device: SaturationFit}}, got {costs!r}")
    out = {}
    for key, value in costs.items():
        device = parse_device(key, "costs")
        if device not in devices:
            raise ValueError(f"costs[{str(key)!r}]: not one of the scheduler's devices ({', '.join(map(str, devices))})")
        fit = value if isinstance(value, SaturationFit) else fit_of(value)
        if fit is None:
            raise ValueError(f"costs[{str(key)!r}]: expected a SaturationFit or {{'t0': seconds, 'n_star': items}}, "
                             f"got {value!r}")
        out[device] = fit
    return out


def _identities(devices, client) -> tuple:
    """``({Device: DeviceIdentity}, the cluster they were all read on, or None)``: on ``client``'s workers
    (``None``: the default client's, if any; ``False``: here)."""
    if client is False:  # identify here, whatever client is current
        client = None
    elif client is None:
        try:
            from distributed import default_client

            client = default_client()
        except (ImportError, ValueError):
            client = None
    unowned = []
    identities = device_identities(devices, client, unowned)
    # A device no worker owned yet was identified here: the next run asks again (its worker may have joined).
    return identities, None if unowned else _cluster_of(client)


def _cluster_of(client):
    """What :meth:`PerformanceModelScheduler.bind` remembers of the cluster it identified the devices on: the
    client (weakly: equal while it lives) and its scheduler's address; ``None`` without a client. Every run binds
    its policy: asking every worker again would cost each run a round trip before its first chunk."""
    if client is None:
        return None
    return weakref.ref(client), getattr(getattr(client, "scheduler", None), "address", None)


def _tuned_fit(model, host, device, directory):
    """The fit ``dsched tune`` saved for ``device`` in the host's profile of ``model``, if any."""
    profile = load_profile(model, host=host, directory=directory) or {}
    return fit_of(profile.get("devices", {}).get(str(device)))


def saved_costs_cover(model, devices, directory=None) -> bool:
    """Whether this host has a saved model of ``model`` for every one of ``devices`` (graphs' ``auto``).

    A cost file entry for the device's hardware, or a ``dsched tune`` profile
    entry for the device, counts.
    """
    identities = device_identities(devices)
    costs = {}
    for device, identity in identities.items():
        if identity.host not in costs:
            costs[identity.host] = load_costs(model, identity.host, directory)
        if fit_of(costs[identity.host].get(identity.key)) is None and \
                (identity.emulated or _tuned_fit(model, identity.host, device, directory) is None):
            return False
    return True
