"""The README is a front page that works: its hello world runs as written, it stays short, and its Quick start
block holds exactly the two commands (CI runs the second one verbatim)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    """The README's ``## title`` section, up to the next second-level heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _fenced_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def test_readme_is_a_front_page_of_at_most_12000_characters():
    assert len(README) <= 12_000, f"README.md has {len(README):,} characters; move detail into docs/"


def test_quick_start_block_has_exactly_the_two_commands():
    blocks = _fenced_blocks(_section("Quick start"), "bash")
    assert len(blocks) == 1, "the Quick start section holds one command block"
    commands = [line.strip() for line in blocks[0].splitlines() if line.strip() and not line.strip().startswith("#")]
    assert commands == ['pip install . && dsched run', 'pip install ".[test]" && pytest']


def test_every_docs_link_of_the_readme_exists():
    for target in re.findall(r"\]\(((?:docs|examples)/[^)#\s]+)", README):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


# distributed's own note when another program on this machine holds the default dashboard port: not the README's
_BUSY_PORT = re.compile(r"Port \d+ is already in use|Perhaps you already have a cluster running|Hosting the HTTP "
                        r"server on port|warnings\.warn\(|UserWarning: Port")


def test_hello_world_runs_as_written_and_prints_its_result_and_nothing_else(tmp_path):
    code = _fenced_blocks(README, "python")[0]
    assert len(code.splitlines()) <= 15, "the hello world is at most 15 lines"
    script = tmp_path / "hello.py"
    script.write_text(code, encoding="utf-8")
    (tmp_path / "sitecustomize.py").write_text(  # the Quick start's install: no prometheus_client
        "import sys\nsys.modules['prometheus_client'] = None\n", encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    noise = [line for line in done.stderr.splitlines() if line.strip() and not _BUSY_PORT.search(line)]
    assert noise == [], "the hello world prints what it promises, no warning:\n" + "\n".join(noise)
    lines = done.stdout.splitlines()
    assert "matches NumPy: True" in lines, done.stdout
    per_device = ast.literal_eval(next(line for line in lines if line.endswith("items per device")).rsplit("}", 1)[0] + "}")
    assert set(per_device) == {"cpu", "cuda:0"} and sum(per_device.values()) == 1_000_000, per_device
    assert min(per_device.values()) > 0, f"both devices computed rows: {per_device}"


def test_readme_describes_the_software_not_its_history():
    """Dated measurements and work-log narrative belong in git log; figures come from the bench blocks."""
    outside_blocks = re.sub(r"<!-- bench:([\w-]+) -->.*?<!-- /bench:\1 -->", "", README, flags=re.S)
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", outside_blocks), "a dated measurement in README.md"
    for phrase in ("session", "lecture", "that day", "this stage", "earlier run"):
        assert phrase not in outside_blocks.lower(), f"README.md reads like a log: {phrase!r}"
