# NEML2 benchmark scenario "radret", written for dsched: the same model and parameters as
# NEML2's benchmark/radret/model.i (its histories are built by dsched.models.scenarios).
# A radial return: the flow directions are fixed by the trial state (elastic predictor from the old
# plastic strain), so only the consistency parameter gamma is solved for (Newton, dense LU, a linear
# extrapolation predictor). Perzyna flow (reference stress 100, exponent 2), yield stress 5, linear
# isotropic and kinematic hardening (moduli 1000), E = 1e5, nu = 0.3; forward Euler for the plastic
# strain, the equivalent plastic strain and the kinematic plastic strain.
[Models]
  # --- the trial state -------------------------------------------------------------
  [trial_elastic_strain]
    type = SR2LinearCombination
    from = 'strain plastic_strain~1'
    to = 'elastic_strain'
    weights = '1 -1'
  []
  [trial_isoharden]
    type = LinearIsotropicHardening
    hardening_modulus = 1000
    equivalent_plastic_strain = 'equivalent_plastic_strain~1'
    isotropic_hardening = 'trial_isoharden'
  []
  [trial_kinharden]
    type = LinearKinematicHardening
    hardening_modulus = 1000
    kinematic_plastic_strain = 'kinematic_plastic_strain~1'
    back_stress = 'trial_backstress'
  []
  [trial_overstress]
    type = SR2LinearCombination
    from = 'mandel_stress trial_backstress'
    to = 'trial_overstress'
    weights = '1 -1'
  []
  [trial_vonmises]
    type = SR2Invariant
    invariant_type = 'VONMISES'
    tensor = 'trial_overstress'
    invariant = 'trial_effective_stress'
  []
  [trial_yield]
    type = YieldFunction
    yield_stress = 5
    effective_stress = 'trial_effective_stress'
    isotropic_hardening = 'trial_isoharden'
    yield_function = 'trial_yield_function'
  []
  [trial_flow]
    type = ComposedModel
    models = 'trial_overstress trial_vonmises trial_yield'
  []
  [trial_normality]
    type = Normality
    model = 'trial_flow'
    function = 'trial_yield_function'
    from = 'mandel_stress trial_isoharden trial_backstress'
    to = 'NM Nk NX'
  []
  [trial_state]
    type = ComposedModel
    models = 'trial_elastic_strain cauchy_stress mandel_stress trial_isoharden trial_kinharden trial_normality'
  []
  # --- the return along the fixed directions -----------------------------------------
  [isoharden]
    type = LinearIsotropicHardening
    hardening_modulus = 1000
  []
  [kinharden]
    type = LinearKinematicHardening
    hardening_modulus = 1000
  []
  [trial_flow_rate]
    type = ScalarVariableRate
    variable = 'gamma'
  []
  [plastic_strain_rate]
    type = AssociativePlasticFlow
    flow_direction = 'NM'
    flow_rate = 'gamma_rate'
  []
  [plastic_strain]
    type = SR2ForwardEulerTimeIntegration
    variable = 'plastic_strain'
  []
  [elastic_strain]
    type = SR2LinearCombination
    from = 'strain plastic_strain'
    to = 'elastic_strain'
    weights = '1 -1'
  []
  [cauchy_stress]
    type = LinearIsotropicElasticity
    coefficient_types = 'YOUNGS_MODULUS POISSONS_RATIO'
    coefficients = '1e5 0.3'
    strain = 'elastic_strain'
  []
  [mandel_stress]
    type = IsotropicMandelStress
    cauchy_stress = 'stress'
  []
  [overstress]
    type = SR2LinearCombination
    from = 'mandel_stress back_stress'
    to = 'overstress'
    weights = '1 -1'
  []
  [vonmises]
    type = SR2Invariant
    invariant_type = 'VONMISES'
    tensor = 'overstress'
    invariant = 'effective_stress'
  []
  [yield_surface]
    type = YieldFunction
    yield_stress = 5
    isotropic_hardening = 'isotropic_hardening'
  []
  [equivalent_plastic_strain_rate]
    type = AssociativeIsotropicPlasticHardening
    isotropic_hardening_direction = 'Nk'
    flow_rate = 'gamma_rate'
  []
  [equivalent_plastic_strain]
    type = ScalarForwardEulerTimeIntegration
    variable = 'equivalent_plastic_strain'
  []
  [kinematic_plastic_strain_rate]
    type = AssociativeKinematicPlasticHardening
    kinematic_hardening_direction = 'NX'
    flow_rate = 'gamma_rate'
  []
  [kinematic_plastic_strain]
    type = SR2ForwardEulerTimeIntegration
    variable = 'kinematic_plastic_strain'
  []
  [flow_rate]
    type = PerzynaPlasticFlowRate
    reference_stress = 100
    exponent = 2
  []
  [consistency]
    type = ScalarLinearCombination
    from = 'gamma_rate flow_rate'
    to = 'gamma_residual'
    weights = '1 -1'
  []
  [surface]
    type = ComposedModel
    models = 'trial_flow_rate plastic_strain_rate plastic_strain elastic_strain cauchy_stress mandel_stress
              kinematic_plastic_strain_rate kinematic_plastic_strain kinharden
              equivalent_plastic_strain_rate equivalent_plastic_strain isoharden
              overstress vonmises yield_surface flow_rate consistency'
  []
[]

[EquationSystems]
  [eq_sys]
    type = NonlinearSystem
    model = 'surface'
    unknowns = 'gamma'
  []
[]

[Solvers]
  [lu]
    type = DenseLU
  []
  [newton]
    type = Newton
    linear_solver = 'lu'
  []
[]

[Models]
  [predictor]
    type = LinearExtrapolationPredictor
    unknowns_Scalar = 'gamma'
  []
  [return_map]
    type = ImplicitUpdate
    equation_system = 'eq_sys'
    solver = 'newton'
    predictor = 'predictor'
  []
  [model0]
    type = ComposedModel
    models = 'trial_state return_map trial_flow_rate plastic_strain_rate plastic_strain
              equivalent_plastic_strain_rate equivalent_plastic_strain
              kinematic_plastic_strain_rate kinematic_plastic_strain'
    additional_outputs = 'gamma'
  []
  [model]
    type = ComposedModel
    models = 'model0 elastic_strain cauchy_stress'
    additional_outputs = 'plastic_strain equivalent_plastic_strain kinematic_plastic_strain'
  []
[]
