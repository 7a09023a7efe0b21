"""serde's framing in-process: kinds, the out-of-band prelude, alignment, and the typed
errors on both sides. (Across real processes: test_queue.py, test_tensors.py.)"""

from __future__ import annotations

import copyreg
import importlib
import pickle
import struct
import threading
import tracemalloc

import numpy as np
import pytest
from _env import IMPLS

from mpx import serde
from mpx.errors import DeserializationError, SerializationError
from mpx.serde import K_BYTES, K_PICKLE, K_PICKLE_OOB


def _joined(parts) -> bytearray:
    out = bytearray()
    for p in parts:
        out += memoryview(p).cast("B")
    return out


def roundtrip(obj):
    kind, parts = serde.encode(obj)
    return kind, serde.decode(kind, _joined(parts))


def test_plain_bytes_travel_as_they_are():
    kind, parts = serde.encode(b"abc")
    assert kind == K_BYTES and parts == (b"abc",)
    assert serde.decode(K_BYTES, b"abc") == b"abc"


@pytest.mark.parametrize("obj", [None, 1, "x" * 1000, ("call", (1, 2), {"k": [1.5]}),
                                 {"nested": {"ok": True}}, bytearray(b"xy")])
def test_objects_without_buffers_are_one_pickle(obj):
    kind, parts = serde.encode(obj)
    assert kind == K_PICKLE and len(parts) == 1
    assert serde.decode(kind, _joined(parts)) == obj


def test_callables_fall_back_to_cloudpickle():
    kind, back = roundtrip(lambda x: x * 3)
    assert kind == K_PICKLE and back(2) == 6


def test_out_of_band_buffers_are_framed_and_aligned():
    arrays = [np.arange(n, dtype=np.float32) for n in (3, 1000, 17)]
    kind, parts = serde.encode({"a": arrays, "tag": "t"})
    assert kind == K_PICKLE_OOB
    data = _joined(parts)
    n, plen = struct.unpack_from("<QQ", data, 0)
    lens = struct.unpack_from(f"<{n}Q", data, 16)
    assert n == 3 and list(lens) == [a.nbytes for a in arrays]
    off = 16 + 8 * n + plen
    for a, ln in zip(arrays, lens):
        off = -(-off // 64) * 64  # every buffer starts on a 64-byte boundary
        assert bytes(data[off:off + ln]) == a.tobytes()
        off += ln
    assert off == len(data)
    back = serde.decode(kind, data)
    assert back["tag"] == "t"
    for a, b in zip(arrays, back["a"]):
        assert np.array_equal(a, b)


def test_unpicklable_objects_raise_serialization_error_naming_the_type():
    with pytest.raises(SerializationError, match="lock"):
        serde.encode(threading.Lock())


@pytest.mark.parametrize("kind, data", [(K_PICKLE, b"not a pickle"), (99, b""),
                                        (K_PICKLE_OOB, b"\x01")])
def test_bad_messages_raise_deserialization_error(kind, data):
    with pytest.raises(DeserializationError, match="cannot unpickle"):
        serde.decode(kind, data)


def test_a_changed_out_of_band_threshold_takes_effect(monkeypatch):
    # each thread keeps its pickler and sink; a new threshold makes new ones
    big = bytes(2 << 20)
    assert serde.encode([big], True)[0] == serde.K_PICKLE_OOB
    monkeypatch.setattr(serde, "OOB_MIN_BYTES", 1 << 62)
    assert serde.encode([big], True)[0] == serde.K_PICKLE
    monkeypatch.setattr(serde, "OOB_MIN_BYTES", 64 << 10)
    small = bytes(range(256)) * 400  # 100 KiB
    kind, parts = serde.encode([small], True)
    assert kind == serde.K_PICKLE_OOB
    assert serde.decode(kind, bytearray(b"".join(bytes(p) for p in parts))) == [small]


@pytest.fixture(params=IMPLS)
def buffers(request):
    """The compiled buffers module, or its twin."""
    if request.param == "cython":
        return pytest.importorskip("mpx._buffers", reason="extension not built")
    return importlib.import_module("mpx._buffers_py")


def test_encoder_sends_bytes_as_they_are_pickles_once_and_hands_off_the_rest(buffers):
    def make(local_only, with_torch):
        sink = buffers.Sink(1 << 10, lambda *a: False)
        return sink, pickle.Pickler(sink, protocol=5, buffer_callback=sink.oob.append), \
            copyreg.dispatch_table.copy()

    refused: list = []
    oob: list = []
    enc = buffers.Encoder(buffers.Picklers(make, {"OOB_MIN_BYTES": 1 << 10}), 1, 4, 2,
                          lambda obj, local, e: refused.append((obj, local, e)) or (9, ()),
                          lambda sink: oob.append(list(sink.oob)) or (3, ("oob",)))
    assert enc.encode(b"raw") == (1, (b"raw",))
    kind, parts = enc.encode((0, "call", None))
    if buffers.IMPLEMENTATION == "cython":  # (the twin pickles: faster in Python)
        assert (kind, parts) == (4, (buffers.small_encode((0, "call", None)),))
    else:
        assert kind == 2 and pickle.loads(b"".join(parts)) == (0, "call", None)
    kind, parts = enc.encode((0, "call", [1]))  # a list: not small
    assert kind == 2 and pickle.loads(b"".join(parts)) == (0, "call", [1])
    kind, parts = enc.encode({"a": 1}, True)
    assert kind == 2 and pickle.loads(b"".join(parts)) == {"a": 1}
    big = pickle.PickleBuffer(bytearray(4 << 10))
    assert enc.encode([big]) == (3, ("oob",)) and len(oob[0]) == 1
    assert enc.encode([big])[0] == 3 and len(oob[1]) == 1  # the sink was reset after
    lock = threading.Lock()
    assert enc.encode(lock, True) == (9, ())
    assert refused[0][:2] == (lock, True) and isinstance(refused[0][2], TypeError)


def test_lent_decoder_unpickles_in_c_and_names_what_failed(buffers):
    class Refused(Exception):
        pass

    def refuse(data):
        raise Refused("mine")

    others: list = []
    decode = buffers.LentDecoder(7, 4, pickle.loads,
                                 lambda k, d: others.append((k, d)) or "other",
                                 lambda e: ValueError(f"undecodable: {e}"), Refused)
    assert decode(7, memoryview(pickle.dumps({"a": 1}))) == {"a": 1}
    assert decode(4, memoryview(buffers.small_encode((1, "x")))) == (1, "x")
    assert decode(3, b"raw") == "other" and others == [(3, b"raw")]
    with pytest.raises(ValueError, match="undecodable: ") as info:
        decode(7, b"not a pickle")
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)
    with pytest.raises(ValueError, match="undecodable: .*truncated") as info:
        decode(4, b"\x07\x02\x00")
    passing = buffers.LentDecoder(7, 4, refuse, None, None, Refused)
    with pytest.raises(Refused, match="mine"):  # passthrough errors are not wrapped
        passing(7, b"")


