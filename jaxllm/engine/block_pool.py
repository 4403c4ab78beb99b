"""GPU KV block allocator: free queue, ref counts and the prefix-cache table.

Block 0 is the null block: never handed out, so the model runner can point padding
slots (and padded block-table entries) at it without corrupting a live request.
Usable blocks are 1..num_blocks-1.

Prefix caching (as in vLLM v1 / nano-vllm): a full block is named by a chained hash
of (parent hash, block tokens). A freed cached block keeps its hash and stays
findable until the free queue hands it out again ("evictable").

Exactness: a hash only picks a table slot. A hit also requires the block's stored
key -- (parent prefix id, block tokens) -- to equal the looked-up one, where the
parent prefix id is the *serial* given to the parent block when it was registered.
Serials are never reused, so by induction a matched chain is exactly the prompt's
prefix: a hash collision (even one that ignores the parent) is a miss, never wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

NULL_BLOCK_ID = 0

# Key of a cached block: (parent ref, block tokens). The parent ref of a prompt's
# first block is a root tuple ("root", scope); deeper blocks use the parent's serial.
CacheKey = tuple[Hashable, tuple[int, ...]]


def hash_block_tokens(parent_hash: Hashable, token_ids: tuple[int, ...]) -> int:
    """Chained block hash. Module-level so tests can force collisions."""
    return hash((parent_hash, token_ids))


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None     # set while registered in the cache table
    cache_key: CacheKey | None = None
    serial: int = 0                   # unique per registration; names this prefix

    def reset_hash(self) -> None:
        self.block_hash, self.cache_key, self.serial = None, None, 0


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    blocks: list[KVBlock] = field(init=False)
    # Insertion-ordered set of free block ids; the head is handed out first.
    _free: OrderedDict[int, None] = field(init=False)
    _cached: dict[int, KVBlock] = field(init=False, default_factory=dict)
    _next_serial: int = field(init=False, default=0)
    prefix_cache_queries: int = field(init=False, default=0)   # tokens
    prefix_cache_hits: int = field(init=False, default=0)      # tokens

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks}: need >= 2 (block 0 is the null block)")
        self.blocks = [KVBlock(i) for i in range(self.num_blocks)]
        self.blocks[NULL_BLOCK_ID].ref_cnt = 1  # pinned forever
        self._free = OrderedDict.fromkeys(range(1, self.num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Free blocks, evictable cached ones included."""
        return len(self._free)

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (evictable counts as free)."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take blocks from the free-queue head, evicting their cache entries."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} free")
        ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cache-hit blocks, pulling evictable ones off the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; give ids in the order they should be evicted.

        Unhashed blocks go to the queue head (reused first: they hold nothing of
        value); cached ones go to the tail so they stay findable as long as possible.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0 and block_id != NULL_BLOCK_ID, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: int, key: CacheKey) -> KVBlock | None:
        block = self._cached.get(block_hash)
        if block is None or block.cache_key != key:
            return None
        return block

    def cache_block(self, block_id: int, block_hash: int, key: CacheKey) -> int | None:
        """Register a computed full block; return the serial naming its prefix.

        If an equal prefix is already registered (another request computed the same
        tokens), that block's serial is returned and this block stays unhashed. On a
        true collision (same hash, other key) None: the prefix cannot be named.
        """
        existing = self._cached.get(block_hash)
        if existing is not None:
            return existing.serial if existing.cache_key == key else None
        block = self.blocks[block_id]
        self._next_serial += 1
        block.block_hash, block.cache_key, block.serial = block_hash, key, self._next_serial
        self._cached[block_hash] = block
        return block.serial

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (call with no block in use: their KV is gone)."""
        for block in self._cached.values():
            block.reset_hash()
        self._cached.clear()

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.reset_hash()
