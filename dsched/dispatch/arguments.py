"""How :func:`dsched.dispatch` reads a call's arguments: which are batched, along which axis, and which keywords
the model takes.

Arrays among the arguments are split; so are the arrays in dicts, lists and
tuples (their other entries go whole to every chunk). ``axis`` says along which
axis, in the manner of JAX's ``in_axes``:

- an integer: every array's batch axis; a negative one counts from the end of
  each array's own shape (``-1``: the last axis, as finite-element codes keep
  their quadrature points and cells);
- a sequence with one entry per argument: an integer, ``None`` (the argument
  goes whole to every chunk), or, for a dict, list or tuple argument, a mapping
  or sequence of such entries for its items.

An array with no such axis is a one-line ``ValueError`` naming it; a scalar,
an argument marked ``None`` and an array of size 1 along its axis go whole.
Nothing is transposed or copied: each chunk is a view of its items.

Examples
--------
>>> import numpy as np
>>> layout = ArgsLayout((np.zeros((3, 3, 8)), [np.zeros((7, 8)), 2.0]), axis=-1)
>>> layout.axes
{'args[0]': -1, 'args[1][0]': -1, 'args[1][1]': None}
>>> ArgsLayout((np.zeros((3, 3, 8)), np.zeros(4)), axis=(-1, None)).axes
{'args[0]': -1, 'args[1]': None}
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass


from dsched.checks import setting
from dsched.checks import did_you_mean
from dsched.dataplane.sources import as_streamed
from dsched.devices import backends

__all__ = ["ArgsLayout", "is_split", "out_axis_of", "check_keywords", "argument_name"]


def is_array(x, field="args") -> bool:
    """Whether ``x`` is an array of a known backend; a ValueError naming ``field`` for look-alikes."""
    kind = type(x).__name__
    if type(x).__module__.partition(".")[0] == "pandas" and kind in ("DataFrame", "Series"):
        how = "its columns, {name: df[name].to_numpy()}, or df.to_numpy()" if kind == "DataFrame" \
            else "series.to_numpy()"
        raise ValueError(f"{field}: a pandas {kind} is not split by dsched; pass {how}")
    try:
        return backends.is_array(x)
    except backends.UnsupportedArrayError as err:
        raise backends.UnsupportedArrayError(f"{field}: {err}") from None


def keep_grad_setting(keep_grad) -> bool:
    """``keep_grad`` if given, else the Dask config ``dsched.keep-grad`` (read on the client)."""
    if keep_grad is None:
        keep_grad = setting("keep-grad", False)
    return bool(keep_grad)


class _Batched:
    """Marks an argument that is split per chunk (compared by type: it survives pickling)."""


_BATCHED = _Batched()


@dataclass(frozen=True)
class _MappingKeys:
    """A dict argument: its keys, each value rebuilt from the chunk."""

    keys: tuple


@dataclass(frozen=True)
class _SequenceItems:
    """A list or tuple argument: its type and length, each item rebuilt from the chunk."""

    kind: type
    length: int


def is_split(entry) -> bool:
    """Whether an entry of a layout's skeleton stands for a split argument (else it is the argument itself)."""
    return isinstance(entry, (_Batched, _MappingKeys, _SequenceItems))


def _check_axis_entry(value, field):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{field}: expected an integer or None, got {value!r}")


def _per_argument(axis, args) -> list:
    """``axis`` as one entry per argument."""
    if isinstance(axis, (list, tuple)):
        if len(axis) != len(args):
            raise ValueError(f"axis: {len(axis)} entries for {len(args)} arguments; give one per argument "
                             "(None for one that goes whole)")
        return list(axis)
    if isinstance(axis, dict) and len(args) == 1:
        return [axis]  # the one argument is a dict: its keys' axes
    if axis is None or isinstance(axis, dict):
        raise ValueError(f"axis: expected an integer, or one entry per argument, got {axis!r}")
    _check_axis_entry(axis, "axis")
    return [axis] * len(args)


