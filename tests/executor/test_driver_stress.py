"""A stateful stress test of the driver: a seeded random schedule mixes blocking calls,
futures whose callbacks call again and wait, asyncio tasks in two loops in two threads,
timeouts, cancels, interrupts in the pump, a full broadcast ring and, at the end, a worker's
death; and in another run, SIGKILLs of ranks restarted in place (Config.max_restarts) and
resizes. After every step each call that ended got its own result or a typed error; at
every checkpoint nothing is left hanging; the fixture checks nothing leaked.

The default run takes a short schedule (MPX_STRESS_STEPS, default 150); ``tox -e soak``
runs the long one (``-m slow``, MPX_SOAK_STRESS_STEPS, default 3000).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import signal
import sys
import threading
import time
import traceback

import pytest
from _rules_workers import Journal

import mpx

# what a call may end with besides its own result (a worker death ends every call)
_TYPED = (mpx.RPCTimeoutError, mpx.ExecutorFailed, mpx.ReplyLostError)
# how long any call may take to end, at the most, on a slow 2-core host
_HANG_S = 30.0


def _stacks() -> str:
    frames = sys._current_frames()
    return "\n".join(f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
                     for t in threading.enumerate() if t.ident in frames)


class _Interrupt:
    """An aggregator that raises KeyboardInterrupt: an interrupt in the pump."""

    def __call__(self, results):
        raise KeyboardInterrupt


class _Loop:
    """An event loop running in a thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name)
        self.thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class Schedule:
    """The random schedule and what it expects of every call it made."""

    def __init__(self, ex: mpx.Executor, seed: int, regroup: bool = False) -> None:
        self.ex = ex
        self.n = ex.world_size  # (changed by a resize, made only once everything ended)
        self.regroup = regroup
        self.restarted: list[int] = []
        self.kills = 0
        self.killed = -1  # the rank killed last
        self.rng = random.Random(seed)
        self.loops = [_Loop("stress-loop-a"), _Loop("stress-loop-b")]
        # (what it is, a concurrent future of its check, started at) of everything running
        self.running: list[tuple[str, concurrent.futures.Future, float]] = []
        self.problems: list[str] = []
        self.dead = False
        self.ops = [self.blocking, self.blocking, self.timed_out, self.future_calls_again,
                    self.future_waits_on_another, self.interrupt, self.task, self.task,
                    self.task_cancelled, self.burst, self.thread_blocking]
        if regroup:  # (max_restarts: a death restarts the rank, calls it had not answered fail)
            ex.register_restart_callback(self.restarted.append)
            self.ops.append(self.kill)

    # ---------------------------------------------------------------- checks

    def _value(self) -> int:
        return self.rng.randrange(1 << 30)

    def _expect(self, got, want, what: str) -> None:
        if got != want:
            self.problems.append(f"{what}: got {got!r}, want {want!r}")

    def _ended_ok(self, fut, want, what: str) -> None:
        """``fut`` (done) ended with ``want`` or a typed error."""
        try:
            self._expect(fut.result(0), want, what)
        except _TYPED:
            pass
        except BaseException as e:  # noqa: BLE001 (reported)
            self.problems.append(f"{what}: {type(e).__name__}: {e}")

    def _track(self, what: str, fut: concurrent.futures.Future) -> None:
        self.running.append((what, fut, time.monotonic()))

    def check(self) -> None:
        """Nothing that ran has hung; forget what ended."""
        now = time.monotonic()
        still = []
        for what, fut, t0 in self.running:
            if fut.done():
                exc = fut.exception()
                if exc is not None and not isinstance(exc, _TYPED):
                    self.problems.append(f"{what}: {type(exc).__name__}: {exc}")
            elif now - t0 > _HANG_S:
                self.problems.append(f"{what} has not ended after {now - t0:.0f} s")
                t = self.ex._group.calls
                reg, pump = t.registry, t.pump
                print(f"{what} hangs; the table: pending {sorted(reg.pending)}, answered "
                      f"{[c.seq for c in reg.answered]}, queued {len(t.sender.outbox)}, "
                      f"outstanding {reg.ledger.outstanding}, waiting {reg.waiting}, baton "
                      f"{pump.baton.locked()}, lease {pump.loops_until - time.monotonic():.3f}, "
                      f"next_reply {reg.next_reply}; the threads:\n{_stacks()}", file=sys.stderr)
            else:
                still.append((what, fut, t0))
        self.running = still
        assert not self.problems, self.problems

    def settle(self) -> None:
        """Wait until everything running ended (or hung past _HANG_S)."""
        deadline = time.monotonic() + _HANG_S
        while self.running and time.monotonic() < deadline:
            concurrent.futures.wait([f for _, f, _ in self.running], timeout=0.5)
            self.check()
        self.check()
        assert not self.running, [w for w, _, _ in self.running]

    # ---------------------------------------------------------------- steps

    def blocking(self) -> None:
        v = self._value()
        try:
            self._expect(self.ex.collective_rpc("ident", args=(v,), timeout=_HANG_S), [v] * self.n,
                         "blocking call")
        except _TYPED:
            pass

    def thread_blocking(self) -> None:
        """A blocking call from another thread, racing the others."""
        v = self._value()
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                done.set_result(self.ex.collective_rpc("ident", args=(v,), timeout=_HANG_S))
            except BaseException as e:  # noqa: BLE001 (checked)
                done.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        check: concurrent.futures.Future = concurrent.futures.Future()
        done.add_done_callback(lambda f: (self._ended_ok(f, [v] * self.n, "thread's call"),
                                          check.set_result(None)))
        self._track("thread's blocking call", check)

    def timed_out(self) -> None:
        try:
            self.ex.collective_rpc("sleep", args=(0.2,), timeout=0.05)
            self.problems.append("a call past its deadline returned")
        except _TYPED:
            pass

    def future_calls_again(self) -> None:
        """A callback that sends again, blocking and not, and waits."""
        v, w = self._value(), self._value()
        check: concurrent.futures.Future = concurrent.futures.Future()

        def again(f):
            try:
                self._ended_ok(f, [v] * self.n, "future")
                if self.dead:
                    return
                nxt = self.ex.collective_rpc("ident", args=(w,), non_block=True)
                self._expect(self.ex.collective_rpc("ident", args=(v,), timeout=_HANG_S),
                             [v] * self.n, "blocking call in a callback")
                self._expect(nxt.result(_HANG_S), [w] * self.n, "future made in a callback")
            except _TYPED:
                pass
            except BaseException as e:  # noqa: BLE001 (reported)
                self.problems.append(f"callback: {type(e).__name__}: {e}")
            finally:
                check.set_result(None)

        self.ex.collective_rpc("ident", args=(v,), non_block=True).add_done_callback(again)
        self._track("future calling again", check)

    def future_waits_on_another(self) -> None:
        v, w = self._value(), self._value()
        check: concurrent.futures.Future = concurrent.futures.Future()
        later: list = []

        def wait_later(f):
            try:
                self._ended_ok(f, [v] * self.n, "future")
                self._ended_ok(concurrent.futures.wait(later, _HANG_S).done.pop(), [w] * self.n,
                               "the later future")
            except BaseException as e:  # noqa: BLE001 (reported)
                self.problems.append(f"callback: {type(e).__name__}: {e}")
            finally:
                check.set_result(None)

        first = self.ex.collective_rpc("log", args=(v, 0.01), non_block=True)
        later.append(self.ex.collective_rpc("ident", args=(w,), non_block=True))
        first.add_done_callback(wait_later)
        self._track("future waiting on a later one", check)

    def interrupt(self) -> None:
        try:
            self.ex.collective_rpc("ident", args=(1,), aggregator=_Interrupt(),
                                   timeout=_HANG_S)
            self.problems.append("an interrupted call returned")
        except KeyboardInterrupt:
            pass
        except _TYPED:
            pass

    def task(self) -> None:
        v = self._value()

        async def awaited():
            return await self.ex.collective_rpc("ident", args=(v,), non_block=True)

        fut = self.rng.choice(self.loops).submit(awaited())
        check: concurrent.futures.Future = concurrent.futures.Future()
        fut.add_done_callback(lambda f: (self._ended_ok(f, [v] * self.n, "task"),
                                         check.set_result(None)))
        self._track("asyncio task", check)

    def task_cancelled(self) -> None:
        """A task gives up on its call (wait_for): the call goes on, its reply dropped."""

        async def gives_up():
            try:
                await asyncio.wait_for(
                    self.ex.collective_rpc("sleep", args=(0.05,), non_block=True), 0.01)
            except asyncio.TimeoutError:
                pass
            return True

        fut = self.rng.choice(self.loops).submit(gives_up())
        check: concurrent.futures.Future = concurrent.futures.Future()
        fut.add_done_callback(lambda f: (self._ended_ok(f, True, "cancelled task"),
                                         check.set_result(None)))
        self._track("cancelled task", check)

    def burst(self) -> None:
        """More calls than the ring holds, at once."""
        vs = [self._value() for _ in range(self.rng.randrange(5, 30))]
        futs = [self.ex.collective_rpc("ident", args=(v,), non_block=True) for v in vs]
        check: concurrent.futures.Future = concurrent.futures.Future()
        left = [len(futs)]
        lock = threading.Lock()

        def one(f, v):
            self._ended_ok(f, [v] * self.n, "burst call")
            with lock:
                left[0] -= 1
                if not left[0]:
                    check.set_result(None)

        for f, v in zip(futs, vs):
            f.add_done_callback(lambda f, v=v: one(f, v))
        self._track("burst", check)

    def kill(self) -> None:
        """A random rank's process is SIGKILLed, calls in flight or not (once the restart
        of the one before is over)."""
        deadline = time.monotonic() + _HANG_S
        while len(self.restarted) < self.kills:
            assert time.monotonic() < deadline, f"a restart did not end:\n{_stacks()}"
            time.sleep(0.005)
        self.kills += 1
        self.killed = self.rng.randrange(self.n)
        os.kill(self.ex.worker_pids()[self.killed], signal.SIGKILL)

    def resize(self) -> None:
        """(everything ended) Grow or shrink the group, or keep its size."""
        self.n = self.rng.randrange(1, 4)
        self.ex.resize(self.n)  # (a kill just before may not have been restarted yet)
        assert self.ex.world_size == self.n
        if self.killed >= self.n and len(self.restarted) < self.kills:
            self.kills -= 1  # it left the group dead: no restart

    # ---------------------------------------------------------------- the run

    def run(self, steps: int) -> None:
        for i in range(steps):
            self.rng.choice(self.ops)()
            self.check()
            if i % 25 == 24:
                self.settle()
                if self.regroup:
                    self.resize()
        self.settle()
        deadline = time.monotonic() + _HANG_S  # (a cancelled task's call may still run)
        while self.ex.pending_calls() != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.ex.pending_calls() == (0, 0)

    def end_with_a_death(self) -> None:
        """Calls in flight, then a worker dies: every one ends, with its result or a
        typed error, within the bound."""
        for _ in range(5):
            self.rng.choice([self.burst, self.task, self.future_calls_again])()
        pid = self.ex.worker_pids[1]
        self.dead = True
        os.kill(pid, signal.SIGKILL)
        self.settle()
        with pytest.raises(mpx.ExecutorFailed):
            self.ex.collective_rpc("ident", args=(1,), timeout=5)

    def close(self) -> None:
        for loop in self.loops:
            loop.close()


def _run_schedule(executor, steps: int, seed: int) -> None:
    ex = executor(Journal, max_chunks=2)
    schedule = Schedule(ex, seed)
    try:
        schedule.run(steps)
        schedule.end_with_a_death()
    finally:
        ex.shutdown()
        schedule.close()


def _run_regroup_schedule(executor, steps: int, seed: int) -> None:
    """The schedule with SIGKILLs among its steps (each rank restarted in place) and a
    resize at every checkpoint: each call gets its own result from every rank of the group
    it went to, or a typed error (WorkerDiedError for those a killed rank missed)."""
    ex = executor(Journal, max_chunks=2, max_restarts=10**6)
    schedule = Schedule(ex, seed, regroup=True)
    try:
        schedule.run(steps)
        deadline = time.monotonic() + _HANG_S
        while len(schedule.restarted) < schedule.kills:
            assert time.monotonic() < deadline, "a restart did not end"
            time.sleep(0.005)
        assert schedule.kills and not ex.is_failed
        assert ex.collective_rpc("ident", args=(7,)) == [7] * schedule.n
    finally:
        ex.shutdown()
        schedule.close()


RUNS = [pytest.param(_run_schedule, id="ending-with-a-death"),
        pytest.param(_run_regroup_schedule, id="with-restarts-and-resizes")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", RUNS)
def test_a_random_schedule_of_everything_never_hangs_or_mixes_replies(executor, run):
    run(executor, int(os.environ.get("MPX_STRESS_STEPS", "150")), seed=27)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_long_random_schedule(executor, run, seed):
    run(executor, int(os.environ.get("MPX_SOAK_STRESS_STEPS", "3000")), seed)
