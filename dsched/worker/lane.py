"""The fast lane, the worker's side: a private Unix socket per worker process, one connection per feed.

A chunk sent over Dask's comms crosses four threads and two event loops on its
way out and back (the dispatching thread, the client's loop, the worker's loop,
the feed's thread, and back), each hop 0.1-0.5 ms on a busy machine. A feed
whose client shares its host needs none of them: the client connects to this
worker's :class:`LaneServer` once per feed, and from then on the dispatching
thread writes each chunk's descriptor straight into the socket that the feed's
own thread reads, and reads the reply straight back (``docs/dataplane.md``).

Privacy: the socket lives in a directory only this user can enter
(:func:`lane_directory`, mode 0700), and every connection passes the HMAC
handshake of :mod:`multiprocessing.connection` with a key made per worker
process, which the client obtains over Dask's own (authenticated, TLS where
configured) comms. Nothing listens on a network interface.

Messages are pickled tuples (:func:`dumps`, :func:`loads`):

- client to feed: ``("chunks", rearm, [(index, work, slot), ...])``, ``("stop",)``
  (parks come over Dask's comms, after ``dsched.feed-park-delay``);
- client to feed, replays (:mod:`dsched.worker.kept`): ``("keep", rearm, plan id, [(index, work, slot), ...])``
  runs the chunks and keeps them; ``("again", rearm, plan id, output targets pickled)`` runs them again, writing
  into that call's outputs;
- feed to client: ``("done", index, ok, value, start, stop)`` per chunk,
  ``("ended",)`` when a parked feed had ended before a run's program reached it, or
  ``("forgotten", plan id)`` for an ``again`` of a plan the feed let go of (the client sends ``keep``).
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import stat
import tempfile
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener

import cloudpickle

from dsched.dataplane.segments import _unlinked

__all__ = ["Bell", "LaneServer", "lane_server", "lane_directory", "dumps", "loads", "look", "sweep_stale_lanes"]

CHUNKS, STOP, DONE, ENDED = "chunks", "stop", "done", "ended"
# A replayed plan's chunks, kept and run; a kept plan run again (dsched.worker.kept). Either may end with where
# inputs lie that the kept chunks read elsewhere (dsched.worker.kept).
KEEP, AGAIN = "keep", "again"
FORGOTTEN = "forgotten"  # the answer to an "again" of a plan the feed no longer keeps
_RETRY_SECONDS = 0.05  # the accept thread's pause after a failed accept (not a handshake refused)
_SOCKET_PREFIX = "lane-"


def dumps(message) -> bytes:
    """``message`` as bytes, by Dask's rule for a task: plain pickle where it is enough (fast), cloudpickle where
    the message holds what only this process could import (a function made in ``__main__``, a lambda, a module
    registered to pickle by value)."""
    try:
        data = pickle.dumps(message, protocol=5)
        if b"__main__" not in data and not cloudpickle.list_registry_pickle_by_value():
            return data
    except Exception:  # noqa: BLE001  anything plain pickle refuses: cloudpickle's turn
        pass
    return cloudpickle.dumps(message, protocol=5)


def loads(data: bytes):
    return pickle.loads(data)


def look(poller, seconds: float) -> list:
    """``poller.poll()``'s ready descriptors, looked for without sleeping for up to ``seconds``; ``[]`` if none came.

    Both ends of a lane look before they sleep in ``poll`` (``dsched.lane-spin`` for a run waiting for its
    replies, ``dsched.feed-spin`` for a feed waiting for a short call's next): a message due within a few hundred
    microseconds then finds its reader awake, where waking a sleeping thread costs about as much again on a
    virtual machine. ``sched_yield`` between looks lets another thread of this core run.
    """
    deadline = time.perf_counter() + seconds
    while True:
        ready = poller.poll(0)
        if ready or time.perf_counter() >= deadline:
            return ready
        os.sched_yield()


class Bell:
    """Wakes a thread that waits on sockets (``multiprocessing.connection.wait``): any thread rings it, the waiter
    waits on :attr:`waitable` beside its other sockets and clears it once woken. A feed's inbox has one
    (:mod:`dsched.worker.feed`), and so has a run's mailbox on the client (:mod:`dsched.dispatch.completion`)."""

    def __init__(self):
        self.waitable, self._ringer = socket.socketpair()
        self.waitable.setblocking(False)
        self._ringer.setblocking(False)

    def ring(self):
        try:
            self._ringer.send(b"!")
        except OSError:  # rung already (a full buffer), or closed: either way the waiter wakes
            pass

    def clear(self):
        try:
            while self.waitable.recv(4096):
                pass
        except OSError:  # nothing more to read, or closed meanwhile
            pass

    def close(self):
        self._ringer.close()
        self.waitable.close()


def lane_directory() -> str:
    """This user's directory for lane sockets, ``<tmp>/dsched-<uid>``, made with mode 0700; refused if another
    user owns it or others may enter it (anyone who can enter could connect)."""
    path = os.path.join(tempfile.gettempdir(), f"dsched-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user: no fast lane")
    return path


class LaneServer:
    """One worker process's listener: each accepted connection is handed to the feed it names.

    The client opens it with the HMAC handshake, then sends the feed's id; the
    accept thread attaches the connection to that feed's inbox
    (:func:`dsched.worker.feed.attach_lane`), whose thread reads and answers it.
    """

    def __init__(self, attach):
        sweep_stale_lanes()  # sockets of worker processes killed before they could remove theirs
        self.authkey = os.urandom(32)
        name = f"{_SOCKET_PREFIX}{os.getpid()}-{os.urandom(6).hex()}.sock"
        self.address = os.path.join(lane_directory(), name)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        os.chmod(self.address, 0o600)
        self._attach = attach
        self._closed = False
        threading.Thread(target=self._accept, name="dsched-lanes", daemon=True).start()

    def _accept(self):
        while not self._closed:
            try:
                connection = self._listener.accept()  # the HMAC handshake: a stranger is refused here
                feed = connection.recv_bytes().decode()
            except AuthenticationError:
                continue
            except Exception:  # noqa: BLE001  the listener closed, or the process is out of descriptors: wait
                time.sleep(_RETRY_SECONDS)  # (never a busy loop) and look again
                continue
            self._attach(feed, connection)

    def close(self):
        """Stop listening and remove the socket file (the process is ending)."""
        if not self._closed:
            self._closed = True
            try:
                self._listener.close()  # unlinks the socket file
            except OSError:
                pass


_server: LaneServer | None = None
_server_lock = threading.Lock()


def lane_server(attach) -> LaneServer | None:
    """This process's :class:`LaneServer`, started on first use; ``None`` where no private socket can be made
    (the client then sends chunks over Dask's comms)."""
    global _server
    with _server_lock:
        if _server is None:
            try:
                _server = LaneServer(attach)
            except OSError:
                return None
            atexit.register(_server.close)
        return _server


def sweep_stale_lanes() -> list:
    """Remove this user's lane sockets whose worker process is gone (killed before it could remove them)."""
    try:
        directory = lane_directory()
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[len(_SOCKET_PREFIX):].partition("-")[0]
        if not name.startswith(_SOCKET_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            if _unlinked(os.path.join(directory, name)):
                removed.append(name)
        except PermissionError:
            pass
    return removed
