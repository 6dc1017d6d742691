"""Guard rails: a user's mistake gets one line naming the field and value and exit status 2, never a hang.

Each case runs the real ``dsched`` command (in this process through ``main``,
or as a subprocess where the process itself matters: Ctrl-C, worker processes)
and checks the exact outcome: exit status and the one line on stderr. Emulated
devices here test placement and error handling only, never a GPU.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import dsched.cluster
from dsched.cli import main
from dsched.devices import visible_gpus
from dsched.graph import GraphError, parse_graph
from dsched.models import MODELS
from dsched.models.j2 import J2Parameters, j2_update, loading_strain

ROOT = Path(__file__).resolve().parents[1]
HEAD = "[model]\nname = 'j2'\n[batch]\nsize = 2000\n"


def graph_file(tmp_path, text, name="graph.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def no_cluster(monkeypatch):
    """Fail loudly if anything tries to start a cluster: these errors come before any."""

    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(dsched.cluster.LocalHybridCluster, "__init__", refuse)


def one_error_line(capsys) -> str:
    """The single line ``dsched`` printed on stderr (asserting there is exactly one)."""
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- graphs refused before any cluster starts ------------------------------------

@pytest.mark.parametrize(
    "text, line",
    [
        (HEAD + "[scheduler]\ndevice = 'cpu'\ndevices = ['cpu', 'cuda:0']\n",
         "dsched: error: scheduler.device: 'cpu' and scheduler.devices: ['cpu', 'cuda:0'] are both set in {path}; give one"),
        (HEAD + "[options]\nthreads_per_worker = 0\n",
         "dsched: error: options.threads_per_worker: must be >= 1, got 0 in {path}"),
        (HEAD + "[options]\nthreads_per_worker = -3\n",
         "dsched: error: options.threads_per_worker: must be >= 1, got -3 in {path}"),
        ("[model]\nname = 'nope'\n[batch]\nsize = 10\n",
         "dsched: error: model.name: unknown model 'nope'; known: " + ", ".join(sorted(MODELS))
         + ", or your own function as 'package.module:function' in {path}"),
        ("[model]\nname = 'J2'\n[batch]\nsize = 10\n",
         "dsched: error: model.name: unknown model 'J2'; did you mean j2?; known: " + ", ".join(sorted(MODELS))
         + ", or your own function as 'package.module:function' in {path}"),
        (HEAD + "[scheduler]\ndevices = ['cpu', 'cuda:0']\nbatch_size = [32768, 262144]\n",
         "dsched: error: scheduler.batch_size: [32768, 262144] has the wrong type (expected an integer) in {path}; "
         "did you mean batch_sizes?"),
        (HEAD + "[scheduler]\nbatchsizes = [4]\n",
         "dsched: error: scheduler.batchsizes: unknown key in {path}; did you mean batch_sizes? (known in [scheduler]: "
         "type, device, devices, batch_size, capacity, batch_sizes, capacities, priorities, profile, chunk_seconds)"),
        ("[model]\nname = 'j2'\n[model.parameters]\nyeild_stress = 300.0\n[batch]\nsize = 10\n",
         "dsched: error: model.parameters.yeild_stress: not a parameter of j2 in {path}; did you mean yield_stress? "
         "(its parameters: youngs_modulus, poisson_ratio, yield_stress, hardening_modulus)"),
        (HEAD + "[scheduler]\ndevices = ['cpu', 'gpu']\n",
         "dsched: error: scheduler.devices: 'gpu' is not a device; expected 'cpu', 'cuda' or 'cuda:N' with N >= 0 "
         "in {path}"),
        (HEAD + "[scheduler]\ndevice = 'cuda:x'\n",
         "dsched: error: scheduler.device: 'cuda:x' is not a device; expected 'cpu', 'cuda' or 'cuda:N' with N >= 0 "
         "in {path}"),
        (HEAD + "[scheduler]\ntype = 'SimpleScheduler'\ndevices = ['cpu', 'cuda:0']\n",
         "dsched: error: scheduler.devices: SimpleScheduler takes one device, got ['cpu', 'cuda:0'] in {path}"),
        (HEAD + "[scheduler]\ndevice = 'cpu'\nbatch_size = 8\ncapacity = 4\n",
         "dsched: error: scheduler.capacity: 4 is below batch_size 8 in {path}"),
    ],
    ids=["device-and-devices", "threads-0", "threads-negative", "model-name", "model-name-case", "batch-size-a-list",
         "unknown-key-close", "parameters-unknown-field", "devices-gpu", "device-cuda-x",
         "simple-two-devices", "capacity-below-batch"],
)
def test_malformed_graph_is_one_line_with_status_2(tmp_path, capsys, no_cluster, text, line):
    path = graph_file(tmp_path, text)
    assert main(["run", str(path), "--no-progress"]) == 2
    assert one_error_line(capsys) == line.format(path=path)


@pytest.mark.skipif(bool(visible_gpus()), reason="this machine has a GPU")
def test_workstation_graph_without_a_gpu_names_the_device_and_the_flag(capsys, no_cluster):
    assert main(["run", str(ROOT / "graphs" / "j2_workstation.toml"), "--no-progress"]) == 2
    assert one_error_line(capsys) == (
        "dsched: error: scheduler.devices: cuda:0 is not present on this machine (visible GPUs: none); pass --emulate "
        f"(options.emulate = true) to emulate it, for testing only, in {ROOT / 'graphs' / 'j2_workstation.toml'}"
    )


def test_absent_gpu_without_emulation(tmp_path, capsys, no_cluster):
    path = graph_file(tmp_path, HEAD + "[scheduler]\ndevice = 'cuda:99'\n")
    shown = ", ".join(map(str, visible_gpus())) or "none"
    assert main(["run", str(path), "--no-progress"]) == 2
    assert one_error_line(capsys) == (
        f"dsched: error: scheduler.device: cuda:99 is not present on this machine (visible GPUs: {shown}); pass "
        f"--emulate (options.emulate = true) to emulate it, for testing only, in {path}"
    )


def test_enormous_batch_is_refused_saying_what_it_needs_and_what_there_is(tmp_path, capsys, no_cluster):
    import psutil

    path = graph_file(tmp_path, "[model]\nname = 'j2'\n[batch]\nsize = 10_000_000_000_000\n")
    assert main(["run", str(path), "--no-progress"]) == 2
    line = one_error_line(capsys)
    # J2 with its tangent: stress (6) + plastic strain (6) + alpha (1) + tangent (36) float64 = 392 bytes a point,
    # declared by the model, so allocated once.
    assert line.startswith(
        "dsched: error: batch.size: 10,000,000,000,000 items need about 3.5 PiB of memory for their outputs "
        "(392 B per item) but "
    )
    available = line.split(" but ")[1].split(" is available")[0]
    value, unit = available.split()
    assert unit == "GiB" and abs(float(value) - psutil.virtual_memory().available / 2**30) < 2.0
    assert line.endswith(f"is available; lower batch.size or write the outputs to disk (--output, options.output) in {path}")


def test_memory_estimate_from_the_models_declared_outputs():
    graph = parse_graph({"model": {"name": "j2", "tangent": False}, "batch": {"size": 1000}})
    assert graph.output_bytes_per_item() == (6 + 6 + 1) * 8  # no tangent
    assert graph.check_memory(available=104 * 1000) == 104 * 1000  # fits exactly
    with pytest.raises(GraphError, match=r"^batch\.size: 1,000 items need about 101\.6 KiB of memory for their "
                                         r"outputs \(104 B per item\) but 101\.6 KiB is available"):
        graph.check_memory(available=104 * 1000 - 1)
    # Outputs that go to disk (options.output, --output) are not held in memory: not refused.
    graph.options["output"] = "outputs.zarr"
    assert graph.check_memory(available=0) == 104 * 1000


def test_memory_estimate_of_a_model_without_declared_outputs_is_probed_and_doubled(monkeypatch):
    from dsched import models

    undeclared = models.MODELS["j2"]._replace(outputs=None)
    monkeypatch.setitem(models.MODELS, "j2", undeclared)
    graph = parse_graph({"model": {"name": "j2"}, "batch": {"size": 1000}})
    assert graph.output_bytes_per_item() == 392  # probed: two points through the real model
    with pytest.raises(GraphError, match=r"\(392 B per item, twice while joining\) but 765\.6 KiB is available"):
        graph.check_memory(available=2 * 392 * 1000 - 1)


# --- reaching a cluster ------------------------------------------------------------

SMALL = HEAD + "[scheduler]\ndevice = 'cpu'\nbatch_size = 500\n"


def test_unreachable_scheduler_address(tmp_path, capsys, no_cluster):
    port = free_port()  # nothing listens there
    path = graph_file(tmp_path, SMALL)
    started = time.monotonic()
    code = main(["run", str(path), "--no-progress", "--scheduler-address", f"tcp://127.0.0.1:{port}",
                 "--connect-timeout", "1"])
    assert code == 2 and time.monotonic() - started < 15
    assert one_error_line(capsys) == (
        f"dsched: error: --scheduler-address: no Dask scheduler answered at tcp://127.0.0.1:{port} within 1 s "
        f"(Timed out trying to connect to tcp://127.0.0.1:{port} after 1 s)"
    )


@pytest.mark.parametrize(
    "address, reason",
    [
        ("foo://bar:1", "unknown address scheme 'foo' (known schemes: ['inproc', 'tcp', 'tls', 'ucx', 'ws', 'wss'])"),
        ("tcp://host:port", "invalid literal for int() with base 10: 'port'"),
    ],
)
def test_malformed_scheduler_address(tmp_path, capsys, no_cluster, address, reason):
    path = graph_file(tmp_path, SMALL)
    assert main(["run", str(path), "--no-progress", "--scheduler-address", address]) == 2
    assert one_error_line(capsys) == (
        f"dsched: error: --scheduler-address: {address!r} is not a Dask scheduler address ({reason}); "
        "expected e.g. tcp://10.0.0.1:8786"
    )


def test_missing_scheduler_file_waits_a_bounded_time_saying_for_what(tmp_path, capsys, no_cluster):
    path, missing = graph_file(tmp_path, SMALL), tmp_path / "missing.json"
    started = time.monotonic()
    assert main(["run", str(path), "--no-progress", "--scheduler-file", str(missing), "--connect-timeout", "0.5"]) == 2
    assert 0.5 <= time.monotonic() - started < 10
    assert capsys.readouterr().err.splitlines() == [
        f"dsched: waiting up to 0.5 s for the scheduler file {missing} (written by the cluster once its workers have "
        "joined, e.g. by python -m dsched.mpi)",
        f"dsched: error: --scheduler-file: {missing} did not appear within 0.5 s; start the cluster first, or wait "
        "longer with --connect-timeout",
    ]


def test_a_file_that_is_not_a_scheduler_file(tmp_path, capsys, no_cluster):
    path, bad = graph_file(tmp_path, SMALL), tmp_path / "sf.json"
    bad.write_text('{"type": "Scheduler"}')
    assert main(["run", str(path), "--no-progress", "--scheduler-file", str(bad)]) == 2
    assert one_error_line(capsys) == f"dsched: error: --scheduler-file: {bad} is not a Dask scheduler file ('address')"


def test_a_cluster_without_dsched_workers(tmp_path, capsys):
    from distributed import LocalCluster

    path = graph_file(tmp_path, SMALL)
    with LocalCluster(n_workers=1, processes=False, protocol="tcp://", host="127.0.0.1", dashboard_address=None) as plain:
        assert main(["run", str(path), "--no-progress", "--scheduler-address", plain.scheduler_address]) == 2
        assert one_error_line(capsys) == (
            f"dsched: error: --scheduler-address: the cluster at {plain.scheduler_address} has no dsched device workers "
            "(workers own a device through a dsched-<device> resource: start them with python -m dsched.mpi, "
            "LocalHybridCluster, or dask worker --preload plugins/dsched_worker.py)"
        )


def test_a_cluster_without_the_graphs_device(tmp_path, capsys):
    path = graph_file(tmp_path, HEAD + "[scheduler]\ndevices = ['cpu', 'cuda:1']\n")
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], emulate=True, protocol="tcp://", dashboard_address=None) as cluster:
        assert main(["run", str(path), "--no-progress", "--scheduler-address", cluster.scheduler_address]) == 2
        assert one_error_line(capsys) == (
            f"dsched: error: scheduler.devices: cuda:1 has no worker on the cluster at {cluster.scheduler_address} "
            f"(its devices: cpu, cuda:0) in {path}"
        )


# --- runs that must work -------------------------------------------------------------

def test_sync_graph_on_an_emulated_cuda_device_runs(tmp_path, capsys):
    path = graph_file(tmp_path, HEAD + "[scheduler]\ndevice = 'cuda:0'\nbatch_size = 700\n"
                      "[options]\nmode = 'sync'\nemulate = true\n")
    assert main(["run", str(path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith("cuda:0"))
    assert row[:4] == ["cuda:0", "yes", "3", "2000"]
    assert "not a GPU measurement" in out


def test_sync_emulation_computes_the_model_with_numpy():
    from dsched.devices import emulating
    from dsched.job import run_graph

    graph = parse_graph({"model": {"name": "j2"}, "batch": {"size": 1500},
                         "scheduler": {"device": "cuda:0", "batch_size": 400},
                         "options": {"mode": "sync", "emulate": True}})
    with emulating(["cuda:0"]):
        result = run_graph(graph, progress=False)
    strain = loading_strain(np.arange(1500))
    expected = j2_update(strain, np.zeros_like(strain), np.zeros(1500), J2Parameters())
    for key in ("stress", "plastic_strain", "alpha", "tangent"):
        np.testing.assert_array_equal(result.outputs[key], expected[key])


# --- Ctrl-C ---------------------------------------------------------------------------

CTRL_C_GRAPHS = {
    # Long enough to be interrupted (20M points, tens of seconds here): Ctrl-C as soon as chunks complete.
    "sync": "[scheduler]\ndevice = 'cpu'\nbatch_size = 20000\n[options]\nmode = 'sync'\n",
    "in-process": "[scheduler]\ndevice = 'cpu'\nbatch_size = 20000\n",
    "processes": "[scheduler]\ndevices = ['cpu', 'cuda:0']\nbatch_sizes = 20000\n"
                 "[options]\nemulate = true\nprocesses = true\n",
}


@pytest.mark.parametrize("kind", list(CTRL_C_GRAPHS))
def test_ctrl_c_cancels_the_run_with_one_line_and_status_130(tmp_path, kind):
    path = graph_file(tmp_path, "[model]\nname = 'j2'\ntangent = false\n[batch]\nsize = 20_000_000\n"
                      + CTRL_C_GRAPHS[kind])
    # A session of its own, so SIGINT goes to the whole process group, worker processes included, as a
    # terminal's Ctrl-C does.
    process = subprocess.Popen([sys.executable, "-m", "dsched", "run", str(path)], stderr=subprocess.PIPE,
                               stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True)
    err = b""
    try:
        while not re.search(rb"\d(\.\d+)?[kM]?pt/s", err):  # the progress bar shows a rate once chunks complete
            piece = os.read(process.stderr.fileno(), 4096)
            assert piece, f"dsched ended before it could be interrupted: {err!r}"
            err += piece
        os.killpg(process.pid, signal.SIGINT)
        started = time.monotonic()
        out, rest = process.communicate(timeout=30)
        elapsed = time.monotonic() - started
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130  # 128 + SIGINT, as shells report it; 2 is a configuration mistake
    assert elapsed < 2.0
    text = (err + rest).decode()
    # The one line comes last (after whatever the progress bar left), once, with no traceback from any process.
    assert text.endswith("dsched: interrupted (Ctrl-C): the run was cancelled\n")
    assert text.count("dsched: interrupted") == 1
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "CancelledError" not in text
    assert out == b""


# --- the dashboard link, quiet logs ---------------------------------------------------

def test_in_process_cluster_dashboard_link_answers():
    with dsched.LocalHybridCluster(["cpu"], dashboard_address="127.0.0.1:0") as cluster:
        link = cluster.dashboard_link
        assert link.startswith("http://127.0.0.1:") and link.endswith("/status")
        with urllib.request.urlopen(link, timeout=10) as response:
            assert response.status == 200


PROCESSES = HEAD + "[scheduler]\ndevices = ['cpu', 'cuda:0']\nbatch_sizes = [300, 600]\n" \
                   "[options]\nemulate = true\nprocesses = true\n"


def test_worker_processes_are_quiet_by_default_and_talk_with_v(tmp_path):
    path = graph_file(tmp_path, PROCESSES)
    quiet = subprocess.run([sys.executable, "-m", "dsched", "run", str(path), "--no-progress"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert "total: 2,000 items" in quiet.stdout
    verbose = subprocess.run([sys.executable, "-m", "dsched", "run", str(path), "--no-progress", "-v"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert verbose.returncode == 0, verbose.stderr
    # Both worker processes log their start at INFO with -v.
    assert verbose.stderr.count("distributed.worker - INFO -       Start worker at:") == 2


def boom(x):
    raise RuntimeError("boom")


@pytest.mark.parametrize("processes", [False, True], ids=["in-process", "processes"])
def test_a_failed_task_logs_no_compute_failed_unless_verbose(capfd, caplog, processes):
    from distributed import Client

    for level, expected in (("warning", 0), ("info", 1)):
        caplog.clear()
        with dsched.LocalHybridCluster(["cpu"], processes=processes, dashboard_address=None, silence_logs=level) as cluster:
            with Client(cluster) as client:
                with pytest.raises(RuntimeError, match="boom"):
                    client.submit(boom, 1).result()
        # A worker process writes to the inherited stderr; an in-process worker's records reach pytest's handler.
        logged = capfd.readouterr().err if processes else caplog.text
        assert logged.count("Compute Failed") == expected, level
    dsched.logs.apply_log_level("warning")


def unread_exception(error):
    """An asyncio future holding ``error``, collected unread: asyncio logs "Future exception was never retrieved"."""
    import asyncio
    import gc

    loop = asyncio.new_event_loop()
    future = loop.create_future()
    future.set_exception(error)
    loop.close()  # as a cluster's event loop stops before a send reads its deadline's timeout
    del future
    gc.collect()


def test_an_unread_send_timeout_is_not_logged_unless_verbose(caplog):
    # The Ctrl-C test's one-line ending once failed on this report, from Dask's teardown, after dsched's last line.
    for level, expected in (("warning", 0), ("info", 1)):
        dsched.logs.apply_log_level(level)
        caplog.clear()
        unread_exception(TimeoutError("Timeout"))  # tornado's with_timeout, which Dask's batched sends wait in
        assert caplog.text.count("Future exception was never retrieved") == expected, level
    dsched.logs.apply_log_level("warning")
    caplog.clear()
    unread_exception(TimeoutError("a timeout of the user's own"))  # any other report stays
    unread_exception(ValueError("Timeout"))
    assert caplog.text.count("Future exception was never retrieved") == 2


# --- dsched tune: the same checks --------------------------------------------------------

@pytest.mark.skipif(bool(visible_gpus()), reason="this machine has a GPU")
@pytest.mark.parametrize("argv, line", [
    (["tune", str(ROOT / "graphs" / "j2_workstation.toml")],
     "dsched: error: scheduler.devices: cuda:0 is not present on this machine (visible GPUs: none); pass --emulate "
     f"(options.emulate = true) to emulate it, for testing only, in {ROOT / 'graphs' / 'j2_workstation.toml'}"),
    (["tune", "--devices", "cpu,cuda:99"],
     "dsched: error: --devices: cuda:99 is not present on this machine (visible GPUs: none); pass --emulate to "
     "emulate it, for testing only"),
    (["tune", "--devices", "cpu,gpu"],
     "dsched: error: --devices: 'gpu' is not a device; expected 'cpu', 'cuda' or 'cuda:N' with N >= 0"),
], ids=["workstation-graph", "cuda-99", "gpu"])
def test_tune_names_the_device_and_the_flag(capsys, no_cluster, argv, line):
    assert main([*argv, "--no-save"]) == 2
    assert one_error_line(capsys) == line


def test_connect_timeout_must_be_positive(tmp_path, capsys, no_cluster):
    path = graph_file(tmp_path, SMALL)
    assert main(["run", str(path), "--scheduler-address", "tcp://127.0.0.1:8786", "--connect-timeout", "0"]) == 2
    assert one_error_line(capsys) == "dsched: error: --connect-timeout: must be > 0 seconds, got 0"


def test_a_sync_graph_with_a_cluster_address_is_refused(tmp_path, capsys, no_cluster):
    path = graph_file(tmp_path, SMALL + "[options]\nmode = 'sync'\n")
    assert main(["run", str(path), "--scheduler-address", "tcp://127.0.0.1:8786"]) == 2
    assert one_error_line(capsys) == (
        f"dsched: error: --scheduler-address: options.mode is 'sync' in {path}: every chunk runs on this thread, not "
        "on a cluster; drop the option or set mode = 'async'"
    )


def test_a_failed_run_is_one_line_with_status_1(tmp_path, capsys):
    # Chunks of 100,000 J2 points take far longer than a microsecond: every one times out (recoverable).
    path = graph_file(tmp_path, "[model]\nname = 'j2'\n[batch]\nsize = 100000\n[scheduler]\ndevice = 'cpu'\n"
                      "batch_size = 100000\n[options]\nmode = 'sync'\n")
    assert main(["run", str(path), "--no-progress", "--chunk-timeout", "0.000001"]) == 1
    assert one_error_line(capsys) == ("dsched: run failed: ChunkTimeoutError: chunk 0 on cpu ran over its timeout "
                                      "of 1e-06 s (its thread is left to finish)")
