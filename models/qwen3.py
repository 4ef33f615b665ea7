"""Qwen3 dense decoder (the architecture of Qwen3-0.6B ... 8B), tensor-parallel and paged.

The forward takes a flat ``[num_tokens]`` batch (all sequences concatenated, no padding) plus
positions; sequence boundaries and cache slots come from ``models.context``.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.gemv import gemv_partials, gemv_partials_fits, norm_gemv, norm_gemv_fits
from kernels.prefill_gemm import gate_up_silu, gate_up_silu_fits
from kernels.skinny_gemm import MAX_MACS, skinny_gemm, skinny_gemm_fits, skinny_gemm_partials, split_k_fits
from models.activation import SiluAndMul
from models.all_reduce import RankSum
from models.attention import Attention
from models.config import Qwen3Config
from models.context import get_context
from models.embed_head import ParallelLMHead, VocabParallelEmbedding
from models.layernorm import RMSNorm
from models.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from models.rotary import RotaryEmbedding


# Above this many multiply-adds (rows x weight elements) the qkv product stays on cuBLAS, whose tiles
# fill the GPU there: through the skinny GEMM, Qwen3-4B's yardstick steps took 2.8% longer at batch
# 65-128 and 1-3% at 33-64 (H100, docs/performance.md). This keeps Qwen3-0.6B's qkv on the skinny
# GEMM up to 128 rows and the 4B's up to 34, at every tensor-parallel size (``skinny_fits``).
QKV_SKINNY_MAX_MACS = 2**29


def skinny_fits(x: torch.Tensor, proj: ColumnParallelLinear, max_macs: int = MAX_MACS) -> bool:
    """Whether ``proj``'s product at these rows goes to the skinny GEMM: ``max_macs`` counts the
    whole weight's multiply-adds on every rank, so a shard takes it up to the same rows as one GPU.

    The skinny GEMM loses to cuBLAS past a row count, not past a product size: counting a rank's
    shard let Qwen3-4B's qkv and gate/up through at up to twice the rows on two GPUs, and the
    yardstick's steps at batch 33-64 took 7% longer than with the rule (two H200s, docs/performance.md)."""
    return skinny_gemm_fits(x, proj.weight, max_macs // proj.tp_size)


def residual_branch_output(proj: RowParallelLinear, x: torch.Tensor) -> torch.Tensor | RankSum:
    """The output of o_proj or down_proj, which always goes on into the next RMSNorm's residual add.

    At decode sizes on one GPU that is the product's float32 split-K partials ``[splits, rows,
    hidden]``: the norm adds them up as it loads them, so splitting K (which fills the GPU where
    cuBLAS leaves it idle) needs no reduction kernel. Under tensor parallelism with the one-shot
    all-reduce it is this rank's term of the sum, which the norm completes (``models.all_reduce``)."""
    if proj.tp_size == 1 and proj.bias is None:
        if gemv_partials_fits(x, proj.weight):
            return gemv_partials(x, proj.weight)
        if split_k_fits(x, proj.weight):
            return skinny_gemm_partials(x, proj.weight)
    return proj(x)


def normed_product(norm: RMSNorm, x: torch.Tensor | RankSum, residual: torch.Tensor | None,
                   proj: MergedColumnParallelLinear | QKVParallelLinear,
                   silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(proj(norm(x + residual)), x + residual)`` as one kernel (``kernels.gemv``) for a batch of up
    to ``gemv.MAX_ROWS`` rows on one GPU; otherwise None, and the caller runs the norm and the product."""
    if proj.tp_size == 1 and proj.bias is None and norm_gemv_fits(x, proj.weight):  # one GPU: no RankSum
        return norm_gemv(x, residual, norm.weight, norm.eps, proj.weight, silu_mul)
    return None


def normalised(norm: RMSNorm, x: torch.Tensor | RankSum,
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``; the first layer's input has no residual yet."""
    if residual is None:
        return norm(x), x
    return norm(x, residual)


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads,
            bias=config.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.rotary_emb = rotary_emb  # one table shared by every layer (not saved)
        self.attn = Attention(self.num_heads, config.head_dim, config.head_dim**-0.5, self.num_kv_heads)
        # QK-norm: each head's q and k are RMS-normalised before rotary, which keeps attention
        # logits bounded without a qkv bias. The attention backend applies both, fused.
        self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor | RankSum, residual: torch.Tensor | None,
                norm: RMSNorm) -> tuple[torch.Tensor | RankSum, torch.Tensor]:
        """The sub-block from the norm before it: ``(o_proj output, residual)``."""
        fused = normed_product(norm, hidden_states, residual, self.qkv_proj)
        if fused is not None:
            qkv, residual = fused
        else:
            hidden_states, residual = normalised(norm, hidden_states, residual)
            weight = self.qkv_proj.weight
            if self.qkv_proj.bias is None and skinny_fits(hidden_states, self.qkv_proj, QKV_SKINNY_MAX_MACS):
                # A small batch: the Triton product, which launches with PDL where cuBLAS would break
                # the layer's chain of overlapping kernels (kernels.pdl).
                qkv = skinny_gemm(hidden_states, weight)
            else:
                qkv = self.qkv_proj(hidden_states)
        attn_out = self.attn(qkv, positions, self.q_norm, self.k_norm, self.rotary_emb.cos_sin_cache)
        return residual_branch_output(self.o_proj, attn_out), residual


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor | RankSum, residual: torch.Tensor, norm: RMSNorm
                ) -> tuple[torch.Tensor | RankSum, torch.Tensor]:
        """The sub-block from the norm before it: ``(down_proj output, residual)``."""
        fused = normed_product(norm, x, residual, self.gate_up_proj, silu_mul=True)
        if fused is not None:
            activated, residual = fused
        else:
            x, residual = norm(x, residual)
            if skinny_fits(x, self.gate_up_proj):
                # A decode-sized batch: one kernel for the projection and the activation.
                activated = skinny_gemm(x, self.gate_up_proj.weight, silu_mul=True)
            elif gate_up_silu_fits(x, self.gate_up_proj.weight):
                # A large prefill on Hopper: the activation in the product's epilogue.
                activated = gate_up_silu(x, self.gate_up_proj.weight)
            else:
                activated = self.act_fn(self.gate_up_proj(x))
        return residual_branch_output(self.down_proj, activated), residual


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous sub-block is fused into the next norm (and so is the sum
        # of split-K partials, where the sub-block's last projection left them), and at a row or a
        # few the norm into the product after it: each sub-block starts from its norm.
        hidden_states, residual = self.self_attn(positions, hidden_states, residual, self.input_layernorm)
        return self.mlp(hidden_states, residual, self.post_attention_layernorm)


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, self.rotary_emb) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        kv_ready = get_context().kv_ready
        for i, layer in enumerate(self.layers):
            if kv_ready is not None and kv_ready[i] is not None:
                torch.cuda.current_stream().wait_event(kv_ready[i])
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    # checkpoint module name -> (packed module name, shard id passed to its weight_loader)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            # One Parameter under two names: named_parameters() reports it once, as the embedding.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]``; call ``compute_logits`` on them."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits of each sequence's sampled position (rank 0 only; ``None`` on other ranks), written
        into ``out`` when given."""
        return self.lm_head(hidden_states, out)
