"""Tests of the vectorized J2 update against a per-point reference and its own invariants."""

import math
import warnings

import numpy as np
import pytest

from dsched.models import MODELS, get_model
from dsched.models.j2 import (
    J2Parameters,
    elastic_stiffness,
    j2_chunk,
    j2_reference_point,
    j2_update,
    loading_strain,
    mandel_to_tensor,
    tensor_to_mandel,
)

ONE = np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])


def spec_stiffness(params):
    """``3K J + 2G Kdev`` written literally, independent of the module's assembly."""
    J = np.outer(ONE, ONE) / 3.0
    return 3.0 * params.bulk_modulus * J + 2.0 * params.shear_modulus * (np.eye(6) - J)


def von_mises(stress):
    dev = stress - (stress[:, :3].sum(axis=1) / 3.0)[:, None] * ONE
    return np.sqrt(1.5 * np.sum(dev * dev, axis=1))


def random_state(n, seed=0, max_strain=0.004):
    """Random strains, nonzero deviatoric plastic strain and alpha: a mix of elastic and plastic."""
    rng = np.random.default_rng(seed)
    direction = rng.normal(size=(n, 6))
    direction /= np.linalg.norm(direction, axis=1)[:, None]
    strain = direction * rng.uniform(0.0, max_strain, size=(n, 1))
    plastic = rng.normal(scale=2e-4, size=(n, 6))
    plastic -= (plastic[:, :3].mean(axis=1))[:, None] * ONE
    alpha = rng.uniform(0.0, 0.01, size=n)
    return strain, plastic, alpha


def test_mandel_round_trip():
    v = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    t = mandel_to_tensor(v)
    np.testing.assert_array_equal(t, t.T)
    assert t[1, 2] == pytest.approx(4.0 / math.sqrt(2.0))
    np.testing.assert_allclose(tensor_to_mandel(t), v, rtol=1e-15)
    # Mandel makes the double contraction a dot product.
    w = np.array([-1.0, 0.5, 2.0, 0.3, -0.7, 1.1])
    assert np.dot(v, w) == pytest.approx(np.sum(t * mandel_to_tensor(w)))


