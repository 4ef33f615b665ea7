"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode layer is a chain of small kernels, each waiting for the one before it: in a CUDA graph
every boundary still costs the next kernel's launch, its programs' start-up and the previous
kernel's drain, a few microseconds against a 0.6B layer's ~10 us of weight reads (docs/performance.md,
#29). Launched with PDL, a kernel's programs start while the previous kernel is still running. Each
kernel here does only work that reads no earlier kernel's output before ``gdc_wait`` (which returns
once the previous grid has finished and its writes are visible), then lets the next kernel launch
(``gdc_launch_dependents``). The skinny GEMM uses that window to start its weights on their way to
L2 (``PREFETCH_WEIGHTS``), so a layer's weight stream need not stop at each boundary; at a batch of
one, ``kernels.gemv`` loads its whole slice of weights into registers there, and it and decode
attention let the next kernel launch before they wait, so that the next product's weights stream
during this kernel's wait as well.

Every program of a kernel launched with PDL reaches the wait (none returns early) before it touches
memory another kernel writes, so a kernel's completion implies its predecessors': ordering stays
transitive along the chain. Kernels launched without PDL (cuBLAS, torch's own, the all-reduce's
barrier) keep the ordinary full dependency. The kernels launch this way wherever they run (prefill
and mixed steps too), but only decode-sized steps are chains of such short kernels.
`tests/test_pdl.py` checks the compiled PTX for memory accesses before the wait.
"""

from __future__ import annotations

import functools

import torch

# ``experiments/floor_bench.py --pdl`` switches these off to time the path without them; kernels
# read them when launched, so a CUDA graph keeps what was set when it was captured.
ENABLED = True
PREFETCH_WEIGHTS = True


@functools.cache
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_pdl(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` now use PDL (CUDA, compute capability 9.0 or later)."""
    if not ENABLED or device.type != "cuda":
        return False
    return _supported(torch.cuda.current_device() if device.index is None else device.index)
