"""The driver across real worker processes: futures that complete on their own, asyncio,
cancel semantics, no lost replies when a worker dies, the failed group stopping, and every
error pickling."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import inspect
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import _env
import _procs
import pytest
from _env import START_METHOD

import mpx
from mpx import errors

# ----------------------------------------------------------------- futures on their own

def test_done_callbacks_run_without_result(executor):
    e = executor()
    done = threading.Event()
    got = []

    def cb(f):
        got.append(f.result(timeout=0))
        if len(got) == 20:
            done.set()

    for i in range(20):
        e.collective_rpc("ident", args=(i,), non_block=True).add_done_callback(cb)
    assert done.wait(10), f"only {len(got)} of 20 callbacks ran"
    assert sorted(pair[0] for pair in got) == list(range(20))
    assert all(pair[0] == pair[1] for pair in got)


def test_wait_and_as_completed_without_result(executor):
    e = executor()
    futs = [e.collective_rpc("mul", args=(i,), non_block=True) for i in range(50)]
    done, not_done = concurrent.futures.wait(futs, timeout=10)
    assert not not_done and len(done) == 50
    seen = [f for f in concurrent.futures.as_completed(futs, timeout=10)]
    assert len(seen) == 50
    assert [f.result(timeout=0) for f in futs] == [[i, 2 * i] for i in range(50)]


def test_slow_call_future_completes_while_nobody_waits(executor):
    e = executor()
    fut = e.collective_rpc("sleep", args=(0.3,), kwargs={"ranks": [1]}, non_block=True)
    assert not fut.done()
    deadline = time.monotonic() + 10
    while not fut.done():
        assert time.monotonic() < deadline, "the future never completed on its own"
        time.sleep(0.01)
    assert fut.result(timeout=0) == [0, 1]


def test_await_wrap_future_and_gather_of_200(executor):
    e = executor()

    async def main():
        one = await e.collective_rpc("ident", args=("a",), non_block=True)
        wrapped = await asyncio.wrap_future(e.collective_rpc("ident", args=("b",),
                                                             non_block=True))
        many = await asyncio.gather(*[e.collective_rpc("ident", args=(i,), non_block=True)
                                      for i in range(200)])
        return one, wrapped, many

    one, wrapped, many = asyncio.run(asyncio.wait_for(main(), 30))
    assert one == ["a", "a"] and wrapped == ["b", "b"]
    assert many == [[i, i] for i in range(200)]


def test_an_asyncio_ticker_keeps_ticking_during_a_1s_call(executor):
    e = executor()
    ticks = []

    async def ticker(stop):
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def main():
        stop = asyncio.Event()
        t = asyncio.create_task(ticker(stop))
        result = await e.collective_rpc("sleep", args=(1.0,), non_block=True)
        stop.set()
        await t
        return result

    assert asyncio.run(main()) == [0, 1]
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) > 40, len(ticks)
    assert max(gaps) < 0.25, f"the event loop was blocked for {max(gaps):.3f} s"


def test_a_blocked_event_loop_holds_up_no_other_future(executor):
    """The loop reads its awaited futures' replies itself; while its thread is blocked
    (here in time.sleep), the background reader still completes the other futures."""
    e = executor()

    async def main():
        awaited = asyncio.ensure_future(e.collective_rpc("sleep", args=(0.05,), non_block=True))
        await asyncio.sleep(0)  # it is awaited: the loop reads for it
        done = threading.Event()
        e.collective_rpc("ident", args=(2,), non_block=True).add_done_callback(
            lambda f: done.set())
        t0 = time.monotonic()
        ran = done.wait(1.0)  # blocks the loop's thread
        took = time.monotonic() - t0
        return ran, took, await awaited

    ran, took, result = asyncio.run(asyncio.wait_for(main(), 30))
    assert ran and took < 0.5, took
    assert result == [0, 1]


def test_one_future_waited_on_by_threads_tasks_and_callbacks_at_once(executor):
    """The future builds its Condition only when a thread sleeps on it: threads in
    result(), concurrent.futures.wait and as_completed, two tasks awaiting it in one loop,
    a wrap_future and callbacks added from threads all see the one outcome, once each."""
    e = executor()
    lock = threading.Lock()
    for _ in range(5):
        fut = e.collective_rpc("sleep", args=(0.1,), non_block=True)
        got: list = []
        called: list = []

        def in_thread(how, fut=fut, got=got, called=called):
            if how == "result":
                value = fut.result(timeout=10)
            elif how == "wait":
                done, _ = concurrent.futures.wait([fut], timeout=10)
                value = done.pop().result(timeout=0)
            elif how == "as_completed":
                value = next(concurrent.futures.as_completed([fut], timeout=10)).result(0)
            elif how == "condition":  # the base class's own sleep on its Condition
                value = concurrent.futures.Future.result(fut, timeout=10)
            else:
                fut.add_done_callback(lambda f: called.append(f.result(timeout=0)))
                return
            with lock:
                got.append(value)

        hows = ["result", "result", "wait", "as_completed", "condition", "callback", "callback"]
        threads = [threading.Thread(target=in_thread, args=(h,)) for h in hows]
        for t in threads:
            t.start()

        async def main(fut=fut):
            return await asyncio.gather(fut, fut, asyncio.wrap_future(fut))

        from_loop = asyncio.run(asyncio.wait_for(main(), 10))
        for t in threads:
            t.join(5)  # (their own timeouts are 10 s: a lost wake-up shows here)
        assert not any(t.is_alive() for t in threads), "a thread missed the completion"
        assert from_loop == [[0, 1]] * 3
        assert got == [[0, 1]] * 5
        deadline = time.monotonic() + 5
        while len(called) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert called == [[0, 1]] * 2
        fut.add_done_callback(lambda f, called=called: called.append("done: at once"))
        assert called[-1] == "done: at once"


def test_futures_awaited_in_a_loop_complete_when_other_threads_read_their_replies(executor):
    """Blocking callers in other threads read the replies of the futures the loop awaits:
    the loop is woken for them (and reads for itself again when they stop)."""
    e = executor()
    stop = threading.Event()
    errors_seen: list = []

    def hammer(k):
        try:
            while not stop.is_set():
                assert e.collective_rpc("ident", args=(k,)) == [k, k]
        except BaseException as ex:  # reported below
            errors_seen.append(ex)

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()

    async def caller(i):
        return [await e.collective_rpc("mul", args=(i * 100 + j,), non_block=True)
                for j in range(50)]

    async def main():
        return await asyncio.gather(*[caller(i) for i in range(8)])

    try:
        out = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not errors_seen, errors_seen
    assert out == [[[x, 2 * x] for x in range(i * 100, i * 100 + 50)] for i in range(8)]


def test_replies_read_in_a_batch_complete_every_future_once(executor):
    """An event loop reads the replies already there in batches and completes their
    futures after each batch: every done callback runs once (callbacks added from the loop
    while another thread completes futures may run in either thread, so in no set order),
    and each awaited future gets its own result."""
    e = executor()
    ran: list = []

    async def main():
        for _ in range(10):
            futs = [e.collective_rpc("ident", args=(i,), non_block=True) for i in range(40)]
            for i, f in enumerate(futs):
                f.add_done_callback(lambda f, i=i: ran.append((i, f.result(timeout=0))))
            await asyncio.sleep(0.02)  # the replies pile up: the loop then reads a batch
            got = await asyncio.gather(*futs[::3])
            assert got == [[i, i] for i in range(0, 40, 3)]
            assert [await f for f in futs] == [[i, i] for i in range(40)]
            assert sorted(ran) == [(i, [i, i]) for i in range(40)], ran
            ran.clear()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_cancel_of_a_sent_call_returns_false(executor):
    e = executor()
    fut = e.collective_rpc("sleep", args=(0.2,), non_block=True)
    assert fut.running()
    assert fut.cancel() is False
    assert not fut.cancelled()
    assert fut.result(timeout=10) == [0, 1]
    assert "cancel()" in inspect.getdoc(mpx.RPCFuture)


def test_a_done_callback_may_call_the_executor(executor):
    e = executor()
    out = concurrent.futures.Future()

    def cb(f):  # runs in the thread that read the reply
        try:
            out.set_result(e.collective_rpc("ident", args=(f.result(timeout=0),)))
        except BaseException as exc:
            out.set_exception(exc)

    e.collective_rpc("ident", args=("inner",), non_block=True).add_done_callback(cb)
    assert out.result(timeout=10) == [["inner", "inner"], ["inner", "inner"]]


def test_12_threads_mix_blocking_and_non_blocking_calls(executor):
    e = executor()
    errors_seen = []

    def run(t):
        rnd = random.Random(t)
        try:
            for i in range(60):
                x = (t, i)
                kind = rnd.randrange(4)
                if kind == 0:
                    assert e.collective_rpc("ident", args=(x,)) == [x, x]
                elif kind == 1:
                    assert e.collective_rpc("ident", args=(x,), non_block=True) \
                        .result(timeout=30) == [x, x]
                elif kind == 2:
                    assert e.collective_rpc("mul", args=(i,), unique_reply_rank=1) == 2 * i
                else:
                    futs = [e.collective_rpc("ident", args=((x, k),), non_block=True)
                            for k in range(3)]
                    done, _ = concurrent.futures.wait(futs, timeout=30)
                    assert len(done) == 3
                    assert [f.result(timeout=0) for f in futs] == [[(x, k)] * 2 for k in range(3)]
        except BaseException as exc:
            errors_seen.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors_seen, errors_seen[:3]


# ----------------------------------------------------------------- deaths


@pytest.mark.parametrize("reply_rank", [None, 1], ids=["every rank", "dying rank only"])
def test_replies_sent_just_before_a_death_are_delivered(executor, reply_rank):
    """While the reader is held up (a done callback that takes 0.3 s), both ranks answer
    call 1 and rank 1 then dies in call 2: call 1 still returns its result."""
    e = executor()
    first = e.collective_rpc("ident", args=(0,), non_block=True)
    first.add_done_callback(lambda f: time.sleep(0.3))
    answered = e.collective_rpc("mul", args=(5,), unique_reply_rank=reply_rank, non_block=True)
    dies = e.collective_rpc("exit", args=(7,), kwargs={"ranks": [1]}, non_block=True)
    assert first.result(timeout=10) == [0, 0]
    assert answered.result(timeout=10) == ([5, 10] if reply_rank is None else 10)
    with pytest.raises(mpx.WorkerDiedError, match="exit code 7"):
        dies.result(timeout=10)


def test_the_survivors_are_stopped_after_a_death(executor):
    e = executor(n=3, shutdown_grace_s=0.5, terminate_grace_s=0.5)
    stopped = threading.Event()
    e.register_failure_callback(stopped.set)
    busy = e.collective_rpc("sleep", args=(30,), kwargs={"ranks": [0]}, non_block=True)
    pids = e.worker_pids
    os.kill(pids[2], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(mpx.WorkerDiedError):
        busy.result(timeout=5)
    # rank 0 is busy (exits on the closed death pipe or SIGTERM), rank 1 idle (stop message)
    assert stopped.wait(0.5 + 0.5 + 3), "the failure callbacks did not run"
    assert not _procs.wait_gone(pids, 0.5)
    assert time.monotonic() - t0 < 0.5 + 0.5 + 3


def test_keep_running_after_a_death_then_dump_stacks(executor):
    e = executor(n=2, stop_on_failure=False)
    failed = threading.Event()
    e.register_failure_callback(failed.set)
    survivor = e.worker_pids[0]
    os.kill(e.worker_pids[1], signal.SIGKILL)
    assert failed.wait(3)
    time.sleep(0.3)
    assert _procs.running(survivor)
    stacks = e.dump_stacks(timeout=5)
    assert "worker_main" in stacks[0] or "_serve" in stacks[0], stacks[0][:500]
    assert "rank 1" in stacks[1] or "dead" in stacks[1] or "gone" in stacks[1], stacks[1]
    e.shutdown()
    assert not _procs.running(survivor)


# ----------------------------------------------------------------- shutdown and exit


# ----------------------------------------------------------------- errors pickle

def _samples() -> list[BaseException]:
    return [
        errors.MpxError("base"), errors.Cancelled("cancelled"), errors.QueueTimeout("late"),
        errors.PeerDiedError("gone", role="writer", rank=3, pid=42),
        errors.MessageAbortedError("given up"),
        errors.ShmError("no room"), errors.HandleError("bad handle"),
        errors.QueueClosedError("closed"), errors.RoleError("role"),
        errors.SerializationError("cannot pickle"), errors.DeserializationError("cannot load"),
        errors.MessageTooLargeError("too large", nbytes=1 << 40),
        errors.RPCError([1, 2], "ValueError", "bad", "Traceback ...", method="f"),
        errors.RPCTimeoutError("timed out", [1]),
        errors.ReplyLostError("lost", rank=1), errors.WaitNudged("nudged"),
        errors.WorkerStalledError("stalled", [0], {0: {"method": "f", "seconds": 2.0}}),
        errors.ExecutorFailed("failed"),
        errors.WorkerDiedError("died", rank=1, pid=42, exitcode=-9),
        errors.NodeLostError("lost", 1, [2, 3]),
        errors.NotOwnerError("not mine"),
        errors.WorkerStartupError("no start", [0], "Traceback ...", pid=42, exitcode=7),
        errors.SharedTensorGoneError("gone", name="mpx-x"),
        errors.WorkerRestartError("no restart", [1], "Traceback ...", pid=43, exitcode=1),
        errors.ResizeError("in flight"),
        errors.RemoteTraceback("Traceback ..."),  # (never raised: a remote error's cause)
    ]


def test_every_error_class_is_sampled():
    classes = {c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, BaseException)}
    assert classes == {type(e) for e in _samples()}


@pytest.mark.parametrize("err", _samples(), ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_its_message_and_attributes(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    assert vars(back) == vars(err)


def test_finished_event_loops_are_not_kept(executor):
    import gc
    import weakref
    e = executor()
    loops = []
    for _ in range(3):
        loop = asyncio.new_event_loop()
        fut = e.collective_rpc("ident", args=(1,), non_block=True)
        assert loop.run_until_complete(asyncio.wait_for(fut, 10)) == [1, 1]
        loop.close()
        loops.append(weakref.ref(loop))
        del loop, fut
    gc.collect()
    assert [ref() for ref in loops] == [None, None, None]


# ----------------------------------------------------------------- forked children

@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_cannot_call_and_leaves_the_parent_alone(executor):  # (forks on purpose)
    e = executor()
    assert e.collective_rpc("ident", args=("before",)) == ["before", "before"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: calling fails clearly; then it exits as a program does
        code = 1
        try:
            e.collective_rpc("ident", args=("child",))
        except mpx.NotOwnerError as exc:
            code = 0 if "forked child" in str(exc) else 2
        except BaseException:
            code = 3
        os.write(w, bytes([code]))
        try:  # what a child's exit runs: the atexit hooks (mpx's: a no-op here)
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"\x00"
    os.close(r)
    os.waitpid(pid, 0)
    # the parent's calls go on, with its own results
    for i in range(20):
        assert e.collective_rpc("ident", args=(i,)) == [i, i]
    assert not e.is_failed


CTRL_C_DURING_SHUTDOWN = textwrap.dedent("""
    import ctypes, os, signal, sys, threading, time
    sys.path.insert(0, {tests!r})
    import mpx

    class Stuck:
        def __init__(self, ctx):
            pass
        def stuck(self):
            ctypes.PyDLL(None).sleep(1000)  # in C, holding the GIL

    if __name__ == "__main__":
        ex = mpx.Executor(Stuck, 1, start_method={method!r})
        print("pids", *ex.worker_pids, flush=True)
        ex.collective_rpc("stuck", non_block=True)
        time.sleep(0.3)
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            ex.shutdown()
        except KeyboardInterrupt:
            print("interrupted after", round(time.monotonic() - t0, 2), flush=True)
        ex.shutdown()  # again: a no-op
        print("done", flush=True)
