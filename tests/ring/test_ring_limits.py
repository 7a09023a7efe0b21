"""The ring at its limits: a message the reader cannot allocate memory for, and slots of
4 GiB or more. Across real processes, for both ring implementations."""

from __future__ import annotations

import json
import mmap
import os
import pickle
import subprocess
import sys

import _env
import _limits_workers as LW
import pytest
from _env import START_METHOD

import mpx
from mpx import _impl
from mpx.errors import MessageTooLargeError
from mpx.mechanism import layout

TESTS = _env.TESTS
# a helper process: python -c this driver|reader (it imports mpx from where the tests do)
HELPER = [sys.executable, "-c", "import _limits_workers; _limits_workers.main()"]


def _env() -> dict:
    path = [TESTS, os.path.dirname(os.path.dirname(os.path.abspath(mpx.__file__)))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]))


def _run_helper(args: list[str], timeout: float = 150) -> tuple[dict, str]:
    res = subprocess.run(HELPER + args, capture_output=True, timeout=timeout, env=_env())
    err = res.stderr.decode(errors="replace")
    assert res.returncode == 0, err
    return json.loads(res.stdout.decode().splitlines()[-1]), err


def _skipped_size(text: str) -> int:
    """The size a message-skipped error names (the payload plus a pickle's few bytes)."""
    assert "could not allocate memory for a message of" in text and "skipped" in text, text
    nbytes = int(text.split("a message of ")[1].split(" bytes")[0])
    assert LW.BIG <= nbytes < LW.BIG + 4096, text
    return nbytes


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_reply_the_driver_cannot_allocate_fails_its_call_alone(impl, transport):
    """A driver under an address-space cap gets a reply too large for it: that call fails
    with an RPCError (exc_type MessageTooLargeError) from that rank naming the size, and the
    executor goes on (the ring used to keep the message at its head: every later read
    raised MemoryError; the ZeroMQ reader raised MemoryError, losing the reply)."""
    out, err = _run_helper(["driver", START_METHOD, transport])
    assert out["impl"] == impl and out["before"] == ["ok", [0, 1]]
    kind, text, ranks, exc_type = out["big"]
    assert kind == "RPCError" and ranks == [1], out["big"]
    assert exc_type == "MessageTooLargeError", out["big"]
    _skipped_size(out["big"][1])
    assert out["after"] == ["ok", [0, 1]], out["after"]
    assert out["big_future"][0] == "RPCError" and out["big_future"][2] == [0], out
    assert out["last"] == ["ok", [repr(bytearray(1000))] * 2], out["last"]
    assert "SystemError" not in err and "exported buffers" not in err, err


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_a_message_the_reader_cannot_allocate_is_skipped(impl, transport):
    """A queue reader under an address-space cap: a message it cannot allocate is skipped
    with MessageTooLargeError (a DeserializationError and a MemoryError) naming its size;
    the messages around it arrive, by dequeue and by dequeue_ready."""
    q = mpx.MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=8,
                         config=mpx.Config(transport=transport, auth_key=LW.KEY))
    reader = subprocess.Popen(HELPER + ["reader"], stdin=subprocess.PIPE,
                              env=dict(_env(), MPX_AUTH_KEY=LW.KEY),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        reader.stdin.write(pickle.dumps(q.export_handle()))
        reader.stdin.close()
        reader.stdin = None
        q.wait_until_ready(60)
        big = bytes(LW.BIG)
        for _ in range(2):  # once for dequeue, once for dequeue_ready
            q.enqueue("first", 60)
            q.enqueue(big, 60)
            q.enqueue(("third", 3), 60)
        q.enqueue("last", 60)
        stdout, stderr = reader.communicate(timeout=120)
    finally:
        q.close()
        reader.kill()
        reader.wait(10)
    err = stderr.decode(errors="replace")
    assert reader.returncode == 0, err
    out = json.loads(stdout.decode().splitlines()[-1])
    assert out["impl"] == impl
    first, skipped, third = out["dequeue"]
    assert first == ["ok", "first"] and third == ["ok", ["third", 3]], out
    assert skipped[0] == "MessageTooLargeError", skipped
    _skipped_size(skipped[1])
    *_, nbytes = out["dequeue_ready"][1]
    assert LW.BIG <= nbytes < LW.BIG + 4096
    assert out["dequeue_ready"] == ["first", ["skipped", "MessageTooLargeError", nbytes],
                                    ["third", 3], "last"], out["dequeue_ready"]
    assert "SystemError" not in err and "exported buffers" not in err, err


def test_the_error_is_a_deserialization_and_a_memory_error():
    e = pickle.loads(pickle.dumps(MessageTooLargeError("m", nbytes=5)))
    assert isinstance(e, mpx.DeserializationError) and isinstance(e, MemoryError)
    assert e.nbytes == 5 and str(e) == "m"


def test_a_slot_of_4_gib_or_more_keeps_its_length(impl):
    """A slot's length is published whole: a ring of one slot of 4 GiB + 64 bytes (mapped,
    never touched: nothing is allocated) hands its reader the length the writer committed
    (the compiled ring narrowed it to 32 bits: 64)."""
    chunk = (1 << 32) + 64
    mm = mmap.mmap(-1, layout.segment_size(chunk, 1, 1))
    layout.init_header(mm, chunk, 1, 1, 1234, os.getpid())
    mod = _impl.ring_module()
    w, r = mod.RingWriter(mm), mod.RingReader(mm, 0)
    try:
        assert w.begin_slot(0) == layout.OK
        w.commit_slot(chunk, 5 | layout.KIND_AS_BYTES)
        assert r.next_slot(0) == (layout.OK, chunk, 5 | layout.KIND_AS_BYTES)
        r.release_slot()
    finally:
        w.release()
        r.release()
        mm.close()
