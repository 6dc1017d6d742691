"""Workload graphs: TOML files naming a model, a batch, devices, a scheduler and options.

They play the part of NEML2's input files with their ``[Schedulers]`` section::

    [model]
    name = "j2"                 # a model of dsched.models, or your own: "package.module:function"
    tangent = true
    generator = "package.module:inputs"   # your own model's inputs, made where each chunk runs
    [model.parameters]          # the model's parameters (J2Parameters fields, or your function's keywords)
    yield_stress = 250.0
    [batch]
    size = 1_000_000
    [scheduler]
    type = "StaticHybridScheduler"   # or "SimpleScheduler", "PerformanceModelScheduler", or "auto"
    devices = ["cpu", "cuda:0"]      # or "all": the CPU and every visible GPU
    batch_sizes = [32768, 262144]
    capacities = [65536, 524288]
    priorities = [1, 2]
    profile = false             # true: sizes and capacities from this host's `dsched tune` profile
    chunk_seconds = 0.02        # PerformanceModelScheduler: seconds of work per chunk (or one per device)
    [options]                   # capacities default to two chunks per device
    mode = "async"              # or "sync"
    emulate = false             # emulate CUDA devices that are not present
    threads_per_worker = 2
    dashboard = false           # true: `dsched run` serves the dashboard on loopback and prints its link

Every key is checked before anything starts: an unknown key or a value of
the wrong type is a :class:`GraphError` naming it, with "did you mean" for a
close key. Two checks need the run's
surroundings and are methods of :class:`Graph`, called before a cluster
starts: :meth:`Graph.check_devices_present` (a CUDA device this machine lacks,
without emulation) and :meth:`Graph.check_memory` (outputs that cannot fit in
memory, unless they go to disk with ``options.output``).
"""

from __future__ import annotations

import dataclasses
import tomllib
from importlib import resources
from pathlib import Path

from dsched.dataplane.loaders import MappingLoader
from dsched.dataplane.store import resolve_work
from dsched.devices.context import running_on
from dsched.devices.cuda import visible_gpus
from dsched.devices.device import UNLIMITED_CAPACITY, Device, parse_devices
from dsched.checks import did_you_mean
from dsched.models import get_model
from dsched.models.imported import is_import_path
from dsched.models.neml2_graph import graph_parameters
from dsched.schedulers import PerformanceModelScheduler, SimpleScheduler, StaticHybridScheduler
from dsched.schedulers.model import saved_costs_cover
from dsched.schedulers.profiles import profile_settings

__all__ = ["Graph", "GraphError", "load_graph", "DEFAULT_GRAPH"]

DEFAULT_GRAPH = "j2_default.toml"

# Sub-batch sizes for "auto": NEML2's measurements put CPU saturation in the
# hundreds to thousands of points and GPU saturation in the tens of thousands.
# A chunk on a worker process costs about 1.5 ms of CPU in messages (client and
# worker together, docs/benchmarks.md): a CPU chunk of J2 at 65,536 points takes
# about 13 ms, so that cost stays near a tenth (at 32,768 points, a fifth).
AUTO_BATCH_SIZE = {"cpu": 65536, "cuda": 262144}
AUTO_PRIORITY = {"cpu": 1.0, "cuda": 2.0}

_INT, _FLOAT, _BOOL, _STR = int, (int, float), bool, str
_SCHEMA = {
    # input, model, inputs and outputs: name = "neml2" only (dsched.models.neml2_graph.graph_parameters)
    # generator: name = "package.module:function" only (dsched.models.imported)
    "model": {"name": _STR, "tangent": _BOOL, "parameters": dict, "input": _STR, "model": _STR, "inputs": dict,
              "outputs": list, "generator": _STR},
    "batch": {"size": _INT},
    "scheduler": {
        "type": _STR,
        "device": _STR,
        "devices": (str, list),
        "batch_size": _INT,
        "capacity": _INT,
        "batch_sizes": (int, list),
        "capacities": (int, list),
        "priorities": (int, float, list),
        "profile": _BOOL,
        "chunk_seconds": (int, float, list),
    },
    "options": {
        "mode": _STR,
        "emulate": _BOOL,
        "threads_per_worker": _INT,
        "processes": _BOOL,
        "trace_file": _STR,
        "performance_report": _STR,
        "dashboard": _BOOL,  # `dsched run`: serve the dashboard on loopback and print the dsched page's link
        "input": _STR,
        "output": _STR,
        "overwrite": _BOOL,
        "chunk_timeout": _FLOAT,
    },
}
_REQUIRED = {("model", "name"), ("batch", "size")}
SCHEDULER_TYPES = ("auto", "SimpleScheduler", "StaticHybridScheduler", "PerformanceModelScheduler")


