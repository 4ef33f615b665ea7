"""Triton attention over the paged KV cache (prefill and decode), same contracts as ``reference.py``.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides, head_dim
contiguous). Block size: any power of two >= 16; head_dim: a power of two. Softmax runs in fp32
(exp2 with log2(e) folded into the scale); outputs are in ``q.dtype``.

Decode is built for CUDA graphs: the host never reads device memory, the grid depends only on the
batch shape and the split count, and sequence lengths are read on the device. Each program owns one
(sequence, KV head, KV split) and loads its query heads as a ``[GROUP_PAD, head_dim]`` tile, so every
K/V tile is read once for the whole GQA group and ``tl.dot`` gets at least 16 rows.
``decode_attention_from_qkv`` runs the same kernel on the qkv projection's rows instead of q: each
program applies QK-norm and rotary to its query heads and stores the new token's K/V, which saves
``norm_rope_store``'s kernel per layer (1-4 us per layer on an H100, most at small batches). At a
batch of one its programs also read their first K/V tile, the step's inputs and the rotary angles
before the PDL wait (none is written by a kernel of the step), so up to 961 tokens (15 splits of one
64-token tile) only the qkv row is read after it: single-stream decode steps of Qwen3-0.6B 0.814 ->
0.759 ms (median) on an H100. The new token there gets a split of its own, which stores it and
attends to it alone, so no program waits for a store and patches it into its tile (0.750-0.751 ->
0.736 ms; docs/performance.md).

Prefill on Hopper loads each whole K/V tile with one TMA copy through a tensor descriptor of the
cache (``tma``, for calls of ``TMA_MIN_QUERIES`` or more): 5-7% less kernel time than pointer loads
on every measured shape (H100, docs/performance.md, #29). Tiles on the causal diagonal keep masked
loads, so slots past a sequence's keys (whatever a freed block left there) are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import gemv
from kernels.device import sm_count
from kernels.norm_rope_store import check_qkv, norm_rope_heads
from kernels.pdl import launch_pdl
from kernels.program_clock import clock, global_time, program_slots, record_program

_LOG2E = 1.4426950408889634
# Prefill calls with fewer queries keep pointer loads. Passing a tensor descriptor costs the launch
# host time (measured on the H100: at least ~30 us more per call of the ring's partial kernel, there
# host-bound), which a step of small prompts, whose attention takes tens of microseconds, would
# wait for; from a few thousand queries the kernel runs long enough to hide it.
TMA_MIN_QUERIES = 4096
_MAX_SPLITS = 16
# A split shorter than this spends more on its partial write and the reduction than it saves.
_MIN_SPLIT_TOKENS = 256
# KV splits by how many programs (rows x KV heads) the grid offers an SM. Measured on an H200 on the
# yardstick's shapes (16 q / 8 KV heads, hd 128; contexts spread over ~1.9x at each batch; 28 layers
# in a CUDA graph; docs/performance.md): with fewer programs than SMs, splitting up to
# ``_FILL_PROGRAMS_PER_SM`` won up to 3x (batch 8-16); once every SM has one, contexts of unequal
# length leave SMs idle at the end of each layer's kernel, and ``_BALANCE_SPLITS`` smaller pieces
# gained 3-13 points of copy bandwidth alone (batch 20-48: 79-87% against 71-80%). In the engine's
# steps that gain shrank with the batch, and at batch 64 (3.9 programs an SM) the 4B's steps lost
# 0.2 ms to it, so from ``_SPLIT_BELOW_PROGRAMS_PER_SM`` each sequence and KV head is one program.
_FILL_PROGRAMS_PER_SM = 2
_BALANCE_SPLITS = 8
_SPLIT_BELOW_PROGRAMS_PER_SM = 3.5
# From this many programs per SM an unsplit decode program streams 128-token tiles, below it and
# split 64. Measured on an H100 on the yardstick's shapes (batch 32-256): 128 gained 1-4 points of
# copy bandwidth at batch >= 96 (6+ programs per SM); split 8 ways, 64 was ahead by 1-5 points at
# batch 8-72, and 4 ways at batch 12-16 by 6-8 (H200).
_LARGE_TILE_PROGRAMS_PER_SM = 5
# Warps of a program that preloads its first K/V tile (a batch of one). Its programs start only as
# the qkv product's leave their SMs (two of those hold 60 Ki of an SM's 64 Ki registers), and a
# program timeline found three of them to an SM at 4 warps (167 registers a thread); at 8 (109) two
# fit, and the batch-1 step took 0.753-0.756 ms against 0.757-0.760; 16 warps (one an SM) 0.755-0.757
# (H100, docs/performance.md). Re-timed once the new token got a split of its own (ptxas 13.0: 105
# registers at 8 warps, 114 at 4): 4 warps 0.739-0.741 ms against 0.720-0.722.
_PRELOAD_WARPS = 8


@triton.jit
def _load_kv_tile(
    cache_ptr,
    bt_row_ptr,
    start,
    toks,
    valid,
    dims,
    kv_head,
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    FULL: tl.constexpr = False,
):
    """Tokens ``start + toks`` of one sequence and KV head as a ``[TILE, head_dim]`` tile.

    Block-table entries of invalid tokens are never read, so padding (-1) is harmless. ``FULL``: the
    caller knows every token of the tile is valid, and the loads go unmasked."""
    pos = start + toks
    if TILE <= BLOCK_SIZE:
        # ``start`` is a multiple of TILE, so the whole tile sits in one block: one table read.
        block = tl.load(bt_row_ptr + start // BLOCK_SIZE).to(tl.int64)
    elif FULL:
        block = tl.load(bt_row_ptr + pos // BLOCK_SIZE).to(tl.int64)
    else:
        block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = block * stride_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_slot
    ptrs = cache_ptr + row[:, None] + kv_head * stride_head + dims[None, :]
    if FULL:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=valid[:, None], other=0.0)


@triton.jit
def _attend_decode_tile(q, k, v, valid, m, l, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One tile of keys and values into the running maximum ``m``, denominator ``l`` and output
    ``acc`` (online softmax); the tile holds at least one valid token, so the new maximum is finite and
    exp2 never sees inf - inf."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    context_lens_ptr,
    block_tables_ptr,
    scale_log2,
    q_stride_seq,
    q_stride_head,
    o_stride_seq,
    o_stride_head,
    kc_stride_block,
    kc_stride_slot,
    kc_stride_head,
    vc_stride_block,
    vc_stride_slot,
    vc_stride_head,
    bt_stride,
    positions_ptr,  # positions_ptr ... cos_sin_stride: only read FROM_QKV
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_sin_ptr,
    eps,
    cos_sin_stride,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FROM_QKV: tl.constexpr,
    PDL: tl.constexpr,
    LAUNCH_FIRST: tl.constexpr,  # PDL: let the next kernel launch before this one waits
    PRELOAD: tl.constexpr,  # FROM_QKV: read what no kernel of the step writes before the PDL wait
    clock_ptr,  # CLOCK: this launch's records (kernels.program_clock)
    CLOCK: tl.constexpr,
):
    if CLOCK:
        started, started_at = clock(), global_time()
        waited = started
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq64 = seq.to(tl.int64)
    if PDL:
        if LAUNCH_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        if not PRELOAD:  # everything below reads or writes what other kernels do (kernels.pdl)
            tl.extra.cuda.gdc_wait()
            if CLOCK:
                waited = clock()
            if not LAUNCH_FIRST:
                tl.extra.cuda.gdc_launch_dependents()
    # With PRELOAD, everything up to its wait below reads the step's inputs (copied in before its
    # first kernel), the rotary table and the K/V of earlier steps. The one K/V row a step writes is
    # its new token's: the last split attends to it alone and stores it after the wait, and the
    # other splits share the tokens before it, so none waits for another's store.
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    tl.static_assert(not PRELOAD or NUM_SPLITS > 1, "PRELOAD gives the new token a split of its own")
    if NUM_SPLITS == 1:
        lo = 0
        hi = ctx
    else:
        # Whole tiles per split, so only a sequence's last tile is ragged. With PRELOAD the last
        # split's range comes out empty: (NUM_SPLITS - 1) * per_split >= cached.
        cached = tl.maximum(ctx - 1, 0) if PRELOAD else ctx
        per_split = tl.cdiv(tl.cdiv(cached, NUM_SPLITS - 1 if PRELOAD else NUM_SPLITS), TILE) * TILE
        lo = split * per_split
        hi = tl.minimum(lo + per_split, cached)
    toks = tl.arange(0, TILE)
    bt_row = block_tables_ptr + seq64 * bt_stride
    if PRELOAD:
        # The range's first tile. An empty split (lo past the context) reads no K/V, and its
        # block-table read stays inside its row.
        first_valid = lo + toks < hi
        first = tl.where(lo < hi, lo, 0)
        k_first = _load_kv_tile(k_cache_ptr, bt_row, first, toks, first_valid, dims, kv_head,
                                kc_stride_block, kc_stride_slot, kc_stride_head, BLOCK_SIZE, TILE)
        v_first = _load_kv_tile(v_cache_ptr, bt_row, first, toks, first_valid, dims, kv_head,
                                vc_stride_block, vc_stride_slot, vc_stride_head, BLOCK_SIZE, TILE)
    if FROM_QKV:
        dtype = q_ptr.dtype.element_ty
        half = tl.arange(0, HEAD_DIM // 2)
        pos = tl.load(positions_ptr + seq).to(tl.int64)
        cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + half).to(dtype).to(tl.float32)[None, :]
        sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HEAD_DIM // 2 + half).to(dtype).to(tl.float32)[None, :]
        slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
        # The program whose range holds this step's token (position ctx - 1), or with PRELOAD the
        # last split, normalises, rotates and stores its K/V head; a slot of -1 (only rows of no
        # context: CUDA-graph padding) stores nothing.
        if PRELOAD:
            owner = (split == NUM_SPLITS - 1) & (ctx >= 1) & (slot >= 0)
        else:
            owner = (ctx - 1 >= lo) & (ctx - 1 < hi) & (slot >= 0)
    if PDL and PRELOAD:
        tl.extra.cuda.gdc_wait()
        if CLOCK:
            waited = clock()
        if not LAUNCH_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
    if FROM_QKV:
        # ``q_ptr`` holds qkv projection rows: QK-norm and rotary happen here, on the group's heads,
        # rounded as ``norm_rope_store`` rounds them, so they cost no kernel and no q round trip.
        qkv_row = q_ptr + seq64 * q_stride_seq
        q1, q2 = norm_rope_heads(qkv_row + kv_head * GROUP * HEAD_DIM, rows, GROUP, q_norm_ptr, cos, sin, eps, half,
                                 HEAD_DIM)
        q = tl.reshape(tl.permute(tl.join(q1.to(dtype), q2.to(dtype)), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))
        if owner:
            num_q_heads = GROUP * tl.num_programs(1)
            k1, k2 = norm_rope_heads(qkv_row + (num_q_heads + kv_head) * HEAD_DIM, tl.arange(0, 1), 1, k_norm_ptr,
                                     cos, sin, eps, half, HEAD_DIM)
            k_new = tl.reshape(tl.permute(tl.join(k1, k2), (0, 2, 1)), (1, HEAD_DIM)).to(k_cache_ptr.dtype.element_ty)
            v_new = tl.load(qkv_row + (num_q_heads + tl.num_programs(1) + kv_head) * HEAD_DIM + dims)
            v_new = v_new.to(v_cache_ptr.dtype.element_ty)
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            tl.store(k_cache_ptr + block * kc_stride_block + offset * kc_stride_slot + kv_head * kc_stride_head
                     + dims[None, :], k_new)
            tl.store(v_cache_ptr + block * vc_stride_block + offset * vc_stride_slot + kv_head * vc_stride_head
                     + dims, v_new)
        else:
            k_new = tl.zeros([1, HEAD_DIM], k_cache_ptr.dtype.element_ty)
            v_new = tl.zeros([HEAD_DIM], v_cache_ptr.dtype.element_ty)
        if not PRELOAD:
            tl.debug_barrier()  # other threads of this program load what was just stored
    else:
        q = tl.load(
            q_ptr + seq64 * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    rest = lo  # where the tiles read after the wait start
    if PRELOAD:
        if lo < hi:
            m, l, acc = _attend_decode_tile(q, k_first, v_first, first_valid, m, l, acc, scale_log2, DOT_PRECISION)
        if owner:
            # One key: its weight is 1 against its own maximum, and the output is its value, exactly
            # as a tile holding only this token computes them.
            m = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2
            l = tl.full([GROUP_PAD], 1.0, tl.float32)
            acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32) + v_new.to(tl.float32)[None, :]
        rest = lo + TILE
    for start in range(rest, hi, TILE):
        valid = start + toks < hi
        k = _load_kv_tile(k_cache_ptr, bt_row, start, toks, valid, dims, kv_head,
                          kc_stride_block, kc_stride_slot, kc_stride_head, BLOCK_SIZE, TILE)
        v = _load_kv_tile(v_cache_ptr, bt_row, start, toks, valid, dims, kv_head,
                          vc_stride_block, vc_stride_slot, vc_stride_head, BLOCK_SIZE, TILE)
        m, l, acc = _attend_decode_tile(q, k, v, valid, m, l, acc, scale_log2, DOT_PRECISION)

    if NUM_SPLITS == 1:
        # Padding rows (ctx == 0) have acc == 0 and l == 0: they come out as zeros.
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        o_ptrs = out_ptr + seq64 * o_stride_seq + heads[:, None] * o_stride_head + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        # Partials are [B, H, NUM_SPLITS(, D)], contiguous; an empty split writes m=-inf, l=0, acc=0.
        part = (seq64 * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m, mask=row_mask)
        tl.store(part_sum_ptr + part, l, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None])
    if CLOCK:
        record_program(clock_ptr, started, started_at, waited)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    o_stride_seq,
    o_stride_head,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr,
    LAUNCH_FIRST: tl.constexpr,  # PDL: let the next kernel launch before this one waits
    clock_ptr,  # CLOCK: this launch's records (kernels.program_clock)
    CLOCK: tl.constexpr,
):
    if CLOCK:
        started, started_at = clock(), global_time()
        waited = started
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if PDL:
        if LAUNCH_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
        if CLOCK:
            waited = clock()
        if not LAUNCH_FIRST:
            tl.extra.cuda.gdc_launch_dependents()
    base = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.load(part_max_ptr + base + splits)
    l = tl.load(part_sum_ptr + base + splits)
    m_all = tl.max(m, 0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # all splits empty: padding row
    w = tl.exp2(m - m_all)
    total = tl.sum(l * w, 0)
    acc = tl.load(part_acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * o_stride_seq + head * o_stride_head + dims, out.to(out_ptr.dtype.element_ty))
    if CLOCK:
        record_program(clock_ptr, started, started_at, waited)


@triton.jit
def _attend_tiles(
    acc,
    m,
    l,
    q,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,
    v_desc,
    bt_row,
    lo,
    hi,
    k_len,
    dims,
    kv_head,
    scale_log2,
    stride_block,
    stride_slot,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Online-softmax update of (acc, m, l) with key tiles ``[lo, hi)``; CAUSAL masks by position and
    by ``k_len``. Without CAUSAL every tile must be whole and below ``k_len`` (the callers' unmasked
    ranges are), and its loads go unmasked. K and V share their caches' strides, so a tile's
    addresses are computed once for both; the scale folds into the exponent's multiply-add and the
    second product accumulates into ``acc`` (5-13% faster on the H100: docs/performance.md, #29).
    With ``TMA`` the unmasked tiles come through the caches' tensor descriptors (``k_desc``,
    ``v_desc``: the cache as ``[blocks x block_size, kv_heads x head_dim]``, tiles of ``BLOCK_N`` rows,
    which lie in one block); masked tiles keep masked loads, so keys past ``k_len`` read as zeros."""
    toks = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + toks
        valid = k_pos < k_len
        if TMA and not CAUSAL:
            cache_row = tl.load(bt_row + start // BLOCK_SIZE) * BLOCK_SIZE + start % BLOCK_SIZE
            k = k_desc.load([cache_row, kv_head * stride_head])
        else:
            k = _load_kv_tile(k_cache_ptr, bt_row, start, toks, valid, dims, kv_head,
                              stride_block, stride_slot, stride_head, BLOCK_SIZE, BLOCK_N, not CAUSAL)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if CAUSAL:
            s = tl.where((k_pos[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if TMA and not CAUSAL:
            v = v_desc.load([cache_row, kv_head * stride_head])
        else:
            v = _load_kv_tile(v_cache_ptr, bt_row, start, toks, valid, dims, kv_head,
                              stride_block, stride_slot, stride_head, BLOCK_SIZE, BLOCK_N, not CAUSAL)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new
    return acc, m, l


@triton.jit
def _attend_causal(acc, m, l, q, rows, m_block, ctx, k_len, k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row, dims,
                   kv_head, scale_log2, stride_block, stride_slot, stride_head, BLOCK_SIZE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """Query block ``m_block`` (its ``rows``, token ``ctx + row`` of the sequence) over its visible keys:
    those up to the block's first query position, visible to every row, unmasked (every one is below
    ``k_len``: the block has a row, so ``ctx + m_block * BLOCK_M < k_len``), then the diagonal masked."""
    unmasked_hi = (ctx + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    hi = tl.minimum(k_len, ctx + (m_block + 1) * BLOCK_M)
    q_pos = ctx + rows
    acc, m, l = _attend_tiles(acc, m, l, q, q_pos, k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row, 0, unmasked_hi,
                              k_len, dims, kv_head, scale_log2, stride_block, stride_slot, stride_head, BLOCK_SIZE,
                              BLOCK_N, False, DOT_PRECISION, TMA)
    return _attend_tiles(acc, m, l, q, q_pos, k_cache_ptr, v_cache_ptr, k_desc, v_desc, bt_row, unmasked_hi, hi, k_len,
                         dims, kv_head, scale_log2, stride_block, stride_slot, stride_head, BLOCK_SIZE, BLOCK_N, True,
                         DOT_PRECISION, TMA)


# A mixed step passes the prompts' lengths and block tables as views that start past its decode
# rows: specialising their addresses' alignment would compile a variant for each offset class.
@triton.jit(do_not_specialize=["cu_seqlens_q_ptr", "cu_seqlens_k_ptr", "block_tables_ptr"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_desc,
    v_desc,
    out_ptr,
    cu_seqlens_q_ptr,
    cu_seqlens_k_ptr,
    block_tables_ptr,
    scale_log2,
    q_stride_tok,
    q_stride_head,
    o_stride_tok,
    o_stride_head,
    kv_stride_block,
    kv_stride_slot,
    kv_stride_head,
    bt_stride,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - tl.load(cu_seqlens_k_ptr + seq)
    # Query row i is token ctx + i of the sequence (cached prefix or earlier chunks come first).
    ctx = k_len - q_len
    kv_head = head // GROUP

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, HEAD_DIM)
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * q_stride_tok + head * q_stride_head + dims[None, :],
                mask=row_mask[:, None], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * bt_stride
    acc, m, l = _attend_causal(acc, m, l, q, rows, m_block, ctx, k_len, k_cache_ptr, v_cache_ptr, k_desc, v_desc,
                               bt_row, dims, kv_head, scale_log2, kv_stride_block, kv_stride_slot, kv_stride_head,
                               BLOCK_SIZE, BLOCK_M, BLOCK_N, DOT_PRECISION, TMA)

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * o_stride_tok + head * o_stride_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def decode_num_splits(
    batch: int, num_kv_heads: int, device: torch.device, max_seqlen_k: int | None = None
) -> int:
    """KV splits per sequence: with fewer programs than SMs, enough to keep every SM busy; with
    fewer than ``_SPLIT_BELOW_PROGRAMS_PER_SM`` an SM, ``_BALANCE_SPLITS``, so that unequal contexts
    end together; none shorter than ``_MIN_SPLIT_TOKENS`` when the longest context is known. A power
    of two (fewer compiled variants); depends on host values only, so a captured graph keeps one
    split count."""
    programs, sms = batch * num_kv_heads, sm_count(device)
    if programs >= _SPLIT_BELOW_PROGRAMS_PER_SM * sms:
        splits = 1
    elif programs < sms:
        splits = triton.cdiv(_FILL_PROGRAMS_PER_SM * sms, max(programs, 1))
    else:
        splits = _BALANCE_SPLITS
    if max_seqlen_k is not None:
        splits = min(splits, triton.cdiv(max_seqlen_k, _MIN_SPLIT_TOKENS))
    splits = max(1, min(splits, _MAX_SPLITS))
    return 1 << (splits - 1).bit_length()


def _decode_tile(batch: int, num_kv_heads: int, num_splits: int, device: torch.device) -> int:
    """Keys per step of the decode kernel: the larger tile once unsplit programs are many enough."""
    return 128 if num_splits == 1 and batch * num_kv_heads >= _LARGE_TILE_PROGRAMS_PER_SM * sm_count(device) else 64


def _launches_first(batch: int) -> bool:
    """Whether the decode kernels let the next kernel launch before they wait: a batch this small
    runs its products through kernels.gemv, whose programs load their weights before their wait, so
    o_proj's weights stream during attention (batch 1, H100: decode steps 0.842 -> 0.813 ms;
    docs/performance.md). Attention from qkv with more than one split then also reads its first K/V
    tile before its wait (``_preloads``), whose registers (167 a thread against 88 at 4 warps when
    measured; it launches at ``_PRELOAD_WARPS``) a larger grid would pay for in occupancy; without
    PDL (the CPU, GPUs before Hopper) that path only orders its loads so. One rule for the launches
    and for the variants warmed at start-up."""
    return batch <= gemv.MAX_ROWS


def _preloads(batch: int, num_splits: int) -> bool:
    """Whether decode attention from qkv reads its first K/V tile before its wait (``PRELOAD``), which
    gives the new token a split of its own: at the batches that launch first, with splits."""
    return _launches_first(batch) and num_splits > 1


def decode_batches(max_batch: int, num_kv_heads: int, device: torch.device) -> list[int]:
    """The fewest rows of each kernel variant (split count, tile, launching the next kernel first)
    that ``decode_attention`` runs, without a length hint, for 1 to ``max_batch`` rows: a call at each
    compiles them all."""
    batches, seen = [], set()
    for batch in range(1, max_batch + 1):
        splits = decode_num_splits(batch, num_kv_heads, device)
        variant = (splits, _decode_tile(batch, num_kv_heads, splits, device), _launches_first(batch))
        if variant not in seen:
            seen.add(variant)
            batches.append(batch)
    return batches


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    num_heads, head_dim = q.shape[-2:]
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape and cache_head_dim == head_dim
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, "head_dim must be a power of two >= 16"
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "block size must be a power of two >= 16"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    # The prefill and partial kernels address a tile's K and V with one set of strides.
    assert k_cache.stride() == v_cache.stride(), "the K and V caches must share their strides"
    return num_heads // num_kv_heads, block_size, num_kv_heads


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tests want fp32 products; tf32 would add ~1e-3 error. Other dtypes ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """One query token per sequence: ``q [B, H, D]`` over its ``context_lens[i]`` cached tokens.

    Rows with context length 0 (CUDA-graph padding) produce zeros. ``max_seqlen_k`` (a host int, an
    upper bound) only limits the split count; ``num_splits`` forces one (a power of two <= 16).
    No host-device synchronisation: safe to capture in a CUDA graph."""
    _check_cache(q, k_cache, v_cache)
    return _launch_decode(q, q.stride(1), q.shape[1], k_cache, v_cache, context_lens, block_tables, scale,
                          max_seqlen_k=max_seqlen_k, num_splits=num_splits, out=out, tile=tile, num_warps=num_warps,
                          num_stages=num_stages)


def decode_attention_from_qkv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``norm_rope_store`` followed by ``decode_attention``, without the kernel in between.

    ``qkv [B, (H + 2*KVH) * D]`` holds each sequence's new token, at ``positions`` (its context
    length minus one) and ``slot_mapping``. Each attention program normalises and rotates the query
    heads of its group; the program whose range holds the new token (at a batch of one with splits,
    a split of its own) also stores its K/V. Results match the two kernels run one after the other
    (at that batch of one up to rounding: its splits hold other tiles). Returns ``[B, H, D]``."""
    num_heads = check_qkv(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    head_dim = k_cache.shape[3]
    _check_cache(qkv.view(qkv.shape[0], -1, head_dim)[:, :num_heads], k_cache, v_cache)  # the query heads
    return _launch_decode(qkv, head_dim, num_heads, k_cache, v_cache, context_lens, block_tables, scale,
                          rope=(positions, slot_mapping, q_norm_weight, k_norm_weight, eps, cos_sin_cache),
                          num_splits=num_splits, out=out)


def _launch_decode(
    q: torch.Tensor,
    q_stride_head: int,
    num_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    rope: tuple | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tile: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """The decode kernel (and the split reduction) for ``q`` rows, or qkv rows when ``rope`` holds
    ``(positions, slot_mapping, q_norm_weight, k_norm_weight, eps, cos_sin_cache)``."""
    batch = q.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, q.device, max_seqlen_k)
    assert 1 <= num_splits <= _MAX_SPLITS and num_splits & (num_splits - 1) == 0
    tile = tile or _decode_tile(batch, num_kv_heads, num_splits, q.device)
    pdl = launch_pdl(q.device)
    small_batch = _launches_first(batch)
    launch_first = pdl and small_batch
    if num_splits > 1:
        part_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the single-split variant
    # Without rope the rotary arguments are never read: any tensor stands in.
    positions, slot_mapping, q_norm_weight, k_norm_weight, eps, cos_sin_cache = (
        rope or (context_lens, context_lens, out, out, 0.0, out))
    preload = rope is not None and _preloads(batch, num_splits)
    records, clocked = program_slots("decode attention" + (" from qkv" if rope else ""),
                                     batch * num_kv_heads * num_splits, batch, out)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, context_lens, block_tables,
        scale * _LOG2E,
        q.stride(0), q_stride_head, out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        positions, slot_mapping, q_norm_weight, k_norm_weight, cos_sin_cache, eps, cos_sin_cache.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE=tile,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(q.dtype),
        FROM_QKV=rope is not None,
        PDL=pdl,
        LAUNCH_FIRST=launch_first,
        PRELOAD=preload,
        clock_ptr=records,
        CLOCK=clocked,
        num_warps=_PRELOAD_WARPS if preload else num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    if num_splits > 1:
        # At the batches that launch first (one row) its programs, one a head, are all the GPU runs
        # between attention and o_proj: 4 warps took batch-1 steps to 0.708-0.709 ms against
        # 0.710-0.715 (four pairs, H100, 0.6B); at 16 rows they lost 1.3%, so larger batches keep 1-2.
        reduce_warps = 4 if small_batch else 1 if head_dim <= 64 else 2
        records, clocked = program_slots("decode split reduction", batch * num_heads, batch, out)
        _decode_reduce_kernel[(batch, num_heads)](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, PDL=pdl, LAUNCH_FIRST=launch_first, clock_ptr=records,
            CLOCK=clocked, num_warps=reduce_warps, launch_pdl=pdl,
        )
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_seqlen_q: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    tma: bool | None = None,
) -> torch.Tensor:
    """Ragged prefill: ``q [total_q, H, D]``; sequence i owns ``q[cu_q[i]:cu_q[i+1]]`` and attends to
    its first ``cu_k[i+1]-cu_k[i]`` cached tokens through ``block_tables[i]`` (K/V already stored),
    causal mask aligned to the end. Pass ``max_seqlen_q`` (host int, an upper bound) to avoid the
    one device-to-host read that sizes the grid. ``tma``: load whole K/V tiles through tensor
    descriptors (default: on Hopper, for at least ``TMA_MIN_QUERIES`` queries, where the caches allow
    it, ``_tma_fits``)."""
    total_q, num_heads, head_dim = q.shape
    group, block_size, _ = _check_cache(q, k_cache, v_cache)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens_q.numel() - 1
    if total_q == 0 or num_seqs == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m = block_m or 64
    block_n = block_n or 64
    if tma is None:
        tma = (total_q >= TMA_MIN_QUERIES and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 9
               and _tma_fits(k_cache, v_cache, block_n))
    elif tma and not _tma_fits(k_cache, v_cache, block_n):
        raise ValueError(f"tma needs contiguous 16-bit caches whose blocks of {block_size} tokens hold whole tiles "
                         f"of {block_n} keys")
    k_desc, v_desc = (_kv_descriptor(k_cache, block_n), _kv_descriptor(v_cache, block_n)) if tma else (k_cache, v_cache)
    grid = (triton.cdiv(max_seqlen_q, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, out, cu_seqlens_q, cu_seqlens_k, block_tables,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype),
        TMA=tma,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _tma_fits(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    # A tile is one descriptor load of rows of the cache seen as [blocks x block_size, heads x head_dim].
    # Measured with 16-bit caches only; float32 ones (the labs' --dtype float32) keep pointer loads.
    return (k_cache.element_size() == 2 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.shape[1] % block_n == 0)


def _kv_descriptor(cache: torch.Tensor, block_n: int) -> TensorDescriptor:
    rows = cache.view(-1, cache.shape[2] * cache.shape[3])
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_n, cache.shape[3]])


__all__ = ["decode_attention", "decode_attention_from_qkv", "decode_batches", "decode_num_splits", "prefill_attention"]
