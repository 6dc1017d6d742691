"""The Bokeh side of the dsched dashboard page: plots and tables drawn from :class:`~dsched.dashboard.DashboardPlugin`.

Every plot has one row (or line, or colour of points) per device and host, labelled
``cuda:0@10.0.0.3``, coloured by device, hatched where the device is emulated
(a worker that claims a CUDA device and computes with NumPy: placement
tests, never a GPU measurement). Models carry names (``dsched-load``,
``dsched-timeline``, ...) so a browser test can read their data.

:func:`register_page` lists the page and each plot alone in Dask's dashboard
(its "More" menu): Dask builds the dashboard's pages when the scheduler
starts, so it must run in the scheduler's process before then. Bokeh is
imported only when a page is drawn or listed.
"""

from __future__ import annotations

import math

from dsched.observe.dashboard.plugin import install
from dsched.observe.dashboard.routes import COLUMNS, PAGE_ROUTE, PLOT_ROUTES

__all__ = ["dsched_doc", "plot_doc", "register_page", "format_count", "format_seconds"]

UPDATE_MS = 500
EMULATED_HATCH = "/"


def format_count(value, digits=0) -> str:
    """``1234567.8`` → ``"1,234,568"``; ``None`` → ``"-"``; strings unchanged."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def format_seconds(seconds) -> str:
    """An ETA or a duration: ``"-"``, ``"0.4 s"``, ``"3 min 20 s"``."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def _colour(device: str) -> str:
    from bokeh.palettes import Category10

    if device == "cpu":
        return Category10[10][0]
    index = device.partition(":")[2]
    return Category10[10][1 + int(index) % 9] if index.isdigit() else Category10[10][1]


def _dash(host, labels) -> str:
    """A line style per host (the colour is the device's), so one device's lines on two nodes differ."""
    hosts = sorted({label.partition("@")[2] for label in labels})
    return ("solid", "dashed", "dotted", "dotdash", "dashdot")[hosts.index(host) % 5]


def _factor(row) -> str:
    """A row's axis label: ``cuda:0@host``, marked where emulated."""
    return row["label"] + (" (emulated)" if row.get("emulated") else "")


def _run_text(run) -> str:
    if run is None:
        return "no dsched run yet"
    done = format_count(run["items_done"])
    if run["total"]:
        progress = f"{done} of {format_count(run['total'])} items ({100 * run['fraction']:.1f} %)"
    else:
        progress = f"{done} items (total unknown: wrap the run in dsched.dashboard.track_run for a percentage)"
    state = "running" if run["active"] else "finished"
    return (f"run {run['number']} ({run['name']}), {state}: {progress}, "
            f"{format_count(run['items_per_s'])} items/s, ETA {format_seconds(run['eta_s'])}, "
            f"elapsed {format_seconds(run['elapsed_s'])}")


def _predictions_title(run) -> str:
    if run is None or not run["predicted_chunks"]:
        return ("Predicted against measured chunk time: no predictions in this run "
                "(PerformanceModelScheduler predicts each chunk's time)")
    return (f"Predicted against measured chunk time: median relative error {100 * run['prediction_error']:.1f} % "
            f"over {run['predicted_chunks']:,} chunks (dashed: predicted = measured)")


