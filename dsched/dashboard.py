"""The dsched page of the Dask dashboard: per device load, capacity, progress and speed.

A scheduler plugin watches the chunks that request a device resource
(``dsched-cpu``, ``dsched-cuda:0``, ...) and keeps, per device: its worker, the
load (items of the chunks the scheduler has sent to that worker and not yet
seen finish) against the capacity (the worker's amount of the resource), the
chunks and items done, items per second and the busy fraction over a recent
window, and whether the device is emulated. The same data are served as JSON
at ``/dsched/status.json`` and drawn as a table at ``/individual-dsched``,
listed in the dashboard's "More" menu (and, without Bokeh's page, as plain
HTML at ``/dsched/status``).

How to get it
-------------
- :class:`~dsched.LocalHybridCluster` installs it whenever it has a dashboard.
- Clusters started from the command line: ``dask scheduler --preload dsched.dashboard``
  (or a preload module that imports this module and calls :func:`install`
  from its ``dask_setup``).
- dask-mpi: :mod:`dsched.mpi` does it; with plain ``dask_mpi.initialize()``,
  import this module at the top of the script (so rank 0 lists the page
  before its scheduler starts) and call :func:`register` on the client rank.
- A running scheduler: ``register(client)`` adds the JSON route and the plain
  page; the Bokeh page needs this module imported (or :func:`register_page`
  called) in the scheduler's process before the scheduler starts, which is
  when Dask builds its dashboard.

Items per second and the busy fraction count chunks that finished within the
last ``window`` seconds (10 by default): a chunk still running shows in the
load, not yet in the speed.
"""

from __future__ import annotations

import collections
import json
import threading
import time

from distributed.diagnostics.plugin import SchedulerPlugin

from .devices import EMULATED_RESOURCE, RESOURCE_PREFIX, UNLIMITED_CAPACITY, Device, device_of_resources

__all__ = [
    "DashboardPlugin",
    "install",
    "register",
    "register_page",
    "dask_setup",
    "PLUGIN_NAME",
    "JSON_ROUTE",
    "PAGE_ROUTE",
    "HTML_ROUTE",
    "COLUMNS",
]

PLUGIN_NAME = "dsched-dashboard"
JSON_ROUTE = "/dsched/status.json"
PAGE_ROUTE = "/individual-dsched"
HTML_ROUTE = "/dsched/status"  # a plain page polling the JSON, for schedulers started without the Bokeh page

# The table's columns: (JSON field, title).
COLUMNS = [
    ("device", "device"),
    ("worker", "worker"),
    ("load", "load (items)"),
    ("capacity", "capacity (items)"),
    ("chunks_in_flight", "chunks in flight"),
    ("chunks_done", "chunks done"),
    ("items_done", "items done"),
    ("items_per_s", "items/s"),
    ("busy_fraction", "busy fraction"),
    ("emulated", "emulated"),
]


def _device_of_restrictions(restrictions):
    """``(Device, items)`` a task requested, or ``None`` if it requested no device."""
    for name, amount in (restrictions or {}).items():
        if name.startswith(RESOURCE_PREFIX) and name != EMULATED_RESOURCE:
            return Device(name[len(RESOURCE_PREFIX):]), amount
    return None


class _DeviceStats:
    """Finished chunks of one device: totals, and the recent ones for rates."""

    def __init__(self):
        self.chunks = 0
        self.items = 0
        self.busy_s = 0.0  # union of compute intervals, as they arrive
        self._busy_until = float("-inf")
        self.recent = collections.deque()  # (start, stop, items)

    def add(self, start, stop, items):
        self.chunks += 1
        self.items += items
        if start >= self._busy_until:
            self.busy_s += stop - start
        elif stop > self._busy_until:
            self.busy_s += stop - self._busy_until
        self._busy_until = max(self._busy_until, stop)
        self.recent.append((start, stop, items))

    def rates(self, now, window):
        """``(items/s, busy fraction)`` over the last ``window`` seconds."""
        since = now - window
        while self.recent and self.recent[0][1] < since:
            self.recent.popleft()
        if not self.recent:
            return 0.0, 0.0
        # Early in a run the window is shorter: from the first chunk's start.
        span = min(window, now - min(s for s, _, _ in self.recent))
        if span <= 0:
            return 0.0, 0.0
        items = busy = 0.0
        end = since
        for start, stop, n in sorted(self.recent):
            # A chunk straddling the window's start counts for its share inside.
            inside = max(0.0, stop - max(start, since))
            length = stop - start
            items += n * (inside / length if length > 0 else 1.0)
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        return items / span, min(1.0, busy / span)


