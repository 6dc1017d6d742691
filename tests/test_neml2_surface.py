"""NEML2's sensitivity surface, parameters, compiled models and AOTI artifacts across worker processes.

Two single-thread worker processes (cpu and an emulated cuda:0, the module's
``process_client``). Every result is compared with NEML2 called directly: on
the same chunks (bit for bit) or on the whole batch in one process (to NEML2's
Newton tolerance, tightened where the test needs it). Compiled models use
torch.compile's ``aot_eager`` backend: the same graphs, guards and
recompilations as the default (inductor), without its C++ code generation,
which takes half a minute per process on a small machine. Skipped where neml2
is not installed.
"""

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

import dsched
from dsched.models.neml2_scenarios import VISCOPLASTIC_INPUT

neml2 = pytest.importorskip("neml2", reason="neml2 is not installed (pip install 'dsched[neml2]')")
torch = pytest.importorskip("torch")

from dsched.models import NEML2Model  # noqa: E402

DATA = Path(__file__).parent / "data"
ELASTIC, VISCOPLASTIC = DATA / "neml2_elastic.i", VISCOPLASTIC_INPUT
TIGHT = ("Solvers/newton/rel_tol:=1e-12", "Solvers/newton/abs_tol:=1e-12")
YIELD = "implicit_rate.normality.flow.yield_surface.sy"
COMPILE = {"backend": "aot_eager"}


def _inputs(n, seed=0):
    strain = np.random.default_rng(seed).uniform(-4e-3, 4e-3, size=(n, 6))
    return {"E": strain, "E~1": np.zeros((1, 6)), "t": 1.0, "t~1": 0.0,
            "stress~1": np.zeros((1, 6)), "equivalent_plastic_strain~1": 0.0}


def _state(inputs, rows=slice(None)):
    return {k: torch.as_tensor(np.asarray(v, dtype=np.float64)[rows] if np.ndim(v) and len(v) > 1 else
                               np.asarray(v, dtype=np.float64)) for k, v in inputs.items()}


def _numpy(value):
    value = getattr(value, "data", value)
    return value.detach().numpy()


def _load(path=VISCOPLASTIC, overrides=(), parameters=None):
    model = neml2.load_input(str(path), additional_args=list(overrides)).get_model("model")
    for name, value in (parameters or {}).items():
        model.set_parameter(name, value)
    return model


def _on_chunks(call, inputs, bounds):
    """NEML2 called on each chunk of points: the chunks' results, in order."""
    return [call(_state(inputs, slice(a, b))) for a, b in bounds]


def _joined(parts):
    """Per-item results of chunks joined along the points, like dsched's (dicts, nested dicts, tensors)."""
    if isinstance(parts[0], dict):
        return {k: _joined([p[k] for p in parts]) for k in parts[0]}
    return np.concatenate([_numpy(p) for p in parts])


def _assert_equal(result, reference):
    if isinstance(reference, dict):
        assert sorted(result) == sorted(reference)
        for k in reference:
            _assert_equal(result[k], reference[k])
    else:
        np.testing.assert_array_equal(np.asarray(result), reference)


EQUAL_CHUNKS = [(0, 20), (20, 40), (40, 60)]  # batch sizes of 20 on both devices: the same cut wherever chunks run


def _equal_halves():
    return dsched.StaticHybridScheduler(["cpu", "cuda:0"], [20, 20])


def test_jvp_jacobian_and_param_jacobian_equal_neml2_on_the_same_chunks(process_client):
    inputs, tangents = _inputs(60, seed=1), {"E": np.random.default_rng(2).normal(size=(60, 6))}
    model, reference = NEML2Model(VISCOPLASTIC, "model"), _load()
    s = _equal_halves()

    outputs, jvp = model.jvp(inputs, tangents, scheduler=s, client=process_client)
    parts = [reference.jvp(_state(inputs, slice(a, b)), {"E": torch.as_tensor(tangents["E"][a:b])})
             for a, b in EQUAL_CHUNKS]
    _assert_equal(outputs, _joined([p[0] for p in parts]))
    _assert_equal(jvp, _joined([p[1] for p in parts]))
    assert jvp["stress"].shape == (60, 6) and np.abs(jvp["stress"]).max() > 0

    outputs, jacobian = model.jacobian(inputs, scheduler=s, client=process_client)
    parts = _on_chunks(reference.jacobian, inputs, EQUAL_CHUNKS)
    _assert_equal(jacobian, _joined([p[1] for p in parts]))
    assert jacobian["stress"]["E"].shape == (60, 6, 6)

    outputs, pjac = model.param_jacobian(inputs, [YIELD, "implicit_rate.elasticity.E"], scheduler=s,
                                         client=process_client)
    parts = _on_chunks(lambda st: reference.param_jacobian(st, [YIELD, "implicit_rate.elasticity.E"]), inputs,
                       EQUAL_CHUNKS)
    _assert_equal(outputs, _joined([p[0] for p in parts]))
    _assert_equal(pjac, _joined([p[1] for p in parts]))
    assert pjac["stress"][YIELD].shape == (60, 6) and np.abs(pjac["stress"][YIELD]).max() > 0  # points yield


