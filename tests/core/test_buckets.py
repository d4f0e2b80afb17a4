"""core.buckets: bucket assignment, names and payload layouts (pure, no framework)."""
import pytest

from horovod_topk.core import TopKConfig, fingerprint, mismatch_message
from horovod_topk.core.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketLayout,
    BucketTable,
    assign_buckets,
    bucket_collective_name,
)


def test_buckets_fill_up_to_the_cap_in_ready_order():
    tensors = [("a", 40), ("b", 40), ("c", 30), ("d", 100), ("e", 10), ("f", 10)]
    assert assign_buckets(tensors, 100) == [("a", "b"), ("c",), ("d",), ("e", "f")]
    assert assign_buckets(tensors, 110) == [("a", "b", "c"), ("d", "e"), ("f",)]


def test_a_tensor_over_the_cap_is_a_bucket_of_its_own_and_cap_zero_buckets_nothing():
    assert assign_buckets([("big", 500), ("x", 1), ("y", 1)], 100) == [("big",), ("x", "y")]
    assert assign_buckets([("a", 1), ("b", 1)], 0) == [("a",), ("b",)]
    with pytest.raises(ValueError, match="cap_bytes"):
        assign_buckets([("a", 1)], -1)


def test_every_tensor_lands_in_exactly_one_bucket():
    tensors = [(f"t{i}", (i * 7919) % 1000 + 1) for i in range(200)]
    buckets = assign_buckets(tensors, 2000)
    flat = [n for b in buckets for n in b]
    assert flat == [n for n, _ in tensors]
    sizes = dict(tensors)
    assert all(sum(sizes[n] for n in b) <= 2000 for b in buckets if len(b) > 1)


def test_table_holds_only_buckets_of_two_or_more_and_keeps_names_where_they_are():
    table = BucketTable()
    table.add([("a", 10), ("b", 10), ("big", 1000), ("c", 10)], 100)
    assert table.buckets == [("a", "b")]
    assert table.bucket_of("a") == table.bucket_of("b") == 0
    assert table.bucket_of("big") is None and table.bucket_of("c") is None
    table.add([("a", 10), ("x", 10), ("y", 10)], 100)  # the same optimizer again: "a" stays in its bucket
    assert table.buckets == [("a", "b"), ("x", "y")]
    assert len(table) == 2
    empty = BucketTable()
    empty.add([("a", 10), ("b", 10)], 0)
    assert len(empty) == 0 and empty.bucket_of("a") is None


def test_collective_names_are_deterministic_and_tell_member_sets_apart():
    assert bucket_collective_name(["a", "b", "c"]) == bucket_collective_name(("a", "b", "c"))
    names = {bucket_collective_name(m) for m in (["a", "b", "c"], ["a", "c"], ["a", "x", "c"], ["a", "b", "c", "d"])}
    assert len(names) == 4
    assert bucket_collective_name(["w"]).startswith("topk.bucket.w.1.")
    assert not bucket_collective_name(["a", "b"]).startswith("topk.a")  # never another tensor's allgather name


def test_layout_offsets_slices_and_size_check():
    layout = BucketLayout(("a", "b", "c"), (24, 8, 40))
    assert layout.offsets == (0, 24, 32)
    assert layout.total_nbytes == 72
    assert layout.member_slice("b") == (24, 32)
    assert layout.mismatch_message(2, 144) is None
    message = layout.mismatch_message(2, 152)
    assert "bucket" in message and "152" in message and "144" in message and "a, b, c" in message
    with pytest.raises(ValueError):
        BucketLayout(("a",), (1, 2))
    with pytest.raises(ValueError):
        BucketLayout((), ())


def test_bucket_bytes_is_validated_and_in_the_rank_check():
    assert TopKConfig().bucket_bytes == DEFAULT_BUCKET_BYTES
    assert TopKConfig(bucket_bytes=0).bucket_bytes == 0
    for bad in (-1, 1.5, True, "25MB"):
        with pytest.raises(ValueError, match="bucket_bytes"):
            TopKConfig(bucket_bytes=bad)
    rows = [fingerprint(TopKConfig(), (10, 10), "float32", 0, 1),
            fingerprint(TopKConfig(bucket_bytes=0), (10, 10), "float32", 0, 1)]
    message = mismatch_message("w", rows)
    assert message is not None and "bucket_bytes" in message
    assert "bucket_bytes=0" in TopKConfig(bucket_bytes=0).describe()


def test_add_groups_makes_each_group_one_bucket_whatever_its_bytes():
    table = BucketTable()
    table.add_groups([["a#0", "a#1", "a#2"], ["b#0"], ["c#0", "c#1"]], cap_bytes=1)
    assert table.buckets == [("a#0", "a#1", "a#2"), ("c#0", "c#1")]
    assert table.bucket_of("a#2") == 0 and table.bucket_of("c#0") == 1 and table.bucket_of("b#0") is None
    per_tensor = BucketTable()
    per_tensor.add_groups([["a#0", "a#1"]], cap_bytes=0)
    assert len(per_tensor) == 0
