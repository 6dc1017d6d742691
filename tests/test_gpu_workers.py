"""GPU workers on a real cuda:0: page-locked memory and a stream per chunk, a worker pinned to its GPU,
LocalHybridCluster's real device, dsched.register on dask-cuda's LocalCUDACluster, and NVML's memory in the
Prometheus families.

Each test checks its result against the same computation on the CPU (or, for the metrics, against NVML read
directly). Marked ``gpu``: skipped without a CUDA GPU and CuPy; ``scripts/gpu-check`` runs them on a GPU
machine (docs/gpu.md).
"""

import os
import time
import urllib.request

import numpy as np
import pytest

import dsched
from dsched.models.j2 import j2_update, loading_strain
from dsched.names import EMULATED_RESOURCE

pytestmark = pytest.mark.gpu

CUDA0 = dsched.Device("cuda:0")
NON_DEFAULT = (0, 1, 2)  # CUDA's legacy default stream (0 or 1) and the per-thread one (2)


@pytest.fixture(scope="module")
def gpu_cluster():
    """A LocalHybridCluster of worker processes, ``cpu`` and the real ``cuda:0``, and a Client on it."""
    from distributed import Client

    with dsched.LocalHybridCluster(["cpu", "cuda:0"], processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        yield cluster, client


def worker_named(client, name):
    return next(a for a, w in client.scheduler_info(n_workers=-1)["workers"].items() if w.get("name") == name)


def j2_with_stream(strain, plastic_strain, alpha):
    """J2, and per row the CUDA stream the chunk ran on (0 on the CPU)."""
    import cupy

    out = j2_update(strain, plastic_strain, alpha)
    on_gpu = isinstance(strain, cupy.ndarray)
    stream = cupy.cuda.get_current_stream().ptr if on_gpu else 0
    out["stream"] = (cupy if on_gpu else np).full(strain.shape[0], stream, dtype=np.uint64)
    return out


def pinned_registrations(dask_worker=None):
    """In a worker: each page-locked segment's (writable, CUDA's memory type of its address: 1 for host)."""
    import cupy

    from dsched.dataplane.segments import _pinned

    def memory_type(pointer):
        attributes = cupy.cuda.runtime.pointerGetAttributes(pointer)
        return int(getattr(attributes, "type", getattr(attributes, "memoryType", -1)))  # CuPy's name varies

    return sorted((writable, memory_type(pointer)) for (_, writable), (_, pointer) in list(_pinned.items()))


def test_shared_inputs_and_outputs_are_page_locked_and_each_chunk_runs_on_a_stream_of_its_own(gpu_cluster):
    _, client = gpu_cluster
    n = 200_000
    strain = dsched.shared_copy(loading_strain(np.arange(n)) * 3.0)
    plastic, alpha = dsched.shared_copy(np.zeros((n, 6))), dsched.shared_copy(np.zeros(n))
    expected = j2_update(strain, plastic, alpha)
    out = {name: dsched.shared_empty(value.shape) for name, value in expected.items()}
    out["stream"] = dsched.shared_empty(n, dtype=np.uint64)
    scheduler = dsched.SimpleScheduler("cuda:0", 25_000, capacity=50_000)  # two chunks at once, one per thread
    got = dsched.dispatch(j2_with_stream, strain, plastic, alpha, scheduler=scheduler, client=client, out=out)
    for name, value in expected.items():
        assert got[name] is out[name]  # written in place, into the caller's page-locked rows
        np.testing.assert_allclose(out[name], value, rtol=1e-12, atol=1e-12 * np.abs(value).max(), err_msg=name)
    assert not set(np.unique(out["stream"]).tolist()) & set(NON_DEFAULT)  # never the default stream
    registered = client.run(pinned_registrations, workers=[worker_named(client, "cuda:0")])
    [(_, kinds)] = registered.items()
    assert (False, 1) in kinds and (True, 1) in kinds  # inputs (read-only) and outputs, host memory to CUDA


def device_and_bus(x):
    """Per row: where the chunk ran (dsched's device, CuPy's device number, its PCI bus), and ``2 x``."""
    import cupy

    from dsched import current_device

    rows = x.shape[0]
    if not isinstance(x, cupy.ndarray):  # dispatch's probe of the layout, on the client
        return x * 2, np.full(rows, "", dtype=object)
    device = cupy.cuda.Device()
    return x * 2, np.full(rows, f"{current_device()} {device.id} {device.pci_bus_id}", dtype=object)


def environment(dask_worker=None):
    """In a worker: its CUDA_VISIBLE_DEVICES and how many GPUs CuPy sees (0 when it sees none)."""
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    return os.environ.get("CUDA_VISIBLE_DEVICES"), count


def test_the_gpu_worker_is_pinned_to_its_gpu_and_the_cpu_worker_sees_none(gpu_cluster):
    import cupy

    cluster, client = gpu_cluster
    assert cluster.emulated[CUDA0] is False
    seen = client.run(environment)
    by_name = {name: seen[worker_named(client, name)] for name in ("cpu", "cuda:0")}
    assert by_name["cpu"] == ("", 0)
    visible, count = by_name["cuda:0"]
    assert visible.split(",")[0] == "0" and count == len(visible.split(","))  # its own GPU first, as dask-cuda does
    x = np.arange(10_000.0)
    doubled, seen = dsched.dispatch(device_and_bus, x, scheduler=dsched.SimpleScheduler("cuda:0", 4096),
                                    client=client)
    np.testing.assert_array_equal(doubled, 2 * x)
    # dsched's cuda:0, the worker's device 0, and the physical GPU 0 that this (unpinned) process sees.
    assert set(seen) == {f"cuda:0 0 {cupy.cuda.Device(0).pci_bus_id}"}


def where(work, device):
    from distributed import get_worker

    return str(dsched.current_device()), get_worker().name


def test_local_hybrid_cluster_runs_chunks_on_the_real_cuda0_and_the_cpu(gpu_cluster):
    _, client = gpu_cluster
    resources = {w["name"]: w["resources"] for w in client.scheduler_info(n_workers=-1)["workers"].values()}
    assert EMULATED_RESOURCE not in resources["cuda:0"] and "dsched-cuda:0" in resources["cuda:0"]
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [512, 2048], priorities=[1, 2])
    seen = dsched.WorkDispatcher(scheduler, where, client=client).run(dsched.SliceGenerator(0, 20_000))
    assert set(seen) == {("cpu", "cpu"), ("cuda:0", "cuda:0")}
    strain, plastic, alpha = loading_strain(np.arange(20_000)) * 3.0, np.zeros((20_000, 6)), np.zeros(20_000)
    out = dsched.dispatch(j2_update, strain, plastic, alpha, scheduler=scheduler, client=client)
    for name, value in j2_update(strain, plastic, alpha).items():
        np.testing.assert_allclose(out[name], value, rtol=1e-12, atol=1e-12 * np.abs(value).max(), err_msg=name)


