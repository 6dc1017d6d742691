"""Small-strain J2 (von Mises) plasticity with linear isotropic hardening.

One radial-return update (Simo & Hughes, *Computational Inelasticity*, box 3.2)
written once against an array module ``xp``, so the same code runs on NumPy and
CuPy. Symmetric tensors are Mandel 6-vectors
``[a11, a22, a33, sqrt2*a23, sqrt2*a13, sqrt2*a12]``: the Mandel basis is
orthonormal, so a double contraction is a dot product and a fourth-order tensor
with minor symmetries is a plain 6x6 matrix. The batch axis is axis 0.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import numpy

try:  # CuPy is optional: without it everything runs on NumPy
    import cupy as _cupy
except ImportError:  # pragma: no cover - depends on the installation
    _cupy = None

__all__ = [
    "J2Parameters",
    "j2_update",
    "j2_reference_point",
    "elastic_stiffness",
    "loading_strain",
    "j2_chunk",
    "J2_INPUTS",
    "write_j2_inputs",
    "mandel_to_tensor",
    "tensor_to_mandel",
    "get_array_module",
]

_SQRT2 = math.sqrt(2.0)
# Python floats, never NumPy scalars: a NumPy float64 scalar would promote
# float32 arrays to float64 under NumPy 2 promotion rules.
_SQRT3_2 = math.sqrt(1.5)
# (row, column) of each Mandel component in the 3x3 tensor.
_MANDEL_INDEX = ((0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1))
_MANDEL_WEIGHT = (1.0, 1.0, 1.0, _SQRT2, _SQRT2, _SQRT2)


@dataclass(frozen=True)
class J2Parameters:
    """Material constants of the J2 model (MPa).

    Parameters
    ----------
    youngs_modulus : float
        Young's modulus E, > 0.
    poisson_ratio : float
        Poisson's ratio nu, in (-1, 0.5).
    yield_stress : float
        Initial uniaxial yield stress, > 0.
    hardening_modulus : float
        Linear isotropic hardening modulus H, >= 0 (0 is perfect plasticity).
    """

    youngs_modulus: float = 200e3
    poisson_ratio: float = 0.3
    yield_stress: float = 250.0
    hardening_modulus: float = 1000.0

    def __post_init__(self):
        # Written as "not (ok)" so that NaN fails every check.
        checks = (
            ("youngs_modulus", self.youngs_modulus, lambda v: v > 0, "> 0"),
            ("poisson_ratio", self.poisson_ratio, lambda v: -1 < v < 0.5, "in (-1, 0.5)"),
            ("yield_stress", self.yield_stress, lambda v: v > 0, "> 0"),
            ("hardening_modulus", self.hardening_modulus, lambda v: v >= 0, ">= 0"),
        )
        for name, value, ok, rule in checks:
            try:
                valid = bool(ok(value)) and not isinstance(value, bool)
            except TypeError:
                valid = False
            if not valid:
                raise ValueError(f"{name} must be {rule}, got {value!r}")

    @property
    def bulk_modulus(self) -> float:
        """K = E / (3 (1 - 2 nu))."""
        return float(self.youngs_modulus) / (3.0 * (1.0 - 2.0 * float(self.poisson_ratio)))

    @property
    def shear_modulus(self) -> float:
        """G = E / (2 (1 + nu))."""
        return float(self.youngs_modulus) / (2.0 * (1.0 + float(self.poisson_ratio)))


_DEFAULT_PARAMETERS = J2Parameters()


def get_array_module(*arrays):
    """CuPy if any of ``arrays`` is a CuPy array (and CuPy is installed), else NumPy."""
    if _cupy is None:
        return numpy
    return _cupy.get_array_module(*arrays)


# --- Mandel <-> 3x3 (reference path only) ----------------------------------

def mandel_to_tensor(v):
    """A symmetric 3x3 NumPy tensor from a Mandel 6-vector."""
    v = numpy.asarray(v, dtype=numpy.float64).reshape(6)
    t = numpy.empty((3, 3))
    for k, ((i, j), w) in enumerate(zip(_MANDEL_INDEX, _MANDEL_WEIGHT)):
        t[i, j] = t[j, i] = v[k] / w
    return t


def tensor_to_mandel(t):
    """The Mandel 6-vector of a symmetric 3x3 tensor (its symmetric part)."""
    t = numpy.asarray(t, dtype=numpy.float64).reshape(3, 3)
    return numpy.array(
        [w * 0.5 * (t[i, j] + t[j, i]) for (i, j), w in zip(_MANDEL_INDEX, _MANDEL_WEIGHT)]
    )


# --- the vectorized update ------------------------------------------------

def _check_inputs(strain, plastic_strain, alpha):
    if strain.ndim != 2 or strain.shape[1] != 6:
        raise ValueError(f"strain must have shape (N, 6), got {tuple(strain.shape)}")
    if plastic_strain.shape != strain.shape:
        raise ValueError(
            f"plastic_strain must have the shape of strain {tuple(strain.shape)}, "
            f"got {tuple(plastic_strain.shape)}"
        )
    if alpha.shape != strain.shape[:1]:
        raise ValueError(
            f"alpha must have shape ({strain.shape[0]},) to match strain {tuple(strain.shape)}, "
            f"got {tuple(alpha.shape)}"
        )


def _assemble_tangent(xp, bulk, two_g_theta, m, n, out=None):
    """``n (x) m + 2G theta I6 + (K - 2G theta / 3) 1 (x) 1``, one (N, 6, 6) allocation.

    This is ``3K J + 2G theta Kdev + n (x) m`` rearranged (Kdev = I6 - J,
    J = 1 (x) 1 / 3) so that only the outer product allocates a full
    (N, 6, 6) array; the isotropic part is added in place.
    """
    tangent = xp.multiply(n[:, :, None], m[:, None, :], out=out)
    flat = tangent.reshape(tangent.shape[0], 36)  # a view: the product is contiguous
    flat[:, ::7] += two_g_theta[:, None]
    tangent[:, :3, :3] += (bulk - two_g_theta / 3.0)[:, None, None]
    return tangent


def elastic_stiffness(params=_DEFAULT_PARAMETERS, xp=numpy, dtype=numpy.float64):
    """The elastic stiffness ``C = 3K J + 2G Kdev`` as a (6, 6) Mandel matrix.

    Built by the same arithmetic as the tangent of :func:`j2_update`, so an
    elastic point's tangent equals it bit for bit.
    """
    two_g = xp.full((1,), 2.0 * params.shear_modulus, dtype=dtype)
    zero = xp.zeros((1, 6), dtype=dtype)
    return _assemble_tangent(xp, params.bulk_modulus, two_g, zero, zero)[0]


def j2_update(strain, plastic_strain, alpha, params=_DEFAULT_PARAMETERS, *, tangent=True, xp=None, out=None):
    """Radial-return update of a batch of material points.

    Parameters
    ----------
    strain : (N, 6) array
        Total strain at the end of the step, Mandel notation.
    plastic_strain : (N, 6) array
        Plastic strain at the start of the step, Mandel notation.
    alpha : (N,) array
        Equivalent plastic strain at the start of the step.
    params : J2Parameters
        Material constants.
    tangent : bool
        Whether to return the consistent tangent.
    xp : module, optional
        NumPy or CuPy; by default the module of ``strain``.
    out : dict, optional
        Arrays to write the results into (the keys of the result), as a NumPy
        ``out=``. Those of the result's dtype are computed in directly, the state
        arrays given among them (an update in place); others get the result cast
        at the end, never rounded intermediates. A dispatcher passes its output
        rows here when ``do_work`` takes ``out``.

    Returns
    -------
    dict
        ``"stress"`` (N, 6), ``"plastic_strain"`` (N, 6), ``"alpha"`` (N,) and,
        when ``tangent`` is true, ``"tangent"`` (N, 6, 6), the algorithmic
        tangent d stress / d strain in Mandel notation. Float32 inputs give
        float32 results; anything else floating gives its promoted type, and
        integers give float64.

    Examples
    --------
    >>> import numpy as np
    >>> eps = np.array([[0.0005, 0, 0, 0, 0, 0], [0.005, 0, 0, 0, 0, 0]])
    >>> out = j2_update(eps, np.zeros((2, 6)), np.zeros(2))
    >>> out["alpha"] > 0
    array([False,  True])
    >>> out["tangent"].shape
    (2, 6, 6)
    """
    if xp is None:
        xp = get_array_module(strain, plastic_strain, alpha)
    strain, plastic_strain, alpha, dtype = _promoted(xp, strain, plastic_strain, alpha)
    # Results computed straight into out= where that cannot overwrite an input still to be read: the
    # stress from the elastic strain on, the state by its final additions (each reads only the same
    # element of its own input, so out may be that input: an update in place).
    into = {} if out is None else _direct_outs(xp, out, strain, plastic_strain, alpha, dtype, tangent)
    result, plastic, q_trial, increment, normal = _radial_return(xp, strain, plastic_strain, alpha, params, dtype,
                                                                 into)
    if tangent:
        result["tangent"] = _consistent_tangent(xp, params, dtype, plastic, q_trial, increment, normal,
                                                out=into.get("tangent"))
    if out is not None:  # what could not be computed in place is copied in
        for name in result:
            if result[name] is not out[name]:
                xp.copyto(out[name], result[name])
                result[name] = out[name]
    return result


def _radial_return(xp, strain, plastic_strain, alpha, params, dtype, into):
    """The stress and the new state; also what the tangent needs (yielding points, trial q, increment, normal)."""
    bulk = params.bulk_modulus
    shear = params.shear_modulus
    hardening = float(params.hardening_modulus)
    two_g = 2.0 * shear
    three_g = 3.0 * shear

    # sigma_tr = C (eps - eps_p) without forming C: K tr(e) 1 + 2G dev(e).
    elastic_strain = xp.subtract(strain, plastic_strain, out=into.get("stress"))
    volumetric = elastic_strain[:, 0] + elastic_strain[:, 1] + elastic_strain[:, 2]
    deviator = elastic_strain  # reused in place: elastic_strain is not needed again
    deviator[:, :3] -= (volumetric / 3.0)[:, None]
    deviator *= two_g  # s = dev(sigma_tr)
    norm_s = xp.sqrt(xp.sum(deviator * deviator, axis=1))
    q_trial = _SQRT3_2 * norm_s
    f_trial = q_trial - (float(params.yield_stress) + hardening * alpha)
    plastic = f_trial > 0.0

    # f > 0 with a positive yield stress implies ||s|| > 0, so replacing the
    # norm by 1 on elastic points only avoids 0/0 there; those points then get
    # n = 0 and a zero increment, which leaves their state exactly unchanged.
    # astype: CuPy may promote a Python scalar in where() where NumPy 2 does not.
    safe_norm = xp.where(plastic, norm_s, 1.0).astype(dtype, copy=False)
    normal = deviator / safe_norm[:, None]
    normal *= plastic[:, None]
    increment = xp.where(plastic, f_trial, 0.0) / (three_g + hardening)
    increment = increment.astype(dtype, copy=False)

    step = (_SQRT3_2 * increment)[:, None] * normal
    # Nothing reads the state given after this: out= may be that state (an update in place).
    new_plastic_strain = xp.add(plastic_strain, step, out=into.get("plastic_strain"))
    step *= two_g
    stress = deviator  # the deviator becomes the stress in place
    stress -= step
    stress[:, :3] += (bulk * volumetric)[:, None]
    result = {"stress": stress, "plastic_strain": new_plastic_strain,
              "alpha": xp.add(alpha, increment, out=into.get("alpha"))}
    return result, plastic, q_trial, increment, normal


def _consistent_tangent(xp, params, dtype, plastic, q_trial, increment, normal, out=None):
    """The algorithmic tangent d stress / d strain (Mandel), assembled in ``out`` where given."""
    three_g = 3.0 * params.shear_modulus
    two_g = 2.0 * params.shear_modulus
    hardening = float(params.hardening_modulus)
    safe_q = xp.where(plastic, q_trial, 1.0).astype(dtype, copy=False)
    theta = 1.0 - three_g * increment / safe_q
    theta_bar = three_g / (three_g + hardening) - (1.0 - theta)
    return _assemble_tangent(
        xp, params.bulk_modulus, (two_g * theta).astype(dtype, copy=False), (-two_g * theta_bar)[:, None] * normal,
        normal, out=out,
    )


def _promoted(xp, strain, plastic_strain, alpha):
    """The inputs as arrays of ``xp``, checked and cast to their common floating dtype, and that dtype."""
    strain = xp.asarray(strain)
    plastic_strain = xp.asarray(plastic_strain)
    alpha = xp.asarray(alpha)
    _check_inputs(strain, plastic_strain, alpha)
    # Dtypes are NumPy dtypes for CuPy arrays too, so NumPy decides promotion.
    dtype = numpy.result_type(strain.dtype, plastic_strain.dtype, alpha.dtype)
    if not numpy.issubdtype(dtype, numpy.floating):
        dtype = numpy.dtype(numpy.float64)
    return (strain.astype(dtype, copy=False), plastic_strain.astype(dtype, copy=False),
            alpha.astype(dtype, copy=False), dtype)


def _direct_outs(xp, out, strain, plastic_strain, alpha, dtype, tangent):
    """Per result, the ``out`` array it may be computed straight into (``None``: computed apart, copied in)."""
    return {
        "stress": _direct_out(xp, out["stress"], strain.shape, dtype, strain, plastic_strain, alpha),
        "plastic_strain": _direct_out(xp, out["plastic_strain"], strain.shape, dtype, strain, alpha),
        "alpha": _direct_out(xp, out["alpha"], alpha.shape, dtype, strain, plastic_strain),
        "tangent": _direct_out(xp, out["tangent"], strain.shape[:1] + (6, 6), dtype) if tangent else None}


def _direct_out(xp, target, shape, dtype, *inputs):
    """``target`` if a result of ``shape`` and ``dtype`` may be computed straight into it, else ``None``.

    Not when it may overlap an input it would overwrite before that is read
    (a bounds check: cheap, and a false yes only costs the copy), nor when a
    cast would round an intermediate: then the result is copied in at the end.
    """
    if getattr(target, "dtype", None) != dtype or tuple(getattr(target, "shape", ())) != tuple(shape):
        return None
    return None if any(xp.may_share_memory(target, array) for array in inputs) else target


# --- the per-point reference -----------------------------------------------

def j2_reference_point(strain6, plastic_strain6, alpha, params=_DEFAULT_PARAMETERS):
    """The same update for one point, in 3x3 tensor notation with plain floats.

    Written independently of :func:`j2_update` (no Mandel algebra, no masks) to
    check it.

    Returns
    -------
    tuple
        ``(stress6, plastic_strain6, alpha)``: two Mandel 6-vectors and a float.
    """
    eye = numpy.eye(3)
    E, nu = float(params.youngs_modulus), float(params.poisson_ratio)
    lam = E * nu / ((1.0 + nu) * (1.0 - 2.0 * nu))
    mu = E / (2.0 * (1.0 + nu))
    H, sy = float(params.hardening_modulus), float(params.yield_stress)
    alpha = float(alpha)

    eps = mandel_to_tensor(strain6)
    eps_p = mandel_to_tensor(plastic_strain6)
    eps_e = eps - eps_p
    sigma = lam * numpy.trace(eps_e) * eye + 2.0 * mu * eps_e
    s = sigma - numpy.trace(sigma) / 3.0 * eye
    norm = math.sqrt(float(numpy.sum(s * s)))
    f = math.sqrt(1.5) * norm - (sy + H * alpha)
    if f <= 0.0:
        return tensor_to_mandel(sigma), tensor_to_mandel(eps_p), alpha
    dgamma = f / (3.0 * mu + H)
    n = s / norm
    sigma = sigma - 2.0 * mu * math.sqrt(1.5) * dgamma * n
    eps_p = eps_p + math.sqrt(1.5) * dgamma * n
    return tensor_to_mandel(sigma), tensor_to_mandel(eps_p), alpha + dgamma


# --- a deterministic loading and the job's do_work ------------------------

_GOLDEN = (1.0 + math.sqrt(5.0)) / 2.0


def _mandel(t11, t22, t33, t23, t13, t12):
    return (t11, t22, t33, _SQRT2 * t23, _SQRT2 * t13, _SQRT2 * t12)


def _scaled_direction(components, deviatoric_norm):
    v = numpy.array(components, dtype=numpy.float64)
    dev = v.copy()
    dev[:3] -= v[:3].mean()
    return v * (deviatoric_norm / numpy.linalg.norm(dev))


# Tension with shear and some volume change. Scaled so that its deviator has
# Mandel norm 2/3: with the default parameters yield starts at a deviatoric
# strain norm of about 1.33e-3, so amplitudes uniform in [0, 0.004] yield for
# about half the points.
_PRIMARY = _scaled_direction(_mandel(1.0, -0.35, -0.15, 0.25, -0.1, 0.4), 2.0 / 3.0)
_SECONDARY = _scaled_direction(_mandel(-0.2, 0.6, -0.4, 0.3, 0.5, -0.2), 1.0)


def loading_strain(indices, xp=numpy, max_strain=0.004):
    """A deterministic mixed strain state for each point index.

    Point ``i`` gets ``max_strain * frac(i * golden_ratio)`` along a fixed
    direction with normal and shear parts, plus ``0.05 * max_strain *
    sin(2 pi frac(i * sqrt 2))`` along a second one. The golden-ratio sequence
    spreads the amplitudes evenly over any index range, so for the default
    :class:`J2Parameters` about half of any slice yields.

    Parameters
    ----------
    indices : (N,) int array
        Global point indices.
    xp : module
        NumPy or CuPy; the result is created there.
    max_strain : float
        Largest amplitude along the primary direction.

    Returns
    -------
    (N, 6) float64 array on ``xp``
    """
    i = xp.asarray(indices).astype(xp.float64).reshape(-1)
    ramp = i * _GOLDEN
    ramp -= xp.floor(ramp)
    wobble = i * _SQRT2
    wobble -= xp.floor(wobble)
    wobble = xp.sin(2.0 * math.pi * wobble)
    primary = xp.asarray(_PRIMARY)
    secondary = xp.asarray(_SECONDARY)
    return float(max_strain) * (ramp[:, None] * primary + (0.05 * wobble)[:, None] * secondary)


def _xp_for(device):
    """The array module for ``device`` and a context that makes it current.

    Uses ``dsched.devices`` when present (it knows about emulated CUDA
    workers, which compute with NumPy); a CUDA device without CuPy falls back
    to NumPy so that the model still runs on a CPU-only installation.
    """
    if device is None or getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return numpy, contextlib.nullcontext()
    try:
        from dsched import devices as _devices
    except ImportError:
        _devices = None
    if _devices is not None and hasattr(_devices, "array_module"):
        try:
            xp = _devices.array_module(device)
        except ImportError:
            return numpy, contextlib.nullcontext()
        if xp is numpy:
            return numpy, contextlib.nullcontext()
        ordinal = _devices.cuda_local_ordinal(device) if hasattr(_devices, "cuda_local_ordinal") else 0
        return xp, xp.cuda.Device(ordinal)
    if _cupy is None:
        return numpy, contextlib.nullcontext()
    return _cupy, _cupy.cuda.Device(getattr(device, "index", None) or 0)


def _to_host(a):
    return a.get() if hasattr(a, "__cuda_array_interface__") else numpy.asarray(a)


#: the inputs of a J2 chunk given as arrays (``dsched run --input``), in j2_update's order
J2_INPUTS = ("strain", "plastic_strain", "alpha")


def write_j2_inputs(path, points, *, piece=1_000_000, overwrite=False):
    """Write ``points`` J2 inputs to a new Zarr store at ``path`` (``loading_strain``, zero state), piece by piece.

    The store holds ``strain`` (points, 6), ``plastic_strain`` (points, 6) and
    ``alpha`` (points,): the input of ``dsched run --input``. At most ``piece``
    points are in memory at once.

    Examples
    --------
    >>> import os, tempfile
    >>> store = write_j2_inputs(os.path.join(tempfile.mkdtemp(), "in.zarr"), 10)
    >>> import zarr; zarr.open_group(store, mode="r")["strain"].shape
    (10, 6)
    """
    import zarr

    group = zarr.open_group(store=os.fspath(path), mode="w" if overwrite else "w-")
    chunk = min(piece, points)
    arrays = {name: group.create_array(name, shape=(points, 6) if name != "alpha" else (points,),
                                       chunks=(chunk, 6) if name != "alpha" else (chunk,), dtype="f8",
                                       compressors=None, fill_value=0.0)
              for name in J2_INPUTS}
    for start in range(0, points, chunk):
        stop = min(start + chunk, points)
        arrays["strain"][start:stop] = loading_strain(numpy.arange(start, stop))
    return os.fspath(path)


def j2_outputs(tangent=True):
    """What :func:`j2_chunk` returns per point, ``{name: (item_shape, dtype)}``, so outputs are allocated up front.

    Examples
    --------
    >>> sorted(j2_outputs(tangent=False))
    ['alpha', 'plastic_strain', 'stress']
    """
    spec = {"stress": ((6,), "f8"), "plastic_strain": ((6,), "f8"), "alpha": ((), "f8")}
    if tangent:
        spec["tangent"] = ((6, 6), "f8")
    return spec


def j2_chunk(work, device=None, params=_DEFAULT_PARAMETERS, *, xp=None, tangent=True, out=None):
    """Run the J2 update on the points ``work``: a slice of global indices, or the chunk's inputs.

    For a slice, inputs are generated where the chunk runs by :func:`loading_strain`,
    from zero plastic strain and zero ``alpha``, so no arrays travel to the worker.
    A dict gives the inputs themselves (``strain``, ``plastic_strain``, ``alpha``;
    ``dsched run --input`` reads them from a Zarr store, chunk by chunk).

    Parameters
    ----------
    work : slice or dict
        Point indices ``work.start`` (default 0) to ``work.stop``, step ``work.step``;
        or ``{"strain": (n, 6), "plastic_strain": (n, 6), "alpha": (n,)}`` arrays.
    device : Device or None
        Where the chunk runs: CuPy on a real CUDA device, NumPy otherwise.
    params : J2Parameters
        Material constants.
    xp : module, optional
        Overrides the array module chosen from ``device``.
    tangent : bool
        Whether to compute and return the tangent.
    out : dict, optional
        Host arrays to compute into (a dispatcher's output rows), as in
        :func:`j2_update`; used when the chunk computes with NumPy.

    Returns
    -------
    dict of NumPy arrays
        As :func:`j2_update`, copied back to the host.
    """
    if isinstance(work, dict):
        missing = [name for name in J2_INPUTS if name not in work]
        if missing:
            raise ValueError(f"work: the J2 inputs {', '.join(missing)} are missing (it has {', '.join(work)})")
    elif not isinstance(work, slice) or work.stop is None:
        raise ValueError(f"work must be a slice with a stop, or a dict of inputs, got {work!r}")
    if xp is None:
        xp, context = _xp_for(device)
    else:
        context = contextlib.nullcontext()
    with context:
        if isinstance(work, dict):
            strain, plastic_strain, alpha = (xp.asarray(work[name]) for name in J2_INPUTS)
        else:
            strain = loading_strain(xp.arange(work.start or 0, work.stop, work.step or 1), xp=xp)
            plastic_strain = xp.zeros(strain.shape, dtype=strain.dtype)
            alpha = xp.zeros(strain.shape[0], dtype=strain.dtype)
        result = j2_update(strain, plastic_strain, alpha, params, tangent=tangent, xp=xp,
                           out=out if xp is numpy else None)
        return {key: _to_host(value) for key, value in result.items()}
