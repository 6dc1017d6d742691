"""Names shared across processes: Dask resources, plugin names, event topics, task annotations, key shapes.

The client, the scheduler and the workers agree on these strings without
importing each other's modules (the scheduler side of the dashboard must not
need the dispatcher, the worker side of a feed must not need Bokeh). Every
string dsched puts on the wire that another process reads is defined here,
once.
"""

from __future__ import annotations

__all__ = [
    "RESOURCE_PREFIX", "EMULATED_RESOURCE",
    "DASHBOARD_PLUGIN", "PLACEMENT_PLUGIN", "DEVICE_WORKER_PLUGIN", "FEED_WORKER_PLUGIN", "WORKER_METRICS_PLUGIN",
    "CHUNK_EVENT_TOPIC", "PLACEMENT_EVENT_TOPIC", "PREDICTIONS", "RUN_EVENT_TOPIC",
    "ITEMS_ANNOTATION", "DEVICE_ANNOTATION", "RELAXED_ANNOTATION",
    "FEED_KEY_MARK", "is_feed_key", "SEGMENT_PREFIX", "CHUNK_BATCH_TOPIC", "RUN_TOTAL",
]

# --- Dask resources ----------------------------------------------------------
#: a worker that owns ``cuda:0`` advertises the resource ``dsched-cuda:0`` (its amount: the capacity in items)
RESOURCE_PREFIX = "dsched-"
#: advertised, besides its device, by a worker that emulates a CUDA device with NumPy
EMULATED_RESOURCE = "dsched-emulated"

# --- plugin names (scheduler and worker plugins) -------------------------------
DASHBOARD_PLUGIN = "dsched-dashboard"
PLACEMENT_PLUGIN = "dsched-placement"
DEVICE_WORKER_PLUGIN = "dsched-device"
FEED_WORKER_PLUGIN = "dsched-feeds"
#: the worker plugin that serves a GPU worker's device memory on its /metrics
WORKER_METRICS_PLUGIN = "dsched-metrics"

# --- event topics (``Worker.log_event`` / ``Client.subscribe_topic``) -----------
#: a feed's or a pack's chunk finished on its worker (read by the dashboard)
CHUNK_EVENT_TOPIC = "dsched-chunks"
#: the same events, a list of them at once: the client's, for chunks that ran on a feed's fast lane, and the
#: ``(RUN_TOTAL, client id, total items, run id)`` of its runs, in the order they happened
CHUNK_BATCH_TOPIC = "dsched-chunk-batch"
#: the first field of a run's total among a batch's events
RUN_TOTAL = "run-total"
#: a planned block was placed, or placed elsewhere than planned
PLACEMENT_EVENT_TOPIC = "dsched-placement"
#: (client id, total items[, run id]) of a run about to start, sent by the client: the page's progress and ETA
RUN_EVENT_TOPIC = "dsched-runs"
#: the first field of ``(PREDICTIONS, run id, client id, [(device, worker, predicted s, measured s), ...])``
#: among a batch's events: a performance-model run's chunk times, as its client paired them
PREDICTIONS = "predictions"

# --- task annotations ----------------------------------------------------------
#: a chunk task's item count, where it differs from its resource request
ITEMS_ANNOTATION = "dsched-items"
#: the device a planned block of the dask.array path must run on
DEVICE_ANNOTATION = "dsched-device"
#: set by the placement plugin on a block it let run on another worker of the same device type
RELAXED_ANNOTATION = "dsched-relaxed"

# --- keys and files ------------------------------------------------------------
#: feed tasks are keyed ``dsched-feed-<client and thread>-<n>``
FEED_KEY_MARK = "-feed-"
#: shared-memory segments dsched creates in /dev/shm start with this
SEGMENT_PREFIX = "dsched-"


def is_feed_key(key) -> bool:
    """Whether a task key is a feed's (``dsched-feed-<client>-<n>``, a successor's with ``-<m>`` after it).

    Examples
    --------
    >>> is_feed_key("dsched-feed-3f2a-0"), is_feed_key("dsched-1a2b-0-4")
    (True, False)
    """
    return FEED_KEY_MARK in str(key)
