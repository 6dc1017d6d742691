"""LocalHybridCluster: one worker per device, device ownership, capacity, validation.

Runs on real Dask clusters: the shared in-process emulated cluster of
``hybrid_client``, one in-process cluster whose cuda:0 holds only 4 items at
once, a short-lived cluster of worker processes, and the cluster a dispatcher
starts for itself. Emulated devices test placement and capacity only.
"""

import threading

import numpy as np
import pytest
from distributed import Client

from dsched import (
    Device,
    LocalHybridCluster,
    SimpleScheduler,
    SliceGenerator,
    StaticHybridScheduler,
    WorkDispatcher,
    array_module,
    current_device,
    dispatch,
    visible_gpus,
)
from dsched.cluster.local import _rotated_visible_devices
from dsched.devices import EMULATED_RESOURCE, UNLIMITED_CAPACITY

CPU, GPU0 = Device("cpu"), Device("cuda:0")
NO_GPU = not visible_gpus()


def where(work, device):
    from distributed import get_worker

    return str(current_device()), get_worker().name


# --- the cluster a dispatcher starts for itself (first: it needs no current client) ---------

def test_dispatcher_without_a_client_starts_and_closes_its_own_cluster():
    from distributed import default_client

    try:
        default_client()
        pytest.skip("a Dask client is already current in this process")
    except ValueError:
        pass
    scheduler = StaticHybridScheduler(["cpu", "cuda:0"], 3)
    options = {"emulate": True, "dashboard_address": None}
    with WorkDispatcher(scheduler, where, cluster_options=options) as dispatcher:
        results = dispatcher.run(SliceGenerator(0, 12))
        client = dispatcher.client
        cluster = client.cluster
        assert isinstance(cluster, LocalHybridCluster) and cluster.devices == [CPU, GPU0]
        assert cluster.emulated == {CPU: False, GPU0: True}
        assert all(device == worker for device, worker in results)
        assert dispatcher.client is client  # started once, reused
    assert client.status == "closed" and cluster.status.name == "closed"


# --- validation: nothing starts ----------------------------------------------------------

@pytest.mark.skipif(not NO_GPU, reason="a GPU is present")
def test_missing_gpu_without_emulation():
    with pytest.raises(ValueError, match=r"devices: cuda:0 is not present on this machine \(visible GPUs: none\); "
                       r"to rehearse without it \(for testing, not measuring\), emulate it: "
                       r"LocalHybridCluster\(\['cpu', 'cuda:0'\], emulate=True\), and pass that cluster's Client "
                       r"to dispatch\(client=\.\.\.\)"):
        LocalHybridCluster(["cpu", "cuda:0"])


@pytest.mark.parametrize(
    "devices, message",
    [
        ([], r"devices: at least one device is required, got none"),
        (["cpu", "cpu"], r"devices: duplicate device in \['cpu', 'cpu'\]"),
        (["cpu", "gpu"], r"^devices: 'gpu' is not a device"),
        (["cuda", "cuda:1"], r"devices: a bare 'cuda' next to cuda:1 is ambiguous"),
    ],
)
def test_bad_device_lists(devices, message):
    with pytest.raises(ValueError, match=message):
        LocalHybridCluster(devices, emulate=True)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_bad_threads_per_worker(threads):
    with pytest.raises(ValueError, match=r"threads_per_worker: expected an integer >= 1, got"):
        LocalHybridCluster(["cpu"], threads_per_worker=threads)


@pytest.mark.parametrize(
    "capacities, message",
    [
        ({"cuda:1": 4}, r"capacities: cuda:1 is not one of the devices \['cpu', 'cuda:0'\]"),
        ({"gpu": 4}, r"^capacities: 'gpu' is not a device"),
        ({"cuda:0": 0}, r"capacities\['cuda:0'\]: expected an integer >= 1, got 0"),
        ({"cpu": 2.5}, r"capacities\['cpu'\]: expected an integer >= 1, got 2.5"),
    ],
)
def test_bad_capacities(capacities, message):
    with pytest.raises(ValueError, match=message):
        LocalHybridCluster(["cpu", "cuda:0"], emulate=True, capacities=capacities)


