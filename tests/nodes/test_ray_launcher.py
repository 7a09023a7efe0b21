"""launcher="ray": a Ray placement group places the nodes, mpx carries the calls.

One Ray cluster (ray.cluster_utils.Cluster) for the module: raylets on this machine, all on
127.0.0.1, each a "node" with 2 CPUs; the driver is connected to the head node. Ray's
processes run with a HOME of their own (``ray_loopback_env`` in tests/_ray_env.py), so
that none of them asks the cloud metadata address anything: nothing leaves 127.0.0.1. Skipped when ray is not
installed (pip install 'mpx[ray]').
"""

from __future__ import annotations

import os
import time

import _workers
import conftest
import psutil
import pytest
from _nodes import TESTS
from _procs import wait_gone
from _ray_env import ray_loopback_env

import mpx

# Ray reads this once, at import: with it, a node started without an address and a driver
# connecting to 127.0.0.1 stay on loopback instead of the machine's outward address
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

ROOT = os.path.dirname(TESTS)
CPUS_PER_NODE = 2
# the heartbeat bound of these tests (a lost node is named within it, plus slack)
HEARTBEAT_S = 1.0
# Ray's own processes, by what they run as (cmdline or process title)
RAY_PROCESS_MARKS = ("gcs_server", "raylet", "ray/dashboard", "log_monitor.py", "monitor.py",
                     "runtime_env/agent", "ray::IDLE", "default_worker.py", "ray::core_worker",
                     "ray/_private", "ray::RuntimeEnvAgent", "ray::DashboardAgent")


def _is_rays_own(p: psutil.Process) -> bool:
    """A Ray process (not an actor of ours: those are 'ray::FollowerActor...')."""
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "FollowerActor" not in cmd and any(m in cmd for m in RAY_PROCESS_MARKS)


# mpx puts nothing in Ray's object store: each raylet gets Ray's minimum, not 30% of the
# machine's memory in /dev/shm (which a CI container may not have)
OBJECT_STORE_BYTES = 80 << 20


class RayCluster:
    """The module's cluster: ``nodes`` (not the head) can be removed and added."""

    def __init__(self) -> None:
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=CPUS_PER_NODE, node_ip_address="127.0.0.1", include_dashboard=False,
            object_store_memory=OBJECT_STORE_BYTES))
        self.nodes = [self.add()]
        ray.init(address=self.cluster.address, logging_level="warning")
        self.cluster.wait_for_nodes(timeout=60)

    def add(self):
        return self.cluster.add_node(num_cpus=CPUS_PER_NODE, node_ip_address="127.0.0.1",
                                     object_store_memory=OBJECT_STORE_BYTES)

    def raylet_node_ids(self) -> dict[int, str]:
        """{raylet pid: Ray node id} of every live node."""
        return {n.all_processes["raylet"][0].process.pid: n.node_id
                for n in self.cluster.list_all_nodes()}

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def cluster():
    saved = {"PYTHONPATH": os.environ.get("PYTHONPATH")}
    # the raylets' workers (the follower actors, and the mpx workers they start) import mpx
    # and tests/_workers by name
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS] + ([saved["PYTHONPATH"]]
                                                              if saved["PYTHONPATH"] else []))
    conftest.ALLOWED_CHILDREN.append(_is_rays_own)
    c = None
    try:
        # before the head starts: its dashboard process would otherwise ask the cloud
        # metadata address (169.254.169.254, metadata.google.internal) which cloud it is on
        with ray_loopback_env():
            try:
                c = RayCluster()
                yield c
            finally:
                if c is not None:
                    c.shutdown()
    finally:
        conftest.ALLOWED_CHILDREN.remove(_is_rays_own)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def ray_executor(cluster):
    made = []

    def make(cls=_workers.Echo, world_size=4, nnodes=2, **kw):
        kw.setdefault("heartbeat_s", HEARTBEAT_S)
        kw.setdefault("startup_timeout_s", 60)
        kw.setdefault("ray_cpus_per_worker", CPUS_PER_NODE / (world_size // nnodes))
        ex = mpx.Executor(cls, world_size, nnodes=nnodes, launcher="ray", **kw)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.shutdown()


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        time.sleep(0.1)
    return got


def _actors(ex) -> list:
    """``ex``'s follower actors and their pids (taken before it shuts down)."""
    placement = ex._group.placement
    return [(a, ray.get(w, timeout=30)[2]) for a, w in zip(placement.actors, placement.wheres)]


def _released(actors) -> None:
    """No follower actor (dead to Ray, its process gone) and no placement group left."""
    for actor, pid in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.where.remote(), timeout=30)
        assert wait_gone([pid], 10) == []
    _wait(lambda: all(p["state"] == "REMOVED"
                      for p in ray.util.placement_group_table().values()),
          15, "placement groups were not all removed")


def _ancestry(pid: int) -> list[int]:
    out = []
    try:
        p = psutil.Process(pid)
        while p is not None:
            out.append(p.pid)
            p = p.parent()
    except psutil.Error:
        pass
    return out


def test_ranks_land_on_their_nodes(ray_executor, cluster):
    ex = ray_executor()
    head = ray.get_runtime_context().get_node_id()
    table = next(iter(t for t in ray.util.placement_group_table().values()
                      if t["state"] == "CREATED"))
    assert table["strategy"] == "STRICT_SPREAD"
    assert table["bundles"] == {0: {"CPU": 2.0}, 1: {"CPU": 2.0}}
    assert table["bundles_to_node_id"][0] == head
    got = ex.collective_rpc(_workers.node_of)
    assert [g[:2] for g in got] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert [g[3] for g in got] == ex.worker_pids
    node1 = table["bundles_to_node_id"][1]
    assert node1 != head
    assert [g[2] for g in got] == [head, head, node1, node1]
    # and the process tree agrees: node 0's workers are the driver's children; node 1's are
    # children of the follower actor, itself a worker process of node 1's raylet
    raylets = cluster.raylet_node_ids()
    for rank, _, node_id, pid, ppid in got:
        if rank < 2:
            assert ppid == os.getpid()
        else:
            owners = [raylets[a] for a in _ancestry(pid) if a in raylets]
            assert owners == [node_id], (rank, owners)
    # the key the executor made for itself never shows on any command line
    assert ex.config.auth_key and ex.config.launcher == "ray"
    for p in psutil.process_iter(["cmdline"]):
        assert ex.config.auth_key not in " ".join(p.info["cmdline"] or ())
    remote = ex.worker_pids[2:]
    actors = _actors(ex)
    ex.shutdown()
    assert wait_gone(remote, 10) == []
    _released(actors)


def test_call_forms_errors_and_timeouts(ray_executor):
    ex = ray_executor()
    assert ex.collective_rpc("mul", args=(2,)) == [2, 4, 6, 8]
    assert ex.collective_rpc("mul", args=(1,), unique_reply_rank=3) == 4
    assert ex.collective_rpc("rank", aggregator=sum) == 6
    futs = [ex.collective_rpc("ident", args=(i,), non_block=True) for i in range(20)]
    assert [f.result(timeout=10) for f in futs] == [[i] * 4 for i in range(20)]
    big = bytes(range(256)) * 8192
    assert ex.collective_rpc("ident", args=(big,), unique_reply_rank=2) == big
    with pytest.raises(mpx.RPCError) as ei:
        ex.collective_rpc("fail", kwargs={"ranks": [2]})
    assert ei.value.ranks == [2] and ei.value.exc_type == "ValueError"
    with pytest.raises(mpx.RPCTimeoutError) as ei:
        ex.collective_rpc("sleep", args=(1.0,), kwargs={"ranks": [3]}, timeout=0.3)
    assert ei.value.ranks == [3]
    assert ex.collective_rpc("ident", args=("fresh",)) == ["fresh"] * 4  # late reply dropped
    ex.check_health(timeout=10)
    stacks = ex.dump_stacks(timeout=5)
    assert sorted(stacks) == [0, 1, 2, 3]
    assert not ex.is_failed


def test_follower_actor_killed_is_node_lost(ray_executor):
    ex = ray_executor()
    remote = ex.worker_pids[2:]
    actors = _actors(ex)
    pending = ex.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0, 1, 2, 3]},
                                non_block=True)
    time.sleep(0.2)
    ray.kill(ex._group.placement.actors[0], no_restart=True)
    t0 = time.monotonic()
    with pytest.raises(mpx.NodeLostError) as ei:
        pending.result(timeout=15)
    assert time.monotonic() - t0 < HEARTBEAT_S + 3
    assert ei.value.node_rank == 1 and ei.value.ranks == [2, 3]
    assert "Ray follower actor died" in str(ei.value) or "sent nothing" in str(ei.value)
    assert wait_gone(remote, 10) == []  # the actor's workers die with it
    ex.shutdown()
    _released(actors)


