"""The outer step's seconds: each phase (bench/outer_step.py reads them), and the outer_step event's compute_s,
wire_s, codec_s and outer_s (docs/telemetry.md)."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch


class Stopwatch:
    def __init__(self, device: torch.device):
        self.device = device
        self.phases: dict[str, float] = {}  # seconds per phase of the last outer step
        self.round_started: float | None = None  # when this round's inner steps began (compute_s)
        self.boundary_at: float | None = None  # when the outer step began (outer_s)

    def boundary(self) -> None:
        """An outer step begins now."""
        self.boundary_at = time.perf_counter()
        self.phases = {}

    def round_starts(self) -> None:
        self.round_started = time.perf_counter()

    def compute_s(self) -> float:
        """Seconds of inner steps in the round this outer step closes."""
        if self.round_started is None or self.boundary_at is None:
            return 0.0
        return max(0.0, self.boundary_at - self.round_started)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the outer step (on CUDA up to the end of its kernels)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0

    def seconds(self, wire: float, codec: float, compute: float) -> dict[str, Any]:
        """The outer_step event's seconds, up to now. allreduce_s = wire_s + codec_s (kept for older readers)."""
        self.phases.update(wire=wire, codec=codec)
        now = time.perf_counter()
        began = self.boundary_at if self.boundary_at is not None else now
        return {"allreduce_s": wire + codec, "wire_s": wire, "codec_s": codec, "compute_s": compute,
                "outer_s": now - began}
