"""Chained page keys and namespaces."""

from __future__ import annotations

import hashlib
import struct

from tierserve.cache.hashing import Namespace, page_keys

NS = Namespace(model="m", kv_dtype="float32", page_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def test_keys_are_chained_sha256_of_u32_le_tokens() -> None:
    tokens = list(range(10))
    keys = page_keys(NS.seed(), tokens, 4)
    assert len(keys) == 2  # the partial third page has no key
    first = hashlib.sha256(NS.seed() + struct.pack("<4I", 0, 1, 2, 3)).digest()
    assert keys[0] == first
    assert keys[1] == hashlib.sha256(first + struct.pack("<4I", 4, 5, 6, 7)).digest()
    assert page_keys(keys[0], tokens[4:], 4) == keys[1:]  # continuing a chain from a page key


def test_ids_of_any_u32_value_keep_the_format_from_a_list_or_a_tuple() -> None:
    """Ids above 16 bits (vocabularies of 150K) and near 2**32 pack as u32 little-endian too; the
    whole prompt is packed at once, so a page boundary must still cut it where it did."""
    tokens = (151_000, 2**32 - 1, 65_536, 7, 2**31 + 5, 0, 1, 2)
    expected = hashlib.sha256(NS.seed() + struct.pack("<4I", *tokens[:4])).digest()
    expected = [expected, hashlib.sha256(expected + struct.pack("<4I", *tokens[4:])).digest()]
    assert page_keys(NS.seed(), tokens, 4) == page_keys(NS.seed(), list(tokens), 4) == expected


def test_same_page_different_prefix_gets_a_different_key() -> None:
    a = page_keys(NS.seed(), [1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = page_keys(NS.seed(), [5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]


def test_every_namespace_field_changes_the_seed() -> None:
    seeds = {NS.seed()}
    variants = [NS.with_salt("tenant-b"), Namespace("m2", "float32", 4, 2, 2, 8),
                Namespace("m", "bfloat16", 4, 2, 2, 8), Namespace("m", "float32", 16, 2, 2, 8),
                Namespace("m", "float32", 4, 3, 2, 8), Namespace("m", "float32", 4, 2, 1, 8),
                Namespace("m", "float32", 4, 2, 2, 16), Namespace("m", "float32", 4, 2, 2, 8, "page_first")]
    for ns in variants:
        seeds.add(ns.seed())
        assert page_keys(ns.seed(), [1, 2, 3, 4], 4) != page_keys(NS.seed(), [1, 2, 3, 4], 4)
    assert len(seeds) == len(variants) + 1
    assert len(NS.digest()) == 16 and NS.digest() == NS.seed().hex()[:16]
