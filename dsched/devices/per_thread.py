"""Per-thread models: build a model once per worker thread and device, reuse it for every chunk there.

Models that keep solver state on the object (NEML2's implicit updates keep
their Newton state, for one) must not be shared by the threads of a worker
that run chunks at once: one chunk would read another's state. Building the
model in every chunk is correct but slow. :class:`PerThread` builds it once
per (thread, device) and hands the same object to every later chunk of that
thread on that device.

A thread's models are not freed by the thread as it ends: they are handed
to the threads that go on, and freed by the next model lookup or at exit.
A thread that frees a torch tensor with autograd history lets go of the GIL
in the middle (in C++); if the interpreter starts to shut down meanwhile,
the thread cannot take the GIL back and is unwound through C++ code that
may not be, which aborts the process ("terminate called without an active
exception"). Dask's in-process workers end their threads as the cluster
closes, just before a script's exit: a NEML2 model that computed a
Jacobian made 4 runs in 10 of such a script abort.

``thread_init`` keeps its own contract (once per dispatcher and device); a
:class:`PerThread` needs no hook at all, so it works from :func:`dsched.dispatch`,
a :class:`~dsched.WorkDispatcher`'s ``do_work`` and graph files alike.

Examples
--------
>>> import numpy as np, dsched
>>> scale = PerThread(lambda device: (lambda x: 2 * x))   # build(device) -> model
>>> dsched.dispatch(scale, np.arange(4.0), scheduler=dsched.SimpleScheduler("cpu", 2), mode="sync").tolist()
[0.0, 2.0, 4.0, 6.0]
"""

from __future__ import annotations

import atexit
import threading
import uuid

from dsched.devices.context import current_device
from dsched.devices.device import Device
from dsched.devices.threads import limit_this_thread

__all__ = ["PerThread"]

_local = threading.local()  # this thread's models: {(token, device): model}
_ENDED = []  # the models of threads that ended, to be freed by a thread that goes on (see the module's docs)


class _Models(dict):
    """One thread's models; when the thread ends, they go to :data:`_ENDED` instead of being freed by it."""

    def __del__(self):
        if self:
            _ENDED.append(dict(self))  # one bytecode-level call under the GIL: no lock, which could let it go
            self.clear()


def _free_ended():
    """Free the models of ended threads here, in a thread that is not ending."""
    while _ENDED:
        try:
            _ENDED.pop()
        except IndexError:  # another thread took the last one
            return


atexit.register(_free_ended)  # at exit: by the main thread, before the interpreter shuts down


class PerThread:
    """A model built by ``build(device)`` once per worker thread and device.

    Parameters
    ----------
    build : callable
        ``build(device) -> model``, called on the worker thread the first time
        that thread runs a chunk on ``device`` (a :class:`~dsched.Device`, or
        ``None`` outside any chunk). It should put the model on that device
        (for torch: ``model.to(dsched.backends.torch_device(device))``).

    Notes
    -----
    The object pickles as its ``build`` and an identity, so every copy
    Dask sends to a worker finds the models its thread already built. Models
    live as long as their thread, and are freed by another one (see the
    module's docs). Calling the object calls the model:
    ``PerThread(build)(*args)`` is ``build(device)(*args)`` for the running
    chunk's device, so it can be passed straight to :func:`~dsched.dispatch`.
    """

    def __init__(self, build):
        if not callable(build):
            raise ValueError(f"build: expected a callable build(device) -> model, got {build!r}")
        self.build = build
        self._token = uuid.uuid4().hex

    def get(self, device=None):
        """This thread's model for ``device`` (default: the running chunk's device), built on first use."""
        limit_this_thread()  # a model's thread computes with this worker's share of the cores
        device = current_device() if device is None else Device(device)
        if _ENDED:
            _free_ended()
        models = _local.__dict__.get("models")
        if models is None:
            models = _local.models = _Models()
        key = (self._token, device)
        model = models.get(key)
        if model is None:
            model = models[key] = self.build(device)
        return model

    def __call__(self, *args, **kwargs):
        return self.get()(*args, **kwargs)

    def __getstate__(self):
        return {"build": self.build, "_token": self._token}

    def __repr__(self):
        return f"PerThread({self.build!r})"
