"""``dispatch()``: the one-call form. Split arrays along the batch axis, call a function per chunk, join the results.

Arrays, and arrays in dicts, lists and tuples, among the arguments are cut into
chunks, each along its own axis (:class:`~dsched.dispatch.arguments.ArgsLayout`
records which are batched, so that each chunk's task carries its rows and
nothing of the batch); :class:`_CallOnChunk` rebuilds
the call on the worker, moves the chunk to its device, and brings the result
back to host memory. A :class:`~dsched.dispatch.dispatcher.WorkDispatcher`
with ``join="concat"`` does the rest.
"""

from __future__ import annotations

import copy
import functools
import os
import queue
import threading

import dask
import numpy as np

from dsched.checks import check_callable, setting
from dsched.dataplane.loaders import MappingLoader, resolve_axis
from dsched.dataplane.outputs import OutputLayout
from dsched.dataplane.pinned import results_may_stay_on_gpu
from dsched.dataplane.rundata import check_out
from dsched.dataplane.store import resolve_work
from dsched.devices import backends
from dsched.devices.context import numpy_cannot_reach
from dsched.devices.device import Device
from dsched.devices.threads import limit_this_thread
from dsched.dispatch.arguments import (ArgsLayout, argument_name, check_keywords, is_split, keep_grad_setting,
                                       out_axis_of)
from dsched.dispatch.dispatcher import WorkDispatcher
from dsched.dispatch.reuse import MAX_KEPT, RecentCalls, without_arrays
from dsched.dataplane.reduce import concat_reduce
from dsched.errors import as_recoverable

__all__ = ["dispatch"]

#: seconds dispatch() gives its probe of fn on one item (Dask config ``dsched.probe-timeout``)
PROBE_SECONDS = 2.0


class _CallOnChunk:
    """``do_work`` for :func:`dispatch`: calls ``fn`` on the rebuilt, device-resident arguments.

    Arrays move to the chunk's device through :mod:`dsched.backends` (torch
    tensors to the CUDA_VISIBLE_DEVICES-aware ``torch.device``; NumPy to CuPy
    on a real GPU), unless ``fn.moves_inputs`` says ``fn`` does that itself or
    ``host_arrays`` keeps every chunk in host memory (a NumPy model on a GPU
    worker), and the result comes back to host memory as the type ``fn`` returned. Autograd
    is kept only with ``keep_grad`` (default: the Dask config
    ``dsched.keep-grad``), which works where chunks run in the caller's
    process (sync mode, in-process workers).
    """

    def __init__(self, fn, layout, kwargs, keep_grad=None, host_arrays=False):
        self.fn, self.layout, self.kwargs, self.keep_grad = fn, layout, kwargs, keep_grad_setting(keep_grad)
        self.host_arrays = bool(host_arrays)

    def __call__(self, chunk, device):
        return self._call(chunk, device, None)

    def on_host(self, chunk):
        """:meth:`__call__` for a chunk of NumPy arrays on a device that computes on the host (the CPU, or an
        emulated GPU): nothing to move either way but a result that is not NumPy (a kept chunk,
        :mod:`dsched.worker.kept`)."""
        return self._on_host(chunk, None)

    def _call(self, chunk, device, out):
        limit_this_thread()  # torch's thread count is per thread: give this one the worker's share
        # Left on the host: a NumPy model on a GPU worker (host_arrays), or NEML2Model, which moves its inputs itself.
        if not (self.host_arrays or getattr(self.fn, "moves_inputs", False)):
            chunk = backends.to_device(chunk, device, keep_grad=self.keep_grad)
        # CuPy results whose chunk's slot copies them into page-locked rows stay on the GPU (dataplane.pinned).
        return backends.to_host(self._fn(chunk, out), keep_grad=self.keep_grad, keep_cupy=results_may_stay_on_gpu())

    def _on_host(self, chunk, out):
        limit_this_thread()
        result = self._fn(chunk, out)
        if type(result) is np.ndarray or type(result) is dict and all(type(v) is np.ndarray for v in result.values()):
            return result  # on the host already (a dict of them: a NEML2 model's outputs, perhaps its out= rows)
        return backends.to_host(result, keep_grad=self.keep_grad)

    def _fn(self, chunk, out):
        """``fn`` on the chunk (and its output rows, where given); NEML2's solve failures as recoverable errors."""
        kwargs = self.kwargs if out is None else {**self.kwargs, "out": out}
        try:
            return self.fn(*self.layout.rebuild(chunk), **kwargs)
        except RuntimeError as err:
            recoverable = as_recoverable(err)  # NEML2's own solve failures, from user code calling NEML2
            if recoverable is None:
                raise
            raise recoverable from err


