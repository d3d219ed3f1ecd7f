"""The outer optimizer, a part of the outer step: Nesterov (DiLoCo's default), SGD or plain averaging, on flat fp32
tensors. It owns its state: nothing outside this module reads or writes it except through the OuterOptimizer
protocol below (state_dict / load_state_dict for checkpoints, the hand-off's tensors and check, and slice(lo, hi):
the same optimizer over a slice of the flat parameters, its state a view of the whole one, for a fragment).

    build_outer_optimizer(kind, lr, momentum)
        nesterov / sgd with momentum > 0   -> MomentumSGD (state: one momentum buffer, per element)
        average, none, or momentum 0       -> Stateless   (no state: nothing to save, hand off or slice)

"none" is no outer optimizer at all: the snapshot moves by the outer lr times the mean (what a codec that keeps its
own state in place of the momentum, error feedback, wants).

The checkpoint format is the one runs have always saved: {"kind": kind, "momentum": tensor | None}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

KINDS = ("nesterov", "sgd", "average", "none")


@dataclass
class Proposal:
    """An outer step computed but not yet committed."""
    params: torch.Tensor  # new flat fp32 parameters
    momentum: torch.Tensor | None  # new momentum buffer (None: this optimizer keeps none)


class OuterOptimizer(Protocol):
    """What the outer step asks of an outer optimizer. step_ is the committed update; preview changes nothing."""

    kind: str

    def step_(self, snapshot: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """The updated parameters into `out` (default: the snapshot, in place), the state updated in place. g is
        clobbered (scratch) and may be `out`; the snapshot is read only when out is given."""

    def preview(self, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The step it would subtract from a snapshot for outer gradient g, into `out` (g may be out), its state
        untouched: snapshot - preview(g) is what step_ would make of it (eager overlap's stand-in)."""

    def slice(self, lo: int, hi: int) -> OuterOptimizer:
        """This optimizer over elements [lo, hi) of the flat parameters: its state there is a view of the whole
        (a fragment's outer step updates its part of the state in place). Needs materialize() first."""

    def reserve(self, numel: int, device: torch.device | str) -> None:
        """Allocate and touch its state's memory now, for the first step to write into (see MomentumSGD)."""

    def materialize(self, numel: int, device: torch.device | str) -> None:
        """Hold a whole state now (zeros where none yet): slices need one to view. A zero momentum's first step
        is torch's first step (buf = beta * 0 + g = g), per slice."""

    def handoff_tensors(self, numel: int, *, source: bool) -> list[torch.Tensor]:
        """Its state as the hand-off moves it (source: its tensors on the host; else: buffers to receive into)."""

    def adopt(self, received: list[torch.Tensor], device: torch.device | str) -> None:
        """The state a hand-off brought (handoff_tensors' order), made this optimizer's."""

    def check_tensor(self) -> torch.Tensor | None:
        """What the members' state check fingerprints of it (None: nothing)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any], device: torch.device | str | None = None) -> None: ...

    def propose(self, snapshot: torch.Tensor, pgrad: torch.Tensor) -> Proposal:
        """The update step_ would make, into copies, nothing of it changed (tests, bench/learning.py)."""

    def commit(self, proposal: Proposal) -> None:
        """Adopt a proposal's state."""


def build_outer_optimizer(kind: str, lr: float, momentum: float) -> OuterOptimizer:
    """diloco.outer_optimizer, outer_lr, outer_momentum -> the part."""
    if kind not in KINDS:
        raise ValueError(f"diloco.outer_optimizer: unknown {kind!r} (known: {', '.join(KINDS)})")
    if kind in ("average", "none") or momentum <= 0:
        return Stateless(kind, lr)
    return MomentumSGD(kind, lr, momentum)


def _check_kind(sd: dict[str, Any], kind: str) -> None:
    if sd.get("kind") != kind:
        raise ValueError(f"outer state: saved for outer_optimizer {sd.get('kind')!r}, config says {kind!r}")


class Stateless:
    """average: p = snapshot - g, the plain mean of the members' parameters (no lr, no state);
    none, and sgd / nesterov with momentum 0: p = snapshot - lr * g."""

    def __init__(self, kind: str, lr: float):
        self.kind, self.lr = kind, lr

    @torch.no_grad()
    def step_(self, snapshot: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None = None) -> None:
        out = snapshot if out is None else out
        if self.kind == "average":
            torch.sub(snapshot, g, out=out)
        else:
            torch.add(snapshot, g, alpha=-self.lr, out=out)

    @torch.no_grad()
    def preview(self, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.kind == "average":
            return out.copy_(g) if out is not g else out
        return torch.mul(g, self.lr, out=out)

    def slice(self, lo: int, hi: int) -> Stateless:
        return self

    def reserve(self, numel: int, device: torch.device | str) -> None:
        pass

    def materialize(self, numel: int, device: torch.device | str) -> None:
        pass

    def handoff_tensors(self, numel: int, *, source: bool) -> list[torch.Tensor]:
        return []

    def adopt(self, received: list[torch.Tensor], device: torch.device | str) -> None:
        assert not received, "a stateless outer optimizer receives no state"

    def check_tensor(self) -> torch.Tensor | None:
        return None

    def propose(self, snapshot: torch.Tensor, pgrad: torch.Tensor) -> Proposal:
        params = snapshot.clone()
        self.step_(params, pgrad.clone())
        return Proposal(params, None)

    def commit(self, proposal: Proposal) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "momentum": None}

    def load_state_dict(self, sd: dict[str, Any], device: torch.device | str | None = None) -> None:
        _check_kind(sd, self.kind)  # a momentum saved under another outer_momentum is not this optimizer's state


