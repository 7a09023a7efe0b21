"""Objects to messages and back: ``encode(obj) -> (kind, parts)``, ``decode(kind, data)``.

A small tuple of scalars (most calls and replies: ``(CALL, seq, "method", (1, 2.0),
None, None)``, ``(seq, OK, None)``) is a ``K_SMALL`` message in a codec of its own
(``mpx._buffers.small_encode``): tags and values, no pickle. Anything else is pickle
protocol 5 with out-of-band buffers, so numpy arrays, CPU tensors and large
``bytes``, ``bytearray`` and ``memoryview`` objects (``OOB_MIN_BYTES`` and up), wherever
they sit in the object, are copied straight from their memory into ring slots. The pickle
itself is not joined either: the message is the pickler's chunks as they came. Callables
that plain pickle refuses (lambdas, local functions) go through cloudpickle. A
K_PICKLE_OOB message is::

    u64 n_buffers, u64 pickle_len, u64 buffer_len[n_buffers], pickle bytes,
    then each buffer at the next 64-byte-aligned offset of the message.

The top byte of a buffer_len says what the reader makes of it: 0 a view of its message
(numpy, tensors), 1 a bytes, 2 a bytearray of its own. Decoded objects own their memory:
buffers are views of a bytearray the reader allocated, or copies.

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
import pickle
import struct
import sys
from typing import Any

import cloudpickle

from mpx import sharing
from mpx._impl import buffers_module
from mpx.errors import DeserializationError, SerializationError
from mpx.layout import KIND_AS_BYTES

# Message kinds. The transports carry a kind untouched and look only at KIND_AS_BYTES:
# whether the reader gets the message as bytes or as a writable bytearray.
K_PICKLE = 1 | KIND_AS_BYTES  # one in-band pickle
K_PICKLE_OOB = 2              # prelude + pickle + out-of-band buffers (views of it stay writable)
K_BYTES = 3 | KIND_AS_BYTES   # a raw bytes object
K_SMALL = 4 | KIND_AS_BYTES   # a small tuple of scalars (calls and replies), not a pickle

_ALIGN = 64
_PAD = bytes(_ALIGN)

# What unpickling may raise and still be no DeserializationError: an interrupt is the
# process's (a signal, sys.exit), not the message's. Anything else (CancelledError, a user's
# BaseException from __setstate__) marks the message undecodable.
_NOT_UNDECODABLE = (DeserializationError, KeyboardInterrupt, SystemExit)


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
_cloud_picklers: dict[tuple[bool, bool], type] = {}


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


# (local_only, torch imported) -> (the copyreg.dispatch_table it was built from, the table)
_merged: dict[tuple[bool, bool], tuple[dict, dict]] = {}


def _table(local_only: bool, with_torch: bool) -> dict:
    """The pickler's dispatch table: every reducer registered with ``copyreg.pickle`` (a
    pickler's own table hides copyreg's, so it must carry them), the memoryview reducer,
    then the tensor reducers once torch is imported. Rebuilt when copyreg's table changed
    since (a dict comparison, ~0.1 us), so later registrations count."""
    key = (local_only, with_torch)
    entry = _merged.get(key)
    registered = copyreg.dispatch_table
    if entry is None or entry[0] != registered:
        snapshot = dict(registered)
        table = {**snapshot, memoryview: _reduce_memoryview}
        if with_torch:
            table.update(_dispatch(local_only))
        entry = _merged[key] = (snapshot, table)
    return entry[1]


# Large bytes and bytearrays travel out of band from this size up. The C pickler hands
# them to its file's write() as they are (no copy) from 64 KiB up (CPython's
# FRAME_SIZE_TARGET), so in band or out, the writer copies them once, into the ring; the
# reader copies twice either way (ring -> message -> object). Out of band costs ~5 us more
# per message below 1 MiB (64 KiB 1.36-1.42x, 256 KiB 1.15-1.19x, 1 MiB in band 1.09x of
# out of band, one run 0.80x) and is 0.80-0.88x from 1-2 MiB up, where fresh memory
# dominates (bench/bench_inband.py --sections t, a shared 2-core VM): 1 MiB it is.
OOB_MIN_BYTES = 1 << 20

_NEXT_BUFFER = b"\x97"          # pickle protocol 5: push the next out-of-band buffer
_BINBYTES, _BINBYTES8, _BYTEARRAY8 = 0x42, 0x8E, 0x96
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Out-of-band buffer tags, in the top byte of a buffer's length in the prelude: what the
# reader makes of the bytes (a view of its message, or an object of its own).
_TAG_VIEW, _TAG_BYTES, _TAG_BYTEARRAY = 0, 1, 2
_TAG_SHIFT = 56
_LEN_MASK = (1 << _TAG_SHIFT) - 1


def _payload_refs() -> int:
    """The reference count (as sys.getrefcount sees it in ``_take_out_of_band``, called by
    the sink's write) above which a write is an object of the caller's, not a chunk the
    pickler made for it; 0 when this Python's pickler does not hand large bytes over as
    they are (everything stays in band).

    The pickler's own chunks are fresh bytes it owns alone when it calls write(); a bytes
    or bytearray of the caller's is also held by its container (or a reducer's args)."""
    seen: list[tuple[int, int]] = []

    def probe(sink, b, n: int) -> bool:
        seen.append((n, sys.getrefcount(b)))
        return False

    big = bytes(OOB_MIN_BYTES)
    pickle.Pickler(_buffers.Sink(0, probe), protocol=5).dump([big])
    payload = [refs for n, refs in seen if n == len(big)]
    chunks = [refs for n, refs in seen if n != len(big)]
    if len(payload) != 1 or not chunks or payload[0] <= max(chunks):
        return 0
    return max(chunks)


def _take_out_of_band(sink, b, n: int) -> bool:
    """The sink's policy for a write of OOB_MIN_BYTES or more: a bytes or bytearray of the
    caller's (not a chunk of the pickler's) goes out of band, and the pickle gets
    NEXT_BUFFER in place of its header (the end of the last part). True if taken."""
    if not (_CHUNK_REFS and sys.getrefcount(b) > _CHUNK_REFS) or \
            not (type(b) is bytes or type(b) is bytearray) or not sink.parts:
        return False
    prev = sink.parts[-1]
    if type(b) is bytes and len(prev) >= 5 and prev[-5] == _BINBYTES and \
            _U32.unpack_from(prev, len(prev) - 4)[0] == n:
        head = 5
    elif len(prev) >= 9 and prev[-9] == (_BINBYTES8 if type(b) is bytes else _BYTEARRAY8) \
            and _U64.unpack_from(prev, len(prev) - 8)[0] == n:
        head = 9
    else:
        return False
    if len(prev) == head:
        sink.parts[-1] = _NEXT_BUFFER
    else:
        sink.parts[-1] = memoryview(prev)[:-head]
        sink.parts.append(_NEXT_BUFFER)
    sink.size += 1 - head
    sink.oob.append(b)
    return True


def _new_sink():
    """The pickler's file: collects its output as parts, without joining them, and takes
    the caller's large bytes and bytearrays out of band (the objects themselves become
    buffers, copied once, into the ring). PickleBuffers come in ``oob`` too, through the
    pickler's buffer_callback."""
    return _buffers.Sink(OOB_MIN_BYTES, _take_out_of_band)


