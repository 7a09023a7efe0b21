"""serde's framing in-process: kinds, the out-of-band prelude, alignment, and the typed
errors on both sides. (Across real processes: test_queue.py, test_tensors.py.)"""

from __future__ import annotations

import ast
import copyreg
import functools
import importlib
import os
import pathlib
import pickle
import re
import struct
import subprocess
import sys
import threading
import tracemalloc

import _builds
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpx.errors import DeserializationError, SerializationError
from mpx.protocol import serde
from mpx.protocol.serde import K_BYTES, K_PICKLE, K_PICKLE_OOB


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


def test_a_changed_out_of_band_threshold_takes_effect():
    # the encoder takes the threshold as a constant: configure() makes a new one, and each
    # thread's kept picklers with it
    big = bytes(2 << 20)
    assert serde.encode([big], True)[0] == serde.K_PICKLE_OOB
    kept = serde.OOB_MIN_BYTES
    try:
        serde.configure(oob_min_bytes=1 << 62)
        assert serde.encode([big], True)[0] == serde.K_PICKLE
        assert serde.encode([memoryview(big)], True)[0] == serde.K_PICKLE  # (its reducer too)
        serde.configure(oob_min_bytes=64 << 10)
        small = bytes(range(256)) * 400  # 100 KiB
        kind, parts = serde.encode([small], True)
        assert kind == serde.K_PICKLE_OOB
        assert serde.decode(kind, bytearray(b"".join(bytes(p) for p in parts))) == [small]
    finally:
        serde.configure(oob_min_bytes=kept)
    assert serde.encode([big], True)[0] == serde.K_PICKLE_OOB


def _compiled():
    mod = importlib.import_module("mpx.mechanism.codec")
    if mod.IMPLEMENTATION != "cython":
        pytest.skip("extension not built")
    return mod


@pytest.fixture(params=["compiled", "plain"])
def codec(request):
    """The codec compiled, or its source run as plain Python: the same cases, no branches."""
    return _compiled() if request.param == "compiled" else _builds.plain("mpx.mechanism.codec")


KINDS = dict(bytes_kind=1, small_kind=4, pickle_kind=2, oob_kind=3)


def _encoder(codec, oob_min_bytes=1 << 10):
    return codec.Encoder(oob_min_bytes, **KINDS)


def _encode(enc, obj, local_only=False, made=None):
    """serde.encode's use of an encoder, with a plain pickler of each thread's kept."""
    got = enc.encode(obj, local_only)
    if got is None:
        sink = enc.sink()
        if made is not None:
            made.append(sink)
        p = pickle.Pickler(sink, protocol=5, buffer_callback=sink.oob.append)
        got = enc.keep(obj, p, sink, local_only, "torch" in sys.modules,
                       copyreg.dispatch_table.copy())
    return got


def test_encoder_sends_bytes_as_they_are_pickles_once_and_frames_the_rest(codec):
    enc = _encoder(codec)
    assert enc.encode(b"raw") == (1, (b"raw",))
    assert enc.encode((0, "call", None)) == (4, (codec.small_encode((0, "call", None)),))
    assert enc.encode({"a": 1}) is None  # no pickler kept yet: serde's to make
    kind, parts = _encode(enc, {"a": 1}, True)
    assert kind == 2 and pickle.loads(b"".join(parts)) == {"a": 1}
    kind, parts = enc.encode((0, "call", [1]), True)  # a list: not small; the kept pickler
    assert kind == 2 and pickle.loads(b"".join(parts)) == (0, "call", [1])
    big = np.arange(1000, dtype=np.float32)
    for _ in range(2):  # (the sink is reset after)
        kind, parts = enc.encode([big, bytes(100 << 10)], True)  # (64 KiB up: as it is)
        assert kind == 3
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        assert struct.unpack_from("<QQ", data)[0] == 2
        back = serde.decode(serde.K_PICKLE_OOB, bytearray(data))
        assert np.array_equal(back[0], big) and back[1] == bytes(100 << 10)
    with pytest.raises(TypeError):  # refused: serde tries cloudpickle
        enc.encode(threading.Lock(), True)
    assert enc.encode(("after", 1), True)[0] == 4
    kind, parts = enc.dump({"b": 2}, pickle.Pickler(s := enc.sink(), protocol=5), s)
    assert kind == 2 and pickle.loads(b"".join(parts)) == {"b": 2}


