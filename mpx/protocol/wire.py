"""Every message that crosses a process boundary, defined once.

The driver (``mpx._driver``), the workers (``mpx._worker``), the follower nodes
(``mpx._node``) and ``python -m mpx launch`` (``mpx._cli.launch``) all import this module,
so that each knows what the others send without importing their code. Four channels:

- **Calls and replies** (the hot path, plain tuples: one of scalars only travels as a
  small message, no pickle, where the codec is compiled: ``mpx/protocol/serde.py``). The
  driver broadcasts ``call(...)``, ``regroup(...)`` (the group was re-formed) and
  ``stop(...)`` to every worker; each worker answers every call exactly once, in order,
  with a reply ``(seq, status, payload)``: OK with the result, or ERR with
  :func:`error_payload` of what the call raised. A STALL report from the worker's watchdog
  may come before a call's real reply.
- **The ready handshake**: the process that starts a worker gives it a :class:`WorkerSpec`
  (its :class:`WorkerContext` inside); the worker answers over its ready pipe with
  :class:`Ready` or :class:`StartupFailed`.
- **Node control** between the leader (the driver's node) and each follower node, sealed
  with the group's key (``mpx/_node/control.py``): ``Hello`` ... ``StopNode`` below.
- **Launch control** between ``python -m mpx launch`` on node 0 and on every other node,
  sealed the same way: ``LaunchHello``, ``LaunchBeat``, ``JobDone``.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import Any

from mpx.config import Config

# ----------------------------------------------------------------------- calls and replies

# broadcast message tags
CALL = 0  # (CALL, seq, method, args, kwargs, reply_rank[, trace context])
STOP = 1  # (STOP, seq): the worker exits its RPC loop
REGROUP = 2  # (REGROUP, seq, handle, world_size): read the calls from seq on from another queue

# reply status
OK = 0     # payload: the result (None on a rank not asked to reply)
ERR = 1    # payload: error_payload(exception)
STALL = 2  # payload: the watchdog's report (a dict); the call's real reply still follows

PING = "mpx.ping"  # a method every worker answers with its pid (Executor.check_health)


def call(seq: int, method: Any, args: tuple, kwargs: dict | None,
         reply_rank: int | None, trace: dict[str, str] | None = None) -> tuple:
    """The broadcast message of call ``seq``: ``method`` (a name or a callable) with its
    arguments; only ``reply_rank`` (None: every rank) sends its result back. ``trace``: the
    caller's trace context as W3C headers (``traceparent``, ``tracestate``), only when
    tracing (``Config.tracing``): the message then has a seventh field."""
    if trace is None:
        return (CALL, seq, method, args, kwargs, reply_rank)
    return (CALL, seq, method, args, kwargs, reply_rank, trace)


def stop(seq: int) -> tuple:
    """The broadcast message that ends every worker's RPC loop."""
    return (STOP, seq)


def regroup(seq: int, handle: Any, world_size: int) -> tuple:
    """The broadcast message that moves the workers to the broadcast queue of ``handle``
    (the group was re-formed: a rank restarted, or the group was resized to
    ``world_size``): the call ``seq`` and those after it come there; a worker whose rank is
    not below ``world_size`` leaves the group (exits as at STOP)."""
    return (REGROUP, seq, handle, world_size)


def error_payload(exc: BaseException) -> tuple[str, str, str]:
    """(type name, message, traceback text) of ``exc``, as an ERR reply (and a
    StartupFailed) carries it. The driver raises an RPCError (a WorkerStartupError) made
    of them, whose ``__cause__`` is the traceback (``mpx.errors.RemoteTraceback``): the
    worker's frames print above the driver's. The exception itself never travels, so its
    type need not be importable, or its pickle loadable, in the driver."""
    return type(exc).__qualname__, str(exc), "".join(
        traceback.format_exception(type(exc), exc, exc.__traceback__))


# ----------------------------------------------------------------------- the ready handshake

