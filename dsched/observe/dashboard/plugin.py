"""The scheduler side of the dsched page: a plugin that counts dsched's chunks per device and host, and per run.

A scheduler plugin watches the chunks that request a device resource
(``dsched-cpu``, ``dsched-cuda:0``, ...) and keeps one row per device and host
(``cuda:0@10.0.0.3``: one device name owned on several nodes gives one row per
node): its workers, the load (items of the chunks the scheduler has sent
there and not yet seen finish) against the capacity (the worker's amount of
the resource), chunks and items done, items per second and the busy fraction
over a recent window, and whether the device is emulated. It also groups the
chunks into runs (one dispatcher run each, told apart by their task keys), so
the page shows the current run, its progress, items/s and ETA, with earlier
runs one tab away.

Items per second and the busy fraction count chunks that finished within the
last ``window`` seconds (10 by default): a chunk still running shows in the
load, not yet in the speed.

It also hears the performance model's predictions
(:mod:`dsched.observe.predictions`: the client sends ``(predicted, measured)``
chunk times as events) and keeps them per device and host and per run, for
the page's "predicted against measured" plot. The same rows are on the
scheduler's Prometheus ``/metrics`` (:mod:`dsched.observe.dashboard.metrics`,
read at scrape time), and the plugin registers the worker side of the metrics
(:mod:`dsched.observe.dashboard.gpu`) on every worker.

:func:`install` (from a scheduler's process, or a preload's ``dask_setup``) and
:func:`register` (from a client) add the plugin; it serves its data at the
routes of :mod:`dsched.observe.dashboard.routes`.
"""

from __future__ import annotations

import collections
import itertools
import math
import re
import threading
import time

from distributed.diagnostics.plugin import SchedulerPlugin

from dsched.checks import check_positive_int
from dsched.devices.device import UNLIMITED_CAPACITY, Device, device_of_resources
from dsched.devices.ownership import dashboard_registered
from dsched.names import (
    CHUNK_BATCH_TOPIC,
    CHUNK_EVENT_TOPIC,
    DASHBOARD_PLUGIN,
    EMULATED_RESOURCE,
    ITEMS_ANNOTATION,
    PREDICTIONS,
    RESOURCE_PREFIX,
    RUN_EVENT_TOPIC,
    RUN_TOTAL,
    is_feed_key,
)
from dsched.observe.dashboard.gpu import WORKER_METRICS_PLUGIN, add_to_workers
from dsched.observe.dashboard.metrics import DURATION_BUCKETS, Histogram, PredictionStats, export, withdraw
from dsched.observe.dashboard.routes import add_routes
from dsched.observe.report import median_relative_error, relative_error, worker_host

__all__ = ["DashboardPlugin", "install", "register", "dask_setup", "PLUGIN_NAME"]

PLUGIN_NAME = DASHBOARD_PLUGIN

HISTORY = 50  # earlier runs kept
RUN_CHUNKS = 5000  # chunks of a run kept for its timeline and items/s plot (the latest)
# dsched's chunk keys start with the run id "dsched-<8 hex>-<n>", then "-<chunk index>" and maybe
# more ("-pack3", "-retry1").
_RUN_KEY = re.compile(r"^(dsched-[0-9a-f]+-\d+)-\d+(-.*)?$")


def _device_of_restrictions(restrictions):
    """``(Device, items)`` a task requested, or ``None`` if it requested no device."""
    for name, amount in (restrictions or {}).items():
        if name.startswith(RESOURCE_PREFIX) and name != EMULATED_RESOURCE:
            return Device(name[len(RESOURCE_PREFIX):]), amount
    return None


def _items(ts, requested):
    """The items a chunk task carries: its ``dsched-items`` annotation, else what it requested of its device.

    A task that packs several chunks may request fewer items than it carries
    (capped at what its worker holds); the annotation says the true count.
    """
    items = (getattr(ts, "annotations", None) or {}).get(ITEMS_ANNOTATION)
    return requested if items is None else items


