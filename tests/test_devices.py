"""Device naming, device lists, where code runs, and array modules per device."""

import pickle

import numpy as np
import pytest

from dsched import Device, array_module, current_device, visible_gpus
from dsched.devices import (
    EMULATED_RESOURCE,
    cuda_local_ordinal,
    device_of_resources,
    device_resource,
    parse_devices,
    placement_device,
    running_on,
    to_device,
    to_host,
)


@pytest.mark.parametrize(
    "spec, type_, index",
    [("cpu", "cpu", None), ("cuda", "cuda", None), ("cuda:0", "cuda", 0), ("cuda:12", "cuda", 12)],
)
def test_valid_specs(spec, type_, index):
    d = Device(spec)
    assert (d.type, d.index) == (type_, index)
    assert str(d) == spec
    assert repr(d) == f"Device({spec!r})"
    assert d.is_cuda == (type_ == "cuda")


def test_bare_cuda_means_ordinal_zero():
    assert Device("cuda").ordinal == 0
    assert Device("cuda:3").ordinal == 3


@pytest.mark.parametrize("spec", ["gpu", "cpu:0", "cuda:-1", "cuda:x", "CUDA:0", "cuda:", "", "cuda:0:1"])
def test_invalid_specs_name_the_value(spec):
    with pytest.raises(ValueError, match=rf"device: {spec!r} is not a device"):
        Device(spec)


@pytest.mark.parametrize("spec", [0, 1.5, None, ["cpu"], b"cpu"])
def test_non_string_spec(spec):
    with pytest.raises(ValueError, match=r"device: expected a string like 'cpu' or 'cuda:0', got"):
        Device(spec)


def test_equality_and_hash():
    assert Device("cuda:1") == Device("cuda:1")
    assert Device("cuda:1") != Device("cuda:2")
    assert Device("cuda") != Device("cuda:0")  # bare cuda is its own name; placement maps it to cuda:0
    assert Device("cpu") == "cpu" and Device("cuda:1") == "cuda:1"
    assert Device("cpu") != "gpu"  # an invalid string compares unequal, it does not raise
    assert Device("cpu") != 3
    assert len({Device("cpu"), Device("cpu"), Device("cuda:0"), Device(Device("cuda:0"))}) == 2
    table = {Device("cuda:0"): "gpu0"}
    assert table[Device("cuda:0")] == "gpu0"


def test_copy_constructor_and_pickle():
    d = Device("cuda:2")
    assert Device(d) == d and Device(d) is not d
    assert Device(Device("cpu")) == Device("cpu")
    restored = pickle.loads(pickle.dumps(d))
    assert restored == d and restored.index == 2 and type(restored) is Device


def test_parse_devices_accepts_one_spec_or_a_list():
    assert parse_devices("cpu") == [Device("cpu")]
    assert parse_devices(Device("cuda:1")) == [Device("cuda:1")]
    assert parse_devices(["cpu", "cuda:0", Device("cuda:1")]) == [Device("cpu"), Device("cuda:0"), Device("cuda:1")]
    assert parse_devices(["cpu", "cuda"]) == [Device("cpu"), Device("cuda")]


def test_parse_devices_names_the_field_and_bad_entry():
    with pytest.raises(ValueError, match=r"^devices: 'gpu' is not a device"):
        parse_devices(["cpu", "gpu"])
    with pytest.raises(ValueError, match=r"^workers: 'cpu:0' is not a device"):
        parse_devices(["cpu:0"], field="workers")


@pytest.mark.parametrize("devices", [["cuda", "cuda:0"], ["cuda:1", "cpu", "cuda"]])
def test_bare_cuda_next_to_indexed_cuda_is_ambiguous(devices):
    indexed = [d for d in devices if d.startswith("cuda:")][0]
    with pytest.raises(ValueError, match=rf"devices: a bare 'cuda' next to {indexed} is ambiguous"):
        parse_devices(devices)


def test_placement_and_resources():
    assert placement_device("cuda") == Device("cuda:0")
    assert placement_device("cuda:2") == Device("cuda:2")
    assert placement_device("cpu") == Device("cpu")
    assert device_resource("cpu") == "dsched-cpu"
    assert device_resource("cuda") == "dsched-cuda:0"
    assert device_resource(Device("cuda:3")) == "dsched-cuda:3"


def test_device_of_resources():
    assert device_of_resources({"dsched-cuda:1": 64, EMULATED_RESOURCE: 1}) == Device("cuda:1")
    assert device_of_resources({EMULATED_RESOURCE: 1, "dsched-cpu": 8}) == Device("cpu")
    assert device_of_resources({"GPU": 1}) is None
    assert device_of_resources(None) is None
    assert device_of_resources({}) is None


def test_current_device_outside_any_worker_is_none():
    assert current_device() is None


def test_running_on_nests_and_restores():
    with running_on("cuda:1"):
        assert current_device() == Device("cuda:1")
        with running_on(Device("cpu")):
            assert current_device() == Device("cpu")
        assert current_device() == Device("cuda:1")
    assert current_device() is None


def test_running_on_restores_after_an_exception():
    with pytest.raises(KeyError):
        with running_on("cuda:0"):
            raise KeyError("boom")
    assert current_device() is None


def test_array_module_is_numpy_for_the_cpu():
    assert array_module("cpu") is np
    assert array_module(Device("cpu")) is np
    assert array_module() is np  # no device anywhere: host memory


def test_to_device_and_to_host_keep_containers_on_the_cpu():
    x = {"a": np.arange(3), "b": (np.ones(2), [np.zeros(1)]), "n": 7}
    moved = to_device(x, "cpu")
    assert moved["a"] is x["a"] and moved["n"] == 7
    assert isinstance(moved["b"], tuple) and isinstance(moved["b"][1], list)
    back = to_host(moved)
    np.testing.assert_array_equal(back["b"][0], np.ones(2))
    assert back["b"][1][0] is x["b"][1][0]


def _gpus_present() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def test_visible_gpus_never_raises():
    gpus = visible_gpus()
    assert isinstance(gpus, list)
    assert all(isinstance(d, Device) and d.is_cuda and d.index is not None for d in gpus)
    if not _gpus_present():
        assert gpus == []


def test_cuda_local_ordinal_follows_the_visible_list(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,0,1")
    assert cuda_local_ordinal("cuda:2") == 0
    assert cuda_local_ordinal("cuda:1") == 3
    assert cuda_local_ordinal("cuda") == 2  # bare cuda is GPU 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cuda_local_ordinal("cuda:1") == 1  # nothing pinned: the global number


@pytest.mark.parametrize("spelling", ["cuda:01", " cpu", "cuda:1 ", "cuda:\u0661", "CPU"])
def test_only_canonical_spellings_are_devices(spelling):
    with pytest.raises(ValueError, match="is not a device"):
        Device(spelling)


def test_a_device_hashes_like_the_string_it_equals():
    assert Device("cuda:0") == "cuda:0"
    assert "cpu" in {Device("cpu")}
    assert {Device("cuda:0"): 1}.get("cuda:0") == 1
