"""Shared fixtures: one emulated CPU + CUDA cluster per test module, and GPU detection."""

import os
import signal
import tempfile

import pytest

# Tests must not read (or write) a user's measured profiles: plan() would follow them.
os.environ["DSCHED_PROFILE_DIR"] = tempfile.mkdtemp(prefix="dsched-test-profiles-")


# A test run started in the background of a non-interactive shell inherits SIGINT ignored, and so would the
# processes the Ctrl-C tests start (they would never see their Ctrl-C): give them the terminal's default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _have_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAVE_GPU = _have_gpu()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU and CuPy")
    for item in items:
        # The marker, not ``item.keywords``: keywords also hold parameter ids such as "gpu".
        if item.get_closest_marker("gpu") is not None and not HAVE_GPU:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def hybrid_client():
    """A Client on an in-process LocalHybridCluster with a CPU and an emulated cuda:0."""
    from distributed import Client

    from dsched import LocalHybridCluster

    with LocalHybridCluster(["cpu", "cuda:0"], emulate=True, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield client


@pytest.fixture(scope="module")
def process_client():
    """Worker processes: a CPU and an emulated cuda:0 (NumPy on the CPU), one thread each, restarted by
    their nannies if killed."""
    from distributed import Client

    from dsched import LocalHybridCluster

    with LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, threads_per_worker=1,
                            dashboard_address=None) as cluster:
        with Client(cluster) as client:
            yield client
