"""mpx: collective RPC to worker processes over a shared-memory ring (local ranks) and
ZeroMQ (remote ranks).

The public API::

    mpx.Executor          N worker processes called collectively (collective_rpc)
    mpx.WorkerContext     what a worker is told about its rank and group
    mpx.MessageQueue      one writer, n readers, broadcast of Python objects
    mpx.Config            every tunable, defaults from MPX_* environment variables
    mpx.ring_implementation()   "cython" or "python"
    mpx.watchdog          feed() and paused() for long calls inside a worker
    mpx.share(tensor)     a CPU tensor in shared memory, sent by reference (mpx/sharing.py)
    mpx.Stats, RankStats, Latency   Executor.stats()'s snapshot (mpx/_driver/stats.py)
    mpx.metrics.Collector           Prometheus metrics of an executor (imported on demand:
                                    needs prometheus_client, the mpx[metrics] extra)
    Config.tracing                  OpenTelemetry spans per call, into the workers
    errors: mpx.MpxError, Cancelled, QueueTimeout, PeerDiedError, MessageAbortedError,
            ShmError, HandleError, QueueClosedError, RoleError, SerializationError,
            DeserializationError, MessageTooLargeError, SharedTensorGoneError, RPCError, RPCTimeoutError,
            WorkerStalledError, ExecutorFailed, WorkerDiedError, NodeLostError,
            WorkerStartupError, WorkerRestartError, ResizeError, NotOwnerError

Everything else is internal. The tree, bottom up (each layer imports only those below it):

    _ring.pyx, _ring_py.py, layout.py   the shared-memory ring (compiled, and its Python twin),
                                        with the compiled halves of its transport ends
    waiting.py                          the wait policy's choices in Python (yield budget, a
                                        crowded host), for the Python ring and the ZeroMQ reader
    _codec.py (+ .pxd)                  serde's mechanism, compiled from Python (Cython pure mode):
                                        owned message memory, the pickler's sink, the small codec
    segments.py, serde.py, sharing.py   named POSIX segments; objects <-> bytes; tensors by reference
    transport/                          one interface, the channel (send, recv): shm (local)
                                        and zmq (remote) ends
    queue.py                            MessageQueue over the transports
    wire.py, config.py, errors.py,      shared by every process of a group (_observe.py: what
    auth.py, dumps.py, _observe.py      an observer hook raises is logged once, never raised)
    _driver/                            runs in the driver: Executor and what it owns;
                                        future_core.py (+ .pxd), the futures' hot part,
                                        compiled from its one source where it was built,
                                        with the meter that Executor.stats() reads
    metrics.py                          the Prometheus collector (above the driver)
    _worker/                            runs in each worker process
    _node/                              starts a node's workers; multi-node leader/follower
    _cli/                               python -m mpx
"""

from mpx import watchdog
from mpx._driver.calls import PendingCalls
from mpx._driver.executor import Executor
from mpx._driver.futures import RPCFuture
from mpx._driver.stats import Latency, RankStats, Stats
from mpx._impl import ring_implementation
from mpx.config import Config
from mpx.errors import (
    Cancelled,
    DeserializationError,
    ExecutorFailed,
    HandleError,
    MessageAbortedError,
    MessageTooLargeError,
    MpxError,
    NodeLostError,
    NotOwnerError,
    PeerDiedError,
    QueueClosedError,
    QueueTimeout,
    ReplyLostError,
    ResizeError,
    RoleError,
    RPCError,
    RPCTimeoutError,
    SerializationError,
    SharedTensorGoneError,
    ShmError,
    WaitNudged,
    WorkerDiedError,
    WorkerRestartError,
    WorkerStalledError,
    WorkerStartupError,
)
from mpx.queue import MessageQueue
from mpx.sharing import share
from mpx.transport.base import Handle
from mpx.wire import WorkerContext

__version__ = "0.1.0"

__all__ = [
    "Cancelled", "Config", "DeserializationError", "Executor", "ExecutorFailed", "Handle",
    "HandleError", "Latency", "MessageAbortedError", "MessageQueue", "MessageTooLargeError",
    "MpxError", "NodeLostError",
    "NotOwnerError", "PeerDiedError", "PendingCalls", "QueueClosedError", "QueueTimeout",
    "RankStats", "ReplyLostError", "ResizeError", "RPCError", "RPCFuture", "RPCTimeoutError", "RoleError",
    "SerializationError", "SharedTensorGoneError", "ShmError", "Stats", "WaitNudged",
    "WorkerContext", "WorkerDiedError", "WorkerRestartError", "WorkerStalledError",
    "WorkerStartupError",
    "ring_implementation", "share", "watchdog", "__version__",
]