def test_param_vjp_sums_the_chunks_in_chunk_order(process_client):
    inputs = _inputs(60, seed=3)
    cotangents = {"stress": np.random.default_rng(4).normal(size=(60, 6))}
    model = NEML2Model(VISCOPLASTIC, "model", overrides=TIGHT)
    first = model.param_vjp(inputs, cotangents, scheduler=_equal_halves(), client=process_client)
    again = model.param_vjp(inputs, cotangents, scheduler=_equal_halves(), client=process_client)
    reference = _load(overrides=TIGHT)
    zero = torch.zeros((), dtype=torch.float64)
    per_chunk = [reference.param_vjp(_state(inputs, slice(a, b)), {
        "stress": torch.as_tensor(cotangents["stress"][a:b]), "equivalent_plastic_strain": zero}) for a, b in EQUAL_CHUNKS]
    summed = {k: sum((p[k] for p in per_chunk[1:]), per_chunk[0][k]) for k in per_chunk[0]}  # chunk order
    assert sorted(first) == sorted(summed) and len(first) == 9
    assert all(type(g) is np.ndarray and g.shape == () for g in first.values())  # NumPy in, NumPy arrays out
    for name, value in summed.items():
        np.testing.assert_array_equal(first[name], _numpy(value), err_msg=name)  # the same bits
        np.testing.assert_array_equal(again[name], first[name], err_msg=name)
    # One NEML2 process on the whole batch: the same gradient, to 1e-10 relative.
    whole = reference.param_vjp(_state(inputs), {"stress": torch.as_tensor(cotangents["stress"]),
                                                  "equivalent_plastic_strain": zero})
    for name, value in whole.items():
        np.testing.assert_allclose(first[name], _numpy(value), rtol=1e-10, atol=0, err_msg=name)


def test_parameter_changes_reach_every_workers_copy(process_client):
    inputs = _inputs(40, seed=5)
    model = NEML2Model(VISCOPLASTIC, "model", overrides=TIGHT)
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [10, 10])  # both workers run chunks of every call
    bounds = [(0, 10), (10, 20), (20, 30), (30, 40)]

    def expected(**parameters):
        return _joined(_on_chunks(_load(overrides=TIGHT, parameters=parameters).call_by_name, inputs, bounds))

    before = model.dispatch(inputs, scheduler=s, client=process_client)
    _assert_equal(before, expected())
    model.set_parameter(YIELD, 120.0)
    _assert_equal(model.dispatch(inputs, scheduler=s, client=process_client), expected(**{YIELD: 120.0}))
    model.named_parameters()["implicit_rate.elasticity.E"].fill_(150e3)  # in place, as on a NEML2 model
    both = expected(**{YIELD: 120.0, "implicit_rate.elasticity.E": 150e3})
    _assert_equal(model.dispatch(inputs, scheduler=s, client=process_client), both)
    _assert_equal(model(inputs), _joined([_load(overrides=TIGHT, parameters={
        YIELD: 120.0, "implicit_rate.elasticity.E": 150e3}).call_by_name(_state(inputs))]))  # a direct call: its own
    model.set_parameter(YIELD, 150.0)  # the file's values again: the copies must drop what they were sent
    model.set_parameter("implicit_rate.elasticity.E", 200e3)
    _assert_equal(model.dispatch(inputs, scheduler=s, client=process_client), before)


