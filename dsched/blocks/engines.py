"""Dask's two array engines: which one an array belongs to, and that engine's own map_blocks and blockwise.

Dask builds ``dask.array`` two ways. The classic engine (``dask.array.core``)
builds a high-level graph as each operation is called; the expression engine
(``dask.array._array_expr``, switched on by the ``array.query-planning``
setting, read once when ``dask.array`` is first imported) builds an
expression that is optimized and lowered to tasks when computed. Their
arrays are different classes, and each engine's ``map_blocks`` and
``blockwise`` accept only its own arrays. :func:`dsched.map_blocks` asks
:func:`engine_of` which engine its arguments belong to and builds with that
engine's functions (:class:`Engine`); everything else it does is the same on
both.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Engine", "engine_of", "array_types", "is_dask_array", "expression_engine_enabled"]


@dataclass(frozen=True)
class Engine:
    """One of Dask's array engines, for :func:`dsched.map_blocks`.

    Attributes
    ----------
    name : str
        ``"classic"`` (``dask.array.core``) or ``"expression"``
        (``dask.array._array_expr``).
    """

    name: str

    @property
    def expression(self) -> bool:
        """Whether this is the expression engine."""
        return self.name == "expression"

    def map_blocks(self):
        """The engine's own ``map_blocks`` (the module's, however ``dask.array`` is patched)."""
        if self.expression:
            from dask.array._array_expr._map_blocks import map_blocks
        else:
            from dask.array.core import map_blocks
        return map_blocks

    def blockwise(self):
        """The engine's own ``blockwise``."""
        if self.expression:
            from dask.array._array_expr._collection import blockwise
        else:
            from dask.array.core import blockwise
        return blockwise

    def naming(self, fn_name, name, token) -> dict:
        """The ``name``/``token`` keywords of the rebuilt layer: ``name`` the whole key name, ``token`` its prefix.

        As ``map_blocks`` documents them on both engines. (The expression
        engine's own ``map_blocks`` takes ``name`` as a prefix too, and
        ``token`` with a ``FutureWarning``, which Dask's own call has already
        given.)
        """
        return {"name": name, "token": token or fn_name}


CLASSIC, EXPRESSION = Engine("classic"), Engine("expression")


def expression_engine_enabled() -> bool:
    """Whether ``dask.array`` is the expression engine in this process (fixed when it was first imported)."""
    import dask.array as da

    enabled = getattr(da, "array_expr_enabled", None)
    return bool(enabled()) if callable(enabled) else False


def array_types() -> tuple:
    """The Dask array classes of the installed Dask: the classic one, and the expression one if present."""
    from dask.array.core import Array

    try:
        from dask.array._array_expr._collection import Array as ExprArray
    except ImportError:  # a Dask without the expression engine
        return (Array,)
    return (Array, ExprArray)


def is_dask_array(x) -> bool:
    """Whether ``x`` is a Dask array of either engine."""
    return isinstance(x, array_types())


def engine_of(args, field="args") -> Engine:
    """The engine of the Dask arrays among ``args``; the one ``dask.array`` is when there is none.

    Raises
    ------
    ValueError
        When ``args`` mixes arrays of both engines (neither engine's
        ``map_blocks`` accepts the other's arrays).
    """
    from dask.array.core import Array

    kinds = {isinstance(a, Array) for a in args if is_dask_array(a)}
    if len(kinds) > 1:
        raise ValueError(f"{field}: mixes Dask arrays of the classic and the expression engine "
                         "(array.query-planning); build all of them with one")
    if not kinds:
        return EXPRESSION if expression_engine_enabled() else CLASSIC
    return CLASSIC if kinds.pop() else EXPRESSION
