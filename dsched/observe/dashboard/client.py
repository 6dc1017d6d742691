"""The client side of the dsched page: telling it a run's total, and finding its address.

A run's total is not visible to the scheduler (a dispatcher sends chunks as
room frees up), so its progress in percent and its ETA need the client to say
it: ``with dsched.dashboard.track_run(client, total): ...`` (``dsched run``
does). Without it the page shows the items done and the rate.
:func:`dashboard_link` asks the scheduler where the page is served.
A run's chunk events reach the page off the run's path (:func:`tell_page`);
:func:`flush_page` returns once the page has them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

from dsched.checks import check_positive_int
from dsched.devices.ownership import has_dashboard
from dsched.names import DASHBOARD_PLUGIN as PLUGIN_NAME
from dsched.names import CHUNK_BATCH_TOPIC, RUN_TOTAL
from dsched.observe.hooks import RunObserver
from dsched.observe.dashboard.routes import scheduler_page_link

__all__ = ["track_run", "dashboard_link", "flush_page", "RunTotal", "tell_page"]


def _begin_run(client_id, name, total, dask_scheduler=None):
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        return False
    plugin.begin_run(client_id, name, total)
    return True


def _end_run(client_id, dask_scheduler=None):
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is not None:
        plugin.end_run(client_id)


@contextlib.contextmanager
def track_run(client, total: int, name: str | None = None):
    """Tell the dsched page that the next run of ``client`` has ``total`` items, for its progress and ETA.

    Wrap one dispatcher run (``dispatch()``, ``WorkDispatcher.run``, ``run_graph``).
    Does nothing where the scheduler has no dsched dashboard plugin.

    >>> with track_run(client, total=1_000_000, name="j2"):   # doctest: +SKIP
    ...     dsched.dispatch(model, x, scheduler=scheduler, client=client)
    """
    check_positive_int(total, "total", integers=int, expected="a positive number of items", below=None)
    client.run_on_scheduler(_begin_run, client.id, name, total)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a closed cluster has nothing left to tell
            flush_page(client)  # the run's chunks are counted before it is over
            client.run_on_scheduler(_end_run, client.id)


def dashboard_link(client) -> str | None:
    """The address of the dsched page on ``client``'s scheduler, or ``None`` without a dashboard."""
    return client.run_on_scheduler(scheduler_page_link)


class RunTotal(RunObserver):
    """Tells the page each run's total as it starts, so that ``dispatch()`` runs show their progress and ETA.

    One small event per run where the scheduler has the dashboard, queued with the
    run's chunk events (:func:`tell_page`): the page gives it to the run it names,
    whether it comes before or after the run's first chunk (a :func:`track_run`
    around the run, which names it too, takes precedence). Every async
    :class:`~dsched.WorkDispatcher` run has one.
    """

    def run_started(self, run):
        if run.client is not None and run.total > 0:
            client = run.client
            if has_dashboard(client):  # only where a page reads it (asked once per scheduler)
                tell_page(client, [(RUN_TOTAL, client.id, int(run.total), run.run_id)])


PAGE_EVENTS_EVERY = 0.05  # seconds between two messages of a client's page events
PAGE_ANSWER_WAIT = 10.0  # seconds the scheduler has to take one


def tell_page(client, events):
    """Queue ``events`` for the dsched page, off the caller's path: a timer on the client's event loop sends what
    is queued every :data:`PAGE_EVENTS_EVERY` seconds, in one message, in order (started once per client).

    A call pays for no message to the scheduler: the page hears of its chunks
    (:data:`~dsched.names.CHUNK_BATCH_TOPIC`) and its total a few milliseconds
    after it returns.
    """
    with _page_lock:
        client.__dict__.setdefault("_dsched_page_events", []).extend(events)
        start = "_dsched_page_timer" not in client.__dict__
        if start:
            client.__dict__["_dsched_page_timer"] = None
    if start:
        client.loop.add_callback(_start_page_timer, client)


_page_lock = threading.Lock()


def flush_page(client):
    """Return once the page has every event queued for it so far (:func:`tell_page`): what a program or a test
    reads from the page after a call then counts that call."""
    if "_dsched_page_timer" in client.__dict__:
        client.sync(_flush_page, client)


def _take_page_events(client) -> list:
    with _page_lock:
        events, client.__dict__["_dsched_page_events"] = client.__dict__.get("_dsched_page_events", []), []
    return events


def _start_page_timer(client):
    from tornado.ioloop import PeriodicCallback

    def send():
        if getattr(client, "status", "running") in ("closing", "closed"):
            timer.stop()
        elif not client.__dict__.get("_dsched_page_sending"):  # one message at a time: the page hears them in order
            asyncio.ensure_future(_flush_page(client))

    timer = PeriodicCallback(send, PAGE_EVENTS_EVERY * 1000)
    client.__dict__["_dsched_page_timer"] = timer
    timer.start()


async def _flush_page(client):
    """On the event loop: send what is queued, after the message under way (if any)."""
    while client.__dict__.get("_dsched_page_sending"):
        await asyncio.sleep(0.001)
    events = _take_page_events(client)
    if not events:
        return
    client.__dict__["_dsched_page_sending"] = True
    try:  # bounded: a scheduler that never answers must not hold a flush_page (or the next events) for good
        await asyncio.wait_for(client.scheduler.log_event(topic=CHUNK_BATCH_TOPIC, msg=events), PAGE_ANSWER_WAIT)
    except Exception:  # noqa: BLE001  the scheduler is gone (or frozen): so is its page
        pass
    finally:
        client.__dict__["_dsched_page_sending"] = False
