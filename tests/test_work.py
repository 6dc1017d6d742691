"""Work generators: chunking with a short last chunk, and their validation.

Ports NEML2 v2.1.6 ``test_SliceGenerator``, ``test_TensorLoader`` and
``test_ValueMapLoader`` (TensorLoader is :class:`ArrayLoader`, ValueMapLoader
is :class:`MappingLoader`).
"""

import numpy as np
import pytest

from dsched import ArrayLoader, MappingLoader, SliceGenerator, WorkGenerator


def drain(generator, n):
    chunks = []
    while generator.has_more():
        chunks.append(generator.next(n))
    return chunks


# --- SliceGenerator ------------------------------------------------------------

def test_slice_generator_short_last_chunk():
    g = SliceGenerator(0, 20)
    assert isinstance(g, WorkGenerator)
    assert (g.total, g.offset) == (20, 0)
    assert drain(g, 8) == [(8, slice(0, 8)), (8, slice(8, 16)), (4, slice(16, 20))]
    assert (g.total, g.offset, g.has_more()) == (20, 20, False)


def test_slice_generator_offset_start_varying_n():
    g = SliceGenerator(50, 2000)
    assert g.total == 1950
    assert g.next(1) == (1, slice(50, 51))
    assert g.offset == 1
    assert g.next(2) == (2, slice(51, 53))
    assert g.offset == 3
    assert g.next(10_000) == (1947, slice(53, 2000))
    assert not g.has_more()


def test_slice_generator_neml2_chunks_of_345():
    stops = [w.stop for _, w in drain(SliceGenerator(50, 2000), 345)]
    assert stops == [395, 740, 1085, 1430, 1775, 2000]


@pytest.mark.parametrize("start, stop", [(5, 5), (10, 3), (0, 0)])
def test_slice_generator_needs_start_below_stop(start, stop):
    with pytest.raises(ValueError, match=rf"SliceGenerator: expected start < stop, got start={start}, stop={stop}"):
        SliceGenerator(start, stop)


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_next_needs_a_positive_int(n):
    g = SliceGenerator(0, 10)
    with pytest.raises(ValueError, match=r"n: a chunk needs at least one item, got"):
        g.next(n)
    assert g.offset == 0  # nothing handed out


def test_next_past_the_end():
    g = SliceGenerator(0, 3)
    g.next(5)
    with pytest.raises(RuntimeError, match=r"SliceGenerator is exhausted \(3 items handed out\)"):
        g.next(1)


# --- ArrayLoader ------------------------------------------------------------------

def test_array_loader_along_a_middle_axis():
    # NEML2's TensorLoader test: batch shape (5, 100, 5), base shape (2, 3), split along axis 1.
    start, end = np.zeros((5, 5, 2, 3)), np.full((5, 5, 2, 3), 100.0)
    ten = np.linspace(start, end, 100, axis=1)
    assert ten.shape == (5, 100, 5, 2, 3)
    loader = ArrayLoader(ten, axis=1)
    assert (loader.total, loader.offset) == (100, 0)

    n, work = loader.next(1)
    assert (n, loader.offset, work.shape) == (1, 1, (5, 1, 5, 2, 3))
    np.testing.assert_array_equal(work, ten[:, 0:1])
    n, work = loader.next(2)
    assert (n, loader.offset, work.shape) == (2, 3, (5, 2, 5, 2, 3))
    np.testing.assert_array_equal(work, ten[:, 1:3])
    n, work = loader.next(1000)
    assert (n, loader.offset, work.shape) == (97, 100, (5, 97, 5, 2, 3))
    np.testing.assert_array_equal(work, ten[:, 3:])
    assert not loader.has_more()


def test_array_loader_short_last_chunk_and_views():
    x = np.arange(40.0).reshape(20, 2)
    chunks = drain(ArrayLoader(x), 8)
    assert [m for m, _ in chunks] == [8, 8, 4]
    np.testing.assert_array_equal(np.concatenate([w for _, w in chunks]), x)
    assert all(np.shares_memory(w, x) for _, w in chunks)  # slices, not copies


@pytest.mark.parametrize("axis", [-3, 2, 5])
def test_array_loader_axis_out_of_range(axis):
    with pytest.raises(ValueError, match=rf"axis: {axis} is out of range for an array of shape \(4, 3\)"):
        ArrayLoader(np.zeros((4, 3)), axis=axis)


def test_array_loader_scalar_has_no_axis():
    with pytest.raises(ValueError, match=r"axis: 0 is out of range for an array of shape \(\)"):
        ArrayLoader(np.float64(3.0))


@pytest.mark.parametrize("shape, axis", [((0,), 0), ((3, 0), 1)])
def test_array_loader_empty(shape, axis):
    with pytest.raises(ValueError, match=rf"array: no items along axis {axis}"):
        ArrayLoader(np.zeros(shape), axis=axis)


# --- MappingLoader ------------------------------------------------------------------

