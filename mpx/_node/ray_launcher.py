"""The Ray launcher (``Config.launcher = "ray"``): Ray places the nodes, mpx carries the calls.

:class:`RayPlacement` runs in the driver. It connects to Ray (or reuses the connection the
program already made), reserves a placement group with one bundle per node
(``STRICT_SPREAD``; bundle 0 is pinned to the driver's own node through the
``ray.io/node-id`` label), and starts one :class:`FollowerActor` in every other bundle.
Each actor runs mpx's follower (:func:`mpx._node.follower.run_follower`) in its own
process: it starts that node's worker processes (plain processes, not Ray actors), joins
the leader, and from then on everything is as with ``launcher="local"``: shared-memory
rings inside a node, authenticated ZeroMQ between nodes, relays, heartbeats.

The group's key reaches each actor as a constructor argument (it travels over Ray's own
channels, never on a command line); see docs/launchers-ray-slurm.md for what Ray's own
security covers.

``ray`` is imported only here, and only when this launcher is chosen.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from typing import Any

from mpx._procinfo import free_tcp_port
from mpx.config import Config
from mpx.errors import WorkerStartupError

logger = logging.getLogger("mpx")

# The label every Ray node carries with its own id (Ray >= 2.49 sets it on every node).
NODE_ID_LABEL = "ray.io/node-id"
# After the follower nodes were told to stop, how much longer than the workers' own grace
# periods an actor may take to return before it is killed.
ACTOR_STOP_SLACK_S = 2.0


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to get it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("mpx: launcher='ray' (MPX_LAUNCHER=ray) needs Ray; install it with "
                          "pip install 'mpx[ray]' (or pip install ray)") from e
    return ray


class FollowerActor:
    """What runs in each follower node's Ray actor: mpx's follower for node ``node_rank``.

    Everything it needs, the key included, comes through the constructor; :meth:`run`
    blocks until the leader stops the node (0), or fails with the follower's reason."""

    def __init__(self, master_addr: str, master_port: int, node_rank: int, nnodes: int,
                 config: Config) -> None:
        self.args = (master_addr, master_port, node_rank, nnodes)
        self.config = config

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, pid) of this actor."""
        ray = import_ray()
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def run(self) -> int:
        """Run the follower: start this node's workers, serve the leader, return when it
        stops this node. A follower that gives up (no leader) raises RuntimeError."""
        from mpx._node.follower import run_follower

        node_id, ip, _ = self.where()
        cfg = dataclasses.replace(self.config, host=ip)
        try:
            return run_follower(*self.args, cfg, node_id=node_id)
        except SystemExit as e:  # Ray would take it for the actor's intended exit
            raise RuntimeError(f"mpx follower node {self.args[2]}: {e.code}") from None


def _short(resources: dict[str, float]) -> str:
    shown = {k: v for k, v in sorted(resources.items())
             if not k.startswith(("node:", "memory", "object_store_memory", "bundle_group"))
             and "_group_" not in k}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in shown.items()) + "}"


class RayPlacement:
    """The placement group and follower actors of one executor (runs in the driver).

    Construction connects to Ray and waits, until ``deadline`` (``time.monotonic()``), for
    the placement group; it raises WorkerStartupError naming what was asked for and what
    the cluster has when Ray cannot place it in time. ``config`` is the executor's config
    with ``master_addr`` and ``host`` set to the driver node's Ray address and a free
    ``master_port`` there."""

    def __init__(self, config: Config, local_world_size: int, deadline: float) -> None:
        self.ray = ray = import_ray()
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            try:
                ray.init(address=config.ray_address, log_to_driver=True)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise WorkerStartupError(f"launcher='ray': cannot connect to Ray at "
                                         f"ray_address={config.ray_address!r} (MPX_RAY_ADDRESS): "
                                         f"{e}") from e
        self.nnodes = config.nnodes
        self.actors: list[Any] = []
        self.wheres: list[Any] = []  # refs to each actor's where(), asked before run()
        self.runs: list[Any] = []
        self.pg: Any = None
        self.driver_node = ray.get_runtime_context().get_node_id()
        ip = ray.util.get_node_ip_address()
        self.bundle: dict[str, float] = {}
        if config.ray_cpus_per_worker:
            self.bundle["CPU"] = config.ray_cpus_per_worker * local_world_size
        if config.ray_gpus_per_worker:
            self.bundle["GPU"] = config.ray_gpus_per_worker * local_world_size
        self.config = dataclasses.replace(config, master_addr=ip, host=ip,
                                          master_port=free_tcp_port(ip))
        name = f"mpx-{os.getpid()}-{secrets.token_hex(4)}"
        self.pg = placement_group([dict(self.bundle)] * self.nnodes, strategy="STRICT_SPREAD",
                                  name=name, bundle_label_selector=[
                                      {NODE_ID_LABEL: self.driver_node}] + [{}] * (self.nnodes - 1))
        try:
            ray.get(self.pg.ready(), timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            message = self._shortfall(config.startup_timeout_s)
            self.close(0.0)
            raise WorkerStartupError(message, list(range(config.nnodes * local_world_size))) \
                from None
        from ray.util.placement_group import placement_group_table
        where = placement_group_table(self.pg)["bundles_to_node_id"]
        #: Ray's node id of each mpx node, by node rank (node 0: the driver's)
        self.node_ids = [where[i] for i in range(self.nnodes)]
        logger.info("Ray placement group %s: nodes %s", name, self.node_ids)

    def _shortfall(self, waited: float) -> str:
        """What was asked for and what the cluster has (its alive nodes' resources)."""
        ray = self.ray
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        have = "; ".join(f"{n['NodeID'][:12]}{' (the driver)' if n['NodeID'] == self.driver_node else ''}"
                         f" {_short(n.get('Resources', {}))}" for n in nodes)
        return (f"launcher='ray': Ray could not place {self.nnodes} nodes within "
                f"startup_timeout_s={waited:g} s: asked for one bundle {_short(self.bundle)} "
                f"on each of {self.nnodes} distinct nodes (STRICT_SPREAD, node 0 on the "
                f"driver's node {self.driver_node[:12]}); the cluster has {len(nodes)} alive "
                f"node(s): {have}; available now: {_short(ray.available_resources())}")

    def start_followers(self) -> None:
        """One FollowerActor in each bundle but the driver's, each running its node."""
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = ray.remote(FollowerActor)
        cfg = dataclasses.replace(self.config, stats_socket="")  # (the driver's alone)
        for node in range(1, self.nnodes):
            actor = remote.options(
                name=None, max_restarts=0, num_cpus=self.bundle.get("CPU", 0),
                num_gpus=self.bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=node)).remote(
                cfg.master_addr, cfg.master_port, node, self.nnodes, cfg)
            self.actors.append(actor)
            self.wheres.append(actor.where.remote())
            self.runs.append(actor.run.remote())  # an actor runs one call at a time: last

    def check(self) -> None:
        """WorkerStartupError when a follower actor already ended (it could not start, or
        gave up): called while the leader waits for the nodes to join."""
        if not self.runs:
            return
        done, _ = self.ray.wait(self.runs, num_returns=1, timeout=0)
        for ref in done:
            node = self.runs.index(ref) + 1
            try:
                rc = self.ray.get(ref, timeout=1.0)
                why = f"returned {rc} before joining"
            except Exception as e:  # the actor's own error (e.g. ActorDiedError, an import)
                why = f"failed: {type(e).__name__}: {e}"
            raise WorkerStartupError(f"launcher='ray': the follower actor of node {node} "
                                     f"(Ray node {self.node_ids[node][:12]}) {why}", [])

    def gone(self, node: int, wait_s: float) -> str | None:
        """Why node ``node``'s follower actor is gone (killed, or its Ray node lost), or
        None while it runs; waits up to ``wait_s`` for Ray to know."""
        if not 1 <= node <= len(self.runs):
            return None
        ref = self.runs[node - 1]
        done, _ = self.ray.wait([ref], timeout=wait_s)
        if not done:
            return None
        try:
            self.ray.get(ref, timeout=1.0)
        except self.ray.exceptions.RayActorError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return (f"its Ray follower actor died (Ray node {self.node_ids[node][:12]}): "
                    f"{type(e).__name__}: {first}")
        except Exception as e:
            return f"its Ray follower actor failed: {type(e).__name__}: {e}"
        return None  # it returned: the node was told to stop

    def close(self, wait_s: float) -> None:
        """Give the follower actors up to ``wait_s`` to return (their nodes were told to
        stop), then kill them and remove the placement group. Idempotent; logs, never
        raises (Ray may be shutting down too)."""
        ray = self.ray
        try:
            if self.runs and wait_s > 0:
                ray.wait(self.runs, num_returns=len(self.runs), timeout=wait_s)
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group
                remove_placement_group(self.pg)
        except Exception as e:
            logger.warning("could not release the Ray actors and placement group: %s", e)
        self.actors, self.wheres, self.runs, self.pg = [], [], [], None


def close_wait_s(config: Config) -> float:
    """How long :meth:`RayPlacement.close` waits for the actors after their nodes were told
    to stop: their workers' grace periods, and some slack."""
    return config.shutdown_grace_s + config.terminate_grace_s + ACTOR_STOP_SLACK_S

