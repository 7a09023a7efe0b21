"""The executor's stats endpoint (``Config.stats_socket``): a Unix socket that answers each
connection with one JSON line, the executor's ``stats()`` and its workers' CPU time, for
``python -m mpx top``.

Rules: one thread (``mpx-stats``) accepts and answers, one connection at a time, each within
``_ANSWER_S``; it takes the call table's lock only for the snapshot's outcome counts, never
runs user code, and waits in ``select`` with a timeout, so ``stop()`` ends it within
``_POLL_S``. The socket is made owner-only (0600) and carries no pickle; ``stop()`` closes
and unlinks it. A stale socket file (its executor killed) is replaced at the next start.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from mpx._driver.stats import Stats

logger = logging.getLogger("mpx")

_POLL_S = 0.2    # how often the thread looks at stop()
_ANSWER_S = 1.0  # a client that does not take its answer within this is dropped
_CLK_TCK = os.sysconf("SC_CLK_TCK")


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
    """Serves ``snapshot()`` (a JSON-ready dict) at the Unix socket ``path``."""

    def __init__(self, path: str, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.path = path
        self._snapshot = snapshot
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._bind(path)
            self._sock.listen(8)
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="mpx-stats", daemon=True)
        self._thread.start()

    def _bind(self, path: str) -> None:
        try:
            self._sock.bind(path)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or _answers(path):
                raise OSError(e.errno, f"Config.stats_socket {path!r}: {e.strerror} (another "
                              "executor serves it?)") from None
            os.unlink(path)  # a stale one: its executor is gone
            self._sock.bind(path)
        os.chmod(path, 0o600)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], _POLL_S)
                if not ready:
                    continue
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                raise
            with conn:
                try:
                    conn.settimeout(_ANSWER_S)
                    conn.sendall(json.dumps(self._snapshot()).encode() + b"\n")
                except Exception as e:  # (a client gone, or a snapshot that failed: say so)
                    logger.debug("mpx stats socket: no answer sent (%s)", e)

    def stop(self) -> None:
        """End the thread, close the socket and remove its file."""
        self._stop.set()
        self._thread.join(_POLL_S + _ANSWER_S + 1.0)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _answers(path: str) -> bool:
    """Whether something listens at the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError:
            return False
        return True


def fetch(path: str, timeout: float = 2.0) -> dict[str, Any]:
    """One snapshot from the stats socket at ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        data = b""
        while not data.endswith(b"\n"):
            more = s.recv(1 << 16)
            if not more:
                break
            data += more
    return json.loads(data)
