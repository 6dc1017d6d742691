"""Dask's own ``map_blocks`` tests, run through ``dsched.map_blocks`` on a real Client.

The test functions below are Dask's, imported unchanged from the installed wheel
(``dask/array/tests/``, dask 2026.8.0, BSD-3-Clause, Copyright (c) Anaconda, Inc. and
contributors): every test function there whose body calls ``map_blocks``. pytest collects
them here, with their own parametrizations. An autouse fixture routes ``da.map_blocks``,
``Array.map_blocks`` and the modules' own ``map_blocks`` name to ``dsched.map_blocks``, and
makes ``assert_eq`` compute on the Client (an in-process ``LocalHybridCluster`` with a CPU
worker and an *emulated* cuda:0 worker: NumPy on the CPU, for placement only). Each test runs
twice: under a ``SimpleScheduler`` and under a ``StaticHybridScheduler``.

Cases a plan cannot honour are marked ``xfail(strict=True)`` in ``CANNOT_HONOUR``, each with its
reason (documented in docs/array.md). Tests that need a package not installed here (pandas,
sparse, xarray, cupy) skip as they do upstream.

Under ``DASK_ARRAY__QUERY_PLANNING=True`` (Dask's expression engine; CI runs this file under both
settings) ``test_array_core`` is loaded with its module-level skip lifted (``GUARDED``), and the
cases that need something the expression engine itself lacks, outside ``map_blocks``, are marked
``xfail(strict=True)`` in ``EXPRESSION_ENGINE_LACKS``.
"""

import functools
import importlib
import importlib.util
import os

import dask.array as da
import pytest
from dask.array.utils import assert_eq as dask_assert_eq

import dsched
from dsched.blocks.engines import expression_engine_enabled

EXPRESSIONS = expression_engine_enabled()  # array.query-planning: Dask's expression engine

# module -> the test functions there whose body calls map_blocks (found by reading their source).
UPSTREAM = {
    "test_array_core": [
        "test_map_blocks", "test_map_blocks2", "test_map_blocks_block_info",
        "test_map_blocks_block_info_with_new_axis", "test_map_blocks_block_info_with_drop_axis",
        "test_map_blocks_block_info_with_broadcast", "test_map_blocks_with_constants",
        "test_map_blocks_with_kwargs", "test_map_blocks_infer_chunks_broadcast", "test_map_blocks_with_chunks",
        "test_map_blocks_dtype_inference", "test_map_blocks_infer_newaxis", "test_map_blocks_no_array_args",
        "test_map_blocks_unique_name_enforce_dim", "test_map_blocks_unique_name_chunks_dtype",
        "test_map_blocks_unique_name_drop_axis", "test_map_blocks_unique_name_new_axis",
        "test_map_blocks_optimize_blockwise", "test_repr_meta", "test_map_blocks3",
        "test_map_blocks_with_changed_dimension", "test_map_blocks_with_negative_drop_axis",
        "test_map_blocks_with_invalid_drop_axis", "test_map_blocks_custom_name",
        "test_map_blocks_with_changed_dimension_and_broadcast_chunks", "test_map_blocks_name",
        "test_map_blocks_delayed", "test_dask_array_holds_scipy_sparse_containers", "test_scipy_sparse_indexing",
        "test_scipy_sparse_concatenate", "test_map_blocks_large_inputs_delayed", "test_map_blocks_chunks",
        "test_no_warnings_from_blockwise", "test_map_blocks_series", "test_map_blocks_dataframe",
        "test_chunk_shape_broadcast", "test_chunk_non_array_like", "test_store_sources_unoptimized_nocompute",
    ],
    "test_array_function": ["test_array_function_sparse"],
    "test_atop": ["test_blockwise_numpy_arg"],
    "test_creation": ["test_like_forgets_graph"],
    "test_cupy_linalg": ["test_cholesky"],
    "test_cupy_sparse": ["test_sparse_hstack_vstack_csr", "test_sparse_concatenate", "test_sparse_dot"],
    "test_gufunc": ["test_preserve_meta_type"],
    "test_map_blocks": ["test_map_blocks_block_id_fusion"],
    "test_masked": ["test_mixed_random"],
    "test_overlap": [
        "test_map_overlap_escapes_to_map_blocks_when_depth_is_zero", "test_map_overlap_multiarray_defaults",
        "test_no_shared_keys_with_different_depths",
    ],
    "test_sparse": ["test_basic", "test_tensordot", "test_metadata", "test_html_repr", "test_map_blocks"],
    "test_xarray": ["test_shared_tasks"],
}

