"""dsched.map_blocks composed with the rest of dask.array, on a Client: results against NumPy, and the exact
device every planned block ran on.

Runs under either of Dask's array engines (CI runs it under both; ``array.query-planning``). A composition that
Dask's expression engine itself does not implement (``NotImplementedError`` from Dask, before any dsched code
runs) is skipped there with Dask's reason; everything else must hold on both.
"""

import itertools
import threading

import dask
import dask.array as da
import numpy as np
import pytest

from dsched import StaticHybridScheduler, as_batched, current_device, map_blocks, plan
from dsched.blocks.engines import expression_engine_enabled

EXPRESSIONS = expression_engine_enabled()
N, K = 40, 6
X = np.arange(N * K, dtype=float).reshape(N, K)


@pytest.fixture(autouse=True)
def no_measured_profile(tmp_path_factory, monkeypatch):
    """Plans from priorities: no profile of this host is in effect."""
    monkeypatch.setenv("DSCHED_PROFILE_DIR", str(tmp_path_factory.mktemp("no-profiles")))


def hybrid():
    return StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 8], priorities=[1, 2])


RECORDS = []
_lock = threading.Lock()


def recorded(a, block_info=None):
    """Doubles the block and records its rows, its device and its worker (in-process workers share the list)."""
    from distributed import get_worker

    with _lock:
        RECORDS.append((tuple(block_info[0]["array-location"][0]), str(current_device()), get_worker().name))
    return a * 2.0


def expected(chunks, times=1, rows=None):
    """The records of one run over a batch cut as ``chunks``: each block on its planned device's worker.

    ``rows=(lo, hi)``: only the blocks holding some of those rows (Dask computes no others).
    """
    out, start = [], 0
    for device, m in chunks:
        if rows is None or (start < rows[1] and rows[0] < start + m):
            out.append(((start, start + m), str(device), str(device)))
        start += m
    return sorted(out * times)


_batches = itertools.count(1)


@pytest.fixture
def x():
    """This test's batch: ``X`` shifted by a constant of its own, so that no two tests share keys (a result
    another test left on the cluster would be reused, its blocks not run again)."""
    return X + 1000.0 * next(_batches)


@pytest.fixture
def records():
    with _lock:
        RECORDS.clear()
    yield RECORDS


def planned(x, scheduler=None):
    """``recorded`` mapped over ``x`` cut by the plan: ``2 * x``, each block on its planned device."""
    scheduler = scheduler or hybrid()
    return map_blocks(recorded, as_batched(x, scheduler)[0], scheduler=scheduler, dtype=float)


def build(make, what):
    """``make()``, skipped where Dask's expression engine does not implement ``what`` itself."""
    try:
        return make()
    except NotImplementedError as err:
        if not EXPRESSIONS:
            raise
        pytest.skip(f"Dask's expression engine does not implement {what} ({err or 'NotImplementedError'})")


# --- reductions --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "name, reduce, reference",
    [
        ("sum", lambda y: y.sum(), lambda y: y.sum()),
        ("sum over the batch axis", lambda y: y.sum(axis=0), lambda y: y.sum(axis=0)),
        ("mean over columns", lambda y: y.mean(axis=1), lambda y: y.mean(axis=1)),
        ("max and min", lambda y: da.stack([y.max(axis=0), y.min(axis=0)]), lambda y: np.stack([y.max(0), y.min(0)])),
        ("nansum", lambda y: da.nansum(y, axis=1), lambda y: np.nansum(y, axis=1)),
        ("prod of a slice", lambda y: y[:, :2].prod(axis=1), lambda y: y[:, :2].prod(axis=1)),
        ("std", lambda y: da.std(y, axis=0), lambda y: y.std(axis=0)),
        ("cumsum", lambda y: da.cumsum(y, axis=0), lambda y: y.cumsum(axis=0)),
        ("argmax", lambda y: da.argmax(y, axis=0), lambda y: y.argmax(axis=0)),
    ],
)
def test_reductions_after_the_blocks(x, hybrid_client, records, name, reduce, reference):
    out = build(lambda: reduce(planned(x)), name)
    np.testing.assert_allclose(out.compute(), reference(2 * x))
    assert sorted(records) == expected(plan(N, hybrid()))


# --- joining arrays ----------------------------------------------------------------------------

def test_stack_of_two_planned_maps(x, hybrid_client, records):
    s = hybrid()
    out = da.stack([planned(x, s), planned(x + 1, s)]).compute()
    np.testing.assert_array_equal(out, np.stack([2 * x, 2 * x + 2]))
    assert sorted(records) == expected(plan(N, s), times=2)


