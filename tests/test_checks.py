"""The host-side value checks read int32 tensors by address: strided views and other dtypes are read as their
values, never as the memory under their first element."""

import pytest
import torch

from sparsekv._checks import check_nonnegative, check_offsets, host_int32
from sparsekv.ops._attention_checks import check_counted_positions


def test_offsets_strided_view_is_read_by_value():
    """Every other entry of ``[0, 9, 2, 1, 4, 0]`` is ``[0, 2, 4]``: valid, though the memory under it decreases."""
    storage = torch.tensor([0, 9, 2, 1, 4, 0], dtype=torch.int32)
    assert check_offsets("offsets", storage[::2], batch=2, total=4).tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match=r"offsets: expected non-decreasing offsets, got \[0, 9, 2\]"):
        check_offsets("offsets", storage[:3], batch=2)
    with pytest.raises(ValueError, match=r"expected the last offset to equal the 5 rows, got 4"):
        check_offsets("offsets", storage[::2], batch=2, total=5)
    with pytest.raises(ValueError, match=r"expected offsets\[0\] == 0, got 9"):
        check_offsets("offsets", storage[1::2], batch=2)


def test_offsets_int64_and_uint32_are_checked_as_int32():
    assert check_offsets("o", torch.tensor([0, 3, 3], dtype=torch.int64), total=3).dtype == torch.int32
    with pytest.raises(ValueError, match="non-decreasing"):
        check_offsets("o", torch.tensor([0, 3, 2], dtype=torch.uint32))


def test_nonnegative_strided_view_names_the_index_of_the_view():
    storage = torch.tensor([5, -1, 6, 7, -2, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"lengths: expected values >= 0, got -2 at index 2"):
        check_nonnegative("lengths", storage[::2])
    assert check_nonnegative("lengths", storage[2:4]).tolist() == [6, 7]


def test_counted_positions_on_a_transposed_index_matrix():
    """``indices`` as a transposed (non-contiguous) view: the row and entry named are the view's."""
    indices = torch.tensor([[0, 1], [2, 9], [3, 4]], dtype=torch.int32).t()  # [2 rows, 3 entries]
    counts = torch.tensor([3, 2], dtype=torch.int32)
    offsets = torch.tensor([0, 2], dtype=torch.int32)
    check_counted_positions(indices, counts, offsets, torch.tensor([8], dtype=torch.int32))  # held 10
    with pytest.raises(ValueError, match=r"indices: row 1, entry 1 holds position 9, outside \[0, 9\)"):
        check_counted_positions(indices, counts, offsets, torch.tensor([7], dtype=torch.int32))
    with pytest.raises(ValueError, match="counts: row 0 counts 4 entries but indices has 3 columns"):
        check_counted_positions(indices, torch.tensor([4, 0], dtype=torch.int32), offsets,
                                torch.tensor([8], dtype=torch.int32))


def test_host_int32_refuses_other_dtypes():
    """The value checks read the tensor's memory as int32: another dtype would be read as other values."""
    with pytest.raises(TypeError, match="expected an int32 tensor for a value check, got torch.int64"):
        host_int32(torch.tensor([0, 1]))
