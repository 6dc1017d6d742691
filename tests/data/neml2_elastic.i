# Linear isotropic elasticity (E = 200 GPa in MPa, nu = 0.3): strain -> stress. Written for dsched's tests.
[Models]
  [model]
    type = LinearIsotropicElasticity
    coefficients = '200e3 0.3'
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
  []
[]
