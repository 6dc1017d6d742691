"""Your own model in a job file: linear elasticity, named in ``elastic.toml`` as ``elastic:stress``.

``dsched run examples/own_model/elastic.toml`` imports this module on the
client and on every worker (from the graph file's folder, since it is not
installed) and calls :func:`stress` on each chunk's rows. The inputs come from
:func:`loading`, the graph's ``model.generator``, called where each chunk runs,
or from a Zarr store with an array ``strain`` (``--input strains.zarr``).
"""

import numpy as np

# Voigt order xx, yy, zz, yz, xz, xy; the shear strains are engineering strains.
_TRACE = np.array([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])


def stress(strain, youngs_modulus=200e3, poisson_ratio=0.3):
    """Small-strain isotropic elasticity: the stress and the strain energy density of each point."""
    lam = youngs_modulus * poisson_ratio / ((1 + poisson_ratio) * (1 - 2 * poisson_ratio))
    mu = youngs_modulus / (2 * (1 + poisson_ratio))
    volumetric = strain[:, :3].sum(axis=1)
    sigma = lam * volumetric[:, None] * _TRACE + 2 * mu * strain * np.where(_TRACE > 0, 1.0, 0.5)
    return {"stress": sigma, "energy": 0.5 * (sigma * strain).sum(axis=1)}


def loading(start, stop):
    """The strain of points ``start`` to ``stop - 1``: a function of each point's index alone, so every chunk
    makes its own rows where it runs and no array travels to the workers."""
    t = np.arange(start, stop, dtype=float)[:, None] / 1_000_000
    return {"strain": 1e-3 * np.sin(t + np.arange(6.0))}
