"""A 2-node group across a link that blips, rots and breaks (tests/_netfault.py's forwarder
between this namespace and the follower's; needs root, iproute2 and /dev/net/tun, skipped
otherwise): partitions shorter than the grace are ridden out, a frame altered on the way is
resent, a link that keeps altering frames or stays cut loses the node, named, in both
directions. The ride-out makes 5 partitions in the default run, 50 in the soak
(``pytest -m slow``, ``tox -e soak``)."""

from __future__ import annotations

import contextlib
import os
import time

import _nodes
import pytest
from _netfault import faulty_link
from _procs import wait_gone

import mpx

HEARTBEAT_S = 1.0
GRACE_S = 2 * HEARTBEAT_S  # (link_grace_s's default)


@contextlib.contextmanager
def group_across(link, world=4):
    """(_nodes.group_across, with a first call checked)"""
    with _nodes.group_across(link, HEARTBEAT_S, world=world) as (ex, follower):
        assert ex.collective_rpc("mul", args=(2,)) == [2 * (r + 1) for r in range(world)]
        yield ex, follower


@pytest.fixture
def link():
    with faulty_link(seed=7) as made:
        yield made


def test_partitions_of_half_the_heartbeat_are_ridden_out(link):
    _ride_out(link, 5)


def test_a_follower_with_one_rank_rides_out_partitions_too(link):
    """Its one worker reads the driver directly (no relay): the follower tells it to take
    its link up again when the leader is heard again (LocalWorkers.kick_links). The first
    call of all sent into a cut comes back too (its reply link's reader reconnects before
    the worker's writer took its HELLO: its RESUME joins it)."""
    with _nodes.group_across(link, HEARTBEAT_S, world=2) as (ex, _):
        link.partition(True)
        first = ex.collective_rpc("ident", args=("first",), non_block=True)
        time.sleep(HEARTBEAT_S / 2)
        link.partition(False)
        assert first.result(timeout=10) == ["first", "first"]
    _ride_out(link, 3, world=2)


@pytest.mark.slow
def test_fifty_partitions_of_half_the_heartbeat_are_ridden_out(link):
    _ride_out(link, 50)


def _ride_out(link, rounds, world=4):
    """Partitions of 0.5 x heartbeat_s, during calls and between them, ``rounds`` times: no
    call is lost, doubled or mixed up, and the group never fails. A call sent into the cut
    waits for it to heal and for TCP's retransmission after it (its timer backs off during
    the cut: 0.2, 0.4 s...)."""
    cut = HEARTBEAT_S / 2
    with group_across(link, world) as (ex, _):
        extra = []
        for i in range(rounds):
            t0 = time.monotonic()
            assert ex.collective_rpc("ident", args=(("before", i),)) == [("before", i)] * world
            rtt = time.monotonic() - t0
            pending = ex.collective_rpc("ident", args=(("during", i),), non_block=True)
            link.partition(True)
            t0 = time.monotonic()
            late = ex.collective_rpc("ident", args=(("in the cut", i),), non_block=True)
            time.sleep(cut)
            link.partition(False)
            assert late.result(timeout=10) == [("in the cut", i)] * world
            extra.append(time.monotonic() - t0 - cut - rtt)
            assert pending.result(timeout=10) == [("during", i)] * world
            time.sleep(cut)  # (a cut between calls too)
            link.partition(True)
            time.sleep(cut)
            link.partition(False)
        assert ex.collective_rpc("rank") == list(range(world))
        assert ex.stats().ranks[-1].alive
        # the end of the cut is seen by the probes, which reconnect the links at once (TCP
        # alone would wait for its backed-off retransmission timer): ~0.1 s past the heal
        assert max(extra) < 0.75, extra


