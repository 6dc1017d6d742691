"""Array backends: NumPy, torch and NEML2's typed tensors through dsched.backends and dispatch.

CuPy is covered by the GPU tests; torch and NEML2 come with the ``neml2``
extra and these tests are skipped, with the reason, without them.
"""

import numpy as np
import pytest

import dsched
from dsched import backends
from dsched.devices import running_on

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'dsched[neml2]')")


def _neml2_types():
    neml2 = pytest.importorskip("neml2", reason="neml2 is not installed (pip install 'dsched[neml2]')")
    return neml2.types


# --- which backend ------------------------------------------------------------------


def test_backend_of_names_each_kind_and_nothing_else():
    assert backends.backend_of(np.zeros(3)).name == "numpy"
    assert backends.backend_of(np.float64(1.0)).name == "numpy"
    assert backends.backend_of(torch.zeros(3)).name == "torch"
    for not_an_array in (1.0, "x", [1, 2], {"a": 1}, None):
        assert backends.backend_of(not_an_array) is None


class LookAlike:
    """Has a shape and a dtype, as arrays do, but no way to be sliced or moved."""

    shape, dtype = (4,), np.dtype("f8")


def test_look_alikes_with_shape_and_dtype_get_a_clear_error():
    with pytest.raises(backends.UnsupportedArrayError, match=r"a test_backends\.LookAlike has shape and dtype"):
        backends.backend_of(LookAlike())
    with pytest.raises(ValueError, match=r"args\[1\]: a test_backends\.LookAlike has shape and dtype"):
        dsched.dispatch(np.add, np.zeros(4), LookAlike(), scheduler=dsched.SimpleScheduler("cpu", 2), mode="sync")
    with pytest.raises(ValueError, match=r"args\[0\]\['b'\]: a test_backends"):
        dsched.dispatch(lambda d: d["a"], {"a": np.zeros(4), "b": LookAlike()},
                        scheduler=dsched.SimpleScheduler("cpu", 2), mode="sync")


def test_dask_and_zarr_arrays_are_streamed_inputs_not_look_alikes():
    import dask.array as da

    out = dsched.dispatch(np.add, np.zeros(4), da.ones(4, chunks=2), scheduler=dsched.SimpleScheduler("cpu", 2),
                          mode="sync")
    np.testing.assert_array_equal(out, np.ones(4))


# --- host views and rebuilding --------------------------------------------------------


def test_host_view_of_a_tensor_shares_memory_and_drops_autograd():
    x = torch.arange(6.0, dtype=torch.float64).reshape(3, 2).requires_grad_()
    view = backends.host_view(x)
    assert isinstance(view, np.ndarray) and view.shape == (3, 2)
    view[1, 1] = -1.0
    assert x[1, 1].item() == -1.0  # the same memory, no copy


def test_from_host_rebuilds_a_cpu_tensor_around_the_same_memory():
    a = np.zeros((4, 3), dtype=np.float32)
    t = backends.from_host(a, torch.ones(1))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
    a[2, 0] = 5.0
    assert t[2, 0].item() == 5.0
    assert backends.from_host(a, np.zeros(1)) is a


