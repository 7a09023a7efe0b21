"""mpx.auth's frames: the HMAC is HMAC-SHA256 under the key whichever SHA-256 hashes the frame
(CPython's own up to SMALL_FRAME bytes, OpenSSL's above), and a frame altered anywhere, or
sealed under another key, does not unseal."""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest

from mpx import auth

KEYS = [b"", b"k", b"k" * 32, b"k" * 64, b"k" * 65, os.urandom(200)]  # (65 on: hashed first)
SIZES = [0, 1, auth.SMALL_FRAME - 1, auth.SMALL_FRAME, auth.SMALL_FRAME + 1, 100_000]


@pytest.mark.parametrize("key", KEYS, ids=lambda k: f"key{len(k)}")
@pytest.mark.parametrize("size", SIZES)
def test_a_frame_is_its_bytes_and_their_hmac_sha256(key, size):
    signer = auth.Signer(key)
    data = os.urandom(size)
    header, body = data[:min(size, 48)], data[48:]
    want = hmac.new(key, data, hashlib.sha256).digest()
    assert signer.digest(data) == want
    frame = signer.seal(header, [body])
    assert frame == data + want
    assert signer.seal(header, [body[:7], body[7:]], len(body)) == frame  # (told its length)
    assert auth.seal(key, header, [body]) == frame
    assert bytes(signer.unseal(frame)) == data == bytes(auth.unseal(key, frame))


@pytest.mark.parametrize("size", SIZES)
def test_an_altered_or_foreign_frame_does_not_unseal(size):
    signer = auth.Signer(b"k" * 32)
    frame = signer.seal(b"h" * 48, [os.urandom(size)])
    for at in (0, len(frame) // 2, len(frame) - 1):
        altered = bytearray(frame)
        altered[at] ^= 1
        assert signer.unseal(altered) is None
    assert signer.unseal(frame[:-1]) is None
    assert signer.unseal(frame[:auth.DIGEST_SIZE - 1]) is None
    assert auth.Signer(b"other").unseal(frame) is None
