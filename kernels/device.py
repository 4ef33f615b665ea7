"""What the kernels' launch heuristics ask of the device they launch on."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the CPU (Triton's interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