def strain_and_temperature():
    """NEML2's ValueMapLoader inputs: strain (5, 100, 5, 6) and temperature (5, 1, 5), split along 1."""
    strain0 = np.broadcast_to(np.array([0.1, 0.05, -0.01, 0, 0, 0]), (5, 5, 6))
    strain1 = np.broadcast_to(np.array([0.2, 0.1, 0, 0, 0, 0]), (5, 5, 6))
    strain = np.linspace(strain0, strain1, 100, axis=1)
    temperature = np.full((5, 1, 5), 300.0)
    return {"strain": strain, "temperature": temperature}


def test_mapping_loader_along_axis_one():
    x = strain_and_temperature()
    loader = MappingLoader(x, axis=1)
    assert (loader.total, loader.offset) == (100, 0)
    for n, (start, stop) in [(1, (0, 1)), (2, (1, 3)), (1000, (3, 100))]:
        assert loader.has_more()
        m, work = loader.next(n)
        assert (m, loader.offset) == (stop - start, stop)
        assert set(work) == {"strain", "temperature"}
        assert work["strain"].shape == (5, stop - start, 5, 6)
        np.testing.assert_array_equal(work["strain"], x["strain"][:, start:stop])
        assert work["temperature"] is x["temperature"]  # size 1 along the axis: passed whole
    assert not loader.has_more()


def test_mapping_loader_passes_entries_without_the_axis_whole():
    x = {"x": np.arange(20.0), "scale": np.float64(2.0), "name": "model-a", "row": np.ones((1,))}
    chunks = drain(MappingLoader(x), 8)
    assert [m for m, _ in chunks] == [8, 8, 4]
    for _, work in chunks:
        assert work["scale"] is x["scale"] and work["name"] == "model-a" and work["row"] is x["row"]
    np.testing.assert_array_equal(np.concatenate([w["x"] for _, w in chunks]), x["x"])


def test_mapping_loader_with_only_size_one_entries_has_one_item():
    loader = MappingLoader({"a": np.ones((1, 3)), "b": np.zeros(1)})
    assert loader.total == 1
    m, work = loader.next(5)
    assert m == 1 and work["a"].shape == (1, 3)


@pytest.mark.parametrize(
    "mapping, key, size, total",
    [
        ({"a": np.zeros(5), "b": np.zeros(3)}, "b", 3, 5),
        ({"a": np.zeros(3), "b": np.zeros(5), "c": np.zeros(1)}, "a", 3, 5),
    ],
)
def test_mapping_loader_incompatible_sizes_name_the_key(mapping, key, size, total):
    with pytest.raises(ValueError, match=rf"mapping\['{key}'\]: size {size} along axis 0 is not compatible; expected 1 or {total}"):
        MappingLoader(mapping)


def test_mapping_loader_incompatible_sizes_along_axis_one():
    with pytest.raises(ValueError, match=r"mapping\['t'\]: size 4 along axis 1 is not compatible; expected 1 or 100"):
        MappingLoader({"s": np.zeros((5, 100)), "t": np.zeros((5, 4))}, axis=1)


def test_mapping_loader_no_axis():
    # An array with no such axis is never passed whole silently; a scalar is.
    with pytest.raises(ValueError, match=r"^mapping\['a'\]: shape \(4,\) has no axis 1 to split along"):
        MappingLoader({"a": np.zeros(4), "b": 3.0}, axis=1)
    with pytest.raises(ValueError, match=r"mapping: no entry has an axis 1 to split along"):
        MappingLoader({"b": 3.0}, axis=1)
    with pytest.raises(ValueError, match=r"mapping: no entry has an axis 0"):
        MappingLoader({})


def test_mapping_loader_no_items():
    with pytest.raises(ValueError, match=r"mapping: no items along axis 0"):
        MappingLoader({"a": np.zeros((0, 2))})


def test_a_negative_axis_counts_from_the_end_of_each_entrys_own_shape():
    loader = MappingLoader({"x": np.zeros((3, 4)), "y": np.zeros(4), "z": np.zeros((2, 2, 4))}, axis=-1)
    m, work = loader.next(3)
    assert (m, loader.axes) == (3, {"x": 1, "y": 0, "z": 2})
    assert [v.shape for v in work.values()] == [(3, 3), (3,), (2, 2, 3)]


def test_per_entry_axes_and_none_for_an_entry_that_goes_whole():
    loader = MappingLoader({"x": np.zeros((3, 4)), "table": np.arange(5.0)}, axis={"x": 1, "table": None})
    work = loader.next(2)[1]
    assert work["x"].shape == (3, 2) and work["table"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match=r"^axis\['x'\]: expected an integer, got 1.5$"):
        MappingLoader({"x": np.zeros(4)}, axis={"x": 1.5})


@pytest.mark.parametrize("start, stop, field", [(0.5, 3, "start"), (0, 2.5, "stop")])
def test_slice_bounds_must_be_integers(start, stop, field):
    with pytest.raises(ValueError, match=f"{field} must be an integer"):
        SliceGenerator(start, stop)
