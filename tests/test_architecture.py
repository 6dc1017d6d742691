"""The package's shape: small modules and functions, small folders, no import cycles, old paths kept."""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dsched"
MODULES = sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_is_over_600_lines():
    long = {_name(p): n for p in MODULES if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


def test_no_function_is_over_80_lines():
    long = {}
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long[f"{_name(path)}.{node.name}"] = lines
    assert long == {}


def test_no_folder_holds_more_than_12_modules():
    counts = defaultdict(int)
    for path in MODULES:
        if path.name != "__init__.py":
            counts[str(path.parent.relative_to(PACKAGE.parent))] += 1
    assert {folder: n for folder, n in counts.items() if n > 12} == {}


def _imports(path: Path, known: set) -> set:
    """The dsched modules ``path`` imports, function-local imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dsched"):
            candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names if a.name.startswith("dsched")]
        else:
            continue
        for name in candidates:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known:
                found.add(name)
    return found


def test_the_layers_hold():
    """``lint-imports`` checks the contracts in pyproject.toml (layers, and what two modules must not import)."""
    import shutil

    lint = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(lint).exists():
        pytest.skip("import-linter is not installed (it comes with the test extra)")
    result = subprocess.run([lint, "--no-cache"], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stdout[-3000:]


def test_no_import_cycles_between_modules():
    known = {_name(p) for p in MODULES}
    graph = {_name(p): _imports(p, known) - {_name(p)} for p in MODULES}
    # A package's __init__ re-exports its modules: an edge into a package is an edge into what it re-exports,
    # so cycles through __init__ files are real; only the top-level package (the public facade) is left out.
    graph = {m: {d for d in deps if d != "dsched"} for m, deps in graph.items() if m != "dsched"}
    cycles = []
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for dep in graph.get(node, ()):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert cycles == []


@pytest.mark.parametrize("old, new", [
    ("dsched.feed", "dsched.dispatch.feeds"),
    ("dsched.mpi", "dsched.cluster.mpi"),
    ("dsched.store", "dsched.dataplane.store"),
    ("dsched.trace", "dsched.observe.trace"),
    ("dsched.tuning", "dsched.apps.tune"),
    ("dsched.array", "dsched.blocks"),
    ("dsched.dashboard", "dsched.observe.dashboard"),
])
def test_old_module_paths_are_the_new_modules(old, new):
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)


def test_old_module_paths_read_as_attributes_of_dsched():
    import dsched

    assert dsched.array.plan_blocks is dsched.blocks.plan_blocks
    with pytest.raises(AttributeError, match="has no attribute 'no_such_module'"):
        dsched.no_such_module


def test_python_m_on_an_old_path_runs_the_module():
    result = subprocess.run([sys.executable, "-m", "dsched.mpi", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: python -m dsched.mpi" in result.stdout


@pytest.mark.parametrize("module", ["dsched", "dsched.observe.dashboard"])
def test_importing_loads_no_optional_dependency(module):
    code = (f"import sys, {module}; heavy = [m for m in ('bokeh', 'torch', 'neml2', 'zarr', 'cupy', 'mpi4py', "
            "'matplotlib') if m in sys.modules]; print(heavy)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
