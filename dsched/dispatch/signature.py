"""What a model's signature tells :func:`~dsched.dispatch.front.dispatch` before any work starts.

``dispatch(fn, *args, scheduler=..., **kwargs)`` hands the keywords it does not
know to ``fn``. A typo in one of dispatch's own (``clinet=``) would then reach
the model on every worker and fail there, far from its cause. Where ``fn``'s
signature can be read and takes no ``**kwargs``, such a keyword is a one-line
``TypeError`` here instead, with "did you mean" when it is close to a keyword
of dispatch or a parameter of ``fn``. The same signature names the batched
arguments in errors (``args[1] ('b' of affine)``).
"""

from __future__ import annotations

import inspect

from dsched.checks import did_you_mean

__all__ = ["argument_name", "check_keywords"]

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
