"""The outer step's story, told the same way for every way of training across hosts (diloco.py says how the parts
are picked; docs/architecture.md, "An outer step"):

    boundary        the schedule says a round is over (after_inner_step); the step in flight, if any, lands
    pseudo-gradient pgrad = snapshot - params over what the outer step covers (cover.py: the model, or fragment p);
                    the landing may take it itself at the boundary (overlap: against the round's anchor)
    plan            the mesh's plan of (outer step, attempt): members, joiners, contributors (_plan)
    exchange        the weighted mean of the members' pseudo-gradients, the codec's bytes on the wire (exchange.py)
    vote            mesh.commit(plan, ok): the same decision on every member; an abort changed nothing (only the mean
                    buffer was written) and the same pgrad is retried, at most diloco.max_attempts times
    commit/abort    the codec's state moves with the outer step (codec.commit / codec.abort)
    landing         the outer optimizer's step and how the agreed weights meet the working ones (landing.py), now or
                    in flight (flight.py: overlap and fragment_delay run the plan..event part in a background thread)
    hand-off        plan.source hands parameters, outer optimizer state and Progress to the plan's joiners
    event           "outer_step", its checksum fingerprinting the agreed weights (the same on every member)

Only local rank 0 talks to the Mesh; it hands each answer to the other local ranks (local.py), so every local rank
takes every branch together.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import torch

from engine.mesh.protocol import Excluded, MeshError, Reformed, Stopped
from engine.outer import allreduce
from engine.outer.buffers import OuterBuffers, finite, fingerprint
from engine.outer.codec import Codec
from engine.outer.cover import Cover
from engine.outer.exchange import Agreed, MeanExchange
from engine.outer.flight import Flight
from engine.outer.groups import MeshLinks
from engine.outer.handoff import MissedState, StateHandoff
from engine.outer.landing import Inner, Landing, Share, Taken
from engine.outer.local import LocalRanks
from engine.outer.optimizer import OuterOptimizer
from engine.outer.progress import Progress
from engine.outer.rounds import RoundClock
from engine.outer.timing import Stopwatch


class OuterStep:
    def __init__(self, cfg: Any, *, opt: OuterOptimizer, codec: Codec, cover: Cover, landing: Landing,
                 exchange: MeanExchange, handoff: StateHandoff, flight: Flight, links: MeshLinks, local: LocalRanks,
                 rounds: RoundClock, watch: Stopwatch, bufs: OuterBuffers, inner: Inner, world: Any,
                 emit: Callable[..., Any], interrupt: Callable[[], str | None]):
        self.cfg, self.opt, self.codec, self.cover, self.landing = cfg, opt, codec, cover, landing
        self.exchange, self.handoff, self.flight, self.links, self.local = exchange, handoff, flight, links, local
        self.rounds, self.watch, self.bufs, self.inner, self.world = rounds, watch, bufs, inner, world
        self.emit, self.interrupt = emit, interrupt  # interrupt: the session's stop or drain, if any
        self.drain = threading.Event()  # a drain was asked for (a signal handler sets it)
        self.max_steps = 1 << 62  # train.max_steps (the run's end syncs every fragment)
        self.contributing = False  # in a round this node contributes to: a drain waits for its commit
        self.last_contributors = max(1, cfg.min_nodes)  # how many pseudo-gradients the last mean counted
        self.last_weights: dict[str, float] = {}  # and their weights, as it agreed them (off the wire)
        self._discard = False  # this round's pseudo-gradient is not finite: not counted, the run's weights adopted
        self._decided = False  # the round under way committed (round(): a codec's staged state stays)
        self._flight_tokens = 0  # the tokens of the round in flight (reopened if it is stopped before its commit)
        self._said_shards = False  # the warning of a node started without GLOBAL_RANK / GLOBAL_WORLD_SIZE

    @property
    def node_id(self) -> str:
        return self.links.node_id

    @property
    def mesh(self) -> Any:
        return self.links.mesh  # local rank 0 only

    def after_inner_step(self, progress: Progress) -> bool:
        """After an inner step: a boundary's outer step, now or launched in flight. True: the node drained (it sent
        its last round and leaves)."""
        if self.flight.lands_by(progress.step):
            # the agreed weights land, this round's progress so far carried over onto them
            self.flush()
        due = self.rounds.due(progress)
        if self.rounds.timed:  # the local ranks of a node stop on the same step, whatever their clocks say
            due = self.local.any(due)
        last = self.cover.parts > 1 and progress.step >= self.max_steps
        if not due and not last:
            return False
        self.watch.boundary()
        draining = self.local.any(self.drain.is_set())
        landed = self._land_flight()
        tokens = self.rounds.close(progress) if due else 0
        flying = self.landing.in_flight(progress.outer_step + 1)
        # an early synchronous step (diloco.overlap_after) follows no flight: the round takes its own pseudo-gradient
        taken = self.landing.boundary(landed, self._share(progress, tokens)) if flying or landed else None
        rest = self.cover.rest(due)  # the outer steps a drain or the run's end sends after this one
        if last and not draining:
            # the run's end: this step's part, then the others, each at the next outer steps without training in
            # between, all taking the agreed weights whole, so that every member ends on the agreed model
            if due:
                self.round(progress, tokens=tokens, whole=True)
            self.send_the_rest(progress, rest, draining=False, whole=True)
            return False
        if due:
            if flying and not draining:  # a draining node's last round is synchronous
                self._launch(progress, tokens, taken)
                return False  # a drain asked for meanwhile is seen at the next boundary
            self.round(progress, draining=draining and not rest, tokens=tokens, taken=taken)
        if not draining and not self.local.any(self.interrupt() == "drained"):
            return False
        self.send_the_rest(progress, rest, draining=True)  # a drain contributes every part it trained once more
        return True

    def flush(self) -> None:
        """Land the outer step in flight now (its landing step, a checkpoint, the export)."""
        if self._land_flight():
            self.landing.land()

    def _share(self, progress: Progress, tokens: int) -> Share:
        """This node's part of the coming mean, for eager overlap's stand-in: 1 / the last mean's contributors; with
        a gathered codec (sparse), its own decoded message times its weight now over the contributors' total weight,
        the others' as the last mean agreed them (off the wire) plus its own (docs/sparse.md, "Overlap")."""
        own = getattr(self.codec, "own_share", None)
        if own is None:
            return Share(self.last_contributors)
        w = float(max(1, self.cover.weight(progress, tokens)))
        others = [v for m, v in self.last_weights.items() if m != self.node_id]
        # no mean agreed yet: the others weigh what this node does
        total = math.fsum(others) + w if self.last_weights else w * self.last_contributors
        index = progress.outer_step + 1
        return Share(self.last_contributors, lambda pgrad, out: own(pgrad, index, w / total, out))

    # ------------------------------------------------------------------ the step in flight

    def _launch(self, progress: Progress, tokens: int, taken: Taken | None) -> None:
        """This boundary's outer step in the background, its pseudo-gradient taken now on the training thread."""
        if taken is None:
            self.cover.select(progress.outer_step + 1)
            taken = Taken(self.pseudo_gradient())
        self._flight_tokens = tokens
        self.flight.launch(progress, lambda frozen: self.round(frozen, tokens=tokens, taken=taken),
                           compute_s=self.watch.compute_s(), land_in=self.landing.land_in, name="diloco-outer")
        self.watch.round_starts()
        self.rounds.begin(progress)  # the next round starts now, before its plan exists: the deadline is chained

    def _land_flight(self) -> bool:
        """Wait for the outer step in flight (bounded); True when it committed and its result waits to land. A stop
        in its waits after its commit lands it too (seen again at the next poll); one before leaves nothing landed."""
        if not self.flight.busy:
            return False
        err = self.flight.wait()
        if err is not None and not (isinstance(err, Stopped) and self.flight.committed):
            if isinstance(err, Stopped):
                self.landing.unsent()
                self.rounds.reopen(self._flight_tokens)
            raise err
        self.flight.settle()
        return True

    def send_the_rest(self, progress: Progress, count: int, *, draining: bool, whole: bool = False) -> None:
        """`count` more outer steps without training: the next parts in turn, the last one leaving if draining."""
        for i in range(count):
            if draining and self.cover.sent_all(progress):
                break  # it took the run's weights meanwhile (left out, repaired): nothing of it is left to send
            self.watch.boundary()
            self.round(progress, draining=draining and i == count - 1, tokens=0, whole=whole)

    # ------------------------------------------------------------------ one outer step, with retries

    def round(self, progress: Progress, *, plan: Any = None, draining: bool = False, tokens: int,
              joining: bool | None = None, taken: Taken | None = None, whole: bool = False,
              first_join: bool = False) -> None:
        """One outer step of a round of `tokens`, with retries. plan: a joiner's admission (members ask the mesh).
        taken: the pseudo-gradient the landing took at the boundary; first_join: start()'s join of a running run. A
        member the mesh left out (Excluded) or listed as a joiner takes the state; after a store restart (Reformed)
        the round starts over in the re-formed run."""
        joining = plan is not None if joining is None else joining
        index = plan.outer_step if plan is not None else progress.outer_step + 1
        attempt = plan.attempt if plan is not None else 0
        if plan is None:
            self.cover.select(index)
        pgrad = None
        self._discard = False
        if not joining:
            pgrad = taken.pgrad if taken is not None else self.pseudo_gradient()
            self._discard = (taken is not None and taken.diverged) or self._not_finite(pgrad, index)
        self.contributing = not joining and not self._discard
        self._decided = False
        try:
            self._rounds(progress, plan, index, attempt, pgrad, joining, draining, tokens, whole, first_join)
        except BaseException:
            if not self._decided:
                # it ends without a commit (a stop, a failure) and its pseudo-gradient stays in the weights, sent
                # with the next (a resume's pending round, overlap's unsent): what the codec staged of it goes back
                self.codec.unsent(pgrad, index)
            raise

    def _rounds(self, progress: Progress, plan: Any, index: int, attempt: int, pgrad: torch.Tensor | None,
                joining: bool, draining: bool, tokens: int, whole: bool, first_join: bool) -> None:
        """round()'s attempts, at most diloco.max_attempts."""
        rejoined = False  # left out mid-run and admitted again: say "training" once it has the state
        tries = 0
        while tries < self.cfg.max_attempts:
            tries += 1
            try:
                if plan is None:
                    plan, rejoined = self._plan(index, attempt, joining, draining, rejoined)
                    rejoined = rejoined and not first_join  # the session says "training" after a first join
                if self.node_id in plan.joiners:
                    joining, index = True, plan.outer_step
                    self.contributing = False  # it takes the state: nothing of it is counted
                if self._attempt(plan, pgrad, progress, tokens, whole):
                    if rejoined:
                        self.emit("state", state="training")
                    return
            except Reformed as e:
                self.emit("warning", message=f"{e}")
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
            self.emit("warning", message=f"{e}")
            self.emit("state", state="joining")
            self.contributing = False  # a drain now leaves at once: there is no round left to contribute
            return self.local.on_leader("mesh admission", lambda: self.mesh.wait_admission()), True

    def _attempt(self, plan: Any, pgrad: torch.Tensor | None, progress: Progress, tokens: int, whole: bool) -> bool:
        joiner = self.node_id in plan.joiners
        if not joiner and pgrad is None:  # a re-formation of nodes none of which holds the run's state
            raise MeshError(f"outer step {plan.outer_step}: the run re-formed with no member that holds its state "
                            f"(every node arrived as a joiner: {', '.join(plan.members)}); resume the nodes from their "
                            f"checkpoints (--ckpt.resume=latest)")
        # the mesh's contributors: members that are not joiners and arrived with a pseudo-gradient
        contributors = plan.contributors or [m for m in plan.members if m not in plan.joiners]
        # a contributor weighs the tokens its pseudo-gradient stands for; a joiner and a diverged node weigh nothing
        counts = self.node_id in contributors and not joiner and not self._discard
        bufs = self.cover.exchange_bufs(plan, joiner)
        if not self.local.every_ok(self.codec.stage(pgrad if counts else None, plan.outer_step, plan.attempt)):
            # the codec's state is not finite (sparse: the accumulator overflowed): reset; the node sends nothing
            # of its own and takes the run's weights, as a diverged round does
            self._discard, counts = True, False
        weight = float(max(1, self.cover.weight(progress, tokens))) if counts else 0.0
        try:
            judged = self.landing.judged(pgrad, bufs.mean) if counts and pgrad is not None else None
            got = self.exchange.attempt(plan, pgrad, weight, bufs, judged=judged)
            decided = self.local.on_leader("mesh commit", lambda: self.mesh.commit(plan, got.ok))
        except BaseException as e:
            self.codec.abort()
            if isinstance(e, allreduce.NothingToAverage) and self._discard:
                self._every_member_diverged(plan)
            raise
        stats, left_out = got.stats, got.left_out
        self._decided = bool(decided)  # from here on the step stands, whatever is raised after
        if not decided:
            self.codec.abort()
            why = got.reason or ("another local rank failed" if not got.ok else "another member failed")
            self.emit("warning", message=f"outer step {plan.outer_step} attempt {plan.attempt} "
                                          f"(generation {plan.generation}) aborted: {why}")
            return False
        if counts and self.node_id not in left_out:
            self.codec.commit()
        elif counts and pgrad is not None:
            self.codec.reject(pgrad)  # the sentinel left it out: the round it judged leaves the codec's state too
        else:
            self.codec.abort()
        in_flight = self.flight.on_it()
        self.flight.committed = self.flight.committed or in_flight
        if plan.size > 1 and not self._said_shards and (say := unplaced(self.world, self.node_id)):
            self._said_shards = True  # a node started by hand without its place: every such node reads one shard
            self.emit("warning", message=say)
        if joiner:
            own = (progress.step, progress.tokens)
            self.handoff.receive(plan, progress, self._adopt, into_mean=self.landing.mean_is_free(in_flight))
            if self._discard:  # a diverged member a re-formation made a joiner: its optimizer's moments are NaN
                self._discarded()
            if self.rounds.timed:
                # with time rounds each node counts its own steps and tokens (its data position, its checkpoints'
                # names); the run is counted in rounds (outer_step, the source's)
                progress.step, progress.tokens = own
        else:
            self.landing.apply(in_flight, whole)
            if self._discard or self.node_id in left_out:
                self._discarded()
            progress.outer_step = plan.outer_step
            if plan.joiners or (plan.forming and plan.size > 1):
                with self.watch.phase("handoff"):
                    self.handoff.send(plan, progress, self.landing.agreed(in_flight), self._adopt,
                                      into_mean=self.landing.mean_is_free(in_flight))
        if stats is not None:
            self.links.recent_wire.append(stats.wire_s + stats.codec_s)
        # whose pseudo-gradient entered the mean, with the weights the reduce really used (off the wire)
        counted = [(m, w) for m, w in zip(plan.members, stats.weights if stats else []) if w > 0]
        self.last_contributors = max(1, len(counted))
        self.last_weights = dict(counted)
        checksum = self.local.joined_fingerprint(fingerprint(self.landing.agreed(in_flight)))  # before outer_s ends
        compute_s = self.flight.compute_s if in_flight else self.watch.compute_s()
        self.emit("outer_step", **event_fields(plan, progress, got, counted, self.watch, compute_s, checksum),
                   **self.cover.fields(), **self.codec_fields(in_flight),
                   **({"overlapped": in_flight} if self.landing.background else {}))
        self.cover.committed(progress)
        if not in_flight:  # in flight, the next round began at the boundary (_launch)
            self.watch.round_starts()
            self.rounds.begin(progress, plan)  # until the deadline the plan set (time rounds)
        return True

    # ------------------------------------------------------------------ small steps of the story

    def codec_fields(self, in_flight: bool) -> dict[str, Any]:
        """A codec with an accumulator: its norm after the step and the agreed weights' over the same values, over
        the node's local ranks (the node detail shows their ratio)."""
        norms = getattr(self.codec, "norms", None)
        if norms is None:
            return {}
        e_sq, w_sq = self.local.sums(list(norms(self.landing.agreed(in_flight))))
        return {"residual_norm": e_sq ** 0.5, "weights_norm": w_sq ** 0.5}

    def pseudo_gradient(self) -> torch.Tensor:
        with self.watch.phase("pseudo_gradient"):
            return self.cover.pseudo_gradient(self.inner.outer_params())

    def _not_finite(self, pgrad: torch.Tensor, index: int) -> bool:
        """A diverged round (NaN or inf) must not poison the run's: it sends weight 0, and at the commit the node
        takes the run's new weights with fresh optimizer state. Agreed across the node's local ranks."""
        bad = self.local.any(not finite(pgrad))
        if bad:
            self.emit("warning", message=f"node {self.node_id}: its pseudo-gradient of outer step {index} is not "
                                          f"finite (its round diverged): not counted; it takes the run's weights")
        return bad

    def _every_member_diverged(self, plan: Any) -> None:
        """No member had a finite pseudo-gradient: nothing to average. Every member stops alike on the last committed
        weights with fresh optimizer state: the checkpoint it saves before exit (engine/train.py) is the last good."""
        self.bufs.write_back(self.inner.outer_params())
        self.inner.after_outer_update()
        self.inner.reset_optimizer_state()
        raise MeshError(f"outer step {plan.outer_step}: no member had a finite pseudo-gradient (every node's round "
                        f"diverged); stopped at the last committed outer step's weights. Resume with a lower "
                        f"optim.lr or a tighter optim.clip_norm")

    def _discarded(self) -> None:
        """This node's round diverged or was left out: it takes the run's weights (every part of them)."""
        self.cover.rebase()
        if self._discard:  # a diverged round's accumulator is not finite; one left out keeps its own (codec.py)
            self.codec.reset()
        self.landing.discarded(self.flight.on_it(), self._discard)

    def _adopt(self, params: torch.Tensor, handoff: list[torch.Tensor] | None = None) -> None:
        """Make params this node's agreed weights (and, from a hand-off, the outer optimizer's state too: the
        tensors between the parameters and the progress, handoff.py)."""
        if handoff is not None:
            self.opt.adopt(handoff[1:-1], self.bufs.device)
        self.cover.rebase()  # every part starts from the agreed weights: none has progress of its own yet
        self.codec.reset()  # a residual of weights the run no longer has (a joiner, a node back): e = 0
        self.landing.adopt(params, self.flight.on_it())


