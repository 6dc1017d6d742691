"""Chrome trace-event files of dispatch runs, with NEML2's event names.

A trace file is a JSON array of Chrome trace events that Perfetto
(https://ui.perfetto.dev) and ``chrome://tracing`` open. The events are
NEML2's: ``"schedule work"`` and ``"dispatch work"`` (begin/end around the
scheduler calls), ``"completed work"`` (an instant per finished chunk),
``"task"`` (begin/end per chunk, on a track of its device, with the worker's
own start and stop times), ``"run"`` around each run, and ``"trace writer"``
around the whole file. Every event but the writer's carries ``device`` and
``batch size`` where it has them.

Crash safety works as in NEML2: the writer writes ``[`` when it opens and then
one event per line, each followed by a comma, so a run that dies leaves a
partial array that Perfetto and :func:`read_trace` still read. Closing the
writer rewrites the file in time order (chunk events arrive only when their
results do, after events that happened later) and writes the closing ``]``.

Writers are shared by absolute path, as NEML2 keys them: dispatchers tracing
to the same file at the same time interleave their events in one writer. The
first time a process opens a path it starts the file afresh; later opens in
the same process append to it, so a dispatcher run many times (once per time
step, say) leaves one file with every run.

Examples
--------
>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "demo.trace.json")
>>> with trace_writer(path) as w:
...     w.begin("run", "demo")
...     w.end("run", "demo")
>>> [e["name"] for e in read_trace(path) if e["ph"] != "M"]
['trace writer', 'run', 'run', 'trace writer']
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time

from dsched.devices.ownership import emulated_devices
from dsched.observe.hooks import RunObserver

__all__ = [
    "TraceWriter",
    "trace_writer",
    "acquire_writer",
    "release_writer",
    "check_trace_path",
    "read_trace",
    "check_balanced",
    "TraceObserver",
    "SCHEDULE_WORK",
    "DISPATCH_WORK",
    "COMPLETED_WORK",
    "ALL_WORK_COMPLETED",
    "TASK",
    "RUN",
    "TRACE_WRITER",
]

# NEML2's event names (TracingInterface / WorkScheduler / WorkDispatcher, v2.1.6).
SCHEDULE_WORK = "schedule work"
DISPATCH_WORK = "dispatch work"
COMPLETED_WORK = "completed work"
ALL_WORK_COMPLETED = "all work completed"
TASK = "task"
RUN = "run"
TRACE_WRITER = "trace writer"

_PID = 0  # one process in the trace: the dispatching program
_LANE_TID_BASE = 1_000_000  # device lanes sit far above the dispatcher-thread ids
_LANES_PER_DEVICE = 1000


class TraceWriter:
    """One open trace file; use :func:`acquire_writer` or :func:`trace_writer` to get one.

    Timestamps are microseconds since the file's origin (the wall-clock time
    it was first created), so events taken on workers (epoch seconds) and on
    the client line up.
    """

    def __init__(self, path: str, *, append: bool = False):
        self.path = path
        self._lock = threading.Lock()
        self._users = 0
        self._devices = {}  # device string -> slot, for lane thread ids
        self._lanes = {}  # (slot, lane) -> list of (start, stop) epoch intervals
        self._named = set()  # thread ids already given a name
        events = _read_events(path) if append and os.path.exists(path) else None
        if events:
            opening = next((e for e in events if e.get("name") == TRACE_WRITER and e.get("ph") == "B"), None)
            self.origin = (opening or {}).get("args", {}).get("origin", time.time())
            kept = [e for e in events if not (e.get("name") == TRACE_WRITER and e.get("ph") == "E")]
            for e in kept:
                if e.get("ph") == "M" and e.get("name") == "thread_name":
                    self._named.add(e["tid"])
                    self._remember_lane_name(e)
            self._file = open(path, "w", encoding="utf-8")
            self._file.write("[\n")
            for e in kept:
                self._file.write(json.dumps(e, separators=(",", ":")) + ",\n")
        else:
            self.origin = time.time()
            self._file = open(path, "w", encoding="utf-8")
            self._file.write("[\n")
            self._write({"name": "process_name", "ph": "M", "pid": _PID, "tid": 0, "args": {"name": "dsched"}})
            self._write(self._event(TRACE_WRITER, "B", "TraceWriter", self.origin, 0,
                                    {"file": path, "origin": self.origin}))
        self._file.flush()

    # --- writing -------------------------------------------------------------

    def _event(self, name, ph, cat, ts, tid, args=None) -> dict:
        event = {"name": name, "cat": cat, "ph": ph, "ts": round((ts - self.origin) * 1e6, 3), "pid": _PID, "tid": tid}
        if args:
            event["args"] = args
        if ph == "i":
            event["s"] = "t"  # thread-scoped instant, as NEML2 writes them
        return event

    def _write(self, event: dict) -> None:
        # One event per line, comma after each: a crash leaves a readable partial array.
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def emit(self, name, ph, cat, *, ts=None, tid=None, args=None) -> None:
        """Write one event; ``ts`` in epoch seconds (now by default), ``tid`` the calling thread by default."""
        if tid is None:
            tid = thread_tid()
        event = self._event(name, ph, cat, time.time() if ts is None else ts, tid, args)
        with self._lock:
            if self._file is None:
                raise RuntimeError(f"trace file {self.path} is closed")
            if tid not in self._named and tid < _LANE_TID_BASE:
                self._named.add(tid)
                self._write({"name": "thread_name", "ph": "M", "pid": _PID, "tid": tid,
                             "args": {"name": f"dispatcher (thread {threading.current_thread().name})"}})
            self._write(event)
            self._file.flush()

    def begin(self, name, cat, args=None, *, ts=None, tid=None) -> None:
        self.emit(name, "B", cat, ts=ts, tid=tid, args=args)

    def end(self, name, cat, args=None, *, ts=None, tid=None) -> None:
        self.emit(name, "E", cat, ts=ts, tid=tid, args=args)

    def instant(self, name, cat, args=None, *, ts=None, tid=None) -> None:
        self.emit(name, "i", cat, ts=ts, tid=tid, args=args)

    def span(self, name, cat, start, stop, *, track, args=None) -> None:
        """A begin/end pair from ``start`` to ``stop`` (epoch seconds) on a lane of ``track``.

        Overlapping spans of one track (two chunks running at once on a
        device) go on separate lanes, so every lane's begin/end pairs nest.
        """
        with self._lock:
            tid, new = self._lane(track, start, stop)
            if new:
                self._write({"name": "thread_name", "ph": "M", "pid": _PID, "tid": tid,
                             "args": {"name": f"{track} #{(tid - _LANE_TID_BASE) % _LANES_PER_DEVICE}"}})
            self._write(self._event(name, "B", cat, start, tid, args))
            self._write(self._event(name, "E", cat, stop, tid))
            self._file.flush()

    def _lane(self, track, start, stop):
        slot = self._devices.setdefault(track, len(self._devices))
        lane = 0
        while True:
            intervals = self._lanes.setdefault((slot, lane), [])
            # Strictly apart: a span that starts when another stops takes a new lane,
            # so sorting by time can never interleave two spans of one lane.
            if all(stop < a or start > b for a, b in intervals):
                intervals.append((start, stop))
                tid = _LANE_TID_BASE + slot * _LANES_PER_DEVICE + lane
                new = tid not in self._named
                self._named.add(tid)
                return tid, new
            lane += 1

    def _remember_lane_name(self, event):
        tid = event["tid"]
        if tid >= _LANE_TID_BASE:
            track = event["args"]["name"].rsplit(" #", 1)[0]
            self._devices.setdefault(track, (tid - _LANE_TID_BASE) // _LANES_PER_DEVICE)

    # --- closing -------------------------------------------------------------

    def close(self) -> None:
        """End the file: rewrite it in time order and close the array with ``]``."""
        with self._lock:
            if self._file is None:
                return
            self._write(self._event(TRACE_WRITER, "E", "TraceWriter", time.time(), 0))
            self._file.close()
            self._file = None
            events = _read_events(self.path)
            # Metadata first, then every event by time; the sort is stable, so a
            # zero-length span keeps its begin before its end.
            meta = [e for e in events if e.get("ph") == "M"]
            timed = sorted((e for e in events if e.get("ph") != "M"), key=lambda e: e["ts"])
            # The writer's own span encloses everything, even events stamped by a
            # worker whose clock runs slightly ahead.
            first = [e for e in timed if e["name"] == TRACE_WRITER and e["ph"] == "B"]
            last = [e for e in timed if e["name"] == TRACE_WRITER and e["ph"] == "E"]
            body = [e for e in timed if e["name"] != TRACE_WRITER]
            if last and body:
                last[-1]["ts"] = max(last[-1]["ts"], body[-1]["ts"])
            ordered = meta + first + body + last
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write("[\n")
                f.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in ordered))
                f.write("\n]\n")
            os.replace(tmp, self.path)

    @property
    def closed(self) -> bool:
        return self._file is None


def thread_tid() -> int:
    """A small thread id for the calling thread (NEML2 hashes the thread id to 16 bits)."""
    return threading.get_ident() % 65521 + 1


# --- the registry: one writer per absolute path -------------------------------

_registry_lock = threading.Lock()
_writers: dict[str, TraceWriter] = {}
_opened_before: set[str] = set()


def check_trace_path(path, field="trace_file") -> str:
    """``path`` made absolute, or a ValueError naming ``field`` (not a path, or no such folder)."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{field}: expected a file path, got {path!r}")
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"{field}: the folder {parent} of {path} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{field}: {path} is a folder, expected a file path")
    return path