def test_an_encoder_without_small_tuples_pickles_them_and_either_decodes_both(codec):
    enc = codec.Encoder(1 << 10, **KINDS, small_tuples=False)
    assert enc.small_tuples is False and _encoder(codec).small_tuples is True
    call = (0, 5, "noop", (1, 2.5), None, None)
    kind, parts = _encode(enc, call)
    assert kind == 2 and pickle.loads(b"".join(parts)) == call
    assert enc.encode(b"raw") == (1, (b"raw",))  # (bytes still as they are)
    for m in (codec, _builds.plain("mpx.mechanism.codec")):
        decode = m.Decoder(1, 4, 2, 3, ValueError, (_Refused,))
        assert decode(2, b"".join(parts)) == call
        assert decode(4, codec.small_encode(call)) == call


def test_configure_switches_small_tuples_and_keeps_what_it_is_not_given():
    call = (0, 5, "noop", (), None, None)
    kept_small, kept_oob = serde.SMALL_TUPLES, serde.OOB_MIN_BYTES
    try:
        serde.configure(small_tuples=False)
        kind, parts = serde.encode(call)
        assert kind == serde.K_PICKLE and serde.decode(kind, _joined(parts)) == call
        assert serde.OOB_MIN_BYTES == kept_oob
        serde.configure(small_tuples=True)
        kind, parts = serde.encode(call)
        assert kind == serde.K_SMALL and serde.decode(kind, _joined(parts)) == call
    finally:
        serde.configure(small_tuples=kept_small)


def test_small_tuples_are_the_default_exactly_where_the_codec_is_compiled():
    # (the plain build pickles them: its small codec costs ~6x the C pickler; serde.py)
    assert serde.SMALL_TUPLES == (serde._codec.IMPLEMENTATION == "cython")
    assert serde._encoder.small_tuples == serde.SMALL_TUPLES


def test_compiled_and_plain_encoders_make_the_same_messages():
    plain, compiled = _builds.plain("mpx.mechanism.codec"), _compiled()
    arrays = [np.arange(n, dtype=np.float64) for n in (3, 1000)]
    for obj in [b"raw", (0, 5, "noop", (), None, None), (5, 0, None), {"a": [1, 2.5]},
                [arrays, "t"], [bytes(100 << 10), bytearray(70 << 10)], (1 << 63, "x"),
                [pickle.PickleBuffer(bytearray(b"x" * 2000))]]:
        got = [_encode(_encoder(m), obj) for m in (plain, compiled)]
        kinds = {kind for kind, _ in got}
        joined = {b"".join(bytes(memoryview(p).cast("B")) for p in parts) for _, parts in got}
        assert len(kinds) == 1 and len(joined) == 1, obj


def test_decoder_decodes_every_kind_and_names_what_failed(codec):
    decode = codec.Decoder(1, 4, 2, 3, ValueError, (_Refused,))
    for lend in (memoryview, bytes):
        assert decode(2, lend(pickle.dumps({"a": 1}))) == {"a": 1}
        assert decode(4, lend(codec.small_encode((1, "x")))) == (1, "x")
        back = decode(1, lend(b"raw"))
        assert back == b"raw" and type(back) is bytes  # (its own, not the lent view)
    assert decode.decode(1, b"raw") == b"raw"
    with pytest.raises(ValueError, match="cannot unpickle a received message: ") as info:
        decode(2, b"not a pickle")
    assert isinstance(info.value.__cause__, pickle.UnpicklingError)
    with pytest.raises(ValueError, match="cannot unpickle.*truncated"):
        decode(4, b"\x07\x02\x00")
    with pytest.raises(ValueError, match="unknown message kind 9"):
        decode(9, memoryview(b""))

    class Boom:
        def __reduce__(self):
            return _refuse, ()

    for call in (decode, decode.decode):
        with pytest.raises(_Refused, match="mine") as info:  # passthrough: not wrapped
            call(2, pickle.dumps(Boom()))
        assert info.value.__cause__ is None


def _refuse():
    raise _Refused("mine")


