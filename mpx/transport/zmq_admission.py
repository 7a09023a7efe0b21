"""Who may connect to a ZeroMQ queue writer, and which connection is which reader.

A writer expects nothing from its readers but their HELLO (``zmq_framing.HELLO``, sealed
with the deployment's key): its socket takes frames of at most ``MAX_CONTROL_FRAME`` bytes
(a peer that sends a larger one is disconnected), holds at most ``CONTROL_HWM`` per
connection, and the writer reads and drops what comes as it writes, so that no peer,
authenticated or not, makes it hold more than a few KiB. It takes new connections only
until the queue is ready: libzmq asks the writer (ZAP) whether to let each one in, the
writer says yes while it waits for its readers' HELLOs, then closes its ZAP handler, after
which libzmq refuses every new connection at its handshake. So a storm of connections costs
nothing (an idle writer reads nothing, and each connection let in held ~20 KiB until read),
and a reader whose connection drops is not let back in: its heartbeat declares it lost.

Concurrency: an ``Admission`` is its writer's, called by one thread at a time, as the writer's
own docstring says (zmq_writer).
"""

from __future__ import annotations

import zmq

from mpx.auth import Signer
from mpx.transport.zmq_drops import DropLog
from mpx.transport.zmq_framing import HELLO, MAGIC, VERSION

# What a writer receives (HELLOs; junk): the largest frame it takes (a HELLO is 68 bytes;
# the limit holds for handshake commands too, and CURVE's INITIATE is ~350), and how many
# wait per connection.
MAX_CONTROL_FRAME = 1024
CONTROL_HWM = 8
# The most messages (HELLOs, ZAP requests) one look takes, so that a flood holds no wait up.
TAKE_MAX = 256
# (libzmq's address for the ZAP handler of a context)
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def guard(sock: zmq.Socket) -> None:
    """Set the options of a writer's ``sock`` (before it binds) that keep what peers send
    small, and let in only the connections its Admission's ZAP handler admits."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_FRAME)
    sock.setsockopt(zmq.RCVHWM, CONTROL_HWM)
    # (with no ZAP handler, an enforced domain refuses the connection)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"mpx")
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


class Admission:
    """The readers of the writer's ``sock`` (set up by ``guard``): ``peers`` maps each reader
    rank that said HELLO to the routing id of its connection; ``need`` of ``ranks`` make the
    writer ready. Until it is, a ZAP handler bound in ``ctx`` lets every connection in.
    The HELLOs it drops are counted in ``drops``."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, ranks: list[int], need: int,
                 signer: Signer, token: int, drops: DropLog) -> None:
        self.ranks = list(ranks)
        self.need = need
        self.peers: dict[int, bytes] = {}    # rank -> routing id
        self.drops = drops
        self._sock, self._signer, self._token = sock, signer, token
        self._zap: zmq.Socket | None = ctx.socket(zmq.ROUTER)
        try:
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(_ZAP_ENDPOINT)
        except BaseException:
            self.close()
            raise

    def ready(self) -> bool:
        return len(self.peers) >= self.need

    def missing(self) -> list[int]:
        """The ranks whose HELLO the writer still waits for (as many as it needs)."""
        return [r for r in self.ranks if r not in self.peers][:self.need - len(self.peers)]

    def release(self, rank: int) -> None:
        """Reader ``rank`` is gone for good: the messages from now on go to the others alone."""
        if self.peers.pop(rank, None) is not None:
            self.need -= 1

    def take(self, timeout_ms: int) -> None:
        """Take the HELLOs that came (waiting up to ``timeout_ms`` for one), and drop
        anything else: TAKE_MAX messages at most. Until the writer is ready, let the new
        connections in; once it is, refuse them."""
        if self._zap is not None:
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._zap, zmq.POLLIN)
            poller.poll(timeout_ms)
            self._admit(self._zap)
        elif not self._sock.poll(timeout_ms, zmq.POLLIN):
            return
        for _ in range(TAKE_MAX):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._hello(frames)
        if self._zap is not None and self.ready():
            self.close()

    def close(self) -> None:
        """Close the ZAP handler: libzmq refuses every new connection from now on."""
        if self._zap is not None:
            self._zap.close()
            self._zap = None

    @staticmethod
    def _admit(zap: zmq.Socket) -> None:
        """Let in the connections that libzmq asks about (ZAP requests: routing id, empty,
        version, request id, ...), TAKE_MAX at most."""
        for _ in range(TAKE_MAX):
            try:
                request = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(request) >= 4:
                zap.send_multipart([request[0], b"", b"1.0", request[3], b"200", b"", b"", b""])

    def _hello(self, frames: list[bytes]) -> None:
        peer = frames[0]
        body = self._signer.unseal(frames[1]) if len(frames) == 2 else None
        if body is None or body.nbytes != HELLO.size:
            self.drops.drop(peer, "malformed or unsigned hello (wrong key?)")
            return
        magic, version, _, token, rank, routing_id = HELLO.unpack(body)
        if magic != MAGIC or version != VERSION or token != self._token or rank not in self.ranks:
            self.drops.drop(peer, f"hello for another queue or rank {rank}")
            return
        if routing_id != peer:
            self.drops.drop(peer, f"hello for rank {rank} from another connection than the one "
                            "it names (replayed?)")
            return
        if rank not in self.peers and len(self.peers) >= self.need:
            self.drops.drop(peer, f"hello from rank {rank}: all {self.need} readers are "
                            f"already connected (ranks {sorted(self.peers)})")
            return
        self.peers[rank] = peer