class GraphError(ValueError):
    """A malformed graph; the message names the offending key."""


@dataclasses.dataclass
class Graph:
    """A validated workload graph."""

    source: str
    model: str
    parameters: dict
    tangent: bool
    batch_size: int
    scheduler: dict
    options: dict
    generator: str | None = None  # a function model's inputs: "package.module:function"

    def entry(self):
        """The graph's :class:`~dsched.models.Model`: a built-in, or the function ``model.name`` names."""
        return get_model(self.model, folder=self.folder, generator=self.generator)

    @property
    def folder(self) -> str | None:
        """The graph file's folder (where a function model's module may be), ``None`` for an embedded graph."""
        return str(Path(self.source).resolve().parent) if Path(self.source).is_file() else None

    @property
    def mode(self) -> str:
        return self.options.get("mode", "async")

    @property
    def emulate(self) -> bool:
        return self.options.get("emulate", False)

    def check_devices_present(self, present=None) -> None:
        """Refuse CUDA devices this machine lacks unless the graph emulates them (a :class:`GraphError`).

        Only for runs on a cluster dsched starts here (or in sync mode): a
        remote cluster's devices are checked against its workers instead.
        """
        if self.emulate:
            return
        present = visible_gpus() if present is None else [d for d in present if d.is_cuda]
        for device in self.devices(present):
            if device.is_cuda and device not in present and not (device.index is None and present):
                shown = ", ".join(map(str, present)) or "none"
                raise GraphError(
                    f"{self._devices_field}: {device} is not present on this machine (visible GPUs: {shown}); "
                    f"pass --emulate (options.emulate = true) to emulate it, for testing only, in {self.source}"
                )

    @property
    def _devices_field(self) -> str:
        return "scheduler.device" if "device" in self.scheduler else "scheduler.devices"

    def input_loader(self):
        """A loader over ``options.input`` (a Zarr store holding the model's input arrays), or ``None``.

        The store's length becomes the graph's ``batch.size``. Its arrays are read
        chunk by chunk where each chunk runs, never whole on the client. Raises
        :class:`GraphError` naming ``options.input`` for a store that is missing,
        lacks one of the model's inputs, or whose arrays differ in length.
        """
        path = self.options.get("input")
        if path is None:
            if is_import_path(self.model) and self.generator is None:
                raise GraphError(f"model.generator: {self.model} needs its inputs: name a generator function "
                                 f"('package.module:function') or give an input store (--input, options.input) "
                                 f"in {self.source}")
            return None
        names = [name for name in self.entry().inputs if name not in self.parameters]
        if not names:
            raise GraphError(f"options.input: the {self.model!r} model reads no input arrays (it makes its own "
                             f"inputs) in {self.source}")
        try:
            import zarr

            group = zarr.open_group(store=path, mode="r")
        except ImportError:
            raise GraphError("options.input: reading a Zarr store needs zarr (pip install 'dsched[zarr]')") from None
        except Exception as err:  # missing folder, not a store
            raise GraphError(f"options.input: {path} is not a Zarr store ({type(err).__name__}) in {self.source}") \
                from None
        missing = [name for name in names if name not in group]
        if missing:
            raise GraphError(f"options.input: {path} lacks the {self.model} inputs {', '.join(missing)} "
                             f"(it needs {', '.join(names)}) in {self.source}")
        lengths = {name: group[name].shape[0] for name in names}
        if len(set(lengths.values())) != 1:
            raise GraphError(f"options.input: the arrays of {path} differ in length ({lengths}) in {self.source}")
        self.batch_size = next(iter(lengths.values()))
        return MappingLoader({name: group[name] for name in names})

    def output_bytes_per_item(self) -> int:
        """Bytes of output per item: the model's declared outputs, else probed on two items on the CPU (of the
        input store where there is one)."""
        model = self.entry()
        if model.outputs is not None:
            import numpy as np

            return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                       for shape, dtype in model.outputs(self.tangent).values())
        loader = self.input_loader()
        work = slice(0, 2) if loader is None else resolve_work(loader.next(min(2, loader.total))[1])
        with running_on("cpu"):
            result = model.chunk(work, Device("cpu"), model.parameters_type(**self.parameters),
                                 tangent=self.tangent)
        return -(-_nbytes(result) // 2)

    def check_memory(self, available=None) -> int:
        """Refuse a run whose outputs cannot fit in memory (a :class:`GraphError`); the bytes it needs.

        Declared outputs are allocated once and written in place; a model
        that declares none has its chunks' results joined, and the pieces
        and the joined arrays briefly coexist: twice the outputs. A graph
        whose outputs go to disk (``options.output``) is never refused.
        """
        declared = self.entry().outputs is not None
        per_item = self.output_bytes_per_item()
        needed = (1 if declared else 2) * per_item * self.batch_size
        if self.options.get("output"):
            return needed
        if available is None:
            import psutil

            available = psutil.virtual_memory().available
        if needed > available:
            how = "" if declared else ", twice while joining"
            raise GraphError(
                f"batch.size: {self.batch_size:,} items need about {_human_bytes(needed)} of memory for their "
                f"outputs ({_human_bytes(per_item)} per item{how}) but {_human_bytes(available)} is available; "
                f"lower batch.size or write the outputs to disk (--output, options.output) in {self.source}"
            )
        return needed

    def devices(self, present=None) -> list[Device]:
        """The devices the scheduler spreads over (``"all"`` resolved against ``present``)."""
        spec = self.scheduler.get("devices", self.scheduler.get("device", "all"))
        if spec == "all":
            gpus = visible_gpus() if present is None else [d for d in present if d.is_cuda]
            return [Device("cpu"), *gpus]
        field = self._devices_field
        return parse_devices(spec, field=field)

    def build_scheduler(self, present=None):
        """The scheduler the graph describes; ``auto`` means Simple on one device, StaticHybrid on more.

        Sub-batch sizes and capacities come from the graph's keys, else from the
        host's ``dsched tune`` profile for the model when ``profile = true``,
        else from the defaults for each kind of device.
        """
        kind = self.scheduler.get("type", "auto")
        devices = self.devices(present)
        if kind == "PerformanceModelScheduler" or (kind == "auto" and self._has_saved_costs(devices)):
            return self._model_scheduler(devices)
        if "chunk_seconds" in self.scheduler:
            raise ValueError(f"chunk_seconds: only for type = 'PerformanceModelScheduler', got type = {kind!r}")
        sizes = [AUTO_BATCH_SIZE[d.type] for d in devices]
        capacities = None
        if self.scheduler.get("profile", False):
            tuned = profile_settings(devices, self.model)
            if tuned is None:
                raise ValueError(
                    f"profile: no tuned profile of model {self.model!r} on this host covers "
                    f"{', '.join(map(str, devices))}; run `dsched tune` first"
                )
            sizes, capacities = tuned["batch_sizes"], tuned["capacities"]
        if kind == "SimpleScheduler" or (kind == "auto" and len(devices) == 1):
            if len(devices) != 1:
                raise ValueError(f"devices: SimpleScheduler takes one device, got {[str(d) for d in devices]}")
            listed = self.scheduler.get("batch_sizes")  # one device: a list of one size, or a scalar, is its size
            size = self.scheduler.get("batch_size", (listed[0] if isinstance(listed, list) and len(listed) == 1 else listed)
                                      if listed is not None else sizes[0])
            default_capacity = capacities[0] if capacities and "batch_size" not in self.scheduler else 2 * size
            return SimpleScheduler(devices[0], size, self.scheduler.get("capacity", default_capacity))
        if "batch_sizes" in self.scheduler:
            sizes, capacities = self.scheduler["batch_sizes"], None
        return StaticHybridScheduler(
            devices,
            sizes,
            self.scheduler.get("capacities", capacities or _doubled(sizes)),
            self.scheduler.get("priorities", [AUTO_PRIORITY[d.type] for d in devices]),
        )


    def _has_saved_costs(self, devices) -> bool:
        """``auto`` on several devices, each with a saved cost model (or tuned profile) for this host and model."""
        if len(devices) < 2 or self.scheduler.get("profile", False) or "batch_sizes" in self.scheduler:
            return False  # explicit sizes keep the static policy they describe

        return saved_costs_cover(self.model, devices)

    def _model_scheduler(self, devices):
        for key in ("batch_size", "capacity", "capacities", "priorities", "profile"):
            if key in self.scheduler:
                raise ValueError(f"{key}: not a setting of PerformanceModelScheduler (it sizes chunks from its "
                                 f"cost model; batch_sizes are its guesses before any measurement)")
        return PerformanceModelScheduler(devices, model=self.model,
                                         chunk_seconds=self.scheduler.get("chunk_seconds", 0.02),
                                         batch_sizes=self.scheduler.get("batch_sizes"))


def _nbytes(result) -> int:
    """Bytes of an array, or of the arrays in a tuple, list or dict."""
    if isinstance(result, dict):
        return sum(_nbytes(v) for v in result.values())
    if isinstance(result, (tuple, list)):
        return sum(_nbytes(v) for v in result)
    return int(getattr(result, "nbytes", 0))


def _human_bytes(n) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def _prefixed(field: str, err) -> str:
    """``err``'s message under ``field``, without doubling a prefix the message already has.

    ``scheduler.`` + ``devices: ...`` gives ``scheduler.devices: ...``;
    ``model.name`` + ``model: unknown model`` gives ``model.name: unknown model``.
    """
    message = str(err)
    head, sep, rest = message.partition(": ")
    section = field.partition(".")[0]
    if sep and " " not in head and head.startswith(section + ".") and head != field.rstrip("."):
        return message  # names another key of the section, or one inside the field, already
    if sep and " " not in head:
        if field.endswith("."):
            return message if head.startswith(field) else f"{field}{message}"
        if head == field or field.endswith("." + head) or field.startswith(head + "."):
            return f"{field}: {rest}"
    return f"{field.rstrip('.')}: {message}"


def _doubled(sizes):
    """Graphs default capacities to two chunks per device, so copies overlap compute."""
    return [2 * s for s in sizes] if isinstance(sizes, list) else 2 * sizes


def load_graph(path=None) -> Graph:
    """Read and validate a graph file; ``None`` gives the embedded default (the main job)."""
    if path is None:
        text = resources.files("dsched.graphs").joinpath(DEFAULT_GRAPH).read_text()
        source = f"<embedded {DEFAULT_GRAPH}>"
    else:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise GraphError(f"graph: cannot read {path}: {err.strerror}") from None
        source = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise GraphError(f"graph: {source} is not valid TOML: {err}") from None
    return parse_graph(data, source)


def _fits(item, expected) -> bool:
    return isinstance(item, expected) and (expected is _BOOL or not isinstance(item, bool))


def _type_name(expected) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
             dict: "a table"}
    kinds = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join(dict.fromkeys(names[k] for k in kinds if k is not float or int not in kinds))


