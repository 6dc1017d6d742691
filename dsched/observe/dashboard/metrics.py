"""dsched's Prometheus metrics on the scheduler's ``/metrics``: per device and host, read from the dashboard plugin when scraped.

Dask's scheduler serves ``/metrics`` from ``prometheus_client``'s default
registry. This module registers one collector there per process, which at
every scrape asks each live :class:`~dsched.observe.dashboard.plugin.DashboardPlugin`
of the process for its device rows (:meth:`~DashboardPlugin.metric_rows`), the
rows the dsched page shows: nothing is counted twice, and nothing is kept
here but the plugins themselves. A plugin joins when it starts
(:func:`export`) and leaves when its scheduler closes (:func:`withdraw`).
Several schedulers in one process (tests, notebooks) are read together, with
rows of the same device and host added up.

Every family is labelled ``device`` and ``host``:

=====================================================  =========  ==========================================
family                                                 type       what
=====================================================  =========  ==========================================
``dsched_items_completed_total``                       counter    items of the chunks that finished
``dsched_chunks_completed_total``                      counter    chunks that finished
``dsched_busy_seconds_total``                          counter    time with at least one chunk computing
``dsched_load_items``                                  gauge      items sent to the device and not finished
``dsched_capacity_items``                              gauge      the device's capacity (``+Inf``: unlimited)
``dsched_chunks_in_flight``                            gauge      chunks sent to the device and not finished
``dsched_workers``                                     gauge      workers owning the device on the host
``dsched_device_emulated``                             gauge      1 for an emulated CUDA device (NumPy)
``dsched_chunk_duration_seconds``                      histogram  each chunk's compute time on its worker
``dsched_predicted_chunk_seconds_total``               counter    performance model: predicted seconds
``dsched_measured_chunk_seconds_total``                counter    the same chunks' measured seconds
``dsched_prediction_relative_error``                   histogram  ``|predicted - measured| / measured``
``dsched_prediction_median_relative_error``            gauge      its median over the last 1,000 chunks
=====================================================  =========  ==========================================

The prediction families have rows only for devices a
:class:`~dsched.schedulers.PerformanceModelScheduler` predicted chunks for
(how the predictions reach the scheduler: :mod:`dsched.observe.predictions`).
A GPU worker's memory is the worker's own ``/metrics``
(:mod:`dsched.observe.dashboard.gpu`).

``prometheus_client`` is optional (``pip install 'dsched[prometheus]'``):
without it the dsched_ families are quietly off, as Dask's own metrics are, and everything else works.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import threading
import weakref

from dsched.observe.report import median_relative_error, relative_error

__all__ = ["Histogram", "PredictionStats", "export", "withdraw", "prometheus_client_if_installed",
           "DURATION_BUCKETS", "ERROR_BUCKETS", "RECENT_PREDICTIONS"]

logger = logging.getLogger(__name__)

#: upper bounds (seconds) of the chunk-duration histogram's buckets
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: upper bounds of the relative-error histogram's buckets (0.1: within 10 %)
ERROR_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
#: predictions per device and host the median gauge is taken over
RECENT_PREDICTIONS = 1000

_lock = threading.Lock()
_plugins = weakref.WeakSet()  # the live DashboardPlugins of this process
_state = {"registered": False, "missing": False}


class Histogram:
    """Counts of values per bucket (``value <= bound``, as Prometheus's ``le``), and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list:
        """``[(le, count), ...]`` as Prometheus writes them, ending with ``("+Inf", count)``."""
        total, out = 0, []
        for bound, n in zip([*map(_bound, self.bounds), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out

    def copy(self) -> Histogram:
        other = Histogram(self.bounds)
        other.counts, other.sum = list(self.counts), self.sum
        return other

    def add(self, other: Histogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.sum += other.sum


def _bound(value) -> str:
    return repr(float(value))


class PredictionStats:
    """A device's predicted against measured chunk times: totals, the error histogram, the recent errors."""

    def __init__(self):
        self.chunks = 0
        self.predicted_s = self.measured_s = 0.0
        self.errors = Histogram(ERROR_BUCKETS)
        self.recent = collections.deque(maxlen=RECENT_PREDICTIONS)

    def add(self, predicted: float, measured: float) -> None:
        if not (measured > 0 and predicted >= 0):
            return
        error = relative_error(predicted, measured)
        self.chunks += 1
        self.predicted_s += predicted
        self.measured_s += measured
        self.errors.observe(error)
        self.recent.append(error)

    def median(self) -> float | None:
        return median_relative_error(self.recent)

    def copy(self) -> PredictionStats:
        other = PredictionStats()
        other.chunks, other.predicted_s, other.measured_s = self.chunks, self.predicted_s, self.measured_s
        other.errors = self.errors.copy()
        other.recent.extend(self.recent)
        return other

    def add_stats(self, other: PredictionStats) -> None:
        self.chunks += other.chunks
        self.predicted_s += other.predicted_s
        self.measured_s += other.measured_s
        self.errors.add(other.errors)
        self.recent.extend(other.recent)


# --- registering --------------------------------------------------------------------

def prometheus_client_if_installed():
    """``prometheus_client``, or ``None`` where it is not installed: the metrics are then quietly off, as Dask's
    own are (one DEBUG log line per process says so)."""
    if _state["missing"]:  # missing: not looked for again (install() runs on every request of the JSON route)
        return None
    try:
        import prometheus_client
    except ImportError:
        with _lock:
            missing, _state["missing"] = _state["missing"], True
        if not missing:
            logger.debug("dsched: prometheus_client is not installed, so the scheduler's /metrics has no dsched_ "
                         "families (pip install 'dsched[prometheus]')")
        return None
    return prometheus_client


def export(plugin) -> bool:
    """Put ``plugin``'s device rows on this process's ``/metrics``; whether ``prometheus_client`` is there.

    Registers the process's collector in ``prometheus_client.REGISTRY`` the
    first time (once per process, however many schedulers start).
    """
    prometheus_client = prometheus_client_if_installed()
    if prometheus_client is None:
        return False
    with _lock:
        _plugins.add(plugin)
        if not _state["registered"]:
            prometheus_client.REGISTRY.register(_Collector())
            _state["registered"] = True
    return True


def withdraw(plugin) -> None:
    """Take ``plugin``'s rows off ``/metrics`` (its scheduler closed)."""
    with _lock:
        _plugins.discard(plugin)


class _Collector:
    """The process's collector: every live plugin's rows, read at scrape time."""

    def describe(self):
        return []  # names vary with the rows; nothing to check against other collectors

    def collect(self):
        with _lock:
            plugins = list(_plugins)
        rows = {}
        for plugin in plugins:
            try:
                found = plugin.metric_rows()
            except Exception:  # never break the scheduler's /metrics (Dask's own families are there too)
                logger.exception("dsched: could not read the dashboard plugin's rows for /metrics")
                continue
            for row in found:
                key = (row["device"], row["host"])
                if key in rows:
                    _merge(rows[key], row)
                else:
                    rows[key] = row
        if rows:
            yield from families([rows[key] for key in sorted(rows)])


def _merge(row, other) -> None:
    """Add ``other``'s counts to ``row`` (the same device and host, seen by two schedulers of one process)."""
    for field in ("items_done", "chunks_done", "busy_s", "load", "chunks_in_flight"):
        row[field] += other[field]
    row["workers"] = row["workers"] + other["workers"]
    if other["capacity"] is not None:
        row["capacity"] = other["capacity"] if row["capacity"] is None else _capacity(row) + _capacity(other)
    if other["emulated"] is not None:
        row["emulated"] = bool(row["emulated"] or other["emulated"])
    for field in ("durations", "predictions"):
        if other[field] is not None:
            if row[field] is None:
                row[field] = other[field]
            elif field == "durations":
                row[field].add(other[field])
            else:
                row[field].add_stats(other[field])


def _capacity(row) -> float:
    return math.inf if row["capacity"] == "unlimited" else float(row["capacity"])


def families(rows) -> list:
    """The ``dsched_`` metric families of device rows (:meth:`DashboardPlugin.metric_rows`)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["device", "host"]

    def family(kind, name, text, values):
        out = kind(name, text, labels=labels)
        for row, value in values:
            out.add_metric([row["device"], row["host"]], value)
        return out

    live = [r for r in rows if r["capacity"] is not None]  # rows whose workers are still there
    out = [
        family(CounterMetricFamily, "dsched_items_completed", "Items of the dsched chunks that finished on the device",
               [(r, r["items_done"]) for r in rows]),
        family(CounterMetricFamily, "dsched_chunks_completed", "dsched chunks that finished on the device",
               [(r, r["chunks_done"]) for r in rows]),
        family(CounterMetricFamily, "dsched_busy_seconds",
               "Seconds with at least one chunk computing on the device (union of chunk compute intervals)",
               [(r, r["busy_s"]) for r in rows]),
        family(GaugeMetricFamily, "dsched_load_items", "Items of the chunks sent to the device and not yet finished",
               [(r, r["load"]) for r in rows]),
        family(GaugeMetricFamily, "dsched_chunks_in_flight", "Chunks sent to the device and not yet finished",
               [(r, r["chunks_in_flight"]) for r in rows]),
        family(GaugeMetricFamily, "dsched_capacity_items",
               "The device's capacity in items: its workers' dsched-<device> resource (+Inf: unlimited)",
               [(r, _capacity(r)) for r in live]),
        family(GaugeMetricFamily, "dsched_workers", "Workers owning the device on the host",
               [(r, len(r["workers"])) for r in rows]),
        family(GaugeMetricFamily, "dsched_device_emulated",
               "1 for a CUDA device emulated with NumPy (placement tests, not a GPU measurement)",
               [(r, float(bool(r["emulated"]))) for r in live]),
    ]
    durations = HistogramMetricFamily("dsched_chunk_duration_seconds", "Each dsched chunk's compute time on its worker",
                                      labels=labels)
    for r in rows:
        if r["durations"] is not None:
            durations.add_metric([r["device"], r["host"]], r["durations"].cumulative(), r["durations"].sum)
    out.append(durations)
    return out + _prediction_families([r for r in rows if r["predictions"] is not None and r["predictions"].chunks])


def _prediction_families(rows) -> list:
    """The performance model's families: predicted against measured chunk seconds, and the relative error."""
    if not rows:
        return []
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["device", "host"]
    predicted = CounterMetricFamily("dsched_predicted_chunk_seconds",
                                    "Seconds the performance model predicted for the chunks it predicted", labels=labels)
    measured = CounterMetricFamily("dsched_measured_chunk_seconds",
                                   "Measured compute seconds of the chunks the performance model predicted", labels=labels)
    errors = HistogramMetricFamily("dsched_prediction_relative_error",
                                   "|predicted - measured| / measured chunk time of the performance model", labels=labels)
    median = GaugeMetricFamily("dsched_prediction_median_relative_error",
                               f"Median relative error of the last {RECENT_PREDICTIONS} predicted chunk times",
                               labels=labels)
    for r in rows:
        stats, values = r["predictions"], [r["device"], r["host"]]
        predicted.add_metric(values, stats.predicted_s)
        measured.add_metric(values, stats.measured_s)
        errors.add_metric(values, stats.errors.cumulative(), stats.errors.sum)
        median.add_metric(values, stats.median())
    return [predicted, measured, errors, median]