def test_read_only_arrays_become_tensors_without_a_warning_in_a_fresh_process():
    """torch warns once per process for a read-only array (shared memory mapped read-only): dsched silences that
    one warning, and every later read-only array, under warnings turned into errors, still converts."""
    import subprocess
    import sys

    code = (
        "import warnings, numpy as np\n"
        "from dsched import backends\n"
        "warnings.simplefilter('error')\n"
        "a = np.arange(3.0); a.flags.writeable = False\n"
        "b = np.arange(4.0)[::2]; b.flags.writeable = False\n"
        "t, u = backends.TORCH.from_host(a, None), backends.TORCH.from_host(b, None)\n"
        "assert t.tolist() == [0.0, 1.0, 2.0] and u.tolist() == [0.0, 2.0], (t, u)\n"
        "assert t.data_ptr() == a.ctypes.data and u.data_ptr() == b.ctypes.data\n"
        "assert backends.TORCH.read_only_warned\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_torch_take_concatenate_and_empty_like():
    x = torch.arange(12.0).reshape(4, 3)
    piece = backends.take(x, 1, 1, 3)
    assert piece.shape == (4, 2) and piece[0].tolist() == [1.0, 2.0]
    joined = backends.concatenate([x[:1], x[1:]], 0)
    assert torch.equal(joined, x)
    out = backends.empty_like(x, 7, 0)
    assert isinstance(out, torch.Tensor) and out.shape == (7, 3) and out.dtype == x.dtype


def test_torch_device_follows_cuda_visible_devices(monkeypatch):
    assert backends.torch_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")  # a worker pinned to GPU 1, dask-cuda style
    assert backends.torch_device("cuda:1") == torch.device("cuda", 0)
    assert backends.torch_device("cuda:0") == torch.device("cuda", 1)
    with running_on("cuda:1"):
        assert backends.torch_device() == torch.device("cuda", 0)  # the running chunk's device


def test_to_device_and_to_host_detach_unless_asked():
    x = torch.ones(3, requires_grad=True) * 2.0  # a non-leaf with history
    assert not backends.to_device(x, "cpu").requires_grad
    assert backends.to_device(x, "cpu", keep_grad=True).grad_fn is not None
    moved = dsched.devices.to_host({"y": (x, 1.0)})
    assert not moved["y"][0].requires_grad and moved["y"][1] == 1.0
    assert dsched.devices.to_host(x, keep_grad=True).requires_grad


# --- NEML2 typed tensors ------------------------------------------------------------------


def test_neml2_tensors_split_on_their_batch_axis_and_keep_their_type():
    types = _neml2_types()
    strain = types.SR2(torch.arange(30.0, dtype=torch.float64).reshape(5, 6))
    assert backends.backend_of(strain).name == "neml2"
    assert backends.batch_shape(strain) == (5,)
    assert backends.batch_shape(types.SR2(torch.zeros(6, dtype=torch.float64))) == ()  # unbatched: no axis
    piece = backends.take(strain, 0, 1, 3)
    assert type(piece) is types.SR2 and piece.data.tolist() == strain.data[1:3].tolist()
    joined = backends.concatenate([backends.take(strain, 0, 0, 2), backends.take(strain, 0, 2, 5)], 0)
    assert type(joined) is types.SR2 and torch.equal(joined.data, strain.data)
    with pytest.raises(ValueError, match=r"axis: 1 is out of range for a NEML2 SR2 with batch shape \(5,\)"):
        backends.take(strain, 1, 0, 1)


def test_a_template_rebuilds_shared_rows_as_the_users_type():
    types = _neml2_types()
    strain = types.SR2(torch.rand(6, 6, dtype=torch.float64))
    shared = backends.host_view(strain).copy()  # what the data plane puts in shared memory
    like = backends.template(strain)
    assert type(like) is types.SR2 and tuple(like.shape) == (0, 6)
    rows = backends.from_host(shared[2:4], like)
    assert type(rows) is types.SR2 and torch.equal(rows.data, strain.data[2:4])
    assert backends.template(torch.ones(3, 2), axis=1).shape == (3, 0)


def test_a_template_travels_as_a_description_and_comes_back_the_same_type_once_per_process():
    import pickle

    from dsched.dataplane.store import SliceRef
    from dsched.devices import templates

    types = _neml2_types()
    for like in (backends.template(types.SR2(torch.rand(6, 6, dtype=torch.float64))),
                 backends.template(torch.ones(4, 3, dtype=torch.float32))):
        packed = templates.pack_template(like)
        assert isinstance(packed, tuple) and len(pickle.dumps(packed)) < 400  # no storage in it
        first, second = (pickle.loads(pickle.dumps(SliceRef(None, 0, 0, 1, like))).template for _ in range(2))
        assert first is second  # one template per description and process
        data = first.data if hasattr(first, "data") else first
        expected = like.data if hasattr(like, "data") else like
        assert type(first) is type(like) and data.dtype == expected.dtype and tuple(data.shape) == tuple(
            expected.shape)
        if hasattr(like, "sub_batch_ndim"):
            assert first.sub_batch_ndim == like.sub_batch_ndim
    assert templates.pack_template(torch.ones(2)) is not None and not isinstance(  # not empty: travels as itself
        templates.pack_template(torch.ones(2)), tuple)
    assert templates.unpack_template(("torch", "float64", (0,), "cpu")) == ("torch", "float64", (0,), "cpu")


def test_neml2_host_view_and_rebuild_share_memory():
    types = _neml2_types()
    scalar = types.Scalar(torch.zeros(4, dtype=torch.float64))
    view = backends.host_view(scalar)
    assert view.shape == (4,)
    rebuilt = backends.from_host(np.full(4, 2.5), scalar)
    assert type(rebuilt) is types.Scalar and rebuilt.data.tolist() == [2.5] * 4
    out = backends.empty_like(types.SR2(torch.zeros(3, 6, dtype=torch.float64)), 8, 0)
    assert type(out) is types.SR2 and tuple(out.shape) == (8, 6)


def test_loaders_split_neml2_tensors_and_pass_unbatched_ones_whole():
    types = _neml2_types()
    strain = types.SR2(torch.rand(7, 6, dtype=torch.float64))
    direction = types.SR2(torch.rand(6, dtype=torch.float64))  # no batch axis, though its shape is (6,)
    loader = dsched.MappingLoader({"strain": strain, "direction": direction})
    assert loader.total == 7
    sizes = []
    while loader.has_more():
        m, work = loader.next(3)
        sizes.append(m)
        assert type(work["strain"]) is types.SR2 and work["direction"] is direction
    assert sizes == [3, 3, 1]
    assert dsched.ArrayLoader(strain).total == 7


# --- dispatch with tensors -------------------------------------------------------------

# dispatch() joins its outputs in place through the data plane, which reads tensor results through
# backends.host_view and rebuilds them with backends.from_host. The same argument layout and per-chunk
# call are also tested below through WorkDispatcher with concat_reduce.


def _tensor_dispatcher(fn, args, scheduler, mode, client=None, keep_grad=None):
    """What dispatch() runs, joined by concat_reduce: dsched's own argument layout and per-chunk call."""
    from dsched.dispatch.arguments import ArgsLayout as _ArgsLayout
    from dsched.dispatch.front import _CallOnChunk

    layout = _ArgsLayout(args, keep_grad=keep_grad)
    dispatcher = dsched.WorkDispatcher(scheduler, _CallOnChunk(fn, layout, {}, keep_grad=keep_grad),
                                       reduce=dsched.concat_reduce, mode=mode, client=client)
    return dispatcher, dsched.MappingLoader(layout.mapping)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tensor_chunks_keep_their_type_through_the_dispatch_path(mode, hybrid_client):
    x = torch.arange(30.0, dtype=torch.float64).reshape(10, 3).requires_grad_()
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [3, 4])  # cuda:0 emulated: placement only
    dispatcher, loader = _tensor_dispatcher(_square_and_sum, (x,), s, mode, hybrid_client)
    with dispatcher:
        out = dispatcher.run(loader)
    assert isinstance(out["square"], torch.Tensor) and not out["square"].requires_grad
    assert torch.equal(out["square"], x.detach() ** 2) and torch.equal(out["sum"], x.detach().sum(dim=1))
    if mode == "async":
        assert {str(r.device) for r in dispatcher.last_run.records} == {"cpu", "cuda:0"}


