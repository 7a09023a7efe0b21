"""Helpers of test_stats_socket.py: a worker that leaves a mark when it starts, and fake
stats servers that misbehave (in a thread of the test process, stopped with the test)."""

from __future__ import annotations

import os
import socket
import threading
import time

import _workers


class Marked(_workers.Echo):
    """Echo that creates ``<marks>/<rank>`` as it starts."""

    def __init__(self, ctx, marks: str) -> None:
        with open(os.path.join(marks, str(ctx.rank)), "w"):
            pass
        super().__init__(ctx)


class FakeServer:
    """A Unix socket at ``path`` that answers each connection as ``mode`` says:

    - ``drip``: an object's first byte, then one byte every 50 ms, never an end of line;
    - ``endless``: 64 KiB blocks without an end of line, as fast as the client reads;
    - ``silent``: nothing, the connection kept open;
    - ``alien``: one line of JSON that is not a stats snapshot."""

    def __init__(self, path: str, mode: str) -> None:
        self.mode = mode
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(8)
        self._sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._serve, name="fake-stats", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            with conn:
                try:
                    self._answer(conn)
                except OSError:  # the client gave up
                    pass

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)
        if self.mode == "alien":
            conn.sendall(b'{"hello": "world"}\n')
            return
        if self.mode == "drip":
            conn.sendall(b"{")
        block = b"x" * 65536
        while not self._stop.is_set():
            if self.mode == "drip":
                conn.sendall(b" ")
                time.sleep(0.05)
            elif self.mode == "endless":
                conn.sendall(block)
            else:
                time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close()
