"""How long KV blocks live, from the block events: vLLM's residency metrics (``--kv-cache-metrics``).

A sampled share of block allocations (vLLM's ``--kv-cache-metrics-sample``, default 1%) starts a
*life*: born when the pool hands the block out for new data, touched whenever a prefix hit reuses
it, ended when the pool hands it out again (vLLM counts that as the eviction, whether or not the
block was a cache entry). An ended life gives its lifetime, the time it sat idle since its last
touch (or its birth), and the gaps between its last four touches, as vLLM's collector gives them.

glassbox's events tell a fresh allocation from a hit without asking the engine: a block allocated
while free and no longer a cache entry (``block_evict`` came first, or it never was one) holds new
data; one allocated while in use, or while still a cache entry, was a hit. Only the prefix cache's
blocks count: the GPU pool's (``medium == "GPU"``), as in vLLM, or in CPU-offload mode the host
pool's, where every block lives.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.events import BlockAlloc, BlockEvict, BlockFree, BlockStored, EngineStarted

# vLLM's buckets for all three histograms (seconds).
RESIDENCY_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
                     1200, 1800]  # fmt: skip
DEFAULT_SAMPLE = 0.01


@dataclass(slots=True)
class _Life:
    born: float
    touches: deque[float] = field(default_factory=lambda: deque(maxlen=4))


@dataclass(frozen=True, slots=True)
class Eviction:
    lifetime: float
    idle: float
    reuse_gaps: tuple[float, ...]


class KVResidency:
    """Feed it block events in order; ``on_eviction`` gets each sampled life that ended."""

    def __init__(self, on_eviction: Callable[[Eviction], None], sample: float = DEFAULT_SAMPLE, seed: int = 0) -> None:
        if not 0 < sample <= 1:
            raise ValueError(f"the KV cache metrics sample must be in (0, 1], got {sample}")
        self.sample = sample
        self._on_eviction = on_eviction
        self._random = random.Random(seed)
        self._enabled = True
        self._medium = "GPU"  # the prefix cache's blocks: host memory's in CPU-offload mode
        self._refcounts: list[int] = []
        self._cached: list[bool] = []
        self._lives: dict[int, _Life] = {}

    def started(self, e: EngineStarted) -> None:
        # vLLM records these only with prefix caching on: without it no block is ever touched.
        self._enabled = e.enable_prefix_caching
        self._medium = "CPU" if e.enable_cpu_offload else "GPU"
        num_blocks = e.num_cpu_blocks if e.enable_cpu_offload else e.num_blocks
        self._refcounts = [0] * num_blocks
        self._cached = [False] * num_blocks
        self._lives.clear()

    def alloc(self, e: BlockAlloc) -> None:
        if not self._enabled or e.medium != self._medium:
            return
        for block_id, refcount in zip(e.block_ids, e.refcounts):
            if not 0 <= block_id < len(self._refcounts):
                continue
            if self._refcounts[block_id] == 0 and not self._cached[block_id]:
                self._reused(block_id, e.t)
            else:
                life = self._lives.get(block_id)
                if life is not None:
                    life.touches.append(e.t)
            self._refcounts[block_id] = refcount

    def free(self, e: BlockFree) -> None:
        if e.medium != self._medium:
            return
        for block_id, refcount in zip(e.block_ids, e.refcounts):
            if 0 <= block_id < len(self._refcounts):
                self._refcounts[block_id] = refcount

    def stored(self, e: BlockStored) -> None:
        if e.medium != self._medium:
            return
        for block_id in e.block_ids:
            if 0 <= block_id < len(self._cached):
                self._cached[block_id] = True

    def evicted(self, e: BlockEvict) -> None:
        if e.medium == self._medium and 0 <= e.block_id < len(self._cached):
            self._cached[e.block_id] = False

    def _reused(self, block_id: int, t: float) -> None:
        """The pool handed ``block_id`` out for new data: its sampled life, if any, ends; a new one
        may begin."""
        life = self._lives.pop(block_id, None)
        if life is not None:
            touches = list(life.touches)
            gaps = tuple(b - a for a, b in zip(touches, touches[1:]))
            self._on_eviction(Eviction(t - life.born, t - (touches[-1] if touches else life.born), gaps))
        if self._random.random() < self.sample:
            self._lives[block_id] = _Life(t)
