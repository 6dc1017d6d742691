"""Running a workload graph: cluster, dispatcher, progress bar, per-device table."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

from dsched.apps.jobfile import GraphError
from dsched.cluster.local import LocalHybridCluster
from dsched.dataplane.loaders import SliceGenerator
from dsched.dataplane.outputs import check_out_path
from dsched.devices.context import emulating
from dsched.devices.cuda import visible_gpus
from dsched.devices.device import UNLIMITED_CAPACITY, Device
from dsched.devices.ownership import emulated_devices
from dsched.dispatch.dispatcher import WorkDispatcher
from dsched.observe.report import RunReport
from dsched.observe.trace import check_trace_path
from dsched.worker.chunk import takes_out

__all__ = ["run_graph", "JobResult", "format_report", "graph_cluster"]


@dataclass
class JobResult:
    """What ``dsched run`` produced: the joined outputs and the run's report."""

    outputs: dict
    report: RunReport
    emulated: dict  # Device -> bool


def run_graph(graph, *, client=None, progress=True) -> JobResult:
    """Run ``graph`` (a :class:`~dsched.graph.Graph`) and return its outputs and report.

    Without ``client`` a :class:`LocalHybridCluster` over the graph's devices is
    started (emulating missing CUDA devices if the graph says so) and closed.
    Before anything starts, the graph is refused (:class:`~dsched.graph.GraphError`)
    if its outputs cannot fit in memory, or if it needs a GPU this machine lacks
    and does not emulate it.
    """
    model = graph.entry()
    parameters = model.parameters_type(**graph.parameters)
    # A model that takes out= computes into the run's output rows (asked once here, not per chunk).
    do_work = functools.partial(_model_chunk_into if takes_out(model.chunk) else _model_chunk, model.chunk,
                                parameters, graph.tangent)
    scheduler = graph.build_scheduler()
    # Output paths are checked before any cluster starts.
    trace_file, report_file = graph.options.get("trace_file"), graph.options.get("performance_report")
    try:
        if trace_file is not None:
            trace_file = check_trace_path(trace_file, "options.trace_file")
        if report_file is not None:
            report_file = check_trace_path(report_file, "options.performance_report")
        output = graph.options.get("output")
        if output is not None:
            output = check_out_path(output, graph.options.get("overwrite", False), "options.output")
    except ValueError as err:
        raise GraphError(f"{err} (in {graph.source})") from None
    graph.check_memory()  # never refused when the outputs go to disk
    if client is None:
        graph.check_devices_present()  # a cluster started here, or sync chunks on this thread
    # Sync chunks run on this thread, with no worker to emulate a device: the missing GPUs are emulated here.
    missing = [d for d in graph.devices() if d.is_cuda and d not in visible_gpus()] if graph.mode == "sync" else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(emulating(missing))
        if client is None and graph.mode == "async":
            client = graph_cluster(stack, graph, scheduler.devices)
        emulated = emulated_devices(client) if client is not None else {}
        if report_file is not None and client is not None:
            from distributed import performance_report

            stack.enter_context(performance_report(filename=report_file))  # written when the run's block closes
        bar = stack.enter_context(_progress_bar(graph.batch_size, progress))
        dispatcher = WorkDispatcher(
            scheduler,
            do_work,
            join="concat",  # outputs written in place by the workers, to memory or to options.output
            out=output,
            overwrite=graph.options.get("overwrite", False),
            timeout=graph.options.get("chunk_timeout"),
            output_spec=None if model.outputs is None else model.outputs(graph.tangent),
            mode=graph.mode,
            client=client,
            on_chunk_done=lambda record: bar.update(record.size),
            trace_file=trace_file,
        )
        outputs = dispatcher.run(graph.input_loader() or SliceGenerator(0, graph.batch_size))
    emulated.update({device: True for device in missing})
    return JobResult(outputs, dispatcher.last_run, emulated)


