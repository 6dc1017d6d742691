"""Preload module making a command-line Dask scheduler dsched-ready.

    dask scheduler --preload plugins/dsched_scheduler.py

installs dsched's placement plugin, which pins every block of
``dsched.map_blocks`` to a worker owning its planned device. ``dsched``
must be importable by the scheduler (``pip install dsched``, or
``PYTHONPATH`` pointing at the repository).
"""

from dsched.placement import scheduler_dask_setup as dask_setup

__all__ = ["dask_setup"]
