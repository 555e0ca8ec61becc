"""numpy arrays <-> Tensor messages."""

from __future__ import annotations

import numpy as np
import pytest

from elasticdl.proto import elasticdl_pb2
from elasticdl.rpc import codec as tensor_codec
from elasticdl.rpc.codec import TensorDecodeError

ARRAYS = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "f64": np.linspace(-1, 1, 5, dtype=np.float64),
    "i64": np.array([[-(2**40), 0, 2**40]], dtype=np.int64),
    "bool": np.array([True, False, True]),
    "scalar": np.array(3.5, dtype=np.float32),
    "empty": np.zeros((0, 3), dtype=np.float32),
    "f16": np.array([1.5, -2.0], dtype=np.float16),
    "i32": np.array([1, -2, 3], dtype=np.int32),
}


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_round_trip(name):
    array = ARRAYS[name]
    message = tensor_codec.encode(name, array)
    # Through the wire format, not just the object.
    message = elasticdl_pb2.Tensor.FromString(message.SerializeToString())
    assert message.name == name and message.dtype == array.dtype.name
    assert tuple(message.shape) == array.shape
    out = tensor_codec.decode(message)
    assert out.dtype == array.dtype and out.shape == array.shape
    np.testing.assert_array_equal(out, array)


def test_non_contiguous_and_big_endian_inputs():
    view = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    np.testing.assert_array_equal(tensor_codec.decode(tensor_codec.encode("v", view)), view)
    big = np.arange(4, dtype=">f8")
    out = tensor_codec.decode(tensor_codec.encode("b", big))
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, big)


def test_decode_is_read_only_unless_writable():
    message = tensor_codec.encode("x", ARRAYS["f32"])
    assert not tensor_codec.decode(message).flags.writeable
    out = tensor_codec.decode(message, writable=True)
    out[0, 0] = 42
    assert tensor_codec.decode(message)[0, 0] == 0  # the message is untouched


def test_dict_round_trip():
    messages = tensor_codec.encode_dict(ARRAYS)
    out = tensor_codec.decode_list(messages)
    assert list(out) == list(ARRAYS)
    for name, array in ARRAYS.items():
        np.testing.assert_array_equal(out[name], array)
    assert tensor_codec.decode_list([]) == {}


def _tensor(name="w", dtype="float32", shape=(2,), content=b"\0" * 8):
    return elasticdl_pb2.Tensor(name=name, dtype=dtype, shape=shape, content=content)


@pytest.mark.parametrize("dtype", ["complex64", "object", "", "uint8", "float32 "])
def test_bad_dtype(dtype):
    with pytest.raises(TensorDecodeError, match=r"tensor 'layer/w'.*unsupported dtype") as info:
        tensor_codec.decode(_tensor(name="layer/w", dtype=dtype))
    assert "float32" in str(info.value)  # lists what is allowed


@pytest.mark.parametrize(
    "shape, content",
    [((2,), b"\0" * 7), ((2,), b"\0" * 9), ((3, 2), b"\0" * 8), ((), b""), ((0,), b"\0" * 4)],
)
def test_byte_count_mismatch(shape, content):
    with pytest.raises(TensorDecodeError) as info:
        tensor_codec.decode(_tensor(name="layer/w", shape=shape, content=content))
    message = str(info.value)
    assert "'layer/w'" in message
    assert f"carries {len(content)}" in message


def test_negative_dimension():
    with pytest.raises(TensorDecodeError, match="'w'.*negative dimension"):
        tensor_codec.decode(_tensor(shape=(-2, -1), content=b"\0" * 8))


def test_duplicate_names():
    messages = [tensor_codec.encode("dense/kernel", ARRAYS["f32"]), tensor_codec.encode("b", ARRAYS["f64"]),
                tensor_codec.encode("dense/kernel", ARRAYS["f32"])]
    with pytest.raises(TensorDecodeError, match="'dense/kernel' appears twice"):
        tensor_codec.decode_list(messages)


