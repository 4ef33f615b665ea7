"""A request's state as it moves WAITING -> RUNNING -> FINISHED (and back to WAITING when preempted).

With a host KV tier a request may also wait for its K/V to be copied in (WAITING_FOR_REMOTE_KVS, as
vLLM's) between WAITING and RUNNING.
"""

from __future__ import annotations

from enum import Enum, auto
from itertools import count
from typing import TYPE_CHECKING

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.host_tier import SwapEntry

# Stands for a token that a launched step is sampling but whose id has not reached the host yet
# (see ``Scheduler.expect_tokens``); never a real token id.
PLACEHOLDER = -1


class SequenceStatus(Enum):
    WAITING = auto()
    WAITING_FOR_REMOTE_KVS = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids plus the bookkeeping the scheduler, block manager and telemetry need.

    ``num_cached_tokens`` counts tokens whose K/V are in the cache or being written there by a launched
    step ahead of any that reads them (prefix hits, launched prefill chunks, landed decode tokens);
    ``num_scheduled_tokens`` is how many this step computes. While a step is in flight its sampled
    token is a ``PLACEHOLDER`` at the end of ``token_ids``, counted in ``num_tokens``, until
    ``set_token`` fills it in. Times are ``time.perf_counter()`` seconds.
    """

    counter = count()

    __slots__ = (
        "seq_id", "status", "token_ids", "last_token", "num_tokens", "num_prompt_tokens",
        "num_cached_tokens", "num_scheduled_tokens", "is_prefill", "block_table", "block_hashes", "block_size",
        "temperature", "max_tokens", "ignore_eos", "params", "plain_sampling", "stop_token_ids",
        "detokenizer", "stop_reason",
        "arrival_time", "first_scheduled_time", "first_token_time", "last_token_time",
        "num_preemptions", "num_prompt_cached_tokens", "num_prompt_host_tokens", "finish_reason",
        "load_job", "loaded", "swapped", "priority", "prefilled", "waiting_reason",
    )

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 arrival_time: float, seq_id: int | None = None,
                 detokenizer: IncrementalDetokenizer | None = None, priority: int = 0) -> None:
        self.seq_id = next(Sequence.counter) if seq_id is None else seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.last_token = self.token_ids[-1]
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = self.num_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0
        self.is_prefill = True
        self.block_table: list[int] = []
        # The chained hash of each full block of known tokens, computed once (vLLM's
        # ``request.block_hashes``): admission attempts and re-admissions look them up, never rehash.
        self.block_hashes: list[int] = []
        self.block_size = block_size
        self.temperature = float(sampling_params.temperature)
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.params = sampling_params
        self.plain_sampling = sampling_params.plain  # read per step by the model runner
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        # Only a request with stop strings has one: the engine decodes no other request's text.
        self.detokenizer = detokenizer
        self.stop_reason: str | int | None = None  # the stop string or stop token id that finished it
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_preemptions = 0
        # Prompt tokens not computed at the first admission (vLLM's cached_tokens): GPU prefix hits
        # and, of those, ``num_prompt_host_tokens`` loaded from the host tier.
        self.num_prompt_cached_tokens = 0
        self.num_prompt_host_tokens = 0
        self.finish_reason: str | None = None
        self.load_job: int | None = None  # the host-tier copy it waits for (WAITING_FOR_REMOTE_KVS)
        self.loaded = False  # that copy landed and the rest of its prompt is not scheduled yet
        self.swapped: SwapEntry | None = None  # where its K/V went when it was preempted by swap
        self.priority = priority  # lower first, under the priority policy
        # Every token before its last has been scheduled: it decodes from now on (a prompt chunked
        # under mixed batching runs before it is).
        self.prefilled = False
        self.waiting_reason: str | None = None  # why it was not admitted at the last schedule

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.last_token = token_id
        self.num_tokens += 1

    def set_token(self, index: int, token_id: int) -> None:
        """Fill in the placeholder at ``index`` with the token that was sampled for it."""
        self.token_ids[index] = token_id
        if index == self.num_tokens - 1:
            self.last_token = token_id

    def truncate(self, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens: drops placeholders a finished request will not need."""
        del self.token_ids[num_tokens:]
        self.num_tokens = len(self.token_ids)
        self.last_token = self.token_ids[-1]

    @property
    def num_known_tokens(self) -> int:
        """Tokens up to the first placeholder."""
        n = self.num_tokens
        while self.token_ids[n - 1] == PLACEHOLDER:
            n -= 1
        return n

    # Worker processes only need what the forward pass reads; a decode step ships the last token
    # instead of the whole history, which keeps tensor-parallel calls small.
    def __getstate__(self) -> tuple:
        tokens = self.token_ids if self.is_prefill else self.last_token
        return (self.seq_id, self.num_tokens, self.num_prompt_tokens, self.num_cached_tokens,
                self.num_scheduled_tokens, self.is_prefill, self.block_table, self.block_size,
                self.temperature, tokens)

    def __setstate__(self, state: tuple) -> None:
        (self.seq_id, self.num_tokens, self.num_prompt_tokens, self.num_cached_tokens,
         self.num_scheduled_tokens, self.is_prefill, self.block_table, self.block_size,
         self.temperature, tokens) = state
        if self.is_prefill:
            self.token_ids = tokens
            self.last_token = tokens[-1]
        else:
            self.token_ids = []
            self.last_token = tokens
