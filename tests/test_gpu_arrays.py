"""CuPy and torch CUDA arrays through dispatch, map_blocks and Batch, on a real cuda:0 beside the CPU.

Each test computes the same thing on the CPU (NumPy, or torch on the CPU) and compares. The models also
report what kind of array each chunk saw, so a chunk that was placed on cuda:0 but computed on the CPU
fails the test. Marked ``gpu``: skipped without a CUDA GPU and CuPy (CI has none); ``scripts/gpu-check``
runs them on a GPU machine (docs/gpu.md).
"""

import numpy as np
import pytest

import dsched
from dsched.models.j2 import j2_update, loading_strain

pytestmark = pytest.mark.gpu

N = 100_000


@pytest.fixture(scope="module")
def gpu_client():
    """A Client on worker processes: ``cpu`` and the real ``cuda:0``, two threads each."""
    from distributed import Client

    with dsched.LocalHybridCluster(["cpu", "cuda:0"], processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        yield client


def hybrid(cpu=4096, gpu=16384):
    # cuda:0 first (priority 2), then the CPU while cuda:0 is full: both get chunks whatever their speeds.
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], [cpu, gpu], priorities=[1, 2])


def on_gpu_flags(x):
    """1.0 per row of a chunk that got a CUDA array (CuPy or a torch CUDA tensor), 0.0 per row of a host one."""
    if type(x).__module__.partition(".")[0] == "cupy":
        import cupy

        return cupy.ones(x.shape[0])
    if type(x).__module__.partition(".")[0] == "torch":
        import torch

        return torch.full((x.shape[0],), 1.0 if x.is_cuda else 0.0, dtype=torch.float64, device=x.device)
    return np.zeros(x.shape[0])


def j2_and_where(strain, plastic_strain, alpha):
    out = j2_update(strain, plastic_strain, alpha)
    out["on_gpu"] = on_gpu_flags(strain)
    return out


def square_and_where(x):
    return x * x, on_gpu_flags(x)


def j2_inputs(n=N):
    return loading_strain(np.arange(n)) * 3.0, np.zeros((n, 6)), np.zeros(n)  # * 3: most points yield


def assert_j2_equal(out, expected):
    for name, value in expected.items():
        np.testing.assert_allclose(np.asarray(out[name]), value, rtol=1e-12, atol=1e-12 * np.abs(value).max(),
                                   err_msg=name)


def test_numpy_inputs_on_cpu_and_cuda0_match_numpy_and_reach_the_gpu_as_cupy(gpu_client):
    inputs = j2_inputs()
    out = dsched.dispatch(j2_and_where, *inputs, scheduler=hybrid(), client=gpu_client)
    assert_j2_equal(out, j2_update(*inputs))
    assert all(isinstance(v, np.ndarray) for v in out.values())  # back in host memory
    assert set(np.unique(out["on_gpu"])) == {0.0, 1.0}  # chunks on both devices, each on its own kind


def test_cupy_inputs_on_cuda0_come_back_as_numpy_equal_to_the_cpu(gpu_client):
    import cupy

    x = np.random.default_rng(1).normal(size=(N, 3))
    y, on_gpu = dsched.dispatch(square_and_where, cupy.asarray(x), scheduler=dsched.SimpleScheduler("cuda:0", 8192),
                                client=gpu_client)
    assert isinstance(y, np.ndarray) and isinstance(on_gpu, np.ndarray)  # a CuPy array's host form is NumPy
    np.testing.assert_array_equal(y, x * x)
    assert on_gpu.min() == 1.0


def test_cupy_inputs_on_cpu_and_cuda0_reach_the_cpu_as_numpy(gpu_client):
    import cupy

    x = np.random.default_rng(2).normal(size=(N, 3))
    y, on_gpu = dsched.dispatch(square_and_where, cupy.asarray(x), scheduler=hybrid(), client=gpu_client)
    np.testing.assert_array_equal(y, x * x)
    assert set(np.unique(on_gpu)) == {0.0, 1.0}


def test_torch_cuda_tensors_on_cuda0_come_back_as_tensors_equal_to_the_cpu(gpu_client):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(np.random.default_rng(3).normal(size=(N, 3)))
    y, on_gpu = dsched.dispatch(square_and_where, x.to("cuda:0"), scheduler=dsched.SimpleScheduler("cuda:0", 8192),
                                client=gpu_client)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float64
    np.testing.assert_array_equal(y.cpu().numpy(), (x * x).numpy())
    assert float(on_gpu.min()) == 1.0


@pytest.mark.parametrize("where", ["cpu", "cuda:0"])
def test_torch_tensors_on_cpu_and_cuda0_compute_on_each_device(gpu_client, where):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(np.random.default_rng(4).normal(size=(N, 3)))
    # Host tensors, or CUDA tensors of the caller: either way each chunk gets its own device's.
    y, on_gpu = dsched.dispatch(square_and_where, x.to(where), scheduler=hybrid(), client=gpu_client)
    assert isinstance(y, torch.Tensor)
    np.testing.assert_array_equal(y.cpu().numpy(), (x * x).numpy())
    assert set(np.unique(on_gpu.cpu().numpy())) == {0.0, 1.0}


