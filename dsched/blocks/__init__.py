"""The dask.array path: a batch as a Dask array chunked by a scheduler's plan, and map_blocks over it."""

from dsched.blocks.map_blocks import TorchBlocks, as_batched, map_blocks
from dsched.blocks.planning import MAX_PLAN_CHUNKS, default_speeds, plan, plan_blocks

__all__ = ["plan", "plan_blocks", "as_batched", "map_blocks", "default_speeds", "TorchBlocks", "MAX_PLAN_CHUNKS"]
