"""The client side of the dsched page: telling it a run's total, and finding its address.

A run's total is not visible to the scheduler (a dispatcher sends chunks as
room frees up), so its progress in percent and its ETA need the client to say
it: ``with dsched.dashboard.track_run(client, total): ...`` (``dsched run``
does). Without it the page shows the items done and the rate.
:func:`dashboard_link` asks the scheduler where the page is served.
"""

from __future__ import annotations

import contextlib

from dsched.checks import check_positive_int
from dsched.devices.ownership import has_dashboard
from dsched.names import DASHBOARD_PLUGIN as PLUGIN_NAME
from dsched.names import RUN_EVENT_TOPIC
from dsched.observe.hooks import RunObserver
from dsched.observe.dashboard.routes import scheduler_page_link

__all__ = ["track_run", "dashboard_link", "RunTotal"]


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
            client.run_on_scheduler(_end_run, client.id)


def dashboard_link(client) -> str | None:
    """The address of the dsched page on ``client``'s scheduler, or ``None`` without a dashboard."""
    return client.run_on_scheduler(scheduler_page_link)


class RunTotal(RunObserver):
    """Tells the page each run's total as it starts, so that ``dispatch()`` runs show their progress and ETA.

    One small event to the scheduler per run where the scheduler has the dashboard
    (a :func:`track_run` around the run, which names it too, takes precedence).
    Every async :class:`~dsched.WorkDispatcher` run has one.
    """

    def run_started(self, run):
        if run.client is not None and run.total > 0:
            # Only where a page reads it (asked once per scheduler), and waited for: the page takes the
            # total at the run's first chunk, which must not come first.
            client = run.client
            if has_dashboard(client):
                client.log_event(RUN_EVENT_TOPIC, (client.id, int(run.total)))