_buffers = buffers_module()
_CHUNK_REFS = _payload_refs()


def _reduce_memoryview(m: memoryview):
    """A memoryview arrives as one (format, shape, read-only) over memory of the reader's
    own; a large one's bytes travel out of band."""
    if m.nbytes >= OOB_MIN_BYTES and m.c_contiguous:
        data: Any = pickle.PickleBuffer(m)
    else:
        data = m.tobytes()
    return _rebuild_memoryview, (data, m.format, m.shape, m.readonly)


def _rebuild_memoryview(data, fmt: str, shape: tuple, readonly: bool) -> memoryview:
    if type(data) is bytes and not readonly:
        data = bytearray(data)
    m = memoryview(data).cast("B")
    if fmt != "B" or len(shape) != 1:
        m = m.cast(fmt, shape)  # type: ignore[call-overload]
    return m.toreadonly() if readonly else m


def _new_pickler(local_only: bool, with_torch: bool) -> tuple[Any, pickle.Pickler, dict]:
    """A pickler to keep (see ``_picklers``): its sink, itself, and the copyreg table its
    dispatch table was built from."""
    sink = _new_sink()
    p = pickle.Pickler(sink, protocol=5, buffer_callback=sink.oob.append)
    p.dispatch_table = _table(local_only, with_torch)
    return sink, p, _merged[(local_only, with_torch)][0]


# Each thread keeps its picklers, with their sinks: building one costs ~1 us, more than
# pickling a small call (0.25 us). ``_picklers.dumps(obj, local_only)``: ``(parts, sink)``;
# ``parts`` is None when something went out of band (the message is in the sink then: the
# caller resets it when done).
_picklers = _buffers.Picklers(_new_pickler, globals())


def _cloud_dumps(obj: Any, local_only: bool) -> tuple[tuple | None, Any]:
    """``_picklers.dumps`` with cloudpickle (lambdas, local functions), a pickler per call."""
    with_torch = "torch" in sys.modules
    cls = _cloud_picklers.get((local_only, with_torch))
    if cls is None:
        # CloudPickler reads its class's dispatch_table when it is built, so a table of
        # our own needs a subclass
        base = cloudpickle.Pickler
        mine = {memoryview: _reduce_memoryview}
        if with_torch:
            mine.update(_dispatch(local_only))
        table = collections.ChainMap(mine, base.dispatch_table)
        cls = _cloud_picklers[(local_only, with_torch)] = type(
            "_MpxCloudPickler", (base,), {"dispatch_table": table})
    sink = _new_sink()
    return sink.dump(cls(sink, protocol=5, buffer_callback=sink.oob.append), obj), sink


