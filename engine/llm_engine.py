"""The engine loop and the vLLM-compatible ``LLM`` facade.

``step()`` is one iteration of continuous batching: schedule, launch the model, postprocess. With
``async_scheduling`` (the default) a step's postprocessing waits until the next step is launched:
the host schedules and prepares step n+1 while the GPU computes step n, and the tokens of step n
reach step n+1's inputs on the GPU. With a host KV tier each step also hands the copies that landed
to the scheduler before it schedules, and the copies its decisions need to the runner before the
launch. Every decision along the way is published on ``self.events``; the engine itself never
formats, exports or stores telemetry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as SequenceOf
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Integral

import numpy as np
from tqdm.auto import tqdm

from engine.config import Config, ConfigError
from engine.detokenizer import IncrementalDetokenizer, detokenize
from engine.events import EngineStarted, EventBus, RequestRejected, Snapshot, Step
from engine.model_runner import LaunchedStep, ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejectedError, ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.tensor_parallel import TensorParallelGroup, check_parallel_config
from models.config import load_qwen3_config
from models.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# A string, or token ids: a list, a tuple or a 1-D integer numpy array.
Prompt = str | SequenceOf[int] | np.ndarray

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch
    launched: LaunchedStep
    number: int  # the engine step that launched it
    start: float  # when its scheduling began
    schedule_s: float


@contextmanager
def _interrupts_between_steps() -> Iterator[Callable[[], None]]:
    """Within: a first Ctrl-C is held until the caller calls the function this yields (between
    steps), which raises ``KeyboardInterrupt`` then; a second one raises at once. Only in the main
    thread with Python's own SIGINT handler installed (elsewhere Ctrl-C is not ours to defer)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield lambda: None
        return
    asked = False

    def on_sigint(signum: int, frame: object) -> None:
        nonlocal asked
        if asked:
            signal.signal(signal.SIGINT, signal.default_int_handler)  # even if it lands as the block exits
            raise KeyboardInterrupt
        asked = True
        # Written straight to the descriptor: a handler that logs could land inside a write to
        # stderr (tqdm's bar, a log line) and make it reentrant.
        with contextlib.suppress(OSError):
            os.write(2, b"\ninterrupted: stopping when this step ends (Ctrl-C again to stop now)\n")

    def interrupt_if_asked() -> None:
        if asked:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupt_if_asked
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class LLMEngine:
    def __init__(self, model: str, **kwargs) -> None:
        unknown = sorted(set(kwargs) - _CONFIG_FIELDS)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; valid options are {sorted(_CONFIG_FIELDS - {'model'})}")
        model_config = load_qwen3_config(model)
        config = Config(model=str(model), **kwargs)
        config.max_model_len = min(config.max_model_len, model_config.max_position_embeddings)
        if model_config.eos_token_id is not None:
            config.eos = model_config.eos_token_id
        check_parallel_config(config, model_config)
        self.config = config
        self.model_config = model_config
        self.events = EventBus()
        self.tokenizer = load_tokenizer(model)
        # Rank 0's runner either way; with tensor parallelism the group also drives the other ranks.
        self.tp_group: TensorParallelGroup | None = None
        if config.tensor_parallel_size > 1:
            self.tp_group = TensorParallelGroup(config, model_config, self.events)
            self.model_runner = self.tp_group.runner
        else:
            self.model_runner = ModelRunner(config, model_config, events=self.events)
        try:
            self.scheduler = Scheduler(config, self.events)
            self._in_flight: _InFlight | None = None
            self._last_completion = 0.0
            self.events.announce(
                EngineStarted, model=config.model, **self.model_runner.describe(),
                block_size=config.kvcache_block_size, num_blocks=config.num_kvcache_blocks,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
                enforce_eager=config.enforce_eager, tensor_parallel_size=config.tensor_parallel_size,
                gpu_memory_utilization=config.gpu_memory_utilization, num_cpu_blocks=config.num_host_kvcache_blocks,
                kv_offloading_size=config.kv_offloading_size or None, enable_cpu_offload=config.enable_cpu_offload,
                kv_offloading_policy=config.kv_offloading_policy, preemption_mode=config.preemption_mode,
                batching=config.batching, scheduling_policy=config.scheduling_policy, wall_time=time.time())
            if self.model_runner.uses_cudagraphs:
                # Every rank captures: the collectives are inside the graphs, so every rank replays.
                if self.tp_group is None:
                    self.model_runner.capture_cudagraph()
                else:
                    self.tp_group.call(ModelRunner.capture_cudagraph)
        except BaseException:
            self.close()
            raise

    # --- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the tensor-parallel workers and release the process group; idempotent, and also done
        at interpreter exit. A single-rank engine holds nothing that needs releasing."""
        if self.tp_group is not None:
            self.tp_group.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- requests -----------------------------------------------------------------------------

    def _tokens(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids, checked; raises ``RequestRejectedError`` naming what is wrong."""
        vocab = self.model_config.vocab_size
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestRejectedError(
                    f"the tokenizer gave token id(s) {bad[:5]} outside the model's vocabulary [0, {vocab}): "
                    "the tokenizer does not match the model (vocab_size in config.json)")
            return ids
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise RequestRejectedError(
                f"a prompt must be a string or a list of token ids (ints), got {type(prompt).__name__}")
        if len(prompt) == 0:
            return []  # the scheduler's check names the problem
        # numpy checks and converts in C: 256 prompts of ~600 ids take ~5 ms rather than ~20 ms of
        # Python loops before the first step can launch.
        try:
            ids = np.asarray(prompt)
        except (TypeError, ValueError, OverflowError):
            ids = None
        if ids is not None and ids.ndim == 1 and ids.dtype.kind in "iu":
            bad = ids[(ids < 0) | (ids >= vocab)].tolist()
            ids = ids.tolist()
        else:
            # Ints too large for numpy land here (as objects), and so does anything that is not an id.
            if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
                kinds = ", ".join(sorted({type(t).__name__ for t in prompt}))
                raise RequestRejectedError(
                    f"a prompt must be a string or a list of token ids (ints), got a {type(prompt).__name__} of {kinds}")
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(
                f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab}): check the tokenizer matches the model")
        return ids

    @contextmanager
    def _refusals(self, request_id: int) -> Iterator[None]:
        """Publish a refusal raised in the block as ``request_rejected``, then let it propagate."""
        try:
            yield
        except RequestRejectedError as exc:
            if self.events.active:
                self.events.emit(RequestRejected, request_id=request_id, reason=str(exc), code=exc.code)
            raise

    def _check(self, prompt: Prompt, sampling_params: object, priority: object = 0) -> list[int]:
        """Everything about a request that can be checked before it is queued; its token ids."""
        if not isinstance(priority, Integral) or isinstance(priority, bool):
            raise RequestRejectedError(f"priority must be an integer (lower is served first), got {priority!r}",
                                       "priority")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise RequestRejectedError(
                f"priority {priority} was given but the scheduling policy is {self.config.scheduling_policy}: "
                "start the engine with scheduling_policy='priority' (--scheduling-policy priority) or leave it 0",
                "priority")
        if not isinstance(sampling_params, SamplingParams):
            raise RequestRejectedError(
                f"sampling params must be a SamplingParams, got {type(sampling_params).__name__}: "
                "build them with SamplingParams(temperature=..., max_tokens=...)")
        vocab = self.model_config.vocab_size
        bad = [t for t in sampling_params.stop_token_ids if t >= vocab]
        if bad:
            raise RequestRejectedError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})",
                                       "stop_token_ids")
        token_ids = self._tokens(prompt)
        self.scheduler.check(len(token_ids), sampling_params.max_tokens)
        return token_ids

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, *, client_id: str | None = None,
                    trace_headers: Mapping[str, str] | None = None, priority: int = 0) -> int:
        """Queue a request and return its id. A request that can never be served, or one that finds
        the waiting queue full, raises ``RequestRejectedError`` (a ``ValueError``; ``QueueFullError``
        for the latter) and leaves the engine as it was. ``priority`` (lower first) needs the
        ``priority`` scheduling policy, as in vLLM.

        ``client_id`` (what the caller calls the request) and ``trace_headers`` (W3C
        ``traceparent``/``tracestate``, as vLLM's) only travel in the ``request_arrived`` event, for
        the consumers: a trace span then names the request and joins the caller's trace."""
        request_id = next(Sequence.counter)
        with self._refusals(request_id):
            sampling_params = SamplingParams() if sampling_params is None else sampling_params
            token_ids = self._check(prompt, sampling_params, priority)
            self.scheduler.check_capacity()
        headers = trace_headers or {}
        self._queue(request_id, token_ids, sampling_params, arrival_time, priority, client_id=client_id,
                    traceparent=headers.get("traceparent"), tracestate=headers.get("tracestate"))
        return request_id

    def _queue(self, request_id: int, token_ids: list[int], sampling_params: SamplingParams,
               arrival_time: float | None, priority: int, **metadata: str | None) -> None:
        """Queue checked token ids."""
        detokenizer = None
        if sampling_params.stop:
            detokenizer = IncrementalDetokenizer(self.tokenizer, sampling_params)
        seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size,
                       time.perf_counter() if arrival_time is None else arrival_time, seq_id=request_id,
                       detokenizer=detokenizer, priority=priority)
        self.scheduler.add(seq, **metadata)

    def snapshot(self) -> Snapshot:
        """The engine's requests and blocks as they stand, for a consumer that joins now; call it
        between steps, after ``events.publish()``, so that the events to come apply on top of it."""
        return self.scheduler.snapshot()

    def abort_request(self, request_id: int) -> bool:
        """Stop a request wherever it is; False when it is unknown or already finished."""
        return self.scheduler.abort(request_id) is not None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, in both tiers, so that a rerun of the same prompts computes them
        again (no request may be in the engine); returns how many blocks were forgotten."""
        if not self.is_finished():
            raise RuntimeError("requests are still in the engine: reset the prefix cache when it is idle")
        offload = self.model_runner.offload
        if offload is None:
            return self.scheduler.block_manager.reset_prefix_cache()
        with self.events.held():
            self.scheduler.complete_transfers(offload.drain())  # copies of aborted requests may be in flight
            forgotten = self.scheduler.block_manager.reset_prefix_cache() + self.scheduler.host_tier.reset()
        self.events.publish()
        return forgotten

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    # --- the loop -----------------------------------------------------------------------------

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """One engine iteration. Returns the requests that finished as ``(request_id, token_ids)``
        and the number of tokens launched: positive for a prefill or mixed step, minus the batch size
        for a decode.

        With asynchronous scheduling a step's results are read in the next call, after that call
        has launched its own step; a step that launches nothing collects what is in flight.

        The bus is held during the step: its events reach batch subscribers when the step waits for
        the GPU (or at the end, when nothing is left in flight to wait for)."""
        with self.events.held():
            try:
                return self._step()
            finally:
                if self._in_flight is None:
                    self.events.publish()

    def _step(self) -> tuple[list[tuple[int, list[int]]], int]:
        start = time.perf_counter()
        self.events.step += 1
        offload = self.model_runner.offload
        if offload is not None:
            self.scheduler.complete_transfers(offload.poll())
        batch = self.scheduler.schedule()
        if offload is not None:
            # Before the launch: a store's gather must precede the step that may reuse its blocks.
            offload.submit(self.scheduler.take_transfers())
        schedule_s = time.perf_counter() - start
        previous, self._in_flight = self._in_flight, None
        if batch:
            try:
                launched = self._launch(batch)
            except BaseException:
                self._in_flight = previous  # still to be collected
                raise
            # In flight before the previous step is collected: if collecting raises, this one is
            # still collected (or failed) later.
            self._in_flight = _InFlight(batch, launched, self.events.step, start, schedule_s)
        finished = self._complete(previous) if previous is not None else []
        if self._in_flight is not None and not self.config.async_scheduling:
            current, self._in_flight = self._in_flight, None
            finished += self._complete(current)
        outputs = self._retire(finished)
        if not batch:
            if previous is None and offload is not None and not self.scheduler.is_finished():
                offload.wait()  # nothing to compute until a copy lands
            return outputs, 0
        return outputs, sum(batch.num_tokens) if batch.phase != "decode" else -len(batch.seqs)

    @staticmethod
    def _retire(finished: list[Sequence]) -> list[tuple[int, list[int]]]:
        return [(seq.seq_id, seq.completion_token_ids) for seq in finished]

    def drain(self) -> list[tuple[int, list[int]]]:
        """Collect the step in flight, if any: afterwards every launched step has landed (for
        single-stepping, and before handing the engine over). Returns the requests it finished."""
        step, self._in_flight = self._in_flight, None
        try:
            return self._retire(self._complete(step) if step is not None else [])
        finally:
            self.events.publish()

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        try:
            if self.tp_group is None:
                launched = self.model_runner.launch(batch.seqs, batch.phase)
            else:
                launched = self.tp_group.call(ModelRunner.launch, batch.seqs, batch.phase)
        except Exception:
            self._fail(batch)
            raise
        self.scheduler.expect_tokens(batch)
        return launched

    def _complete(self, step: _InFlight) -> list[Sequence]:
        """Wait for a launched step's tokens and postprocess them; returns the requests it finished."""
        # The consumers' threads take this step's events while this thread waits without the GIL.
        self.events.publish()
        try:
            token_ids = step.launched.token_ids()
            if self.tp_group is not None:
                self.tp_group.raise_if_failed()
        except Exception:
            self._fail(step.batch)
            raise
        # What a step's results cause (tokens, finishes, freed blocks, its Step event) is stamped
        # with that step's number, also when it lands during the next step.
        now_stepping, self.events.step = self.events.step, step.number
        try:
            return self._postprocess(step, token_ids)
        finally:
            self.events.step = now_stepping

    def _postprocess(self, step: _InFlight, token_ids: list[int]) -> list[Sequence]:
        t = time.perf_counter()
        scheduler = self.scheduler
        finished = scheduler.postprocess(step.batch, token_ids)
        end = time.perf_counter()
        if self.events.active:
            batch, launched = step.batch, step.launched
            self.events.emit(
                Step, phase=batch.phase, num_seqs=len(batch.seqs), num_prefill_tokens=batch.num_prefill_tokens,
                num_decode_tokens=batch.prefill.count(False),
                duration_s=end - max(step.start, self._last_completion), schedule_s=step.schedule_s,
                prepare_s=launched.prepare_s, launch_s=launched.launch_s, wait_s=launched.wait_s,
                postprocess_s=end - t, padded_batch_size=launched.padded_batch_size,
                waiting=len(scheduler.waiting) + len(scheduler.loading), running=len(scheduler.running),
                free_blocks=scheduler.block_manager.num_free_blocks, loading=len(scheduler.loading),
                free_cpu_blocks=scheduler.free_cpu_blocks, waiting_by_reason=scheduler.waiting_by_reason())
        self._last_completion = end
        return finished

    def _fail(self, batch: ScheduledBatch) -> None:
        # The batch is lost, the engine is not (unless its tensor-parallel ranks fell out of step,
        # which the group reports on every later call): fail these requests and free their blocks.
        for seq in batch.seqs:
            self.scheduler.fail(seq)

    def generate(self, prompts: Prompt | SequenceOf[Prompt],
                 sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: SequenceOf[int] | None = None) -> list[dict]:
        """Run prompts to completion; results in prompt order as ``{"text", "token_ids"}``. A single
        string or list of token ids is one prompt, as in vLLM; ``priority`` is one per prompt, as
        vLLM's (the ``priority`` scheduling policy only).

        Every prompt is checked before any is queued, so a bad one raises (and emits
        ``request_rejected``) without side effects. Beyond ``max_waiting_requests`` prompts wait
        here and join the queue as it drains. Interrupted (Ctrl-C) or failed, it aborts what it
        started and leaves the engine idle; a Ctrl-C lands when the step under way ends, since a step
        cut halfway leaves the host tier's copies issued but not booked (a second Ctrl-C stops at once,
        and with a host tier may leave it so: build a new engine then)."""
        if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], Integral)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams: give one, or one per prompt")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities: give one per prompt")
        request_ids = [next(Sequence.counter) for _ in prompts]
        token_lists = []
        for i, (request_id, prompt, sp, prio) in enumerate(zip(request_ids, prompts, params, priorities)):
            try:
                with self._refusals(request_id):
                    token_lists.append(self._check(prompt, sp, prio))  # tokenised and checked once, here
            except RequestRejectedError as exc:
                raise type(exc)(f"prompt {i}: {exc}", exc.param) from None
        unqueued = deque(zip(request_ids, token_lists, params, priorities))
        params_of = dict(zip(request_ids, params))
        results: dict[int, dict] = {}
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            with _interrupts_between_steps() as interrupt_if_asked:
                while len(results) < len(request_ids):
                    interrupt_if_asked()
                    self._queue_until_full(unqueued)
                    t = time.perf_counter()
                    outputs, num_tokens = self.step()
                    dt = max(time.perf_counter() - t, 1e-9)
                    if num_tokens > 0:
                        prefill_tps = num_tokens / dt
                    elif num_tokens < 0:
                        decode_tps = -num_tokens / dt
                    bar.set_postfix(prefill=f"{prefill_tps:.0f}tok/s", decode=f"{decode_tps:.0f}tok/s", refresh=False)
                    for request_id, token_ids in outputs:
                        # Detokenised as it finishes, while the GPU computes the step in flight: all at
                        # the end, ~134k tokens of the yardstick kept the GPU idle for ~60 ms.
                        text = detokenize(self.tokenizer, token_ids, params_of[request_id])
                        results[request_id] = {"text": text, "token_ids": token_ids}
                        bar.update(1)
                interrupt_if_asked()  # the last step ended the work, but the caller asked to stop
        except BaseException:
            self._abandon([r for r in request_ids if r not in results])
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]

    def _queue_until_full(self, unqueued: deque[tuple[int, list[int], SamplingParams, int]]) -> None:
        """Move checked requests into the waiting queue while it has room."""
        if not unqueued:
            return  # the common case once everything is queued: nothing to do on this step
        limit = self.config.max_waiting_requests
        room = len(unqueued) if limit is None else limit - len(self.scheduler.waiting)
        with self.events.held():  # the arrivals publish with the next step, not one by one
            for _ in range(min(room, len(unqueued))):
                request_id, token_ids, sp, priority = unqueued.popleft()
                self._queue(request_id, token_ids, sp, None, priority)

    def _abandon(self, request_ids: list[int]) -> None:
        """After an interrupt or an engine error: abort ``request_ids`` (freeing their blocks) and
        land the step in flight, so that the engine is idle and serves the next call."""
        for request_id in request_ids:
            self.abort_request(request_id)
        try:
            self.drain()
        except Exception:  # the error that brought us here is already on its way to the caller
            logger.exception("collecting the step in flight failed while abandoning requests")


class LLM(LLMEngine):
    """``LLM(model_dir, **config)``: see ``engine.config.Config`` for the options."""
