"""Screenshots of the dsched dashboard page for the docs: ``python docs/img/screenshots.py``.

A CPU and an emulated cuda:0 worker (processes) on each of two hosts, the loopback
addresses 127.0.0.2 and 127.0.0.3 standing in for two nodes. Each chunk sleeps
n / rate (50,000 items/s on a CPU, 200,000 on a cuda:0), which leaves this
machine's cores to the browser: the pictures show scheduling, not a GPU. Needs
headless Chromium (``apt-get install chromium``); drives it with the test suite's
helper.
"""

import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

N = 16_000_000
RATES = {"cpu": 50_000, "cuda": 200_000}  # items/s of the emulated devices


def sleepy(x):
    """An emulated device of known speed: sleeps n / rate."""
    import dsched

    time.sleep(len(x) / RATES[dsched.current_device().type])
    return -x


def main():
    import numpy as np
    from distributed import Client, Nanny, Scheduler, SpecCluster

    import dsched
    from dsched.dashboard import PAGE_ROUTE, PLOT_ROUTES, DashboardPlugin, register_page, track_run
    from test_dashboard import browse

    register_page()  # before the scheduler builds its dashboard
    workers = {}
    for host in ("127.0.0.2", "127.0.0.3"):
        for device, extra, capacity in (("cpu", {}, 100_000), ("cuda:0", {"dsched-emulated": 1}, 400_000)):
            workers[f"{device}@{host}"] = {"cls": Nanny, "options": {
                "host": host, "nthreads": 2, "dashboard": False, "name": f"{device}@{host}",
                "resources": {f"dsched-{device}": capacity, **extra}}}
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0",
                                                "plugins": [DashboardPlugin()]}}
    policy = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [25_000, 100_000], [100_000, 400_000], [1, 2])
    with SpecCluster(workers=workers, scheduler=scheduler) as cluster, Client(cluster) as client:
        client.wait_for_workers(4)
        base = dsched.dashboard.dashboard_link(client).rsplit(PAGE_ROUTE, 1)[0]
        with track_run(client, 200_000, name="warm-up"):  # an earlier run, for the history
            dsched.dispatch(sleepy, np.arange(200_000.0), scheduler=policy, client=client)

        def run():
            with track_run(client, N, name=f"sleep n/rate, {N:,} items"):
                dsched.dispatch(sleepy, np.arange(float(N)), scheduler=policy, client=client)

        thread = threading.Thread(target=run)

        def page_ready(data):
            return data.get("progress", {}).get("total") == [200_000]

        def half_done(data):
            fraction = data.get("progress", {}).get("fraction", [None])[0]
            return data["progress"]["total"] == [N] and fraction is not None and fraction >= 0.45

        browse(base + PAGE_ROUTE, [(page_ready, thread.start), (half_done, None)], timeout=300,
               screenshot=HERE / "dsched-dashboard.png", window=(1400, 1330))
        thread.join()
        browse(base + PLOT_ROUTES["timeline"], [(lambda data: True, None)], timeout=60,
               screenshot=HERE / "dsched-timeline.png", window=(1300, 520))


if __name__ == "__main__":
    main()
