"""Streaming DiLoCo (diloco.fragments = P, arXiv 2501.18512): the model synced in P fragments, one at a time.

The flat buffers (buffers.py) are cut into P contiguous ranges of about equal size (ranges of elements, so a flat
ZeRO partition of one tensor is cut as well as a list of many). Every inner_steps / P steps there is an outer step,
and outer step k syncs fragment (k - 1) % P only:

    pgrad[f]    = snapshot[f] - params[f]              the node's progress on f since f was last synced
    mean[f]     = the members' weighted mean of it     weight: the tokens this node trained since f's last sync
    snapshot[f] = the outer optimizer's step on f      (its momentum is kept per element, so per fragment too)
    params[f]   = (1 - alpha) snapshot[f] + alpha params[f]          (diloco.fragment_alpha; 0: the agreed f)

Each fragment is still synced every inner_steps steps, as in DiLoCo; an outer step sends 1/P of the model, so the
peak bytes per sync fall by P. Everything else is the DiLoCo loop's (diloco.py), one outer step per fragment:
plans, attempts and aborts (a death aborts the fragment in flight only; the same pseudo-gradient is resent), the
snapshot the members compare (the checksum covers every fragment: the snapshot is agreed fragment by fragment),
joins (a joiner takes the whole snapshot and momentum and starts every fragment from it), resume. Two things
differ:

- A draining node contributes its last fragments: it leaves after it has sent each of the P fragments once more,
  without training in between, so none of its progress is lost. At the run's last step every member does the
  same, and takes the agreed weights whole, so that the run ends on one model (checkpoint, export) as DiLoCo's
  does.
- A node whose round diverged, or that the sentinel left out, takes the run's weights for every fragment, not only
  the one synced (its other fragments may hold the same damage).

With diloco.fragment_delay = tau > 0 (nodes of one process) a fragment's outer step runs in a background thread
while the node trains on: its pseudo-gradient is taken at the boundary on the training thread, and the thread
(mesh boundary, exchange, commit, retries, hand-offs: the same loop) writes only the snapshot, the momentum and the
buffers. tau steps later, on the training thread, the fragment lands: the mix above, as of the boundary, plus the
node's progress on f since then (params[f] += (1 - alpha) (snapshot[f] - its weights of f at the boundary)), so
the tau steps are not lost and count in f's next sync, as any step. A checkpoint, a drain and the run's end land
the fragment in flight first (flush), and their outer steps are synchronous.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from engine.outer.diloco import DilocoOuter
from engine.outer.progress import Progress


def spans(numel: int, parts: int) -> list[tuple[int, int]]:
    """parts contiguous [lo, hi) ranges of about equal size covering range(numel)."""
    bounds = [numel * p // parts for p in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


class FragmentBuffers:
    """What exchange() needs of the buffers (mean, wire scratch, renewal), for one fragment: views of the flat mean,
    and wire buffers of the fragment's own (kept per fragment, so nothing is reallocated per outer step)."""

    def __init__(self, bufs, lo: int, hi: int):
        self.bufs, self.lo, self.hi = bufs, lo, hi
        self.exchange = type(bufs.exchange)(bufs.device)

    @property
    def mean(self) -> torch.Tensor:
        return self.bufs.mean[self.lo:self.hi]  # read anew: renew_scratch replaces the flat mean

    def renew_scratch(self) -> None:
        self.bufs.renew_scratch()
        self.exchange = type(self.bufs.exchange)(self.bufs.device)


