"""Chained, deterministic hashes of full KV cache pages (SPEC 1.2, prefix caching).

A page's hash identifies everything its KV content depends on: the tokens of
every earlier page (through the parent hash), its own tokens, and an optional
namespace (a LoRA adapter, a cache salt) that keeps otherwise equal prefixes
apart::

    h_0 = page_hash(None, tokens[0:16], ns)
    h_1 = page_hash(h_0,  tokens[16:32], ns)      # page_size 16

NOTE: the digest is SHA-256 over a canonical byte encoding (a domain tag, the
32-byte parent digest or 32 zero bytes for the first page, a tagged namespace,
the token count, then the token ids as little-endian int64). Python's built-in
``hash()`` is never used: it is salted per process, and prefix hits must agree
across processes (for example a router and its workers).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator, Sequence

#: Length in bytes of every page hash.
PAGE_HASH_BYTES = 32

_DOMAIN = b"sparsekv/page-hash/v1\x00"
_NO_PARENT = bytes(PAGE_HASH_BYTES)
_BIG_ENDIAN = sys.byteorder == "big"

Namespace = str | bytes | int | None


def encode_namespace(namespace: Namespace) -> bytes:
    """The canonical, tagged bytes of a namespace (``None``, ``str``, ``bytes`` or ``int``).

    Tags keep kinds apart: ``"7"``, ``b"7"`` and ``7`` are three different namespaces.
    """
    if namespace is None:
        return b"n"
    if isinstance(namespace, bool):
        raise TypeError("namespace: expected None, str, bytes or int, got bool")
    if isinstance(namespace, str):
        tag, payload = b"s", namespace.encode("utf-8")
    elif isinstance(namespace, (bytes, bytearray)):
        tag, payload = b"b", bytes(namespace)
    elif isinstance(namespace, int):
        tag, payload = b"i", str(namespace).encode("ascii")
    else:
        raise TypeError(f"namespace: expected None, str, bytes or int, got {type(namespace).__name__}")
    return tag + len(payload).to_bytes(8, "little") + payload


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The canonical encoding of token ids: little-endian int64, 8 bytes per token.

    Raises ``TypeError`` for non-integer ids and ``ValueError`` outside the int64 range.
    """
    if type(token_ids) is array and token_ids.typecode == "q" and not _BIG_ENDIAN:
        return token_ids.tobytes()
    try:
        tokens = array("q", token_ids)
    except TypeError:
        raise TypeError("token_ids: expected integer token ids") from None
    except OverflowError:
        raise ValueError("token_ids: expected token ids in the int64 range") from None
    if _BIG_ENDIAN:
        tokens.byteswap()
    return tokens.tobytes()


def page_hash_encoded(parent_hash: bytes | None, page_token_bytes: bytes | memoryview,
                      namespace_bytes: bytes) -> bytes:
    """:func:`page_hash` from already encoded parts (:func:`token_bytes`, :func:`encode_namespace`).

    The manager encodes a request's tokens and namespace once and calls this per page.
    """
    count = (len(page_token_bytes) // 8).to_bytes(8, "little")
    return hashlib.sha256(b"".join((_DOMAIN, _parent_bytes(parent_hash), namespace_bytes, count,
                                    page_token_bytes))).digest()


def _parent_bytes(parent_hash: bytes | None) -> bytes:
    """The parent's 32 bytes in the encoding (zeros for ``None``); ``ValueError`` for anything else."""
    if parent_hash is None:
        return _NO_PARENT
    if type(parent_hash) is not bytes or len(parent_hash) != PAGE_HASH_BYTES:
        raise ValueError(f"parent_hash: expected None or {PAGE_HASH_BYTES} bytes, got {parent_hash!r:.80}")
    return parent_hash


def chained_page_hashes(parent_hash: bytes | None, token_data: bytes | memoryview, page_size: int,
                        namespace_bytes: bytes) -> Iterator[bytes]:
    """The chained hash of each full page of ``token_data`` (:func:`token_bytes` of whole pages), in order.

    The first page's parent is ``parent_hash``; each next page's is the hash
    just yielded. Equal to :func:`page_hash_encoded` page by page, with the
    constant parts of the encoding joined once; lazy, so a caller looking
    pages up can stop at its first miss.
    """
    parent = _parent_bytes(parent_hash)
    stride = 8 * page_size
    middle = namespace_bytes + page_size.to_bytes(8, "little")
    data = memoryview(token_data)
    sha256, join = hashlib.sha256, b"".join
    for start in range(0, len(data) - stride + 1, stride):
        parent = sha256(join((_DOMAIN, parent, middle, data[start:start + stride]))).digest()
        yield parent


def chained_page_hash_list(parent_hash: bytes | None, token_data: bytes | memoryview, page_size: int,
                           namespace_bytes: bytes) -> list[bytes]:
    """``list(chained_page_hashes(...))``, without a generator step per page (a commit hashes every page)."""
    parent = _parent_bytes(parent_hash)
    stride = 8 * page_size
    middle = namespace_bytes + page_size.to_bytes(8, "little")
    data = memoryview(token_data)
    sha256, join = hashlib.sha256, b"".join
    digests = []
    append = digests.append
    for start in range(0, len(data) - stride + 1, stride):
        parent = sha256(join((_DOMAIN, parent, middle, data[start:start + stride]))).digest()
        append(parent)
    return digests


def page_hash(parent_hash: bytes | None, token_ids: Sequence[int], namespace: Namespace = None) -> bytes:
    """Hash of one page: its parent page's hash, its token ids and the namespace.

    Args:
        parent_hash: the previous page's hash (``PAGE_HASH_BYTES`` bytes), ``None`` for page 0.
        token_ids: the page's token ids (ints in the int64 range).
        namespace: ``None``, ``str``, ``bytes`` or ``int``; see :func:`encode_namespace`.

    Returns a ``PAGE_HASH_BYTES``-byte digest, equal in every process and on every machine.
    """
    return page_hash_encoded(parent_hash, token_bytes(token_ids), encode_namespace(namespace))


def prefix_page_hashes(
    token_ids: Sequence[int], page_size: int, namespace: Namespace = None, *, max_pages: int | None = None
) -> list[bytes]:
    """The chained hashes of every full page of ``token_ids`` (at most ``max_pages``).

    Example: 37 tokens with page size 16 give 2 hashes (pages ``[0, 16)`` and
    ``[16, 32)``); the 5 trailing tokens fill no page and get none.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
    full_pages = len(token_ids) // page_size
    if max_pages is not None:
        full_pages = min(full_pages, max_pages)
    data = token_bytes(token_ids[:full_pages * page_size])
    return list(chained_page_hashes(None, data, page_size, encode_namespace(namespace)))