class _Refused(Exception):
    pass

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
def test_small_tuples_round_trip_exactly_compiled_and_plain(codec, obj):
    other = _builds.plain("mpx.mechanism.codec")
    data = codec.small_encode(obj)
    assert data is not None and data == other.small_encode(obj)  # one layout
    for decode in (codec.small_decode, other.small_decode):
        for form in (data, memoryview(data), bytearray(data)):
            back = decode(form)
            assert back == obj and repr(back) == repr(obj)  # types, -0.0, bools kept
    kind, parts = serde.encode(obj)
    assert kind == (serde.K_SMALL if serde.SMALL_TUPLES else serde.K_PICKLE)
    assert serde.decode(kind, _joined(parts)) == obj
    assert serde.decode_lent(kind, memoryview(_joined(parts))) == obj


@pytest.mark.parametrize("obj", NOT_SMALL + [(_MyInt(1),), (_MyStr("s"),), (_MyTuple(),),
                                             _MyTuple((1,)), [1], None, 1, "s"])
def test_anything_else_is_pickled(codec, obj):
    assert codec.small_encode(obj) is None
    kind, parts = serde.encode(obj)
    assert kind in (K_PICKLE, K_PICKLE_OOB)
    back = serde.decode(kind, _joined(parts))
    assert repr(back) == repr(obj) and type(back) is type(obj)


def test_a_nan_keeps_its_bits(codec):
    nan = struct.unpack("<d", b"\x01\x00\x00\x00\x00\x00\xf8\x7f")[0]
    back = codec.small_decode(codec.small_encode((nan,)))[0]
    assert struct.pack("<d", back) == struct.pack("<d", nan)


@pytest.mark.parametrize("data", [b"", b"\x00", b"\x07", b"\x07\x01", b"\x07\x01\x03\x00",
                                  b"\x07\x00\x00", b"\x07\x01\x05\x05ab", b"\x07\x01\x08",
                                  b"\x07\x01\x05\x01\xe9",
                                  b"\x07\x01" * 4 + b"\x07\x00"])
def test_malformed_small_messages_raise_value_error_and_deserialization_error(codec, data):
    with pytest.raises(ValueError):
        codec.small_decode(data)
    with pytest.raises(DeserializationError, match="cannot unpickle"):
        serde.decode(serde.K_SMALL, data)
    with pytest.raises(DeserializationError):
        serde.decode_lent(serde.K_SMALL, memoryview(data))


def test_kept_picklers_per_thread_nested_and_remade(codec):
    made: list = []
    enc = _encoder(codec, 1 << 20)
    parts = _encode(enc, {1: "a"}, True, made)[1]
    assert pickle.loads(b"".join(parts)) == {1: "a"} and len(made) == 1
    _encode(enc, [2], True, made)
    assert len(made) == 1  # kept
    _encode(enc, [2], False, made)
    assert len(made) == 2  # one per local_only

    class Nested:  # a reducer that pickles in the same thread gets a pickler of its own
        def __reduce__(self):
            inner = _encode(enc, ["inner"], True, made)[1]
            return str, (pickle.loads(b"".join(inner))[0],)

    parts = _encode(enc, [Nested()], True, made)[1]
    assert pickle.loads(b"".join(parts)) == ["inner"] and len(made) == 3
    _encode(enc, [4], True, made)
    assert len(made) == 3  # the outer one is still the one kept
    t = threading.Thread(target=lambda: _encode(enc, [3], True, made))
    t.start()
    t.join()
    assert len(made) == 4  # each thread keeps its own
    copyreg.pickle(Nested, lambda n: (str, ("registered",)))  # a new registration: a new one
    try:
        _encode(enc, [5], True, made)
        assert len(made) == 5
    finally:
        del copyreg.dispatch_table[Nested]


def test_a_kept_pickler_does_not_keep_a_large_message_s_memo_table(codec):
    """A pickler's memo table never shrinks and clear_memo() walks all of it: kept after a
    message of many objects, it made every later small message slow (~110 us a no-op
    call). After a large message the kept pickler has a new, small table."""
    made: list = []
    enc = _encoder(codec, 1 << 20)
    _encode(enc, ["warm", 1], True, made)
    big = [[i] for i in range(40000)]  # ~40000 memo entries: a table of a megabyte or more
    tracemalloc.start()
    try:
        parts = _encode(enc, big, True, made)[1]
        assert pickle.loads(b"".join(parts)) == big
        del parts
        left = tracemalloc.get_traced_memory()[0]
        parts = _encode(enc, ["small", 2], True, made)[1]
    finally:
        tracemalloc.stop()
    assert len(made) == 1 and pickle.loads(b"".join(parts)) == ["small", 2]
    assert left < 64 << 10, f"{left} bytes still held after pickling a large message"


