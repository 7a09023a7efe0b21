"""The writer end of the ZeroMQ transport: a ROUTER socket that sends each message, as
sealed chunks (``zmq_framing``), to every remote reader's DEALER over TCP.

The remote transport, module by module: ``zmq_framing`` (the frames and their HMAC),
``zmq_admission`` (who may connect; what the readers say), ``zmq_link`` (a link that
outlives its TCP connection: the frames held for resends), ``zmq_context`` (the context a
process's ends share; fork), ``zmq_drops`` (what was thrown away), this writer, and the
reader: ``zmq_reader`` (receiving and waiting) with ``zmq_reassembly`` (chunks into
messages). With ``Config.curve`` the traffic is also encrypted (CURVE; the writer's public
key travels in the handle; authentication stays with the HMAC).

High-water marks never drop a call: the writer sends with ROUTER_MANDATORY, so a full
pipe to a slow reader makes it wait (until its deadline, then QueueTimeout naming the rank).
A reader whose connection broke gets what it missed when it is back (zmq_link); one that
stays away for ``Config.link_grace`` makes the writer raise PeerDiedError. A message the
writer gave up on part way is discarded by the readers that got its start.

What a writer has written reaches its readers even when its process exits next: close()
waits (up to ``Config.heartbeat_s``) until libzmq has handed it all to the kernel, which
sends it after the process is gone (``_flush``: terminating a context, libzmq's own wait,
needs every socket in it closed, and the others of the process may still be in use).

Concurrency: write(), missing_readers(), release_reader(), close() and the link's thread
(``mpx-zmq-link``: every ``_LINK_POLL_S``, if the lock is free, it takes what readers sent,
answers their RESUMEs and libzmq's questions about new connections, so that a reader whose
link broke is let back in while the writer is idle) hold the writer's lock
(``Endpoint._lock``): the sockets, the Admission and the ResendWindow see one of them at a
time. wait_ready() called on its own (the queue's wait_until_ready) takes the readers'
HELLOs without it, before the thread starts; a write that finds readers missing waits for
them under the lock. shutdown() only sets ``_shut``, which a send waiting for room and
wait_ready() look at between tries; close() stops the thread before it releases the
sockets.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable
from typing import Any, cast

import zmq

from mpx import _addresses, _debug
from mpx.auth import Signer
from mpx.config import Config
from mpx.errors import Cancelled, PeerDiedError, QueueTimeout
from mpx.transport.base import Writer
from mpx.transport.zmq_admission import Admission, guard
from mpx.transport.zmq_context import CONTEXTS, POLL_MS, configure, inherited
from mpx.transport.zmq_drops import DropLog
from mpx.transport.zmq_framing import END, HEADER, MAGIC, RESUMED, VERSION, split
from mpx.transport.zmq_link import WINDOW_PER_CHUNKS, ResendWindow

logger = logging.getLogger("mpx")

# A writer reads (and drops) what came every this many messages (a look costs ~3 us).
_READ_EVERY = 64
# How often the link's thread looks at what readers sent, while the writer is idle: a
# reader whose link broke waits this long at most to be let back in; once one is, the
# thread looks every _LINK_FAST_S for _LINK_FAST_FOR_S, for its RESUME.
_LINK_POLL_S = 0.1
_LINK_FAST_S = 0.002
_LINK_FAST_FOR_S = 0.5
# How long a writer sleeps between tries while a reader's pipe is full.
_BACKOFF_S = 0.0005
# A frame smaller than this is sent by copy, as two plain sends with int flags (pyzmq's
# send_multipart with copy=False costs ~6 us more per message, for a Frame object and
# its flags' enum arithmetic); larger ones without a copy.
_COPY_MAX = 64 << 10
# The end of a writer's stream (_flush): padding that makes the frame larger than
# libzmq's batch (8 KiB) and pyzmq's copy threshold (64 KiB, below which it is not tracked)
_END_PAD = bytes(64 << 10)
_NOBLOCK, _MORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
# The backend's send, which zmq.Socket.send wraps in Python for what the transport does not
# use (DRAFT sockets' routing ids and groups): ~0.3 us less a call.
_backend_send = zmq.backend.Socket.send


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
        self._signer = Signer(config.auth_key.encode())
        self.token = secrets.randbits(63)
        self._ctx, self._ctx_pid = CONTEXTS.take(writer=True), os.getpid()
        try:
            self._open(config, host)
            self.drops = DropLog(f"queue writer {self.endpoint}")
            self._window = ResendWindow(WINDOW_PER_CHUNKS * config.max_chunks)
            self._admission = Admission(self._ctx, self._sock, ranks,
                                        len(ranks) if need is None else need,
                                        self._signer, self.token, self.drops, self._window)
        except BaseException:
            self._close_sockets()
            raise
        self._seq = 0
        self._frame = 0  # the number of the last frame sealed
        self._grace_ns = int(config.link_grace * 1e9)
        self.resumes = 0  # RESUMEs answered: readers whose link broke, taken up again
        self.resent = 0   # frames sent again to them
        self._serving = False  # (_serve_resumes is sending)
        self._link_stop = threading.Event()
        self._link_nudge = threading.Event()  # (look now: stop, or readers expected back)
        self._fast_until = 0.0  # (the link's thread looks every _LINK_FAST_S until then)
        self._link_thread: threading.Thread | None = None

    def _open(self, config: Config, host: str) -> None:
        self._sock = self._ctx.socket(zmq.ROUTER)
        configure(self._sock, config)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        guard(self._sock)
        self._curve_key: bytes | None = None
        if config.curve:
            if not zmq.has("curve"):
                raise ValueError("Config.curve is set but this libzmq has no CURVE support")
            self._curve_key, secret = zmq.curve_keypair()
            self._sock.curve_secretkey = secret
            self._sock.curve_server = True
        self._sock.setsockopt(zmq.SNDHWM, config.max_chunks)
        try:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            raise _addresses.bind_failed("Config.host, MPX_HOST", host, e) from None
        self.endpoint = f"tcp://{host}:{port}"

    def handle_info(self) -> dict[str, Any]:
        return dict(endpoint=self.endpoint, token=self.token,
                    zmq_ranks=tuple(self._admission.ranks), link_grace_s=self.config.link_grace,
                    ack_every=self.config.max_chunks,
                    curve_server_key=self._curve_key)

    def link_counts(self) -> tuple[int, int, int]:
        return 0, self.resumes, self.resent

    def missing_readers(self) -> list[int]:
        with self._lock:
            self._admission.take(0)
            if self._admission.ready():
                self._keep_link()
            return self._admission.missing()

    def release_reader(self, rank: int) -> None:
        with self._lock:
            self._admission.release(rank)

    def admit_reader(self, rank: int) -> None:
        """A new process reads as remote reader ``rank`` from now on (a remote rank started
        again): the one before is released, and the writer is ready again once the new one
        said HELLO (wait_ready)."""
        with self._lock:
            self._check_open()
            self._admission.admit(rank)

    def wait_ready(self, deadline_ns: int, cancel: threading.Event | None = None) -> None:
        admission = self._admission
        while not admission.ready():
            if self._closed or self._shut:
                raise Cancelled("wait_until_ready cancelled: the queue was shut down")
            if cancel is not None and cancel.is_set():
                raise Cancelled("wait_until_ready cancelled by its cancel event")
            if 0 <= deadline_ns <= time.monotonic_ns():
                also = "" if admission.need == len(admission.ranks) else \
                    f" ({admission.need} of ranks {admission.ranks} must connect)"
                raise QueueTimeout(f"remote readers never connected: ranks "
                                   f"{admission.missing()}{also}")
            admission.take(POLL_MS)
        self._keep_link()

    def _keep_link(self) -> None:
        """Start the link's thread (once, when the writer is first ready: wait_ready(), or
        the first write() or missing_readers() that finds it ready, whichever takes the
        readers' HELLOs)."""
        if self._link_thread is None and not self._closed:
            self._link_thread = threading.Thread(target=_debug.counted_thread(self._link),
                                                 name="mpx-zmq-link", daemon=True)
            self._link_thread.start()

    def _link(self) -> None:
        """(the link's thread) See the module's docstring."""
        lock = cast(threading.Lock, self._lock)  # (the Endpoint's own: a writer gives none)
        nudge = self._link_nudge
        while True:
            nudge.wait(_LINK_FAST_S if time.monotonic() < self._fast_until else _LINK_POLL_S)
            nudge.clear()
            if self._link_stop.is_set():
                return
            if not lock.acquire(blocking=False):
                continue  # (a write or a close: a write takes what came itself)
            try:
                if self._closed:
                    return
                if self._admission.take(0):
                    self._fast_until = time.monotonic() + _LINK_FAST_FOR_S
                self._serve_resumes(time.monotonic_ns() + self._grace_ns)
            except (zmq.ZMQError, PeerDiedError, QueueTimeout, Cancelled):
                pass  # (the next write meets it, and says so)
            finally:
                lock.release()

    def _serve_resumes(self, deadline_ns: int) -> None:
        """Answer the readers back after their link broke: to each, a RESUMED frame with
        its RESUME's nonce, then every frame held after the last one it has."""
        admission = self._admission
        self._serving = True
        try:
            while admission.resumes:
                rank, last, nonce = admission.resumes.pop(0)
                if any(r == rank for r, _, _ in admission.resumes):
                    continue  # (a later one of that reader's: the one it waits for)
                self._serve_resume(rank, last, nonce, deadline_ns)
        finally:
            self._serving = False

    def _serve_resume(self, rank: int, last: int, nonce: int, deadline_ns: int) -> None:
        """Answer reader ``rank``'s RESUME (``nonce``): it has every frame up to ``last``."""
        window = self._window
        oldest = window.oldest()
        if oldest is not None and last + 1 < oldest:
            # (cannot be: a frame is held until that reader acknowledges it)
            self._admission.release(rank)
            raise PeerDiedError(f"remote reader rank {rank} came back after its link broke, "
                                f"but frames {last + 1}-{oldest - 1} it missed are no longer "
                                "held", role="reader", rank=rank)
        window.down.pop(rank, None)
        missed = window.after(last)
        mark = self._signer.seal(HEADER.pack(MAGIC, VERSION, 0, self.token, nonce, RESUMED, 0,
                                             len(missed), last), ())
        self._send(rank, mark, deadline_ns)
        self.resumes += 1
        peer = self._admission.peers[rank]
        for _, frame in missed:
            if self._admission.peers.get(rank) != peer:
                return  # (it came back again, on another connection: its RESUME is next)
            self._send(rank, frame, deadline_ns)
            self.resent += 1

    def _make_room(self, deadline_ns: int) -> None:
        """Wait until the resend window has room: the readers acknowledge what they read."""
        admission, window = self._admission, self._window
        while True:
            admission.take(0)
            self._serve_resumes(deadline_ns)
            if not window.full():
                return
            self._check_links()
            if self._shut:
                raise Cancelled("enqueue cancelled: the queue was shut down")
            if 0 <= deadline_ns <= time.monotonic_ns():
                raise QueueTimeout(f"enqueue timed out: remote reader rank {window.behind()} "
                                   f"has not acknowledged frame {window.oldest()}")
            admission.take(1)

    def _check_links(self) -> None:
        """PeerDiedError if a reader's link has been broken for longer than the grace."""
        window = self._window
        for rank, since in list(window.down.items()):
            if time.monotonic_ns() - since > self._grace_ns:
                self._admission.release(rank)
                raise PeerDiedError(f"remote reader rank {rank} disconnected (died, or its link "
                                    f"was cut) for more than {self.config.link_grace:g} s "
                                    "(link_grace_s)", role="reader", rank=rank)

    def write(self, kind: int, pieces: Iterable, deadline_ns: int, total: int = -1) -> None:
        with self._lock:
            self._check_open()
            admission = self._admission
            window = self._window
            if not admission.ready() or not self._seq % _READ_EVERY:
                admission.take(0)
                if not admission.ready() or self._link_thread is None:
                    self.wait_ready(deadline_ns)  # (which starts the link's thread)
                if admission.resumes:
                    self._serve_resumes(deadline_ns)
                if window.down:
                    self._check_links()
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
                    if window.full():
                        self._make_room(deadline_ns)
                    self._frame += 1
                    frame = seal(HEADER.pack(MAGIC, VERSION, kind, self.token, self._seq, index,
                                             count, total, self._frame), chunk,
                                 min(size, total - index * size))
                    window.hold(self._frame, frame)
                    for rank in admission.peers:
                        self._send(rank, frame, deadline_ns)
            finally:
                self._seq += 1  # also when given up part way: readers drop the partial message
        # The send woke libzmq's I/O thread to carry the message: let it run now. A woken
        # thread waits for the running one's slice to end (the scheduler's run to parity),
        # and what this thread does next (wait for the answer, or write again) goes no
        # faster for holding the CPU meanwhile; with nothing else to run, ~0.5 us.
        os.sched_yield()

    def _send(self, rank: int, frame: bytes, deadline_ns: int, track: bool = False,
              past_shutdown: bool = False) -> Any:
        """Send ``frame`` to reader ``rank``, waiting for room until ``deadline_ns``; a frame
        of ``_COPY_MAX`` bytes or more goes without a copy, and with ``track``, its tracker
        is returned. Shutdown ends the wait (Cancelled), unless ``past_shutdown`` (close()'s
        own _flush: close has shut the end down)."""
        peer, sock = self._admission.peers[rank], self._sock
        small = len(frame) < _COPY_MAX
        credit_taken = False
        while True:
            try:
                if small:
                    # (a ROUTER checks the reader's pipe at the routing frame: once that is
                    # taken, so is the rest)
                    _backend_send(sock, peer, _MORE_NOBLOCK)
                    _backend_send(sock, frame, _NOBLOCK)
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
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                # that reader's connection broke: what it misses is held for it until it
                # is back (RESUME), for the grace at most
                self._window.down.setdefault(rank, time.monotonic_ns())
                if not past_shutdown:
                    self._check_links()
                return None
            if self._shut and not past_shutdown:
                raise Cancelled("enqueue cancelled: the queue was shut down")
            if 0 <= deadline_ns <= time.monotonic_ns():
                raise QueueTimeout(f"enqueue timed out: remote reader rank {rank} is not "
                                   "taking messages")
            time.sleep(_BACKOFF_S)
            credit_taken = False
            # the reader may be back on a new connection (this one broke, and the writer
            # has not seen it yet): its RESUME brings this frame again
            self._admission.take(0)
            if self._admission.peers.get(rank) != peer:
                if not self._serving:
                    self._serve_resumes(deadline_ns)
                return None

    def reconnect_now(self) -> None:
        """Some readers' node was silent and is heard again: they reconnect now, and the
        link's thread lets them in and answers them at once (it looks every _LINK_FAST_S
        for _LINK_FAST_FOR_S), not at its next idle look. From any thread."""
        self._fast_until = time.monotonic() + _LINK_FAST_FOR_S
        self._link_nudge.set()

    def _wake(self) -> None:
        """Stop the link's thread; an enqueue waiting for a slow reader polls ``_shut``
        (Cancelled); the readers are not told (that is close())."""
        self._link_stop.set()
        self._link_nudge.set()

    def _release(self) -> None:
        if inherited(self._ctx_pid):
            return
        thread = self._link_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # (it takes the lock only if free: close holds it)
        # the messages still queued go out first: this process may exit next (a worker
        # whose call ended it, right after its reply); a reader that takes nothing for
        # heartbeat_s is lost, and what is queued for it with it
        deadline_ns = time.monotonic_ns() + int(self.config.heartbeat_s * 1e9)
        self._flush(deadline_ns)
        self._settle(deadline_ns)
        self._close_sockets()

    def _settle(self, deadline_ns: int) -> None:
        """Wait, until ``deadline_ns``, until every reader has acknowledged what it was sent
        or said BYE, taking what they send: a reader's ACK that reached a closed socket
        would make the reader's kernel throw away what it had not read yet (zmq_framing)."""
        window = self._window
        while not window.settled() and time.monotonic_ns() < deadline_ns:
            self._admission.take(POLL_MS)

    def _flush(self, deadline_ns: int) -> None:
        """Wait, until ``deadline_ns``, until what was written has left for every reader.
        Two end-of-stream frames (a chunk count of 0: readers skip them) go last to each,
        the second tracked: libzmq lets go of a frame when its engine takes the next one
        (with CURVE, once it is encrypted), and it takes the second only after writing the
        first, too large for one batch, to the connection, after all that came before. A
        reader that disconnected is skipped; one whose pipe stays full ends the wait at the
        deadline, as a context's linger would."""
        frame = self._signer.seal(HEADER.pack(MAGIC, VERSION, 0, self.token, self._seq, END, 0, 0,
                                              0), (_END_PAD,))
        trackers = []
        for rank in list(self._admission.peers):
            if rank in self._window.down:
                continue  # gone for now: nothing more reaches it
            try:
                self._send(rank, frame, deadline_ns, past_shutdown=True)
                tracker = self._send(rank, frame, deadline_ns, track=True, past_shutdown=True)
            except QueueTimeout:
                return
            if tracker is not None:
                trackers.append(tracker)
        for tracker in trackers:
            try:
                tracker.wait(max((deadline_ns - time.monotonic_ns()) / 1e9, 0.0))
            except zmq.NotDone:
                return

    def _close_sockets(self) -> None:
        admission, sock = getattr(self, "_admission", None), getattr(self, "_sock", None)
        if admission is not None:
            admission.close()
        if sock is not None:
            sock.close(linger=0)  # (what was to leave has: _flush)
        CONTEXTS.give_back(self._ctx, True)
