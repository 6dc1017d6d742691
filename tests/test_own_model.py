"""Your own model in a job file: ``model.name = "package.module:function"`` (dsched.models.imported).

The function is imported on the client when the graph is read and on every
worker (worker processes here, which import it from the graph file's folder);
its inputs come from a generator function named the same way or from a Zarr
store. A name that does not import, lacks its attribute or is not callable is
one line naming it, before any cluster starts.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dsched.cluster
from dsched.apps.cli import main
from dsched.apps.job import run_graph
from dsched.apps.jobfile import load_graph

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_model"

MODULE = '''
import os
import numpy as np

def scaled_norm(x, scale=1.0):
    """The norm of each row, scaled; and the process that computed it."""
    return {"norm": scale * np.linalg.norm(x, axis=1), "pid": np.full(len(x), os.getpid())}

def rows(start, stop):
    return {"x": np.arange(start, stop, dtype=float)[:, None] * np.array([[3.0, 4.0]])}

answer = 42
'''


def _write(folder: Path, module: str, graph: str) -> Path:
    (folder / f"{module}.py").write_text(MODULE)
    path = folder / "graph.toml"
    path.write_text(textwrap.dedent(graph).replace("MODULE", module))
    return path


def test_the_example_runs_from_any_folder_as_the_docs_say(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dsched", "run", str(EXAMPLE / "elastic.toml"), "--no-progress"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "model: elastic:stress  batch: 1,000,000" in done.stdout
    assert "total: 1,000,000 items" in done.stdout


def test_the_example_model_is_linear_elasticity():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import elastic
    finally:
        sys.path.remove(str(EXAMPLE))
    strain = elastic.loading(0, 3)["strain"]
    out = elastic.stress(strain, youngs_modulus=200e3, poisson_ratio=0.3)
    lam, mu = 200e3 * 0.3 / (1.3 * 0.4), 200e3 / 2.6
    full = np.array([[[e[0], e[5] / 2, e[4] / 2], [e[5] / 2, e[1], e[3] / 2], [e[4] / 2, e[3] / 2, e[2]]]
                     for e in strain])
    sigma = lam * np.trace(full, axis1=1, axis2=2)[:, None, None] * np.eye(3) + 2 * mu * full
    np.testing.assert_allclose(out["stress"], sigma[:, [0, 1, 2, 1, 0, 0], [0, 1, 2, 2, 2, 1]], rtol=1e-12)
    np.testing.assert_allclose(out["energy"], 0.5 * np.einsum("nij,nij->n", sigma, full), rtol=1e-12)


def test_worker_processes_import_the_function_from_the_graph_s_folder(tmp_path):
    path = _write(tmp_path, "own_model_on_processes", """
        [model]
        name = "MODULE:scaled_norm"
        generator = "MODULE:rows"
        [model.parameters]
        scale = 2.0
        [batch]
        size = 10_000
        [scheduler]
        devices = ["cpu", "cuda:0"]
        batch_sizes = [1_000, 3_000]
        [options]
        emulate = true
        processes = true
        """)
    result = run_graph(load_graph(path), progress=False)
    np.testing.assert_allclose(result.outputs["norm"], 2.0 * 5.0 * np.arange(10_000.0))
    pids = set(result.outputs["pid"].tolist())
    assert len(pids) == 2 and sys.modules.get("own_model_on_processes") is not None  # the client imported it too
    assert {str(r.device) for r in result.report.records} == {"cpu", "cuda:0"}


def test_inputs_from_a_zarr_store_by_the_function_s_argument_names(tmp_path):
    import zarr

    x = np.random.default_rng(0).random((2_500, 2))
    zarr.save_group(str(tmp_path / "in.zarr"), x=x)
    path = _write(tmp_path, "own_model_from_a_store", """
        [model]
        name = "MODULE:scaled_norm"
        [batch]
        size = 1
        [scheduler]
        device = "cpu"
        batch_size = 1_000
        [options]
        input = "IN"
        """.replace("IN", str(tmp_path / "in.zarr")))
    graph = load_graph(path)
    graph.input_loader()  # as dsched run does: the store's length is the batch size
    result = run_graph(graph, progress=False)
    assert graph.batch_size == 2_500
    np.testing.assert_allclose(result.outputs["norm"], np.linalg.norm(x, axis=1))


@pytest.fixture
def no_cluster(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(dsched.cluster.LocalHybridCluster, "__init__", refuse)


@pytest.mark.parametrize("model, extra, line", [
    ("no_such_package.models:f", "", "model.name: cannot import 'no_such_package.models:f' (nor from {folder}): "
                                     "No module named 'no_such_package'"),
    ("MODULE:scaled_nrom", "", "model.name: 'MODULE:scaled_nrom': 'MODULE' has no attribute 'scaled_nrom'; "
                               "did you mean scaled_norm?"),
    ("MODULE:answer", "", "model.name: 'MODULE:answer' is not callable (type int)"),
    ("MODULE", "", "model.name: unknown model 'MODULE'; known: j2, neml2, or your own function as "
                   "'package.module:function'"),
    ("MODULE:scaled_norm", "generator = 'MODULE:row'\n",
     "model.generator: 'MODULE:row': 'MODULE' has no attribute 'row'; did you mean rows?"),
    ("MODULE:scaled_norm", "[model.parameters]\nscael = 2.0\n",
     "model.parameters.scael: MODULE:scaled_norm takes no such argument; did you mean scale? (it takes: x, scale)"),
    ("MODULE:scaled_norm", "", "model.generator: MODULE:scaled_norm needs its inputs: name a generator function "
                               "('package.module:function') or give an input store (--input, options.input)"),
    ("MODULE:scaled_norm", "tangent = false\n", "model.tangent: only for the built-in models"),
    ("j2", "generator = 'MODULE:rows'\n",
     "model.generator: only for your own model (name = 'package.module:function')"),
], ids=["no-module", "no-attribute", "not-callable", "no-colon", "no-generator-attribute", "unknown-parameter",
        "no-inputs", "tangent", "generator-of-a-built-in"])
def test_a_bad_name_is_one_line_naming_it_before_any_cluster(tmp_path, capsys, no_cluster, model, extra, line):
    module = f"own_model_{abs(hash((model, extra))) % 10**8}"
    parameters = extra if extra.startswith("[") else ""
    path = _write(tmp_path, module, f"""
        [model]
        name = "{model}"
        {extra if not parameters else ""}
        {parameters}
        [batch]
        size = 10
        [scheduler]
        device = "cpu"
        """)
    assert main(["run", str(path), "--no-progress"]) == 2
    lines = capsys.readouterr().err.splitlines()
    expected = line.replace("MODULE", module).format(folder=tmp_path)
    assert lines == [f"dsched: error: {expected} in {path}"]