def test_a_frame_altered_on_the_way_is_resent_both_ways(link):
    """A byte altered in flight past TCP's checksum fails the frame's HMAC: the reader
    resets its link and the writer resends; the call returns the right result, and the
    driver counts what its links went through."""
    blob = os.urandom(300_000)
    with group_across(link) as (ex, _):
        for direction in ("to_follower", "to_leader"):
            before = link.counters()[direction]["corrupted"]
            link.corrupt(1, direction, min_payload=1000)  # (a data frame's packet)
            assert ex.collective_rpc("ident", args=(blob,), timeout=10) == [blob] * 4
            assert link.counters()[direction]["corrupted"] == before + 1
        links = ex.stats().links
        assert links.integrity_failures >= 1  # a reply frame, read by the driver
        assert links.resumes >= 2             # that reply link, and a call link's reader
        assert ex.collective_rpc("rank") == [0, 1, 2, 3]


def test_a_link_that_keeps_altering_frames_loses_the_node_past_the_grace(link):
    blob = os.urandom(300_000)
    with group_across(link) as (ex, follower):
        link.corrupt(10 ** 9, "to_leader", min_payload=1000)
        t0 = time.monotonic()
        with pytest.raises(mpx.NodeLostError) as ei:
            ex.collective_rpc("ident", args=(blob,), timeout=30)
        took = time.monotonic() - t0
        assert ei.value.node_rank == 1 and ei.value.ranks == [2, 3]
        assert "failed authentication" in str(ei.value)
        assert GRACE_S <= took < GRACE_S + 3, took
        link.reset()


def test_a_timeout_says_what_the_link_is_going_through(link):
    """A call that times out while its node's link is cut, or rots, says so (not "busy");
    after the cut the group goes on."""
    blob = os.urandom(300_000)
    with group_across(link) as (ex, _):
        link.partition(True)
        with pytest.raises(mpx.RPCTimeoutError) as ei:
            ex.collective_rpc("rank", timeout=1.0)
        link.partition(False)
        assert "rank 2 (pid" in str(ei.value) and "on node 1, silent for" in str(ei.value)
        assert "busy" not in str(ei.value)
        assert ex.collective_rpc("rank", timeout=10) == [0, 1, 2, 3]
        link.corrupt(10 ** 9, "to_leader", min_payload=1000)
        with pytest.raises(mpx.RPCTimeoutError) as ei:
            ex.collective_rpc("ident", args=(blob,), timeout=1.0)
        link.reset()
        assert "failing authentication" in str(ei.value), str(ei.value)


def test_a_link_resumes_once_the_rot_stops(link):
    """After a second of frames altered on every resend, the reply links resume once the
    rot stops: each writer lets its reader back in while idle, whichever call of it took
    the readers' HELLOs (its link's thread runs from then)."""
    blob = os.urandom(300_000)
    with group_across(link) as (ex, _):
        link.corrupt(10 ** 9, "to_leader", min_payload=1000)
        with pytest.raises(mpx.RPCTimeoutError):
            ex.collective_rpc("ident", args=(blob,), timeout=1.0)
        link.reset()
        assert ex.collective_rpc("ident", args=(blob,), timeout=10) == [blob] * 4
        assert ex.collective_rpc("rank") == [0, 1, 2, 3]


@pytest.mark.parametrize("direction", ["both", "to_leader", "to_follower"])
def test_a_cut_longer_than_the_grace_loses_the_node(link, direction):
    """A cut, both ways or one, past link_grace_s: NodeLostError naming the node and its
    ranks within the grace and a probe's period; the follower finds the leader silent (or
    is told) and exits, its workers with it."""
    with group_across(link) as (ex, follower):
        remote = ex.worker_pids[2:]
        pending = ex.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0, 1]},
                                    non_block=True)
        link.partition(True, direction)
        t0 = time.monotonic()
        with pytest.raises(mpx.NodeLostError) as ei:
            pending.result(timeout=30)
        took = time.monotonic() - t0
        assert ei.value.node_rank == 1 and ei.value.ranks == [2, 3]
        assert GRACE_S <= took < GRACE_S + 1.0, took
        # (cut one way, the follower may be told to stop, or hear nothing and leave)
        assert follower.wait(GRACE_S + 5) in ((1,) if direction == "both" else (0, 1))
        assert wait_gone(remote, 5) == []
