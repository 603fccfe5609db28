"""The benchmarks' same-run peers read what they claim to read."""

from __future__ import annotations

import pytest
import torch

from sparsekv.bench import common, kpool, qsa
from sparsekv.bench.common import gather_peer, random_paged_blocks
from sparsekv.bench.page_read import page_read_peer
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_read_peer_reads_the_keys_each_sequence_sees_where_they_lie_layer_by_layer(dtype):
    """Each call sums (as int32 words) the next layer's keys of every sequence, page by page through the
    lookup table: the sums of the same keys gathered by indexing, layers 0, 1, 2, 0."""
    generator = torch.Generator().manual_seed(6)
    pages, layers, per_page, dim = 7, 3, 4, 6
    blocks = torch.randn(pages, 2, layers, per_page, 1, dim, generator=generator).to(dtype)
    table = torch.tensor([[5, 0, 3], [6, 2, 1]], dtype=torch.int32)
    seq_keys = [9, 4]  # three pages, the last holding one key; one whole page

    def expected(layer: int) -> int:
        keys = [blocks[int(table[b, k // per_page]), 0, layer, k % per_page] for b, n in enumerate(seq_keys)
                for k in range(n)]
        total = int(torch.stack(keys).reshape(-1).view(torch.int32).long().sum())
        return (total + 2**31) % 2**32 - 2**31  # the peer's int32 sum wraps

    peer = page_read_peer(blocks, table, seq_keys, layers)
    assert [peer() for _ in range(4)] == [expected(layer) for layer in (0, 1, 2, 0)]


def _spied_turns(seen: list[int]):
    def layer_turns(layers: int):
        for layer in common.layer_turns(layers):
            seen.append(layer)
            yield layer
    return layer_turns


def test_layered_score_rows_score_each_layer_in_turn(monkeypatch):
    """The "layers in turn" rows: each call (ours, and ours on one thread) scores the next layer, as a model's
    step does, against one thread, a read of the layer's pages where they lie, and the peak."""
    kpool_turns, qsa_turns = [], []
    monkeypatch.setattr(kpool, "layer_turns", _spied_turns(kpool_turns))
    monkeypatch.setattr(qsa, "layer_turns", _spied_turns(qsa_turns))
    rows = [kpool._score_row(2, 256, torch.bfloat16, 1, False, layers=3),
            qsa.bench_block_score(2, 512, 4, torch.bfloat16, None, paged=True, layers=3)]
    for row, turns in zip(rows, (kpool_turns, qsa_turns)):
        assert row.shape.endswith("3 layers in turn") and "the next of 3 layers" in row.note
        assert set(row.peers_ms) == {"1thread", "read", "peak"} and set(row.paired) >= {"1thread", "peak"}
        assert turns[:7] == [0, 1, 2, 0, 1, 2, 0]
