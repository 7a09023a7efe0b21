"""Who may connect to a ZeroMQ queue writer, and which connection is which reader.

A writer expects nothing from its readers but ``zmq_framing.CONTROL`` frames sealed with
the deployment's key (HELLO, ACK, RESUME): its socket takes frames of at most
``MAX_CONTROL_FRAME`` bytes (a peer that sends a larger one is disconnected), holds at
most ``CONTROL_HWM`` per connection, and the writer reads and drops the rest as it writes
and every ``POLL_MS`` while idle (zmq_writer), so that no peer, authenticated or not, makes
it hold more than a few KiB. libzmq asks the writer (ZAP) whether to let each connection
in: until the queue is ready, every one; then only those from the addresses its readers
said HELLO from, where a reader whose link broke comes back from (zmq_link). A HELLO binds
a rank once: another connection's HELLO for a rank already bound is dropped. A reader whose
link broke comes back on a new connection, with a new routing id, and its RESUME binds its
rank to that connection, if no connection of this writer ever had that routing id: so a
RESUME replayed, from the connection it names or another, binds nothing. A reader whose
HELLO went with a connection that broke before the writer took it (a writer takes what came
only when it writes, or once ready) is joined by its RESUME, as by a HELLO.

Concurrency: an ``Admission`` is its writer's, called by one thread at a time, as the writer's
own docstring says (zmq_writer).
"""

from __future__ import annotations

import zmq

from mpx.auth import Signer
from mpx.transport.zmq_drops import DropLog
from mpx.transport.zmq_framing import ACK, BYE, CONTROL, HELLO, MAGIC, RESUME, VERSION
from mpx.transport.zmq_link import ResendWindow

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
    writer ready. A ZAP handler bound in ``ctx`` lets connections in (see the module's
    docstring). The readers' ACKs go to ``window``; their RESUMEs wait in ``resumes`` as
    ``(rank, last frame, nonce)`` for the writer to answer. What it drops is counted in
    ``drops``."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, ranks: list[int], need: int,
                 signer: Signer, token: int, drops: DropLog, window: ResendWindow) -> None:
        self.ranks = list(ranks)
        self.need = need
        self.peers: dict[int, bytes] = {}    # rank -> routing id
        self.drops = drops
        self.window = window
        self.resumes: list[tuple[int, int, int]] = []
        self._addresses: set[str] = set()  # where the readers said HELLO from
        self._bound: set[bytes] = set()     # every routing id a rank was ever bound to
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

    def admit(self, rank: int) -> None:
        """A new process reads as reader ``rank`` (started again, or a reader it had not):
        its HELLO binds the rank anew (the one before, if any, is released)."""
        self.release(rank)
        if rank not in self.ranks:
            self.ranks.append(rank)
        self.need += 1

    def release(self, rank: int) -> None:
        """Reader ``rank`` is gone for good: the messages from now on go to the others alone."""
        if self.peers.pop(rank, None) is not None:
            self.need -= 1
            self.window.leave(rank)

    def take(self, timeout_ms: int) -> bool:
        """Take what the readers sent (waiting up to ``timeout_ms`` for something), and drop
        anything else; answer libzmq's questions about new connections: TAKE_MAX messages
        of each at most. Whether a connection was let in (its reader speaks next)."""
        if self._zap is None:
            return False
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._zap, zmq.POLLIN)
        poller.poll(timeout_ms)
        admitted = self._admit(self._zap)
        for _ in range(TAKE_MAX):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._control(frames)
        return admitted

    def close(self) -> None:
        """Close the ZAP handler: libzmq refuses every new connection from now on."""
        if self._zap is not None:
            try:  # (at once: a close frees the endpoint later, in libzmq's reaper)
                self._zap.unbind(_ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass  # (its bind failed)
            self._zap.close()
            self._zap = None

    def _admit(self, zap: zmq.Socket) -> bool:
        """Answer the questions libzmq asks about new connections (ZAP requests: routing
        id, empty, version, request id, domain, address, ...), TAKE_MAX at most: until the
        writer is ready every one is let in, then those from its readers' addresses.
        Whether one was let in."""
        admitted = False
        for _ in range(TAKE_MAX):
            try:
                request = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(request) >= 6:
                ok = not self.ready() or request[5].decode(errors="replace") in self._addresses
                admitted |= ok
                zap.send_multipart([request[0], b"", b"1.0", request[3],
                                    b"200" if ok else b"400", b"", b"", b""])
        return admitted

    def _control(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        body = self._signer.unseal(frames[1].buffer) if len(frames) == 2 else None
        if body is None or body.nbytes != CONTROL.size:
            self.drops.drop(peer, "malformed or unsigned control frame (wrong key?)")
            return
        magic, version, what, token, rank, routing_id, number, nonce = CONTROL.unpack(body)
        if magic != MAGIC or version != VERSION or token != self._token or rank not in self.ranks:
            self.drops.drop(peer, f"control frame for another queue or rank {rank}")
            return
        if routing_id != peer:
            self.drops.drop(peer, f"control frame for rank {rank} from another connection than "
                            "the one it names (replayed?)")
            return
        if what == RESUME and peer not in self._bound:
            if rank in self.peers:
                self.peers[rank] = peer  # (its link broke: this is its new connection)
                self._bound.add(peer)
                self.resumes.append((rank, number, nonce))
                return
            if len(self.peers) < self.need:
                # its HELLO went with the connection that broke before this writer took it
                # (a writer takes what came when it writes, or once ready): the RESUME
                # joins it as the HELLO would have, to read what is sent from now on
                self._join(rank, peer, frames[1])
                self.resumes.append((rank, self.window.last, nonce))
                return
        if what != HELLO:
            if self.peers.get(rank) != peer:
                self.drops.drop(peer, f"control frame for rank {rank}, which is not connected "
                                "by this connection")
            elif what == ACK:
                self.window.ack(rank, number)
            elif what == BYE:
                self.window.done(rank)
            elif what == RESUME:  # (again: its first went unanswered)
                self.resumes.append((rank, number, nonce))
            return
        if rank in self.peers:
            if self.peers[rank] != peer:
                self.drops.drop(peer, f"hello from rank {rank}, which is connected by another "
                                "connection")
            return
        if len(self.peers) >= self.need:
            self.drops.drop(peer, f"hello from rank {rank}: all {self.need} readers are "
                            f"already connected (ranks {sorted(self.peers)})")
            return
        self._join(rank, peer, frames[1])

    def _join(self, rank: int, peer: bytes, frame: zmq.Frame) -> None:
        """Reader ``rank`` reads from now on, on the connection ``peer`` that ``frame`` came by."""
        self.peers[rank] = peer
        self._bound.add(peer)
        self.window.join(rank)
        try:
            self._addresses.add(str(frame.get("Peer-Address")))
        except (zmq.ZMQError, ValueError):
            pass