def _label(device, host) -> str:
    return f"{device}@{host}"


class _DeviceStats:
    """Finished chunks of one device on one host: totals, and the recent ones for rates."""

    def __init__(self):
        self.chunks = 0
        self.items = 0
        self.busy_s = 0.0  # union of compute intervals, as they arrive
        self._busy_until = float("-inf")
        self.recent = collections.deque()  # (start, stop, items)
        self.durations = Histogram(DURATION_BUCKETS)

    def add(self, start, stop, items):
        self.chunks += 1
        self.items += items
        self.durations.observe(max(0.0, stop - start))
        if start >= self._busy_until:
            self.busy_s += stop - start
        elif stop > self._busy_until:
            self.busy_s += stop - self._busy_until
        self._busy_until = max(self._busy_until, stop)
        self.recent.append((start, stop, items))

    def rates(self, now, window):
        """``(items/s, busy fraction)`` over the last ``window`` seconds."""
        since = now - window
        while self.recent and self.recent[0][1] < since:
            self.recent.popleft()
        if not self.recent:
            return 0.0, 0.0
        # Early in a run the window is shorter: from the first chunk's start.
        span = min(window, now - min(s for s, _, _ in self.recent))
        if span <= 0:
            return 0.0, 0.0
        items = busy = 0.0
        end = since
        for start, stop, n in sorted(self.recent):
            # A chunk straddling the window's start counts for its share inside.
            inside = max(0.0, stop - max(start, since))
            length = stop - start
            items += n * (inside / length if length > 0 else 1.0)
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        return items / span, min(1.0, busy / span)


class _Run:
    """One dispatcher run as the scheduler sees it: its chunks, and the total if the client told it."""

    def __init__(self, run_id, number, client, name=None, total=None, started=None):
        self.id = run_id
        self.number = number
        self.client = client
        self.name = name or run_id
        self.total = total
        self.started = time.time() if started is None else started
        self.first_start = None  # the first chunk's compute start, on its worker
        self.last_stop = None
        self.ended = None  # set when the client says the run is over (track_run)
        self.items_done = self.chunks_done = 0
        self.in_flight = {}  # key -> items
        self.items_by_row = collections.Counter()
        self.chunks = collections.deque(maxlen=RUN_CHUNKS)  # (label, device, start, stop, items)
        self.predictions = collections.deque(maxlen=RUN_CHUNKS)  # (label, device, predicted s, measured s)
        self._error = (0, None)  # (predictions heard, their median relative error): cached for summary()
        self._heard = 0

    def add(self, label, device, start, stop, items):
        self.items_done += items
        self.chunks_done += 1
        self.items_by_row[label] += items
        self.chunks.append((label, device, start, stop, items))
        self.first_start = start if self.first_start is None else min(self.first_start, start)
        self.last_stop = stop if self.last_stop is None else max(self.last_stop, stop)

    def predicted(self, label, device, predicted, measured):
        self.predictions.append((label, device, predicted, measured))
        self._heard += 1

    def prediction_error(self):
        """The median relative error of the run's predicted chunk times (the latest kept), ``None`` without any."""
        if self._error[0] != self._heard:
            self._error = (self._heard, median_relative_error(relative_error(p, m) for _, _, p, m in self.predictions))
        return self._error[1]

    @property
    def active(self) -> bool:
        # A run the client announced stays current until it ends or has all its items.
        told = self.ended is None and self.total is not None and self.items_done < self.total
        return bool(self.in_flight) or told

    def summary(self, now) -> dict:
        """The run as JSON: progress, rate (items over the time since its first chunk started), ETA."""
        begin = self.first_start if self.first_start is not None else self.started
        end = now if self.active else (self.last_stop or now)
        elapsed = max(0.0, end - begin)
        rate = self.items_done / elapsed if elapsed > 0 else 0.0
        fraction = min(1.0, self.items_done / self.total) if self.total else None
        left = None if self.total is None else max(0, self.total - self.items_done)
        if left is None or (left and rate <= 0):
            eta = None  # no total told, or nothing finished yet to measure a rate
        else:
            eta = left / rate if left else 0.0
        return {
            "id": self.id, "number": self.number, "name": self.name, "client": self.client,
            "total": self.total, "items_done": self.items_done, "chunks_done": self.chunks_done,
            "items_in_flight": sum(self.in_flight.values()), "chunks_in_flight": len(self.in_flight),
            "fraction": fraction, "items_per_s": rate, "elapsed_s": elapsed,
            "eta_s": eta,
            "started": self.started, "active": self.active, "items_by_device": dict(self.items_by_row),
            "predicted_chunks": len(self.predictions), "prediction_error": self.prediction_error(),
        }


