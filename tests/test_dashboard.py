"""The dsched dashboard page and JSON route, over real HTTP, in a real headless Chromium, on three kinds of cluster.

Run as a script under ``mpiexec -n 3``, this file is the dask-mpi program of
``test_dask_mpi_cluster_serves_the_page_and_the_json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mpi_program():
    """The dask-mpi job: scheduler on rank 0, this client on rank 1, one emulated cuda:0 worker on rank 2."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    import dsched.dashboard  # noqa: F401  (lists the page before the scheduler starts)
    import dsched.mpi
    from dsched import SimpleScheduler, dispatch

    if not dsched.mpi.initialize(devices=["cuda:0"], capacities={"cuda:0": 32}, emulate=True,
                                 dashboard_address="127.0.0.1:0", verbose=True):
        return
    from distributed import Client

    with Client() as client:
        out = dispatch(np.square, np.arange(100.0), scheduler=SimpleScheduler("cuda:0", 10, 20), client=client)
        assert out.tolist() == (np.arange(100.0) ** 2).tolist()
        dsched.dashboard.flush_page(client)
        port = client.scheduler_info()["services"]["dashboard"]
        status = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/dsched/status.json", timeout=10))
        plots = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/individual-plots.json", timeout=10))
        print("RESULT " + json.dumps({"status": status, "plots": plots, "port": port}), flush=True)


if __name__ == "__main__":
    _mpi_program()
    sys.exit(0)


import numpy as np  # noqa: E402
import pytest  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402

from dsched import LocalHybridCluster, StaticHybridScheduler, dispatch  # noqa: E402
from dsched.dashboard import COLUMNS, JSON_ROUTE, PAGE_ROUTE, PLOT_ROUTES, flush_page, register  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
CAPACITY = {"cpu": 8, "cuda:0": 16}


@pytest.fixture(scope="module")
def dashboard_cluster():
    """An in-process cpu + emulated cuda:0 cluster with its dashboard on a free loopback port."""
    with LocalHybridCluster(["cpu", "cuda:0"], emulate=True, capacities=CAPACITY,
                            dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            port = client.scheduler_info()["services"]["dashboard"]
            yield client, f"http://127.0.0.1:{port}"


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/json")
        return json.load(response)


def by_device(status):
    return {row["device"]: row for row in status["devices"]}


GATE = threading.Event()


def _gated(x):
    """A chunk that holds its device until the test has seen the load (in-process workers share GATE)."""
    if not GATE.wait(timeout=60):
        raise TimeoutError("the test never opened the gate")
    return x + 1


def test_json_route_over_http_while_a_dispatch_runs(dashboard_cluster):
    client, base = dashboard_cluster
    flush_page(client)  # earlier tests' chunks counted before this one's
    before = by_device(get_json(base + JSON_ROUTE))
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 8], capacities=[8, 16], priorities=[1, 2])
    GATE.clear()
    box = {}

    def run():
        try:
            box["out"] = dispatch(_gated, np.arange(300.0), scheduler=scheduler, client=client)
        except BaseException as err:  # surfaced by the assertion below
            box["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    snapshots = []
    try:
        # Every chunk waits at the gate: the devices fill to their capacity and stay there.
        deadline = time.monotonic() + 30
        while True:
            rows = by_device(get_json(base + JSON_ROUTE))
            snapshots.append(rows)
            if all(rows[d]["load"] == CAPACITY[d] for d in CAPACITY):
                break
            assert time.monotonic() < deadline, f"devices never filled: {rows}"
            time.sleep(0.02)
        assert rows["cpu"]["chunks_in_flight"] == 2 and rows["cuda:0"]["chunks_in_flight"] == 2
        GATE.set()
        while thread.is_alive():
            snapshots.append(by_device(get_json(base + JSON_ROUTE)))
        thread.join()
    finally:
        GATE.set()
        thread.join(timeout=60)
    assert "error" not in box, box.get("error")
    np.testing.assert_array_equal(box["out"], np.arange(300.0) + 1)
    for rows in snapshots:
        for device, row in rows.items():
            assert 0 <= row["load"] <= row["capacity"] == CAPACITY[device], (device, row)

    flush_page(client)  # the lanes' chunk events reach the page off the call's path
    after = by_device(get_json(base + JSON_ROUTE))
    done = {}
    for device in CAPACITY:
        row, old = after[device], before[device]
        done[device] = (row["chunks_done"] - old["chunks_done"], row["items_done"] - old["items_done"])
        assert row["load"] == 0 and row["chunks_in_flight"] == 0
        assert row["worker_name"] == device
        assert row["items_per_s"] > 0 and 0 < row["busy_fraction"] <= 1
    assert done["cpu"][1] + done["cuda:0"][1] == 300
    assert after["cpu"]["emulated"] is False and after["cuda:0"]["emulated"] is True


def test_page_is_listed_in_the_more_menu(dashboard_cluster):
    _, base = dashboard_cluster
    plots = get_json(base + "/individual-plots.json")
    assert plots["Individual Dsched"] == PAGE_ROUTE
    for part, route in PLOT_ROUTES.items():  # each plot alone, for the "More" menu and JupyterLab
        assert plots[f"Individual Dsched {part.title()}"] == route
        with urllib.request.urlopen(base + route, timeout=10) as response:
            assert response.status == 200 and b"Bokeh.embed.embed_items" in response.read()
    with urllib.request.urlopen(base + PAGE_ROUTE, timeout=10) as response:
        assert response.status == 200
        assert b"Bokeh.embed.embed_items" in response.read()  # a Bokeh page inside the dashboard's frame


# --- headless Chromium, driven over the DevTools protocol ----------------------------

# Bokeh draws inside shadow roots, which --dump-dom leaves out: walk them in the page.
_TABLE_JS = r"""(() => {
  const rows = [], headers = [], hosts = [], runs = [], tips = [];
  const walk = (root) => {
    root.querySelectorAll('.slick-header-column').forEach(h => headers.push(h.textContent.trim()));
    root.querySelectorAll('.slick-row').forEach(r =>
      rows.push(Array.from(r.querySelectorAll('.slick-cell')).map(c => c.textContent.trim())));
    root.querySelectorAll('tr.device').forEach(r =>
      rows.push(Array.from(r.querySelectorAll('td')).map(c => c.textContent.trim())));
    root.querySelectorAll('tr.host').forEach(r =>
      hosts.push(Array.from(r.querySelectorAll('td')).map(c => c.textContent.trim())));
    root.querySelectorAll('tr.run').forEach(r =>
      runs.push(Array.from(r.querySelectorAll('td')).map(c => c.textContent.trim())));
    root.querySelectorAll('td[title]').forEach(c => tips.push([c.textContent.trim(), c.title]));
    root.querySelectorAll('th').forEach(h => headers.push(h.textContent.trim()));
    root.querySelectorAll('*').forEach(el => { if (el.shadowRoot) walk(el.shadowRoot); });
  };
  walk(document);
  return JSON.stringify({title: document.title, headers, rows, hosts, runs, tips});
})()"""


def render_table(url, until, timeout=45):
    """Open ``url`` in headless Chromium; the page's table once ``until(table)`` holds (or at the timeout)."""

    profile = tempfile.mkdtemp(prefix="dsched-chromium-")
    browser = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout

    async def drive():
        socket = await _devtools_page(profile, url, browser, deadline)
        ask = 0
        while True:
            ask += 1
            socket.write_message(json.dumps({"id": ask, "method": "Runtime.evaluate",
                                             "params": {"expression": _TABLE_JS, "returnByValue": True}}))
            while True:
                reply = json.loads(await socket.read_message())
                if reply.get("id") == ask:
                    break
            table = json.loads(reply["result"]["result"]["value"])
            if until(table) or time.monotonic() > deadline:
                socket.close()
                return table
            await asyncio.sleep(0.1)

    try:
        return asyncio.run(drive())
    finally:
        browser.kill()
        browser.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium; .ci/run does)")
