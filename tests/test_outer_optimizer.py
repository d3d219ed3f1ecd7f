"""The outer optimizer as a part (engine/outer/optimizer.py): it owns its state behind state_dict / load_state_dict,
the hand-off's tensors and a slice view; a stateless one has none; the outer loop reaches no state but through it,
so an optimizer with other state (two buffers here) runs the fragments' loop, its checkpoint and a resume."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.config import DilocoConfig, MeshConfig
from engine.outer import Progress
from engine.outer.diloco import DilocoOuter
from engine.outer.optimizer import MomentumSGD, Proposal, Stateless, build_outer_optimizer
from engine.telemetry import Telemetry
from test_diloco_math import FakeMesh, TinyInner, _Null, make_plan


def test_a_slice_steps_its_part_of_the_whole_state_in_place_as_an_optimizer_of_its_own():
    whole = build_outer_optimizer("nesterov", 0.7, 0.9)
    whole.materialize(10, "cpu")
    state = whole.state_dict()["momentum"]
    gen = torch.Generator().manual_seed(1)
    snap, g1, g2 = (torch.randn(4, generator=gen) for _ in range(3))
    own = build_outer_optimizer("nesterov", 0.7, 0.9)  # the slice's numbers: a fresh optimizer of 4 values
    mine, theirs = snap.clone(), snap.clone()
    for g in (g1, g2):
        own.step_(mine, g.clone())
        whole.slice(3, 7).step_(theirs, g.clone())
    assert torch.equal(mine, theirs)  # bit for bit: a zero momentum's first step is torch's (buf = g)
    assert whole.state_dict()["momentum"] is state  # updated in place, never replaced
    assert torch.equal(state[3:7], own.state_dict()["momentum"])
    assert not state[:3].any() and not state[7:].any()  # the rest of the state untouched


@pytest.mark.parametrize("kind,beta", [("average", 0.9), ("sgd", 0.0), ("nesterov", 0.0)])
def test_an_optimizer_without_momentum_holds_no_state(kind, beta):
    opt = build_outer_optimizer(kind, 0.7, beta)
    assert isinstance(opt, Stateless)
    opt.reserve(5, "cpu")
    opt.materialize(5, "cpu")
    assert opt.slice(1, 3) is opt and opt.check_tensor() is None
    assert opt.handoff_tensors(5, source=True) == [] and opt.handoff_tensors(5, source=False) == []
    assert opt.state_dict() == {"kind": kind, "momentum": None}  # the checkpoint format of today's runs


def test_todays_checkpoint_of_the_outer_optimizer_loads_and_saves_the_same():
    saved = {"kind": "nesterov", "momentum": torch.arange(6, dtype=torch.float64)}  # as torch.load gives it back
    opt = build_outer_optimizer("nesterov", 0.7, 0.9)
    opt.load_state_dict(saved, device="cpu")
    sd = opt.state_dict()
    assert sd["kind"] == "nesterov" and sd["momentum"].dtype == torch.float32
    assert torch.equal(sd["momentum"], torch.arange(6, dtype=torch.float32))
    with pytest.raises(ValueError, match="saved for outer_optimizer 'nesterov', config says 'sgd'"):
        build_outer_optimizer("sgd", 0.7, 0.9).load_state_dict(saved)
    with pytest.raises(ValueError, match="saved for outer_optimizer 'nesterov', config says 'average'"):
        build_outer_optimizer("average", 0.7, 0.9).load_state_dict(saved)


def test_a_joiner_takes_the_state_the_hand_off_brought():
    source, joiner = build_outer_optimizer("sgd", 0.5, 0.5), build_outer_optimizer("sgd", 0.5, 0.5)
    assert isinstance(source, MomentumSGD)
    assert torch.equal(source.handoff_tensors(3, source=True)[0], torch.zeros(3))  # no outer step yet: zeros
    source.step_(torch.ones(3), torch.tensor([0.1, 0.2, 0.3]))
    sent = source.handoff_tensors(3, source=True)
    received = [t.copy_(s) for t, s in zip(joiner.handoff_tensors(3, source=False), sent)]
    joiner.adopt(received, "cpu")
    assert torch.equal(joiner.check_tensor(), source.check_tensor())


class TwoBuffers:
    """An outer optimizer with other state than a momentum (two buffers, Adam-like in shape, not in math):
    m = g + m; v = v + g * g; p = snapshot - lr * m. What the outer loop may ask of any outer optimizer."""

    kind = "two-buffers"

    def __init__(self, lr: float, m: torch.Tensor | None = None, v: torch.Tensor | None = None):
        self.lr, self.m, self.v = lr, m, v

    def step_(self, snapshot, g, out=None):
        out = snapshot if out is None else out
        self.m.add_(g)
        self.v.addcmul_(g, g)
        torch.add(snapshot, self.m, alpha=-self.lr, out=out)

    def preview(self, g, out):
        return torch.add(g, self.m, out=out).mul_(self.lr)

    def slice(self, lo, hi):
        return TwoBuffers(self.lr, self.m[lo:hi], self.v[lo:hi])

    def reserve(self, numel, device):
        self.materialize(numel, device)

    def materialize(self, numel, device):
        if self.m is None:
            self.m, self.v = torch.zeros(numel, device=device), torch.zeros(numel, device=device)

    def handoff_tensors(self, numel, *, source):
        return [self.m.cpu(), self.v.cpu()] if source else [torch.empty(numel), torch.empty(numel)]

    def adopt(self, received, device):
        self.m.copy_(received[0])
        self.v.copy_(received[1])

    def check_tensor(self):
        return self.v

    def propose(self, snapshot, pgrad) -> Proposal:
        raise NotImplementedError

    def commit(self, proposal) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "m": self.m, "v": self.v}

    def load_state_dict(self, sd, device=None):
        assert sd["kind"] == self.kind
        self.m, self.v = sd["m"].to(device or "cpu"), sd["v"].to(device or "cpu")


def _fragments(opt: TwoBuffers, plans: list) -> tuple[DilocoOuter, TinyInner]:
    inner = TinyInner(0)
    tele = Telemetry("a", 0, json_out=_Null(), extra_sinks=[])
    world = SimpleNamespace(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)
    outer = DilocoOuter(DilocoConfig(enabled=True, inner_steps=4, fragments=2), MeshConfig(node_id="a"), world,
                             inner, tele, config_digest="d", mesh_factory=lambda _: FakeMesh(plans, [True] * 4),
                             outer_optimizer=opt)
    return outer, inner


def test_an_outer_optimizer_with_other_state_runs_the_fragments_loop_and_its_checkpoint():
    """Two outer steps (fragment 0, then 1) on one node: each fragment's step reaches only its slice of both
    buffers; the checkpoint holds the optimizer's own state_dict, and a resume from it goes on with it."""
    plans = [make_plan(1, k, 0, ["a"], source="a") for k in (1, 2, 3)]
    outer, inner = _fragments(TwoBuffers(0.5), plans)
    lo, hi = outer.cover.spans[0]
    p = Progress()
    outer.start(p)
    grads = []
    for step in range(1, 5):  # an outer step every inner_steps / fragments = 2 steps
        before = outer.bufs.snapshot.clone()
        inner.train_step(step)
        p.step, p.tokens = step, p.tokens + 64
        flat = torch.cat([t.detach().reshape(-1).clone() for t in inner.outer_params()])
        outer.after_inner_step(p)
        if step % 2 == 0:
            grads.append(before - flat)  # one node: the mean is its own pseudo-gradient
    assert p.outer_step == 2
    m, v = outer.opt.m, outer.opt.v
    torch.testing.assert_close(m[lo:hi], grads[0][lo:hi])  # fragment 0 at outer step 1
    torch.testing.assert_close(m[hi:], grads[1][hi:])  # fragment 1 at outer step 2
    torch.testing.assert_close(v[lo:hi], grads[0][lo:hi] ** 2)
    torch.testing.assert_close(v[hi:], grads[1][hi:] ** 2)
    sd = outer.state_dict()
    assert set(sd["outer_optimizer"]) == {"kind", "m", "v"}
    resumed, _ = _fragments(TwoBuffers(0.5), plans[2:])
    resumed.load_state_dict(sd)
    assert torch.equal(resumed.opt.m, m) and torch.equal(resumed.opt.v, v)
