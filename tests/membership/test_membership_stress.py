"""The stateful stress test of the group's membership (issue 49): callers, resizers (plain
threads and ``asyncio.to_thread``), a killer that also kills restarted processes while
they start, restart callbacks that raise, ``unique_reply_rank`` racing shrinks, and
snapshots, all at once, in a driver process of its own whose locks check their nesting
order (``MPX_CHECK_LOCKS=1``, mpx/_driver/lockorder.py).

The invariants: every call either returns one result per rank of the membership it went
to (each its own tag) or fails with an error that says why (a dead rank, a rank not in
the group, a resize that could not be made); the executor never fails while restarts are
left; no lock is taken out of order; afterwards nothing is pending, calls work, and
nothing is left in /dev/shm. ``MPX_STRESS_S`` sets how long it runs (tox -e soak: 60 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import _env
import pytest
from _env import START_METHOD

TESTS = _env.TESTS

_SCRIPT = textwrap.dedent("""
    import asyncio, faulthandler, os, random, signal, sys, threading, time
    faulthandler.dump_traceback_later({limit}, exit=True)
    sys.path.insert(0, {tests!r})
    import mpx
    from mpx._driver import lockorder
    from mpx.metrics import Collector
    from _restart_workers import Member, full_answer

    assert lockorder.CHECK, "MPX_CHECK_LOCKS is not on"
    SECONDS = {seconds}
    rnd = random.Random({seed})
    ex = mpx.Executor(Member, 3, max_restarts=10_000, start_method={start!r},
                      max_chunk_bytes=64 << 10, max_chunks=8)
    stop = threading.Event()
    errors = []
    counts = dict(ok=0, died=0, not_in_group=0, resize_refused=0, resized=0, kills=0,
                  callbacks=0, snapshots=0)

    def fail(what, e):
        errors.append(f"{{what}}: {{type(e).__name__}}: {{e}}")
        stop.set()

    def caller(me):
        i = 0
        while not stop.is_set():
            i += 1
            tag = (me, i)
            try:
                if i % 5 == 0:
                    out = ex.collective_rpc("echo", args=(tag,), unique_reply_rank=2,
                                            timeout=60)
                    assert out == (2, tag), out
                elif i % 2:
                    out = ex.collective_rpc("echo", args=(tag,), timeout=60)
                    assert [t for _, t in out] == [tag] * len(out), out
                    assert [r for r, _ in out] == list(range(len(out))), out
                else:
                    out = ex.collective_rpc("echo", args=(tag,), non_block=True).result(60)
                    assert [r for r, t in out] == list(range(len(out))), out
                counts["ok"] += 1
            except mpx.WorkerDiedError as e:
                if isinstance(e, mpx.WorkerRestartError):
                    return fail("caller", e)
                counts["died"] += 1
            except ValueError as e:
                if "unique_reply_rank" not in str(e):
                    return fail("caller", e)
                counts["not_in_group"] += 1
            except BaseException as e:
                return fail("caller", e)

    def resize_to(n):
        try:
            ex.resize(n, timeout=30)
            counts["resized"] += 1
        except (mpx.ResizeError, mpx.WorkerStartupError):
            counts["resize_refused"] += 1  # (a new rank killed while it started, ...)

    def resizer(via_asyncio):
        r = random.Random(rnd.random())
        while not stop.is_set():
            n = r.choice([2, 3, 4])
            try:
                if via_asyncio:
                    asyncio.run(asyncio.to_thread(resize_to, n))
                else:
                    resize_to(n)
            except BaseException as e:
                return fail("resizer", e)
            time.sleep(r.random() * 0.2)

    def killer():
        r = random.Random(rnd.random())
        while not stop.wait(0.1 + r.random() * 0.3):
            try:
                pids = ex.worker_pids()
                rank = r.randrange(len(pids))
                os.kill(pids[rank], signal.SIGKILL)
                counts["kills"] += 1
                if r.random() < 0.3:  # a restart storm: its next process too, as it starts
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline and not stop.is_set():
                        now = ex.worker_pids()
                        if rank < len(now) and now[rank] != pids[rank]:
                            os.kill(now[rank], signal.SIGKILL)
                            counts["kills"] += 1
                            break
                        time.sleep(0.001)
            except ProcessLookupError:
                pass
            except BaseException as e:
                return fail("killer", e)

    def looker():
        collector = Collector(ex)
        while not stop.is_set():
            try:
                s = ex.stats()
                assert [r.rank for r in s.ranks] == list(range(len(s.ranks))), s.ranks
                assert list(collector.collect())
                counts["snapshots"] += 1
            except BaseException as e:
                return fail("looker", e)
            time.sleep(0.01)

    def on_restart(rank):
        counts["callbacks"] += 1
        raise (SystemExit if counts["callbacks"] % 2 else RuntimeError)("from a callback")

    ex.register_restart_callback(on_restart)
    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    threads += [threading.Thread(target=resizer, args=(k == 1,)) for k in range(2)]
    threads += [threading.Thread(target=killer), threading.Thread(target=looker)]
    for t in threads:
        t.start()
    stop.wait(SECONDS)
    stop.set()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), f"{{t.name}} still runs"
    assert not errors, errors
    full_answer(ex)
    assert not lockorder.violations, lockorder.violations
    ex.shutdown()
    print("counts", counts)
""")


def _run(seconds: float, seed: int) -> str:
    # (the script dumps every thread's stack and exits at ``limit``, before pytest's own
    # timeout ends the test without them: a hang is then told by where it hangs)
    limit = int(seconds + 80)
    env = dict(os.environ, MPX_CHECK_LOCKS="1")
    code = _SCRIPT.format(tests=TESTS, start=START_METHOD, seconds=seconds, seed=seed,
                          limit=limit)
    before = {n for n in os.listdir("/dev/shm") if n.startswith("mpx-")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=limit + 20, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-8000:]
    left = {n for n in os.listdir("/dev/shm") if n.startswith("mpx-")} - before
    assert not left, left
    line = [x for x in r.stdout.splitlines() if x.startswith("counts")][-1]
    return line


def test_membership_under_every_hostile_thing_at_once():
    line = _run(float(os.environ.get("MPX_STRESS_S", "8")), seed=1)
    print(line)
    counts = eval(line[len("counts "):])  # (our own script's dict)
    assert counts["ok"] and counts["kills"] and counts["resized"] and counts["snapshots"]


@pytest.mark.slow
@pytest.mark.timeout(3 * (int(os.environ.get("MPX_STRESS_S", "60")) + 120))
def test_membership_stress_soak():
    for seed in range(2, 5):
        print(_run(float(os.environ.get("MPX_STRESS_S", "60")), seed=seed))
