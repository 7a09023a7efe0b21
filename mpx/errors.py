"""The exceptions mpx raises.

Each one subclasses the builtin that callers already catch (``RuntimeError``,
``TimeoutError``, ``ValueError``...) and :class:`MpxError`, so ``except mpx.MpxError``
catches everything mpx raises on purpose.

An error that stands for an exception raised in a worker (:class:`RPCError`,
:class:`WorkerStartupError`) has that exception's traceback, as text, for its
``__cause__`` (a :class:`RemoteTraceback`, which mpx never raises), as CPython's
``concurrent.futures.process`` does: an uncaught one prints the worker's traceback above
the driver's, under "The above exception was the direct cause of the following exception".
"""

from __future__ import annotations

from typing import Any


class RemoteTraceback(Exception):
    """The traceback of an exception raised in another process, as text: the
    ``__cause__`` of the error that stands for it here (never raised itself). Its ``str``
    is the traceback between triple quotes, as CPython's ``concurrent.futures.process``
    shows a worker's; ``tb`` is the traceback as it was formatted there."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb.rstrip()}\n"""'


def _rebuild(cls: type[MpxError], message: str, state: dict[str, Any],
             cause: RemoteTraceback | None = None) -> MpxError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    err.__cause__ = cause
    return err


class MpxError(Exception):
    """Base class of every error mpx raises on purpose.

    Every mpx error pickles with its message and attributes (an engine forwards a worker's
    error to another process), whatever its constructor takes, and with its remote
    traceback (``__cause__``) when it has one; another cause stays behind, as a pickled
    builtin exception's does.
    """

    def __reduce__(self) -> tuple:
        cause = self.__cause__
        if isinstance(cause, RemoteTraceback):
            return (_rebuild, (type(self), str(self), dict(self.__dict__), cause))
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


class Cancelled(MpxError, RuntimeError):
    """A wait was ended by ``shutdown()`` or by a cancel event."""


class QueueTimeout(MpxError, TimeoutError):
    """A queue operation did not complete before its deadline."""


class WaitNudged(QueueTimeout):
    """A reader's wait was ended early by ``nudge()`` (from another thread of its process):
    nothing was consumed, and a message it was in the middle of stays for the next read.
    A QueueTimeout, so that a loop that recomputes its deadline after a timeout (the
    driver's reply reader, when a new call has an earlier deadline) needs no other case."""


class PeerDiedError(MpxError, RuntimeError):
    """The process on the other side of a queue died or closed it.

    ``role`` is ``"writer"`` or ``"reader"``; ``rank`` is the reader rank (None for the
    writer); ``pid`` the peer's process id when known.
    """

    def __init__(self, message: str, *, role: str = "", rank: int | None = None,
                 pid: int | None = None) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.pid = pid


class MessageAbortedError(MpxError, RuntimeError):
    """The writer gave up on a message part way while it was being streamed to this reader
    (``MessageQueue.dequeue_stream``); the next message follows."""


class ShmError(MpxError, OSError):
    """A shared-memory segment could not be created or attached."""


class HandleError(MpxError, ValueError):
    """A queue handle does not match the segment or this version of mpx."""


class QueueClosedError(MpxError, RuntimeError):
    """The queue was used after ``close()``."""


class RoleError(MpxError, RuntimeError):
    """A writer-only method was called on a reader, or the other way round."""


class SerializationError(MpxError, TypeError):
    """An object could not be pickled (raised before anything is sent)."""


class DeserializationError(MpxError, ValueError):
    """A received message could not be unpickled; the queue stays usable."""


class MessageTooLargeError(DeserializationError, MemoryError):
    """A received message of ``nbytes`` that this process could not allocate memory for:
    it was skipped, and the queue reads on from the next message."""

    def __init__(self, message: str, nbytes: int = 0) -> None:
        super().__init__(message)
        self.nbytes = nbytes