def square_and_kind(x):
    import cupy

    return x * x, (cupy if isinstance(x, cupy.ndarray) else np).full(x.shape[0], float(isinstance(x, cupy.ndarray)))


def test_register_on_dask_cudas_local_cuda_cluster_places_chunks_on_its_gpu_worker():
    pytest.importorskip("dask_cuda")
    from dask_cuda import LocalCUDACluster
    from distributed import Client

    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", host="127.0.0.1", dashboard_address=None) as cluster, \
            Client(cluster) as client:
        dsched.register(client)  # the worker claims the GPU it is pinned to
        deadline = time.monotonic() + 60
        workers = lambda: client.scheduler_info(n_workers=-1)["workers"].values()  # noqa: E731
        while not any("dsched-cuda:0" in w["resources"] for w in workers()):
            assert time.monotonic() < deadline, "the dask-cuda worker did not claim cuda:0 within 60 s"
            time.sleep(0.1)  # polling the scheduler's view: there is nothing to wait on
        x = np.random.default_rng(0).normal(size=50_000)
        y, on_gpu = dsched.dispatch(square_and_kind, x, scheduler=dsched.SimpleScheduler("cuda:0", 8192),
                                    client=client)
        s = dsched.SimpleScheduler("cuda:0", 8192)
        blocked, _ = dsched.as_batched(x, s)
        z = dsched.map_blocks(np.negative, blocked, scheduler=s, dtype=float).compute()
    np.testing.assert_array_equal(y, x * x)
    assert on_gpu.min() == 1.0  # computed with CuPy on the GPU
    np.testing.assert_array_equal(z, -x)


def scrape(port) -> dict:
    """``{(family, device): value}`` of the dsched_gpu_ families on a worker's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(family.name, sample.labels["device"]): sample.value for family in text_string_to_metric_families(text)
            if family.name.startswith("dsched_gpu_memory") for sample in family.samples}


def http_port(dask_worker=None):
    from distributed.comm.utils import get_tcp_server_addresses

    return get_tcp_server_addresses(dask_worker.http_server)[0][1]


def hold_gpu_memory(nbytes, dask_worker=None):
    import cupy

    dask_worker._dsched_test_block = cupy.ones(nbytes // 8)  # held until released below
    cupy.cuda.runtime.deviceSynchronize()


def release_gpu_memory(dask_worker=None):
    import cupy

    dask_worker._dsched_test_block = None
    cupy.get_default_memory_pool().free_all_blocks()


def nvml_memory():
    import pynvml

    pynvml.nvmlInit()
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        return int(info.used), int(info.total)
    finally:
        pynvml.nvmlShutdown()


def test_a_gpu_worker_process_exports_nvmls_memory_of_its_gpu():
    pytest.importorskip("prometheus_client")
    pytest.importorskip("pynvml")
    from distributed import Client

    held = 2 * 2**30
    with dsched.LocalHybridCluster(["cuda:0"], processes=True, dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        deadline = time.monotonic() + 30
        while not all(client.run(lambda dask_worker: "dsched-metrics" in dask_worker.plugins).values()):
            assert time.monotonic() < deadline, "the metrics plugin did not reach the worker within 30 s"
            time.sleep(0.1)
        [port] = client.run(http_port).values()
        used_before, total = nvml_memory()
        client.run(hold_gpu_memory, held)
        families = scrape(port)
        used_now, _ = nvml_memory()
        client.run(release_gpu_memory)
    assert families[("dsched_gpu_memory_total_bytes", "cuda:0")] == total
    exported = families[("dsched_gpu_memory_used_bytes", "cuda:0")]
    assert exported >= used_before + 0.9 * held  # the worker's 2 GiB are counted
    assert abs(exported - used_now) <= 256 * 2**20  # and agree with NVML read here, moments apart
