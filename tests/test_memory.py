"""Page storage allocation: zeroed like torch.zeros, with the huge-page hint where Linux offers it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from sparsekv.cache import CacheGroupSpec, PagedKVCacheManager, allocate_pages
from sparsekv.cache.memory import HUGE_PAGE_BYTES, advise_huge_pages

_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The bracketed mode of the kernel's THP switch (``always``, ``madvise``, ``never``), if there is one."""
    if not sys.platform.startswith("linux") or not _THP_MODE.exists():
        return None
    found = re.search(r"\[(\w+)\]", _THP_MODE.read_text())
    return found.group(1) if found else None


@pytest.mark.parametrize("shape, dtype", [((3, 5), torch.float32), ((8, 2, 1, 128, 2, 256), torch.bfloat16),
                                          ((0, 4), torch.float16)], ids=["small", "huge", "empty"])
def test_allocate_pages_gives_zeros_of_the_shape_and_dtype(shape, dtype):
    pages = allocate_pages(shape, dtype, "cpu")
    assert pages.shape == shape and pages.dtype == dtype and pages.is_contiguous()
    assert not pages.any()


def test_the_hint_is_taken_where_the_kernel_offers_huge_pages():
    mode = _thp_mode()
    if mode not in ("always", "madvise"):
        pytest.skip(f"no transparent huge pages to ask for here (mode {mode})")
    fresh = torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    assert advise_huge_pages(fresh)
    assert not advise_huge_pages(torch.empty(HUGE_PAGE_BYTES // 2, dtype=torch.uint8)[:16])  # no whole huge page


def test_the_manager_blocks_start_as_zeros_of_the_group_shape():
    spec = CacheGroupSpec("main", num_layers=1, kv_planes=2, num_heads=2, head_size=256, dtype=torch.bfloat16)
    manager = PagedKVCacheManager([spec], page_size=128, num_pages=64)
    blocks = manager.blocks("main")
    assert blocks.shape == (64, 2, 1, 128, 2, 256) and not blocks.any()


def test_the_hint_refuses_memory_that_is_not_one_span():
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        advise_huge_pages(torch.zeros(64, 64)[:, ::2])
