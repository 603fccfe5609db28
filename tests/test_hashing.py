"""Page hashes: chained, namespaced, canonical and equal across processes."""

import hashlib
import os
import subprocess
import sys

import pytest

from sparsekv.cache.hashing import PAGE_HASH_BYTES, encode_namespace, page_hash, prefix_page_hashes

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
