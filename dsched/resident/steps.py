"""A transient driver's steps: what a chunk runs, and the runs of a driver whose state is in host memory.

:class:`TransientSteps` steps a model through a chunk's rows of the
prescribed histories, feeding each step's outputs back as the next step's
old state by :func:`neml2_feedback`'s rule (or a driver's own). A driver
whose state stays on the devices calls it as a :class:`~dsched.Batch`
update (torch tensors kept between steps and runs).

A driver whose state is in this host's memory (:class:`HostRuns`) calls it
through :class:`HostSteps`. Where every device is served by workers on this
host and none is a real GPU (``memory="host"``, or ``"auto"`` there), the
state need not stay where a chunk computes: it lives in shared memory that
the worker processes map, one array per source, and each update is one
:func:`dsched.submit` over the points: the state of the update before and the
histories go in by reference, each chunk steps its points, and writes its
state after the last step into its rows of new arrays. So an update costs
what a call costs (a message each way on the fast lanes,
``docs/dataplane.md``), with no task, no scheduler round trip and nothing
joined: a compiled model's last step is computed straight into those rows.

Each update writes other arrays than the ones it read: a chunk run again (its
worker was lost) reads what it read the first time, and the arrays a caller
holds from an earlier run never change (a run's own updates take two sets in
turn between them). They come from dsched's pool of segments, and go back to
it once nobody holds them. An update runs after the one before it (they share
the driver's scheduler, whose calls run in order); one that failed fails every
later result of the driver too, as their state was never written, and the
updates pushed after it are cancelled.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import CancelledError

import numpy as np

from dsched.dataplane.store import RunStore, find_shared, shared_copy
from dsched.devices.backends import TORCH, torch_device
from dsched.dispatch.submit import submit
from dsched.resident.tasks import read_only

__all__ = ["TransientSteps", "neml2_feedback", "HostSteps", "HostRuns", "host_steps", "HISTORY", "FINAL", "RECORD",
           "copy_into"]

HISTORY = "history/"  # an update's inputs: the prescribed histories, time leading
FINAL = "final/"  # an update's out arrays: the outputs after its last step, one row per point
RECORD = "record/"  # an update's out arrays: recorded outputs at every step of the run, (points, steps, *base)


def neml2_feedback(input_names, output_names) -> dict:
    """NEML2's old-state rule: ``{history input: its source}`` (the source's value of the step before).

    Examples
    --------
    >>> neml2_feedback(["strain", "t", "t~1", "t~2", "stress~1"], ["stress"])
    {'t~1': 't', 't~2': 't~1', 'stress~1': 'stress'}
    """
    feedback = {}
    for name in input_names:
        base, lag = _lag(name)
        if lag:
            feedback[name] = base if lag == 1 else f"{base}~{lag - 1}"
    return feedback


def _lag(name):
    base, _, lag = name.rpartition("~")
    return (base, int(lag)) if base and lag.isdigit() and int(lag) > 0 else (name, 0)


class TransientSteps:
    """A :meth:`Batch.update <dsched.Batch.update>` function: steps ``first`` to ``last`` of a history on one chunk.

    It reads the chunk's old state (its fields, one per feedback source) and
    the histories (the update's inputs, ``history/<name>``, time leading),
    runs the model step after step where the chunk lives, and returns the new
    state as torch tensors. Into the update's ``out`` arrays it writes the
    recorded outputs of every step (``record/<name>``) and, with ``final``,
    the outputs after the last step (``final/<name>``).

    Parameters
    ----------
    model : NEML2Model
        The model (see the module docs).
    feedback : dict
        ``{history input: source}``, as :func:`neml2_feedback` makes.
    first, last : int
        The history entries to step to (entry 0 is the starting point).
    keep : tuple of str
        The state to return: every source, and the outputs kept.
    constants : dict
        Numbers for inputs with neither history nor feedback (zero otherwise).
    """

    def __init__(self, model, feedback, first, last, keep, constants=None):
        self.model, self.feedback = model, dict(feedback)
        self.first, self.last, self.keep = int(first), int(last), tuple(keep)
        self.constants = dict(constants or {})
        self.__name__ = f"steps-{self.first}-{self.last}"

    def __call__(self, **arrays):
        import torch

        histories, state, out = self.split(arrays, lambda value: _tensor(value, torch))
        rows = next(iter(histories.values())).shape[1]  # (entries, rows, *base): the chunk's items on axis 1
        outputs = self.model.output_names
        for step in range(self.first, self.last + 1):
            inputs = self.inputs_of(histories, step, state, lambda value: _tensor(value, torch))
            values = self.model(inputs)
            state = {source: values[source] if source in outputs else inputs[source] for source in self.keep}
            self.record(out, step, values)
        for name in outputs:
            if FINAL + name in out:
                copy_into(out[FINAL + name], state[name])
        # Inputs kept as state may be views of a history (released after the update): the chunk copies them.
        return {name: self._rows(value, name, rows, torch, copy=name not in outputs) for name, value in state.items()}

    def split(self, arrays, convert=None) -> tuple:
        """``(histories, state, out)`` of an update's arrays on a chunk: the histories by name (``history/<name>``),
        the state the first step starts from (the sources fed back, and the prescribed values of the entry before
        the first step of a history kept), and the ``final/`` and ``record/`` arrays; the state ``convert``-ed."""
        convert = convert or (lambda value: value)
        histories, state, out = {}, {}, {}
        for name, value in arrays.items():
            if name.startswith(HISTORY):
                histories[name[len(HISTORY):]] = value
            elif name.startswith((FINAL, RECORD)):
                out[name] = value
            else:
                state[name] = convert(value)
        state.update({name: convert(h[self.first - 1]) for name, h in histories.items() if name in self.keep})
        return histories, state, out

    def inputs_of(self, histories, step, state, convert=None) -> dict:
        """The model's inputs at ``step``: the prescribed rows (``convert``-ed), else the old state fed back, else
        a constant, else zero (NEML2's rule)."""
        inputs = {}
        for name in self.model.input_names:
            if name in histories:
                value = histories[name][step]
                inputs[name] = value if convert is None else convert(value)
            else:
                inputs[name] = state.get(self.feedback.get(name), self.constants.get(name, 0.0))
        return inputs

    def record(self, out, step, values):
        """The outputs recorded at ``step`` into their column of the ``record/<name>`` rows in ``out``."""
        for name in self.model.output_names:
            if RECORD + name in out:
                copy_into(out[RECORD + name][:, step - 1], values[name])

    def key(self) -> tuple:
        """What tells these steps from others of the same model (:func:`host_steps`)."""
        return (self.first, self.last, self.keep, tuple(self.feedback.items()), tuple(self.constants.items()))

    def _rows(self, value, name, rows, torch, copy=False):
        """``value`` over the chunk's rows (NEML2 leaves unchanged values unbatched; a number is a zero)."""
        base = self.model.base_shapes[name]
        if not isinstance(value, torch.Tensor):  # on the chunk's device, as the model's outputs are
            return torch.full((rows, *base), float(value), dtype=torch.float64, device=torch_device())
        if tuple(value.shape) != (rows, *base):
            return value.expand(rows, *base).clone()
        return value.clone() if copy else value


def _tensor(value, torch):
    """A chunk's array as a torch tensor (NumPy shares its memory); numbers and tensors as they are."""
    if isinstance(value, np.ndarray):
        return TORCH.from_host(value, None)
    return value


def copy_into(target, value):
    """Write ``value`` (a tensor, on any device, or an array) into the NumPy rows ``target``, broadcasting an
    unbatched one."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    np.copyto(target, value)


# --- a driver's state in host memory: each update one call ----------------------------

class HostSteps:
    """An update's function on one chunk, as :func:`dsched.dispatch` calls it: the steps, and the state into rows.

    ``steps`` is a :class:`TransientSteps` (the model, the feedback, the steps to run). Called with one dict of
    the chunk's rows of the state of the update before (``{source: rows}``; none on a driver's first run) and of
    the histories (``{"history/<name>": (entries, rows, *base)}``), and ``out``: its rows of the new state
    (``{source: rows}``) and of the recorded outputs (``{"record/<name>": (rows, steps, *base)}``). The model
    gets NumPy inputs, and its last step the rows its outputs go to (a compiled model computes them there);
    what it did not compute there is copied there. Returns ``out``.
    """

    moves_inputs = True  # host arrays in, host arrays out: the model moves what it computes on (NEML2Model does)
    takes_out_rows = True  # dispatch hands it its rows of the new state as out=: written there, not copied back
    probe_outputs = False  # out= declares the layout: never called on the client

    def __init__(self, steps):
        self.steps = steps
        self.__name__ = steps.__name__

    def __call__(self, arrays, out=None):
        if out is None:
            raise RuntimeError(f"{self.__name__}: called without the rows of the new state (out=)")
        steps, model = self.steps, self.steps.model
        histories, current, _ = steps.split(arrays)
        outputs = model.output_names
        # The last step's outputs straight into their rows, where the model can compute every output there.
        last_rows = {name: out[name] for name in model.all_output_names} \
            if all(name in out for name in model.all_output_names) else None
        rows = next(iter(histories.values())).shape[1]  # (entries, rows, *base): the chunk's items on axis 1
        scratch = _Scratch.of_this_thread({name: (rows, *model.base_shapes[name]) for name in model.all_output_names})
        for step in range(steps.first, steps.last + 1):
            inputs = steps.inputs_of(histories, step, current)
            target = last_rows if step == steps.last else scratch.free_of(inputs.values())
            values = _call(model, inputs, target)
            current = {source: values[source] if source in outputs else inputs[source] for source in steps.keep}
            steps.record(out, step, values)
        for name in steps.keep:
            value = current[name]
            if value is not out[name]:
                copy_into(out[name], value)
        return out


class _Scratch:
    """Rows a thread's steps before the last compute into, kept from call to call: a model that computes into
    given rows (a compiled one) then allocates nothing per step, where a new array of a large chunk would be
    faulted in page by page at every step. A step's rows are a set no input of that step lies in (the old
    state of one step back, or two with lags of two, is read while the next is written)."""

    _local = threading.local()

    def __init__(self, shapes):
        self.shapes, self.sets = shapes, []

    @classmethod
    def of_this_thread(cls, shapes) -> _Scratch:
        kept = getattr(cls._local, "scratch", None)
        if kept is None or kept.shapes != shapes:  # one chunk size per thread kept: a new one lets the old go
            kept = cls._local.scratch = cls(shapes)
        return kept

    def free_of(self, values) -> dict:
        """A set of rows none of ``values`` lies in (made when every set kept holds one)."""
        taken = {id(v) for v in values}
        for rows in self.sets:
            if not any(id(array) in taken for array in rows.values()):
                return rows
        rows = {name: np.empty(shape) for name, shape in self.shapes.items()}
        self.sets.append(rows)
        return rows


def _call(model, inputs, rows):
    """``model(inputs)``, computed into ``rows`` where the model takes them (``out=``)."""
    if rows is not None and getattr(model, "computes_into", False):
        return model(inputs, out=rows)
    return model(inputs)


STEPS_KEPT = 4  # like steps of recent drivers kept (each holds its model): those of older ones are let go
_recent_steps: "collections.OrderedDict[tuple, HostSteps]" = collections.OrderedDict()
_recent_lock = threading.Lock()


def host_steps(steps) -> HostSteps:
    """The :class:`HostSteps` of ``steps``, the same object for like steps of a recent driver's model with the
    same parameters: dispatch takes a call of a function it ran recently the way it went then (a driver per
    history, in a loop), and a worker that keeps its program runs it on the model as it was sent. A parameter
    changed since (``set_parameter``, a calibration's step) makes another, sent with the model as it is now."""
    # The model is alive while its entry holds it: its id is its own.
    key = (id(steps.model), *steps.key(), _parameters_now(steps.model))
    with _recent_lock:
        found = _recent_steps.pop(key, None) or HostSteps(steps)
        _recent_steps[key] = found
        while len(_recent_steps) > STEPS_KEPT:
            _recent_steps.popitem(last=False)
    return found


def _parameters_now(model) -> tuple:
    """The values of a model's parameters that differ from its file's (a NEML2Model's ``parameters``), as bytes."""
    parameters = getattr(model, "parameters", None)
    changed = parameters.changed() if hasattr(parameters, "changed") else {}
    return tuple((name, value.detach().cpu().numpy().tobytes()) for name, value in sorted(changed.items()))


class HostRuns:
    """The state of a driver in host memory and the updates pushed on it.

    Parameters
    ----------
    model : NEML2Model
        The driver's model.
    scheduler : WorkScheduler
        The driver's scheduler (its calls run one after another, in the order submitted).
    client : distributed.Client
    n : int
        The points.
    shared : bool
        Whether worker processes read the arrays (in shared memory), or workers in this process.
    initial : dict
        ``{source: number or array of one value per point}``: the state before the first step.
    """

    def __init__(self, model, scheduler, client, n, shared, initial):
        self.model, self.scheduler, self.client, self.n, self.shared = model, scheduler, client, n, shared
        self.state = {}  # {source: array} of the last update pushed (not yet written while it runs)
        if initial:
            names = list(initial)
            for name, view in zip(names, self._allocate([(n, *model.base_shapes[name]) for name in names])):
                np.copyto(view, np.broadcast_to(np.asarray(initial[name], dtype=np.float64), view.shape))
                self.state[name] = view
        self.runs = []  # per run: [futures, stores, {out name: array}]
        self.failure = None  # the first update that failed: every result after it raises it

    def _allocate(self, shapes, stores=None) -> list:
        """New float64 arrays of ``shapes`` in one segment of dsched's pool, back to the pool once nobody holds
        them (``stores``: a list the run's store joins, closed when the run ended)."""
        store = RunStore(shared=self.shared)
        views = [view for _, view in store.allocate_many([(shape, np.float64) for shape in shapes],
                                                         handed_out=True)]
        if stores is None:
            store.close(clean=True)
        else:
            stores.append(store)
        return views

    def run(self, steps_list, histories, records):
        """Push one update per :class:`TransientSteps` of ``steps_list``; ``records``:
        ``{name: steps}`` of the outputs recorded at every step. Returns at once."""
        if self.failure is not None:
            raise self.failure  # the state it should have written was never written
        keep, base = steps_list[0].keep, self.model.base_shapes
        stores = []
        # Each in a segment of its own, so that each goes back to the pool when its own arrays are let go: the
        # state after the run when the next run's is asked for, the records when the driver closes, and between
        # the updates two sets in turn (an update reads the set the one before wrote and writes the other).
        [after] = self._sets(keep, 1, stores)
        between = self._sets(keep, min(len(steps_list) - 1, 2), stores)
        recorded = dict(zip((RECORD + name for name in records), self._allocate(
            [(self.n, steps, *base[name]) for name, steps in records.items()], stores))) if records else {}
        # Histories not in shared memory are copied there once for the run (not once per update), as they are now.
        if self.shared:
            histories = {name: h if find_shared(h) is not None else shared_copy(h) for name, h in histories.items()}
        futures = []
        for i, steps in enumerate(steps_list):  # each update writes its steps' columns of the records
            state = after if i == len(steps_list) - 1 else between[i % 2]
            # One dict, the state along axis 0 and the histories along axis 1: the same layout from run to run (a
            # driver's first has no state), so that each call after the first goes the way the last one went.
            arrays = {**self.state, **{HISTORY + name: h for name, h in histories.items()}}
            axes = {name: 1 if name.startswith(HISTORY) else 0 for name in arrays}
            futures.append(submit(host_steps(steps), arrays, scheduler=self.scheduler, client=self.client,
                                  axis=axes, out_axis=0, out={**state, **recorded}))
            self.state = state
        finals = {FINAL + name: read_only(self.state[name]) for name in self.model.output_names}
        self.runs.append([futures, stores, {**finals, **recorded}])

    def _sets(self, keep, count, stores) -> list:
        """``count`` sets of state arrays, ``[{source: array}]``, in one segment."""
        base = self.model.base_shapes
        views = iter(self._allocate([(self.n, *base[name]) for _ in range(count) for name in keep], stores))
        return [{name: next(views) for name in keep} for _ in range(count)]

    def finish(self, raise_errors=True) -> list:
        """Wait for every run's updates; the arrays they wrote, per run. The first failure raises (with
        ``raise_errors``), for its run and every later one: their state was never written, and the updates
        pushed after it are cancelled."""
        for entry in self.runs:
            futures, stores, _ = entry
            for future in futures:
                if self.failure is not None:
                    future.cancel()  # it would step from a state never written
                try:
                    error = future.exception()
                except CancelledError as cancelled:  # cancelled before it started
                    error = cancelled
                self.failure = self.failure or error
            for store in stores:  # a failed run's arrays may still be written by a chunk: not pooled
                store.close(clean=self.failure is None)
            # Then let go of the futures, which hold their calls' results (the run's arrays): a segment goes back
            # to the pool only once its store said whether it may.
            entry[0], entry[1] = (), ()
        # A run before the last keeps only what history() reads: its state after its last step (the finals) goes
        # back to the pool once the caller lets go of it too, and a long-lived driver's next runs reuse its pages.
        for entry in self.runs[:-1]:
            entry[2] = {name: array for name, array in entry[2].items() if not name.startswith(FINAL)}
        if self.failure is not None and raise_errors:
            raise self.failure
        return [written for _, _, written in self.runs]

    def get_many(self, names) -> dict:
        """The sources ``names`` after the last step (read-only: the next run starts from them)."""
        self.finish()
        return {name: read_only(self.state[name]) for name in names}

    def close(self):
        try:
            self.finish(raise_errors=False)
        finally:
            self.state, self.runs = {}, []

