"""The replies a worker wrote before it died are read, over both transports: "every reply
already written, by every rank, is read" (CallTable.fail)."""

from __future__ import annotations

import _final_workers
import pytest
from _env import START_METHOD

import mpx

KEY = "final-replies-key-" + "x" * 16
BIG = 16 << 20


@pytest.mark.parametrize("async_output", [False, True], ids=["inline", "async_output"])
@pytest.mark.parametrize("transport", ["shm", "zmq"])
@pytest.mark.parametrize("where", ["method", "get_output"])
def test_a_large_reply_then_a_fatal_exit_is_delivered(transport, async_output, where):
    # small rings and pipes (4 chunks of 1 MiB): the reply's write returns while much of it
    # is still on its way, and the worker dies right after
    e = mpx.Executor(_final_workers.LastWordsThenOutputFails, 2, transport=transport,
                     async_output=async_output, max_chunks=4, auth_key=KEY, heartbeat_s=2.0,
                     start_method=START_METHOD, startup_timeout_s=60)
    try:
        reply = e.collective_rpc("big", args=(BIG,), non_block=True)
        # SystemExit(1) on rank 1: from the method, or where its reply is made (with
        # async_output, the output thread)
        death = e.collective_rpc("exit" if where == "method" else "exit_in_output",
                                 args=(1, 1), non_block=True)
        got = reply.result(timeout=30)
        assert [len(r) for r in got] == [BIG, BIG]
        assert got[0][-1] == 0 and got[1][-1] == 1
        with pytest.raises(mpx.WorkerDiedError, match="exit code 1") as ei:
            death.result(timeout=30)
        assert ei.value.rank == 1
    finally:
        e.shutdown()
