"""Paged KV-cache bookkeeping shaped like vLLM V1's KVCacheManager / BlockPool.

* The device KV pool has ``num_blocks`` blocks of ``block_size`` token slots.
* Prefix cache: every *full* block of a request's tokens gets a hash chained over the previous
  block's hash (``hash((parent, tokens, cache_salt))``); computed full blocks are registered in
  ``cached`` (hash → block id). A new request reuses the longest chain of cached blocks from its
  start and skips their prefill compute (at most ``num_tokens - 1`` tokens, as vLLM, so the last
  prompt token is always computed and produces logits).
* Freed blocks keep their hash and sit in an LRU free queue (tail blocks of a request first, as
  vLLM frees in reverse), so they can be hit again until the allocator evicts them.
* Optional host offload (``--kv-offload``): when the allocator evicts a hashed block it is first
  copied to a host-memory pool (D2H); a later prefix lookup that misses on the device but hits the
  host pool allocates device blocks and copies the data back (H2D). These hits are reported as
  *external* cached tokens (as a vLLM KV connector's hits are). Copies are queued as ordered
  ``CopyOp`` s that the model runner executes at the start of the step, before the forward pass.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence


def hash_block(parent: Optional[int], tokens: Sequence[int], salt: Optional[str]) -> int:
    # Python's hash of a tuple of ints/None is deterministic; str hashing is salted per process,
    # which is fine because hashes never leave the engine process.
    return hash((parent, tuple(tokens), salt))


@dataclass
class CopyOp:
    dir: str  # "d2h" (offload) or "h2d" (onload)
    device_block: int
    host_slot: int
    req_id: str


class HostCache:
    """LRU pool of host-memory block slots keyed by block hash."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self.map: "OrderedDict[int, int]" = OrderedDict()
        self.free_slots = list(range(self.capacity - 1, -1, -1))

    def __contains__(self, h: int) -> bool:
        return h in self.map

    def touch(self, h: int) -> int:
        self.map.move_to_end(h)
        return self.map[h]

    def put(self, h: int) -> int:
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            _, slot = self.map.popitem(last=False)
        self.map[h] = slot
        return slot


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 host_capacity_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.req_blocks: dict[str, list[int]] = {}
        self.req_num_hashed: dict[str, int] = {}
        self.host: Optional[HostCache] = HostCache(host_capacity_blocks) if host_capacity_blocks > 0 else None
        self.pending_ops: list[CopyOp] = []
        # counters
        self.num_evictions = 0
        self.num_offloaded_blocks = 0
        self.num_onloaded_blocks = 0

    # ---------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_computed_blocks(self, block_hashes: Sequence[int], num_tokens: int) -> tuple[list[int], int]:
        """Longest cached prefix: (device block ids, number of further blocks found on the host)."""
        if not self.enable_caching:
            return [], 0
        max_blocks = min((num_tokens - 1) // self.block_size, len(block_hashes))
        local: list[int] = []
        for h in block_hashes[:max_blocks]:
            bid = self.cached.get(h)
            if bid is None:
                break
            local.append(bid)
        ext = 0
        if self.host is not None:
            for h in block_hashes[len(local):max_blocks]:
                if h not in self.host:
                    break
                ext += 1
        return local, ext

    # ------------------------------------------------------------- allocation
    def allocate_slots(self, req_id: str, num_computed_tokens: int, num_new_tokens: int,
                       block_hashes: Sequence[int] = (), new_local_blocks: Sequence[int] = (),
                       num_ext_blocks: int = 0) -> bool:
        """Make room for ``num_new_tokens`` after ``num_computed_tokens`` (which must already
        include the cache hits passed in). Returns False, changing nothing, if blocks run out."""
        bs = self.block_size
        existing = self.req_blocks.get(req_id, [])
        need_total = -(-(num_computed_tokens + num_new_tokens) // bs)
        num_new_blocks = need_total - len(existing) - len(new_local_blocks)
        evictable_hits = sum(1 for b in new_local_blocks if self.blocks[b].ref_cnt == 0)
        if num_new_blocks > len(self.free_queue) - evictable_hits:
            return False
        for b in new_local_blocks:
            blk = self.blocks[b]
            if blk.ref_cnt == 0:
                del self.free_queue[b]
            blk.ref_cnt += 1
        blocks = list(existing) + list(new_local_blocks)
        ext_hashes = list(block_hashes[len(new_local_blocks):len(new_local_blocks) + num_ext_blocks])
        if self.host is not None:
            for h in ext_hashes:  # most recently used: keep them while we evict below
                self.host.touch(h)
        first_new = len(blocks)
        for _ in range(max(0, num_new_blocks)):
            blocks.append(self._pop_free(req_id))
        for j, h in enumerate(ext_hashes):
            bid = blocks[first_new + j]
            assert self.host is not None
            slot = self.host.touch(h)
            self.pending_ops.append(CopyOp("h2d", bid, slot, req_id))
            self.num_onloaded_blocks += 1
            if h not in self.cached:
                self.cached[h] = bid
                self.blocks[bid].block_hash = h
        self.req_blocks[req_id] = blocks
        if req_id not in self.req_num_hashed:
            self.req_num_hashed[req_id] = len(new_local_blocks) + len(ext_hashes)
        return True

    def _pop_free(self, req_id: str) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        blk = self.blocks[bid]
        if blk.block_hash is not None:
            h = blk.block_hash
            if self.cached.get(h) == bid:
                del self.cached[h]
                self.num_evictions += 1
                if self.host is not None and h not in self.host:
                    slot = self.host.put(h)
                    self.pending_ops.append(CopyOp("d2h", bid, slot, req_id))
                    self.num_offloaded_blocks += 1
            blk.block_hash = None
        blk.ref_cnt = 1
        return bid

    def cache_full_blocks(self, req_id: str, block_hashes: Sequence[int], num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(req_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(blocks))
        start = self.req_num_hashed.get(req_id, 0)
        for i in range(start, num_full):
            h = block_hashes[i]
            if h in self.cached:
                continue  # duplicate content already cached in another block
            bid = blocks[i]
            self.cached[h] = bid
            self.blocks[bid].block_hash = h
        if num_full > start:
            self.req_num_hashed[req_id] = num_full

    def free(self, req_id: str) -> None:
        blocks = self.req_blocks.pop(req_id, [])
        self.req_num_hashed.pop(req_id, None)
        for bid in reversed(blocks):
            blk = self.blocks[bid]
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                if blk.block_hash is None or self.cached.get(blk.block_hash) != bid:
                    blk.block_hash = None
                self.free_queue[bid] = None

    def take_ops(self) -> list[CopyOp]:
        ops, self.pending_ops = self.pending_ops, []
        return ops

    def reset_prefix_cache(self) -> None:
        for h, bid in list(self.cached.items()):
            if self.blocks[bid].ref_cnt == 0:
                self.blocks[bid].block_hash = None
                del self.cached[h]
