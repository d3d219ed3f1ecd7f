"""The state hand-off: after a commit, a plan's source broadcasts parameters, outer momentum and Progress to its
joiners (and, at a run's first outer step, to every member, so nodes resumed from checkpoints of different ages
start from one set of weights).

Every member takes part in the broadcast over the plan's group. A member that is not the source compares what it
received with its own state, a free check that the members agree, and adopts the source's state where it differs.
If the hand-off fails the commit stands: a joiner that missed its state fails and is dropped at the next boundary.
Gloo moves host tensors only, so on a GPU these are host copies (a hand-off is rare).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.outer.buffers import OuterBuffers
from engine.outer.groups import GROUP_ERRORS, MeshLinks
from engine.outer.optimizer import OuterOptimizer
from engine.outer.progress import Progress
from engine.errors import first_line

Adopt = Callable[[torch.Tensor, list[torch.Tensor]], None]  # (parameters, every tensor received) -> None


class StateHandoff:
    def __init__(self, bufs: OuterBuffers, opt: OuterOptimizer, links: MeshLinks, emit: Callable[..., Any]):
        self.bufs, self.opt, self.links, self.emit = bufs, opt, links, emit

    def send(self, plan: Any, progress: Progress, agreed: torch.Tensor, adopt: Adopt, *, into_mean: bool) -> None:
        """A member's side: the source sends `agreed` (its weights of this outer step); the others check theirs
        (into_mean: receive the parameters straight into the free mean buffer, where it is on the host)."""
        source = self.links.node_id == plan.source
        tensors = self._tensors(progress, agreed, source=source, into_mean=into_mean)
        try:
            self._broadcast(plan, tensors)
        except GROUP_ERRORS as e:
            # already committed here: a joiner that missed its state fails on its side and is dropped later
            self.emit("warning", message=f"state hand-off to {list(plan.joiners)} failed: {first_line(e, 200)}")
            return
        if not source and not torch.equal(tensors[0], agreed.cpu()):
            self.emit("warning", message=f"outer step {plan.outer_step}: parameters differed from source "
                                         f"{plan.source}'s; adopted the source's")
            adopt(tensors[0], tensors)

    def receive(self, plan: Any, progress: Progress, adopt: Adopt, *, into_mean: bool) -> None:
        """A joiner's side: adopt the source's state and its counters."""
        tensors = self._tensors(progress, None, source=False, into_mean=into_mean)
        try:
            self._broadcast(plan, tensors)
        except GROUP_ERRORS as e:
            raise RuntimeError(f"join: state from {plan.source} did not arrive: {first_line(e, 200)}") from None
        adopt(tensors[0], tensors)
        progress.step, progress.outer_step, progress.tokens = (int(c) for c in tensors[-1].tolist())

    def _tensors(self, progress: Progress, agreed: torch.Tensor | None, *, source: bool,
                 into_mean: bool) -> list[torch.Tensor]:
        """In order: parameters, outer momentum (when kept), progress."""
        n = self.bufs.numel
        if source:
            assert agreed is not None
            out = [agreed.cpu()]
            if self.opt.keeps_momentum:
                mom = self.opt.momentum
                out.append(mom.cpu() if mom is not None else torch.zeros(n))
        else:
            out = [self.bufs.mean if into_mean and self.bufs.device.type == "cpu" else torch.empty(n)]
            if self.opt.keeps_momentum:
                out.append(torch.empty(n))
        out.append(torch.tensor([progress.step, progress.outer_step, progress.tokens], dtype=torch.int64))
        return out

    def _broadcast(self, plan: Any, tensors: list[torch.Tensor]) -> None:
        pg = self.links.group(plan)
        assert pg is not None, "a plan with joiners has more than one member"
        opts = dist.BroadcastOptions()
        opts.rootRank = plan.rank_of(plan.source)

        def send_all() -> None:
            for t in tensors:
                pg.broadcast([t], opts).wait()
        self.links.bounded(plan, "state hand-off", send_all, until_decided=False)
