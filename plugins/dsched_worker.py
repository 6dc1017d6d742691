"""Preload module making a command-line Dask worker own a dsched device.

    dask worker ADDR --preload plugins/dsched_worker.py --resources "dsched-cpu=1000000"
    dask worker ADDR --preload plugins/dsched_worker.py --dsched-device cuda:0 [--dsched-capacity N]
    dask worker ADDR --preload plugins/dsched_worker.py --dsched-device cuda:0 --dsched-emulate

With neither ``--resources dsched-...`` nor ``--dsched-device``, the worker
claims the GPU it sees (its first ``CUDA_VISIBLE_DEVICES`` entry, as
``dask cuda worker`` pins them) or else the CPU. The options come after the
scheduler address; ``dask worker`` hands them to this module.
"""

from dsched.cluster.placement import worker_dask_setup as dask_setup

__all__ = ["dask_setup"]