def test_the_dispatch_path_keeps_the_graph_when_asked():
    x = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    dispatcher, loader = _tensor_dispatcher(lambda a: a * a, (x,), dsched.SimpleScheduler("cpu", 4), "sync",
                                            keep_grad=True)
    dispatcher.run(loader).sum().backward()
    assert torch.allclose(x.grad, 2 * x.detach())


def _square_and_sum(x):
    return {"square": x * x, "sum": x.sum(dim=1)}



@pytest.mark.parametrize("mode", ["sync", "async"])
def test_dispatch_keeps_torch_tensors(mode, hybrid_client):
    x = torch.arange(30.0, dtype=torch.float64).reshape(10, 3)
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [3, 4])  # cuda:0 emulated: placement only
    out = dsched.dispatch(_square_and_sum, x, scheduler=s, mode=mode, client=hybrid_client)
    assert isinstance(out["square"], torch.Tensor) and torch.equal(out["square"], x * x)
    assert torch.equal(out["sum"], x.sum(dim=1))



def test_dispatch_of_a_tensor_with_autograd_returns_plain_tensors(hybrid_client):
    x = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    y = dsched.dispatch(lambda a: a * 3.0, x, scheduler=dsched.SimpleScheduler("cpu", 4), client=hybrid_client)
    assert not y.requires_grad and torch.allclose(y, x.detach() * 3.0)



def test_dispatch_keeps_the_graph_when_asked():
    import dask

    x = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    with dask.config.set({"dsched.keep-grad": True}):
        y = dsched.dispatch(lambda a: a * a, x, scheduler=dsched.SimpleScheduler("cpu", 4), mode="sync")
    y.sum().backward()
    assert torch.allclose(x.grad, 2 * x.detach())


def test_work_dispatcher_joins_torch_results():
    x = torch.arange(10.0)
    dispatcher = dsched.WorkDispatcher(
        dsched.SimpleScheduler("cpu", 4), lambda w, d: w + 1, reduce=dsched.concat_reduce, mode="sync"
    )
    y = dispatcher.run(dsched.ArrayLoader(x))
    assert isinstance(y, torch.Tensor) and torch.equal(y, x + 1)



