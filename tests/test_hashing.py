"""Page hashes: chained, namespaced, canonical and equal across processes."""

import hashlib
import os
import random
import subprocess
import sys

import pytest

import torch

from sparsekv.cache.hashing import (PAGE_HASH_BYTES, chained_page_hashes, encode_namespace, page_hash,
                                    prefix_page_hashes, token_bytes)
from sparsekv.cache.manager import CacheGroupSpec, PagedKVCacheManager

TOKENS = [3, 141, 59, 26, 535, 8979, 32, 38, 4626, 43, 383, 27950, 288, 41971, 69399, 3]


def test_hash_is_the_documented_canonical_encoding():
    # Spelled out from the module docstring, so a silent format change fails here.
    parent = bytes(32)
    ns = b"s" + (4).to_bytes(8, "little") + b"lora"
    body = b"".join(t.to_bytes(8, "little", signed=True) for t in TOKENS[:5])
    want = hashlib.sha256(b"sparsekv/page-hash/v1\x00" + parent + ns + (5).to_bytes(8, "little") + body).digest()
    assert page_hash(None, TOKENS[:5], "lora") == want
    assert len(want) == PAGE_HASH_BYTES


def test_hashes_equal_across_processes():
    script = (
        "from sparsekv.cache.hashing import prefix_page_hashes\n"
        f"print(','.join(h.hex() for h in prefix_page_hashes({TOKENS!r}, 4, 'salt-1')))\n"
    )
    here = [h.hex() for h in prefix_page_hashes(TOKENS, 4, "salt-1")]
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().split(",") == here


def test_chain_matches_page_by_page_hashing():
    hashes = prefix_page_hashes(TOKENS[:15], 4)  # 3 full pages, 3 trailing tokens not hashed
    assert len(hashes) == 3
    parent = None
    for i, h in enumerate(hashes):
        parent = page_hash(parent, TOKENS[4 * i:4 * i + 4])
        assert h == parent
    assert prefix_page_hashes(TOKENS, 4, max_pages=2) == prefix_page_hashes(TOKENS, 4)[:2]


def test_chain_list_equals_the_lazy_chain():
    from sparsekv.cache.hashing import chained_page_hash_list, chained_page_hashes, encode_namespace, token_bytes

    data, ns = token_bytes(TOKENS[:15]), encode_namespace("lora")
    parent = page_hash(None, [9])
    assert chained_page_hash_list(parent, data, 4, ns) == list(chained_page_hashes(parent, data, 4, ns))
    assert chained_page_hash_list(None, data, 4, ns) == list(chained_page_hashes(None, data, 4, ns))


def test_hash_depends_on_parent_tokens_order_and_namespace():
    page = TOKENS[:4]
    base = page_hash(None, page)
    assert page_hash(page_hash(None, [1, 2, 3, 4]), page) != base
    assert page_hash(None, page[::-1]) != base
    spaces = [None, "", b"", 0, "0", b"0", "lora-a", "lora-b"]
    digests = {page_hash(None, page, ns) for ns in spaces}
    assert len(digests) == len(spaces)
    assert base == page_hash(None, tuple(page))  # any int sequence


def test_bad_arguments():
    with pytest.raises(ValueError, match="parent_hash"):
        page_hash(b"short", [1])
    with pytest.raises(ValueError, match="token_ids"):
        page_hash(None, [2**63])
    with pytest.raises(TypeError, match="namespace"):
        encode_namespace(1.5)
    with pytest.raises(TypeError, match="namespace"):
        encode_namespace(True)
    with pytest.raises(ValueError, match="page_size"):
        prefix_page_hashes([1, 2], 0)


def _spelled_out_chain(tokens: list[int], page_size: int, namespace) -> list[bytes]:
    """The documented encoding, page by page, with hashlib alone."""
    hashes, parent = [], bytes(32)
    for start in range(0, len(tokens) - page_size + 1, page_size):
        body = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens[start:start + page_size])
        parent = hashlib.sha256(b"sparsekv/page-hash/v1\x00" + parent + encode_namespace(namespace)
                                + page_size.to_bytes(8, "little") + body).digest()
        hashes.append(parent)
    return hashes


def test_chains_and_manager_hashes_equal_the_encoding_for_random_prompts(seed):
    rng = random.Random(seed)
    for _ in range(20):
        page_size = rng.choice([1, 2, 4, 16])
        namespace = rng.choice([None, "lora-a", b"salt", 7])
        tokens = [rng.randrange(2 ** rng.choice([8, 17, 62])) for _ in range(rng.randrange(0, 150))]
        want = _spelled_out_chain(tokens, page_size, namespace)
        assert prefix_page_hashes(tokens, page_size, namespace) == want
        pages = len(tokens) // page_size
        middle = list(chained_page_hashes(want[0] if want else None, token_bytes(tokens[page_size:pages * page_size]),
                                          page_size, encode_namespace(namespace)))
        assert middle == want[1:]
        # the manager: committed in random chunks, then a second request hitting the cached pages
        mgr = PagedKVCacheManager([CacheGroupSpec("kv", 1, 1, 1, 1, torch.float32)], page_size=page_size,
                                  num_pages=2 * pages + 4)
        mgr.claim("a", tokens, namespace=namespace)
        mgr.allocate("a", len(tokens))
        done = 0
        while done < len(tokens):
            chunk = rng.randrange(1, 9)
            mgr.step("a", tokens[done:done + chunk])
            done += chunk
        assert mgr._requests["a"].page_hashes == want
        hit = mgr.claim("b", tokens, namespace=namespace)
        assert hit == max(0, (len(tokens) - 1) // page_size) * page_size
        assert mgr._requests["b"].page_hashes == want[:hit // page_size]
        mgr.check_invariants()
