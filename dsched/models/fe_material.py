"""A finite-element material whose points run through :func:`dsched.dispatch`: FElupe's material protocol, by shape.

FE codes such as `FElupe <https://github.com/adtzlr/felupe>`_ call their
material as an object with two methods, at every Newton iteration, on all
quadrature points of all cells at once:

- ``gradient(x)`` -> ``[stress, ..., new_state]``,
- ``hessian(x)`` -> ``[tangent, ...]``,

where ``x = [F, ..., state]`` holds arrays whose last two axes are the
quadrature points and the cells (``F`` is ``(3, 3, q, c)``, the state
``(n, q, c)``), and whose attribute ``x`` gives their shapes without those axes
(a solid sizes its state variables from ``x[-1]``). :class:`FEMaterial` has
that shape: handed to the FE code in place of the material, it evaluates the
material's own methods chunk by chunk over the devices, every input and output
split along the cell axis (``axis=-1``, views in the caller's layout).

A Newton iteration asks for the gradient and the hessian at the same ``x``.
So one evaluation gives both, in one dispatch, and the second call at equal
inputs returns what the first computed: one dispatch per iteration, not two.

The state goes round: the new state of one evaluation is the old state of the
evaluations of the next load step (FElupe commits it by reference when a step
converges). The outputs live in shared memory, where the workers wrote them,
and come back read-only; an output handed back as an input is therefore passed
to the workers by reference and known unchanged: the state, the largest array
of the loop, is neither copied nor compared from one iteration to the next.
Nothing here imports FElupe: the adapter meets its protocol by methods and arrays.

Examples
--------
>>> import numpy as np
>>> from dsched import SimpleScheduler
>>> class Scaled:                         # the shape of a FElupe material: x, gradient(x), hessian(x)
...     x = [np.eye(3), np.zeros(1)]
...     def gradient(self, x):
...         F, state = x
...         return [2.0 * F, state + 1.0]
...     def hessian(self, x):
...         return [np.ones((3, 3, 3, 3, *x[0].shape[2:]))]
>>> umat = FEMaterial(Scaled(), scheduler=SimpleScheduler("cpu", 2), mode="sync")
>>> F, state = np.ones((3, 3, 4, 5)), np.zeros((1, 4, 5))   # 4 quadrature points, 5 cells
>>> stress, new_state = umat.gradient([F, state])
>>> (tangent,) = umat.hessian([F, state])                   # the same x: no second evaluation
>>> stress.shape, new_state.shape, tangent.shape, umat.evaluations
((3, 3, 4, 5), (1, 4, 5), (3, 3, 3, 3, 4, 5), 1)
"""

from __future__ import annotations

import copy
import inspect
import numbers
import weakref

import cloudpickle
import numpy as np

from dsched.checks import check_scheduler
from dsched.dataplane.store import shared_empty
from dsched.dispatch.front import dispatch

__all__ = ["FEMaterial"]

#: how ``FEMaterial`` evaluates: gradient and hessian in one call, each when asked, or the tangent left out of an
#: evaluation that looks like Newton's convergence check
TANGENT_MODES = ("with-gradient", "apart", "predict")
#: what each mode dispatches for a ``gradient`` and a ``hessian`` call that finds nothing to reuse ("predict" may
#: leave the gradient's tangent out, see ``FEMaterial``)
_WHAT = {"with-gradient": {"gradient": "both", "hessian": "both"},
         "apart": {"gradient": "gradient", "hessian": "hessian"},
         "predict": {"gradient": "both", "hessian": "both"}}
_SLAB = 1 << 19  # bytes compared at a time: a changed input is told from its first slab