@pytest.mark.parametrize("params", [J2Parameters(), J2Parameters(hardening_modulus=0.0)])
def test_matches_reference(params):
    strain, plastic, alpha = random_state(200, seed=1)
    out = j2_update(strain, plastic, alpha, params, tangent=False)
    assert set(out) == {"stress", "plastic_strain", "alpha"}
    ref = [j2_reference_point(strain[i], plastic[i], alpha[i], params) for i in range(len(alpha))]
    yielded = out["alpha"] > alpha
    assert 40 < yielded.sum() < 160  # both branches are exercised
    np.testing.assert_allclose(out["stress"], np.array([r[0] for r in ref]), rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(out["plastic_strain"], np.array([r[1] for r in ref]), rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(out["alpha"], np.array([r[2] for r in ref]), rtol=1e-10, atol=1e-15)


def finite_difference_tangent(strain, plastic, alpha, params, h=1e-8):
    n = strain.shape[0]
    fd = np.empty((n, 6, 6))
    for j in range(6):
        step = np.zeros(6)
        step[j] = h
        up = j2_update(strain + step, plastic, alpha, params, tangent=False)["stress"]
        down = j2_update(strain - step, plastic, alpha, params, tangent=False)["stress"]
        fd[:, :, j] = (up - down) / (2.0 * h)
    return fd


@pytest.mark.parametrize("hardening", [1000.0, 0.0, 20e3])
def test_tangent_matches_finite_differences(hardening):
    params = J2Parameters(hardening_modulus=hardening)
    strain, plastic, alpha = random_state(300, seed=2)
    out = j2_update(strain, plastic, alpha, params)
    # Points close to the yield surface would let the difference stencil cross it.
    trial_q = von_mises((spec_stiffness(params) @ (strain - plastic).T).T)
    radius = params.yield_stress + hardening * alpha
    clear = np.abs(trial_q - radius) > 1e-3 * radius
    yielded = out["alpha"] > alpha
    assert (clear & yielded).sum() > 20 and (clear & ~yielded).sum() > 20
    fd = finite_difference_tangent(strain[clear], plastic[clear], alpha[clear], params)
    scale = np.abs(out["tangent"][clear]).max(axis=(1, 2))
    err = np.abs(out["tangent"][clear] - fd).max(axis=(1, 2)) / scale
    assert err.max() < 1e-5, err.max()
    # Plastic tangents differ from the elastic one (the check is not vacuous).
    assert np.abs(out["tangent"][yielded] - elastic_stiffness(params)).max() > 1e3


def test_tangent_is_symmetric():
    strain, plastic, alpha = random_state(100, seed=3)
    t = j2_update(strain, plastic, alpha)["tangent"]
    np.testing.assert_allclose(t, np.swapaxes(t, 1, 2), rtol=0, atol=1e-9 * np.abs(t).max())


def test_elastic_points_are_exact():
    params = J2Parameters()
    strain, plastic, alpha = random_state(200, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the guarded division must not warn
        out = j2_update(strain, plastic, alpha, params)
    elastic = out["alpha"] == alpha
    assert elastic.sum() > 40
    C = elastic_stiffness(params)
    np.testing.assert_allclose(C, spec_stiffness(params), rtol=1e-14)
    assert np.array_equal(out["tangent"][elastic], np.broadcast_to(C, (elastic.sum(), 6, 6)))
    assert np.array_equal(out["plastic_strain"][elastic], plastic[elastic])
    assert np.array_equal(out["alpha"][elastic], alpha[elastic])
    trial = (C @ (strain - plastic)[elastic].T).T
    np.testing.assert_allclose(out["stress"][elastic], trial, rtol=1e-12, atol=1e-9)


def test_zero_strain_has_no_nans():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = j2_update(np.zeros((3, 6)), np.zeros((3, 6)), np.zeros(3))
    for value in out.values():
        assert np.all(np.isfinite(value))
    np.testing.assert_array_equal(out["stress"], 0.0)


@pytest.mark.parametrize("hardening", [1000.0, 0.0])
def test_plastic_points_satisfy_consistency(hardening):
    params = J2Parameters(hardening_modulus=hardening)
    strain, plastic, alpha = random_state(200, seed=5)
    out = j2_update(strain, plastic, alpha, params)
    yielded = out["alpha"] > alpha
    assert yielded.sum() > 40
    q = von_mises(out["stress"][yielded])
    radius = params.yield_stress + hardening * out["alpha"][yielded]
    np.testing.assert_allclose(q, radius, rtol=1e-8)
    dp = out["plastic_strain"][yielded] - plastic[yielded]
    assert np.abs(dp[:, :3].sum(axis=1)).max() < 1e-14
    # The equivalent plastic strain grows by sqrt(2/3) ||d eps_p||.
    np.testing.assert_allclose(
        out["alpha"][yielded] - alpha[yielded], math.sqrt(2.0 / 3.0) * np.linalg.norm(dp, axis=1), rtol=1e-10
    )


def test_perfect_plasticity_caps_stress():
    params = J2Parameters(hardening_modulus=0.0)
    strain = np.array([[0.01, -0.005, -0.005, 0.0, 0.0, 0.0], [0.05, 0.0, 0.0, 0.02, 0.0, 0.0]])
    out = j2_update(strain, np.zeros((2, 6)), np.zeros(2), params)
    np.testing.assert_allclose(von_mises(out["stress"]), params.yield_stress, rtol=1e-12)
    assert np.all(np.isfinite(out["tangent"]))


def test_float32_stays_float32():
    strain, plastic, alpha = random_state(100, seed=6)
    out32 = j2_update(strain.astype(np.float32), plastic.astype(np.float32), alpha.astype(np.float32))
    out64 = j2_update(strain, plastic, alpha)
    for key, value in out32.items():
        assert value.dtype == np.float32, key
        scale = np.abs(out64[key]).max()
        np.testing.assert_allclose(value, out64[key], rtol=0, atol=1e-4 * scale, err_msg=key)


def test_dtype_promotion():
    strain, plastic, alpha = random_state(10, seed=7)
    out = j2_update(strain.astype(np.float32), plastic, alpha.astype(np.float32))
    assert out["stress"].dtype == np.float64
    out = j2_update(np.zeros((2, 6), dtype=int), np.zeros((2, 6), dtype=int), np.zeros(2, dtype=int))
    assert out["tangent"].dtype == np.float64


def test_inputs_are_not_modified():
    strain, plastic, alpha = random_state(50, seed=8)
    copies = strain.copy(), plastic.copy(), alpha.copy()
    j2_update(strain, plastic, alpha)
    for before, after in zip(copies, (strain, plastic, alpha)):
        np.testing.assert_array_equal(before, after)


def test_loading_strain_yields_about_half():
    strain = loading_strain(np.arange(10_000))
    assert strain.shape == (10_000, 6) and strain.dtype == np.float64
    out = j2_update(strain, np.zeros_like(strain), np.zeros(10_000), tangent=False)
    fraction = np.mean(out["alpha"] > 0)
    assert 0.3 < fraction < 0.7, fraction
    # Mixed loading: normal and shear parts are both present.
    assert np.abs(strain[:, :3]).max() > 0 and np.abs(strain[:, 3:]).max() > 0
    # Deterministic and position-independent: a slice reproduces the same rows.
    np.testing.assert_array_equal(loading_strain(np.arange(500, 700)), strain[500:700])


def test_j2_chunk():
    out = j2_chunk(slice(100, 400))
    assert out["stress"].shape == (300, 6) and out["tangent"].shape == (300, 6, 6)
    assert all(isinstance(v, np.ndarray) for v in out.values())
    strain = loading_strain(np.arange(100, 400))
    expected = j2_update(strain, np.zeros_like(strain), np.zeros(300))
    for key in expected:
        np.testing.assert_array_equal(out[key], expected[key])
    assert j2_chunk(slice(0, 10), None, tangent=False).keys() == {"stress", "plastic_strain", "alpha"}
    assert j2_chunk(slice(5, 5))["stress"].shape == (0, 6)
    with pytest.raises(ValueError, match="work"):
        j2_chunk(slice(0, None))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"youngs_modulus": -1.0}, r"youngs_modulus must be > 0, got -1\.0"),
        ({"youngs_modulus": float("nan")}, "youngs_modulus"),
        ({"poisson_ratio": 0.5}, r"poisson_ratio .*0\.5"),
        ({"poisson_ratio": -1.0}, "poisson_ratio"),
        ({"yield_stress": 0.0}, r"yield_stress .*0\.0"),
        ({"hardening_modulus": -5.0}, r"hardening_modulus .*-5\.0"),
    ],
)
def test_bad_parameters(kwargs, field):
    with pytest.raises(ValueError, match=field):
        J2Parameters(**kwargs)


