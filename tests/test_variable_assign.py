"""Pulled parameters into variables without a copy (elasticdl/model/variable_assign.py) and the
aligned receive buffers that make it possible (elasticdl/model/aligned_arrays.py): the values are
right on every path, and a variable that shares a pulled array's buffer never writes into it."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from elasticdl.model.aligned_arrays import ALIGNMENT, aligned_empty, is_aligned
from elasticdl.model.variable_assign import assign, shareable


def aligned_copy(values: np.ndarray) -> np.ndarray:
    out = aligned_empty(values.shape, values.dtype)
    out[...] = values
    return out


@pytest.mark.parametrize("shape", [(), (1,), (3,), (17, 5), (1024, 1024), (0,), (2, 0, 3)])
def test_aligned_arrays_start_on_the_boundary_and_hold_their_shape(shape):
    array = aligned_empty(shape, np.float32)
    assert array.shape == shape and array.dtype == np.float32 and array.flags.writeable
    if array.size:  # an empty array has no bytes to align (and is never shared)
        assert is_aligned(array) and array.ctypes.data % ALIGNMENT == 0


@pytest.mark.parametrize("shape", [(-1,), (3, -2), (1 << 62, 8), (1 << 32, 1 << 32)])
def test_a_shape_no_buffer_can_hold_is_refused_as_numpy_refuses_it(shape):
    # A forged shape whose int64 product wraps around must not get a small buffer reshaped to it.
    with pytest.raises((ValueError, MemoryError)):
        aligned_empty(shape, np.float32)


def unaligned(values: np.ndarray) -> np.ndarray:
    raw = np.empty(values.nbytes + ALIGNMENT + 4, np.uint8)
    start = (-raw.ctypes.data % ALIGNMENT) + 4
    out = raw[start:start + values.nbytes].view(values.dtype).reshape(values.shape)
    out[...] = values
    assert not is_aligned(out)
    return out


VALUES = np.arange(12, dtype=np.float32).reshape(3, 4) / 7


@pytest.mark.parametrize("make, shared", [
    (aligned_copy, True),
    (unaligned, False),
    (lambda v: np.frombuffer(v.tobytes(), np.float32).reshape(v.shape), False),  # a message's read-only view
    (lambda v: v.astype(np.float64), False),  # another dtype: cast, as before
    (lambda v: aligned_copy(v)[:, 1:3], False),  # not contiguous
])
def test_every_kind_of_array_is_assigned_its_values(make, shared):
    variable = tf.Variable(tf.zeros([3, 4]))
    value = make(VALUES)
    assert shareable(value, np.float32) is shared
    expected = VALUES if value.shape == VALUES.shape else VALUES[:, 1:3]
    if value.shape != VALUES.shape:
        variable = tf.Variable(tf.zeros(value.shape))
    assign(variable, value)
    np.testing.assert_array_equal(variable.numpy(), expected.astype(np.float32))


def test_updates_of_a_variable_that_shares_a_pulled_array_leave_the_array_as_pulled():
    variable = tf.Variable(tf.zeros([3, 4]))
    pulled = aligned_copy(VALUES)
    assign(variable, pulled)
    variable.assign_sub(tf.ones([3, 4]))
    variable.assign_add(2 * tf.ones([3, 4]))
    tf.function(lambda: variable.assign(variable * 3))()
    np.testing.assert_array_equal(pulled, VALUES)
    np.testing.assert_allclose(variable.numpy(), (VALUES + 1) * 3, rtol=1e-6)
    # The next pull replaces it; the first array may be dropped.
    second = aligned_copy(VALUES * 2)
    assign(variable, second)
    del pulled
    np.testing.assert_array_equal(variable.numpy(), VALUES * 2)


def test_the_transports_receive_a_large_tensor_into_an_aligned_array_the_variable_can_share():
    import socket
    import threading

    from elasticdl.proto import elasticdl_pb2
    from elasticdl.rpc import bulk, codec

    kernel = np.random.default_rng(0).standard_normal((600, 500)).astype(np.float32)  # 1.2 MB: pieces
    field = elasticdl_pb2.PullDenseParametersResponse.DESCRIPTOR.fields_by_name["dense_parameters"].number
    assembler = codec.TensorAssembler()
    for data in codec.serialize_chunks(elasticdl_pb2.PullDenseParametersResponse(), field, {"k": kernel}):
        assembler.add(codec.parse_with_tensors(data, elasticdl_pb2.PullDenseParametersResponse, field)[1])
    over_grpc = assembler.result()["k"]

    metas, arrays = bulk.tensor_metas({"k": kernel})
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=bulk.send_frame, args=(left, bulk.REPLY, b"", arrays))
        sender.start()
        bulk.recv_head(right)
        over_tcp = bulk.recv_arrays(right, bulk.plan(metas)[0])["k"]
        sender.join()

    for received in (over_grpc, over_tcp):
        np.testing.assert_array_equal(received, kernel)
        assert shareable(received, np.float32)
        variable = tf.Variable(tf.zeros(kernel.shape))
        assign(variable, received)
        np.testing.assert_array_equal(variable.numpy(), kernel)
