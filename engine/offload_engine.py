"""CPU-primary KV (seed 004's ``enable_cpu_offload``): every KV block lives in host memory, and the GPU
keeps only a ring of block-sized slots that the KV streams through, so that one GPU serves contexts
far larger than its KV memory (the seed's ``OffloadEngine``).

A step computes one request's tokens (the scheduler runs one request per step in this mode):

- a prefill chunk writes its K/V to ``w`` consecutive slots, the *write window*, which moves on by
  ``w`` slots chunk after chunk (seed 004: chunk K in slot K % N); the other slots, in ring order
  after the window, are the *load slots*;
- a decode writes its token's K/V to the *decode slot* (slot 0) and loads through slots 1..N-1:
  running requests take turns (one token a step each), and the slot never outlives a step, so
  several requests share it without swapping anything.

Attention, layer by layer, is done in parts merged by log-sum-exp (``kernels.ring_attention``): the
chunk over its own tokens (causal), then the request's earlier blocks, a *group* at a time. A slot
holds a block for every layer, but a load slot only stages what attention reads next, so the loads
use each load slot's every layer as a *unit* of one layer's K/V of one block: a group is one layer's
K/V of up to half the load units (double buffering: one half is attended while the other fills; with
one unit, single buffering). A 36-slot ring decoding a 32k context thus streams each layer's 128
earlier blocks as one group instead of eight, and the host issues eight times fewer launches and
waits a step (~200 us of host time a group) and half the copies (a group's units span four layers).
The groups of every layer form one stream: groups 0 and 1 are copied in when the step begins, and
group ``i + 2`` as soon as group ``i``'s attention releases its half, so copies run ahead of
attention across layer boundaries; on the GPU each group's attention waits only for its own copy
event. After the forward the chunk's K/V goes down to its host blocks, and the step lands when that
copy has, so the next step's loads read it (this mode schedules synchronously).

Both pools keep a layer's K and V of a block side by side (``[layers, blocks, 2, block_size,
kv_heads, head_dim]``), so a group's copy is one ``cudaMemcpyAsync`` per run of consecutive host
blocks and units. The host pool is pinned by registering it with CUDA rather than allocating it
from torch's pinned-memory cache, which would record and poll an event for every copy.

Every block is loaded whole, once per layer per step: the bytes a step moves are its earlier blocks
times the block size, the figure the lab checks. Each copy and each wait is timed (CUDA events on
the GPU, the host clock on the CPU, where copies are synchronous and hide nothing) and published as
``ring_transfer`` and ``ring_step`` events once the step has landed.
"""

from __future__ import annotations

import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.events import EventBus, RingStep, RingTransfer
from engine.kv_transfer import runs
from engine.sequence import Sequence

DECODE_SLOT = 0


def chunk_limit(num_slots: int, block_size: int, max_num_batched_tokens: int) -> int:
    """The most tokens one prefill chunk takes: the budget, and at most every slot but two (one when
    the ring has two), so that the load slots can double-buffer. Block-aligned when it can be, so that
    chunks start on block boundaries."""
    window = max(1, num_slots - 2) * block_size
    limit = min(max_num_batched_tokens, window)
    return limit // block_size * block_size if limit >= block_size else limit


@dataclass(slots=True)
class _Group:
    layer: int
    half: int  # which half of the load units it is copied into
    cpu_block_ids: list[int]
    num_tokens: int  # keys in those blocks (a decode's last earlier block may be partial)
    # Measurements: markers (CUDA events, or host clock readings on the CPU). ``ready`` is when the
    # compute stream reached the group (it had finished the work before it) and ``wait_end`` when its
    # copy let it go on.
    copy_start: object = None
    copy_end: object = None
    ready: object = None
    wait_end: object = None


@dataclass(slots=True)
class _Step:
    seq_id: int
    phase: str
    start: int  # the first position computed; the tokens before it stream in from host memory
    num_tokens: int
    write_slots: list[int]
    load_slots: list[int]
    halves: list[list[int]]  # the load units of each half (unit: ``layer * num_slots + slot``)
    groups: list[_Group]
    by_layer: list[list[int]]  # group indices of each layer
    # (slot, offset, host block, offset, tokens): whole blocks are runs of several (offsets 0, tokens
    # a multiple of the block size), a partial block one.
    offloads: list[tuple[int, int, int, int, int]]
    cpu_block_ids: list[int]  # per write slot, the host block its first token goes to
    slot_mapping: torch.Tensor  # ring position of each of the chunk's tokens
    tables: torch.Tensor  # rows: the write window's slots, then each half's units
    began: object = None
    offload_start: object = None
    offload_end: object = None
    forward_end: object = None
    layer_marks: list[tuple[object, object]] = field(default_factory=list)
    issued: int = 0  # groups whose copies were issued
    # Each group's part of the attention, reused group after group (the merge reads it before the
    # next part is written: one stream).
    part: torch.Tensor | None = None
    part_lse: torch.Tensor | None = None


