"""Clusters: a local one with a worker per device, dask-mpi, placement plugins, and how much Dask logs.

==================  ==========================================================
module              holds
==================  ==========================================================
``local``           :class:`LocalHybridCluster`: one worker per device here
``mpi``             a cluster started by ``mpiexec``, a worker rank per device
``mpi_layout``      which rank owns which device; the layout as a table
``placement``       scheduler and worker plugins pinning blocks to devices
``logs``            Dask's log level, here and in worker processes
==================  ==========================================================
"""

from dsched.cluster.local import LocalHybridCluster

__all__ = ["LocalHybridCluster"]
