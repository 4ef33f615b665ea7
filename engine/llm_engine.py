"""The engine loop and the vLLM-compatible ``LLM`` facade.

``step()`` is one iteration of continuous batching: schedule, run the model, postprocess. Every
decision along the way is published on ``self.events``; the engine itself never formats, exports or
stores telemetry.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence as SequenceOf

from tqdm.auto import tqdm

from engine.config import Config, ConfigError
from engine.events import EngineStarted, EventBus, RequestArrived, RequestRejected, Step
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejectedError, Scheduler
from engine.sequence import Sequence
from engine.tensor_parallel import TensorParallelGroup, check_parallel_config
from models.config import load_qwen3_config

Prompt = str | list[int]

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


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
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise RequestRejectedError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestRejectedError(
                f"token id(s) {bad[:5]} are outside the vocabulary [0, {vocab}): check the tokenizer matches the model")
        return list(prompt)

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

    def is_finished(self) -> bool:
        return self.scheduler.is_finished()

    # --- the loop -----------------------------------------------------------------------------

    def step(self) -> tuple[list[tuple[int, list[int]]], int]:
        """One engine iteration. Returns the requests that finished as ``(request_id, token_ids)``
        and the number of tokens processed: positive for a prefill, minus the batch size for a decode."""
        t0 = time.perf_counter()
        self.events.step += 1
        seqs, is_prefill = self.scheduler.schedule()
        if not seqs:
            return [], 0
        num_tokens = sum(seq.num_scheduled_tokens for seq in seqs) if is_prefill else -len(seqs)
        t1 = time.perf_counter()
        try:
            if self.tp_group is None:
                token_ids = self.model_runner.run(seqs, is_prefill)
            else:
                token_ids = self.tp_group.call(ModelRunner.run, seqs, is_prefill)
        except Exception:
            # The batch is lost, the engine is not (unless its tensor-parallel ranks fell out of step,
            # which the group reports on every later call): fail these requests and free their blocks.
            for seq in seqs:
                self.scheduler.abort(seq.seq_id, reason="error")
                self._seqs.pop(seq.seq_id, None)
            raise
        t2 = time.perf_counter()
        finished = self.scheduler.postprocess(seqs, token_ids, is_prefill)
        outputs = [(seq.seq_id, seq.completion_token_ids) for seq in finished]
        for seq in finished:
            del self._seqs[seq.seq_id]
        t3 = time.perf_counter()
        if self.events.active:
            timing = self.model_runner.timing
            self.events.emit(
                Step, phase="prefill" if is_prefill else "decode", num_seqs=len(seqs),
                num_prefill_tokens=num_tokens if is_prefill else 0,
                num_decode_tokens=0 if is_prefill else len(seqs), duration_s=t3 - t0,
                schedule_s=t1 - t0, prepare_s=timing.prepare_s, forward_s=timing.forward_s,
                sample_s=timing.sample_s, postprocess_s=t3 - t2, padded_batch_size=timing.padded_batch_size)
        return outputs, num_tokens

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
                token_ids = self._tokens(prompt)  # tokenised once, here
                self.scheduler.check(len(token_ids), sp.max_tokens)
            except RequestRejectedError as exc:
                raise RequestRejectedError(f"prompt {i}: {exc}") from None
            token_lists.append(token_ids)
        request_ids = [self.add_request(token_ids, sp) for token_ids, sp in zip(token_lists, params)]
        results: dict[int, list[int]] = {}
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
                    results[request_id] = token_ids
                    bar.update(1)
        except BaseException:
            # Ctrl-C or an engine error: leave no half-finished request holding KV blocks.
            for request_id in request_ids:
                if request_id not in results:
                    self.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [{"text": self.tokenizer.decode(results[r]), "token_ids": results[r]} for r in request_ids]


class LLM(LLMEngine):
    """``LLM(model_dir, **config)``: see ``engine.config.Config`` for the options."""


def _load_tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, use_fast=True)
