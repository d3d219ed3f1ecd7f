"""The overlapped outer step (diloco.overlap): each round's outer step runs in the background while the next
round trains.

At boundary t the round's pseudo-gradient d_t = anchor - params is taken (the anchor: the weights round t trained
from), the snapshot takes the weights the previous round's outer step agreed on if they landed meanwhile, and the
working weights become snapshot - u_t, where u_t is what the node's own fresh progress stands for while the mean
of round t is in flight (diloco.overlap_update):

    delayed  u_t = d_t: the node trains on from its own weights, no jump at the boundary
    eager    u_t = the outer optimizer's step for d_t / M (M: the contributors of the last mean): the node's own
             pseudo-gradient stands in for its share of the mean (arXiv 2502.12996, "eager updates")
    projected  u_t = a d_t, a = <d_{t-1}, s_{t-1}> / |d_{t-1}|^2 clamped to [0, 1] (1 until a round has landed):
             s_{t-1} is the step the agreed weights took when the last round landed (snapshot before - after), so
             a d_t is the least-squares fit of that step on the node's own pseudo-gradient, carried to this round.
             Where the nodes agree a is near 1 (delayed); where they differ it falls towards 1/M (eager with the
             plain mean); it absorbs the outer lr too (projected_scale; docs/learning.md, "Overlap on a second
             corpus"). The scale is not in the checkpoint: a resumed node starts again at 1

The working weights are also round t+1's anchor. The whole outer step of round t (mesh boundary, exchange, commit,
retries, hand-offs) runs in a background thread while round t+1 trains; its result (the outer optimizer's new
weights, or a hand-off's) lands in bufs.mean. It lands into the parameters on the main thread, between two inner
steps (diloco.overlap_delay: as soon as it is done, or exactly N steps into round t+1): the snapshot takes the
agreed weights and the parameters become them plus the node's progress since the boundary, which is then part of
round t+1's pseudo-gradient like any of its steps. So the working weights miss the others' round t only for the
steps before the landing; landing a whole round late cost 3-16 % of held-out loss in docs/learning.md, landing one
step in far less. The snapshot, whose fingerprint the members compare, is the same on every member; only the
working weights differ, as they do inside any round. Nothing is lost or counted twice: d_t goes into the mean
once, and the working weights are rebuilt from the agreed weights at every landing. A node whose round the
sentinel left out gets fresh optimizer state as the round lands, on the training thread (its own d_t is gone from
the working weights then; the steps since the boundary are carried over, as at any landing). A draining node's last
round is synchronous; flush() lands the round in flight at once (a checkpoint, the export).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import torch

from engine.mesh.protocol import Stopped
from engine.outer.buffers import finite
from engine.outer.diloco import DilocoOuter
from engine.outer.progress import Progress


class OverlappedDiloco(DilocoOuter):
    overlapped = True

    def __init__(self, cfg, mesh_cfg, world, inner, telemetry, **kwargs: Any):
        if world.world_size > 1:
            raise ValueError(f"diloco.overlap: needs nodes of one process; this node has {world.world_size} (its "
                             f"local collectives would run beside the inner strategy's on the same group)")
        super().__init__(cfg, mesh_cfg, world, inner, telemetry, **kwargs)
        # the round in flight, what it raised, its counters, and where the anchor (the weights this round trained
        # from) is: snapshot - pgrad when _anchored, else the snapshot
        self._flight_progress: tuple[Progress, Progress, int, int] | None = None
        self._anchored = False
        self._eager = cfg.overlap_update in ("eager", "projected")  # u_t is a buffer of its own (_stand_in)
        self._projected = cfg.overlap_update == "projected"
        self._scale = 1.0  # projected: a of the top (projected_scale), from the last round that landed
        self._step: torch.Tensor | None = None  # u of the last boundary: the anchor is snapshot - u when _anchored
        self._eager_buf: torch.Tensor | None = None  # u, eager (delayed: u is bufs.pgrad itself)
        self._pgrad_ready = False  # bufs.pgrad already holds this round's pseudo-gradient
        self._diverged_at_boundary = False  # the boundary found this round diverged (and repaired it)
        self._land_at: int | None = None  # the inner step at which the round in flight lands (diloco.overlap_delay)
        self._flight_tokens = 0  # the tokens of the round in flight (its weight)
        self._committed_in_flight = False  # the round in flight committed (its update waits in bufs.mean)
        self._reset_at_landing = False  # the sentinel left the round in flight out: fresh optimizer state as it lands

    # ---- the Outer protocol -----------------------------------------------------------------------------------

    def finished(self, progress: Progress, max_steps: int) -> bool:
        """Time rounds count rounds: one whose outer step is in flight is done (its boundary ends the run when it
        is the last, as the last step does with step rounds; the save lands it, so every node ends on the agreed
        model). Step rounds count the node's steps."""
        return super().finished(self._counting_the_flight(progress), max_steps)

    def step_for_schedule(self, progress: Progress) -> int | None:
        """Time rounds: the round clock's step, the round in flight counted (else the LR went back a round until
        it landed)."""
        return super().step_for_schedule(self._counting_the_flight(progress))

    def _counting_the_flight(self, progress: Progress) -> Progress:
        if self._flight is None or not self.rounds.timed:
            return progress
        return dataclasses.replace(progress, outer_step=progress.outer_step + 1)

    def after_inner_step(self, progress: Progress) -> bool:
        flight = self._flight
        if flight is not None and (not flight.is_alive() if self._land_at is None else progress.step >= self._land_at):
            # the agreed weights land (diloco.overlap_delay), this round's progress so far carried over onto them:
            # it is part of the round's pseudo-gradient at its boundary, as any step is
            self.flush()
        return super().after_inner_step(progress)

    def _boundary(self, progress: Progress, draining: bool, tokens: int) -> bool:
        with self.watch.phase("pseudo_gradient"):
            self._rebase(self._settle(), eager=self._eager)
            if not finite(self.bufs.pgrad):
                # the round just ended diverged: its progress would carry NaN into the next one. Restart from the
                # agreed weights with fresh optimizer state (here, on the training thread), and send nothing of it
                self._emit("warning", message=f"node {self.node_id}: its last round diverged (not finite): not "
                                              f"counted; it takes the run's weights")
                self.bufs.pgrad.zero_()
                self._step = self.bufs.pgrad  # the next round trains from the snapshot itself
                self._restart_from_snapshot()
                self._diverged_at_boundary = True
        self._anchored = True  # the next round trains from snapshot - pgrad
        self._pgrad_ready = True
        if draining:  # a draining node's last round is synchronous: it contributes it, then leaves
            return False
        self._launch(progress, tokens)
        return True

    def flush(self) -> None:
        """Land the round in flight into the parameters now (before a checkpoint or the export). This round's
        progress so far stays in the parameters and is exchanged at its boundary."""
        if self._settle():
            self._rebase(True, eager=False)
            self._anchored = False  # the round's anchor, rebased, is the new snapshot itself

    # ---- the round in flight ----------------------------------------------------------------------------------

    def _launch(self, progress: Progress, tokens: int) -> None:
        frozen = copy.copy(progress)  # the round's own counters
        self._flight_progress = (frozen, progress, progress.step, progress.tokens)
        self._flight_tokens = tokens
        self._committed_in_flight = False
        delay = self.cfg.overlap_delay
        self._land_at = progress.step + delay if delay else None  # None: as soon as it is done
        self._start_flight(lambda: self._round(frozen, plan=None, draining=False, tokens=tokens), "diloco-overlap")
        self.watch.round_starts()
        self.rounds.begin(progress)  # the next round starts now, before its plan exists: the deadline is chained

    def _settle(self) -> bool:
        """Wait for the round in flight (bounded); True when its new weights wait in bufs.mean. A node the sentinel
        left out of it starts over here with fresh optimizer state, on the training thread that owns the optimizer."""
        try:
            if not self._join_flight("diloco.overlap"):
                return False
        except Stopped:
            if not self._committed_in_flight:
                self._unsent()
                raise
            # stopped after its commit (in a hand-off's wait): the round landed like any other, and the stop is
            # seen again at the next poll (the signal stays set)
        assert self._flight_progress is not None
        frozen, live, step0, tokens0 = self._flight_progress
        # the round's counters (its outer step; a hand-off's step and tokens) plus what trained meanwhile
        live.step, live.tokens = frozen.step + live.step - step0, frozen.tokens + live.tokens - tokens0
        live.outer_step = frozen.outer_step
        if self._reset_at_landing:
            self._reset_at_landing = False
            self.inner.reset_optimizer_state()
        return True

    @torch.no_grad()
    def _unsent(self) -> None:
        """The round in flight met a stop or drain in its waits and did not commit: nothing landed. Its progress is
        measured from the snapshot again (eager: the stand-in u in the weights swapped back for the round's own
        pseudo-gradient, which the exchange left intact), so the checkpoint saved now, or the next boundary, holds
        and sends it with the next round's progress, weighed by both rounds' tokens."""
        if self._anchored:
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
        self.rounds.reopen(self._flight_tokens)

    @torch.no_grad()
    def _rebase(self, landed: bool, *, eager: bool) -> None:
        """pgrad = anchor - params; snapshot = the landed weights; params = snapshot - u (see the top)."""
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
        self._step = self._stand_in(bufs.pgrad) if eager else bufs.pgrad
        torch.sub(bufs.snapshot, self._step, out=bufs.mean)
        bufs.write(params, bufs.mean)
        self.inner.after_outer_update()

    def _stand_in(self, pgrad: torch.Tensor) -> torch.Tensor:
        """Eager: the outer optimizer's step for this node's share of the mean (its state untouched). Projected:
        the node's pseudo-gradient times the scale fitted at the last landing."""
        if self._eager_buf is None:  # 4 bytes per parameter more, only with eager or projected overlap
            self._eager_buf = torch.empty_like(pgrad)
        if self._projected:
            return torch.mul(pgrad, self._scale, out=self._eager_buf)
        torch.mul(pgrad, 1.0 / self.last_contributors, out=self._eager_buf)
        return self.opt.preview(self._eager_buf, out=self._eager_buf)

    # ---- where the base loop's results land while a round is in flight -----------------------------------------

    def _pseudo_gradient(self) -> torch.Tensor:
        if self._pgrad_ready:  # taken at the boundary, before the round went to the background
            self._pgrad_ready = False
            return self.bufs.pgrad
        return super()._pseudo_gradient()

    def _not_finite(self, pgrad: torch.Tensor, index: int) -> bool:
        if self._diverged_at_boundary:  # found (and repaired) on the main thread at the boundary
            self._diverged_at_boundary = False
            return True
        return super()._not_finite(pgrad, index)

    def _agreed(self) -> torch.Tensor:
        """In flight, the round's result once it committed there (bufs.mean)."""
        return self.bufs.mean if self._in_flight() else self.bufs.snapshot

    def _mean_is_free(self) -> bool:
        return not self._in_flight()  # in flight, bufs.mean holds the result

    def _apply(self) -> None:
        """In flight, the new weights wait in bufs.mean: the boundary after it puts them in place."""
        if not self._in_flight():
            return super()._apply()
        with self.watch.phase("optimizer"):
            self.opt.step_(self.bufs.snapshot, self.bufs.mean, out=self.bufs.mean)
        self._committed_in_flight = True

    def _land(self, params: torch.Tensor) -> None:
        """In flight, the weights land at the next boundary, like an update."""
        if not self._in_flight():
            return super()._land(params)
        if params.data_ptr() != self.bufs.mean.data_ptr():
            self.bufs.mean.copy_(params)
        self._committed_in_flight = True

    def _after_discarded_round(self) -> None:
        """In flight the inner optimizer is the training thread's: a node the sentinel left out is reset as its round
        lands (_settle); a diverged round was restarted at its boundary already (_boundary)."""
        if not self._in_flight():
            super()._after_discarded_round()
        elif not self._discard:
            self._reset_at_landing = True

    def _next_round_starts(self, progress: Progress, plan: Any) -> None:
        if not self._in_flight():  # in flight, the next round began at the boundary (_launch)
            super()._next_round_starts(progress, plan)


@torch.no_grad()
def projected_scale(pgrad: torch.Tensor, before: torch.Tensor, after: torch.Tensor, previous: float,
                    chunk: int = 1 << 20) -> float:
    """diloco.overlap_update = "projected": <d, s> / |d|^2 for a node's pseudo-gradient d of a round and the step
    s = before - after the agreed weights took when that round landed, clamped to [0, 1]: the scale of d that
    comes closest to s. Each chunk's dot products in float32, their sum in float64 (no full-size temporary). `previous` where it is undefined
    (d zero: a round not counted; not finite)."""
    num = den = 0.0
    for lo in range(0, pgrad.numel(), chunk):
        g = pgrad[lo:lo + chunk]
        num += float(torch.dot(g, before[lo:lo + chunk] - after[lo:lo + chunk]))
        den += float(torch.dot(g, g))
    if not (den > 0 and math.isfinite(den) and math.isfinite(num)):
        return previous
    return min(1.0, max(0.0, num / den))
