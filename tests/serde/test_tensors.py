"""Tensors through MessageQueue and Executor across real processes, and mpx.share."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import struct
import warnings

import _procs
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

import _tensor_procs as tp  # noqa: E402  (imports torch)
from _env import START_METHOD  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import mpx  # noqa: E402
from mpx.mechanism import segments  # noqa: E402
from mpx.protocol import serde, sharing, wire  # noqa: E402
from mpx.protocol.serde import K_PICKLE_OOB  # noqa: E402


def _copyable(dtype) -> bool:
    if "qint" in str(dtype) or "quint" in str(dtype):
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "ComplexHalf support is experimental"
            torch.zeros(64, dtype=torch.uint8).view(dtype).reshape(2, -1)[:, ::2].contiguous()
        return True
    except (RuntimeError, NotImplementedError):
        return False


# every dtype this torch can hold in a dense CPU tensor and copy (not the quantized ones,
# not the sub-byte int1..7/uint1..7 placeholders)
DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype) and _copyable(d)},
                key=str)
GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64)


def random_tensor(dtype, shape, seed):
    """A tensor whose bytes are random (NaN payloads included); bools are 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


class Echo:
    """A long-lived reader child that sends back what it gets and its description of it."""

    def __init__(self, ctx, **queue_kw):
        self.q = mpx.MessageQueue(1, 1, **queue_kw)
        self.back = None
        self.proc, self.conn = _procs.start(ctx, tp.echo, self.q.export_handle())
        try:
            assert self.conn.poll(60), "echo child did not start"
            self.back = mpx.MessageQueue.create_from_handle(self.conn.recv(), 0)
            self.q.wait_until_ready(60)
            self.back.wait_until_ready(60)
        except BaseException:
            self.close()
            raise

    def __call__(self, obj):
        """(the object as the child got it, echoed back; the child's description)."""
        self.q.enqueue(obj, timeout=30)
        return self.back.dequeue(timeout=30)

    def close(self):
        if self.proc.is_alive():
            self.q.enqueue(None, timeout=10)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        if self.back is not None:
            self.back.close()
        self.q.close()
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def contiguous_copy_description(t):
    """What the receiver must see for ``t``: same type, dtype, shape, bytes; contiguous."""
    return ("tensor", type(t).__name__, str(t.dtype), tuple(t.shape), True, t.requires_grad,
            True, tp.tensor_bytes(t))


