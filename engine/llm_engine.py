"""The engine loop and the vLLM-compatible ``LLM`` facade.

``step()`` is one iteration of continuous batching: schedule, launch the model, postprocess. With
``async_scheduling`` (the default) a step's postprocessing waits until the next step is launched:
the host schedules and prepares step n+1 while the GPU computes step n, and the tokens of step n
reach step n+1's inputs on the GPU. Every decision along the way is published on
``self.events``; the engine itself never formats, exports or stores telemetry.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from engine.config import Config, ConfigError
from engine.events import EngineStarted, EventBus, RequestArrived, RequestRejected, Step
from engine.model_runner import LaunchedStep, ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejectedError, ScheduledBatch, Scheduler
from engine.sequence import Sequence
from engine.tensor_parallel import TensorParallelGroup, check_parallel_config
from models.config import load_qwen3_config

Prompt = str | list[int]

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


@dataclass(slots=True)
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch
    launched: LaunchedStep
    number: int  # the engine step that launched it
    start: float  # when its scheduling began
    schedule_s: float


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
        self.tokenizer = _load_tokenizer(model)
        # Rank 0's runner either way; with tensor parallelism the group also drives the other ranks.
        self.tp_group: TensorParallelGroup | None = None
        if config.tensor_parallel_size > 1:
            self.tp_group = TensorParallelGroup(config, model_config, self.events)
            self.model_runner = self.tp_group.runner
        else:
            self.model_runner = ModelRunner(config, model_config, events=self.events)
        try:
            self.scheduler = Scheduler(config, self.events)
            self._seqs: dict[int, Sequence] = {}
            self._in_flight: _InFlight | None = None
            self._last_completion = 0.0
            self.events.announce(
                EngineStarted, model=config.model, **self.model_runner.describe(),
                block_size=config.kvcache_block_size, num_blocks=config.num_kvcache_blocks,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
                enforce_eager=config.enforce_eager, tensor_parallel_size=config.tensor_parallel_size,
                wall_time=time.time())
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
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise RequestRejectedError(
                f"a prompt must be a string or a list of token ids (ints), got {type(prompt).__name__}")
        if not prompt:
            return []  # the scheduler's check names the problem
        # numpy checks and converts in C: 256 prompts of ~600 ids take ~5 ms rather than ~20 ms of
        # Python loops before the first step can launch.
        try:
            ids = np.asarray(prompt)
        except (TypeError, ValueError, OverflowError):
            ids = None
        if ids is None or ids.ndim != 1 or ids.dtype.kind not in "iu":
            kinds = ", ".join(sorted({type(t).__name__ for t in prompt}))
            raise RequestRejectedError(
                f"a prompt must be a string or a list of token ids (ints), got a {type(prompt).__name__} of {kinds}")
        vocab = self.model_config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = ids[(ids < 0) | (ids >= vocab)].tolist()
            raise RequestRejectedError(
                f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab}): check the tokenizer matches the model")
        return ids.tolist()

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        """Queue a request and return its id; a request that can never be served raises
        ``RequestRejectedError`` (a ``ValueError``) and leaves the engine as it was."""
        sampling_params = sampling_params or SamplingParams()
        request_id = next(Sequence.counter)
        try:
            token_ids = self._tokens(prompt)
            self.scheduler.check(len(token_ids), sampling_params.max_tokens)
        except RequestRejectedError as exc:
            if self.events.active:
                self.events.emit(RequestRejected, request_id=request_id, reason=str(exc))
            raise
        return self._queue(request_id, token_ids, sampling_params, arrival_time)

    def _queue(self, request_id: int, token_ids: list[int], sampling_params: SamplingParams,
               arrival_time: float | None) -> int:
        """Queue checked token ids."""
        seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size,
                       time.perf_counter() if arrival_time is None else arrival_time, seq_id=request_id)
        if self.events.active:
            self.events.emit(RequestArrived, request_id=request_id, prompt_tokens=len(token_ids),
                             max_tokens=sampling_params.max_tokens, temperature=seq.temperature,
                             arrival=seq.arrival_time)
        self.scheduler.add(seq)
        self._seqs[request_id] = seq
        return request_id

    def abort_request(self, request_id: int) -> bool:
        """Stop a request wherever it is; False when it is unknown or already finished."""
        seq = self.scheduler.abort(request_id)
        self._seqs.pop(request_id, None)
        return seq is not None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, so that a rerun of the same prompts computes them again (no
        request may be in the engine); returns how many blocks were forgotten."""
        if not self.is_finished():
            raise RuntimeError("requests are still in the engine: reset the prefix cache when it is idle")
        return self.scheduler.block_manager.reset_prefix_cache()

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    # --- the loop -----------------------------------------------------------------------------

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """One engine iteration. Returns the requests that finished as ``(request_id, token_ids)``
        and the number of tokens launched: positive for a prefill, minus the batch size for a decode.

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
        batch = self.scheduler.schedule()
        schedule_s = time.perf_counter() - start
        previous, self._in_flight = self._in_flight, None
        if batch:
            try:
                launched = self._launch(batch)
            except Exception:
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
            return outputs, 0
        return outputs, sum(batch.num_tokens) if batch.is_prefill else -len(batch.seqs)

    def _retire(self, finished: list[Sequence]) -> list[tuple[int, list[int]]]:
        """Forget finished requests; their ``(request_id, token_ids)``."""
        for seq in finished:
            del self._seqs[seq.seq_id]
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
                launched = self.model_runner.launch(batch.seqs, batch.is_prefill)
            else:
                launched = self.tp_group.call(ModelRunner.launch, batch.seqs, batch.is_prefill)
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
        finished = self.scheduler.postprocess(step.batch, token_ids)
        end = time.perf_counter()
        if self.events.active:
            batch, launched = step.batch, step.launched
            self.events.emit(
                Step, phase="prefill" if batch.is_prefill else "decode", num_seqs=len(batch.seqs),
                num_prefill_tokens=sum(batch.num_tokens) if batch.is_prefill else 0,
                num_decode_tokens=0 if batch.is_prefill else len(batch.seqs),
                duration_s=end - max(step.start, self._last_completion), schedule_s=step.schedule_s,
                prepare_s=launched.prepare_s, forward_s=launched.launch_s, sample_s=launched.wait_s,
                postprocess_s=end - t, padded_batch_size=launched.padded_batch_size)
        self._last_completion = end
        return finished

    def _fail(self, batch: ScheduledBatch) -> None:
        # The batch is lost, the engine is not (unless its tensor-parallel ranks fell out of step,
        # which the group reports on every later call): fail these requests and free their blocks.
        for seq in batch.seqs:
            self.scheduler.fail(seq)
            self._seqs.pop(seq.seq_id, None)

    def generate(self, prompts: SequenceOf[Prompt], sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[dict]:
        """Run prompts to completion; results in prompt order as ``{"text", "token_ids"}``.

        Every prompt is checked before any is queued, so a bad one raises without side effects."""
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams: give one, or one per prompt")
        token_lists = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            try:
                token_ids = self._tokens(prompt)  # tokenised and checked once, here
                self.scheduler.check(len(token_ids), sp.max_tokens)
            except RequestRejectedError as exc:
                raise RequestRejectedError(f"prompt {i}: {exc}") from None
            token_lists.append(token_ids)
        with self.events.held():  # the arrivals publish with the first step, not one by one
            request_ids = [self._queue(next(Sequence.counter), token_ids, sp, None)
                           for token_ids, sp in zip(token_lists, params)]
        results: dict[int, dict] = {}
        bar = tqdm(total=len(prompts), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        prefill_tps = decode_tps = 0.0
        try:
            while len(results) < len(request_ids):
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
                    results[request_id] = {"text": self.tokenizer.decode(token_ids), "token_ids": token_ids}
                    bar.update(1)
        except BaseException:
            # Ctrl-C or an engine error: leave no half-finished request holding KV blocks.
            for request_id in request_ids:
                if request_id not in results:
                    self.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]


class LLM(LLMEngine):
    """``LLM(model_dir, **config)``: see ``engine.config.Config`` for the options."""


def _load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, use_fast=True)
