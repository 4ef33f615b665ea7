"""Paged KV-cache blocks with chained-hash prefix caching and lazy eviction.

A full block's hash chains its parent's hash with its token ids (xxhash64), so equal hashes mean
equal prefixes, not just equal blocks; the stored token ids guard against collisions. A released
block keeps its hash and stays a cache hit until the free pool hands it out again ("lazy eviction").
The pool is ordered so that empty blocks are reused before cached ones, and cached ones in the order
they were released (least recently used first).
"""

from __future__ import annotations

from collections import deque

import numpy as np
import xxhash

from engine.events import BlockAlloc, BlockEvict, BlockFree, BlockStored, EventBus, PrefixHit
from engine.sequence import Sequence

NO_HASH = -1


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.token_ids: list[int] = []

    def update(self, hash_: int, token_ids: list[int]) -> None:
        self.hash = hash_
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = NO_HASH
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: EventBus | None = None) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events or EventBus()
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @staticmethod
    def compute_hash(token_ids: list[int], prefix: int = NO_HASH) -> int:
        h = xxhash.xxh64()
        if prefix != NO_HASH:
            h.update(prefix.to_bytes(8, "little"))
        h.update(np.array(token_ids, dtype=np.int64).tobytes())
        return h.intdigest()

    def _allocate_block(self) -> int:
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
            if self.events.active:
                self.events.emit(BlockEvict, block_id=block_id, hash=block.hash)
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the cached prefix of ``seq``: at most every block but the one holding the last
        token, which is always recomputed so that at least one query token produces logits."""
        if not self.enable_prefix_caching:
            return []
        hit_block_ids = []
        h = NO_HASH
        for i in range((seq.num_tokens - 1) // self.block_size):
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids:
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> int:
        """The number of prefix-cached blocks ``seq`` would reuse, or -1 when the pool cannot hold it."""
        hit_block_ids = self._cached_prefix(seq)
        # Hits on blocks already in use cost nothing; hits on cached free blocks still leave the pool.
        num_new_blocks = seq.num_blocks - sum(1 for b in hit_block_ids if b in self.used_block_ids)
        if len(self.free_block_ids) < num_new_blocks:
            return -1
        return len(hit_block_ids)

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> None:
        """Give ``seq`` a block table for its whole token list, reusing its first ``num_cached_blocks``
        blocks from the prefix cache (as returned by ``can_allocate``)."""
        assert not seq.block_table, f"request {seq.seq_id} already holds blocks"
        hit_block_ids = self._cached_prefix(seq)[:num_cached_blocks]
        assert len(hit_block_ids) == num_cached_blocks, "the prefix cache changed since can_allocate"
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                block.ref_count = 1
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        for _ in range(num_cached_blocks, seq.num_blocks):
            seq.block_table.append(self._allocate_block())
        seq.num_cached_tokens = num_cached_blocks * self.block_size
        if self.events.active:
            self.events.emit(BlockAlloc, request_id=seq.seq_id, block_ids=tuple(seq.block_table),
                             refcounts=tuple(self.blocks[b].ref_count for b in seq.block_table))
            self.events.emit(PrefixHit, request_id=seq.seq_id, query_tokens=seq.num_tokens,
                             hit_tokens=seq.num_cached_tokens, hit_block_ids=tuple(hit_block_ids))

    def deallocate(self, seq: Sequence) -> int:
        """Release every block of ``seq``; returns how many went back to the free pool."""
        freed = 0
        # Tail blocks are released first so that, among one request's blocks, the prefix is evicted last.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block_id:
                    self.free_block_ids.append(block_id)
                else:
                    # Holds nothing reusable: hand it out before any cached block.
                    self.free_block_ids.appendleft(block_id)
                freed += 1
        if self.events.active and seq.block_table:
            block_ids = tuple(reversed(seq.block_table))
            self.events.emit(BlockFree, request_id=seq.seq_id, block_ids=block_ids,
                             refcounts=tuple(self.blocks[b].ref_count for b in block_ids))
        seq.num_cached_tokens = 0
        seq.block_table = []
        return freed

    def uncache(self, seq: Sequence) -> None:
        """Withdraw the prefix-cache entries of ``seq``'s blocks (their K/V cannot be trusted). The
        blocks keep their hashes, which later blocks of other requests chain from."""
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
                if self.events.active:
                    self.events.emit(BlockEvict, block_id=block_id, hash=block.hash)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``), for benchmarks that rerun the
        same prompts; only while no request holds a block. Returns how many blocks were forgotten."""
        if self.used_block_ids:
            raise RuntimeError(f"{len(self.used_block_ids)} blocks are held by requests: the prefix cache can "
                               "only be reset when the engine is idle")
        for h, block_id in self.hash_to_block_id.items():
            self.blocks[block_id].update(NO_HASH, [])
            if self.events.active:
                self.events.emit(BlockEvict, block_id=block_id, hash=h)
        forgotten = len(self.hash_to_block_id)
        self.hash_to_block_id.clear()
        return forgotten

    def can_append(self, seq: Sequence) -> bool:
        """Whether the token being decoded has a slot: a new block is needed when it opens one."""
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        if len(seq) % self.block_size == 1:
            block_id = self._allocate_block()
            seq.block_table.append(block_id)
            if self.events.active:
                self.events.emit(BlockAlloc, request_id=seq.seq_id, block_ids=(block_id,), refcounts=(1,))

    def hash_blocks(self, seq: Sequence, num_new_tokens: int) -> None:
        """Register the blocks that ``num_new_tokens`` newly computed tokens (prompt or generated)
        completed, before ``seq.num_cached_tokens`` counts them."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + num_new_tokens) // self.block_size
        if start == end:
            return
        parent = self.blocks[seq.block_table[start - 1]].hash if start > 0 else NO_HASH
        h = parent
        stored_ids, stored_hashes = [], []
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            token_ids = seq.block(i)
            h = self.compute_hash(token_ids, h)
            block.update(h, token_ids)
            # The first block to compute a prefix owns the cache entry; a twin computed in the same
            # step (identical prompts admitted together) keeps its hash for chaining but stays private.
            if self.hash_to_block_id.setdefault(h, block.block_id) == block.block_id:
                stored_ids.append(block.block_id)
                stored_hashes.append(h)
        if self.events.active and stored_ids:
            self.events.emit(BlockStored, request_id=seq.seq_id, block_ids=tuple(stored_ids),
                             hashes=tuple(stored_hashes), parent_hash=parent)
