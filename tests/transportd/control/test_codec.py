"""The msgpack codec: what goes through, and every kind of garbage it refuses with a clear error."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transportd.control.codec import MAX_DEPTH, as_array, decode, encode
from transportd.errors import LocalProtocolError, RemoteProtocolError

LIMIT = 1 << 16


def test_round_trip_plain_values():
    msg = {"v": 1, "op": "join", "job": "j", "n": -3, "x": 1.5, "ok": True, "none": None, "list": [1, "a"]}
    assert decode(encode(msg), LIMIT) == msg


def test_arrays_and_buffers_travel_as_bin():
    arr = np.arange(6, dtype=np.uint32).reshape(2, 3)
    out = decode(encode({"a": arr, "b": bytearray(b"xy"), "m": memoryview(b"zz"), "s": np.int64(7)}), LIMIT)
    assert out["b"] == b"xy" and out["m"] == b"zz" and out["s"] == 7
    view = as_array(out["a"], np.uint32, (2, 3))
    np.testing.assert_array_equal(view, arr)
    assert not view.flags.writeable  # a view of the received bytes, not a copy


def test_non_contiguous_array_is_packed_in_logical_order():
    arr = np.arange(12, dtype=np.uint16).reshape(3, 4)[:, ::2]
    out = decode(encode({"a": arr}), LIMIT)
    np.testing.assert_array_equal(as_array(out["a"], np.uint16, (3, 2)), arr)


def test_as_array_refuses_partial_items():
    with pytest.raises(RemoteProtocolError, match="whole number"):
        as_array(b"abc", np.uint32)


def test_encode_refuses_unknown_types():
    with pytest.raises(LocalProtocolError, match="cannot encode a value of type object"):
        encode({"x": object()})


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "empty payload"),
        (b"\xc1", "not valid msgpack"),
        (b"\x82\xa1a", "not valid msgpack"),  # truncated map
        (msgpack.packb({"a": 1}) + b"\x00", "trailing bytes"),
        (msgpack.packb([1, 2]), "top level must be a map, got array"),
        (msgpack.packb(5), "top level must be a map, got integer"),
        (msgpack.packb("hello"), "top level must be a map, got string"),
        (msgpack.packb({1: "x"}), "not valid msgpack"),
        (msgpack.packb({"a": {b"k": 1}}), "map key b'k' is not a string"),
        (msgpack.packb({"e": msgpack.ExtType(5, b"x")}), "ext type 5"),
        (msgpack.packb({"t": msgpack.Timestamp(1, 0)}, datetime=False), "timestamp"),
        (b"\x81\xa1a\xa1\xff", "not valid UTF-8"),
    ],
)
def test_decode_refuses_garbage(data, match):
    with pytest.raises(RemoteProtocolError, match=match) as info:
        decode(data, LIMIT)
    assert info.value.code == "bad_message"


def test_decode_refuses_oversized_before_parsing():
    data = encode({"blob": b"x" * 200})
    with pytest.raises(RemoteProtocolError, match=rf"{len(data)} bytes exceeds the limit of 100") as info:
        decode(data, 100)
    assert info.value.code == "too_large"


def test_decode_refuses_deep_nesting():
    msg: dict = {"leaf": 1}
    for _ in range(MAX_DEPTH):
        msg = {"a": msg}
    with pytest.raises(RemoteProtocolError, match="nested deeper"):
        decode(encode(msg), LIMIT)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_raise_anything_but_protocol_error(data):
    try:
        assert isinstance(decode(data, LIMIT), dict)
    except RemoteProtocolError:
        pass


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _json, max_size=5))
def test_round_trip_property(msg):
    assert decode(encode(msg), LIMIT) == msg
