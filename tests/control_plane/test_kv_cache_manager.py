"""The seeds' scenarios at the KV-cache-manager level, with exact block accounting."""

from control_plane.invariants import check_pool
from control_plane.kv_cache_manager import KVCacheManager
from tests.control_plane.helpers import make_seq


def _prefill(kv: KVCacheManager, seq, use_cache: bool = True):
    hits, n_hit = kv.get_computed_blocks(seq) if use_cache else ([], 0)
    alloc = kv.allocate_slots(seq, seq.num_tokens - n_hit, hits)
    assert alloc is not None
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    return n_hit, alloc


def _decode(kv: KVCacheManager, seq, token: int):
    seq.token_ids.append(token)
    alloc = kv.allocate_slots(seq, 1)
    assert alloc is not None
    seq.num_computed_tokens += 1
    kv.cache_full_blocks(seq)
    return alloc


def test_35_token_prompt_takes_3_blocks_and_crossing_48_takes_exactly_one_more():
    kv = KVCacheManager(num_blocks=32, block_size=16)
    seq = make_seq(list(range(35)))
    _prefill(kv, seq)
    assert len(kv.tables[seq.seq_id]) == 3
    assert kv.pool.num_free_blocks == 31 - 3
    for _ in range(35, 48):  # fill positions 35..47
        _decode(kv, seq, 7)
        assert len(kv.tables[seq.seq_id]) == 3
    alloc = _decode(kv, seq, 7)  # position 48 starts block 4
    assert alloc.num_new_blocks == 1 and len(kv.tables[seq.seq_id]) == 4
    assert kv.pool.num_free_blocks == 31 - 4
    kv.free(seq)
    assert kv.pool.num_free_blocks == 31
    check_pool(kv.pool)


def test_two_requests_share_a_40_token_prefix_in_2_full_blocks():
    kv = KVCacheManager(num_blocks=32, block_size=16)
    prefix = list(range(100, 140))
    a = make_seq(prefix + [1, 2, 3])
    _prefill(kv, a)
    b = make_seq(prefix + [9, 9])
    n_hit, _ = _prefill(kv, b)
    assert n_hit == 32  # 2 full blocks; the 8 remaining prefix tokens live in a partial block
    ta, tb = kv.tables[a.seq_id], kv.tables[b.seq_id]
    assert ta[:2] == tb[:2] and ta[2] is not tb[2]
    assert [blk.ref_cnt for blk in tb[:2]] == [2, 2]
    assert kv.prefix_hits == 0  # lookups are recorded by the scheduler at admission
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 31
    check_pool(kv.pool)


def test_hit_is_capped_so_one_token_is_computed():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(8)))
    _prefill(kv, a)
    kv.free(a)
    b = make_seq(list(range(8)))  # identical, block-aligned prompt
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 4 and len(hits) == 1  # the last block is recomputed


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(9)), salt=b"salt=a")
    _prefill(kv, a)
    assert kv.get_computed_blocks(make_seq(list(range(9)), salt=b"salt=b"))[1] == 0
    assert kv.get_computed_blocks(make_seq(list(range(9)), salt=b"salt=a"))[1] == 8


def test_freed_prefix_survives_longest_tail_is_evicted_first():
    kv = KVCacheManager(num_blocks=5, block_size=2)  # 4 real blocks
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8])  # exactly 4 full blocks
    _prefill(kv, a)
    kv.free(a)
    order = [blk.block_id for blk in kv.pool.free_queue]
    table_ids = [1, 2, 3, 4]
    assert sorted(order) == table_ids
    # freed in reverse: the last block of the prompt is evicted first, the first survives longest
    first_block = kv.pool.get_cached_block(a.block_hashes[0])
    last_block = kv.pool.get_cached_block(a.block_hashes[3])
    assert order[0] == last_block.block_id and order[-1] == first_block.block_id


def test_beam_width_2_copy_on_write_makes_exactly_one_copy():
    """Timeline: prompt of 5 tokens (block 4) -> fork into 2 beams -> each beam appends one
    token into the shared, partial last block. The first writer copies; the second then owns
    the block alone and writes in place."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    beam0 = make_seq([1, 2, 3, 4, 5])
    _prefill(kv, beam0)
    beam1 = make_seq([1, 2, 3, 4, 5])
    beam1.num_computed_tokens = beam0.num_computed_tokens
    kv.fork(beam0, beam1, beam0.num_computed_tokens)
    shared = kv.tables[beam0.seq_id][1]
    assert shared.ref_cnt == 2 and kv.tables[beam0.seq_id][0].ref_cnt == 2
    a0 = _decode(kv, beam0, 10)
    a1 = _decode(kv, beam1, 11)
    copies = a0.copies + a1.copies
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == shared.block_id
    assert a0.replaced == [(1, dst)] and a1.replaced == []
    assert kv.tables[beam1.seq_id][1] is shared and shared.ref_cnt == 1
    assert kv.tables[beam0.seq_id][0] is kv.tables[beam1.seq_id][0]  # the full block stays shared
    kv.free(beam0)
    kv.free(beam1)
    assert kv.pool.num_free_blocks == 15
    check_pool(kv.pool)


def test_allocate_returns_none_and_changes_nothing_when_pool_is_short():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 real blocks
    a = make_seq(list(range(10)))
    _prefill(kv, a)
    b = make_seq(list(range(50, 55)))
    before = kv.pool.num_free_blocks
    assert kv.allocate_slots(b, 5) is None
    assert kv.pool.num_free_blocks == before and b.seq_id not in kv.tables
    check_pool(kv.pool)
