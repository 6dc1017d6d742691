"""CPU targets of NEML2 dispatch: a viscoplastic model on 200,000 points against a direct chunked loop.

``python -m dsched.neml2_bench [--points N] [--batch-size B] [--repeats R]``
prints one table:

- **loop**: NEML2 called directly, one thread (``torch.set_num_threads(1)``),
  chunk after chunk of ``B`` points on the calling thread: what a NEML2 user
  writes without a dispatcher. The reference.
- **processes**: :meth:`NEML2Model.dispatch` on two single-thread worker
  processes, ``cpu`` and an emulated ``cuda:0`` (a second CPU worker that
  claims a CUDA device; placement only, not a GPU measurement). Target
  >= 1.6 x the loop.
- **in-process**: the same dispatch on in-process workers (threads of this
  process, sharing its GIL). Target >= 0.95 x the loop.

Every row is the best of ``R`` runs after one warm-up (worker start-up,
imports and the model's first load are not timed). Results are checked
against the loop's. The model is tests/data/neml2_viscoplastic.i (Perzyna
J2 viscoplasticity, NEML2's own Newton solve), one step of 1 s from rest.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

import dsched
from dsched.models.neml2 import NEML2Model

__all__ = ["measure", "main", "VISCOPLASTIC_INPUT"]

VISCOPLASTIC_INPUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "neml2_viscoplastic.i"


def _inputs(n):
    strain = np.random.default_rng(0).uniform(-4e-3, 4e-3, size=(n, 6))
    return {"E": strain, "E~1": np.zeros((1, 6)), "t": 1.0, "t~1": 0.0,
            "stress~1": np.zeros((1, 6)), "equivalent_plastic_strain~1": 0.0}


def _direct_loop(path, inputs, batch_size):
    """NEML2 on one thread, chunk after chunk, as a user would write it."""
    import neml2
    import torch

    torch.set_num_threads(1)
    model = neml2.load_model(str(path), "model")
    n = len(inputs["E"])
    pieces = []
    for start in range(0, n, batch_size):
        state = {k: torch.as_tensor(v[start:start + batch_size] if k == "E" else np.asarray(v, dtype=np.float64))
                 for k, v in inputs.items()}
        out = model.call_by_name(state)
        pieces.append(out["stress"].data.detach().numpy())
    return np.concatenate(pieces)


def _best(fn, repeats):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def _dispatch_row(model, inputs, batch_size, repeats, processes):
    from distributed import Client

    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [batch_size, batch_size])
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=processes, threads_per_worker=1,
                                   dashboard_address=None) as cluster, Client(cluster) as client:
        warm = _inputs(2 * batch_size)
        model.dispatch(warm, scheduler=scheduler, client=client)  # imports, model loads: not timed
        return _best(lambda: model.dispatch(inputs, scheduler=scheduler, client=client)["stress"], repeats)


def measure(points=200_000, batch_size=20_000, repeats=3, path=VISCOPLASTIC_INPUT) -> dict:
    """``{row: seconds}`` for the loop and both dispatches, with the speed-ups and a result check."""
    inputs = _inputs(points)
    model = NEML2Model(path, "model", outputs=["stress"])
    _direct_loop(path, _inputs(batch_size), batch_size)  # warm-up: first-call costs are not timed
    loop, reference = _best(lambda: _direct_loop(path, inputs, batch_size), repeats)
    rows = {"loop": loop}
    for name, processes in (("processes", True), ("in-process", False)):
        seconds, stress = _dispatch_row(model, inputs, batch_size, repeats, processes)
        np.testing.assert_allclose(stress, reference, rtol=1e-8, atol=1e-9)
        rows[name] = seconds
    return {"points": points, "batch_size": batch_size, "repeats": repeats, "seconds": rows,
            "speedup": {name: loop / seconds for name, seconds in rows.items() if name != "loop"}}


TARGETS = {"processes": 1.6, "in-process": 0.95}


def format_result(result) -> str:
    lines = [
        f"NEML2 viscoplastic model (neml2_viscoplastic.i), {result['points']:,} points, "
        f"batch size {result['batch_size']:,}, best of {result['repeats']}; "
        f"{platform.machine()}, {os.cpu_count()} cores; cuda:0 is emulated (a CPU worker: placement only)",
        f"{'row':<12} {'seconds':>8} {'points/s':>10} {'x loop':>7}  target",
    ]
    for name, seconds in result["seconds"].items():
        speedup = result["speedup"].get(name)
        target = TARGETS.get(name)
        verdict = "" if target is None else f">= {target}: {'met' if speedup >= target else 'MISSED'}"
        lines.append(f"{name:<12} {seconds:>8.2f} {result['points'] / seconds:>10,.0f} "
                     f"{'' if speedup is None else f'{speedup:.2f}':>7}  {verdict}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(format_result(measure(args.points, args.batch_size, args.repeats)))


if __name__ == "__main__":
    main()
