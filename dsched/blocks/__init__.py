"""The dask.array path: a batch as a Dask array chunked by a scheduler's plan, and map_blocks over it."""

from dsched.blocks.map_blocks import (MAX_PLAN_CHUNKS, TorchBlocks, as_batched, default_speeds, map_blocks, plan,
                                      plan_blocks)

__all__ = ["plan", "plan_blocks", "as_batched", "map_blocks", "default_speeds", "TorchBlocks", "MAX_PLAN_CHUNKS"]
