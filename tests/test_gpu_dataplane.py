"""The data plane on a real GPU: page-locked shared inputs, a CUDA stream per chunk, results written in place.

Marked ``gpu``: skipped on machines without a CUDA GPU and CuPy.
"""

import numpy as np
import pytest

import dsched

pytestmark = pytest.mark.gpu


def test_pinned_segment_is_registered_once_and_sliced_without_copy():
    from dsched.dataplane.segments import _pinned
    from dsched.store import RunStore, pinned_segment

    with RunStore(shared=True) as store:
        ref = store.share(np.arange(4096.0).reshape(1024, 4))
        view = ref.rows(10, 20, pinned=True)
        np.testing.assert_array_equal(view, np.arange(4096.0).reshape(1024, 4)[10:20])
        assert (ref.token, False) in _pinned  # inputs: a read-only mapping, registered once
        assert pinned_segment(ref.token, False) is pinned_segment(ref.token, False)


def test_chunk_stream_is_a_cuda_stream_of_the_chunk():
    import cupy

    from dsched.transfer import chunk_stream

    with chunk_stream("cuda:0") as stream:
        assert stream is not None and cupy.cuda.get_current_stream() == stream
    with chunk_stream("cpu") as none:
        assert none is None


def test_dispatch_j2_on_the_gpu_equals_numpy():
    from distributed import Client

    from dsched.models import j2_update, loading_strain

    n = 300_000
    strain, zeros6, zeros = loading_strain(np.arange(n)), np.zeros((n, 6)), np.zeros(n)
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        scheduler = dsched.StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[8192, 65536],
                                                 capacities=[16384, 131072], priorities=[1, 2])
        out = dsched.dispatch(lambda e, p, a: j2_update(e, p, a), strain, zeros6, zeros, scheduler=scheduler,
                              client=client)
    expected = j2_update(strain, zeros6, zeros)
    for name, values in expected.items():
        np.testing.assert_allclose(out[name], values, rtol=1e-12, atol=1e-12)


def test_dispatch_leaves_a_cupy_result_on_the_gpu_only_for_a_slot_that_copies_it():
    """A chunk whose slot copies its result into page-locked rows gets dispatch's CuPy result as it is: brought
    to host memory first, it would land in fresh pageable memory (a pageable copy's speed) and be copied again."""
    import cupy

    from dsched.dataplane.pinned import slot_copies_from_gpu
    from dsched.dispatch.arguments import ArgsLayout
    from dsched.dispatch.front import _chunk_call

    x = np.arange(12.0).reshape(6, 2)
    layout = ArgsLayout((x,))
    call, chunk = _chunk_call(lambda a: 2 * a, layout, {}), {"args[0]": x}
    with slot_copies_from_gpu(True):
        kept = call(chunk, "cuda:0")
    brought = call(chunk, "cuda:0")
    assert isinstance(kept, cupy.ndarray) and isinstance(brought, np.ndarray)
    np.testing.assert_array_equal(kept.get(), 2 * x)
    np.testing.assert_array_equal(brought, 2 * x)