def test_functions_that_move_their_own_inputs_get_them_as_given():
    from dsched.dispatch.arguments import ArgsLayout as _ArgsLayout
    from dsched.dispatch.front import _CallOnChunk

    x = np.arange(4.0)

    def fn(a):
        assert isinstance(a, np.ndarray)  # not turned into CuPy for the GPU chunk
        return a + 1

    fn.moves_inputs = True  # as NEML2Model declares: it puts its inputs on its torch device itself
    layout = _ArgsLayout((x,))
    with running_on("cuda:0"):  # a chunk on a CUDA device that is not emulated, as far as dsched can tell
        assert _CallOnChunk(fn, layout, {})(layout.mapping, dsched.Device("cuda:0")).tolist() == [1.0, 2.0, 3.0, 4.0]
        try:
            import cupy  # noqa: F401
        except ImportError:
            with pytest.raises(RuntimeError, match="moving NumPy arrays to a CUDA device needs CuPy"):
                _CallOnChunk(lambda a: a, layout, {})(layout.mapping, dsched.Device("cuda:0"))


def _torch_model(strain, scale):
    assert isinstance(strain, torch.Tensor) and isinstance(scale, torch.Tensor), (type(strain), type(scale))
    assert strain.device.type == "cpu"  # the emulated cuda:0 computes on the CPU
    return {"stress": torch.sin(strain) * scale, "norm": strain.norm(dim=1)}


def test_map_blocks_with_the_torch_backend_gives_tensors_and_returns_numpy(hybrid_client):
    import dask.array as da

    x = np.arange(120.0).reshape(40, 3) / 40
    strain = da.from_array(x, chunks=(10, 3))
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], 10, 20)
    stress = dsched.map_blocks(lambda s, k: _torch_model(s, k)["stress"], strain, np.full(3, 2.0),
                               scheduler=scheduler, backend="torch")
    norm = dsched.map_blocks(lambda s: _torch_model(s, torch.ones(1))["norm"], strain, scheduler=scheduler,
                             backend="torch", drop_axis=1)
    got_stress, got_norm = hybrid_client.compute([stress, norm], sync=True)
    assert type(got_stress) is np.ndarray and got_stress.dtype == np.float64
    np.testing.assert_allclose(got_stress, np.sin(x) * 2.0)
    np.testing.assert_allclose(got_norm, np.linalg.norm(x, axis=1))
    assert stress.name.startswith("lambda-") and stress.name != norm.name
    with pytest.raises(ValueError, match="backend: expected 'numpy' or 'torch', got 'jax'"):
        dsched.map_blocks(np.sin, strain, scheduler=scheduler, backend="jax")


def test_host_arrays_leaves_a_gpu_chunk_in_host_memory():
    """A NumPy model on a GPU worker: with host_arrays its chunks arrive as NumPy, not CuPy."""
    seen = []

    def numpy_model(a):
        seen.append(type(a))
        return np.sin(a)

    x = np.arange(6.0)
    gpu = dsched.SimpleScheduler("cuda:0", 4)  # sync: a CUDA device that is not emulated, as far as dsched can tell
    got = dsched.dispatch(numpy_model, x, scheduler=gpu, mode="sync", host_arrays=True)
    np.testing.assert_array_equal(got, np.sin(x))
    assert set(seen) == {np.ndarray}
    try:
        import cupy  # noqa: F401
    except ImportError:  # without host_arrays the chunk would go to the GPU: refused in one line before any work
        seen.clear()
        with pytest.raises(ValueError, match=r"^devices: cuda:0 is out of this sync run's reach: .*; a sync run "
                                             r"computes every chunk in this process\. Pass host_arrays=True"):
            dsched.dispatch(numpy_model, x, scheduler=gpu, mode="sync")
        assert seen == []


class DevicesByName(dsched.SimpleScheduler):
    """A policy that names its devices as strings, as a duck-typed one may."""

    @property
    def devices(self):
        return [str(device) for device in super().devices]


def test_a_sync_run_takes_a_policy_that_names_its_devices_as_strings():
    x = np.arange(6.0)
    np.testing.assert_array_equal(dsched.dispatch(np.square, x, scheduler=DevicesByName("cpu", 4), mode="sync"), x * x)


def test_a_sync_run_on_a_gpu_emulated_here_computes_with_numpy():
    """dsched.devices.emulating marks a GPU this machine may lack: a sync run's chunks there compute with NumPy."""
    from dsched.devices import emulating

    where = []

    def model(a):
        where.append((str(dsched.current_device()), type(a), len(a)))
        return np.sin(a)

    x = np.arange(6.0)
    with emulating(["cuda:0"]):
        got = dsched.dispatch(model, x, scheduler=dsched.StaticHybridScheduler(["cpu", "cuda:0"], [2, 4],
                                                                               priorities=[1, 2]), mode="sync")
    np.testing.assert_array_equal(got, np.sin(x))
    assert where == [("cuda:0", np.ndarray, 4), ("cuda:0", np.ndarray, 2)]  # sync: no load, the first priority
