"""The GPU check's parts that run without a GPU: the wheelhouse's walk of the requirements, the scripts' usage
errors, the GPU bench's skip and its table. (``.ci/run`` runs ``scripts/gpu-check --dry-run`` itself: the install,
``pytest -m gpu`` collecting the GPU tests and skipping them with the reason, and the bench's skip.)"""

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsched.apps.bench.figures import blocks
from dsched.apps.bench.gpu import figures, format_gpu_table, gpu_missing
from dsched.apps.cli import main

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name):
    """A script of ``scripts/`` (no ``.py``) as a module."""
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(SCRIPTS / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_wheelhouse_carries_what_the_requirements_reach_through_packages_the_image_lacks():
    wheelhouse = load_script("gpu-wheelhouse")
    projects = [  # as pip's resolver reports them: name, version, Requires-Dist
        {"name": "dsched", "version": "0.1.0", "requires": [
            "distributed>=2026.7.1", "numpy>=1.26", 'dask-cuda[cu13]>=26.8; extra == "cuda13"',
            'neml2==3.1.*; extra == "neml2"', 'zarr>=3; extra == "zarr"']},
        {"name": "distributed", "version": "2026.7.1", "requires": ["tornado>=6.2", "psutil>=5.8",
                                                                    'importlib_metadata; python_version < "3.12"']},
        {"name": "dask-cuda", "version": "26.10.0", "requires": ["pandas>=1.3", 'cuda-core[cu13]; extra == "cu13"']},
        {"name": "neml2", "version": "3.1.0", "requires": ["torch>=2.10", "pyzag==2.0.0"]},
        {"name": "pyzag", "version": "2.0.0", "requires": ["torch", "Pyro-PPL"]},
        {"name": "pyro_ppl", "version": "1.9.2", "requires": ["torch", "opt_einsum"]},
        {"name": "tornado", "version": "6.6.1", "requires": []},
        {"name": "importlib_metadata", "version": "10.2.0", "requires": []},
        {"name": "zarr", "version": "3.1.0", "requires": []},
        # The image's: torch (and its CUDA libraries), pandas (and tzdata, which only pandas needs), cuda-core.
        {"name": "torch", "version": "2.11.0", "requires": ["nvidia-nvvm"]},
        {"name": "nvidia-nvvm", "version": "13.0.88", "requires": []},
        {"name": "pandas", "version": "3.0.0", "requires": ["tzdata"]},
        {"name": "tzdata", "version": "2026.6", "requires": []},
        {"name": "cuda-core", "version": "1.2.2", "requires": ["cuda-bindings"]},
        {"name": "psutil", "version": "7.2.2", "requires": []},
        {"name": "numpy", "version": "2.5.2", "requires": []},
    ]
    original = wheelhouse.REQUIREMENTS
    try:
        wheelhouse.REQUIREMENTS = ["dsched[cuda13,neml2]"]
        carried = wheelhouse.to_carry(projects)
    finally:
        wheelhouse.REQUIREMENTS = original
    # Not zarr (an extra not asked for), not importlib_metadata (Python < 3.12), nothing behind the image's
    # packages (tzdata behind pandas, nvidia-nvvm behind torch).
    assert carried == {"dsched", "distributed", "dask-cuda", "neml2", "pyzag", "pyro-ppl", "tornado"}
    assert wheelhouse.in_image("nvidia-nvvm") and wheelhouse.in_image("Jinja2") and not wheelhouse.in_image("bokeh")
    assert wheelhouse.HEAVY.match("cupy-cuda13x") and not wheelhouse.HEAVY.match("nvidia-ml-py")


@pytest.mark.parametrize("script, args", [("gpu-check", ["--dry-run"]), ("gpu-wheelhouse", ["--no-check"])])
def test_the_scripts_refuse_an_output_folder_that_is_a_file_in_one_line(tmp_path, script, args):
    afile = tmp_path / "afile"
    afile.write_text("")
    done = subprocess.run([sys.executable, str(SCRIPTS / script), *args, str(afile)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"{script}: error: {'OUTDIR' if script == 'gpu-check' else 'DIR'}: "
                                                f"{afile} is not a folder"]


@pytest.mark.skipif(gpu_missing() is None, reason="a GPU is present: the suite would run")
def test_the_gpu_bench_is_skipped_in_one_line_without_a_gpu(tmp_path, capsys):
    target = tmp_path / "bench.json"
    assert main(["bench", "--only", "gpu", "--quick", "--json", str(target)]) == 0
    results = json.loads(target.read_text())
    assert results["gpu"] == {"skipped": gpu_missing()}
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if "gpu" in line.lower() and "skipped" in line] == [
        f"gpu suite skipped: {gpu_missing()}"]
    assert "gpu" not in err
    # A skipped suite leaves a page's block alone: a CPU machine's bench run keeps docs/gpu.md's figures.
    assert "gpu" not in blocks(results)


def test_the_gpu_table_and_figures_read_a_results_file():
    seconds = {"CuPy, one call, arrays on the GPU": 0.01, "CuPy, one call, host -> GPU -> host": 0.1,
               "dsched.dispatch on cuda:0": 0.08}
    results = {
        "gpu": {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "cuda_runtime": 13000, "cuda_driver": 13000,
                "cupy": "14.2.0"},
        "quick": False, "repeats": 5, "skipped_sections": {"radret": "neml2 is not installed"},
        "j2": {"points": 1000, "chunk": 100, "seconds": seconds, "items_per_s": {k: 1000 / s for k, s in seconds.items()},
               "error": {"dsched.dispatch on cuda:0": 1e-15, "CuPy, one call": 2e-15}},
        "transfer": {"bytes": 2**20, "chunk_rows": 10, "seconds": {"CuPy, page-locked host memory": 0.001},
                     "gb_per_s": {"CuPy, page-locked host memory": 2.1}, "equal": {"CuPy, page-locked host memory": True}},
        "hybrid": {"points": 1000, "chunks": {"cpu": 10, "cuda:0": 100}, "seconds": {"cuda:0 alone": 1.0},
                   "items_per_s": {"cuda:0 alone": 1000.0}, "vs_gpu_alone": {"cuda:0 alone": 1.0},
                   "cpu_share": {"cuda:0 alone": 0.0}, "error": {"cuda:0 alone": 0.0}},
        "percall": {"calls": 10, "us": {"dsched.dispatch on cuda:0": 812.4}},
    }
    results["figures"] = figures(results)
    assert results["figures"]["j2: dsched / one call with copies"] == 1.25  # 0.1 s against 0.08 s
    assert results["figures"]["j2: dsched / one call on the GPU"] == 0.125
    assert results["figures"]["percall: dsched.dispatch on cuda:0, us"] == 812.4
    table = format_gpu_table(results)
    assert table.splitlines()[0].startswith("NVIDIA H100 80GB HBM3 (79.2 GiB)")
    assert "NEML2 radret, one step: skipped: neml2 is not installed" in table
    assert "dsched.dispatch on cuda:0" in table and "12,500 points/s" in table
    filled = blocks({"command": "dsched bench --only gpu", "gpu": results})
    assert filled["gpu"].startswith("```text\n$ dsched bench --only gpu\nNVIDIA H100")
    assert "GPU: NVIDIA H100 80GB HBM3" in filled["machine"] and "emulated" not in filled["machine"]


def test_the_gpu_benchs_neml2_peer_runs_on_the_cpu_and_equals_dispatch():
    """The radret section's peer (NEML2 called by hand on the whole batch), run on the CPU: the GPU machine found
    it importing a helper that had been renamed, which only a GPU run reached."""
    pytest.importorskip("neml2")
    import dsched
    from dsched.apps.bench.gpu import _neml2_call, _radret_step

    scenario, model, inputs = _radret_step(50)
    run, state = _neml2_call(scenario, model, inputs, "cpu")
    by_hand = run(state())
    dispatched = model.dispatch(inputs, scheduler=dsched.SimpleScheduler("cpu", 20), mode="sync")
    assert set(model.output_names) <= set(dispatched)
    for name in model.output_names:  # an implicit update: Newton stops at its tolerance, batch by batch
        np.testing.assert_allclose(by_hand[name].data.detach().numpy(), dispatched[name], rtol=1e-9, atol=1e-14)
