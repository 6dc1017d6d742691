"""The forms the NEML2 bench measures, and NEML2 itself on two workers side by side.

Each form steps a :class:`~dsched.models.NEML2Model` through prescribed
histories (time leading, NEML2's layout) the way a user would: a dispatch per
step on NumPy or on NEML2's typed tensors, a resident :class:`dsched.Batch`
with one update per step (its state in device memory), or a
:class:`~dsched.resident.driver.TransientDriver` with every step in one update
(its state where ``memory="auto"`` puts it: host memory here).
:func:`side_by_side` runs NEML2's own driver on each half of the points in the
two workers at once: what the hardware gives two single-thread workers.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time

import numpy as np

from dsched.models.neml2_scenarios import run_neml2_driver
from dsched.resident.driver import TransientDriver, neml2_feedback

__all__ = ["FORMS", "FORM_TITLES", "STEPPED", "dispatch_steps", "driver_steps", "halves", "forms", "side_by_side",
           "side_by_side_paced", "errors", "first_step_inputs", "take_devices"]

FORMS = ("numpy", "typed", "batch", "driver")
FORM_TITLES = {"numpy": "dispatch, NumPy", "typed": "dispatch, typed", "batch": "Batch", "driver": "driver"}
STEPPED = ("numpy", "typed")  # the forms that return to the caller after every step, both halves done


def dispatch_steps(model, histories, scheduler, client, *, typed=False):
    """NEML2Model.dispatch once per step, the old state carried on the client as NEML2's driver carries it.

    ``histories`` maps each prescribed input (``"t"``, ``"strain"``) to its
    history ``(steps + 1, points, *base)``. Returns the last step's outputs.
    """
    wrap = _typed_wrappers(model) if typed else None
    feedback = neml2_feedback(model.input_names, model.all_output_names)
    prescribed = {name: h for name, h in histories.items() if name in model.input_names}
    if wrap:
        import torch

        prescribed = {name: torch.from_numpy(h) for name, h in prescribed.items()}
    before, outputs = {name: h[0] for name, h in prescribed.items()}, {}
    steps = len(next(iter(prescribed.values()))) - 1
    for step in range(1, steps + 1):
        inputs = {}
        for name in model.input_names:
            if name in prescribed:
                inputs[name] = prescribed[name][step]
            else:  # the old state: an output of the step before, else an input of it, else zero (NEML2's rule)
                source = feedback.get(name)
                inputs[name] = outputs.get(source, before.get(source, 0.0))
        if wrap:
            inputs = {name: wrap[name](v) if not isinstance(v, float) and not hasattr(v, "base_shape") else v
                      for name, v in inputs.items()}
        outputs = model.dispatch(inputs, scheduler=scheduler, client=client)
        before = inputs
    return {name: _numpy(v) for name, v in outputs.items()}


_WRAPPERS = {}  # (input, model, overrides) -> {input: NEML2 type}: read once, not in any timed run


def _typed_wrappers(model):
    from dsched.models.neml2 import _import_neml2

    key = (str(model.input), model.model, model.overrides)
    if key not in _WRAPPERS:
        _WRAPPERS[key] = dict(_import_neml2().load_input(str(model.input), additional_args=list(
            model.overrides)).get_model(model.model).input_spec)
    return _WRAPPERS[key]


def _numpy(value):
    return value.data.detach().numpy() if hasattr(value, "base_shape") else np.asarray(value)


def driver_steps(model, histories, scheduler, client, *, steps_per_update=None, memory="auto"):
    """A :class:`TransientDriver` over the histories; the last step's outputs."""
    with TransientDriver(model, scheduler, client=client, memory=memory) as driver:
        driver.run(histories, steps_per_update=steps_per_update)
        return driver.get_many()


def halves(points):
    first = (points + 1) // 2
    return [first, points - first]


def forms(model, histories, scheduler, client):
    return {
        "numpy": lambda: dispatch_steps(model, histories, scheduler, client),
        "typed": lambda: dispatch_steps(model, histories, scheduler, client, typed=True),
        # The state on the workers as torch tensors, each step a task per chunk: a chunk steps on without
        # waiting for the other (in host memory each step would be one call, every chunk waiting for the slower).
        "batch": lambda: driver_steps(model, histories, scheduler, client, steps_per_update=1, memory="device"),
        "driver": lambda: driver_steps(model, histories, scheduler, client),
    }



def first_step_inputs(model, histories) -> dict:
    """The model's inputs at the first step: the prescribed values of entry 1, the old state as NEML2's driver
    starts it (``X~1`` from entry 0 of a prescribed ``X``, zero otherwise)."""
    prescribed = {"t": histories.time, **histories.prescribed}
    feedback = neml2_feedback(model.input_names, model.all_output_names)
    inputs = {}
    for name in model.input_names:
        if name in prescribed:
            inputs[name] = prescribed[name][1]
        else:
            source = feedback.get(name)
            inputs[name] = prescribed[source][0] if source in prescribed else 0.0
    return inputs


def take_devices(model, histories, scheduler, client) -> None:
    """One untimed call of ``model``'s first step, so that dsched's forms are timed on devices they hold.

    :func:`side_by_side` runs NEML2 as tasks on the same devices: its tasks
    end the feeds dsched's last call left parked (a device is shared), and the
    next call starts new ones, a scheduler round trip (some 10 ms here). A
    solver calling dsched step after step holds its feeds; this call takes
    them back as its loop would have them.
    """
    model.dispatch(first_step_inputs(model, histories), scheduler=scheduler, client=client)


