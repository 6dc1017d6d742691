"""Per-argument batch axes in dispatch(): negative axes, one entry per argument, containers, out_axis.

Finite-element codes keep their quadrature points and cells last, in arrays of different ranks. These
tests run on worker processes (a CPU and an emulated cuda:0), where chunks are references into shared
memory, and check results against the model called on the whole batch.
"""

import numpy as np
import pytest

import dsched
from dsched import SimpleScheduler, StaticHybridScheduler

N = 10  # cells: the batch


def material(F, state, scale):
    """An FE-shaped model: F (3, 3, q, c), state (n, q, c); stress, new state and tangent, batch axes last."""
    P = scale * np.einsum("ij...,kj...->ik...", F, F)
    new_state = state + np.trace(F)[None]
    tangent = np.einsum("ij...,kl...->ijkl...", F, F)
    return P, new_state, tangent


@pytest.fixture(scope="module")
def fe_arrays():
    rng = np.random.default_rng(7)
    return rng.normal(size=(3, 3, 4, N)), rng.normal(size=(5, 4, N))


@pytest.fixture(scope="module")
def hybrid():
    return StaticHybridScheduler(["cpu", "cuda:0"], [3, 4])


def test_a_negative_axis_splits_each_argument_along_its_own_last_axis(process_client, fe_arrays, hybrid):
    F, state = fe_arrays
    got = dsched.dispatch(material, F, state, 2.0, scheduler=hybrid, client=process_client, axis=-1)
    want = material(F, state, 2.0)
    assert [g.shape for g in got] == [(3, 3, 4, N), (5, 4, N), (3, 3, 3, 3, 4, N)]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def strides_and_sizes(F):
    """Per cell: the strides the chunk's F arrived with, and the chunk's size."""
    n = F.shape[-1]
    return np.array(F.strides + (n,))[:, None].repeat(n, axis=1)


def test_chunks_are_views_in_the_callers_layout_of_the_exact_sizes(process_client, fe_arrays):
    F, _ = fe_arrays
    got = dsched.dispatch(strides_and_sizes, F, scheduler=SimpleScheduler("cuda:0", 4), client=process_client,
                          axis=-1)
    # No transpose, no copy into points-first order: every chunk has the whole array's strides.
    assert (got[:4] == np.array(F.strides)[:, None]).all()
    assert got[4].tolist() == [4, 4, 4, 4, 4, 4, 4, 4, 2, 2]


def per_argument(F, table, x):
    return F.sum(axis=(0, 1)) + x + table.size


def test_one_axis_per_argument_and_none_passes_an_array_whole(process_client):
    F, table, x = np.ones((3, 3, N)), np.arange(7.0), np.arange(float(N))
    got = dsched.dispatch(per_argument, F, table, x, scheduler=SimpleScheduler("cpu", 3), client=process_client,
                          axis=(-1, None, 0))
    np.testing.assert_array_equal(got, 9.0 + x + 7)  # every chunk saw the whole table


def from_mapping(fields):
    return {"P": 2 * fields["F"], "state": fields["state"] + fields["c"]}


def test_a_dict_argument_takes_a_mapping_of_axes(process_client, fe_arrays, hybrid):
    F, state = fe_arrays
    first = state[:, 0]  # (5, N): split along axis 1 while F is split along its last
    got = dsched.dispatch(from_mapping, {"F": F, "state": first, "c": 1.5}, scheduler=hybrid, client=process_client,
                          axis={"F": -1, "state": 1}, out_axis=-1)
    np.testing.assert_array_equal(got["P"], 2 * F)
    np.testing.assert_array_equal(got["state"], first + 1.5)


def felupe_like(x):
    """A material in the manner of FElupe's: a list [F, statevars] in, a list [P, statevars_new] out."""
    F, statevars = x
    return [3 * F, statevars + 1]


def test_a_list_of_arrays_is_split_like_a_dict_and_the_result_stays_a_list(process_client, fe_arrays, hybrid):
    F, state = fe_arrays
    got = dsched.dispatch(felupe_like, [F, state], scheduler=hybrid, client=process_client, axis=-1)
    assert isinstance(got, list) and len(got) == 2
    np.testing.assert_array_equal(got[0], 3 * F)
    np.testing.assert_array_equal(got[1], state + 1)


def broadcasts(F, weight, scalar):
    return F * weight * scalar


def test_size_one_along_the_axis_and_scalars_go_whole(process_client):
    F, weight = np.ones((2, 2, N)), np.full((2, 2, 1), 3.0)
    got = dsched.dispatch(broadcasts, F, weight, np.float64(2.0), scheduler=SimpleScheduler("cpu", 4),
                          client=process_client, axis=-1)
    np.testing.assert_array_equal(got, np.full((2, 2, N), 6.0))


def items_first(x):
    return x.T.copy()


def test_out_axis_joins_the_outputs_along_another_axis(process_client):
    x = np.arange(2.0 * N).reshape(N, 2)
    got = dsched.dispatch(items_first, x, scheduler=SimpleScheduler("cpu", 4), client=process_client, out_axis=1)
    np.testing.assert_array_equal(got, x.T)


def test_like_calls_with_other_axes_are_not_confused(process_client):
    """A recent call's dispatcher is reused only with the same output axis and its layout per input axes."""
    a = np.arange(2.0 * N).reshape(2, N)
    b = np.arange(2.0 * N).reshape(N, 2)
    s = SimpleScheduler("cpu", 4)
    for _ in range(2):
        np.testing.assert_array_equal(dsched.dispatch(np.negative, a, scheduler=s, client=process_client, axis=-1), -a)
        np.testing.assert_array_equal(dsched.dispatch(np.negative, b, scheduler=s, client=process_client, axis=0), -b)


@pytest.mark.parametrize("args, axis, message", [
    ((np.zeros((3, 3, 4, N)), np.zeros((5, 4, N))), 3,
     r"^args\[1\]: shape \(5, 4, 10\) has no axis 3 to split along; mark it None to pass it whole to every chunk$"),
    ((np.zeros((3, N)),), -3, r"^args\[0\]: shape \(3, 10\) has no axis -3 to split along"),
    (([np.zeros((3, N)), np.zeros(N)],), -2, r"^args\[0\]\[1\]: shape \(10,\) has no axis -2"),
    ((np.zeros(N), np.zeros(N)), (0,), r"^axis: 1 entries for 2 arguments; give one per argument"),
    (({"F": np.zeros(N)},), {"G": 0}, r"^axis for args\[0\]: no item 'G' in the argument \(items: 'F'\)$"),
    ((np.zeros(N),), "0", r"^axis: expected an integer or None, got '0'$"),
    ((np.zeros(N),), None, r"^axis: expected an integer, or one entry per argument, got None$"),
    ((np.zeros(N),), ({"a": 0},), r"^axis for args\[0\]: an array takes an integer or None, got \{'a': 0\}$"),
    ((np.zeros(N), np.zeros(N)), (None, None), r"^args: dispatch needs at least one array"),
    ((np.zeros((3, N)), np.zeros((4, 7))), -1, r"^args\[1\]: size 7 along axis 1 is not compatible; expected 1 or 10$"),
])
def test_an_axis_an_argument_cannot_have_is_one_line_before_any_work(args, axis, message):
    called = []
    with pytest.raises(ValueError, match=message):
        dsched.dispatch(lambda *a: called.append(a), *args, scheduler=SimpleScheduler("cpu", 4), mode="sync",
                        axis=axis)
    assert called == []
