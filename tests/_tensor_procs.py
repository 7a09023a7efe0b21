"""Child processes and helpers of test_tensors.py (module level, so every start method
finds them; importing this module imports torch)."""

from __future__ import annotations

import dataclasses
import gc
import os
import time

import torch

import mpx


@dataclasses.dataclass
class Batch:
    """A dataclass with tensors inside, as engines send them."""

    ids: torch.Tensor
    extra: dict
    step: int = 0


def tensor_bytes(t) -> bytes:
    """The bytes of ``t``'s elements in row-major order (conj and neg bits applied)."""
    c = t.detach().resolve_conj().resolve_neg().contiguous()
    if not c.numel():
        return b""
    dense = c.clone(memory_format=torch.contiguous_format)   # strides of size-1 dims too
    return dense.reshape(-1).view(torch.uint8).numpy().tobytes()


def describe(obj):
    """What the tests compare: every tensor's type, dtype, shape, flags and bytes."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", type(obj).__name__, str(obj.dtype), tuple(obj.shape),
                obj.is_contiguous(), obj.requires_grad, obj.is_leaf, tensor_bytes(obj))
    if isinstance(obj, dict):
        return {k: describe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [describe(v) for v in obj])
    if dataclasses.is_dataclass(obj):
        return (type(obj).__name__, {f.name: describe(getattr(obj, f.name))
                                     for f in dataclasses.fields(obj)})
    return repr(obj)


def echo(handle, conn):
    """Reader 0 of ``handle``: send back ``(obj, describe(obj))`` for every object, on a
    queue of its own whose handle goes out over ``conn``, until None arrives."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    back = mpx.MessageQueue(1, 1)
    conn.send(back.export_handle())
    try:
        q.wait_until_ready(60)
        back.wait_until_ready(60)
        while True:
            try:
                obj = q.dequeue(timeout=60)
            except mpx.DeserializationError as e:
                back.enqueue(("error", type(e).__name__, str(e), getattr(e, "name", None)))
                continue
            if obj is None:
                break
            back.enqueue((obj, describe(obj)), timeout=60)
    finally:
        back.close()
        q.close()
        conn.close()


def keep_tensor(handle, n_more, conn):
    """Receive a tensor, keep it while ``n_more`` messages lap the ring, report whether it
    changed and whether it is writable."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    try:
        first = q.dequeue(timeout=30)
        before = tensor_bytes(first)
        for _ in range(n_more):
            q.dequeue(timeout=30)
        same = tensor_bytes(first) == before
        first.add_(1)  # owned and writable
        conn.send(("unchanged", same, int(first.sum())))
    finally:
        q.close()
        conn.close()


def modify_shared(handle, conn):
    """Receive a shared tensor, add 1 to it, then report what it holds after the parent
    wrote to it."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    try:
        t = q.dequeue(timeout=30)
        t.add_(1)
        conn.send(("modified", t.shape, t.stride()))
        assert conn.recv() == "check"
        conn.send(("sees", t.tolist()))
        assert conn.recv() == "unlinked"
        t.mul_(2)  # the mapping works after the name is gone
        conn.send(("still", t.tolist()))
    finally:
        q.close()
        conn.close()


def late_reader(handle, conn):
    """Attach, wait for "go", then dequeue; report the error."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    try:
        q.wait_until_ready(30)
        conn.send("ready")
        assert conn.recv() == "go"
        try:
            got = q.dequeue(timeout=30)
            conn.send(("got", got.tolist()))
        except mpx.MpxError as e:
            conn.send(("error", type(e).__name__, isinstance(e, mpx.DeserializationError),
                       getattr(e, "name", None), str(e)))
    finally:
        q.close()
        conn.close()


def share_then(then, conn):
    """Share a tensor, send it to the parent over a queue this child writes, then ``then``:
    "hang" (until killed) or "exit" (return with the tensor still alive)."""
    keep = mpx.share(torch.arange(16, dtype=torch.float32))
    q = mpx.MessageQueue(1, 1)
    conn.send(q.export_handle())
    q.wait_until_ready(30)
    q.enqueue(keep, timeout=30)
    conn.send(("sent", os.getpid()))
    if then == "hang":
        time.sleep(120)
    assert conn.recv() == "exit"
    q.close()
    conn.close()
    # `keep` is still referenced: the exit hook unlinks its segment


def cuda_reader(handle, conn):
    """Receive a CUDA tensor, report where it is, add 1 to it in place."""
    q = mpx.MessageQueue.create_from_handle(handle, 0)
    try:
        t = q.dequeue(timeout=60)
        conn.send(("got", str(t.device), t.cpu().tolist()))
        t.add_(1)
        torch.cuda.synchronize()
        conn.send("added")
        assert conn.recv() == "bye"
        del t
        gc.collect()
    finally:
        q.close()
        conn.close()


def make_step(n=290, seed=0):
    """A scheduler step shaped as bench/kit_step.make_step's (~150 KB pickled): request ids, token
    lists, block tables and sampling parameters in plain containers, and two small tensors."""
    import random
    rng = random.Random(seed)
    ids = [f"cmpl-{rng.getrandbits(64):016x}-0" for _ in range(n)]
    tokens = [[rng.randrange(152_000) for _ in range(rng.randrange(16, 64))] for _ in ids]
    blocks = [[rng.randrange(1 << 16) for _ in range(rng.randrange(40, 120))] for _ in ids]
    return {"step": 0, "req_ids": ids, "new_token_ids": dict(zip(ids, tokens)),
            "block_tables": dict(zip(ids, blocks)),
            "num_scheduled_tokens": {r: len(t) for r, t in zip(ids, tokens)},
            "sampling": {r: {"temperature": 0.7, "top_p": 0.95, "seed": i} for i, r in enumerate(ids)},
            "finished_req_ids": set(ids[: n // 32]), "positions": torch.arange(n, dtype=torch.int64),
            "slot_mapping": torch.arange(n * 4, dtype=torch.int32)}


class StepWorker:
    """An Executor worker that says how the step dicts it was sent were decoded: how often
    torch's own in-band tensor unpickling ran (``torch.storage._load_from_bytes``, which the
    unpickler looks up by name: counted from the worker's start), and which codec it runs."""

    def __init__(self, ctx):
        import torch.storage
        self.torch_loads = 0
        original = torch.storage._load_from_bytes

        def counting(b):
            self.torch_loads += 1
            return original(b)

        torch.storage._load_from_bytes = counting

    def inspect(self, step):
        from mpx.protocol import serde
        a, b = step["positions"], step["slot_mapping"]
        return {"torch_loads": self.torch_loads, "codec": serde._codec.IMPLEMENTATION,
                "requests": len(step["req_ids"]), "tensors": (a.tolist(), b.tolist()),
                "tokens": sum(map(len, step["new_token_ids"].values()))}
