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

from multiprocessing.connection import Client as connect_to

import dask

from dsched.dispatch.completion import ask_worker
from dsched.worker import lane as wire
from dsched.worker.feed import LANE_OP

__all__ = ["Lane", "open_lane", "lanes_enabled"]

_ASK_WAIT = 5.0  # seconds a worker has to say where its lane listens


def lanes_enabled() -> bool:
    """Dask config ``dsched.fast-lane`` (default true): feeds of this host take chunks over their fast lane."""
    return bool(dask.config.get("dsched.fast-lane", True))


class Lane:
    """The client's end of one feed's fast lane: the connection, and the chunks sent and not yet answered.

    Used only by the run's dispatching thread (and the event loop only after the
    feed was given up).
    """

    def __init__(self, connection):
        self.connection = connection
        self.waiting = {}  # chunk index -> (ticket, index): sent, not yet answered
        self.rearming = False  # its first message since it was taken from the parked ones is not answered yet

    def send(self, message) -> bool:
        """Write ``message``; ``False`` if the feed's end is closed (it ended, or its worker is gone)."""
        try:
            self.connection.send_bytes(wire.dumps(message))
            return True
        except (OSError, ValueError):  # ValueError: closed on this side
            return False

    def receive(self):
        """The next message from the feed; raises ``EOFError`` or ``OSError`` once it has ended."""
        return wire.loads(self.connection.recv_bytes())

    def close(self):
        try:
            self.connection.close()
        except OSError:
            pass


def open_lane(client, address, feed_id) -> Lane | None:
    """A lane to ``feed_id`` on the worker at ``address``, or ``None`` where none can be opened (the worker
    cannot listen, or its socket cannot be reached from here)."""
    info = _lane_info(client, address)
    if info is None:
        return None
    try:
        connection = connect_to(info["address"], family="AF_UNIX", authkey=info["authkey"])
        connection.send_bytes(feed_id.encode())
    except (OSError, EOFError, ValueError) as err:  # not reachable from here (another file system): no lane
        if not isinstance(err, (FileNotFoundError, ConnectionRefusedError)):
            return None
        _forget(client, address)  # its process may have been replaced at the same address
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
