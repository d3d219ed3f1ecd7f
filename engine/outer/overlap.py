"""The overlapped outer step (diloco.overlap): each round's outer step runs in the background while the next
round trains.

At boundary t the round's pseudo-gradient d_t = anchor - params is taken, the weights are rebased on the newest
agreed weights (params = snapshot - d_t: the agreed weights plus this round's own progress, which is also the next
round's anchor), and the whole outer step of round t (mesh boundary, exchange, commit, retries, hand-offs) runs in
a background thread while round t+1 trains. Its result (the outer optimizer's new weights, or a hand-off's) lands
in bufs.mean; snapshot and parameters move only on the main thread, at the next boundary or at flush(). So each
node's progress is averaged one round late, and no progress is lost or counted twice: after every landing,
params = agreed weights + the node's not yet exchanged progress. A draining node's last round is synchronous.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from typing import Any

import torch

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
        self._flight: threading.Thread | None = None
        self._flight_error: BaseException | None = None
        self._flight_progress: tuple[Progress, Progress, int, int] | None = None
        self._flight_compute = 0.0
        self._anchored = False
        self._pgrad_ready = False  # bufs.pgrad already holds this round's pseudo-gradient
        self._diverged_at_boundary = False  # the boundary found this round diverged (and repaired it)
        self._stream: Any = None  # CUDA: the background outer step's stream

    # ---- the Outer protocol -----------------------------------------------------------------------------------

    def _boundary(self, progress: Progress, draining: bool) -> bool:
        with self._phase("pseudo_gradient"):
            self._rebase(self._settle())
            if not bool(torch.isfinite(self.bufs.pgrad).all()):
                # the round just ended diverged: its progress would carry NaN into the next one. Restart from the
                # agreed weights with fresh optimizer state (here, on the training thread), and send nothing of it
                self._emit("warning", message=f"node {self.node_id}: its last round diverged (not finite): not "
                                              f"counted; it takes the run's weights")
                self.bufs.pgrad.zero_()
                self._restart_from_snapshot()
                self._diverged_at_boundary = True
        self._anchored = True  # the next round trains from snapshot - pgrad
        self._pgrad_ready = True
        if draining:  # a draining node's last round is synchronous: it contributes it, then leaves
            return False
        self._launch(progress)
        return True

    def flush(self) -> None:
        """Land the round in flight into the parameters now (before a checkpoint or the export). This round's
        progress so far stays in the parameters and is exchanged at its boundary."""
        if self._settle():
            self._rebase(True)
            self._anchored = False  # the round's anchor, rebased, is the new snapshot itself

    def close(self, status: str) -> None:
        if self._flight is not None:  # the round in flight ends (bounded) before this node says goodbye
            self._flight.join(timeout=self._flight_timeout())
            self._flight = None
        super().close(status)

    def state_dict(self) -> dict[str, Any]:
        assert self._flight is None, "overlap: flush() lands the round in flight before a checkpoint"
        return super().state_dict()

    # ---- the round in flight ----------------------------------------------------------------------------------

    def _in_flight(self) -> bool:
        """True on the background thread."""
        return self._flight is not None and threading.current_thread() is self._flight

    def _flight_timeout(self) -> float:
        m = self.links.mesh_cfg
        return self.cfg.max_attempts * (self.cfg.allreduce_timeout + m.store_timeout + m.join_timeout
                                        + 2 * m.heartbeat_timeout) + m.start_timeout

    def _launch(self, progress: Progress) -> None:
        frozen = copy.copy(progress)  # the round's own counters
        self._flight_progress = (frozen, progress, progress.step, progress.tokens)
        self._flight_compute = (self._boundary_at or 0.0) - (self._round_started or 0.0)
        self._flight_error = None
        stream = self._side_stream()

        def body() -> None:
            try:
                # on a GPU the outer step's kernels go to their own stream, beside the training's
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    self._round(frozen, plan=None, draining=False)
                    if stream is not None:
                        stream.synchronize()  # its results are complete before the main thread lands them
            except BaseException as e:  # raised on the main thread when it lands this round (_settle)
                self._flight_error = e

        self._flight = threading.Thread(target=body, name="diloco-overlap", daemon=True)
        self._flight.start()
        self._round_started = time.perf_counter()

    def _side_stream(self) -> Any:
        """The CUDA stream of the background outer step (None on CPU), ordered after the boundary's work."""
        if self.bufs.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.bufs.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.bufs.device))
        return self._stream

    def _settle(self) -> bool:
        """Wait for the round in flight (bounded); True when its new weights wait in bufs.mean."""
        flight = self._flight
        if flight is None:
            return False
        flight.join(timeout=self._flight_timeout())
        if flight.is_alive():
            raise RuntimeError(f"diloco.overlap: the outer step in flight did not finish within "
                               f"{self._flight_timeout():g}s")
        self._flight = None
        if self._flight_error is not None:
            err, self._flight_error = self._flight_error, None
            raise err
        assert self._flight_progress is not None
        frozen, live, step0, tokens0 = self._flight_progress
        # the round's counters (its outer step; a hand-off's step and tokens) plus what trained meanwhile
        live.step, live.tokens = frozen.step + live.step - step0, frozen.tokens + live.tokens - tokens0
        live.outer_step = frozen.outer_step
        return True

    @torch.no_grad()
    def _rebase(self, landed: bool) -> None:
        """pgrad = anchor - params; snapshot = the landed weights; params = snapshot - pgrad."""
        params, bufs = self.inner.outer_params(), self.bufs
        if self._anchored:
            torch.sub(bufs.snapshot, bufs.pgrad, out=bufs.pgrad)
        else:
            bufs.pgrad.copy_(bufs.snapshot)
        torch._foreach_sub_(bufs.views(bufs.pgrad), params)
        if landed:
            bufs.snapshot.copy_(bufs.mean)
        torch.sub(bufs.snapshot, bufs.pgrad, out=bufs.mean)
        bufs.write(params, bufs.mean)
        self.inner.after_outer_update()

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

    def _compute_s(self, boundary_at: float) -> float:
        return self._flight_compute if self._in_flight() else super()._compute_s(boundary_at)

    def _apply(self) -> None:
        """In flight, the new weights wait in bufs.mean: the boundary after it puts them in place."""
        if not self._in_flight():
            return super()._apply()
        with self._phase("optimizer"):
            self.opt.step_(self.bufs.snapshot, self.bufs.mean, out=self.bufs.mean)

    def _land(self, params: torch.Tensor) -> None:
        """In flight, the weights land at the next boundary, like an update."""
        if not self._in_flight():
            return super()._land(params)
        if params.data_ptr() != self.bufs.mean.data_ptr():
            self.bufs.mean.copy_(params)

    def _after_discarded_round(self) -> None:
        if not self._in_flight():  # in flight: done at the boundary (_boundary)
            super()._after_discarded_round()

    def _next_round_starts(self) -> None:
        if not self._in_flight():
            super()._next_round_starts()
