"""Joining chunk results: concat_reduce and derivative_reduce.

Ports NEML2 v2.1.6 ``test_valuemap_helpers`` and ``test_derivmap_helpers``.
"""

import numpy as np
import pytest

from dsched import concat_reduce, derivative_reduce


def test_arrays_join_in_order():
    out = concat_reduce([np.arange(3), np.arange(3, 8), np.arange(8, 9)])
    np.testing.assert_array_equal(out, np.arange(9))


def test_along_axis_one():
    pieces = [np.full((2, k, 3), k) for k in (1, 4, 2)]
    out = concat_reduce(pieces, axis=1)
    assert out.shape == (2, 7, 3)
    np.testing.assert_array_equal(out[0, :, 0], [1, 4, 4, 4, 4, 2, 2])


def test_tuples_and_lists_entry_by_entry():
    results = [(np.zeros(2), np.ones((2, 3))), (np.ones(1), np.zeros((1, 3)))]
    a, b = concat_reduce(results)
    np.testing.assert_array_equal(a, [0, 0, 1])
    assert b.shape == (3, 3) and b[:2].sum() == 6 and b[2].sum() == 0
    out = concat_reduce([[np.zeros(1)], [np.ones(2)]])
    assert isinstance(out, list) and out[0].tolist() == [0, 1, 1]


def test_dicts_entry_by_entry_keep_key_order():
    results = [{"y": np.zeros(2), "x": np.arange(2)}, {"x": np.arange(2, 5), "y": np.ones(3)}]
    out = concat_reduce(results)
    assert list(out) == ["y", "x"]
    assert out["x"].tolist() == [0, 1, 2, 3, 4] and out["y"].tolist() == [0, 0, 1, 1, 1]


def test_entries_without_the_axis_come_from_the_first_result():
    first_k, first_v = np.float64(7.0), np.arange(4)
    out = concat_reduce(
        [{"y": np.zeros((4, 2)), "k": first_k, "v": first_v},
         {"y": np.ones((4, 3)), "k": np.float64(9.0), "v": np.arange(4) + 10}],
        axis=1,
    )
    assert out["y"].shape == (4, 5) and out["y"][:, 2:].min() == 1
    assert out["k"] is first_k  # 0-d: no axis 1
    assert out["v"] is first_v  # 1-d: ndim <= axis, batch-independent


def test_valuemap_cat_like_neml2():
    strain = np.linspace(np.zeros((5, 6)), np.ones((5, 6)), 100, axis=1)
    temperature = np.full((5, 1), 300.0)
    maps = [{"strain": strain, "temperature": temperature}, {"strain": strain, "temperature": temperature}]
    out = concat_reduce(maps, axis=0)
    assert out["strain"].shape == (10, 100, 6)
    assert out["temperature"].shape == (10, 1)


def test_mismatched_keys():
    with pytest.raises(ValueError, match=r"results\[1\]: keys \['x', 'z'\] differ from the first chunk's \['x', 'y'\]"):
        concat_reduce([{"x": np.zeros(1), "y": np.zeros(1)}, {"x": np.zeros(1), "z": np.zeros(1)}])


def test_tuples_of_different_lengths():
    with pytest.raises(ValueError, match=r"results: chunks returned tuples of different lengths \[1, 2\]"):
        concat_reduce([(np.zeros(1), np.zeros(1)), (np.zeros(1),)])


@pytest.mark.parametrize("reduce", [concat_reduce, derivative_reduce])
def test_nothing_to_reduce(reduce):
    with pytest.raises(ValueError, match=r"results: nothing to reduce"):
        reduce([])


def test_derivative_blocks_join_like_neml2():
    d1 = {"s2": {"s1": np.full((5, 10), 300.0)}}
    d2 = {"s2": {"s1": np.full((7, 10), 500.0)}}
    out = derivative_reduce([d1, d2], axis=0)
    assert out["s2"]["s1"].shape == (12, 10)
    assert out["s2"]["s1"][:5].min() == 300 and out["s2"]["s1"][5:].min() == 500


def test_derivative_block_without_the_axis_is_taken_from_the_first_result():
    shared = np.eye(3)  # ndim 2 <= axis 2: carries no batch
    results = [
        {"stress": {"strain": np.ones((2, 3, 4, 3)), "E": shared}},
        {"stress": {"strain": np.zeros((2, 3, 1, 3)), "E": np.zeros((3, 3))}},
    ]
    out = derivative_reduce(results, axis=2)
    assert out["stress"]["E"] is shared
    assert out["stress"]["strain"].shape == (2, 3, 5, 3)
    assert out["stress"]["strain"][:, :, :4].min() == 1 and out["stress"]["strain"][:, :, 4].max() == 0


def test_derivative_blocks_along_axis_one_with_a_scalar_block():
    scalar = np.float64(2.0)
    results = [{"y": {"x": np.ones((3, 2)), "p": scalar}}, {"y": {"x": np.zeros((3, 5)), "p": np.float64(4.0)}}]
    out = derivative_reduce(results, axis=1)
    assert out["y"]["x"].shape == (3, 7) and out["y"]["p"] is scalar


def test_derivative_outputs_must_agree():
    with pytest.raises(ValueError, match=r"results\[1\]: keys \['z'\] differ"):
        derivative_reduce([{"y": {"x": np.ones(1)}}, {"z": {"x": np.ones(1)}}])


def test_nested_containers_join_entry_by_entry():
    # A tuple holding a dict (``return y, {"aux": ...}``) must join its inner arrays too.
    results = [(np.zeros(2), {"aux": np.zeros((2, 3))}), (np.ones(3), {"aux": np.ones((3, 3))})]
    y, extra = concat_reduce(results)
    assert y.tolist() == [0, 0, 1, 1, 1]
    assert extra["aux"].shape == (5, 3) and extra["aux"][2:].min() == 1
