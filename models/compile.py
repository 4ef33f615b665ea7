"""``torch.compile`` where it pays: on CUDA, each RMSNorm's chain of small elementwise ops (with the
residual add before it) becomes one fused kernel instead of a dozen launches per layer. On the CPU
the plain function runs: compiling would cost start-up time for no gain on the test path."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def fused_on_cuda(fn: F) -> F:
    """Run ``fn`` compiled when its first tensor argument is on CUDA, eagerly otherwise."""
    compiled = torch.compile(fn, dynamic=True)  # compiles on first use, once for all batch sizes

    @functools.wraps(fn)
    def wrapper(*args):
        tensor = next(a for a in args if isinstance(a, torch.Tensor))
        return compiled(*args) if tensor.is_cuda else fn(*args)

    return wrapper  # type: ignore[return-value]