@pytest.mark.parametrize("route", [PAGE_ROUTE, "/dsched/status"])
def test_page_renders_one_row_per_device_in_headless_chromium(dashboard_cluster, route):
    client, base = dashboard_cluster
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 8], capacities=[8, 16])
    dispatch(np.negative, np.arange(64.0), scheduler=scheduler, client=client)
    flush_page(client)
    expected = by_device(get_json(base + JSON_ROUTE))
    fields = [f for f, _ in COLUMNS]

    def device_rows(table):  # the page also has the hosts table (its rows start with a host)
        return [r for r in table["rows"] if len(r) == len(fields) and r[0] in ("cpu", "cuda:0")]

    done = fields.index("chunks_done")
    table = render_table(base + route, until=lambda t: len(device_rows(t)) == 2
                         and all(r[done] != "0" for r in device_rows(t)))
    assert table["headers"][:len(COLUMNS)] == [title for _, title in COLUMNS]
    rows = {row[0]: dict(zip(fields, row)) for row in device_rows(table)}
    assert len(device_rows(table)) == 2 and set(rows) == {"cpu", "cuda:0"}
    for device in ("cpu", "cuda:0"):
        assert rows[device]["capacity"] == str(CAPACITY[device])
        assert rows[device]["worker"] == expected[device]["worker"]  # whole, never cut
        assert rows[device]["host"] == expected[device]["host"]
        assert rows[device]["load"] == "0"
        assert rows[device]["chunks_done"] == f"{expected[device]['chunks_done']:,}"
    assert rows["cpu"]["emulated"] == "no" and rows["cuda:0"]["emulated"] == "yes"


