import pytest

from control_plane.block_hash import extra_keys, hash_block
from control_plane.block_pool import BlockPool
from control_plane.invariants import check_pool


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    check_pool(pool)


def test_eviction_order_uncached_first_then_least_recently_freed_cached():
    pool = BlockPool(6)
    a, b, c, d, e = pool.get_new_blocks(5)
    pool.cache_block(a, b"A" * 32)
    pool.cache_block(b, b"B" * 32)
    pool.free_blocks([b])  # cached, freed first
    pool.free_blocks([c])  # uncached
    pool.free_blocks([a])  # cached, freed second
    pool.free_blocks([d])  # uncached
    check_pool(pool)
    order = [blk.block_id for blk in pool.free_queue]
    assert set(order[:2]) == {c.block_id, d.block_id}
    assert order[2:] == [b.block_id, a.block_id]
    # Taking three blocks evicts only the least recently freed cached one (b).
    taken = pool.get_new_blocks(3)
    assert {x.block_id for x in taken} == {c.block_id, d.block_id, b.block_id}
    assert pool.get_cached_block(b"B" * 32) is None
    assert pool.get_cached_block(b"A" * 32) is a
    check_pool(pool)


def test_touch_revives_free_cached_block_in_place():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(7)
    pool.cache_block(blocks[3], b"h" * 32)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 7
    pool.touch([blocks[3]])
    assert blocks[3].ref_cnt == 1 and pool.num_free_blocks == 6
    pool.touch([blocks[3]])
    assert blocks[3].ref_cnt == 2 and pool.num_free_blocks == 6
    check_pool(pool)


def test_double_free_is_an_internal_error():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([blk])


def test_reset_prefix_cache_only_when_nothing_is_held():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"x" * 32)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([a, b])
    assert pool.reset_prefix_cache()
    assert not pool.cached and a.block_hash is None
    check_pool(pool)


def test_disabled_caching_never_caches():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"x" * 32)
    assert a.block_hash is None and not pool.cached


def test_hash_chains_parent_tokens_and_extra_keys():
    h1 = hash_block(None, [1, 2, 3])
    assert h1 == hash_block(None, [1, 2, 3]) and len(h1) == 32
    assert h1 != hash_block(None, [1, 2, 4])
    assert hash_block(h1, [5]) != hash_block(hash_block(None, [1, 2, 4]), [5])  # parent matters
    assert hash_block(None, [1, 2, 3], extra_keys("tenant-a")) != h1
    assert hash_block(None, [1, 2, 3], extra_keys("tenant-a")) != hash_block(None, [1, 2, 3], extra_keys("b"))
    # token boundaries are unambiguous (fixed-width encoding)
    assert hash_block(None, [1, 23]) != hash_block(None, [12, 3])
