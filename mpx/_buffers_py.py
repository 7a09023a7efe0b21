"""Pure-Python twin of ``mpx/_buffers.pyx``: the ZeroMQ reader's reassembler, the
pickler's sink, each thread's kept picklers and the small-message codec."""

from __future__ import annotations

import copyreg
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

IMPLEMENTATION = "python"

FRESH_MEMO_BYTES = 512  # (see mpx/_buffers.pyx)

# the small-message codec's tags and limits (see mpx/_buffers.pyx)
SMALL_NONE, SMALL_FALSE, SMALL_TRUE, SMALL_INT, SMALL_FLOAT = 0, 1, 2, 3, 4
SMALL_STR, SMALL_BYTES, SMALL_TUPLE = 5, 6, 7
SMALL_MAX_BYTES, SMALL_MAX_LEN, SMALL_MAX_DEPTH = 256, 255, 4
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class Assembler:
    """See ``mpx._buffers.Assembler``."""

    def __init__(self, total: int, as_bytes: bool) -> None:
        self._as_bytes = as_bytes
        self._dest: bytearray | None = bytearray(total)
        self._total = total
        self._off = 0

    def add(self, piece) -> None:
        """Append ``piece``; ValueError if it would overrun the message."""
        if self._dest is None:
            raise ValueError("the message was already taken")
        n = memoryview(piece).nbytes
        if n > self._total - self._off:
            raise ValueError(f"a piece of {n} bytes overruns the message "
                             f"({self._off} of {self._total} bytes filled)")
        self._dest[self._off:self._off + n] = piece
        self._off += n

    @property
    def complete(self) -> bool:
        """Whether every byte of the message was added."""
        return self._off == self._total

    def result(self) -> bytes | bytearray:
        """The message; ValueError unless every byte was added."""
        if not self.complete:
            raise ValueError(f"message incomplete: {self._off} of {self._total} bytes")
        if self._dest is None:
            raise ValueError("the message was already taken")
        dest, self._dest = self._dest, None
        return bytes(dest) if self._as_bytes else dest


class Sink:
    """See ``mpx._buffers.Sink``."""

    __slots__ = ("parts", "oob", "size", "big", "_on_big")

    def __init__(self, big: int, on_big: Callable[[Sink, Any, int], bool]) -> None:
        self.parts: list = []
        self.oob: list = []
        self.size = 0
        self.big = big
        self._on_big = on_big

    def write(self, b) -> None:
        n = len(b)
        if n >= self.big and self._on_big(self, b, n):
            return
        self.parts.append(b)
        self.size += n

    def dump(self, pickler: Any, obj: Any) -> tuple | None:
        """See ``mpx._buffers.Sink.dump``."""
        large = True
        try:
            pickler.dump(obj)
            large = self.size >= FRESH_MEMO_BYTES
        except BaseException:
            self.reset()
            raise
        finally:
            if large:
                pickler.memo = {}
            else:
                pickler.clear_memo()
        if self.oob:
            return None
        parts = tuple(self.parts)
        self.parts = []
        self.size = 0
        return parts

    def reset(self) -> None:
        """Forget what was written."""
        self.parts = []
        self.oob.clear()
        self.size = 0


class Picklers:
    """See ``mpx._buffers.Picklers``."""

    def __init__(self, make: Callable[[bool, bool], tuple[Sink, Any, Any]],
                 settings: dict[str, Any]) -> None:
        self._make = make
        self._settings = settings
        self._local = threading.local()

    def dumps(self, obj: Any, local_only: bool) -> tuple[tuple | None, Sink]:
        """See ``mpx._buffers.Picklers.dumps``."""
        try:
            kept = self._local.kept
        except AttributeError:
            kept = self._local.kept = [None] * 4
        with_torch = "torch" in sys.modules
        i = local_only + 2 * with_torch
        entry = kept[i]  # [sink, pickler, seen, busy]
        if entry is None or entry[0].big != self._settings["OOB_MIN_BYTES"] or \
                entry[2] != copyreg.dispatch_table:
            entry = kept[i] = [*self._make(local_only, with_torch), False]
        elif entry[3]:
            entry = [*self._make(local_only, with_torch), False]
        sink, pickler = entry[0], entry[1]
        entry[3] = True
        try:
            return sink.dump(pickler, obj), sink
        finally:
            entry[3] = False


