"""The benchmarks' same-run peers read what they claim to read."""

from __future__ import annotations

import torch

from sparsekv.bench.common import gather_peer, random_paged_blocks
from sparsekv.cache.layout import PagedKVCacheCollection


def test_gather_peer_copies_the_selected_key_and_value_rows_of_every_head():
    generator = torch.Generator().manual_seed(5)
    batch, tokens, kv_heads, dim = 2, 300, 3, 8
    blocks, table = random_paged_blocks(batch, tokens, 2, kv_heads, dim, torch.float32, generator)
    cache = PagedKVCacheCollection(blocks, torch.full((batch,), tokens, dtype=torch.int32), table,
                                   max_seq_length=1, max_cache_length=tokens)
    indices = torch.tensor([[3, 140, 299, -1], [0, 128, 129, 250]], dtype=torch.int32)
    counts = torch.tensor([3, 4], dtype=torch.int32)
    peer = gather_peer(blocks, table, indices, counts)
    gathered = peer()
    want = []
    for b in range(batch):
        positions = indices[b, : counts[b]]
        for plane in (cache.get_key_cache(0), cache.get_value_cache(0)):
            rows = plane.load(b, positions)  # [n, kv_heads, dim]
            want += [rows[:, head] for head in range(kv_heads)]
    assert torch.equal(gathered, torch.cat(want))
