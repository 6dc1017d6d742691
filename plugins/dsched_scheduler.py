"""Preload module making a command-line Dask scheduler dsched-ready.

    dask scheduler --preload plugins/dsched_scheduler.py

installs dsched's placement plugin, which pins every block of
``dsched.map_blocks`` to a worker owning its planned device, and the dsched
dashboard: the ``/individual-dsched`` page (in the dashboard's "More" menu,
listed because importing ``dsched.dashboard`` here happens before the
scheduler starts) and the ``/dsched/status.json`` route. ``dsched`` must be
importable by the scheduler (``pip install dsched``, or ``PYTHONPATH``
pointing at the repository).
"""

import dsched.observe.dashboard
from dsched.cluster.placement import scheduler_dask_setup


def dask_setup(scheduler):
    scheduler_dask_setup(scheduler)
    dsched.observe.dashboard.install(scheduler)


__all__ = ["dask_setup"]
