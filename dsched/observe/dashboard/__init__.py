"""The dsched page of the Dask dashboard: devices per host, live plots, and the runs."""

from dsched.observe.dashboard.plugin import (COLUMNS, HTML_ROUTE, JSON_ROUTE, PAGE_ROUTE, PLOT_ROUTES, PLUGIN_NAME,
                                             DashboardPlugin, dashboard_link, dask_setup, install, register,
                                             register_page, scheduler_page_link, track_run)
from dsched.names import ITEMS_ANNOTATION

__all__ = ["DashboardPlugin", "install", "register", "register_page", "track_run", "dashboard_link",
           "scheduler_page_link", "dask_setup", "PLUGIN_NAME", "JSON_ROUTE", "PAGE_ROUTE", "HTML_ROUTE", "PLOT_ROUTES",
           "ITEMS_ANNOTATION", "COLUMNS"]
