"""The wait policy (mpx/mechanism/waiting.py): its constants, pinned; its two builds, which
step the same on the same inputs; the ring ends of both twins, which wait by it; and, across
processes, that a waiter whose yields hand its core away parks at once, and one on a quiet
host yields (the policy's docstring; over ZeroMQ, ZmqReader's)."""

from __future__ import annotations

import importlib
import mmap
import os
import random
import subprocess
import sys
import time
from types import ModuleType

import _builds
import _procs
import pytest

import mpx
from mpx.mechanism import layout, waiting

KEY = "test-key-" + "c" * 20

two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs to pin to")

# The policy's constants. A change to one changes how every waiter waits: make it in
# mpx/mechanism/waiting.py and here, on purpose, with what measured it.
CONSTANTS = {
    "YIELD_STEP_NS": 20_000,
    "WAKE_COST_PRIOR_NS": 50_000,
    "COST_WINDOW": 32,
    "PARK_WAITS_MIN": 256,
    "PARK_WAITS_MAX": 16_384,
    "COST_WEIGHT": 8,
}

# every field of a waiter's policy
FIELDS = ("spin_ns", "yield_ns", "yield_budget_ns", "yield_cost_ns", "wake_cost_ns",
          "parks_first", "park_waits", "_parked_waits", "_probing", "_window_n",
          "_window_lost_ns")

SPIN, YIELD = 20_000, 200_000


def _compiled_waiting() -> ModuleType:
    if waiting.__file__.endswith(".py"):
        pytest.skip("the policy runs as plain Python in this process (not built, or "
                    "MPX_PURE_PYTHON=1)")
    return waiting


def _plain_waiting() -> ModuleType:
    return _builds.plain("mpx.mechanism.waiting")


def _ring_reader(mod: ModuleType, made: list):
    """A reader end of ring module ``mod`` (with its writer), released by the caller."""
    mm = mmap.mmap(-1, layout.segment_size(256, 4, 1))
    layout.init_header(mm, 256, 4, 1, 1234, os.getpid())
    kw = dict(spin_ns=SPIN, yield_ns=YIELD, poll_ns=20_000_000)
    w = mod.RingWriter(mm, **kw)
    r = mod.RingReader(mm, 0, **kw)
    made.append((mm, w, r))
    return r


@pytest.fixture
def ring_readers():
    """Reader ends of the compiled ring (where this process can load it) and of its pure
    twin, over the policy this process loaded."""
    made: list = []
    mods = [importlib.import_module("mpx._ring_py")]
    if not waiting.__file__.endswith(".py"):
        mods.insert(0, pytest.importorskip("mpx._ring"))
    yield {m.IMPLEMENTATION: _ring_reader(m, made) for m in mods}
    for mm, w, r in made:
        r.release()
        w.release()
        mm.close()


@pytest.fixture(params=["compiled", "plain", "compiled ring", "pure ring"])
def waiter(request, ring_readers):
    """A waiter of each kind: the policy compiled or plain, and the ring ends of both
    twins."""
    if request.param == "compiled":
        return _compiled_waiting().AdaptiveWait()
    if request.param == "plain":
        return _plain_waiting().AdaptiveWait()
    impl = "cython" if request.param == "compiled ring" else "python"
    if impl not in ring_readers:
        pytest.skip("the compiled ring is not loaded in this process")
    return ring_readers[impl]


def test_the_constants_are_pinned_in_both_builds():
    for build in (_plain_waiting(), waiting):
        assert build.constants() == CONSTANTS, build.__file__
    plain = _plain_waiting()
    assert {name: getattr(plain, name) for name in CONSTANTS} == CONSTANTS


