"""A chunk of material points evaluated in cache-sized blocks of rows, on a CPU.

A NEML2 model is a chain of small tensor operations, each of which reads
and writes every point's values in memory: on a chunk of 250,000 points an
``SR2`` temporary is 12 MB, which no core's cache holds. And NEML2's Newton
solve tests convergence over all the points of a call, so every point
iterates until the slowest has converged. Evaluating a chunk in blocks of
some 25,000 points keeps a block's temporaries nearer the core, and lets a
block stop iterating when its own points have converged. With two worker
processes on a 2-core machine, each given half the points, blocks took
about a third off a dispatch per step of NEML2's radret scenario at
100,000 points, 5 to 15 % off isoharden's, and made no difference beyond
the machine's noise to elasticity at 500,000 (``dsched bench --only neml2
--neml2-points 100000 --neml2-block none``, against the default
``25000``). Blocks much smaller pay NEML2's own cost per call too often.
This is NEML2's own ``batch_size``: its schedulers hand a device
sub-batches.

GPUs want the whole chunk in one call, so blocks apply on CPU devices only.
Since a call's Newton solve converges over its own points, a blocked chunk
equals NEML2 run on the same blocks (as a chunked batch equals NEML2 run on
the same chunks), and one whole call within the solver's tolerance.

>>> spans(10, 4)
[(0, 4), (4, 7), (7, 10)]
"""

from __future__ import annotations

import math

from dsched.devices.backends import NEML2

__all__ = ["BLOCK", "spans", "rows_of", "joined"]

#: Points per NEML2 call on a CPU (:class:`~dsched.models.neml2.NEML2Model`'s ``block``; see the module docs).
BLOCK = 25_000


def spans(rows: int, block) -> list:
    """``rows`` cut into the fewest blocks of at most ``block`` rows, of equal sizes (the first ones one
    larger); one span when ``block`` is ``None`` or not smaller than ``rows``."""
    if block is None or rows <= block:
        return [(0, rows)]
    count = math.ceil(rows / block)
    size, extra = divmod(rows, count)
    bounds = [0]
    for i in range(count):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def rows_of(value, start, stop, rows):
    """Rows ``start:stop`` of a NEML2 value batched over ``rows`` points; an unbatched value as it is."""
    if NEML2.batch_shape(value) != (rows,):
        return value  # broadcast to every point (NEML2's rule), so to every block
    return NEML2.take(value, 0, start, stop)


def joined(pieces, bounds, allocate=None, keep_grad=False):
    """One NEML2 value (a typed value, or a Jacobian block) over every point from one value per block
    (``bounds``: the blocks' spans).

    A piece NEML2 left unbatched (nothing varied in its block) is expanded to
    its block's rows. ``allocate(shape, dtype)`` makes the joined storage (a
    torch tensor), so NumPy results can be allocated where dsched places them.
    """
    pieces = [NEML2.expanded(piece, (stop - start,)) for piece, (start, stop) in zip(pieces, bounds)]
    if keep_grad or allocate is None:
        return NEML2.concatenate(pieces, 0)
    import torch

    first = pieces[0]
    axis = NEML2._data_axis(first, 0)
    shape = list(first.data.shape)
    shape[axis] = bounds[-1][1]
    data = allocate(tuple(shape), first.data.dtype)
    # NEML2's autograd history is dropped, as the caller asked: torch.cat(out=) takes no graph.
    torch.cat([piece.data.detach() for piece in pieces], dim=axis, out=data)
    return NEML2._rewrap(first, data)