def _item_axes(spec, keys, field) -> dict:
    """The axes of a container argument's items: one for all, or a mapping (dict) or sequence (list, tuple)."""
    if isinstance(spec, dict):
        unknown = [k for k in spec if k not in keys]
        if unknown:
            raise ValueError(f"{field}: no item {unknown[0]!r} in the argument (items: {', '.join(map(repr, keys))})")
        for k in keys:
            _check_axis_entry(spec.get(k), f"{field}[{k!r}]")
        return {k: spec.get(k) for k in keys}
    if isinstance(spec, (list, tuple)):
        if len(spec) != len(keys):
            raise ValueError(f"{field}: {len(spec)} entries for an argument of {len(keys)} items")
        for k, value in zip(keys, spec):
            _check_axis_entry(value, f"{field}[{k!r}]")
        return dict(zip(keys, spec))
    _check_axis_entry(spec, field)
    return dict.fromkeys(keys, spec)


def out_axis_of(axis, out_axis=None) -> int:
    """The axis outputs are joined along: ``out_axis``, else the one every argument's axis names, else 0.

    Examples
    --------
    >>> out_axis_of(-1), out_axis_of((-1, None, {"a": -1})), out_axis_of((0, 1)), out_axis_of(0, out_axis=2)
    (-1, -1, 0, 2)
    """
    if out_axis is not None:
        _check_axis_entry(out_axis, "out_axis")
        return out_axis
    named = set()

    def collect(spec):
        if isinstance(spec, dict):
            spec = list(spec.values())
        if isinstance(spec, (list, tuple)):
            for entry in spec:
                collect(entry)
        elif spec is not None:
            named.add(spec)

    collect(axis)
    return named.pop() if len(named) == 1 else 0


class ArgsLayout:
    """Flattens ``args`` into a mapping of batched entries, with each entry's axis, and rebuilds them per chunk.

    ``mapping`` holds the arrays (and the other items of split containers),
    ``axes`` each entry's batch axis as given (``None``: whole), and ``skeleton``
    per argument a mark of how it is split, or the argument itself. Inputs keep
    their type (torch and NEML2 tensors stay tensors). Their autograd history is
    dropped (``detach``, no copy) unless ``keep_grad``: a graph cannot cross to a
    worker process, and slicing it per chunk would only grow it.
    """

    def __init__(self, args, keep_grad=None, axis=0):
        # Per argument: a mark, or the argument itself. Never the arrays: the layout travels with every
        # chunk's task, the batch must not.
        self.skeleton, self.mapping, self.axes = [], {}, {}
        self._prepare = (lambda v: v) if keep_grad_setting(keep_grad) else backends.detach
        for i, (arg, spec) in enumerate(zip(args, _per_argument(axis, args))):
            self.skeleton.append(self._add(f"args[{i}]", arg, spec))

    def _add(self, name, arg, spec):
        """Enter one argument; its skeleton entry."""
        if isinstance(arg, dict):
            # A Zarr or Dask array (alone or in a container) is streamed: its rows are read where each chunk runs.
            items = {k: as_streamed(v) for k, v in arg.items()}
            mark = _MappingKeys(tuple(items))
        elif isinstance(arg, (list, tuple)) and type(arg) in (list, tuple):  # not named tuples: their fields
            items = dict(enumerate(as_streamed(v) for v in arg))
            mark = _SequenceItems(type(arg), len(arg))
        else:
            arg = as_streamed(arg)
            if not is_array(arg, name):
                return arg
            if isinstance(spec, (dict, list, tuple)):
                raise ValueError(f"axis for {name}: an array takes an integer or None, got {spec!r}")
            _check_axis_entry(spec, f"axis for {name}")
            self.mapping[name], self.axes[name] = self._prepare(arg), spec
            return _BATCHED
        arrays = [k for k, v in items.items() if is_array(v, f"{name}[{k!r}]")]
        if not arrays:
            return arg
        axes = _item_axes(spec, list(items), f"axis for {name}")
        for k, v in items.items():
            key = f"{name}[{k!r}]"
            self.mapping[key] = self._prepare(v)
            self.axes[key] = axes[k] if k in arrays else None
        return mark

    def __getstate__(self):
        return {"skeleton": self.skeleton, "mapping": {}, "axes": {}}  # the worker rebuilds from the chunk alone

    def rebuild(self, chunk):
        """The call's arguments, with each split one's items taken from ``chunk``."""
        out = []
        for i, arg in enumerate(self.skeleton):
            name = f"args[{i}]"
            if isinstance(arg, _Batched):
                out.append(chunk[name])
            elif isinstance(arg, _MappingKeys):
                out.append({k: chunk[f"{name}[{k!r}]"] for k in arg.keys})
            elif isinstance(arg, _SequenceItems):
                out.append(arg.kind(chunk[f"{name}[{k!r}]"] for k in range(arg.length)))
            else:
                out.append(arg)
        return out


