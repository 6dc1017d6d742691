# NEML2 benchmark scenario "elasticity", written for dsched: the same model and parameters as
# NEML2's benchmark/elasticity/model.i (its histories are built by dsched.models.scenarios).
# Linear isotropic elasticity, E = 1000, nu = 0.3: strain -> stress.
[Models]
  [model]
    type = LinearIsotropicElasticity
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
    coefficients = '1e3 0.3'
  []
[]