def _toward_zero(a: int, b: int) -> int:
    return -(-a // b) if a < 0 else a // b


def test_a_waiter_steps_as_the_policy_says(waiter):
    """The policy's story, told to each kind of waiter, with what each step must leave
    (from CONSTANTS): the running means, the window that judges the host quiet or crowded,
    the span of waits that park at once and its doubling, and the yield budget."""
    c = CONSTANTS
    w = waiter
    w._init_waiting(SPIN, YIELD)
    assert (w.spin_ns, w.yield_ns, w.yield_budget_ns, w.yield_cost_ns) == (SPIN, YIELD, YIELD, 0)
    assert (w.wake_cost_ns, w.park_waits, w.parks_first) == (
        c["WAKE_COST_PRIOR_NS"], c["PARK_WAITS_MIN"], False)
    # the running means move 1/COST_WEIGHT of the way, rounded toward zero (as C divides)
    w._yielded(100)
    assert w.yield_cost_ns == 100 // c["COST_WEIGHT"]
    before = w.yield_cost_ns
    w._yielded(-3)
    assert w.yield_cost_ns == before + _toward_zero(-3 - before, c["COST_WEIGHT"]) != \
        before + (-3 - before) // c["COST_WEIGHT"]
    w._woke(10_000)
    wake = c["WAKE_COST_PRIOR_NS"] + _toward_zero(10_000 - c["WAKE_COST_PRIOR_NS"],
                                                  c["COST_WEIGHT"])
    assert w.wake_cost_ns == wake
    # a window of waits that yields found in time: the host is quiet
    for n in range(1, c["COST_WINDOW"]):
        w._judge(0)
        assert w._window_n == n
    w._judge(wake)  # (late by a wake: no loss)
    assert (w._window_n, w._window_lost_ns, w.parks_first) == (0, 0, False)
    assert not w._skips_yield()
    # one yield that found its message late by more than a window of wakes: crowded at once
    late = wake + c["COST_WINDOW"] * wake + 1
    w._judge(late)
    assert (w.parks_first, w._parked_waits, w._window_n, w._window_lost_ns) == (True, 0, 0, 0)
    # the span parks at once; the wait after it yields again, judging anew; still crowded:
    # the span doubles, up to PARK_WAITS_MAX, where it stays
    span = c["PARK_WAITS_MIN"]
    for _ in range((c["PARK_WAITS_MAX"] // span).bit_length() + 1):  # (one more at the max)
        assert all(w._skips_yield() for _ in range(span))
        assert not w._skips_yield()
        assert (w.parks_first, w._probing) == (False, True)
        w._judge(late)
        assert w.park_waits == min(2 * span, c["PARK_WAITS_MAX"]) and w.parks_first
        span = w.park_waits
    assert span == c["PARK_WAITS_MAX"]
    # a window yielding that finds the host quiet again resets the span
    assert all(w._skips_yield() for _ in range(span)) and not w._skips_yield()
    for _ in range(c["COST_WINDOW"]):
        w._judge(0)
    assert (w.park_waits, w.parks_first, w._probing) == (c["PARK_WAITS_MIN"], False, False)
    # the yield budget: halved by a wait longer than the window, grown back by one that a
    # full yield phase would have ended (twice, plus YIELD_STEP_NS, up to yield_ns)
    w._adapt(SPIN + YIELD + 1, True)
    w._adapt(SPIN + YIELD + 1, False)
    assert w.yield_budget_ns == YIELD // 4
    w._adapt(1000, False)
    assert w.yield_budget_ns == YIELD // 4
    budgets = [w.yield_budget_ns]
    while budgets[-1] < YIELD:
        w._adapt(1000, True)
        budgets.append(w.yield_budget_ns)
    assert budgets == [YIELD // 4, 2 * (YIELD // 4) + c["YIELD_STEP_NS"], YIELD], budgets


def _script(seed: int, n: int) -> list[tuple]:
    """``n`` steps of a waiter's life, at random (``seed``): yields, wakes, judgements,
    waits that park, and runs of waits."""
    rnd = random.Random(seed)
    steps: list[tuple] = []
    for _ in range(n):
        step = rnd.choice(["_yielded", "_woke", "_judge", "_judge", "_adapt", "_skips_yield"])
        if step == "_adapt":
            steps.append((step, rnd.choice([10, SPIN + YIELD, SPIN + YIELD + 1, 10**9]),
                          rnd.random() < 0.5))
        elif step == "_skips_yield":
            steps.append((step,) * rnd.choice([1, 1, 40, 300]))
        else:
            steps.append((step, rnd.choice([-7, 0, 1, 999, 60_000, 3_000_000, 10**8])
                          + rnd.randrange(-5000, 5000)))
    return steps


def _run(w, steps: list[tuple]) -> list[tuple]:
    """What each step returned, and every field after it."""
    w._init_waiting(SPIN, YIELD)
    out = []
    for step in steps:
        if step[0] == "_skips_yield":
            got = [w._skips_yield() for _ in step]
        else:
            got = getattr(w, step[0])(*step[1:])
        out.append((got, tuple(getattr(w, f) for f in FIELDS)))
    return out


def test_both_builds_and_both_ring_twins_step_alike(ring_readers):
    """The same random scripts leave the same fields after every step in the policy
    compiled and plain, and in the ring ends of both twins: one policy, no branch of a
    build of its own (C's int64 arithmetic in both)."""
    waiters = {"plain": _plain_waiting().AdaptiveWait(), "loaded": waiting.AdaptiveWait(),
               **{f"ring {impl}": r for impl, r in ring_readers.items()}}
    for seed in range(4):
        steps = _script(seed, 3000)
        runs = {name: _run(w, steps) for name, w in waiters.items()}
        for name, run in runs.items():
            for i, (a, b) in enumerate(zip(runs["plain"], run)):
                assert a == b, (seed, name, i, steps[i])
        # (the scripts reach both judgements and a doubled span)
        assert any(fields[5] for _, fields in runs["plain"])
        assert max(fields[6] for _, fields in runs["plain"]) > CONSTANTS["PARK_WAITS_MIN"]


def test_the_ring_ends_of_both_twins_are_waiters_of_the_one_policy(ring_readers):
    """Both twins' ends inherit the policy this process loaded, start from its constants,
    and their wait loops run its steps: a reader judged crowded parks at once (it does not
    yield, and counts the wait in its span), and a long wait halves its yield budget."""
    for impl, r in ring_readers.items():
        assert isinstance(r, waiting.AdaptiveWait), impl
        assert (r.wake_cost_ns, r.park_waits, r.yield_budget_ns, r.parks_first) == (
            CONSTANTS["WAKE_COST_PRIOR_NS"], CONSTANTS["PARK_WAITS_MIN"], YIELD, False), impl
        # (nothing comes; the deadline well past the yield phase, even on a loaded host)
        st, _, _ = r.read(time.monotonic_ns() + 50_000_000)
        assert st == layout.TIMEOUT
        assert r.yield_cost_ns > 0 and r.yield_budget_ns == YIELD // 2, impl  # (it yielded)
        r._init_waiting(SPIN, YIELD)
        r._judge(10**9)
        assert r.parks_first, impl
        st, _, _ = r.read(time.monotonic_ns() + 5_000_000)
        assert st == layout.TIMEOUT
        assert (r.yield_cost_ns, r._parked_waits, r.yield_budget_ns) == (0, 1, YIELD // 2), impl


def _busy_loops(n, cpu):
    """``n`` busy-loop processes pinned to ``cpu``, killed with this process."""
    code = ("import ctypes, os, signal; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
            f"os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass")
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def _stop(loops):
    for p in loops:
        p.kill()
        p.wait()


@two_cpus
@pytest.mark.parametrize("remote", [False, True], ids=["shm", "zmq"])
def test_a_reader_on_a_crowded_core_parks_first_and_yields_again_once_it_is_quiet(impl, ctx, remote):
    """The reader (this thread) shares its CPU with two busy loops, the writer (a child
    process on the other CPU) sends a message every millisecond: each yield returns a time
    slice late, so the reader learns that a wake costs less and parks at once. Once the
    loops are gone, a window of yielding finds quick yields, and it yields again. The same
    over ZeroMQ, whose reader judges by how long the yield took that found the message."""
    cpu_a, cpu_b = sorted(os.sched_getaffinity(0))[:2]
    # (a wide window: each message is found yielding)
    cfg = mpx.Config(spin_us=0, yield_us=50_000, **(dict(auth_key=KEY, heartbeat_s=5.0)
                                                    if remote else {}))
    if remote:
        w, conn = _procs.start(ctx, _procs.paced_remote_writer, cfg, cpu_b, 0.001, 0.0)
    else:
        w, conn = _procs.start(ctx, _procs.paced_writer, cpu_b, 0.001, 0.0)
    mine = os.sched_getaffinity(0)
    loops = []
    q = mpx.MessageQueue.create_from_handle(conn.recv(), 0, config=cfg)
    ring = q.reading_end() if remote else q.reading_end()._ring
    try:
        q.wait_until_ready(10)
        assert not ring.parks_first
        loops = _busy_loops(2, cpu_a)
        os.sched_setaffinity(0, {cpu_a})  # (this thread)
        for _ in range(1000):
            q.dequeue(timeout=10)
            if ring.parks_first:
                break
        assert ring.parks_first, (ring.yield_cost_ns, ring.wake_cost_ns)
        _stop(loops)
        yielding = 0  # reads in a row since it last parked first
        for _ in range(5000):  # a span parked (256 waits), then a window yielding (32)...
            q.dequeue(timeout=10)
            yielding = 0 if ring.parks_first else yielding + 1
            if yielding > 64:  # ...which it kept: it yields again
                break
        assert yielding > 64, (ring.yield_cost_ns, ring.wake_cost_ns)
    finally:
        os.sched_setaffinity(0, mine)
        _stop(loops)
        conn.send("stop")
        q.close()
        w.join(10)
        conn.close()


@two_cpus
def test_a_reader_whose_yields_run_the_writers_work_keeps_yielding(impl, ctx):
    """The reader (this thread) and the writer share one CPU and nothing else runs there:
    each of the reader's yields hands the core to the writer, which works 2 ms on the
    message and publishes it. The yields return milliseconds later, but never late after
    the message was published: the reader does not take the host for crowded."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    w, conn = _procs.start(ctx, _procs.paced_writer, cpu, 0.0005, 0.002)
    mine = os.sched_getaffinity(0)
    q = mpx.MessageQueue.create_from_handle(conn.recv(), 0, config=mpx.Config(
        spin_us=0, yield_us=50_000))
    ring = q.reading_end()._ring
    try:
        q.wait_until_ready(10)
        os.sched_setaffinity(0, {cpu})
        run = longest = 0  # reads in a row that did not park first (a rule that judged
        costliest = 0      # a yield by its length would park first from the first)
        for _ in range(1000):
            q.dequeue(timeout=10)
            run = 0 if ring.parks_first else run + 1
            longest = max(longest, run)
            costliest = max(costliest, ring.yield_cost_ns)
            if longest > 64:
                break
        assert longest > 64, (ring.yield_cost_ns, ring.wake_cost_ns)
        # (the last yields may have met the writer asleep; some ran its work)
        assert costliest > 100_000, "the yields ran the writer's work"
    finally:
        os.sched_setaffinity(0, mine)
        conn.send("stop")
        q.close()
        w.join(10)
        conn.close()
