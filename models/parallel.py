"""Tensor-parallel rank and size, read from torch.distributed so layers need no extra arguments.

Without an initialised process group every layer behaves as the single rank of a group of one.
"""

from __future__ import annotations

import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def check_shape(loaded: tuple[int, ...], expected: tuple[int, ...]) -> None:
    """Weight loaders call this before narrowing: a too-large tensor would otherwise narrow silently."""
    if tuple(loaded) != tuple(expected):
        raise ValueError(f"expected shape {tuple(expected)}, got {tuple(loaded)}")