def acquire_writer(path) -> TraceWriter:
    """The shared writer of ``path``, opening it if no one holds it; pair with :func:`release_writer`."""
    path = check_trace_path(path)
    with _registry_lock:
        writer = _writers.get(path)
        if writer is None:
            writer = TraceWriter(path, append=path in _opened_before)
            _opened_before.add(path)
            _writers[path] = writer
        writer._users += 1
        return writer


def release_writer(writer: TraceWriter) -> None:
    """Give back a writer from :func:`acquire_writer`; the last user closes the file."""
    with _registry_lock:
        writer._users -= 1
        if writer._users > 0:
            return
        _writers.pop(writer.path, None)
    writer.close()


@contextlib.contextmanager
def trace_writer(path):
    """``with trace_writer(path) as w:`` — a shared writer, closed (and the file finished) at the end."""
    writer = acquire_writer(path)
    try:
        yield writer
    finally:
        release_writer(writer)


@atexit.register
def _close_all_writers():
    with _registry_lock:
        writers = list(_writers.values())
        _writers.clear()
    for writer in writers:
        try:
            writer.close()
        except Exception:
            pass


# --- reading back -----------------------------------------------------------

def _read_events(path) -> list:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return _parse(text)


def _parse(text: str) -> list:
    body = text.strip()
    if not body.startswith("["):
        raise ValueError("not a trace-event array: it does not start with '['")
    if not body.endswith("]"):
        # A run that died: every complete line is an event; a torn last line is dropped.
        events = []
        for line in body[1:].splitlines():
            line = line.strip().rstrip(",")
            if not line:
                continue
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break
        return events
    return json.loads(body)


