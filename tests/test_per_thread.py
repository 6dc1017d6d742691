"""Per-thread models (dsched.per_thread) and compute threads per worker (dsched.threads)."""

import pickle
import threading

import numpy as np
import pytest

import dsched
from dsched.per_thread import PerThread
from dsched.threads import ThreadLimits, apply_thread_limit, thread_share, user_thread_settings

BUILDS = []  # (thread id, device) of every model built, in this process


class _StatefulModel:
    """Keeps per-call state on the object, as NEML2's implicit updates do: unsafe to share between threads."""

    def __init__(self, device):
        self.owner = threading.get_ident()
        self.device = device
        BUILDS.append((self.owner, str(device)))

    def __call__(self, x):
        assert threading.get_ident() == self.owner, "a model was used by a thread that did not build it"
        self.last = x  # state on the object
        return x * 2.0


def test_each_thread_and_device_builds_its_model_once(hybrid_client):
    BUILDS.clear()
    model = PerThread(_StatefulModel)
    x = np.arange(200.0)
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [7, 9])  # 23 to 29 chunks; cuda:0 emulated: placement only
    dispatcher = dsched.WorkDispatcher(s, lambda w, device: model(w), reduce=dsched.concat_reduce,
                                       client=hybrid_client)
    with dispatcher:
        y = dispatcher.run(dsched.ArrayLoader(x))
    assert np.array_equal(y, 2 * x)
    assert len(BUILDS) == len(set(BUILDS))  # never twice for one thread and device
    assert {device for _, device in BUILDS} == {"cpu", "cuda:0"}
    assert len(BUILDS) <= 4  # two workers of two threads, whatever the number of chunks
    assert len(dispatcher.last_run.records) >= 200 // 9 + 1  # far more chunks than models built


def test_a_pickled_copy_finds_the_model_its_thread_built():
    model = PerThread(_StatefulModel)
    first = model.get("cpu")
    copy = pickle.loads(pickle.dumps(model))
    assert copy.get("cpu") is first
    assert copy.get("cuda:0") is not first  # another device, another model


def test_per_thread_models_work_as_dispatch_functions():
    model = PerThread(lambda device: np.negative)
    y = dsched.dispatch(model, np.arange(5.0), scheduler=dsched.SimpleScheduler("cpu", 2), mode="sync")
    assert y.tolist() == [-0.0, -1.0, -2.0, -3.0, -4.0]
    with pytest.raises(ValueError, match=r"build: expected a callable build\(device\) -> model, got 3"):
        PerThread(3)


# --- compute threads ----------------------------------------------------------------


FREED_BY = []  # the names of the threads that freed a _Freed model


class _Freed:
    """A model that records which thread freed it."""

    def __init__(self, device):
        pass

    def __del__(self, record=FREED_BY.append, thread=threading.current_thread):  # still there at exit
        record(thread().name)


def test_a_thread_that_ends_leaves_its_models_to_a_thread_that_goes_on():
    """A thread ending as the interpreter shuts down must not free a torch model (it would let go of the GIL in
    C++ and abort the process): its models are freed by the next lookup, in a thread that goes on, or at exit."""
    from dsched.devices import per_thread

    FREED_BY.clear()
    model = PerThread(_Freed)
    worker = threading.Thread(target=model.get, args=("cpu",), name="ending")
    worker.start()
    worker.join()
    assert FREED_BY == [] and len(per_thread._ENDED) == 1  # handed over, not freed by "ending"
    PerThread(_Freed).get("cpu")  # any lookup, here in the main thread, frees what ended threads left
    assert FREED_BY == ["MainThread"] and per_thread._ENDED == []


def test_thread_share_divides_the_cores_among_worker_threads():
    assert thread_share(4, cores=2) == 1
    assert thread_share(3, cores=16) == 5
    assert thread_share(1, cores=16) == 16
    with pytest.raises(ValueError, match="threads: expected an integer >= 1, got 0"):
        ThreadLimits(0)


def test_chunk_threads_of_in_process_workers_limit_torch_threads(hybrid_client):
    pytest.importorskip("torch", reason="torch is not installed (pip install 'dsched[neml2]')")
    if user_thread_settings():
        pytest.skip("the user's OMP_NUM_THREADS / MKL_NUM_THREADS take precedence")
    # torch's thread count belongs to each thread (OpenMP): it is set in the threads that run chunks.
    y = dsched.dispatch(_threads_seen, np.zeros(8), scheduler=dsched.SimpleScheduler("cpu", 4), client=hybrid_client)
    assert y.tolist() == [thread_share(4)] * 8  # two workers of two threads (conftest)


def _threads_seen(x):
    import torch

    return np.full(len(x), float(torch.get_num_threads()))


def test_a_user_setting_is_left_alone_but_not_dasks(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    plugin = ThreadLimits(1)
    plugin.setup(worker=None)
    assert plugin.applied == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Dask's nanny leaves in the process that starts workers
    assert "OMP_NUM_THREADS" not in user_thread_settings()


def test_worker_processes_get_their_share_before_torch_is_imported():
    from distributed import Client

    pytest.importorskip("torch", reason="torch is not installed (pip install 'dsched[neml2]')")
    if user_thread_settings():
        pytest.skip("the user's OMP_NUM_THREADS / MKL_NUM_THREADS take precedence")
    with dsched.LocalHybridCluster(["cpu"], processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            threads = client.submit(_torch_threads_after_import, pure=False).result()
    assert threads == thread_share(1)


def _torch_threads_after_import():
    import torch

    return torch.get_num_threads()


def test_apply_thread_limit_reports_what_it_set():
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'dsched[neml2]')")
    before = torch.get_num_threads()
    try:
        assert apply_thread_limit(1, own_process=False)["torch"] == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_worker_processes_get_glibc_mmap_threshold_back():
    import platform

    from dsched.threads import restore_mmap_threshold

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert restore_mmap_threshold() is True


def test_a_thread_is_limited_once_torch_is_whole_not_while_another_thread_imports_it(monkeypatch):
    # While one worker thread imports torch, sys.modules holds it half made (no set_num_threads yet): another
    # thread's chunk must go on, and be limited on its next call, once torch is whole.
    import sys
    import types

    from dsched.devices import threads

    calls = []
    half_made = types.ModuleType("torch")
    monkeypatch.setitem(sys.modules, "torch", half_made)
    monkeypatch.setattr(threads, "_share", 3)
    monkeypatch.setattr(threads, "_applied", threading.local())
    threads.limit_this_thread()
    assert calls == [] and getattr(threads._applied, "threads", None) is None
    half_made.set_num_threads = calls.append  # the import finished
    threads.limit_this_thread()
    threads.limit_this_thread()  # once per thread
    assert calls == [3]