class FragmentedDiloco(DilocoOuter):
    def __init__(self, cfg, mesh_cfg, world, inner, telemetry, **kwargs: Any):
        super().__init__(cfg, mesh_cfg, world, inner, telemetry, **kwargs)
        self.parts = self.schedule.parts  # an outer step every inner_steps / parts steps (the schedule's rounds)
        if self.bufs.numel < self.parts:
            raise ValueError(f"diloco.fragments ({self.parts}): this rank holds only {self.bufs.numel} values")
        self.alpha = cfg.fragment_alpha
        self.spans = spans(self.bufs.numel, self.parts)
        self.frag_bufs = [FragmentBuffers(self.bufs, lo, hi) for lo, hi in self.spans]
        self._frag = 0  # the fragment of the outer step under way
        # progress.tokens when each fragment was last synced (its weight is what this node trained since), and
        # whether every fragment was just re-based on the agreed weights (a join, a hand-off adopted, a repair)
        self._anchors: list[int] | None = None
        self._rebased = False
        self._max_steps = 1 << 62  # train.max_steps, as finished() is told it
        # a whole state now (zeros): each fragment's outer step updates its slice of it (opt.slice)
        self.opt.materialize(self.bufs.numel, self.bufs.device)
        # diloco.fragment_delay: the fragment in flight (its thread, what it raised, its progress), when it lands,
        # and what it left to write into the parameters there ("fragment" or "all", the fragment, reset the
        # optimizer's moments)
        self.delay = cfg.fragment_delay
        if self.delay and world.world_size > 1:
            raise ValueError(f"diloco.fragment_delay: needs nodes of one process; this node has {world.world_size} "
                             f"(its local collectives would run beside the inner strategy's on the same group)")
        self._resumed_at_boundary = False  # resumed at a boundary before it committed (see finished)
        self._flight_progress: tuple[Progress, Progress, int, int] | None = None  # frozen, live, live's step, tokens
        self._land_at: int | None = None
        self._pending: tuple[str, int, bool] | None = None
        self._pgrad_ready = False

    # ---- which fragment, and its slices -------------------------------------------------------------------------

    def fragment_of(self, outer_step: int) -> int:
        """The fragment outer step `outer_step` (1, 2, ...) syncs: the same on every member."""
        return self.schedule.fragment_of(outer_step)

    def _param_slices(self, f: int) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
        """The pieces of the parameters that fragment f covers (flat views), and where each lies: (its first and
        last-plus-one element in its parameter, its first element in the flat buffers)."""
        lo, hi = self.spans[f]
        params, at, pieces = self.inner.outer_params(), 0, []
        for p in params:
            n = p.numel()
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                pieces.append((p, a - at, b - at, a))
            at += n
        flat_params = [p.view(-1)[x:y] for p, x, y, _ in pieces]
        return flat_params, [(x, y, a) for _, x, y, a in pieces]

    @torch.no_grad()
    def _copy_params_into(self, flat: torch.Tensor, f: int) -> None:
        """flat[span f] = the parameters of fragment f (fp32)."""
        pieces, where = self._param_slices(f)
        torch._foreach_copy_([flat[a:a + (y - x)] for x, y, a in where], pieces)

    @torch.no_grad()
    def _write_params_from(self, flat: torch.Tensor, f: int) -> None:
        """The parameters of fragment f = flat[span f], each in its own dtype."""
        pieces, where = self._param_slices(f)
        torch._foreach_copy_(pieces, [flat[a:a + (y - x)] for x, y, a in where])

    # ---- the DiLoCo loop's hooks --------------------------------------------------------------------------------

    def start(self, progress: Progress) -> None:
        if self._anchors is None:  # a fresh run, or a checkpoint of a run without fragments: count from here
            self._anchors = [progress.tokens] * self.parts
        self._resumed_at_boundary = self.rounds.pending_at_resume(progress)  # start() sends that step's fragment
        super().start(progress)

    def finished(self, progress: Progress, max_steps: int) -> bool:
        self._max_steps = max_steps  # after_inner_step syncs every fragment at the run's last step
        done = super().finished(progress, max_steps)
        if self._resumed_at_boundary:
            self._resumed_at_boundary = False
            if done:
                # resumed from a checkpoint of the run's last step saved before its outer step committed (a stop in
                # its wait): start() sent that step's fragment; the others follow, as at the last step, and every
                # member ends on the agreed model (it ended with one fragment synced and mixed by fragment_alpha)
                with self._mixing(0.0):
                    self._send_the_rest(progress, self.parts - 1, draining=False)
                self.bufs.write_back(self.inner.outer_params())
                self.inner.after_outer_update()
        return done

    def after_inner_step(self, progress: Progress) -> bool:
        if self._flight is not None and self._land_at is not None and progress.step >= self._land_at:
            self.flush()
        due = self.rounds.due(progress)
        last = progress.step >= self._max_steps
        if not due and not last:
            return False
        self.flush()
        draining = self.local.any(self._drain.is_set())
        rest = self.parts - 1 if due else self.parts  # the fragments not synced at this step
        if last and not draining:
            # the run's end: this step's fragment, then the others, each at the next outer steps without training
            # in between, all taking the agreed weights whole (no fragment_alpha), so that every member ends on the
            # agreed model (checkpoint, export). The count follows from the steps alone: the same on every member
            with self._mixing(0.0):
                if due:
                    self.watch.boundary()
                    self._round(progress, plan=None, draining=False, tokens=self.rounds.close(progress))
                self._send_the_rest(progress, rest, draining=False)
            return False
        if due:
            self.watch.boundary()
            if self.delay and not draining:
                self._launch(progress, self.rounds.close(progress))
                return False  # a drain asked for meanwhile is seen at the next boundary
            self._round(progress, plan=None, draining=False, tokens=self.rounds.close(progress))
        if not draining and not self._drain_requested_meanwhile():
            return False
        # a drain contributes its last fragments: the others, each at the next outer steps, without training in
        # between (what it trained since their last syncs is in them), the last one as its goodbye
        self._send_the_rest(progress, rest, draining=True)
        if self.local.leader:
            self.mesh.leave("drained")
        self._left = True
        self._emit("drained", outer_step=progress.outer_step, step=progress.step)
        return True

    @contextlib.contextmanager
    def _mixing(self, alpha: float):
        kept, self.alpha = self.alpha, alpha
        try:
            yield
        finally:
            self.alpha = kept

    def _send_the_rest(self, progress: Progress, count: int, *, draining: bool) -> None:
        """`count` more outer steps without training: the next fragments in turn, the last one leaving if draining."""
        for i in range(count):
            assert self._anchors is not None
            if draining and progress.tokens == self._anchors[self.fragment_of(progress.outer_step + 1)]:
                break  # it took the run's weights meanwhile (left out, repaired): nothing of it is left to send
            self.watch.boundary()
            self._round(progress, plan=None, draining=draining and i == count - 1, tokens=0)

    def _round(self, progress: Progress, *, plan: Any, draining: bool, tokens: int,
               joining: bool | None = None) -> None:
        if plan is None:
            self._frag = self.fragment_of(progress.outer_step + 1)
        super()._round(progress, plan=plan, draining=draining, tokens=tokens, joining=joining)

    def _round_weight(self, progress: Progress, tokens: int) -> int:
        """The tokens this node trained since the fragment of this outer step was last synced."""
        assert self._anchors is not None
        return progress.tokens - self._anchors[self._frag]

    def _exchange_bufs(self, plan: Any) -> Any:
        f = self.fragment_of(plan.outer_step)
        if self.node_id not in plan.joiners:
            assert f == self._frag, f"outer step {plan.outer_step} syncs fragment {f}, this node took {self._frag}"
        self._frag = f  # a joiner sends zeros of the fragment's size
        return self.frag_bufs[f]

    def _exchanges(self) -> list[tuple[Any, int]]:
        return [(fb.exchange, fb.hi - fb.lo) for fb in self.frag_bufs]

    @torch.no_grad()
    def _pseudo_gradient(self) -> torch.Tensor:
        """pgrad[f] = snapshot[f] - params[f] for this outer step's fragment f (a view of the pgrad buffer)."""
        lo, hi = self.spans[self._frag]
        if self._pgrad_ready:  # taken at the boundary, before the outer step went to the background
            self._pgrad_ready = False
            return self.bufs.pgrad[lo:hi]
        with self.watch.phase("pseudo_gradient"):
            pgrad = self.bufs.pgrad[lo:hi]
            self._copy_params_into(self.bufs.pgrad, self._frag)
            torch.sub(self.bufs.snapshot[lo:hi], pgrad, out=pgrad)
            return pgrad

    def _outer_step_fields(self) -> dict[str, Any]:
        return {"fragment": self._frag, "fragments": self.parts}

    @torch.no_grad()
    def _apply(self) -> None:
        """The committed update of fragment f: its snapshot and its slice of the outer optimizer's state from the
        mean, then its parameters mixed (fragment_alpha) from the agreed weights and the node's own."""
        f = self._frag
        lo, hi = self.spans[f]
        snap, mean = self.bufs.snapshot[lo:hi], self.bufs.mean[lo:hi]
        with self.watch.phase("optimizer"):
            if self._in_flight():  # the node's weights of f as of the boundary, for the landing (snapshot - pgrad)
                torch.sub(snap, self.bufs.pgrad[lo:hi], out=self.bufs.pgrad[lo:hi])
            self.opt.slice(lo, hi).step_(snap, mean)  # the state of f, updated in place
        if self._in_flight():
            self._pending = self._pending or ("fragment", f, False)  # lands on the training thread (flush)
            return
        with self.watch.phase("write_back"):
            self._write_fragment(f)

    @torch.no_grad()
    def _write_fragment(self, f: int, *, landing: bool = False) -> None:
        """The parameters of fragment f = (1 - alpha) x the agreed ones + alpha x the node's own. Landing after the
        steps trained meanwhile (fragment_delay), they are carried over: params[f] += (1 - alpha) (snapshot[f] -
        mine), mine (in pgrad, kept by _apply) the node's weights of f at the boundary; no step is lost."""
        lo, hi = self.spans[f]
        if landing:
            delta, scratch = self.bufs.pgrad[lo:hi], self.bufs.mean
            torch.sub(self.bufs.snapshot[lo:hi], delta, out=delta)
            self._copy_params_into(scratch, f)
            scratch[lo:hi].add_(delta, alpha=1.0 - self.alpha)
            self._write_params_from(scratch, f)
        elif self.alpha:
            mine = self.bufs.pgrad  # free after the commit: the node's own weights of f, then the mix
            self._copy_params_into(mine, f)
            mine[lo:hi].lerp_(self.bufs.snapshot[lo:hi], 1.0 - self.alpha)
            self._write_params_from(mine, f)
        else:
            self._write_params_from(self.bufs.snapshot, f)
        self.inner.after_outer_update()

    def _after_discarded_round(self) -> None:
        """This node's round diverged or was left out: every fragment takes the run's weights, not only f."""
        self._rebased = True
        if self._in_flight():
            self._pending = ("all", self._frag, True)
            return
        self.bufs.write_back(self.inner.outer_params())
        self.inner.after_outer_update()
        super()._after_discarded_round()

    def _land(self, params: torch.Tensor) -> None:
        self._rebased = True  # every fragment starts from the agreed weights: none has progress of its own yet
        if self._in_flight():  # a hand-off adopted in flight: the parameters take it when it lands
            self.bufs.snapshot.copy_(params)
            self._pending = ("all", self._frag, bool(self._pending and self._pending[2]))
            return
        super()._land(params)

    def _next_round_starts(self, progress: Progress, plan: Any) -> None:
        assert self._anchors is not None or self._rebased
        if self._rebased or self._anchors is None:
            self._anchors = [progress.tokens] * self.parts
        else:
            self._anchors[self._frag] = progress.tokens
        self._rebased = False
        if not self._in_flight():  # in flight, the next round began at the boundary (_launch)
            super()._next_round_starts(progress, plan)

    # ---- diloco.fragment_delay: the fragment in flight ------------------------------------------------------------

    def _launch(self, progress: Progress, tokens: int) -> None:
        """This boundary's fragment: its pseudo-gradient now, the rest of its outer step in the background."""
        self._frag = self.fragment_of(progress.outer_step + 1)
        self._pseudo_gradient()
        self._pgrad_ready = True
        frozen = copy.copy(progress)  # the counters as of the boundary: the outer step and the weight's tokens
        self._flight_progress, self._pending = (frozen, progress, progress.step, progress.tokens), None
        self._start_flight(lambda: self._round(frozen, plan=None, draining=False, tokens=tokens), "diloco-fragment")
        self._land_at = progress.step + self.delay
        self.watch.round_starts()
        self.rounds.begin(progress)

    def flush(self) -> None:
        """Land the fragment in flight now (its landing step, a boundary, a checkpoint, the export)."""
        if self._flight is None:
            return
        assert self._flight_progress is not None
        frozen, live, step0, tokens0 = self._flight_progress
        try:
            self._join_flight("diloco.fragment_delay")
        finally:
            self._land_at = None
            live.outer_step = frozen.outer_step
        # a re-join in flight took the source's step and tokens (step rounds): what trained meanwhile goes on top,
        # as the anchors the commit set count from them (the node kept its own, and its next weight was negative)
        live.step, live.tokens = frozen.step + live.step - step0, frozen.tokens + live.tokens - tokens0
        pending, self._pending = self._pending, None
        if pending is None:
            return
        kind, f, reset = pending
        with self.watch.phase("write_back"):
            if kind == "all":
                self.bufs.write_back(self.inner.outer_params())
                self.inner.after_outer_update()
                if reset:
                    self.inner.reset_optimizer_state()
            else:
                self._write_fragment(f, landing=True)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fragment_tokens0": list(self._anchors or []), "fragments": self.parts}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        super().load_state_dict(sd)
        anchors = sd.get("fragment_tokens0")
        if anchors and sd.get("fragments") == self.parts:
            self._anchors = [int(a) for a in anchors]
        self.opt.materialize(self.bufs.numel, self.bufs.device)
