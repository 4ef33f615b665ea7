"""Runs the model for one scheduled batch: inputs, KV cache, attention backend, sampling.

One runner per tensor-parallel rank; rank 0 samples and broadcasts the sampled ids. The runner
owns the KV pool: one tensor ``[2, layers, num_blocks, block_size, kv_heads, head_dim]`` whose
per-layer views are handed to the attention layers; with a host KV tier, also the host pool and the
copies between the two (``offload``, an ``engine.kv_transfer.OffloadingHandler``). Per step it turns the scheduler's sequences
into a flat token batch plus the attention metadata (``models.context``), launches the forward and
the sampler without waiting for them, and hands back a ``LaunchedStep`` whose ``token_ids()`` waits.

Every rank keeps the last step's sampled ids on its device (``sampled``): a decode input that is
still a placeholder on the host (its step was in flight when this one was scheduled) is read from
there, so the host never waits for a step before launching the next.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from engine.config import Config, ConfigError
from engine.decode_inputs import DecodeInputs
from engine.events import CudaGraphCapture, CudaGraphReplay, EventBus, PrefillGraphReplay
from engine.kv_transfer import OffloadingHandler, store_staging_blocks
from engine.offload_engine import OffloadEngine, chunk_limit
from engine.prefill_graphs import PrefillGraphs, layer_flops_per_token, prefill_token_counts
from engine.sequence import PLACEHOLDER, Sequence
from kernels.paged_attention import decode_batches
from kernels.skinny_gemm import tile_rows
from models.attention import TORCH_BACKEND, AttentionBackend, attention_layers, set_attention_backend
from models.config import Qwen3Config, dtype_name, parse_dtype
from models.context import Context, get_context, reset_context, set_context
from models.all_reduce import OneShotAllReduce, attach_all_reduce
from models.loader import build_model, load_model
from models.sampler import Sampler, SamplingMetadata, row_seed

# The CPU has no memory to profile; a fixed budget keeps the pool predictable and small.
CPU_KV_CACHE_BYTES = 512 * 1024**2
# CPU-offload mode's host pool when no size is given: room for max_num_seqs requests of max_model_len
# tokens, at most this much.
DEFAULT_HOST_KV_BYTES = 8 * 1024**3
_HOST_POOL_FIX = "give it less (kv_offloading_size, num_host_kvcache_blocks)"


def _physical_memory() -> int:
    """This machine's memory in bytes: an unpinned host allocation past it succeeds, and fails only
    when touched, so the pools are checked against it first."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_device(requested: str | None) -> torch.device:
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={requested!r} was requested but CUDA is not available: pass device='cpu'")
    return device


def resolve_dtype(requested: str | None, device: torch.device, checkpoint_dtype: torch.dtype) -> torch.dtype:
    if requested is not None:
        return parse_dtype(requested)
    # Half precision on the CPU is slow and inexact; the checkpoint's dtype is what a GPU wants.
    return checkpoint_dtype if device.type == "cuda" else torch.float32


def select_attention_backend(device: torch.device, block_size: int) -> AttentionBackend:
    """flash-attn when it imports on CUDA (and takes the block size), else the project's Triton
    kernels; the pure-torch reference on the CPU."""
    if device.type != "cuda":
        return TORCH_BACKEND
    from models.backends import cuda_backend

    return cuda_backend(block_size)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes to capture: 1, 2, 4, 8, every multiple of 16, and ``max_num_seqs`` itself,
    so that every batch the scheduler can form pads to a captured size."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


@dataclass(slots=True)
class LaunchedStep:
    """Rank 0's handle on a launched step: ``token_ids()`` waits for its samples. Host seconds spent
    preparing inputs, launching (forward and sampler) and waiting; ``padded_batch_size`` is set when
    the step replayed a CUDA graph."""

    samples: torch.Tensor  # on the host once ``ready`` has fired
    ready: torch.cuda.Event | None  # None on the CPU, where the samples are already there
    prepare_s: float
    launch_s: float
    padded_batch_size: int | None
    launch_order: list[int] | None = None  # samples[j] belongs to the caller's sequence launch_order[j]
    wait_s: float = 0.0
    landed: Callable[[], None] | None = None  # told once everything the step launched has completed

    def token_ids(self) -> list[int]:
        """One sampled id per sequence, in the order the sequences were passed to ``launch``."""
        t = time.perf_counter()
        if self.ready is not None:
            self.ready.synchronize()
        self.wait_s = time.perf_counter() - t
        if self.landed is not None:
            self.landed()
        samples = self.samples.tolist()
        if self.launch_order is None:
            return samples
        token_ids = [0] * len(samples)
        for row, index in enumerate(self.launch_order):
            token_ids[index] = samples[row]
        return token_ids


