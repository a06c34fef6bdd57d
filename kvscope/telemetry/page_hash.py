"""Content identity of cached pages: SGLang's chained page hash, shared by the KV-event stream
(server/kv_events.py) and tree snapshots (tree_snapshots.page_hashes, schema version 7), so two
replicas' trees can be compared page by page without storing their tokens.

NOTE: the hash (SGLang 0.5.23's HiCache page hash, `get_hash_str` page by page)
    digest(page)    sha256(digest(parent page), all 32 bytes, absent for a page under the root
                           | the page's token ids as uint32 little-endian)
    block hash      the digest's first 8 bytes as a signed big-endian int64
    page_hashes     a node's full pages' block hashes, 8 bytes each (the digests' first 8 bytes),
                    in path order; two pages with the same bytes hold the same tokens after the
                    same path from the root (up to a 64-bit collision)
"""

from __future__ import annotations

import hashlib

PAGE_HASH_BYTES = 8


def page_digest(parent_digest: bytes | None, token_bytes: bytes) -> bytes:
    """sha256(the parent page's 32-byte digest, absent under the root | the page's token bytes)."""
    digest = hashlib.sha256()
    if parent_digest is not None:
        digest.update(parent_digest)
    digest.update(token_bytes)
    return digest.digest()


def block_hash(digest: bytes) -> int:
    """The event's block hash of a page digest: its first 8 bytes, signed big-endian."""
    return int.from_bytes(digest[:PAGE_HASH_BYTES], "big", signed=True)


def chained_digests(key: bytes, page_bytes: int, parent_digest: bytes | None) -> list[bytes]:
    """The digests of `key`'s full pages (int32 token bytes, `page_bytes` per page), chained on
    `parent_digest`; a trailing partial page has none."""
    out: list[bytes] = []
    for start in range(0, len(key) - page_bytes + 1, page_bytes):
        parent_digest = page_digest(parent_digest, key[start : start + page_bytes])
        out.append(parent_digest)
    return out


def split_page_hashes(blob: bytes | None) -> list[bytes]:
    """A stored page_hashes value as one 8-byte hash per page ([] for NULL)."""
    if not blob:
        return []
    return [bytes(blob[i : i + PAGE_HASH_BYTES]) for i in range(0, len(blob), PAGE_HASH_BYTES)]
