"""What an outer step covers, a part of the outer loop: the whole model (`WholeModel`), or fragment p of it
(`Fragments`, diloco.fragments = P, Streaming DiLoCo arXiv 2501.18512). The schedule says which (schedule.py); the
cover holds what follows from it: the slice of the flat buffers the pseudo-gradient is taken over, the exchange
buffers of that slice, and the weight of this node's pseudo-gradient.

The flat buffers (buffers.py) are cut into P contiguous ranges of about equal size (ranges of elements, so a flat
ZeRO partition of one tensor is cut as well as a list of many), and outer step k syncs fragment (k - 1) % P:

    pgrad[f]    = snapshot[f] - params[f]              the node's progress on f since f was last synced
    weight      = the tokens this node trained since f's last sync (its anchor); the whole model: the round's

A node that took the run's weights (a join, a hand-off adopted, a repair) starts every fragment from them: none has
progress of its own yet, and every anchor moves to now (rebase, then committed).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.outer.allreduce import Exchange
from engine.outer.buffers import OuterBuffers
from engine.outer.progress import Progress
from engine.outer.schedule import Schedule


class Cover(Protocol):
    parts: int  # 1: the whole model

    def start(self, progress: Progress) -> None: ...

    def select(self, outer_step: int) -> None:
        """Outer step `outer_step` is this node's next (a member's: it sends its progress on what it covers)."""

    def span(self) -> tuple[int, int]:
        """The elements [lo, hi) of the flat buffers the outer step under way covers."""

    def exchange_bufs(self, plan: Any, joiner: bool) -> Any:
        """The buffers the plan's exchange writes its mean into (a joiner sends zeros of the plan's slice)."""

    def exchanges(self) -> list[tuple[Exchange, int]]:
        """Every Exchange an outer step's mean may use, with the values it averages (prepared at start)."""

    def pseudo_gradient(self, params: list[torch.Tensor]) -> torch.Tensor: ...

    def weight(self, progress: Progress, tokens: int) -> int: ...

    def fields(self) -> dict[str, Any]:
        """More fields of the outer_step event."""

    def rebase(self) -> None:
        """Every part starts from the agreed weights at the next commit (a join, a hand-off adopted, a repair)."""

    def committed(self, progress: Progress) -> None: ...

    def rest(self, due: bool) -> int:
        """Outer steps more than this boundary's that a drain or the run's end sends (every fragment once)."""

    def sent_all(self, progress: Progress) -> bool:
        """Nothing of this node's progress is left unsent on the next outer step's part (a drain ends there)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


class WholeModel:
    parts = 1

    def __init__(self, bufs: OuterBuffers):
        self.bufs = bufs

    def start(self, progress: Progress) -> None:
        pass

    def select(self, outer_step: int) -> None:
        pass

    def span(self) -> tuple[int, int]:
        return 0, self.bufs.numel

    def exchange_bufs(self, plan: Any, joiner: bool) -> Any:
        return self.bufs

    def exchanges(self) -> list[tuple[Exchange, int]]:
        return [(self.bufs.exchange, self.bufs.numel)]

    def pseudo_gradient(self, params: list[torch.Tensor]) -> torch.Tensor:
        return self.bufs.pseudo_gradient(params)

    def weight(self, progress: Progress, tokens: int) -> int:
        return tokens  # the round's

    def fields(self) -> dict[str, Any]:
        return {}

    def rebase(self) -> None:
        pass

    def committed(self, progress: Progress) -> None:
        pass

    def rest(self, due: bool) -> int:
        return 0

    def sent_all(self, progress: Progress) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def spans(numel: int, parts: int) -> list[tuple[int, int]]:
    """parts contiguous [lo, hi) ranges of about equal size covering range(numel)."""
    bounds = [numel * p // parts for p in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class FragmentBuffers:
    """What exchange() needs of the buffers (mean, wire scratch, renewal), for one fragment: views of the flat mean,
    and wire buffers of the fragment's own (kept per fragment, so nothing is reallocated per outer step)."""

    def __init__(self, bufs: OuterBuffers, lo: int, hi: int):
        self.bufs, self.lo, self.hi = bufs, lo, hi
        self.exchange = Exchange(bufs.device)

    @property
    def mean(self) -> torch.Tensor:
        return self.bufs.mean[self.lo:self.hi]  # read anew: renew_scratch replaces the flat mean

    def renew_scratch(self) -> None:
        self.bufs.renew_scratch()
        self.exchange = Exchange(self.bufs.device)