class Encoder:
    """See ``mpx._buffers.Encoder``; ``small_kind`` goes unused here (see ``encode``)."""

    def __init__(self, picklers: Picklers, bytes_kind: int, small_kind: int, pickle_kind: int,
                 refused: Callable[[Any, bool, Exception], tuple[int, tuple]],
                 oob: Callable[[Sink], tuple[int, tuple]]) -> None:
        self.picklers = picklers
        self.bytes_kind = bytes_kind
        self.pickle_kind = pickle_kind
        self.refused = refused
        self.oob = oob

    def encode(self, obj: Any, local_only: bool = False) -> tuple[int, tuple]:
        """See ``mpx._buffers.Encoder.encode``; but a small tuple is pickled here: the C
        pickler is faster than the small codec in Python (~0.3 us against ~2.6 for a call).
        Its small messages still decode anywhere, and this twin decodes the compiled
        encoder's."""
        if type(obj) is bytes:
            return self.bytes_kind, (obj,)
        try:
            parts, sink = self.picklers.dumps(obj, local_only)
        except Exception as e:
            return self.refused(obj, local_only, e)
        if parts is not None:
            return self.pickle_kind, parts
        try:
            return self.oob(sink)
        finally:
            sink.reset()


class LentDecoder:
    """See ``mpx._buffers.LentDecoder``."""

    def __init__(self, pickle_kind: int, small_kind: int, loads: Callable[[Any], Any],
                 other: Callable[[int, Any], Any], undecodable: Callable[[BaseException], Exception],
                 passthrough: tuple[type[BaseException], ...]) -> None:
        self.pickle_kind = pickle_kind
        self.small_kind = small_kind
        self.loads = loads
        self.other = other
        self.undecodable = undecodable
        self.passthrough = passthrough

    def __call__(self, kind: int, data: Any) -> Any:
        try:
            if kind == self.small_kind:
                return small_decode(data)
            if kind != self.pickle_kind:
                return self.other(kind, data)
            return self.loads(data)
        except self.passthrough:
            raise
        except BaseException as e:
            raise self.undecodable(e) from e


def _small_put(o: Any, out: bytearray, depth: int) -> bool:
    if len(out) + 10 > SMALL_MAX_BYTES:
        return False
    if o is None:
        out.append(SMALL_NONE)
        return True
    t = type(o)
    if t is tuple:
        if depth >= SMALL_MAX_DEPTH or len(o) > SMALL_MAX_LEN:
            return False
        out += bytes((SMALL_TUPLE, len(o)))
        return all(_small_put(item, out, depth + 1) for item in o)
    if t is int:
        if not _INT64_MIN <= o <= _INT64_MAX:
            return False
        out.append(SMALL_INT)
        out += _I64.pack(o)
        return True
    if t is str:
        if len(o) > SMALL_MAX_LEN or not o.isascii() or len(out) + 2 + len(o) > SMALL_MAX_BYTES:
            return False
        out += bytes((SMALL_STR, len(o)))
        out += o.encode("ascii")
        return True
    if t is bool:
        out.append(SMALL_TRUE if o else SMALL_FALSE)
        return True
    if t is float:
        out.append(SMALL_FLOAT)
        out += _F64.pack(o)
        return True
    if t is bytes:
        if len(o) > SMALL_MAX_LEN or len(out) + 2 + len(o) > SMALL_MAX_BYTES:
            return False
        out += bytes((SMALL_BYTES, len(o)))
        out += o
        return True
    return False


def small_encode(obj: Any) -> bytes | None:
    """See ``mpx._buffers.small_encode``."""
    if type(obj) is not tuple:
        return None
    out = bytearray()
    return bytes(out) if _small_put(obj, out, 0) else None


def _small_get(p: memoryview, pos: int, depth: int) -> tuple[Any, int]:
    if pos >= len(p):
        raise ValueError("small message truncated")
    tag = p[pos]
    pos += 1
    if tag in (SMALL_NONE, SMALL_FALSE, SMALL_TRUE):
        return (None if tag == SMALL_NONE else tag == SMALL_TRUE), pos
    if tag in (SMALL_INT, SMALL_FLOAT):
        if pos + 8 > len(p):
            raise ValueError("small message truncated")
        return (_I64 if tag == SMALL_INT else _F64).unpack_from(p, pos)[0], pos + 8
    if tag not in (SMALL_STR, SMALL_BYTES, SMALL_TUPLE):
        raise ValueError(f"small message has an unknown tag {tag}")
    if pos >= len(p):
        raise ValueError("small message truncated")
    n = p[pos]
    pos += 1
    if tag == SMALL_TUPLE:
        if depth >= SMALL_MAX_DEPTH:
            raise ValueError("small message nested too deep")
        items = []
        for _ in range(n):
            item, pos = _small_get(p, pos, depth + 1)
            items.append(item)
        return tuple(items), pos
    if pos + n > len(p):
        raise ValueError("small message truncated")
    raw = bytes(p[pos:pos + n])
    return (raw.decode("ascii") if tag == SMALL_STR else raw), pos + n


def small_decode(data: Any) -> tuple:
    """See ``mpx._buffers.small_decode``."""
    with memoryview(data) as view:
        p = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        obj, pos = _small_get(p, 0, 0)
        if pos != len(p) or type(obj) is not tuple:
            raise ValueError("small message malformed")
        return obj
