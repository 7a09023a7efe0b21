"""The leader: the driver's side of a multi-node group (runs in the driver process).

The leader binds a ROUTER on ``master_addr:master_port``. Each follower (``python -m mpx
node``, see :mod:`mpx._node.follower`) connects and introduces itself; a follower joins
only by signing a fresh nonce from the leader, so a replayed hello is useless. A node joins
once: a second follower for a joined node (the first died, and its launcher started
another) is refused and the node counted lost, and so is a node rank beyond nnodes; but
a node lost whose ranks have restarts left may be joined again (``await_rejoin``: the
executor restarts its ranks so). The leader sends each follower the worker class, kwargs,
config and the broadcast queue's handle, collects its workers' response-queue handles,
then watches it: each side probes the other over UDP (:mod:`mpx._node.liveness`), and a
node silent for ``Config.link_grace`` is lost; the follower tells it of its workers'
deaths, and starts a rank again when asked (``restart_rank``).

Threads: during startup the caller of ``admit`` and ``collect`` uses the control socket
and the probes; after it, the node monitor's watch thread (``poll``) alone. Other threads
ask through it: ``stacks`` (Executor.dump_stacks), ``restart_rank`` and ``await_rejoin``
(the restarter) leave their asks under ``_dumps_lock`` and wait on its condition, which
the watch thread notifies with the answers and ``stop`` with the end. ``lost`` is added to
by the watch thread and by a queue end's thread that found a node's link gone
(``lost_error``); nothing waits under the lock.

A control frame sealed under another key (a node started with another ``MPX_AUTH_KEY``) is
answered with ``control.BAD_KEY`` and nothing else, and its sender's address is kept for
the startup error: the leader goes on waiting for a follower with the right key, and if
none comes in time it says that a node with another key tried to join, and from where.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from mpx import _addresses
from mpx._node import control
from mpx._node.liveness import LEADER, Probes
from mpx._procinfo import describe_exit
from mpx.config import Config
from mpx.errors import ExecutorFailed, NodeLostError, WorkerDiedError, WorkerStartupError
from mpx.protocol import wire

logger = logging.getLogger("mpx")

# How many addresses of nodes with another key the startup error names (a stranger may try
# from many).
BAD_KEY_ADDRESSES = 4
# How long a worker death reported by a follower waits for the launcher to say whether the
# whole node is going (its Ray actor being killed takes its workers first).
GONE_CHECK_WAIT_S = 1.0


class Leader:
    """The driver's side of a multi-node group (used by mpx.Executor when nnodes > 1)."""

    def __init__(self, config: Config, world_size: int) -> None:
        self.config = config
        self.key = config.auth_key.encode()
        self.local = world_size // config.nnodes
        self.sock = control.control_socket(zmq.ROUTER)
        at = f"{config.master_addr}:{config.master_port}"
        try:
            self.sock.bind(f"tcp://{at}")
        except zmq.ZMQError as e:
            self.sock.close(linger=0)
            raise _addresses.bind_failed(
                "Config.master_addr and master_port, MPX_MASTER_ADDR and MPX_MASTER_PORT",
                at, e) from None
        # (a follower that reconnects after its link broke keeps its routing id: the new
        # connection takes the place of the old one, which may not have noticed yet)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            self.probes = Probes(self.key, LEADER, config.master_addr, config.master_port,
                                 config.heartbeat_s)
        except OSError as e:
            self.sock.close(linger=0)
            raise _addresses.bind_failed(
                "Config.master_addr and master_port (UDP, for the liveness probes)", at,
                e) from None
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.probes.fileno(), zmq.POLLIN)
        self.nodes: dict[int, bytes] = {}       # node rank -> routing id
        self.last_seen: dict[int, float] = {}
        self.pids: dict[int, int] = {}          # global rank -> pid
        self.handles: dict[int, Any] = {}       # global rank -> response-queue handle
        self._spec: wire.NodeSpec | None = None
        self._challenges: dict[bytes, tuple[int, bytes]] = {}  # routing id -> (node, nonce)
        self._refused: set[bytes] = set()   # routing ids that may not join (see _join)
        self._unsigned: set[bytes] = set()  # routing ids warned about a failed authentication
        self._bad_key_from: list[str] = []  # addresses of nodes with another key (_unauthentic)
        self._rejoined: list[int] = []      # joined nodes that another follower joined for
        self._strays: list[int] = []        # node ranks outside [1, nnodes) that joined
        self._serving = False  # poll() told the followers that startup is over
        self.lost: set[int] = set()
        # Executor.dump_stacks: a request for the watch thread to send, and the answers
        self._dumps_lock = threading.Lock()  # (entered itself: see mpx/_driver/pump.py)
        self._dumps = threading.Condition(self._dumps_lock)
        self._dump_token = 0
        self._dump_asks: list[wire.DumpStacks] = []
        self._dump_answers: dict[int, dict[int, str]] = {}
        # restart_rank: the asks for the watch thread to send, and the followers' answers
        # (also under _dumps_lock, and notified on _dumps)
        self._restart_asks: list[int] = []
        self._restarted: dict[int, wire.WorkerReady | wire.RestartFailed] = {}
        # await_rejoin: the lost nodes a new follower may join for, and why one could not
        # (also under _dumps_lock)
        self._rejoin: set[int] = set()
        self._rejoin_failed: dict[int, wire.NodeStartupFailed] = {}
        self._stopping = False  # (under _dumps_lock) stop(): those waits end
        # called on every turn of the startup waits: raises when a node can no longer join
        # (the Ray launcher's follower actor died), so startup fails at once
        self.startup_check: Callable[[], None] | None = None
        # launcher="ray": why node n is gone (its actor died) or None, waiting up to the
        # given seconds for the launcher to know
        self.gone_check: Callable[[int, float], str | None] | None = None
        # node n was silent and is heard again: reconnect the links that read from it
        self.heard_again: Callable[[int], None] | None = None

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.local, (node + 1) * self.local))

    def node_of(self, rank: int) -> int:
        """The node that global ``rank`` runs on."""
        return rank // self.local

    def _recv(self, timeout_ms: int) -> tuple[int | None, Any]:
        """(node, message) of the next authenticated message from a joined node. A hello
        gets a fresh nonce to sign back ("join"): a replayed hello or join joins nothing."""
        self.probes.tick()
        ready = dict(self._poller.poll(min(timeout_ms, int(self.probes.wait_s() * 1000) + 1)))
        if self.probes.fileno() in ready:
            for again in self.probes.take():
                if self.heard_again is not None:
                    self.heard_again(again)
        if self.sock not in ready:
            return None, None
        frames = self.sock.recv_multipart(copy=False)
        ident = frames[0].bytes
        if ident in self._refused:
            return None, None
        msg = control.unpack(self.key, frames[-1].bytes) if len(frames) == 2 else None
        if msg is None:
            self._unauthentic(ident, frames[-1])
            return None, None
        node = next((n for n, i in self.nodes.items() if i == ident), None)
        if isinstance(msg, wire.Hello):
            if node is None:  # (a joined follower's repeated hello needs no answer)
                nonce = secrets.token_bytes(16)
                self._challenges[ident] = (msg.node_rank, nonce)
                self.sock.send_multipart([ident, control.pack(self.key, wire.Challenge(nonce))])
            return None, None
        if isinstance(msg, wire.Join):
            if node is not None or not self._join(ident, msg):
                return None, None
            node = msg.node_rank
        if node is not None:
            self.last_seen[node] = time.monotonic()
        return node, msg

    def _unauthentic(self, ident: bytes, frame: zmq.Frame) -> None:
        """A frame from routing id ``ident`` failed authentication. One sealed by an mpx
        node under another key is answered with ``control.BAD_KEY`` (which tells that
        node nothing but that) and its address noted for the startup error; junk is
        dropped. Either way nothing else changes: a follower with the right key still
        joins."""
        where = control.peer_address(frame)
        if not control.sealed_by_mpx(frame.bytes):
            if ident not in self._unsigned:
                self._unsigned.add(ident)
                logger.warning("leader dropped a message from %s that is no mpx control "
                               "message", where)
            return
        self.sock.send_multipart([ident, control.BAD_KEY])
        if ident in self._unsigned:
            return
        self._unsigned.add(ident)
        if where not in self._bad_key_from and len(self._bad_key_from) < BAD_KEY_ADDRESSES:
            self._bad_key_from.append(where)
        logger.warning("leader: a node at %s tried to join with another MPX_AUTH_KEY (its "
                       "message failed authentication): give every node the same key", where)

    def _not_joined_error(self, missing: list[int]) -> WorkerStartupError:
        """The startup error of follower nodes ``missing``, which did not join in time."""
        within = f"within {self.config.startup_timeout_s:g} s (startup_timeout_s)"
        at = f"{self.config.master_addr}:{self.config.master_port}"
        if self._bad_key_from:
            why = (f"; a node with another MPX_AUTH_KEY tried to join from "
                   f"{', '.join(self._bad_key_from)}: give every node the same MPX_AUTH_KEY")
        else:
            why = (f"; none asked to join at {at}: start `python -m mpx node --master-addr "
                   f"{self.config.master_addr} --master-port {self.config.master_port} "
                   f"--node-rank N --nnodes {self.config.nnodes}` on each (with this "
                   f"MPX_AUTH_KEY), and check that it reaches {at}")
        return WorkerStartupError(f"follower nodes {missing} did not join {within}{why}",
                                  [r for n in missing for r in self.node_ranks(n)])

    def _join(self, ident: bytes, msg: wire.Join) -> bool:
        """Whether ``msg`` (from routing id ``ident``, no joined node's) joins its node."""
        if self._challenges.get(ident) != (msg.node_rank, msg.nonce):
            logger.warning("leader dropped a join that answers no challenge")
            return False
        del self._challenges[ident]
        if msg.node_rank in self.nodes:
            with self._dumps_lock:
                again = msg.node_rank in self._rejoin
                self._rejoin.discard(msg.node_rank)
            if again:  # (a lost node, whose ranks are being restarted: await_rejoin)
                logger.warning("leader: a new follower joined for lost node %d", msg.node_rank)
                self.lost.discard(msg.node_rank)
                self.nodes[msg.node_rank] = ident
                self.probes.expect(msg.node_rank, msg.nonce)
                self._send_spec(msg.node_rank)
                return True
            # the follower that joined for this node is gone: taking this one in its place
            # would hide that (and its workers, with their queues, went with it); it asks
            # again, and joins if the node's ranks are restarted (await_rejoin)
            self._rejoined.append(msg.node_rank)
            logger.warning("leader refused a second follower for node %d", msg.node_rank)
            return False
        if not 0 < msg.node_rank < self.config.nnodes:
            self._refused.add(ident)
            self._strays.append(msg.node_rank)
            logger.warning("leader refused node %d: this group has nnodes=%d",
                           msg.node_rank, self.config.nnodes)
            return False
        self.nodes[msg.node_rank] = ident
        self.probes.expect(msg.node_rank, msg.nonce)
        return True

    def _rejoined_error(self, node: int) -> str:
        return (f"node {node} (ranks {self.node_ranks(node)}) lost its follower: another "
                f"follower joined for it (the first died, e.g. killed by the OOM killer, and "
                "its launcher started another)")

    def _send_spec(self, node: int) -> None:
        """Send follower ``node`` what to start."""
        assert self._spec is not None
        # the key never travels: each follower has its own copy; the stats socket is the
        # driver's alone (its directory may not exist on the follower)
        self.send(node, dataclasses.replace(
            self._spec, node_rank=node,
            config=dataclasses.replace(self._spec.config, auth_key="", stats_socket="")))

    def send(self, node: int, msg: Any) -> None:
        self.sock.send_multipart([self.nodes[node], control.pack(self.key, msg)])

    def admit(self, spec: wire.NodeSpec, deadline: float) -> None:
        """Wait for every follower to say hello and send it ``spec`` (its workers then start
        while the leader's own finish theirs: torch.distributed needs all of them at once).
        ``spec.node_rank`` is filled in per node, and the key is taken out of its config."""
        self._spec = spec
        self._wait(deadline, lambda: len(self.nodes) == self.config.nnodes - 1)

    def collect(self, deadline: float) -> dict[int, Any]:
        """The response-queue handles of every follower worker, once all are ready."""
        self._wait(deadline, lambda: len(self.handles) == self.local * (self.config.nnodes - 1))
        return self.handles

    def _wait(self, deadline: float, done: Any) -> None:
        while not done():
            if self.startup_check is not None:
                self.startup_check()
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.config.nnodes)) - set(self.nodes))
                if missing:
                    raise self._not_joined_error(missing)
                late = [r for r in range(self.local, self.local * self.config.nnodes)
                        if r not in self.handles]
                raise WorkerStartupError(f"follower workers {late} did not become ready "
                                         f"within {self.config.startup_timeout_s} s", late)
            node, msg = self._recv(min(control.POLL_MS, int(left * 1000) + 1))
            if self._rejoined:
                n = self._rejoined[0]
                raise WorkerStartupError(self._rejoined_error(n), self.node_ranks(n))
            if self._strays:
                raise WorkerStartupError(
                    f"node {self._strays[0]} asked to join, but node 0 has "
                    f"nnodes={self.config.nnodes} (nodes 0..{self.config.nnodes - 1}): give "
                    "every node the same node count")
            if msg is None or node is None:
                continue
            if isinstance(msg, wire.Join):
                self._send_spec(node)
            elif isinstance(msg, wire.WorkerReady):
                self.handles[msg.rank] = msg.handle
                self.pids[msg.rank] = msg.pid
            elif isinstance(msg, wire.NodeStartupFailed):
                raise WorkerStartupError(f"on node {node}: {msg.message}", msg.ranks,
                                         msg.traceback)

    def poll(self) -> WorkerDiedError | NodeLostError | None:
        """One step of the leader's watch: probes out and in, a failure if one was reported
        or a node was silent for ``Config.link_grace``."""
        if not self._serving:
            # a follower's silence bound is startup_timeout_s until this word, its probes'
            # grace from then on
            self._serving = True
            for n in self.nodes:
                self.send(n, wire.Beat())
        with self._dumps_lock:
            asks, self._dump_asks = self._dump_asks, []
            restarts, self._restart_asks = self._restart_asks, []
        for ask in asks:
            for n in self.nodes:
                self.send(n, ask)
        for rank in restarts:
            self.send(self.node_of(rank), wire.RestartRank(rank))
        node, msg = self._recv(control.POLL_MS)
        if isinstance(msg, (wire.WorkerReady, wire.RestartFailed)) and node is not None:
            if isinstance(msg, wire.WorkerReady):
                self.pids[msg.rank] = msg.pid
            with self._dumps_lock:
                self._restarted[msg.rank] = msg
                self._dumps.notify_all()
        if isinstance(msg, wire.NodeStartupFailed) and node is not None:
            with self._dumps_lock:
                self._rejoin_failed[node] = msg
                self._dumps.notify_all()
        while self._rejoined:
            n = self._rejoined.pop(0)
            if n not in self.lost:
                self.lost.add(n)
                return NodeLostError(self._rejoined_error(n), n, self.node_ranks(n))
        if isinstance(msg, wire.Stacks) and node is not None:
            with self._dumps_lock:
                if msg.token == self._dump_token:
                    self._dump_answers[node] = msg.stacks
                    self._dumps.notify_all()
        if isinstance(msg, wire.NodeLeaving) and node is not None and node not in self.lost:
            return self.lost_error(node, f"its follower stopped: {msg.why}")
        if isinstance(msg, wire.WorkerDead) and node is not None:
            # a whole node going down (Ray kills an actor's children first) can show as
            # its workers dying: ask the launcher before blaming the worker
            lost = self._lost(node, GONE_CHECK_WAIT_S)
            if lost is not None:
                return lost
            return WorkerDiedError(f"worker rank {msg.rank} (pid {msg.pid}) on node {node} died: "
                                   f"{describe_exit(msg.exitcode)}", rank=msg.rank, pid=msg.pid,
                                   exitcode=msg.exitcode)
        for n in list(self.nodes):
            lost = self._lost(n, 0.0)
            if lost is not None:
                return lost
        grace = self.config.link_grace
        for n, seen in list(self.last_seen.items()):
            seen = max(seen, self.probes.heard.get(n, 0.0))
            if n not in self.lost and time.monotonic() - seen > grace:
                self.lost.add(n)
                self.probes.forget(n)
                return NodeLostError(f"node {n} (ranks {self.node_ranks(n)}) sent nothing for "
                                     f"{grace:g} s (link_grace_s): it died or its link was cut",
                                     n, self.node_ranks(n))
        return None

    def restart_rank(self, rank: int, deadline: float) -> tuple[Any, int]:
        """(not the watch thread) Have remote ``rank``'s follower start it again, reading
        the broadcast directly: its response queue's handle and pid once it is ready;
        WorkerStartupError if it could not be started by ``deadline``."""
        with self._dumps_lock:
            self._restarted.pop(rank, None)
            self._restart_asks.append(rank)
            self._dumps.wait_for(lambda: rank in self._restarted or self._stopping,
                                 max(0.0, deadline - time.monotonic()))
            answer = self._restarted.pop(rank, None)
            self._check_stopping()
        if isinstance(answer, wire.WorkerReady):
            return answer.handle, answer.pid
        if answer is None:
            raise WorkerStartupError(f"worker rank {rank} on node {self.node_of(rank)} was "
                                     "not ready again in time (startup_timeout_s)", [rank])
        raise WorkerStartupError(f"on node {self.node_of(rank)}: {answer.message}", [rank],
                                 answer.traceback, exitcode=answer.exitcode)

    def await_rejoin(self, node: int, deadline: float) -> dict[int, tuple[Any, int]]:
        """(not the watch thread) Let a new follower join for lost ``node`` (``python -m mpx
        node`` again, or its launcher's), and wait until it has started every rank of the
        node: ``{rank: (its response queue's handle, pid)}``. WorkerStartupError if none
        did by ``deadline`` (naming what to run), or its workers could not start."""
        ranks = self.node_ranks(node)
        with self._dumps_lock:
            for r in ranks:
                self._restarted.pop(r, None)
            self._rejoin_failed.pop(node, None)
            self._rejoin.add(node)
            self._dumps.wait_for(lambda: self._stopping or node in self._rejoin_failed or all(
                isinstance(self._restarted.get(r), wire.WorkerReady) for r in ranks),
                max(0.0, deadline - time.monotonic()))
            self._rejoin.discard(node)
            self._check_stopping()
            failed = self._rejoin_failed.pop(node, None)
            ready = {r: self._restarted.pop(r, None) for r in ranks}
        if failed is not None:
            raise WorkerStartupError(f"on node {node}: {failed.message}", failed.ranks,
                                     failed.traceback)
        if not all(isinstance(a, wire.WorkerReady) for a in ready.values()):
            raise WorkerStartupError(
                f"node {node} (ranks {ranks}) was lost, and no follower joined for it again "
                f"within {self.config.startup_timeout_s:g} s (startup_timeout_s): start "
                f"`python -m mpx node --master-addr {self.config.master_addr} --master-port "
                f"{self.config.master_port} --node-rank {node} --nnodes {self.config.nnodes}` "
                "there again", ranks)
        return {r: (a.handle, a.pid) for r, a in ready.items()
                if isinstance(a, wire.WorkerReady)}

    def _check_stopping(self) -> None:
        """(under _dumps_lock) ExecutorFailed once stop() has begun."""
        if self._stopping:
            raise ExecutorFailed("the executor is shutting down: its followers were stopped")

    def heard_ago(self, node: int) -> float | None:
        """How long ago follower ``node`` was last heard (a probe or a message), or None."""
        seen = max(self.last_seen.get(node, 0.0), self.probes.heard.get(node, 0.0))
        return time.monotonic() - seen if seen else None

    def lost_error(self, node: int, why: str) -> NodeLostError:
        """The error of follower ``node`` lost for ``why`` (noted: it is reported once by
        the watch; another thread, a queue's end whose peer there is gone, may ask too)."""
        self.lost.add(node)
        return NodeLostError(f"node {node} (ranks {self.node_ranks(node)}) is lost: {why}",
                             node, self.node_ranks(node))

    def _lost(self, node: int, wait_s: float) -> NodeLostError | None:
        if self.gone_check is None or node in self.lost:
            return None
        why = self.gone_check(node, wait_s)
        if why is None:
            return None
        self.lost.add(node)
        return NodeLostError(f"node {node} (ranks {self.node_ranks(node)}) is gone: {why}",
                             node, self.node_ranks(node))

    def stacks(self, timeout: float) -> dict[int, str]:
        """Every follower worker's stacks by rank (see Executor.dump_stacks); ranks of a
        node that does not answer within ``timeout`` get a line saying so."""
        deadline = time.monotonic() + timeout
        with self._dumps_lock:
            self._dump_token += 1
            self._dump_answers = {}
            self._dump_asks.append(wire.DumpStacks(self._dump_token, timeout))
            nodes = list(self.nodes)
            self._dumps.wait_for(lambda: len(self._dump_answers) == len(nodes),
                                 max(0.0, deadline - time.monotonic()))
            answers = dict(self._dump_answers)
        out: dict[int, str] = {}
        for n in nodes:
            out.update(answers.get(n) or {r: f"<no stacks from rank {r}: node {n} did not "
                                           f"answer within {timeout} s>"
                                           for r in self.node_ranks(n)})
        return out

    def stop(self) -> None:
        with self._dumps_lock:
            self._stopping = True
            self._dumps.notify_all()
        for node in self.nodes:
            try:
                self.send(node, wire.StopNode())
            except zmq.ZMQError:
                pass
        self.sock.close(linger=100)
        self.probes.close()
