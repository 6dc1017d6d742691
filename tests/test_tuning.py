"""Sub-batch tuning: the saturation fit, a real sweep of synthetic devices, recommendations, profiles, the plot."""

import json
import time

import numpy as np
import pytest

from dsched import Device, SimpleScheduler, StaticHybridScheduler
from dsched.tuning import (
    SaturationFit,
    TuningWorkload,
    fit_saturation,
    format_tuning,
    load_profile,
    profile_path,
    profile_settings,
    profile_speeds,
    recommend,
    run_tuning,
    saturation_time,
)

SIZES = [64 * 2**i for i in range(10)]  # 64 .. 32768, as a doubling sweep visits them


@pytest.mark.parametrize("t0, n_star", [(0.01, 1000), (0.004, 3000), (0.5, 100), (0.02, 20000)])
def test_fit_recovers_exact_parameters_between_sweep_points(t0, n_star):
    fit = fit_saturation(SIZES, saturation_time(SIZES, t0, n_star))
    assert fit.t0 == pytest.approx(t0, rel=1e-6)
    assert fit.n_star == pytest.approx(n_star, rel=1e-6)
    assert fit.saturated and fit.rms_log_error < 1e-6
    assert fit.peak_items_per_s == pytest.approx(n_star / t0, rel=1e-6)


def test_fit_within_ten_percent_under_five_percent_noise():
    rng = np.random.default_rng(7)
    for t0, n_star in [(0.01, 1500), (0.002, 700), (0.05, 9000)]:
        seconds = np.array(saturation_time(SIZES, t0, n_star)) * np.exp(rng.normal(0.0, 0.05, len(SIZES)))
        fit = fit_saturation(SIZES, seconds)
        assert fit.t0 == pytest.approx(t0, rel=0.1)
        assert fit.n_star == pytest.approx(n_star, rel=0.1)


def test_fit_says_when_the_sweep_never_saturated():
    flat = fit_saturation([64, 128, 256], [0.01, 0.01, 0.01])  # still in the flat part
    assert not flat.saturated and flat.t0 == pytest.approx(0.01)
    assert flat.n_star >= 256


@pytest.mark.parametrize("sizes, seconds, message", [
    ([64], [0.1], "batch_sizes: expected at least two sizes"),
    ([64, 128], [0.1], "batch_sizes: expected at least two sizes matching the times, got 2 sizes and 1 times"),
    ([64, 128], [0.1, 0.0], "seconds: every batch size must be >= 1 and every time positive"),
])
def test_fit_rejects_bad_input(sizes, seconds, message):
    with pytest.raises(ValueError, match=message):
        fit_saturation(sizes, seconds)


def test_recommendation_rules():
    slow = SaturationFit(t0=0.05, n_star=1000.2, rms_log_error=0.0, saturated=True)
    assert recommend(slow) == (1001, 2002)  # N*, two chunks
    fast = SaturationFit(t0=0.005, n_star=1000, rms_log_error=0.0, saturated=True)
    assert recommend(fast, min_chunk_time=0.02) == (4000, 8000)  # 4x N* so a chunk takes 20 ms
    # A 50 ms round trip behind 20 ms chunks: three more chunks queued behind the running one.
    assert recommend(fast, min_chunk_time=0.02, gap=0.05) == (4000, 16000)


# --- a real sweep of synthetic devices on the emulated cluster ------------------------

# (t0 seconds, N*); t0 of 40-50 ms keeps sleep's overshoot on a loaded machine (a few ms when the
# whole suite runs on two cores) well below the 10% the fit must meet.
SYNTHETIC = {"cpu": (0.04, 1000), "cuda:0": (0.05, 3000)}


def synthetic_device(work, device):
    """A device of known saturation: sleeps t(N) (emulation; nothing is computed)."""
    t0, n_star = SYNTHETIC[str(device)]
    time.sleep(saturation_time(work.stop - work.start, t0, n_star))


