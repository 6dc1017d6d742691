"""Inputs streamed from where they live: Zarr stores and Dask arrays, read chunk by chunk, never whole."""

import numpy as np
import pytest

import dsched
from dsched.dataplane.sources import DaskRows, ZarrInput, ZarrRows, as_streamed

zarr = pytest.importorskip("zarr")
da = pytest.importorskip("dask.array")


def model(a, b, shift):
    return {"sum": a * 2 + b[:, None], "norm": np.sqrt((a * a).sum(axis=1)) + shift}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = np.random.default_rng(0)
    a, b = rng.random((1000, 3)), rng.random(1000)
    path = str(tmp_path_factory.mktemp("zarr") / "in.zarr")
    group = zarr.open_group(path, mode="w")
    za = group.create_array("a", shape=a.shape, chunks=(128, 3), dtype="f8")
    zb = group.create_array("b", shape=b.shape, chunks=(128,), dtype="f8")
    za[:], zb[:] = a, b
    return {"a": a, "b": b, "za": za, "zb": zb, "expected": model(a, b, 0.5)}


@pytest.fixture(params=["sync", "in-process", "processes"])
def run(request, hybrid_client, process_client):
    client = {"sync": None, "in-process": hybrid_client, "processes": process_client}[request.param]
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[64, 96])
    return lambda *args: dsched.dispatch(model, *args, 0.5, scheduler=scheduler, client=client,
                                         mode="sync" if client is None else "async")


def _equal(out, expected):
    assert sorted(out) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(out[key], expected[key])


def test_zarr_arrays_on_disk(run, data):
    _equal(run(data["za"], data["zb"]), data["expected"])


def test_zarr_arrays_in_memory(run, data):
    _equal(run(zarr.array(data["a"]), zarr.array(data["b"])), data["expected"])


def test_dask_arrays(run, data):
    a = da.from_array(data["a"], chunks=(300, 3)) * 1.0  # a graph, not only stored data
    _equal(run(a, da.from_array(data["b"], chunks=250)), data["expected"])


def test_streamed_inputs_mix_with_numpy_arrays(run, data):
    _equal(run(data["za"], data["b"]), data["expected"])
    _equal(run(data["a"], da.from_array(data["b"], chunks=250)), data["expected"])


def test_a_chunk_of_a_store_on_disk_carries_a_reference_not_its_rows(data):
    rows = as_streamed(data["za"]).__dsched_rows__(0, 100, 164)
    assert isinstance(rows, ZarrRows) and (rows.path, rows.start, rows.stop) == ("a", 100, 164)
    np.testing.assert_array_equal(rows.resolve(), data["a"][100:164])
    in_memory = as_streamed(zarr.array(data["a"])).__dsched_rows__(0, 0, 10)
    assert isinstance(in_memory, np.ndarray)  # another process could not open it: read on the client
    assert isinstance(as_streamed(da.ones(10, chunks=5)).__dsched_rows__(0, 2, 4), DaskRows)
    assert repr(as_streamed(data["za"])).startswith("ZarrInput(")
    assert as_streamed(data["a"]) is data["a"]
    assert isinstance(as_streamed(data["za"]), ZarrInput)


def test_dask_rows_are_computed_on_the_workers(process_client, data):
    a = da.from_array(data["a"], chunks=(300, 3)).map_blocks(np.negative, name="dsched-test-negate")
    scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[64, 96])
    from distributed import get_task_stream

    with get_task_stream(process_client) as stream:
        out = dsched.dispatch(model, a, data["b"], 0.5, scheduler=scheduler, client=process_client)
    np.testing.assert_array_equal(out["sum"], -data["a"] * 2 + data["b"][:, None])
    computed = [t for t in stream.data if "negate" in str(t["key"])]
    assert computed and {t["worker"] for t in computed} <= set(process_client.scheduler_info()["workers"])


def test_an_empty_store_is_an_empty_batch(tmp_path):
    z = zarr.open_array(str(tmp_path / "e.zarr"), mode="w", shape=(0, 3), dtype="f8")
    with pytest.raises(ValueError, match=r"^args: the batch is empty"):
        dsched.dispatch(np.sqrt, z, scheduler=dsched.SimpleScheduler("cpu", 4), mode="sync")


# --- dsched run --input ------------------------------------------------------------------------

GRAPH = """
[model]
name = "j2"
tangent = false

[batch]
size = 10

[scheduler]
type = "StaticHybridScheduler"
devices = ["cpu", "cuda:0"]
batch_sizes = [700, 900]

[options]
emulate = true
"""


def test_dsched_run_reads_its_inputs_from_a_store_and_writes_its_outputs_to_another(tmp_path, capsys):
    from dsched.apps.cli import main
    from dsched.models import j2_update, loading_strain, write_j2_inputs

    n = 5000
    write_j2_inputs(tmp_path / "in.zarr", n, piece=1200)
    graph = tmp_path / "j2.toml"
    graph.write_text(GRAPH)
    assert main(["run", str(graph), "--input", str(tmp_path / "in.zarr"), "--output", str(tmp_path / "out.zarr"),
                 "--no-progress"]) == 0
    assert f"total: {n:,} items" in capsys.readouterr().out  # the store's length, not batch.size
    out = zarr.open_group(str(tmp_path / "out.zarr"), mode="r")
    expected = j2_update(loading_strain(np.arange(n)), np.zeros((n, 6)), np.zeros(n), tangent=False)
    for key, value in expected.items():
        np.testing.assert_array_equal(out[key][:], value)


@pytest.mark.parametrize("make, message", [
    (lambda p: None, r"options.input: .*missing.zarr is not a Zarr store \(FileNotFoundError\)"),
    (lambda p: zarr.open_group(str(p), mode="w").create_array("strain", shape=(4, 6), dtype="f8"),
     r"options.input: .* lacks the j2 inputs plastic_strain, alpha \(it needs strain, plastic_strain, alpha\)"),
])
def test_a_bad_input_store_is_a_one_line_error_before_any_cluster(tmp_path, capsys, make, message):
    from dsched.apps.cli import main

    store = tmp_path / "missing.zarr"
    make(store)
    graph = tmp_path / "j2.toml"
    graph.write_text(GRAPH)
    assert main(["run", str(graph), "--input", str(store)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert __import__("re").search(message, err), err