@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """What a worker knows about its place in the group; passed to ``worker_cls(ctx, ...)``.

    ``distributed_init_method`` is a ``tcp://host:port`` the workers can hand to
    ``torch.distributed.init_process_group`` (rank ``rank``, world size ``world_size``):
    the driver holds the port (bound with SO_REUSEADDR, not listening) for the executor's
    life, so that nobody else takes it before rank 0's TCPStore binds it. A rank restarted
    in place, or started by a resize, gets a fresh one (``Executor.distributed_init_method``
    is the current one, for the ranks that were already running).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    distributed_init_method: str
    config: Config
    #: the cluster engine's id of this worker's node: Ray's node id with
    #: ``launcher="ray"``, else ``""``
    node_id: str = ""
    #: how many times this rank was restarted (``Config.max_restarts``): 0 at first start
    generation: int = 0


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process is started with.

    ``handle`` is the broadcast queue's, read as reader ``queue_rank`` (the global rank, or
    the local rank on a follower node that relays). ``worker_cls`` and ``worker_kwargs`` are
    cloudpickled. ``close_fds`` are the starter's pipe ends a forked child must close.
    ``remote_driver``: the driver is on another node, so replies go over ZeroMQ.
    """

    ctx: WorkerContext
    handle: Any
    queue_rank: int
    worker_cls: bytes
    worker_kwargs: bytes
    parent_pid: int
    arm_pdeathsig: bool
    close_fds: tuple[int, ...] = ()
    remote_driver: bool = False


@dataclasses.dataclass(frozen=True)
class Ready:
    """A worker built its object: ``handle`` is its response queue's."""

    handle: Any
    pid: int


@dataclasses.dataclass(frozen=True)
class StartupFailed:
    """A worker could not start: its ``__init__`` (or its setup) raised."""

    exc_type: str
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> StartupFailed:
        return cls(*error_payload(exc))


# ----------------------------------------------------------------------- node control

@dataclasses.dataclass(frozen=True)
class Hello:
    """Follower -> leader: node ``node_rank`` wants to join."""

    node_rank: int
    pid: int


@dataclasses.dataclass(frozen=True)
class Challenge:
    """Leader -> follower: sign this fresh nonce back (a replayed hello joins nothing)."""

    nonce: bytes


@dataclasses.dataclass(frozen=True)
class Join:
    """Follower -> leader: the answer to a Challenge."""

    node_rank: int
    nonce: bytes


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """Leader -> follower: what to start. ``config`` has no key: each node has its own."""

    node_rank: int
    config: Config
    world_size: int
    distributed_init_method: str
    handle: Any
    worker_cls: bytes
    worker_kwargs: bytes


@dataclasses.dataclass(frozen=True)
class WorkerReady:
    """Follower -> leader: global ``rank`` is ready; ``handle`` is its response queue's."""

    rank: int
    handle: Any
    pid: int


@dataclasses.dataclass(frozen=True)
class NodeStartupFailed:
    """Follower -> leader: its workers ``ranks`` could not start."""

    message: str
    ranks: list[int]
    traceback: str


@dataclasses.dataclass(frozen=True)
class Beat:
    """Leader -> follower: the leader's startup is over (from now on the follower judges it
    by its liveness probes, mpx._node.liveness)."""


@dataclasses.dataclass(frozen=True)
class WorkerDead:
    """Follower -> leader: worker ``rank`` exited with ``exitcode`` (negative: -signal)."""

    rank: int
    pid: int
    exitcode: int


@dataclasses.dataclass(frozen=True)
class DumpStacks:
    """Leader -> follower: send every worker's stacks within ``timeout`` seconds."""

    token: int
    timeout: float


@dataclasses.dataclass(frozen=True)
class Stacks:
    """Follower -> leader: the answer to DumpStacks ``token``, by rank."""

    token: int
    stacks: dict[int, str]


@dataclasses.dataclass(frozen=True)
class StopNode:
    """Leader -> follower: stop the workers and exit."""


@dataclasses.dataclass(frozen=True)
class RestartRank:
    """Leader -> follower: start global ``rank`` again (its process died and it has
    restarts left), reading the driver's broadcast directly; answered with WorkerReady, or
    RestartFailed."""

    rank: int


@dataclasses.dataclass(frozen=True)
class RestartFailed:
    """Follower -> leader: ``rank`` could not be started again."""

    rank: int
    message: str
    traceback: str
    exitcode: int | None


@dataclasses.dataclass(frozen=True)
class NodeLeaving:
    """Follower -> leader: the leader was silent past the grace, so this node stops (said
    in case only the leader's direction of the link is cut: then the leader hears it)."""

    why: str


# ----------------------------------------------------------------------- launch control

@dataclasses.dataclass(frozen=True)
class LaunchHello:
    """``mpx launch`` on node ``node_rank`` -> node 0's: I am here; answer with ``nonce``
    (so that a message replayed from another job or node means nothing to me)."""

    node_rank: int
    nonce: bytes


@dataclasses.dataclass(frozen=True)
class LaunchBeat:
    """Node 0's ``mpx launch`` -> another node's: the job still runs."""

    nonce: bytes


@dataclasses.dataclass(frozen=True)
class JobDone:
    """Node 0's ``mpx launch`` -> another node's: the user's program exited with
    ``exit_code``; exit with it too."""

    exit_code: int
    nonce: bytes
