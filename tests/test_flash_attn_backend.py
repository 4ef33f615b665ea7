"""The flash-attn backend's argument handling, checked with a stand-in ``flash_attn`` module that
validates the call and delegates to the torch reference (flash-attn itself needs CUDA)."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from kernels.reference import decode_attention_ref, norm_rope_store_ref, prefill_attention_ref
from models.attention import set_attention_backend
from models.backends import cuda_backend, flash_attn_backend

CALLS: list[str] = []


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, block_table):
    assert causal and q.dim() == 3 and k.dim() == 4 and v.shape == k.shape
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == block_table.dtype == torch.int32
    assert max_seqlen_q == int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    assert max_seqlen_k == int((cu_seqlens_k[1:] - cu_seqlens_k[:-1]).max())
    assert block_table.shape[0] == cu_seqlens_q.numel() - 1
    CALLS.append("varlen")
    return prefill_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, softmax_scale)


def _with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, causal):
    assert causal and q.dim() == 4 and q.shape[1] == 1, "decode queries are [batch, 1, heads, dim]"
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
    CALLS.append("kvcache")
    return decode_attention_ref(q.squeeze(1), k_cache, v_cache, cache_seqlens, block_table, softmax_scale).unsqueeze(1)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = _varlen
    module.flash_attn_with_kvcache = _with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    CALLS.clear()
    return module


def test_flash_attn_backend_generates_what_the_torch_backend_does(fake_flash_attn, tiny_checkpoint):
    prompts = [[1, 2, 3, 4, 5] * 7, [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    expected = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    # flash-attn cannot store into the paged cache; the real backend pairs it with the Triton kernel.
    backend = dataclasses.replace(flash_attn_backend(), norm_rope_store=norm_rope_store_ref)
    set_attention_backend(llm.model_runner.model, backend)
    got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]  # prefix hits included
    assert got == expected
    assert "varlen" in CALLS and "kvcache" in CALLS


def test_cuda_backend_prefers_flash_attn_only_for_its_block_sizes(fake_flash_attn):
    assert cuda_backend(256).name == "flash-attn"
    assert cuda_backend(512).name == "flash-attn"
    assert cuda_backend(16).name == "triton"


def test_cuda_backend_falls_back_to_triton_without_flash_attn(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` raise ImportError
    assert cuda_backend(256).name == "triton"