class ModelRunner:
    def __init__(self, config: Config, model_config: Qwen3Config, rank: int = 0,
                 events: EventBus | None = None, all_reduce_abort: torch.Tensor | None = None) -> None:
        """``all_reduce_abort``: the pinned word that ends this rank's one-shot all-reduce barriers
        (``models.all_reduce``; rank 0's is raised by the tensor-parallel watchdog)."""
        self.config = config
        self.events = events or EventBus()
        self.model_config = model_config
        self.rank = rank
        self.block_size = config.kvcache_block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, model_config.torch_dtype)
        self.model = build_model(model_config, dtype=self.dtype, device=self.device)
        load_model(self.model, config.model)
        self.model.eval()
        self.all_reduce: OneShotAllReduce | None = None
        if config.tensor_parallel_size > 1 and self.device.type == "cuda" and not config.disable_custom_all_reduce:
            # Before the KV pool is sized: the buffers are the all-reduce's whole memory.
            self.all_reduce = OneShotAllReduce(max(config.max_num_batched_tokens, config.max_num_seqs),
                                               model_config.hidden_size, self.dtype, self.device, all_reduce_abort)
            attach_all_reduce(self.model, self.all_reduce)
        self.backend = select_attention_backend(self.device, self.block_size)
        set_attention_backend(self.model, self.backend)
        self.sampler = Sampler(config.seed)
        self.offload: OffloadingHandler | None = None
        self.ring: OffloadEngine | None = None
        # Its buffers before the KV pool is sized, which leaves room for them.
        self.prefill_graphs: PrefillGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and not config.enable_cpu_offload:
            counts = prefill_token_counts(self.max_step_rows, layer_flops_per_token(self.model))
            if counts:
                with torch.inference_mode():
                    self.prefill_graphs = PrefillGraphs(self.model, counts)
        self.allocate_kv_cache()
        max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        # Inference tensors, like every tensor a step makes (steps run in inference mode).
        with torch.inference_mode():
            self.decode_inputs = DecodeInputs(config.max_num_seqs, max_blocks_per_seq, self.device)
            # The last step's sampled ids (row i: its i-th sequence), and which request had which row.
            self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.int32, device=self.device)
        self.sample_rows: dict[int, int] = {}
        # Filled by capture_cudagraph(), which the engine calls once it has announced itself.
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_bs: list[int] = []
        self.graph_logits: torch.Tensor | None = None  # rank 0's; other ranks' graphs end in the gather
        if self.device.type == "cuda" and self.ring is None:
            self.compile_step_kernels()
        if self.device.type == "cuda" and self.rank == 0:
            self.compile_sampler()

    @property
    def uses_cudagraphs(self) -> bool:
        # CPU-offload mode runs eagerly: a step's copies, waits and merges depend on its context length.
        return self.device.type == "cuda" and not self.config.enforce_eager and self.ring is None

    # --- KV cache -----------------------------------------------------------------------------

    @property
    def num_kv_heads(self) -> int:
        return self.model_config.num_key_value_heads // self.config.tensor_parallel_size

    @property
    def block_bytes(self) -> int:
        mc = self.model_config
        return 2 * mc.num_hidden_layers * self.block_size * self.num_kv_heads * mc.head_dim * self.dtype.itemsize

    def _blocks_that_fit(self) -> int:
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES // self.block_bytes
        # Profile a maximum-size prefill without a cache to learn peak activation memory, then give
        # the KV pool what is left of ``gpu_memory_utilization`` of the device.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.warmup_model()
        free, total = torch.cuda.mem_get_info(self.device)
        stats = torch.cuda.memory_stats(self.device)
        used = total - free
        peak, current = stats["allocated_bytes.all.peak"], stats["allocated_bytes.all.current"]
        available = int(total * self.config.gpu_memory_utilization) - used - peak + current
        # The prefill graphs' pool takes these activations' place. Where their counts stop short of the
        # largest step (MAX_GRAPH_FLOPS), larger steps take them eagerly beside the pool, which holds
        # about the largest count's share of them: that share is kept free too.
        if self.prefill_graphs is not None and (largest := self.prefill_graphs.token_counts[-1]) < self.max_step_rows:
            available -= (peak - current) * largest // self.max_step_rows
        return (available - self._staging_bytes()) // self.block_bytes

    def _staging_bytes(self) -> int:
        """GPU memory the host tier's copies need beside the pool (none without a tier)."""
        if not self.config.host_tier_enabled:
            return 0
        return (self.config.kv_offloading_staging_blocks * self.block_bytes
                + OffloadingHandler.load_staging_bytes(self.block_bytes))

    @property
    def max_step_rows(self) -> int:
        """The most tokens a step computes: ``max_num_batched_tokens``, or ``max_num_seqs`` requests of
        ``max_model_len`` if fewer."""
        config = self.config
        return min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)

    def _prompt_lengths(self, rows: int) -> list[int]:
        # As many requests of the longest length as fit, then the rest: the shape of a step's largest
        # prefill, which both the memory profile and the warm-up must see.
        longest = self.config.max_model_len
        return [longest] * (rows // longest) + ([rows % longest] if rows % longest else [])

    def _packed(self, q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences of these lengths packed as a prefill step takes them: cumulative lengths and
        positions from 0 in each."""
        cu = torch.tensor(np.concatenate(([0], np.cumsum(q_lens))), dtype=torch.int32, device=self.device)
        return cu, torch.cat([torch.arange(n) for n in q_lens]).to(self.device)

    @torch.inference_mode()
    def warmup_model(self) -> None:
        """The memory profile's forward: the largest prefill a step takes, without a KV cache."""
        lengths = self._prompt_lengths(self.max_step_rows)
        cu, positions = self._packed(lengths)
        set_context(Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                            max_seqlen_k=max(lengths)))
        self.model.compute_logits(self.model(torch.zeros_like(positions), positions))
        reset_context()
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def compile_sampler(self) -> None:
        """Compile the sampler's kernels now rather than stall the first request of each kind: one
        call per variant (temperature alone, top-k/top-p, per-request seeds, both) into the engine's
        sample buffer covers every batch size, which is only their grid. The engine's stream of draws
        is left where it was."""
        logits = torch.zeros(1, self.model_config.vocab_size, dtype=self.dtype, device=self.device)
        one = torch.ones(1, device=self.device)
        row = self._tensor([0], np.int64)
        filters = dict(filter_rows=row, top_k=self._tensor([2], np.int64), top_p=self._tensor([0.5], np.float32))
        seeds = dict(row_seeds=row, positions=row)
        calls = self.sampler.calls
        for meta in (None, SamplingMetadata(**filters), SamplingMetadata(**seeds), SamplingMetadata(**filters, **seeds)):
            self.sampler(logits, one, out=self.sampled[:1], meta=meta)
        self.sampler.calls = calls
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def compile_step_kernels(self) -> None:
        """Compile now every kernel variant a request's step can run (a compile stalls every request
        in its step, up to a second), beyond the graphs: prefills at the fewest rows of each
        small-product tile (without prefill graphs, and past their largest count, prefill and mixed
        steps have row counts no graph has) and at the most rows a step takes (large prefills take
        kernels of their own: on Hopper the TMA attention and gate/up product from 4,096 rows),
        mixed steps at the fewest decode rows of each decode-kernel variant (their attention runs
        eagerly, between prefill graphs too), and without graphs, decode steps at the same. The K/V
        all go to block 0, which holds nothing yet (decode rows here are padding)."""
        config = self.config
        for rows in sorted({*tile_rows(config.max_num_batched_tokens), self.max_step_rows}):
            self._warm_step(0, rows)
        if self.backend.mixed_decode:
            for decode_rows in decode_batches(config.max_num_seqs - 1, self.num_kv_heads, self.device):
                self._warm_step(decode_rows, 1)
        if config.enforce_eager:
            self.decode_inputs.stage([], config.max_num_seqs, {}, self.block_size)
            for rows in decode_batches(config.max_num_seqs, self.num_kv_heads, self.device):
                self.decode_forward(rows)
        torch.cuda.synchronize(self.device)

    def _warm_step(self, decode_rows: int, prompt_rows: int, graphs: PrefillGraphs | None = None) -> None:
        """A step's forward on made-up sequences, eagerly; through the prefill graphs' buffers when
        ``graphs`` is given."""
        # The prompt rows in sequences no longer than a request can be, so that block tables hold them.
        q_lens = [1] * decode_rows + self._prompt_lengths(prompt_rows)
        cu, positions = self._packed(q_lens)
        ids, slots = torch.zeros_like(positions), positions % self.block_size
        if graphs is not None:
            ids, positions, slots = graphs.stage(ids, positions, slots, positions.numel())
        set_context(Context(
            is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(q_lens), max_seqlen_k=max(q_lens),
            slot_mapping=slots,
            block_tables=torch.zeros(len(q_lens), self.decode_inputs.max_blocks_per_seq, dtype=torch.int32,
                                     device=self.device),
            context_lens=torch.ones(decode_rows, dtype=torch.int32, device=self.device) if decode_rows else None,
            decode_seqs=decode_rows, split=graphs))
        try:
            hidden = self.model(ids, positions) if graphs is None else graphs.forward(positions.numel())
            self.model.compute_logits(hidden)
        finally:
            reset_context()

    def allocate_kv_cache(self) -> None:
        config = self.config
        if config.host_tier_enabled:
            if config.kv_offloading_staging_blocks == -1:
                config.kv_offloading_staging_blocks = store_staging_blocks(self.block_bytes)
            if config.kv_offloading_size > 0:
                config.num_host_kvcache_blocks = int(config.kv_offloading_size * 2**30) // self.block_bytes
                if config.num_host_kvcache_blocks < 1:
                    raise RuntimeError(
                        f"kv_offloading_size={config.kv_offloading_size} GiB holds no KV block of "
                        f"{self.block_bytes / 2**20:.1f} MiB: give the host tier at least that much")
        if config.num_kvcache_blocks == -1:
            num_blocks = self._blocks_that_fit()
            if config.tensor_parallel_size > 1:
                # Each rank measured its own memory; all must allocate the same pool: the smallest.
                agreed = torch.tensor([num_blocks], device=self.device)
                dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
                num_blocks = int(agreed.item())
            if num_blocks < 1:
                raise RuntimeError(
                    f"no memory is left for the KV cache ({self.block_bytes / 2**20:.1f} MiB per block of "
                    f"{self.block_size} tokens): raise gpu_memory_utilization (now "
                    f"{config.gpu_memory_utilization}), lower max_num_batched_tokens (now "
                    f"{config.max_num_batched_tokens}) or max_model_len, or use a smaller block size")
            config.num_kvcache_blocks = num_blocks
        mc = self.model_config
        block = (self.block_size, self.num_kv_heads, mc.head_dim)
        if config.enable_cpu_offload:
            # The ring keeps each layer's K and V of a block side by side, as the host pool does, so
            # that one copy moves a layer of a run of blocks.
            self.kv_cache = self._pool((mc.num_hidden_layers, config.num_kvcache_blocks, 2, *block))
            caches = [(self.kv_cache[i, :, 0], self.kv_cache[i, :, 1]) for i in range(mc.num_hidden_layers)]
        else:
            self.kv_cache = self._pool((2, mc.num_hidden_layers, config.num_kvcache_blocks, *block))
            caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(mc.num_hidden_layers)]
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(attention_layers(self.model), caches)):
            layer.k_cache, layer.v_cache, layer.layer_index = k_cache, v_cache, i
        if config.host_tier_enabled:
            self.offload = self._allocate_host_tier()
        if config.enable_cpu_offload:
            self.ring = self._allocate_ring()

    def _allocate_ring(self) -> OffloadEngine:
        """CPU-offload mode: the host pool that holds every block, behind the GPU ring (the pool just
        allocated, ``num_kvcache_blocks`` slots); a prefill chunk is limited to what the ring takes."""
        config = self.config
        if config.kv_offloading_size > 0:
            config.num_host_kvcache_blocks = int(config.kv_offloading_size * 2**30) // self.block_bytes
        elif config.num_host_kvcache_blocks == 0:
            per_request = -(-config.max_model_len // self.block_size)
            config.num_host_kvcache_blocks = max(per_request, min(config.max_num_seqs * per_request,
                                                                  DEFAULT_HOST_KV_BYTES // self.block_bytes))
        if config.num_kvcache_blocks < 2:
            raise ConfigError(f"the GPU ring has room for {config.num_kvcache_blocks} slot(s) of "
                              f"{self.block_bytes / 2**20:.1f} MiB; CPU-offload mode needs 2: raise "
                              "gpu_memory_utilization or use a smaller block size")
        if config.num_host_kvcache_blocks < 1:
            raise ConfigError(f"kv_offloading_size={config.kv_offloading_size} GiB holds no KV block of "
                              f"{self.block_bytes / 2**20:.1f} MiB: give the host pool at least that much")
        what = self._host_pool_that_fits("the host KV pool")
        host = torch.empty((self.kv_cache.shape[0], config.num_host_kvcache_blocks, *self.kv_cache.shape[2:]),
                           dtype=self.dtype)
        try:
            ring = OffloadEngine(self.kv_cache, host, self.events)
        except RuntimeError as exc:  # pinned memory has limits of its own
            raise ConfigError(f"{what} could not be pinned ({str(exc).splitlines()[0]}): {_HOST_POOL_FIX}") from exc
        config.max_num_batched_tokens = chunk_limit(config.num_kvcache_blocks, self.block_size,
                                                    config.max_num_batched_tokens)
        return ring

    def _pool(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The KV pool; one that cannot be had is a usage error naming its size (on the CPU, one past
        physical memory is refused first: such an allocation succeeds, and fails only when touched)."""
        blocks = self.config.num_kvcache_blocks
        what = f"the KV pool ({blocks} blocks, {blocks * self.block_bytes / 2**30:.1f} GiB)"
        fix = "give it fewer blocks (num_kvcache_blocks, --num-blocks)"
        if self.device.type == "cpu":
            physical = _physical_memory()
            if blocks * self.block_bytes > physical:
                raise ConfigError(f"{what} is larger than this machine's memory ({physical / 2**30:.1f} GiB): {fix}")
        try:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        except RuntimeError as exc:  # torch.OutOfMemoryError is one
            raise ConfigError(f"{what} could not be allocated ({str(exc).splitlines()[0]}): {fix}") from exc

    def _allocate_host_tier(self) -> OffloadingHandler:
        config = self.config
        what = self._host_pool_that_fits("the host KV tier")
        try:
            return OffloadingHandler(self.kv_cache, config.num_host_kvcache_blocks, config.kv_offloading_staging_blocks)
        except RuntimeError as exc:  # pinned memory has limits of its own
            raise ConfigError(f"{what} could not be allocated ({str(exc).splitlines()[0]}): {_HOST_POOL_FIX}") from exc

    def _host_pool_that_fits(self, name: str) -> str:
        """``name`` with the host pool's size (``num_host_kvcache_blocks``), for its errors; refused first
        when it is larger than this machine's memory (an unpinned allocation past physical memory
        succeeds, and fails only when touched)."""
        blocks = self.config.num_host_kvcache_blocks
        host_bytes = blocks * self.block_bytes
        what = f"{name} ({blocks} blocks, {host_bytes / 2**30:.1f} GiB)"
        physical = _physical_memory()
        if host_bytes > physical:
            raise ConfigError(f"{what} is larger than this machine's memory ({physical / 2**30:.1f} GiB): "
                              f"{_HOST_POOL_FIX}")
        return what

    # --- inputs -------------------------------------------------------------------------------

    def _host(self, values: npt.ArrayLike, dtype: npt.DTypeLike) -> torch.Tensor:
        host = torch.from_numpy(np.asarray(values, dtype=dtype))
        # Pinned host memory lets the copy to the GPU overlap with host work.
        return host.pin_memory() if self.device.type == "cuda" else host

    def _tensor(self, values: npt.ArrayLike, dtype: npt.DTypeLike) -> torch.Tensor:
        return self._host(values, dtype).to(self.device, non_blocking=True)

    def prepare_prefill(self, seqs: list[Sequence], padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each prefilling sequence computes tokens ``[num_cached_tokens, num_cached_tokens +
        num_scheduled_tokens)``, each decoding one (a mixed step) its last token, and attends to
        everything before them through its block table. A decode token still being sampled by the
        step in flight is read on the device, from that step's samples.

        Per-token inputs are built with numpy, not per-token Python loops: a step has ~16k tokens, and
        prefill is bound by the host that prepares and launches it. ``padded``: the step replays the
        prefill graphs of that many rows, and its inputs go to their buffers (returned padded)."""
        # A mixed step's leading decode rows attend through the decode kernel (``Context.decode_seqs``).
        decode_seqs = next((i for i, seq in enumerate(seqs) if seq.is_prefill), len(seqs)) \
            if self.backend.mixed_decode else 0
        starts = np.array([seq.num_cached_tokens if seq.is_prefill else seq.num_tokens - 1 for seq in seqs],
                          dtype=np.int64)
        q_lens = np.array([seq.num_scheduled_tokens for seq in seqs], dtype=np.int64)
        ends = starts + q_lens
        cu_seqlens_q = np.concatenate(([0], np.cumsum(q_lens)))
        # Always the full width: Triton specialises kernels on the row stride, and a stride that
        # changed with the longest prompt would compile a new prefill kernel mid-run.
        block_tables = np.full((len(seqs), self.decode_inputs.max_blocks_per_seq), -1, dtype=np.int32)
        input_ids: list[int] = []
        in_flight: list[tuple[int, int]] = []  # (token index, the row of the previous step's samples)
        for i, (seq, start, end) in enumerate(zip(seqs, starts.tolist(), ends.tolist())):
            block_tables[i, :len(seq.block_table)] = seq.block_table
            if seq.is_prefill:
                input_ids += seq.token_ids[start:end]
            else:  # a decode token: workers of a tensor-parallel group only have the last one
                if seq.last_token == PLACEHOLDER:
                    in_flight.append((len(input_ids), self.sample_rows[seq.seq_id]))
                input_ids.append(seq.last_token)
        token_seq = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(cu_seqlens_q[-1]) + np.repeat(starts - cu_seqlens_q[:-1], q_lens)
        slot_mapping = block_tables[token_seq, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        if padded is None:
            ids, positions, slots = (self._tensor(values, np.int64) for values in (input_ids, positions, slot_mapping))
        else:
            assert self.prefill_graphs is not None
            ids, positions, slots = self.prefill_graphs.stage(
                *(self._host(values, np.int64) for values in (input_ids, positions, slot_mapping)), padded)
        set_context(Context(
            is_prefill=True,
            cu_seqlens_q=self._tensor(cu_seqlens_q, np.int32),
            cu_seqlens_k=self._tensor(np.concatenate(([0], np.cumsum(ends))), np.int32),
            max_seqlen_q=int(q_lens.max()),
            max_seqlen_k=int(ends.max()),
            slot_mapping=slots,
            block_tables=self._tensor(block_tables, np.int32),
            context_lens=self._tensor(ends[:decode_seqs], np.int32) if decode_seqs else None,
            decode_seqs=decode_seqs,
        ))
        if in_flight:
            index, rows = zip(*in_flight)
            ids[self._tensor(index, np.int64)] = self.sampled[self._tensor(rows, np.int64)].long()
        return ids, positions

    def prepare_decode(self, seqs: list[Sequence]) -> int:
        """Stage the decode inputs (padded to the CUDA graph that will run them); returns the rows."""
        num_rows = len(seqs)
        if self.graphs and num_rows <= self.graph_bs[-1]:
            num_rows = next(size for size in self.graph_bs if size >= num_rows)
        self.decode_inputs.stage(seqs, num_rows, self.sample_rows, self.block_size)
        return num_rows

    def decode_forward(self, num_rows: int, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of the first ``num_rows`` staged decode rows (rank 0; None on other ranks), into
        ``out`` if given: what each CUDA graph captures, LM head included, so that replays choose no
        GEMM kernel per batch."""
        inputs = self.decode_inputs
        rows = inputs.view("sample_rows", num_rows)
        # A token the previous step was still sampling when this one was prepared is read on the device.
        input_ids = torch.where(rows >= 0, self.sampled[rows.clamp(min=0)], inputs.view("token_ids", num_rows))
        set_context(Context(is_prefill=False, slot_mapping=inputs.view("slot_mapping", num_rows),
                            context_lens=inputs.view("context_lens", num_rows),
                            block_tables=inputs.view("block_tables", num_rows)))
        try:
            return self.model.compute_logits(self.model(input_ids, inputs.view("positions", num_rows)), out)
        finally:
            reset_context()

    # --- CUDA graphs --------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_cudagraph(self) -> None:
        """Capture the prefill forward in pieces for each of ``prefill_token_counts``, then
        ``decode_forward`` for each size of ``graph_batch_sizes``, each largest first, all in one memory
        pool. Replays read the staged inputs in place and write ``graph_logits`` (decode) or the
        prefill graphs' buffers."""
        device = self.device
        self.graph_bs = graph_batch_sizes(self.config.max_num_seqs)
        start = time.perf_counter()
        torch.cuda.synchronize(device)
        pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
        prefill_counts = [] if self.prefill_graphs is None else self.prefill_graphs.token_counts
        # Each count once eagerly through the same buffers first (kernels compile, cuBLAS meets the
        # row count), all before the first capture: the eager allocator's cache is then given back,
        # and the graphs' pool takes the activations' place in the memory the KV pool left.
        for n in reversed(prefill_counts):
            self._warm_step(0, n, self.prefill_graphs)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        counts = reversed(prefill_counts)
        if self.rank == 0 and prefill_counts:
            counts = tqdm(counts, total=len(prefill_counts), desc="Capturing prefill graphs", leave=False)
        for n in counts:
            set_context(Context(is_prefill=True, slot_mapping=self.prefill_graphs.slot_mapping[:n],
                                split=self.prefill_graphs))
            try:
                self.prefill_graphs.capture(n, pool, stream)
            finally:
                reset_context()
        if self.rank == 0:
            self.graph_logits = torch.zeros(self.graph_bs[-1], self.model_config.vocab_size, dtype=self.dtype,
                                            device=device)
        # Captured with every row as padding (slot -1, length 0): no cache entry is touched.
        self.decode_inputs.stage([], self.graph_bs[-1], {}, self.block_size)
        sizes = reversed(self.graph_bs)
        if self.rank == 0:
            # Workers make no bar, not even a disabled one: tqdm's lock is a named semaphore, which a
            # worker killed by a signal leaves to the resource tracker's warning at shutdown.
            sizes = tqdm(sizes, total=len(self.graph_bs), desc="Capturing CUDA graphs", leave=False)
        for bs in sizes:
            # One eager run first: kernels compile and allocate outside the capture.
            out = None if self.graph_logits is None else self.graph_logits[:bs]
            self.decode_forward(bs, out)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool, stream=stream):
                self.decode_forward(bs, out)
            # Stored before anything runs it, where an abort of the group finds it (tensor parallelism).
            self.graphs[bs] = graph
            self.graphs[bs].replay()  # the first replay uploads the graph: not in a request's step
        torch.cuda.synchronize(device)
        pool_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        self.events.announce(CudaGraphCapture, batch_sizes=tuple(self.graph_bs),
                             prefill_token_counts=tuple(prefill_counts), seconds=time.perf_counter() - start,
                             pool_bytes=pool_bytes)

    # --- the step -----------------------------------------------------------------------------

    def _decode_logits(self, num_rows: int, num_seqs: int) -> tuple[torch.Tensor | None, int | None]:
        """Logits of the staged decode rows (rank 0), and the padded batch size when a captured
        graph ran."""
        if num_rows not in self.graphs:  # no graph of this size: the rows were not padded
            return self.decode_forward(num_rows), None
        self.graphs[num_rows].replay()
        if self.events.active:
            self.events.emit(CudaGraphReplay, batch_size=num_seqs, padded_batch_size=num_rows)
        return (None if self.graph_logits is None else self.graph_logits[:num_seqs]), num_rows

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], phase: str) -> LaunchedStep | None:
        """Compute the scheduled tokens of ``seqs`` and sample one token id per sequence, without
        waiting for the device. A pure decode step (``phase``) replays a CUDA graph; a prefill or
        mixed one runs the prefill path. Rank 0 returns the handle to read the ids with; other ranks
        None."""
        if self.ring is not None:
            return self._launch_ring(seqs, phase)
        t0 = time.perf_counter()
        n = len(seqs)
        padded_batch_size = launch_order = None
        if phase != "decode":
            if phase == "mixed" and self.backend.mixed_decode:
                # Decode rows first, so that attention can take them apart from the prompts' rows
                # (sorted() is stable: every tensor-parallel rank computes the same order).
                launch_order = sorted(range(n), key=lambda i: seqs[i].is_prefill)
                seqs = [seqs[i] for i in launch_order]
            # Taken first: whatever happens below, the streamed loads' events are this step's.
            kv_ready = None if self.offload is None else self.offload.take_layer_waits()
            num_tokens = sum(seq.num_scheduled_tokens for seq in seqs)
            padded = None if self.prefill_graphs is None else self.prefill_graphs.padded(num_tokens)
            try:
                input_ids, positions = self.prepare_prefill(seqs, padded)
                temperatures = self._tensor([seq.temperature for seq in seqs], np.float32)
                t1 = time.perf_counter()
                if padded is None:
                    get_context().kv_ready = kv_ready
                    hidden = self.model(input_ids, positions)
                else:
                    hidden = self.prefill_graphs.replay(num_tokens, padded, kv_ready)
                    if self.events.active:
                        self.events.emit(PrefillGraphReplay, num_tokens=num_tokens, padded_tokens=padded)
                logits = self.model.compute_logits(hidden)
            finally:
                reset_context()
                if kv_ready is not None:
                    # Every later use of the loaded blocks comes after the whole copy, also when the
                    # step failed before its last layer group.
                    torch.cuda.current_stream().wait_event(next(e for e in reversed(kv_ready) if e is not None))
        else:
            # Longest context first: the attention grid starts its longest programs first and ends on
            # short ones, so fewer SMs idle at the end of each layer's kernel (sorted() is stable, so
            # every tensor-parallel rank computes the same order).
            launch_order = sorted(range(n), key=lambda i: -seqs[i].num_tokens)
            seqs = [seqs[i] for i in launch_order]
            num_rows = self.prepare_decode(seqs)
            temperatures = self.decode_inputs.view("temperatures", n)
            t1 = time.perf_counter()
            logits, padded_batch_size = self._decode_logits(num_rows, n)
        if self.rank == 0:
            self.sampler(logits, temperatures, out=self.sampled[:n], meta=self._sampling_metadata(seqs))
        if self.config.tensor_parallel_size > 1:
            dist.broadcast(self.sampled[:n], src=0)
        self.sample_rows = {seq.seq_id: i for i, seq in enumerate(seqs)}
        if self.rank != 0:
            return None
        samples, ready = self._samples_to_host(n), None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(samples, ready, prepare_s=t1 - t0, launch_s=time.perf_counter() - t1,
                            padded_batch_size=padded_batch_size, launch_order=launch_order)

    def _launch_ring(self, seqs: list[Sequence], phase: str) -> LaunchedStep:
        """CPU-offload mode: one request's chunk or decode token through the ring (its K/V streams in
        from host memory layer by layer, and its new K/V goes back there before the step lands)."""
        t0 = time.perf_counter()
        (seq,) = seqs  # the scheduler runs one request per step in this mode
        ring = self.ring
        step = ring.plan(seq, phase)
        positions = np.arange(step.start, step.start + step.num_tokens)
        input_ids = self._tensor(seq.token_ids[step.start:step.start + step.num_tokens], np.int64)
        set_context(Context(is_prefill=phase == "prefill", cu_seqlens_q=self._tensor([0, step.num_tokens], np.int32),
                            ring=ring))
        temperatures = self._tensor([seq.temperature], np.float32)
        t1 = time.perf_counter()
        ring.begin(step)
        try:
            logits = self.model.compute_logits(self.model(input_ids, self._tensor(positions, np.int64)))
        finally:
            reset_context()
        self.sampler(logits, temperatures, out=self.sampled[:1], meta=self._sampling_metadata(seqs))
        self.sample_rows = {seq.seq_id: 0}
        samples = self._samples_to_host(1)
        ready = ring.end()  # the offload follows the sampler: the step has landed once it has
        return LaunchedStep(samples, ready, prepare_s=t1 - t0, launch_s=time.perf_counter() - t1,
                            padded_batch_size=None, landed=ring.landed)

    def _samples_to_host(self, n: int) -> torch.Tensor:
        """The first ``n`` sampled ids on their way to host memory (pinned, not yet waited for, on CUDA)."""
        if self.device.type != "cuda":
            return self.sampled[:n].clone()
        samples = torch.empty(n, dtype=torch.int32, pin_memory=True)
        samples.copy_(self.sampled[:n], non_blocking=True)
        return samples

    def _sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata | None:
        """What the sampler needs beyond temperatures for ``seqs`` (in launch order); None for a
        batch of temperature-only requests, which costs one pass over the batch."""
        rows = [i for i, seq in enumerate(seqs) if not seq.plain_sampling]
        if not rows:
            return None
        meta = SamplingMetadata()
        filters = [i for i in rows if seqs[i].params.filters]
        if filters:
            meta.filter_rows = self._tensor(filters, np.int64)
            meta.top_k = self._tensor([seqs[i].params.top_k for i in filters], np.int64)
            meta.top_p = self._tensor([seqs[i].params.top_p for i in filters], np.float32)
        seeded = [i for i in rows if seqs[i].params.seed is not None and seqs[i].temperature > 0]
        if seeded:
            row_seeds = np.full(len(seqs), -1, dtype=np.int64)
            positions = np.zeros(len(seqs), dtype=np.int64)
            for i in seeded:
                # The token this step samples for the request sits at index num_tokens.
                row_seeds[i], positions[i] = row_seed(seqs[i].params.seed), seqs[i].num_tokens
            meta.row_seeds, meta.positions = self._tensor(row_seeds, np.int64), self._tensor(positions, np.int64)
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        for i in rows:
            seq = seqs[i]
            if seq.num_tokens - seq.num_prompt_tokens < seq.params.min_tokens:
                stops = set(seq.stop_token_ids)
                if not seq.ignore_eos and self.config.eos >= 0:
                    stops.add(self.config.eos)
                banned_rows += [i] * len(stops)
                banned_ids += sorted(stops)
        if banned_rows:
            meta.banned = (self._tensor(banned_rows, np.int64), self._tensor(banned_ids, np.int64))
        return meta

    def describe(self) -> dict[str, str | None]:
        if self.config.tensor_parallel_size == 1:
            all_reduce = None
        else:
            all_reduce = "one-shot" if self.all_reduce is not None else dist.get_backend()
        return {"device": str(self.device), "dtype": dtype_name(self.dtype), "attention_backend": self.backend.name,
                "all_reduce": all_reduce}
