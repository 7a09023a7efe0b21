"""The ZeroMQ context that a process's queue ends share, and the socket options both ends set.

Concurrency and processes:

- One context per process carries both directions of its traffic (``CONTEXTS``); a second
  writer alive at once gets a context of its own (a writer's ZAP handler is bound in its
  context, one per context). ``Contexts``' lock guards its counts; nothing waits under it.
- Terminating a context is libzmq's only wait for what a closed socket still holds, and it
  needs every socket of the context closed: so a writer waits for its messages to leave by
  itself (``ZmqWriter._flush``) and closes with no linger.
- libzmq is not fork-safe. A forked child starts afresh (``Contexts.forget``, registered at
  fork), and an end it inherited, closed there, calls nothing of libzmq (``inherited``).
"""

from __future__ import annotations

import os
import threading

import zmq

from mpx.config import Config

# How long a wait blocks in libzmq (a receive, a poll) before it looks at its exits again.
POLL_MS = 20


class Contexts:
    """The ZeroMQ context that a process's queue ends share, so that one I/O thread carries
    a process's sends and receives: a worker's calls in and its replies out, a driver's
    calls out and its replies in (with a context per end, each message woke a second I/O
    thread: ~0.4 more thread wake-ups per call on each side, ~20% of a no-op's round trip).

    Each end takes a context when it is made and gives it back once its sockets are closed;
    the last one out terminates it. The shared context serves one writer at a time, and a
    second live writer of the process (a queue re-formed beside the old one, a test's
    several queues) gets a context of its own, terminated when it closes."""

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


CONTEXTS = Contexts()
os.register_at_fork(after_in_child=CONTEXTS.forget)


def inherited(taken_in: int) -> bool:
    """Whether an end made in process ``taken_in`` is closed in another, a fork's child: it
    must then leave its sockets alone. A send or a monitor's teardown there posts to the
    parent's I/O thread through a mailbox whose lock that thread may have held at the fork
    (the child then waits forever), and terminating the inherited context waits for an I/O
    thread that is not there. pyzmq's close() already does nothing in such a child; the
    descriptors go with the child."""
    return taken_in != os.getpid()


def configure(sock: zmq.Socket, config: Config) -> None:
    """The options every socket of a queue end sets: no linger, TCP keepalive."""
    # TCP keepalive, not ZMTP heartbeats: libzmq 4.3 aborts (session_base.cpp:233) when a
    # heartbeat meets a full pipe, which ROUTER_MANDATORY with a small HWM makes routine.
    idle = max(1, int(config.heartbeat_s))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, idle)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
