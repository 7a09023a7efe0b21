"""Objects to messages and back: ``encode(obj) -> (kind, parts)``, ``decode(kind, data)``.

Pickle protocol 5 with out-of-band buffers, so numpy arrays, bytearrays and CPU tensors are
copied straight from their memory into ring slots. Callables that plain pickle refuses
(lambdas, local functions) go through cloudpickle. A K_PICKLE_OOB message is::

    u64 n_buffers, u64 pickle_len, u64 buffer_len[n_buffers], pickle bytes,
    then each buffer at the next 64-byte-aligned offset of the message.

Decoded objects own their memory: buffers are views of a bytearray the reader allocated.

Tensors (``torch.Tensor`` and ``nn.Parameter``, dense, strided):

- CPU: every dtype travels bit-exactly (bfloat16, float8, complex32, bool, unsigned...)
  with its shape, ``requires_grad`` and type. The bytes go out of band: one copy into the
  ring, one out into the reader's own memory. A non-contiguous tensor (a transpose, a
  slice with a step, an ``expand``, channels-last) is made contiguous on the writer, at the
  cost of one more copy there, and arrives contiguous; conj and neg views arrive resolved.
  A tensor with ``requires_grad`` arrives as a leaf (the autograd graph stays behind).
- With ``local_only``, a tensor in a segment made by ``mpx.share`` (or a view of one)
  travels by reference: the receiver maps the same memory and keeps the view's strides
  (``mpx/sharing.py``). Otherwise it is copied like any CPU tensor.
- CUDA: with ``local_only`` (every reader on this node) a CUDA IPC handle
  (``torch.multiprocessing.reductions.reduce_tensor``); the receiver gets a tensor on the
  same device, sharing its memory. Otherwise a host copy, rebuilt on the receiver's current
  CUDA device when it has CUDA, else left on its CPU.
- Sparse, quantized, nested and other devices' tensors use torch's own pickling (in band).
"""

from __future__ import annotations

import collections
import copyreg
import io
import pickle
import struct
import sys
import threading
from typing import Any

import cloudpickle

from mpx import sharing
from mpx.errors import DeserializationError, SerializationError
from mpx.layout import KIND_AS_BYTES

# Message kinds. The transports carry a kind untouched and look only at KIND_AS_BYTES:
# whether the reader gets the message as bytes or as a writable bytearray.
K_PICKLE = 1 | KIND_AS_BYTES  # one in-band pickle
K_PICKLE_OOB = 2              # prelude + pickle + out-of-band buffers (views of it stay writable)
K_BYTES = 3 | KIND_AS_BYTES   # a raw bytes object

_ALIGN = 64
_PAD = bytes(_ALIGN)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def _rebuild_tensor(buf, dtype, shape, requires_grad, is_param, device=None):
    import torch
    flat = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape)
    if device == "cuda" and torch.cuda.is_available():
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _host_reduce(t):
    """A dense tensor's bytes, in host memory, contiguous, conj/neg bits applied, out of
    band. A CUDA tensor is marked to go back to a GPU on the receiver."""
    import torch
    c = t.detach().resolve_conj().resolve_neg()
    device = None
    if c.device.type == "cuda":
        c, device = c.cpu(), "cuda"
    c = c.contiguous()
    # a contiguous tensor may still have odd strides on dims of size 0 or 1
    n = c.numel()
    flat = torch.as_strided(c, (n,), (1,)) if n else torch.empty(0, dtype=c.dtype)
    raw = flat.view(torch.uint8).numpy()
    return _rebuild_tensor, (pickle.PickleBuffer(raw), c.dtype, tuple(c.shape),
                             t.requires_grad, isinstance(t, torch.nn.Parameter), device)


def _cuda_ipc_reduce(t):
    from torch.multiprocessing.reductions import reduce_tensor
    if t.is_conj() or t.is_neg() or (t.requires_grad and not t.is_leaf):
        # torch shares leaves only, and its handle does not carry the conj/neg bits
        t = t.detach().resolve_conj().resolve_neg().requires_grad_(t.requires_grad)
    return reduce_tensor(t)


def _reduce_tensor(t, local_only=False):
    if t.layout is not sys.modules["torch"].strided or t.is_quantized or t.is_nested:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    kind = t.device.type
    if kind == "cpu":
        if local_only and sharing.by_base:
            ref = sharing.reference(t)
            if ref is not None:
                return sharing.rebuild, ref
        return _host_reduce(t)
    if kind == "cuda":
        return _cuda_ipc_reduce(t) if local_only else _host_reduce(t)
    return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def _reduce_tensor_local(t):
    return _reduce_tensor(t, True)


_tables: dict[bool, dict] | None = None
_cloud_picklers: dict[bool, type] = {}


def _dispatch(local_only: bool) -> dict:
    """The pickler's dispatch table for tensors, or {} without numpy (CPU tensor bytes
    travel as numpy views)."""
    global _tables
    if _tables is None:
        torch = sys.modules["torch"]
        try:
            import numpy  # noqa: F401
        except ImportError:
            _tables = {False: {}, True: {}}
        else:
            types = (torch.Tensor, torch.nn.Parameter)
            _tables = {False: dict.fromkeys(types, _reduce_tensor),
                       True: dict.fromkeys(types, _reduce_tensor_local)}
    return _tables[local_only]