def graph_cluster(stack, graph, devices=None, dashboard_address=None):
    """A client of the :class:`LocalHybridCluster` a graph runs on, entered into ``stack`` (closed with it).

    ``dashboard_address`` serves the cluster's dashboard there (``dsched run --dashboard``); none by default.
    """
    from distributed import Client

    scheduler = graph.build_scheduler()
    # The workers hold what the graph's policy allows in flight, so the dashboard shows the graph's capacities.
    capacities = {} if hasattr(scheduler, "observe") else {  # a learning policy sizes its chunks as it goes
        s.device: s.capacity for s in scheduler.status() if s.capacity < UNLIMITED_CAPACITY}
    cluster = stack.enter_context(LocalHybridCluster(
        devices if devices is not None else scheduler.devices,
        capacities={d: c for d, c in capacities.items() if devices is None or d in devices} or None,
        emulate=graph.emulate,
        threads_per_worker=graph.options.get("threads_per_worker", 2),
        processes=graph.options.get("processes"),
        dashboard_address=dashboard_address,
    ))
    return stack.enter_context(Client(cluster))


def _model_chunk(chunk, parameters, tangent, work, device):
    return chunk(work, device, parameters, tangent=tangent)


def _model_chunk_into(chunk, parameters, tangent, work, device, out=None):
    # out: the chunk's output rows (None where they cannot be views): no copy into place afterwards.
    return chunk(work, device, parameters, tangent=tangent, out=out)


@contextlib.contextmanager
def _progress_bar(total, enabled):
    from tqdm import tqdm

    with tqdm(total=total, unit="pt", unit_scale=True, disable=not enabled, desc="dispatch", leave=False) as bar:
        yield bar


def format_report(result: JobResult) -> str:
    """The per-device table, a per-host summary on several hosts, and the total throughput, as text.

    One row per device and host: a device name owned on several hosts (the
    multi-node case) gets a row per host, labelled ``cuda:0@node3``; on one
    host the label is the device alone. Busy seconds are the device worker's
    time inside the chunks; items/s is items over busy seconds, so it
    measures the device, not the transfers. A run whose policy predicted
    chunk times (``PerformanceModelScheduler``) has a ``model err`` column, the
    median relative error of each device's predictions, and a line with the
    run's.
    """
    report = result.report
    rows = report.by_device()
    hosts = report.by_host()
    several = len(hosts) > 1
    predicted = report.prediction_error is not None
    width = max([10, *(len(str(key)) + 1 for key in rows)]) if several else 10
    header = f"{'device':<{width}} {'emulated':<9} {'chunks':>7} {'items':>10} {'busy s':>8} {'items/s':>12}"
    if predicted:
        header += f" {'model err':>9}"
    lines = [header, "-" * len(header)]

    def line(label, emulated, row):
        rate = row["items_per_s"]
        text = (f"{label:<{width}} {emulated:<9} {row['chunks']:>7} {row['items']:>10} "
                f"{row['busy']:>8.3f} {'-' if math.isnan(rate) else f'{rate:,.0f}':>12}")
        if predicted and "prediction_error" in row:
            text += f" {_percent(row['prediction_error']):>9}"
        return text

    for key, row in sorted(rows.items(), key=lambda kv: (kv[0].host, str(kv[0].device))) if several else rows.items():
        emulated = "yes" if result.emulated.get(Device(row["device"]), False) else "no"
        lines.append(line(str(key) if several else str(row["device"]), emulated, row))
    if several:  # per-node balance: one line per host, its devices together
        lines.append("-" * len(header))
        lines.append(f"{'host':<{width}} {'devices':<9}" + header[width + 10:len(header) - 10 * predicted])
        for host, row in sorted(hosts.items()):
            lines.append(line(host, str(len(row["devices"])), row))
    wall = report.wall_time
    lines.append("-" * len(header))
    lines.append(
        f"total: {report.items:,} items in {wall:.3f} s = {report.items / wall:,.0f} items/s ({report.mode} mode)"
        + (f" on {len(hosts)} hosts" if several else "")
    )
    if predicted:
        count = sum(r.prediction_error is not None for r in report.records)
        lines.append(f"performance model: median relative error of predicted chunk times "
                     f"{_percent(report.prediction_error)} over {count:,} chunks")
    if any(result.emulated.values()):
        lines.append("emulated devices computed with NumPy on the CPU: not a GPU measurement")
    return "\n".join(lines)


def _percent(fraction) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f} %"
