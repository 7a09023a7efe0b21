"""The exceptions mpx raises.

Each one subclasses the builtin that callers already catch (``RuntimeError``,
``TimeoutError``, ``ValueError``...) and :class:`MpxError`, so ``except mpx.MpxError``
catches everything mpx raises on purpose.
"""

from __future__ import annotations


class MpxError(Exception):
    """Base class of every error mpx raises on purpose."""


class Cancelled(MpxError, RuntimeError):
    """A wait was ended by ``shutdown()`` or by a cancel event."""


class QueueTimeout(MpxError, TimeoutError):
    """A queue operation did not complete before its deadline."""


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
