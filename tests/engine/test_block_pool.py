"""BlockPool and KVCacheManager: allocation, ref counts, prefix-cache exactness."""

import pytest
from sched_util import SP

from jaxllm.engine import block_pool
from jaxllm.engine.block_pool import NULL_BLOCK_ID, BlockPool
from jaxllm.engine.kv_cache_manager import KVCacheManager
from jaxllm.engine.request import Request


def key(tokens, parent=("root", None)):
    return (parent, tuple(tokens))


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.get_num_free_blocks() == 4
    ids = pool.get_new_blocks(4)
    assert sorted(ids) == [1, 2, 3, 4] and NULL_BLOCK_ID not in ids
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(ids)
    assert pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, block_size=4)


def test_ref_counts_and_usage():
    pool = BlockPool(num_blocks=9, block_size=4)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])
    assert pool.ref_cnt(a) == 2 and pool.ref_cnt(b) == 1
    assert pool.get_usage() == pytest.approx(2 / 8)
    pool.free_blocks([a, b])
    assert pool.ref_cnt(a) == 1 and pool.ref_cnt(b) == 0
    assert pool.get_num_free_blocks() == 7
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 8


def test_cached_blocks_stay_findable_until_reallocated():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b, c = pool.get_new_blocks(3)
    serial = pool.cache_block(a, 111, key([1, 2]))
    assert serial and pool.lookup(111, key([1, 2])).block_id == a
    pool.free_blocks([a, b, c])
    # The unhashed blocks are reused first; the cached one survives them.
    assert sorted(pool.get_new_blocks(2)) == sorted([b, c])
    assert pool.lookup(111, key([1, 2])).block_id == a
    pool.touch([a])  # a hit takes an evictable block off the free queue
    assert pool.get_num_free_blocks() == 0 and pool.ref_cnt(a) == 1
    pool.free_blocks([a])
    assert pool.get_new_blocks(1) == [a]
    assert pool.lookup(111, key([1, 2])) is None  # evicted on reallocation


def test_lookup_compares_contents_not_just_hashes():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, 7, key([1, 2])) is not None
    assert pool.lookup(7, key([3, 4])) is None                      # same hash, other tokens
    assert pool.lookup(7, key([1, 2], parent=("root", "x"))) is None  # other scope
    assert pool.cache_block(b, 7, key([3, 4])) is None               # collision: not named
    # Same contents computed twice: the second copy is named by the first's serial.
    assert pool.cache_block(b, 7, key([1, 2])) == pool.blocks[a].serial
    assert pool.blocks[b].block_hash is None


def compute(manager, req, num_tokens):
    """Pretend the runner computed num_tokens more tokens of req."""
    assert manager.allocate_slots(req, num_tokens)
    req.num_computed_tokens += num_tokens
    manager.cache_blocks(req)


def admit(manager, req):
    hit = manager.get_computed_blocks(req)
    num_new = req.num_tokens - len(hit.block_ids) * manager.block_size
    assert manager.allocate_slots(req, num_new, hit)
    req.num_computed_tokens = req.num_tokens - num_new
    return hit


def test_hash_ignoring_the_parent_cannot_give_a_wrong_prefix(monkeypatch):
    # With a hash of the block tokens only, [W, Y] finds the [X, Y] block for Y.
    # Its KV was computed after X, so it must be a miss.
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent, tokens: hash(tokens))
    manager = KVCacheManager(2, 32, 0, enable_prefix_caching=True)
    X, Y, W = [1, 2], [3, 4], [5, 6]
    for rid, prompt in (("a", X + Y + [9]), ("c", W + [9])):
        req = Request(rid, prompt, SP())
        compute(manager, req, req.num_tokens)
    b = Request("b", W + Y + [9], SP())
    hit = admit(manager, b)
    assert len(hit.block_ids) == 1 and hit.block_ids == manager.req_blocks["c"][:1]


def test_scoped_caching_when_prefix_caching_is_off():
    manager = KVCacheManager(2, 32, 0, enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5]
    first = Request("0_p", prompt, SP(), parent_id="p")
    compute(manager, first, 5)
    sibling = Request("1_p", prompt, SP(), parent_id="p")
    stranger = Request("q", prompt, SP())
    other_parent = Request("0_r", prompt, SP(), parent_id="r")
    assert admit(manager, sibling).block_ids == manager.req_blocks["0_p"][:2]
    assert admit(manager, stranger).block_ids == []
    assert admit(manager, other_parent).block_ids == []
    assert manager.block_pool.ref_cnt(manager.req_blocks["0_p"][0]) == 2


def test_swap_out_and_in_round_trip():
    manager = KVCacheManager(4, 8, 4, enable_prefix_caching=False)
    req = Request("a", list(range(10)), SP())
    compute(manager, req, 10)
    gpu = manager.get_block_table(req)
    pairs = manager.swap_out(req)
    assert [g for g, _ in pairs] == gpu and len({c for _, c in pairs}) == 3
    assert manager.block_pool.get_num_free_blocks() == 7 and len(manager.cpu_free) == 1
    back = manager.swap_in(req, 1)
    assert [c for c, _ in back] == [c for _, c in pairs]
    assert [g for _, g in back] == manager.get_block_table(req)
    assert len(manager.cpu_free) == 4
    manager.free(req)
    assert manager.block_pool.get_num_free_blocks() == 7


def test_swap_refuses_shared_blocks_and_full_cpu():
    manager = KVCacheManager(2, 16, 8, enable_prefix_caching=True)
    a = Request("a", [1, 2, 3, 4, 5], SP())
    compute(manager, a, 5)
    b = Request("b", [1, 2, 3, 4, 6], SP())
    admit(manager, b)
    assert manager.swap_out(b) is None   # shares two blocks with a
    small = KVCacheManager(2, 16, 1, enable_prefix_caching=False)
    c = Request("c", [1, 2, 3], SP())
    compute(small, c, 3)
    assert small.swap_out(c) is None     # 2 blocks, 1 CPU block
