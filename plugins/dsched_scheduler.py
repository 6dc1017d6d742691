"""Preload module making a command-line Dask scheduler dsched-ready.

    dask scheduler --preload plugins/dsched_scheduler.py

installs dsched's placement plugin, which pins every block of
``dsched.map_blocks`` to a worker owning its planned device, and the dsched
dashboard: the ``/individual-dsched`` page (in the dashboard's "More" menu,
listed by ``register_page`` here, when the module is imported: before the
scheduler starts) and the ``/dsched/status.json`` route. ``dsched`` must be
importable by the scheduler (``pip install dsched``, or ``PYTHONPATH``
pointing at the repository).
"""

from dsched.cluster.placement import scheduler_dask_setup
from dsched.observe.dashboard import install
from dsched.observe.dashboard import preload  # noqa: F401  (importing it lists the page, before the scheduler starts)


def dask_setup(scheduler):
    scheduler_dask_setup(scheduler)
    install(scheduler)


__all__ = ["dask_setup"]