class DschedPlots:
    """All the page's parts, updated together from one snapshot of the plugin.

    Parameters
    ----------
    plugin : DashboardPlugin
        The scheduler's plugin.
    """

    def __init__(self, plugin):
        from bokeh.models import ColumnDataSource

        self.plugin = plugin
        self.pinned_run = None  # an earlier run picked in the runs table; None follows the current run
        self.sources = {name: ColumnDataSource(name=f"dsched-{name}") for name in
                        ("progress", "load", "throughput", "timeline", "predictions", "diagonal", "devices", "hosts",
                         "runs")}
        self.heading = self.progress = self.load = self.throughput = self.timeline = self.predictions = None
        self.tables = {}
        self.run_select = None

    # --- the parts --------------------------------------------------------------

    def build_heading(self):
        from bokeh.models import Div

        self.heading = Div(name="dsched-heading", text="", sizing_mode="stretch_width")
        return self.heading

    def build_progress(self):
        from bokeh.models import FactorRange, Range1d
        from bokeh.plotting import figure

        fig = figure(name="dsched-progress-figure", height=110, sizing_mode="stretch_width", tools="",
                     toolbar_location=None, x_range=Range1d(0, 100), y_range=FactorRange(factors=["run"]),
                     title="Current run")
        fig.hbar(y="y", right="whole", height=0.7, fill_color="#e6e6e6", line_color=None, source=self.sources["progress"])
        fig.hbar(y="y", right="percent", height=0.7, fill_color="#2ca02c", line_color=None, source=self.sources["progress"])
        fig.xaxis.axis_label = "% of the run's items done"
        fig.yaxis.visible = False
        self.progress = fig
        return fig

    def build_load(self):
        from bokeh.models import DataRange1d, FactorRange, HoverTool, NumeralTickFormatter
        from bokeh.plotting import figure

        fig = figure(name="dsched-load-figure", height=220, sizing_mode="stretch_width", tools="",
                     toolbar_location=None, y_range=FactorRange(), x_range=DataRange1d(start=0),
                     title="Load against capacity (items in flight per device)")
        src = self.sources["load"]
        fig.hbar(y="factor", right="capacity_bar", height=0.8, fill_color="#e6e6e6", line_color="#999999", source=src)
        fig.hbar(y="factor", right="load", height=0.8, fill_color="color", hatch_pattern="hatch",
                 hatch_color="white", line_color=None, source=src)
        fig.add_tools(HoverTool(tooltips=[("device", "@label"), ("workers", "@worker"), ("load", "@load_text"),
                                          ("capacity", "@capacity_text"), ("chunks in flight", "@chunks_in_flight")]))
        fig.xaxis.axis_label = "items"
        fig.xaxis.formatter = NumeralTickFormatter(format="0,0")
        self.load = fig
        return fig

    def build_throughput(self):
        from bokeh.models import DataRange1d, HoverTool, NumeralTickFormatter
        from bokeh.plotting import figure

        fig = figure(name="dsched-throughput-figure", height=260, sizing_mode="stretch_width", tools="",
                     toolbar_location=None, x_range=DataRange1d(start=0), y_range=DataRange1d(start=0),
                     title="Items/s per device over the run")
        fig.multi_line(xs="xs", ys="ys", line_color="color", line_dash="dash", line_width=2, legend_field="factor",
                       source=self.sources["throughput"])
        fig.add_tools(HoverTool(tooltips=[("device", "@factor"), ("t", "$data_x{0.0} s"), ("items/s", "$data_y{0,0}")]))
        fig.legend.label_text_font_size = "9pt"
        fig.add_layout(fig.legend[0], "right")  # beside the lines, never over them
        fig.xaxis.axis_label = "seconds since the run's first chunk started"
        fig.yaxis.axis_label = "items/s"
        fig.yaxis.formatter = NumeralTickFormatter(format="0,0")
        self.throughput = fig
        return fig

    def build_timeline(self):
        from bokeh.models import DataRange1d, FactorRange, HoverTool
        from bokeh.plotting import figure

        fig = figure(name="dsched-timeline-figure", height=240, sizing_mode="stretch_width",
                     tools="xwheel_zoom,xpan,reset", toolbar_location="above", y_range=FactorRange(),
                     x_range=DataRange1d(start=0), title="Chunks per device (task stream of the run)")
        fig.hbar(y="factor", left="start", right="stop", height=0.8, fill_color="color", hatch_pattern="hatch",
                 hatch_color="white", line_color="white", line_width=0.5, source=self.sources["timeline"])
        fig.add_tools(HoverTool(tooltips=[("device", "@factor"), ("items", "@items{0,0}"),
                                          ("start", "@start{0.000} s"), ("duration", "@duration{0.000} s")]))
        fig.xaxis.axis_label = "seconds since the run's first chunk started"
        self.timeline = fig
        return fig

    def build_predictions(self):
        """Predicted against measured chunk seconds (log-log, one colour per device), and the line where they agree."""
        from bokeh.models import HoverTool
        from bokeh.plotting import figure

        fig = figure(name="dsched-predictions-figure", height=300, sizing_mode="stretch_width", tools="",
                     toolbar_location=None, x_axis_type="log", y_axis_type="log", title=_predictions_title(None))
        fig.line(x="x", y="y", line_color="#999999", line_dash="dashed", source=self.sources["diagonal"])
        fig.scatter(x="predicted", y="measured", size=6, fill_color="color", line_color=None, fill_alpha=0.6,
                    legend_field="factor", source=self.sources["predictions"])
        fig.add_tools(HoverTool(tooltips=[("device", "@factor"), ("predicted", "@predicted{0.0000} s"),
                                          ("measured", "@measured{0.0000} s"), ("error", "@error{0.0 %}")]))
        fig.legend.label_text_font_size = "9pt"
        fig.add_layout(fig.legend[0], "right")
        fig.xaxis.axis_label = "predicted chunk seconds (the performance model, at dispatch)"
        fig.yaxis.axis_label = "measured chunk seconds (on the worker)"
        self.predictions = fig
        return fig

    def build_tables(self):
        """The devices, hosts and runs tables (HTML: cheap to redraw, whole cells with tooltips), and the run picker."""
        from bokeh.models import Div, Select

        for name in ("devices", "hosts", "runs"):
            self.tables[name] = Div(name=f"dsched-{name}-table", text="", sizing_mode="stretch_width")
        self.run_select = Select(name="dsched-run-select", title="Show", value="", options=[("", "the current run")],
                                 width=420)
        self.run_select.on_change("value", self._pick_run)
        return self.tables

    def _pick_run(self, attr, old, new):
        self.pinned_run = new or None
        self.update()

    # --- refreshing ---------------------------------------------------------------

    def update(self):
        snapshot = self.plugin.snapshot()
        detail = self.plugin.run_detail(self.pinned_run)
        if self.pinned_run is not None and detail is None:  # the run left the history
            self.pinned_run, detail = None, self.plugin.run_detail()
        rows = snapshot["devices"]
        run = detail["run"] if detail is not None else None
        factors = [_factor(r) for r in rows]
        emulated = {r["label"] for r in rows if r["emulated"]}
        if self.heading is not None:
            self.heading.text = _heading(snapshot, run, self.pinned_run is not None)
        if self.progress is not None:
            self._update_progress(run)
        if self.load is not None:
            self.load.y_range.factors = factors
            _set(self.sources["load"], _load_data(rows, factors))
        if self.throughput is not None or self.timeline is not None or self.predictions is not None:
            self._update_run_plots(detail, rows, factors, emulated)
        if self.tables:
            self._update_tables(snapshot)

    def _update_progress(self, run):
        percent = 100 * run["fraction"] if run and run["fraction"] is not None else 0.0
        _set(self.sources["progress"], {
            "y": ["run"], "whole": [100.0], "percent": [percent],
            "items_done": [run["items_done"] if run else 0], "total": [run["total"] if run else None],
            "fraction": [run["fraction"] if run else None], "items_per_s": [run["items_per_s"] if run else 0.0],
            "eta_s": [run["eta_s"] if run else None], "text": [_run_text(run)],
        })
        self.progress.title.text = _run_text(run)

    def _update_run_plots(self, detail, rows, factors, emulated):
        label_factor = {r["label"]: f for r, f in zip(rows, factors)}
        series = detail["series"] if detail else {}
        chunks = detail["chunks"] if detail else []
        predicted = detail["predictions"] if detail else []
        for label in list(series) + [c["label"] for c in chunks + predicted]:  # a device whose workers have left
            if label not in label_factor:
                label_factor[label] = label
                factors = factors + [label]
        if self.throughput is not None:
            labels = list(series)
            _set(self.sources["throughput"], {
                "label": labels, "factor": [label_factor[lb] for lb in labels],
                "xs": [series[lb][0] for lb in labels], "ys": [series[lb][1] for lb in labels],
                "color": [_colour(lb.partition("@")[0]) for lb in labels],
                "dash": [_dash(lb.partition("@")[2], labels) for lb in labels],
            })
        if self.predictions is not None:
            self._update_predictions(detail, label_factor)
        if self.timeline is not None:
            self.timeline.y_range.factors = factors
            _set(self.sources["timeline"], {
                "label": [c["label"] for c in chunks], "factor": [label_factor[c["label"]] for c in chunks],
                "start": [c["start"] for c in chunks], "stop": [c["stop"] for c in chunks],
                "duration": [c["stop"] - c["start"] for c in chunks], "items": [c["items"] for c in chunks],
                "color": [_colour(c["device"]) for c in chunks],
                "hatch": [EMULATED_HATCH if c["label"] in emulated else " " for c in chunks],
            })

    def _update_predictions(self, detail, label_factor):
        points = detail["predictions"] if detail else []
        _set(self.sources["predictions"], {
            "label": [p["label"] for p in points], "factor": [label_factor[p["label"]] for p in points],
            "predicted": [p["predicted"] for p in points], "measured": [p["measured"] for p in points],
            "error": [abs(p["predicted"] - p["measured"]) / p["measured"] for p in points],
            "color": [_colour(p["device"]) for p in points],
        })
        values = [v for p in points for v in (p["predicted"], p["measured"]) if v > 0]
        ends = [min(values), max(values)] if values else []
        _set(self.sources["diagonal"], {"x": ends, "y": ends})
        self.predictions.title.text = _predictions_title(detail["run"] if detail else None)

    def _update_tables(self, snapshot):
        rows = snapshot["devices"]
        changed = {"devices": _set(self.sources["devices"], {f: [_cell(f, r[f]) for r in rows] for f, _ in COLUMNS})}
        hosts = snapshot["hosts"]
        changed["hosts"] = _set(self.sources["hosts"], {
            "host": [h["host"] for h in hosts], "devices": [", ".join(h["devices"]) for h in hosts],
            "workers": [str(h["workers"]) for h in hosts], "load": [format_count(h["load"]) for h in hosts],
            "capacity": [format_count(h["capacity"]) for h in hosts],
            "chunks_done": [format_count(h["chunks_done"]) for h in hosts],
            "items_done": [format_count(h["items_done"]) for h in hosts],
            "items_per_s": [format_count(h["items_per_s"]) for h in hosts],
            "emulated": [", ".join(h["emulated"]) or "none" for h in hosts],
        })
        runs = snapshot["runs"]
        changed["runs"] = _set(self.sources["runs"], {
            "id": [r["id"] for r in runs], "number": [str(r["number"]) for r in runs],
            "name": [r["name"] for r in runs], "state": ["running" if r["active"] else "finished" for r in runs],
            "items_done": [format_count(r["items_done"]) for r in runs],
            "total": [format_count(r["total"]) for r in runs],
            "progress": ["-" if r["fraction"] is None else f"{100 * r['fraction']:.1f} %" for r in runs],
            "items_per_s": [format_count(r["items_per_s"]) for r in runs],
            "elapsed": [format_seconds(r["elapsed_s"]) for r in runs], "client": [r["client"] or "-" for r in runs],
        })
        if changed["devices"]:
            self.tables["devices"].text = _html_table(self.sources["devices"].data, COLUMNS, "device", tips={"worker"})
        if changed["hosts"]:
            self.tables["hosts"].text = _html_table(self.sources["hosts"].data, HOST_COLUMNS, "host")
        if changed["runs"]:
            self.tables["runs"].text = _html_table(self.sources["runs"].data, RUN_COLUMNS, "run", tips={"client"})
            options = [("", "the current run")] + [
                (i, f"run {n}: {name}") for i, n, name in zip(*(self.sources["runs"].data[k] for k in ("id", "number", "name")))]
            if self.run_select.options != options:
                self.run_select.options = options


