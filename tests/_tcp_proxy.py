"""A TCP proxy on loopback that a test can break: every connection through it reset at once
(both ends get an RST, as when a NAT or a middlebox forgets a connection), and new ones
refused for a while. Its pumping runs in one thread; close() ends it."""

from __future__ import annotations

import selectors
import socket
import struct
import threading

_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST


class Proxy:
    """Listens on 127.0.0.1 (``endpoint``: its tcp:// address) and forwards each connection
    to ``target_port`` on 127.0.0.1."""

    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ)
        self._pairs: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._refusing = False
        self._stop = False
        self.resets = 0
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="test-proxy", daemon=True)
        self._thread.start()

    def reset(self, refuse: bool = False) -> None:
        """Reset every connection through the proxy; with ``refuse``, also every new one
        until ``allow()``."""
        with self._lock:
            self._refusing = refuse
            for s in list(self._pairs):
                self._drop(s)
            self.resets += 1

    def allow(self) -> None:
        with self._lock:
            self._refusing = False

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join(5)
        with self._lock:
            for s in list(self._pairs):
                self._drop(s)
        self._sel.close()
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def _drop(self, s: socket.socket) -> None:
        peer = self._pairs.pop(s, None)
        for x in (s, peer):
            if x is None:
                continue
            self._pairs.pop(x, None)
            try:
                self._sel.unregister(x)
            except (KeyError, ValueError):
                pass
            try:
                x.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
            except OSError:
                pass
            x.close()

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.1):
                with self._lock:
                    s = key.fileobj
                    if s is self._wake_r:
                        continue
                    if s is self._listener:
                        self._accept()
                    elif s in self._pairs:
                        self._pump(s)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._refusing:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
            client.close()
            return
        try:
            server = socket.create_connection(self._target, timeout=2)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setblocking(True)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._pairs[client], self._pairs[server] = server, client
        self._sel.register(client, selectors.EVENT_READ)
        self._sel.register(server, selectors.EVENT_READ)

    def _pump(self, s: socket.socket) -> None:
        try:
            data = s.recv(1 << 20)
            if data:
                self._pairs[s].sendall(data)
                return
        except OSError:
            pass
        self._drop(s)
