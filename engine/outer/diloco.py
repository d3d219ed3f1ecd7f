"""DiLoCo's outer loop (arXiv 2311.08105, INTELLECT-1 arXiv 2412.01152), wrapped around any Inner: the Outer the
session sees (DilocoOuter), built of parts that each hold their own state, picked from the config by build_parts:

    opt       outer optimizer   how the agreed mean moves the snapshot: nesterov, sgd, average, none (optimizer.py)
    codec     codec             what goes on the wire for a slice, reduced or gathered, its state staged per attempt
                                and committed or dropped with the outer step (codec.py)
    cover     cover             what an outer step covers: the whole model, or fragment p (cover.py)
    landing   landing           when and how the agreed mean meets the working weights: synchronous, overlapped
                                (delayed, eager, projected), fragment mixing with alpha and delay (landing.py)

and, the same for every run: the schedule and its round clock (schedule.py, rounds.py), the exchange (exchange.py:
the collective, its buffers, the sentinel's screen), the hand-off to joiners (handoff.py), the step in flight
(flight.py) and the links to the mesh (groups.py, local.py). The outer step's story, told with them the same way for
every combination, is step.py: boundary -> pseudo-gradient -> plan -> exchange -> vote -> commit/abort -> landing ->
hand-off -> event. Every combination the config allows (sync, overlap eager or delayed, fragments with delay and
alpha; every codec; step or time rounds; the sentinel on or off) is a choice of parts, never a subclass.

The node's worker count and inner strategy are part of the digest the mesh compares, since shard layouts only line
up between nodes of equal layouts.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from engine.mesh.protocol import Reformed
from engine.outer import allreduce
from engine.outer.buffers import OuterBuffers
from engine.outer.codec import Codec, build_codec
from engine.outer.cover import Cover, Fragments, WholeModel, spans
from engine.outer.exchange import MeanExchange
from engine.outer.flight import Flight
from engine.outer.groups import MeshLinks
from engine.outer.handoff import StateHandoff
from engine.outer.landing import FragmentMix, Inner, Landing, Overlapped, Synchronous
from engine.outer.local import LocalRanks
from engine.outer.optimizer import OuterOptimizer, build_outer_optimizer
from engine.outer.progress import Progress
from engine.outer.schedule import Schedule
from engine.outer.sentinel import Sentinel
from engine.outer.step import OuterStep
from engine.outer.timing import Stopwatch


@dataclass
class Parts:
    opt: OuterOptimizer  # how the mean moves the snapshot (its state: momentum or none)
    codec: Codec  # what goes on the wire
    cover: Cover  # what an outer step covers: the whole model, or fragment p
    landing: Landing  # when and how the agreed weights meet the working ones


def build_parts(cfg: Any, world: Any, schedule: Schedule, bufs: OuterBuffers, inner: Inner, watch: Stopwatch,
                emit: Callable[..., Any], node_id: Callable[[], str], *, opt: OuterOptimizer | None = None,
                codec: Codec | None = None) -> Parts:
    """The parts of the outer step for the config's diloco slice (opt, codec: given parts instead of the config's)."""
    opt = opt or build_outer_optimizer(cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum)
    if codec is None:  # the slices the cover exchanges: the whole model, or each fragment (a sparse accumulator each)
        parts = schedule.parts if schedule.parts > 1 and not cfg.overlap else 1
        codec = build_codec(cfg, [math.prod(s) for s in bufs.shapes], spans(bufs.numel, parts),
                            schedule.fragment_of if parts > 1 else lambda step: 0, bufs.device)
    background = "diloco.overlap" if cfg.overlap else "diloco.fragment_delay" if cfg.fragment_delay else None
    if background and world.world_size > 1:
        raise ValueError(f"{background}: needs nodes of one process; this node has {world.world_size} (its local "
                         f"collectives would run beside the inner strategy's on the same group)")
    if cfg.overlap:
        return Parts(opt, codec, WholeModel(bufs), Overlapped(bufs, opt, inner, watch, update=cfg.overlap_update,
                                                              delay=cfg.overlap_delay, emit=emit, node_id=node_id,
                                                              after=cfg.overlap_after))
    if schedule.parts > 1:
        cover = Fragments(schedule, bufs)
        return Parts(opt, codec, cover, FragmentMix(bufs, opt, inner, watch, cover, alpha=cfg.fragment_alpha,
                                                    delay=cfg.fragment_delay))
    return Parts(opt, codec, WholeModel(bufs), Synchronous(bufs, opt, inner, watch))


def flight_timeout(cfg: Any, m: Any) -> float:
    """How long an outer step in a background thread may take at most (overlap, fragment_delay)."""
    return cfg.max_attempts * (cfg.allreduce_timeout + m.store_timeout + m.join_timeout
                               + 2 * m.heartbeat_timeout) + m.start_timeout


def compared_digest(digest: str, settings: dict[str, Any] | None) -> str:
    """The digest with the settings it hashes, so that a refused node can say which of them differ."""
    return digest if settings is None else f"{digest} {json.dumps(settings, sort_keys=True, separators=(',', ':'))}"


def layout_digest(config_digest: str, world: Any, inner: Any) -> str:
    """What the mesh compares: the outer buffers only line up between nodes of equal worker counts and inner
    strategy (ZeRO's padded fp32 partitions, FSDP's shards, DDP's whole parameters: the same byte count can be
    another layout, averaged element by element into noise under an agreed checksum), and the wire protocol."""
    layout = getattr(inner, "strategy", "single")
    layout = "ddp" if layout == "single" else layout  # one process of whole parameters: a DDP node's layout
    return f"{config_digest}/w{world.world_size}/s{layout}/p{allreduce.WIRE_PROTOCOL}"


class DilocoOuter:
    """The Outer of a DiLoCo run (the protocol: engine/outer/build.py): its parts, built from the config, and the
    outer step's story (step.py) told with them."""

    # a diverged node is repaired at the next outer step (it takes the run's weights): a non-finite loss alone does
    # not end the run (engine/train.py)
    repairs_divergence = True

    def __init__(self, cfg: Any, mesh_cfg: Any, world: Any, inner: Any, telemetry: Any, *, config_digest: str,
                 settings: dict[str, Any] | None = None, local_group: dist.ProcessGroup | None = None,
                 mesh_factory: Callable[..., Any] | None = None,
                 group_factory: Callable[..., dist.ProcessGroup] | None = None,
                 outer_optimizer: OuterOptimizer | None = None, codec: Codec | None = None,
                 clock: Callable[[], float] = time.time):
        # mesh_factory / group_factory replace engine.mesh in unit tests; outer_optimizer, codec: parts other than
        # the config's (tests); clock: the round clock's wall clock (tests and the golden table inject a virtual one)
        self.cfg, self.world, self.inner, self.telemetry = cfg, world, inner, telemetry
        self.local = LocalRanks(world.rank, world.world_size, local_group)
        self.node_id: str = mesh_cfg.node_id or telemetry.node
        self.bufs = OuterBuffers(inner.outer_params())  # snapshot, pgrad, mean: flat fp32 where the params live
        self.digest = layout_digest(config_digest, world, inner)
        self.links = MeshLinks(
            cfg, mesh_cfg, self.local, self.node_id, telemetry.emit, self._interrupted,
            digest=compared_digest(self.digest, settings), group_factory=group_factory,
            info={"host": world.hostname, "pid": world.pid, "workers": world.world_size},
            mesh_factory=None if mesh_factory is None else lambda: mesh_factory(self))
        self.sentinel = Sentinel(cfg.sentinel_ratio, cfg.sentinel_min_cosine, self.local, self._emit)
        # when an outer step is due and what it covers (schedule.py); the round under way on the clock given here
        self.schedule = Schedule(cfg)
        self.rounds = self.schedule.round_clock(clock)
        self.watch = Stopwatch(self.bufs.device)  # the outer step's seconds, by phase
        parts = build_parts(cfg, world, self.schedule, self.bufs, inner, self.watch, self._emit,
                            lambda: self.node_id, opt=outer_optimizer, codec=codec)
        self.opt, self.codec, self.cover, self.landing = parts.opt, parts.codec, parts.cover, parts.landing
        self.flight = Flight(self.bufs.device, flight_timeout(cfg, mesh_cfg))  # an outer step in the background
        self.step = OuterStep(
            cfg, opt=self.opt, codec=self.codec, cover=self.cover, landing=self.landing,
            exchange=MeanExchange(self.links, self.sentinel, self.codec, self.watch),
            handoff=StateHandoff(self.bufs, self.opt, self.links, telemetry.emit), flight=self.flight,
            links=self.links, local=self.local, rounds=self.rounds, watch=self.watch, bufs=self.bufs, inner=inner,
            world=world, emit=self._emit, interrupt=lambda: self.interrupt() if self.interrupt is not None else None)
        # polled by every mesh wait and collective (session.Signals.requested): "stopped" / "drained" end the wait
        self.interrupt: Callable[[], str | None] | None = None
        self._restored = False  # the snapshot came from a checkpoint (load_state_dict), not from the parameters
        self._left = False
        self._started = False  # mesh.start() succeeded: only then may close() say goodbye under this id
        self._resumed_at_boundary = False  # fragments: resumed at a boundary before it committed (finished)
        self.last_outer_step: dict[str, Any] | None = None  # the last "outer_step" event (tests, benchmarks)

    @property
    def mesh(self) -> Any:
        return self.links.mesh  # local rank 0 only

    @property
    def last_phases(self) -> dict[str, float]:
        """Seconds per phase of the last outer step (bench/outer_step.py)."""
        return self.watch.phases

    def _interrupted(self) -> str | None:
        """The interrupt the mesh waits obey: a stop always; a drain only where this node has no round to contribute
        (a join, an admission): in one it contributes to, it leaves right after the commit, having lost nothing."""
        reason = self.interrupt() if self.interrupt is not None else None
        return None if reason == "drained" and self.step.contributing else reason

    def _emit(self, type_: str, **fields: Any) -> None:
        event = self.telemetry.emit(type_, **fields)
        if type_ == "outer_step":
            self.last_outer_step = event

    # ------------------------------------------------------------------ the Outer protocol

    def start(self, progress: Progress) -> None:
        """Join the mesh. A joiner waits for admission, takes part in that outer step with weight 0 and then
        receives parameters, outer state and progress from the plan's source."""
        self.node_id = self.links.node_id = self.local.share(self.node_id)  # local rank 0's id names the node
        self.cover.start(progress)
        self._resumed_at_boundary = self.cover.parts > 1 and self.rounds.pending_at_resume(progress)
        if self.cfg.min_nodes >= 2:  # a run that may stay one node has no mean to send, and allocates nothing
            for ex, numel in self.cover.exchanges():
                self.codec.prepare(ex, numel, self.cfg.min_nodes)
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
            self.step.round(progress, plan=plan, tokens=0, joining=True, first_join=True)
        elif self.rounds.pending_at_resume(progress):
            # resumed from a checkpoint saved at a boundary before it committed (a stop or a failure in the
            # boundary wait): contribute that round now rather than fold it into the next one
            self.step.round(progress, tokens=self.rounds.close(progress))
        else:
            self.rounds.begin(progress, keep_tokens=True)

    def finished(self, progress: Progress, max_steps: int) -> bool:
        """Step rounds: this node's max_steps. Time rounds: the run's rounds, the same on every node (a round in
        flight counts: its boundary ends the run when it is the last, and the save lands it)."""
        self.step.max_steps = max_steps
        done = self.rounds.finished(self._counting_the_flight(progress), max_steps)
        if self._resumed_at_boundary:
            self._resumed_at_boundary = False
            if done:
                # resumed from a checkpoint of the run's last step saved before its outer step committed: start()
                # sent that step's fragment; the others follow, as at the last step, and every member ends on the
                # agreed model
                self.step.send_the_rest(progress, self.cover.parts - 1, draining=False, whole=True)
                self.bufs.write_back(self.inner.outer_params())
                self.inner.after_outer_update()
        return done

    def step_for_schedule(self, progress: Progress) -> int | None:
        """The LR schedule's step where it is not the node's own (time rounds: the round clock's), else None."""
        return self.rounds.step_for_schedule(self._counting_the_flight(progress))

    def _counting_the_flight(self, progress: Progress) -> Progress:
        if not self.flight.busy or not self.rounds.timed:
            return progress
        return Progress(progress.step, progress.outer_step + 1, progress.tokens)

    def request_drain(self) -> None:
        """Safe from a signal handler: only sets a flag, read at the next inner step."""
        self.step.drain.set()

    def after_inner_step(self, progress: Progress) -> bool:
        if not self.step.after_inner_step(progress):
            return False
        if self.local.leader:
            self.mesh.leave("drained")
        self._left = True
        self._emit("drained", outer_step=progress.outer_step, step=progress.step)
        return True

    def flush(self) -> None:
        """Land the outer step in flight now (a checkpoint, the export)."""
        self.step.flush()

    def close(self, status: str) -> None:
        """Say goodbye (peers drop this node at once instead of waiting a heartbeat timeout). A rejected node
        (duplicate id, other digest) must not write a goodbye under a live node's id. An outer step in flight ends
        (bounded) first."""
        self.flight.close()
        self.links.close(status if self._started and not self._left else None)
        self._left = True

    def state_dict(self) -> dict[str, Any]:
        assert not self.flight.busy, "diloco: flush() lands the outer step in flight before a checkpoint"
        codec = self.codec.state_dict()  # written only for a codec with state (sparse's accumulators)
        return {"snapshot": self.bufs.snapshot.cpu(), "outer_optimizer": self.opt.state_dict(),
                **self.rounds.state_dict(), **self.cover.state_dict(), **({"codec": codec} if codec else {})}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        check_outer_state(sd, self.bufs.numel, self.rounds.timed)
        self.bufs.snapshot.copy_(sd["snapshot"])
        self._restored = True
        self.opt.load_state_dict(sd["outer_optimizer"], device=self.bufs.device)
        self.rounds.load_state_dict(sd)
        self.cover.load_state_dict(sd)
        if "codec" in sd:  # a checkpoint without it (another codec, or none yet): the accumulator starts at 0
            self.codec.load_state_dict(sd["codec"])
        if self.cover.parts > 1:  # each fragment's outer step updates its slice of a whole state (opt.slice)
            self.opt.materialize(self.bufs.numel, self.bufs.device)


def check_outer_state(sd: dict[str, Any], numel: int, timed: bool) -> None:
    """A checkpoint's outer state that this node cannot take: one clear line."""
    if sd["snapshot"].numel() != numel:
        raise ValueError(f"outer state: the snapshot holds {sd['snapshot'].numel()} values, this node's parameters "
                         f"{numel} (another model or worker count?)")
    if timed and int(sd.get("fragments") or 1) > 1:  # time rounds read outer_step as rounds
        raise ValueError(f"outer state: the checkpoint's run synced the model in {sd['fragments']} fragments, so its "
                         f"outer steps count fragments, not rounds: with diloco.round = \"time\" it would be "
                         f"{sd['fragments']}x further into the run and its LR schedule; resume it with "
                         f"diloco.round = \"steps\"")