class _CallOnChunkInto(_CallOnChunk):
    """:class:`_CallOnChunk` for a function that computes into its chunk's output rows, given as ``out=``
    (NumPy's convention) where they are writable views: a function marked ``fn.takes_out_rows = True``
    (a batch's update, :class:`~dsched.resident.host_update.ChunkUpdate`). Others never get ``out=``: an
    ``out`` keyword of a user's function may mean something else."""

    def __call__(self, chunk, device, out=None):
        return self._call(chunk, device, out)

    def on_host(self, chunk, out=None):
        return self._on_host(chunk, out)


def _chunk_call(fn, layout, kwargs, keep_grad=None, host_arrays=False):
    """dispatch's ``do_work`` for ``fn``: a :class:`_CallOnChunk`, or a :class:`_CallOnChunkInto` for a function
    that takes its output rows."""
    kind = _CallOnChunkInto if getattr(fn, "takes_out_rows", False) is True else _CallOnChunk
    return kind(fn, layout, kwargs, keep_grad, host_arrays)


def dispatch(fn, *args, scheduler, client=None, mode="async", axis=0, out_axis=None, trace_file=None, out=None,
             overwrite=False, timeout=None, keep_grad=None, host_arrays=False, **kwargs):
    """Evaluate ``fn`` over a batch split along ``axis`` by ``scheduler``; the joined result.

    Arrays in ``args``, and the arrays in dicts, lists and tuples there, are
    split (a scalar, an entry of size 1 along its axis and a container's
    non-array items go whole into every chunk); other arguments and
    ``kwargs`` pass unchanged. ``axis`` is every array's batch axis (a
    negative one counts from the end of each array's own shape), or one
    entry per argument, ``None`` for one that goes whole, a mapping or
    sequence of entries for a container (see :mod:`dsched.dispatch.arguments`).
    An array with no such axis is a ``ValueError``. ``fn`` returns an array,
    a tuple or a dict of arrays, joined along ``out_axis`` (default: the axis
    the arguments name, if they name one, else 0; negative ones per output)
    in order, in place: each chunk writes its own rows of the outputs where it runs, after a check
    that its result fits its chunk. On worker processes the inputs are
    placed once in shared memory and chunks carry references to them.
    ``out`` sends the outputs to a Zarr store (a path; ``overwrite`` replaces
    an existing one) or into arrays you provide. On a CUDA device the chunk
    is moved there (CuPy) before ``fn`` and the result back to host memory
    after, unless ``host_arrays``: then every chunk arrives as host arrays, for a
    model written with NumPy (it runs on the GPU worker's CPU threads, or moves
    its arrays to the GPU itself). ``trace_file`` writes a Chrome trace of the run (see
    :mod:`dsched.observe.trace`). torch tensors stay torch, their autograd
    dropped unless ``keep_grad`` (default: the Dask config
    ``dsched.keep-grad``), which joins the chunks' tensors themselves (in
    the caller's process only).

    Examples
    --------
    >>> import numpy as np
    >>> from dsched import SimpleScheduler
    >>> dispatch(np.square, np.arange(5.0), scheduler=SimpleScheduler("cpu", 2), mode="sync").tolist()
    [0.0, 1.0, 4.0, 9.0, 16.0]
    >>> F, state = np.ones((3, 3, 5)), np.zeros((2, 5))   # the batch axis last, ranks that differ
    >>> [a.shape for a in dispatch(lambda F, s: (2 * F, s + 1), F, state, scheduler=SimpleScheduler("cpu", 2),
    ...                             mode="sync", axis=-1)]
    [(3, 3, 5), (2, 5)]
    """
    quick = None
    if not kwargs and mode == "async" and trace_file is None and keep_grad is None and not overwrite:
        quick = _plain_call(fn, args, scheduler, client, axis, out_axis, timeout, host_arrays, out)
        kept = None if quick is None else _last.find(fn, scheduler, quick)
        if kept is not None:  # like one of the last plain calls of this thread
            return _last.run(kept, fn, args, out)
    call = PreparedCall(fn, args, kwargs, scheduler=scheduler, client=client, mode=mode, axis=axis,
                        out_axis=out_axis, trace_file=trace_file, out=out, overwrite=overwrite, timeout=timeout,
                        keep_grad=keep_grad, host_arrays=host_arrays)
    call.plain = quick
    return call.run()


