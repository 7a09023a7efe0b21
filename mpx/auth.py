"""HMAC-SHA256 framing for what crosses a network: the queue's ZeroMQ chunks and the node
control channel. A frame is ``header + parts + HMAC(header + parts)`` under the
deployment's key; a receiver checks it before it parses or unpickles anything."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

DIGEST_SIZE = hashlib.sha256().digest_size


def digest(key: bytes, data) -> bytes:
    """HMAC-SHA256 of ``data`` under ``key``."""
    return hmac.new(key, data, hashlib.sha256).digest()


def seal(key: bytes, header: bytes, parts: Iterable) -> bytes:
    """One frame: header, the parts, and the HMAC of both. (One frame, not a multipart
    message: libzmq 4.3 aborts when a multipart message meets a reader's full pipe.)"""
    h = hmac.new(key, header, hashlib.sha256)
    parts = list(parts)
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
