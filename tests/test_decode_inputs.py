"""Decode inputs staged in one buffer: rows per request, padding that touches nothing, and tokens still
in flight pointed at the previous step's samples."""

from __future__ import annotations

import pytest
import torch

from engine.decode_inputs import DecodeInputs
from engine.sampling_params import SamplingParams
from engine.sequence import PLACEHOLDER, Sequence


def make_seq(tokens: list[int], blocks: list[int], temperature: float) -> Sequence:
    seq = Sequence(tokens, SamplingParams(temperature=temperature, max_tokens=8), block_size=16, arrival_time=0.0)
    seq.block_table = blocks
    return seq


def test_rows_padding_and_placeholders():
    inputs = DecodeInputs(max_num_seqs=4, max_blocks_per_seq=3, device=torch.device("cpu"))
    a = make_seq(list(range(17)), [5, 9], temperature=0.0)  # 17 tokens: the last sits in block 9, offset 0
    b = make_seq([1, 2, 3], [7], temperature=0.7)
    b.append_token(PLACEHOLDER)  # its last token is still being sampled by the step in flight, in row 2
    inputs.stage([a, b], num_rows=4, sample_rows={b.seq_id: 2}, block_size=16)
    view = lambda name: inputs.view(name, 4).tolist()  # noqa: E731
    assert view("token_ids")[:2] == [16, PLACEHOLDER]
    assert view("sample_rows") == [-1, 2, -1, -1]
    assert view("positions")[:2] == [16, 3]
    assert view("context_lens") == [17, 4, 0, 0]  # padding rows attend to nothing
    assert view("slot_mapping") == [9 * 16 + 0, 7 * 16 + 3, -1, -1]  # and write no K/V
    assert view("temperatures")[:2] == [0.0, pytest.approx(0.7)]
    tables = view("block_tables")
    assert tables[0][:2] == [5, 9] and tables[1][:1] == [7]  # entries past a table are never read


def test_a_smaller_batch_reuses_the_rows_and_pads_the_rest():
    inputs = DecodeInputs(max_num_seqs=4, max_blocks_per_seq=2, device=torch.device("cpu"))
    seqs = [make_seq([1] * (n + 1), [n], temperature=0.0) for n in range(4)]
    inputs.stage(seqs, num_rows=4, sample_rows={}, block_size=16)
    inputs.stage(seqs[:1], num_rows=2, sample_rows={}, block_size=16)
    assert inputs.view("context_lens", 2).tolist() == [1, 0]
    assert inputs.view("slot_mapping", 2).tolist() == [0, -1]