def test_rotated_visible_devices_put_the_workers_gpu_first():
    assert _rotated_visible_devices(0, [0, 1, 2, 3]) == "0,1,2,3"
    assert _rotated_visible_devices(2, [0, 1, 2, 3]) == "2,3,0,1"
    assert _rotated_visible_devices(5, [1, 5]) == "5,1"


# --- the shared emulated cluster ------------------------------------------------------------

def test_one_named_worker_per_device_owning_it(hybrid_client):
    cluster = hybrid_client.cluster
    assert isinstance(cluster, LocalHybridCluster)
    assert cluster.device_workers == {CPU: "cpu", GPU0: "cuda:0"}
    assert "cuda:0 (emulated)" in repr(cluster) and "cpu (emulated)" not in repr(cluster)
    workers = {w["name"]: w for w in hybrid_client.scheduler_info(n_workers=-1)["workers"].values()}
    assert set(workers) == {"cpu", "cuda:0"}
    assert workers["cpu"]["resources"] == {"dsched-cpu": UNLIMITED_CAPACITY}
    assert workers["cuda:0"]["resources"] == {"dsched-cuda:0": UNLIMITED_CAPACITY, EMULATED_RESOURCE: 1}
    assert {w["nthreads"] for w in workers.values()} == {2}


def test_emulated_gpu_worker_computes_with_numpy(hybrid_client):
    def module_name():
        return array_module().__name__, str(current_device())

    result = hybrid_client.submit(module_name, workers=["cuda:0"], pure=False).result()
    assert result == ("numpy", "cuda:0")


# --- a cluster whose cuda:0 runs at most 4 items at once ----------------------------------

@pytest.fixture(scope="module")
def capped_client():
    with LocalHybridCluster(
        ["cpu", "cuda:0"], emulate=True, capacities={"cuda:0": 4}, threads_per_worker=4, dashboard_address=None
    ) as cluster, Client(cluster) as client:
        yield client


def test_batch_size_above_the_workers_capacity_fails_before_any_work(capped_client):
    generator = SliceGenerator(0, 20)
    dispatcher = WorkDispatcher(SimpleScheduler("cuda:0", 8), where, client=capped_client)
    with pytest.raises(ValueError, match=r"batch_sizes: 8 for cuda:0 exceeds the 4 items its worker may run at once"):
        dispatcher.run(generator)
    assert generator.offset == 0 and dispatcher.scheduler.all_work_completed()


PAIR = threading.Condition()  # shared with the in-process workers (same module)
PAIR_STATE = {}


def pair_up(work, device):
    """Counts the items executing at once; each chunk waits (bounded) for a partner chunk.

    The wait makes the bound's peak deterministic: two chunks of 2 meet whenever
    the worker lets them, so the peak reaches the worker's capacity of 4. The pair
    then lingers a moment, in which a third concurrent chunk (capacity broken)
    would push the peak to 6; with the bound kept, that window passes empty.
    """
    size, state = work.stop - work.start, PAIR_STATE
    with PAIR:
        state["entered"] += 1
        state["active"] += size
        state["peak"] = max(state["peak"], state["active"])
        PAIR.notify_all()
        if not PAIR.wait_for(lambda: state["active"] >= 4 or state["entered"] == state["chunks"], timeout=10):
            raise TimeoutError("no partner chunk arrived")
        PAIR.wait_for(lambda: state["active"] > 4, timeout=0.1)
        state["active"] -= size
    return size


def test_the_workers_capacity_bounds_items_in_flight(capped_client):
    # The dispatcher allows 8 items (four chunks) on cuda:0 and the worker has 4 threads,
    # but the worker owns only 4 items of its device: two chunks run at a time.
    PAIR_STATE.update(chunks=6, entered=0, active=0, peak=0)
    scheduler = SimpleScheduler("cuda:0", 2, capacity=8)
    dispatcher = WorkDispatcher(scheduler, pair_up, client=capped_client)
    assert dispatcher.run(SliceGenerator(0, 12)) == [2] * 6
    assert PAIR_STATE["peak"] == 4 and PAIR_STATE["entered"] == 6
    assert scheduler.all_work_completed()