def _plain_call(fn, args, scheduler, client, axis, out_axis, timeout, host_arrays, out):
    """What makes a call of NumPy arrays alone (arguments that are arrays, or dicts, lists and tuples of arrays;
    ``out=`` NumPy arrays or none), with no keywords and an integer axis (or one per argument), like another:
    ``None`` for any other call."""
    if not (type(axis) is int or type(axis) is tuple and all(type(a) is int for a in axis)):
        return None
    arguments = tuple(map(_argument_key, args))
    outs = _arrays_key(out)
    if outs is False or False in arguments:
        return None
    # The policy by its id (a policy need not be hashable; the kept call holds it, so the id stays its own).
    return (id(scheduler), client, axis, out_axis, timeout, host_arrays, setting("place-results", True),
            setting("keep-grad", False), arguments, outs)


def _argument_key(arg):
    """One argument's part of :func:`_plain_call`'s key: a NumPy array's shape and dtype, or a container's type
    and, per item, its name and an array's shape and dtype or a number's value (a dict, list or tuple of NumPy
    arrays and numbers, at least one array: dispatch splits it item by item, the numbers going whole);
    ``False`` for anything else."""
    kind = type(arg)
    if kind is np.ndarray:
        return arg.shape, arg.dtype.str
    if kind is dict:
        items = arg.items()
    elif kind is list or kind is tuple:
        items = enumerate(arg)
    else:
        return False
    key, arrays = [kind], 0
    for name, value in items:
        if type(value) is np.ndarray:
            key.append((name, value.shape, value.dtype.str))
            arrays += 1
        elif type(value) in (float, int):  # a NEML2 driver's old state at its first step: 0.0
            key.append((name, type(value), value))
        else:
            return False
    return tuple(key) if arrays else False


def _leaves(args):
    """The entries of a plain call's arguments (arrays, and numbers in containers), in the order
    :class:`ArgsLayout` enters them."""
    for arg in args:
        if type(arg) is np.ndarray:
            yield arg
        else:
            yield from (arg.values() if type(arg) is dict else arg)


def _arrays_key(out):
    """The structure, shapes and dtypes of ``out`` (NumPy arrays in tuples and dicts, or ``None``); ``False`` for
    anything else."""
    if out is None:
        return None
    if type(out) is np.ndarray:
        return out.shape, out.dtype.str
    if type(out) is tuple:
        keys = [_arrays_key(o) for o in out]
        return False if any(k is False or k is None for k in keys) else ("tuple", *keys)
    if type(out) is dict:
        keys = [(name, _arrays_key(o)) for name, o in out.items()]
        return False if any(k is False or k is None for _, k in keys) else ("dict", *keys)
    return False


class _LastCalls(threading.local):
    """The last few plain calls of this thread (:func:`_plain_call`) that ran on a recent call's dispatcher, by
    their key, kept without their arrays (and their function held weakly, as the recent call holds it): a like
    call skips its layout, checks and probe, which would come out the same. A few, not one: a solver's first
    steps pass its old state as numbers, the next as arrays, and each kind comes round again."""

    def __init__(self):
        # (id of the function, key) -> (recent call, layout, loader, signature), the most recently used last
        self.calls = {}

    def find(self, fn, scheduler, key):
        """The kept call like this one, made the most recently used; ``None`` if there is none."""
        kept = self.calls.pop((id(fn), key), None)
        if kept is None:
            return None
        recent = kept[0]
        client = key[1] if key[1] is not None else _default_client()  # the default client may have changed
        if recent.fn is not fn or recent.scheduler is not scheduler or client is not recent.client or \
                getattr(client, "status", "running") != "running":
            return None  # and forgotten: that function (whose id this one took) or that client is gone
        self.calls[(id(fn), key)] = kept
        return kept

    def keep(self, fn, key, runner, layout, loader, signature):
        self.calls.pop((id(fn), key), None)
        self.calls[(id(fn), key)] = (runner.recent, without_arrays(layout), loader.like({}), signature)
        while len(self.calls) > MAX_KEPT:
            del self.calls[next(iter(self.calls))]

    def run(self, kept, fn, args, out):
        recent, layout, loader, signature = kept
        loader = loader.like(dict(zip(loader.axes, _leaves(args))))
        return recent.run(fn, loader, layout, out, False, None, signature)


_last = _LastCalls()


def _default_client():
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        return None