def test_bad_arguments_name_the_field_before_any_work():
    model = NEML2Model(VISCOPLASTIC, "model")
    s, inputs = dsched.SimpleScheduler("cpu", 4), _inputs(4)
    with pytest.raises(ValueError, match=r"tangents: \['strain'\] are not inputs of this model \(it has \['E', "):
        model.jvp(inputs, {"strain": np.ones((4, 6))}, scheduler=s, mode="sync")
    with pytest.raises(ValueError, match=r"cotangents: \['strain'\] are not outputs of this model \(it has \["):
        model.param_vjp(inputs, {"strain": np.ones((4, 6))}, scheduler=s, mode="sync")
    with pytest.raises(ValueError, match=r"params: \['E'\] are not parameters of this model \(it has \['implicit_"):
        model.param_jacobian(inputs, ["E"], scheduler=s, mode="sync")
    with pytest.raises(ValueError, match=r"name: 'E' is not a parameter of this model \(its parameters: implicit_"):
        model.set_parameter("E", 1.0)
    with pytest.raises(ValueError, match=r"value: '.*\.sy' takes a number or a tensor of shape \(\), got ndarray of "
                                         r"shape \(4,\) \(a value per point is an input, not a parameter\)"):
        model.set_parameter(YIELD, np.ones(4))
    assert float(model.named_parameters()[YIELD]) == 150.0  # nothing changed
    with pytest.raises(ValueError, match=r"compile: expected True, False, a torch.compile mode or a dict of "
                                         r"torch.compile options \(but dynamic, which neml2.compile fixes\), got 3"):
        NEML2Model(ELASTIC, "model", compile=3)
    with pytest.raises(ValueError, match=r"compile: .*got \{'dynamic': True\}"):
        NEML2Model(ELASTIC, "model", compile={"dynamic": True})


def test_blocks_by_default_only_for_an_eager_model_that_solves():
    from dsched.models.row_blocks import BLOCK

    assert NEML2Model(VISCOPLASTIC, "model").block == BLOCK  # an implicit update: a Newton solve per call
    assert NEML2Model(ELASTIC, "model").block is None  # no solve: one call per chunk
    assert NEML2Model(ELASTIC, "model", block=9).block == 9
    assert NEML2Model(VISCOPLASTIC, "model", compile=True).block is None
    assert NEML2Model(ELASTIC, "model", compile=True).block is None
    assert NEML2Model(ELASTIC, "model", compile=True, block=7).block == 7
    with pytest.raises(ValueError, match=r"block: expected an integer >= 1, None or 'auto', got 'big'"):
        NEML2Model(ELASTIC, "model", block="big")


# --- compiled models ------------------------------------------------------------------


def test_a_compiled_model_compiles_once_per_worker_with_a_fixed_batch(process_client):
    """One graph per worker process: the short last chunk is padded to its device's size (counted, not timed)."""
    inputs = {"strain": np.random.default_rng(6).uniform(-4e-3, 4e-3, size=(50, 6))}
    model = NEML2Model(ELASTIC, "model", compile=COMPILE)
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [8, 12])  # 50 = 8 + 12 + ... + a short last chunk
    start = model.compiled_graphs(process_client)
    out = model.dispatch(inputs, scheduler=s, client=process_client)
    first = model.compiled_graphs(process_client)
    workers = [w for w in first if w != "client"]
    assert len(workers) == 2 and all(first[w] - start[w] == 1 for w in workers), (start, first)
    reference = _load(ELASTIC)
    expected = _numpy(reference.call_by_name(_state({"strain": inputs["strain"]}))["stress"])
    np.testing.assert_array_equal(out["stress"], expected)
    for _ in range(3):
        np.testing.assert_array_equal(model.dispatch(inputs, scheduler=s, client=process_client)["stress"], expected)
    assert model.compiled_graphs(process_client) == first  # no recompilation after the first call

    model.set_parameter("E", 100e3)  # reaches the compiled copies without a recompilation
    np.testing.assert_allclose(model.dispatch(inputs, scheduler=s, client=process_client)["stress"], expected / 2,
                               rtol=1e-14)
    assert model.compiled_graphs(process_client) == first

    cotangents = {"stress": np.random.default_rng(7).normal(size=(50, 6))}
    grads = model.param_vjp(inputs, cotangents, scheduler=s, client=process_client)
    reference.set_parameter("E", 100e3)
    whole = reference.param_vjp(_state({"strain": inputs["strain"]}), {"stress": torch.as_tensor(cotangents["stress"])})
    for name, value in whole.items():
        np.testing.assert_allclose(grads[name], _numpy(value), rtol=1e-10, atol=0, err_msg=name)
    after_vjp = model.compiled_graphs(process_client)
    model.param_vjp(inputs, cotangents, scheduler=s, client=process_client)
    assert model.compiled_graphs(process_client) == after_vjp


def test_a_compiled_model_with_a_block_compiles_once_whatever_the_chunk_sizes(process_client):
    """Cuts that move from call to call (a BalancedScheduler's) make chunks of new sizes: with block=8 each chunk
    runs in pieces of 8 rows, the last one padded, so each worker compiles one graph."""
    inputs = {"strain": np.random.default_rng(10).uniform(-4e-3, 4e-3, size=(40, 6))}
    model = NEML2Model(ELASTIC, "model", compile=COMPILE, block=8)
    expected = _numpy(_load(ELASTIC).call_by_name(_state({"strain": inputs["strain"]}))["stress"])
    start, first = model.compiled_graphs(process_client), None
    for cut in ([24, 16], [13, 27], [31, 9], [20, 20]):
        s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], cut)
        np.testing.assert_array_equal(model.dispatch(inputs, scheduler=s, client=process_client)["stress"], expected)
        graphs = model.compiled_graphs(process_client)
        first = first or graphs  # at most one graph per worker (none where an earlier test's graph of 8 rows fits)
        assert graphs == first and all(graphs[w] - start[w] <= 1 for w in graphs), (cut, start, graphs)


