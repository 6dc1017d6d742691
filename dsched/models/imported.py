"""Your own model in a job file: ``model.name = "package.module:function"``, as entry points are written.

The function is a chunk's model, as for :func:`dsched.dispatch`: it takes
the chunk's rows of its inputs and returns an array, a tuple or a dict of
arrays. Its inputs are its parameters without a default that
``[model.parameters]`` does not set; the others are keywords from
``[model.parameters]``. The inputs come from a Zarr store (``--input``,
``options.input``: one array per input, by name) or from a generator
function named the same way (``model.generator = "package.module:inputs"``),
called where each chunk runs as ``inputs(start, stop)`` for the items
``start`` to ``stop - 1`` and returning a dict of arrays (by name), a tuple
(in order) or one array (the only input).

Names are imported on the client when the graph is read, so a name that does
not import, lacks its attribute or is not callable is a one-line error naming
it before anything starts; each worker imports them again (once per process).
A module is looked for as Python looks for it (installed, or on
``PYTHONPATH``), then in the graph file's folder.

Examples
--------
>>> resolve("math:sqrt", "model.name")(16.0)
4.0
>>> resolve("math:tau", "model.name")
Traceback (most recent call last):
...
ValueError: model.name: 'math:tau' is not callable (type float)
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import threading

from dsched.checks import did_you_mean
from dsched.errors import DispatchError

__all__ = ["is_import_path", "resolve", "imported_fields", "FunctionChunk", "ModelImportError"]

_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_lock = threading.Lock()
_resolved = {}  # (path, folder) -> the object, per process


class ModelImportError(DispatchError):
    """A worker could not import the model (or generator) the graph names: its environment lacks it."""


def is_import_path(name) -> bool:
    """Whether a model's ``name`` is an import path (``"package.module:function"``) rather than a built-in's."""
    return isinstance(name, str) and ":" in name


def resolve(path: str, field: str, folder=None):
    """The callable ``path`` (``"package.module:attribute"``) names, imported; a one-line ``ValueError`` naming
    ``field`` and ``path`` otherwise. ``folder``: where to look for the module when Python does not find it."""
    key = (path, folder)
    found = _resolved.get(key)
    if found is not None:
        return found
    if not isinstance(path, str) or not _PATH.fullmatch(path):
        raise ValueError(f"{field}: {path!r} is not an import path; expected 'package.module:function'")
    module_name, _, attribute = path.partition(":")
    module = _import(module_name, path, field, folder)
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            names = [n for n in dir(target) if not n.startswith("_")]
            raise ValueError(f"{field}: {path!r}: {target.__name__!r} has no attribute {part!r}"
                             f"{did_you_mean(part, names)}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{field}: {path!r} is not callable (type {type(target).__name__})")
    with _lock:
        _resolved[key] = target
    return target


def _import(module_name, path, field, folder):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        top = module_name.partition(".")[0]
        if folder is None or err.name != top or str(folder) in sys.path:
            raise ValueError(f"{field}: cannot import {path!r}: {err}") from None
    with _lock:  # the graph's folder, after what Python searches already
        if str(folder) not in sys.path:
            sys.path.append(str(folder))
    try:
        return importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{field}: cannot import {path!r} (nor from {folder}): {err}") from None
    except Exception as err:  # the module itself fails as it runs
        raise ValueError(f"{field}: importing {module_name!r} for {path!r} failed: {type(err).__name__}: {err}") \
            from None


def _inputs_of(fn) -> tuple:
    """``fn``'s parameters without a default, in order (``*args`` and ``**kwargs`` are no inputs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in parameters if p.default is inspect.Parameter.empty
                 and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD))


class _Parameters:
    """``[model.parameters]`` of a function model: checked against its signature, passed as keywords."""

    def __init__(self, fn, path):
        self.path = path
        try:
            parameters = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            parameters = None
        any_keyword = parameters is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self.fields = None if any_keyword else [
            name for name, p in parameters.items()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]

    def __call__(self, **values) -> dict:
        for name in values:
            if self.fields is not None and name not in self.fields:
                raise ValueError(f"model.parameters.{name}: {self.path} takes no such argument"
                                 f"{did_you_mean(name, self.fields)} (it takes: {', '.join(self.fields)})")
        return dict(values)


class FunctionChunk:
    """A job's ``do_work`` for a function model: the chunk's inputs (its rows of a store, or made by the
    generator), then the function. Holds names only; each process imports them once."""

    def __init__(self, path: str, generator: str | None, folder: str | None):
        self.path, self.generator, self.folder = path, generator, folder

    def _resolve(self, path, field):
        try:
            return resolve(path, field, self.folder)
        except ValueError as err:  # imported on the client already: this process's environment lacks it
            raise ModelImportError(f"{err} (on this worker; the client imported it)") from None

    def __call__(self, work, device=None, parameters=None, *, tangent=None):
        fn = self._resolve(self.path, "model.name")
        parameters = parameters or {}
        if isinstance(work, dict):  # rows of the input store, by name
            return fn(**work, **parameters)
        if self.generator is None:
            raise ModelImportError(f"model.generator: {self.path} needs its inputs from a store or a generator")
        inputs = self._resolve(self.generator, "model.generator")(work.start, work.stop)
        if isinstance(inputs, dict):
            return fn(**inputs, **parameters)
        if isinstance(inputs, tuple):
            return fn(*inputs, **parameters)
        return fn(inputs, **parameters)

    def __repr__(self):
        return f"FunctionChunk({self.path!r})"


def imported_fields(path: str, folder=None, generator: str | None = None) -> dict:
    """The fields of the :class:`~dsched.models.Model` of the function ``path`` names, imported here (so errors
    name it now): ``chunk``, ``parameters_type``, ``description`` and ``inputs``."""
    fn = resolve(path, "model.name", folder)
    if generator is not None:
        resolve(generator, "model.generator", folder)
    return {"chunk": FunctionChunk(path, generator, None if folder is None else str(folder)),
            "parameters_type": _Parameters(fn, path),
            "description": (inspect.getdoc(fn) or path).splitlines()[0],
            "inputs": _inputs_of(fn)}
