"""Liveness between the leader and each follower node, over UDP probes of its own.

Heartbeats that ride a TCP connection (the data's, or the control channel's) arrive only
as fast as TCP retransmits them: after a cut, TCP's retransmission timer backs off (0.2,
0.4, 0.8 s...), so a 0.5 s partition kept a link silent for 1.27 s, longer than a 1 s
heartbeat. A datagram is never held back: the first probe sent after a link heals
arrives. So each side sends a probe every ``heartbeat_s / 4`` and judges the other by when
its last probe came; a partition shorter than the grace (``Config.link_grace``) costs
nothing. While a peer is silent for longer than 1.75 probe periods, its probes go every
``FAST_PROBE_S`` instead, so that the end of the cut is seen at once: the first probe
after it names the peer in ``take()``'s answer, and the node's queue links are then
reconnected at once (ZmqReader.reconnect_now), rather than left waiting for TCP's
retransmission timer, which backed off during the cut (a call sent into a 1.5 s cut would
arrive 1.5 s after the heal).

A probe is ``PROBE`` sealed with the group's key (mpx.auth): the follower's node rank,
the nonce of its join (fresh per join: a probe of another group or an earlier join of the
node proves nothing), who sent it, and a counter that only grows (a replayed probe is
dropped). The leader binds its UDP socket on ``master_addr:master_port`` (the control
port's number, in UDP's space) and answers each follower at the address its probes come
from; a follower binds its own host, on an ephemeral port.

Concurrency: a ``Probes`` is used by one thread at a time (the leader's watch thread after
startup; the follower's control loop).
"""

from __future__ import annotations

import socket
import struct
import time

from mpx.auth import Signer

PROBE = struct.Struct("<4sHI16sBQ")  # tag, version, node rank, join nonce, sender, counter
_TAG, _VERSION = b"MPXP", 1
LEADER, FOLLOWER = 0, 1
# The most datagrams one look takes (a flood holds no wait up).
_TAKE_MAX = 256
PROBES_PER_HEARTBEAT = 4
# How often a silent peer is probed (and how soon the end of its silence is seen).
FAST_PROBE_S = 0.02
# A peer unheard for this many probe periods is silent (one probe missed, and more than a
# loaded host's jitter).
SILENT_PERIODS = 1.75


class Probes:
    """This node's probes: it is ``me`` (LEADER or FOLLOWER), binds ``host:port`` (port 0:
    any), and probes each peer added with :meth:`expect` every ``heartbeat_s / 4``.
    ``heard[node]``: when node's last authentic probe came (monotonic seconds)."""

    def __init__(self, key: bytes, me: int, host: str, port: int, heartbeat_s: float) -> None:
        family, _, _, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.sock.setblocking(False)
            self.sock.bind(where)
        except BaseException:
            self.sock.close()
            raise
        self._signer = Signer(key)
        self._me = me
        self._every = heartbeat_s / PROBES_PER_HEARTBEAT
        self._fast = min(FAST_PROBE_S, self._every)
        self._next = 0.0
        self._counter = 0
        self._links: dict[int, tuple[bytes, tuple | None]] = {}  # node -> (nonce, address)
        self._counters: dict[int, int] = {}  # node -> the counter of its last probe
        self.heard: dict[int, float] = {}

    def fileno(self) -> int:
        return self.sock.fileno()

    def expect(self, node: int, nonce: bytes, address: tuple | None = None) -> None:
        """Probe ``node`` (joined with ``nonce``) at ``address``; None: where its own probes
        come from, once one has."""
        if address is not None:
            family, _, _, _, address = socket.getaddrinfo(address[0], address[1],
                                                          type=socket.SOCK_DGRAM)[0]
        self._links[node] = (nonce, address)
        self._counters.pop(node, None)  # (a new join: its counter starts again)
        self.heard.pop(node, None)

    def forget(self, node: int) -> None:
        self._links.pop(node, None)

    def silent(self, node: int, now: float) -> bool:
        """Whether ``node`` was heard once, and not for SILENT_PERIODS probe periods."""
        heard = self.heard.get(node)
        return heard is not None and now - heard > SILENT_PERIODS * self._every

    def wait_s(self) -> float:
        """How long until the next probe is due (a loop's longest wait)."""
        return max(0.0, self._next - time.monotonic())

    def tick(self, now: float | None = None) -> None:
        """Send every peer a probe if one is due (fast while one is silent)."""
        now = time.monotonic() if now is None else now
        if now < self._next:
            return
        silent = any(self.silent(node, now) for node in self._links)
        self._next = now + (self._fast if silent else self._every)
        for node, (nonce, address) in self._links.items():
            if address is None:
                continue
            self._counter += 1
            frame = self._signer.seal(PROBE.pack(_TAG, _VERSION, node, nonce, self._me,
                                                 self._counter), ())
            try:
                self.sock.sendto(frame, address)
            except OSError:
                pass  # (no route, refused: the peer is judged by its silence)

    def take(self) -> list[int]:
        """Read the probes that came, noting who is alive; drop the rest. The nodes heard
        again after a silence (their links are worth reconnecting now)."""
        back: list[int] = []
        for _ in range(_TAKE_MAX):
            try:
                frame, address = self.sock.recvfrom(256)
            except (BlockingIOError, InterruptedError):
                return back
            except OSError:
                continue  # (an ICMP error of an earlier send)
            body = self._signer.unseal(frame)
            if body is None or body.nbytes != PROBE.size:
                continue
            tag, version, node, nonce, sender, counter = PROBE.unpack(body)
            link = self._links.get(node)
            if tag != _TAG or version != _VERSION or sender == self._me or link is None or \
                    link[0] != nonce or counter <= self._counters.get(node, 0):
                continue
            self._counters[node] = counter
            now = time.monotonic()
            if self.silent(node, now):
                back.append(node)
            self.heard[node] = now
            if self._me == LEADER and link[1] != address:
                self._links[node] = (nonce, address)  # (where to answer: its probes' source)

        return back

    def close(self) -> None:
        self.sock.close()