class RPCError(MpxError, RuntimeError):
    """A worker method raised (or its call or result could not be (un)pickled).

    ``ranks``: the ranks that failed; ``exc_type``: the remote exception's type name;
    ``exc_message``: its message; ``remote_traceback``: the remote traceback (of the first
    rank) as text, shown by ``str()`` and, when there is one, the ``__cause__`` (a
    :class:`RemoteTraceback`).
    """

    def __init__(self, ranks: list[int], exc_type: str, exc_message: str,
                 remote_traceback: str = "", method: str = "") -> None:
        self.ranks = list(ranks)
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.method = method
        where = f"{method!r} " if method else ""
        text = f"{where}failed on rank(s) {self.ranks}: {exc_type}: {exc_message}"
        if remote_traceback:
            text += f"\n\nRemote traceback (rank {self.ranks[0]}):\n{remote_traceback.rstrip()}"
            self.__cause__ = RemoteTraceback(remote_traceback)
        super().__init__(text)


class RPCTimeoutError(MpxError, TimeoutError):
    """A collective RPC did not complete in time; ``ranks`` have not answered."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = list(ranks)


class WorkerStalledError(RPCTimeoutError):
    """A call timed out (or ``check_health`` found) ranks alive but stalled: stuck in a
    call past the watchdog timeout, or stopped (SIGSTOP). ``stalls`` maps each stalled
    rank to what is known: method, seconds, top frames (``stack``), pid, dump file."""

    def __init__(self, message: str, ranks: list[int], stalls: dict[int, dict]) -> None:
        super().__init__(message, ranks)
        self.stalls = stalls


class ReplyLostError(MpxError, RuntimeError):
    """A call's reply from ``rank`` was read and lost: an interrupt (Ctrl-C) came between
    the driver's read and its record. That call fails; the executor goes on."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class ExecutorFailed(MpxError, RuntimeError):
    """The executor can no longer serve calls (a worker or node was lost)."""


class NotOwnerError(MpxError, RuntimeError):
    """An executor or its future was used in a process other than the one that created it
    (a forked child): it serves only its creator; create another executor in this process."""

    @classmethod
    def of(cls, what: str, owner: int, here: int) -> NotOwnerError:
        """The error of a use of ``what``, made by process ``owner``, in process ``here``."""
        return cls(f"{what} belongs to process {owner}, and this is process {here} (a forked "
                   "child?): it serves only the process that created it; create an executor "
                   "in this process instead")


class WorkerDiedError(ExecutorFailed):
    """A worker process died. ``rank``, ``pid`` and ``exitcode`` (negative: -signal)."""

    def __init__(self, message: str, rank: int | None = None, pid: int | None = None,
                 exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.pid = pid
        self.exitcode = exitcode


class NodeLostError(ExecutorFailed):
    """A follower node stopped answering (it died, or its link was cut)."""

    def __init__(self, message: str, node_rank: int, ranks: list[int]) -> None:
        super().__init__(message)
        self.node_rank = node_rank
        self.ranks = list(ranks)


class WorkerStartupError(MpxError, RuntimeError):
    """A worker failed to start: its ``__init__`` raised, it died, or it never became ready.
    ``ranks``: the ranks at fault; for one worker, its ``pid`` and, when it died, its
    ``exitcode`` (negative: -signal). ``remote_traceback``: what ``__init__`` raised, as
    text, and then the ``__cause__`` too (a :class:`RemoteTraceback`)."""

    def __init__(self, message: str, ranks: list[int] | None = None,
                 remote_traceback: str = "", *, pid: int | None = None,
                 exitcode: int | None = None) -> None:
        super().__init__(message)
        self.ranks = list(ranks or [])
        self.remote_traceback = remote_traceback
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)
        self.pid = pid
        self.exitcode = exitcode


class WorkerRestartError(WorkerStartupError, ExecutorFailed):
    """A rank restarted in place (``Config.max_restarts``) could not start again: its
    ``__init__`` raised, it was not ready in time, or it died before it was ready with no
    restart left. The executor has failed with it; ``ranks`` names the rank."""


class ResizeError(MpxError, RuntimeError):
    """``Executor.resize`` could not run now: calls stayed in flight past its timeout, or
    the executor cannot be resized (several nodes). The executor is as it was."""


class SharedTensorGoneError(DeserializationError):
    """A tensor sent with ``mpx.share`` arrived after its segment was unlinked: the sender
    freed the tensor or exited first. ``name`` is the segment's name."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name