def test_a_compiled_model_without_autograd_takes_turns_between_values_and_gradients_with_no_recompilation(
        process_client):
    """Values under torch.no_grad and a parameter gradient with autograd are two graphs per worker, each built once."""
    inputs = {"strain": np.random.default_rng(8).uniform(-4e-3, 4e-3, size=(40, 6))}
    cotangents = {"stress": np.random.default_rng(9).normal(size=(40, 6))}
    model = NEML2Model(ELASTIC, "model", compile=COMPILE, autograd=False)
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [20, 20])
    model.dispatch(inputs, scheduler=s, client=process_client)
    grads = model.param_vjp(inputs, cotangents, scheduler=s, client=process_client)
    both = model.compiled_graphs(process_client)
    for _ in range(2):
        out = model.dispatch(inputs, scheduler=s, client=process_client)
        again = model.param_vjp(inputs, cotangents, scheduler=s, client=process_client)
    assert model.compiled_graphs(process_client) == both  # no recompilation when the two take turns
    with torch.no_grad():
        expected = _numpy(_load(ELASTIC).call_by_name(_state({"strain": inputs["strain"]}))["stress"])
    np.testing.assert_allclose(out["stress"], expected, rtol=1e-14, atol=0)
    for name, value in grads.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)


def test_padding_keeps_a_device_to_the_sizes_it_has_compiled():
    from dsched.models.row_blocks import PaddedSizes, padded, pieces, unpadded

    assert pieces(10, 4) == [(0, 4), (4, 8), (8, 10)] and pieces(3, 4) == [(0, 3)] and pieces(5, None) == [(0, 5)]
    sizes = PaddedSizes()
    assert [sizes.size(n) for n in (8, 3, 8, 12, 10, 2)] == [8, 8, 8, 12, 12, 8] and sizes.sizes == [8, 12]
    value = neml2.types.SR2(torch.arange(18.0, dtype=torch.float64).reshape(3, 6))
    grown = padded(value, 3, 5)
    assert grown.data.shape == (5, 6) and torch.equal(grown.data[3:], value.data[[2, 2]])  # the last point again
    assert torch.equal(padded(value, 3, 5, zeros=True).data[3:], torch.zeros(2, 6, dtype=torch.float64))
    assert torch.equal(unpadded(grown, 3, 5).data, value.data)
    unbatched = neml2.types.SR2(torch.ones(6, dtype=torch.float64))
    assert padded(unbatched, 3, 5) is unbatched and unpadded(unbatched, 3, 5) is unbatched


# --- AOTI artifacts -----------------------------------------------------------------


def _fake_artifacts(root, leaves=("cpu/float64",), derivatives=()):
    """An artifact root's layout (metadata, leaves with a .pt2 each) without compiled graphs: the checks before any
    work read nothing else."""
    meta = {"inputs": [{"name": "strain", "var_type": "SR2", "base_shape": [6]}],
            "outputs": [{"name": "stress", "var_type": "SR2", "base_shape": [6]}],
            "parameters": [{"name": "model.E", "shape": [], "values": [200e3]}],
            "derivatives": [list(d) for d in derivatives], "parameter_derivatives": []}
    root.mkdir()
    (root / "metadata.json").write_text(json.dumps(meta))
    for leaf in leaves:
        (root / leaf).mkdir(parents=True)
        (root / leaf / "model.pt2").write_bytes(b"")
    return root


