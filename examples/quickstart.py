"""sparsekv in one small walk-through: paged storage, the cache manager, QSA, the k-pool indexer, sparse MLA.

Run it with ``python examples/quickstart.py`` (a few seconds of CPU time once
the CPU kernels are compiled; the first run also compiles them). Random
tensors stand in for a model's weights and projections; the asserts check
real results: stored rows read back, sparse attention equal to dense
attention while every causal token fits the budget, sparse MLA over the
k-pool selection equal to dense absorbed MLA while the selection holds every
causal token, pooled keys written step by step equal to one compress over all
of them, and a prefix-cache hit.
"""

import torch
import torch.nn.functional as F

import sparsekv

torch.manual_seed(0)
dtype = torch.float32
page_size, q_heads, kv_heads, head_size = 16, 8, 2, 64  # GQA: query head h reads KV head h // 4
index_heads, index_dim, rotary_dim, ratio, budget = 2, 32, 16, 4, 32  # QSA: rows past budget + ratio - 1 are sparse
kpool, pool_heads, topk = 4, 4, 64  # k-pool: one pooled key per 4 tokens; 16 pools fit the top-k
kv_lora_rank, rope_dim = 32, 16  # MLA: latent rows of kv_lora_rank + rope_dim channels, values the first 32

# Storage: blocks [num_pages, KV, num_layers, page_size, num_heads, head_size]
blocks = sparsekv.cache.allocate_pages((4, 2, 1, page_size, kv_heads, head_size), dtype, "cpu")  # zeros
cache_lengths = torch.tensor([3])                       # one sequence, 3 tokens cached
lookup_table = torch.tensor([[2, 0]])                   # its pages: logical page 0 -> id 2, 1 -> id 0
coll = sparsekv.PagedKVCacheCollection(blocks, cache_lengths, lookup_table, max_seq_length=20, max_cache_length=3)
new_keys = torch.randn(20, kv_heads, head_size, dtype=dtype)
coll.get_key_cache(0).store(new_keys, torch.tensor([0, 20]))   # row i of sequence b goes to cache_lengths[b] + i
assert torch.equal(coll.get_key_cache(0).load(0, torch.arange(3, 23)), new_keys)  # [n, heads, head_size]

# Stand-ins for model weights
gamma = 1 + 0.1 * torch.randn(index_dim)                # QSA indexer key norm weight
freqs_cis = sparsekv.rope_freqs_cis(256, rotary_dim)    # RoPE table [positions, rotary_dim]
ape = 0.1 * torch.randn(kpool, index_dim)               # k-pool within-pool position embedding, float32
ring = torch.zeros(1, 2, kpool, index_dim, dtype=dtype)  # open k-pool pools, one slot per running request
slot_ids = torch.tensor([0], dtype=torch.int32)

# Management: co-indexed cache groups sharing one page-id space
mgr = sparsekv.PagedKVCacheManager(
    [sparsekv.CacheGroupSpec("main", kv_planes=2, num_layers=1, num_heads=kv_heads, head_size=head_size, dtype=dtype),
     sparsekv.CacheGroupSpec("indexer", kv_planes=1, num_layers=1, num_heads=1, head_size=index_dim, dtype=dtype),
     sparsekv.CacheGroupSpec("blocks", kv_planes=1, num_layers=1, num_heads=1, head_size=index_dim, dtype=dtype,
                             tokens_per_entry=ratio),
     sparsekv.CacheGroupSpec("kpool", kv_planes=1, num_layers=1, num_heads=1, head_size=index_dim, dtype=dtype,
                             tokens_per_entry=kpool),
     sparsekv.CacheGroupSpec("latent", kv_planes=1, num_layers=1, num_heads=1, head_size=kv_lora_rank + rope_dim,
                             dtype=dtype)],
    page_size=page_size, num_pages=16)
