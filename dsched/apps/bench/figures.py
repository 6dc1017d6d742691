"""Figures for the docs, from one ``dsched bench --json`` file: no number in the README or docs/ is typed by hand.

Pages mark where figures go with a pair of HTML comments::

    <!-- bench:data -->
    (replaced)
    <!-- /bench:data -->

and ``python -m dsched.apps.bench.figures results.json README.md docs/*.md``
rewrites every marked block from the file: ``bench:<suite>`` (``percall``,
``scheduling``, ``data``, ``policy``, ``batch``, ``neml2``, ``fe``, ``gpu``) holds the suite's table as
``dsched bench`` prints it, ``bench:summary`` a table of the headline ratios
with their targets, ``bench:headline`` dsched against each peer (NumPy, Dask,
Ray, NEML2; :mod:`dsched.apps.bench.headline`), ``bench:break-even`` the model
time per call that distributing a call needs (from the percall suite),
``bench:gpu-targets`` the GPU suite's figures against their targets,
``bench:machine`` the machine and command they come from, and ``bench:setup``
the same without the load and the date. A block whose suite is not in the file,
or was skipped or failed in it (``gpu`` without a GPU, ``neml2`` without
NEML2), is left as it is.

Examples
--------
>>> page = "a\\n<!-- bench:machine -->\\nold\\n<!-- /bench:machine -->\\nb"
>>> print(fill(page, {"machine": "new"}))
a
<!-- bench:machine -->
new
<!-- /bench:machine -->
b
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from dsched.apps.bench.batch import format_load_steps
from dsched.apps.bench.data import format_data_table
from dsched.apps.bench.fe import format_fe_table
from dsched.apps.bench.gpu import format_gpu_table, format_gpu_targets
from dsched.apps.bench.headline import headline
from dsched.apps.bench.neml2 import format_neml2_table
from dsched.apps.bench.percall import format_percall
from dsched.apps.bench.policy import format_policy_table
from dsched.apps.bench.scheduling import format_table

__all__ = ["blocks", "fill", "machine_info", "main"]

FORMATTERS = {"percall": format_percall, "scheduling": format_table, "data": format_data_table,
              "policy": format_policy_table, "batch": format_load_steps, "neml2": format_neml2_table,
              "fe": format_fe_table, "gpu": format_gpu_table}
_BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.S)


def blocks(results: dict) -> dict:
    """``{block name: markdown}`` for every block ``results`` (a ``dsched bench --json`` file's content) can fill."""
    out = {"machine": _machine(results), "setup": _machine(results, brief=True), "summary": _summary(results)}
    if headline(results):
        out["headline"] = headline(results)
    if "rows" in results.get("percall", {}):
        out["break-even"] = break_even(results["percall"])
    for suite, formatter in FORMATTERS.items():
        if isinstance(results.get(suite), dict) and not {"skipped", "failed"} & set(results[suite]):  # kept
            # The suite's own command where the file has it (a file merged from runs has a composite one)
            command = results[suite].get("bench_command") or results.get("command", "dsched bench")
            out[suite] = f"```text\n$ {command}\n{formatter(results[suite])}\n```"
    if "gpu" in out:
        out["gpu-targets"] = format_gpu_targets(results["gpu"])
    return out


def fill(page: str, filled: dict) -> str:
    """``page`` with each marked block that ``filled`` names rewritten; other blocks unchanged."""
    def replace(match):
        name = match.group("name")
        if name not in filled:
            return match.group(0)
        return f"{match.group(1)}{filled[name]}\n{match.group(4)}"

    return _BLOCK.sub(replace, page)


def machine_info() -> dict:
    """What a bench result needs to be read: this machine's cores, CPU model, memory, GPUs, whether its shared
    memory takes huge pages (``/dev/shm``'s ``huge=``), load and the date."""
    import datetime
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError, AttributeError):
        memory = None
    from dsched.dataplane.segments import shared_memory_huge_pages
    from dsched.devices.cuda import visible_gpus

    gpus = ", ".join(map(str, visible_gpus()))
    return {"cpus": os.cpu_count(), "cpu": cpu, "memory_gib": memory, "gpus": gpus or None,
            "shm_huge_pages": shared_memory_huge_pages(),
            "load_average": round(os.getloadavg()[0], 2), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _machine(results, brief=False) -> str:
    """The machine and command of the run; ``brief``: without the load and the date (the README's)."""
    machine = results.get("machine", {})
    parts = [f"`{results.get('command', 'dsched bench')}`"]
    if machine:
        parts.append(f"{machine.get('cpus', '?')} CPU cores ({machine.get('cpu', 'unknown CPU')}), "
                     f"{machine.get('memory_gib', '?')} GiB, {machine.get('gpus') or 'no GPU'}"
                     + (f", /dev/shm huge={machine['shm_huge_pages']}" if machine.get("shm_huge_pages") else "")
                     + ("" if brief else f", load {machine.get('load_average', '?')} at the start, "
                                         f"{machine.get('date', '')}"))
    gpu = results.get("gpu")
    if any(suite in results for suite in FORMATTERS if suite != "gpu"):
        parts.append("CUDA devices of these runs are emulated (NumPy on the CPU): not a GPU measurement"
                     if not isinstance(gpu, dict) or "skipped" in gpu else
                     "the gpu suite on a real GPU; the other suites' CUDA devices are emulated (NumPy on the CPU)")
    if isinstance(gpu, dict) and "gpu" in gpu:
        parts.append(f"GPU: {gpu['gpu']['name']}")
    return "Measured with " + "; ".join(parts) + "."


def _summary(results) -> str:
    """The targets of every suite in the file as one table (set for the reference machine; information)."""
    rows = ["| suite | target | on this run |", "|---|---|---|"]
    for suite in FORMATTERS:
        for target, reached in (results.get(suite) or {}).get("targets", {}).items():
            if isinstance(reached, (list, tuple)):  # (value, threshold, reached)
                reached = reached[-1]
            rows.append(f"| {suite} | {target} | {'reached' if reached else 'not reached'} |")
    return "\n".join(rows)


#: speed-ups on two workers the break-even table gives the model time for
SPEEDUPS = (1.0, 1.5, 1.8)


def break_even(percall, workers=2) -> str:
    """When distributing a call pays: the model time per call that ``workers`` workers need for each speed-up.

    A call whose model takes ``T`` on one process takes ``T / workers + c`` on
    ``workers`` equal workers, ``c`` being the call's fixed cost (``dsched.dispatch``
    of a no-op, from the percall suite), so a speed-up ``S`` needs
    ``T >= S c / (1 - S / workers)``.

    Examples
    --------
    >>> print(break_even({"rows": {"dsched.dispatch": 1000.0}}))  # doctest: +NORMALIZE_WHITESPACE
    | speed-up on 2 workers | the model's time per call on one process, at least |
    |---|---|
    | 1.0 x (break-even) | 2.0 ms |
    | 1.5 x | 6.0 ms |
    | 1.8 x | 18.0 ms |
    <BLANKLINE>
    From a call's fixed cost of 1,000 us (`dsched.dispatch` of a no-op, two chunks on two worker processes).
    """
    cost = percall["rows"]["dsched.dispatch"] / 1e3  # milliseconds
    rows = ["| speed-up on 2 workers | the model's time per call on one process, at least |", "|---|---|"]
    for speedup in SPEEDUPS:
        label = f"{speedup:.1f} x" + (" (break-even)" if speedup == 1.0 else "")
        rows.append(f"| {label} | {speedup * cost / (1 - speedup / workers):.1f} ms |")
    return "\n".join(rows) + (f"\n\nFrom a call's fixed cost of {cost * 1e3:,.0f} us (`dsched.dispatch` of a no-op, "
                              "two chunks on two worker processes).")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsched.apps.bench.figures",
                                     description="Rewrite the bench blocks of pages from a dsched bench --json file.")
    parser.add_argument("results", help="the JSON file dsched bench --json wrote")
    parser.add_argument("pages", nargs="+", help="Markdown pages with <!-- bench:NAME --> blocks")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        filled = blocks(json.load(f))
    for path in args.pages:
        with open(path) as f:
            page = f.read()
        new = fill(page, filled)
        if new != page:
            with open(path, "w") as f:
                f.write(new)
            print(f"{path}: figures rewritten", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
