"""The README's headline figures: dsched against each peer (NumPy, Dask, Ray, NEML2), from one bench JSON file.

One row per comparison a user would make first, each taken from a suite of
the file: the speed-up, how many times faster dsched is than the peer (a rate
over the peer's, or the peer's time over dsched's; higher favours dsched). A
peer the run did not measure (Ray where it is not installed) gets a row saying
so; a suite missing from the file gives no row. :mod:`dsched.apps.bench.figures`
writes the table into the ``<!-- bench:headline -->`` block.

Examples
--------
>>> results = {"data": {"points": 1000, "items_per_s": {"dispatch, plain": 3e6, "numpy": 2e6}}}
>>> print(headline(results))
| against | what is compared | dsched | peer | speed-up |
|---|---|---|---|---|
| NumPy | J2 with its tangent on 1,000 points: `dispatch` on 2 worker processes against one NumPy call | 3.00 M points/s | 2.00 M points/s | 1.50 x |
| Ray | the same J2 points: `dispatch` against `ray.put` and a Ray task per chunk | - | - | not measured: Ray was not installed |
"""

from __future__ import annotations

__all__ = ["headline"]


def _rate(items_per_s, unit="points") -> str:
    return f"{items_per_s / 1e6:.2f} M {unit}/s"


def _rows(results) -> list:
    """``[(against, what, dsched, peer, ratio)]`` of the comparisons the file holds."""
    rows = []
    data = results.get("data") or {}
    rates = data.get("items_per_s") or {}
    if "dispatch, plain" in rates and "numpy" in rates:
        rows.append(("NumPy", f"J2 with its tangent on {data['points']:,} points: `dispatch` on 2 worker processes "
                     "against one NumPy call", _rate(rates["dispatch, plain"]), _rate(rates["numpy"]),
                     f"{rates['dispatch, plain'] / rates['numpy']:.2f} x"))
    hybrid = (results.get("scheduling") or {}).get("hybrid") or {}
    if "dsched" in hybrid and "client.map" in hybrid:
        devices = len(results["scheduling"]["config"]["devices"])
        ours, theirs = hybrid["dsched"]["items_per_s"], hybrid["client.map"]["items_per_s"]
        rows.append(("Dask", f"one batch over {devices} emulated devices of different speeds: dsched against "
                     "`client.map`", _rate(ours, "items"), _rate(theirs, "items"), f"{ours / theirs:.2f} x"))
    calls = (results.get("percall") or {}).get("rows") or {}
    if "dsched.dispatch" in calls and "dask submit + gather" in calls:
        ours, theirs = calls["dsched.dispatch"], calls["dask submit + gather"]
        rows.append(("Dask", "one call of a model that does nothing, on 2 workers: `dispatch` against `submit` "
                     "and `gather`", f"{ours / 1000:.2f} ms", f"{theirs / 1000:.2f} ms", f"{theirs / ours:.2f} x"))
    if rates or calls:
        ray = rates.get("ray, put and tasks")
        if ray is not None and "dispatch, plain" in rates:
            rows.append(("Ray", "the same J2 points: `dispatch` against `ray.put` and a Ray task per chunk",
                         _rate(rates["dispatch, plain"]), _rate(ray), f"{rates['dispatch, plain'] / ray:.2f} x"))
        elif "ray tasks + get" in calls and "dsched.dispatch" in calls:
            ours, theirs = calls["dsched.dispatch"], calls["ray tasks + get"]
            rows.append(("Ray", "one call of a model that does nothing: `dispatch` against two Ray tasks and "
                         "`ray.get`", f"{ours / 1000:.2f} ms", f"{theirs / 1000:.2f} ms", f"{theirs / ours:.2f} x"))
        else:
            rows.append(("Ray", "the same J2 points: `dispatch` against `ray.put` and a Ray task per chunk", "-", "-",
                         "not measured: Ray was not installed"))
    neml2 = results.get("neml2") or {}
    median = (neml2.get("targets") or {}).get("median >= 1.1 x NEML2 on 2 threads")
    if median is not None:
        scenarios = len(neml2.get("scenarios", ()))
        rows.append(("NEML2", f"{scenarios} of NEML2's own benchmark scenarios, median over dsched's forms, against "
                     "NEML2's driver on 2 threads", "-", "-", f"{median[0]:.2f} x"))
    return rows


def headline(results: dict) -> str:
    """The headline table (Markdown) of a ``dsched bench --json`` file's content; ``""`` if it holds none."""
    rows = _rows(results)
    if not rows:
        return ""
    lines = ["| against | what is compared | dsched | peer | speed-up |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