def test_pure_python_is_the_codec_s_source_run_plain_without_cython():
    """MPX_PURE_PYTHON=1 runs mpx/mechanism/codec.py itself, uncompiled, though the extension sits
    beside it; and it needs no Cython (a build dependency only)."""
    code = (
        "import sys\n"
        "sys.modules['cython'] = None  # (import cython raises ImportError)\n"
        "from mpx.protocol import serde\n"
        "c = serde._codec\n"
        "assert c.IMPLEMENTATION == 'python' and c.__file__.endswith('codec.py'), c\n"
        "assert c.cython.__name__ == 'mpx.mechanism._cython_shim', c.cython\n"
        "for obj in [(0, 5, 'noop', (), None, None), {'a': 1}, [bytes(2 << 20)], b'x']:\n"
        "    kind, parts = serde.encode(obj)\n"
        "    data = b''.join(bytes(memoryview(p).cast('B')) for p in parts)\n"
        "    assert serde.decode_lent(kind, memoryview(data)) == obj\n"
        "print(kind, c.CHUNK_REFS > 0)\n")
    env = dict(os.environ, MPX_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(serde.K_BYTES), "True"]


# ------------------------------------------------------------------ one source, two builds

MECHANISM = pathlib.Path(__file__).resolve().parents[2] / "mpx" / "mechanism"


def _is_compiled_flag(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "compiled" and \
        isinstance(node.value, ast.Name) and node.value.id == "cython"


def test_the_codec_branches_on_its_build_only_to_choose_its_primitives():
    """codec.py is one source: ``cython.compiled`` picks the primitives of
    mpx/mechanism/buffers once, where it is imported (its .pxd's C, or its .py), and names
    the build; no line of its logic asks which build runs it."""
    tree = ast.parse((MECHANISM / "codec.py").read_text())
    flags = [n for n in ast.walk(tree) if _is_compiled_flag(n)]
    ifs = [n for n in ast.walk(tree) if isinstance(n, ast.If) and
           any(_is_compiled_flag(t) for t in ast.walk(n.test))]
    assert len(ifs) == 1 and ifs[0] in tree.body and _is_compiled_flag(ifs[0].test)
    choice = ifs[0]
    assert all(isinstance(s, ast.ImportFrom) for s in choice.body + choice.orelse)
    assert [s.module for s in choice.body] == ["cython.cimports.mpx.mechanism.buffers"]
    assert [s.module for s in choice.orelse] == ["mpx.mechanism.buffers"]
    names = [sorted(a.name for s in arm for a in s.names) for arm in (choice.body, choice.orelse)]
    assert names[0] == names[1]
    implementation = [n for n in tree.body if isinstance(n, ast.Assign) and
                      [t.id for t in n.targets if isinstance(t, ast.Name)] == ["IMPLEMENTATION"]]
    assert len(implementation) == 1 and isinstance(implementation[0].value, ast.IfExp)
    assert flags == [choice.test, implementation[0].value.test] or \
        sorted(map(id, flags)) == sorted([id(choice.test), id(implementation[0].value.test)])
    # and nothing else of Cython's (cython.address, cython.declare...) in its logic
    assert {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and
            isinstance(n.value, ast.Name) and n.value.id == "cython"} == {"compiled"}


def _pxd_enum(text: str) -> dict[str, int]:
    """The ``NAME = value`` entries of the ``cdef enum:`` blocks of a .pxd."""
    out: dict[str, int] = {}
    for block in re.findall(r"^cdef enum:\n((?:[ \t]+.*\n|\n)+)", text, re.M):
        for name, value in re.findall(r"^\s+(\w+)\s*=\s*(\S+)", block, re.M):
            out[name] = int(value, 0)
    return out


def test_the_primitives_are_the_same_names_and_constants_in_c_and_in_python():
    from mpx.mechanism import buffers
    pxd = (MECHANISM / "buffers.pxd").read_text()
    enum = _pxd_enum(pxd)
    assert enum == {"HUGE_ADVICE_MIN": buffers.HUGE_ADVICE_MIN}
    in_c = set(re.findall(r"^cdef inline \w[\w ]*[\s*]+(\w+)\(", pxd, re.M))
    in_c |= set(re.findall(r"^\s+\w[\w ]*[\s*]+(\w+) \"\w+\"\(", pxd, re.M))  # (C macros)
    tree = ast.parse((MECHANISM / "buffers.py").read_text())
    in_py = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    in_py |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name) and t.id.islower()}
    assert in_c == {n for n in in_py if not n.startswith("_")}


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.floats(), st.binary(max_size=260),
    st.integers(min_value=-(1 << 64), max_value=1 << 64),
    st.sampled_from([(1 << 63) - 1, -(1 << 63), 1 << 63, -(1 << 63) - 1, 0.0, -0.0]),
    st.text(max_size=260),  # (non-ASCII characters and surrogates too)
    st.text(st.characters(max_codepoint=127), max_size=260),
    st.sampled_from([_MyInt(1), _MyStr("s"), bytearray(b"x"), [1], 1j, {}]),
)
_OBJECTS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=8).map(tuple) | st.lists(inner, max_size=2).map(_MyTuple),
    max_leaves=40,
) | st.sampled_from([tuple(range(256)), (None,) * 255, (1.0,) * 40, (((((1,),),),),)])


