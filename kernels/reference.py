"""Pure-torch paged attention, QK-norm/rotary/KV store, RMSNorm and the decode GEMM: the CPU backend,
and the oracle for the Triton kernels.

Cache layout (one layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``; a token's slot is
``block_id * block_size + offset``. Query tokens of a sequence are the *last* ``q_len`` of its
``k_len`` tokens, so the causal mask is aligned to the end (this covers plain prefill, prefill
behind prefix-cached blocks and a chunk continuing a partial prompt with one code path).
"""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. Statistics in float32, then back to the input dtype *before*
    the weight multiply, as transformers' Qwen3RMSNorm does, so bf16 results round the same way."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's entry: ``(rms_norm_ref(x + residual), x + residual)``, the sum rounded to
    the input dtype."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary (rotate halves) of ``x [..., D]`` with ``cos, sin [..., D/2]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def norm_rope_store_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """From the fused projection ``qkv [N, (H + 2*KVH) * D]`` to attention's inputs: q and k
    RMS-normalised per head (QK-norm) and rotated at ``positions`` (``cos_sin_cache[pos]`` holds the
    cos, then the sin, of the half frequencies), K/V written at their slots. Returns ``q [N, H, D]``,
    in ``out`` when given."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    q, k, v = qkv.reshape(-1, num_heads + 2 * num_kv_heads, head_dim).split(
        [num_heads, num_kv_heads, num_kv_heads], dim=1)
    cos, sin = cos_sin_cache[positions].to(qkv.dtype).unsqueeze(1).chunk(2, dim=-1)
    q = rotary_ref(rms_norm_ref(q, q_norm_weight, eps), cos, sin)
    k = rotary_ref(rms_norm_ref(k, k_norm_weight, eps), cos, sin)
    store_kvcache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q if out is None else out.copy_(q)


def store_kvcache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` rows ``[N, kv_heads, head_dim]`` at their slots; slot -1 is skipped. The
    caches may have any strides (CPU-offload mode's ring keeps a block's K and V side by side)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[valid].to(v_cache.dtype)


def _gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence as ``[length, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q [q_len, H, D]`` over ``k, v [k_len, KVH, D]``, mask aligned to the end."""
    q_len, num_heads, _ = q.shape
    k_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    qf = q.float().transpose(0, 1)  # [H, q_len, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, k_len, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, q_len, k_len]
    q_pos = torch.arange(k_len - q_len, k_len, device=q.device)[:, None]
    k_pos = torch.arange(k_len, device=q.device)[None, :]
    scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [H, q_len, D]
    return out.transpose(0, 1).to(q.dtype)


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Ragged prefill: ``q [total_q, H, D]``; sequence i owns ``q[cu_q[i]:cu_q[i+1]]`` and attends to
    its first ``cu_k[i+1]-cu_k[i]`` cached tokens through ``block_tables[i]``. K/V must already be stored.
    Into ``out`` when given (its rows of no sequence are left as they were)."""
    if out is None:
        out = torch.empty_like(q)
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q_start, q_end = cu_q[i], cu_q[i + 1]
        k_len = cu_k[i + 1] - cu_k[i]
        if q_end == q_start:
            continue
        k = _gather_kv(k_cache, block_tables[i], k_len)
        v = _gather_kv(v_cache, block_tables[i], k_len)
        out[q_start:q_end] = _attend(q[q_start:q_end], k, v, scale)
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, H, D]`` over its ``context_lens[i]`` cached tokens.
    Rows with context length 0 (CUDA-graph padding) produce zeros."""
    out = torch.zeros_like(q)
    for i, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k = _gather_kv(k_cache, block_tables[i], length)
        v = _gather_kv(v_cache, block_tables[i], length)
        out[i] = _attend(q[i : i + 1], k, v, scale)[0]
    return out


def partial_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_len: int,
    scale: float,
    causal: bool,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One part of a chunk's attention (``kernels.ring_attention``): ``q [Q, H, D]`` over the first
    ``k_len`` keys in the slots ``block_table``, the mask aligned to the end when ``causal``, none
    otherwise. Returns the float32 output ``[Q, H, D]`` and log-sum-exp ``[Q, H]`` (natural log),
    written into ``out`` and ``lse`` when given."""
    q_len, num_heads, _ = q.shape
    k = _gather_kv(k_cache, block_table, k_len).float()
    v = _gather_kv(v_cache, block_table, k_len).float()
    group = num_heads // k.shape[1]
    qf = q.float().transpose(0, 1)  # [H, Q, D]
    kf = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [H, Q, K]
    if causal:
        q_pos = torch.arange(k_len - q_len, k_len, device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(k_len, device=q.device)[None, :] > q_pos, float("-inf"))
    part_lse = torch.logsumexp(scores, dim=-1).transpose(0, 1)  # [Q, H]
    part = torch.matmul(torch.softmax(scores, dim=-1), vf).transpose(0, 1)
    if out is None:
        return part.contiguous(), part_lse.contiguous()
    out.copy_(part)
    lse.copy_(part_lse)
    return out, lse


def merge_attention_ref(o: torch.Tensor, lse: torch.Tensor, o2: torch.Tensor,
                        lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the part ``(o2, lse2)`` into ``(o, lse)`` in place: exact attention over both parts'
    keys, by the log-sum-exp of each (outputs ``[Q, H, D]``, log-sum-exp ``[Q, H]``)."""
    merged = torch.logaddexp(lse, lse2)
    safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    w1 = torch.exp(lse - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    o.copy_((o.float() * w1 + o2.float() * w2).to(o.dtype))
    lse.copy_(merged)
    return o, lse


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU over a packed ``[gate | up]`` last dimension, computed in float32 and rounded once."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """``x @ weight.T`` accumulated in float32 and rounded to ``x``'s dtype; with ``silu_mul`` the
    weight stacks gate and up, and SiLU-and-mul of the two products follows."""
    y = (x.float() @ weight.float().T).to(x.dtype)
    return silu_and_mul_ref(y) if silu_mul else y


def _pool_blocks(kv_cache: torch.Tensor, layers: range | None) -> torch.Tensor:
    """The pool ``[2, layers, blocks, ...]`` (its ``layers``, default all) indexed by block first."""
    part = kv_cache if layers is None else kv_cache[:, layers.start:layers.stop]
    return part.movedim(2, 0)


def gather_blocks_ref(kv_cache: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor,
                      layers: range | None = None) -> None:
    """Whole blocks of the pool ``[2, layers, blocks, ...]`` (or their ``layers``) into block-contiguous
    staging rows: ``staging[ids[1, i]] = kv_cache[:, layers, ids[0, i]]``."""
    staging.index_copy_(0, ids[1], _pool_blocks(kv_cache, layers).index_select(0, ids[0]))


def scatter_blocks_ref(kv_cache: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor,
                       layers: range | None = None) -> None:
    """``gather_blocks_ref`` backwards: ``kv_cache[:, layers, ids[0, i]] = staging[ids[1, i]]``."""
    _pool_blocks(kv_cache, layers).index_copy_(0, ids[0], staging.index_select(0, ids[1]))