""")


def test_ctrl_c_during_shutdown_still_ends_every_worker(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(CTRL_C_DURING_SHUTDOWN.format(tests=_env.TESTS, method=START_METHOD))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "interrupted after" in out.stdout and "done" in out.stdout, out.stdout + out.stderr
    pids = [int(p) for p in next(ln for ln in out.stdout.splitlines()
                                 if ln.startswith("pids")).split()[1:]]
    assert not _procs.wait_gone(pids, 1)
    took = float(next(ln for ln in out.stdout.splitlines()
                      if ln.startswith("interrupted")).split()[-1])
    assert took < 5.0  # the interrupt came at 1 s, during the 5 s grace: SIGKILL then


def test_a_process_forked_by_a_worker_method_never_serves(executor):
    e = executor()
    children = e.collective_rpc("fork")
    assert all(isinstance(c, int) and c > 0 for c in children)  # the workers' answers
    assert not _procs.wait_gone(children, 2)  # the children came back into mpx: they left
    for i in range(50):
        assert e.collective_rpc("ident", args=(i,)) == [i, i]
    e.check_health(timeout=10)  # every answer comes from the workers' own pids


def test_a_process_forked_by_a_worker_method_dies_with_the_group(executor):
    e = executor()
    children = e.collective_rpc("fork", kwargs={"child_sleeps": 60})
    time.sleep(0.2)
    assert all(_procs.running(c) for c in children)
    e.shutdown()
    assert not _procs.wait_gone(children, 2)


def test_special_method_names_are_refused_but_callables_work(executor):
    e = executor()
    with pytest.raises(ValueError, match="__setattr__"):
        e.collective_rpc("__setattr__", args=("scale", 0))
    assert e.collective_rpc(lambda w, *a: w.__class__.__name__) == ["Echo", "Echo"]
    assert e.collective_rpc("mul", args=(1,)) == [1, 2]  # nothing was sent; all is well


class _KVAggregator:
    """Like vLLM's KVOutputAggregator: every rank's output, one rank's answer."""

    def __init__(self):
        self.seen = []

    def aggregate(self, outputs, output_rank=0):
        self.seen.append((list(outputs), output_rank))
        return {"from": output_rank, "all": sorted(outputs)}


def test_vllm_kv_output_aggregator(executor):
    e = executor()
    agg = _KVAggregator()
    assert e.collective_rpc("mul", args=(1,), kv_output_aggregator=agg) == \
        {"from": 0, "all": [1, 2]}
    got = e.collective_rpc("mul", args=(2,), aggregator=agg, unique_reply_rank=1,
                           non_block=True).result(timeout=10)
    assert got == {"from": 1, "all": [2, 4]}  # every rank replied, rank 1 answers
    assert agg.seen == [([1, 2], 0), ([2, 4], 1)]
    assert e.collective_rpc("mul", args=(1,), aggregator=sum) == 3  # mpx's callables stay
    with pytest.raises(TypeError, match="not both"):
        e.collective_rpc("mul", args=(1,), aggregator=sum, kv_output_aggregator=agg)
    with pytest.raises(TypeError, match="aggregate"):
        e.collective_rpc("mul", args=(1,), kv_output_aggregator=object())