def _encode_refused(obj: Any, local_only: bool, first: Exception) -> tuple[int, tuple]:
    """encode() of an object the kept pickler refused (``first``): with cloudpickle
    (lambdas, local functions), else SerializationError."""
    try:
        parts, sink = _cloud_dumps(obj, local_only)
    except Exception as e:
        raise SerializationError(
            f"cannot pickle {type(obj).__name__} object for mpx: {e}") from first
    if parts is not None:
        return K_PICKLE, parts
    try:
        return _oob_message(sink)
    finally:
        sink.reset()


def _oob_message(sink: Any) -> tuple[int, tuple]:
    """The K_PICKLE_OOB message of a sink whose pickle sent buffers out of band."""
    raws: list = []
    lens: list[int] = []
    for b in sink.oob:
        t = type(b)
        if t is bytes or t is bytearray:
            raws.append(b)
            lens.append(len(b) | (_TAG_BYTES if t is bytes else _TAG_BYTEARRAY) << _TAG_SHIFT)
            continue
        try:
            r = b.raw()
        except BufferError as e:
            raise SerializationError(f"out-of-band buffer is not contiguous: {e}") from e
        raws.append(r)
        lens.append(r.nbytes)
    n = len(raws)
    prelude = struct.pack(f"<QQ{n}Q", n, sink.size, *lens)
    parts: list = [prelude, *sink.parts]
    off = len(prelude) + sink.size
    for r, ln in zip(raws, lens):
        ln &= _LEN_MASK
        pad = _aligned(off) - off
        if pad:
            parts.append(_PAD[:pad])
        parts.append(r)
        off += pad + ln
    return K_PICKLE_OOB, tuple(parts)


# ``encode(obj, local_only=False)``: ``(kind, parts)``, the message as buffers to
# concatenate; raises SerializationError. ``local_only``: every receiver is a process on
# this node that maps shared memory, so ``mpx.share`` tensors travel by reference and CUDA
# tensors as CUDA IPC handles; otherwise both are copied (CUDA ones through host memory).
# Compiled: bytes as they are, a small tuple (most calls and replies) in the small codec
# (``K_SMALL``), or one pickle by this thread's kept pickler, in C.
encode = _buffers.Encoder(_picklers, K_BYTES, K_SMALL, K_PICKLE, _encode_refused,
                          _oob_message).encode


def _owned_bytes(view: memoryview) -> bytes:
    return bytes(view)


def decode(kind: int, data) -> Any:
    """The object of a received message. Raises DeserializationError."""
    if kind == K_BYTES:
        return data
    try:
        if kind == K_PICKLE:
            return pickle.loads(data)
        if kind == K_SMALL:
            return _buffers.small_decode(data)
        if kind != K_PICKLE_OOB:
            raise ValueError(f"unknown message kind {kind}")
        mv = memoryview(data)
        n, plen = struct.unpack_from("<QQ", mv, 0)
        lens = struct.unpack_from(f"<{n}Q", mv, 16)
        off = 16 + 8 * n
        payload = mv[off:off + plen]
        off += plen
        bufs: list = []
        for ln in lens:
            tag = ln >> _TAG_SHIFT
            ln &= _LEN_MASK
            off = _aligned(off)
            view = mv[off:off + ln]
            if tag == _TAG_BYTES:
                bufs.append(_owned_bytes(view))
            elif tag == _TAG_BYTEARRAY:
                bufs.append(bytearray(view))
            else:
                bufs.append(view)
            off += ln
        return pickle.loads(payload, buffers=bufs)
    except _NOT_UNDECODABLE:
        raise
    except BaseException as e:
        raise _undecodable(e) from e


def _decode_lent_other(kind: int, data) -> Any:
    """decode_lent of any kind but a plain pickle."""
    if type(data) is memoryview:
        data = bytes(data) if kind & KIND_AS_BYTES else bytearray(data)
    return decode(kind, data)


def _undecodable(e: BaseException) -> DeserializationError:
    return DeserializationError(f"cannot unpickle a received message: {type(e).__name__}: {e}")


# ``decode`` of a message whose ``data`` may be lent: a read-only memoryview of a ring slot,
# valid during the call only. What it returns owns its memory (an in-band pickle copies what
# it builds out of its input). A plain pickle and a small message, the common ones, are
# decoded in C.
decode_lent = _buffers.LentDecoder(K_PICKLE, K_SMALL, pickle.loads, _decode_lent_other,
                                   _undecodable, _NOT_UNDECODABLE)
