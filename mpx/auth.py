"""HMAC-SHA256 framing for what crosses a network: the queue's ZeroMQ chunks and the node
control channel. A frame is ``header + parts + HMAC(header + parts)`` under the
deployment's key; a receiver checks it before it parses or unpickles anything."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

DIGEST_SIZE = hashlib.sha256().digest_size


# Up to this many bytes a frame is joined first and its HMAC taken in one C call (a few
# us less than the hmac module's object); above, the HMAC streams over the parts, which
# are then copied once.
_ONE_SHOT_MAX = 64 << 10


def digest(key: bytes, data) -> bytes:
    """HMAC-SHA256 of ``data`` under ``key``."""
    return hmac.digest(key, data, "sha256")


def seal(key: bytes, header: bytes, parts: Iterable) -> bytes:
    """One frame: header, the parts, and the HMAC of both. (One frame, not a multipart
    message: libzmq 4.3 aborts when a multipart message meets a reader's full pipe.)"""
    parts = list(parts)
    if sum(memoryview(p).nbytes for p in parts) <= _ONE_SHOT_MAX:
        body = b"".join([header, *parts])
        return body + hmac.digest(key, body, "sha256")
    h = hmac.new(key, header, hashlib.sha256)
    for p in parts:
        h.update(p)
    return b"".join([header, *parts, h.digest()])


def unseal(key: bytes, frame) -> memoryview | None:
    """The frame without its HMAC if the HMAC checks out, else None."""
    mv = memoryview(frame)
    if mv.nbytes < DIGEST_SIZE:
        return None
    body = mv[:-DIGEST_SIZE]
    return body if hmac.compare_digest(digest(key, body), mv[-DIGEST_SIZE:]) else None