class _Evaluate:
    """What each chunk runs on its worker: the material's gradient and/or hessian of the chunk, as one dict.

    The keys say where each array goes: ``"g0/2"`` is item 0 of a gradient list
    of 2, ``"h1/3"`` item 1 of a hessian list of 3 (an item the material
    returned as ``None`` has no key). An output with one entry along the cell
    axis (a tangent the same for every point, as FElupe's linear elasticity
    gives) is broadcast to the chunk's cells, so that the chunks join.
    """

    def __init__(self, material, what, host_arrays):
        self.material, self.what = material, what
        self.moves_inputs = host_arrays  # dispatch then leaves the chunk in host memory (NumPy) on a GPU worker
        self.has_methods = callable(getattr(material, "gradient", None))
        self.tells_tangent = not self.has_methods and _takes_tangent(material)  # a function told whether to compute it

    def __reduce__(self):
        # The material through cloudpickle, whichever pickler carries this (Dask's tries plain pickle first): a
        # material of a module registered to travel by value (cloudpickle.register_pickle_by_value, for a module
        # the workers cannot import) must not go by reference on the way.
        return _rebuilt, (cloudpickle.dumps(self.material), self.what, self.moves_inputs)

    def __call__(self, *x, **kwargs):
        x = list(x)
        cells = max((a.shape[-1] for a in x if isinstance(a, np.ndarray) and a.ndim), default=1)
        if self.has_methods:
            gradient = self.material.gradient(x, **kwargs) if self.what != "hessian" else None
            hessian = self.material.hessian(x, **kwargs) if self.what != "gradient" else None
        elif self.tells_tangent:  # one function, told whether the tangent is wanted
            gradient, hessian = self.material(x, tangent=self.what != "gradient", **kwargs)
        else:  # one function gives both
            gradient, hessian = self.material(x, **kwargs)
        out = {}
        for tag, items in (("g", gradient if self.what != "hessian" else None),
                           ("h", hessian if self.what != "gradient" else None)):
            if items is None:
                continue
            items = list(items)
            for i, item in enumerate(items):
                if item is None:
                    continue
                if isinstance(item, np.ndarray) and item.ndim and item.shape[-1] == 1 and cells > 1:
                    item = np.broadcast_to(item, item.shape[:-1] + (cells,))
                out[f"{tag}{i}/{len(items)}"] = item
        return out


def _takes_tangent(function) -> bool:
    """Whether a one-call material function has a ``tangent`` parameter (then ``tangent=False`` asks it for the
    gradient alone)."""
    try:
        return "tangent" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return False


def _rebuilt(material, what, host_arrays):
    """An :class:`_Evaluate` from its pickled form (its material's cloudpickle bytes)."""
    return _Evaluate(cloudpickle.loads(material), what, host_arrays)


def _lists(result) -> tuple:
    """The gradient and hessian lists of one evaluation's dict (``None`` for one not evaluated)."""
    lists = {}
    for key, value in result.items():
        tag, (index, length) = key[0], (int(n) for n in key[1:].split("/"))
        items = lists.setdefault(tag, [None] * length)
        items[index] = value
    return lists.get("g"), lists.get("h")


def _equal(a, b) -> bool:
    """Whether two inputs hold the same values, bit for bit (NaN included); a changed array is usually told from
    its first slab."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not (a.flags.c_contiguous and b.flags.c_contiguous) or a.dtype.hasobject:
            return bool(np.array_equal(a, b))
        bytes_a, bytes_b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
        return all(np.array_equal(bytes_a[i:i + _SLAB], bytes_b[i:i + _SLAB]) for i in range(0, bytes_a.size, _SLAB))
    try:
        return a is b or bool(a == b)
    except (TypeError, ValueError):  # e.g. dicts of arrays: told apart, evaluated again
        return False


class _Uncomparable:
    """Kept in place of an input that cannot be copied: equal to nothing, so the next call evaluates again."""

    def __eq__(self, other):
        return False

    __hash__ = None


def _kept(value):
    """What an evaluation keeps of an input to compare the next call's with: an array the workers read (a
    shared-memory buffer of ours, or an output of ours) as it is, anything else as a copy, so that a change made
    to it in place afterwards is seen."""
    if isinstance(value, np.ndarray) and value.ndim and not value.dtype.hasobject:
        return value
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an object that does not copy is never taken as unchanged
        return _Uncomparable()


def _change(a, b) -> float:
    """The largest absolute difference between an input and the last evaluation's: 0 for the same object or equal
    values, NaN where no size of a change can be told (another type or shape, or values that are not numbers)."""
    if a is b:
        return 0.0
    numbers_ = "iuf"  # integers and floats: a difference in float64 (no unsigned wrap-around)
    if (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
            and a.dtype.kind in numbers_ and b.dtype.kind in numbers_):
        return _largest_difference(a.reshape(-1), b.reshape(-1))
    return 0.0 if _equal(a, b) else float("nan")


def _largest_difference(a, b) -> float:
    """``max |a - b|`` of two flat arrays, in float64, slab by slab: a slab's difference stays in the caches (a
    state of many variables is tens of MB, and the client waits for this), equal infinities differ by 0."""
    items = _SLAB // 8
    buffer, largest = np.empty(min(a.size, items)), 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, a.size, items):
            part_a, part_b = a[start:start + items], b[start:start + items]
            difference = np.subtract(part_a, part_b, out=buffer[:part_a.size], dtype=np.float64)
            slab = np.abs(difference, out=difference).max()
            if slab != slab:  # NaN: an unchanged infinity (inf - inf), else a NaN input, whose change has no size
                difference[part_a == part_b] = 0.0
                slab = difference.max()
                if slab != slab:
                    return float("nan")
            largest = max(largest, float(slab))
    return largest


def _shrank(changes, before, contraction) -> bool:
    """Whether every input that changed (``changes``) changed by at most ``contraction`` times its change the time
    before (``before``), and at least one did: Newton's iterates closing in. A NaN change never shrank."""
    if before is None or not any(changes):
        return False
    return all(now <= contraction * then for now, then in zip(changes, before) if now)


