"""DiLoCo's outer loop (arXiv 2311.08105, INTELLECT-1 arXiv 2412.01152), wrapped around any Inner.

Every H inner steps, on every local rank of every member node:

    pgrad    = snapshot - current                 fp32, on the parameters' device, into a kept buffer
    mean     = sum_i(w_i * pgrad_i) / sum_i(w_i)  over "local rank r of every member node"; joiners have w = 0
    ok       = MIN over this node's local ranks of "my exchange succeeded"
    commit   = mesh.commit(plan, ok)              the store's decision, the same for every member
    commit:  outer optimizer in place (nesterov | sgd | average: snapshot and momentum from the mean), copy the
             snapshot into inner.outer_params(), inner.after_outer_update(), then `plan.source` hands
             parameters, outer momentum and Progress to the plan's joiners
    abort:   nothing changed (params, momentum, snapshot: only the mean buffer was written); the same pgrad is
             retried with attempt + 1 on the plan the mesh gives next (without the dead), at most
             diloco.max_attempts times

The buffers (buffers.py) live where the parameters live and are allocated once: the math is a few
foreach/flat ops there, the codec encodes on that device and only the encoded bytes cross to the host.

Joiners (plan.joiners) send zeros with weight 0, then, after the commit, receive parameters, outer momentum and
Progress from plan.source by broadcasts over the same group (every member takes part; a non-source member checks
that what it received equals its own state). If that hand-off fails the commit stands: the joiner fails and is
dropped at the next boundary. A member the mesh left out (Excluded: it was declared dead, then came back) drops
its stale pseudo-gradient and re-joins as a joiner.

Only local rank 0 talks to the Mesh; it hands each answer (a Plan, a decision, or the error it raised) to the
other local ranks by a broadcast on the node's own group (local.py), so all local ranks take every branch together.
Each local rank r exchanges only its own tensors (FSDP: its shards) in the global group of "local rank r on every
member node", built per generation by engine.mesh.make_group (groups.py). The state hand-off is handoff.py; the
overlapped outer step (diloco.overlap) is a subclass, overlap.py. The node's worker count is part of the digest
the mesh compares, since shard layouts only line up between nodes with equal worker counts.

Every committed outer step emits an "outer_step" event whose checksum fingerprints the node's snapshot (every
parameter): identical on every member, which the end-to-end tests check; and its seconds (wire, codec, compute,
the whole outer step; docs/telemetry.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.mesh.protocol import Excluded, MeshError, Reformed
from engine.outer import allreduce
from engine.outer.buffers import OuterBuffers, finite, fingerprint
from engine.outer.exchange import exchange
from engine.outer.groups import MeshLinks
from engine.outer.handoff import MissedState, StateHandoff
from engine.outer.local import LocalRanks
from engine.outer.optimizer import OuterOptimizer, build_outer_optimizer
from engine.outer.progress import Progress
from engine.outer.sentinel import Sentinel
from engine.outer.timing import Stopwatch
from engine.outer.schedule import Schedule


class DilocoOuter:
    """The Outer of a DiLoCo run (see engine/outer/protocol.py for the protocol and docs/architecture.md)."""

    overlapped = False  # OverlappedDiloco (overlap.py) runs each outer step in the background

    def __init__(self, cfg, mesh_cfg, world, inner, telemetry, *, config_digest: str,
                 settings: dict[str, Any] | None = None, local_group: dist.ProcessGroup | None = None,
                 mesh_factory: Callable[..., Any] | None = None,
                 group_factory: Callable[..., dist.ProcessGroup] | None = None,
                 outer_optimizer: OuterOptimizer | None = None, clock: Callable[[], float] = time.time):
        # mesh_factory / group_factory replace engine.mesh in unit tests; outer_optimizer: a part other than the
        # config's (tests); clock: the round clock's wall clock (tests and the golden table inject a virtual one)
        if cfg.overlap != self.overlapped:
            raise ValueError(f"diloco.overlap = {cfg.overlap}: build the outer loop with engine.outer.build_outer")
        self.cfg, self.world, self.inner, self.telemetry = cfg, world, inner, telemetry
        self.local = LocalRanks(world.rank, world.world_size, local_group)
        self.node_id: str = mesh_cfg.node_id or telemetry.node
        # the outer optimizer owns its state (momentum or none): nothing here reaches into it (optimizer.py)
        self.opt = outer_optimizer or build_outer_optimizer(cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum)
        # snapshot, pseudo-gradient and mean, flat fp32 on the parameters' device (engine/outer/buffers.py)
        self.bufs = OuterBuffers(inner.outer_params())
        # what the mesh compares: the outer buffers only line up between nodes of equal worker counts and inner
        # strategy (ZeRO's padded fp32 partitions, FSDP's shards, DDP's whole parameters: the same byte count can be
        # another layout, averaged element by element into noise under an agreed checksum); the settings the
        # digest hashes travel with it, so that a refused node can say which of them differ
        layout = getattr(inner, "strategy", "single")
        layout = "ddp" if layout == "single" else layout  # one process of whole parameters: a DDP node's layout
        self.digest = f"{config_digest}/w{world.world_size}/s{layout}/p{allreduce.WIRE_PROTOCOL}"
        compared = self.digest if settings is None else \
            f"{self.digest} {json.dumps(settings, sort_keys=True, separators=(',', ':'))}"
        self.links = MeshLinks(
            cfg, mesh_cfg, self.local, self.node_id, telemetry.emit, self._interrupted, digest=compared,
            info={"host": world.hostname, "pid": world.pid, "workers": world.world_size},
            mesh_factory=None if mesh_factory is None else lambda: mesh_factory(self), group_factory=group_factory)
        self.handoff = StateHandoff(self.bufs, self.opt, self.links, telemetry.emit)
        self.sentinel = Sentinel(cfg.sentinel_ratio, cfg.sentinel_min_cosine, self.local, self._emit)
        # when an outer step is due and what it covers (schedule.py); the round under way, when it ends (steps or
        # time) and its tokens (the node's weight), on the clock given here and never replaced (rounds.py)
        self.schedule = Schedule(cfg)
        self.rounds = self.schedule.round_clock(clock)
        self._restored = False  # the snapshot came from a checkpoint (load_state_dict), not from the parameters
        self._said_shards = False  # the warning of a node started without GLOBAL_RANK / GLOBAL_WORLD_SIZE
        self.watch = Stopwatch(self.bufs.device)  # the outer step's seconds, by phase
        self._drain = threading.Event()
        # polled by every mesh wait and collective (session.Signals.requested): "stopped" / "drained" end the wait
        self.interrupt: Callable[[], str | None] | None = None
        self._contributing = False  # in a round this node contributes to: a drain waits for its commit
        self._discard = False  # this round's pseudo-gradient is not finite: not counted, the run's weights adopted
        self._left = False
        self._started = False  # mesh.start() succeeded: only then may close() say goodbye under this id
        self._first_join = False  # in start()'s join of a running run: the session says "training" after it
        self.last_outer_step: dict[str, Any] | None = None  # the last "outer_step" event (tests, benchmarks)
        self.last_contributors = max(1, cfg.min_nodes)  # how many pseudo-gradients the last mean counted
        # an outer step in a background thread (overlap.py, fragments.py with fragment_delay): the thread, what it
        # raised, the compute seconds of the round it closes, and its CUDA stream (_start_flight)
        self._flight: threading.Thread | None = None
        self._flight_error: BaseException | None = None
        self._flight_compute = 0.0
        self._stream: Any = None

    @property
    def mesh(self) -> Any:
        return self.links.mesh  # local rank 0 only

    @property
    def last_phases(self) -> dict[str, float]:
        """Seconds per phase of the last outer step (bench/outer_step.py)."""
        return self.watch.phases

    @property
    def snapshot(self) -> torch.Tensor:
        return self.bufs.snapshot

    @property
    def repairs_divergence(self) -> bool:
        """A diverged node is repaired at the next outer step (it takes the run's weights): a non-finite loss
        alone does not end the run (engine/train.py)."""
        return True

    def _interrupted(self) -> str | None:
        """The interrupt the mesh waits obey: a stop always; a drain only where this node has no round to
        contribute (a join, an admission after being left out). A drain that comes while the node waits in a
        round it contributes to (its peers count on its pseudo-gradient) lets the round finish: the node then
        leaves right after the commit (after_inner_step), having lost nothing."""
        reason = self.interrupt() if self.interrupt is not None else None
        if reason == "drained" and self._contributing:
            return None
        return reason

    def _drain_requested_meanwhile(self) -> bool:
        """A drain (signal or drain file) that came during this boundary's round, the same on every local rank."""
        return self.local.any(self.interrupt is not None and self.interrupt() == "drained")

    def _checksum(self) -> str:
        """A fingerprint of the agreed weights (the parameters as of this outer step) where they live, joined over
        the node's local ranks; identical on every member (engine/outer/buffers.py)."""
        return self.local.joined_fingerprint(fingerprint(self._agreed()))

    def _emit(self, type_: str, **fields: Any) -> None:
        event = self.telemetry.emit(type_, **fields)
        if type_ == "outer_step":
            self.last_outer_step = event

    # ------------------------------------------------------------------ the Outer protocol

    def start(self, progress: Progress) -> None:
        """Join the mesh. A joiner waits for admission, takes part in that outer step with weight 0 and then
        receives parameters, outer state and progress from the plan's source."""
        self.node_id = self.links.node_id = self.local.share(self.node_id)  # local rank 0's id names the node
        if self.cfg.min_nodes >= 2:  # a run that may stay one node has no mean to send, and allocates nothing
            for ex, numel in self._exchanges():
                ex.prepare(numel, self.cfg.min_nodes, self.cfg.compression)
        self.opt.reserve(self.bufs.numel, self.bufs.device)  # where a state is kept and none was restored
        self.links.connect()
        joiner = self.local.on_leader("mesh start", lambda: self.mesh.start())
        self._started = True
        if not self._restored:
            self.bufs.capture(self.inner.outer_params())
        self.watch.boundary()
        self.watch.round_starts()
        self.rounds.resume(progress)
        if joiner:
            self._emit("state", state="joining")
            try:
                plan = self.local.on_leader("mesh admission", lambda: self.mesh.wait_admission())
            except Reformed as e:  # the store restarted empty: the run re-forms, and this node joins it there
                self._emit("warning", message=f"{e}")
                self.links.after_reform()
                plan = None
            self._first_join = True
            try:
                self._round(progress, plan=plan, draining=False, tokens=0, joining=True)
            finally:
                self._first_join = False
        elif self.rounds.pending_at_resume(progress):
            # resumed from a checkpoint saved at a boundary before it committed (a stop or a failure in the
            # boundary wait): contribute that round now rather than fold it into the next one
            self._round(progress, plan=None, draining=False, tokens=self.rounds.close(progress))
        else:
            self.rounds.begin(progress, keep_tokens=True)

    def finished(self, progress: Progress, max_steps: int) -> bool:
        """Step rounds: this node's max_steps. Time rounds: max_steps / inner_steps rounds, the same on every node."""
        return self.rounds.finished(progress, max_steps)

    def step_for_schedule(self, progress: Progress) -> int | None:
        """The LR schedule's step where it is not the node's own (time rounds: the round clock's), else None."""
        return self.rounds.step_for_schedule(progress)

    def request_drain(self) -> None:
        """Safe from a signal handler: only sets a flag, read at the next inner step."""
        self._drain.set()

    def after_inner_step(self, progress: Progress) -> bool:
        due = self.rounds.due(progress)
        if self.rounds.timed:  # the local ranks of a node stop on the same step, whatever their clocks say
            due = self.local.any(due)
        if not due:
            return False
        self.watch.boundary()
        draining = self.local.any(self._drain.is_set())
        tokens = self.rounds.close(progress)
        if self._boundary(progress, draining, tokens):
            return False
        self._round(progress, plan=None, draining=draining, tokens=tokens)
        if not draining and not self._drain_requested_meanwhile():
            return False
        if self.local.leader:
            self.mesh.leave("drained")
        self._left = True
        self._emit("drained", outer_step=progress.outer_step, step=progress.step)
        return True

    def _boundary(self, progress: Progress, draining: bool, tokens: int) -> bool:
        """Before a boundary's round; True when it was handed elsewhere (overlap.py) and training goes on."""
        return False

    def flush(self) -> None:
        pass  # nothing in flight: the parameters hold every committed update

    def close(self, status: str) -> None:
        """Say goodbye (peers drop this node at once instead of waiting a heartbeat timeout). A rejected node
        (duplicate id, other digest) must not write a goodbye under a live node's id. An outer step in flight ends
        (bounded) first."""
        if self._flight is not None:
            self._flight.join(timeout=self._flight_timeout())
            self._flight = None
        self.links.close(status if self._started and not self._left else None)
        self._left = True

    def state_dict(self) -> dict[str, Any]:
        assert self._flight is None, "diloco: flush() lands the outer step in flight before a checkpoint"
        return {"snapshot": self.bufs.snapshot.cpu(), "outer_optimizer": self.opt.state_dict(),
                **self.rounds.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        snapshot = sd["snapshot"]
        if snapshot.numel() != self.bufs.numel:
            raise ValueError(f"outer state: the snapshot holds {snapshot.numel()} values, this node's parameters "
                             f"{self.bufs.numel} (another model or worker count?)")
        if self.rounds.timed and int(sd.get("fragments") or 1) > 1:  # time rounds read outer_step as rounds
            raise ValueError(f"outer state: the checkpoint's run synced the model in {sd['fragments']} fragments, so "
                             f"its outer steps count fragments, not rounds: with diloco.round = \"time\" it would "
                             f"be {sd['fragments']}x further into the run and its LR schedule; resume it with "
                             f"diloco.round = \"steps\"")
        self.bufs.snapshot.copy_(snapshot)
        self._restored = True
        self.opt.load_state_dict(sd["outer_optimizer"], device=self.bufs.device)
        self.rounds.load_state_dict(sd)

    # ------------------------------------------------------------------ one outer step, with retries

    def _round(self, progress: Progress, *, plan: Any, draining: bool, tokens: int,
               joining: bool | None = None) -> None:
        """One outer step of a round of `tokens` (the node's weight). plan is given for a joiner (its admission);
        members ask the mesh for it. A member the mesh left out (it arrived late, Excluded) re-joins: its
        pseudo-gradient is stale, it takes the state. A plan that lists a member as a joiner (a formation at a
        newer outer step than its checkpoint) makes it one too. After a store restart (Reformed) the round starts
        over in the re-formed run; a joiner arrives there with nothing to give (joining without a plan: its
        admission was voided), and the formation makes it a joiner again."""
        joining = plan is not None if joining is None else joining
        index = plan.outer_step if plan is not None else progress.outer_step + 1
        attempt = plan.attempt if plan is not None else 0
        pgrad = None
        rejoined = False  # left out mid-run and admitted again: say "training" once it has the state
        self._discard = False
        if not joining:
            pgrad = self._pseudo_gradient()
            self._discard = self._not_finite(pgrad, index)
        self._contributing = not joining and not self._discard
        tries = 0
        while tries < self.cfg.max_attempts:
            tries += 1
            try:
                if plan is None:
                    plan, rejoined = self._plan(index, attempt, joining, draining, rejoined)
                    rejoined = rejoined and not self._first_join  # the session says "training" after a first join
                if self.node_id in plan.joiners:
                    joining, index = True, plan.outer_step
                    self._contributing = False  # it takes the state: nothing of it is counted
                if self._attempt(plan, pgrad, progress, tokens):
                    if rejoined:
                        self._emit("state", state="training")
                    return
            except Reformed as e:
                self._emit("warning", message=f"{e}")
                self.links.after_reform()
                attempt, plan = 0, None
                continue
            except MissedState:
                # the commit stands without this joiner: it stepped out (handoff.receive), so its next boundary
                # answers Excluded and it asks to join again (_plan), a new join with its own tries
                joining, attempt, plan, tries = True, 0, None, 0
                continue
            attempt, plan = plan.attempt + 1, None
        raise MeshError(f"outer step {index}: no attempt committed in {self.cfg.max_attempts} tries "
                        f"(diloco.max_attempts)")

    def _plan(self, index: int, attempt: int, joining: bool, draining: bool, rejoined: bool) -> tuple[Any, bool]:
        """The plan of (index, attempt) from the mesh, or, when this node was left out, its admission."""
        self.links.arrived = (index, attempt, time.monotonic())
        try:
            # the straggler budget counts from the arrival here too: a node on a slow link steps out before it
            # crawls on to the collective (Mesh.poll_plan)
            return self.local.on_leader("mesh boundary", lambda: self.mesh.boundary(
                index, attempt, contributing=not joining and not self._discard, draining=draining,
                budget=self.links.straggler_timeout())), rejoined
        except Excluded as e:
            self._emit("warning", message=f"{e}")
            self._emit("state", state="joining")
            self._contributing = False  # a drain now leaves at once: there is no round left to contribute
            return self.local.on_leader("mesh admission", lambda: self.mesh.wait_admission()), True

    def _attempt(self, plan: Any, pgrad: torch.Tensor | None, progress: Progress, tokens: int) -> bool:
        joiner = self.node_id in plan.joiners
        if not joiner and pgrad is None:  # a re-formation of nodes none of which holds the run's state
            raise MeshError(f"outer step {plan.outer_step}: the run re-formed with no member that holds its state "
                            f"(every node arrived as a joiner: {', '.join(plan.members)}); resume the nodes from their "
                            f"checkpoints (--ckpt.resume=latest)")
        # the mesh's contributors: members that are not joiners and arrived with a pseudo-gradient
        contributors = plan.contributors or [m for m in plan.members if m not in plan.joiners]
        # a contributor weighs the tokens of its round (rounds.py); a joiner and a diverged node weigh nothing
        counts = self.node_id in contributors and not joiner and not self._discard
        weight = float(max(1, self._round_weight(progress, tokens))) if counts else 0.0
        bufs = self._exchange_bufs(plan)
        try:
            out = exchange(plan, pgrad, weight, node_id=self.node_id, links=self.links, sentinel=self.sentinel,
                           bufs=bufs, compression=self.cfg.compression)
        except allreduce.NothingToAverage:
            if self._discard:
                self._every_member_diverged(plan)
            raise
        stats, reason, left_out = out.stats, out.reason, out.left_out
        with self.watch.phase("norm"):
            sq = float(torch.linalg.vector_norm(bufs.mean)) ** 2 if stats is not None else 0.0
        ok, nbytes, sq = self.local.stats(stats is not None, stats.bytes_sent if stats else 0, sq)
        if ok and not math.isfinite(sq):
            # every contributor's pseudo-gradient was finite, yet the mean is not: a value beyond the codec's range
            # (fp16: 65504). The same bits on every member, so every member stops here, before its vote, on the last
            # committed weights (a commit would have put inf into every member's snapshot)
            raise MeshError(f"outer step {plan.outer_step}: the mean of finite pseudo-gradients is not finite: a "
                            f"value beyond diloco.compression = {self.cfg.compression!r}'s range (fp16 ends at "
                            f"65504); use \"bf16\" or \"int8\" (scaled per chunk), then resume")
        if not self.local.on_leader("mesh commit", lambda: self.mesh.commit(plan, ok)):
            why = reason or ("another local rank failed" if not ok else "another member failed")
            self._emit("warning", message=f"outer step {plan.outer_step} attempt {plan.attempt} "
                                          f"(generation {plan.generation}) aborted: {why}")
            return False
        unplaced = None in (getattr(self.world, "global_rank", 0), getattr(self.world, "global_world_size", 0))
        if plan.size > 1 and unplaced and not self._said_shards:
            self._said_shards = True  # a node started by hand without its place: every such node reads one shard
            self._emit("warning", message=f"GLOBAL_RANK and GLOBAL_WORLD_SIZE are not set on node {self.node_id}: "
                       "it reads the data set's first share, as does every node started so (the same sequences); "
                       "set both to each node's place and the run's node count (the console does)")
        if joiner:
            own = (progress.step, progress.tokens)
            self.handoff.receive(plan, progress, self._adopt, into_mean=self._mean_is_free())
            if self._discard:  # a diverged member a re-formation made a joiner: its optimizer's moments are NaN
                self._after_discarded_round()
            if self.rounds.timed:
                # with time rounds each node counts its own steps and tokens (its data position, its checkpoints'
                # names); the run is counted in rounds (outer_step, the source's). A node that re-joined took the
                # source's lower step and went back over step numbers it had saved ("step-N already exists"); a
                # fresh one skipped that many steps of its own data shard
                progress.step, progress.tokens = own
        else:
            self._apply()
            if self._discard or self.node_id in left_out:
                self._after_discarded_round()
            progress.outer_step = plan.outer_step
            if plan.joiners or (plan.forming and plan.size > 1):
                with self.watch.phase("handoff"):
                    self.handoff.send(plan, progress, self._agreed(), self._adopt, into_mean=self._mean_is_free())
        if stats is not None:
            self.links.recent_wire.append(stats.wire_s + stats.codec_s)
        # whose pseudo-gradient entered the mean, with the weights the reduce really used (off the wire)
        counted = [(m, w) for m, w in zip(plan.members, stats.weights if stats else []) if w > 0]
        self.last_contributors = max(1, len(counted))
        self._emit("outer_step", outer_step=progress.outer_step, step=progress.step, generation=plan.generation,
                   members=list(plan.members), pgrad_norm=sq ** 0.5, bytes_sent=nbytes,
                   **self._timings(stats, checksum=self._checksum()),
                   contributors=[m for m, _ in counted], weights=[w for _, w in counted],
                   **({"left_out": left_out} if left_out else {}), **self._outer_step_fields())
        self._next_round_starts(progress, plan)
        return True

    # ------------------------------------------------------------------ the math, where the parameters live

    def _not_finite(self, pgrad: torch.Tensor, index: int) -> bool:
        """A node whose round diverged (NaN or inf in its weights) must not poison the run's: its pseudo-gradient
        is left out of the mean (it arrives as not contributing and sends weight 0), and at the commit it takes the
        run's new weights like every member, with fresh optimizer state. Agreed across the node's local ranks."""
        bad = self.local.any(not finite(pgrad))
        if bad:
            self._emit("warning", message=f"node {self.node_id}: its pseudo-gradient of outer step {index} is not "
                                          f"finite (its round diverged): not counted; it takes the run's weights")
        return bad

    def _every_member_diverged(self, plan: Any) -> None:
        """No member of the attempt had a finite pseudo-gradient (every weight was 0): there is nothing to average,
        and the same data would diverge again. Every member sees the same weights and stops alike, holding the last
        committed weights (written back from the snapshot) with fresh optimizer state, so that the checkpoint it
        saves before exit (a MeshError after training started: engine/train.py) is the run's last good state."""
        self._restart_from_snapshot()
        raise MeshError(f"outer step {plan.outer_step}: no member had a finite pseudo-gradient (every node's round "
                        f"diverged); stopped at the last committed outer step's weights. Resume with a lower "
                        f"optim.lr or a tighter optim.clip_norm")

    def _restart_from_snapshot(self) -> None:
        """A diverged node's weights back to the last agreed ones, with the optimizer's moments back to zero."""
        self.bufs.write_back(self.inner.outer_params())
        self.inner.after_outer_update()
        self.inner.reset_optimizer_state()

    def _pseudo_gradient(self) -> torch.Tensor:
        with self.watch.phase("pseudo_gradient"):
            return self.bufs.pseudo_gradient(self.inner.outer_params())

    def _timings(self, stats: allreduce.ReduceStats | None, *, checksum: str) -> dict[str, Any]:
        """The outer_step event's seconds and its checksum, computed first so outer_s covers it."""
        wire, codec = (stats.wire_s, stats.codec_s) if stats else (0.0, 0.0)
        return {**self.watch.seconds(wire, codec, self._compute_s()), "checksum": checksum}

    def _compute_s(self) -> float:
        """Seconds of inner steps in the round this outer step closes (in flight: as of its boundary)."""
        return self._flight_compute if self._in_flight() else self.watch.compute_s()

    def _apply(self) -> None:
        """The committed update, in place: snapshot and momentum from the mean, then the parameters."""
        with self.watch.phase("optimizer"):
            self.opt.step_(self.bufs.snapshot, self.bufs.mean)
        with self.watch.phase("write_back"):
            self.bufs.write_back(self.inner.outer_params())
            self.inner.after_outer_update()

    def _adopt(self, params: torch.Tensor, handoff: list[torch.Tensor] | None = None) -> None:
        """Make params this node's weights and snapshot (and, from a hand-off, the outer optimizer's state too:
        the tensors between the parameters and the progress, handoff.py)."""
        if handoff is not None:
            self.opt.adopt(handoff[1:-1], self.bufs.device)
        self._land(params)

    def _land(self, params: torch.Tensor) -> None:
        """New agreed weights (a hand-off's) into the snapshot and the parameters."""
        self.bufs.snapshot.copy_(params)
        self.bufs.write_back(self.inner.outer_params())
        self.inner.after_outer_update()

    # ------------------------------------------------------------------ what overlap (overlap.py) and fragments
    # (fragments.py) do otherwise

    def _in_flight(self) -> bool:
        """True on the thread of an outer step in flight."""
        return self._flight is not None and threading.current_thread() is self._flight

    def _start_flight(self, run: Callable[[], None], name: str) -> None:
        """run() (an outer step) in a background thread, its kernels on their own CUDA stream on a GPU; what it
        raises is raised by _join_flight on the training thread. The mean's collectives run in a further thread
        (groups.run_sliced) on the same stream."""
        self._flight_compute, self._flight_error = self.watch.compute_s(), None
        stream = self._side_stream()

        def body() -> None:
            try:
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    run()
                    if stream is not None:
                        stream.synchronize()  # its results are complete before the training thread lands them
            except BaseException as e:  # noqa: BLE001 - raised on the training thread (_join_flight)
                self._flight_error = e

        self._flight = threading.Thread(target=body, name=name, daemon=True)
        self._flight.start()

    def _join_flight(self, what: str) -> bool:
        """Wait for the outer step in flight (bounded by _flight_timeout) and raise what it raised; False when none
        was in flight."""
        flight = self._flight
        if flight is None:
            return False
        flight.join(timeout=self._flight_timeout())
        if flight.is_alive():
            raise RuntimeError(f"{what}: the outer step in flight did not finish within {self._flight_timeout():g}s")
        self._flight = None
        if self._flight_error is not None:
            err, self._flight_error = self._flight_error, None
            raise err
        return True

    def _flight_timeout(self) -> float:
        """How long an outer step in a background thread may take at most (overlap, fragment_delay)."""
        m = self.links.mesh_cfg
        return self.cfg.max_attempts * (self.cfg.allreduce_timeout + m.store_timeout + m.join_timeout
                                        + 2 * m.heartbeat_timeout) + m.start_timeout

    def _side_stream(self) -> Any:
        """The CUDA stream of an outer step in a background thread (None on CPU), ordered after the boundary's
        work, so that its kernels run beside the training's."""
        if self.bufs.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.bufs.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.bufs.device))
        return self._stream

    def _round_weight(self, progress: Progress, tokens: int) -> int:
        """The tokens this node's pseudo-gradient stands for: its round's."""
        return tokens

    def _exchange_bufs(self, plan: Any) -> Any:
        """The buffers this outer step's exchange writes its mean into (and renews after an abandoned collective)."""
        return self.bufs

    def _exchanges(self) -> list[tuple[allreduce.Exchange, int]]:
        """Every Exchange an outer step's mean may use, with the values it averages (prepared at start)."""
        return [(self.bufs.exchange, self.bufs.numel)]

    def _outer_step_fields(self) -> dict[str, Any]:
        """More fields of the outer_step event."""
        return {}

    def _agreed(self) -> torch.Tensor:
        """The weights the members agreed on last."""
        return self.bufs.snapshot

    def _mean_is_free(self) -> bool:
        """bufs.mean may receive a hand-off's parameters (it holds nothing after the update)."""
        return True

    def _after_discarded_round(self) -> None:
        """This node's round diverged and it took the run's weights: its optimizer's moments are NaN."""
        self.inner.reset_optimizer_state()

    def _next_round_starts(self, progress: Progress, plan: Any) -> None:
        """After a commit: the next round trains from now, until the deadline the plan set (time rounds)."""
        self.watch.round_starts()
        self.rounds.begin(progress, plan)