def _sleep_in_proportion(work, device):
    """A chunk of ``n`` items sleeping ``n / 4000`` s, as the performance model below predicts."""
    time.sleep((work.stop - work.start) / 4000)
    return work.stop - work.start


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium; .ci/run does)")
def test_page_plots_predicted_against_measured_chunk_times_in_headless_chromium(dashboard_cluster):
    """A PerformanceModelScheduler run: the plot has one point per chunk, as the run report has it, per device."""
    from dsched import PerformanceModelScheduler, SliceGenerator, WorkDispatcher

    client, base = dashboard_cluster
    costs = {device: {"t0": 0.001, "n_star": 4} for device in CAPACITY}  # 4,000 items/s: chunks of 8 in 2 ms
    scheduler = PerformanceModelScheduler(list(CAPACITY), costs=costs, chunk_seconds=0.002, client=False)
    dispatcher = WorkDispatcher(scheduler, _sleep_in_proportion, reduce=sum, client=client)
    assert dispatcher.run(SliceGenerator(0, 400)) == 400
    report = dispatcher.last_run
    records = [r for r in report.records if r.predicted is not None]
    assert len(records) == len(report.records) > 10  # each device had a model from its first chunk
    labels = {r["device"]: r["label"] for r in get_json(base + JSON_ROUTE)["devices"]}
    expected = sorted((labels[str(r.device)], r.predicted, r.duration) for r in records)

    def plotted(data):  # the page refreshes every 0.5 s: the run's every chunk, once
        return len(_column(data, "predictions", "predicted")) == len(expected)

    seen = browse(base + PAGE_ROUTE, [(plotted, None)], timeout=60)
    last = [d for d in seen if "dom" not in d][-1]
    drawn = sorted(zip(*(last["predictions"][k] for k in ("label", "predicted", "measured"))))
    assert [d[0] for d in drawn] == [e[0] for e in expected] and {d[0] for d in drawn} == set(labels.values())
    assert [v for d in drawn for v in d[1:]] == pytest.approx([v for e in expected for v in e[1:]], rel=1e-9)
    errors = [abs(p - m) / m for _, p, m in drawn]
    assert last["predictions"]["error"] == pytest.approx([abs(p - m) / m for p, m in zip(
        last["predictions"]["predicted"], last["predictions"]["measured"])], rel=1e-9)
    assert min(errors) >= 0 and len(last["diagonal"]["x"]) == 2  # the dashed line where predicted = measured
    lo, hi = last["diagonal"]["x"]
    assert lo == min(v for _, p, m in drawn for v in (p, m)) and hi == max(v for _, p, m in drawn for v in (p, m))
    assert f"median relative error {100 * report.prediction_error:.1f} % over {len(records):,} chunks" in \
        last["predictions_title"]


# --- other clusters: registered on a running scheduler, command line, dask-mpi ----------