class DashboardPlugin(SchedulerPlugin):
    """Collects per-device statistics of dsched chunks on the scheduler.

    Parameters
    ----------
    window : float
        Seconds over which items/s and the busy fraction are measured.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, window: float = 10.0):
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not window > 0:
            raise ValueError(f"window: expected a positive number of seconds, got {window!r}")
        self.window = float(window)
        self.scheduler = None
        self._stats = {}  # Device -> _DeviceStats
        self._lock = threading.Lock()  # the JSON route and the page may read from other threads

    def __getstate__(self):  # register() ships the plugin to the scheduler: settings only
        return {"window": self.window}

    def __setstate__(self, state):
        self.__init__(state["window"])

    async def start(self, scheduler):
        self.scheduler = scheduler
        add_routes(scheduler)

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs):
        if start != "processing" or finish != "memory":
            return
        ts = self.scheduler.tasks.get(key) if self.scheduler is not None else None
        requested = _device_of_restrictions(getattr(ts, "resource_restrictions", None))
        if requested is None:
            return
        device, items = requested
        computes = [s for s in kwargs.get("startstops") or () if s.get("action") == "compute"]
        if computes:
            begin, end = computes[0]["start"], computes[-1]["stop"]
        else:
            begin = end = time.time()
        with self._lock:
            self._stats.setdefault(device, _DeviceStats()).add(begin, end, int(items))

    def snapshot(self) -> dict:
        """The page's data: ``{"time", "window_s", "devices": [row, ...]}``, one row per device worker."""
        now = time.time()
        rows = []
        seen = set()
        scheduler = self.scheduler
        workers = list(scheduler.workers.values()) if scheduler is not None else []
        with self._lock:
            for ws in sorted(workers, key=lambda w: str(w.name)):
                device = device_of_resources(ws.resources)
                if device is None:
                    continue
                seen.add(device)
                resource = f"{RESOURCE_PREFIX}{device}"
                amount = ws.resources[resource]
                load = in_flight = 0
                for ts in ws.processing:
                    requested = _device_of_restrictions(ts.resource_restrictions)
                    if requested is not None and requested[0] == device:
                        load += requested[1]
                        in_flight += 1
                rows.append(self._row(device, ws.address, str(ws.name), amount, load, in_flight,
                                      EMULATED_RESOURCE in ws.resources, now))
            for device in self._stats:  # a device whose worker left still shows what it did
                if device not in seen:
                    rows.append(self._row(device, None, None, None, 0, 0, None, now))
        return {"time": now, "window_s": self.window, "devices": rows}

    def _row(self, device, address, name, amount, load, in_flight, emulated, now):
        stats = self._stats.get(device) or _DeviceStats()
        rate, busy = stats.rates(now, self.window)
        if amount is None:
            capacity = None
        elif amount >= UNLIMITED_CAPACITY:
            capacity = "unlimited"
        else:
            capacity = int(amount) if float(amount).is_integer() else amount
        return {
            "device": str(device),
            "worker": address,
            "worker_name": name,
            "load": int(load) if float(load).is_integer() else load,
            "capacity": capacity,
            "chunks_in_flight": in_flight,
            "chunks_done": stats.chunks,
            "items_done": stats.items,
            "items_per_s": rate,
            "busy_fraction": busy,
            "busy_s": stats.busy_s,
            "emulated": emulated,
        }

    def reset(self):
        """Forget the finished chunks (the page starts counting again)."""
        with self._lock:
            self._stats.clear()


# --- HTTP: the JSON route ---------------------------------------------------

def _json_handler():
    from distributed.http.utils import RequestHandler

    class StatusJSON(RequestHandler):
        def get(self):
            plugin = install(self.server)
            self.set_header("Content-Type", "application/json")
            self.set_header("Cache-Control", "no-store")
            self.write(json.dumps(plugin.snapshot()))

    return StatusJSON


