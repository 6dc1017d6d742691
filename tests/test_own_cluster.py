"""A dispatcher with no client and no default client starts a cluster of its own (kept apart from
the other modules, whose shared cluster's client is the default while they run)."""

from dsched import SimpleScheduler, SliceGenerator, WorkDispatcher, current_device


def device_and_worker(work, device):
    from distributed import get_worker

    return str(current_device()), get_worker().name


def test_a_dispatcher_s_own_cluster_is_not_the_default_client():
    options = {"emulate": True, "dashboard_address": None}
    with WorkDispatcher(SimpleScheduler("cpu", 4), device_and_worker, cluster_options=options) as on_cpu:
        assert on_cpu.run(SliceGenerator(0, 8)) == [("cpu", "cpu")] * 2
        # A second dispatcher over another device starts its own cluster instead of using the first's.
        with WorkDispatcher(SimpleScheduler("cuda:0", 4), device_and_worker, cluster_options=options) as on_gpu:
            assert on_gpu.run(SliceGenerator(0, 8)) == [("cuda:0", "cuda:0")] * 2
            assert on_gpu.client is not on_cpu.client
