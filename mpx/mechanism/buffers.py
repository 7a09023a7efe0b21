"""The primitives that reach memory directly, for mpx/mechanism/codec.py and the compiled
ring: here in plain Python, and in C as the ``cdef inline`` functions of ``buffers.pxd``
beside this file, which the compiled codec and ``mpx/_ring.pyx`` cimport (this file is
never compiled). The codec chooses one set once, where it is imported, so its own logic is
one source. The two sets take the same arguments and give the same results, but for what a
"memory" is: compiled, a ``char*``; here, a bytearray (or, read, a bytes).

Nothing here knows a message: these move bytes, numbers and references.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from typing import Any

# Large buffers get transparent-huge-page advice: 4 KiB page faults would otherwise cap a
# copy into fresh memory at ~3 GB/s. (Also a ``cdef enum`` of buffers.pxd, for the C.)
HUGE_ADVICE_MIN = 4 << 20

_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


def owned_buffer(as_bytes: bool, size: int, ptr: Any) -> bytes | bytearray:
    """A new buffer of ``size`` bytes that no one else holds: a bytes if ``as_bytes``, else a
    bytearray; MemoryError if it cannot be allocated. Compiled: uninitialised, its memory
    in ``*ptr`` (a ``char**``) for the caller to fill, with huge-page advice from
    HUGE_ADVICE_MIN bytes. Here: zeroed, ``ptr`` unused."""
    if size > sys.maxsize:
        raise MemoryError(f"cannot allocate a buffer of {size} bytes")
    return bytes(size) if as_bytes else bytearray(size)


def writable_buffer(as_bytes: bool, size: int) -> Any:
    """A buffer of ``size`` bytes for ``copy_into`` to fill; ``finished`` then makes it the
    message (a bytes if ``as_bytes``, else a bytearray). Compiled: ``owned_buffer``'s. Here
    a bytearray, whatever ``as_bytes`` says: a bytes cannot be written to."""
    return owned_buffer(False, size, None)


# Asks ``obj`` for a PyBUF_SIMPLE view and lets it go: the request the C bodies make, so
# that what they refuse (no buffer, not C-contiguous) is refused here alike, as they do.
_simple_request = struct.Struct("").unpack_from


def copy_into(dest: Any, off: int, piece: Any, room: int) -> int:
    """The length in bytes of ``piece`` (any C-contiguous buffer), whose bytes are copied
    into ``dest`` (a ``writable_buffer``) at ``off`` if they fit in ``room`` bytes.
    Compiled, the copy runs without the GIL."""
    _simple_request(piece)
    with memoryview(piece) as m:
        n = m.nbytes
        if 0 < n <= room:
            dest[off:off + n] = m
    return n


def finished(dest: Any, as_bytes: bool) -> bytes | bytearray:
    """The message a ``writable_buffer`` was filled with: a bytes if ``as_bytes``, else a
    bytearray (compiled, ``dest`` itself)."""
    return bytes(dest) if as_bytes else dest


def read_buffer(data: Any, read: Callable[[Any, int], Any]) -> Any:
    """``read(p, n)`` of the ``n`` bytes of ``data`` (any C-contiguous buffer; TypeError if
    it is none, BufferError if it is not contiguous): compiled, ``p`` points at ``data``'s
    memory while ``read`` runs; here ``p`` is a bytes of it (``data`` itself when it is
    one)."""
    if type(data) is not bytes:
        _simple_request(data)
        with memoryview(data) as m:
            data = m.tobytes()
    return read(data, len(data))


def scratch(n: int) -> bytearray:
    """``n`` bytes of scratch memory, the caller's alone, until it returns: compiled, on its
    stack, uninitialised (so ``scratch`` is a C macro there); here a new bytearray."""
    return bytearray(n)


def bytes_of(p: Any, n: int) -> bytes:
    """A new bytes of the first ``n`` bytes of memory ``p``."""
    return bytes(p[:n])


def put_i64(p: bytearray, at: int, o: int) -> bool:
    """Write int ``o`` at ``p[at:at + 8]``, little-endian; False (nothing written) if it is
    past int64."""
    try:
        _I64.pack_into(p, at, o)
    except struct.error:
        return False
    return True


# put_f64(p, at, o): write float ``o`` at ``p[at:at + 8]`` (IEEE 754 binary64, little-endian)
put_f64 = _F64.pack_into


def put_ascii(p: bytearray, at: int, o: str, room: int) -> int:
    """Copy str ``o``'s characters, one byte each, to ``p[at:]`` if it is ASCII and at most
    ``room`` characters long: how many, else -1 (nothing written)."""
    n = len(o)
    if n > room or not o.isascii():
        return -1
    p[at:at + n] = o.encode("ascii")
    return n


def put_bytes(p: bytearray, at: int, o: bytes, room: int) -> int:
    """Copy bytes ``o`` to ``p[at:]`` if it is at most ``room`` bytes long: how many, else -1
    (nothing written)."""
    n = len(o)
    if n > room:
        return -1
    p[at:at + n] = o
    return n


def get_i64(p: bytes, at: int) -> int:
    """The int64 at ``p[at:at + 8]``, little-endian."""
    return _I64.unpack_from(p, at)[0]


def get_f64(p: bytes, at: int) -> float:
    """The float at ``p[at:at + 8]`` (IEEE 754 binary64, little-endian)."""
    return _F64.unpack_from(p, at)[0]


def new_tuple(n: int) -> list:
    """A tuple of ``n`` items being built: ``set_item`` sets each, once, in order (0, 1...),
    then ``built_tuple`` is the tuple. Compiled, a tuple whose items are not set yet; here
    an empty list until it is built."""
    return []


# set_item(t, i, item): item i of a new_tuple, the items set in order (here inserted at
# the list's end: list.insert costs a tenth of list.__setitem__, a slot wrapper)
set_item = list.insert

# built_tuple(t): the tuple a new_tuple, each of its items set, is
built_tuple = tuple

# ref_count(o): o's reference count, as this build sees it from where it is called (plain
# Python counts the call's own reference too: compare counts taken the same way only)
ref_count = sys.getrefcount
