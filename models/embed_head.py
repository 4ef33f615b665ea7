"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous slice of the vocabulary. The embedding zeroes rows it does not own
and all-reduces; the head computes its slice of the logits and gathers the slices on rank 0,
which is the only rank that samples.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.context import get_context
from models.parallel import check_shape, divide, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = divide(num_embeddings, self.tp_size, "vocab_size")
        self.vocab_start = self.tp_rank * self.shard_size
        self.vocab_end = self.vocab_start + self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(loaded_weight.shape, (self.num_embeddings, param.shape[1]))
        param.data.copy_(loaded_weight.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * owned
        y = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1).to(self.weight.dtype)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    def forward(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits ``[num_seqs, vocab]`` on rank 0 (``None`` on other ranks), into ``out`` if given.

        In prefill only each sequence's last position is projected: that is the only one sampled,
        and the full ``[tokens, vocab]`` product would dominate a long prefill's memory.
        """
        context = get_context()
        if context.is_prefill:
            hidden_states = hidden_states[context.cu_seqlens_q[1:] - 1].contiguous()
        if self.tp_size == 1:
            return torch.matmul(hidden_states, self.weight.t(), out=out)
        logits = F.linear(hidden_states, self.weight)
        shards = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(logits, shards, dst=0)
        return torch.cat(shards, dim=-1, out=out) if self.tp_rank == 0 else None
