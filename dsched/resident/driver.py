"""NEML2's ``TransientDriver`` over the devices: prescribed histories in, the old state kept between steps.

NEML2's driver steps a model through prescribed histories (time, strain),
feeding each step's outputs back as the next step's old state
(``stress~1 <- stress``, ``t~1 <- t``, ``t~2 <- t~1``). :class:`TransientDriver`
does the same over the scheduler's chunks: each chunk of points steps on its
device, its state kept between runs (``memory=``: in host memory as NumPy
arrays the workers map, each update one call, :class:`~dsched.resident.steps.HostRuns`;
or in device memory as torch tensors on the chunk's device, over a resident
:class:`~dsched.Batch`, each update one task per chunk), and the histories
are read by reference from shared memory, one step's rows at a time.

>>> model = dsched.models.NEML2Model("radret.i", "model")               # doctest: +SKIP
>>> with TransientDriver(model, scheduler, client=client) as driver:   # doctest: +SKIP
...     driver.run({"t": time, "strain": strain})  # (steps + 1, points, ...), time leading
...     stress = driver.get("stress")

The model is any callable on a dict of named inputs that returns a dict of
named outputs (torch tensors in, torch tensors out) and says its
``input_names``, ``output_names`` (those kept), ``all_output_names`` and
``base_shapes`` (each variable's shape per point): a
:class:`~dsched.models.NEML2Model` does. In host memory it is given NumPy
arrays, and ``out=`` rows to compute into, so ``memory="auto"`` picks host
memory only for a model that says it takes them (``computes_into``, as
:class:`~dsched.models.NEML2Model` does).

The feedback is declared once. By default it is NEML2's own rule
(:func:`neml2_feedback`): every input ``X~k`` takes, from the step before,
``X`` (for ``k = 1``) or ``X~(k-1)``, an output if the model has one of that
name, else the input. An input with no history and no feedback is zero, as
in NEML2. Several steps run in one update of each chunk (by default all of a
:meth:`TransientDriver.run`), so a step costs what NEML2 costs, not a round trip.
"""

from __future__ import annotations

import numpy as np

from dsched.dataplane.store import RunStore
from dsched.resident.batch import MEMORY, Batch, placement
from dsched.resident.steps import FINAL, HISTORY, RECORD, HostRuns, TransientSteps, neml2_feedback
from dsched.resident.tasks import _client

__all__ = ["TransientDriver", "TransientSteps", "neml2_feedback"]


class TransientDriver:
    """NEML2's ``TransientDriver`` over the devices, its state kept in host or device memory.

    Parameters
    ----------
    model : NEML2Model
        The model (its ``outputs`` are the outputs kept and returned; see the module docs).
    scheduler : WorkScheduler
        Cuts the points into chunks and places them (one chunk per device is
        best: NEML2's floor per call is paid per chunk and step).
    client : distributed.Client, optional
        The cluster (default: the current client).
    feedback : dict, optional
        ``{history input: source}`` overriding NEML2's rule
        (:func:`neml2_feedback`) for those inputs; a source of ``None`` feeds
        nothing back (the input is then zero, or its constant).
    initial : dict, optional
        The state before the first step (NEML2's initial conditions): a
        number, or an array of one value per point, per source (``stress``);
        zero otherwise.
    constants : dict, optional
        Numbers for inputs with neither a history nor a feedback (zero otherwise).
    record : tuple of str
        Outputs whose value at every step :meth:`history` returns.
    time : str
        The model's time input (NEML2's ``time`` option), fed back like any other.
    memory : {"auto", "host", "device"}
        Where the state lives between updates. ``"device"`` keeps it on each chunk's device as torch tensors
        in a :class:`~dsched.Batch`, each update one Dask task per chunk, and pipelines the updates: a chunk
        starts its next update without waiting for the others, and a model's outputs never go through NumPy.
        ``"host"`` keeps it in this host's memory as NumPy arrays that the workers map
        (:class:`~dsched.resident.steps.HostRuns`), each update one call over the fast lanes: a run costs what a
        call costs, not a task's round trips, but every chunk of an update waits for the slowest before the
        next update starts. ``"auto"`` (the default): host memory where every device is served by workers on
        this host and none is a real GPU (as :class:`~dsched.Batch` chooses) and the model computes into rows
        (``computes_into``), else device memory. With every step in one update (the default) the two differ
        only in those fixed costs. Workers on another host are refused either way.

    Examples
    --------
    >>> with TransientDriver(model, scheduler, client=client) as driver:  # doctest: +SKIP
    ...     driver.run({"t": time, "strain": strain})    # (steps + 1, points, ...) each
    ...     stress = driver.get("stress")
    """

    def __init__(self, model, scheduler, *, client=None, feedback=None, initial=None, constants=None, record=(),
                 time="t", memory="auto"):
        self.model, self.scheduler, self.client, self.time = model, scheduler, client, str(time)
        if not isinstance(memory, str) or memory not in MEMORY:
            raise ValueError(f"memory: expected 'auto', 'host' or 'device', got {memory!r}")
        self.memory = memory  # as asked; "host" or "device" once the first run started
        self.feedback = _check_feedback(model, feedback)
        sources = tuple(dict.fromkeys(s for s in self.feedback.values() if s is not None))
        self.keep = tuple(dict.fromkeys(sources + tuple(model.output_names)))
        self.initial = _check_named(initial, sources, "initial")
        self.constants = _check_named(constants, model.input_names, "constants", numbers_only=True)
        self.record = tuple(record)
        unknown = [name for name in self.record if name not in model.output_names]
        if unknown:
            raise ValueError(f"record: {unknown} are not outputs kept by the model (it keeps {model.output_names})")
        self.batch = None  # in device memory: the Batch holding the state
        self._host = None  # in host memory: the HostRuns holding it
        self.n = None
        self._closed = False
        self.steps_done = 0
        self._runs = []  # per run: (its last update, its store, {out name: array}), the arrays written by its updates

    def run(self, prescribed, *, steps_per_update=None):
        """Step through ``prescribed`` histories: ``{input: array of (steps + 1, points, *base)}``, time leading.

        Entry 0 of each history is the starting point (its values are the
        ``~1`` of the first step, as in NEML2); steps ``1..steps`` call the
        model. Returns at once (the steps are pushed to the devices); :meth:`get`
        waits for them. ``steps_per_update`` (default: all) runs that many
        steps per update of each chunk. Histories in shared memory
        (:func:`dsched.shared_empty`) are read where they are; others are
        copied there once.
        """
        if self._closed:
            raise RuntimeError("this driver is closed")
        histories, steps = self._check_prescribed(prescribed)
        per_update = steps if steps_per_update is None else steps_per_update
        if isinstance(per_update, bool) or not isinstance(per_update, int) or per_update < 1:
            raise ValueError(f"steps_per_update: expected a positive number of steps, got {steps_per_update!r}")
        if self.n is None:
            self._start(histories)
        if self._host is not None:
            self._host.run(list(self._steps(steps, per_update)), histories, {name: steps for name in self.record})
            self.steps_done += steps
            return self
        store, finals, records = self._allocate(steps)
        inputs = {f"{HISTORY}{name}": value for name, value in histories.items()}
        update = None
        with self.batch.together():  # a run's updates go to each chunk's worker as one task
            for fn in self._steps(steps, per_update):
                out = {**records, **(finals if fn.last == steps else {})}
                fields = self.batch.fields
                made = [f for f in self.keep if f not in fields]
                update = self.batch.update(fn, reads=[f for f in self.keep if f in fields],
                                           writes=[f for f in self.keep if f in fields], outputs=made,
                                           inputs=inputs, axis=1, out={n: view for n, (_, view) in out.items()},
                                           label=fn.__name__,
                                           layouts={f: (self.model.base_shapes[f], "<f8") for f in made})
        self._runs.append((update, store, {name: view for name, (_, view) in {**finals, **records}.items()}))
        self.steps_done += steps
        return self

    def get(self, name) -> np.ndarray:
        """The value of ``name`` (an output kept, or a source) after the last step, one row per point (read-only in
        host memory: the next run starts from it; a later run never changes it)."""
        return self.get_many([name])[name]

    def get_many(self, names=None) -> dict:
        """Several values after the last step (default: the outputs kept), ``{name: array}``.

        The outputs kept are already in this process's memory once the last
        step is done (the steps wrote them there); a source is fetched from
        where it lives. In host memory the arrays are read-only: the next run
        starts from them (a later run never changes them; copy one to change it).
        """
        names = list(self.model.output_names if names is None else names)
        unknown = [name for name in names if name not in self.keep]
        if unknown:
            raise ValueError(f"names: {unknown} are not kept by this driver (it keeps {list(self.keep)})")
        self._check_started()
        written = self._finish()[-1]
        values = {name: written[FINAL + name] for name in names if FINAL + name in written}
        rest = [name for name in names if name not in values]
        if rest and self._host is not None:
            values.update(self._host.get_many(rest))
        elif rest:
            layouts = {name: (self.model.base_shapes[name], "<f8") for name in rest}
            values.update(self.batch.get_many(rest, layouts=layouts))
        return {name: values[name] for name in names}

    def history(self, name) -> np.ndarray:
        """A recorded output at every step run, ``(steps, points, *base)`` (time leading, as NEML2's driver)."""
        if name not in self.record:
            raise ValueError(f"name: {name!r} is not recorded (record: {list(self.record)})")
        self._check_started()
        pieces = [written[RECORD + name] for written in self._finish()]
        return np.moveaxis(pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1), 1, 0)

    def close(self):
        """Release the state (every chunk's) and the arrays of runs nobody asked for; the driver runs no more."""
        self._closed = True
        if self._host is not None:
            self._host.close()
        if self.batch is not None:
            try:
                self._finish(raise_errors=False)  # a failed run says so where its results are asked for
            finally:
                self.batch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<TransientDriver of {self.model!r}: {self.steps_done} steps, feedback {self.feedback}>"

    # --- internals ---------------------------------------------------------------

    def _steps(self, steps, per_update):
        """The :class:`TransientSteps` of each update of a run of ``steps`` steps."""
        for first in range(1, steps + 1, per_update):
            yield TransientSteps(self.model, self.feedback, first, min(first + per_update - 1, steps), self.keep,
                                 self.constants)

    def _start(self, histories):
        n = self.n = next(iter(histories.values())).shape[1]
        if self.memory == "host" or (self.memory == "auto" and getattr(self.model, "computes_into", False)):
            client = _client(self.client)
            _, shared, memory = placement(client, self.scheduler, n, self.memory)
            if memory == "host":
                self._host = HostRuns(self.model, self.scheduler, client, n, shared, self.initial)
                self.memory = "host"
                return
        self.memory = "device"
        fields = {}
        for name, value in self.initial.items():
            fields[name] = np.broadcast_to(np.asarray(value, dtype=np.float64), (n, *self.model.base_shapes[name]))
        # Without initial values nothing is loaded: the first steps' task is each chunk's first.
        self.batch = Batch({k: np.ascontiguousarray(v) for k, v in fields.items()}, self.scheduler, n=n,
                           client=self.client, memory="device")

    def _allocate(self, steps):
        """This run's arrays written by its steps: the outputs after the last step, and the recorded outputs."""
        n, base = self.batch.n, self.model.base_shapes
        final = list(self.model.output_names)
        specs = [((n, *base[name]), np.float64) for name in final]
        specs += [((n, steps, *base[name]), np.float64) for name in self.record]
        store = RunStore(shared=self.batch._shared)
        placed = store.allocate_many(specs, handed_out=True)  # back to the pool once the arrays are gone
        finals = {FINAL + name: placed[i] for i, name in enumerate(final)}
        records = {RECORD + name: placed[len(final) + i] for i, name in enumerate(self.record)}
        return store, finals, records

    def _finish(self, raise_errors=True) -> list:
        """Wait for every run's steps; the arrays they wrote, per run (their stores released)."""
        if self._host is not None:
            return self._host.finish(raise_errors)
        done = []
        for i, (update, store, written) in enumerate(self._runs):
            if store is not None:
                ok = False
                try:
                    update.wait()
                    ok = True
                except Exception:  # noqa: BLE001  raised below, as often as the results are asked for
                    pass
                finally:  # a failed run's arrays may still be written by a chunk: not pooled
                    store.close(clean=ok)
                    self._runs[i] = (update, None, written)
            if raise_errors:
                update.wait()  # a failed run's error
            done.append(written)
        # A run before the last keeps only what history() reads: its outputs after its last step go back to the
        # pool (a long-lived driver's next runs reuse their pages), now that no chunk writes there.
        for i, (update, store, written) in enumerate(self._runs[:-1]):
            if store is None and any(name.startswith(FINAL) for name in written):
                self._runs[i] = (update, None, {k: v for k, v in written.items() if not k.startswith(FINAL)})
        return done

    def _check_prescribed(self, prescribed):
        if not isinstance(prescribed, dict) or not prescribed:
            raise ValueError("prescribed: expected a dict of input name -> history (steps + 1, points, ...)")
        histories, shape = {}, None
        for name, value in prescribed.items():
            if name not in self.model.input_names:
                if name == self.time:
                    continue  # a time the model does not take (elasticity): nothing to feed
                raise ValueError(f"prescribed: {name!r} is not an input of {self.model.model!r} "
                                 f"(inputs: {self.model.input_names})")
            array = np.asarray(value, dtype=np.float64) if not isinstance(value, np.ndarray) else value
            base = self.model.base_shapes[name]
            if array.ndim != 2 + len(base) or tuple(array.shape[2:]) != base or array.shape[0] < 2:
                raise ValueError(f"prescribed[{name!r}]: expected (steps + 1, points, *{base}) with at least two "
                                 f"entries, got shape {array.shape}")
            if shape is not None and array.shape[:2] != shape:
                raise ValueError(f"prescribed[{name!r}]: {array.shape[:2]} entries and points; "
                                 f"the others have {shape}")
            shape = array.shape[:2]
            histories[name] = array
        if not histories:
            raise ValueError(f"prescribed: no input of {self.model.model!r} among {list(prescribed)}")
        if self.n is not None and shape[1] != self.n:
            raise ValueError(f"prescribed: {shape[1]} points; this driver's batch has {self.n}")
        return histories, shape[0] - 1

    def _check_started(self):
        if self._closed:
            raise RuntimeError("this driver is closed")
        if self.n is None:
            raise RuntimeError("this driver has run no step yet (call run() first)")


