"""mpx: collective RPC to worker processes over a shared-memory ring (and, later, ZeroMQ).

The public API::

    mpx.Executor          N worker processes called collectively (collective_rpc)
    mpx.WorkerContext     what a worker is told about its rank and group
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
    ExecutorFailed,
    HandleError,
    MpxError,
    NodeLostError,
    PeerDiedError,
    QueueClosedError,
    QueueTimeout,
    RoleError,
    RPCError,
    RPCTimeoutError,
    SerializationError,
    ShmError,
    WorkerDiedError,
    WorkerStartupError,
)
from mpx.executor import Executor
from mpx.futures import RPCFuture
from mpx.queue import Handle, MessageQueue
from mpx.worker import WorkerContext

__version__ = "0.1.0"

__all__ = [
    "Cancelled", "Config", "DeserializationError", "Executor", "ExecutorFailed", "Handle",
    "HandleError", "MessageQueue", "MpxError", "NodeLostError", "PeerDiedError", "QueueClosedError",
    "QueueTimeout", "RPCError", "RPCFuture", "RPCTimeoutError", "RoleError",
    "SerializationError", "ShmError", "WorkerContext", "WorkerDiedError", "WorkerStartupError",
    "ring_implementation", "__version__",
]
