"""The outer optimizer on flat fp32 tensors: Nesterov (DiLoCo's default), SGD or plain averaging."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Proposal:
    """An outer step computed but not yet committed."""
    params: torch.Tensor  # new flat fp32 parameters
    momentum: torch.Tensor | None  # new momentum buffer (None: this optimizer keeps none)


class OuterOptimizer:
    """The outer update on flat fp32 tensors. step_() updates a snapshot and the momentum in place (after a commit);
    propose() computes the same update into copies and changes nothing (tests, tools); commit() adopts a proposal.

    nesterov (torch.optim.SGD(nesterov=True) semantics, DiLoCo's default):
        buf = momentum * buf + g;  p = snapshot - lr * (g + momentum * buf)
    sgd: buf = momentum * buf + g;  p = snapshot - lr * buf   (plain SGD when momentum is 0)
    average: p = snapshot - g, the plain mean of the members' parameters (no lr, no momentum)
    """

    KINDS = ("nesterov", "sgd", "average")

    def __init__(self, kind: str, lr: float, momentum: float):
        if kind not in self.KINDS:
            raise ValueError(f"diloco.outer_optimizer: unknown {kind!r} (known: {', '.join(self.KINDS)})")
        self.kind, self.lr, self.beta = kind, lr, momentum
        # created on the first step (buf = g, like torch's SGD), then updated in place for the life of the run
        self.momentum: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # reserve(): the memory the first momentum is written into

    @property
    def keeps_momentum(self) -> bool:
        return self.kind != "average" and self.beta > 0

    def reserve(self, numel: int, device: torch.device | str) -> None:
        """Allocate and touch the momentum's memory now (zeros), where a config keeps one and none was restored: the
        first outer step (or a joiner's hand-off) writes into it instead of a fresh copy, whose first touch of 4
        bytes per parameter would fall in a boundary, where every member waits for the slowest. `momentum` stays
        None until then: the checkpoint, the hand-off and the fingerprints tell "no outer step yet" by it."""
        if self.keeps_momentum and self.momentum is None:
            self._spare = torch.zeros(numel, dtype=torch.float32, device=device)

    def first_momentum(self, buf: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """The run's first momentum: a fp32 copy of buf on `device`, in the reserved memory when it fits."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.shape == buf.shape and spare.device == torch.device(device):
            return spare.copy_(buf)
        return buf.to(device, torch.float32, copy=True)

    @torch.no_grad()
    def step_(self, snapshot: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """The updated parameters into `out` (default: the snapshot itself, in place) and the momentum updated in
        place. g is clobbered (scratch) and may be `out`; the snapshot is read only when out is given."""
        out = snapshot if out is None else out
        if self.kind == "average":
            torch.sub(snapshot, g, out=out)
            return
        if not self.keeps_momentum:
            torch.add(snapshot, g, alpha=-self.lr, out=out)
            return
        if self.momentum is None:
            self.momentum = self.first_momentum(g, g.device)  # once per run: buf = g
        else:
            torch.add(g, self.momentum, alpha=self.beta, out=self.momentum)  # beta * buf + g, one pass
        step = g.add_(self.momentum, alpha=self.beta) if self.kind == "nesterov" else self.momentum
        torch.add(snapshot, step, alpha=-self.lr, out=out)

    @torch.no_grad()
    def preview(self, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The step this optimizer would subtract from a snapshot for outer gradient g, into `out` (g may be out),
        with its state untouched: snapshot - preview(g) is what step_ would make of it (eager overlap's proxy)."""
        if self.kind == "average":
            return out.copy_(g) if out is not g else out
        if not self.keeps_momentum:
            return torch.mul(g, self.lr, out=out)
        if self.momentum is None:  # the first step: buf = g
            return torch.mul(g, self.lr * (1 + self.beta) if self.kind == "nesterov" else self.lr, out=out)
        if self.kind == "nesterov":  # g + beta * (beta * buf + g) = (1 + beta) g + beta^2 buf
            torch.mul(g, 1 + self.beta, out=out)
            out.add_(self.momentum, alpha=self.beta * self.beta)
        else:  # beta * buf + g
            torch.add(g, self.momentum, alpha=self.beta, out=out)
        return out.mul_(self.lr)

    def propose(self, snapshot: torch.Tensor, pgrad: torch.Tensor) -> Proposal:
        """The update step_ would make, into copies: nothing of this optimizer changes."""
        params, kept, spare = snapshot.clone(), self.momentum, self._spare
        self.momentum, self._spare = None if kept is None else kept.clone(), None
        try:
            self.step_(params, pgrad.clone())
            return Proposal(params, self.momentum if self.keeps_momentum else None)
        finally:
            self.momentum, self._spare = kept, spare

    def commit(self, proposal: Proposal) -> None:
        self.momentum = proposal.momentum
        if self.momentum is not None:
            self._spare = None  # the proposal brought its own

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "momentum": self.momentum}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != self.kind:
            raise ValueError(f"outer state: saved for outer_optimizer {sd.get('kind')!r}, config says {self.kind!r}")
        self.momentum = sd["momentum"]
        if self.momentum is not None:
            self._spare = None


def flat_params(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one fp32 CPU vector (a copy; tests and tools; the outer step uses OuterBuffers)."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