def _pin(host: torch.Tensor, owner: object) -> None:
    """Page-lock ``host`` for asynchronous copies until ``owner`` is collected (the finalizer holds
    ``host``, so it is unregistered before it can be freed)."""
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {cudart.cudaGetErrorString(error)}")
    weakref.finalize(owner, lambda pinned: cudart.cudaHostUnregister(pinned.data_ptr()), host)


class OffloadEngine:
    """The ring (``ring``: ``[layers, slots, 2, block_size, kv_heads, head_dim]`` on the device) and the
    host pool (``host``: the same layout with ``cpu_blocks``, in host memory; pinned here on CUDA), and
    one step at a time through them. ``forward_layer`` is what each attention layer calls
    (``models.context.Context.ring``)."""

    def __init__(self, ring: torch.Tensor, host: torch.Tensor, events: EventBus) -> None:
        self.ring = ring
        self.host = host
        self.events = events
        self.num_layers, self.num_slots, self.block_size = ring.shape[0], ring.shape[1], ring.shape[3]
        self.cuda = ring.device.type == "cuda"
        if self.cuda:
            _pin(host, self)
        # Views made once: indexing on the hot path costs the host a few microseconds a view.
        self._ring_layers = list(ring.unbind(0))
        self._host_layers = list(host.unbind(0))
        self._units = ring.view(self.num_layers * self.num_slots, *ring.shape[2:])  # [units, 2, bs, kvh, hd]
        self._unit_k, self._unit_v = self._units[:, 0], self._units[:, 1]
        self.token_bytes = ring[:, 0, :, 0].numel() * ring.element_size()  # one token, every layer, K and V
        self.layer_block_bytes = ring[0, 0].numel() * ring.element_size()  # one layer of one block, K and V
        self.copy_stream = torch.cuda.Stream(ring.device) if self.cuda else None
        # The compute stream, looked up once a step: ``current_stream()`` costs the host ~10 us a call.
        self._compute: torch.cuda.Stream | None = None
        self._last_compute: object = None  # the latest marker on the compute stream
        # Timing events, made once and recorded again step after step (a step lands, and is read,
        # before the next begins): a new CUDA event costs the host more than recording one.
        self._event_pool: list[torch.cuda.Event] = []
        self._events_used = 0
        self._cursor = 0  # where the next prefill chunk's write window starts
        self._released: list[object] = [None, None]  # per half: the attention that last read it
        self.step: _Step | None = None
        self.slot_blocks = [-1] * self.num_slots  # the host block each slot received last, in any layer

    # --- planning -------------------------------------------------------------------------------

    def plan(self, seq: Sequence, phase: str) -> _Step:
        """Slots, groups and copies for ``seq``'s scheduled tokens (a chunk, or one decode token)."""
        bs, n = self.block_size, seq.num_scheduled_tokens
        start = seq.num_cached_tokens if phase == "prefill" else seq.num_tokens - 1
        if phase == "prefill":
            w = -(-n // bs)
            write = [(self._cursor + j) % self.num_slots for j in range(w)]
            self._cursor = (self._cursor + w) % self.num_slots
            load = [(write[-1] + 1 + j) % self.num_slots for j in range(self.num_slots - w)]
        else:
            write = [DECODE_SLOT]
            load = [s for s in range(self.num_slots) if s != DECODE_SLOT]
        units = [layer * self.num_slots + slot for layer in range(self.num_layers) for slot in load]
        half = len(units) // 2
        halves = [units[:half], units[half:2 * half]] if half else [units]
        earlier_blocks = -(-start // bs)
        earlier = seq.block_table[:earlier_blocks]
        groups, by_layer = [], []
        size = len(halves[0])
        for layer in range(self.num_layers):
            by_layer.append([])
            for first in range(0, earlier_blocks, size):
                ids = earlier[first:first + size]
                by_layer[-1].append(len(groups))
                groups.append(_Group(layer, len(groups) % len(halves), ids, min(start - first * bs, len(ids) * bs)))
        # Chunk token j sits in slot write[j // bs] at offset j % bs and belongs in host block
        # table[(start + j) // bs] at offset (start + j) % bs.
        j = np.arange(n)
        ring_pos = np.asarray(write)[j // bs] * bs + j % bs
        host_pos = np.asarray(seq.block_table)[(start + j) // bs] * bs + (start + j) % bs
        offloads = []
        for ring0, host0, length in runs(ring_pos.tolist(), host_pos.tolist()):
            while length:  # split where either side crosses a block boundary
                piece = min(length, bs - ring0 % bs, bs - host0 % bs)
                if ring0 % bs or host0 % bs or piece < bs:
                    offloads.append((ring0 // bs, ring0 % bs, host0 // bs, host0 % bs, piece))
                else:  # whole blocks: as many as the run holds
                    piece = length // bs * bs
                    offloads.append((ring0 // bs, 0, host0 // bs, 0, piece))
                ring0, host0, length = ring0 + piece, host0 + piece, length - piece
        written = [seq.block_table[(start + k * bs) // bs] for k in range(len(write))]
        slot_mapping = torch.from_numpy(ring_pos.astype(np.int64))
        tables = np.full((1 + len(halves), max(len(write), size, 1)), -1, dtype=np.int32)
        for row, slots in enumerate([write, *halves]):
            tables[row, :len(slots)] = slots
        tables = torch.from_numpy(tables)
        if self.cuda:
            device = self.ring.device
            slot_mapping = slot_mapping.pin_memory().to(device, non_blocking=True)
            tables = tables.pin_memory().to(device, non_blocking=True)
        return _Step(seq.seq_id, phase, start, n, write, load, halves, groups, by_layer, offloads, written,
                     slot_mapping, tables)

    # --- the step on the device ----------------------------------------------------------------

    def _mark(self, stream: torch.cuda.Stream | None = None) -> object:
        if not self.cuda:
            return time.perf_counter()
        if self._events_used == len(self._event_pool):
            self._event_pool.append(torch.cuda.Event(enable_timing=True))
        event = self._event_pool[self._events_used]
        self._events_used += 1
        event.record(stream or self._compute)
        return event

    def _compute_mark(self) -> object:
        self._last_compute = self._mark()
        return self._last_compute

    def begin(self, step: _Step) -> None:
        """Start the step: its first groups' copies go out before the forward begins."""
        self.step = step
        self._events_used = 0
        if self.cuda:
            self._compute = torch.cuda.current_stream()
        step.began = self._compute_mark()
        if self.cuda:
            self.copy_stream.wait_stream(self._compute)  # the previous step is done with the slots
        step.layer_marks = [(None, None)] * self.num_layers
        for _ in range(min(len(step.halves), len(step.groups))):
            self._issue()

    def _issue(self) -> None:
        """Copy the next group's blocks (one layer of each) into its half of the load units."""
        step = self.step
        index = step.issued
        step.issued += 1
        group = step.groups[index]
        units = step.halves[group.half][:len(group.cpu_block_ids)]
        stream = self.copy_stream
        if self.cuda:
            released = self._released[group.half]
            if released is not None:
                stream.wait_event(released)  # the half's last attention has read it
        group.copy_start = self._mark(stream)
        ring, host = self._units, self._host_layers[group.layer]
        with torch.cuda.stream(stream) if self.cuda else nullcontext():
            for cpu0, unit0, length in runs(group.cpu_block_ids, units):
                ring[unit0:unit0 + length].copy_(host[cpu0:cpu0 + length], non_blocking=True)
        group.copy_end = self._mark(stream)
        for unit, block in zip(units, group.cpu_block_ids):
            self.slot_blocks[unit % self.num_slots] = block

    def forward_layer(self, attention, qkv: torch.Tensor, positions: torch.Tensor, q_norm, k_norm,
                      cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """One attention layer of the step (called by ``models.attention.Attention``): store the new
        K/V in the write window, attend to it, then to each group of earlier blocks as it lands."""
        step, backend, layer = self.step, attention.backend, attention.layer_index
        k_cache, v_cache = attention.k_cache, attention.v_cache
        n = step.num_tokens
        q = backend.norm_rope_store(qkv, positions, q_norm.weight, k_norm.weight, q_norm.eps, cos_sin_cache,
                                    k_cache, v_cache, step.slot_mapping)
        q = q.view(n, attention.num_heads, attention.head_dim)
        began = self._compute_mark()
        out, lse = backend.partial(q, k_cache, v_cache, step.tables[0], n, attention.scale, True)
        self._compute_mark()  # the first group's wait starts here
        if step.part is None and step.groups:
            step.part, step.part_lse = torch.empty_like(out), torch.empty_like(lse)
        tables, scale = step.tables, attention.scale
        for index in step.by_layer[layer]:
            group = step.groups[index]
            group.ready = self._last_compute
            if self.cuda:
                self._compute.wait_event(group.copy_end)
            group.wait_end = self._mark()
            backend.partial(q, self._unit_k, self._unit_v, tables[1 + group.half], group.num_tokens, scale, False,
                            out=step.part, lse=step.part_lse)
            backend.merge(out, lse, step.part, step.part_lse)
            self._released[group.half] = self._compute_mark()
            if step.issued < len(step.groups):
                self._issue()
        step.layer_marks[layer] = (began, self._compute_mark())
        return out.to(q.dtype).reshape(n, attention.num_heads * attention.head_dim)

    def end(self) -> object:
        """After the forward (and the sampler, on the current stream): copy the computed K/V down to
        the host blocks. Returns what the step's landing waits for (a CUDA event; None on the CPU)."""
        step = self.step
        step.forward_end = self._compute_mark()
        stream = self.copy_stream
        if self.cuda:
            stream.wait_stream(self._compute)
        step.offload_start = self._mark(stream)
        bs = self.block_size
        with torch.cuda.stream(stream) if self.cuda else nullcontext():
            # Per layer, contiguous on both sides: whole blocks K and V together, a partial block's
            # tokens K and V apart (a strided copy would go through a host-side temporary and block).
            for slot, offset, block, host_offset, length in step.offloads:
                for ring, host in zip(self._ring_layers, self._host_layers):
                    if offset == host_offset == 0 and length % bs == 0:
                        host[block:block + length // bs].copy_(ring[slot:slot + length // bs], non_blocking=True)
                        continue
                    for kv in (0, 1):
                        host[block, kv, host_offset:host_offset + length].copy_(
                            ring[slot, kv, offset:offset + length], non_blocking=True)
        step.offload_end = self._mark(stream)
        for slot, block in zip(step.write_slots, step.cpu_block_ids):
            self.slot_blocks[slot] = block
        return step.offload_end if self.cuda else None

    # --- after the step landed -------------------------------------------------------------------

    def _seconds(self, a: object, b: object) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1e3
        return b - a

    def landed(self) -> None:
        """The step's copies have all completed: publish what it moved and when."""
        step, self.step = self.step, None
        self._released = [None, None]
        if step is None or not self.events.active:
            return
        began, seconds, events = step.began, self._seconds, self.events
        load_s = wait_s = 0.0
        for group in step.groups:
            copy_s = seconds(group.copy_start, group.copy_end)
            # On the CPU a copy is done when issued: attention waited for all of it.
            waited = max(0.0, seconds(group.ready, group.wait_end)) if self.cuda else copy_s
            load_s += copy_s
            wait_s += waited
            events.emit(RingTransfer, request_id=step.seq_id, direction="CPU_to_GPU", layer=group.layer,
                        slots=tuple(unit % self.num_slots for unit in step.halves[group.half][:len(group.cpu_block_ids)]),
                        cpu_block_ids=tuple(group.cpu_block_ids),
                        num_bytes=len(group.cpu_block_ids) * self.layer_block_bytes,
                        start_s=seconds(began, group.copy_start), end_s=seconds(began, group.copy_end),
                        waited_s=waited)
        offload_s = seconds(step.offload_start, step.offload_end)
        offloaded = step.num_tokens * self.token_bytes
        events.emit(RingTransfer, request_id=step.seq_id, direction="GPU_to_CPU", layer=-1,
                    slots=tuple(step.write_slots), cpu_block_ids=tuple(step.cpu_block_ids), num_bytes=offloaded,
                    start_s=seconds(began, step.offload_start), end_s=seconds(began, step.offload_end), waited_s=0.0)
        events.emit(RingStep, request_id=step.seq_id, phase=step.phase, num_tokens=step.num_tokens,
                    context_tokens=step.start, write_slots=tuple(step.write_slots),
                    load_slots=tuple(step.load_slots), slot_blocks=tuple(self.slot_blocks),
                    loaded_bytes=sum(len(g.cpu_block_ids) for g in step.groups) * self.layer_block_bytes,
                    offloaded_bytes=offloaded, load_s=load_s, wait_s=wait_s, offload_s=offload_s,
                    compute_s=seconds(began, step.forward_end), merges=len(step.groups),
                    layer_attention_start_s=tuple(seconds(began, a) for a, _ in step.layer_marks),
                    layer_attention_end_s=tuple(seconds(began, b) for _, b in step.layer_marks))