class DashboardPlugin(SchedulerPlugin):
    """Collects per device-and-host statistics and per-run progress of dsched chunks on the scheduler.

    Parameters
    ----------
    window : float
        Seconds over which items/s and the busy fraction are measured.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, window: float = 10.0):
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0:
            raise ValueError(f"window: expected a positive number of seconds, got {window!r}")
        self.window = float(window)
        self.scheduler = None
        self._stats = {}  # (Device, host) -> _DeviceStats
        self._accuracy = {}  # (Device, host) -> PredictionStats of the performance model's chunk times
        self._fed = {}  # (Device, host) -> {chunk key: (items, worker address)} of chunks running on device feeds
        self._runs = collections.OrderedDict()  # run id -> _Run, oldest first
        self._announced = {}  # client id -> (name, total, time): the next run of that client
        self._totals = collections.OrderedDict()  # run id -> total of a run told before its first chunk
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()  # the JSON route and the pages may read from other threads

    def __getstate__(self):  # register() ships the plugin to the scheduler: settings only
        return {"window": self.window}

    def __setstate__(self, state):
        self.__init__(state["window"])

    async def start(self, scheduler):
        self.scheduler = scheduler
        add_routes(scheduler, install)
        export(self)
        await add_to_workers(scheduler)

    async def close(self):
        withdraw(self)

    # --- events ---------------------------------------------------------------

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs):
        if start != "processing" and finish != "processing" or is_feed_key(key):
            return  # a feed's chunks are told by its events (log_event)
        ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
        requested = _device_of_restrictions(getattr(ts, "resource_restrictions", None))
        if requested is None:
            return
        device, items = requested[0], _items(ts, requested[1])
        with self._lock:
            run = self._run_of(key, ts)
            if finish == "processing":
                run.in_flight[key] = items
                return
            run.in_flight.pop(key, None)
            if finish != "memory":
                return
            computes = [s for s in kwargs.get("startstops") or () if s.get("action") == "compute"]
            if computes:
                begin, end = computes[0]["start"], computes[-1]["stop"]
            else:
                begin = end = time.time()
            host = worker_host(kwargs.get("worker"))
            self._stats.setdefault((device, host), _DeviceStats()).add(begin, end, int(items))
            run.add(_label(device, host), str(device), begin, end, int(items))

    def log_event(self, topic, msg):
        """A chunk that a device feed (:mod:`dsched.feed`) started or finished, or the client's predictions."""
        if topic == RUN_EVENT_TOPIC:  # a run's total, from its dispatcher: unless track_run announced it already
            self._run_total(*msg)
            return
        if topic == CHUNK_BATCH_TOPIC:  # a client's page events (fast-lane chunks, totals, predictions): off the path
            for event in msg:
                if event[0] == RUN_TOTAL:
                    self._run_total(*event[1:])
                elif event[0] == PREDICTIONS:
                    self.predictions_heard(*event[1:])
                else:
                    self.log_event(CHUNK_EVENT_TOPIC, event)
            return
        if topic != CHUNK_EVENT_TOPIC:
            return
        phase, run_id, client, device, items, address, chunk, start, stop = msg
        device, host = Device(device), worker_host(address)
        with self._lock:
            run = self._run_named(run_id, client)
            fed = self._fed.setdefault((device, host), {})
            if phase == "start":
                run.in_flight[chunk], fed[chunk] = items, (items, address)
                return
            run.in_flight.pop(chunk, None)
            fed.pop(chunk, None)
            if phase == "done":
                self._stats.setdefault((device, host), _DeviceStats()).add(start, stop, int(items))
                run.add(_label(device, host), str(device), start, stop, int(items))

    def _run_total(self, client, total, run_id=None):
        """A run's total from its client: for the run ``run_id``, whenever it comes (before or after the run's
        first chunk); without a run id (older clients), for the client's next run."""
        with self._lock:
            if run_id is None:
                self._announced.setdefault(client, (None, total, time.time()))
                return
            run = self._runs.get(run_id)
            if run is None:
                self._totals[run_id] = total
                while len(self._totals) > HISTORY:
                    self._totals.popitem(last=False)
            elif run.total is None:
                run.total = total

    def predictions_heard(self, run_id, client, pairs):
        """Predicted against measured seconds of chunks of a run: ``[(device, worker address, predicted, measured)]``."""
        with self._lock:
            run = self._run_named(run_id, client)
            for device, address, predicted, measured in pairs:
                predicted, measured = float(predicted), float(measured)
                if not (measured > 0 and predicted >= 0):
                    continue  # no time measured: nothing to compare with
                device, host = Device(device), worker_host(address)
                self._accuracy.setdefault((device, host), PredictionStats()).add(predicted, measured)
                run.predicted(_label(device, host), str(device), predicted, measured)

    def remove_worker(self, scheduler=None, worker=None, **kwargs):
        """A worker left: the feed chunks it was running will send no end (they run again elsewhere)."""
        with self._lock:
            gone = set()
            for fed in self._fed.values():
                lost = [chunk for chunk, (_, address) in fed.items() if address == worker]
                for chunk in lost:
                    del fed[chunk]
                gone.update(lost)
            for run in self._runs.values():
                for chunk in gone:
                    run.in_flight.pop(chunk, None)

    def _run_of(self, key, ts) -> _Run:
        """The run a chunk belongs to, started on its first chunk (taking its client's announcement)."""
        match = _RUN_KEY.match(str(key))
        run_id = match.group(1) if match else "other dsched tasks"
        if run_id in self._runs:  # every transition of a chunk task comes here: ask for clients only once
            return self._runs[run_id]
        clients = sorted(cs.client_key for cs in getattr(ts, "who_wants", None) or ())
        return self._run_named(run_id, clients[0] if clients else None)

    def _run_named(self, run_id, client) -> _Run:
        """The run ``run_id`` of ``client`` (a client id), started now if new."""
        run = self._runs.get(run_id)
        if run is None:
            name, total, announced = self._announced.pop(client, (None, None, None))
            told = self._totals.pop(run_id, None)  # the run's own total, heard before its first chunk
            total = total if total is not None else told
            run = self._runs[run_id] = _Run(run_id, next(self._numbers), client, name, total, announced)
            while len(self._runs) > HISTORY:
                self._runs.popitem(last=False)
        return run

    def begin_run(self, client, name=None, total=None):
        """The next run of ``client`` (a client id) is called ``name`` and has ``total`` items."""
        if total is not None:
            check_positive_int(total, "total", integers=int, expected="a positive number of items", below=None)
        with self._lock:
            self._announced[client] = (name, total, time.time())

    def end_run(self, client):
        """``client``'s announced run is over (whether or not it sent chunks)."""
        with self._lock:
            self._announced.pop(client, None)
            now = time.time()
            for run in self._runs.values():
                if run.client == client and run.ended is None:
                    run.ended = now

    def reset(self):
        """Forget the finished chunks and the runs (the page starts counting again)."""
        with self._lock:
            self._stats.clear()
            self._accuracy.clear()
            self._runs.clear()

    # --- views ----------------------------------------------------------------

    def snapshot(self) -> dict:
        """The page's data as JSON-able dicts.

        ``{"time", "window_s", "devices": [row, ...], "hosts": [row, ...], "run": the current
        run or None, "runs": [earlier and current runs, newest first]}``, one device row per
        device and host, in host then device order.
        """
        now = time.time()
        with self._lock:
            rows = self._device_rows(now)
            runs = [run.summary(now) for run in reversed(self._runs.values())]
        current = next((r for r in runs if r["active"]), runs[0] if runs else None)
        return {"time": now, "window_s": self.window, "devices": rows, "hosts": _host_rows(rows),
                "run": current, "runs": runs}

    def _device_rows(self, now):
        groups = {}  # (Device, host) -> [WorkerState, ...]
        for ws in (self.scheduler.workers.values() if self.scheduler is not None else ()):
            device = device_of_resources(ws.resources)
            if device is not None:
                groups.setdefault((device, ws.host), []).append(ws)
        for key in [*self._stats, *self._accuracy]:  # a device whose workers left still shows what it did
            groups.setdefault(key, [])
        rows = [self._row(device, host, workers, now) for (device, host), workers in groups.items()]
        return sorted(rows, key=lambda r: (r["host"], r["device"]))

    def _row(self, device, host, workers, now):
        stats = self._stats.get((device, host)) or _DeviceStats()
        accuracy = self._accuracy.get((device, host))
        rate, busy = stats.rates(now, self.window)
        fed = self._fed.get((device, host), {})
        load, in_flight = sum(items for items, _ in fed.values()), len(fed)
        for ws in workers:
            for ts in ws.processing:
                requested = _device_of_restrictions(ts.resource_restrictions)
                if requested is not None and requested[0] == device and not is_feed_key(ts.key):
                    load += _items(ts, requested[1])
                    in_flight += 1
        workers = sorted(workers, key=lambda w: w.address)
        amounts = [ws.resources[f"{RESOURCE_PREFIX}{device}"] for ws in workers]
        if not amounts:
            capacity = None
        elif max(amounts) >= UNLIMITED_CAPACITY:
            capacity = "unlimited"
        else:
            capacity = _number(sum(amounts))
        return {
            "device": str(device),
            "host": host,
            "label": _label(device, host),
            "worker": ", ".join(ws.address for ws in workers) or None,
            "workers": [ws.address for ws in workers],
            "worker_name": ", ".join(str(ws.name) for ws in workers) or None,
            "load": _number(load),
            "capacity": capacity,
            "chunks_in_flight": in_flight,
            "chunks_done": stats.chunks,
            "items_done": stats.items,
            "items_per_s": rate,
            "busy_fraction": busy,
            "busy_s": stats.busy_s,
            "emulated": any(EMULATED_RESOURCE in ws.resources for ws in workers) if workers else None,
            "prediction_error": accuracy.median() if accuracy is not None else None,
        }

    def metric_rows(self) -> list[dict]:
        """The device rows with what ``/metrics`` adds: ``durations`` (a :class:`Histogram` of chunk
        seconds) and ``predictions`` (:class:`PredictionStats`), ``None`` where nothing was seen."""
        now = time.time()
        with self._lock:
            rows = self._device_rows(now)
            for row in rows:
                key = (Device(row["device"]), row["host"])
                stats, accuracy = self._stats.get(key), self._accuracy.get(key)
                row["durations"] = stats.durations.copy() if stats is not None else None
                row["predictions"] = accuracy.copy() if accuracy is not None else None
        return rows

    def run_detail(self, run_id=None, bins=60) -> dict | None:
        """A run's chunks (the timeline) and items/s per device over time; the current run by default.

        Times are seconds since the run's first chunk started. ``series`` maps
        each ``device@host`` to ``(times, items/s)`` over ``bins`` equal bins,
        each chunk's items spread evenly over its compute interval.
        """
        now = time.time()
        with self._lock:
            if run_id is None:
                run = next((r for r in reversed(self._runs.values()) if r.active), None)
                run = run or (next(reversed(self._runs.values())) if self._runs else None)
            else:
                run = self._runs.get(run_id)
            if run is None:
                return None
            chunks = list(run.chunks)
            predictions = list(run.predictions)
            summary = run.summary(now)
        origin = min((c[2] for c in chunks), default=now)
        # Up to the last finished chunk: a bin reaching "now" would count only part of what is running.
        end = max((c[3] for c in chunks), default=now)
        return {"run": summary, "origin": origin,
                "chunks": [{"label": c[0], "device": c[1], "start": c[2] - origin, "stop": c[3] - origin,
                            "items": c[4]} for c in chunks],
                "series": _throughput_series(chunks, origin, end, bins),
                "predictions": [{"label": p[0], "device": p[1], "predicted": p[2], "measured": p[3]}
                                for p in predictions]}