_HTML_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>dsched devices</title>
<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child,th{text-align:left}</style></head>
<body><h3>dsched devices</h3><p id="note"></p>
<table id="devices"><thead><tr>%(head)s</tr></thead><tbody></tbody></table>
<script>
const fields = %(fields)s;
function cell(f, v) {
  if (v === null || v === undefined) return "-";
  if (f === "items_per_s") return Math.round(v).toLocaleString("en");
  if (f === "busy_fraction") return v.toFixed(2);
  if (f === "emulated") return v ? "yes" : "no";
  return String(v);
}
async function refresh() {
  try {
    const data = await (await fetch("%(json)s", {cache: "no-store"})).json();
    const body = document.querySelector("#devices tbody");
    body.replaceChildren(...data.devices.map(row => {
      const tr = document.createElement("tr");
      tr.className = "device";
      for (const f of fields) { const td = document.createElement("td"); td.textContent = cell(f, row[f]); tr.appendChild(td); }
      return tr;
    }));
    document.getElementById("note").textContent =
      "items/s and busy fraction over the last " + data.window_s + " s";
  } catch (e) { document.getElementById("note").textContent = "no data: " + e; }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""


def _html_handler():
    from distributed.http.utils import RequestHandler

    class StatusPage(RequestHandler):
        def get(self):
            install(self.server)
            head = "".join(f"<th>{title}</th>" for _, title in COLUMNS)
            fields = json.dumps([field for field, _ in COLUMNS])
            self.write(_HTML_PAGE % {"head": head, "fields": fields, "json": JSON_ROUTE})

    return StatusPage


def add_routes(scheduler) -> bool:
    """Serve :data:`JSON_ROUTE` and :data:`HTML_ROUTE` from ``scheduler``'s HTTP server; False if it has none."""
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    if not getattr(app, "_dsched_routes", False):
        app.add_handlers(r".*", [
            (JSON_ROUTE, _json_handler(), {"dask_server": scheduler}),
            (HTML_ROUTE, _html_handler(), {"dask_server": scheduler}),
        ])
        app._dsched_routes = True
    return True


def install(scheduler, window: float = 10.0) -> DashboardPlugin:
    """Add the plugin and the JSON route to a scheduler (in its process); idempotent.

    Call it from a preload module's ``dask_setup(scheduler)``.
    """
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        plugin = DashboardPlugin(window)
        scheduler.add_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    plugin.scheduler = scheduler  # add_plugin on a running scheduler does not call start()
    add_routes(scheduler)
    return plugin


def dask_setup(scheduler):
    """Preload hook: ``dask scheduler --preload dsched.dashboard``."""
    install(scheduler)


def register(client, window: float = 10.0) -> None:
    """Install the plugin and the JSON route on the running scheduler of ``client``."""
    client.register_plugin(DashboardPlugin(window), name=PLUGIN_NAME)


# --- the Bokeh page ---------------------------------------------------------

def dsched_doc(scheduler, extra, doc):
    """The ``/individual-dsched`` page: one table row per device, refreshed twice a second."""
    from bokeh.models import ColumnDataSource, DataTable, Div, TableColumn
    from bokeh.layouts import column
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    plugin = install(scheduler)
    fields = [f for f, _ in COLUMNS]
    source = ColumnDataSource({f: [] for f in fields})
    table = DataTable(
        source=source,
        columns=[TableColumn(field=f, title=t) for f, t in COLUMNS],
        index_position=None,
        sizing_mode="stretch_width",
        height=300,
    )
    note = Div(text="")

    def update():
        data = plugin.snapshot()
        rows = data["devices"]
        source.data = {f: [_cell(f, row[f]) for row in rows] for f in fields}
        emulated = [row["device"] for row in rows if row["emulated"]]
        note.text = (
            f"items/s and busy fraction over the last {data['window_s']:g} s; "
            "load counts the items the scheduler has sent to the device's worker. "
            + (f"Emulated (placement tests, not a GPU measurement): {', '.join(emulated)}." if emulated else "")
        )

    update()
    doc.add_periodic_callback(update, 500)
    doc.title = "Dask: dsched devices"
    doc.add_root(column(note, table, sizing_mode="stretch_width"))
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME


def _cell(field, value):
    if value is None:
        return "-"
    if field == "items_per_s":
        return f"{value:,.0f}"
    if field == "busy_fraction":
        return f"{value:.2f}"
    if field == "emulated":
        return "yes" if value else "no"
    return str(value)


def register_page() -> None:
    """List the page in the dashboard; must run before the scheduler starts (Dask builds the dashboard then)."""
    from distributed.dashboard import scheduler as dashboard_scheduler

    dashboard_scheduler.applications.setdefault(PAGE_ROUTE, dsched_doc)


try:  # importing this module (a preload does) lists the page
    register_page()
except ImportError:  # no Bokeh: the JSON route still works
    pass
