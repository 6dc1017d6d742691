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
100,000 points and 5 to 15 % off isoharden's (``dsched bench --only neml2
--neml2-points 100000 --neml2-block none``, against ``25000``). A model
without an implicit update (elasticity) has no Newton solve to stop early
and only a few passes over the points. When blocks' values were joined after
the last block, blocks made each of its forms slower (by some 15 % at 500,000
points, ``dsched bench --only neml2 --neml2-scenarios elasticity
--neml2-block none`` against ``25000``); written into the chunk's output rows
block by block (:mod:`dsched.models.neml2_evaluate`), they measured within the
run-to-run noise of one call per chunk, so
:class:`~dsched.models.neml2.NEML2Model` still cuts only the chunks of models
that solve. Blocks much smaller pay NEML2's own cost per
call too often. This is NEML2's own ``batch_size``: its schedulers hand a
device sub-batches.

GPUs want the whole chunk in one call, so blocks apply on CPU devices only.
Since a call's Newton solve converges over its own points, a blocked chunk
equals NEML2 run on the same blocks (as a chunked batch equals NEML2 run on
the same chunks), and one whole call within the solver's tolerance.

A compiled model (``neml2.compile``, ``torch.compile`` with static shapes)
builds one graph per distinct batch size. It calls NEML2 once per chunk unless
given a ``block`` (its fused kernels keep no large temporaries); with one, its
chunks are cut in *fixed* pieces of ``block`` rows (:func:`pieces`). Either way
a chunk or piece is padded up to a size already compiled (:class:`PaddedSizes`,
:func:`padded`): a device then sees its batch size, not every size a short last
chunk has.

>>> spans(10, 4)
[(0, 4), (4, 7), (7, 10)]
>>> pieces(10, 4)
[(0, 4), (4, 8), (8, 10)]
"""

from __future__ import annotations

import math
import threading

from dsched.devices.backends import NEML2

__all__ = ["BLOCK", "spans", "pieces", "rows_of", "joined", "PaddedSizes", "padded", "unpadded"]

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


def pieces(rows: int, block) -> list:
    """``rows`` cut into pieces of ``block`` rows, the last one short; one piece when ``block`` is ``None`` or not
    smaller than ``rows``."""
    if block is None or rows <= block:
        return [(0, rows)]
    return [(start, min(start + block, rows)) for start in range(0, rows, block)]


class PaddedSizes:
    """The batch sizes a compiled model has been called with, on one device of this process.

    :meth:`size` gives the size to evaluate ``rows`` rows at: the smallest one
    already used that holds them, else ``rows`` itself (a new size, one more
    compilation). Shared by the threads of a process, as torch's compiled
    graphs are.
    """

    def __init__(self):
        self._sizes, self._lock = [], threading.Lock()

    def size(self, rows: int) -> int:
        with self._lock:
            fits = [size for size in self._sizes if size >= rows]
            if fits:
                return min(fits)
            self._sizes.append(rows)
            return rows

    @property
    def sizes(self) -> list:
        return sorted(self._sizes)


_SIZES = {}  # (model token, device) -> PaddedSizes, per process
_SIZES_LOCK = threading.Lock()


def padded_sizes(key) -> PaddedSizes:
    """This process's :class:`PaddedSizes` for ``key`` (a model's identity and a device)."""
    with _SIZES_LOCK:
        return _SIZES.setdefault(key, PaddedSizes())


def padded(value, rows, size, zeros=False):
    """A NEML2 value batched over ``rows`` points, padded to ``size`` rows: its last row repeated (a point whose
    solve converges like its neighbour's), or ``zeros``; an unbatched value as it is."""
    if size == rows or NEML2.batch_shape(value) != (rows,):
        return value
    import torch

    data = value.data
    axis = NEML2._data_axis(value, 0)
    last = data.narrow(axis, rows - 1, 1)
    shape = list(data.shape)
    shape[axis] = size - rows
    fill = torch.zeros(shape, dtype=data.dtype, device=data.device) if zeros else last.expand(*shape)
    return NEML2._rewrap(value, torch.cat([data, fill], dim=axis))


def unpadded(value, rows, size):
    """The first ``rows`` rows of a result evaluated on ``size`` padded rows; an unbatched result as it is."""
    if size == rows or NEML2.batch_shape(value)[:1] != (size,):
        return value
    return NEML2.take(value, 0, 0, rows)


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
