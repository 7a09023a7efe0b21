"""ZeroMQ transport: the writer's ROUTER socket sends each message to every remote reader's
DEALER over TCP.

A message travels as chunks of at most ``Config.max_chunk_bytes``, so that a large one is
signed, sent, checked and copied out in a pipeline. Every chunk is one frame carrying an
HMAC-SHA256 under the deployment's key (``Config.auth_key``) over its header (queue token,
message sequence number, chunk index and count, message length) and its bytes; a reader
checks it, and that the chunk is the next one, before anything is unpickled. Forged,
altered, truncated and replayed chunks are dropped and counted, and the connection keeps
working for honest peers. A message the writer gave up on part way (a reader too slow for
its deadline) is discarded by the readers that got its start. Readers introduce
themselves with a signed HELLO naming their rank and their connection (a routing id drawn
afresh by each reader), so a HELLO replayed from another connection binds nothing. With
``Config.curve`` the traffic is also encrypted (CURVE; the writer's public key travels in the
handle; authentication stays with the HMAC).

A writer expects nothing from its readers but their HELLO: it takes frames of at most
``_MAX_CONTROL_FRAME`` bytes (a peer that sends a larger one is disconnected), holds at most
``_CONTROL_HWM`` per connection, and reads and drops what comes as it writes, so that no
peer, authenticated or not, makes it hold more than a few KiB. It takes new connections
only until the queue is ready: libzmq asks the writer (ZAP) whether to let each one in, the
writer says yes while it waits for its readers' HELLOs, then closes its ZAP handler, after
which libzmq refuses every new connection at its handshake. So a storm of connections costs
nothing (an idle writer reads nothing, and each connection let in held ~20 KiB until read),
and a reader whose connection drops is not let back in: its heartbeat declares it lost.

A process's ends share one ZeroMQ context (``_Contexts``), so that one I/O thread carries
both directions of its traffic; a second writer alive at once gets a context of its own.

What a writer has written reaches its readers even when its process exits next: close()
waits (up to ``Config.heartbeat_s``) until libzmq has handed it all to the kernel, which
sends it after the process is gone (``ZmqWriter._flush``: terminating a context, libzmq's
own wait, needs every socket in it closed, and the others of the process may still be in
use); and a reader drained after its writer's death (``Reader.drain``) reads what was on
its way.

High-water marks never drop a call: the writer sends with ROUTER_MANDATORY, so a full
pipe to a slow reader makes it wait (until its deadline, then QueueTimeout naming the rank)
and a reader that disconnected makes it raise PeerDiedError.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import zmq
import zmq.utils.monitor

from mpx import _addresses
from mpx._units import human_size
from mpx.auth import Signer
from mpx.config import Config
from mpx.errors import (
    Cancelled,
    MessageAbortedError,
    MessageTooLargeError,
    PeerDiedError,
    QueueClosedError,
    QueueTimeout,
    WaitNudged,
)
from mpx.mechanism import codec, layout
from mpx.mechanism.waiting import AdaptiveWait
from mpx.transport.base import Reader, Writer

logger = logging.getLogger("mpx")

MAGIC = b"MPXZ"
VERSION = 5  # 3: kinds are opaque but for layout.KIND_AS_BYTES; 4: a HELLO names its connection;
# 5: a chunk count of 0 ends the stream
# magic, version, kind, token, seq, chunk index, chunk count, message length
_HEADER = struct.Struct("<4sHHQQIIQ")
_ID_BYTES = 16
_HELLO = struct.Struct(f"<4sHHQI{_ID_BYTES}s")   # magic, version, 0, token, rank, routing id
# What a writer receives (HELLOs; junk): the largest frame it takes (a HELLO is 68 bytes;
# the limit holds for handshake commands too, and CURVE's INITIATE is ~350), and how many
# wait per connection.
_MAX_CONTROL_FRAME = 1024
_CONTROL_HWM = 8
# A writer reads (and drops) what came every this many messages (a look costs ~3 us), up
# to _TAKE_MAX messages at a time.
_READ_EVERY = 64
_TAKE_MAX = 256
# How long a writer or reader sleeps between tries while a peer is not ready.
_BACKOFF_S = 0.0005
_POLL_MS = 20
# A drained reader (Reader.drain) whose writer is still connected waits this long after
# the drain began, or after the last frame, for more (what was on its way when the drain
# began comes in faster than that); one whose writer disconnected, _POLL_MS (libzmq
# reports the disconnect just before it hands over the last frames).
_DRAIN_QUIET_NS = 100_000_000
# A frame smaller than this is sent by copy, as two plain sends with int flags (pyzmq's
# send_multipart with copy=False costs ~6 us more per message, for a Frame object and
# its flags' enum arithmetic); larger ones without a copy.
_COPY_MAX = 64 << 10
# The end of a writer's stream (ZmqWriter._flush): padding that makes the frame larger than
# libzmq's batch (8 KiB) and pyzmq's copy threshold (64 KiB, below which it is not tracked)
_END_PAD = bytes(64 << 10)
_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)


def split(parts: Iterable, size: int, total: int) -> Iterator[list]:
    """The message ``parts`` of ``total`` bytes as consecutive chunks of ``size`` bytes (the
    last one shorter; one empty chunk for an empty message), each a list of memoryviews
    into the parts. ValueError, before the chunk that holds them, if the parts exceed
    ``total``, and at the end if they fall short."""
    chunk: list = []
    room = size
    sent = False
    seen = 0
    for p in parts:
        v = memoryview(p).cast("B")
        seen += v.nbytes
        if seen > total:
            raise ValueError(f"the message's pieces exceed its length {total}")
        while v.nbytes:
            take = v[:room]
            chunk.append(take)
            v = v[take.nbytes:]
            room -= take.nbytes
            if not room:
                yield chunk
                chunk, room, sent = [], size, True
    if seen != total:
        raise ValueError(f"the message's pieces add up to {seen} bytes, not {total}")
    if chunk or not sent:
        yield chunk


class _Contexts:
    """The ZeroMQ context that a process's queue ends share, so that one I/O thread carries
    a process's sends and receives: a worker's calls in and its replies out, a driver's
    calls out and its replies in (with a context per end, each message woke a second I/O
    thread: ~0.4 more thread wake-ups per call on each side, ~20% of a no-op's round trip).

    Each end takes a context when it is made and gives it back once its sockets are closed;
    the last one out terminates it. Terminating is libzmq's only wait for what a closed
    socket still holds, and it needs every socket of the context closed: so a writer waits
    for its messages to leave by itself (ZmqWriter._flush), and closes with no linger. A
    writer's ZAP handler is bound in its context, one per context: so the
    shared context serves one writer at a time, and a second live writer of the process (a
    queue re-formed beside the old one, a test's several queues) gets a context of its own,
    terminated when it closes. A forked child starts afresh (``forget``), and an end it
    inherited, closed there, calls nothing of libzmq (``_inherited``): its sockets, their I/O
    thread and the locks inside them are the parent's. The lock guards the counts; nothing
    waits under it."""

    def __init__(self) -> None:
        self.forget()

    def forget(self) -> None:
        """Start afresh, sharing nothing (in a forked child: the parent's context has no
        I/O thread here, and the lock may have been held by a thread that is not)."""
        self._lock = threading.Lock()
        self._shared: zmq.Context | None = None
        self._users = 0
        self._has_writer = False

    def take(self, writer: bool) -> zmq.Context:
        """A context for a new end (``writer``: one that binds a ZAP handler in it)."""
        with self._lock:
            if writer and self._has_writer:
                return zmq.Context(io_threads=1)
            if self._shared is None:
                self._shared = zmq.Context(io_threads=1)
            self._users += 1
            self._has_writer |= writer
            return self._shared

    def give_back(self, ctx: zmq.Context, writer: bool) -> None:
        """``ctx``, taken in this process by an end whose sockets are all closed now:
        terminated if it was that end's own or the shared one's last user."""
        with self._lock:
            if ctx is self._shared:
                self._users -= 1
                if writer:
                    self._has_writer = False
                if self._users:
                    return
                self._shared = None
        ctx.term()


_CONTEXTS = _Contexts()
os.register_at_fork(after_in_child=_CONTEXTS.forget)


def _inherited(taken_in: int) -> bool:
    """Whether an end made in process ``taken_in`` is closed in another, a fork's child: it
    must then leave its sockets alone. libzmq is not fork-safe: a send or a monitor's
    teardown there posts to the parent's I/O thread through a mailbox whose lock that
    thread may have held at the fork (the child then waits forever), and terminating the
    inherited context waits for an I/O thread that is not there. pyzmq's close() already
    does nothing in such a child; the descriptors go with the child."""
    return taken_in != os.getpid()


def _configure(sock: zmq.Socket, config: Config) -> None:
    # TCP keepalive, not ZMTP heartbeats: libzmq 4.3 aborts (session_base.cpp:233) when a
    # heartbeat meets a full pipe, which ROUTER_MANDATORY with a small HWM makes routine.
    idle = max(1, int(config.heartbeat_s))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)


class _DropLog:
    """Counts dropped frames and logs once per peer (for the first _LOGGED_PEERS peers)."""

    _LOGGED_PEERS = 64

    def __init__(self, where: str) -> None:
        self.where = where
        self.count = 0
        self._logged: set = set()

    def drop(self, peer: Any, why: str) -> None:
        self.count += 1
        if peer not in self._logged and len(self._logged) < self._LOGGED_PEERS:
            self._logged.add(peer)
            logger.warning("%s dropped a message from %r: %s (further drops from this "
                           "peer are counted, not logged)", self.where, peer, why)


class ZmqWriter(Writer):
    """The writer end for the remote ``ranks``: binds a ROUTER on ``host``, ephemeral port.

    ``need``: how many distinct readers of ``ranks`` make the queue ready (default: all of
    them). A vLLM-style queue whose writer's own group rank is unknown accepts any
    ``need`` of ``n + 1`` candidate ranks; messages go to the readers that connected.
    """

    def __init__(self, ranks: list[int], config: Config, host: str,
                 need: int | None = None) -> None:
        if not config.auth_key and not config.allow_insecure:
            raise ValueError("remote readers need an authentication key: set Config.auth_key "
                             "(MPX_AUTH_KEY) on every node, or MPX_ALLOW_INSECURE=1 to accept "
                             "unauthenticated pickles over TCP (anyone who can reach the port "
                             "can then run code in your processes)")
        if not config.auth_key:
            logger.warning("MPX_ALLOW_INSECURE=1: remote queue traffic is not "
                           "authenticated; anyone who can reach %s can run code here", host)
        super().__init__(config)
        self.ranks = list(ranks)
        self.need = len(self.ranks) if need is None else need
        self._signer = Signer(config.auth_key.encode())
        self.token = secrets.randbits(63)
        self._ctx, self._ctx_pid = _CONTEXTS.take(writer=True), os.getpid()
        try:
            self._open(config, host)
        except BaseException:
            self._close_sockets()
            raise
        self._peers: dict[int, bytes] = {}    # rank -> routing id
        self._seq = 0
        self.drops = _DropLog(f"queue writer {self.endpoint}")

    def _open(self, config: Config, host: str) -> None:
        self._sock = self._ctx.socket(zmq.ROUTER)
        _configure(self._sock, config)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_CONTROL_FRAME)
        # (with no ZAP handler, an enforced domain refuses the connection)
        self._sock.setsockopt(zmq.ZAP_DOMAIN, b"mpx")
        self._sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        self._zap: zmq.Socket | None = self._ctx.socket(zmq.ROUTER)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind("inproc://zeromq.zap.01")
        self._curve_key: bytes | None = None
        if config.curve:
            if not zmq.has("curve"):
                raise ValueError("Config.curve is set but this libzmq has no CURVE support")
            self._curve_key, secret = zmq.curve_keypair()
            self._sock.curve_secretkey = secret
            self._sock.curve_server = True
        self._sock.setsockopt(zmq.SNDHWM, config.max_chunks)
        self._sock.setsockopt(zmq.RCVHWM, _CONTROL_HWM)
        try:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            raise _addresses.bind_failed("Config.host, MPX_HOST", host, e) from None
        self.endpoint = f"tcp://{host}:{port}"

    def handle_info(self) -> dict[str, Any]:
        return dict(endpoint=self.endpoint, token=self.token, zmq_ranks=tuple(self.ranks),
                    heartbeat_s=self.config.heartbeat_s, curve_server_key=self._curve_key)

    def _take_hellos(self, timeout_ms: int) -> None:
        """Take the HELLOs that came (waiting up to ``timeout_ms`` for one), and drop
        anything else: _TAKE_MAX messages at most, so that a flood holds no wait up. Until
        the queue is ready, let the new connections in; once it is, refuse them."""
        if self._zap is not None:
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._zap, zmq.POLLIN)
            poller.poll(timeout_ms)
            self._admit(self._zap)
        elif not self._sock.poll(timeout_ms, zmq.POLLIN):
            return
        for _ in range(_TAKE_MAX):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._hello(frames)
        if self._zap is not None and self._ready():
            self._zap.close()
            self._zap = None

    @staticmethod
    def _admit(zap: zmq.Socket) -> None:
        """Let in the connections that libzmq asks about (ZAP requests: routing id, empty,
        version, request id, ...), _TAKE_MAX at most."""
        for _ in range(_TAKE_MAX):
            try:
                request = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(request) >= 4:
                zap.send_multipart([request[0], b"", b"1.0", request[3], b"200", b"", b"", b""])

    def _hello(self, frames: list[bytes]) -> None:
        peer = frames[0]
        body = self._signer.unseal(frames[1]) if len(frames) == 2 else None
        if body is None or body.nbytes != _HELLO.size:
            self.drops.drop(peer, "malformed or unsigned hello (wrong key?)")
            return
        magic, version, _, token, rank, routing_id = _HELLO.unpack(body)
        if magic != MAGIC or version != VERSION or token != self.token or rank not in self.ranks:
            self.drops.drop(peer, f"hello for another queue or rank {rank}")
            return
        if routing_id != peer:
            self.drops.drop(peer, f"hello for rank {rank} from another connection than the one "
                            "it names (replayed?)")
            return
        if rank not in self._peers and len(self._peers) >= self.need:
            self.drops.drop(peer, f"hello from rank {rank}: all {self.need} readers are "
                            f"already connected (ranks {sorted(self._peers)})")
            return
        self._peers[rank] = peer

    def missing_readers(self) -> list[int]:
        with self._lock:
            self._take_hellos(0)
            return self._missing()[:self.need - len(self._peers)]

    def release_reader(self, rank: int) -> None:
        with self._lock:
            if self._peers.pop(rank, None) is not None:
                self.need -= 1  # (the messages from now on go to the others alone)

    def _missing(self) -> list[int]:
        return [r for r in self.ranks if r not in self._peers]

    def _ready(self) -> bool:
        return len(self._peers) >= self.need

    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        while not self._ready():
            if self._closed or self._shut:
                raise Cancelled("wait_until_ready cancelled: the queue was shut down")
            if cancel is not None and cancel.is_set():
                raise Cancelled("wait_until_ready cancelled by its cancel event")
            if 0 <= deadline_ns <= time.monotonic_ns():
                missing = self._missing()[:self.need - len(self._peers)]
                also = "" if self.need == len(self.ranks) else \
                    f" ({self.need} of ranks {self.ranks} must connect)"
                raise QueueTimeout(f"remote readers never connected: ranks {missing}{also}")
            self._take_hellos(_POLL_MS)

    def write(self, kind: int, pieces: Iterable, deadline_ns: int, total: int = -1) -> None:
        with self._lock:
            self._check_open()
            if not self._ready() or not self._seq % _READ_EVERY:
                self._take_hellos(0)
                if not self._ready():
                    self.wait_ready(deadline_ns)
            size = self.config.max_chunk_bytes
            if total < 0:
                pieces = tuple(pieces)
                total = sum([memoryview(p).nbytes for p in pieces])
                # (pieces that add up by construction: if they fit one chunk, they are it)
                chunks: Iterable = (pieces,) if total <= size else split(pieces, size, total)
            else:
                chunks = split(pieces, size, total)
            count = max(1, -(-total // size))
            seal = self._signer.seal
            try:
                for index, chunk in enumerate(chunks):
                    frame = seal(_HEADER.pack(MAGIC, VERSION, kind, self.token, self._seq, index,
                                              count, total), chunk)
                    for rank in self._peers:
                        self._send(rank, frame, deadline_ns)
            finally:
                self._seq += 1  # also when given up part way: readers drop the partial message

    def _send(self, rank: int, frame: bytes, deadline_ns: int, track: bool = False,
              past_shutdown: bool = False) -> Any:
        """Send ``frame`` to reader ``rank``, waiting for room until ``deadline_ns``; a frame
        of ``_COPY_MAX`` bytes or more goes without a copy, and with ``track``, its tracker
        is returned. Shutdown ends the wait (Cancelled), unless ``past_shutdown`` (close()'s
        own _flush: close has shut the end down)."""
        peer, sock = self._peers[rank], self._sock
        small = len(frame) < _COPY_MAX
        credit_taken = False
        while True:
            try:
                if small:
                    # (a ROUTER checks the reader's pipe at the routing frame: once that is
                    # taken, so is the rest)
                    sock.send(peer, _MORE_NOBLOCK)
                    sock.send(frame, _NOBLOCK)
                else:
                    return sock.send_multipart([peer, frame], zmq.NOBLOCK, copy=False,
                                               track=track)
                return None
            except zmq.Again:
                # That reader's pipe is full, or looks full: libzmq passes the credit for
                # what the reader took to this socket as a command, which a send processes
                # at most every ~1 ms (a burst of max_chunks small messages in less meets
                # it). Taking the socket's commands (EVENTS) brings it in; else the reader
                # is slow: wait for it.
                if not credit_taken:
                    sock.getsockopt(zmq.EVENTS)
                    credit_taken = True
                    continue
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:
                    raise PeerDiedError(f"remote reader rank {rank} disconnected (died, or its "
                                        "link was cut)", role="reader", rank=rank) from None
                raise
            if self._shut and not past_shutdown:
                raise Cancelled("enqueue cancelled: the queue was shut down")
            if 0 <= deadline_ns <= time.monotonic_ns():
                raise QueueTimeout(f"enqueue timed out: remote reader rank {rank} is not "
                                   "taking messages")
            time.sleep(_BACKOFF_S)
            credit_taken = False

    def _wake(self) -> None:
        """Nothing to do: an enqueue waiting for a slow reader polls ``_shut`` (Cancelled);
        the readers are not told (that is close())."""

    def _release(self) -> None:
        if _inherited(self._ctx_pid):
            return
        # the messages still queued go out first: this process may exit next (a worker
        # whose call ended it, right after its reply); a reader that takes nothing for
        # heartbeat_s is lost, and what is queued for it with it
        self._flush(time.monotonic_ns() + int(self.config.heartbeat_s * 1e9))
        self._close_sockets()

    def _flush(self, deadline_ns: int) -> None:
        """Wait, until ``deadline_ns``, until what was written has left for every reader.
        Two end-of-stream frames (a chunk count of 0: readers skip them) go last to each,
        the second tracked: libzmq lets go of a frame when its engine takes the next one
        (with CURVE, once it is encrypted), and it takes the second only after writing the
        first, too large for one batch, to the connection, after all that came before. A
        reader that disconnected is skipped; one whose pipe stays full ends the wait at the
        deadline, as a context's linger would."""
        frame = self._signer.seal(_HEADER.pack(MAGIC, VERSION, 0, self.token, self._seq, 0, 0, 0),
                                  (_END_PAD,))
        trackers = []
        for rank in list(self._peers):
            try:
                self._send(rank, frame, deadline_ns, past_shutdown=True)
                trackers.append(self._send(rank, frame, deadline_ns, track=True,
                                           past_shutdown=True))
            except PeerDiedError:
                continue  # gone: nothing more reaches it
            except QueueTimeout:
                return
        for tracker in trackers:
            try:
                tracker.wait(max((deadline_ns - time.monotonic_ns()) / 1e9, 0.0))
            except zmq.NotDone:
                return

    def _close_sockets(self) -> None:
        zap, sock = getattr(self, "_zap", None), getattr(self, "_sock", None)
        if zap is not None:
            zap.close()
        if sock is not None:
            sock.close(linger=0)  # (what was to leave has: _flush)
        _CONTEXTS.give_back(self._ctx, True)


@dataclasses.dataclass(slots=True)  # (not frozen: its __init__ then costs ~1 us less)
class _Chunk:
    """One authentic chunk: its header's fields and its bytes (a view of the frame)."""

    kind: int
    seq: int
    index: int
    count: int
    total: int
    data: memoryview


class _Partial:
    """A message being gathered: its first chunk, the assembler, and the index of the
    chunk it needs next (0: the first one is still to be added)."""

    def __init__(self, first: _Chunk, assembler: Any) -> None:
        self.first = first
        self.out = assembler(first.total, bool(first.kind & layout.KIND_AS_BYTES))
        self.next = 0


class ZmqReader(AdaptiveWait, Reader):
    """Remote reader ``rank``: a DEALER connected to the writer's ROUTER.

    A read waits as a ring's reader does (mpx.mechanism.waiting): it looks at its socket, with
    ``sched_yield`` between looks, for its yield budget, and only then blocks in libzmq's
    receive (the park), so that a frame that comes soon is taken by a thread that is still
    running: a blocked one must be woken by the I/O thread, and on a VM an idle CPU's wake
    costs tens of microseconds, several of them to a round trip. The budget adapts as the
    ring's does (halved by a wait longer than the window, grown back by one the window would
    have ended); the host is judged crowded by how long the yield took that found a frame
    (there is no writer's stamp to compare with across machines), so a reader whose yields
    hand its core to other work for a time slice parks at once for a span of waits.
    ``yield_us=0`` blocks at once, always."""

    def __init__(self, info: dict[str, Any], rank: int, config: Config) -> None:
        super().__init__(config)
        self._init_waiting(config.spin_us * 1000, config.yield_us * 1000)
        self.rank = rank
        self._signer = Signer(config.auth_key.encode())
        self.token = info["token"]
        self.endpoint = info["endpoint"]
        self._heartbeat_s = info.get("heartbeat_s", config.heartbeat_s)
        self._ctx, self._ctx_pid = _CONTEXTS.take(writer=False), os.getpid()
        self._sock = self._ctx.socket(zmq.DEALER)
        _configure(self._sock, config)
        # (its first byte not 0: libzmq keeps those for the ids it makes up)
        self._routing_id = b"\x01" + secrets.token_bytes(_ID_BYTES - 1)
        self._sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
        self._sock.setsockopt(zmq.RCVHWM, config.max_chunks)
        self._sock.setsockopt(zmq.RCVTIMEO, _POLL_MS)
        if info.get("curve_server_key"):  # the writer encrypts: so must we
            public, secret = zmq.curve_keypair()
            self._sock.curve_serverkey = info["curve_server_key"]
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.endpoint)
        self._sock.send(self._signer.seal(_HELLO.pack(MAGIC, VERSION, 0, self.token, rank,
                                                      self._routing_id), ()))
        self._seq = 0          # the lowest sequence number a new message may have
        self._assembler = codec.Assembler
        self._stash: _Chunk | None = None  # a chunk read ahead: the start of a message
        self._skipping = -1  # the sequence number of a message skipped (too large)
        self._too_large: MessageTooLargeError | None = None  # for the next read to raise
        # a message that a read left part way (a timeout, a cancel, a nudge, a signal):
        # the next read goes on with it
        self._partial: _Partial | None = None
        self._nudged = False  # set by nudge(); taken by the wait it ends
        self._drain_until = -1  # drain()'s deadline (-1: not drained)
        self._heard_ns = 0      # while drained: when the drain began, or the last frame came
        self._connected = False
        self._lost_since: float | None = time.monotonic()
        self.drops = _DropLog(f"queue reader rank {rank}")
        self._bytes = 0  # the bytes of the authentic chunks read

    @property
    def bytes_read(self) -> int:
        return self._bytes

    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        """Return once connected to the writer. Ends with Cancelled on shutdown() or
        ``cancel``, QueueClosedError on close() (also from another thread), QueueTimeout at
        the deadline."""
        while not self._connected:
            with self._lock:
                if self._closed:
                    raise QueueClosedError(f"wait_until_ready on reader rank {self.rank}: "
                                           "the queue was closed")
                self._watch_link()
            if self._connected:
                return
            if self._shut:
                raise self._shut_error(f"wait_until_ready on reader rank {self.rank}")
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"wait_until_ready on reader rank {self.rank} cancelled by "
                                "its cancel event")
            if 0 <= deadline_ns <= time.monotonic_ns():
                raise QueueTimeout(f"reader rank {self.rank} could not reach the writer at "
                                   f"{self.endpoint}")
            time.sleep(0.005)

    def _watch_link(self) -> None:
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected, self._lost_since = True, None
            elif event == zmq.EVENT_DISCONNECTED:
                self._lost_since = time.monotonic()

    def poll(self) -> bool:
        # (EVENTS, not a Poller: no poller to build, and no wait to set up)
        return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def read(self, deadline_ns: int, cancel: threading.Event | None, warn: bool):
        """(See Reader.read.) A message this process cannot allocate memory for is skipped,
        its chunks dropped as they come: MessageTooLargeError."""
        return self._read(deadline_ns, cancel, -1)

    def read_into(self, deadline_ns: int, cancel: threading.Event | None, warn: bool,
                  decode: Callable[[int, Any], Any], in_place_min: int | None = None) -> Any:
        """(See Reader.read_into.) A message of one chunk, from ``in_place_min`` bytes up
        (any, by default), is lent: ``decode`` reads it in the frame it came in, memory of
        this reader's own that nothing else writes, with no copy to gather it."""
        kind, data = self._read(deadline_ns, cancel, 0 if in_place_min is None else in_place_min)
        return decode(kind, data)  # (not under the lock: unpickling may run user code)

    def _read(self, deadline_ns: int, cancel: threading.Event | None, lend_min: int):
        """read()'s ``(kind, data)``; a message of one chunk of at least ``lend_min`` bytes
        (``lend_min`` >= 0) comes as a view of its frame."""
        with self._lock:
            if self._too_large is not None:
                e, self._too_large = self._too_large, None
                raise e
            while True:
                if self._partial is None:
                    first = self._next_start(deadline_ns, cancel)
                    if first.count == 1 and 0 <= lend_min <= first.total:
                        if first.data.nbytes == first.total:
                            return first.kind, first.data
                        self.drops.drop(self.endpoint, f"message {first.seq}: its one chunk "
                                        f"holds {first.data.nbytes} bytes, its header says "
                                        f"{first.total}")
                        continue
                    try:
                        self._partial = _Partial(first, self._assembler)
                    except MemoryError:
                        self._skipping = first.seq
                        raise self._too_large_error(first.total) from None
                part = self._partial
                whole = self._gather(part, deadline_ns, cancel)  # (raises: part stays)
                self._partial = None
                if whole:
                    try:
                        return part.first.kind, part.out.result()
                    except MemoryError:  # (the pure Assembler copies a bytes message)
                        raise self._too_large_error(part.first.total) from None

    def _too_large_error(self, n: int) -> MessageTooLargeError:
        return MessageTooLargeError(
            f"reader rank {self.rank} (pid {os.getpid()}) could not allocate memory for a "
            f"message of {n} bytes ({human_size(n)}) from the writer at {self.endpoint}; "
            "the message was skipped, the queue reads on", nbytes=n)

    def read_ready(self) -> list[tuple[int, Any]]:
        # (as Reader.read_ready, but a message skipped after others is not met again: the
        # next read raises its error)
        out: list = []
        while self._too_large is not None or self.poll():
            try:
                out.append(self.read(0, None, False))
            except QueueTimeout:
                break
            except MessageTooLargeError as e:
                if not out:
                    raise
                self._too_large = e
                break
            except Exception:
                if not out:
                    raise
                break
        return out

    def _gather(self, part: _Partial, deadline_ns: int, cancel: threading.Event | None) -> bool:
        """Add ``part``'s missing chunks to it as they arrive: True once it is whole, False
        if it is discarded (the writer gave up on it, or its sizes do not add up; the drop
        is counted). A wait's exception propagates, leaving ``part`` as far as it got."""
        first = part.first
        while part.next < first.count:
            c = first if part.next == 0 else self._next_chunk(deadline_ns, cancel)
            if c.index == 0 and c.seq > first.seq:  # the writer gave up on this one
                self._stash = c
                return False
            if c.seq != first.seq or c.index != part.next:
                self.drops.drop(self.endpoint, f"chunk {c.index} of message {c.seq} out of "
                                "order (replayed?)")
                continue
            try:
                part.out.add(c.data)
            except ValueError as e:  # more bytes than the header says
                self.drops.drop(self.endpoint, f"message {first.seq}: {e}")
                return False
            part.next += 1
        if not part.out.complete:
            self.drops.drop(self.endpoint, f"message {first.seq} is shorter than its header says")
            return False
        return True

    def read_stream(self, deadline_ns: int, cancel: threading.Event | None):
        """``(kind, total, pieces)`` of the next message without gathering it: ``pieces``
        yields each checked chunk as it arrives (a relay writes them on at once). It raises
        MessageAbortedError if the writer gave up on the message part way; one consumer
        only. A message that a read() left part way comes whole, as one piece."""
        with self._lock:
            if self._partial is None:
                first = self._next_start(deadline_ns, cancel)
                return first.kind, first.total, self._pieces(first, deadline_ns, cancel)
        kind, data = self.read(deadline_ns, cancel, False)
        return kind, memoryview(data).nbytes, (data,)

    def _next_start(self, deadline_ns: int, cancel: threading.Event | None) -> _Chunk:
        """The first chunk of the next message; stray continuations are dropped."""
        while True:
            c = self._next_chunk(deadline_ns, cancel)
            if c.seq == self._skipping:
                continue  # the rest of a message too large for this process
            if c.index != 0:
                self.drops.drop(self.endpoint, f"chunk {c.index} of message {c.seq} out of "
                                "order (replayed?)")
            elif c.seq < self._seq:
                self.drops.drop(self.endpoint, f"sequence {c.seq}, expected {self._seq} or "
                                "later (replayed?)")
            else:
                # a later sequence number than expected: the writer gave up on those between
                self._seq = c.seq + 1
                return c

    def _pieces(self, first: _Chunk, deadline_ns: int, cancel: threading.Event | None):
        yield first.data
        for index in range(1, first.count):
            while True:
                with self._lock:
                    c = self._next_chunk(deadline_ns, cancel)
                if c.index == 0 and c.seq > first.seq:  # the writer gave up on this one
                    self._stash = c
                    raise MessageAbortedError(f"the writer gave up on message {first.seq} part way")
                if c.seq == first.seq and c.index == index:
                    break
                self.drops.drop(self.endpoint, f"chunk {c.index} of message {c.seq} out of "
                                "order (replayed?)")
            yield c.data

    def _next_chunk(self, deadline_ns: int, cancel: threading.Event | None) -> _Chunk:
        """The next authentic chunk, waiting with every exit: shutdown, ``cancel``, a
        nudge (WaitNudged), the writer lost for longer than the heartbeat timeout, the
        deadline. As on a ring, a reader shut down still gets what has already arrived,
        then Cancelled; a deadline already past takes only what has arrived, and leaves a
        nudge for a wait."""
        stashed = self._stash
        if stashed is not None:
            self._stash = None
            return stashed
        if self._closed:
            raise Cancelled("the queue is closed")
        start = time.monotonic_ns()
        yield_phase, parked, found = True, False, False
        try:
            while True:
                shut = self._shut
                if cancel is not None and cancel.is_set():
                    raise Cancelled(f"dequeue on rank {self.rank} cancelled by its cancel event")
                if shut:
                    waits = self._drain_until >= 0 and self._in_flight(deadline_ns)
                else:
                    waits = deadline_ns < 0 or time.monotonic_ns() < deadline_ns
                block = waits and not (self._nudged and not shut)  # (a nudge ends no drain)
                frame = None
                if block and yield_phase:
                    yield_phase = False
                    frame = self._yield_for_frame(start, deadline_ns, cancel)
                    if frame is None and (self._nudged or self._shut or
                                          cancel is not None and cancel.is_set()):
                        continue  # (ended early: the loop's checks see why)
                if frame is None:
                    try:  # blocks up to RCVTIMEO = _POLL_MS, but for a reader that must not wait
                        frame = self._sock.recv(0 if block else _NOBLOCK, copy=False)
                    except zmq.Again:
                        if shut and not waits:
                            raise Cancelled(f"dequeue on rank {self.rank} cancelled: the queue "
                                            "was shut down") from None
                        if waits and not block:
                            self._nudged = False  # (a nudge that comes in between is merged in)
                            raise WaitNudged(f"dequeue on remote reader rank {self.rank}: its "
                                             "wait was nudged") from None
                    parked |= block
                if frame is not None:
                    if self._drain_until >= 0:
                        self._heard_ns = time.monotonic_ns()
                    if not frame.more:
                        c = self._parse(frame)
                        if c is not None:
                            found = True
                            return c
                    else:  # a multipart message: no writer of ours sends one
                        self._sock.recv_multipart(copy=False)  # (the rest arrived with it)
                        self.drops.drop(self.endpoint, "malformed message (multipart)")
                    # (on to the deadline: a stream of forged frames holds no reader past it)
                self._watch_link()
                if self._lost_since is not None and \
                        time.monotonic() - self._lost_since > self._heartbeat_s:
                    raise PeerDiedError(
                        f"reader rank {self.rank} lost the writer at {self.endpoint} for more "
                        f"than {self._heartbeat_s} s (it died, or the link was cut)",
                        role="writer")
                if 0 <= deadline_ns <= time.monotonic_ns():
                    raise QueueTimeout(f"dequeue on remote reader rank {self.rank} timed out: "
                                       f"nothing from the writer at {self.endpoint}")
        finally:
            if parked:
                self._adapt(time.monotonic_ns() - start, found)

    def _yield_for_frame(self, start: int, deadline_ns: int,
                         cancel: threading.Event | None) -> zmq.Frame | None:
        """A wait's yield phase (see the class docstring): the next frame if one comes within
        ``spin_us`` of looking and the yield budget of looking with ``sched_yield`` between
        (to ``deadline_ns`` at most), else None (and None at once while the host is judged
        crowded). Shutdown, a nudge and ``cancel`` end it early: the wait then sees them."""
        if self._skips_yield() or not self.spin_ns + self.yield_budget_ns:
            return None
        end = spin_end = start + self.spin_ns
        end += self.yield_budget_ns
        if 0 <= deadline_ns < end:
            end = deadline_ns
        sock, clock, yield_cpu = self._sock, time.monotonic_ns, os.sched_yield
        now, took = start, 0
        while True:
            try:
                frame = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:
                pass
            else:
                if took:  # (the frame came during that yield: seen that late at most)
                    self._judge(took)
                return frame
            if now >= end or self._shut or self._nudged or cancel is not None and cancel.is_set():
                return None
            if now < spin_end:
                now, took = clock(), 0
                continue
            yield_cpu()
            took = clock() - now
            now += took
            self._yielded(took)

    def drain(self, deadline_ns: int) -> None:
        """After shutdown(), reads go on taking what the writer sent, waiting (up to
        ``deadline_ns``, which must be set) for what is still on its way: until the writer
        disconnects (a writer that died: everything it sent has come), or, while it is
        connected, for the rest of a message begun, else _DRAIN_QUIET_NS after the drain
        began or the last frame came. Then Cancelled, as before."""
        self._heard_ns = time.monotonic_ns()
        self._drain_until = deadline_ns

    def _in_flight(self, deadline_ns: int) -> bool:
        """(drained, shut down) Whether a read waits for more: see drain()."""
        now = time.monotonic_ns()
        if now >= self._drain_until or 0 <= deadline_ns <= now:
            return False
        self._watch_link()
        if self._lost_since is not None:
            return time.monotonic() - self._lost_since < _POLL_MS / 1000
        return self._partial is not None or now < self._heard_ns + _DRAIN_QUIET_NS

    def _parse(self, frame: zmq.Frame) -> _Chunk | None:
        """The chunk in ``frame``, or None (the drop logged) if it is not an authentic one
        of this queue."""
        body = self._signer.unseal(frame.buffer)
        if body is None or body.nbytes < _HEADER.size:
            self.drops.drop(self.endpoint, "malformed or unsigned message (wrong key, altered?)")
            return None
        magic, version, kind, token, seq, index, count, total = _HEADER.unpack_from(body)
        if magic != MAGIC or version != VERSION or token != self.token:
            self.drops.drop(self.endpoint, "message of another queue or version")
            return None
        if not count:
            return None  # the end of the writer's stream (ZmqWriter._flush): nothing to read
        data = body[_HEADER.size:]
        self._bytes += data.nbytes
        return _Chunk(kind, seq, index, count, total, data)

    def nudge(self) -> None:
        # a waiting read looks at it every receive timeout (_POLL_MS)
        self._nudged = True

    def _wake(self) -> None:
        """Nothing to do: a waiting dequeue polls ``_shut`` every receive timeout."""

    def _release(self) -> None:
        if _inherited(self._ctx_pid):
            return
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        _CONTEXTS.give_back(self._ctx, False)
