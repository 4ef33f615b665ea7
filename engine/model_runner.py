"""Runs the model for one scheduled batch: inputs, KV cache, attention backend, sampling.

One runner per tensor-parallel rank; rank 0 samples. The runner owns the KV pool: one tensor
``[2, layers, num_blocks, block_size, kv_heads, head_dim]`` whose per-layer views are handed to the
attention layers. Per step it turns the scheduler's sequences into a flat token batch plus the
attention metadata (``models.context``) and returns the sampled token ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from engine.config import Config
from engine.events import CudaGraphCapture, CudaGraphReplay, EventBus
from engine.sequence import Sequence
from models.attention import TORCH_BACKEND, AttentionBackend, attention_layers, set_attention_backend
from models.config import Qwen3Config, dtype_name, parse_dtype
from models.context import Context, get_context, reset_context, set_context
from models.loader import build_model, load_model
from models.sampler import Sampler

# The CPU has no memory to profile; a fixed budget keeps the pool predictable and small.
CPU_KV_CACHE_BYTES = 512 * 1024**2


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
class StepTiming:
    """Host seconds spent in each part of ``ModelRunner.run``; ``padded_batch_size`` is set when the
    step replayed a CUDA graph."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    padded_batch_size: int | None = None


class ModelRunner:
    def __init__(self, config: Config, model_config: Qwen3Config, rank: int = 0,
                 events: EventBus | None = None) -> None:
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
        self.backend = select_attention_backend(self.device, self.block_size)
        set_attention_backend(self.model, self.backend)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.timing = StepTiming()
        self.allocate_kv_cache()
        # Filled by capture_cudagraph(), which the engine calls once it has announced itself.
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @property
    def uses_cudagraphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.enforce_eager

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
        return available // self.block_bytes

    @torch.inference_mode()
    def warmup_model(self) -> None:
        max_len = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        num_seqs = max(1, min(self.config.max_num_batched_tokens // max_len, self.config.max_num_seqs))
        cu = torch.arange(0, (num_seqs + 1) * max_len, max_len, dtype=torch.int32, device=self.device)
        set_context(Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                            max_seqlen_k=max_len))
        input_ids = torch.zeros(num_seqs * max_len, dtype=torch.int64, device=self.device)
        positions = torch.arange(max_len, device=self.device).repeat(num_seqs)
        self.model.compute_logits(self.model(input_ids, positions))
        reset_context()
        torch.cuda.synchronize(self.device)

    def allocate_kv_cache(self) -> None:
        config = self.config
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
        self.kv_cache = torch.empty(2, mc.num_hidden_layers, config.num_kvcache_blocks, self.block_size,
                                    self.num_kv_heads, mc.head_dim, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(attention_layers(self.model)):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]

    # --- inputs -------------------------------------------------------------------------------

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        # Pinned host memory lets the copy to the GPU overlap with host work.
        pin = self.device.type == "cuda"
        return torch.tensor(values, dtype=dtype, pin_memory=pin).to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        rows = [seq.block_table + [-1] * (width - len(seq.block_table)) for seq in seqs]
        return self._tensor([b for row in rows for b in row], torch.int32).view(len(seqs), width)

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sequence computes tokens ``[num_cached_tokens, num_cached_tokens + num_scheduled_tokens)``
        and attends to everything before them through its block table."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_seqlens_q, cu_seqlens_k = [0], [0]
        max_seqlen_q = max_seqlen_k = 0
        bs = self.block_size
        for seq in seqs:
            start = seq.num_cached_tokens
            end = start + seq.num_scheduled_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
            cu_seqlens_k.append(cu_seqlens_k[-1] + end)
            max_seqlen_q = max(max_seqlen_q, end - start)
            max_seqlen_k = max(max_seqlen_k, end)
            for i in range(start // bs, (end + bs - 1) // bs):
                first = max(start, i * bs)
                last = min(end, (i + 1) * bs)
                base = seq.block_table[i] * bs - i * bs
                slot_mapping += range(base + first, base + last)
        set_context(Context(
            is_prefill=True,
            cu_seqlens_q=self._tensor(cu_seqlens_q, torch.int32),
            cu_seqlens_k=self._tensor(cu_seqlens_k, torch.int32),
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            block_tables=self._block_tables(seqs),
        ))
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64)

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        input_ids = [seq.last_token for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        context_lens = [len(seq) for seq in seqs]
        slot_mapping = [seq.block_table[-1] * bs + seq.last_block_num_tokens - 1 for seq in seqs]
        set_context(Context(
            is_prefill=False,
            slot_mapping=self._tensor(slot_mapping, torch.int64),
            context_lens=self._tensor(context_lens, torch.int32),
            block_tables=self._block_tables(seqs),
        ))
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64)

    # --- CUDA graphs --------------------------------------------------------------------------

    @torch.inference_mode()
    def capture_cudagraph(self) -> None:
        """Capture the decode forward for each size of ``graph_batch_sizes``, largest first, all in
        one memory pool. Replays read their inputs from static buffers that ``run_model`` fills."""
        config = self.config
        self.graph_bs = graph_batch_sizes(config.max_num_seqs)
        max_bs = self.graph_bs[-1]
        max_blocks = (config.max_model_len + self.block_size - 1) // self.block_size
        device = self.device
        self.graph_vars = {
            "input_ids": torch.zeros(max_bs, dtype=torch.int64, device=device),
            "positions": torch.zeros(max_bs, dtype=torch.int64, device=device),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int64, device=device),
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=device),
            "block_tables": torch.full((max_bs, max_blocks), -1, dtype=torch.int32, device=device),
            "outputs": torch.zeros(max_bs, self.model_config.hidden_size, dtype=self.dtype, device=device),
        }
        gv = self.graph_vars
        start = time.perf_counter()
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = None
        for bs in tqdm(reversed(self.graph_bs), total=len(self.graph_bs), desc="Capturing CUDA graphs",
                       disable=self.rank != 0, leave=False):
            set_context(Context(is_prefill=False, slot_mapping=gv["slot_mapping"][:bs],
                                context_lens=gv["context_lens"][:bs], block_tables=gv["block_tables"][:bs]))
            # One eager run first: kernels compile and allocate outside the capture.
            gv["outputs"][:bs] = self.model(gv["input_ids"][:bs], gv["positions"][:bs])
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                gv["outputs"][:bs] = self.model(gv["input_ids"][:bs], gv["positions"][:bs])
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
            reset_context()
        torch.cuda.synchronize(device)
        pool_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        self.events.announce(CudaGraphCapture, batch_sizes=tuple(self.graph_bs),
                             seconds=time.perf_counter() - start, pool_bytes=pool_bytes)

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, int]:
        bs = input_ids.size(0)
        padded = next(size for size in self.graph_bs if size >= bs)
        context = get_context()
        gv = self.graph_vars
        gv["input_ids"][:bs] = input_ids
        gv["positions"][:bs] = positions
        # Padding rows write nowhere (slot -1) and attend to nothing (length 0).
        gv["slot_mapping"].fill_(-1)
        gv["slot_mapping"][:bs] = context.slot_mapping
        gv["context_lens"].zero_()
        gv["context_lens"][:bs] = context.context_lens
        gv["block_tables"][:bs, : context.block_tables.size(1)] = context.block_tables
        self.graphs[padded].replay()
        if self.events.active:
            self.events.emit(CudaGraphReplay, batch_size=bs, padded_batch_size=padded)
        return gv["outputs"][:bs], padded

    # --- the step -----------------------------------------------------------------------------

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, is_prefill: bool) -> torch.Tensor:
        """Hidden states -> logits; decode batches that fit a captured graph replay it."""
        if not is_prefill and self.graphs and input_ids.size(0) <= self.graph_bs[-1]:
            hidden, self.timing.padded_batch_size = self._replay(input_ids, positions)
        else:
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> list[int]:
        """Compute the scheduled tokens of ``seqs`` and return one sampled token id per sequence."""
        t0 = time.perf_counter()
        input_ids, positions = self.prepare_prefill(seqs) if is_prefill else self.prepare_decode(seqs)
        temperatures = self._tensor([seq.temperature for seq in seqs], torch.float32) if self.rank == 0 else None
        t1 = time.perf_counter()
        self.timing = StepTiming()
        try:
            logits = self.run_model(input_ids, positions, is_prefill)
        finally:
            reset_context()
        t2 = time.perf_counter()
        token_ids = self.sampler(logits, temperatures, self.generator).tolist() if self.rank == 0 else []
        t3 = time.perf_counter()
        self.timing.prepare_s, self.timing.forward_s, self.timing.sample_s = t1 - t0, t2 - t1, t3 - t2
        return token_ids

    def describe(self) -> dict[str, str]:
        return {"device": str(self.device), "dtype": dtype_name(self.dtype), "attention_backend": self.backend.name}
