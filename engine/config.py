"""Engine configuration: nano-vllm's fields and defaults, validated on construction.

A ``Config`` needs no checkpoint: the control plane is built and tested from one alone. When the
engine loads a model it narrows ``max_model_len`` to the model's context and fills in ``eos`` and
``num_kvcache_blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field and the allowed values."""


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: {allowed}")


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


_DEVICES = ("cpu", "cuda")
OFFLOADING_POLICIES = ("write-through", "write-back")
BATCHING = ("prefill-first", "mixed")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(slots=True)
class Config:
    model: str = ""
    max_num_batched_tokens: int = 16384
    max_num_seqs: int = 512
    max_model_len: int = 4096
    # Beyond this many waiting requests a new one is refused (``QueueFullError``); None: unbounded.
    max_waiting_requests: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    # Tensor parallelism on CUDA sums row-parallel products with NCCL's all-reduce instead of the
    # one-shot one fused into the next norm (models.all_reduce); vLLM's option of that name.
    disable_custom_all_reduce: bool = False
    enforce_eager: bool = False
    # Schedule and prepare decode step n+1 while the GPU runs step n (see engine.llm_engine).
    async_scheduling: bool = True
    eos: int = -1
    kvcache_block_size: int = 256
    num_kvcache_blocks: int = -1
    # None picks CUDA when present, else the CPU.
    device: str | None = None
    # None picks the checkpoint's dtype on CUDA and float32 on the CPU.
    dtype: str | None = None
    enable_prefix_caching: bool = True
    # Seeds the sampler's random stream (and nothing else).
    seed: int = 0
    # The host KV tier (engine.host_tier): its size in GiB (vLLM's --kv-offloading-size) or in blocks
    # (exact, for tests); 0 turns it off. The engine fills in num_host_kvcache_blocks from the size.
    kv_offloading_size: float = 0.0
    num_host_kvcache_blocks: int = 0
    kv_offloading_policy: str = "write-through"
    # Blocks of GPU staging for stores to the host tier (copies wait there for the link); -1: 256 MiB.
    kv_offloading_staging_blocks: int = -1
    # What a preempted request loses: recompute (its K/V is dropped) or swap (kept in the host tier).
    preemption_mode: str = "recompute"
    # How a step is filled (engine.scheduler): prefill-first (nano-vllm's: prefill and decode never
    # share a step) or mixed (vLLM V1's: running requests first, chunked prefills from what is left).
    batching: str = "prefill-first"
    # The order of the waiting queue and of preemption victims (engine.scheduling_policy).
    scheduling_policy: str = "fcfs"
    # Mixed batching: a prefill chunk takes at most this many tokens of a step (0: no cap; vLLM's).
    long_prefill_token_threshold: int = 0
    # Seed 004's CPU-primary KV (engine.offload_engine): every block lives in host memory (sized by
    # kv_offloading_size or num_host_kvcache_blocks, else by default), and num_kvcache_blocks is the
    # GPU ring the KV streams through. Steps run one request each, synchronously.
    enable_cpu_offload: bool = False

    @property
    def host_tier_enabled(self) -> bool:
        """A second KV tier behind the GPU pool (engine.host_tier); in CPU-offload mode the host
        sizes are the primary pool's instead."""
        return not self.enable_cpu_offload and (self.kv_offloading_size > 0 or self.num_host_kvcache_blocks > 0)

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens,
                 "must be at least 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be at least 1")
        _require(self.max_model_len >= 1, "max_model_len", self.max_model_len, "must be at least 1")
        _require(self.max_waiting_requests is None or self.max_waiting_requests >= 1, "max_waiting_requests",
                 self.max_waiting_requests, "must be None (unbounded) or at least 1")
        _require(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
                 self.gpu_memory_utilization, "must be in (0, 1]")
        _require(1 <= self.tensor_parallel_size <= 8, "tensor_parallel_size", self.tensor_parallel_size,
                 "must be between 1 and 8")
        # Any power of two from 16: the 256-multiple rule of nano-vllm was a flash-attn paged-KV limit.
        _require(self.kvcache_block_size >= 16 and is_power_of_two(self.kvcache_block_size),
                 "kvcache_block_size", self.kvcache_block_size, "must be a power of two >= 16 (16, 32, ..., 256, ...)")
        _require(self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 1, "num_kvcache_blocks",
                 self.num_kvcache_blocks, "must be -1 (size from memory) or at least 1")
        _require(self.device is None or self.device.split(":")[0] in _DEVICES, "device", self.device,
                 f"must be None (auto) or one of {', '.join(_DEVICES)} (optionally 'cuda:N')")
        _require(self.dtype is None or self.dtype in DTYPES, "dtype", self.dtype,
                 f"must be None (auto) or one of {', '.join(DTYPES)}")
        _require(self.kv_offloading_size >= 0, "kv_offloading_size", self.kv_offloading_size,
                 "must be a size in GiB, 0 for no host tier")
        _require(self.num_host_kvcache_blocks >= 0, "num_host_kvcache_blocks", self.num_host_kvcache_blocks,
                 "must be a number of blocks, 0 for no host tier")
        if self.kv_offloading_size > 0 and self.num_host_kvcache_blocks > 0:
            raise ConfigError(
                f"kv_offloading_size={self.kv_offloading_size} and num_host_kvcache_blocks="
                f"{self.num_host_kvcache_blocks} both size the host tier: give one of them")
        _require(self.kv_offloading_policy in OFFLOADING_POLICIES, "kv_offloading_policy",
                 self.kv_offloading_policy, f"must be one of {', '.join(OFFLOADING_POLICIES)}")
        _require(self.kv_offloading_staging_blocks == -1 or self.kv_offloading_staging_blocks >= 1,
                 "kv_offloading_staging_blocks", self.kv_offloading_staging_blocks,
                 "must be -1 (256 MiB) or at least 1")
        _require(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", self.preemption_mode,
                 f"must be one of {', '.join(PREEMPTION_MODES)}")
        _require(self.preemption_mode != "swap" or self.host_tier_enabled or self.enable_cpu_offload, "preemption_mode",
                 self.preemption_mode, "swap needs the host tier: give kv_offloading_size (GiB) or "
                 "num_host_kvcache_blocks too")
        _require(self.batching in BATCHING, "batching", self.batching, f"must be one of {', '.join(BATCHING)}")
        _require(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy", self.scheduling_policy,
                 f"must be one of {', '.join(SCHEDULING_POLICIES)}")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 self.long_prefill_token_threshold, "must be a number of tokens, 0 for no cap")
        if self.enable_cpu_offload:
            self._check_cpu_offload()
        _require(self.tensor_parallel_size == 1 or not self.host_tier_enabled, "tensor_parallel_size",
                 self.tensor_parallel_size, "the host KV tier does not run with tensor parallelism yet: "
                 "use one of them")

    def _check_cpu_offload(self) -> None:
        """What CPU-offload mode does not support yet is refused, naming what to change."""
        mode = "enable_cpu_offload runs one request per step through the GPU ring"
        _require(self.batching == "prefill-first", "batching", self.batching,
                 f"{mode}: mixed batches are not supported with it yet; use prefill-first")
        _require(self.preemption_mode == "recompute", "preemption_mode", self.preemption_mode,
                 "with enable_cpu_offload every block is in host memory already: there is nothing to swap; "
                 "use recompute")
        _require(self.kv_offloading_policy == "write-through", "kv_offloading_policy", self.kv_offloading_policy,
                 "with enable_cpu_offload every block is written to host memory as it is computed: the "
                 "host tier's store policies do not apply; leave it write-through")
        _require(self.tensor_parallel_size == 1, "tensor_parallel_size", self.tensor_parallel_size,
                 "enable_cpu_offload does not run with tensor parallelism yet: use one of them")
        _require(self.num_kvcache_blocks == -1 or self.num_kvcache_blocks >= 2, "num_kvcache_blocks",
                 self.num_kvcache_blocks, "with enable_cpu_offload the GPU ring needs at least 2 slots: one to "
                 "write the new tokens in, one to load earlier blocks through")
        # A step's new K/V must reach host memory before the next step's loads read it.
        self.async_scheduling = False
