"""Objects to messages and back: ``encode(obj) -> (kind, parts)``, ``decode(kind, data)``.

A small tuple of scalars (most calls and replies: ``(CALL, seq, "method", (1, 2.0),
None, None)``, ``(seq, OK, None)``) is a ``K_SMALL`` message in a codec of its own
(``mpx.mechanism.codec.small_encode``): tags and values, no pickle (where the codec is
compiled: ``SMALL_TUPLES``). Anything else is pickle protocol 5 with out-of-band buffers,
so numpy arrays, CPU tensors and large ``bytes``, ``bytearray`` and ``memoryview``
objects (``OOB_MIN_BYTES`` and up), wherever they sit in the object, are copied straight
from their memory into ring slots. The pickle itself is not joined either: the message is the
pickler's chunks as they came. Callables that plain pickle refuses (lambdas, local
functions) go through cloudpickle. A K_PICKLE_OOB message is a prelude (the buffers'
lengths and what each becomes), the pickle and the buffers, 64-byte aligned
(``mpx/mechanism/codec.py`` frames it). Decoded objects own their memory: buffers are views
of a bytearray the reader allocated, or copies.

This module is the policy: what goes out of band, the picklers (dispatch tables, the
tensor and memoryview reducers, cloudpickle), the message kinds and the errors. The
mechanism is ``mpx.mechanism.codec`` (compiled where a compiler is), which gets the
settings as constructor arguments: ``configure`` rebuilds it with others.

Tensors (``torch.Tensor`` and ``nn.Parameter``, dense, strided):

- CPU: every dtype travels bit-exactly (bfloat16, float8, complex32, bool, unsigned...)
  with its shape, ``requires_grad`` and type. The bytes go out of band: one copy into the
  ring, one out into the reader's own memory. A non-contiguous tensor (a transpose, a
  slice with a step, an ``expand``, channels-last) is made contiguous on the writer, at the
  cost of one more copy there, and arrives contiguous; conj and neg views arrive resolved.
  A tensor with ``requires_grad`` arrives as a leaf (the autograd graph stays behind).
- With ``local_only``, a tensor in a segment made by ``mpx.share`` (or a view of one)
  travels by reference: the receiver maps the same memory and keeps the view's strides
  (``mpx/protocol/sharing.py``). Otherwise it is copied like any CPU tensor.
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
import sys
from typing import Any

import cloudpickle

from mpx.errors import DeserializationError, SerializationError
from mpx.mechanism import codec as _codec
from mpx.mechanism.layout import KIND_AS_BYTES
from mpx.protocol import sharing

# Message kinds. The transports carry a kind untouched and look only at KIND_AS_BYTES:
# whether the reader gets the message as bytes or as a writable bytearray.
K_PICKLE = 1 | KIND_AS_BYTES  # one in-band pickle
K_PICKLE_OOB = 2              # prelude + pickle + out-of-band buffers (views of it stay writable)
K_BYTES = 3 | KIND_AS_BYTES   # a raw bytes object
K_SMALL = 4 | KIND_AS_BYTES   # a small tuple of scalars (calls and replies), not a pickle

# What unpickling may raise and still be no DeserializationError: an interrupt is the
# process's (a signal, sys.exit), not the message's. Anything else (CancelledError, a user's
# BaseException from __setstate__) marks the message undecodable.
_NOT_UNDECODABLE = (DeserializationError, KeyboardInterrupt, SystemExit)


def _rebuild_tensor(buf, dtype, shape, requires_grad, is_param, device=None):
    import torch
    if len(buf):
        t = torch.frombuffer(buf, dtype=dtype)
        if len(shape) != 1:
            t = t.view(shape)
    else:
        t = torch.empty(shape, dtype=dtype)
    if device == "cuda" and torch.cuda.is_available():
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    if is_param:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _host_reduce(t):
    """A dense tensor's bytes, in host memory, contiguous, conj/neg bits applied, out of
    band. A CUDA tensor is marked to go back to a GPU on the receiver. (Each torch call
    costs ~1 us: the common tensor, contiguous, on the CPU, with no grad and no conj/neg
    bit, takes three.)"""
    import torch
    c = t.detach() if t.requires_grad else t
    if c.is_conj() or c.is_neg():
        c = c.resolve_conj().resolve_neg()
    device = None
    if c.is_cuda:
        c, device = c.cpu(), "cuda"
    c = c.contiguous()
    if c.dim() != 1 or c.stride(0) != 1:
        # (a contiguous tensor may still have odd strides on dims of size 0 or 1)
        n = c.numel()
        c_flat = torch.as_strided(c, (n,), (1,)) if n else torch.empty(0, dtype=c.dtype)
    else:
        c_flat = c
    raw = c_flat.view(torch.uint8).numpy()
    is_param = type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter)
    return _rebuild_tensor, (pickle.PickleBuffer(raw), c.dtype, tuple(c.shape),
                             t.requires_grad, is_param, device)


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
OOB_MIN_BYTES = 1 << 20  # (configure() changes it)

# Small tuples travel in the small codec where it is compiled: there a no-op's round trip
# takes 0.84x its time with pickle. Run as plain Python the codec costs ~6x the C pickler
# (9.3 us against 1.5 us for a call and its reply, each encoded and decoded), so the plain
# build pickles them. Either build decodes both kinds, so the two talk to each other.
SMALL_TUPLES = _codec.IMPLEMENTATION == "cython"  # (configure() changes it)


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


def _kept_encode(enc: Any, obj: Any, local_only: bool) -> tuple[int, tuple]:
    """``encode`` when this thread keeps no pickler the encoder can use for ``local_only``
    (none yet, torch imported or a reducer registered with copyreg since, or it is in use:
    a reducer that encodes): a new one, whose dispatch table carries copyreg's reducers,
    the memoryview reducer and, once torch is imported, the tensor reducers (see
    ``_table``), which the encoder keeps."""
    with_torch = "torch" in sys.modules
    sink = enc.sink()
    p = pickle.Pickler(sink, protocol=5, buffer_callback=sink.oob.append)
    p.dispatch_table = _table(local_only, with_torch)
    return enc.keep(obj, p, sink, local_only, with_torch, _merged[(local_only, with_torch)][0])


def _cloud_encode(enc: Any, obj: Any, local_only: bool, first: Exception) -> tuple[int, tuple]:
    """``encode`` of an object the kept pickler refused (``first``): with cloudpickle
    (lambdas, local functions), a pickler per call, else SerializationError."""
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
    sink = enc.sink()
    try:
        return enc.dump(obj, cls(sink, protocol=5, buffer_callback=sink.oob.append), sink)
    except Exception as e:
        raise SerializationError(
            f"cannot pickle {type(obj).__name__} object for mpx: {e}") from first


def encode(obj: Any, local_only: bool = False) -> tuple[int, tuple]:
    """``(kind, parts)``: ``obj`` as a message, its buffers to concatenate; raises
    SerializationError. ``local_only``: every receiver is a process on this node that maps
    shared memory, so ``mpx.share`` tensors travel by reference and CUDA tensors as CUDA
    IPC handles; otherwise both are copied (CUDA ones through host memory). Bytes travel as
    they are, a small tuple (most calls and replies) in the small codec (``K_SMALL``;
    see ``SMALL_TUPLES``),
    anything else as one pickle by this thread's kept pickler: all in the codec (compiled),
    which leaves to this module only what it returns None or raises for."""
    enc = _encoder
    try:
        got = enc.encode(obj, local_only)
        return got if got is not None else _kept_encode(enc, obj, local_only)
    except Exception as e:
        return _cloud_encode(enc, obj, local_only, e)


def encode_small(obj: Any) -> tuple[int, tuple] | None:
    """``(kind, parts)`` of ``obj`` when it travels as a small message (see ``SMALL_TUPLES``:
    a tuple of scalars), else None: what ``encode`` would make of it, with no pickler, so
    that no user code (a ``__reduce__``) runs."""
    if not SMALL_TUPLES:
        return None
    small = _codec.small_encode(obj)
    return None if small is None else (K_SMALL, (small,))


def configure(*, oob_min_bytes: int | None = None, small_tuples: bool | None = None) -> None:
    """Rebuild the encoder with ``oob_min_bytes`` as the size from which bytes, bytearrays
    and memoryviews travel out of band (``OOB_MIN_BYTES``) and ``small_tuples``: whether a
    small tuple is a small message or a pickle (``SMALL_TUPLES``); a setting not given
    stays as it is. The compiled encoder takes its settings as constants: this, not
    assigning the module's globals, is how a test or a benchmark changes them
    (``configure(oob_min_bytes=old)`` undoes it). Every later encode in any thread uses it;
    each thread's kept picklers are made again."""
    global OOB_MIN_BYTES, SMALL_TUPLES, _encoder
    if oob_min_bytes is not None:
        OOB_MIN_BYTES = oob_min_bytes
    if small_tuples is not None:
        SMALL_TUPLES = small_tuples
    _encoder = _codec.Encoder(OOB_MIN_BYTES, K_BYTES, K_SMALL, K_PICKLE, K_PICKLE_OOB,
                              SMALL_TUPLES)


_encoder: Any = None
configure()

_decoder = _codec.Decoder(K_BYTES, K_SMALL, K_PICKLE, K_PICKLE_OOB, DeserializationError,
                          _NOT_UNDECODABLE)

# ``decode(kind, data)``: the object of a received message (``data`` of its own). Raises
# DeserializationError.
decode = _decoder.decode

# ``decode_lent(kind, data)``: ``decode`` of a message whose ``data`` may be lent: a
# read-only memoryview of a ring slot, valid during the call only. What it returns owns its
# memory (an in-band pickle copies what it builds out of its input). A plain pickle and a
# small message, the common ones, are decoded in C without a copy first.
decode_lent = _decoder