def _number(value):
    return int(value) if float(value).is_integer() else value


def _host_rows(rows) -> list[dict]:
    """The per-host summary of device rows: devices, workers, load, capacity, items, items/s."""
    hosts = {}
    for row in rows:
        h = hosts.setdefault(row["host"], {"host": row["host"], "devices": [], "workers": 0, "load": 0,
                                           "capacity": 0, "chunks_done": 0, "items_done": 0, "items_per_s": 0.0,
                                           "emulated": []})
        h["devices"].append(row["device"])
        h["workers"] += len(row["workers"])
        h["load"] += row["load"]
        if isinstance(h["capacity"], (int, float)) and isinstance(row["capacity"], (int, float)):
            h["capacity"] += row["capacity"]
        elif row["capacity"] == "unlimited":
            h["capacity"] = "unlimited"
        h["chunks_done"] += row["chunks_done"]
        h["items_done"] += row["items_done"]
        h["items_per_s"] += row["items_per_s"]
        if row["emulated"]:
            h["emulated"].append(row["device"])
    return list(hosts.values())


def _throughput_series(chunks, origin, end, bins) -> dict:
    """``{label: (bin centres, items/s)}`` with each chunk's items spread over its compute interval."""
    width = max((end - origin) / bins, 1e-3)
    n = max(1, min(bins, math.ceil((end - origin) / width - 1e-9)))  # the last bin ends at the last chunk
    per_label = {}
    for label, _, start, stop, items in chunks:
        counts = per_label.setdefault(label, [0.0] * n)
        a, b = start - origin, stop - origin
        if b <= a:  # no duration measured: all in the bin where it ended
            counts[min(n - 1, int(b / width))] += items
            continue
        for i in range(max(0, int(a / width)), min(n, int(b / width) + 1)):
            overlap = min(b, (i + 1) * width) - max(a, i * width)
            if overlap > 0:
                counts[i] += items * overlap / (b - a)
    times = [(i + 0.5) * width for i in range(n)]
    return {label: (times, [c / width for c in counts]) for label, counts in sorted(per_label.items())}


# --- adding it to a scheduler ----------------------------------------------------

def install(scheduler, window: float = 10.0) -> DashboardPlugin:
    """Add the plugin and the JSON route to a scheduler (in its process); idempotent.

    Call it from a preload module's ``dask_setup(scheduler)``.
    """
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        plugin = DashboardPlugin(window)
        scheduler.add_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    plugin.scheduler = scheduler  # add_plugin on a running scheduler does not call start()
    add_routes(scheduler, install)
    export(plugin)
    if WORKER_METRICS_PLUGIN not in scheduler.worker_plugins:  # cheap: install() runs on every JSON request
        scheduler.loop.add_callback(add_to_workers, scheduler)  # thread-safe, from the loop's thread or another
    return plugin


def dask_setup(scheduler):
    """Preload hook: ``dask scheduler --preload dsched.dashboard``."""
    install(scheduler)


def register(client, window: float = 10.0) -> None:
    """Install the plugin and the JSON route on the running scheduler of ``client``."""
    client.register_plugin(DashboardPlugin(window), name=PLUGIN_NAME)
    dashboard_registered(client)  # the next run tells it of its chunks

