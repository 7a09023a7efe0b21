"""The frames of the ZeroMQ transport: a chunk's header and a reader's HELLO, their version,
and a message cut into chunks.

A message travels as chunks of at most ``Config.max_chunk_bytes``, so that a large one is
signed, sent, checked and copied out in a pipeline. Every chunk is one frame: ``HEADER``
(queue token, message sequence number, chunk index and count, message length) and its
bytes, sealed with an HMAC-SHA256 under the deployment's key (``mpx.auth.Signer``). A chunk
count of 0 ends the writer's stream (readers skip it). A reader introduces itself with a
sealed ``HELLO`` naming its rank and its connection (a routing id of ``ID_BYTES`` drawn
afresh by each reader), so that a HELLO replayed from another connection binds nothing.

Nothing here holds state: the ends that use it keep their own.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Iterator

MAGIC = b"MPXZ"
VERSION = 5  # 3: kinds are opaque but for layout.KIND_AS_BYTES; 4: a HELLO names its connection;
# 5: a chunk count of 0 ends the stream
# magic, version, kind, token, seq, chunk index, chunk count, message length
HEADER = struct.Struct("<4sHHQQIIQ")
ID_BYTES = 16
HELLO = struct.Struct(f"<4sHHQI{ID_BYTES}s")   # magic, version, 0, token, rank, routing id


@dataclasses.dataclass(slots=True)  # (not frozen: its __init__ then costs ~1 us less)
class Chunk:
    """One authentic chunk: its header's fields and its bytes (a view of the frame)."""

    kind: int
    seq: int
    index: int
    count: int
    total: int
    data: memoryview


def split(parts: Iterable, size: int, total: int) -> Iterator[list]:
    """The message ``parts`` of ``total`` bytes as consecutive chunks of ``size`` bytes (the
    last one shorter; one empty chunk for an empty message), each a list of memoryviews
    into the parts. ValueError, before the chunk that holds them, if the parts exceed
    ``total``, and at the end if they fall short."""
    chunk: list = []
    room = size
    sent = False
    seen = 0
    for p in parts:
        v = memoryview(p).cast("B")
        seen += v.nbytes
        if seen > total:
            raise ValueError(f"the message's pieces exceed its length {total}")
        while v.nbytes:
            take = v[:room]
            chunk.append(take)
            v = v[take.nbytes:]
            room -= take.nbytes
            if not room:
                yield chunk
                chunk, room, sent = [], size, True
    if seen != total:
        raise ValueError(f"the message's pieces add up to {seen} bytes, not {total}")
    if chunk or not sent:
        yield chunk