def side_by_side(client, scenario, points, steps, halves, **model) -> float:
    """Seconds of NEML2's driver on each half in the two workers at once (the slower half): what the hardware
    gives two single-thread workers side by side (shared caches and memory bandwidth), measured. ``model``:
    :func:`~dsched.models.neml2_scenarios.run_neml2_driver`'s ``compile``, ``artifacts`` or ``grad``."""
    import uuid

    token = uuid.uuid4().hex
    futures = _on_halves(client, halves, lambda i, a, b: (
        _neml2_half, scenario, points, steps, a, b, f"{token}-{i}", f"{token}-{1 - i}", model))
    return max(client.gather(futures))


def _on_halves(client, halves, call) -> list:
    """A task per half on its device's worker (``cpu``, then ``cuda:0``): ``call(i, start, stop)`` gives the
    function and its arguments."""
    from dsched.devices.device import device_resource

    bounds = [(0, halves[0]), (halves[0], sum(halves))]
    return [client.submit(*call(i, a, b), resources={device_resource(device): 1}, pure=False)
            for i, (device, (a, b)) in enumerate(zip(["cpu", "cuda:0"], bounds))]


def _half(scenario, points, steps, start, stop):
    """Points ``start:stop`` of the scenario's histories, copied: NEML2's driver builds its own."""
    whole = scenario.histories(points, steps)
    return dataclasses.replace(whole, time=whole.time[:, start:stop].copy(),
                               prescribed={k: v[:, start:stop].copy() for k, v in whole.prescribed.items()})


def _neml2_half(scenario, points, steps, start, stop, mine, other, model=None):
    """On a worker: NEML2's driver on points ``start:stop``, started when the other half's worker is ready too."""
    from distributed import Event

    part = _half(scenario, points, steps, start, stop)
    run_neml2_driver(scenario, part, threads=1, **(model or {}))  # this worker's first call: imports, loads, compiles
    Event(mine).set()
    Event(other).wait(timeout=600)
    return run_neml2_driver(scenario, part, threads=1, **(model or {}))[1][0]


def side_by_side_paced(client, scenario, points, steps, halves, **model) -> float:
    """Seconds of :func:`side_by_side` with every step of both halves released by a message from this thread
    and answered by one (a Unix socket per worker), the next step released once both answered.

    The fastest any call per step can be on these workers: NEML2's own steps on
    data that never moves, with nothing between them but the slower half and a
    message each way, as a form that returns to its caller after every step
    (``STEPPED``) must wait. The halves' steps differ in cost as their Newton
    solves do, so each step waits for the slower one.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dsched-paced-") as folder:  # made with mode 0700
        path = os.path.join(folder, "steps")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(path)
            server.listen(2)
            futures = _on_halves(client, halves, lambda i, a, b: (
                _neml2_half_paced, scenario, points, steps, a, b, path, model))
            connections = [_accept(server, futures) for _ in futures]
            try:
                for c in connections:
                    c.recv_bytes()  # warmed up, its driver built
                seconds = _pace(connections)
            finally:
                for c in connections:
                    c.close()
            client.gather(futures)
    return seconds


def _accept(server, futures, wait=600.0):
    """The next worker's connection; a task's error rather than a wait for ever if one failed first."""
    from multiprocessing.connection import Connection

    server.settimeout(0.5)
    deadline = time.monotonic() + wait
    while True:
        try:
            sock, _ = server.accept()
        except TimeoutError:
            for future in futures:
                if future.status == "error":
                    future.result()  # raises the task's error
            if time.monotonic() > deadline:
                raise TimeoutError(f"the paced halves did not connect within {wait:.0f} s") from None
            continue
        sock.settimeout(None)
        return Connection(sock.detach())


def _pace(connections) -> float:
    """Release the halves' steps together until both drivers end (each answers the release after its last step
    with ``end``); seconds from the first release to the last step's answer."""
    start = last = time.perf_counter()
    running = list(connections)
    while running:
        for c in running:
            c.send_bytes(b"go")
        for c in list(running):
            if c.recv_bytes() == b"end":
                running.remove(c)
            else:
                last = time.perf_counter()
    return last - start


def _neml2_half_paced(scenario, points, steps, start, stop, path, model=None):
    """On a worker: NEML2's driver on points ``start:stop``, each of its steps released over the socket at
    ``path`` (:func:`side_by_side_paced`)."""
    from multiprocessing.connection import Connection

    part = _half(scenario, points, steps, start, stop)
    run_neml2_driver(scenario, part, threads=1, **(model or {}))  # imports, loads, compiles
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    with Connection(sock.detach()) as connection:
        seconds = run_neml2_driver(scenario, part, threads=1, paced=connection, **(model or {}))[1][0]
        connection.recv_bytes()  # the release of a step this half does not have: the other half may
        connection.send_bytes(b"end")
    return seconds


def errors(result, halved, whole) -> dict:
    """The largest difference from NEML2 on the same chunks (``same_chunks``: the halves, in blocks) and on the
    whole batch, absolute and relative to the largest value of the whole batch's outputs."""
    same = max(float(np.max(np.abs(result[k] - halved[k]), initial=0.0)) for k in result)
    scale = max(float(np.max(np.abs(whole[k]), initial=0.0)) for k in result) or 1.0
    full = max(float(np.max(np.abs(result[k] - whole[k]), initial=0.0)) for k in result)
    return {"same_chunks": same, "same_chunks_relative": same / scale, "whole_batch": full,
            "whole_batch_relative": full / scale}

