"""Seeded synthetic workloads: requests that arrive over time.

Each workload is an iterator of ``Request`` (arrival offset in seconds from the start, prompt token
ids, sampling parameters); open-ended ones are infinite and the consumer stops when it likes. The
same name, parameters and seed always give the same requests.

| name | what it exercises | parameters |
|---|---|---|
| ``bench`` | nano-vllm's bench.py exactly: 256 requests at t=0, prompts U[100,1024] of ids U[0,10000], outputs U[100,1024], temperature 0.6, ignore_eos | ``num_requests`` |
| ``poisson`` | steady load: exponential gaps at ``rate`` req/s | ``rate``, ``prompt_len``, ``output_len`` |
| ``bursty`` | gamma-distributed gaps (vLLM's ``--burstiness``: 1 is Poisson, lower is burstier) | ``rate``, ``burstiness``, ``prompt_len``, ``output_len`` |
| ``shared-prefix`` | ``num_prefixes`` system prompts shared by many requests: prefix-cache food | ``rate``, ``num_prefixes``, ``prefix_len``, ``suffix_len``, ``output_len`` |
| ``multi-turn`` | conversations whose next turn is the previous prompt + the model's answer + a new message | ``rate``, ``turns``, ``message_len``, ``output_len``, ``think_time`` |
| ``mixed`` | the dashboard's default blend: shared prefixes, a long prompt now and then (chunked prefill), long ``ignore_eos`` answers that fill a small pool (preemption, eviction), wildly different output lengths | ``rate`` |

Lengths are ``(low, high)`` inclusive ranges drawn uniformly. Token ids are drawn below the model's
vocabulary (``vocab_size``); ``bench`` draws its ids exactly as nano-vllm does and folds them into a
smaller vocabulary only when the model's is smaller than 10,001 (the tiny preset).

A workload's own rate suits one machine only. ``ArrivalPacer`` fits it to the engine that serves it:
it compares the work the engine serves per busy second with the work the workload offers per
second of its clock, and says how fast that clock should run so that arrivals sit just above
capacity and the waiting queue stays short (see its docstring).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.sampling_params import SamplingParams

Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Request:
    arrival_time: float  # seconds after the workload starts
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    tag: str = ""  # which part of a workload this request belongs to (for tables and the TUI)
    priority: int = 0  # lower first, under the priority scheduling policy
    # Multi-turn: given this request's output tokens, the follow-up turn (arrival relative to the
    # moment this one finished).
    next_turn: Callable[[list[int]], Request | None] | None = None


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _gaps(rng: random.Random, rate: float, burstiness: float = 1.0) -> Iterator[float]:
    """Inter-arrival gaps with mean 1/rate: gamma(shape=burstiness, scale=1/(rate*burstiness))."""
    if rate <= 0:
        raise ValueError(f"rate={rate} is invalid: must be > 0 requests per second")
    if burstiness <= 0:
        raise ValueError(f"burstiness={burstiness} is invalid: must be > 0 (1 is Poisson)")
    while True:
        yield rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def bench(vocab_size: int = 151_936, seed: int = 0, num_requests: int = 256) -> Iterator[Request]:
    rng = random.Random(seed)
    # Drawn in nano-vllm's order: all prompts first, then all output lengths, from one stream.
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_requests)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(100, 1024))
              for _ in range(num_requests)]
    for prompt, sp in zip(prompts, params):
        if vocab_size <= 10000:
            prompt = [t % vocab_size for t in prompt]
        yield Request(0.0, prompt, sp, tag="bench")


def poisson(vocab_size: int, seed: int = 0, rate: float = 4.0, prompt_len: Range = (32, 512),
            output_len: Range = (16, 256), temperature: float = 0.8) -> Iterator[Request]:
    return bursty(vocab_size, seed, rate, 1.0, prompt_len, output_len, temperature, tag="poisson")


def bursty(vocab_size: int, seed: int = 0, rate: float = 4.0, burstiness: float = 0.25,
           prompt_len: Range = (32, 512), output_len: Range = (16, 256), temperature: float = 0.8,
           tag: str = "bursty") -> Iterator[Request]:
    rng = random.Random(seed)
    t = 0.0
    for gap in _gaps(rng, rate, burstiness):
        t += gap
        yield Request(t, _tokens(rng, rng.randint(*prompt_len), vocab_size),
                      SamplingParams(temperature=temperature, max_tokens=rng.randint(*output_len)), tag=tag)


def shared_prefix(vocab_size: int, seed: int = 0, rate: float = 4.0, num_prefixes: int = 4,
                  prefix_len: Range = (128, 384), suffix_len: Range = (8, 64), output_len: Range = (8, 128),
                  temperature: float = 0.8) -> Iterator[Request]:
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(*prefix_len), vocab_size) for _ in range(num_prefixes)]
    t = 0.0
    for gap in _gaps(rng, rate):
        t += gap
        i = rng.randrange(num_prefixes)
        prompt = prefixes[i] + _tokens(rng, rng.randint(*suffix_len), vocab_size)
        yield Request(t, prompt, SamplingParams(temperature=temperature, max_tokens=rng.randint(*output_len)),
                      tag=f"prefix-{i}")


def multi_turn(vocab_size: int, seed: int = 0, rate: float = 1.0, turns: int = 4, message_len: Range = (16, 96),
               output_len: Range = (16, 96), think_time: float = 0.5, temperature: float = 0.8) -> Iterator[Request]:
    rng = random.Random(seed)

    def turn(conversation: int, k: int, history: list[int], arrival: float) -> Request:
        prompt = history + _tokens(rng, rng.randint(*message_len), vocab_size)

        def follow_up(answer: list[int]) -> Request | None:
            if k + 1 >= turns:
                return None
            return turn(conversation, k + 1, prompt + answer, rng.expovariate(1.0 / think_time))

        return Request(arrival, prompt, SamplingParams(temperature=temperature, max_tokens=rng.randint(*output_len)),
                       tag=f"conversation-{conversation}", next_turn=follow_up)

    t = 0.0
    for conversation, gap in enumerate(_gaps(rng, rate)):
        t += gap
        yield turn(conversation, 0, [], t)


def mixed(vocab_size: int, seed: int = 0, rate: float = 6.0) -> Iterator[Request]:
    """Every mechanism within seconds on a small pool (the dashboard's defaults: 16-token blocks,
    a few hundred of them, a budget of a few hundred tokens)."""
    rng = random.Random(seed)
    prefixes = [_tokens(rng, rng.randint(96, 200), vocab_size) for _ in range(3)]
    t = 0.0
    for gap in _gaps(rng, rate, burstiness=0.5):
        t += gap
        roll = rng.random()
        if roll < 0.45:  # a chat with a shared system prompt: prefix hits
            i = rng.randrange(len(prefixes))
            prompt = prefixes[i] + _tokens(rng, rng.randint(4, 48), vocab_size)
            sp = SamplingParams(temperature=0.8, max_tokens=rng.choice([4, 16, 48, 160]))
            tag = f"prefix-{i}"
        elif roll < 0.55:  # a document to summarise: longer than the budget, so chunked
            prompt = _tokens(rng, rng.randint(600, 1100), vocab_size)
            sp = SamplingParams(temperature=0.8, max_tokens=rng.randint(8, 64))
            tag = "long-prompt"
        elif roll < 0.75:  # a long generation that never stops early: fills the pool, preempts
            prompt = _tokens(rng, rng.randint(16, 96), vocab_size)
            sp = SamplingParams(temperature=0.8, max_tokens=rng.randint(300, 700), ignore_eos=True)
            tag = "long-output"
        else:  # short questions with very different answer lengths
            prompt = _tokens(rng, rng.randint(8, 128), vocab_size)
            sp = SamplingParams(temperature=0.8, max_tokens=rng.choice([1, 8, 32, 96, 256]))
            tag = "short"
        yield Request(t, prompt, sp, tag=tag)


class ArrivalPacer:
    """How fast a workload's clock should run (a multiple of real time) to keep the engine just busy.

    Work is counted in tokens: a request offers ``len(prompt) + max_tokens``, a step serves the
    tokens it computes. Capacity ``S`` is the engine's served tokens per *busy* second (an
    exponential average over ``window_s`` of busy time; idle time would make a fast engine look
    slow), the offered rate ``W`` is the work per workload-clock second of the last ``horizon``
    arrivals. ``S / W`` workload seconds per second would offer exactly what the engine serves;
    the pace is that times a queue term ``1 + headroom * (1 - waiting / target_waiting)``: above
    capacity (×1.25) while the queue is empty, so an idle engine is driven until it saturates (the
    busy-second rate of small batches understates what large ones serve), balanced at
    ``target_waiting``, and zero at ``target_waiting * (1 + 1 / headroom)`` waiting: arrivals stop
    until the queue drains, whatever the estimates got wrong (cache hits, recomputation after
    preemption and early stops make tokens an approximate measure of work).

    Called on the thread that drives the engine; ``pace`` is a float another thread may read.
    """

    def __init__(self, target_waiting: int = 8, headroom: float = 0.25, window_s: float = 5.0,
                 horizon: int = 64, min_arrivals: int = 8, sample_s: float = 0.25) -> None:
        self.target_waiting = target_waiting
        self.headroom = headroom
        self.window_s = window_s
        self.min_arrivals = min_arrivals
        self.sample_s = sample_s
        self.pace: float | None = None  # None until both rates are known: run at the workload's own
        self.capacity: float | None = None  # served tokens per busy second
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=horizon)
        self._offered: float | None = None  # work per workload-clock second, from the arrivals
        self._busy = 0.0
        self._tokens = 0
        self._waiting = 0

    @property
    def max_waiting(self) -> float:
        """The queue length at which arrivals stop."""
        return self.target_waiting * (1 + 1 / self.headroom)

    def offered(self, at: float, request: Request) -> None:
        """``request`` arrived at ``at`` seconds of the workload clock (in order of ``at``)."""
        self._arrivals.append((at, len(request.prompt_token_ids) + request.sampling_params.max_tokens))
        self._offered = self._offered_rate()
        self._update()

    def forget_arrivals(self) -> None:
        """A different workload starts: its rate has nothing to do with the last one's."""
        self._arrivals.clear()
        self._offered = None
        self._update()

    def served(self, busy_s: float, tokens: int, waiting: int) -> None:
        """A step took ``busy_s`` seconds, computed ``tokens`` tokens and left ``waiting`` queued."""
        self._busy += busy_s
        self._tokens += tokens
        self._waiting = waiting
        if self._busy >= self.sample_s:
            rate = self._tokens / self._busy
            weight = 1 - math.exp(-self._busy / self.window_s)
            self.capacity = rate if self.capacity is None else self.capacity + weight * (rate - self.capacity)
            self._busy, self._tokens = 0.0, 0
        self._update()

    def _offered_rate(self) -> float | None:
        if len(self._arrivals) < self.min_arrivals:
            return None
        span = self._arrivals[-1][0] - self._arrivals[0][0]
        if span <= 0:
            return None  # all at once (bench): there is no rate to fit
        return sum(work for _, work in itertools.islice(self._arrivals, 1, None)) / span

    def _update(self) -> None:
        if self._offered is None or self.capacity is None:
            self.pace = None
            return
        queue_term = max(0.0, 1 + self.headroom * (1 - self._waiting / self.target_waiting))
        self.pace = self.capacity * queue_term / self._offered


WORKLOADS: dict[str, Callable[..., Iterator[Request]]] = {
    "bench": bench,
    "poisson": poisson,
    "bursty": bursty,
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "mixed": mixed,
}


def make_workload(name: str, vocab_size: int, seed: int = 0, **params) -> Iterator[Request]:
    """The workload ``name`` for a model with ``vocab_size`` tokens; unknown names are a clear error."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
    return WORKLOADS[name](vocab_size, seed=seed, **params)
