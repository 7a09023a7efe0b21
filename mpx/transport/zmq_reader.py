"""The reader end of the ZeroMQ transport: a DEALER connected to the writer's ROUTER, that
says HELLO, checks every frame's HMAC before anything is unpickled, and waits for the next
chunk with every exit (shutdown, a cancel, a nudge, the writer lost, the deadline); its
Reassembly (``zmq_reassembly``) gathers the chunks into messages.

Its link outlives its TCP connection (zmq_link): it acknowledges what it read, and when
the connection breaks (libzmq connects again) it asks for what it missed (RESUME) and
reads on from there. A frame that fails its HMAC on the link is treated as a broken link
(the bytes were altered on the way, or someone else's): it is dropped and counted
(``integrity_failures``), the connection reset and the frame read again from the resend.
A link that stays broken, or keeps delivering frames that fail, for ``Config.link_grace``
loses the writer (PeerDiedError, saying which). Forged, altered, truncated and replayed
frames never reach the application. A reader drained after its writer's death
(``Reader.drain``) reads what was on its way.

Concurrency: a read holds the reader's lock (``Endpoint._lock``) while it waits and
gathers, and decodes outside it (unpickling may run user code); a streamed message's
pieces take it for each chunk (one consumer). shutdown(), close() and nudge() come from
other threads and set ``_shut``, ``_closed`` and ``_nudged`` without it, which a waiting
read looks at between its yields and at every receive timeout (``POLL_MS``); close() then
takes the lock to close the sockets.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor

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
from mpx.mechanism.waiting import AdaptiveWait
from mpx.transport.base import Reader
from mpx.transport.zmq_context import CONTEXTS, POLL_MS, configure, inherited
from mpx.transport.zmq_drops import DropLog
from mpx.transport.zmq_framing import (
    ACK,
    BYE,
    CONTROL,
    END,
    HEADER,
    HELLO,
    ID_BYTES,
    MAGIC,
    RESUME,
    RESUMED,
    VERSION,
    Chunk,
)
from mpx.transport.zmq_reassembly import Reassembly

# A drained reader (Reader.drain) whose writer is still connected waits this long after
# the drain began, or after the last frame, for more (what was on its way when the drain
# began comes in faster than that); one whose writer disconnected, POLL_MS (libzmq
# reports the disconnect just before it hands over the last frames).
_DRAIN_QUIET_NS = 100_000_000
# How long a closing reader's BYE may wait to leave (its writer may be gone already).
_BYE_LINGER_MS = 50
# A RESUME that got no answer is sent again after this long (with a fresh nonce).
_RESUME_AGAIN_S = 0.5
# A reader looks at its link every receive timeout while it reads; a longer gap between two
# looks is time it did not read, which the link's clocks do not count (_watch_link).
_IDLE_S = 0.25
_NOBLOCK = int(zmq.NOBLOCK)


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
        self._grace = info.get("link_grace_s", config.link_grace)
        self._ack_every = info.get("ack_every", config.max_chunks)
        self._ctx, self._ctx_pid = CONTEXTS.take(writer=False), os.getpid()
        self._sock = self._ctx.socket(zmq.DEALER)
        configure(self._sock, config)
        self._new_routing_id()
        self._sock.setsockopt(zmq.RCVHWM, config.max_chunks)
        self._sock.setsockopt(zmq.RCVTIMEO, POLL_MS)
        if info.get("curve_server_key"):  # the writer encrypts: so must we
            public, secret = zmq.curve_keypair()
            self._sock.curve_serverkey = info["curve_server_key"]
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.endpoint)
        self._say(HELLO, 0, 0)
        self._stash: Chunk | None = None  # a chunk read ahead: the start of a message
        self._too_large: MessageTooLargeError | None = None  # for the next read to raise
        self._nudged = False  # set by nudge(); taken by the wait it ends
        self._drain_until = -1  # drain()'s deadline (-1: not drained)
        self._heard_ns = 0      # while drained: when the drain began, or the last frame came
        self._connected = False
        self._lost_since: float | None = time.monotonic()
        # the link (zmq_link): the last frame read, those read since the last ACK, the
        # nonce of the RESUME waiting for its answer (and when it was sent), and since when
        # frames have been failing their HMAC (and after which frame)
        self._last = 0
        self._unacked = 0
        self._resume: int | None = None
        self._resume_at = 0.0
        self._failing_since: float | None = None
        self._failed_after = 0
        self._kicked = False  # reconnect_now() asked (from any thread): the next look does
        self._broken = False  # the connection broke: reconnect once what came is read
        self._looked = time.monotonic()  # the last look at the link
        self.integrity_failures = 0  # frames that failed their HMAC on the link
        self.resumes = 0             # times the link was taken up again where it broke
        self.drops = DropLog(f"queue reader rank {rank}")
        self._messages = Reassembly(self.drops, self.endpoint, rank)
        self._bytes = 0  # the bytes of the authentic chunks read

    @property
    def bytes_read(self) -> int:
        return self._bytes

    def link_counts(self) -> tuple[int, int, int]:
        return self.integrity_failures, self.resumes, 0

    def link_state(self) -> str:
        # (read without the lock, by another thread: each field is one read)
        now = time.monotonic()
        failing, lost = self._failing_since, self._lost_since
        if failing is not None:
            return (f"its frames failing authentication (HMAC) for {now - failing:.1f} s "
                    f"({self.integrity_failures} so far): the link is reset and they are resent")
        if lost is not None:
            return f"its link broken for {now - lost:.1f} s: reconnecting, to resume where it broke"
        if self._resume is not None:
            return "its link reconnected: resuming where it broke"
        return ""

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

    def _new_routing_id(self) -> None:
        """A routing id for the next connection (never one before: zmq_admission)."""
        # (its first byte not 0: libzmq keeps those for the ids it makes up)
        self._routing_id = b"\x01" + secrets.token_bytes(ID_BYTES - 1)
        self._sock.setsockopt(zmq.ROUTING_ID, self._routing_id)

    def _say(self, what: int, number: int, nonce: int) -> None:
        """Send the writer a CONTROL frame (never waits: one that finds no room is lost,
        and said again later where it matters)."""
        try:
            self._sock.send(self._signer.seal(CONTROL.pack(
                MAGIC, VERSION, what, self.token, self.rank, self._routing_id, number, nonce),
                ()), _NOBLOCK)
        except zmq.Again:
            pass

    def _watch_link(self) -> None:
        # A link's trouble is timed while the reader reads: events it has not looked at yet
        # (a reconnection, the RESUMED that answers it) may have set it right meanwhile.
        now = time.monotonic()
        idle = now - self._looked - _IDLE_S
        self._looked = now
        if idle > 0:
            if self._lost_since is not None:
                self._lost_since += idle
            if self._failing_since is not None:
                self._failing_since += idle
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                if not self._connected:  # (the first connection: nothing to take up again)
                    self._connected, self._lost_since = True, None
                elif self._resume is not None:
                    self._ask_resume()
            elif event == zmq.EVENT_DISCONNECTED and self._connected and self._resume is None:
                self._broken = True
                if self._lost_since is None:
                    self._lost_since = now
        if self._broken and not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            # (once what came before the break is read: a new connection drops it)
            self._broken = False
            self._reconnect()
        if self._kicked:
            self._kicked = False
            if self._connected and self._resume is None:
                self._reconnect(broken=False)
        if self._resume is not None and time.monotonic() - self._resume_at > _RESUME_AGAIN_S:
            self._ask_resume()

    def reconnect_now(self) -> None:
        # (a flag: the reading thread reconnects within a receive timeout, POLL_MS, or at
        # its next read)
        self._kicked = True

    def _reconnect(self, broken: bool = True) -> None:
        """The link broke (or carried a frame that failed; not ``broken``: it is only
        suspected stale, reconnect_now()): connect again, on a new connection with a new
        routing id, and ask for what follows the last frame read once connected (frames
        until the answer are dropped: the resend has them). A broken link's clock starts
        (``_lost_since``); a link only suspected is the node's liveness' to judge (its
        new connection may have met a cut that came back, and waits for TCP's SYN)."""
        if broken and self._lost_since is None:
            self._lost_since = time.monotonic()
        self._resume, self._resume_at = secrets.randbits(63), time.monotonic()
        self._sock.disconnect(self.endpoint)
        self._new_routing_id()
        self._sock.connect(self.endpoint)

    def _ask_resume(self) -> None:
        """Ask the writer for the frames after the last one read (zmq_link), with a fresh
        nonce: an answer to an earlier RESUME is not taken for this one's."""
        self._resume = secrets.randbits(63)
        self._resume_at = time.monotonic()
        self._say(RESUME, self._last, self._resume)

    def _reset_link(self) -> None:
        """A frame failed its HMAC: take the link down and up again (once the RESUME that
        follows is answered, a new failure resets it again)."""
        if self._failing_since is None:
            self._failing_since, self._failed_after = time.monotonic(), self._last
        if self._resume is None:
            self._reconnect()

    def _link_error(self) -> PeerDiedError | None:
        """The error of a link broken, or failing, for longer than the grace, else None."""
        now = time.monotonic()
        if self._failing_since is not None and now - self._failing_since > self._grace:
            return PeerDiedError(
                f"reader rank {self.rank}: the frames from the writer at {self.endpoint} "
                f"failed authentication (HMAC) for more than {self._grace:g} s "
                f"(link_grace_s; {self.integrity_failures} frames failed): the link alters "
                "data, or someone else sends on it", role="writer")
        if self._lost_since is not None and now - self._lost_since > self._grace:
            return PeerDiedError(
                f"reader rank {self.rank} lost the writer at {self.endpoint} for more than "
                f"{self._grace:g} s (link_grace_s: it died, or the link was cut)", role="writer")
        return None

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
            add = self._messages.add
            while True:
                whole = add(self._next_chunk(deadline_ns, cancel), lend_min)
                if whole is not None:
                    return whole

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

    def read_stream(self, deadline_ns: int, cancel: threading.Event | None):
        """``(kind, total, pieces)`` of the next message without gathering it: ``pieces``
        yields each checked chunk as it arrives (a relay writes them on at once). It raises
        MessageAbortedError if the writer gave up on the message part way; one consumer
        only. A message that a read() left part way comes whole, as one piece."""
        with self._lock:
            if self._messages.partial is None:
                while True:
                    first = self._next_chunk(deadline_ns, cancel)
                    if self._messages.begins(first):
                        return first.kind, first.total, self._pieces(first, deadline_ns, cancel)
        kind, data = self.read(deadline_ns, cancel, False)
        return kind, memoryview(data).nbytes, (data,)

    def _pieces(self, first: Chunk, deadline_ns: int, cancel: threading.Event | None):
        yield first.data
        for index in range(1, first.count):
            while True:
                with self._lock:
                    c = self._next_chunk(deadline_ns, cancel)
                try:
                    if self._messages.next_piece(first, index, c):
                        break
                except MessageAbortedError:
                    self._stash = c  # (the start of the next message)
                    raise
            yield c.data

    def _next_chunk(self, deadline_ns: int, cancel: threading.Event | None) -> Chunk:
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
                    try:  # blocks up to RCVTIMEO = POLL_MS, but for a reader that must not wait
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
                if self._lost_since is not None or self._failing_since is not None:
                    lost = self._link_error()
                    if lost is not None:
                        raise lost
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
            return time.monotonic() - self._lost_since < POLL_MS / 1000
        return self._messages.partial is not None or now < self._heard_ns + _DRAIN_QUIET_NS

    def _parse(self, frame: zmq.Frame) -> Chunk | None:
        """The chunk in ``frame``, or None (the drop logged) if it is not an authentic one
        of this queue."""
        body = self._signer.unseal(frame)  # (the frame's buffer, with no view of it first)
        if body is None or body.nbytes < HEADER.size:
            self.drops.drop(self.endpoint, "malformed or unsigned message (wrong key, altered?)")
            self.integrity_failures += 1
            self._reset_link()
            return None
        magic, version, kind, token, seq, index, count, total, number = HEADER.unpack_from(body)
        if magic != MAGIC or version != VERSION or token != self.token:
            self.drops.drop(self.endpoint, "message of another queue or version")
            return None
        if not count:  # a frame of the link
            if index == RESUMED and seq == self._resume:
                # the frames after it: the ``total`` frames missed, then new ones
                self._resume = self._lost_since = None
                self.resumes += 1
                if not total:
                    self._failing_since = None  # (nothing to read again: nothing failed)
            if index == END:  # the end of the writer's stream (ZmqWriter._flush): it waits
                self._say(ACK, self._last, 0)  # for this before it closes
            return None
        if self._resume is not None:
            return None  # (the resend after the RESUMED brings it again)
        if number <= self._last:
            self.drops.drop(self.endpoint, f"frame {number} again, after frame {self._last} "
                            "(replayed?)")
            return None
        self._last = number
        if self._failing_since is not None and number > self._failed_after:
            self._failing_since = None  # (past the frame that failed)
        self._unacked += 1
        if self._unacked >= self._ack_every:
            self._unacked = 0
            self._say(ACK, number, 0)
        data = body[HEADER.size:]
        self._bytes += data.nbytes
        return Chunk(kind, seq, index, count, total, data, number)

    def nudge(self) -> None:
        # a waiting read looks at it every receive timeout (POLL_MS)
        self._nudged = True

    def _wake(self) -> None:
        """Nothing to do: a waiting dequeue polls ``_shut`` every receive timeout."""

    def _release(self) -> None:
        if inherited(self._ctx_pid):
            return
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._say(BYE, self._last, 0)  # (the writer waits for nothing more from this reader)
        self._sock.close(linger=_BYE_LINGER_MS)
        CONTEXTS.give_back(self._ctx, False)
