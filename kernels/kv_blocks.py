"""Triton gather and scatter of whole KV blocks between the decode-layout pool and block-contiguous
staging: the GPU side of the host tier's copies (``engine.kv_transfer``).

The pool is ``[2, layers, blocks, block_size, kv_heads, head_dim]``, so a block is ``2 x layers``
pieces of ``block_size x kv_heads x head_dim`` elements (32 KiB in bf16 on the Qwen3 presets), each
contiguous, one ``blocks`` stride apart; staging rows hold a block's pieces back to back, for all
layers or for a range of them (the host tier copies a block in layer groups, so that a step can
start on the first layers while the last are still on the link). The torch
way, ``index_select``/``index_copy_`` on the pool's ``movedim(2, 0)`` view, indexes every element
through that six-dimensional view: on an H100 it moved a 16-block store's bytes at about 200 GB/s,
a quarter of the job's time beside the link's copy. Here each program copies ``BLOCK`` contiguous
elements of one piece, its addresses computed once per program.

Same contract as ``gather_blocks_ref`` and ``scatter_blocks_ref``, except that ids out of range are
not caught (the references raise; the engine's ids come from its own block tables and staging
slots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


# The number of blocks changes with every job, the layers with every group: specialising them would
# compile new variants mid-run.
@triton.jit(do_not_specialize=["num_copies", "first_layer", "num_layers"])
def _copy_blocks_kernel(
    pool_ptr,
    staging_ptr,
    ids_ptr,
    num_copies,
    first_layer,
    num_layers,
    kv_stride,
    layer_stride,
    piece_numel,
    GATHER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program: BLOCK elements of piece ``piece`` (K or V of one layer) of copy ``copy`` (pool
    # block ids[copy], staging row ids[num_copies + copy]).
    pieces_per_block = 2 * num_layers
    copy = tl.program_id(0) // pieces_per_block
    piece = tl.program_id(0) % pieces_per_block
    kv = piece // num_layers
    layer = first_layer + piece % num_layers
    block = tl.load(ids_ptr + copy).to(tl.int64)
    row = tl.load(ids_ptr + num_copies + copy).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < piece_numel
    in_pool = pool_ptr + kv.to(tl.int64) * kv_stride + layer.to(tl.int64) * layer_stride + block * piece_numel + cols
    in_staging = staging_ptr + (row * pieces_per_block + piece) * piece_numel + cols
    if GATHER:
        tl.store(in_staging, tl.load(in_pool, mask=mask), mask=mask)
    else:
        tl.store(in_pool, tl.load(in_staging, mask=mask), mask=mask)


def block_shape(kv_cache: torch.Tensor, layers: range | None = None) -> tuple[int, ...]:
    """One block of the pool as a staging row holds it, for all its layers or for ``layers``:
    ``[2, len(layers), block_size, kv_heads, head_dim]``."""
    return (2, kv_cache.shape[1] if layers is None else len(layers), *kv_cache.shape[3:])


def _launch(kv_cache: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor, layers: range | None,
            gather: bool) -> None:
    if not (kv_cache.is_contiguous() and staging.is_contiguous()):
        raise ValueError("kv_cache and staging must be contiguous")
    if kv_cache.dim() != 6 or kv_cache.shape[0] != 2:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [2, layers, blocks, block_size, kv_heads, head_dim]")
    layers = range(kv_cache.shape[1]) if layers is None else layers
    if layers.step != 1 or not layers or layers.start < 0 or layers.stop > kv_cache.shape[1]:
        raise ValueError(f"layers {layers} must be a non-empty run of the pool's {kv_cache.shape[1]} layers")
    row = block_shape(kv_cache, layers)
    if tuple(staging.shape[1:]) != row or staging.dtype != kv_cache.dtype:
        raise ValueError(f"staging {tuple(staging.shape)} {staging.dtype} must be [rows, {', '.join(map(str, row))}] "
                         f"{kv_cache.dtype}")
    if staging.device != kv_cache.device:
        raise ValueError(f"staging is on {staging.device}, kv_cache on {kv_cache.device}: both must be on one device")
    if ids.dim() != 2 or ids.shape[0] != 2 or ids.device != kv_cache.device or ids.dtype != torch.int64:
        raise ValueError(f"ids {tuple(ids.shape)} {ids.dtype} must be int64 [2, n] on {kv_cache.device}: pool blocks, "
                         "then staging rows")
    num_copies = ids.shape[1]
    if num_copies == 0:
        return
    piece_numel = kv_cache[0, 0, 0].numel()
    grid = (num_copies * 2 * len(layers), triton.cdiv(piece_numel, BLOCK))
    _copy_blocks_kernel[grid](kv_cache, staging, ids.contiguous(), num_copies, layers.start, len(layers),
                              kv_cache.stride(0), kv_cache.stride(1), piece_numel, GATHER=gather, BLOCK=BLOCK,
                              num_warps=8)


def gather_blocks(kv_cache: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor, layers: range | None = None) -> None:
    """``staging[ids[1, i]] = block ids[0, i]`` of ``kv_cache`` (its ``layers``, default all), each as
    ``[2, len(layers), block_size, kv_heads, head_dim]``. The rows must be distinct (two blocks
    written to one row race)."""
    _launch(kv_cache, staging, ids, layers, gather=True)


def scatter_blocks(kv_cache: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor, layers: range | None = None) -> None:
    """Block ``ids[0, i]`` of ``kv_cache`` (its ``layers``) = ``staging[ids[1, i]]``: ``gather_blocks``
    backwards. The blocks must be distinct (two rows written to one block race)."""
    _launch(kv_cache, staging, ids, layers, gather=False)