def test_artifacts_name_a_device_without_a_leaf_before_any_work(tmp_path):
    model = NEML2Model.from_artifacts(_fake_artifacts(tmp_path / "elastic"))
    assert model.input_names == ["strain"] and model.output_names == ["stress"]
    assert model.base_shapes == {"strain": (6,), "stress": (6,)}
    assert {k: float(v) for k, v in model.named_parameters().items()} == {"model.E": 200e3}
    inputs = {"strain": np.zeros((4, 6))}
    with pytest.raises(ValueError, match=r"devices: cuda:0 has no artifact: no cuda/float64 leaf under .*elastic \(it "
                                         r"has cpu/float64\); export one with neml2.export_model_for_aoti\(\.\.\., "
                                         r"device='cuda', dtype='float64'\)"):
        model.dispatch(inputs, scheduler=dsched.StaticHybridScheduler(["cpu", "cuda:0"], [2, 2]), mode="sync")
    with pytest.raises(ValueError, match=r"jvp: the artifact under .* has none of these derivatives compiled in \(it "
                                         r"has none\); export with derivatives=\['OUT:IN', \.\.\.\]"):
        model.jvp(inputs, {"strain": np.ones((4, 6))}, scheduler=dsched.SimpleScheduler("cpu", 2), mode="sync")
    with pytest.raises(ValueError, match=r"param_vjp: .* export with derivatives=\['OUT:PARAM', \.\.\.\] and the "
                                         r"parameters promoted"):
        model.param_vjp(inputs, {"stress": np.ones((4, 6))}, scheduler=dsched.SimpleScheduler("cpu", 2), mode="sync")
    with pytest.raises(ValueError, match=r"root: no NEML2 artifact at .*nowhere \(no metadata.json; write one with "
                                         r"neml2.export_model_for_aoti\)"):
        NEML2Model.from_artifacts(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"dtype: expected one of \('float64', 'float32'\), got 'float16'"):
        NEML2Model.from_artifacts(tmp_path / "elastic", dtype="float16")
    with pytest.raises(ValueError, match=r"root: .*empty holds no compiled leaf"):
        NEML2Model.from_artifacts(_fake_artifacts(tmp_path / "empty", leaves=()))


def test_an_emulated_gpu_loads_the_cpu_leaf(tmp_path, process_client):
    """The check asks the cluster: an emulated cuda:0 computes on the CPU, so the cpu leaf serves it."""
    model = NEML2Model.from_artifacts(_fake_artifacts(tmp_path / "elastic"))
    model._prepare("values", {"strain": 0.0}, dsched.StaticHybridScheduler(["cpu", "cuda:0"], [2, 2]),
                   {"client": process_client})  # no error: both workers have their leaf


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DSCHED_TEST_AOTI"), reason="set DSCHED_TEST_AOTI=1 to export an AOTI "
                    "artifact (one to two minutes of C++ compilation) and run it across workers")
def test_artifacts_across_workers_equal_neml2(tmp_path, process_client):
    root = tmp_path / "elastic"
    neml2.export_model_for_aoti(str(ELASTIC), "model", str(root), promoted=["model.E"],
                                derivatives=["stress:strain", "stress:model.E"])
    model = NEML2Model.from_artifacts(root)
    inputs = {"strain": np.random.default_rng(8).uniform(-4e-3, 4e-3, size=(50, 6))}
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [8, 12])
    reference = _load(ELASTIC, parameters={"E": 100e3})
    model.set_parameter("model.E", 100e3)
    state = _state(inputs)
    np.testing.assert_allclose(model.dispatch(inputs, scheduler=s, client=process_client)["stress"],
                               _numpy(reference.call_by_name(state)["stress"]), rtol=1e-14)
    _, jvp = model.jvp(inputs, {"strain": np.ones((50, 6))}, scheduler=s, client=process_client)
    _, expected = reference.jvp(state, {"strain": torch.ones(50, 6, dtype=torch.float64)})
    np.testing.assert_allclose(jvp["stress"], _numpy(expected["stress"]), rtol=1e-14)
    cotangents = {"stress": np.random.default_rng(9).normal(size=(50, 6))}
    grads = model.param_vjp(inputs, cotangents, scheduler=s, client=process_client)
    whole = reference.param_vjp(state, {"stress": torch.as_tensor(cotangents["stress"])}, ["E"])
    np.testing.assert_allclose(grads["model.E"], _numpy(whole["E"]), rtol=1e-10)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DSCHED_TEST_AOTI"), reason="set DSCHED_TEST_AOTI=1 to compile with "
                    "torch.compile's default backend (half a minute of C++ compilation)")
def test_the_default_compiler_equals_neml2_compiled():
    inputs = {"strain": np.random.default_rng(10).uniform(-4e-3, 4e-3, size=(30, 6))}
    model = NEML2Model(ELASTIC, "model", compile=True)
    out = model.dispatch(inputs, scheduler=dsched.SimpleScheduler("cpu", 8), mode="sync")
    reference = neml2.compile(_load(ELASTIC))
    np.testing.assert_allclose(out["stress"], _numpy(reference.call_by_name(_state(inputs))["stress"]), rtol=1e-14)


# --- calibration ----------------------------------------------------------------------