def assert_same_tensor(got, want):
    assert type(got) is type(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.requires_grad == want.requires_grad
    assert got.is_contiguous()
    assert tp.tensor_bytes(got) == tp.tensor_bytes(want)


# --------------------------------------------------------------------------- copies

@pytest.mark.usefixtures("impl")
def test_every_dtype_round_trips_bit_exactly(ctx):
    assert {torch.bfloat16, torch.bool, torch.complex32, torch.complex128, torch.uint64,
            torch.float8_e4m3fn, torch.float8_e5m2} <= set(DTYPES)
    with Echo(ctx) as echo:
        for i, dtype in enumerate(DTYPES):
            t = random_tensor(dtype, (3, 5), seed=i)
            got, desc = echo(t)
            assert desc == contiguous_copy_description(t), dtype
            assert_same_tensor(got, t)
        # all in one message, sharing one receive buffer
        ts = [random_tensor(d, (7,), seed=100 + i) for i, d in enumerate(DTYPES)]
        got, desc = echo(ts)
        assert desc == ("list", [contiguous_copy_description(t) for t in ts])
        for g, t in zip(got, ts):
            assert_same_tensor(g, t)


def _special_cases():
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    leaf = torch.randn(3, 4, requires_grad=True)
    z = torch.randn(3, 4, dtype=torch.complex64)
    return {
        "0-d": torch.tensor(2.5, dtype=torch.float64),
        "0-d bfloat16": torch.tensor(-1.0, dtype=torch.bfloat16),
        "empty": torch.empty(0, dtype=torch.float32),
        "empty 2-d": torch.empty(4, 0, dtype=torch.int16),
        "empty, odd strides": torch.arange(8, dtype=torch.bfloat16)[::2][4:],
        "one element, stride 5": torch.arange(10, dtype=torch.float32)[::5][:1],
        "transpose": x.transpose(0, 2),
        "step": x[:, ::2, 1::3],
        "storage offset": x[1, 1:],
        "expand (stride 0)": torch.arange(3).expand(4, 3),
        "channels last": torch.arange(2 * 3 * 4 * 5, dtype=torch.float16).reshape(2, 3, 4, 5)
        .to(memory_format=torch.channels_last),
        "conj view": z.conj(),
        "neg view": torch._neg_view(z),
        "requires_grad leaf": leaf,
        "requires_grad non-leaf": leaf * 2,
        "parameter": torch.nn.Parameter(torch.randn(2, 3)),
        "frozen parameter": torch.nn.Parameter(torch.randn(2, 3), requires_grad=False),
        "non-contiguous parameter": torch.nn.Parameter(torch.randn(4, 3).t()),
        "int parameter": torch.nn.Parameter(torch.arange(5), requires_grad=False),
    }


@pytest.mark.usefixtures("impl")
def test_special_tensors_round_trip(ctx):
    with Echo(ctx) as echo:
        for name, t in _special_cases().items():
            got, desc = echo(t)
            assert desc == contiguous_copy_description(t), name
            assert_same_tensor(got, t)
            assert got.is_leaf and not got.is_conj() and not got.is_neg()
            if t.dtype.is_floating_point and not isinstance(t, torch.nn.Parameter):
                got.detach().add_(1)  # writable memory of the receiver's own


@pytest.mark.usefixtures("impl")
def test_tensors_nested_in_containers(ctx):
    a = torch.randn(4, 4)
    b = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()
    p = torch.nn.Parameter(torch.ones(3))
    obj = {"batch": tp.Batch(ids=b, extra={"mask": torch.tensor([True, False]), "w": [a, p]},
                             step=7),
           "list": [a, (b, 3, "x")], "same twice": [a, a]}
    with Echo(ctx) as echo:
        got, desc = echo(obj)
    assert desc == tp.describe({**obj, "batch": tp.Batch(b.contiguous(), obj["batch"].extra, 7),
                                "list": [a, (b.contiguous(), 3, "x")]})
    assert isinstance(got["batch"], tp.Batch) and got["batch"].step == 7
    assert_same_tensor(got["batch"].ids, b)
    assert_same_tensor(got["batch"].extra["w"][1], p)
    assert_same_tensor(got["list"][1][0], b)
    # pickle's memo: one tensor sent twice is one tensor received
    assert got["same twice"][0] is got["same twice"][1]


@pytest.mark.usefixtures("impl")
def test_received_tensor_does_not_alias_the_ring(ctx):
    chunk, nchunks, n_more = 4096, 4, 50
    with mpx.MessageQueue(1, 1, max_chunk_bytes=chunk, max_chunks=nchunks) as q:
        p, conn = _procs.start(ctx, tp.keep_tensor, q.export_handle(), n_more)
        q.wait_until_ready(30)
        first = torch.arange(chunk // 8 * 3, dtype=torch.int64)   # spans 3 slots
        q.enqueue(first, timeout=10)
        for i in range(n_more):   # each fills a slot with other bytes: every slot, many times
            q.enqueue(torch.full((chunk // 8 - 16,), -i - 1, dtype=torch.int64), timeout=10)
        assert conn.poll(30)
        tag, unchanged, total = conn.recv()
        assert tag == "unchanged" and unchanged
        assert total == int(first.sum()) + first.numel()
        p.join(20)
        assert p.exitcode == 0


def test_tensor_bytes_go_out_of_band_also_with_a_callable():
    """A message with a lambda falls back to cloudpickle; its tensors still travel out of
    band (not through torch's in-band pickling)."""
    t = torch.randn(1000)
    for obj in (t, (lambda w, x: x, t)):
        kind, parts = serde.encode(obj)
        assert kind == K_PICKLE_OOB
        assert any(memoryview(p).nbytes == t.numel() * 4 for p in parts)
        data = bytearray(b"".join(bytes(p) for p in parts))
        got = serde.decode(kind, data)
        got = got if isinstance(got, torch.Tensor) else got[1]
        assert torch.equal(got, t)



def _address(part) -> int:
    import numpy as np
    return np.frombuffer(part, dtype=np.uint8).ctypes.data


def test_step_dict_tensors_leave_the_pickle_as_they_are():
    """A scheduler step (bench_inband's [s] row: ~150 KB of containers and two small
    tensors), as the driver sends a call with it: one out-of-band message whose two buffers
    are the tensors' own memory (no copy before the ring, none of torch's in-band pickling),
    a pickle no larger than the step's containers', and the step back on decoding."""
    step = tp.make_step()
    tensors = (step["positions"], step["slot_mapping"])
    kind, parts = serde.encode(wire.call(7, "inspect", (step,), None, None), True)
    assert kind == K_PICKLE_OOB
    n_buffers, pickle_len = struct.unpack_from("<QQ", parts[0])
    assert n_buffers == 2
    for t in tensors:
        assert [p for p in parts if memoryview(p).nbytes == t.nbytes
                and _address(p) == t.data_ptr()], "a tensor's bytes were copied before the ring"
    plain = {k: v for k, v in step.items() if not isinstance(v, torch.Tensor)}
    assert pickle_len < len(pickle.dumps(plain, protocol=5)) + 1024
    got = serde.decode(kind, bytearray(b"".join(bytes(memoryview(p)) for p in parts)))
    assert got[2] == "inspect" and got[3][0]["req_ids"] == step["req_ids"]
    assert all(torch.equal(got[3][0][k], t) for k, t in zip(("positions", "slot_mapping"), tensors))


def test_step_dict_reaches_the_worker_without_torch_pickling(impl):
    """Across processes: the worker decodes the step's tensors from the out-of-band buffers,
    never through torch's own in-band unpickling (which costs the pickle floor its most),
    with the codec of the implementation under test. A quantized tensor, which does use
    torch's pickling, shows that the worker's count sees it."""
    step = tp.make_step()
    want = (step["positions"].tolist(), step["slot_mapping"].tolist())
    with mpx.Executor(tp.StepWorker, 1, start_method=START_METHOD) as ex:
        for _ in range(3):
            [got] = ex.collective_rpc("inspect", args=(step,), timeout=60)
            assert got == {"torch_loads": 0, "codec": impl, "requests": 290, "tensors": want,
                           "tokens": sum(map(len, step["new_token_ids"].values()))}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch: quantized tensors deprecated
            q = torch.quantize_per_tensor(torch.rand(5), 0.1, 3, torch.quint8)
        [got] = ex.collective_rpc("inspect", args=({**step, "extra": q},), timeout=60)
        assert got["torch_loads"] >= 1


@pytest.mark.filterwarnings("ignore::UserWarning")   # torch: CSR beta, quantized deprecated
def test_sparse_and_quantized_tensors_use_torch_pickling():
    coo = torch.eye(4).to_sparse()
    csr = torch.eye(4).to_sparse_csr()
    q = torch.quantize_per_tensor(torch.rand(5), 0.1, 3, torch.quint8)
    for t in (coo, csr, q):
        kind, parts = serde.encode(t)
        got = serde.decode(kind, bytearray(b"".join(bytes(p) for p in parts)))
        assert got.layout == t.layout and got.dtype == t.dtype
        if t.is_quantized:
            assert torch.equal(got.int_repr(), t.int_repr()) and got.q_scale() == t.q_scale()
        else:
            assert torch.equal(got.to_dense(), t.to_dense())

# --------------------------------------------------------------------------- property

@st.composite
def tensor_views(draw):
    """(a tensor view, the bytes its elements must arrive as): random dtype, shape, byte
    content, then permutes, slices with steps, expands and index selects. The expected bytes
    are gathered by element index, independent of torch's copy kernels."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    base = random_tensor(dtype, shape, draw(st.integers(0, 2**31)))
    idx = torch.arange(base.numel()).reshape(shape)
    v, i = base, idx
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["permute", "slice", "expand", "select"]))
        if op == "permute" and v.dim() > 1:
            perm = draw(st.permutations(range(v.dim())))
            v, i = v.permute(*perm), i.permute(*perm)
        elif op == "slice" and v.dim() > 0:
            d = draw(st.integers(0, v.dim() - 1))
            start = draw(st.integers(0, v.shape[d]))
            step = draw(st.integers(1, 3))
            sl = (slice(None),) * d + (slice(start, None, step),)
            v, i = v[sl], i[sl]
        elif op == "expand" and v.dim() < 4:
            k = draw(st.integers(0, 3))
            v, i = v.unsqueeze(0).expand(k, *v.shape), i.unsqueeze(0).expand(k, *i.shape)
        elif op == "select" and v.dim() > 0 and v.shape[0] > 0:
            j = draw(st.integers(0, v.shape[0] - 1))
            v, i = v[j], i[j]
    itemsize = v.element_size()
    rows = base.reshape(-1).view(torch.uint8).reshape(-1, itemsize) if base.numel() else None
    want = b"" if rows is None or i.numel() == 0 else rows[i.reshape(-1)].numpy().tobytes()
    wrap = draw(st.sampled_from(["plain", "grad", "param"]))
    if wrap != "plain" and (dtype.is_floating_point or dtype.is_complex):
        try:
            v = (torch.nn.Parameter(v) if wrap == "param"
                 else v.detach().requires_grad_(True))
        except RuntimeError:   # a dtype autograd does not take (float8...)
            pass
    return v, want


@pytest.mark.usefixtures("impl")
def test_property_any_view_of_any_dtype_round_trips(ctx):
    with Echo(ctx) as echo:
        @settings(max_examples=80, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(tensor_views())
        def check(case):
            v, want = case
            got, desc = echo(v)
            assert desc == ("tensor", type(v).__name__, str(v.dtype), tuple(v.shape), True,
                            v.requires_grad, True, want)
            assert type(got) is type(v) and got.dtype == v.dtype and got.shape == v.shape
            assert got.is_contiguous() and tp.tensor_bytes(got) == want

        check()


# --------------------------------------------------------------------------- executor

def test_executor_sends_and_returns_tensors():
    import _workers
    start = START_METHOD
    t = torch.randn(64, 33, dtype=torch.bfloat16).t()
    with mpx.Executor(_workers.Echo, 2, start_method=start) as ex:
        for got in ex.collective_rpc("ident", args=(t,)):
            assert_same_tensor(got, t)
        doubled = ex.collective_rpc(lambda w, x: x.float() * (w.ctx.rank + 1), args=(t,))
        assert [torch.equal(d, t.float() * (r + 1)) for r, d in enumerate(doubled)] == [True] * 2
        p = ex.collective_rpc(lambda w: torch.nn.Parameter(torch.full((2,), float(w.ctx.rank))),
                              unique_reply_rank=1)
        assert type(p) is torch.nn.Parameter and p.tolist() == [1.0, 1.0]
        # by reference: each worker writes its row of a tensor the driver shared
        shared = mpx.share(torch.zeros(2, 5))
        ex.collective_rpc(lambda w, x: x[w.ctx.rank].fill_(w.ctx.rank + 1).sum().item(),
                          args=(shared,))
        assert shared.tolist() == [[1.0] * 5, [2.0] * 5]
    del shared
    gc.collect()


# --------------------------------------------------------------------------- mpx.share

def _segments_of(pid):
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"mpx-{pid}-"))


def test_share_in_process_semantics():
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    s = mpx.share(src)
    assert torch.equal(s, src) and s.dtype == src.dtype and s.is_contiguous()
    assert mpx.share(s) is s                       # already shared: as it is
    assert sharing.locate(s[1:, ::2]) is not None  # views of it are shared too
    src.add_(1)
    assert s[0, 0].item() == 0.0                   # a copy of src, not src
    p = mpx.share(torch.nn.Parameter(torch.ones(3)))
    assert type(p) is torch.nn.Parameter and p.requires_grad
    e = mpx.share(torch.empty(0, 3, dtype=torch.bfloat16))
    assert e.shape == (0, 3)
    c = mpx.share(torch.tensor([1 + 2j]).conj())
    assert c.tolist() == [1 - 2j] and not c.is_conj()
    # a torch-shared tensor (file descriptor strategy) is copied into an mpx segment
    ts = torch.ones(4).share_memory_()
    ts2 = mpx.share(ts)
    assert ts.is_shared() and sharing.locate(ts2) is not None and sharing.locate(ts) is None
    # a shared tensor's message carries a reference, not its bytes
    big = mpx.share(torch.zeros(1 << 20))
    kind, parts = serde.encode({"w": big[:, None].t()}, local_only=True)
    assert sum(memoryview(x).nbytes for x in parts) < 1024
    names = _segments_of(os.getpid())
    assert len(names) == 6
    back = serde.decode(kind, b"".join(bytes(x) for x in parts))["w"]
    back.fill_(3)
    assert big.sum().item() == 3 << 20             # same memory, in this process too
    del s, p, e, c, ts, ts2, big, back
    gc.collect()
    assert _segments_of(os.getpid()) == []         # unlinked with the last tensor
    assert not sharing.by_base


def test_share_bad_input():
    with pytest.raises(TypeError, match="torch.Tensor"):
        mpx.share([1, 2, 3])
    with pytest.raises(ValueError, match="strided"):
        mpx.share(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match="CPU"):
        mpx.share(torch.empty(2, device="meta"))


@pytest.mark.usefixtures("impl")
def test_shared_tensor_writes_are_seen_by_both_sides(ctx):
    with mpx.MessageQueue(1, 1) as q:
        p, conn = _procs.start(ctx, tp.modify_shared, q.export_handle())
        q.wait_until_ready(30)
        s = mpx.share(torch.zeros(4, 6))
        view = s[1:, ::2]
        q.enqueue(view, timeout=10)
        assert conn.poll(30)
        assert conn.recv() == ("modified", view.shape, view.stride())  # strides kept
        assert s[1:, ::2].eq(1).all() and s[0].eq(0).all() and s[1:, 1::2].eq(0).all()
        view.fill_(5)
        conn.send("check")
        assert conn.recv() == ("sees", [[5.0] * 3] * 3)
        (name,) = _segments_of(os.getpid())
        del s, view
        gc.collect()
        assert _segments_of(os.getpid()) == []      # the creator's last tensor is gone
        conn.send("unlinked")
        assert conn.recv() == ("still", [[10.0] * 3] * 3)
        p.join(20)
        assert p.exitcode == 0



def test_shared_tensor_is_copied_to_zmq_readers():
    """Readers over ZeroMQ may be on another node: they get a copy, not a mapping."""
    cfg = mpx.Config(auth_key="tensor-test-key", heartbeat_s=1.0, transport="zmq")
    s = mpx.share(torch.arange(1 << 16, dtype=torch.int32))
    with mpx.MessageQueue(1, 1, config=cfg) as q:
        r = mpx.MessageQueue.create_from_handle(q.export_handle(), 0, config=cfg)
        try:
            q.wait_until_ready(10)
            r.wait_until_ready(10)
            q.enqueue(s[::2], timeout=10)
            got = r.dequeue(timeout=10)
        finally:
            r.close()
    assert torch.equal(got, s[::2]) and got.is_contiguous() and sharing.locate(got) is None
    got.fill_(-1)
    assert s[0].item() == 0
    kind, parts = serde.encode(s)                       # local_only=False by default
    assert sum(memoryview(x).nbytes for x in parts) >= s.numel() * 4
    del s, got
    gc.collect()

@pytest.mark.usefixtures("impl")
def test_unpickling_after_the_creator_freed_it_is_a_typed_error(ctx):
    with mpx.MessageQueue(1, 1) as q:
        p, conn = _procs.start(ctx, tp.late_reader, q.export_handle())
        q.wait_until_ready(30)
        assert conn.poll(30) and conn.recv() == "ready"
        s = mpx.share(torch.ones(8))
        (name,) = _segments_of(os.getpid())
        q.enqueue(s, timeout=10)
        del s
        gc.collect()
        conn.send("go")
        assert conn.poll(30)
        tag, typ, is_deser, seg, msg = conn.recv()
        assert (tag, typ, is_deser) == ("error", "SharedTensorGoneError", True)
        assert seg == "/" + name and name in msg and "mpx.share" in msg
        p.join(20)
        assert p.exitcode == 0


def test_sigkilled_creator_segment_is_reaped(ctx):
    p, conn = _procs.start(ctx, tp.share_then, "hang")
    try:
        assert conn.poll(60)
        r = mpx.MessageQueue.create_from_handle(conn.recv(), 0)
        t = r.dequeue(timeout=30)
        assert conn.recv() == ("sent", p.pid)
        assert t.tolist() == list(range(16))
        left = _segments_of(p.pid)
        assert len(left) == 1                      # the queue's own ring is unlinked already
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert _segments_of(p.pid) == left         # nobody unlinked it
        assert "/" + left[0] in segments.stale_segments()
        assert "/" + left[0] in segments.reap_stale()
        assert _segments_of(p.pid) == []
        t.add_(1)                                  # our mapping outlives the name
        assert t.tolist() == list(range(1, 17))
        r.close()
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)
        conn.close()


def test_creator_exit_unlinks_live_shared_tensors(ctx):
    p, conn = _procs.start(ctx, tp.share_then, "exit")
    try:
        assert conn.poll(60)
        r = mpx.MessageQueue.create_from_handle(conn.recv(), 0)
        t = r.dequeue(timeout=30)
        assert conn.recv() == ("sent", p.pid)
        assert len(_segments_of(p.pid)) == 1
        conn.send("exit")
        p.join(30)
        assert p.exitcode == 0
        assert _segments_of(p.pid) == []           # unlinked at exit, tensor alive or not
        assert t.tolist() == list(range(16))
        r.close()
    finally:
        if p.is_alive():
            p.kill()
        p.join(10)
        conn.close()


# --------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_tensor_goes_by_ipc_to_a_local_reader():
    spawn = multiprocessing.get_context("spawn")   # CUDA does not survive fork
    t = torch.arange(1024, dtype=torch.float32, device="cuda")
    with mpx.MessageQueue(1, 1) as q:
        p, conn = _procs.start(spawn, tp.cuda_reader, q.export_handle())
        q.wait_until_ready(60)
        kind, parts = serde.encode(t, local_only=True)
        assert sum(memoryview(x).nbytes for x in parts) < 4096   # a handle, not the bytes
        q.enqueue(t, timeout=30)
        assert conn.poll(60)
        tag, device, values = conn.recv()
        assert device.startswith("cuda") and values == list(range(1024))
        assert conn.recv() == "added"
        torch.cuda.synchronize()
        assert t.cpu().tolist() == list(range(1, 1025))          # the same device memory
        conn.send("bye")
        p.join(30)
        assert p.exitcode == 0


@cuda
def test_cuda_tensor_goes_through_host_memory_to_remote_readers():
    t = torch.randn(33, 17, device="cuda").t()
    kind, parts = serde.encode(t, local_only=False)
    assert sum(memoryview(x).nbytes for x in parts) >= t.numel() * 4
    got = serde.decode(kind, bytearray(b"".join(bytes(x) for x in parts)))
    assert got.device.type == "cuda" and got.is_contiguous() and torch.equal(got, t)
    got.add_(1)
    assert not torch.equal(got, t)                               # a copy



class _Nested:
    """Encodes another message while being pickled (a reentrant encode in one thread)."""

    def __reduce__(self):
        kind, parts = serde.encode({"inner": torch.ones(3)})
        return (bytes, (sum(memoryview(p).nbytes for p in parts),))


def _roundtrip(obj):
    kind, parts = serde.encode(obj)
    return serde.decode(kind, bytearray(b"".join(bytes(memoryview(p)) for p in parts)))


class _Payload:
    pass


def test_kept_picklers_are_reentrant_and_hold_nothing():
    import weakref
    out = _roundtrip({"t": torch.arange(4.0), "n": _Nested()})
    assert torch.equal(out["t"], torch.arange(4.0)) and isinstance(out["n"], bytes)
    obj = _Payload()
    ref = weakref.ref(obj)
    assert isinstance(_roundtrip({"obj": [obj], "t": torch.zeros(2)})["obj"][0], _Payload)
    del obj
    gc.collect()
    assert ref() is None  # the kept pickler's memo let go of it
    # a pickle over 1 MiB (bytes travel in band): its pickler is dropped, the next is new
    assert _roundtrip([torch.ones(2), bytes(2 << 20)])[1] == bytes(2 << 20)
    assert torch.equal(_roundtrip(torch.ones(3)), torch.ones(3))
