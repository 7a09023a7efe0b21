"""Objects to messages and back: ``encode(obj) -> (kind, parts)``, ``decode(kind, data)``.

Pickle protocol 5 with out-of-band buffers, so numpy arrays, bytearrays and CPU tensors are
copied straight from their memory into ring slots. Callables that plain pickle refuses
(lambdas, local functions) go through cloudpickle. A K_PICKLE_OOB message is::

    u64 n_buffers, u64 pickle_len, u64 buffer_len[n_buffers], pickle bytes,
    then each buffer at the next 64-byte-aligned offset of the message.

Decoded objects own their memory: buffers are views of a bytearray the reader allocated.
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from typing import Any

import cloudpickle

from mpx.errors import DeserializationError, SerializationError
from mpx.layout import K_BYTES, K_PICKLE, K_PICKLE_OOB

_ALIGN = 64
_U64 = struct.Struct("<Q")
_PAD = bytes(_ALIGN)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def _rebuild_tensor(buf, dtype, shape, requires_grad, is_param):
    import torch
    flat = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape)
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t):
    import torch
    if t.device.type != "cpu" or t.is_sparse or t.is_quantized or t.is_nested:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    c = t.detach().contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy()
    return _rebuild_tensor, (pickle.PickleBuffer(raw), c.dtype, tuple(c.shape),
                             t.requires_grad, isinstance(t, torch.nn.Parameter))


def _torch_dispatch() -> dict:
    torch = sys.modules["torch"]
    try:
        import numpy  # noqa: F401  (tensor bytes travel as numpy views)
    except ImportError:
        return {}
    return {torch.Tensor: _reduce_tensor, torch.nn.Parameter: _reduce_tensor}


_dispatch: dict | None = None


def _dumps(obj: Any, buffers: list) -> bytes:
    global _dispatch
    if "torch" not in sys.modules:
        return pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    if _dispatch is None:
        _dispatch = _torch_dispatch()
    f = io.BytesIO()
    p = pickle.Pickler(f, protocol=5, buffer_callback=buffers.append)
    p.dispatch_table = _dispatch
    p.dump(obj)
    return f.getvalue()


def encode(obj: Any) -> tuple[int, tuple]:
    """``(kind, parts)``: the message as buffers to concatenate. Raises SerializationError."""
    if type(obj) is bytes:
        return K_BYTES, (obj,)
    buffers: list = []
    try:
        data = _dumps(obj, buffers)
    except Exception as first:
        buffers.clear()
        try:
            data = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
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
    except Exception as e:
        raise DeserializationError(f"cannot unpickle a received message: {type(e).__name__}: {e}") from e