def _example(name):
    path = Path(__file__).parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_calibration_example_fits_as_one_neml2_process_does(process_client):
    calibrate = _example("neml2_calibrate")
    inputs = calibrate.step_inputs(40)
    target = calibrate.synthetic_target(inputs)
    model = NEML2Model(VISCOPLASTIC, "model", overrides=calibrate.TIGHT)
    s = _equal_halves()
    across = calibrate.fit_with_dsched(model, inputs, target, s, process_client, 150.0, 10)
    alone = calibrate.fit_in_one_process(inputs, target, 150.0, 10)
    assert len(across) == len(alone) >= 4
    np.testing.assert_allclose(across, alone, rtol=1e-10, atol=0)
    assert abs(across[-1] - calibrate.TRUE_YIELD) < 1e-6  # the truth, recovered


def test_a_compiled_model_without_autograd_computes_its_values_in_the_rows_it_is_given():
    """The chunk's output rows given (dispatch's ``out=``): the compiled graph writes the values there and they
    come back as those very arrays; rows that do not fit, or values recorded for autograd, get arrays of their own."""
    strain = np.random.default_rng(11).uniform(-4e-3, 4e-3, size=(30, 6))
    with torch.no_grad():
        expected = _numpy(_load(ELASTIC).call_by_name(_state({"strain": strain}))["stress"])
    model = NEML2Model(ELASTIC, "model", compile=COMPILE, autograd=False)
    values = model._operation("values")
    rows = {"stress": np.full((30, 6), np.nan)}
    assert values({"strain": strain}, out=rows)["stress"] is rows["stress"]
    np.testing.assert_array_equal(rows["stress"], expected)
    # The same rows again (a replay's): the torch view made for them the first time serves; other rows get theirs.
    engine = model._per_thread.get()
    [(kept_rows, kept_view)] = engine.row_views.values()
    rows["stress"][:] = np.nan
    assert values({"strain": 2 * strain}, out=rows)["stress"] is rows["stress"]
    assert list(engine.row_views.values()) == [(kept_rows, kept_view)] and kept_rows is rows["stress"]
    np.testing.assert_allclose(rows["stress"], 2 * expected, rtol=1e-14)
    other = {"stress": np.full((30, 6), np.nan)}
    assert values({"strain": strain}, out=other)["stress"] is other["stress"] and len(engine.row_views) == 2
    np.testing.assert_array_equal(other["stress"], expected)
    for name, unfit in [("short", {"stress": np.full((29, 6), np.nan)}),
                        ("float32", {"stress": np.full((30, 6), np.nan, np.float32)}),
                        ("read-only", {"stress": np.full((30, 6), np.nan)}),
                        ("strided", {"stress": np.full((60, 6), np.nan)[::2]}),
                        ("another name", {"strain": np.full((30, 6), np.nan)})]:
        if name == "read-only":
            unfit["stress"].flags.writeable = False
        result = values({"strain": strain}, out=unfit)["stress"]
        assert all(result is not array for array in unfit.values()), name
        assert all(np.isnan(array).all() for array in unfit.values()), name  # left alone
        np.testing.assert_array_equal(result, expected, err_msg=name)
    recorded = NEML2Model(ELASTIC, "model", compile=COMPILE)._operation("values")  # autograd: NEML2's own call
    rows = {"stress": np.full((30, 6), np.nan)}
    assert recorded({"strain": strain}, out=rows)["stress"] is not rows["stress"] and np.isnan(rows["stress"]).all()


def test_a_chunk_evaluated_in_blocks_writes_each_blocks_values_into_the_rows_it_is_given():
    """Blocks of 8 of 30 rows: each block's values go straight into the chunk's output rows (recorded or not,
    eager or compiled and padded), and come back as those arrays; kept autograd history gets arrays of its own."""
    strain = np.random.default_rng(12).uniform(-4e-3, 4e-3, size=(30, 6))
    with torch.no_grad():
        expected = _numpy(_load(ELASTIC).call_by_name(_state({"strain": strain}))["stress"])
    for name, options in [("eager", {}), ("eager, nothing recorded", {"autograd": False}),
                          ("compiled, padded pieces", {"compile": COMPILE, "autograd": False})]:
        values = NEML2Model(ELASTIC, "model", block=8, **options)._operation("values")
        rows = {"stress": np.full((30, 6), np.nan)}
        assert values({"strain": strain}, out=rows)["stress"] is rows["stress"], name
        np.testing.assert_allclose(rows["stress"], expected, rtol=1e-14, atol=0, err_msg=name)
    kept = NEML2Model(ELASTIC, "model", block=8, keep_grad=True)._operation("values")
    rows = {"stress": np.full((30, 6), np.nan)}
    result = kept({"strain": strain}, out=rows)["stress"]
    assert result is not rows["stress"] and np.isnan(rows["stress"]).all()
    np.testing.assert_allclose(np.asarray(result), expected, rtol=1e-14, atol=0)