def _shape(obj):
    """``obj`` as exactly as equality can tell it: each item's type, a float's bits."""
    if type(obj) is tuple:
        return tuple(_shape(o) for o in obj)
    return (type(obj), struct.pack("<d", obj) if type(obj) is float else obj)


def _outcome(decode, data):
    """What ``decode(data)`` makes of ``data`` (its ``_shape``), or the exception's type and
    message."""
    try:
        return _shape(decode(data))
    except Exception as e:
        return (type(e), str(e))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_OBJECTS)
def test_both_builds_make_the_same_small_messages_and_refuse_the_same_objects(obj):
    plain, compiled = _builds.plain("mpx.mechanism.codec"), _compiled()
    data = compiled.small_encode(obj)
    assert plain.small_encode(obj) == data
    if data is not None:
        for form in (bytes, bytearray, memoryview):
            outcomes = {_outcome(m.small_decode, form(data)) for m in (plain, compiled)}
            assert outcomes == {_shape(obj)}


@st.composite
def _received(draw):
    """A small message of an object, then damaged: bytes changed, cut short or added."""
    obj = draw(st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=6).map(tuple),
                            max_leaves=20).filter(lambda o: type(o) is tuple))
    data = bytearray(_builds.plain("mpx.mechanism.codec").small_encode(obj) or b"\x07\x00")
    for at, value in draw(st.lists(st.tuples(st.integers(0, len(data) - 1),
                                             st.integers(0, 255)), max_size=3)):
        data[at] = value
    cut = draw(st.integers(0, len(data)))
    return bytes(data[:cut]) + draw(st.binary(max_size=4))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_received(), st.binary(max_size=40)))
def test_both_builds_decode_any_bytes_alike_and_refuse_alike(data):
    plain, compiled = _builds.plain("mpx.mechanism.codec"), _compiled()
    for form in (bytes, bytearray, memoryview):
        outcomes = [_outcome(m.small_decode, form(data)) for m in (plain, compiled)]
        assert outcomes[0] == outcomes[1]


def test_both_builds_refuse_the_same_inputs_that_are_no_contiguous_buffer():
    plain, compiled = _builds.plain("mpx.mechanism.codec"), _compiled()
    msg = compiled.small_encode((1, "x"))
    assert msg is not None
    for data in (5, "s", [7, 0], None, memoryview(msg * 2)[::2],
                 np.frombuffer(msg * 2, dtype=np.uint8)[::2],  # (numpy's own error)
                 memoryview(msg).cast("H"), np.frombuffer(msg, np.uint8).reshape(1, -1)):
        outcomes = [_outcome(m.small_decode, data) for m in (plain, compiled)]
        assert outcomes[0] == outcomes[1], data
        outcomes = [_outcome(functools.partial(_assembled, m), data) for m in (plain, compiled)]
        assert outcomes[0] == outcomes[1], data


def _assembled(codec, piece) -> tuple:
    out = codec.Assembler(64, True)
    out.add(piece)
    return (out.complete,)