class MomentumSGD:
    """nesterov (torch.optim.SGD(nesterov=True) semantics, DiLoCo's default):
        buf = momentum * buf + g;  p = snapshot - lr * (g + momentum * buf)
    sgd: buf = momentum * buf + g;  p = snapshot - lr * buf
    step_() updates a snapshot and the momentum in place (after a commit); propose() computes the same update into
    copies and changes nothing (tests, tools); commit() adopts a proposal."""

    def __init__(self, kind: str, lr: float, momentum: float):
        assert kind in ("nesterov", "sgd") and momentum > 0, (kind, momentum)
        self.kind, self.lr, self.beta = kind, lr, momentum
        # created on the first step (buf = g, like torch's SGD), then updated in place for the life of the run
        self.momentum: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # reserve(): the memory the first momentum is written into

    def reserve(self, numel: int, device: torch.device | str) -> None:
        """Allocate and touch the momentum's memory now (zeros), where none was restored: the first outer step (or
        a joiner's hand-off) writes into it instead of a fresh copy, whose first touch of 4 bytes per parameter
        would fall in a boundary, where every member waits for the slowest. `momentum` stays None until then: the
        checkpoint, the hand-off and the fingerprints tell "no outer step yet" by it."""
        if self.momentum is None:
            self._spare = torch.zeros(numel, dtype=torch.float32, device=device)

    def materialize(self, numel: int, device: torch.device | str) -> None:
        if self.momentum is None:
            self.momentum = torch.zeros(numel, dtype=torch.float32, device=device)

    def slice(self, lo: int, hi: int) -> MomentumSGD:
        assert self.momentum is not None, "materialize() before slice()"
        view = MomentumSGD(self.kind, self.lr, self.beta)
        view.momentum = self.momentum[lo:hi]  # updated in place: a view of the whole buffer
        return view

    def _first_momentum(self, buf: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """The run's first momentum: a fp32 copy of buf on `device`, in the reserved memory when it fits."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.shape == buf.shape and spare.device == torch.device(device):
            return spare.copy_(buf)
        return buf.to(device, torch.float32, copy=True)

    @torch.no_grad()
    def step_(self, snapshot: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None = None) -> None:
        out = snapshot if out is None else out
        if self.momentum is None:
            self.momentum = self._first_momentum(g, g.device)  # once per run: buf = g
        else:
            torch.add(g, self.momentum, alpha=self.beta, out=self.momentum)  # beta * buf + g, one pass
        step = g.add_(self.momentum, alpha=self.beta) if self.kind == "nesterov" else self.momentum
        torch.add(snapshot, step, alpha=-self.lr, out=out)

    @torch.no_grad()
    def preview(self, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.momentum is None:  # the first step: buf = g
            return torch.mul(g, self.lr * (1 + self.beta) if self.kind == "nesterov" else self.lr, out=out)
        if self.kind == "nesterov":  # g + beta * (beta * buf + g) = (1 + beta) g + beta^2 buf
            torch.mul(g, 1 + self.beta, out=out)
            out.add_(self.momentum, alpha=self.beta * self.beta)
        else:  # beta * buf + g
            torch.add(g, self.momentum, alpha=self.beta, out=out)
        return out.mul_(self.lr)

    def handoff_tensors(self, numel: int, *, source: bool) -> list[torch.Tensor]:
        if not source:
            return [torch.empty(numel)]
        return [self.momentum.cpu() if self.momentum is not None else torch.zeros(numel)]

    def adopt(self, received: list[torch.Tensor], device: torch.device | str) -> None:
        (mom,) = received
        if self.momentum is None:
            self.momentum = self._first_momentum(mom, device)
        else:
            self.momentum.copy_(mom)

    def check_tensor(self) -> torch.Tensor | None:
        return self.momentum

    def propose(self, snapshot: torch.Tensor, pgrad: torch.Tensor) -> Proposal:
        """The update step_ would make, into copies: nothing of this optimizer changes."""
        params, kept, spare = snapshot.clone(), self.momentum, self._spare
        self.momentum, self._spare = None if kept is None else kept.clone(), None
        try:
            self.step_(params, pgrad.clone())
            return Proposal(params, self.momentum)
        finally:
            self.momentum, self._spare = kept, spare

    def commit(self, proposal: Proposal) -> None:
        self.momentum = proposal.momentum
        if self.momentum is not None:
            self._spare = None  # the proposal brought its own

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "momentum": self.momentum}

    def load_state_dict(self, sd: dict[str, Any], device: torch.device | str | None = None) -> None:
        _check_kind(sd, self.kind)
        self.momentum = sd["momentum"]
        if self.momentum is not None:
            self._spare = None
            if device is not None:
                self.momentum = self.momentum.to(device, torch.float32)


def flat_params(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one fp32 CPU vector (a copy; tests and tools; the outer step uses OuterBuffers)."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])