def test_copies_of_a_compiled_model_share_its_graphs_and_read_their_own_parameters():
    """Two copies computing into rows in one process (a worker's threads): one graph per chunk size for both, each
    copy's values from its own parameters."""
    from dsched.models.neml2_engines import compiled_graphs

    strain = np.random.default_rng(13).uniform(-4e-3, 4e-3, size=(40, 6))
    with torch.no_grad():
        expected = _numpy(_load(ELASTIC).call_by_name(_state({"strain": strain}))["stress"])
    model = NEML2Model(ELASTIC, "model", compile=COMPILE, autograd=False)
    stiffer = NEML2Model(ELASTIC, "model", compile=COMPILE, autograd=False)
    stiffer.set_parameter("E", 2 * stiffer.named_parameters()["E"])
    before = compiled_graphs()
    for n in (37, 40):  # growing sizes: neither is padded up to the other
        rows = {"stress": np.full((n, 6), np.nan)}
        model._operation("values")({"strain": strain[:n]}, out=rows)
        np.testing.assert_array_equal(rows["stress"], expected[:n], err_msg=str(n))
        stiffer._evaluate_entries("values", {"strain": strain[:n]}, out=rows)  # its own parameters, as a call sends
        np.testing.assert_allclose(rows["stress"], 2 * expected[:n], rtol=1e-14, atol=0, err_msg=str(n))
    assert compiled_graphs() - before == 2


def test_a_compiled_dispatch_without_autograd_equals_neml2_on_worker_processes(process_client):
    """Through dispatch on worker processes (its chunks' output rows in shared memory): the same values as NEML2,
    one graph per worker, none again at the next calls."""
    strain = np.random.default_rng(12).uniform(-4e-3, 4e-3, size=(64, 6))
    with torch.no_grad():
        expected = _numpy(_load(ELASTIC).call_by_name(_state({"strain": strain}))["stress"])
    model = NEML2Model(ELASTIC, "model", compile=COMPILE, autograd=False)
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [32, 32])
    start = model.compiled_graphs(process_client)
    np.testing.assert_array_equal(model.dispatch({"strain": strain}, scheduler=s, client=process_client)["stress"],
                                  expected)
    first = model.compiled_graphs(process_client)
    assert all(first[w] - start[w] <= 1 for w in first if w != "client"), (start, first)
    for _ in range(2):
        np.testing.assert_array_equal(model.dispatch({"strain": strain}, scheduler=s, client=process_client)["stress"],
                                      expected)
    assert model.compiled_graphs(process_client) == first


# --- the bench's compiled rows ------------------------------------------------------


def test_the_bench_measures_compiled_rows_and_counts_recompilations(process_client):
    import dataclasses

    from dsched.apps.bench.neml2 import format_neml2_table, measure_scenario, verdicts
    from dsched.models.neml2_scenarios import SCENARIOS

    small = dataclasses.replace(SCENARIOS["elasticity"], points=40)
    result = measure_scenario(small, process_client, steps=2, repeats=1, block=7, compile=COMPILE)
    compiled = result["compiled"]
    assert compiled["forms"] == ["numpy", "driver"] and compiled["options"] == COMPILE
    assert set(compiled["rate"]) == {"neml2_1", "neml2_2", "neml2", "side_by_side", "paced", "numpy", "driver"}
    assert set(compiled["vs_paced"]) == {"numpy"}  # the form that returns after every step
    assert compiled["neml2_threads"] in (1, 2)
    assert compiled["seconds"]["neml2"] == min(compiled["seconds"]["neml2_1"], compiled["seconds"]["neml2_2"])
    assert compiled["graphs"]["warm_up"] > 0 and compiled["graphs"]["recompilations"] == 0
    # Halves of 20 points in pieces of 7, 7 and 6 (padded to 7): elasticity is exact on the same pieces.
    assert all(e["same_chunks_relative"] == 0.0 for e in compiled["error"].values())
    assert compiled["param_vjp"]["parameters"] == 2 and compiled["param_vjp"]["relative"] <= 1e-10  # E and nu
    targets = verdicts([result])
    assert targets["compiled: param_vjp equals NEML2's to 1e-10 relative"][2]
    assert targets["compiled: no recompilation after the warm-up (graphs)"] == (0, 0, True)
    assert {"compiled: median >= 1.2 x NEML2 compiled",
            "compiled: every form >= 0.8 x compiled halves side by side"} <= set(targets)
    table = format_neml2_table({"scenarios": [result], "forms": list(result["efficiency"]), "steps": 2,
                                "repeats": 1, "machine": "test", "load": None, "targets": targets, "block": 7})
    assert "compiled (neml2.compile): NEML2's driver, the better of 1 and 2 threads" in table
    assert "/ vs paced (dispatch, NumPy)" in table
    assert "target compiled: no recompilation after the warm-up (graphs): 0.00 (threshold 0): reached" in table