HOST_COLUMNS = [("host", "host"), ("devices", "devices"), ("workers", "workers"), ("load", "load"),
                ("capacity", "capacity"), ("chunks_done", "chunks done"), ("items_done", "items done"),
                ("items_per_s", "items/s"), ("emulated", "emulated devices")]
RUN_COLUMNS = [("number", "run"), ("name", "name"), ("state", "state"), ("items_done", "items done"),
               ("total", "total"), ("progress", "progress"), ("items_per_s", "items/s"), ("elapsed", "elapsed"),
               ("client", "client")]
_TABLE_STYLE = ("<style>table.dsched{border-collapse:collapse;font-size:12px;width:100%}"
                "table.dsched td,table.dsched th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right;"
                "white-space:nowrap}table.dsched th{background:#f4f4f4}"
                "table.dsched td:first-child,table.dsched th:first-child{text-align:left}</style>")


def _html_table(data, columns, row_class, tips=()) -> str:
    """An HTML table of formatted columns; ``tips`` columns carry their text as a tooltip too."""
    from html import escape

    head = "".join(f"<th>{escape(title)}</th>" for _, title in columns)
    n = len(data[columns[0][0]]) if columns[0][0] in data else 0
    body = []
    for i in range(n):
        cells = []
        for field, _ in columns:
            text = escape(str(data[field][i]))
            cells.append(f'<td title="{text}">{text}</td>' if field in tips else f"<td>{text}</td>")
        body.append(f'<tr class="{row_class}">{"".join(cells)}</tr>')
    return f'{_TABLE_STYLE}<table class="dsched"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _set(source, data) -> bool:
    """Replace a source's columns the way Dask's own plots do; whether anything changed."""
    from distributed.dashboard.utils import update

    old = source.data
    if set(old) == set(data) and all(_as_list(old[k]) == _as_list(v) for k, v in data.items()):
        return False
    update(source, data)  # turns long numeric columns into NumPy arrays, hence _as_list
    return True