def _check_parameters(entry, parameters, name, source):
    """Unknown fields of a built-in model's parameter type, named with the valid ones (a :class:`GraphError`)."""
    kind = entry.parameters_type
    if not dataclasses.is_dataclass(kind):
        return
    fields = [f.name for f in dataclasses.fields(kind)]
    for key in parameters:
        if key not in fields:
            raise GraphError(f"model.parameters.{key}: not a parameter of {name} in {source}"
                             f"{did_you_mean(key, fields)} (its parameters: {', '.join(fields)})")


def _check_count(field, value, source):
    """A count of items (a size, a capacity, or a list of them) must fit a device's resource: <= 10**15."""
    values = value if isinstance(value, list) else [value]
    for item in values:
        if isinstance(item, int) and not isinstance(item, bool) and item > UNLIMITED_CAPACITY:
            raise GraphError(f"{field}: {item:,} is more items than any device can hold (at most "
                             f"{UNLIMITED_CAPACITY:,}) in {source}")


def parse_graph(data: dict, source: str = "<graph>") -> Graph:
    """Validate a graph already read into a dict."""
    for section, value in data.items():
        if section not in _SCHEMA:
            raise GraphError(f"{section}: unknown section in {source} (known: {', '.join(_SCHEMA)})")
        if not isinstance(value, dict):
            raise GraphError(f"{section}: expected a table in {source}, got {value!r}")
        for key, item in value.items():
            expected = _SCHEMA[section].get(key)
            if expected is None:
                raise GraphError(f"{section}.{key}: unknown key in {source}{did_you_mean(key, _SCHEMA[section])} "
                                 f"(known in [{section}]: {', '.join(_SCHEMA[section])})")
            if not _fits(item, expected):
                fitting = [k for k, kind in _SCHEMA[section].items() if k != key and _fits(item, kind)]
                raise GraphError(f"{section}.{key}: {item!r} has the wrong type (expected {_type_name(expected)}) "
                                 f"in {source}{did_you_mean(key, fitting)}")
            _check_count(f"{section}.{key}", item, source)
    for section, key in _REQUIRED:
        if key not in data.get(section, {}):
            raise GraphError(f"{section}.{key}: required in {source}")

    model = data["model"]
    parameters = model.get("parameters", {})
    neml2_keys = [key for key in ("input", "model", "inputs", "outputs") if key in model]
    if model["name"] == "neml2":
        try:
            parameters = graph_parameters(model, source)
        except ValueError as err:
            raise GraphError(f"{err} in {source}") from None
    elif neml2_keys:
        raise GraphError(f"model.{neml2_keys[0]}: only for name = 'neml2' in {source}")
    own = is_import_path(model["name"])
    for key in ("generator",) if not own else ("tangent",):
        if key in model:
            raise GraphError(f"model.{key}: only for " + ("your own model (name = 'package.module:function')"
                                                          if key == "generator" else "the built-in models")
                             + f" in {source}")
    folder = str(Path(source).resolve().parent) if Path(source).is_file() else None
    try:
        entry = get_model(model["name"], folder=folder, generator=model.get("generator"))
    except ValueError as err:
        raise GraphError(f"{_prefixed('model.name', err)} in {source}") from None
    _check_parameters(entry, parameters, model["name"], source)
    try:
        entry.parameters_type(**parameters)
    except (TypeError, ValueError) as err:
        raise GraphError(f"{_prefixed('model.parameters', err)} in {source}") from None

    size = data["batch"]["size"]
    if size < 1:
        raise GraphError(f"batch.size: must be >= 1, got {size} in {source}")
    scheduler = dict(data.get("scheduler", {}))
    if scheduler.get("type", "auto") not in SCHEDULER_TYPES:
        raise GraphError(f"scheduler.type: {scheduler['type']!r} in {source}; expected one of {', '.join(SCHEDULER_TYPES)}")
    if "device" in scheduler and "devices" in scheduler:
        raise GraphError(
            f"scheduler.device: {scheduler['device']!r} and scheduler.devices: {scheduler['devices']!r} are both "
            f"set in {source}; give one"
        )
    options = dict(data.get("options", {}))
    if options.get("mode", "async") not in ("sync", "async"):
        raise GraphError(f"options.mode: {options['mode']!r} in {source}; expected 'sync' or 'async'")
    if "chunk_timeout" in options and not options["chunk_timeout"] > 0:
        raise GraphError(f"options.chunk_timeout: must be a positive number of seconds, got "
                         f"{options['chunk_timeout']} in {source}")
    if options.get("threads_per_worker", 1) < 1:
        raise GraphError(f"options.threads_per_worker: must be >= 1, got {options['threads_per_worker']} in {source}")
    graph = Graph(source, model["name"], dict(parameters), model.get("tangent", True), size, scheduler, options,
                  model.get("generator"))
    try:
        graph.build_scheduler()  # every scheduler error surfaces now, before any cluster starts
    except ValueError as err:
        raise GraphError(f"{_prefixed('scheduler.', err)} in {source}") from None
    return graph