def test_compiled_bench_options_name_the_option(tmp_path):
    import argparse

    from dsched.apps.bench.neml2 import add_arguments, options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true")
    assert options(parser.parse_args([]))["compile"] is None and options(parser.parse_args([]))["aoti"] is None
    assert options(parser.parse_args(["--neml2-compile"]))["compile"] == {}
    assert options(parser.parse_args(["--neml2-compile", "max-autotune"]))["compile"] == {"mode": "max-autotune"}
    assert options(parser.parse_args(["--neml2-compile", "backend=aot_eager"]))["compile"] == {"backend": "aot_eager"}
    assert options(parser.parse_args(["--neml2-aoti", str(tmp_path / "aoti")]))["aoti"] == str(tmp_path / "aoti")
    with pytest.raises(ValueError, match=r"--neml2-aoti: the folder holding .*nowhere/aoti does not exist"):
        options(parser.parse_args(["--neml2-aoti", str(tmp_path / "nowhere" / "aoti")]))


# --- a real GPU -----------------------------------------------------------------------


@pytest.mark.gpu
def test_the_surface_and_parameters_on_a_real_gpu_match_neml2_on_the_cpu():
    """cuda:0 beside the CPU: jvp, param_vjp, a parameter change and a compiled model, against NEML2 on the CPU
    (the GPU's last bits differ, and NEML2's Newton stops on a tolerance: tightened, the two agree closely)."""
    from distributed import Client

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to torch")
    inputs, n = _inputs(4_000, seed=11), 4_000
    tangents = {"E": np.random.default_rng(12).normal(size=(n, 6))}
    cotangents = {"stress": np.random.default_rng(13).normal(size=(n, 6))}
    s = dsched.StaticHybridScheduler(["cpu", "cuda:0"], [1_000, 3_000], priorities=[1, 2])
    model = NEML2Model(VISCOPLASTIC, "model", overrides=TIGHT)
    reference = _load(overrides=TIGHT, parameters={YIELD: 120.0})
    state = _state(inputs)
    zero = torch.zeros((), dtype=torch.float64)
    with dsched.LocalHybridCluster(["cpu", "cuda:0"], processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        model.set_parameter(YIELD, 120.0)
        outputs, jvp = model.jvp(inputs, tangents, scheduler=s, client=client)
        grads = model.param_vjp(inputs, cotangents, scheduler=s, client=client)
        compiled = NEML2Model(ELASTIC, "model", compile=COMPILE).dispatch(
            {"strain": inputs["E"]}, scheduler=s, client=client)
    expected_out, expected_jvp = reference.jvp(state, {"E": torch.as_tensor(tangents["E"])})
    for name in outputs:
        np.testing.assert_allclose(outputs[name], _numpy(expected_out[name]), rtol=1e-9, atol=1e-9, err_msg=name)
    np.testing.assert_allclose(jvp["stress"], _numpy(expected_jvp["stress"]), rtol=1e-8, atol=1e-6)
    whole = reference.param_vjp(state, {"stress": torch.as_tensor(cotangents["stress"]), "equivalent_plastic_strain": zero})
    largest = max(float(value.abs().max()) for value in whole.values())  # round-off zeros compare at its scale
    for name, value in whole.items():
        np.testing.assert_allclose(grads[name], _numpy(value), rtol=1e-8, atol=1e-12 * largest, err_msg=name)
    np.testing.assert_allclose(compiled["stress"], _numpy(_load(ELASTIC).call_by_name(
        {"strain": torch.as_tensor(inputs["E"])})["stress"]), rtol=1e-12)


def test_changed_parameters_are_compared_again_only_when_a_value_changed():
    """ParameterValues.changed() remembers its answer while no value changed: every way a caller changes one (set,
    in place, a new .data) is seen at the next call, and a value put back to the file's is no longer sent."""
    from dsched.models.neml2_parameters import ParameterValues

    values = ParameterValues({"E": torch.tensor(200e3, dtype=torch.float64), "nu": torch.tensor(0.3)})
    assert values.changed() == {} and values.changed() == {}
    values.values["E"].fill_(150e3)  # in place, as named_parameters() allows
    assert {k: float(v) for k, v in values.changed().items()} == {"E": 150e3}
    values.set("E", 200e3)
    assert values.changed() == {}
    values.values["nu"].data = torch.tensor(0.25)  # a new storage, its version unchanged
    assert {k: round(float(v), 6) for k, v in values.changed().items()} == {"nu": 0.25}
    values.changed()["nu"] = None  # a copy: the remembered answer is not the caller's to change
    assert set(values.changed()) == {"nu"}
