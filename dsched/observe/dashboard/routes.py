"""Where the dsched page is served, and the scheduler's HTTP routes that serve its data without Bokeh.

Served at
---------
- ``/individual-dsched``: the page (heading, progress, load against capacity,
  items/s over time, a timeline of chunks per device, the performance model's
  predicted against measured chunk times, tables of devices, hosts and runs),
  listed in the dashboard's "More" menu;
- ``/individual-dsched-progress``, ``-load``, ``-throughput``, ``-timeline``,
  ``-predictions``: each plot alone, for the "More" menu and JupyterLab's dask
  extension;
- ``/dsched/status.json``: the same data as JSON; ``/dsched/status``: a plain
  HTML table polling it, for schedulers started without the Bokeh pages.

This module adds the last two to a scheduler's HTTP server (:func:`add_routes`)
and builds the page's address (:func:`scheduler_page_link`); the Bokeh pages
are :mod:`dsched.observe.dashboard.plots`, the data they all show is
:class:`~dsched.observe.dashboard.plugin.DashboardPlugin`'s.
"""

from __future__ import annotations

import json

from dsched.observe.report import worker_host

__all__ = ["JSON_ROUTE", "PAGE_ROUTE", "HTML_ROUTE", "PLOT_ROUTES", "COLUMNS", "add_routes", "scheduler_page_link"]

JSON_ROUTE = "/dsched/status.json"
PAGE_ROUTE = "/individual-dsched"
HTML_ROUTE = "/dsched/status"  # a plain page polling the JSON, for schedulers started without the Bokeh page
# Each plot alone (Dask lists every /individual-* route in its "More" menu and in individual-plots.json).
PLOT_ROUTES = {
    "progress": PAGE_ROUTE + "-progress",
    "load": PAGE_ROUTE + "-load",
    "throughput": PAGE_ROUTE + "-throughput",
    "timeline": PAGE_ROUTE + "-timeline",
    "predictions": PAGE_ROUTE + "-predictions",
}

# The device table's columns: (JSON field, title).
COLUMNS = [
    ("device", "device"),
    ("host", "host"),
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


def scheduler_page_link(dask_scheduler=None) -> str | None:
    """The address of the dsched page of a scheduler (in its process), or ``None`` without a dashboard.

    Built from where the scheduler's HTTP server really listens (a loopback
    dashboard gives a loopback link); a server on every interface gets the
    host of the scheduler's address.
    """
    port = dask_scheduler.identity().get("services", {}).get("dashboard")
    server = getattr(dask_scheduler, "http_server", None)
    if port is None or server is None:
        return None
    hosts = [sock.getsockname()[0] for sock in getattr(server, "_sockets", {}).values()
             if sock.getsockname()[1] == port]
    host = next((h for h in sorted(hosts) if h not in ("0.0.0.0", "::")), None)
    if host is None:
        address = str(dask_scheduler.address)
        host = "127.0.0.1" if address.startswith("inproc://") or "://" not in address else worker_host(address)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}{PAGE_ROUTE}"


# --- HTTP: the JSON route and the plain page ---------------------------------

def _json_handler(plugin_of):
    from distributed.http.utils import RequestHandler

    class StatusJSON(RequestHandler):
        def get(self):
            plugin = plugin_of(self.server)
            self.set_header("Content-Type", "application/json")
            self.set_header("Cache-Control", "no-store")
            self.write(json.dumps(plugin.snapshot()))

    return StatusJSON


_HTML_PAGE = """<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>dsched devices</title>
<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child,th{text-align:left}</style></head>
<body><h2>dsched devices</h2><p id="run"></p><p id="note"></p>
<table id="devices"><thead><tr>%(head)s</tr></thead><tbody></tbody></table>
<script>
const fields = %(fields)s;
const fmt = (v, d) => v.toLocaleString("en", {maximumFractionDigits: d});
function cell(f, v) {
  if (v === null || v === undefined) return "-";
  if (f === "busy_fraction") return v.toFixed(2);
  if (f === "emulated") return v ? "yes" : "no";
  if (typeof v === "number") return fmt(v, 0);
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
    const run = data.run;
    document.getElementById("run").textContent = run ? ("run " + run.number + " (" + run.name + "): " +
      fmt(run.items_done, 0) + (run.total ? " of " + fmt(run.total, 0) + " items, " + fmt(100 * run.fraction, 1) + " %%"
      : " items") + ", " + fmt(run.items_per_s, 0) + " items/s") : "no run yet";
    document.getElementById("note").textContent =
      "items/s and busy fraction over the last " + data.window_s + " s";
  } catch (e) { document.getElementById("note").textContent = "no data: " + e; }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""


def _html_handler(plugin_of):
    from distributed.http.utils import RequestHandler

    class StatusPage(RequestHandler):
        def get(self):
            plugin_of(self.server)
            head = "".join(f"<th>{title}</th>" for _, title in COLUMNS)
            fields = json.dumps([field for field, _ in COLUMNS])
            self.write(_HTML_PAGE % {"head": head, "fields": fields, "json": JSON_ROUTE})

    return StatusPage


def add_routes(scheduler, plugin_of) -> bool:
    """Serve :data:`JSON_ROUTE` and :data:`HTML_ROUTE` from ``scheduler``'s HTTP server; False if it has none.

    Each request asks ``plugin_of(scheduler)`` for the plugin whose data it
    shows: :func:`~dsched.observe.dashboard.plugin.install`, which adds the
    plugin again if it was removed (passed in, as the plugin adds these
    routes when it starts).
    """
    app = getattr(scheduler, "http_application", None)
    if app is None:
        return False
    if not getattr(app, "_dsched_routes", False):
        app.add_handlers(r".*", [
            (JSON_ROUTE, _json_handler(plugin_of), {"dask_server": scheduler}),
            (HTML_ROUTE, _html_handler(plugin_of), {"dask_server": scheduler}),
        ])
        app._dsched_routes = True
    return True