def test_ray_node_removed_is_node_lost(ray_executor, cluster):
    ex = ray_executor()
    remote = ex.worker_pids[2:]
    actors = _actors(ex)
    assert ex.collective_rpc("rank") == [0, 1, 2, 3]
    node = cluster.nodes.pop()
    pending = ex.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0, 1]}, non_block=True)
    t0 = time.monotonic()
    try:
        cluster.cluster.remove_node(node)
        with pytest.raises(mpx.NodeLostError) as ei:
            pending.result(timeout=15)
        assert time.monotonic() - t0 < HEARTBEAT_S + 5  # remove_node itself takes ~1 s
        assert ei.value.node_rank == 1
        assert wait_gone(remote, 10) == []
        ex.shutdown()
        _released(actors)
    finally:
        cluster.nodes.append(cluster.add())
        cluster.cluster.wait_for_nodes(timeout=60)


def test_placement_that_cannot_be_met(cluster):
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerStartupError) as ei:
        mpx.Executor(_workers.Echo, 6, nnodes=3, launcher="ray", startup_timeout_s=3.0,
                     ray_cpus_per_worker=1.0)
    took = time.monotonic() - t0
    assert took < 3.0 + 5
    msg = str(ei.value)
    assert "could not place 3 nodes" in msg and "{CPU: 2}" in msg
    assert "2 alive node(s)" in msg and "STRICT_SPREAD" in msg
    _released([])


def test_single_node_and_gpu_free_bundle(ray_executor):
    ex = ray_executor(world_size=2, nnodes=1, ray_cpus_per_worker=0.5)
    assert ex.collective_rpc("rank") == [0, 1]
    head = ray.get_runtime_context().get_node_id()
    assert {g[2] for g in ex.collective_rpc(_workers.node_of)} == {head}
    ex.shutdown()
    _released([])


def test_config_validates_the_launcher():
    assert mpx.Config().launcher == "local" and mpx.Config().ray_address == "auto"
    with pytest.raises(ValueError, match="launcher"):
        mpx.Config(launcher="slurm")
    with pytest.raises(ValueError, match="ray_gpus_per_worker cannot both be 0"):
        mpx.Config(launcher="ray", ray_cpus_per_worker=0.0)
    assert mpx.Config.from_env({"MPX_LAUNCHER": "ray"}).launcher == "ray"