class PreparedCall:
    """A :func:`dispatch` call checked and laid out, ready to :meth:`run` (now, or later on another thread).

    Everything a user can get wrong in the call's arguments is found here, before any work: the function,
    the axes, the arrays' sizes, ``out`` with ``keep_grad``.
    """

    def __init__(self, fn, args, kwargs, *, scheduler, client, mode, axis, out_axis, trace_file, out, overwrite,
                 timeout, keep_grad, host_arrays=False):
        check_callable(fn, "fn")
        check_keywords(fn, kwargs, dispatch)  # a typo'd keyword of dispatch's would otherwise reach the model
        keep_grad = keep_grad_setting(keep_grad)
        if keep_grad and out is not None:
            raise ValueError("out: outputs written in place carry no autograd graph; drop out= or keep_grad")
        self.layout = layout = ArgsLayout(args, keep_grad, axis)
        if not any(a is not None for a in layout.axes.values()):
            numbers = any(type(a) in (list, tuple) and a and all(isinstance(v, (int, float)) for v in a) for a in args)
            raise ValueError("args: dispatch needs at least one array (or container of arrays) to split"
                             + ("; a list of numbers is not one: np.asarray(...) makes one" if numbers else ""))
        if mode == "sync" and not host_arrays and not getattr(fn, "moves_inputs", False):
            _check_sync_devices(scheduler, layout)
        self.fn, self.kwargs, self.axis, self.out_axis = fn, kwargs, axis, out_axis_of(axis, out_axis)
        self.scheduler, self.client, self.mode, self.timeout = scheduler, client, mode, timeout
        self.trace_file, self.out, self.overwrite, self.keep_grad = trace_file, out, overwrite, keep_grad
        self.host_arrays = bool(host_arrays)
        self.loader = None if _batch_is_empty(layout) else _loader(layout, fn)
        self.plain = None  # dispatch's key of a plain call (_plain_call), for the next like one

    def run(self):
        """Dispatch the call; the joined result."""
        fn, layout, kwargs, out_axis = self.fn, self.layout, self.kwargs, self.out_axis
        if self.loader is None:
            return _empty_result(self.out, self.axis, out_axis)
        reused = None if self.keep_grad or self.trace_file is not None or self.mode != "async" else _REUSED.take(
            fn, layout, kwargs, scheduler=self.scheduler, client=self.client, axis=out_axis, timeout=self.timeout,
            host_arrays=self.host_arrays, place_results=bool(setting("place-results", True)))
        if reused is not None:  # a call like a recent one: its dispatcher, program and feeds again
            result = reused.run(self.loader, layout, self.out, self.overwrite)
            if self.plain is not None:  # the next like call skips all of the above
                signature, known = reused.known_layout(layout)
                if known or self.out is not None:  # the result's layout is known, or out= declares it
                    _last.keep(fn, self.plain, reused, layout, self.loader, signature)
            return result
        # Kept autograd needs the tensors themselves joined (torch.cat), not their values copied in place.
        join = dict(reduce=functools.partial(concat_reduce, axis=out_axis)) if self.keep_grad else dict(
            join="concat", axis=out_axis, out=self.out, overwrite=self.overwrite)
        if not self.keep_grad:  # the first chunks then write in place like the others (WorkDispatcher's layout_probe)
            join["layout_probe"] = functools.partial(_probe_layout, fn, layout, kwargs, out_axis)
        program = _chunk_call(fn, layout, kwargs, self.keep_grad, self.host_arrays)
        dispatcher = WorkDispatcher(self.scheduler, program, **join,
                                    timeout=self.timeout, mode=self.mode, client=self.client,
                                    trace_file=self.trace_file)
        with dispatcher:
            return dispatcher.run(self.loader)


def _check_sync_devices(scheduler, layout):
    """A sync run computes every chunk here: NumPy inputs bound for a CUDA device they cannot reach from this
    process are a one-line error before any work, not a failed first chunk (torch tensors move as torch does)."""
    device = _sync_device(scheduler)
    if device is None or not device.is_cuda or not any(type(v) is np.ndarray for v in layout.mapping.values()):
        return
    reason = numpy_cannot_reach(device)
    if reason is not None:
        raise ValueError(
            f"devices: {device} is out of this sync run's reach: {reason}; a sync run computes every chunk in "
            f"this process. Pass host_arrays=True for a NumPy model, emulate the device here (with "
            f"dsched.devices.emulating(['{device}']): ...), or run on a cluster that has it "
            f"(mode='async', client=...; LocalHybridCluster(..., emulate=True) to rehearse)")


def _sync_device(scheduler):
    """The device of every chunk of a sync run of ``scheduler`` (one of dsched's policies), or ``None`` (a policy
    of another kind: its first chunk's device then says what is missing)."""
    choice = getattr(scheduler, "zero_load_choice", None)
    device = choice() if choice is not None else None
    return None if device is None else Device(device)


