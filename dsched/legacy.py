"""Module paths of earlier releases, kept working: ``import dsched.feed`` gives today's module.

dsched's modules once sat in one flat folder (``dsched/feed.py``,
``dsched/dashboard.py``, ...). They now live in subpackages (see
``docs/architecture.md``). Code, docs and command lines written against the
old paths (``python -m dsched.mpi``, ``--preload dsched.dashboard``) keep
working: each old name is an alias of the module that holds its contents now,
the same module object, so state and monkeypatching are shared.

Examples
--------
>>> import dsched.feed
>>> from dsched.dispatch import feeds
>>> dsched.feed is feeds
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

#: old module path -> the module that holds its public names now
ALIASES = {
    "dsched.array": "dsched.blocks",
    "dsched.backends": "dsched.devices.backends",
    "dsched.batch": "dsched.resident.batch",
    "dsched.bench": "dsched.apps.bench.scheduling",
    "dsched.bench_batch": "dsched.apps.bench.batch",
    "dsched.bench_data": "dsched.apps.bench.data",
    "dsched.bench_policy": "dsched.apps.bench.policy",
    "dsched.chunk": "dsched.worker.chunk",
    "dsched.cli": "dsched.apps.cli",
    "dsched.completion": "dsched.dispatch.completion",
    "dsched.costmodel": "dsched.schedulers.costmodel",
    "dsched.dashboard": "dsched.observe.dashboard",
    "dsched.dashboard_plots": "dsched.observe.dashboard.plots",
    "dsched.engine": "dsched.resident.engine",
    "dsched.feed": "dsched.dispatch.feeds",
    "dsched.graph": "dsched.apps.jobfile",
    "dsched.job": "dsched.apps.job",
    "dsched.logs": "dsched.cluster.logs",
    "dsched.mpi": "dsched.cluster.mpi",
    "dsched.neml2_bench": "dsched.apps.bench.neml2",
    "dsched.outputs": "dsched.dataplane.outputs",
    "dsched.ownership": "dsched.devices.ownership",
    "dsched.per_thread": "dsched.devices.per_thread",
    "dsched.placement": "dsched.cluster.placement",
    "dsched.reduce": "dsched.dataplane.reduce",
    "dsched.dispatch.reduce": "dsched.dataplane.reduce",
    "dsched.dispatch.tasks": "dsched.dispatch.async_run",
    "dsched.report": "dsched.observe.report",
    "dsched.store": "dsched.dataplane.store",
    "dsched.threads": "dsched.devices.threads",
    "dsched.trace": "dsched.observe.trace",
    "dsched.transfer": "dsched.dataplane.pinned",
    "dsched.tuning": "dsched.apps.tune",
    "dsched.work": "dsched.dataplane.loaders",
}


#: old paths whose import had an effect that command lines rely on: the module to import along with it
IMPORTED_WITH = {
    # ``dask scheduler --preload dsched.dashboard`` listed the dsched page by importing the module
    "dsched.dashboard": "dsched.observe.dashboard.preload",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module it names: ``sys.modules`` maps both names to one object."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module):
        # The import system reads the module back from sys.modules after this call, so the
        # old name ends up bound to the real module (and set as an attribute of ``dsched``).
        name = module.__spec__.name
        sys.modules[name] = importlib.import_module(self.target)
        if name in IMPORTED_WITH:
            importlib.import_module(IMPORTED_WITH[name])

    def get_code(self, fullname):
        """For ``python -m <old path>``: the code of the module it names, run as ``__main__``."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)

    def is_package(self, fullname):
        return False


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = ALIASES.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Make the old paths importable (idempotent; ``import dsched`` calls it)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def module_attribute(name: str):
    """The module an old path ``dsched.<name>`` names, for ``dsched.<name>`` read as an attribute.

    ``import dsched`` once imported every flat module, so ``dsched.array.plan_blocks``
    worked without importing ``dsched.array``; this keeps it working (lazily).
    """
    if f"dsched.{name}" not in ALIASES:
        raise AttributeError(f"module 'dsched' has no attribute {name!r}")
    return importlib.import_module(f"dsched.{name}")