def test_register_on_a_running_scheduler_serves_the_json_route():
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address="127.0.0.1:0",
                      resources={"dsched-cpu": 4}) as cluster, Client(cluster) as client:
        port = client.scheduler_info()["services"]["dashboard"]
        register(client)
        out = dispatch(np.sqrt, np.arange(40.0), scheduler=StaticHybridScheduler(["cpu"], 4), client=client)
        np.testing.assert_allclose(out, np.sqrt(np.arange(40.0)))
        flush_page(client)
        rows = get_json(f"http://127.0.0.1:{port}{JSON_ROUTE}")["devices"]
        assert [(r["device"], r["capacity"], r["chunks_done"], r["items_done"], r["emulated"]) for r in rows] == [
            ("cpu", 4, 10, 40, False)
        ]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_scheduler_on_the_port_of_a_closed_one_with_the_page_is_known_to_have_none():
    """What a process learnt of a scheduler (its dashboard: runs skip their replays) is not the next one's that
    listens on the same address, as often happens in a test suite that starts dozens of clusters."""
    from dsched.devices.ownership import has_dashboard

    port = _free_port()
    with LocalCluster(n_workers=0, processes=False, scheduler_port=port, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        register(client)
        assert has_dashboard(client)
    with LocalCluster(n_workers=0, processes=False, scheduler_port=port, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        assert client.scheduler.address == f"tcp://127.0.0.1:{port}"
        assert not has_dashboard(client)


@pytest.mark.parametrize("preload", ["dsched.dashboard", str(ROOT / "plugins" / "dsched_scheduler.py")])
def test_command_line_cluster_with_the_preload_module(tmp_path, preload):
    """``dask scheduler --preload ...`` (the module, or the bundled preload file) and two ``dask worker`` processes."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    dask = str(Path(sys.executable).parent / "dask")
    port, http = _free_port(), _free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--dashboard-address", f"127.0.0.1:{http}", "--preload", preload],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        for resources, name in [("dsched-cpu=6", "cpu"), ("dsched-cuda:0=1000000000000000,dsched-emulated=1", "cuda:0")]:
            procs.append(subprocess.Popen(
                [dask, "worker", address, "--host", "127.0.0.1", "--nthreads", "2", "--no-nanny", "--name", name,
                 "--resources", resources, "--no-dashboard"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 60
        while True:  # the scheduler is up once its HTTP server answers (Client's own retries back off for long)
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/health", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and procs[0].poll() is None, "dask scheduler did not start"
                time.sleep(0.1)
        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=60)
            scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 5], capacities=[6, 10])
            out = dispatch(np.negative, np.arange(50.0), scheduler=scheduler, client=client)
            np.testing.assert_array_equal(out, -np.arange(50.0))
            flush_page(client)
            rows = by_device(get_json(f"http://127.0.0.1:{http}{JSON_ROUTE}"))
            plots = get_json(f"http://127.0.0.1:{http}/individual-plots.json")
    finally:
        # Workers first, then the scheduler: a worker stopping while the scheduler closes can hang.
        for proc in [*procs[1:], procs[0]]:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    assert plots.get("Individual Dsched") == PAGE_ROUTE
    assert (rows["cpu"]["capacity"], rows["cpu"]["emulated"]) == (6, False)
    assert (rows["cuda:0"]["capacity"], rows["cuda:0"]["emulated"]) == ("unlimited", True)
    assert rows["cpu"]["items_done"] + rows["cuda:0"]["items_done"] == 50


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not installed (pip install mpich)")
def test_dask_mpi_cluster_serves_the_page_and_the_json():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([MPIEXEC, "-n", "3", sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stdout + done.stderr
    result = json.loads(lines[0][len("RESULT "):])
    assert result["plots"].get("Individual Dsched") == PAGE_ROUTE
    assert f"dsched.mpi dashboard: http://127.0.0.1:{result['port']}{PAGE_ROUTE}\n" in done.stdout  # the link, printed
    [row] = result["status"]["devices"]
    assert (row["device"], row["capacity"], row["emulated"], row["chunks_done"], row["items_done"]) == (
        "cuda:0", 32, True, 10, 100)


# --- many nodes: rows per device and host, the plots, progress, a screenshot --------------

HOSTS = ("127.0.0.2", "127.0.0.3")  # loopback addresses stand in for two nodes
HOST_CAPACITY = {"cpu": 8, "cuda:0": 16}  # per worker, so per device and host
ARTIFACTS = Path(os.environ.get("DSCHED_TEST_ARTIFACTS", ROOT / "out" / "test-artifacts"))


@pytest.fixture(scope="module")
def two_hosts():
    """A cpu and an emulated cuda:0 worker on each of two hosts: in-process on the first, worker processes on the second.

    Emulated cuda:0 workers compute with NumPy: they test placement and the page, never a GPU.
    """
    from distributed import Nanny, Scheduler, SpecCluster, Worker

    from dsched.dashboard import DashboardPlugin, register_page

    register_page()  # before the scheduler builds its dashboard
    workers = {}
    for host, cls in zip(HOSTS, (Worker, Nanny)):
        for device, extra in (("cpu", {}), ("cuda:0", {"dsched-emulated": 1})):
            workers[f"{device}@{host}"] = {"cls": cls, "options": {
                "host": host, "nthreads": 2, "dashboard": False, "name": f"{device}@{host}",
                "resources": {f"dsched-{device}": HOST_CAPACITY[device], **extra}}}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0",
                                                "plugins": [DashboardPlugin()]}}
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(4, timeout=60)
        port = client.scheduler_info()["services"]["dashboard"]
        yield client, f"http://127.0.0.1:{port}"


def _two_host_scheduler():
    # Client-side capacities: both hosts' workers together.
    return StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 8], capacities=[16, 32], priorities=[1, 2])


def _wait_for_file(x, path):
    """A chunk that holds its device until ``path`` exists (works across worker processes)."""
    deadline = time.monotonic() + 240
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never created {path}")
        time.sleep(0.005)
    return -x


LABELS = {f"{device}@{host}" for host in HOSTS for device in HOST_CAPACITY}


def test_rows_per_device_and_host_agree_with_the_run_report(two_hosts):
    from dsched import WorkDispatcher
    from dsched.dashboard import track_run
    from dsched.report import DeviceOnHost
    from dsched.work import ArrayLoader
    from dsched.reduce import concat_reduce

    client, base = two_hosts
    flush_page(client)  # earlier tests' chunks counted before this one's
    before = {row["label"]: row for row in get_json(base + JSON_ROUTE)["devices"]}
    dispatcher = WorkDispatcher(_two_host_scheduler(), lambda x, device: -x, reduce=concat_reduce, client=client)
    with track_run(client, total=1000, name="four devices on two hosts"):
        out = dispatcher.run(ArrayLoader(np.arange(1000.0)))
    np.testing.assert_array_equal(out, -np.arange(1000.0))
    status = get_json(base + JSON_ROUTE)
    rows = {row["label"]: row for row in status["devices"]}
    assert set(rows) == LABELS
    assert [(r["host"], r["device"]) for r in status["devices"]] == sorted((h, d) for h in HOSTS for d in HOST_CAPACITY)
    report = dispatcher.last_run.by_device()
    assert {str(key) for key in report} <= LABELS and all(isinstance(k, DeviceOnHost) for k in report)
    for label, row in rows.items():
        done = row["items_done"] - (before[label]["items_done"] if label in before else 0)
        mine = next((r for k, r in report.items() if str(k) == label), {"items": 0})
        assert done == mine["items"], label
        assert row["capacity"] == HOST_CAPACITY[row["device"]] and row["load"] == 0
        assert row["worker_name"] == label and row["emulated"] == (row["device"] == "cuda:0")
    hosts = {h["host"]: h for h in status["hosts"]}
    by_host = dispatcher.last_run.by_host()
    assert set(hosts) == set(HOSTS) and sum(r["items"] for r in by_host.values()) == 1000
    for host in HOSTS:
        assert hosts[host]["devices"] == ["cpu", "cuda:0"] and hosts[host]["capacity"] == 24
        assert hosts[host]["emulated"] == ["cuda:0"]
    run = status["run"]
    assert (run["name"], run["total"], run["items_done"], run["fraction"], run["eta_s"], run["active"]) == (
        "four devices on two hosts", 1000, 1000, 1.0, 0.0, False)
    assert sum(run["items_by_device"].values()) == 1000 and set(run["items_by_device"]) <= LABELS
    assert status["runs"][0]["id"] == run["id"]


_SOURCES_JS = r"""(() => {
  const doc = window.Bokeh && Bokeh.documents && Bokeh.documents[0];
  if (!doc) return JSON.stringify(null);
  const plain = v => (v !== null && typeof v === "object" && typeof v.length === "number") ? Array.from(v, plain) : v;
  const out = {};
  for (const name of ["progress", "load", "throughput", "timeline", "predictions", "diagonal"]) {
    const model = doc.get_model_by_name("dsched-" + name);
    if (!model) continue;
    const data = {};
    const entries = model.data instanceof Map ? model.data.entries() : Object.entries(model.data);
    for (const [key, value] of entries) data[key] = plain(value);
    out[name] = data;
  }
  const heading = doc.get_model_by_name("dsched-heading");
  out.heading = heading ? heading.text : null;
  const predictions = doc.get_model_by_name("dsched-predictions-figure");
  out.predictions_title = predictions && predictions.title ? predictions.title.text : null;
  return JSON.stringify(out);
})()"""


def browse(url, steps, timeout=60, screenshot=None, window=(1400, 1900)):
    """Drive headless Chromium on ``url``: evaluate ``_SOURCES_JS`` until each of ``steps`` (in order) holds.

    ``steps`` are ``(predicate(data) -> bool, action() or None)``: once a predicate
    holds its action runs and the next step starts. Returns every data seen.
    The last entry is ``{"dom": tables as drawn}`` (see ``_TABLE_JS``), read
    once more after the last step. Saves a PNG of the page to ``screenshot``.
    """

    profile = tempfile.mkdtemp(prefix="dsched-chromium-")
    browser = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", f"--window-size={window[0]},{window[1]}",
         f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    seen = []

    async def drive():
        socket = await _devtools_page(profile, url, browser, deadline)
        asks = iter(range(1, 10**6))

        async def call(method, **params):
            ask = next(asks)
            socket.write_message(json.dumps({"id": ask, "method": method, "params": params}))
            while True:
                reply = json.loads(await socket.read_message())
                if reply.get("id") == ask:
                    return reply["result"]

        for predicate, action in steps:
            while True:
                result = await call("Runtime.evaluate", expression=_SOURCES_JS, returnByValue=True)
                data = json.loads(result["result"]["value"])
                if data is not None:
                    seen.append(data)
                    if predicate(data):
                        break
                assert time.monotonic() < deadline, f"the page never reached step {predicate.__name__}: {data}"
                await asyncio.sleep(0.1)
            if action is not None:
                action()
        await asyncio.sleep(0.6)  # one more refresh, so the tables and the picture show what was checked
        result = await call("Runtime.evaluate", expression=_TABLE_JS, returnByValue=True)
        seen.append({"dom": json.loads(result["result"]["value"])})
        if screenshot is not None:
            shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            screenshot.write_bytes(__import__("base64").b64decode(shot["data"]))
        socket.close()

    try:
        asyncio.run(drive())
        return seen
    finally:
        browser.kill()
        browser.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


def _column(data, source, field):
    return data.get(source, {}).get(field, [])


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium; .ci/run does)")
def test_page_plots_a_running_dispatch_on_two_hosts_in_headless_chromium(two_hosts, tmp_path):
    import functools

    from dsched.dashboard import track_run

    client, base = two_hosts
    gate = tmp_path / "open"
    total = 800
    box = {}

    def run():
        try:
            with track_run(client, total=total, name="gated run"):
                box["out"] = dispatch(functools.partial(_wait_for_file, path=str(gate)), np.arange(float(total)),
                                      scheduler=_two_host_scheduler(), client=client)
        except BaseException as err:  # surfaced below
            box["error"] = err

    thread = threading.Thread(target=run)
    thread.start()

    def devices_full(data):  # every chunk waits at the gate: each device on each host fills to its capacity
        load = dict(zip(_column(data, "load", "label"), _column(data, "load", "load")))
        return set(load) == LABELS and all(load[lb] == HOST_CAPACITY[lb.split("@")[0]] for lb in LABELS) and \
            _column(data, "progress", "total") == [total]

    def run_complete(data):
        return _column(data, "progress", "fraction") == [1.0] and \
            set(_column(data, "timeline", "label")) == LABELS and set(_column(data, "throughput", "label")) == LABELS

    shot = ARTIFACTS / "dsched-dashboard-two-hosts.png"
    try:
        seen = browse(base + PAGE_ROUTE, [(devices_full, gate.touch), (run_complete, None)], screenshot=shot,
                      timeout=180)  # a deadline, not a wait: generous for a loaded machine
    finally:
        gate.touch()
        thread.join(timeout=60)
    assert "error" not in box, box.get("error")
    np.testing.assert_array_equal(box["out"], -np.arange(float(total)))
    drawn = seen.pop()["dom"]
    full = next(d for d in seen if devices_full(d))
    assert _column(full, "progress", "fraction") == [0.0] and _column(full, "progress", "percent") == [0.0]
    last = seen[-1]
    # Progress: every snapshot between 0 and 100 %, never going back, ending at all items with no time left.
    fractions = [d["progress"]["fraction"][0] for d in seen if _column(d, "progress", "total") == [total]]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert (last["progress"]["items_done"], last["progress"]["eta_s"], last["progress"]["percent"]) == ([total], [0.0], [100.0])
    # Each plot has data for every device and host; the timeline has every chunk of the run.
    chunks = dict.fromkeys(LABELS, 0)
    for label, start, stop in zip(last["timeline"]["label"], last["timeline"]["start"], last["timeline"]["stop"]):
        chunks[label] += 1
        assert 0 <= start <= stop
    assert all(chunks.values()) and sum(last["timeline"]["items"]) == total
    for label, ys in zip(last["throughput"]["label"], last["throughput"]["ys"]):
        assert max(ys) > 0, label
    emulated = {lb for lb, hatch in zip(last["load"]["label"], last["load"]["hatch"]) if hatch.strip()}
    assert emulated == {lb for lb in LABELS if lb.startswith("cuda")}
    assert all(f.endswith("(emulated)") == f.startswith("cuda") for f in last["load"]["factor"])
    # Tables as drawn: one device row per device and host, the hosts, this run first in the history.
    assert [r[0] for r in drawn["hosts"]] == list(HOSTS)
    assert [r[1:3] for r in drawn["runs"]][0] == ["gated run", "finished"]
    assert drawn["runs"][0][3:6] == [f"{total:,}", f"{total:,}", "100.0 %"]
    assert "dsched: 4 devices on 2 hosts" in last["heading"]
    # The tables as drawn (not only their data): final counts, thousands separators, whole worker addresses.
    fields = [f for f, _ in COLUMNS]
    drawn_rows = [dict(zip(fields, r)) for r in drawn["rows"] if len(r) == len(fields) and r[0] in HOST_CAPACITY]
    assert [(r["device"], r["host"], r["load"], r["chunks_in_flight"]) for r in drawn_rows] == [
        (lb.split("@")[0], lb.split("@")[1], "0", "0") for lb in sorted(LABELS, key=lambda lb: lb.split("@")[::-1])]
    workers = {r["label"]: r for r in get_json(base + JSON_ROUTE)["devices"]}
    assert [r["worker"] for r in drawn_rows] == [workers[f"{r['device']}@{r['host']}"]["worker"] for r in drawn_rows]
    assert {r["worker"] for r in drawn_rows} <= {text for text, tip in drawn["tips"] if text == tip}  # with a tooltip
    expected_items = [workers[f"{r['device']}@{r['host']}"]["items_done"] for r in drawn_rows]
    assert [r["items_done"] for r in drawn_rows] == [f"{n:,}" for n in expected_items]
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- dsched run --dashboard ------------------------------------------------------------

GRAPH = """[model]
name = "j2"
tangent = false
[batch]
size = 60000
[scheduler]
devices = ["cpu", "cuda:0"]
batch_sizes = [5000, 10000]
[options]
emulate = true
"""


def test_dsched_run_dashboard_serves_the_page_during_the_run(tmp_path, monkeypatch, capsys):
    """In-process ``dsched run --dashboard``: the page answers while the run is told, and shows it complete."""
    import contextlib

    import dsched.dashboard
    from dsched.cli import main

    graph = tmp_path / "j2.toml"
    graph.write_text(GRAPH)
    port = _free_port()
    real_track_run = dsched.dashboard.track_run
    seen = {}

    @contextlib.contextmanager
    def spy(client, total, name=None):  # the cluster is up on both sides of the run
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + PAGE_ROUTE, timeout=10) as response:
            seen["page"] = response.status
        with real_track_run(client, total, name):
            yield
        seen["after"] = get_json(base + JSON_ROUTE)

    monkeypatch.setattr(dsched.dashboard, "track_run", spy)
    assert main(["run", str(graph), "--dashboard", f"127.0.0.1:{port}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"dashboard: http://127.0.0.1:{port}{PAGE_ROUTE} " in out
    assert seen["page"] == 200
    run = seen["after"]["run"]
    assert (run["total"], run["items_done"], run["fraction"], run["active"]) == (60000, 60000, 1.0, False)
    assert run["name"] == f"j2 ({graph})"
    assert sorted(r["device"] for r in seen["after"]["devices"]) == ["cpu", "cuda:0"]
    assert sum(r["items_done"] for r in seen["after"]["devices"]) == 60000


@pytest.mark.parametrize("extra, options, message", [
    (["--dashboard", "8787"], "", "--dashboard: expected HOST:PORT such as 127.0.0.1:8787, got '8787'"),
    (["--dashboard", "127.0.0.1:99999"], "", "--dashboard: expected HOST:PORT such as 127.0.0.1:8787, got '127.0.0.1:99999'"),
    (["--dashboard"], 'mode = "sync"\n', "--dashboard: a sync run (options.mode = 'sync') starts no cluster"),
    ([], 'mode = "sync"\ndashboard = true\n', "--dashboard: a sync run (options.mode = 'sync') starts no cluster"),
    ([], 'dashboard = "yes"\n', "options.dashboard: 'yes' has the wrong type"),
])
def test_dsched_run_dashboard_refuses_bad_input_before_any_cluster(tmp_path, capsys, extra, options, message):
    from dsched.cli import main

    graph = tmp_path / "j2.toml"
    graph.write_text(GRAPH + options)
    assert main(["run", str(graph), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# --- the run table: rows per device and host -----------------------------------------------

def _records():
    from dsched.devices import Device
    from dsched.report import ChunkRecord

    cpu, gpu = Device("cpu"), Device("cuda:0")
    return [  # (index, device, size, worker, start, stop): cuda:0 on two nodes, the cpu on one
        ChunkRecord(0, gpu, 400, "tcp://10.0.0.3:4001", 0.0, 1.0),
        ChunkRecord(1, cpu, 100, "tcp://10.0.0.3:4000", 0.0, 2.0),
        ChunkRecord(2, gpu, 400, "tcp://10.0.0.4:4001", 0.5, 1.5),
        ChunkRecord(3, gpu, 400, "tcp://10.0.0.3:4001", 0.5, 2.0),  # overlaps chunk 0: busy 2 s, not 2.5
        ChunkRecord(4, gpu, 200, "tcp://10.0.0.4:4002", 1.5, 2.5),  # a second worker owning cuda:0 on node 4
    ]


def test_run_report_rows_per_device_and_host():
    from dsched.devices import Device
    from dsched.report import DeviceOnHost, RunReport

    report = RunReport("async", _records(), [None] * 5, wall_start=0.0, wall_stop=2.5)
    rows = report.by_device()
    assert [str(key) for key in rows] == ["cuda:0@10.0.0.3", "cpu@10.0.0.3", "cuda:0@10.0.0.4"]
    assert list(rows) == [DeviceOnHost(Device("cuda:0"), "10.0.0.3"), DeviceOnHost(Device("cpu"), "10.0.0.3"),
                          DeviceOnHost(Device("cuda:0"), "10.0.0.4")]
    assert [(r["chunks"], r["items"], r["busy"], r["items_per_s"]) for r in rows.values()] == [
        (2, 800, 2.0, 400.0), (1, 100, 2.0, 50.0), (2, 600, 2.0, 300.0)]
    node4 = rows[DeviceOnHost(Device("cuda:0"), "10.0.0.4")]
    assert (node4["worker"], node4["workers"]) == ("tcp://10.0.0.4:4001", ["tcp://10.0.0.4:4001", "tcp://10.0.0.4:4002"])
    hosts = report.by_host()
    assert list(hosts) == ["10.0.0.3", "10.0.0.4"]
    assert [(h["devices"], h["chunks"], h["items"], h["busy"], h["items_per_s"]) for h in hosts.values()] == [
        ([Device("cuda:0"), Device("cpu")], 3, 900, 2.0, 450.0), ([Device("cuda:0")], 2, 600, 2.0, 300.0)]


def test_run_table_has_a_row_per_device_and_host_and_a_host_summary():
    from dsched.devices import Device
    from dsched.job import JobResult, format_report
    from dsched.report import RunReport

    report = RunReport("async", _records(), [None] * 5, wall_start=0.0, wall_stop=2.5)
    text = format_report(JobResult({}, report, {Device("cpu"): False, Device("cuda:0"): True}))
    lines = text.splitlines()
    table = [line.split() for line in lines if "@" in line]
    assert table == [
        ["cpu@10.0.0.3", "no", "1", "100", "2.000", "50"],
        ["cuda:0@10.0.0.3", "yes", "2", "800", "2.000", "400"],
        ["cuda:0@10.0.0.4", "yes", "2", "600", "2.000", "300"],
    ]
    start = next(i for i, line in enumerate(lines) if line.startswith("host "))
    assert [line.split() for line in lines[start + 1:start + 3]] == [
        ["10.0.0.3", "2", "3", "900", "2.000", "450"], ["10.0.0.4", "1", "2", "600", "2.000", "300"]]
    assert "total: 1,500 items in 2.500 s = 600 items/s (async mode) on 2 hosts" in text
    # One host: the device alone labels its row, and no host summary.
    one = RunReport("async", _records()[:2], [None] * 2, wall_start=0.0, wall_stop=2.0)
    text = format_report(JobResult({}, one, {Device("cpu"): False, Device("cuda:0"): True}))
    assert [line.split()[0] for line in text.splitlines()[2:4]] == ["cuda:0", "cpu"] and "host " not in text


def test_items_per_second_series_keeps_every_item_and_the_formats():
    from dsched.observe.dashboard import DashboardPlugin, track_run
    from dsched.observe.dashboard.plugin import _throughput_series
    from dsched.dashboard_plots import format_count, format_seconds

    chunks = [("cpu@a", "cpu", 10.0, 11.0, 100), ("cpu@a", "cpu", 11.0, 13.0, 100),
              ("cuda:0@b", "cuda:0", 10.5, 10.5, 50)]  # the last has no measured duration
    series = _throughput_series(chunks, origin=10.0, end=14.0, bins=8)
    assert list(series) == ["cpu@a", "cuda:0@b"]
    times, rates = series["cpu@a"]
    assert times == [0.25 + 0.5 * i for i in range(8)]
    assert rates == [100.0, 100.0, 50.0, 50.0, 50.0, 50.0, 0.0, 0.0]  # items/s: 100 then 50, then idle
    assert sum(r * 0.5 for r in series["cuda:0@b"][1]) == 50
    assert (format_count(1234567.8), format_count(None), format_count("unlimited"), format_count(float("nan"))) == (
        "1,234,568", "-", "unlimited", "-")
    assert (format_seconds(None), format_seconds(0.42), format_seconds(200), format_seconds(7300)) == (
        "-", "0.4 s", "3 min 20 s", "2 h 1 min")
    with pytest.raises(ValueError, match=r"^total: expected a positive number of items, got 0$"):
        DashboardPlugin().begin_run("client", total=0)
    with pytest.raises(ValueError, match=r"^total: expected a positive number of items, got 2.5$"):
        with track_run(None, total=2.5):
            pass


def test_feed_chunks_of_a_worker_that_left_are_no_longer_in_flight():
    # A feed's chunk tells the dashboard its start and its end; a worker that dies sends no end (the client
    # runs the chunk again as a task), so its chunks must not stay in flight, nor keep their run active.
    from dsched.dashboard import DashboardPlugin
    from dsched.feed import CHUNK_EVENT_TOPIC

    plugin = DashboardPlugin()
    for chunk, address in (("run-feed-0-1", "tcp://10.0.0.1:1"), ("run-feed-1-2", "tcp://10.0.0.2:2")):
        plugin.log_event(CHUNK_EVENT_TOPIC, ("start", "dsched-run-1", "client", "cpu", 10, address, chunk, None, None))
    [run] = plugin.snapshot()["runs"]
    assert (run["chunks_in_flight"], run["items_in_flight"], run["active"]) == (2, 20, True)
    plugin.remove_worker(worker="tcp://10.0.0.1:1")
    [run] = plugin.snapshot()["runs"]
    assert (run["chunks_in_flight"], run["items_in_flight"]) == (1, 10)
    plugin.log_event(CHUNK_EVENT_TOPIC, ("done", "dsched-run-1", "client", "cpu", 10, "tcp://10.0.0.2:2",
                                         "run-feed-1-2", 1.0, 2.0))
    [run] = plugin.snapshot()["runs"]
    assert (run["chunks_in_flight"], run["items_done"], run["active"]) == (0, 10, False)


def test_the_page_updates_again_and_again_on_a_long_run(dashboard_cluster):
    """The page's refresh, run in Python: long columns (Dask stores them as NumPy arrays) compare and update."""
    from dsched.dashboard import install
    from dsched.dashboard_plots import DschedPlots

    client, _ = dashboard_cluster
    plots = DschedPlots(install(client.cluster.scheduler))
    plots.build_tables()
    for build in (plots.build_heading, plots.build_progress, plots.build_load, plots.build_throughput,
                  plots.build_timeline, plots.build_predictions):
        build()
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[2, 4], capacities=[8, 16])
    for n in (120, 60):
        dispatch(np.negative, np.arange(float(n)), scheduler=scheduler, client=client)
        flush_page(client)
        plots.update()
        plots.update()  # nothing changed: compares NumPy columns with lists
        timeline = plots.sources["timeline"].data
        assert len(timeline["start"]) > 10 and sum(timeline["items"]) == n
        assert plots.sources["runs"].data["items_done"][0] == f"{n:,}"
    plots.pinned_run = plots.sources["runs"].data["id"][1]  # an earlier run, picked in the history
    plots.update()
    assert sum(plots.sources["timeline"].data["items"]) == 120
    assert "Showing earlier run" in plots.heading.text


def test_a_task_annotated_with_its_items_counts_them_rather_than_its_request(dashboard_cluster):
    """A task packing several chunks may request fewer items than it carries: ``dsched-items`` says how many."""
    import dask

    from dsched.dashboard import ITEMS_ANNOTATION

    client, base = dashboard_cluster
    flush_page(client)  # earlier tests' chunks counted before this one's
    before = by_device(get_json(base + JSON_ROUTE))["cpu"]
    with dask.annotate(**{ITEMS_ANNOTATION: 7}):
        future = client.submit(sum, [1, 2], key="dsched-0123abcd-0-0-pack3", resources={"dsched-cpu": 2})
    assert future.result() == 3
    after = get_json(base + JSON_ROUTE)
    row = by_device(after)["cpu"]
    assert (row["chunks_done"] - before["chunks_done"], row["items_done"] - before["items_done"]) == (1, 7)
    run = next(r for r in after["runs"] if r["id"] == "dsched-0123abcd-0")  # its run, from the key's prefix
    assert (run["chunks_done"], run["items_done"]) == (1, 7)


async def _devtools_page(profile, url, browser, deadline):
    """A DevTools websocket to the page at ``url`` of the headless Chromium started with ``profile``."""
    from tornado.websocket import websocket_connect

    port_file = Path(profile, "DevToolsActivePort")
    while not (port_file.exists() and port_file.read_text().strip()):
        assert time.monotonic() < deadline and browser.poll() is None, "Chromium did not start"
        await asyncio.sleep(0.05)
    port = int(port_file.read_text().split()[0])
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            pages = [t for t in json.load(response) if t["type"] == "page" and t["url"].startswith(url)]
        if pages:
            break
        assert time.monotonic() < deadline, "Chromium opened no page"
        await asyncio.sleep(0.05)
    return await websocket_connect(pages[0]["webSocketDebuggerUrl"], max_message_size=2**26)


def test_a_plain_dispatch_tells_the_page_its_total(dashboard_cluster):
    """No track_run: dispatch() itself says how many items its run has, so the page shows progress, not
    'total unknown'."""
    client, base = dashboard_cluster
    x = np.arange(777.0)
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 8], capacities=[8, 16])
    np.testing.assert_array_equal(dispatch(np.negative, x, scheduler=scheduler, client=client), -x)
    deadline = time.monotonic() + 10
    while True:  # the chunk events reach the scheduler after the run returns, within moments
        run = get_json(base + JSON_ROUTE)["run"]
        if run["items_done"] == 777 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (run["total"], run["items_done"], run["fraction"]) == (777, 777, 1.0)


def test_dsched_run_keeps_serving_its_page_after_the_run_for_its_linger(tmp_path):
    """The link dsched run --dashboard prints still answers once the run is over, until the linger ends."""
    graph = tmp_path / "j2.toml"
    graph.write_text(GRAPH)
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "dsched", "run", str(graph), "--no-progress", "--dashboard",
                                f"127.0.0.1:{port}", "--dashboard-linger", "4"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        for line in process.stdout:  # the report, then the linger line; the cluster is still up
            lines.append(line)
            if "keeps serving" in line:
                break
        assert "dashboard: the run is over; the page keeps serving until 4 s or Ctrl-C\n" in lines, lines
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{PAGE_ROUTE}", timeout=10) as response:
            assert response.status == 200
        assert get_json(f"http://127.0.0.1:{port}{JSON_ROUTE}")["run"]["items_done"] == 60000
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
