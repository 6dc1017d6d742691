"""The `dsched` command and the graph format: the main job's table, and errors before any cluster starts."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import dsched.cluster
from dsched.cli import main
from dsched.graph import GraphError, load_graph, parse_graph
from dsched.job import run_graph
from dsched.models.j2 import J2Parameters, j2_update, loading_strain


def write(tmp_path, text, name="graph.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


SMALL = """
    [model]
    name = "j2"
    [batch]
    size = 2000
    [scheduler]
    type = "SimpleScheduler"
    device = "cpu"
    batch_size = 300
    capacity = 600
"""


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail loudly if anything tries to start a cluster."""

    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(dsched.cluster.LocalHybridCluster, "__init__", refuse)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[model]\nname='j2'\n[batch]\nsize=10\nbatchsize=3\n", "batch.batchsize: unknown key"),
        ("[model]\nname='j2'\n[batch]\nsize=10\n[schedulers]\n", "schedulers: unknown section"),
        ("[model]\nname='j2'\n[batch]\nsize='ten'\n", "batch.size: 'ten' has the wrong type"),
        ("[model]\nname='j2'\n", "batch.size: required"),
        ("[model]\nname='nope'\n[batch]\nsize=10\n", "model.name: unknown model 'nope'; known: j2"),
        ("[model]\nname='j2'\n[model.parameters]\nyield_stress=-1.0\n[batch]\nsize=10\n", "model.parameters: yield_stress"),
        ("[model]\nname='j2'\n[batch]\nsize=0\n", "batch.size: must be >= 1"),
        ("[model]\nname='j2'\n[batch]\nsize=10\n[scheduler]\ntype='Fancy'\n", "scheduler.type: 'Fancy'"),
        ("[model]\nname='j2'\n[batch]\nsize=10\n[scheduler]\ndevices=['cpu','gpu']\n", "scheduler.devices: 'gpu' is not a device"),
        ("[model]\nname='j2'\n[batch]\nsize=10\n[scheduler]\ndevices=['cpu','cuda']\nbatch_sizes=[4,8,16]\n",
         "scheduler.batch_sizes: expected 1 or 2 values"),
        ("[model]\nname='j2'\n[batch]\nsize=10\n[scheduler]\ntype='SimpleScheduler'\ndevice='cpu'\nbatch_size=8\ncapacity=4\n",
         "scheduler.capacity: 4 is below batch_size 8"),
        ("[model]\nname='j2'\n[batch]\nsize=10\n[options]\nmode='parallel'\n", "options.mode: 'parallel'"),
        ("[model\nname='j2'\n", "is not valid TOML"),
    ],
)
def test_malformed_graph_exits_2_naming_the_key(tmp_path, capsys, no_cluster, text, message):
    path = write(tmp_path, text)
    assert main(["run", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err
    with pytest.raises(GraphError, match=message.split(":")[0]):
        load_graph(path)


def test_missing_graph_file(tmp_path, capsys, no_cluster):
    assert main(["run", str(tmp_path / "absent.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_embedded_default_is_the_main_job():
    graph = load_graph()
    assert (graph.model, graph.batch_size, graph.mode) == ("j2", 1_000_000, "async")
    scheduler = graph.build_scheduler(present=[])  # a machine without a GPU: the CPU alone
    assert isinstance(scheduler, dsched.SimpleScheduler) and str(scheduler.device) == "cpu"
    gpus = [dsched.Device("cuda:0"), dsched.Device("cuda:1")]
    hybrid = graph.build_scheduler(present=gpus)  # with GPUs: CPU and every GPU, GPUs first by priority
    assert isinstance(hybrid, dsched.StaticHybridScheduler)
    assert [(str(s.device), s.batch_size, s.capacity, s.priority) for s in hybrid.status()] == [
        ("cpu", 65536, 131072, 1.0), ("cuda:0", 262144, 524288, 2.0), ("cuda:1", 262144, 524288, 2.0)]


def test_graph_files_in_the_repository_parse():
    from pathlib import Path

    files = sorted(Path(__file__).parent.parent.joinpath("graphs").glob("*.toml"))
    assert files, "graphs/ has example graphs"
    for path in files:
        assert load_graph(path).build_scheduler() is not None


def test_run_graph_results_match_the_model(tmp_path):
    graph = parse_graph({"model": {"name": "j2"}, "batch": {"size": 2000},
                         "scheduler": {"type": "SimpleScheduler", "device": "cpu", "batch_size": 300},
                         "options": {"mode": "sync"}})
    result = run_graph(graph, progress=False)
    assert [r.size for r in result.report.records] == [300] * 6 + [200]
    strain = loading_strain(np.arange(2000))
    expected = j2_update(strain, np.zeros_like(strain), np.zeros(2000), J2Parameters())
    for key in ("stress", "plastic_strain", "alpha", "tangent"):
        np.testing.assert_array_equal(result.outputs[key], expected[key])


def test_dsched_run_prints_the_device_table(tmp_path):
    path = write(tmp_path, SMALL)
    out = subprocess.run([sys.executable, "-m", "dsched", "run", str(path), "--no-progress"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("cpu"))
    assert row.split()[:4] == ["cpu", "no", "7", "2000"]
    assert "total: 2,000 items" in out.stdout


def test_emulated_devices_are_marked(tmp_path):
    graph = parse_graph({"model": {"name": "j2", "tangent": False}, "batch": {"size": 4000},
                         "scheduler": {"devices": ["cpu", "cuda:0"], "batch_sizes": [500, 1000]},
                         "options": {"emulate": True}})
    result = run_graph(graph, progress=False)
    from dsched.job import format_report

    text = format_report(result)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("cpu", "cuda"))}
    assert rows["cuda:0"][1] == "yes" and rows["cpu"][1] == "no"
    assert "not a GPU measurement" in text
    assert sum(int(r[3]) for r in rows.values()) == 4000


def test_help_says_what_each_command_does():
    out = subprocess.run([sys.executable, "-m", "dsched", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "run" in out.stdout
    out = subprocess.run([sys.executable, "-m", "dsched", "run", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "1,000,000 points" in out.stdout


def test_a_graph_may_take_its_sizes_from_the_tuned_profile(tmp_path, monkeypatch, capsys, no_cluster):
    import json

    from dsched.tuning import profile_path

    monkeypatch.setenv("DSCHED_PROFILE_DIR", str(tmp_path / "profiles"))
    text = "[model]\nname='j2'\n[batch]\nsize=10\n[scheduler]\ndevices=['cpu','cuda:0']\nprofile=true\n"
    graph_file = write(tmp_path, text)
    # No profile yet: the graph is refused before anything starts, naming the key.
    assert main(["run", str(graph_file)]) == 2
    assert "scheduler.profile: no tuned profile of model 'j2' on this host covers cpu, cuda:0" in capsys.readouterr().err
    path = profile_path("j2")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"model": "j2", "devices": {
        "cpu": {"batch_size": 3000, "capacity": 6000, "items_per_s": 1e6},
        "cuda:0": {"batch_size": 50000, "capacity": 150000, "items_per_s": 1e7}}}))
    scheduler = load_graph(graph_file).build_scheduler()
    assert [(s.batch_size, s.capacity) for s in scheduler.status()] == [(3000, 6000), (50000, 150000)]
    # Keys in the graph win over the profile.
    explicit = write(tmp_path, text + "batch_sizes=[100, 200]\n", "explicit.toml")
    assert [(s.batch_size, s.capacity) for s in load_graph(explicit).build_scheduler().status()] == [(100, 200), (200, 400)]