SMALL = [
    (0, 5, "noop", (), None, None),  # a call
    (5, 0, None),  # its reply
    (True, False, 0, 1, -1, 1 << 62, -(1 << 63), (1 << 63) - 1, 0.0, -0.0, 1.5, float("inf"),
     "", b"", b"\x00\xff" * 50),
    ("a" * 250,), (b"\x00" * 250,),
    ((), ((),), (1, (2.0, "x"))),
]
NOT_SMALL = [
    (1 << 63,), (-(1 << 63) - 1,),  # past int64
    ("\u00e9",), ("\ud800",), ("a" * 256,), (b"b" * 256,),  # not ASCII, too long
    (((((1,),),),),),  # nested too deep
    (1.0,) * 40,  # more than SMALL_MAX_BYTES encoded
    tuple(range(256)),  # more items than a length byte counts
    ([1],), ({},), (bytearray(b"x"),), (1 + 2j,),  # other types
]


class _MyInt(int):
    pass


class _MyStr(str):
    pass


class _MyTuple(tuple):
    pass


@pytest.mark.parametrize("obj", SMALL)
def test_small_tuples_round_trip_exactly_in_both_twins(buffers, obj):
    other = importlib.import_module("mpx._buffers_py")
    data = buffers.small_encode(obj)
    assert data is not None and data == other.small_encode(obj)  # one layout
    for decode in (buffers.small_decode, other.small_decode):
        for form in (data, memoryview(data), bytearray(data)):
            back = decode(form)
            assert back == obj and repr(back) == repr(obj)  # types, -0.0, bools kept
    kind, parts = serde.encode(obj)
    assert kind == (serde.K_SMALL if serde._buffers.IMPLEMENTATION == "cython" else K_PICKLE)
    assert serde.decode(kind, _joined(parts)) == obj
    assert serde.decode_lent(kind, memoryview(_joined(parts))) == obj


