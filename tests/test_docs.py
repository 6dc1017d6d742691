"""The documentation works as written: every Python block of README.md and docs/*.md runs, every link and path
resolves, and every figure is the bench JSON's.

The blocks run in one process (``tests/doc_blocks.py``, which says how, and how a block is marked when it cannot
run here), once for the module; each block is a test of its own, named by its page and line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("doc_blocks", Path(__file__).with_name("doc_blocks.py"))
doc_blocks = sys.modules.setdefault("doc_blocks", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(doc_blocks)

BLOCKS = doc_blocks.blocks(ROOT)
PAGES = doc_blocks.pages(ROOT)
pytestmark = pytest.mark.timeout(300)  # the first test runs every block (about 30 s; a hung one ends at 60 s)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every block's outcome: one run of all of them, in a scratch folder, with a profile folder of its own."""
    scratch = tmp_path_factory.mktemp("doc-blocks")
    env = dict(os.environ, DSCHED_PROFILE_DIR=str(scratch / "profiles"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("doc_blocks.py")), str(ROOT),
                               str(scratch / "outcomes.json")], cwd=scratch, env=env, capture_output=True, text=True,
                              timeout=240)
    except subprocess.TimeoutExpired as slow:  # many slow blocks, none hung: the ones that ran, in order
        pytest.fail(f"the doc blocks took over 240 s; started:\n{slow.stderr[-8000:] if slow.stderr else ''}")
    assert done.returncode == 0, done.stderr[-8000:]  # a hung block: its id, then every thread's stack
    return json.loads((scratch / "outcomes.json").read_text())


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_the_block_runs_as_written(block, outcomes):
    outcome = outcomes[block.id]
    if outcome["status"] == "skipped":
        pytest.skip(f"{block.id}: {outcome['error']}")
    assert outcome["status"] == "passed", f"{block.id} fails as written:\n{outcome['error']}"


def test_every_marker_stands_before_a_python_block_and_gives_a_reason():
    for path in PAGES:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(rf"^ *{doc_blocks.MARKER.pattern} *$", text, re.M):  # a line of its own
            line = text.count("\n", 0, match.start()) + 1
            following = text[match.end():].lstrip(" \n")
            assert following.startswith("```python"), f"{path.name}:{line}: a marker not followed by a Python block"
            assert len(match.group("value")) > 3, f"{path.name}:{line}: a marker without its reason"
            if match.group("kind") == "needs":
                assert re.fullmatch(r"[\w.]+", match.group("value")), f"{path.name}:{line}: needs one module"


def test_the_readme_s_hello_world_is_its_first_block_and_runs_here():
    hello = BLOCKS[0]
    assert hello.page == "README.md" and hello.skip is None and hello.needs is None


# --- links and paths ----------------------------------------------------------------------------------------------

def _prose(text: str) -> str:
    """``text`` without its fenced blocks (their lines kept blank, so line numbers stay)."""
    return re.sub(r"^( *)```.*?^\1```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)


def _anchors(path: Path) -> set:
    """The anchors GitHub gives the headings of a page: lower case, punctuation dropped, spaces as hyphens."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", _prose(path.read_text(encoding="utf-8")), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path):
    text = _prose(path.read_text(encoding="utf-8"))
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        yield text.count("\n", 0, match.start()) + 1, match.group(1)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for line, target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not checked (no network)
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{page.name}:{line}: {target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{page.name}:{line}: {target} (no heading #{anchor} in {resolved.name})")
    assert not broken, "\n".join(broken)


REPOSITORY_PATH = re.compile(r"`((?:docs|examples|tests|graphs|plugins|dsched|notes|\.ci)/[^`\s]*)`")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_repository_path_a_page_names_exists(page):
    """A path in backticks (``examples/load_steps.py``, ``tests/test_x.py::test_y``) names a file or folder that
    exists; paths with placeholders (``*``, ``<``, ``{``, ``...``) are patterns, not checked."""
    text = _prose(page.read_text(encoding="utf-8"))
    missing = []
    for match in REPOSITORY_PATH.finditer(text):
        path = match.group(1).split("::")[0].rstrip(".,:;")
        if any(mark in path for mark in ("*", "<", "{", "…", "...", "NN")):
            continue
        if not (ROOT / path).exists():
            missing.append(f"{page.name}:{text.count(chr(10), 0, match.start()) + 1}: {path}")
    assert not missing, "\n".join(missing)


# --- figures and pages --------------------------------------------------------------------------------------------

def test_every_figure_block_is_what_the_bench_json_renders():
    """README.md and docs/ hold no hand-typed figure: each bench block is the figures script's rendering of
    docs/results/bench.json (re-render with python -m dsched.apps.bench.figures after a new run)."""
    from dsched.apps.bench.figures import blocks, fill

    filled = blocks(json.loads((ROOT / "docs" / "results" / "bench.json").read_text()))
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert fill(text, filled) == text, f"{page.name}: a bench block differs from docs/results/bench.json"


def test_the_gpu_pages_blocks_are_what_the_gpu_checks_bench_json_renders():
    """docs/gpu.md's GPU tables come from the GPU check's file, docs/results/gpu-bench.json (a machine without a
    GPU skips that suite, so the CPU run's file leaves them alone)."""
    from dsched.apps.bench.figures import blocks, fill

    filled = blocks(json.loads((ROOT / "docs" / "results" / "gpu-bench.json").read_text()))
    assert {"gpu", "gpu-targets"} <= set(filled)
    page = (ROOT / "docs" / "gpu.md").read_text(encoding="utf-8")
    assert fill(page, {k: filled[k] for k in ("gpu", "gpu-targets")}) == page


def test_the_readme_s_benchmarks_are_a_headline_table_against_the_peers():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Benchmarks\n(.*?)(?=^## )", readme, re.S | re.M).group(1)
    table = re.search(r"<!-- bench:headline -->\n(.*?)<!-- /bench:headline -->", section, re.S).group(1)
    peers = [row.split("|")[1].strip() for row in table.strip().splitlines()[2:]]
    assert {"NumPy", "Dask", "Ray", "NEML2"} <= set(peers) and len(peers) <= 8
    assert "bench:summary" not in section and "load " not in section  # the targets are in docs/benchmarks.md
    assert "<!-- bench:summary -->" in (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")


def test_the_docs_extra_is_named_where_the_api_reference_is():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = next(line for line in readme.split("\n- ") if line.startswith("`docs/api/`"))
    assert 'pip install ".[docs]"' in line
    assert 'pip install ".[docs]"' in (ROOT / "docs" / "api" / "index.rst").read_text(encoding="utf-8")


def test_the_dask_array_page_is_a_user_guide():
    text = (ROOT / "docs" / "array.md").read_text(encoding="utf-8")
    for note in (".ci/", "CI ", "pytest", "cases collected", "tests/"):
        assert note not in text, f"docs/array.md holds a test or CI note ({note!r}): it belongs in docs/testing.md"
