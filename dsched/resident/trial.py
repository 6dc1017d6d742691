"""State with trial and commit: the material state of a Newton loop, as finite-element codes keep it.

Within a load step a solver evaluates its material again and again from the
state committed at the end of the last step (each Newton iteration is a *trial*);
when the step converges it *commits* the last trial's state, and when it does
not it *rolls back* and retries with a smaller step. :class:`TrialState` keeps
both states in shared memory, so that no call copies them:

- the committed fields are copied once, into shared memory, when it is made;
- each :meth:`~TrialState.trial` is one :func:`dsched.dispatch` (so one fast-lane
  round trip per device on worker processes of this host), whose new state is
  allocated in shared memory by the workers that compute it, and is passed by
  reference when it becomes the next step's committed state;
- :meth:`~TrialState.commit` and :meth:`~TrialState.rollback` copy nothing: they
  swap references, and states nobody refers to give their memory back to the
  pool (``/dev/shm`` stays flat however long the solve).
"""

from __future__ import annotations

import numpy as np

from dsched.dataplane.segments import shared_copy
from dsched.dispatch import dispatch, submit
from dsched.resident.tasks import read_only

__all__ = ["TrialState"]


class TrialState:
    """Committed and trial values of named per-item fields, for ``fn(*args, state) -> (result, new_state)``.

    Parameters
    ----------
    fields : dict of array
        The committed state at the start: ``{name: array}``, the items along ``axis``.
    axis : int
        The fields' batch axis (negative: counted from each field's own end, ``-1`` as FE codes keep cells).

    Examples
    --------
    >>> import numpy as np, dsched
    >>> def model(strain, state):
    ...     total = state["total"] + strain
    ...     return 2 * total, {"total": total}
    >>> state = dsched.TrialState({"total": np.zeros(4)})
    >>> s = dsched.SimpleScheduler("cpu", 2)
    >>> state.trial(model, np.ones(4), scheduler=s, mode="sync").tolist()     # from the committed state
    [2.0, 2.0, 2.0, 2.0]
    >>> state.trial(model, np.full(4, 0.5), scheduler=s, mode="sync").tolist()  # again from it: a Newton iteration
    [1.0, 1.0, 1.0, 1.0]
    >>> state.commit()
    >>> state.committed["total"].tolist()
    [0.5, 0.5, 0.5, 0.5]
    """

    def __init__(self, fields, *, axis=0):
        if not isinstance(fields, dict) or not fields:
            raise ValueError(f"fields: expected a dict of arrays, one per state variable, got {fields!r}")
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ValueError(f"axis: expected an integer, got {axis!r}")
        committed = {}
        for name, value in fields.items():
            array = np.asarray(value)
            if array.dtype.hasobject or array.ndim == 0:
                raise ValueError(f"fields[{name!r}]: expected an array of numbers with a batch axis, got "
                                 f"{array.dtype} of shape {array.shape}")
            committed[name] = shared_copy(array)  # once: every trial then passes it by reference
        self.axis = axis
        self._committed = committed
        self._trial = None

    @property
    def committed(self) -> dict:
        """The committed state, read-only."""
        return {name: read_only(array) for name, array in self._committed.items()}

    @property
    def trial_state(self):
        """The last trial's state (read-only), or ``None`` when there is none since the last commit or rollback."""
        return None if self._trial is None else {name: read_only(a) for name, a in self._trial.items()}

    def trial(self, fn, *args, scheduler, axis=None, **options):
        """``fn(*args, state)`` over the batch, from the committed state; its ``result`` (the new state is kept).

        ``fn`` returns ``(result, new_state)``, ``new_state`` a dict of the same fields. ``args`` are split along
        ``axis`` (default: the state's axis) as :func:`dsched.dispatch` splits them; ``options`` are dispatch's
        (``client``, ``mode``, ``timeout``, ``out_axis``, ...) and ``fn``'s keyword arguments.
        """
        joined = dispatch(fn, *args, self._committed, scheduler=scheduler, axis=self._axes(args, axis), **options)
        return self._keep(joined)

    def submit_trial(self, fn, *args, scheduler, axis=None, **options):
        """:meth:`trial` without waiting: a :class:`~dsched.DispatchFuture` of its result. The trial state is kept
        when the result is taken (``result()``), so a commit waits for it."""
        future = submit(fn, *args, self._committed, scheduler=scheduler, axis=self._axes(args, axis), **options)
        return _TrialFuture(future, self)

    def commit(self):
        """The last trial's state becomes the committed one (no copy)."""
        if self._trial is None:
            raise RuntimeError("commit: no trial since the last commit or rollback")
        self._committed, self._trial = self._trial, None

    def rollback(self):
        """Drop the last trial's state: the next trial starts from the committed state again (a cut-back)."""
        self._trial = None

    def _axes(self, args, axis):
        spec = self.axis if axis is None else axis
        per_argument = list(spec) if isinstance(spec, (list, tuple)) else [spec] * len(args)
        return tuple(per_argument) + (self.axis,)

    def _keep(self, joined):
        """Keep the new state of a trial's joined ``(result, new_state)``; its result."""
        if not (isinstance(joined, tuple) and len(joined) == 2 and isinstance(joined[1], dict)):
            raise ValueError("fn: a trial's function returns (result, new_state), new_state a dict of the fields "
                             f"({', '.join(self._committed)})")
        result, state = joined
        if state.keys() != self._committed.keys():
            raise ValueError(f"fn: new_state has the fields ({', '.join(state)}); the state has "
                             f"({', '.join(self._committed)})")
        for name, array in state.items():
            if array.shape != self._committed[name].shape or array.dtype != self._committed[name].dtype:
                raise ValueError(f"fn: new_state[{name!r}] is {array.dtype} of shape {array.shape}; the state's is "
                                 f"{self._committed[name].dtype} of shape {self._committed[name].shape}")
        self._trial = state
        return result

    def __repr__(self):
        fields = ", ".join(f"{name}{tuple(a.shape)}" for name, a in self._committed.items())
        return f"TrialState({fields}, trial={'yes' if self._trial is not None else 'no'})"


class _TrialFuture:
    """A submitted trial: the call's future, keeping its new state when its result is taken."""

    def __init__(self, future, state):
        self._future, self._state, self._result = future, state, None
        self._taken = False

    def result(self, timeout=None):
        if not self._taken:
            self._result = self._state._keep(self._future.result(timeout))
            self._taken = True
        return self._result

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        return self._future.cancel()