def test_parameters_are_frozen():
    with pytest.raises(AttributeError):
        J2Parameters().yield_stress = 1.0


@pytest.mark.parametrize(
    "shapes, name",
    [
        (((5, 3), (5, 3), (5,)), "strain"),
        (((6,), (6,), ()), "strain"),
        (((5, 6), (4, 6), (5,)), r"plastic_strain .*\(4, 6\)"),
        (((5, 6), (5, 6), (4,)), r"alpha .*\(4,\)"),
        (((5, 6), (5, 6), (5, 1)), "alpha"),
    ],
)
def test_bad_shapes(shapes, name):
    with pytest.raises(ValueError, match=name):
        j2_update(*(np.zeros(s) for s in shapes))


def test_registry():
    model = get_model("j2")
    assert model is MODELS["j2"]
    assert model.chunk is j2_chunk and model.parameters_type is J2Parameters
    assert isinstance(model.description, str) and "\n" not in model.description
    with pytest.raises(ValueError, match="'nope'.*known: j2"):
        get_model("nope")


def _cupy_with_device():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver or no runtime: same as no device
        count = 0
    if count <= 0:
        pytest.skip("no CUDA device")
    return cupy


@pytest.mark.gpu
def test_cupy_matches_numpy():
    cupy = _cupy_with_device()
    strain, plastic, alpha = random_state(1000, seed=9)
    expected = j2_update(strain, plastic, alpha)
    out = j2_update(cupy.asarray(strain), cupy.asarray(plastic), cupy.asarray(alpha))
    for key, value in expected.items():
        assert isinstance(out[key], cupy.ndarray), key
        np.testing.assert_allclose(out[key].get(), value, rtol=1e-12, atol=1e-12 * np.abs(value).max())
    out32 = j2_update(*(cupy.asarray(a, dtype=cupy.float32) for a in (strain, plastic, alpha)))
    assert all(v.dtype == cupy.float32 for v in out32.values())
    chunk = j2_chunk(slice(0, 1000), xp=cupy)
    host = j2_chunk(slice(0, 1000))
    for key, value in host.items():
        assert isinstance(chunk[key], np.ndarray)
        np.testing.assert_allclose(chunk[key], value, rtol=1e-12, atol=1e-12 * np.abs(value).max())