# --- worker processes ----------------------------------------------------------------------

def http_addresses(cluster):
    from distributed.comm.utils import get_tcp_server_addresses

    return [host for host, *_ in get_tcp_server_addresses(cluster.scheduler.http_server)]


def test_scheduler_http_server_stays_on_loopback_without_a_dashboard(hybrid_client):
    # The scheduler serves /health and /metrics even with no dashboard; by default Dask
    # would bind them on every interface at port 8787.
    assert http_addresses(hybrid_client.cluster) == ["127.0.0.1"]


def test_worker_processes_listen_on_loopback_and_hide_gpus():
    with LocalHybridCluster(
        ["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1, dashboard_address=None
    ) as cluster, Client(cluster) as client:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:")
        assert http_addresses(cluster) == ["127.0.0.1"]
        workers = client.scheduler_info(n_workers=-1)["workers"]
        assert all(address.startswith("tcp://127.0.0.1:") for address in workers)
        env = client.run(lambda: __import__("os").environ.get("CUDA_VISIBLE_DEVICES"))
        assert set(env.values()) == {""}  # CPU and emulated workers must not grab a GPU

        def square_where(x):
            return x * x, np.full(len(x), 1.0 if array_module().__name__ == "numpy" else 0.0)

        scheduler = StaticHybridScheduler(["cpu", "cuda:0"], [3, 5], [3, 10])
        y, on_numpy = dispatch(square_where, np.arange(40.0), scheduler=scheduler, client=client)
        np.testing.assert_array_equal(y, np.arange(40.0) ** 2)
        assert on_numpy.min() == 1.0
        seen = WorkDispatcher(scheduler, where, client=client).run(SliceGenerator(0, 24))
        assert {s for s in seen} == {("cpu", "cpu"), ("cuda:0", "cuda:0")}


# --- a real GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
def test_dispatch_on_a_real_gpu_uses_cupy():
    import cupy

    def kind_and_square(x):
        on_gpu = isinstance(x, cupy.ndarray)
        return x * x, (cupy if on_gpu else np).full(x.shape[0], 1.0 if on_gpu else 0.0)

    with LocalHybridCluster(["cpu", "cuda:0"], dashboard_address=None) as cluster, Client(cluster) as client:
        assert cluster.emulated[GPU0] is False
        scheduler = StaticHybridScheduler(["cpu", "cuda:0"], [64, 1024], priorities=[1, 2])
        x = np.random.default_rng(0).normal(size=5000)
        y, on_gpu = dispatch(kind_and_square, x, scheduler=scheduler, client=client)
        assert isinstance(y, np.ndarray)  # back in host memory
        np.testing.assert_allclose(y, x * x, rtol=1e-12)
        assert on_gpu[:1024].min() == 1.0  # the first chunk went to cuda:0 (priority 2) and saw CuPy
        seen = WorkDispatcher(scheduler, where, client=client).run(SliceGenerator(0, 4096))
        assert ("cuda:0", "cuda:0") in seen


def test_in_process_workers_http_servers_stay_on_loopback(hybrid_client):
    # Each worker serves /health and /metrics even without a dashboard; with inproc://
    # there is no host to inherit, so the cluster must bind them to loopback itself.
    from distributed.comm.utils import get_tcp_server_addresses

    for worker in hybrid_client.cluster.workers.values():
        assert {host for host, *_ in get_tcp_server_addresses(worker.http_server)} == {"127.0.0.1"}


def test_get_client_of_a_second_cluster_is_its_own_not_the_current_one():
    """distributed compares clusters by name and hands out the current client of an equal one: two
    LocalHybridClusters are never equal, so a second cluster's get_client() never closes the first's client."""
    from distributed import Client

    with LocalHybridCluster(["cpu"], dashboard_address=None) as first, Client(first) as outer:
        with LocalHybridCluster(["cpu"], dashboard_address=None) as second, second.get_client() as inner:
            assert inner is not outer and inner.cluster is second and first != second
        assert outer.status == "running" and outer.submit(abs, -3).result() == 3
