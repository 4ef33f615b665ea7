"""A decode step's inputs, staged in one persistent buffer and sent to the GPU in one copy.

A decode step needs six numbers per request (input token, where that token lies if a step still in
flight is sampling it, position, KV slot, context length, temperature) plus its block table.
Building a fresh tensor for each would cost an allocation and a copy apiece every step; here they
are rows of one pinned int32 buffer whose device twin the captured CUDA graphs read in place.
Rows past the batch are padding: they write no K/V (slot -1) and attend to nothing (length 0).

There are two host buffers, used in turn: with asynchronous scheduling the host stages step n+1
while the copy of step n may still wait in the stream behind step n-1, so it must not write the
buffer that copy reads.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.sequence import PLACEHOLDER, Sequence

_FIELDS = ("token_ids", "sample_rows", "positions", "slot_mapping", "context_lens", "temperatures")


class DecodeInputs:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self._table_start = len(_FIELDS) * max_num_seqs
        size = self._table_start + max_num_seqs * max_blocks_per_seq
        if device.type == "cpu":  # the staging buffer is the device buffer, and nothing is in flight
            self.buffer = torch.zeros(size, dtype=torch.int32)
            self._hosts = [self.buffer]
        else:
            self.buffer = torch.zeros(size, dtype=torch.int32, device=device)
            self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._staged = [self._views(host.numpy()) for host in self._hosts]
        self._turn = 0
        self.device_views = self._views(self.buffer)

    def _views(self, flat):
        n = self.max_num_seqs
        views = {name: flat[i * n:(i + 1) * n] for i, name in enumerate(_FIELDS)}
        # Temperatures are float32 bit patterns in the int32 buffer.
        views["temperatures"] = views["temperatures"].view(np.float32 if isinstance(flat, np.ndarray) else torch.float32)
        views["block_tables"] = flat[self._table_start:].reshape(n, self.max_blocks_per_seq)
        return views

    def stage(self, seqs: list[Sequence], num_rows: int, sample_rows: dict[int, int], block_size: int) -> None:
        """Write ``seqs`` into the first rows and padding up to ``num_rows``, then copy to the device.

        ``sample_rows`` maps a request to its row in the previous step's samples: a request whose
        last token is a placeholder reads it from there, on the device."""
        bs = len(seqs)
        self._turn = (self._turn + 1) % len(self._hosts)
        host, v = self._hosts[self._turn], self._staged[self._turn]
        last = [seq.last_token for seq in seqs]
        v["token_ids"][:bs] = last
        v["sample_rows"][:bs] = [sample_rows[seq.seq_id] if t == PLACEHOLDER else -1 for seq, t in zip(seqs, last)]
        lengths = [seq.num_tokens for seq in seqs]
        v["context_lens"][:bs] = lengths
        positions = np.asarray(lengths, dtype=np.int32) - 1
        v["positions"][:bs] = positions
        tables = v["block_tables"]
        last_blocks = []
        for i, seq in enumerate(seqs):
            table = seq.block_table
            tables[i, :len(table)] = table
            last_blocks.append(table[-1])
        v["slot_mapping"][:bs] = np.asarray(last_blocks, dtype=np.int32) * block_size + positions % block_size
        v["temperatures"][:bs] = [seq.temperature for seq in seqs]
        for name, pad in (("token_ids", 0), ("sample_rows", -1), ("positions", 0), ("slot_mapping", -1),
                          ("context_lens", 0), ("temperatures", 0.0)):
            v[name][bs:num_rows] = pad
        if host is not self.buffer:
            # Every per-request field, then the block-table rows in use: one contiguous copy.
            end = self._table_start + num_rows * self.max_blocks_per_seq
            self.buffer[:end].copy_(host[:end], non_blocking=True)

    def view(self, name: str, num_rows: int) -> torch.Tensor:
        return self.device_views[name][:num_rows]