prompt = torch.randint(0, 32000, (45,)).tolist()
cached = mgr.claim("req-0", prompt)                     # prefix-cache hit, in tokens
assert cached == 0
pool_keys, pool_gates, checked_rows, read, causal_tokens = [], [], 0, 0, 0
for token_ids in (prompt[:32], prompt[32:], [7], [8], [9]):  # chunked prefill, then three decode steps
    num_new_tokens = len(token_ids)
    mgr.allocate("req-0", num_new_tokens)               # InsufficientPagesError when full
    batch = mgr.prepare(["req-0"], [num_new_tokens])    # lookup tables, offsets, collections
    main_coll, indexer_coll, pooled_coll = (batch.collection(name) for name in ("main", "indexer", "kpool"))
    latent_coll = batch.collection("latent")
    input_row_offsets, start = batch.input_row_offsets, int(batch.cache_lengths[0])
    query_positions = torch.arange(start, start + num_new_tokens, dtype=torch.int32)

    def rows(*shape: int) -> torch.Tensor:  # random stand-ins for this step's projections: [num_new_tokens, *shape]
        return torch.randn(num_new_tokens, *shape, dtype=dtype)

    q_main, gate, q = rows(q_heads, head_size), rows(q_heads, head_size), rows(index_heads, index_dim)
    main_coll.get_key_cache(0).store(rows(kv_heads, head_size), input_row_offsets)
    main_coll.get_value_cache(0).store(rows(kv_heads, head_size), input_row_offsets)
    indexer_coll.get_key_cache(0).store(rows(1, index_dim), input_row_offsets)  # raw indexer keys
    latent_coll.get_key_cache(0).store(rows(1, kv_lora_rank + rope_dim), input_row_offsets)  # MLA latent rows

    # QSA (SPEC 2)
    key_counts = batch.cache_lengths + num_new_tokens
    max_blocks = 256 // ratio
    block_keys = sparsekv.qsa_compress_keys_paged(gamma, freqs_cis, key_counts, indexer_coll, 0,
                                                  ratio=ratio, eps=1e-6, max_blocks=max_blocks)
    # or pool each block once, in the step that completes it, into a block-key cache and read them back
    blocks_coll = batch.collection("blocks")
    sparsekv.qsa_store_block_keys_paged(gamma, freqs_cis, key_counts, indexer_coll, blocks_coll, 0,
                                        ratio=ratio, eps=1e-6)
    assert torch.equal(sparsekv.qsa_load_block_keys_paged(key_counts, blocks_coll, 0, ratio=ratio,
                                                          max_blocks=max_blocks), block_keys)  # the same bits
    scores = sparsekv.qsa_block_score(q, block_keys, query_positions, input_row_offsets,
                                      ratio=ratio, score_scale=index_dim ** 0.5)
    paged_scores = sparsekv.qsa_block_score_paged(q, blocks_coll, 0, query_positions, input_row_offsets,
                                                  ratio=ratio, score_scale=index_dim ** 0.5, out_cols=max_blocks)
    assert torch.equal(paged_scores, scores)            # the blocks scored where they lie in the cache's pages
    indices, counts = sparsekv.qsa_select_tokens(scores, query_positions, input_row_offsets,
                                                 ratio=ratio, budget=budget)
    out = sparsekv.qsa_sparse_attention_paged(q_main, main_coll, 0, indices, counts,
                                              input_row_offsets, scale=head_size ** -0.5, gate=gate)

    # MLA k-pool (SPEC 3): ring close -> compress -> seed tail -> store, in one call
    k, k_gate = rows(index_dim), rows(index_dim)
    sparsekv.kpool_indexer_step(ring, slot_ids, k, k_gate, ape, input_row_offsets, batch.cache_lengths,
                                pooled_coll, 0, kpool=kpool)
    q_idx, head_weights = rows(pool_heads, index_dim), torch.rand(num_new_tokens, pool_heads)
    pool_scores = sparsekv.mla_kpool_score(q_idx, head_weights, pooled_coll, 0, query_positions,
                                           input_row_offsets, kpool=kpool)
    # a model's step: one plan of its rows, then one run per indexer layer (the same scores, less per layer)
    score_plan = sparsekv.plan_kpool_score(pooled_coll, query_positions, input_row_offsets, kpool=kpool)
    assert torch.equal(score_plan.run(q_idx, head_weights, 0), pool_scores)
    pool_indices, pool_counts = sparsekv.mla_kpool_expand_topk(pool_scores, query_positions, kpool=kpool, topk=topk)

    # Sparse MLA (SPEC 3.4): absorbed queries [q_nope @ W_uk, q_rope] over the latent rows the k-pool selected
    q_lat = rows(q_heads, kv_lora_rank + rope_dim)
    o_lat = sparsekv.mla_sparse_attention_paged(q_lat, latent_coll, 0, pool_indices, pool_counts, input_row_offsets,
                                                scale=head_size ** -0.5, v_head_dim=kv_lora_rank)
    mgr.step("req-0", token_ids)                        # commit: the tokens are cached, full pages hashed

    # Rows whose causal tokens fit budget + ratio - 1 read all of them and equal dense attention (torch SDPA).
    fits = query_positions + 1 <= budget + ratio - 1
    assert torch.equal(counts[fits], query_positions[fits] + 1)
    history = torch.arange(start + num_new_tokens)
    keys = main_coll.get_key_cache(0).load(0, history).transpose(0, 1)  # [kv_heads, n, head_size]
    values = main_coll.get_value_cache(0).load(0, history).transpose(0, 1)
    dense = F.scaled_dot_product_attention(
        q_main.transpose(0, 1), keys.repeat_interleave(q_heads // kv_heads, 0),
        values.repeat_interleave(q_heads // kv_heads, 0), attn_mask=history[None, :] <= query_positions[:, None],
        scale=head_size ** -0.5).transpose(0, 1) * torch.sigmoid(gate)
    torch.testing.assert_close(out[fits], dense[fits])
    # topk // kpool = 16 pools cover every visible pool here, so the k-pool selection is every causal token.
    assert torch.equal(pool_counts, query_positions + 1)
    assert torch.equal(pool_indices[-1, :int(pool_counts[-1])].long(), history)
    latent = latent_coll.get_key_cache(0).load(0, history)[:, 0]  # [n, kv_lora_rank + rope_dim]
    logits = torch.einsum("thd,nd->thn", q_lat, latent) * head_size ** -0.5
    logits = logits.masked_fill(history[None, None, :] > query_positions[:, None, None], float("-inf"))
    torch.testing.assert_close(o_lat, logits.softmax(-1) @ latent[:, :kv_lora_rank])  # dense absorbed MLA
    pool_keys.append(k)
    pool_gates.append(k_gate)
    checked_rows, read = checked_rows + int(fits.sum()), read + int(counts.sum())
    causal_tokens += int((query_positions + 1).sum())
print("sparse MLA: every row equals dense absorbed MLA over its causal latent rows")
print(f"QSA: {checked_rows} rows equal dense attention; the sparse attention read {read} of {causal_tokens} "
      f"causal tokens ({read / causal_tokens:.0%})")

# The pooled keys stored step by step equal one compress over all the rows (SPEC 3.2: schedule-independent).
tokens = mgr.cache_length("req-0")
oneshot = sparsekv.mla_kpool_compress(torch.cat(pool_keys), torch.cat(pool_gates), ape, torch.tensor([0, tokens]),
                                      None, torch.tensor([0]), kpool=kpool)
pooled_coll = mgr.prepare(["req-0"], [0]).collection("kpool")
assert torch.equal(pooled_coll.get_key_cache(0).load(0, torch.arange(tokens // kpool))[:, 0], oneshot)
print(f"k-pool: {tokens // kpool} pooled keys written over 5 steps equal one compress, bit for bit")

mgr.release("req-0")                                    # its full pages stay in the prefix cache
cached = mgr.claim("req-1", prompt)
assert cached == 32                                     # the prompt's two full pages
print(f"prefix cache: a second request with the same prompt starts with {cached} of {len(prompt)} tokens cached")
mgr.release("req-1")
mgr.check_invariants()
print("quickstart: all checks passed")
