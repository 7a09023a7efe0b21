"""The executor's stats endpoint (``Config.stats_socket``): a Unix socket that answers each
connection with one JSON line, the executor's ``stats()`` and its workers' CPU time, for
``python -m mpx top`` (whose client is ``fetch`` below).

The socket is bound when the executor starts, before any worker does (``StatsServer()``:
a path that cannot be served fails the start at once), and answered from when the queues
are attached (``serve()``); a client that connects in between waits in the backlog.

Rules: one thread (``mpx-stats``) accepts and answers, one connection at a time, each within
``_ANSWER_S``; it takes the call table's lock only for the snapshot's outcome counts, never
runs user code, and waits in ``accept`` with a timeout (a poll of one descriptor: nothing
here limits the descriptors the process may hold), so ``stop()`` ends it within
``_POLL_S``. It is an observer: what the snapshot raises is logged once per kind and answered
as ``{"error": ...}``, and no error of its own ends the thread or reaches a call. The socket
is made owner-only (0600) and carries no pickle. mpx removes only what it created: a stale
socket file of this user (its executor killed) is replaced at the next start, anything else
at the path is refused; ``stop()`` unlinks the path only while it is still the socket bound
here.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from mpx import _addresses
from mpx._driver.stats import Stats

logger = logging.getLogger("mpx")

_POLL_S = 0.2    # how often the thread looks at stop()
_ANSWER_S = 1.0  # a client that does not take its answer within this is dropped
# pending connections the kernel holds while one is answered: a burst of `mpx top`s (a
# Unix socket refuses a non-blocking connect, and blocks a blocking one, past it)
_BACKLOG = max(128, socket.SOMAXCONN)
FETCH_S = 2.0              # fetch(): connect and whole answer, one deadline
MAX_ANSWER = 16 << 20      # fetch(): an answer longer than this is not a stats snapshot
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_WHAT = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
         (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` (None if it is not readable here)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime


def to_json(stats: Stats, is_local: Callable[[int], bool], own_pid: int) -> dict[str, Any]:
    """``stats`` as plain JSON values, with the CPU seconds of the driver and of each rank
    that ``is_local`` (a remote rank's pid names a process of another machine: None)."""
    out = dataclasses.asdict(dataclasses.replace(stats, calls={}))
    out["calls"] = {m: dict(o) for m, o in stats.calls.items()}
    for rank in out["ranks"]:
        rank["cpu_s"] = cpu_seconds(rank["pid"]) if is_local(rank["rank"]) else None
    out["driver"] = {"pid": own_pid, "cpu_s": cpu_seconds(own_pid)}
    out["time"] = time.time()
    return out


class StatsServer:
    """Binds the Unix socket ``path`` (OSError or ValueError naming ``Config.stats_socket``
    when it cannot); ``serve()`` then answers each connection with ``snapshot()`` (a
    JSON-ready dict) as one line, in a thread of its own, until ``stop()``."""

    def __init__(self, path: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._snapshot = snapshot
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._logged: set[str] = set()  # the kinds of failure already logged
        self._bound: tuple[int, int] | None = None  # (st_dev, st_ino) of the file bound
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._bind(path)
            self._sock.listen(_BACKLOG)
            self._sock.settimeout(_POLL_S)
        except BaseException:
            self._close()
            raise

    def _bind(self, path: str) -> None:
        # (as Config checks it; here too for a server made from any path: with a NUL byte,
        # the kernel would bind the path up to it, another file)
        why = _addresses.nul_byte(path) or _addresses.unix_socket_path(path)
        if why:
            raise ValueError(f"Config.stats_socket {path!r} {why}")
        try:
            self._sock.bind(path)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise _bind_error(path, e) from None
            self._replace_stale(path)
            try:
                self._sock.bind(path)
            except OSError as e2:
                raise _bind_error(path, e2) from None
        st = os.lstat(path)
        self._bound = (st.st_dev, st.st_ino)
        os.chmod(path, 0o600)

    @staticmethod
    def _replace_stale(path: str) -> None:
        """Unlink ``path`` if it is a socket file of this user that nobody answers at (what
        a killed executor leaves); raise if it is anything else."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return  # gone meanwhile: bind again
        if not stat.S_ISSOCK(st.st_mode):
            what = next((w for test, w in _WHAT if test(st.st_mode)), "not a socket")
            raise FileExistsError(
                errno.EEXIST, f"Config.stats_socket {path!r} is {what}: mpx serves its stats "
                "only at a new path or at a stale socket of its own, and removes nothing "
                "else; choose another path, or remove it yourself")
        if st.st_uid != os.getuid():
            raise FileExistsError(
                errno.EEXIST, f"Config.stats_socket {path!r} is a socket of user id "
                f"{st.st_uid}, not this user's: choose another path")
        if _answers(path):
            raise OSError(errno.EADDRINUSE, f"Config.stats_socket {path!r} is in use (another "
                          "executor serves it?): choose another path, or stop that executor")
        os.unlink(path)  # a stale one: its executor is gone

    def serve(self) -> None:
        """Start answering (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="mpx-stats",
                                            daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                # (EMFILE, ENFILE, ENOBUFS: the process is short of something; try later)
                self._log_once(f"accept:{e.errno}", "mpx stats socket: accept failed (%s); "
                               "trying again", e)
                self._stop.wait(_POLL_S)
                continue
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            line = json.dumps(self._snapshot()).encode() + b"\n"
        except Exception as e:  # the snapshot's own failure: say so, to the log and client
            self._log_once(f"snapshot:{type(e).__qualname__}", "mpx stats socket: the "
                           "snapshot raised (logged once per kind; the socket goes on "
                           "serving)", exc_info=True)
            line = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n"
        try:
            conn.settimeout(_ANSWER_S)  # (sendall: one deadline for the whole answer)
            conn.sendall(line)
        except OSError as e:  # a client gone, or one that does not read
            logger.debug("mpx stats socket: no answer sent (%s)", e)

    def _log_once(self, kind: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        if kind in self._logged:
            logger.debug(msg, *args, exc_info=exc_info)
        else:
            self._logged.add(kind)
            logger.warning(msg, *args, exc_info=exc_info)

    def stop(self) -> None:
        """End the thread, close the socket and remove its file (if it is still the socket
        bound here: a path replaced since is left alone)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(_POLL_S + _ANSWER_S + 1.0)
        self._close()

    def _close(self) -> None:
        self._sock.close()
        if self._bound is None:
            return
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._bound and stat.S_ISSOCK(st.st_mode):
                os.unlink(self.path)
        except FileNotFoundError:
            pass


def _bind_error(path: str, e: OSError) -> OSError:
    """``e`` of bind() as an error that names Config.stats_socket and the path."""
    return OSError(e.errno, f"Config.stats_socket {path!r} cannot be bound: "
                   f"{e.strerror or e}")


def _answers(path: str) -> bool:
    """Whether something listens at the Unix socket ``path`` (one busy enough that its
    backlog is full counts; only a refused connection says nobody does)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(_ANSWER_S)
        try:
            s.connect(path)
        except ConnectionRefusedError:
            return False
        except OSError:  # (busy, or not ours to probe: not stale either way)
            return True
        return True


def _connect(s: socket.socket, path: str, deadline: float, timeout: float) -> None:
    """Connect ``s`` to ``path`` by ``deadline``: a server whose backlog is full (EAGAIN)
    is tried again every few milliseconds."""
    while True:
        s.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            s.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the server took no connection within {timeout:g} s "
                                   "(its backlog is full)") from None
            time.sleep(0.005)


def fetch(path: str, timeout: float = FETCH_S) -> dict[str, Any]:
    """One snapshot from the stats socket at ``path``, connected to and read within
    ``timeout`` seconds in all (TimeoutError past it). ValueError: the answer is longer
    than MAX_ANSWER, ends early or is not JSON; RuntimeError: the executor's snapshot
    failed (its error)."""
    deadline = time.monotonic() + timeout
    data = bytearray()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        _connect(s, path, deadline, timeout)
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no full answer within {timeout:g} s ({len(data)} bytes "
                                   "came)")
            s.settimeout(left)
            try:
                more = s.recv(1 << 16)
            except TimeoutError:
                raise TimeoutError(f"no full answer within {timeout:g} s ({len(data)} bytes "
                                   "came)") from None
            if not more:
                raise ValueError(f"the answer ended after {len(data)} bytes, before its end "
                                 "of line")
            data += more
            if len(data) > MAX_ANSWER:
                raise ValueError(f"the answer is over {MAX_ANSWER >> 20} MiB without an end "
                                 "of line: not an mpx stats socket?")
    out = json.loads(data)
    if not isinstance(out, dict):
        raise ValueError(f"the answer is a JSON {type(out).__name__}, not an object")
    if "error" in out:
        raise RuntimeError(f"the executor's stats snapshot failed: {out['error']}")
    return out