def _check_feedback(model, feedback) -> dict:
    rule = neml2_feedback(model.input_names, model.all_output_names)
    if feedback is None:
        return rule
    if not isinstance(feedback, dict):
        raise ValueError(f"feedback: expected a dict of history input -> source, got {type(feedback).__name__}")
    known = set(model.input_names) | set(model.all_output_names)
    for name, source in feedback.items():
        if name not in model.input_names:
            raise ValueError(f"feedback: {name!r} is not an input of {model.model!r} (inputs: {model.input_names})")
        if source is not None and source not in known:
            raise ValueError(f"feedback[{name!r}]: {source!r} is neither an input nor an output of {model.model!r}")
    merged = {**rule, **feedback}
    kept_outputs = [s for s in merged.values() if s in model.all_output_names and s not in model.output_names]
    if kept_outputs:
        raise ValueError(f"feedback: the sources {kept_outputs} are outputs this model does not keep "
                         f"(NEML2Model(..., outputs=...) must keep them)")
    return merged


def _check_named(values, names, field, numbers_only=False) -> dict:
    values = dict(values or {})
    for name, value in values.items():
        if name not in names:
            raise ValueError(f"{field}: {name!r} is not one of {list(names)}")
        if numbers_only and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{field}[{name!r}]: expected a number, got {value!r}")
    return values
