"""The order of the waiting queue and of preemption victims: vLLM's ``--scheduling-policy``.

- ``fcfs``: arrival order (a preempted request goes back to the front); the youngest running
  request is preempted first.
- ``priority`` (vLLM's): lower ``priority`` first, ties by arrival; the running request with the
  highest priority value (the least important; the latest arrival among equals) is preempted first.
- ``lpm`` (SGLang's longest prefix match): the waiting request with the longest prefix-cache hit
  first, ties by arrival, so requests that share a cached prefix run while it is cached; past
  ``LPM_MAX_WAITING`` waiting requests the lookups cost more than they save and the order is FCFS,
  as in SGLang. Victims as FCFS.

Whatever the policy, waiting requests that already hold KV blocks (a prompt part-way through its
chunks, one whose blocks were loaded from the host tier) come first: they cannot give their blocks
back, and a request admitted before them could wait for those very blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf

from engine.sequence import Sequence

POLICIES = ("fcfs", "priority", "lpm")
# SGLang's threshold (schedule_policy.py): above it, longest-prefix-match falls back to FCFS.
LPM_MAX_WAITING = 128


def _holding_first(waiting: deque[Sequence], key: Callable[[Sequence], tuple] | None = None) -> list[Sequence]:
    """Holders of blocks, then the rest sorted by ``key`` (None: in queue order)."""
    holding = [s for s in waiting if s.block_table]
    rest = [s for s in waiting if not s.block_table]
    return holding + (rest if key is None else sorted(rest, key=key))


class SchedulingPolicy:
    """FCFS; the other policies override the two decisions."""

    name = "fcfs"

    def order(self, waiting: deque[Sequence], cached_blocks: Callable[[Sequence], int]) -> SequenceOf[Sequence]:
        """The waiting requests in the order admission considers them. ``cached_blocks`` gives a
        request's prefix-cache hit in blocks (only ``lpm`` asks)."""
        return waiting  # admitted in this order, holders of blocks stay at the queue's front

    def victim(self, running: deque[Sequence]) -> Sequence:
        """The running request to preempt when a decode finds no free block."""
        return running[-1]


class PriorityPolicy(SchedulingPolicy):
    name = "priority"

    def order(self, waiting: deque[Sequence], cached_blocks: Callable[[Sequence], int]) -> SequenceOf[Sequence]:
        return _holding_first(waiting, lambda s: (s.priority, s.arrival_time, s.seq_id))

    def victim(self, running: deque[Sequence]) -> Sequence:
        return max(running, key=lambda s: (s.priority, s.arrival_time, s.seq_id))


class LongestPrefixMatchPolicy(SchedulingPolicy):
    name = "lpm"

    def order(self, waiting: deque[Sequence], cached_blocks: Callable[[Sequence], int]) -> SequenceOf[Sequence]:
        if len(waiting) > LPM_MAX_WAITING:  # FCFS, but this queue's holders may be anywhere in it
            return _holding_first(waiting)
        return _holding_first(waiting, lambda s: (-cached_blocks(s), s.arrival_time, s.seq_id))


def make_policy(name: str) -> SchedulingPolicy:
    return {"fcfs": SchedulingPolicy, "priority": PriorityPolicy, "lpm": LongestPrefixMatchPolicy}[name]()