def test_out_may_be_the_state_itself_and_is_bitwise_the_same():
    # An update in place (a resident batch's state): out= is the plastic strain and alpha given, and a
    # stress buffer; a float32 out= is written by a copy at the end, never used for float64 intermediates.
    from dsched.bench_data import j2_inputs

    strain, plastic, alpha = j2_inputs(5000)
    strain = strain * 3.0  # most points yield: the state changes
    reference = j2_update(strain, plastic, alpha, tangent=False)
    state = {"stress": np.full((5000, 6), np.nan), "plastic_strain": plastic.copy(), "alpha": alpha.copy()}
    got = j2_update(strain, state["plastic_strain"], state["alpha"], tangent=False, out=state)
    assert all(got[k] is state[k] and np.array_equal(got[k], reference[k]) for k in reference)
    assert (reference["alpha"] > 0).mean() > 0.5
    single = {k: np.empty(v.shape, np.float32) for k, v in reference.items()}
    got = j2_update(strain, plastic, alpha, tangent=False, out=single)
    assert all(got[k] is single[k] and np.array_equal(got[k], reference[k].astype(np.float32)) for k in reference)
    with_tangent = j2_update(strain, plastic, alpha)
    single = {k: np.empty(v.shape, np.float32) for k, v in with_tangent.items()}
    got = j2_update(strain, plastic, alpha, out=single)
    assert all(got[k] is single[k] and np.array_equal(got[k], with_tangent[k].astype(np.float32))
               for k in with_tangent)
    # A stress buffer that is an input read later (the plastic strain) is not computed into, only copied into.
    given = plastic.copy()
    got = j2_update(strain, given, alpha, tangent=False,
                    out={"stress": given, "plastic_strain": np.empty_like(plastic), "alpha": np.empty_like(alpha)})
    assert np.array_equal(got["stress"], reference["stress"])
    assert np.array_equal(got["plastic_strain"], reference["plastic_strain"])


@pytest.mark.parametrize("tangent", [True, False])
def test_j2_chunk_computes_into_out_rows(tangent):
    # A graph job's model computes into the dispatcher's output rows (views of the run's outputs).
    from dsched.job import _model_chunk_into

    reference = j2_chunk(slice(5, 105), tangent=tangent)
    outputs = {k: np.full((200,) + v.shape[1:], np.nan) for k, v in reference.items()}
    rows = {k: v[50:150] for k, v in outputs.items()}
    got = _model_chunk_into(j2_chunk, J2Parameters(), tangent, slice(5, 105), None, out=rows)
    assert all(got[k] is rows[k] and np.array_equal(got[k], reference[k]) for k in reference)
    assert all(np.isnan(v[:50]).all() and np.isnan(v[150:]).all() for v in outputs.values())
