"""The memory layout of a ring segment, shared by the Cython ring and its pure-Python twin.

The Cython ring takes its numbers from ``mpx/_ring_layout.pxi``; this module carries the
same names and values for Python, the pure twin (``mpx/_ring_py.py``) and the shm end
(``mpx/transport/shm.py``) among its readers; tests/ring/test_ring.py checks that they agree.

A segment is a header, one 64-byte block per reader, then ``max_chunks`` slots from
``slots_offset`` (the first multiple of ``SLOTS_ALIGN``, 4096, after the blocks). Every
word that more than one process writes sits on its own 64-byte cache line. All integers
are little-endian; u64 words are 8-byte aligned, u32 words 4-byte aligned.

Header (offsets in bytes)::

    0   magic u64          8  version u32      12 header_size u32
    16  max_chunk_bytes    24 max_chunks       32 n_readers       40 slot_stride
    48  token u64          56 writer_pid u64
    64  write_seq u64      slots published so far (writer only)
    72  published_ns u64   when the writer last published (CLOCK_MONOTONIC)
    128 data_futex u32     bumped to wake parked readers; 132 state u32 (SHUTDOWN|CLOSED)
    136 data_woken_ns u64  when the writer last woke them (CLOCK_MONOTONIC)
    192 space_futex u32    bumped to wake a writer parked on a full ring
    196 writer_parked u32  200 space_woken_ns u64: when a reader last woke it
    256 reader blocks, 64 bytes each:
        +0 read_seq u64 (slots this reader consumed) +8 pid u64 +16 attached u32
        +20 closed u32  +24 parked u32  +28 released u32 (set by the writer: the
        reader's process is gone, it holds nothing up)

Slot ``seq`` lives at ``slots_offset + (seq % max_chunks) * slot_stride``: a 64-byte slot
header (+0 length u64, +8 flags u32, +12 kind u32, +16 total u64) and the payload at +64.

A message's kind is the caller's, opaque to the ring, but for one bit: ``KIND_AS_BYTES``
has the reader deliver the message as ``bytes`` (else as a writable ``bytearray``).
"""

from __future__ import annotations

import struct
import threading

MAGIC = int.from_bytes(b"MPXRING\x00", "little")
VERSION = 3  # 2: kinds are opaque but for KIND_AS_BYTES; 3: woken_ns, published_ns

CACHE_LINE = 64

# The fixed fields up to writer_pid are packed by init_header (_HEAD); the ring reads these:
OFF_CHUNK_BYTES = 16
OFF_N_CHUNKS = 24
OFF_N_READERS = 32
OFF_SLOT_STRIDE = 40
OFF_WRITER_PID = 56
OFF_WRITE_SEQ = 64
OFF_PUBLISHED_NS = 72
OFF_DATA_FUTEX = 128
OFF_STATE = 132
OFF_DATA_WOKEN = 136
OFF_SPACE_FUTEX = 192
OFF_WRITER_PARKED = 196
OFF_SPACE_WOKEN = 200
OFF_READERS = 256
SLOTS_ALIGN = 4096  # the slots start at the first multiple of this after the reader blocks

READER_BLOCK = 64
# The most readers one ring serves: the writer scans every reader's block for each message
# it publishes (who is parked, who holds it up) and keeps a pidfd open per reader, so a
# ring's cost grows with its readers; a group larger than this is refused before anything
# is allocated (mpx/_driver/preflight.py).
MAX_READERS = 1024
RB_READ_SEQ = 0
RB_PID = 8
RB_ATTACHED = 16
RB_CLOSED = 20
RB_PARKED = 24
RB_RELEASED = 28  # set by the writer: the reader's process is gone, it holds nothing up

SLOT_HEADER = 64
SH_LENGTH = 0
SH_FLAGS = 8
SH_KIND = 12
SH_TOTAL = 16

# slot flags
F_BEGIN = 1
F_END = 2
F_ABORT = 4  # the writer gave up on a half-written message: readers drop it

# state bits
S_SHUTDOWN = 1
S_CLOSED = 2

# the bit of a message's kind that has it delivered as bytes (else a bytearray); kinds
# travel in 16 bits over ZeroMQ
KIND_AS_BYTES = 0x8000

# wait results returned by the rings' reads and writes, and by the shm end's calls
OK = 0
TIMEOUT = 1
INTERRUPTED = 2
PEER_GONE = 3      # writer: reader `gone_index` died or closed; reader: the writer did
SHUTDOWN = 4       # the writer called shutdown() and nothing unread remains
SLICE = 5          # a reader's slice of `slice_ns` ended (or a signal came); call again to resume
NUDGED = 6         # a reader's wait was ended by nudge() (nothing consumed); call again to resume
NO_MEMORY = 7      # a reader skipped a message it could not allocate (`skipped_bytes`: its size)
CLOSED = 8         # the shm end's call after its close() (transport/shm_end.py), not the ring's

_HEAD = struct.Struct("<QIIQQQQQQ")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def header_size(n_readers: int) -> int:
    return OFF_READERS + READER_BLOCK * n_readers


def slots_offset(n_readers: int) -> int:
    return _round_up(header_size(n_readers), SLOTS_ALIGN)


def slot_stride(max_chunk_bytes: int) -> int:
    return _round_up(SLOT_HEADER + max_chunk_bytes, CACHE_LINE)


def segment_size(max_chunk_bytes: int, max_chunks: int, n_readers: int) -> int:
    return slots_offset(n_readers) + slot_stride(max_chunk_bytes) * max_chunks


def init_header(buf, max_chunk_bytes: int, max_chunks: int, n_readers: int, token: int,
                writer_pid: int) -> None:
    """Write a fresh header into ``buf`` (the whole, zero-filled segment)."""
    if not 0 < n_readers <= MAX_READERS:
        raise ValueError(f"a ring has 1 to {MAX_READERS} readers (layout.MAX_READERS), "
                         f"not {n_readers}")
    _HEAD.pack_into(buf, 0, MAGIC, VERSION, header_size(n_readers), max_chunk_bytes,
                    max_chunks, n_readers, slot_stride(max_chunk_bytes), token, writer_pid)


def read_header(buf) -> dict:
    """The header's fixed fields as a dict (no validation)."""
    (magic, version, hsize, chunk, nchunks, nreaders, stride, token,
     wpid) = _HEAD.unpack_from(buf, 0)
    return dict(magic=magic, version=version, header_size=hsize, max_chunk_bytes=chunk,
                max_chunks=nchunks, n_readers=nreaders, slot_stride=stride, token=token,
                writer_pid=wpid)


def reader_block(index: int) -> int:
    return OFF_READERS + READER_BLOCK * index


_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier for Python code that orders its own stores and loads on the
    segment (a lock round trip is an atomic read-modify-write in the C library)."""
    with _fence_lock:
        pass
