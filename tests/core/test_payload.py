import pytest

from horovod_topk.core import ALIGNMENT, PayloadLayout, PayloadSizeMismatch


@pytest.mark.parametrize("k", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_layout_is_aligned_and_tight(k, itemsize):
    layout = PayloadLayout(k, itemsize)
    assert layout.indices_nbytes == 4 * k
    assert layout.values_offset % itemsize == 0 and layout.values_offset >= 4 * k
    assert layout.values_end == layout.values_offset + k * itemsize
    assert layout.nbytes % ALIGNMENT == 0
    # never more than the alignment padding on top of the 4 + itemsize bytes per entry
    assert layout.nbytes - k * (4 + itemsize) < 2 * ALIGNMENT


def test_bytes_per_entry_float32_is_8():
    assert PayloadLayout(1000, 4).nbytes == 8000


def test_gathered_size_mismatch_names_the_tensor():
    layout = PayloadLayout(10, 4)
    layout.check_gathered("w", 2 * layout.nbytes, 2)
    with pytest.raises(PayloadSizeMismatch, match="'fc.weight'"):
        layout.check_gathered("fc.weight", layout.nbytes + 88, 2)


def test_invalid_layouts_are_refused():
    with pytest.raises(ValueError):
        PayloadLayout(0, 4)
    with pytest.raises(ValueError):
        PayloadLayout(3, 3)