def stress_block(strain, plastic_strain, alpha):
    return j2_update(strain, plastic_strain, alpha.reshape(-1), tangent=False)["stress"]


def kind_block(strain):
    return on_gpu_flags(strain)


def test_map_blocks_on_cpu_and_cuda0_matches_numpy(gpu_client):
    strain, plastic, alpha = j2_inputs()
    s = hybrid(8192, 32768)
    blocked = [dsched.as_batched(a, s)[0] for a in (strain, plastic, alpha.reshape(-1, 1))]
    stress = dsched.map_blocks(stress_block, *blocked, scheduler=s, dtype=float).compute()
    kinds = dsched.map_blocks(kind_block, blocked[0], scheduler=s, drop_axis=1, dtype=float).compute()
    assert isinstance(stress, np.ndarray)
    np.testing.assert_allclose(stress, j2_update(strain, plastic, alpha, tangent=False)["stress"], rtol=1e-12,
                               atol=1e-9)
    planned = np.concatenate([np.full(m, float(d.is_cuda)) for d, m in dsched.plan(N, s)])
    np.testing.assert_array_equal(kinds, planned)  # every block computed on the device planned for it


def test_map_blocks_with_the_torch_backend_hands_cuda_tensors_to_gpu_blocks(gpu_client):
    pytest.importorskip("torch")
    s = hybrid(8192, 32768)
    x = np.random.default_rng(5).normal(size=N)
    blocked, chunks = dsched.as_batched(x, s)
    y = dsched.map_blocks(lambda b: b * b, blocked, scheduler=s, backend="torch", dtype=float).compute()
    kinds = dsched.map_blocks(on_gpu_flags, blocked, scheduler=s, backend="torch", dtype=float).compute()
    np.testing.assert_array_equal(y, x * x)
    planned = np.concatenate([np.full(m, float(d.is_cuda)) for d, m in chunks])
    np.testing.assert_array_equal(kinds, planned)


def j2_step(strain, plastic_strain, alpha):
    out = j2_update(strain, plastic_strain, alpha, tangent=False)
    return {"plastic_strain": out["plastic_strain"], "alpha": out["alpha"], "stress": out["stress"],
            "on_gpu": on_gpu_flags(strain)}


def test_batch_load_steps_on_cpu_and_cuda0_match_numpy_step_by_step(gpu_client):
    n, steps = 50_000, 5
    final = loading_strain(np.arange(n)) * 3.0
    fields = {"strain": np.zeros((n, 6)), "plastic_strain": np.zeros((n, 6)), "alpha": np.zeros(n)}
    plastic, alpha = np.zeros((n, 6)), np.zeros(n)
    with dsched.Batch(fields, hybrid(8192, 16384), client=gpu_client) as batch:
        for step in range(steps):
            strain = final * (step + 1) / steps
            batch.set("strain", strain)
            batch.update(j2_step, reads=["strain", "plastic_strain", "alpha"], writes=["plastic_strain", "alpha"],
                         outputs=["stress", "on_gpu"])
            expected = j2_update(strain, plastic, alpha, tangent=False)
            plastic, alpha = expected["plastic_strain"], expected["alpha"]
        kinds = batch.reduce(lambda a: type(a).__module__.partition(".")[0], "alpha", combine=set)
        got = {name: batch.get(name) for name in ("stress", "plastic_strain", "alpha", "on_gpu")}
    assert_j2_equal(got, expected)
    assert (expected["alpha"] > 0).mean() > 0.5  # the state changed: the steps carried it
    assert set(np.unique(got["on_gpu"])) == {0.0, 1.0}
    assert "cupy" in kinds and "numpy" in kinds  # resident on the GPU as CuPy, on the CPU as NumPy


def numpy_only_model(x):
    """A model written with NumPy alone, as most FE materials are: it fails on a CuPy array."""
    assert type(x) is np.ndarray, type(x)
    return np.sqrt(x) + 1.0, on_gpu_flags(x)


def test_a_numpy_model_on_the_gpu_worker_gets_host_arrays(gpu_client):
    """host_arrays=True: the chunks placed on cuda:0 arrive as NumPy (the model runs on the GPU worker's CPU
    threads), equal to the CPU's result; without it, the cuda:0 chunks are CuPy and this model refuses them."""
    x = np.random.default_rng(3).random(N)
    y, on_gpu = dsched.dispatch(numpy_only_model, x, scheduler=hybrid(), client=gpu_client, host_arrays=True)
    np.testing.assert_array_equal(y, np.sqrt(x) + 1.0)
    assert not on_gpu.any()
    with pytest.raises(Exception, match="ndarray"):
        dsched.dispatch(numpy_only_model, x, scheduler=hybrid(), client=gpu_client)