def read_trace(path) -> list:
    """The events of a trace file, finished or left unterminated by a crash."""
    return _read_events(path)


def check_balanced(events) -> None:
    """Raise ``ValueError`` unless every begin has its end on the same track, properly nested and in time order.

    The events are taken in file order, as a viewer replays them.
    """
    stacks: dict = {}
    last_ts: dict = {}
    for i, e in enumerate(events):
        if e.get("ph") == "M":
            continue
        key = (e["pid"], e["tid"])
        if e["ts"] < last_ts.get(key, float("-inf")):
            raise ValueError(f"event {i} ({e['name']!r}) goes back in time on track {key}")
        last_ts[key] = e["ts"]
        if e["ph"] == "B":
            stacks.setdefault(key, []).append(e["name"])
        elif e["ph"] == "E":
            stack = stacks.get(key)
            if not stack:
                raise ValueError(f"event {i}: end of {e['name']!r} without a begin on track {key}")
            opened = stack.pop()
            if opened != e["name"]:
                raise ValueError(f"event {i}: end of {e['name']!r} closes {opened!r} on track {key}")
    open_spans = {k: v for k, v in stacks.items() if v}
    if open_spans:
        raise ValueError(f"spans never ended: {open_spans}")


# --- what a dispatcher writes -----------------------------------------------