def test_decode_list_names_the_bad_tensor():
    messages = [tensor_codec.encode("ok", ARRAYS["f32"]), _tensor(name="broken", content=b"\0")]
    with pytest.raises(TensorDecodeError, match="'broken'"):
        tensor_codec.decode_list(messages)


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.float32(3.5),  # a scalar keeps its empty shape
    np.zeros((0, 7), np.float32),
    np.array([True, False]),
    np.arange(200_000, dtype=np.int64)[::2],  # not contiguous; a multi-byte length varint
    np.arange(6, dtype=">f4").reshape(2, 3).T,  # big-endian and transposed
], ids=["matrix", "scalar", "empty", "bool", "strided", "big-endian"])
def test_serialize_with_tensors_gives_the_message_filling_the_field_would(array):
    head = elasticdl_pb2.PullDenseParametersResponse(initialized=True, version=7)
    raw = tensor_codec.serialize_with_tensors(head, 3, {"w": array, "b": np.ones(3, np.float32)})
    message = elasticdl_pb2.PullDenseParametersResponse.FromString(raw)
    assert (message.initialized, message.version) == (True, 7)
    decoded = tensor_codec.decode_list(message.dense_parameters)
    assert list(decoded) == ["w", "b"]
    assert decoded["w"].shape == np.shape(array) and decoded["w"].dtype == np.asarray(array).dtype.newbyteorder("=")
    np.testing.assert_array_equal(decoded["w"], array)
    np.testing.assert_array_equal(decoded["b"], np.ones(3, np.float32))


def _stream(arrays, chunk_bytes, later_head=None):
    head = elasticdl_pb2.PullDenseParametersResponse(initialized=True, version=7)
    raw = tensor_codec.serialize_chunks(head, 3, arrays, later_head, chunk_bytes=chunk_bytes)
    return [elasticdl_pb2.PullDenseParametersResponse.FromString(r) for r in raw]


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, 1 << 20])
def test_chunks_reassemble_to_the_arrays(chunk_bytes):
    arrays = dict(ARRAYS, big=np.arange(3000, dtype=np.float32).reshape(30, 100))
    messages = _stream(arrays, chunk_bytes)
    assembler = tensor_codec.TensorAssembler()
    for message in messages:
        assert message.version == 7
        assembler.add(message.dense_parameters)
    out = assembler.result()
    assert list(out) == list(arrays)
    for name, array in arrays.items():
        assert out[name].dtype == array.dtype and out[name].shape == array.shape
        np.testing.assert_array_equal(out[name], array)


def test_chunks_stay_near_their_size_and_cut_large_tensors():
    arrays = {"big": np.zeros(1_000_000, np.float32), "small": np.ones(10, np.float32)}
    messages = _stream(arrays, chunk_bytes=1 << 20)
    assert len(messages) == 4  # 4 MB of floats in 1 MB messages; the small one rides along
    assert all(len(m.SerializeToString()) <= (1 << 20) + 200 for m in messages)
    assert [t.offset for t in messages[1].dense_parameters] == [1 << 20]


def test_later_messages_carry_the_later_head():
    later = elasticdl_pb2.PullDenseParametersResponse(version=7)
    messages = _stream({"w": np.zeros(100, np.float32)}, 100, later_head=later)
    assert messages[0].initialized and not any(m.initialized for m in messages[1:])


def _pieces(array, chunk_bytes):
    return [t for m in _stream({"w": array}, chunk_bytes) for t in m.dense_parameters]


def test_assembler_rejects_out_of_order_missing_and_mismatched_pieces():
    pieces = _pieces(np.arange(10, dtype=np.float32), 16)
    assert len(pieces) == 3
    assembler = tensor_codec.TensorAssembler()
    with pytest.raises(TensorDecodeError, match="'w': its first piece starts at byte 16"):
        assembler.add([pieces[1]])
    assembler = tensor_codec.TensorAssembler()
    with pytest.raises(TensorDecodeError, match="next piece should start at 16"):
        assembler.add([pieces[0], pieces[2]])
    assembler = tensor_codec.TensorAssembler()
    assembler.add(pieces[:2])
    with pytest.raises(TensorDecodeError, match="'w': 32 of its 40 bytes arrived"):
        assembler.result()
    wrong = elasticdl_pb2.Tensor()
    wrong.CopyFrom(pieces[1])
    wrong.shape[:] = [5, 2]
    assembler = tensor_codec.TensorAssembler()
    with pytest.raises(TensorDecodeError, match=r"a piece says float32 \(5, 2\)"):
        assembler.add([pieces[0], wrong])
    assembler = tensor_codec.TensorAssembler()
    with pytest.raises(TensorDecodeError, match="'w' appears twice"):
        assembler.add(pieces + pieces[:1])


