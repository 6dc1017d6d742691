"""The fast lane, the client's side: a feed's chunks go from the dispatching thread straight into a socket.

A feed (:mod:`dsched.dispatch.feeds`) on a worker of this host is reached
without Dask's comms: the client connects once to the worker's lane server
(:mod:`dsched.worker.lane`) and names the feed; from then on the dispatching
thread writes each chunk's descriptor into that connection, and the run's
loop waits on the connections themselves, so the reply is read on the thread
that accounts for it. No event loop, no scheduler, no thread hand-off on the
path of a chunk. A parked feed keeps its lane for the client's next run.

Where the lane cannot be opened (another host, another mount namespace, no
private directory) the feed's chunks travel over Dask's comms as before.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import struct
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client as connect_to

from dsched.checks import setting
from dsched.dispatch.completion import ask_worker
from dsched.errors import unsendable_fn
from dsched.observe.dashboard.client import tell_page
from dsched.worker import lane as wire
from dsched.worker.chunk import PROGRAMS_KEPT, ProgramRef
from dsched.worker.feed import LANE_OP

__all__ = ["Lane", "FastLanes", "open_lane", "lanes_enabled", "program_to_send", "hold_program", "WINDOW"]

_ASK_WAIT = 5.0  # seconds a worker has to say where its lane listens
WINDOW = 64  # chunks a lane holds unanswered at most (their descriptors and replies fit its socket's buffers)


def program_to_send(feed, program):
    """What a rearm of ``feed`` carries for ``program``: nothing if its worker runs that program now, a
    :class:`~dsched.worker.chunk.ProgramRef` if its inbox keeps it, else the program itself. A solver whose calls
    take turns between models (a stress and a tangent) so sends each of them once: unpickling a model again on
    every turn costs the worker milliseconds, and the model's first call on the new copy more."""
    held, key = feed.programs, program.dispatcher_id
    carried = None if held and next(reversed(held)) == key else ProgramRef(key) if key in held else program
    hold_program(feed, key)
    return carried


def hold_program(feed, key):
    """Note that ``feed``'s worker runs the program of dispatcher ``key`` now, and keeps it, as its inbox does
    (the most recently used :data:`~dsched.worker.chunk.PROGRAMS_KEPT`)."""
    held = feed.programs
    held.pop(key, None)
    held[key] = None
    while len(held) > PROGRAMS_KEPT:
        held.popitem(last=False)


def lanes_enabled() -> bool:
    """Dask config ``dsched.fast-lane`` (default true): feeds of this host take chunks over their fast lane."""
    return bool(setting("fast-lane", True))


class Lane:
    """The client's end of one feed's fast lane: the connection, and the chunks sent and not yet answered.

    Used only by the run's dispatching thread (and the event loop only after the
    feed was given up).

    A send never waits on the worker while the worker waits on it: the window
    keeps both directions small, but a reply carrying a value (a first chunk's
    result, a torch output) can be large, and a worker blocked writing it reads
    nothing meanwhile. So a message the socket cannot take at once is written as
    room comes, and the replies that arrive meanwhile are read and kept
    (:attr:`pending`), for :meth:`receive` to return first; the run's loops look
    at :attr:`pending` before they wait on the socket.
    """

    def __init__(self, connection):
        self.connection = connection
        self.waiting = {}  # chunk index -> (ticket, work, slot, about): sent, not yet answered
        self.backlog = collections.deque()  # (ticket, index, work, slot, about) waiting for room in the window
        self.rearming = False  # its first message since it was taken from the parked ones is not answered yet
        self.pending = collections.deque()  # replies read while a send waited for room: received first
        # The same socket, written with MSG_DONTWAIT (the connection itself blocks, as its reads must).
        self._socket = socket.socket(fileno=os.dup(connection.fileno()))

    def send(self, message) -> bool:
        """Write ``message`` (bytes: one pickled already); ``False`` if the feed's end is closed (it ended, or its
        worker is gone)."""
        try:
            data = message if type(message) is bytes else wire.dumps(message)
        except Exception as err:  # noqa: BLE001  what the pickler refused: a run's program (fn) for a parked feed
            raise unsendable_fn(err) from None
        try:
            for part in _framed(data):  # multiprocessing.connection's framing: the worker reads with recv_bytes
                self._write(memoryview(part))
            return True
        except (OSError, ValueError, EOFError):  # ValueError: closed on this side; EOFError: while reading a reply
            return False

    def _write(self, view):
        while view:
            try:
                view = view[self._socket.send(view, socket.MSG_DONTWAIT):]
            except BlockingIOError:  # the socket is full: wait for room, reading what the worker writes meanwhile
                events = _wait_for(self._socket)
                if events & select.POLLIN:
                    self.pending.append(self.connection.recv_bytes())
                elif events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    raise OSError("the feed's end of the lane closed")

    def receive(self):
        """The next message from the feed; raises ``EOFError`` or ``OSError`` once it has ended."""
        if self.pending:
            return wire.loads(self.pending.popleft())
        return wire.loads(self.connection.recv_bytes())

    def close(self):
        for end in (self.connection, self._socket):
            try:
                end.close()
            except OSError:
                pass