# --- what the model's signature says, before any work starts -----------------------------------
#
# dispatch(fn, *args, scheduler=..., **kwargs) hands the keywords it does not know to fn. A typo in one of
# dispatch's own (clinet=) would then reach the model on every worker and fail there, far from its cause.
# Where fn's signature can be read and takes no **kwargs, such a keyword is a one-line TypeError instead,
# with "did you mean" when it is close to a keyword of dispatch or a parameter of fn. The same signature
# names the batched arguments in errors (args[1] ('b' of affine)).

_BY_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _signature(fn):
    """``fn``'s signature, or ``None`` where Python cannot read one (a ufunc, a C function)."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def check_keywords(fn, kwargs: dict, own) -> None:
    """Raise a ``TypeError`` naming the first keyword of ``kwargs`` that ``fn`` does not take.

    ``own`` is the function whose keyword-only parameters are the caller's own
    (``dispatch``): a typo close to one of them is pointed at it. Nothing is
    checked where ``fn``'s signature cannot be read or takes ``**kwargs``.

    Examples
    --------
    >>> def norm(x, order=2):
    ...     return x
    >>> def dispatch(fn, *args, scheduler, client=None, **kwargs):
    ...     pass
    >>> check_keywords(norm, {"order": 1}, dispatch)
    >>> check_keywords(norm, {"clinet": None}, dispatch)
    Traceback (most recent call last):
    ...
    TypeError: clinet: not a keyword of dispatch, and norm(x, order=2) takes no such argument; did you mean client=?
    """
    if not kwargs:
        return
    signature = _signature(fn)
    if signature is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return
    takes = [name for name, p in signature.parameters.items() if p.kind in _BY_KEYWORD]
    unknown = [key for key in kwargs if key not in takes]
    if not unknown:
        return
    key = unknown[0]
    ours = [name for name, p in inspect.signature(own).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    raise TypeError(f"{key}: not a keyword of {own.__name__}, and {_name(fn)}{signature} takes no such "
                    f"argument{did_you_mean(key, ours + takes, '=')}")


def argument_name(fn, key: str) -> str:
    """The name errors give a batched entry ``key`` of dispatch's arguments (``"args[1]"``, ``"args[1]['b']"``):
    the key, followed by the name ``fn`` gives that positional argument where it has one. Read only when an
    error needs it (a signature costs microseconds on every call otherwise).

    Examples
    --------
    >>> def affine(x, params, scale):
    ...     return x
    >>> argument_name(affine, "args[0]"), argument_name(affine, "args[1]['b']"), argument_name(max, "args[0]")
    ("args[0] ('x' of affine)", "args[1]['b'] ('params' of affine)", 'args[0]')
    """
    signature = _signature(fn)
    positional = [] if signature is None else [
        name for name, p in signature.parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    index = int(key[len("args["):key.index("]")])
    return f"{key} ({positional[index]!r} of {_name(fn)})" if index < len(positional) else key
