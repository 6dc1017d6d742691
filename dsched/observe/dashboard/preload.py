"""A Dask preload module for the dsched page: ``dask scheduler --preload dsched.observe.dashboard.preload``.

Importing it lists the dsched page among the dashboard's pages
(:func:`~dsched.observe.dashboard.register_page`), which has to happen before
the scheduler builds its dashboard: Dask imports a preload module first and
calls its ``dask_setup`` only once the scheduler exists. ``dask_setup`` then
installs the scheduler plugin that feeds the page.
"""

from dsched.observe.dashboard.plots import register_page
from dsched.observe.dashboard.plugin import dask_setup

__all__ = ["dask_setup"]

try:
    register_page()
except ImportError:  # no Bokeh: the JSON route and the plain HTML page still work
    pass