# test (without the scheduler mode) -> why it cannot pass here. Each is documented in docs/array.md.
CANNOT_HONOUR = {
    # Not a plan's doing: its function closes over a threading.Lock, which no Client can ship to a
    # worker (plain dask.array.map_blocks fails the same on this Client; see
    # test_a_function_holding_a_lock_cannot_reach_any_client_worker).
    "test_test_xarray__shared_tasks": "the test's function holds a threading.Lock, which does not pickle for a Client",
}


# Under the expression engine these modules skip themselves at import ("parametrize using unsupported
# functions": some of their *other* tests are parametrized over functions it lacks). Their map_blocks tests
# are the core of the port, so they are loaded with that one guard lifted, the rest unchanged.
GUARDED = {"test_array_core": '    pytest.skip("parametrize using unsupported functions", allow_module_level=True)\n'}


def _import(short):
    """Dask's test module ``short``; under the expression engine, a guarded one with its guard lifted."""
    name = f"dask.array.tests.{short}"
    if not (EXPRESSIONS and short in GUARDED):
        return importlib.import_module(name)
    import types

    spec = importlib.util.find_spec(name)
    with open(spec.origin) as file:
        source = file.read()
    assert source.count(GUARDED[short]) == 1, f"{short}: its expression-engine guard changed"
    module = types.ModuleType(name)
    module.__file__ = spec.origin
    exec(compile(source.replace(GUARDED[short], "    pass\n"), spec.origin, "exec"), module.__dict__)
    return module


_ASSIGNMENT = "item assignment (x[mask] = 0, in the test's own setup)"
# Under the expression engine only: test (or case) -> what the test needs, outside map_blocks, that Dask's
# expression engine lacks (dask 2026.8). Dask's own map_blocks fails each the same way on this Client (run
# DSCHED_UPSTREAM_ROUTE=dask DASK_ARRAY__QUERY_PLANNING=True pytest tests/test_map_blocks_upstream.py).
EXPRESSION_ENGINE_LACKS = {
    "test_test_masked__mixed_random": _ASSIGNMENT,
    "test_test_array_core__dask_array_holds_scipy_sparse_containers": _ASSIGNMENT,
    "test_test_array_core__scipy_sparse_indexing": _ASSIGNMENT,
    "test_test_array_core__scipy_sparse_concatenate": _ASSIGNMENT,
    "test_test_creation__like_forgets_graph[arange]": "arange(like=x) keeps x's graph (the test pickles it)",
    "test_test_creation__like_forgets_graph[inner_func]": "da.tri",
    "test_test_array_core__map_blocks_optimize_blockwise": "a HighLevelGraph (the test reads its .layers)",
    "test_test_array_core__map_blocks_delayed": "a HighLevelGraph (the test calls .dask.validate())",
    "test_test_map_blocks__map_blocks_block_id_fusion": "low-level blockwise fusion (the test counts fused tasks)",
    "test_test_array_core__map_blocks_large_inputs_delayed": "a large argument held once in the graph (the engine "
                                                             "embeds it in every task; the test counts it)",
    "test_test_array_core__store_sources_unoptimized_nocompute": "da.store",
    "test_test_array_core__repr_meta": "'chunktype=' in an array's repr",
    "test_test_array_core__no_warnings_from_blockwise": "Array.dot",
    "test_test_array_core__map_blocks3": "nothing of map_blocks: the test calls dask.array.core.map_blocks, the "
                                         "classic engine's own, on expression arrays",
}


def _load():
    modules, tests = {}, {}
    for short, names in UPSTREAM.items():
        try:
            module = _import(short)
        except pytest.skip.Exception:  # the module itself needs a package not installed here
            continue
        modules[short] = module
        for name in names:
            tests[f"test_{short}__{name[len('test_'):]}"] = _routed(getattr(module, name))
    return modules, tests


CALLS = []  # the functions the running test passed to map_blocks


def _routed(test):
    """``test``, then a check that it reached ``dsched.map_blocks`` (skips raise before it)."""

    @functools.wraps(test)  # keeps the signature (fixtures, parameters) and the marks
    def routed_test(*args, **kwargs):
        test(*args, **kwargs)
        assert CALLS, f"{test.__name__} never called map_blocks"

    return routed_test


MODULES, _TESTS = _load()

# DSCHED_UPSTREAM_ROUTE=dask runs the same cases through Dask's own map_blocks (a measurement of what
# Dask itself passes on this Client, not a test of dsched): the baseline EXPRESSION_ENGINE_LACKS is checked
# against.
ROUTE = os.environ.get("DSCHED_UPSTREAM_ROUTE", "dsched")
DASK_MAP_BLOCKS = da.map_blocks
globals().update(_TESTS)


