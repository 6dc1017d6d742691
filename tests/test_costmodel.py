"""dsched.costmodel: NEML2's saturation model, StarPU's calibration rules, identities and cost files."""

import json
import socket

import numpy as np
import pytest

from dsched import Device
from dsched.costmodel import (
    DeviceCalibration,
    DeviceIdentity,
    SaturationFit,
    costs_path,
    device_identities,
    device_identity,
    fit_of,
    fit_saturation,
    load_costs,
    saturation_time,
    save_costs,
)


def test_weighted_fit_equals_the_fit_over_every_sample():
    sizes = [1024, 2048, 4096, 8192, 20000]
    rng = np.random.default_rng(3)
    n = np.repeat(sizes, [1, 1, 1, 1, 40])
    t = np.asarray(saturation_time(n, 0.004, 3000)) * np.exp(rng.normal(0, 0.03, n.size))
    every = fit_saturation(n, t)
    # One mean log time per size, weighted by its count: the same optimum.
    mean_log = np.array([np.log(t[n == s]).mean() for s in sizes])
    grouped = fit_saturation(sizes, np.exp(mean_log), weights=[1, 1, 1, 1, 40])
    assert grouped.t0 == pytest.approx(every.t0, rel=1e-6)
    assert grouped.n_star == pytest.approx(every.n_star, rel=1e-6)


def test_first_sample_discarded_and_calibrated_at_ten():
    calibration = DeviceCalibration()
    calibration.add(1000, 5.0)  # the first chunk paid for imports: never part of the fit
    assert (calibration.seen, calibration.samples, calibration.calibrated) == (1, 0, False)
    sizes = [500, 1000, 2000, 4000, 8000, 8000, 8000, 8000, 8000, 8000]
    for i, n in enumerate(sizes):
        calibration.add(n, saturation_time(n, 0.01, 1000))
        assert calibration.calibrated == (i == 9)
    assert calibration.samples == 10
    assert calibration.fit.t0 == pytest.approx(0.01, rel=1e-5)
    assert calibration.fit.n_star == pytest.approx(1000, rel=1e-5)


def test_outliers_are_dropped():
    calibration = DeviceCalibration()
    calibration.add(1, 1.0)
    sizes = [256, 512, 1024, 2048, 4096, 4096, 4096, 4096, 4096, 4096, 4096, 4096]
    for n in sizes:
        calibration.add(n, saturation_time(n, 0.002, 800))
    calibration.add(4096, 3 * saturation_time(4096, 0.002, 800))  # a chunk that waited behind another program
    fit = calibration.fit
    assert calibration.dropped == 1
    assert fit.t0 == pytest.approx(0.002, rel=1e-5) and fit.n_star == pytest.approx(800, rel=1e-5)


def test_small_sizes_survive_many_full_size_samples():
    calibration = DeviceCalibration(per_size=16)
    calibration.add(1, 1.0)
    for n in [256, 512, 1024, 2048] + [20000] * 500:
        calibration.add(n, saturation_time(n, 0.003, 1500))
    assert calibration.samples == 4 + 16  # each size keeps its last 16
    assert calibration.fit.n_star == pytest.approx(1500, rel=1e-5)  # t0 still seen through the small chunks


def test_prior_until_calibrated_then_the_samples():
    prior = SaturationFit(0.5, 100.0, 0.0, True)
    calibration = DeviceCalibration(prior)
    assert calibration.fit is prior
    calibration.add(1, 1.0)
    for n in [100, 200, 400, 800, 1600, 1600, 1600, 1600, 1600]:
        calibration.add(n, saturation_time(n, 0.01, 300))
        assert calibration.fit is prior  # nine samples do not outvote a saved calibration
    calibration.add(1600, saturation_time(1600, 0.01, 300))
    assert calibration.fit.n_star == pytest.approx(300, rel=1e-5)


def test_one_size_is_taken_as_linear():
    calibration = DeviceCalibration()
    calibration.add(1, 1.0)
    calibration.add(4000, 0.02)
    fit = calibration.fit
    assert (fit.t0, fit.n_star) == (pytest.approx(0.02 / 4000), 1.0)
    assert fit.seconds(2000) == pytest.approx(0.01)


def test_identity_here():
    cpu = device_identity("cpu")
    assert cpu.host == socket.gethostname() and cpu.hardware.startswith("cpu ") and not cpu.emulated
    # No GPU here: a CUDA device neither CuPy nor NVML knows is emulated, never a GPU's entry.
    assert device_identity("cuda:0").key == "emulated cuda:0"
    assert device_identity("cuda:1", emulated=True) == DeviceIdentity(socket.gethostname(), "cuda:1", True)


def test_identities_from_worker_processes():
    from distributed import Client

    from dsched import LocalHybridCluster

    with LocalHybridCluster(["cpu", "cuda:0"], emulate=True, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        found = device_identities(["cpu", "cuda:0", "cuda:1"], client)
    assert found[Device("cuda:0")] == DeviceIdentity(socket.gethostname(), "cuda:0", True)  # told by its worker
    assert found[Device("cpu")].hardware.startswith("cpu ")
    assert found[Device("cuda:1")].emulated  # no worker owns it: identified here


def test_cost_files_round_trip_per_host_and_hardware(tmp_path):
    a = DeviceIdentity("node1", "NVIDIA H100 80GB HBM3")
    b = DeviceIdentity("node2", "cuda:0", emulated=True)
    save_costs("j2", a, "cuda:0", {"t0": 0.002, "n_star": 50000.0, "samples": 12}, tmp_path)
    save_costs("j2", a, "cuda:1", {"t0": 0.003, "n_star": 60000.0, "samples": 30}, tmp_path)  # same model of GPU
    save_costs("j2", b, "cuda:0", {"t0": 0.004, "n_star": 1000.0, "samples": 10}, tmp_path)
    node1 = load_costs("j2", "node1", tmp_path)
    assert list(node1) == ["NVIDIA H100 80GB HBM3"]  # keyed by what ran it: the last save of that hardware
    assert node1["NVIDIA H100 80GB HBM3"]["device"] == "cuda:1"
    assert fit_of(node1["NVIDIA H100 80GB HBM3"]) == SaturationFit(0.003, 60000.0, 0.0, True)
    assert list(load_costs("j2", "node2", tmp_path)) == ["emulated cuda:0"]
    data = json.loads(costs_path("j2", "node1", tmp_path).read_text())
    assert data["host"] == "node1" and data["model"] == "j2"
    assert load_costs("j2", "node3", tmp_path) == {}
    assert fit_of({"t0": -1, "n_star": 5}) is None and fit_of({}) is None
