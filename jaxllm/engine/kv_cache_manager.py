"""Per-request block tables over the GPU BlockPool, plus the CPU swap space.

Caching scope: with prefix caching on, every request looks up and registers its
full blocks in one global namespace. With it off, only the n samples of one prompt
(same ``parent_id``) share, in a namespace seeded by the parent id, so siblings
reuse the prompt's full blocks without copies and nothing leaks across requests.

Blocks are registered in the cache once the step that computes their KV is
scheduled and their tokens are known (``cache_blocks``, called when a request is
scheduled and again when its sampled token is read back). A hit is then valid KV by
the time it is read: device steps run in launch order, and within a step each layer
writes the step's new KV into the pool before its attention reads the pool. (A decode
kernel that writes the KV itself, the default unless JAXLLM_DECODE_KV_WRITE=0, breaks
that order, so the runner keeps steps with a row admitted by their schedule,
ScheduledRequest.admitted, out of it.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from jaxllm.engine import block_pool
from jaxllm.engine.block_pool import BlockPool
from jaxllm.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class CacheHit:
    block_ids: list[int]
    refs: list[int]    # serials naming each hit prefix (parents of later blocks)


class KVCacheManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_gpu_blocks, block_size)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_free: deque[int] = deque(range(num_cpu_blocks))
        self.req_blocks: dict[str, list[int]] = {}       # GPU block table
        self.req_cpu_blocks: dict[str, list[int]] = {}   # while swapped out
        # Serials of the request's registered full-block prefixes, in order; None
        # once a collision broke the chain. len() = full blocks already handled.
        self.req_refs: dict[str, list[int | None]] = {}

    # -- prefix cache -----------------------------------------------------------

    def _scope(self, req: Request) -> Hashable | None:
        """Root of the hash chain, or None when this request does not cache."""
        if self.enable_prefix_caching:
            return ("root", None)
        return None if req.parent_id is None else ("root", req.parent_id)

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(req.all_token_ids[i * bs:(i + 1) * bs])

    def _update_block_hashes(self, req: Request, root: Hashable) -> None:
        hashes = req.block_hashes
        for i in range(len(hashes), req.num_tokens // self.block_size):
            parent = hashes[-1] if hashes else root
            hashes.append(block_pool.hash_block_tokens(parent, self._block_tokens(req, i)))

    def get_computed_blocks(self, req: Request) -> CacheHit:
        """Longest cached chain of full blocks, leaving >= 1 token to compute."""
        hit = CacheHit([], [])
        root = self._scope(req)
        if root is None or _needs_prompt_logprobs(req):
            return hit
        self._update_block_hashes(req, root)
        # The last token must be computed so there are logits to sample from.
        max_blocks = (req.num_tokens - 1) // self.block_size
        parent: Hashable = root
        for i in range(max_blocks):
            block = self.block_pool.lookup(req.block_hashes[i],
                                           (parent, self._block_tokens(req, i)))
            if block is None:
                break
            hit.block_ids.append(block.block_id)
            hit.refs.append(block.serial)
            parent = block.serial
        return hit

    def cache_blocks(self, req: Request) -> None:
        """Register the request's newly computed full blocks."""
        # Known tokens only: a block's last token may still be in flight.
        num_done = min(req.num_computed_tokens, len(req.all_token_ids))
        refs = self.req_refs.get(req.request_id)
        if refs is not None and len(refs) >= num_done // self.block_size:
            return    # no new full block (most steps)
        root = self._scope(req)
        if root is None:
            return
        self._update_block_hashes(req, root)
        refs = self.req_refs.setdefault(req.request_id, [])
        blocks = self.req_blocks[req.request_id]
        for i in range(len(refs), num_done // self.block_size):
            parent = root if i == 0 else refs[-1]
            serial = None
            if parent is not None:
                key = (parent, self._block_tokens(req, i))
                serial = self.block_pool.cache_block(blocks[i], req.block_hashes[i], key)
            refs.append(serial)

    def num_cached_blocks(self, req: Request) -> int:
        """Full blocks of the request registered so far (or skipped on a collision)."""
        return len(self.req_refs.get(req.request_id, ()))

    # -- allocation ---------------------------------------------------------------

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit: CacheHit | None = None) -> bool:
        """Grow the block table to cover num_computed_tokens (+ hit) + num_new_tokens.

        All or nothing: returns False, changing nothing, when blocks run short.
        """
        pool = self.block_pool
        blocks = self.req_blocks.get(req.request_id, ())
        if hit is None and (req.num_computed_tokens + num_new_tokens
                            <= len(blocks) * self.block_size):
            return True    # the common decode step: the last block has room
        hit_ids = hit.block_ids if hit else []
        num_total = req.num_computed_tokens + len(hit_ids) * self.block_size + num_new_tokens
        num_needed = max(cdiv(num_total, self.block_size) - len(blocks) - len(hit_ids), 0)
        # Evictable hit blocks sit in the free queue; touching them takes them out.
        num_evictable_hits = sum(1 for b in hit_ids if pool.ref_cnt(b) == 0)
        if num_needed + num_evictable_hits > pool.get_num_free_blocks():
            return False
        pool.touch(hit_ids)
        blocks = self.req_blocks.setdefault(req.request_id, [])
        blocks.extend(hit_ids)
        blocks.extend(pool.get_new_blocks(num_needed))
        if hit is not None:
            self.req_refs[req.request_id] = list(hit.refs)
        return True

    def get_block_table(self, req: Request) -> list[int]:
        return list(self.req_blocks.get(req.request_id, ()))

    def free(self, req: Request) -> None:
        """Release GPU and CPU blocks. Cached full blocks stay evictable."""
        # Reverse order: a prompt's tail blocks are the least likely to be shared,
        # so they should be evicted first.
        self.block_pool.free_blocks(reversed(self.req_blocks.pop(req.request_id, [])))
        self.cpu_free.extend(self.req_cpu_blocks.pop(req.request_id, []))
        self.req_refs.pop(req.request_id, None)

    # -- swap -----------------------------------------------------------------------

    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to CPU; (gpu, cpu) pairs, or None if impossible.

        A request holding a shared block (ref count > 1: a prefix hit or a sibling's
        prompt) is not swapped -- the caller recomputes it instead -- so a GPU block
        is never owned by both a swapped and a running request.
        """
        blocks = self.req_blocks.get(req.request_id, [])
        if len(blocks) > len(self.cpu_free):
            return None
        if any(self.block_pool.ref_cnt(b) > 1 for b in blocks):
            return None
        cpu = [self.cpu_free.popleft() for _ in blocks]
        self.req_cpu_blocks[req.request_id] = cpu
        self.block_pool.free_blocks(reversed(self.req_blocks.pop(req.request_id)))
        # req_refs stay: serials name token prefixes, not blocks, so later blocks
        # can still be registered under them. The swapped-in copies are not
        # registered again (their prefixes may still be cached elsewhere).
        return list(zip(blocks, cpu))

    def swap_in(self, req: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Bring the KV back and room for num_new_tokens; (cpu, gpu) pairs or None."""
        cpu = self.req_cpu_blocks[req.request_id]
        num_needed = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size)
        if num_needed > self.block_pool.get_num_free_blocks():
            return None
        gpu = self.block_pool.get_new_blocks(num_needed)
        self.req_blocks[req.request_id] = gpu
        self.cpu_free.extend(self.req_cpu_blocks.pop(req.request_id))
        return list(zip(cpu, gpu))


def _needs_prompt_logprobs(req: Request) -> bool:
    """A request asking for prompt logprobs computes its whole prompt once: cached
    blocks would skip the positions it must score."""
    return (getattr(req.sampling_params, "prompt_logprobs", None) is not None
            and req.num_output_tokens == 0)
