"""The dsched page of the Dask dashboard: devices per host, live plots, and the runs.

==============  ==============================================================
module          holds
==============  ==============================================================
``plugin``      :class:`DashboardPlugin` (scheduler side: what the page shows),
                :func:`install`, :func:`register`, :func:`dask_setup`
``routes``      where the page is served; the JSON route and the plain HTML page
``plots``       the Bokeh page and plots; :func:`register_page` lists them
``client``      :func:`track_run` (a run's total), :func:`dashboard_link`,
                :func:`flush_page` (the page has heard of every call so far)
``metrics``     the ``dsched_`` Prometheus families of the scheduler's ``/metrics``,
                read from the plugin when scraped
``gpu``         the worker side of ``/metrics``: a GPU worker's memory (NVML)
==============  ==============================================================

How to get it
-------------
- :class:`~dsched.LocalHybridCluster` installs it whenever it has a dashboard.
- Clusters started from the command line: ``dask scheduler --preload dsched.observe.dashboard.preload``
  (or a preload module that calls :func:`register_page` when it is imported and
  :func:`install` from its ``dask_setup``, as ``plugins/dsched_scheduler.py`` does;
  the old path ``--preload dsched.dashboard`` works too).
- dask-mpi: :mod:`dsched.mpi` does it; with plain ``dask_mpi.initialize()``,
  import :mod:`dsched.observe.dashboard.preload` at the top of the script (so
  rank 0 lists the pages before its scheduler starts) and call :func:`register`
  on the client rank.
- A running scheduler: ``register(client)`` adds the JSON route and the plain
  page; the Bokeh pages need this module imported (or :func:`register_page`
  called) in the scheduler's process before the scheduler starts, which is
  when Dask builds its dashboard.

Importing this package does nothing but define names. Listing the page is
the job of :mod:`~dsched.observe.dashboard.preload`, which does it when imported:
Dask imports a preload module before it builds the scheduler's dashboard, and
calls its ``dask_setup`` only after.
"""

from dsched.names import ITEMS_ANNOTATION
from dsched.observe.dashboard.client import dashboard_link, flush_page, track_run
from dsched.observe.dashboard.plots import register_page
from dsched.observe.dashboard.plugin import PLUGIN_NAME, DashboardPlugin, dask_setup, install, register
from dsched.observe.dashboard.routes import (
                                             COLUMNS,
                                             HTML_ROUTE,
                                             JSON_ROUTE,
                                             PAGE_ROUTE,
                                             PLOT_ROUTES,
                                             scheduler_page_link,
)

__all__ = ["DashboardPlugin", "install", "register", "register_page", "track_run", "dashboard_link", "flush_page",
           "scheduler_page_link", "dask_setup", "PLUGIN_NAME", "JSON_ROUTE", "PAGE_ROUTE", "HTML_ROUTE", "PLOT_ROUTES",
           "ITEMS_ANNOTATION", "COLUMNS"]
