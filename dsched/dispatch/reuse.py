"""Calls like a recent one reuse its dispatcher: a solver's call, again and again, pays for its set-up once.

:func:`dsched.dispatch` builds a :class:`~dsched.dispatch.dispatcher.WorkDispatcher`,
its chunk program and a probe of the function on the batch's first item for
every call. A solver calls the same function on arrays of the same shapes at
every iteration. So a call like one of the last few made on the same thread
runs on that call's dispatcher: its program is the one the parked feeds hold
already, so nothing of it travels again (:mod:`dsched.dispatch.feeds`), and
the layout of the function's result, probed on the first call, is known for
the next calls with inputs of the same shapes and types.

A call is *like* a recent one when it names the same function object,
scheduler, client (or the same default client), output axis, timeout and options, and its
arguments that are not split and its keyword arguments are equal plain values
(numbers, strings, ``None``). Calls with anything else among those build their
own dispatcher, so that no caller's array or model is kept alive here beyond
the function itself. At most :data:`MAX_KEPT` calls are kept per thread; a
reused dispatcher forgets each call's inputs and outputs once it returns.
"""

from __future__ import annotations

import copy
import threading
import weakref

from dsched.dataplane.loaders import items_signature
from dsched.dispatch.dispatcher import WorkDispatcher

__all__ = ["RecentCalls", "MAX_KEPT", "without_arrays"]

MAX_KEPT = 4  # recent calls kept per thread
_PLAIN = (int, float, complex, str, bytes, bool, type(None))


def _plain(value) -> bool:
    return type(value) in _PLAIN


def _same(a, b) -> bool:
    return type(a) is type(b) and (a is b or a == b)


class _Recent:
    """One recent call: what makes another call like it, and its dispatcher.

    The function is held weakly, and the dispatcher's program (``call``) holds it
    only while a call runs: a model the caller lets go of is not kept alive here.
    """

    def __init__(self, fn, scheduler, client, axis, options, skeleton, kwargs, dispatcher, call):
        self.fn_ref = _weak(fn)
        self.scheduler, self.client, self.axis, self.options = scheduler, client, axis, options
        self.skeleton, self.kwargs, self.dispatcher, self.call = skeleton, kwargs, dispatcher, call
        self.layouts = {}  # the input signature -> the layout of fn's result probed for it
        call.fn = None

    @property
    def fn(self):
        return self.fn_ref()

    def matches(self, fn, scheduler, client, axis, options, skeleton, kwargs) -> bool:
        return (fn is self.fn and scheduler is self.scheduler and client is self.client and axis == self.axis
                and options == self.options and len(skeleton) == len(self.skeleton)
                and all(_same(a, b) for a, b in zip(skeleton, self.skeleton))
                and kwargs.keys() == self.kwargs.keys() and all(_same(v, self.kwargs[k]) for k, v in kwargs.items()))

    def run(self, fn, loader, layout, out, overwrite, probe, signature=None):
        """Run the call of ``fn`` on the kept dispatcher; the joined result. ``signature``: the inputs', if known."""
        dispatcher = self.dispatcher
        self.call.fn = fn
        signature = items_signature(layout.mapping, layout.axes) if signature is None else signature
        known = self.layouts.get(signature)
        dispatcher.out, dispatcher.overwrite = out, bool(overwrite)
        dispatcher._layout = known
        dispatcher._layout_probe = None if known is not None or probe is None else self._learning(probe, signature)
        try:
            return dispatcher.run(loader)
        finally:  # the caller's model and arrays, in and out, are not kept here (lent outputs go back to the pool)
            dispatcher.out = dispatcher.last_run = dispatcher._last_generator = dispatcher._layout_probe = None
            self.call.fn = None

    def _learning(self, probe, signature):
        def learn():
            found = probe()
            if found is not None:
                self.layouts[signature] = found
            return found

        return learn


class RecentCalls:
    """The recent calls of each thread (:class:`_Recent`), and the dispatchers they run on.

    Parameters
    ----------
    make_call : callable
        ``make_call(fn, layout, kwargs, axis, **options)`` -> the ``do_work`` of a call (:func:`dsched.dispatch`'s),
        whose ``fn`` attribute is the function it calls (set while a call runs).
    make_probe : callable
        ``make_probe(fn, layout, kwargs, axis)`` -> ``probe()``, the layout of ``fn``'s result.
    is_split : callable
        ``is_split(entry)``: whether an entry of a layout's ``skeleton`` stands for a split argument (its others
        are the arguments passed whole).
    """

    def __init__(self, make_call, make_probe, is_split):
        self.make_call, self.make_probe, self.is_split = make_call, make_probe, is_split
        self._local = threading.local()

    def take(self, fn, layout, kwargs, *, scheduler, client, axis, timeout, **options):
        """The call's runner: a recent call's, or a new one kept from now on; ``None`` if the call cannot be
        kept (arguments that are not plain values, or no client to run on without starting a cluster).
        ``options`` (plain values) are the program's: calls are alike only with equal ones."""
        skeleton = list(layout.skeleton)  # split arguments' marks, and the others' values, in order
        if not all(self.is_split(v) or _plain(v) for v in skeleton) or not all(_plain(v) for v in kwargs.values()):
            return None
        if client is None:
            from distributed import default_client

            try:
                client = default_client()
            except ValueError:  # no client: the call starts (and closes) a cluster of its own
                return None
        if getattr(client, "status", "running") != "running":
            return None
        kept = self._local.__dict__.setdefault("calls", [])
        # Functions let go of since, and clients closed since (a closed cluster is not kept alive here).
        kept[:] = [recent for recent in kept
                   if recent.fn is not None and getattr(recent.client, "status", "running") == "running"]
        for i, recent in enumerate(kept):
            if recent.matches(fn, scheduler, client, axis, (timeout, options), skeleton, kwargs):
                kept.insert(0, kept.pop(i))
                break
        else:
            call = self.make_call(fn, without_arrays(layout), dict(kwargs), axis, **options)
            dispatcher = WorkDispatcher(scheduler, call, join="concat", axis=axis, timeout=timeout, client=client)
            recent = _Recent(fn, scheduler, client, axis, (timeout, options), skeleton, dict(kwargs), dispatcher,
                             call)
            kept.insert(0, recent)
            del kept[MAX_KEPT:]
        return _Runner(recent, fn, self.make_probe(fn, layout, kwargs, axis))


class _Runner:
    """One call on a recent call's dispatcher."""

    def __init__(self, recent, fn, probe):
        self.recent, self.fn, self.probe = recent, fn, probe

    def run(self, loader, layout, out, overwrite):
        return self.recent.run(self.fn, loader, layout, out, overwrite, self.probe)

    def known_layout(self, layout):
        """``(signature of layout's inputs, whether the layout of fn's result is known for it)``."""
        signature = items_signature(layout.mapping, layout.axes)
        return signature, signature in self.recent.layouts


class _Strong:
    """A function that cannot be referenced weakly (a builtin): held, like a weak reference's target."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self):
        return self.fn


def _weak(fn):
    try:
        return weakref.ref(fn)
    except TypeError:
        return _Strong(fn)


def without_arrays(layout):
    """A copy of ``layout`` without its arrays: the kept dispatcher's program must not hold the first call's
    batch (a worker rebuilds each chunk's arguments from the skeleton alone)."""
    stripped = copy.copy(layout)
    stripped.mapping = {}
    return stripped
