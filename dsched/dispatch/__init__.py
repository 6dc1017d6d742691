"""Dispatching: NEML2's WorkDispatcher over a Dask cluster, and the one-call ``dispatch()``.

==================  ==========================================================
module              holds
==================  ==========================================================
``dispatcher``      :class:`WorkDispatcher`: configuration, a run, the sync loop
``async_run``       one async run: the loop, completions, timeouts, lost devices
``tasks``           transport: chunks as Dask tasks, or packs of chunks
``feeds``           transport: device feeds, one message per chunk (client side)
``completion``      hearing that chunks finished (or a cancel); devices that lost their workers
``front``           ``dispatch()``: check and lay out a call, run it, join
``arguments``       which arguments are split, along which axis; keywords the model takes
``submit``          ``submit()``: a call that returns a future at once
``lanes``           transport: the same-host fast lane of device feeds
``reuse``           calls like a recent one reuse its dispatcher
``parking``         feeds parked between calls, and workers that left
``reduce``          joining chunk results in dispatch order
==================  ==========================================================

The worker half of a chunk's journey lives in :mod:`dsched.worker`.
"""

from dsched.dispatch.dispatcher import WorkDispatcher
from dsched.dispatch.front import dispatch
from dsched.dispatch.submit import DispatchFuture, submit
from dsched.observe.report import ChunkRecord, RunReport

__all__ = ["WorkDispatcher", "dispatch", "submit", "DispatchFuture", "ChunkRecord", "RunReport"]
