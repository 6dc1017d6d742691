"""The Python blocks of README.md and docs/*.md, and a runner that executes them as a reader would.

A page's ```` ```python ```` blocks run in order in one namespace named
``__main__``, as one script holding them would: a block may use what an earlier
block of its page defined, and ``if __name__ == "__main__":`` bodies run.
Blocks written as a Python session (``>>>``) run as doctests in that
namespace, their output checked. Every page runs in this one process, with a
Dask client on an in-process cluster of a CPU and an emulated ``cuda:0`` as the
default, which a block that names no client uses (a block that starts its own
cluster uses its own). The working directory is a scratch folder, so files a
block writes land there.

An HTML comment on the line before a block's fence marks it:

- ``<!-- skip: REASON -->``: never run here; the reason says what it needs
  (a GPU, ``mpiexec``, a batch system, a running cluster's address);
- ``<!-- needs: MODULE -->``: run only where ``MODULE`` imports (``neml2``).

``python tests/doc_blocks.py ROOT RESULTS.json`` runs every block and writes
``{block id: {"status", "error", "seconds"}}``; ``tests/test_docs.py`` reads it. Each block's id goes
to standard error as it starts, and a block still running after ``BLOCK_LIMIT`` seconds ends the
process with every thread's stack there (``faulthandler``): a hang names its block.
"""

from __future__ import annotations

import contextlib
import doctest
import faulthandler
import importlib.util
import io
import json
import re
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent> *)```python\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(?P<kind>skip|needs):\s*(?P<value>.*?)\s*-->")
BLOCK_LIMIT = 60.0  # seconds; the slowest block takes a few
_START = time.perf_counter()


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository's root
    line: int  # the fence's line, 1-based
    code: str
    skip: str | None = None  # the reason it never runs here
    needs: str | None = None  # a module it needs

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_session(self) -> bool:
        return self.code.lstrip().startswith(">>>")


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(root: Path) -> list[Block]:
    """Every Python block of the pages, in page order, with its markers."""
    found = []
    for path in pages(root):
        text = path.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            marker = MARKER.fullmatch(before)
            kind, value = (marker.group("kind"), marker.group("value")) if marker else (None, None)
            found.append(Block(str(path.relative_to(root)), line, textwrap.dedent(match.group("code")),
                               skip=value if kind == "skip" else None, needs=value if kind == "needs" else None))
    return found


def _run_session(block: Block, namespace: dict) -> None:
    test = doctest.DocTestParser().get_doctest(block.code, namespace, block.id, block.page, block.line)
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test, out=report.write, clear_globs=False)
    if runner.failures:
        raise AssertionError(report.getvalue())


@contextlib.contextmanager
def _watched(what: str):
    """``what`` named on standard error; past ``BLOCK_LIMIT`` seconds, every thread's stack there and the end."""
    print(f"{time.perf_counter() - _START:6.1f} s  {what}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback_later(BLOCK_LIMIT, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run(block: Block, namespace: dict) -> dict:
    if block.skip is not None:
        return {"status": "skipped", "error": f"marked skip: {block.skip}", "seconds": 0.0}
    if block.needs is not None and importlib.util.find_spec(block.needs) is None:
        return {"status": "skipped", "error": f"needs {block.needs}, which is not installed", "seconds": 0.0}
    started = time.perf_counter()
    output = io.StringIO()
    try:
        with _watched(f"block {block.id}"), contextlib.redirect_stdout(output):
            if block.is_session:
                _run_session(block, namespace)
            else:  # padded so that a traceback's line numbers are the page's
                exec(compile("\n" * block.line + block.code, block.page, "exec"), namespace)
        status, error = "passed", None
    except BaseException:  # noqa: BLE001  every block's outcome is reported, the others still run
        status, error = "failed", traceback.format_exc(limit=-8)
    return {"status": status, "error": error, "seconds": time.perf_counter() - started,
            "stdout": output.getvalue()[-2000:]}


def run_all(root: Path) -> dict:
    """Every block's outcome, by id; one shared default client for the blocks that name none."""
    sys.path.insert(0, str(root))
    from distributed import Client

    import dsched

    results, namespaces = {}, {}
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, dashboard_address=None) as cluster:
        client = Client(cluster)  # the default client (not a with block: blocks enter and leave their own)
        try:
            for block in blocks(root):
                if namespaces and block.page not in namespaces:  # the previous page's script has ended
                    previous = next(reversed(namespaces))
                    with _watched(f"end of {previous}"):
                        _end(namespaces[previous])
                namespace = namespaces.setdefault(block.page, {"__name__": "__main__", "__builtins__": __builtins__})
                with client.as_current():  # again the default, whatever clients earlier blocks made and closed
                    results[block.id] = _run(block, namespace)
            for page, namespace in namespaces.items():
                if namespace:  # the last page's; the others have ended
                    with _watched(f"end of {page}"):
                        _end(namespace)
        finally:
            client.close()
    return results


def _end(namespace: dict) -> None:
    """Close the clients, then the clusters, a page's script left open, as its process's exit would."""
    from distributed import Client
    from distributed.deploy import Cluster

    for kind in (Client, Cluster):
        for value in list(namespace.values()):
            if isinstance(value, kind):
                with contextlib.suppress(Exception):
                    value.close()
    namespace.clear()


def main(argv) -> int:
    root, out = Path(argv[0]).resolve(), Path(argv[1])
    results = run_all(root)
    out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