def _as_list(column) -> list:
    return column.tolist() if hasattr(column, "tolist") else list(column)


def _load_data(rows, factors) -> dict:
    def capacity_bar(r):
        return float(r["capacity"]) if isinstance(r["capacity"], (int, float)) else float(r["load"])

    return {
        "label": [r["label"] for r in rows], "factor": factors,
        "load": [float(r["load"]) for r in rows], "capacity_bar": [capacity_bar(r) for r in rows],
        "load_text": [format_count(r["load"]) for r in rows], "capacity_text": [format_count(r["capacity"]) for r in rows],
        "chunks_in_flight": [r["chunks_in_flight"] for r in rows], "worker": [r["worker"] or "-" for r in rows],
        "color": [_colour(r["device"]) for r in rows],
        "hatch": [EMULATED_HATCH if r["emulated"] else " " for r in rows],
    }


def _heading(snapshot, run, pinned) -> str:
    rows = snapshot["devices"]
    hosts = snapshot["hosts"]
    emulated = [r["label"] for r in rows if r["emulated"]]
    text = (f"<h2 style='margin:4px 0'>dsched: {len(rows)} device{'s' * (len(rows) != 1)} on "
            f"{len(hosts)} host{'s' * (len(hosts) != 1)}</h2>")
    if run is not None:
        text += f"<p style='margin:2px 0'>{'Showing earlier' if pinned else 'Current'} {_run_text(run)}</p>"
    if emulated:
        text += ("<p style='margin:2px 0'>Hatched: emulated devices (workers claiming a CUDA device and computing "
                 f"with NumPy; placement tests, not a GPU measurement): {', '.join(emulated)}.</p>")
    text += (f"<p style='margin:2px 0;color:#666'>items/s and busy fraction in the tables over the last "
             f"{snapshot['window_s']:g} s; load counts the items the scheduler has sent to a device's workers.</p>")
    return text