def test_concatenate_along_the_batch_axis(x, hybrid_client, records):
    s = hybrid()
    out = da.concatenate([planned(x, s), planned(-x, s)], axis=0)
    assert out.chunks[0] == tuple(m for _, m in plan(N, s)) * 2
    np.testing.assert_array_equal(out.compute(), np.concatenate([2 * x, -2 * x]))
    assert sorted(records) == expected(plan(N, s), times=2)


def test_concatenate_along_the_columns_then_reduce(x, hybrid_client, records):
    s = hybrid()
    out = da.concatenate([planned(x, s), planned(x[:, :2], s)], axis=1).sum(axis=1).compute()
    np.testing.assert_array_equal(out, (2 * x).sum(axis=1) + (2 * x[:, :2]).sum(axis=1))
    assert sorted(records) == expected(plan(N, s), times=2)


# --- element-wise, slicing, rechunking -----------------------------------------------------------

@pytest.mark.parametrize(
    "name, compose, reference, rows",
    [
        ("ufunc and astype", lambda y: np.sin(y).astype(np.float32), lambda y: np.sin(y).astype(np.float32), None),
        ("transpose and clip", lambda y: da.clip(y.T, 10, 200), lambda y: np.clip(y.T, 10, 200), None),
        ("a slice across blocks", lambda y: y[5:30, 1:4] + 1, lambda y: y[5:30, 1:4] + 1, (5, 30)),
        ("rechunked", lambda y: y.rechunk((10, 3)) * 3, lambda y: y * 3, None),
    ],
)
def test_elementwise_slicing_and_rechunking_after_the_blocks(x, hybrid_client, records, name, compose, reference,
                                                            rows):
    out = compose(planned(x))
    np.testing.assert_allclose(out.compute(), reference(2 * x), rtol=1e-6)
    assert sorted(records) == expected(plan(N, hybrid()), rows=rows)


def test_a_planned_map_of_a_slice_is_placed_by_its_own_blocks(x, hybrid_client, records):
    # The input is 2X[10:35], cut by the first plan; rechunk=True cuts it again by the plan of its 25 items.
    s = hybrid()
    sliced = planned(x, s)[10:35]
    out = map_blocks(recorded, sliced, scheduler=s, rechunk=True, dtype=float)
    np.testing.assert_array_equal(out.compute(), 4 * x[10:35])
    assert sorted(records) == sorted(expected(plan(N, s), rows=(10, 35)) + expected(plan(25, s)))


# --- persist, repeated keys, optimize --------------------------------------------------------------

def test_persist_then_compose_runs_every_block_once(x, hybrid_client, records):
    from distributed import wait

    s = hybrid()
    y = planned(x, s).persist()
    wait(y, timeout=60)
    np.testing.assert_array_equal((y + 1).sum(axis=1).compute(), (2 * x + 1).sum(axis=1))
    np.testing.assert_array_equal(da.concatenate([y, y]).max(axis=0).compute(), (2 * x).max(axis=0))
    assert sorted(records) == expected(plan(N, s))  # persisted: computed once, where planned


def test_a_planned_map_over_a_persisted_planned_map(x, hybrid_client, records):
    from distributed import wait

    s = hybrid()
    y = planned(x, s).persist()
    wait(y, timeout=60)
    z = map_blocks(recorded, y, scheduler=s, dtype=float)
    np.testing.assert_array_equal(z.compute(), 4 * x)
    assert sorted(records) == expected(plan(N, s), times=2)


def test_the_same_call_twice_builds_the_same_keys_and_places_both_runs(x, hybrid_client, records):
    s = hybrid()
    first, again = planned(x, s), planned(x, s)
    assert first.name == again.name
    np.testing.assert_array_equal(first.sum(axis=1).compute(), (2 * x).sum(axis=1))
    np.testing.assert_array_equal(again.compute(), 2 * x)
    assert sorted(records) == expected(plan(N, s), times=2)


def test_dask_optimize_then_compute(x, hybrid_client, records):
    (optimized,) = dask.optimize((planned(x) - 1).sum(axis=0))
    np.testing.assert_array_equal(optimized.compute(), (2 * x - 1).sum(axis=0))
    assert sorted(records) == expected(plan(N, hybrid()))


def test_unoptimized_compute_and_client_futures(x, hybrid_client, records):
    s = hybrid()
    (total,) = dask.compute(planned(x, s).sum(), optimize_graph=False)
    assert total == (2 * x).sum()
    future = hybrid_client.compute(planned(x + 1, s).max(axis=1))
    np.testing.assert_array_equal(future.result(timeout=60), (2 * x + 2).max(axis=1))
    assert sorted(records) == expected(plan(N, s), times=2)


