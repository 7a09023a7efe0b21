"""mpx: collective RPC to worker processes over a shared-memory ring (and, later, ZeroMQ).

The public API::

    mpx.MessageQueue      one writer, n readers, broadcast of Python objects
    mpx.Config            every tunable, defaults from MPX_* environment variables
    mpx.ring_implementation()   "cython" or "python"
    errors: mpx.MpxError, Cancelled, QueueTimeout, PeerDiedError, ShmError, HandleError,
            QueueClosedError, RoleError, SerializationError, DeserializationError
"""

from mpx._impl import ring_implementation
from mpx.config import Config
from mpx.errors import (
    Cancelled,
    DeserializationError,
    HandleError,
    MpxError,
    PeerDiedError,
    QueueClosedError,
    QueueTimeout,
    RoleError,
    SerializationError,
    ShmError,
)
from mpx.queue import Handle, MessageQueue

__version__ = "0.1.0"

__all__ = [
    "Cancelled", "Config", "DeserializationError", "Handle", "HandleError", "MessageQueue",
    "MpxError", "PeerDiedError", "QueueClosedError", "QueueTimeout", "RoleError",
    "SerializationError", "ShmError", "ring_implementation", "__version__",
]