def _loader(layout, fn):
    """The call's chunks: a :class:`MappingLoader` over the layout's entries, each along its own axis, named in
    errors as written (``args[1]['b'] ('params' of fn)``)."""
    return MappingLoader(layout.mapping, axis=layout.axes, names=functools.partial(argument_name, fn))


def _batch_is_empty(layout) -> bool:
    """Whether every batched entry has 0 items along its axis (nothing to dispatch)."""
    sizes = []
    for key, axis in layout.axes.items():
        shape = backends.batch_shape(layout.mapping[key])
        if axis is not None and shape:
            sizes.append(shape[resolve_axis(axis, shape, key)])
    return bool(sizes) and max(sizes) == 0


def _probe_layout(fn, layout, kwargs, axis):
    """The layout of ``fn``'s result, learned by calling it on the batch's first item, here on the client.

    A function marked ``fn.probe_outputs = False`` is never called this way
    (its first chunks then send their results back, and fix the layout); a
    callable ``fn.probe_outputs`` is called instead of ``fn``, with the same
    arguments, and returns a result of ``fn``'s layout without computing it
    (a model whose call has a high floor, such as :class:`~dsched.models.NEML2Model`).
    """
    probe = getattr(fn, "probe_outputs", True)
    if probe is False:
        return None
    _, first = _loader(layout, fn).next(1)
    first = {key: _read_only_copy(value) for key, value in resolve_work(first).items()}
    call = functools.partial(probe if callable(probe) else fn, *layout.rebuild(first), **kwargs)
    result = _within(call, float(dask.config.get("dsched.probe-timeout", PROBE_SECONDS)))
    if result is None:
        return None
    return OutputLayout.of(backends.to_host(result), 1, axis, where="dispatch's probe of fn on the first item")


def _within(call, seconds):
    """``call()``'s result if it returns within ``seconds``, else ``None``.

    The call runs on a thread of its own, which is left to finish if it runs
    over: a model that waits for something (a file, an event, another process)
    must not hold the run up before its first chunk is even sent. The thread
    waits for the next probe once done (starting one costs more than a cached probe).
    """
    box, done = {}, threading.Event()
    try:
        inbox = _idle_probe_threads.pop()
    except IndexError:
        inbox = queue.SimpleQueue()
        threading.Thread(target=_probe_thread, args=(inbox,), name="dsched-layout-probe", daemon=True).start()
    inbox.put((call, box, done))
    done.wait(seconds)
    if "error" in box:
        raise box["error"]
    return box.get("result")


_idle_probe_threads = []  # the inboxes of probe threads waiting for a call (at most one is kept)


def _probe_thread(inbox):
    while True:
        call, box, done = inbox.get()
        try:
            box["result"] = call()
        except BaseException as err:  # handed to the caller
            box["error"] = err
        keep = not _idle_probe_threads
        if keep:  # before done is set: the caller's next probe finds this thread
            _idle_probe_threads.append(inbox)
        done.set()
        if not keep:
            return
        call = box = done = None  # an idle thread must not keep the last probe's model (and its arrays) alive


def _read_only_copy(value):
    """One item of an input, copied, and read-only where NumPy: the probe must never touch the caller's batch."""
    if isinstance(value, np.ndarray):
        value = value.copy()
        value.flags.writeable = False
        return value
    backend = backends.backend_of(value, strict=False)  # a deep copy of a tensor view copies its whole storage
    if backend is backends.TORCH:  # (one item of a step of a history: all the history); a clone, the item
        return value.detach().clone()
    if backend is backends.NEML2:
        return backend._rewrap(value, value.data.detach().clone())
    return copy.deepcopy(value)


def _empty_result(out, axis, out_axis):
    """An empty batch: the ``out=`` arrays as given (they declare the outputs), else a one-line error."""
    if out is not None and not isinstance(out, (str, os.PathLike)):
        return check_out(out, 0, out_axis)
    raise ValueError(f"args: the batch is empty (0 items along axis {axis}); with nothing to run, dispatch cannot "
                     "know the outputs' shapes: pass out= arrays of 0 items to get them back")


# The dispatchers of recent calls, per thread (dsched.dispatch.reuse): built from this module's pieces.
# (``place_results``, Dask's config when the call's dispatcher is made, keeps calls made under another apart.)
_REUSED = RecentCalls(lambda fn, layout, kwargs, axis, host_arrays, place_results: _chunk_call(
                          fn, layout, kwargs, host_arrays=host_arrays),
                      lambda fn, layout, kwargs, axis: functools.partial(_probe_layout, fn, layout, kwargs, axis),
                      is_split)
