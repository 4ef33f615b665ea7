"""Paged KV-cache blocks with chained-hash prefix caching and lazy eviction.

A full block's hash chains its parent's hash with its token ids (xxhash64), so equal hashes mean
equal prefixes, not just equal blocks; the stored token ids guard against collisions. A released
block keeps its hash and stays a cache hit until the free pool hands it out again ("lazy eviction").
The pool is ordered so that empty blocks are reused before cached ones, and cached ones in the order
they were released (least recently used first).

With a host tier (``engine.host_tier``) the manager also names the blocks worth copying down: every
block that enters the cache (write-through) or every cache entry it evicts (write-back), collected in
``offload_candidates`` for the tier to take once per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import xxhash

from engine.events import BlockAlloc, BlockEvict, BlockFree, BlockStored, EventBus, PrefixHit
from engine.sequence import Sequence

NO_HASH = -1


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH
        self.parent_hash = NO_HASH  # the hash its own chains from, for the host tier's events
        self.token_ids: list[int] = []

    def update(self, hash_: int, parent_hash: int, token_ids: list[int]) -> None:
        self.hash = hash_
        self.parent_hash = parent_hash
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = NO_HASH
        self.parent_hash = NO_HASH
        self.token_ids = []

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hash={self.hash})"


@dataclass(frozen=True, slots=True)
class OffloadCandidate:
    """A cached GPU block the host tier may copy down: which block, what it held then, and (while
    a request still holds it) which request computed it."""

    block_id: int
    hash: int
    parent_hash: int
    token_ids: list[int]
    request_id: int | None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: EventBus | None = None, offload_policy: str | None = None, medium: str = "GPU") -> None:
        self.block_size = block_size
        # Where the blocks live, as the block events say: the GPU pool, or host memory in CPU-offload mode.
        self.medium = medium
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events or EventBus()
        self.blocks: list[Block] = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        # "write-through", "write-back" or None (no host tier, or no hashes to key it by).
        self.offload_policy = offload_policy if enable_prefix_caching else None
        self.offload_candidates: list[OffloadCandidate] = []

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

    def is_cache_entry(self, block: Block) -> bool:
        """Whether ``block`` is the one the prefix cache hands out for its hash."""
        return block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block.block_id

    def _allocate_block(self, evicted: list[tuple[int, int]]) -> int:
        """Take the free pool's next block; the cache entry it held, if any, is appended to ``evicted``
        as ``(block_id, hash)``, for the caller to emit once its own state is complete."""
        block_id = self.free_block_ids.popleft()
        block = self.blocks[block_id]
        if self.is_cache_entry(block):
            del self.hash_to_block_id[block.hash]
            evicted.append((block_id, block.hash))
            if self.offload_policy == "write-back":
                # Its copy is gathered before the step that overwrites it (the same stream orders them).
                self.offload_candidates.append(
                    OffloadCandidate(block_id, block.hash, block.parent_hash, block.token_ids, None))
        block.reset()
        self.used_block_ids.add(block_id)
        return block_id

    def _emit_evictions(self, evicted: list[tuple[int, int]]) -> None:
        if self.events.active:
            for block_id, hash_ in evicted:
                self.events.emit(BlockEvict, block_id=block_id, hash=hash_, medium=self.medium)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of the first ``num_blocks`` full blocks of ``seq``, each computed once
        and kept on the sequence (its tokens never change once known)."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_blocks):
            hashes.append(self.compute_hash(seq.block(i), hashes[-1] if hashes else NO_HASH))
        return hashes

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the cached prefix of ``seq``: at most every block but the one holding the last
        token, which is always recomputed so that at least one query token produces logits."""
        if not self.enable_prefix_caching:
            return []
        hit_block_ids = []
        for i, h in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)):
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != seq.block(i):
                break
            hit_block_ids.append(block_id)
        return hit_block_ids

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence, hit_block_ids: list[int]) -> bool:
        """Whether the pool can hold ``seq`` with its ``cached_prefix`` reused."""
        # Hits on blocks already in use cost nothing; hits on cached free blocks still leave the pool.
        num_new_blocks = seq.num_blocks - sum(1 for b in hit_block_ids if b in self.used_block_ids)
        return len(self.free_block_ids) >= num_new_blocks

    def allocate(self, seq: Sequence, hit_block_ids: list[int]) -> None:
        """Give ``seq`` a block table for its whole token list, reusing its ``cached_prefix``
        (``can_allocate`` said it fits, and nothing was allocated since)."""
        assert not seq.block_table, f"request {seq.seq_id} already holds blocks"
        for block_id in hit_block_ids:
            block = self.blocks[block_id]
            if block_id in self.used_block_ids:
                block.ref_count += 1
            else:
                block.ref_count = 1
                self.free_block_ids.remove(block_id)
                self.used_block_ids.add(block_id)
            seq.block_table.append(block_id)
        evicted: list[tuple[int, int]] = []
        for _ in range(len(hit_block_ids), seq.num_blocks):
            seq.block_table.append(self._allocate_block(evicted))
        seq.num_cached_tokens = len(hit_block_ids) * self.block_size
        self._emit_evictions(evicted)
        if self.events.active:
            self.events.emit(BlockAlloc, request_id=seq.seq_id, block_ids=tuple(seq.block_table),
                             refcounts=tuple(self.blocks[b].ref_count for b in seq.block_table), medium=self.medium)
            self.events.emit(PrefixHit, request_id=seq.seq_id, query_tokens=seq.num_tokens,
                             hit_tokens=seq.num_cached_tokens, hit_block_ids=tuple(hit_block_ids))

    def deallocate(self, seq: Sequence) -> int:
        """Release every block of ``seq``; returns how many went back to the free pool."""
        freed = 0
        # Tail blocks are released first so that, among one request's blocks, the prefix is evicted last.
        block_ids = tuple(reversed(seq.block_table))
        seq.num_cached_tokens = 0
        seq.block_table = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used_block_ids.remove(block_id)
                if self.is_cache_entry(block):
                    self.free_block_ids.append(block_id)
                else:
                    # Holds nothing reusable: hand it out before any cached block.
                    self.free_block_ids.appendleft(block_id)
                freed += 1
        if self.events.active and block_ids:
            self.events.emit(BlockFree, request_id=seq.seq_id, block_ids=block_ids,
                             refcounts=tuple(self.blocks[b].ref_count for b in block_ids), medium=self.medium)
        return freed

    def uncache(self, seq: Sequence) -> None:
        """Withdraw the prefix-cache entries of ``seq``'s blocks (their K/V cannot be trusted). The
        blocks keep their hashes, which later blocks of other requests chain from."""
        withdrawn = [(b, self.blocks[b].hash) for b in seq.block_table if self.is_cache_entry(self.blocks[b])]
        for _, hash_ in withdrawn:
            del self.hash_to_block_id[hash_]
        self._emit_evictions(withdrawn)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``), for benchmarks that rerun the
        same prompts; only while no request holds a block. Returns how many blocks were forgotten."""
        if self.used_block_ids:
            raise RuntimeError(f"{len(self.used_block_ids)} blocks are held by requests: the prefix cache can "
                               "only be reset when the engine is idle")
        forgotten = [(block_id, hash_) for hash_, block_id in self.hash_to_block_id.items()]
        self.hash_to_block_id.clear()
        for block_id, _ in forgotten:
            self.blocks[block_id].update(NO_HASH, NO_HASH, [])
        self.offload_candidates.clear()
        self._emit_evictions(forgotten)
        return len(forgotten)

    def can_append(self, seq: Sequence) -> bool:
        """Whether the token being decoded has a slot: a new block is needed when it opens one."""
        return len(self.free_block_ids) >= (len(seq) % self.block_size == 1)

    def may_append(self, seq: Sequence) -> None:
        if len(seq) % self.block_size == 1:
            evicted: list[tuple[int, int]] = []
            block_id = self._allocate_block(evicted)
            seq.block_table.append(block_id)
            self._emit_evictions(evicted)
            if self.events.active:
                self.events.emit(BlockAlloc, request_id=seq.seq_id, block_ids=(block_id,), refcounts=(1,), medium=self.medium)

    def hash_blocks(self, seq: Sequence, num_new_tokens: int) -> None:
        """Register the blocks that ``num_new_tokens`` newly computed tokens (prompt or generated)
        completed, before ``seq.num_cached_tokens`` counts them."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_cached_tokens // self.block_size
        end = (seq.num_cached_tokens + num_new_tokens) // self.block_size
        if start == end:
            return
        hashes = self._block_hashes(seq, end)
        # Runs of consecutive stored blocks, (first index, block ids): one block_stored each, so that
        # every event's hashes chain from its parent_hash.
        runs: list[tuple[int, list[int]]] = []
        write_through = self.offload_policy == "write-through"
        for i in range(start, end):
            block = self.blocks[seq.block_table[i]]
            h = hashes[i]
            block.update(h, hashes[i - 1] if i > 0 else NO_HASH, seq.block(i))
            # The first block to compute a prefix owns the cache entry; a twin computed in the same
            # step (identical prompts admitted together) keeps its hash for chaining but stays private.
            if self.hash_to_block_id.setdefault(h, block.block_id) == block.block_id:
                if runs and runs[-1][0] + len(runs[-1][1]) == i:
                    runs[-1][1].append(block.block_id)
                else:
                    runs.append((i, [block.block_id]))
                if write_through:
                    self.offload_candidates.append(
                        OffloadCandidate(block.block_id, h, block.parent_hash, block.token_ids, seq.seq_id))
        if self.events.active:
            for first, block_ids in runs:
                self.events.emit(BlockStored, request_id=seq.seq_id, block_ids=tuple(block_ids),
                                 hashes=tuple(hashes[first:first + len(block_ids)]),
                                 parent_hash=hashes[first - 1] if first > 0 else NO_HASH, medium=self.medium)