def test_assembler_rejects_a_piece_past_the_end_and_bad_meta():
    pieces = _pieces(np.arange(10, dtype=np.float32), 16)
    long = elasticdl_pb2.Tensor()
    long.CopyFrom(pieces[2])
    long.content = b"\0" * 16
    assembler = tensor_codec.TensorAssembler()
    with pytest.raises(TensorDecodeError, match="covers bytes 32-48 of 40"):
        assembler.add(pieces[:2] + [long])
    with pytest.raises(TensorDecodeError, match="unsupported dtype"):
        tensor_codec.TensorAssembler().add([_tensor(dtype="object")])


def test_decode_refuses_a_piece():
    piece = _pieces(np.arange(10, dtype=np.float32), 16)[1]
    with pytest.raises(TensorDecodeError, match="from byte 16"):
        tensor_codec.decode(piece)


_PUSH_FIELD = elasticdl_pb2.PushGradientsRequest.DESCRIPTOR.fields_by_name["gradients"].number


def _parse_push(data: bytes):
    return tensor_codec.parse_with_tensors(data, elasticdl_pb2.PushGradientsRequest, _PUSH_FIELD)


@pytest.mark.parametrize("chunk_bytes", [1, 100, 1 << 20])
def test_parse_with_tensors_reads_what_protobuf_reads(chunk_bytes):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array(7, np.int64),
              "c": np.zeros((0, 5), np.float16), "big/w": np.random.default_rng(0).random((40, 50))}
    rows = elasticdl_pb2.IndexedRows(name="t", ids=tensor_codec.encode("ids", np.arange(3)))
    head = elasticdl_pb2.PushGradientsRequest(worker_id=3, version=-2, learning_rate=0.5,
                                              embedding_gradients=[rows], return_parameters=True)
    for message in tensor_codec.serialize_chunks(head, _PUSH_FIELD, arrays, chunk_bytes=chunk_bytes):
        parsed_head, tensors = _parse_push(message)
        reference = elasticdl_pb2.PushGradientsRequest.FromString(message)
        assert [(t.name, t.dtype, tuple(t.shape), t.offset, bytes(t.content)) for t in tensors] == [
            (t.name, t.dtype, tuple(t.shape), t.offset, t.content) for t in reference.gradients]
        del reference.gradients[:]
        assert parsed_head == reference
    assembler = tensor_codec.TensorAssembler()
    for message in tensor_codec.serialize_chunks(head, _PUSH_FIELD, arrays, chunk_bytes=chunk_bytes):
        assembler.add(_parse_push(message)[1])
    for name, value in assembler.result().items():
        np.testing.assert_array_equal(value, arrays[name])


def test_parse_with_tensors_takes_unpacked_shapes_and_skips_unknown_fields():
    tensor = elasticdl_pb2.Tensor(name="x", dtype="float32", shape=[2, 3], content=bytes(24), offset=5)
    inner = tensor.SerializeToString()
    # The same tensor with its shape unpacked (field 3 as two varints) and an unknown field 9.
    unpacked = (b"\x0a\x01x" b"\x12\x07float32" b"\x18\x02\x18\x03" b"\x22\x18" + bytes(24) + b"\x28\x05"
                b"\x48\x01")
    for body in (inner, unpacked):
        data = b"\x10\x04" + b"\x22" + bytes([len(body)]) + body + b"\x7a\x00"  # version=4, unknown field 15
        head, tensors = _parse_push(data)
        assert head.version == 4
        assert [(t.name, t.dtype, t.shape, len(t.content), t.offset) for t in tensors] == [("x", "float32", (2, 3), 24, 5)]