def schedulers():
    return {
        "simple": dsched.SimpleScheduler("cpu", 4),
        "hybrid": dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[3, 8], priorities=[1, 2]),
    }


@pytest.fixture(autouse=True, params=["simple", "hybrid"])
def routed(request, hybrid_client, monkeypatch, tmp_path_factory):
    """``map_blocks`` is dsched's, and ``assert_eq`` computes on the Client, for one test."""
    monkeypatch.setenv("DSCHED_PROFILE_DIR", str(tmp_path_factory.mktemp("no-profiles")))
    name = request.node.name.split("[")[0]
    params = request.node.callspec.id if hasattr(request.node, "callspec") else ""
    case = f"{name}[{params}]".replace(f"{request.param}-", "").replace(f"-{request.param}", "").replace(
        f"[{request.param}]", "")
    reason = CANNOT_HONOUR.get(case) or CANNOT_HONOUR.get(name)
    lacks = EXPRESSIONS and (EXPRESSION_ENGINE_LACKS.get(case) or EXPRESSION_ENGINE_LACKS.get(name))
    if lacks:
        reason = f"Dask's expression engine lacks {lacks}"
    if reason:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=True))
    scheduler = schedulers()[request.param]
    CALLS.clear()

    def map_blocks(func, *args, **kwargs):
        CALLS.append(func)
        if ROUTE == "dask":  # the baseline: Dask's own map_blocks on the same Client
            return DASK_MAP_BLOCKS(func, *args, **kwargs)
        return dsched.map_blocks(func, *args, scheduler=scheduler, **kwargs)

    def map_blocks_method(self, func, *args, **kwargs):
        return map_blocks(func, self, *args, **kwargs)

    monkeypatch.setattr(da, "map_blocks", map_blocks)
    monkeypatch.setattr(da.Array, "map_blocks", map_blocks_method)
    # Some modules build classic arrays through dask.array.core's own names under either setting.
    monkeypatch.setattr(importlib.import_module("dask.array.core").Array, "map_blocks", map_blocks_method)
    for module in MODULES.values():
        if getattr(module, "map_blocks", None) is not None:
            monkeypatch.setattr(module, "map_blocks", map_blocks)
        if getattr(module, "assert_eq", None) is dask_assert_eq:
            monkeypatch.setattr(module, "assert_eq", functools.partial(_assert_eq_on, hybrid_client))
    # map_overlap (tested here for its map_blocks path) calls its module's own map_blocks.
    monkeypatch.setattr(importlib.import_module("dask.array.overlap"), "map_blocks", map_blocks)
    if EXPRESSIONS:  # the expression engine's map_overlap has its own module
        monkeypatch.setattr(importlib.import_module("dask.array._array_expr._overlap"), "map_blocks", map_blocks)
    yield scheduler


def _assert_eq_on(client, a, b, *args, scheduler=None, **kwargs):
    return dask_assert_eq(a, b, *args, scheduler=client if scheduler in (None, "sync") else scheduler, **kwargs)


@pytest.fixture
def xfail(request):
    """Dask's conftest fixture: mark the running test as an expected failure."""
    return lambda reason: request.applymarker(pytest.mark.xfail(reason=reason))


def test_a_function_holding_a_lock_cannot_reach_any_client_worker(routed, hybrid_client):
    """Why test_shared_tasks cannot pass on a Client: Dask's own map_blocks fails there the same way."""
    import threading

    import numpy as np
    from dask.array.core import map_blocks as dask_map_blocks

    lock = threading.Lock()

    def locked(a):
        with lock:
            return a

    x = da.zeros((5, 5), chunks=2)
    if EXPRESSIONS:  # the expression engine tokenizes the function deterministically: both refuse to build
        from dask.tokenize import TokenizationError

        for build in (lambda: DASK_MAP_BLOCKS(locked, x, dtype=x.dtype),
                      lambda: dsched.map_blocks(locked, x, scheduler=routed, dtype=x.dtype)):
            with pytest.raises(TokenizationError, match="cannot be deterministically hashed"):
                build()
        return
    for y in (dask_map_blocks(locked, x, dtype=x.dtype), dsched.map_blocks(locked, x, scheduler=routed, dtype=x.dtype)):
        with pytest.raises(TypeError, match="Could not serialize object of type _HLGExprSequence"):
            hybrid_client.compute(y).result()
    np.testing.assert_array_equal(dsched.map_blocks(locked, x, scheduler=routed).compute(scheduler="sync"),
                                  np.zeros((5, 5)))