def unplaced(world: Any, node_id: str) -> str | None:
    """The warning of a node started without its place in the run (GLOBAL_RANK, GLOBAL_WORLD_SIZE), or None."""
    if None not in (getattr(world, "global_rank", 0), getattr(world, "global_world_size", 0)):
        return None
    return (f"GLOBAL_RANK and GLOBAL_WORLD_SIZE are not set on node {node_id}: it reads the data set's first share, "
            "as does every node started so (the same sequences); set both to each node's place and the run's node "
            "count (the console does)")


def event_fields(plan: Any, progress: Progress, got: Agreed, counted: list[tuple[str, float]], watch: Stopwatch,
                 compute_s: float, checksum: str) -> dict[str, Any]:
    """The outer_step event of a committed attempt (docs/telemetry.md): its checksum fingerprints the agreed weights."""
    wire, codec = (got.stats.wire_s, got.stats.codec_s) if got.stats else (0.0, 0.0)
    return {"outer_step": progress.outer_step, "step": progress.step, "generation": plan.generation,
            "members": list(plan.members), "pgrad_norm": got.sq ** 0.5, "bytes_sent": got.nbytes,
            **watch.seconds(wire, codec, compute_s), "checksum": checksum,
            "contributors": [m for m, _ in counted], "weights": [w for _, w in counted], "fp32_bytes": got.fp32_bytes,
            **({"left_out": got.left_out} if got.left_out else {})}
