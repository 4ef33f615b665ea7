"""CPU-offload mode's Prometheus series (``glassbox:``; vLLM has no such mode), from ``ring_step``
events: what streamed through the GPU ring each way, how long the copies took, how long attention
waited for them, and so the share of the load time hidden behind compute."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.events import TRANSFER_TYPES, RingStep


class RingMetrics:
    """The ring's series of one engine in ``registry``, labelled ``labels`` (names, values)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        names, values = list(labels), list(labels.values())
        moved = Counter("glassbox:ring_bytes", "KV bytes copied through the CPU-offload ring: CPU_to_GPU "
                        "loads of earlier blocks, GPU_to_CPU the new tokens' K/V.", [*names, "direction"],
                        registry=registry)
        busy = Counter("glassbox:ring_transfer_seconds", "Time the copy engine spent on the ring's copies "
                       "(device time).", [*names, "direction"], registry=registry)
        self.bytes = {d: moved.labels(*values, d) for d in TRANSFER_TYPES}
        self.seconds = {d: busy.labels(*values, d) for d in TRANSFER_TYPES}
        self.wait = Counter("glassbox:ring_wait_seconds", "Time attention stood waiting for a ring load "
                            "(the part of the load time not hidden behind compute).", names,
                            registry=registry).labels(*values)
        self.merges = Counter("glassbox:ring_merges", "Partial attention results merged by log-sum-exp.", names,
                              registry=registry).labels(*values)
        self.hidden = Gauge("glassbox:ring_hidden_ratio", "Share of the ring's load time hidden behind compute, "
                            "since the start (0 on the CPU, where copies block).", names,
                            registry=registry).labels(*values)
        self._load_s = self._hidden_s = 0.0

    def step(self, e: RingStep) -> None:
        self.bytes["CPU_to_GPU"].inc(e.loaded_bytes)
        self.bytes["GPU_to_CPU"].inc(e.offloaded_bytes)
        self.seconds["CPU_to_GPU"].inc(e.load_s)
        self.seconds["GPU_to_CPU"].inc(e.offload_s)
        self.wait.inc(e.wait_s)
        self.merges.inc(e.merges)
        self._load_s += e.load_s
        self._hidden_s += e.hidden_s
        if self._load_s > 0:
            self.hidden.set(self._hidden_s / self._load_s)
