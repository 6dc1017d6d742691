"""``submit()``: :func:`dsched.dispatch` without waiting, for a caller with its own work to overlap.

A solver evaluates its material's tangent while it assembles the residual; an
inference loop prepares the next batch while this one runs. ``submit`` checks
the call at once (every mistake ``dispatch`` would report is raised here,
before any work) and returns a :class:`DispatchFuture` at once; the call runs
on a thread of its scheduler's, and its result (or the error ``dispatch``
would have raised, of the same type) arrives at :meth:`DispatchFuture.result`.

Calls submitted with the same scheduler object run one after another, in the
order submitted: a scheduler's loads are those of one run at a time, so the
devices' capacity holds however many calls are in flight. Calls with
different schedulers run at the same time, sharing the devices as
concurrent clients do (each task holds its device's resource).

A submitted call runs for the thread that submitted it: it takes the feeds
that thread's calls left parked on the workers, and parks its own for that
thread's next call (:func:`~dsched.dispatch.parking.caller_id`), so a thread's
own calls and the ones it submits take turns on the same feeds.

The arrays given to a submitted call are read while it runs (by reference,
never copied up front): leave them unchanged until its result is in.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref

from dsched.dispatch.completion import Cancellation, CancelledError, cancellable
from dsched.dispatch.front import PreparedCall
from dsched.dispatch.parking import caller_id, running_for

__all__ = ["submit", "DispatchFuture"]


class DispatchFuture:
    """The handle of a submitted call: ``result()``, ``done()``, ``cancel()``, as ``concurrent.futures`` has them.

    Examples
    --------
    >>> import numpy as np, dsched
    >>> future = dsched.submit(np.square, np.arange(4.0), scheduler=dsched.SimpleScheduler("cpu", 2), mode="sync")
    >>> future.result().tolist()
    [0.0, 1.0, 4.0, 9.0]
    >>> future.done(), future.cancelled()
    (True, False)
    """

    def __init__(self):
        self._future = concurrent.futures.Future()
        self._cancellation = Cancellation()

    def result(self, timeout=None):
        """The joined result, once the call has run (waits at most ``timeout`` seconds: ``TimeoutError`` past it).

        A Ctrl-C while waiting cancels the call (its chunks, their loads) before it propagates.
        """
        try:
            return self._future.result(timeout)
        except KeyboardInterrupt:
            self.cancel()
            raise

    def exception(self, timeout=None):
        """The error the call raised, or ``None``."""
        return self._future.exception(timeout)

    def done(self) -> bool:
        """Whether the call has ended (with a result, an error, or cancelled)."""
        return self._future.done()

    def cancel(self) -> bool:
        """Stop the call: one still waiting for its turn never starts; a running one cancels its chunks and gives
        their loads back. ``False`` if it had ended already."""
        if self._future.cancel():
            return True
        if self._future.done():
            return False
        self._cancellation.cancel()
        return True

    def cancelled(self) -> bool:
        """Whether :meth:`cancel` stopped the call."""
        if self._future.cancelled():
            return True
        return self._future.done() and self._cancellation.requested and \
            isinstance(self._future.exception(), CancelledError)

    def add_done_callback(self, fn):
        """Call ``fn(future)`` once the call ends (at once if it has), on the thread that ends it."""
        self._future.add_done_callback(lambda _: fn(self))

    def __repr__(self):
        state = "cancelled" if self.cancelled() else "finished" if self.done() else "pending"
        return f"<DispatchFuture {state}>"

    def _run(self, call, caller):
        if not self._future.set_running_or_notify_cancel():
            return
        try:
            with cancellable(self._cancellation), running_for(caller):
                self._cancellation.check()
                result = call.run()
        except BaseException as err:  # handed to result()
            self._future.set_exception(err)
        else:
            self._future.set_result(result)


def submit(fn, *args, scheduler, client=None, mode="async", axis=0, out_axis=None, trace_file=None, out=None,
           overwrite=False, timeout=None, keep_grad=None, host_arrays=False, **kwargs) -> DispatchFuture:
    """:func:`dsched.dispatch` of the same arguments, returning at once; a :class:`DispatchFuture` of its result.

    The call is checked before this returns (its mistakes raise here); it then runs after the calls submitted
    before it with the same ``scheduler``.
    """
    call = PreparedCall(fn, args, kwargs, scheduler=scheduler, client=client, mode=mode, axis=axis,
                        out_axis=out_axis, trace_file=trace_file, out=out, overwrite=overwrite, timeout=timeout,
                        keep_grad=keep_grad, host_arrays=host_arrays)
    future = DispatchFuture()
    _runner_of(scheduler).put((future, call, caller_id()))  # run for this thread: its parked feeds are taken
    return future


# --- one thread per scheduler, running its calls in order ---------------------------------

_runners = {}  # id(scheduler) -> its runner's queue, while the scheduler lives
_runners_lock = threading.Lock()


def _runner_of(scheduler) -> queue.SimpleQueue:
    key = id(scheduler)
    with _runners_lock:
        inbox = _runners.get(key)
        if inbox is None:
            inbox = _runners[key] = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(inbox,), name="dsched-submit", daemon=True).start()
            try:
                weakref.finalize(scheduler, _stop, key)  # the thread ends with its scheduler
            except TypeError:  # a scheduler that cannot be referenced weakly keeps its thread (a daemon)
                pass
    return inbox


def _stop(key):
    with _runners_lock:
        inbox = _runners.pop(key, None)
    if inbox is not None:
        inbox.put(None)


def _serve(inbox):
    while True:
        item = inbox.get()
        if item is None:
            return
        future, call, caller = item
        future._run(call, caller)
        item = future = call = None  # an idle runner keeps no call's arrays or result alive