def _check_list(x):
    if not isinstance(x, (list, tuple)):
        raise ValueError(f"x: expected a list of arrays, such as [F, state], got {type(x).__name__}")


def _check_cells(x, axis: int) -> None:
    """Every array of ``x`` has the same number of cells along ``axis`` (or one, broadcast to all), named by its
    place in ``x`` (dispatch would name its own argument, which the user never wrote)."""
    first = None  # (index, cells) of the first array with more than one cell
    for i, value in enumerate(x):
        shape = getattr(value, "shape", None)
        if shape is None or not len(shape):
            continue  # a number: the same for every cell
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"x[{i}]: shape {tuple(shape)} has no cell axis {axis}")
        cells = shape[axis]
        if cells == 1:
            continue
        if first is None:
            first = (i, cells)
        elif cells != first[1]:
            raise ValueError(f"x[{i}]: {cells} cells along axis {axis} (shape {tuple(shape)}), but x[{first[0]}] "
                             f"has {first[1]}; every input has the same cells, or one")


class FEMaterial:
    """A finite-element material (FElupe's ``gradient``/``hessian`` protocol) evaluated through :func:`dsched.dispatch`.

    Parameters
    ----------
    material : object or callable
        An object with ``gradient(x)`` and ``hessian(x)`` (a FElupe material
        such as ``LinearElasticPlasticIsotropicHardening``, or any object of
        that shape), or a function ``evaluate(x) -> (gradient, hessian)`` that
        gives both lists in one call (then ``x`` must be given); a function with
        a ``tangent`` parameter is told ``tangent=False`` where the gradient
        alone is wanted (its hessian list may then be ``None``), and
        ``tangent=True`` otherwise. It travels to the workers by cloudpickle
        (a lambda or a closure too).
    scheduler : WorkScheduler
        How the cells are split over the devices (the batch is the cells).
    client : distributed.Client, optional
        The cluster. Default: the current client; with none, each evaluation
        runs on a :class:`LocalHybridCluster` of the scheduler's devices that
        :func:`dsched.dispatch` starts and closes (slow: give a client).
    x : list, optional
        The input template, shapes without the point and cell axes (FElupe:
        ``[np.eye(3), np.zeros(n_state)]``); default: ``material.x``.
    tangent : {"with-gradient", "apart", "predict"}
        ``"with-gradient"`` (default): each evaluation gives the gradient and
        the hessian in one dispatch, and a call at equal inputs returns what the
        last evaluation gave (Newton's iteration: one dispatch). ``"apart"``:
        ``gradient`` dispatches the gradient only, ``hessian`` the hessian only
        (for a solver that reuses its tangent over many iterations); at equal
        inputs, each keeps what the other gave. ``"predict"``: as
        ``"with-gradient"``, except for a gradient whose inputs look like
        Newton's convergence check (``contraction``): it is evaluated without
        the tangent, and a hessian asked for at its inputs after all is a
        second dispatch, which keeps the gradient. The modes differ in the
        work done, not in the results (a function told ``tangent=`` must give
        the same gradient either way).
    contraction : float
        With ``tangent="predict"``: a gradient leaves its tangent out when
        every input that changed since the last evaluation changed by at most
        ``contraction`` times its change at that evaluation (the largest
        absolute difference; keyword arguments equal). Newton's iterates
        converge quadratically, so a change a hundredfold smaller (the default
        0.01) is most often the solver's last iteration, whose stress it only
        compares with its tolerance. A guess is wrong when the tangent is then
        asked for at its inputs (``tangents_asked_after_all``); guessing stops
        for good once more than half of the guesses were wrong (a material
        without state, whose converged ``x`` starts the next load step, asks
        for every tangent).
        ``0`` never guesses; it must be in ``[0, 1)``.
    host_arrays : bool
        Chunks stay NumPy arrays in host memory on every device, as NumPy
        materials need (on a GPU worker the material runs on that worker's CPU
        thread). ``False`` moves them to the device first (CuPy on a GPU).
    axis : int
        The cell axis of every input and output: FElupe's last (-1).
    **dispatch_options
        Passed to :func:`dsched.dispatch` (``mode``, ``timeout``, ``trace_file``).

    Notes
    -----
    Outputs are joined along the cell axis, in shared memory where the workers
    wrote them, and are read-only (copy one to change it); one the same for
    every cell (size 1 there) comes back broadcast to all cells. An input that
    is one of these outputs (the new state, handed back at the next load step)
    goes to the workers by reference and is compared by identity: it cannot
    have changed. Other inputs are copied into shared memory, where the workers
    read them (no second copy), and kept to compare the next call's inputs
    with by value; :meth:`clear` forgets them (call it after changing the
    material's parameters). ``evaluations`` counts the dispatches,
    ``tangents_left_out`` the gradients evaluated without their tangent, and
    ``tangents_asked_after_all`` those of them whose tangent was then asked for.
    """

    def __init__(self, material, *, scheduler, client=None, x=None, tangent="with-gradient", host_arrays=True,
                 axis=-1, contraction=0.01, **dispatch_options):
        has_methods = callable(getattr(material, "gradient", None)) and callable(getattr(material, "hessian", None))
        if not has_methods and not callable(material):
            raise ValueError(f"material: expected an object with gradient(x) and hessian(x), or a function "
                             f"evaluate(x) -> (gradient, hessian), got {material!r}")
        if tangent not in TANGENT_MODES:
            raise ValueError(f"tangent: expected one of {', '.join(map(repr, TANGENT_MODES))}, got {tangent!r}")
        if isinstance(contraction, bool) or not isinstance(contraction, numbers.Real) or not 0 <= contraction < 1:
            raise ValueError(f"contraction: expected a number in [0, 1), got {contraction!r}")
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ValueError(f"axis: expected an integer (the cell axis), got {axis!r}")
        x = getattr(material, "x", None) if x is None else x
        if not has_methods and x is None:
            raise ValueError("x: a material given as a function needs x=, the input template (e.g. [np.eye(3), "
                             "np.zeros(n_state)])")
        check_scheduler(scheduler)
        unknown = sorted(set(dispatch_options) - {"mode", "timeout", "trace_file"})
        if unknown:
            raise ValueError(f"{unknown[0]}: not an option of FEMaterial (dispatch options: mode, timeout, "
                             "trace_file)")
        self.material, self.scheduler, self.client, self.tangent, self.axis = material, scheduler, client, tangent, axis
        self.contraction = float(contraction)
        if x is not None:
            self.x = x
        self._options = dispatch_options
        self._calls = {what: _Evaluate(material, what, bool(host_arrays)) for what in ("both", "gradient", "hessian")}
        self._buffers = {}  # input index -> a shared-memory array the inputs are copied into
        self._inputs = []  # the last evaluation's inputs, in those arrays or our outputs (what the workers read)
        self._handed_out = {}  # id -> weak reference of every read-only output still alive (see _ours)
        self._kwargs = None
        self._gradient = self._hessian = None
        self._changes = None  # with tangent="predict": each input's change at the last evaluation
        self.evaluations = 0  # dispatches made: a Newton iteration costs one
        self.tangents_left_out = 0  # gradient evaluations without their tangent (tangent="predict")
        self.tangents_asked_after_all = 0  # of those, the ones whose tangent was then asked for: wrong guesses
        self._guessed = False  # the last evaluation left its tangent out, and nobody has asked for it yet

    @property
    def kwargs(self):
        """The material's parameters (``material.kwargs``, as FElupe's views read them), else ``{}``."""
        return getattr(self.material, "kwargs", {})

    def gradient(self, x, **kwargs):
        """The material's ``gradient(x)`` (stress, ..., new state), evaluated over the devices."""
        _check_list(x)
        same = self._holds(x, kwargs)
        if same and self._gradient is not None:
            return list(self._gradient)
        if same:  # the x of a hessian evaluated alone
            self._add(x, kwargs, "gradient")
            return list(self._gradient)
        self._guessed = False  # a new x: the last guess, if any, was right
        left_out = False
        if self.tangent == "predict":
            changes, before = self._changes_since_last(x, kwargs), self._changes
            self._changes = changes
            left_out = (changes is not None and _shrank(changes, before, self.contraction)
                        and self.tangents_asked_after_all * 2 <= self.tangents_left_out)
        self._evaluate(x, kwargs, "gradient" if left_out else _WHAT[self.tangent]["gradient"])
        if left_out:  # Newton's convergence check, most likely: it asks for no tangent
            self.tangents_left_out += 1
            self._guessed = True
        return list(self._gradient)

    def hessian(self, x, **kwargs):
        """The material's ``hessian(x)`` (tangents), evaluated over the devices."""
        _check_list(x)
        same = self._holds(x, kwargs)
        if same and self._hessian is not None:
            return list(self._hessian)
        if same:  # the x of a gradient evaluated without its tangent
            if self._guessed:  # a wrong guess: counted; past half of the guesses, guessing stops
                self.tangents_asked_after_all += 1
                self._guessed = False
            self._add(x, kwargs, "hessian")
        else:
            self._changes, self._guessed = None, False  # a new x: nothing to compare the next gradient's with
            self._evaluate(x, kwargs, _WHAT[self.tangent]["hessian"])
        return list(self._hessian)

    def clear(self):
        """Forget the last evaluation, so that the next call evaluates again (after changing the material)."""
        self._forget()
        self._changes, self._guessed = None, False

    def _forget(self):
        self._inputs, self._kwargs, self._gradient, self._hessian = [], None, None, None

    def _changes_since_last(self, x, kwargs):
        """Each input's change since the last evaluation (:func:`_change`), or ``None`` where none can be told
        (another number of inputs, other keyword arguments)."""
        if len(x) != len(self._inputs) or not _equal(kwargs, self._kwargs):
            return None
        return [_change(a, b) for a, b in zip(x, self._inputs)]

    def _holds(self, x, kwargs) -> bool:
        """Whether a gradient or a hessian is held, evaluated at ``x`` and ``kwargs``."""
        return (self._gradient is not None or self._hessian is not None) and self._same(x, kwargs)

    def _add(self, x, kwargs, what):
        """The ``what`` (``"gradient"`` or ``"hessian"``) of the held evaluation's ``x``: evaluated, and the other
        list kept, so that neither costs a second dispatch."""
        held = self._gradient, self._hessian
        self._evaluate(x, kwargs, what)
        if what == "gradient":
            self._hessian = held[1]
        else:
            self._gradient = held[0]

    def _same(self, x, kwargs) -> bool:
        """Whether ``x`` and ``kwargs`` equal the last evaluation's. An input kept by reference is a read-only
        output of ours: handed back itself, it is equal without a look at its values."""
        return (len(x) == len(self._inputs) and _equal(kwargs, self._kwargs)
                and all(a is b or _equal(a, b) for a, b in zip(x, self._inputs)))

    def _evaluate(self, x, kwargs, what):
        """One dispatch; keeps what it gave, and the inputs it gave it for."""
        self._forget()  # a failed evaluation leaves nothing to reuse
        _check_cells(x, self.axis)
        inputs = [self._shared(a, i) for i, a in enumerate(x)]
        result = dispatch(self._calls[what], *inputs, scheduler=self.scheduler, client=self.client, axis=self.axis,
                          **self._options, **kwargs)
        self.evaluations += 1
        gradient, hessian = (self._hand_out(items) for items in _lists(result))
        self._inputs, self._kwargs = [_kept(value) for value in inputs], _kept(dict(kwargs))
        self._gradient, self._hessian = gradient, hessian

    def _hand_out(self, items):
        """An evaluation's list of outputs, each array made read-only and remembered as ours."""
        if items is None:
            return None
        handed_out = self._handed_out  # (the weak references' callbacks must not hold self)
        for item in items:
            if isinstance(item, np.ndarray):
                item.flags.writeable = False
                key = id(item)
                handed_out[key] = weakref.ref(item, lambda _, key=key: handed_out.pop(key, None))
        return items

    def _ours(self, value) -> bool:
        """Whether ``value`` is one of the read-only outputs this material handed out (so unchanged since)."""
        ref = self._handed_out.get(id(value))
        return ref is not None and ref() is value

    def _shared(self, value, index):
        """An input where the workers read it: an output of ours as it is (in shared memory already, and
        unchanged), another array copied into a shared-memory array of this material's (reused while its shape
        holds)."""
        if not isinstance(value, np.ndarray) or not value.ndim or value.dtype.hasobject or self._ours(value):
            return value
        kept = self._buffers.get(index)
        if kept is None or kept.shape != value.shape or kept.dtype != value.dtype:
            kept = self._buffers[index] = shared_empty(value.shape, value.dtype)
        np.copyto(kept, value)
        return kept

    def __repr__(self):
        return f"FEMaterial({self.material!r}, tangent={self.tangent!r}, evaluations={self.evaluations})"