# local_only -> (the copyreg.dispatch_table it was built from, the merged table)
_merged: dict[bool, tuple[dict, dict]] = {}


def _table(local_only: bool) -> dict:
    """The pickler's dispatch table: every reducer registered with ``copyreg.pickle`` (a
    pickler's own table hides copyreg's, so it must carry them), then the tensor reducers.
    Rebuilt when copyreg's table changed since (a dict comparison, ~0.1 us), so later
    registrations count."""
    entry = _merged.get(local_only)
    registered = copyreg.dispatch_table
    if entry is None or entry[0] != registered:
        snapshot = dict(registered)
        entry = _merged[local_only] = (snapshot, {**snapshot, **_dispatch(local_only)})
    return entry[1]


# Each thread keeps its tensor-aware picklers: building one costs ~1 us, more than
# pickling a small call (0.25 us), and every message pays it once torch is imported.
_picklers = threading.local()
# A pickler whose output grew past this is dropped, not kept with its big buffer.
_KEEP_PICKLER_BYTES = 1 << 20


def _dumps(obj: Any, buffers: list, local_only: bool) -> bytes:
    if "torch" not in sys.modules:
        return pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    kept = _picklers.__dict__
    key = "local" if local_only else "any"
    entry = kept.pop(key, None)  # in use (a nested call) makes a fresh one
    if entry is None:
        f = io.BytesIO()
        out: list = []
        p = pickle.Pickler(f, protocol=5, buffer_callback=out.append)
        entry = [f, p, out, None]
    f, p, out, seen = entry
    if seen != copyreg.dispatch_table:  # a new registration (or a new pickler)
        p.dispatch_table = _table(local_only)
        entry[3] = _merged[local_only][0]
    try:
        p.dump(obj)
        buffers.extend(out)
        return f.getvalue()
    finally:
        big = f.tell() > _KEEP_PICKLER_BYTES
        p.clear_memo()
        out.clear()
        f.seek(0)
        f.truncate()
        if not big:
            kept[key] = entry


def _cloud_dumps(obj: Any, buffers: list, local_only: bool) -> bytes:
    if "torch" not in sys.modules:
        return cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    cls = _cloud_picklers.get(local_only)
    if cls is None:
        # CloudPickler reads its class's dispatch_table when it is built, so a table of
        # our own needs a subclass
        base = cloudpickle.Pickler
        table = collections.ChainMap(_dispatch(local_only), base.dispatch_table)
        cls = _cloud_picklers[local_only] = type("_MpxCloudPickler", (base,),
                                                 {"dispatch_table": table})
    f = io.BytesIO()
    cls(f, protocol=5, buffer_callback=buffers.append).dump(obj)
    return f.getvalue()


def encode(obj: Any, local_only: bool = False) -> tuple[int, tuple]:
    """``(kind, parts)``: the message as buffers to concatenate. Raises SerializationError.

    ``local_only``: every receiver is a process on this node that maps shared memory, so
    ``mpx.share`` tensors travel by reference and CUDA tensors as CUDA IPC handles;
    otherwise both are copied (CUDA ones through host memory).
    """
    if type(obj) is bytes:
        return K_BYTES, (obj,)
    buffers: list = []
    try:
        data = _dumps(obj, buffers, local_only)
    except Exception as first:
        buffers.clear()
        try:
            data = _cloud_dumps(obj, buffers, local_only)
        except Exception as e:
            raise SerializationError(
                f"cannot pickle {type(obj).__name__} object for mpx: {e}") from first
    if not buffers:
        return K_PICKLE, (data,)
    try:
        raws = [b.raw() for b in buffers]
    except BufferError as e:
        raise SerializationError(f"out-of-band buffer is not contiguous: {e}") from e
    n = len(raws)
    prelude = struct.pack(f"<QQ{n}Q", n, len(data), *[r.nbytes for r in raws])
    parts: list = [prelude, data]
    off = len(prelude) + len(data)
    for r in raws:
        pad = _aligned(off) - off
        if pad:
            parts.append(_PAD[:pad])
        parts.append(r)
        off += pad + r.nbytes
    return K_PICKLE_OOB, tuple(parts)


def decode(kind: int, data) -> Any:
    """The object of a received message. Raises DeserializationError."""
    if kind == K_BYTES:
        return data
    try:
        if kind == K_PICKLE:
            return pickle.loads(data)
        if kind != K_PICKLE_OOB:
            raise ValueError(f"unknown message kind {kind}")
        mv = memoryview(data)
        n, plen = struct.unpack_from("<QQ", mv, 0)
        lens = struct.unpack_from(f"<{n}Q", mv, 16)
        off = 16 + 8 * n
        payload = mv[off:off + plen]
        off += plen
        bufs = []
        for ln in lens:
            off = _aligned(off)
            bufs.append(mv[off:off + ln])
            off += ln
        return pickle.loads(payload, buffers=bufs)
    except DeserializationError:
        raise
    except Exception as e:
        raise DeserializationError(f"cannot unpickle a received message: {type(e).__name__}: {e}") from e