def _framed(data) -> tuple:
    """``data`` with ``multiprocessing.connection``'s header (a 4-byte length, or -1 and an 8-byte one)."""
    if len(data) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(data)), data
    if len(data) > 16384:  # large: written after its header rather than copied behind it
        return struct.pack("!i", len(data)), data
    return (struct.pack("!i", len(data)) + data,)


def _wait_for(sock) -> int:
    """The events of ``sock`` once it can be written or read (or has ended)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLOUT)
    return max((events for _, events in poller.poll()), default=0)


def open_lane(client, address, feed_id) -> Lane | None:
    """A lane to ``feed_id`` on the worker at ``address``, or ``None`` where none can be opened (the worker
    cannot listen, or its socket cannot be reached from here)."""
    info = _lane_info(client, address)
    if info is None:
        return None
    try:
        connection = connect_to(info["address"], family="AF_UNIX", authkey=info["authkey"])
        connection.send_bytes(feed_id.encode())
    except (OSError, EOFError, ValueError, AuthenticationError) as err:  # not reachable from here: no lane
        if isinstance(err, (FileNotFoundError, ConnectionRefusedError, AuthenticationError)):
            _forget(client, address)  # its process may have been replaced at the same address: ask again next time
        return None
    return Lane(connection)


def _lane_info(client, address):
    """``{"address", "authkey"}`` of the worker's lane server, asked once per client and worker."""
    known = client.__dict__.setdefault("_dsched_lanes", {})
    if address not in known:
        try:
            known[address] = client.sync(ask_worker, client, address, LANE_OP, _ASK_WAIT)
        except Exception:  # noqa: BLE001  a worker without the handler, or gone: no lane to it
            return None
    return known[address]


def _forget(client, address):
    client.__dict__.setdefault("_dsched_lanes", {}).pop(address, None)