@pytest.mark.parametrize("obj", NOT_SMALL + [(_MyInt(1),), (_MyStr("s"),), (_MyTuple(),),
                                             _MyTuple((1,)), [1], None, 1, "s"])
def test_anything_else_is_pickled(buffers, obj):
    assert buffers.small_encode(obj) is None
    kind, parts = serde.encode(obj)
    assert kind in (K_PICKLE, K_PICKLE_OOB)
    back = serde.decode(kind, _joined(parts))
    assert repr(back) == repr(obj) and type(back) is type(obj)


def test_a_nan_keeps_its_bits(buffers):
    nan = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]
    back = buffers.small_decode(buffers.small_encode((nan,)))[0]
    assert struct.pack("<d", back) == struct.pack("<d", nan)


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x07", b"\x07\x01", b"\x07\x01\x03\x00",
                                  b"\x07\x00\x00", b"\x07\x01\x05\x05ab", b"\x07\x01\x08",
                                  b"\x07\x01\x05\x01\xe9",
                                  b"\x07\x01" * 4 + b"\x07\x00"])
def test_malformed_small_messages_raise_value_error_and_deserialization_error(buffers, data):
    with pytest.raises(ValueError):
        buffers.small_decode(data)
    with pytest.raises(DeserializationError, match="cannot unpickle"):
        serde.decode(serde.K_SMALL, data)
    with pytest.raises(DeserializationError):
        serde.decode_lent(serde.K_SMALL, memoryview(data))


def test_kept_picklers_per_thread_nested_and_remade(buffers):
    made = []
    settings = {"OOB_MIN_BYTES": 1 << 20}

    def make(local_only, with_torch):
        sink = buffers.Sink(settings["OOB_MIN_BYTES"], lambda *a: False)
        made.append(sink)
        return sink, pickle.Pickler(sink, protocol=5, buffer_callback=sink.oob.append), \
            copyreg.dispatch_table.copy()

    kept = buffers.Picklers(make, settings)
    parts, sink = kept.dumps((1, "a"), True)
    assert pickle.loads(b"".join(parts)) == (1, "a")
    assert kept.dumps(2, True)[1] is sink and len(made) == 1  # kept
    assert kept.dumps(2, False)[1] is not sink  # one per local_only

    class Nested:  # a reducer that pickles in the same thread gets a pickler of its own
        def __reduce__(self):
            inner, inner_sink = kept.dumps("inner", True)
            assert inner_sink is not sink
            return str, (pickle.loads(b"".join(inner)),)

    parts, again = kept.dumps([Nested()], True)
    assert again is sink and pickle.loads(b"".join(parts)) == ["inner"]
    other: list = []
    t = threading.Thread(target=lambda: other.append(kept.dumps(3, True)[1]))
    t.start()
    t.join()
    assert other[0] is not sink  # each thread keeps its own
    settings["OOB_MIN_BYTES"] = 1 << 10  # a new out-of-band floor: a new sink
    assert kept.dumps(4, True)[1] is not sink
    sink = kept.dumps(4, True)[1]
    copyreg.pickle(Nested, lambda n: (str, ("registered",)))  # a new registration too
    try:
        assert kept.dumps(5, True)[1] is not sink
    finally:
        del copyreg.dispatch_table[Nested]


def test_a_kept_pickler_does_not_keep_a_large_message_s_memo_table(buffers):
    """A pickler's memo table never shrinks and clear_memo() walks all of it: kept after a
    message of many objects, it made every later small message slow (~110 us a no-op
    call). After a large message the kept pickler has a new, small table."""
    def make(local_only, with_torch):
        sink = buffers.Sink(1 << 20, lambda *a: False)
        return sink, pickle.Pickler(sink, protocol=5, buffer_callback=sink.oob.append), \
            copyreg.dispatch_table.copy()

    kept = buffers.Picklers(make, {"OOB_MIN_BYTES": 1 << 20})
    kept.dumps(("warm", 1), True)
    big = [[i] for i in range(40000)]  # ~40000 memo entries: a table of a megabyte or more
    tracemalloc.start()
    try:
        parts, sink = kept.dumps(big, True)
        assert pickle.loads(b"".join(parts)) == big
        del parts
        left = tracemalloc.get_traced_memory()[0]
        parts, again = kept.dumps(("small", 2), True)
    finally:
        tracemalloc.stop()
    assert again is sink and pickle.loads(b"".join(parts)) == ("small", 2)
    assert left < 64 << 10, f"{left} bytes still held after pickling a large message"
