"""The TensorFlow compact encoder puts the same bytes on the wire as the PyTorch one, and keeps error feedback exact."""
import numpy as np
import pytest
import tensorflow as tf

from horovod_topk.core.payload import SEGMENT_BITS, payload_layout
from horovod_topk.tensorflow import encoding


def _pairs(numel, k, seed):
    rng = np.random.default_rng(seed)
    indices = rng.permutation(numel)[:k].astype(np.int32)
    values = (rng.standard_normal(k) * rng.random(k) ** 4 * 10).astype(np.float32)
    return indices, values


@pytest.mark.parametrize("index_bits,scaled", [(16, False), (16, True), (32, True)])
def test_same_bytes_as_the_pytorch_encoder(index_bits, scaled):
    torch = pytest.importorskip("torch")
    from horovod_topk.torch import encoding as torch_encoding

    numel, k = 3 * (1 << SEGMENT_BITS) + 11, 900
    indices, values = _pairs(numel, k, 3)
    values[5], values[17] = np.nan, np.inf
    layout = payload_layout(k, numel, 1 if scaled else 4, index_bits=index_bits, scaled=scaled)
    tf_payload, tf_residual = encoding.encode(tf.constant(indices), tf.constant(values), tf.zeros([numel]), layout)
    torch_residual = torch.zeros(numel)
    torch_payload = torch_encoding.encode(torch.from_numpy(indices), torch.from_numpy(values), torch_residual, layout)
    np.testing.assert_array_equal(tf_payload.numpy(), torch_payload.numpy())
    np.testing.assert_allclose(tf_residual.numpy(), torch_residual.numpy(), rtol=0, atol=1e-7)


def test_round_trip_and_error_feedback_for_several_ranks():
    numel, k, ranks = 150_000, 500, 3
    layout = payload_layout(k, numel, 1, index_bits=16, scaled=True)
    payloads, expected = [], []
    for rank in range(ranks):
        indices, values = _pairs(numel, k, rank)
        residual = np.random.default_rng(10 + rank).standard_normal(numel).astype(np.float32) * 1e-3
        payload, new_residual = encoding.encode(tf.constant(indices), tf.constant(values), tf.constant(residual),
                                                layout)
        payloads.append(payload)
        expected.append((indices, values, residual, new_residual.numpy()))
    got_indices, got_values = encoding.decode(tf.concat(payloads, 0), ranks, layout, tf.float32)
    for rank, (indices, values, residual, new_residual) in enumerate(expected):
        order = np.argsort(indices)
        np.testing.assert_array_equal(got_indices[rank].numpy(), indices[order])
        sent = np.zeros(numel, np.float32)
        np.add.at(sent, got_indices[rank].numpy(), got_values[rank].numpy())
        exact = residual.copy()
        np.add.at(exact, indices, values)
        np.testing.assert_allclose(sent + new_residual, exact, rtol=0, atol=1e-6)  # nothing lost
