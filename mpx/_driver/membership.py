"""Who is in the group: the one owner of an executor's membership.

``Membership`` owns which ranks exist and what each one is now: this node's worker
processes (``LocalWorkers``), each rank's incarnation (which of its processes is the current
one), restarts and deaths, the ``torch.distributed`` port of the workers' init method, and
the queues that reach them (the broadcast queue, a response queue per rank). Restart and
resize are its operations (their steps are in mpx/_driver/regroup.py, which calls the
methods below); nothing else writes its state.

Threads and locks:

- ``regroup_lock`` is held by the one re-forming under way for the whole of it: a restart
  (the ``mpx-restarter`` thread, mpx/_driver/regroup.py) or a resize (its caller's thread).
  The death watch never takes it, and never waits for anything that holds it.
- ``lock`` (re-entrant) is held to change the membership in one step (``swap``: the call
  table's ends and sizes, the per-rank counters, the size) and to read it whole
  (``view``, the stats snapshot, the Prometheus collector): the readers see one membership,
  never half of two. It is held for field updates and reads only: never while waiting for
  a process or a queue, never while user code runs.
- Nesting, outermost first: ``regroup_lock`` -> ``lock`` -> the call table's ``order`` ->
  its ``lock`` (mpx/_driver/calls.py). No thread takes them in another order.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Any, NamedTuple

from mpx._driver import lockorder
from mpx._node.local_workers import LocalWorkers
from mpx._procinfo import reserve_tcp_port

if TYPE_CHECKING:
    from mpx._driver.calls import CallTable
    from mpx._node.leader import Leader
    from mpx.queue import MessageQueue


class View(NamedTuple):
    """One membership, read whole: the size, and per rank its pid (None while unknown),
    whether it runs, and how often its process was found dead."""

    world_size: int
    pids: tuple[int | None, ...]
    alive: tuple[bool, ...]
    deaths: tuple[int, ...]


class Membership:
    """The ranks of one executor's group (see the module docstring)."""

    def __init__(self, world_size: int) -> None:
        self.regroup_lock = lockorder.lock("Membership.regroup_lock", lockorder.REGROUP)
        self.lock = lockorder.rlock("Membership.lock", lockorder.MEMBERSHIP)
        self._world_size = world_size
        self.workers: LocalWorkers | None = None
        self.leader: Leader | None = None
        self.broadcast: MessageQueue | None = None
        self.resp: list[MessageQueue] = []
        # The port of the workers' distributed_init_method, held until shutdown: rank 0's
        # TCPStore binds it whenever the workers init torch.distributed, and until then no
        # one else may take it (reserve_tcp_port).
        self._dist_port: socket.socket | None = None
        self.dist_method = ""
        self._deaths = [0] * world_size       # per rank: its processes found dead (stats)
        self._restarts = [0] * world_size     # per rank: how many times it was restarted
        # Each process a rank ever had is numbered apart, across the group's life (a rank
        # that left and came back by resizes too): a report about a process names its
        # number, and a report about one that is no longer current is stale.
        self._incarnation = {rank: rank for rank in range(world_size)}  # per rank: now
        self._read = list(range(world_size))  # per rank: the process whose queue is read
        self._next_incarnation = world_size
        self._dead: set[int] = set()          # ranks found dead and not yet replaced
        self._stopped = False                 # the workers were stopped: none runs

    # ------------------------------------------------------------------ reading

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def procs(self) -> list[Any]:
        """This node's worker processes, by rank (a grown rank's before the swap too)."""
        return self.workers.procs if self.workers is not None else []

    @property
    def pids(self) -> list[int]:
        """Every worker's pid by rank (those of follower nodes as they reported)."""
        remote = self.leader.pids if self.leader is not None else {}
        return [p.pid for p in self.procs][:self._world_size] + [remote[r] for r in sorted(remote)]

    @property
    def workers_stopped(self) -> bool:
        """Whether the workers are being stopped (``stopped``): none runs, none restarts."""
        return self._stopped

    def is_local(self, rank: int) -> bool:
        """Whether ``rank`` runs on this node (else on a follower node)."""
        return rank < len(self.procs)

    def incarnation(self, rank: int) -> int:
        """The number of ``rank``'s current process (see ``__init__``)."""
        return self._incarnation[rank]

    def incarnations(self) -> list[int]:
        """The number of each rank's current process, by rank."""
        with self.lock:
            return [self._incarnation[r] for r in range(self._world_size)]

    def restarts(self, rank: int) -> int:
        return self._restarts[rank]

    def read_incarnation(self, rank: int) -> int:
        """Which of ``rank``'s processes answers on the response queue the call table reads
        now (until the swap, the one that died, while its successor starts)."""
        return self._read[rank]

    def is_current(self, rank: int, incarnation: int) -> bool:
        """Whether ``rank`` is in the group and its process number ``incarnation`` is the
        current one: a report about any other is stale."""
        return rank < self._world_size and self._incarnation.get(rank) == incarnation

    def alive(self) -> list[bool]:
        """Per rank, whether its worker runs: not found dead, not stopped, and (a local
        one) its process not exited. Never waits."""
        with self.lock:
            n = self._world_size
            if self._stopped:
                return [False] * n
            procs = self.procs
            return [r not in self._dead and (r >= len(procs) or procs[r].exitcode is None)
                    for r in range(n)]

    def view(self) -> View:
        """The membership now, read whole (under ``lock``)."""
        with self.lock:
            pids = self.pids
            n = self._world_size
            return View(n, tuple(pids[r] if r < len(pids) else None for r in range(n)),
                        tuple(self.alive()), tuple(self._deaths[:n]))

    # ------------------------------------------------------------------ writing

    def started(self, workers: LocalWorkers) -> None:
        """This node's first worker processes (at start)."""
        with self.lock:
            self.workers = workers

    def led(self, leader: Leader) -> None:
        """The follower nodes' leader (at a multi-node start)."""
        with self.lock:
            self.leader = leader

    def attached(self, resp: list[MessageQueue]) -> None:
        """Every rank's response queue (at start)."""
        with self.lock:
            self.resp = resp

    def reserve_init_method(self, host: str) -> str:
        """A new ``distributed_init_method`` on ``host`` (a new port, held until the next
        one or shutdown); the workers started from now on get it, and a forked worker
        closes the port's socket at once."""
        with self.lock:
            if self._dist_port is not None:
                self._dist_port.close()
            self._dist_port = reserve_tcp_port(host)
            self.dist_method = f"tcp://{host}:{self._dist_port.getsockname()[1]}"
            if self.workers is not None:
                self.workers.keep_fds = (self._dist_port.fileno(),)
            return self.dist_method

    def dist_port_fd(self) -> int:
        assert self._dist_port is not None
        return self._dist_port.fileno()

    def found_dead(self, rank: int) -> None:
        """``rank``'s current process was found dead, not stopped by mpx: counted once."""
        with self.lock:
            if not self._stopped and rank < self._world_size and rank not in self._dead:
                self._dead.add(rank)
                self._deaths[rank] += 1

    def may_restart(self, rank: int, max_restarts: int) -> bool:
        """Whether ``rank`` is started again in place after its death (while it has
        restarts left and the workers are not being stopped)."""
        return not self._stopped and rank < self._world_size and \
            self._restarts[rank] < max_restarts

    def count_restart(self, rank: int) -> int:
        """``rank`` is started once more: one restart used, and what is reported of its
        process so far is stale. Its restart number (its new process's generation)."""
        with self.lock:
            self._incarnation[rank] = self._new_incarnation()
            self._restarts[rank] += 1
            return self._restarts[rank]

    def joining(self, rank: int) -> int:
        """A rank the group grows by gets its first process: its number."""
        with self.lock:
            self._incarnation[rank] = self._new_incarnation()
            return self._incarnation[rank]

    def _new_incarnation(self) -> int:
        self._next_incarnation += 1
        return self._next_incarnation - 1

    def count_startup_death(self, rank: int) -> None:
        """A new process of ``rank`` died before it was ready (stats)."""
        with self.lock:
            self._deaths[rank] += 1

    def set_broadcast(self, broadcast: MessageQueue) -> MessageQueue | None:
        """The broadcast queue of the group being formed (a shutdown from now on tells
        the workers to stop on it); the one before."""
        with self.lock:
            old, self.broadcast = self.broadcast, broadcast
            return old

    def swap(self, calls: CallTable, resp: list[MessageQueue]) -> list[MessageQueue]:
        """The one step that replaces the membership: the call table sends on the broadcast
        queue now set and reads ``resp`` (a rank's queue, by rank), the group has
        ``len(resp)`` ranks, every one running. The response queues no longer read, for the
        caller to close."""
        with self.lock:
            n = len(resp)
            replaced = [q for r, q in enumerate(self.resp) if r >= n or resp[r] is not q]
            assert self.broadcast is not None
            calls.regrouped(self.broadcast, resp)
            old = self.resp
            self.resp = resp
            for counts in (self._deaths, self._restarts, self._read):
                del counts[n:]
                counts.extend([0] * (n - len(counts)))
            for rank in [r for r in self._incarnation if r >= n]:
                del self._incarnation[rank]
            for r in range(n):
                if r >= len(old) or old[r] is not resp[r]:
                    self._read[r] = self._incarnation[r]
            self._dead.clear()
            self._world_size = n
            return replaced

    def stopped(self) -> None:
        """The workers are being stopped: none counts as running, none restarts."""
        with self.lock:
            self._stopped = True

    def release_port(self) -> None:
        with self.lock:
            if self._dist_port is not None:
                self._dist_port.close()
                self._dist_port = None