def test_two_results_of_one_planned_map_share_its_blocks(x, hybrid_client, records):
    y = planned(x)
    low, high = dask.compute(y.min(axis=1), y.max(axis=1))
    np.testing.assert_array_equal(low, (2 * x).min(axis=1))
    np.testing.assert_array_equal(high, (2 * x).max(axis=1))
    assert sorted(records) == expected(plan(N, hybrid()))  # one graph: each block once


# --- block_info -----------------------------------------------------------------------------------

def located(a, block_info=None):
    """Each row's global index, from ``block_info``, and the device it ran on (recorded)."""
    recorded(a, block_info=block_info)
    start, stop = block_info[None]["array-location"][0]
    return np.arange(start, stop, dtype=float)[:, None] + np.zeros((1, a.shape[1]))


def test_block_info_in_a_composed_graph(x, hybrid_client, records):
    s = hybrid()
    # Input cut 13 a block; rechunk=True cuts it by the plan, and block_info reports the planned blocks.
    y = map_blocks(located, da.from_array(x, chunks=(13, K)), scheduler=s, rechunk=True, dtype=float)
    out = da.concatenate([y, y + N]).sum(axis=1).compute()
    np.testing.assert_array_equal(out, K * np.arange(2.0 * N))
    assert sorted(records) == expected(plan(N, s))


# --- Zarr -----------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:The array uses irregular chunk sizes:UserWarning")
def test_to_zarr(x, hybrid_client, records, tmp_path):
    zarr = pytest.importorskip("zarr")
    build(lambda: da.to_zarr(planned(x), str(tmp_path / "out.zarr")), "da.to_zarr")
    np.testing.assert_array_equal(zarr.open_array(str(tmp_path / "out.zarr"), mode="r")[:], 2 * x)
    assert sorted(records) == expected(plan(N, hybrid()))


def written(a, path, block_info=None):
    """Writes the block's rows into the Zarr array at ``path`` from its worker; returns the rows written."""
    import zarr

    doubled = recorded(a, block_info=block_info)
    start, stop = block_info[0]["array-location"][0]
    zarr.open_array(path, mode="r+")[start:stop] = doubled
    return np.full(len(a), stop - start)


def test_planned_blocks_write_their_rows_to_zarr_on_their_devices(x, hybrid_client, records, tmp_path):
    zarr = pytest.importorskip("zarr")
    s = hybrid()
    path = str(tmp_path / "regions.zarr")
    chunks = tuple(m for _, m in plan(N, s))
    # One row a Zarr chunk: concurrent blocks never write into the same chunk.
    zarr.create_array(path, shape=x.shape, chunks=(1, K), dtype=float, fill_value=np.nan)
    counts = map_blocks(written, as_batched(x, s)[0], path, scheduler=s, drop_axis=1, dtype=int).compute()
    np.testing.assert_array_equal(counts, np.repeat(chunks, chunks))
    np.testing.assert_array_equal(zarr.open_array(path, mode="r")[:], 2 * x)
    assert sorted(records) == expected(plan(N, s))


# --- xarray ---------------------------------------------------------------------------------------

def test_xarray_arithmetic_selection_and_persist(x, hybrid_client, records):
    xr = pytest.importorskip("xarray")
    s = hybrid()
    a = xr.DataArray(planned(x, s), dims=("item", "component"), coords={"item": np.arange(N)})
    # .compute() first: .values of an expression-engine array is not NumPy (xarray 2026.9, dask 2026.8).
    np.testing.assert_array_equal((a + 1).isel(item=slice(5, 30)).compute().values, 2 * x[5:30] + 1)
    kept = a.persist()
    np.testing.assert_array_equal((kept * 2).compute().values, 4 * x)
    # The blocks holding rows 5 to 30 for the first result, then every block for persist.
    assert sorted(records) == sorted(expected(plan(N, s), rows=(5, 30)) + expected(plan(N, s)))


def test_xarray_apply_ufunc_with_a_planned_map(x, hybrid_client, records):
    xr = pytest.importorskip("xarray")
    s = hybrid()
    a = xr.DataArray(as_batched(x, s)[0], dims=("item", "component"))
    out = xr.apply_ufunc(lambda d: map_blocks(recorded, d, scheduler=s, dtype=float), a, dask="allowed")
    np.testing.assert_array_equal(out.compute().values, 2 * x)
    assert sorted(records) == expected(plan(N, s))


def test_xarray_reductions(x, hybrid_client, records):
    xr = pytest.importorskip("xarray")
    a = xr.DataArray(planned(x), dims=("item", "component"))
    total = build(lambda: a.sum("component", skipna=False), "np.sum through __array_function__").compute().values
    np.testing.assert_array_equal(total, (2 * x).sum(axis=1))
    assert sorted(records) == expected(plan(N, hybrid()))