class Fragments:
    def __init__(self, schedule: Schedule, bufs: OuterBuffers):
        self.schedule, self.bufs = schedule, bufs
        self.parts = schedule.parts  # an outer step every inner_steps / parts steps (the schedule's rounds)
        if bufs.numel < self.parts:
            raise ValueError(f"diloco.fragments ({self.parts}): this rank holds only {bufs.numel} values")
        self.spans = spans(bufs.numel, self.parts)
        self.frag_bufs = [FragmentBuffers(bufs, lo, hi) for lo, hi in self.spans]
        self.frag = 0  # the fragment of the outer step under way
        # progress.tokens when each fragment was last synced (its weight is what this node trained since), and
        # whether every fragment was just re-based on the agreed weights
        self.anchors: list[int] | None = None
        self._rebased = False

    def start(self, progress: Progress) -> None:
        if self.anchors is None:  # a fresh run, or a checkpoint of a run without fragments: count from here
            self.anchors = [progress.tokens] * self.parts

    def select(self, outer_step: int) -> None:
        self.frag = self.schedule.fragment_of(outer_step)

    def span(self) -> tuple[int, int]:
        return self.spans[self.frag]

    def exchange_bufs(self, plan: Any, joiner: bool) -> Any:
        f = self.schedule.fragment_of(plan.outer_step)
        if not joiner:
            assert f == self.frag, f"outer step {plan.outer_step} syncs fragment {f}, this node took {self.frag}"
        self.frag = f  # a joiner sends zeros of the fragment's size
        return self.frag_bufs[f]

    def exchanges(self) -> list[tuple[Exchange, int]]:
        return [(fb.exchange, fb.hi - fb.lo) for fb in self.frag_bufs]

    @torch.no_grad()
    def pseudo_gradient(self, params: list[torch.Tensor]) -> torch.Tensor:
        """pgrad[f] = snapshot[f] - params[f] for this outer step's fragment f (a view of the pgrad buffer)."""
        lo, hi = self.spans[self.frag]
        pgrad = self.bufs.pgrad[lo:hi]
        self.copy_params_into(params, self.bufs.pgrad, self.frag)
        torch.sub(self.bufs.snapshot[lo:hi], pgrad, out=pgrad)
        return pgrad

    def weight(self, progress: Progress, tokens: int) -> int:
        """The tokens this node trained since the fragment of this outer step was last synced."""
        assert self.anchors is not None
        return progress.tokens - self.anchors[self.frag]

    def fields(self) -> dict[str, Any]:
        return {"fragment": self.frag, "fragments": self.parts}

    def rebase(self) -> None:
        self._rebased = True

    def committed(self, progress: Progress) -> None:
        assert self.anchors is not None or self._rebased
        if self._rebased or self.anchors is None:
            self.anchors = [progress.tokens] * self.parts
        else:
            self.anchors[self.frag] = progress.tokens
        self._rebased = False

    def rest(self, due: bool) -> int:
        return self.parts - 1 if due else self.parts  # the fragments not synced at this step

    def sent_all(self, progress: Progress) -> bool:
        assert self.anchors is not None  # it took the run's weights meanwhile (left out, repaired)
        return progress.tokens == self.anchors[self.schedule.fragment_of(progress.outer_step + 1)]

    # ---- fragment f's pieces of the parameters --------------------------------------------------------------------

    def _param_slices(self, params: list[torch.Tensor], f: int
                      ) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """The pieces of the parameters that fragment f covers (flat views), and where each lies: (its first and
        last-plus-one element in its parameter, its first element in the flat buffers)."""
        lo, hi = self.spans[f]
        at, pieces = 0, []
        for p in params:
            n = p.numel()
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                pieces.append((p, a - at, b - at, a))
            at += n
        flat_params = [p.view(-1)[x:y] for p, x, y, _ in pieces]
        return flat_params, [(x, y, a) for _, x, y, a in pieces]

    @torch.no_grad()
    def copy_params_into(self, params: list[torch.Tensor], flat: torch.Tensor, f: int) -> None:
        """flat[span f] = the parameters of fragment f (fp32)."""
        pieces, where = self._param_slices(params, f)
        torch._foreach_copy_([flat[a:a + (y - x)] for x, y, a in where], pieces)

    @torch.no_grad()
    def write_params_from(self, params: list[torch.Tensor], flat: torch.Tensor, f: int) -> None:
        """The parameters of fragment f = flat[span f], each in its own dtype."""
        pieces, where = self._param_slices(params, f)
        torch._foreach_copy_(pieces, [flat[a:a + (y - x)] for x, y, a in where])

    def state_dict(self) -> dict[str, Any]:
        return {"fragment_tokens0": list(self.anchors or []), "fragments": self.parts}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        anchors = sd.get("fragment_tokens0")
        if anchors and sd.get("fragments") == self.parts:
            self.anchors = [int(a) for a in anchors]