class FastLanes:
    """The fast-lane side of a run's feeds (:class:`~dsched.dispatch.feeds.Feeds` takes it in): chunks written
    and replies read on the dispatching thread.

    It relies on the feeds' ``_feeds`` (``{Device: [feed]}``), ``program``, and
    ``_answered``, ``_outcome``, ``_lost`` and ``_renew``.
    """

    def _send_lane(self, feed, items):
        """Send ``items`` (``(ticket, index, work, slot, about)``) on ``feed``'s lane, as the window allows."""
        feed.lane.backlog.extend(items)
        self._pump_lane(feed)

    def _pump_lane(self, feed):
        """Write what waits for ``feed``'s lane into it, in one message, up to :data:`WINDOW` chunks unanswered.

        The window bounds what the lane holds both ways: the client writes only while it is not reading, and
        the worker's replies wait in the socket meanwhile, so neither side may fill it and block the other.
        """
        lane = feed.lane
        room = WINDOW - len(lane.waiting)
        if room <= 0 or not lane.backlog:
            return
        items = [lane.backlog.popleft() for _ in range(min(room, len(lane.backlog)))]
        rearm = None
        if feed.rearm:  # taken from the parked ones: the first message carries the run's program (or names it)
            rearm, feed.rearm, lane.rearming = (program_to_send(feed, self.program), feed.epoch), False, True
        for ticket, index, work, slot, about in items:
            lane.waiting[index] = (ticket, work, slot, about)
            if about is not None:  # the dashboard hears of it from here, in batches (flush_events)
                self._chunk_events.append(("start", *about[:4], feed.address, about[4], None, None))
        # The worker logs no event per chunk: ``about`` stays here.
        if not lane.send((wire.CHUNKS, rearm, [(index, work, slot) for _, index, work, slot, _ in items])):
            self._lane_broken(feed)

    def flush_events(self):
        """Queue for the page the events of this run's lane chunks heard since the last flush (each tick of the
        run, and at its end): sent off the run's path (:func:`~dsched.observe.dashboard.client.tell_page`)."""
        events, self._chunk_events = self._chunk_events, []
        if events:
            tell_page(self.client, events)

    def on_lane(self, device) -> bool:
        """Whether ``device``'s feeds (started) have a lane: its chunks go out one by one as they are scheduled."""
        return any(f.lane is not None and not f.lost for f in self._feeds.get(device, ()))

    def lanes_only(self) -> bool:
        """Whether every chunk of the run went over a fast lane, and every feed of the run still has one."""
        feeds = [f for fs in self._feeds.values() for f in fs]
        return bool(feeds) and not self._over_comms and all(f.lane is not None and not f.lost for f in feeds)

    def waiting_lanes(self) -> dict:
        """``{connection: feed}`` of the lanes with chunks not yet answered: the run's loop waits on them."""
        return {f.lane.connection: f for fs in self._feeds.values() for f in fs
                if f.lane is not None and f.lane.waiting}

    def receive(self, feed) -> list:
        """Read one message from ``feed``'s lane (readable): the :class:`FeedOutcome` it carries, if any. A lane
        that ended puts its chunks' outcomes in the run's mailbox (:meth:`_lane_broken`)."""
        lane = feed.lane
        try:
            message = lane.receive()
        except (EOFError, OSError):
            message = (wire.ENDED,)
        if message[0] != wire.DONE:
            self._lane_broken(feed)
            return []
        _, index, ok, value, start, stop = message
        lane.rearming = False
        entry = lane.waiting.pop(index, None)
        if entry is None:
            return []
        about = entry[3]
        if about is not None:
            self._chunk_events.append(("done" if ok else "failed", *about[:4], feed.address, about[4], start, stop))
        outcome = self._answered(feed, self._outcome(feed, entry[0], index, ok, value, start, stop), put=False)
        if lane.backlog:
            self._pump_lane(feed)
        return [outcome]

    def lane_lost(self, feed):
        """The event loop gave ``feed`` up (its worker left): its lane's chunks run again elsewhere."""
        if feed.lane is not None:
            self._lane_broken(feed)

    def _lane_broken(self, feed):
        """``feed``'s lane ended (on the dispatching thread). A parked feed taken by this run that ended before
        its program reached it: a new feed on its worker takes its chunks. Otherwise the feed is lost: its
        chunks not answered run again as tasks."""
        lane, feed.lane = feed.lane, None
        if lane is None:
            return
        lane.close()
        waiting = list(lane.waiting.items()) + [(index, (ticket, work, slot, about))
                                                for ticket, index, work, slot, about in lane.backlog]
        if lane.rearming and not feed.lost:
            self._renew(feed, [(feed, ticket, index, work, slot, about)
                               for index, (ticket, work, slot, about) in waiting], on_lane=True)
            return
        if not feed.lost:
            feed.lost, feed.error = True, ConnectionError(f"feed {feed.id} on {feed.address} ended during the run")
            feed.future.release()
        for index, (ticket, _, _, about) in waiting:
            if about is not None:  # not run here: it runs again elsewhere, and ends there
                self._chunk_events.append(("failed", *about[:4], feed.address, about[4], None, None))
            self._answered(feed, self._lost(feed, ticket, index))
