"""Dispatching: NEML2's WorkDispatcher over a Dask cluster, and the one-call ``dispatch()``.

==================  ==========================================================
module              holds
==================  ==========================================================
``dispatcher``      :class:`WorkDispatcher`: configuration, a run, the sync loop
``async_run``       one async run: the loop, completions, timeouts, lost devices
``tasks``           transport: chunks as Dask tasks, or packs of chunks
``feeds``           transport: device feeds, one message per chunk (client side)
``completion``      hearing that chunks finished; devices that lost their workers
``front``           ``dispatch()``: split the arguments, call, join
``signature``       what the model's signature says: unknown keywords, names
``reduce``          joining chunk results in dispatch order
==================  ==========================================================

The worker half of a chunk's journey lives in :mod:`dsched.worker`.
"""

from dsched.dispatch.dispatcher import WorkDispatcher
from dsched.dispatch.front import dispatch
from dsched.observe.report import ChunkRecord, RunReport

__all__ = ["WorkDispatcher", "dispatch", "ChunkRecord", "RunReport"]