class TraceObserver(RunObserver):
    """The events of one :class:`~dsched.dispatch.WorkDispatcher` run, in NEML2's vocabulary.

    A run observer (:mod:`dsched.observe.hooks`): the dispatcher adds one for
    each run when ``trace_file`` is set; an untraced run has none and pays nothing.
    """

    def __init__(self, path):
        self.path = path
        self.writer = None
        self.tid = thread_tid()
        self.emulated = {}
        self.scheduler = None

    def run_started(self, run):
        self.writer = acquire_writer(self.path)
        self.scheduler = run.scheduler
        if run.client is not None:  # which devices are emulated, to label their tracks
            self.emulated = emulated_devices(run.client)
        self.writer.begin(RUN, "WorkDispatcher", tid=self.tid)

    def work_scheduled(self, choice, start, stop):
        """A "schedule work" span around ``scheduler.schedule_work()``."""
        args = None if choice is None else {"device": str(choice[0]), "batch size": int(choice[1])}
        self.writer.begin(SCHEDULE_WORK, "WorkScheduler", ts=start, tid=self.tid)
        self.writer.end(SCHEDULE_WORK, "WorkScheduler", args, ts=stop, tid=self.tid)

    def work_dispatched(self, device, n, start, stop):
        """A "dispatch work" span around ``scheduler.dispatched_work(device, n)``."""
        self.writer.begin(DISPATCH_WORK, "WorkScheduler", ts=start, tid=self.tid)
        self.writer.end(DISPATCH_WORK, "WorkScheduler", {"device": str(device), "batch size": int(n)}, ts=stop,
                        tid=self.tid)

    def chunk_completed(self, record):
        """A "completed work" instant."""
        self.writer.instant(COMPLETED_WORK, "WorkScheduler", {"device": str(record.device), "batch size": int(record.size)},
                            tid=self.tid)

    def run_finished(self, report):
        """Write each chunk's ``task`` span, the run's end, and give the writer back."""
        if self.writer is None:  # the run failed before it started
            return
        try:
            for record in report.records:
                if record.stop <= 0:  # never ran (failed before starting, or cancelled)
                    continue
                self._task_span(record)
            scheduler = self.scheduler
            if scheduler is not None and report.mode == "async" and scheduler.all_work_completed():
                self.writer.instant(ALL_WORK_COMPLETED, "WorkScheduler", tid=self.tid)
            self.writer.end(RUN, "WorkDispatcher", {"chunks": len(report.records), "mode": report.mode}, tid=self.tid)
        finally:
            writer, self.writer = self.writer, None
            release_writer(writer)

    def _task_span(self, record):
        device = str(record.device)
        track = f"{device} (emulated)" if self.emulated.get(device) else device
        args = {"device": device, "batch size": int(record.size), "chunk": record.index}
        if record.worker:
            args["worker"] = record.worker
        if record.error is not None:
            args["error"] = f"{type(record.error).__name__}: {record.error}"
        self.writer.span(TASK, "WorkDispatcher", record.start, record.stop, track=track, args=args)
