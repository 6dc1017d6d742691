"""The data plane: where a batch's inputs live, how chunks reach them, and where outputs go.

==================  ==========================================================
module              holds
==================  ==========================================================
``loaders``         work generators: cut a batch into chunks
``segments``        shared-memory segments: made, mapped, page-locked, swept
``store``           shared memory: a batch placed once, chunks carry references
``outputs``         joined outputs written in place, row by row
``pinned``          page-locked host memory and a CUDA stream per chunk
``rundata``         one run's data plane, from its generator to its outputs
==================  ==========================================================
"""

from dsched.dataplane.rundata import RunData, check_out, direct_to_workers, zarr_chunk_items

__all__ = ["RunData", "check_out", "direct_to_workers", "zarr_chunk_items"]