def _cell(field, value) -> str:
    if value is None:
        return "-"
    if field == "busy_fraction":
        return f"{value:.2f}"
    if field == "emulated":
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format_count(value)
    return str(value)


# --- documents ----------------------------------------------------------------------

def _finish(doc, extra, title, root, plots):
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    plots.update()
    doc.add_periodic_callback(plots.update, UPDATE_MS)
    doc.title = title
    doc.add_root(root)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def dsched_doc(scheduler, extra, doc):
    """The ``/individual-dsched`` page: heading, the run's plots and tables; earlier runs one tab away."""
    from bokeh.layouts import column
    from bokeh.models import Div, TabPanel, Tabs

    plots = DschedPlots(install(scheduler))
    tables = plots.build_tables()
    current = column(plots.run_select, plots.build_progress(), plots.build_load(), plots.build_throughput(),
                     plots.build_timeline(), plots.build_predictions(),
                     Div(text="<b>Devices</b> (one row per device and host)"), tables["devices"],
                     Div(text="<b>Hosts</b>"), tables["hosts"], sizing_mode="stretch_width")
    history = column(Div(text="Every run the scheduler has seen, newest first; pick one under <i>Show</i> in the "
                              "first tab to see its plots."), tables["runs"], sizing_mode="stretch_width")
    tabs = Tabs(name="dsched-tabs", sizing_mode="stretch_width",
                tabs=[TabPanel(child=current, title="Run"), TabPanel(child=history, title="Earlier runs")])
    _finish(doc, extra, "Dask: dsched", column(plots.build_heading(), tabs, sizing_mode="stretch_width"), plots)


def plot_doc(part: str):
    """A document function showing one plot alone.

    ``part``: ``progress``, ``load``, ``throughput``, ``timeline`` or ``predictions``.
    """
    builders = {"progress": "build_progress", "load": "build_load", "throughput": "build_throughput",
                "timeline": "build_timeline", "predictions": "build_predictions"}
    if part not in builders:
        raise ValueError(f"part: expected one of {', '.join(builders)}, got {part!r}")

    def doc_function(scheduler, extra, doc):
        plots = DschedPlots(install(scheduler))
        figure = getattr(plots, builders[part])()
        figure.sizing_mode = "stretch_both"
        _finish(doc, extra, f"Dask: dsched {part}", figure, plots)

    doc_function.__name__ = f"dsched_{part}_doc"
    return doc_function


def register_page() -> None:
    """List the page and its plots in the dashboard; must run before the scheduler starts."""
    from distributed.dashboard import scheduler as dashboard_scheduler

    dashboard_scheduler.applications.setdefault(PAGE_ROUTE, dsched_doc)
    for part, route in PLOT_ROUTES.items():
        dashboard_scheduler.applications.setdefault(route, plot_doc(part))