@pytest.fixture(scope="module")
def tuned(hybrid_client, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tuning")
    result = run_tuning(
        TuningWorkload("synthetic", synthetic_device), ["cpu", "cuda:0"], client=hybrid_client,
        start=256, min_time=0.0, min_repeats=3, png_path=folder / "throughput.png", profile_dir=folder / "profiles",
        host="testhost",
    )
    return result, folder


def test_sweep_recovers_t0_and_n_star_of_synthetic_devices_within_ten_percent(tuned):
    result, _ = tuned
    assert list(result.devices) == [Device("cpu"), Device("cuda:0")]
    for device, (t0, n_star) in SYNTHETIC.items():
        tuning = result.devices[Device(device)]
        assert tuning.fit.t0 == pytest.approx(t0, rel=0.1)
        assert tuning.fit.n_star == pytest.approx(n_star, rel=0.1)
        assert tuning.fit.saturated
        sizes = [p.batch_size for p in tuning.points]
        assert sizes[:3] == [256, 512, 1024] and all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
        # Stopped after three doublings that doubled the time: nothing past saturation is wasted.
        assert sizes[-1] == 8 * 2 ** int(np.ceil(np.log2(n_star)))
        assert all(len(p.samples) == 3 for p in tuning.points)
    cpu, cuda = result.devices[Device("cpu")], result.devices[Device("cuda:0")]
    assert not cpu.emulated and cuda.emulated
    # Chunks of N* already take 20 ms or more, so N* is the recommended batch size.
    assert cpu.batch_size == pytest.approx(1000, rel=0.1) and cpu.capacity >= 2 * cpu.batch_size
    assert cuda.batch_size == pytest.approx(3000, rel=0.1) and cuda.capacity >= 2 * cuda.batch_size
    assert cuda.items_per_s == pytest.approx(3000 / 0.05, rel=0.1)
    table = format_tuning(result)
    assert "cuda:0     yes" in table and "not a GPU measurement" in table


def test_profile_is_saved_per_host_and_model_and_read_back_as_speeds(tuned, monkeypatch):
    result, folder = tuned
    path = folder / "profiles" / "testhost" / "synthetic.json"
    assert result.profile_path == str(path)
    data = json.loads(path.read_text())
    assert data["model"] == "synthetic" and data["host"] == "testhost"
    assert data["devices"]["cuda:0"]["emulated"] is True
    assert data["devices"]["cpu"]["batch_size"] == result.devices[Device("cpu")].batch_size

    both = StaticHybridScheduler(["cpu", "cuda:0"], batch_sizes=[4, 8])
    speeds = profile_speeds(both, "synthetic", host="testhost", directory=folder / "profiles")
    assert speeds == {d: pytest.approx(t.items_per_s) for d, t in result.devices.items()}
    # $DSCHED_PROFILE_DIR, and model=None for the host's latest profile.
    monkeypatch.setenv("DSCHED_PROFILE_DIR", str(folder / "profiles"))
    assert profile_speeds(both, host="testhost") == speeds
    assert profile_path("synthetic", "testhost") == path
    # A bare cuda reads cuda:0; a device the profile lacks gives no speeds at all.
    assert profile_speeds(SimpleScheduler("cuda", 8), "synthetic", host="testhost") == {
        Device("cuda"): pytest.approx(speeds[Device("cuda:0")])
    }
    assert profile_speeds(StaticHybridScheduler(["cpu", "cuda:1"], 4), "synthetic", host="testhost") is None
    assert profile_speeds(both, "no-such-model", host="testhost") is None
    assert load_profile("synthetic", host="elsewhere") is None
    # What a graph file or a scheduler takes from the profile, in the devices' order.
    settings = profile_settings(["cuda:0", "cpu"], "synthetic", host="testhost")
    assert settings["batch_sizes"] == [result.devices[Device("cuda:0")].batch_size,
                                       result.devices[Device("cpu")].batch_size]
    assert settings["capacities"] == [result.devices[Device("cuda:0")].capacity,
                                      result.devices[Device("cpu")].capacity]
    StaticHybridScheduler(["cuda:0", "cpu"], settings["batch_sizes"], settings["capacities"])  # valid as is
    assert profile_settings(["cpu", "cuda:3"], "synthetic", host="testhost") is None


def test_throughput_plot_is_a_png(tuned):
    result, folder = tuned
    from matplotlib.image import imread

    png = folder / "throughput.png"
    assert result.png_path == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(png).shape == (450, 700, 4)


def test_builtin_model_by_name_tunes_in_sync_mode(tmp_path):
    result = run_tuning("j2", ["cpu"], mode="sync", start=64, max_batch=256, min_time=0.0, min_repeats=2,
                        save=False)
    points = result.devices[Device("cpu")].points
    assert [p.batch_size for p in points] == [64, 128, 256]
    assert result.model == "j2" and result.profile_path is None


@pytest.mark.parametrize("kwargs, message", [
    ({"start": 0}, "start: expected an integer >= 1, got 0"),
    ({"start": 512, "max_batch": 256}, "max_batch: 256 is below start 512"),
    ({"mode": "fast"}, "mode: expected 'sync' or 'async', got 'fast'"),
    ({"max_time": -1}, r"max_time: expected a number of seconds >= 0, got -1"),
    ({"devices": ["gpu"]}, "devices: 'gpu' is not a device"),
    ({"png_path": "/no/such/folder/x.png"}, "png_path: the folder /no/such/folder does not exist"),
])
def test_bad_tuning_options_are_value_errors_before_any_work(kwargs, message):
    options = {"devices": ["cpu"], "mode": "sync", "save": False, **kwargs}
    with pytest.raises(ValueError, match=message):
        run_tuning(TuningWorkload("x", synthetic_device), **options)


def test_bad_model_is_a_value_error():
    with pytest.raises(ValueError, match="model: unknown model 'nope'"):
        run_tuning("nope", ["cpu"], mode="sync", save=False)
    with pytest.raises(ValueError, match="model: expected a plain name for the profile file, got '../x'"):
        TuningWorkload("../x", synthetic_device)


def test_dsched_tune_command(tmp_path, capsys):
    from dsched.cli import main

    png = tmp_path / "tune.png"
    assert main(["tune", "--devices", "cpu", "--mode", "sync", "--start", "64", "--max-batch", "256",
                 "--min-time", "0", "--png", str(png), "--profile-dir", str(tmp_path / "profiles")]) == 0
    out = capsys.readouterr().out
    assert "cpu: N=64 " in out and "cpu: N=256 " in out and "profile: " in out
    assert png.exists() and list((tmp_path / "profiles").glob("*/j2.json"))
    assert main(["tune", "--devices", "gpu", "--mode", "sync"]) == 2
    assert "--devices: 'gpu' is not a device" in capsys.readouterr().err


def test_dsched_tune_on_a_cluster_saves_per_worker_host_and_hardware(tmp_path, capsys):
    """``dsched tune --scheduler-address``: measured on the cluster's workers (processes), keyed by what ran them."""
    import socket

    from distributed import Client

    from dsched import LocalHybridCluster
    from dsched.cli import main
    from dsched.costmodel import load_costs

    profiles = tmp_path / "profiles"
    with LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, dashboard_address=None) as cluster:
        assert main(["tune", "--devices", "cuda:0", "--scheduler-address", cluster.scheduler_address,
                     "--start", "64", "--max-batch", "256", "--min-time", "0", "--png", str(tmp_path / "t.png"),
                     "--profile-dir", str(profiles)]) == 0
        with Client(cluster) as client:  # the cluster is still there for others: tune closed only its client
            assert len(client.scheduler_info()["workers"]) == 2
    out = capsys.readouterr().out
    host = socket.gethostname()
    assert f"cuda:0: measured on {host} (emulated cuda:0)" in out
    profile = load_profile("j2", host=host, directory=profiles)
    assert profile["devices"]["cuda:0"]["hardware"] == "cuda:0" and profile["devices"]["cuda:0"]["emulated"]
    costs = load_costs("j2", host, profiles)
    assert list(costs) == ["emulated cuda:0"] and costs["emulated cuda:0"]["source"] == "dsched tune"


def test_dsched_tune_cluster_options_are_checked(capsys):
    from dsched.cli import main

    assert main(["tune", "--scheduler-address", "tcp://127.0.0.1:8786", "--scheduler-file", "sf.json"]) == 2
    assert "--scheduler-address: 'tcp://127.0.0.1:8786' and --scheduler-file: 'sf.json' are both set" in \
        capsys.readouterr().err
    assert main(["tune", "--scheduler-address", "not an address"]) == 2
    assert "--scheduler-address: 'not an address' is not a Dask scheduler address" in capsys.readouterr().err
    assert main(["tune", "--scheduler-address", "tcp://127.0.0.1:8786", "--mode", "sync"]) == 2
    assert "--mode: sync times chunks here" in capsys.readouterr().err
