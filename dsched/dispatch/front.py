"""``dispatch()``: the one-call form. Split arrays along the batch axis, call a function per chunk, join the results.

Arrays and dicts of arrays among the arguments are cut into chunks
(:class:`_ArgsLayout` records which arguments are batched, so that each chunk's
task carries its rows and nothing of the batch); :class:`_CallOnChunk` rebuilds
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
from dataclasses import dataclass

import dask
import numpy as np

from dsched.dataplane.loaders import MappingLoader
from dsched.dataplane.outputs import OutputLayout
from dsched.dataplane.rundata import check_out
from dsched.dataplane.sources import as_streamed
from dsched.dataplane.store import resolve_work
from dsched.devices import backends
from dsched.devices.threads import limit_this_thread
from dsched.dispatch.dispatcher import WorkDispatcher
from dsched.dispatch.reuse import RecentCalls
from dsched.dispatch.reduce import concat_reduce
from dsched.dispatch.signature import argument_name, check_keywords
from dsched.errors import as_recoverable

__all__ = ["dispatch"]

#: seconds dispatch() gives its probe of fn on one item (Dask config ``dsched.probe-timeout``)
PROBE_SECONDS = 2.0


def _is_array(x, field="args") -> bool:
    """Whether ``x`` is an array of a known backend; a ValueError naming ``field`` for look-alikes."""
    kind = type(x).__name__
    if type(x).__module__.partition(".")[0] == "pandas" and kind in ("DataFrame", "Series"):
        how = "its columns, {name: df[name].to_numpy()}, or df.to_numpy()" if kind == "DataFrame" \
            else "series.to_numpy()"
        raise ValueError(f"{field}: a pandas {kind} is not split by dsched; pass {how}")
    try:
        return backends.is_array(x)
    except backends.UnsupportedArrayError as err:
        raise backends.UnsupportedArrayError(f"{field}: {err}") from None


def _is_mapping_of_arrays(x, field="args") -> bool:
    """A dict holding at least one array: split like a MappingLoader (non-arrays go whole)."""
    return isinstance(x, dict) and any([_is_array(v, f"{field}[{k!r}]") for k, v in x.items()])


def _keep_grad(keep_grad) -> bool:
    """``keep_grad`` if given, else the Dask config ``dsched.keep-grad`` (read on the client)."""
    if keep_grad is None:
        keep_grad = dask.config.get("dsched.keep-grad", False)
    return bool(keep_grad)


class _ArgsLayout:
    """Flattens ``args`` into a mapping of batched entries and rebuilds them per chunk.

    Inputs keep their type (torch and NEML2 tensors stay tensors). Their
    autograd history is dropped (``detach``, no copy) unless ``keep_grad``:
    a graph cannot cross to a worker process, and slicing it per chunk
    would only grow it.
    """

    def __init__(self, args, keep_grad=None):
        # Per argument: _BATCHED, the keys of a mapping, or the argument itself. Never the
        # arrays: the layout travels with every chunk's task, the batch must not.
        self.skeleton = []
        self.mapping = {}
        prepare = (lambda v: v) if _keep_grad(keep_grad) else backends.detach
        for i, arg in enumerate(args):
            # A Zarr or Dask array (alone or in a dict) is streamed: its rows are read chunk by chunk, where each runs.
            arg = {k: as_streamed(v) for k, v in arg.items()} if isinstance(arg, dict) else as_streamed(arg)
            if _is_array(arg, f"args[{i}]"):
                self.mapping[f"args[{i}]"] = prepare(arg)
                self.skeleton.append(_BATCHED)
            elif _is_mapping_of_arrays(arg, f"args[{i}]"):
                for k, v in arg.items():
                    self.mapping[f"args[{i}][{k!r}]"] = prepare(v)
                self.skeleton.append(_MappingKeys(tuple(arg)))
            else:
                self.skeleton.append(arg)

    def __getstate__(self):
        return {"skeleton": self.skeleton, "mapping": {}}  # the worker rebuilds from the chunk alone

    def rebuild(self, chunk):
        out = []
        for i, arg in enumerate(self.skeleton):
            if isinstance(arg, _Batched):
                out.append(chunk[f"args[{i}]"])
            elif isinstance(arg, _MappingKeys):
                out.append({k: chunk[f"args[{i}][{k!r}]"] for k in arg.keys})
            else:
                out.append(arg)
        return out


class _Batched:
    """Marks an argument that is split per chunk (compared by type: it survives pickling)."""


_BATCHED = _Batched()


@dataclass(frozen=True)
class _MappingKeys:
    keys: tuple


class _CallOnChunk:
    """``do_work`` for :func:`dispatch`: calls ``fn`` on the rebuilt, device-resident arguments.

    Arrays move to the chunk's device through :mod:`dsched.backends` (torch
    tensors to the CUDA_VISIBLE_DEVICES-aware ``torch.device``; NumPy to CuPy
    on a real GPU), unless ``fn.moves_inputs`` says ``fn`` does that itself, and the
    result comes back to host memory as the type ``fn`` returned. Autograd
    is kept only with ``keep_grad`` (default: the Dask config
    ``dsched.keep-grad``), which works where chunks run in the caller's
    process (sync mode, in-process workers).
    """

    def __init__(self, fn, layout, kwargs, keep_grad=None):
        self.fn, self.layout, self.kwargs, self.keep_grad = fn, layout, kwargs, _keep_grad(keep_grad)

    def __call__(self, chunk, device):
        limit_this_thread()  # torch's thread count is per thread: give this one the worker's share
        if not getattr(self.fn, "moves_inputs", False):  # e.g. NEML2Model, which moves its inputs itself
            chunk = backends.to_device(chunk, device, keep_grad=self.keep_grad)
        args = self.layout.rebuild(chunk)
        try:
            result = self.fn(*args, **self.kwargs)
        except RuntimeError as err:
            recoverable = as_recoverable(err)  # NEML2's own solve failures, from user code calling NEML2
            if recoverable is None:
                raise
            raise recoverable from err
        return backends.to_host(result, keep_grad=self.keep_grad)


def dispatch(fn, *args, scheduler, client=None, mode="async", axis=0, trace_file=None, out=None, overwrite=False,
             timeout=None, keep_grad=None, **kwargs):
    """Evaluate ``fn`` over a batch split along ``axis`` by ``scheduler``; the joined result.

    Arrays and dicts holding arrays in ``args`` are split (entries of size 1
    along ``axis``, and a dict's non-array entries, go whole into every chunk); other arguments and ``kwargs`` pass
    unchanged. ``fn`` returns an array, a tuple or a dict of arrays, joined
    along ``axis`` in order, in place: each chunk writes its own rows of the
    outputs where it runs, after a check that its result fits its chunk. On
    worker processes the inputs are placed once in shared memory and chunks
    carry references to them. ``out`` sends the outputs to a Zarr store (a
    path; ``overwrite`` replaces an existing one) or into arrays you provide.
    On a CUDA device the chunk is moved there (CuPy) before ``fn`` and the
    result back to host memory after. ``trace_file`` writes a Chrome trace of
    the run (see :mod:`dsched.observe.trace`). torch tensors stay torch, their autograd
    dropped unless ``keep_grad`` (default: the Dask config ``dsched.keep-grad``),
    which joins the chunks' tensors themselves (in the caller's process only).

    Examples
    --------
    >>> import numpy as np
    >>> from dsched import SimpleScheduler
    >>> dispatch(np.square, np.arange(5.0), scheduler=SimpleScheduler("cpu", 2), mode="sync").tolist()
    [0.0, 1.0, 4.0, 9.0, 16.0]
    """
    if not callable(fn):
        raise ValueError(f"fn: expected a callable, got {fn!r}")
    check_keywords(fn, kwargs, dispatch)  # a typo'd keyword of dispatch's would otherwise reach the model
    keep_grad = _keep_grad(keep_grad)
    if keep_grad and out is not None:
        raise ValueError("out: outputs written in place carry no autograd graph; drop out= or keep_grad")
    layout = _ArgsLayout(args, keep_grad)
    if not layout.mapping:
        raise ValueError("args: dispatch needs at least one array (or dict of arrays) to split")
    if _batch_is_empty(layout.mapping, axis):
        return _empty_result(out, axis)
    loader = MappingLoader(layout.mapping, axis=axis, names=functools.partial(argument_name, fn))
    reused = None if keep_grad or trace_file is not None or mode != "async" else _REUSED.take(
        fn, layout, kwargs, scheduler=scheduler, client=client, axis=axis, timeout=timeout)
    if reused is not None:  # a call like a recent one: its dispatcher, program and feeds again
        return reused.run(loader, layout, out, overwrite)
    # Kept autograd needs the tensors themselves joined (torch.cat), not their values copied in place.
    join = dict(reduce=functools.partial(concat_reduce, axis=axis)) if keep_grad else dict(
        join="concat", axis=axis, out=out, overwrite=overwrite)
    if not keep_grad:  # the first chunks then write in place like the others (see WorkDispatcher's layout_probe)
        join["layout_probe"] = functools.partial(_probe_layout, fn, layout, kwargs, axis)
    dispatcher = WorkDispatcher(
        scheduler,
        _CallOnChunk(fn, layout, kwargs, keep_grad),
        **join,
        timeout=timeout,
        mode=mode,
        client=client,
        trace_file=trace_file,
    )
    with dispatcher:
        return dispatcher.run(loader)


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
    _, first = MappingLoader(layout.mapping, axis=axis).next(1)
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


def _batch_is_empty(mapping, axis) -> bool:
    """Whether every batched argument has 0 items along ``axis`` (nothing to dispatch)."""
    sizes = [backends.batch_shape(v)[axis] for v in mapping.values() if len(backends.batch_shape(v)) > axis]
    return bool(sizes) and max(sizes) == 0


def _empty_result(out, axis):
    """An empty batch: the ``out=`` arrays as given (they declare the outputs), else a one-line error."""
    if out is not None and not isinstance(out, (str, os.PathLike)):
        return check_out(out, 0, axis)
    raise ValueError(f"args: the batch is empty (0 items along axis {axis}); with nothing to run, dispatch cannot "
                     "know the outputs' shapes: pass out= arrays of 0 items to get them back")


# The dispatchers of recent calls, per thread (dsched.dispatch.reuse): built from this module's pieces.
_REUSED = RecentCalls(lambda fn, layout, kwargs, axis: _CallOnChunk(fn, layout, kwargs),
                      lambda fn, layout, kwargs, axis: functools.partial(_probe_layout, fn, layout, kwargs, axis),
                      lambda entry: isinstance(entry, (_Batched, _MappingKeys)))