@pytest.mark.parametrize("data, words", [
    (b"\x22\x10\x0a\x01x", "past"),  # a tensor longer than the message
    (b"\x22\x02\x0a\x05", "past"),  # a field inside the tensor runs past it
    (b"\x10", "not a PushGradientsRequest"),  # a truncated varint
    (b"\x10" + b"\xff" * 11, "longer than 10 bytes"),
    (b"\x0f", "unsupported wire type"),
    (b"\x1a\x02\x01", "past the end"),  # a length-delimited field past the end
    (b"\x2a\x03\x0a\x01\xff", "not a PushGradientsRequest"),  # a head protobuf refuses (bad UTF-8)
])
def test_parse_with_tensors_refuses_broken_bytes(data, words):
    with pytest.raises(TensorDecodeError, match=words):
        _parse_push(data)


# ---------------------------------------------------------------- reduced precision (--wire_dtype)

# Relative rounding error of one cast, round to nearest even: half a unit in the last place.
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def _through_the_wire(arrays, wire_dtype, streamed):
    head = elasticdl_pb2.PullDenseParametersResponse(version=1)
    if streamed:
        assembler = tensor_codec.TensorAssembler()
        for data in tensor_codec.serialize_chunks(head, 3, arrays, chunk_bytes=1000, wire_dtype=wire_dtype):
            _, pieces = tensor_codec.parse_with_tensors(data, elasticdl_pb2.PullDenseParametersResponse, 3)
            assert {p.dtype for p in pieces} <= {wire_dtype, "int64"}
            assembler.add(pieces)
        return tensor_codec.widened(assembler.result())
    message = elasticdl_pb2.PullDenseParametersResponse.FromString(
        tensor_codec.serialize_with_tensors(head, 3, arrays, wire_dtype))
    assert {t.dtype for t in message.dense_parameters} == {wire_dtype, "int64"}
    return tensor_codec.widened(tensor_codec.decode_list(message.dense_parameters))


@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("wire_dtype", ["bfloat16", "float16"])
def test_half_precision_round_trip_is_float32_within_one_rounding(wire_dtype, streamed):
    rng = np.random.default_rng(1)
    values = (rng.uniform(1e-3, 1e3, size=(70, 30)) * rng.choice([-1, 1], size=(70, 30))).astype(np.float32)
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0], np.float32)
    ids = np.arange(300, dtype=np.int64)
    out = _through_the_wire({"w": values, "special": special, "ids": ids}, wire_dtype, streamed)
    assert out["w"].dtype == np.float32 and out["w"].shape == values.shape
    # bfloat16 halves would fail this bound for float16 (2**-8 > 2**-11): the cast is the one named.
    np.testing.assert_array_less(np.abs(out["w"] - values), np.abs(values) * HALF_ULP[wire_dtype] * 1.0001)
    assert np.any(out["w"] != values)  # it did travel in fewer bits
    # NaN and infinities survive, so a PS refuses them as it refuses float32 ones.
    np.testing.assert_array_equal(out["special"], special)
    np.testing.assert_array_equal(out["ids"], ids)  # not float32: as it was
    assert out["ids"].dtype == np.int64


def test_a_half_precision_piece_of_the_wrong_length_is_refused():
    message = elasticdl_pb2.Tensor(name="g", dtype="bfloat16", shape=[3, 2], content=bytes(6 * 4))
    with pytest.raises(TensorDecodeError, match="needs 12 bytes"):
        tensor_codec.decode(message)
    assembler = tensor_codec.TensorAssembler()
    assembler.add([elasticdl_pb2.Tensor(name="g", dtype="bfloat16", shape=[3, 2], content=bytes(4))])
    with pytest.raises(TensorDecodeError, match="4 of its 12 bytes"):
        assembler.result()
    odd = tensor_codec.TensorAssembler()  # widened element by element: a piece holds whole ones
    with pytest.raises(TensorDecodeError, match="ends inside an element"):
        odd.add([elasticdl_pb2.Tensor(name="g", dtype="bfloat16", shape=[3, 2], content=bytes(5))])


@pytest.mark.parametrize("wire_dtype", ["int8", "bf16", "float64"])
def test_a_wire_dtype_a_tensor_may_not_travel_as_is_named(wire_dtype):
    from elasticdl.rpc.ps_client import PSClient

    assert wire_dtype in tensor_codec.wire_dtype_problem(wire_dtype)
    assert tensor_codec.wire_dtype_problem("") == tensor_codec.wire_dtype_problem("bfloat16") == ""
    with pytest.raises(ValueError, match="--wire_dtype"):
        PSClient([], wire_dtype=wire_dtype)
