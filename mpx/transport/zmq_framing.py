"""The frames of the ZeroMQ transport: a chunk's header and what a reader says to its
writer, their version, and a message cut into chunks.

A message travels as chunks of at most ``Config.max_chunk_bytes``, so that a large one is
signed, sent, checked and copied out in a pipeline. Every chunk is one frame: ``HEADER``
(queue token, message sequence number, chunk index and count, message length, and the
frame's number in the writer's stream, which only grows) and its bytes, sealed with an
HMAC-SHA256 under the deployment's key (``mpx.auth.Signer``). A chunk count of 0 marks a
frame of the link, not of a message (readers read none of it as data): ``index`` 0 ends the
writer's stream, ``index`` 1 (``RESUMED``) answers a reader's RESUME, its ``seq`` the
RESUME's nonce: the frames after it are those the reader missed (zmq_link).

A reader speaks to its writer in sealed ``CONTROL`` frames that name its rank and its
connection (a routing id of ``ID_BYTES`` drawn afresh by each reader, kept across the
reconnections of its link), so that one replayed from another connection binds nothing:
``HELLO`` introduces it, ``ACK`` says up to which frame it has read (also on reading the
end of the stream), ``RESUME`` (after its link broke) asks for the frames after the one it
names, ``BYE`` says it is closing. A writer closes once every reader has acknowledged all
or said BYE: what a reader sends that reaches a closed socket makes its kernel answer with
a reset, which throws away what the reader had not read yet.

Nothing here holds state: the ends that use it keep their own.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Iterator

MAGIC = b"MPXZ"
VERSION = 6  # 3: kinds are opaque but for layout.KIND_AS_BYTES; 4: a HELLO names its connection;
# 5: a chunk count of 0 ends the stream; 6: frame numbers, ACK and RESUME (links that break)
# magic, version, kind, token, seq, chunk index, chunk count, message length, frame number
HEADER = struct.Struct("<4sHHQQIIQQ")
ID_BYTES = 16
# magic, version, what (HELLO, ACK, RESUME), token, rank, routing id, frame number, nonce
CONTROL = struct.Struct(f"<4sHHQI{ID_BYTES}sQQ")
HELLO, ACK, RESUME, BYE = 0, 1, 2, 3
# (a chunk count of 0:) the index of the end of the stream, and of the answer to a RESUME
END, RESUMED = 0, 1


@dataclasses.dataclass(slots=True)  # (not frozen: its __init__ then costs ~1 us less)
class Chunk:
    """One authentic chunk: its header's fields and its bytes (a view of the frame)."""

    kind: int
    seq: int
    index: int
    count: int
    total: int
    data: memoryview
    number: int  # the frame's number in the writer's stream


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
