"""transformers' Qwen3 on the same weights: the reference the engine's greedy tokens must equal."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(hf_model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``max_tokens`` tokens each, EOS ignored."""
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs
