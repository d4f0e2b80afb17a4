from horovod_topk.core import TopKConfig, fingerprint, mismatch_message
from horovod_topk.core.consistency import FINGERPRINT_LENGTH


def test_fingerprints_have_one_length_whatever_the_shape():
    config = TopKConfig()
    for shape in [(), (7,), (3, 4, 5, 6, 7, 8, 9, 10, 11, 12)]:
        assert len(fingerprint(config, shape, "float32", 0, None)) == FINGERPRINT_LENGTH


def test_agreeing_ranks_give_no_message():
    row = fingerprint(TopKConfig(ratio=0.01), (64, 32), "torch.float32", 3, 21)
    assert mismatch_message("fc.weight", [row, list(row)]) is None


def test_every_differing_field_is_named_with_each_ranks_value():
    a = fingerprint(TopKConfig(ratio=0.01), (64, 32), "float32", 3, 21)
    b = fingerprint(TopKConfig(ratio=0.001, value_dtype="float16", momentum=0.9), (32, 64), "float16", 4, None)
    message = mismatch_message("fc.weight", [a, a, b])
    assert message is not None and "'fc.weight'" in message
    for fragment in [
        "ratio (rank 0: 0.01, rank 1: 0.01, rank 2: 0.001)",
        "value_dtype (rank 0: None, rank 1: None, rank 2: 'float16')",
        "momentum (rank 0: 0, rank 1: 0, rank 2: 0.9)",
        "dtype (rank 0: float32, rank 1: float32, rank 2: float16)",
        "step (rank 0: 3, rank 1: 3, rank 2: 4)",
        "decision (rank 0: 21, rank 1: 21, rank 2: dense)",
        "shape (rank 0: (64, 32), rank 1: (64, 32), rank 2: (32, 64))",
    ]:
        assert fragment in message, (fragment, message)
    assert "numel" not in message and "min_numel" not in message  # equal fields are not listed


def test_dtypes_of_both_frameworks_encode_alike():
    class TfLikeDtype:
        name = "bfloat16"

    config = TopKConfig()
    assert fingerprint(config, (8,), TfLikeDtype(), 0, None) == fingerprint(config, (8,), "torch.bfloat16", 0, None)


def test_the_wire_encoding_is_part_of_the_agreement():
    a = fingerprint(TopKConfig(), (70000,), "float32", 0, 700)
    b = fingerprint(TopKConfig(index_bits=16, value_dtype="float8"), (70000,), "float32", 0, 700)
    message = mismatch_message("w", [a, b])
    assert "index_bits (rank 0: 32, rank 1: 16)" in message and "'float8'" in message
