"""mpx: collective RPC to worker processes over a shared-memory ring (local ranks) and
ZeroMQ (remote ranks).

The public API::

    mpx.Executor          N worker processes called collectively (collective_rpc)
    mpx.WorkerContext     what a worker is told about its rank and group
    mpx.MessageQueue      one writer, n readers, broadcast of Python objects
    mpx.Config            every tunable, defaults from MPX_* environment variables
    mpx.ring_implementation()   "cython" or "python"
    mpx.watchdog          feed() and paused() for long calls inside a worker
    mpx.share(tensor)     a CPU tensor in shared memory, sent by reference (mpx/protocol/sharing.py)
    mpx.Stats, RankStats, Latency, LinkStats
                                    Executor.stats()'s snapshot (mpx/_driver/stats.py)
    mpx.metrics.Collector           Prometheus metrics of an executor (imported on demand:
                                    needs prometheus_client, the mpx[metrics] extra)
    Config.tracing                  OpenTelemetry spans per call, into the workers
    errors: mpx.MpxError, Cancelled, QueueTimeout, PeerDiedError, MessageAbortedError,
            ShmError, HandleError, QueueClosedError, RoleError, SerializationError,
            DeserializationError, MessageTooLargeError, SharedTensorGoneError, RPCError, RPCTimeoutError,
            WorkerStalledError, ExecutorFailed, WorkerDiedError, NodeLostError,
            WorkerStartupError, WorkerRestartError, ResizeError, NotOwnerError

Everything else is internal.

One call, end to end (``ex.collective_rpc("execute_model", args=(batch,))``)::

    driver, the caller's thread                 each worker process (mpx/_worker/main.py)
    ---------------------------                 -----------------------------------------
    Executor.collective_rpc (_driver/executor)
      Sender.send (_driver/sender): number it,
        encode (protocol/serde: the small codec
        or pickle 5 + out-of-band buffers),
        register its Call (_driver/registry)
      write to the broadcast queue's writing
        end (queue.py): ShmWriter (transport/
        shm) -> WriterEnd.write (transport/
        shm_end) -> the ring's slots (_ring.pyx);
        wake parked readers              ------>  ring read (park, then woken) -> decode
                                                  -> the method, in the main thread
                                                  -> encode the reply -> the rank's
      ReplyPump.wait (_driver/pump): read the  <------ reply ring (inline, or from the
        reply rings while no other thread does       output thread, _worker/output.py)
        -> decode -> Call.take (_driver/ledger):
        the reply goes to its call by number
      the last reply completes the future
      (_driver/future_core), outside every lock
    <- the results (or aggregator(results))

With ``non_block=True`` the caller returns an ``RPCFuture`` at once; whichever thread reads
next (another caller, the ``mpx-reply-reader`` thread) completes it. Awaited in an event
loop, the loop's own thread reads the replies while it holds the read lease, and the future
wakes its task through ``call_soon_threadsafe`` only when another thread completed it
(mpx/_driver/futures.py, the core's waiters.py). Remote workers are the same path with the
zmq end (transport/zmq_writer.py, zmq_reader.py) in place of the shm end.

Layers, bottom up (each imports only from its own layer and those below; this list holds
every file and package of mpx/, and tests/tree/test_layers.py holds the tree and every import,
``cimport`` included, to it):

    base:       errors.py config.py auth.py dumps.py watchdog.py _addresses.py _units.py
                _procinfo.py _observe.py _debug.py _impl.py _pg.py _interp.py
    mechanism:  _ring.pyx _ring.pxd _ring.pyi _ring_layout.pxi _ring_sync.h _ring_py.py
                mechanism/
    protocol:   protocol/
    transport:  transport/
    queue:      queue.py
    processes:  _driver/ _worker/ _node/
    surface:    metrics.py _cli/ __main__.py

- base: shared by every process: errors, ``Config``, HMAC keys, stack dumps, the
  watchdog's worker-side API, small helpers; ``_impl`` is the one loader of the two builds;
  ``_interp`` names every private part of CPython and its standard library mpx relies on.
- mechanism: the shared-memory ring (compiled, ``_ring.pyx``, and its one deliberate twin
  ``_ring_py.py``, behind one contract); ``mechanism/``: its layout, the wait policy,
  named segments, and serde's compiled codec.
- protocol: every message of a group (``wire``), objects <-> messages (``serde``), tensors
  by reference (``sharing``).
- transport: one Writer/Reader interface; shm (local) and zmq (remote, HMAC-signed) ends.
- queue: ``MessageQueue``, one writer and n readers over the transports.
- processes: the code each kind of process runs: the driver (``Executor`` and what it
  owns), a worker, a node's launcher and the multi-node leader and follower.
- surface: the Prometheus collector and ``python -m mpx``.
"""

# (_impl first: it installs the pure build's finder where MPX_PURE_PYTHON=1)
from mpx import _impl, watchdog  # noqa: F401
from mpx._driver.calls import PendingCalls
from mpx._driver.executor import Executor
from mpx._driver.futures import RPCFuture
from mpx._driver.stats import Latency, LinkStats, RankStats, Stats
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
from mpx.protocol.sharing import share
from mpx.protocol.wire import WorkerContext
from mpx.queue import MessageQueue
from mpx.transport.base import Handle

__version__ = "0.1.0"

__all__ = [
    "Cancelled", "Config", "DeserializationError", "Executor", "ExecutorFailed", "Handle",
    "HandleError", "Latency", "LinkStats", "MessageAbortedError", "MessageQueue", "MessageTooLargeError",
    "MpxError", "NodeLostError",
    "NotOwnerError", "PeerDiedError", "PendingCalls", "QueueClosedError", "QueueTimeout",
    "RankStats", "ReplyLostError", "ResizeError", "RPCError", "RPCFuture", "RPCTimeoutError", "RoleError",
    "SerializationError", "SharedTensorGoneError", "ShmError", "Stats", "WaitNudged",
    "WorkerContext", "WorkerDiedError", "WorkerRestartError", "WorkerStalledError",
    "WorkerStartupError",
    "ring_implementation", "share", "watchdog", "__version__",
]
