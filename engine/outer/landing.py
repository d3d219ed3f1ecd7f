"""The landing, a part of the outer loop: when and how the agreed mean meets the working weights. One of

    Synchronous   at the commit: the outer optimizer's step on the snapshot, then params = snapshot
    Overlapped    diloco.overlap: the outer step runs in flight while the next round trains; at the boundary the
                  working weights become snapshot - u (u: delayed, the node's own pseudo-gradient; eager, the outer
                  optimizer's step for its share of the mean; projected, a scaled one), and the agreed weights land
                  diloco.overlap_delay steps later, the progress since the boundary carried over
    FragmentMix   diloco.fragments: fragment f's parameters = (1 - alpha) agreed + alpha own (diloco.fragment_alpha);
                  with diloco.fragment_delay the outer step runs in flight and lands tau steps later, the steps
                  trained meanwhile carried over

The outer loop (diloco.py) tells its story the same way for every landing and asks it at these points:

    boundary(landed, share)          a round ends (after the step in flight, if any, was joined: landed = it committed);
                                     the pseudo-gradient where the landing takes it here (Taken), else None; share:
                                     this node's part of the coming mean (eager's stand-in)
    in_flight(outer_step)            whether that outer step runs in flight (overlap after diloco.overlap_after steps,
                                     fragment_delay) or lands at its boundary
    apply(in_flight, whole)          the committed update of the outer step's slice (whole: the agreed weights whole,
                                     the run's end with fragments)
    discarded(in_flight, diverged)   this node's round was not counted (diverged, left out): it takes the run's weights
    adopt(params, in_flight)         a hand-off's weights become the agreed ones
    land()                           the step in flight committed: its result into the parameters (flush)
    unsent()                         the step in flight was stopped before it committed: nothing landed
    agreed(in_flight), mean_is_free(in_flight)   where the agreed weights are; whether bufs.mean may take a hand-off
    judged(pgrad, scratch)           what the sentinel judges of pgrad: the node's own progress since its last sync

Each landing holds its own state (what waits to land); none reaches into another part's. A new rule of how the mean
meets the weights is a new class here with these methods, picked in build_landing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from engine.outer.buffers import OuterBuffers, finite
from engine.outer.cover import Fragments
from engine.outer.optimizer import OuterOptimizer
from engine.outer.timing import Stopwatch


@dataclass
class Taken:
    """A pseudo-gradient the landing took at the boundary, on the training thread."""
    pgrad: torch.Tensor
    diverged: bool = False  # found not finite there (and repaired): not counted


@dataclass
class Share:
    """This node's part of the coming mean, for eager overlap's stand-in (outer step's _share): pgrad / contributors
    (the last mean's), or, from a gathered codec that sends less than pgrad (sparse), message(pgrad, out): its own
    decoded message times its weight over the contributors' total, into out (None: the codec found it not finite)."""
    contributors: int
    message: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None


class Landing(Protocol):
    background: bool  # a boundary's outer step runs in flight while the next round trains
    land_in: int | None  # inner steps after the boundary at which it lands (None: as soon as it is done)

    def boundary(self, landed: bool, share: Share) -> Taken | None: ...

    def in_flight(self, outer_step: int) -> bool:
        """Whether outer step `outer_step` runs in flight (a draining node's last one never does)."""

    def apply(self, in_flight: bool, whole: bool) -> None: ...

    def discarded(self, in_flight: bool, diverged: bool) -> None: ...

    def adopt(self, params: torch.Tensor, in_flight: bool) -> None: ...

    def land(self) -> None: ...

    def unsent(self) -> None: ...

    def agreed(self, in_flight: bool) -> torch.Tensor: ...

    def mean_is_free(self, in_flight: bool) -> bool: ...

    def judged(self, pgrad: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor: ...


class Inner(Protocol):
    """What a landing asks of the inner strategy (engine/inner)."""

    def outer_params(self) -> list[torch.Tensor]: ...

    def after_outer_update(self) -> None: ...

    def reset_optimizer_state(self) -> None: ...


class Synchronous:
    background = False
    land_in: int | None = None

    def __init__(self, bufs: OuterBuffers, opt: OuterOptimizer, inner: Inner, watch: Stopwatch):
        self.bufs, self.opt, self.inner, self.watch = bufs, opt, inner, watch

    def boundary(self, landed: bool, share: Share) -> Taken | None:
        return None

    def in_flight(self, outer_step: int) -> bool:
        return False

    def apply(self, in_flight: bool, whole: bool) -> None:
        """The committed update, in place: snapshot and momentum from the mean, then the parameters."""
        with self.watch.phase("optimizer"):
            self.opt.step_(self.bufs.snapshot, self.bufs.mean)
        with self.watch.phase("write_back"):
            self.bufs.write_back(self.inner.outer_params())
            self.inner.after_outer_update()

    def discarded(self, in_flight: bool, diverged: bool) -> None:
        """It took the run's weights at the commit: its inner optimizer's moments are NaN or stale."""
        self.inner.reset_optimizer_state()

    def adopt(self, params: torch.Tensor, in_flight: bool) -> None:
        """New agreed weights (a hand-off's) into the snapshot and the parameters."""
        self.bufs.snapshot.copy_(params)
        self.bufs.write_back(self.inner.outer_params())
        self.inner.after_outer_update()

    def land(self) -> None:
        pass

    def unsent(self) -> None:
        pass

    def agreed(self, in_flight: bool) -> torch.Tensor:
        return self.bufs.snapshot

    def mean_is_free(self, in_flight: bool) -> bool:
        return True

    def judged(self, pgrad: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        return pgrad


class Overlapped:
    """diloco.overlap (see overlap's account in docs/learning.md and docs/architecture.md). At boundary t the round's
    pseudo-gradient d_t = anchor - params is taken (the anchor: the weights round t trained from), the snapshot takes
    the weights the previous round agreed on if they landed meanwhile, and the working weights become snapshot - u_t:

        delayed    u_t = d_t: the node trains on from its own weights, no jump at the boundary
        eager      u_t = the outer optimizer's step for d_t / M (M: the contributors of the last mean): the node's own
                   pseudo-gradient stands in for its share of the mean (arXiv 2502.12996, "eager updates"); with
                   sparse, its own decoded message times its weight over the contributors' (Share.message)
        projected  u_t = a d_t, a = <d_{t-1}, s_{t-1}> / |d_{t-1}|^2 clamped to [0, 1] (1 until a round landed),
                   s_{t-1} the step the agreed weights took when the last round landed (projected_scale)

    The working weights are round t+1's anchor. In flight the step's result (the outer optimizer's new weights, or
    a hand-off's) waits in bufs.mean; it lands on the training thread: the snapshot takes it, and the parameters
    become it plus the node's progress since the boundary, which is part of round t+1's pseudo-gradient like any
    of its steps. A node the sentinel left out gets fresh optimizer state as the round lands; a round found
    diverged at its boundary restarts from the snapshot there. A draining node's last round is synchronous, and so
    are the first `after` outer steps (diloco.overlap_after): the round's outer step completes at its boundary, its
    pseudo-gradient taken against the snapshot as without overlap (the outer step takes it; boundary is not asked)."""

    background = True

    def __init__(self, bufs: OuterBuffers, opt: OuterOptimizer, inner: Inner, watch: Stopwatch, *, update: str,
                 delay: int, emit: Callable[..., Any], node_id: Callable[[], str], after: int = 0):
        self.bufs, self.opt, self.inner, self.emit, self.node_id = bufs, opt, inner, emit, node_id
        self.sync = Synchronous(bufs, opt, inner, watch)  # a round not in flight (a drain's, a resume's) lands so
        self.watch = watch
        self.land_in = delay or None  # None: as soon as it is done
        self._eager = update in ("eager", "projected")  # u_t is a buffer of its own (_stand_in)
        self._projected = update == "projected"
        self._scale = 1.0  # projected: a of the top, from the last round that landed
        self._anchored = False  # the anchor (the weights this round trained from) is snapshot - u, not the snapshot
        self._step: torch.Tensor | None = None  # u of the last boundary
        self._eager_buf: torch.Tensor | None = None  # u, eager (delayed: u is bufs.pgrad itself)
        self._reset_at_landing = False  # the sentinel left the round in flight out: fresh optimizer state as it lands
        self.after = after  # outer steps up to and including this one land synchronously

    def in_flight(self, outer_step: int) -> bool:
        return outer_step > self.after

    def boundary(self, landed: bool, share: Share) -> Taken | None:
        self._landed(landed)
        diverged = False
        with self.watch.phase("pseudo_gradient"):
            self._rebase(landed, eager=self._eager, share=share)
            if not finite(self.bufs.pgrad):
                # the round just ended diverged: its progress would carry NaN into the next one. Restart from the
                # agreed weights with fresh optimizer state (here, on the training thread), and send nothing of it
                self.emit("warning", message=f"node {self.node_id()}: its last round diverged (not finite): not "
                                             f"counted; it takes the run's weights")
                self.bufs.pgrad.zero_()
                self._step = self.bufs.pgrad  # the next round trains from the snapshot itself
                self.bufs.write_back(self.inner.outer_params())
                self.inner.after_outer_update()
                self.inner.reset_optimizer_state()
                diverged = True
        self._anchored = True  # the next round trains from snapshot - pgrad
        return Taken(self.bufs.pgrad, diverged)

    def land(self) -> None:
        """This round's progress so far stays in the parameters and is exchanged at its boundary."""
        self._landed(True)
        self._rebase(True, eager=False, share=Share(1))
        self._anchored = False  # the round's anchor, rebased, is the new snapshot itself

    def _landed(self, landed: bool) -> None:
        if landed and self._reset_at_landing:
            self._reset_at_landing = False
            self.inner.reset_optimizer_state()

    def apply(self, in_flight: bool, whole: bool) -> None:
        """In flight, the new weights wait in bufs.mean: the boundary after it puts them in place."""
        if not in_flight:
            return self.sync.apply(in_flight, whole)
        with self.watch.phase("optimizer"):
            self.opt.step_(self.bufs.snapshot, self.bufs.mean, out=self.bufs.mean)

    def discarded(self, in_flight: bool, diverged: bool) -> None:
        """In flight the inner optimizer is the training thread's: a node the sentinel left out is reset as its round
        lands; a diverged round was restarted at its boundary already."""
        if not in_flight:
            self.sync.discarded(in_flight, diverged)
        elif not diverged:
            self._reset_at_landing = True

    def adopt(self, params: torch.Tensor, in_flight: bool) -> None:
        """In flight, the weights land at the next boundary, like an update."""
        if not in_flight:
            return self.sync.adopt(params, in_flight)
        if params.data_ptr() != self.bufs.mean.data_ptr():
            self.bufs.mean.copy_(params)

    @torch.no_grad()
    def unsent(self) -> None:
        """The round in flight met a stop or drain in its waits and did not commit: nothing landed. Its progress is
        measured from the snapshot again (eager: the stand-in u in the weights swapped back for the round's own
        pseudo-gradient, which the exchange left intact), so the checkpoint saved now, or the next boundary, holds
        and sends it with the next round's progress (the caller reopens the round's tokens)."""
        if not self._anchored:
            return
        assert self._step is not None
        if self._step is not self.bufs.pgrad:  # eager: params = snapshot - u - progress -> snapshot - d - ...
            # a buffer of its own: a collective the stop abandoned may still write into bufs.mean
            params, work = self.inner.outer_params(), torch.empty_like(self.bufs.pgrad)
            for view, p in zip(self.bufs.views(work), params):
                view.copy_(p)
            work.add_(self._step).sub_(self.bufs.pgrad)
            self.bufs.write(params, work)
            self.inner.after_outer_update()
        self._anchored = False

    def agreed(self, in_flight: bool) -> torch.Tensor:
        """In flight, the round's result once it committed there (bufs.mean)."""
        return self.bufs.mean if in_flight else self.bufs.snapshot

    def mean_is_free(self, in_flight: bool) -> bool:
        return not in_flight  # in flight, bufs.mean holds the result

    def judged(self, pgrad: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        return pgrad

    @torch.no_grad()
    def _rebase(self, landed: bool, *, eager: bool, share: Share) -> None:
        """pgrad = anchor - params; snapshot = the landed weights; params = snapshot - u (see the class)."""
        params, bufs = self.inner.outer_params(), self.bufs
        if landed and self._projected:  # bufs.pgrad still holds the landed round's d (it is rewritten below)
            self._scale = projected_scale(bufs.pgrad, bufs.snapshot, bufs.mean, self._scale)
        if self._anchored:
            assert self._step is not None
            torch.sub(bufs.snapshot, self._step, out=bufs.pgrad)  # the anchor (u may be bufs.pgrad itself)
            torch._foreach_sub_(bufs.views(bufs.pgrad), params)
        else:
            bufs.pseudo_gradient(params)  # the anchor is the snapshot: one pass
        if landed:
            bufs.snapshot.copy_(bufs.mean)
        self._step = self._stand_in(bufs.pgrad, share) if eager else bufs.pgrad
        torch.sub(bufs.snapshot, self._step, out=bufs.mean)
        bufs.write(params, bufs.mean)
        self.inner.after_outer_update()

    def _stand_in(self, pgrad: torch.Tensor, share: Share) -> torch.Tensor:
        """Eager: the outer optimizer's step for this node's share of the mean (its state untouched): pgrad / M, or
        a gathered codec's own decoded message times its share (Share). Projected: the node's pseudo-gradient times
        the scale fitted at the last landing."""
        if self._eager_buf is None:  # 4 bytes per parameter more, only with eager or projected overlap
            self._eager_buf = torch.empty_like(pgrad)
        if self._projected:
            return torch.mul(pgrad, self._scale, out=self._eager_buf)
        if share.message is None or share.message(pgrad, self._eager_buf) is None:
            torch.mul(pgrad, 1.0 / share.contributors, out=self._eager_buf)
        return self.opt.preview(self._eager_buf, out=self._eager_buf)


@torch.no_grad()
def projected_scale(pgrad: torch.Tensor, before: torch.Tensor, after: torch.Tensor, previous: float,
                    chunk: int = 1 << 20) -> float:
    """diloco.overlap_update = "projected": <d, s> / |d|^2 for a node's pseudo-gradient d of a round and the step
    s = before - after the agreed weights took when that round landed, clamped to [0, 1]: the scale of d that
    comes closest to s. Each chunk's dot products in float32, their sum in float64 (no full-size temporary).
    `previous` where it is undefined (d zero: a round not counted; not finite)."""
    num = den = 0.0
    for lo in range(0, pgrad.numel(), chunk):
        g = pgrad[lo:lo + chunk]
        num += float(torch.dot(g, before[lo:lo + chunk] - after[lo:lo + chunk]))
        den += float(torch.dot(g, g))
    if not (den > 0 and math.isfinite(den) and math.isfinite(num)):
        return previous
    return min(1.0, max(0.0, num / den))


class FragmentMix:
    """diloco.fragments: the committed update of fragment f (its snapshot and its slice of the outer optimizer's
    state from the mean), then its parameters mixed from the agreed weights and the node's own:

        params[f] = (1 - alpha) snapshot[f] + alpha params[f]          (diloco.fragment_alpha; 0: the agreed f)

    A node whose round diverged or that the sentinel left out takes the run's weights for every fragment (its other
    fragments may hold the same damage). With diloco.fragment_delay = tau the outer step runs in flight and writes
    only the snapshot, the outer optimizer's state and the buffers; tau steps later, on the training thread, the
    fragment lands: the mix above as of the boundary plus the node's progress on f since then
    (params[f] += (1 - alpha) (snapshot[f] - its weights of f at the boundary)), so no step is lost.

    With alpha > 0 the next pseudo-gradient of f holds, besides the node's training since the sync, the mix's own
    deviation dev[f] = snapshot[f] - the mixed weights = alpha (snapshot[f] - its weights of f at the sync); the
    members' deviations point away from their mean, so against each other by construction. The sentinel judges
    pgrad[f] - dev[f] (judged): with it the deviation, not a poisoned update, left an unpoisoned node out (the golden
    run fragments-int8-poison, outer step 3). dev is 4 bytes per parameter more, kept only with alpha > 0, and not
    checkpointed (a resumed node judges its first syncs with the deviation in, as before)."""

    def __init__(self, bufs: OuterBuffers, opt: OuterOptimizer, inner: Inner, watch: Stopwatch, cover: Fragments, *,
                 alpha: float, delay: int):
        self.bufs, self.opt, self.inner, self.watch, self.cover = bufs, opt, inner, watch, cover
        self.sync = Synchronous(bufs, opt, inner, watch)
        self.alpha = alpha
        self.background = delay > 0
        self.land_in: int | None = delay or None
        # what the fragment in flight left to write into the parameters as it lands: every fragment (it took the
        # run's weights; reset: and fresh optimizer state), or fragment f's mix
        self._pending: tuple[str, int, bool] | None = None
        self._dev: torch.Tensor | None = None  # the mix's deviation per element (alpha > 0; see the class)
        opt.materialize(bufs.numel, bufs.device)  # a whole state (zeros): each fragment's step updates its slice

    def boundary(self, landed: bool, share: Share) -> Taken | None:
        if landed:
            self.land()
        return None

    def in_flight(self, outer_step: int) -> bool:
        return self.background

    @torch.no_grad()
    def apply(self, in_flight: bool, whole: bool) -> None:
        f = self.cover.frag
        lo, hi = self.cover.spans[f]
        snap, mean = self.bufs.snapshot[lo:hi], self.bufs.mean[lo:hi]
        with self.watch.phase("optimizer"):
            if in_flight:  # the node's weights of f as of the boundary, for the landing (snapshot - pgrad)
                torch.sub(snap, self.bufs.pgrad[lo:hi], out=self.bufs.pgrad[lo:hi])
            self.opt.slice(lo, hi).step_(snap, mean)  # the state of f, updated in place
        if in_flight:
            self._pending = self._pending or ("fragment", f, False)  # lands on the training thread (land)
            return
        with self.watch.phase("write_back"):
            self._write_fragment(f, alpha=0.0 if whole else self.alpha)

    def discarded(self, in_flight: bool, diverged: bool) -> None:
        """Every fragment takes the run's weights, not only f."""
        if in_flight:
            self._pending = ("all", self.cover.frag, True)
            return
        self.bufs.write_back(self.inner.outer_params())
        self.inner.after_outer_update()
        self.inner.reset_optimizer_state()
        self._no_deviation(0, self.bufs.numel)

    def adopt(self, params: torch.Tensor, in_flight: bool) -> None:
        if in_flight:  # a hand-off adopted in flight: the parameters take it when it lands
            self.bufs.snapshot.copy_(params)
            self._pending = ("all", self.cover.frag, bool(self._pending and self._pending[2]))
            return
        self.sync.adopt(params, in_flight)
        self._no_deviation(0, self.bufs.numel)

    def land(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        kind, f, reset = pending
        with self.watch.phase("write_back"):
            if kind == "all":
                self.bufs.write_back(self.inner.outer_params())
                self.inner.after_outer_update()
                self._no_deviation(0, self.bufs.numel)
                if reset:
                    self.inner.reset_optimizer_state()
            else:
                self._write_fragment(f, alpha=self.alpha, landing=True)

    def unsent(self) -> None:
        self._pending = None  # nothing committed: the fragment's progress is in the parameters, counted next time

    def agreed(self, in_flight: bool) -> torch.Tensor:
        return self.bufs.snapshot

    def mean_is_free(self, in_flight: bool) -> bool:
        return True

    def judged(self, pgrad: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
        """pgrad[f] less the mix's deviation of f (scratch: a free buffer of f's size)."""
        if self._dev is None:
            return pgrad
        lo, hi = self.cover.span()
        return torch.sub(pgrad, self._dev[lo:hi], out=scratch)

    def _no_deviation(self, lo: int, hi: int) -> None:
        if self._dev is not None:
            self._dev[lo:hi].zero_()

    def _deviation(self, lo: int, hi: int) -> torch.Tensor:
        if self._dev is None:  # the first mix with alpha > 0
            self._dev = torch.zeros(self.bufs.numel, dtype=torch.float32, device=self.bufs.device)
        return self._dev[lo:hi]

    @torch.no_grad()
    def _write_fragment(self, f: int, *, alpha: float, landing: bool = False) -> None:
        """The parameters of fragment f = (1 - alpha) x the agreed ones + alpha x the node's own. Landing after the
        steps trained meanwhile (fragment_delay), they are carried over: params[f] += (1 - alpha) (snapshot[f] -
        mine), mine (in pgrad, kept by apply) the node's weights of f at the boundary; no step is lost."""
        lo, hi = self.cover.spans[f]
        params = self.inner.outer_params()
        if landing:
            delta, scratch = self.bufs.pgrad[lo:hi], self.bufs.mean
            torch.sub(self.bufs.snapshot[lo:hi], delta, out=delta)
            if alpha:
                torch.mul(delta, alpha, out=self._deviation(lo, hi))
            else:
                self._no_deviation(lo, hi)
            self.cover.copy_params_into(params, scratch, f)
            scratch[lo:hi].add_(delta, alpha=1.0 - alpha)
            self.cover.write_params_from(params, scratch, f)
        elif alpha:
            mine = self.bufs.pgrad  # free after the commit: the node's own weights of f, then the mix
            self.cover.copy_params_into(params, mine, f)
            mine[lo:hi].lerp_(self.bufs.snapshot[lo:hi], 1.0 - alpha)
            torch.sub(self.bufs.snapshot[lo:hi], mine[lo:hi], out=self._deviation(lo, hi))
            self.cover.write_params_from(params, mine, f)
        else:
            self.cover.write_params_from(params, self.bufs.snapshot, f)
            self._no_deviation(lo, hi)
        self.inner.after_outer_update()
