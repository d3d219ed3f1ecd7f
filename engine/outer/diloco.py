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

The buffers (engine/outer/buffers.py) live where the parameters live and are allocated once: the math is a few
foreach/flat ops there, the codec encodes on that device and only the encoded bytes cross to the host.

Joiners (plan.joiners) send zeros with weight 0, then, after the commit, receive parameters, outer momentum and
Progress from plan.source by broadcasts over the same group (every member takes part; a non-source member checks
that what it received equals its own state). If that hand-off fails the commit stands: the joiner fails and is
dropped at the next boundary. A member the mesh left out (Excluded: it was declared dead, then came back) drops
its stale pseudo-gradient and re-joins as a joiner.

Only local rank 0 talks to the Mesh; it hands each answer (a Plan, a decision, or the error it raised) to the
other local ranks by a broadcast on the node's own group, so all local ranks take every branch together. Each
local rank r exchanges only its own tensors (FSDP: its shards) in the global group of "local rank r on every
member node", built per generation by engine.mesh.make_group. The node's worker count is part of the digest
the mesh compares, since shard layouts only line up between nodes with equal worker counts.

Every committed outer step emits an "outer_step" event whose checksum fingerprints the node's snapshot (every
parameter): identical on every member, which the end-to-end tests check; and its seconds (wire, codec, compute,
the whole outer step; docs/telemetry.md).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.outer import allreduce as compression
from engine.mesh.protocol import Excluded, MeshError, Reformed, Stopped
from engine.outer.buffers import OuterBuffers, fingerprint

_GROUP_ERRORS = (RuntimeError, TimeoutError, ConnectionError, OSError)


class PeerLost(RuntimeError):
    """A collective or group rendezvous was given up: a member stopped beating, or the attempt was decided."""


# ---------------------------------------------------------------------------------------------- outer optimizer

@dataclass
class Proposal:
    """An outer step computed but not yet committed."""
    params: torch.Tensor  # new flat fp32 parameters
    momentum: torch.Tensor | None  # new momentum buffer (None: this optimizer keeps none)


class OuterOptimizer:
    """The outer update on flat fp32 tensors. step_() updates a snapshot and the momentum in place (after a commit);
    propose() computes the same update into copies and changes nothing (tests, tools); commit() adopts a proposal.

    nesterov (torch.optim.SGD(nesterov=True) semantics, DiLoCo's default):
        buf = momentum * buf + g;  p = snapshot - lr * (g + momentum * buf)
    sgd: buf = momentum * buf + g;  p = snapshot - lr * buf   (plain SGD when momentum is 0)
    average: p = snapshot - g, the plain mean of the members' parameters (no lr, no momentum)
    """

    KINDS = ("nesterov", "sgd", "average")

    def __init__(self, kind: str, lr: float, momentum: float):
        if kind not in self.KINDS:
            raise ValueError(f"diloco.outer_optimizer: unknown {kind!r} (known: {', '.join(self.KINDS)})")
        self.kind, self.lr, self.beta = kind, lr, momentum
        # created on the first step (buf = g, like torch's SGD), then updated in place for the life of the run
        self.momentum: torch.Tensor | None = None

    @property
    def keeps_momentum(self) -> bool:
        return self.kind != "average" and self.beta > 0

    @torch.no_grad()
    def step_(self, snapshot: torch.Tensor, g: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """The updated parameters into `out` (default: the snapshot itself, in place) and the momentum updated in
        place. g is clobbered (scratch) and may be `out`; the snapshot is read only when out is given."""
        out = snapshot if out is None else out
        if self.kind == "average":
            torch.sub(snapshot, g, out=out)
            return
        if not self.keeps_momentum:
            torch.add(snapshot, g, alpha=-self.lr, out=out)
            return
        if self.momentum is None:
            self.momentum = g.clone()  # once per run: buf = g
        else:
            self.momentum.mul_(self.beta).add_(g)
        step = g.add_(self.momentum, alpha=self.beta) if self.kind == "nesterov" else self.momentum
        torch.add(snapshot, step, alpha=-self.lr, out=out)

    def propose(self, snapshot: torch.Tensor, pgrad: torch.Tensor) -> Proposal:
        """The update step_ would make, into copies: nothing of this optimizer changes."""
        params, kept = snapshot.clone(), self.momentum
        self.momentum = None if kept is None else kept.clone()
        try:
            self.step_(params, pgrad.clone())
            return Proposal(params, self.momentum if self.keeps_momentum else None)
        finally:
            self.momentum = kept

    def commit(self, proposal: Proposal) -> None:
        self.momentum = proposal.momentum

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "momentum": self.momentum}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("kind") != self.kind:
            raise ValueError(f"outer state: saved for outer_optimizer {sd.get('kind')!r}, config says {self.kind!r}")
        self.momentum = sd["momentum"]


# ---------------------------------------------------------------------------------------------- helpers

def flat_params(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one fp32 CPU vector (a copy; tests and tools; the outer step uses OuterBuffers)."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


class _Failed(MeshError):
    """Local rank 0's mesh call raised; every local rank raises this with its text."""


def _run_sliced(fn: Callable[[], Any], name: str, slice_s: float, give_up: Callable[[], str | None]) -> Any:
    """fn() in a helper thread, waited for in slices of slice_s; give_up() is asked after each slice and a reason
    ends the wait (PeerLost). gloo cannot cancel a collective: an abandoned one ends in its helper thread at its
    own timeout (diloco.allreduce_timeout), its result unused, its group never used again."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread below
            box["err"] = e
    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    while True:
        thread.join(slice_s)
        if not thread.is_alive():
            break
        reason = give_up()
        if reason:
            raise PeerLost(reason)
    if "err" in box:
        raise box["err"]
    return box["out"]


# ---------------------------------------------------------------------------------------------- the outer loop

class DilocoOuter:
    """The Outer of a DiLoCo run (see engine/outer/protocol.py for the protocol and docs/architecture.md)."""

    def __init__(self, cfg, mesh_cfg, world, inner, telemetry, *, config_digest: str,
                 local_group: dist.ProcessGroup | None = None,
                 mesh_factory: Callable[..., Any] | None = None,
                 group_factory: Callable[..., dist.ProcessGroup] | None = None):
        # mesh_factory / group_factory replace engine.mesh in unit tests
        self.cfg, self.mesh_cfg, self.world, self.inner, self.telemetry = cfg, mesh_cfg, world, inner, telemetry
        assert world.world_size == 1 or local_group is not None, "a node of several processes needs its group"
        self.local_group = local_group if world.world_size > 1 else None
        self.digest = f"{config_digest}/w{world.world_size}/p{compression.WIRE_PROTOCOL}"
        self.opt = OuterOptimizer(cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum)
        self.node_id: str = mesh_cfg.node_id or telemetry.node
        # snapshot, pseudo-gradient and mean, flat fp32 on the parameters' device (engine/outer/buffers.py)
        self.bufs = OuterBuffers(inner.outer_params())
        self._restored = False  # the snapshot came from a checkpoint (load_state_dict), not from the parameters
        self.last_phases: dict[str, float] = {}  # seconds per phase of the last outer step (bench/outer_step.py)
        self._round_started: float | None = None  # when this round's inner steps began (compute_s)
        self._boundary_at: float | None = None  # when the outer step began (outer_s)
        # (outer step, attempt, monotonic time) of this node's last arrival at a boundary: its peers can have been
        # held in that attempt's collectives since then, not only since this node entered them (_bounded)
        self._arrived: tuple[int, int, float] | None = None
        if cfg.overlap and world.world_size > 1:
            raise ValueError(f"diloco.overlap: needs nodes of one process; this node has {world.world_size} (its "
                             f"local collectives would run beside the inner strategy's on the same group)")
        # overlap (see "Overlap" below): the round in flight, what it raised, its counters, and where the anchor
        # (the weights this round trained from) is: snapshot - pgrad when _anchored, else the snapshot
        self._flight: threading.Thread | None = None
        self._flight_error: BaseException | None = None
        self._flight_progress: tuple[Any, Any, int, int] | None = None
        self._flight_compute = 0.0
        self._anchored = False
        self._pgrad_ready = False  # bufs.pgrad already holds this round's pseudo-gradient
        self._stream: Any = None  # CUDA: the background outer step's stream
        self.mesh: Any = None  # local rank 0 only
        self._store: Any = None
        self._mesh_factory, self._group_factory = mesh_factory, group_factory
        self._groups: dict[int, dist.ProcessGroup] = {}
        self._drain = threading.Event()
        # polled by every mesh wait and collective (train.Signals.requested): "stopped" / "drained" end the wait
        self.interrupt: Callable[[], str | None] | None = None
        self._contributing = False  # in a round this node contributes to: a drain waits for its commit
        self._discard = False  # this round's pseudo-gradient is not finite: not counted, the run's weights adopted
        self._diverged_at_boundary = False  # overlap: the boundary found this round diverged (see _overlap_boundary)
        self._store_stale = False  # a group build failed: reconnect this rank's store client before the next
        self._left = False
        self._started = False  # mesh.start() succeeded: only then may close() say goodbye under this id
        # committed rounds in this process. Every non-joiner member of a run's first plan (its formation, or a
        # re-formation after all nodes stopped) has none, so they all agree to align their state on the source's:
        # nodes resumed from checkpoints of different ages then start from one set of weights.
        self._rounds = 0
        self.last_outer_step: dict[str, Any] | None = None  # the last "outer_step" event (tests, benchmarks)
        self._recent_wire: collections.deque[float] = collections.deque(maxlen=5)  # seconds of recent all-reduces

    # ------------------------------------------------------------------ local group plumbing

    @property
    def _leader(self) -> bool:
        return self.world.rank == 0

    def _share(self, obj: Any) -> Any:
        """Local rank 0's obj on every local rank."""
        if self.local_group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group_src=0, group=self.local_group)
        return box[0]

    def _on_leader(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a mesh call on local rank 0; every local rank gets its result or raises its error (a stop, a
        re-formation and an exclusion as themselves, anything else as _Failed)."""
        out: Any = None
        if self._leader:
            try:
                out = ("ok", fn())
            except Excluded as e:
                out = ("excluded", str(e), e)
            except Stopped as e:
                out = ("stopped", e.reason, e)
            except Reformed as e:
                out = ("reformed", str(e), e)
            except Exception as e:  # handed to the other ranks, then raised on every rank below
                out = ("error", f"{what}: {type(e).__name__}: {e}", e)
        shared = self._share(out if out is None or out[0] == "ok" else out[:2])
        if shared[0] == "ok":
            return shared[1]
        if self._leader:
            raise out[2]
        kind, text = shared
        if kind == "stopped":
            raise Stopped(text, what)
        raise {"excluded": Excluded, "reformed": Reformed}.get(kind, _Failed)(text)

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
        return self._local_any(self.interrupt is not None and self.interrupt() == "drained")

    def _local_any(self, flag: bool) -> bool:
        if self.local_group is None:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.local_group)
        return bool(t.item())

    def _local_stats(self, ok: bool, nbytes: int, sq_norm: float) -> tuple[bool, int, float]:
        """(every local rank ok, bytes sent by the node, squared norm over the node's shards)."""
        mine = torch.tensor([float(ok), float(nbytes), sq_norm], dtype=torch.float64)
        if self.local_group is None:
            return ok, nbytes, sq_norm
        rows = [torch.empty_like(mine) for _ in range(self.world.world_size)]
        dist.all_gather(rows, mine, group=self.local_group)
        table = torch.stack(rows)
        return bool(table[:, 0].min() > 0), int(table[:, 1].sum()), float(table[:, 2].sum())

    @property
    def snapshot(self) -> torch.Tensor:
        return self.bufs.snapshot

    def _checksum(self) -> str:
        """A fingerprint of the snapshot (the parameters as of this outer step) where it lives, joined over the
        node's local ranks; identical on every member (engine/outer/buffers.py)."""
        mine = fingerprint(self._agreed())
        if self.local_group is None:
            return mine[:12]
        parts: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(parts, mine, group=self.local_group)
        return hashlib.blake2b("".join(parts).encode(), digest_size=6).hexdigest()

    def _emit(self, type_: str, **fields: Any) -> None:
        event = self.telemetry.emit(type_, **fields)
        if type_ == "outer_step":
            self.last_outer_step = event

    # ------------------------------------------------------------------ mesh and groups

    def _connect(self) -> None:
        if self._mesh_factory is not None:
            self.mesh = self._mesh_factory(self) if self._leader else None
            return
        from engine.mesh import Mesh, open_store
        m = self.mesh_cfg
        # every local rank needs the store to build its own global group; only rank 0 owns the Mesh
        self._store = open_store(m)
        if self._leader:
            info = {"host": self.world.hostname, "pid": self.world.pid, "workers": self.world.world_size}
            self.mesh = Mesh(self._store, self.node_id, m, digest=self.digest, info=info,
                             min_nodes=self.cfg.min_nodes, emit=self.telemetry.emit, interrupt=self._interrupted,
                             reconnect=lambda: open_store(m, probe_timeout=m.heartbeat_interval, like=self._store))

    def _group(self, plan: Any) -> dist.ProcessGroup | None:
        if plan.size == 1:
            return None
        pg = self._groups.get(plan.generation)
        if pg is None:
            # an older generation's group is never used again; dropping it frees its sockets
            self._groups.clear()
            if self._group_factory is not None:
                pg = self._group_factory(plan, self.node_id, self.world.rank)
            else:
                from engine.mesh import make_group, open_store
                if self._store_stale:  # the store went away under this rank's client: a fresh one
                    self._store = self.mesh.store if self.mesh is not None else open_store(self.mesh_cfg)
                    self._store_stale = False
                # a client of its own: a rendezvous given up stays blocked in its wait on that client, and a
                # shared client would block every store call of this rank (the mesh's included) behind it
                store = (self.mesh.store if self.mesh is not None else self._store).clone()
                pg = self._bounded(plan, "group rendezvous", lambda: make_group(
                    store, plan, self.node_id, self.world.rank, self.cfg.allreduce_timeout))
            self._groups[plan.generation] = pg
        return pg

    def _bounded(self, plan: Any, what: str, fn: Callable[[], Any], *, until_decided: bool = True) -> Any:
        """A collective or rendezvous that a frozen, partitioned or dead peer cannot hold up for longer than the
        heartbeat timeout (plus a poll): given up when local rank 0's heartbeat sees a member dead, or when
        the attempt was decided without this rank (read from the store by every rank; until_decided=False for
        the hand-off, which runs after the decision), or on a stop."""
        if self._store is None:
            return fn()  # unit tests with an injected mesh: no store to watch
        from engine.mesh import Keys
        decision = Keys().decision(plan.epoch, plan.outer_step, plan.attempt)
        began, overdue = time.monotonic(), self._straggler_timeout()
        arrived = self._arrived
        if arrived is not None and arrived[:2] == (plan.outer_step, plan.attempt):
            # the plan needed this node's arrival, so its peers were held from (at the earliest) then: a node whose
            # slow link delayed its arrival or its reading of the plan has used up that much of the budget already
            began = min(began, arrived[2])

        def give_up() -> str | None:
            if self.world.world_size == 1:  # several local ranks leave together, through the mesh calls
                reason = self._interrupted()
                if reason:
                    raise Stopped(reason, what)
            if self.mesh is not None:
                dead = self.mesh.dead_members(plan)
                if dead:
                    return f"{what}: {', '.join(dead)} stopped beating (mesh.heartbeat_timeout)"
            if not until_decided:
                return None
            if self.mesh is not None and time.monotonic() - began > overdue and self.mesh.link_slow():
                # this node is the straggler: its own store round trips are being retransmitted while the
                # collective is overdue. It steps out (and aborts the attempt) rather than hold its peers for as
                # long as the fault lasts; its other local ranks see the abort at their next poll
                why = f"{what} overdue ({overdue:.1f}s, diloco.straggler_timeout) on a slow link (mesh.slow_tick)"
                self.mesh.step_out(plan, why)
                return why
            store = self.mesh.store if self.mesh is not None else self._store
            try:
                decided = store.check([decision]) and bool(store.get(decision))
            except _GROUP_ERRORS:
                decided = False  # the store is away: the collective may still finish; the mesh handles the store
            return f"{what}: outer step {plan.outer_step} attempt {plan.attempt} was decided" if decided else None
        return _run_sliced(fn, f"diloco-{what.replace(' ', '-')}", self.mesh_cfg.polling_interval, give_up)

    def _straggler_timeout(self) -> float:
        """How long a collective may run before a member on a slow link steps out (diloco.straggler_timeout)."""
        if self.cfg.straggler_timeout:
            return self.cfg.straggler_timeout
        return max(self.mesh_cfg.heartbeat_timeout / 2, 4 * max(self._recent_wire, default=0.0))

    # ------------------------------------------------------------------ the Outer protocol

    def start(self, progress: Any) -> None:
        """Join the mesh. A joiner waits for admission, takes part in that outer step with weight 0 and then
        receives parameters, outer state and progress from the plan's source."""
        self.node_id = self._share(self.node_id)  # local rank 0's id names the node
        self._connect_everywhere()
        joiner = self._on_leader("mesh start", lambda: self.mesh.start())
        self._started = True
        if not self._restored:
            self.bufs.capture(self.inner.outer_params())
        self._round_started = self._boundary_at = time.perf_counter()
        if joiner:
            self._emit("state", state="joining")
            plan = self._on_leader("mesh admission", lambda: self.mesh.wait_admission())
            self._round(progress, plan=plan, draining=False)
        elif progress.step and progress.step % self.cfg.inner_steps == 0 \
                and progress.step // self.cfg.inner_steps > progress.outer_step:
            # resumed from a checkpoint saved at a boundary before it committed (a stop or a failure in the
            # boundary wait): contribute that round now rather than fold it into the next one
            self._round(progress, plan=None, draining=False)

    def _connect_everywhere(self) -> None:
        err: str | None = None
        try:
            self._connect()
        except Exception as e:  # agreed on below, then raised on every rank
            err = f"{type(e).__name__}: {e}"
            if self.local_group is None:
                raise
        errs: list[Any] = [err]
        if self.local_group is not None:
            errs = [None] * self.world.world_size
            dist.all_gather_object(errs, err, group=self.local_group)
        bad = [e for e in errs if e]
        if bad:
            raise MeshError(f"mesh: {bad[0]}")

    def request_drain(self) -> None:
        """Safe from a signal handler: only sets a flag, read at the next inner step."""
        self._drain.set()

    def after_inner_step(self, progress: Any) -> bool:
        if progress.step % self.cfg.inner_steps:
            return False
        self._boundary_at = time.perf_counter()
        self.last_phases = {}
        draining = self._local_any(self._drain.is_set())
        if self.cfg.overlap:
            self._overlap_boundary()
            if not draining:  # a draining node's last round is synchronous: it contributes it, then leaves
                self._launch(progress)
                return False
        self._round(progress, plan=None, draining=draining)
        if not draining and not self._drain_requested_meanwhile():
            return False
        if self._leader:
            self.mesh.leave("drained")
        self._left = True
        self._emit("drained", outer_step=progress.outer_step, step=progress.step)
        return True

    def close(self, status: str) -> None:
        """Say goodbye (peers drop this node at once instead of waiting a heartbeat timeout)."""
        if self._flight is not None:  # overlap: the round in flight ends (bounded) before this node says goodbye
            self._flight.join(timeout=self._flight_timeout())
            self._flight = None
        self._groups.clear()
        if self._group_factory is None:
            from engine.mesh import forget_groups
            forget_groups()
        if self.mesh is not None:
            try:
                if self._started and not self._left:
                    # a rejected node (duplicate id, other digest) must not write a goodbye under a live node's
                    # id; run_end statuses -> mesh leave reasons; a stop is not a completion
                    self.mesh.leave({"completed": "completed", "drained": "drained"}.get(status, "failed"))
            except MeshError as e:  # the store is gone: the peers see this node's silence instead of a goodbye
                self._emit("warning", message=f"no goodbye to the mesh: {e}")
            finally:
                self.mesh.close()
                self.mesh = None
        self._left = True

    def state_dict(self) -> dict[str, Any]:
        assert self._flight is None, "overlap: flush() lands the round in flight before a checkpoint"
        return {"snapshot": self.bufs.snapshot.cpu(), "outer_optimizer": self.opt.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        snapshot = sd["snapshot"]
        if snapshot.numel() != self.bufs.numel:
            raise ValueError(f"outer state: the snapshot holds {snapshot.numel()} values, this node's parameters "
                             f"{self.bufs.numel} (another model or worker count?)")
        self.bufs.snapshot.copy_(snapshot)
        self._restored = True
        self.opt.load_state_dict(sd["outer_optimizer"])
        if self.opt.momentum is not None:
            self.opt.momentum = self.opt.momentum.to(self.bufs.device, torch.float32)

    # ------------------------------------------------------------------ one outer step, with retries

    def _round(self, progress: Any, *, plan: Any, draining: bool) -> None:
        """One outer step. plan is given for a joiner (its admission); members ask the mesh for it. A member the
        mesh left out (it arrived late, Excluded) re-joins: its pseudo-gradient is stale, it takes the state.
        A plan that lists a member as a joiner (a formation at a newer outer step than its checkpoint) makes it
        one too. After a store restart (Reformed) the round starts over in the re-formed run."""
        joining = plan is not None
        index = plan.outer_step if joining else progress.outer_step + 1
        attempt = plan.attempt if joining else 0
        pgrad = None
        rejoined = False  # left out mid-run and admitted again: say "training" once it has the state
        self._discard = False
        if not joining:
            pgrad = self._pseudo_gradient()
            self._discard = self._not_finite(pgrad, index)
        self._contributing = not joining and not self._discard
        for _ in range(self.cfg.max_attempts):
            try:
                if plan is None:
                    plan, rejoined = self._plan(index, attempt, joining, draining, rejoined)
                if self.node_id in plan.joiners and not joining:
                    joining, index = True, plan.outer_step
                    self._contributing = False  # it takes the state: nothing of it is counted
                if self._attempt(plan, pgrad, progress):
                    if rejoined:
                        self._emit("state", state="training")
                    return
            except Reformed as e:
                self._emit("warning", message=f"{e}")
                self._after_reform()
                attempt, plan = 0, None
                continue
            attempt, plan = plan.attempt + 1, None
        raise MeshError(f"outer step {index}: no attempt committed in {self.cfg.max_attempts} tries "
                        f"(diloco.max_attempts)")

    def _plan(self, index: int, attempt: int, joining: bool, draining: bool, rejoined: bool) -> tuple[Any, bool]:
        """The plan of (index, attempt) from the mesh, or, when this node was left out, its admission."""
        self._arrived = (index, attempt, time.monotonic())
        try:
            return self._on_leader("mesh boundary", lambda: self.mesh.boundary(
                index, attempt, contributing=not joining and not self._discard, draining=draining)), rejoined
        except Excluded as e:
            self._emit("warning", message=f"{e}")
            self._emit("state", state="joining")
            self._contributing = False  # a drain now leaves at once: there is no round left to contribute
            return self._on_leader("mesh admission", lambda: self.mesh.wait_admission()), True

    def _after_reform(self) -> None:
        """The store restarted empty: every group of the old store is gone, and so is every rank's client."""
        self._groups.clear()
        self._store_stale = self._group_factory is None
        if self._group_factory is None:
            from engine.mesh import forget_groups
            forget_groups()

    def _attempt(self, plan: Any, pgrad: torch.Tensor | None, progress: Any) -> bool:
        joiner = self.node_id in plan.joiners
        assert joiner or pgrad is not None, "a member without a pseudo-gradient"
        # the mesh's contributors: members that are not joiners and arrived with a pseudo-gradient
        contributors = plan.contributors or [m for m in plan.members if m not in plan.joiners]
        weight = 1.0 if self.node_id in contributors and not joiner and not self._discard else 0.0
        # zeros go out of the mean buffer: pgrad stays intact for a retry that counts it
        send = pgrad if weight else self.bufs.mean.zero_()
        stats, reason = None, ""
        try:
            group = self._group(plan)
            # into bufs.mean; nothing of the node's state (params, momentum, snapshot) changes before the commit
            _, stats = self._bounded(plan, "all-reduce", lambda: compression.weighted_mean(
                send, weight, group, self.cfg.compression, out=self.bufs.mean, exchange=self.bufs.exchange))
        except compression.NothingToAverage:
            if self._discard:
                self._every_member_diverged(plan)
            raise
        except _GROUP_ERRORS as e:
            reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            self._groups.pop(plan.generation, None)  # a group whose collective failed is never reused
            self._store_stale = self._group_factory is None and not isinstance(e, PeerLost)
            if isinstance(e, PeerLost):
                # the abandoned collective's thread may still write into the mean and wire buffers
                self.bufs.renew_scratch()
            if self._group_factory is None:
                from engine.mesh import forget_groups
                forget_groups()
        with self._phase("norm"):
            sq = float(torch.linalg.vector_norm(self.bufs.mean)) ** 2 if stats is not None else 0.0
        ok, nbytes, sq = self._local_stats(stats is not None, stats.bytes_sent if stats else 0, sq)
        if not self._on_leader("mesh commit", lambda: self.mesh.commit(plan, ok)):
            why = reason or ("another local rank failed" if not ok else "another member failed")
            self._emit("warning", message=f"outer step {plan.outer_step} attempt {plan.attempt} "
                                          f"(generation {plan.generation}) aborted: {why}")
            return False
        if joiner:
            self._receive_state(plan, progress)
        else:
            self._apply()
            if self._discard and not self._in_flight():  # it holds the run's weights now; its moments are NaN
                self.inner.reset_optimizer_state()  # (overlap: done at the boundary, _overlap_boundary)
            progress.outer_step = plan.outer_step
            if plan.joiners or (self._rounds == 0 and plan.size > 1):
                with self._phase("handoff"):
                    self._send_state(plan, progress)
        self._rounds += 1
        if stats is not None:
            self._recent_wire.append(stats.wire_s + stats.codec_s)
        # whose pseudo-gradient entered the mean, with the weights the reduce really used (off the wire)
        counted = [(m, w) for m, w in zip(plan.members, stats.weights if stats else []) if w > 0]
        self._emit("outer_step", outer_step=progress.outer_step, step=progress.step, generation=plan.generation,
                   members=list(plan.members), pgrad_norm=sq ** 0.5, bytes_sent=nbytes,
                   **self._timings(stats, checksum=self._checksum()),
                   contributors=[m for m, _ in counted], weights=[w for _, w in counted])
        if not self._in_flight():
            self._round_started = time.perf_counter()
        return True

    # ------------------------------------------------------------------ the math, where the parameters live

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time a phase of the outer step into last_phases (on CUDA up to the end of its kernels)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.bufs.device.type == "cuda":
                torch.cuda.synchronize(self.bufs.device)
            self.last_phases[name] = self.last_phases.get(name, 0.0) + time.perf_counter() - t0

    def _not_finite(self, pgrad: torch.Tensor, index: int) -> bool:
        """A node whose round diverged (NaN or inf in its weights) must not poison the run's: its pseudo-gradient
        is left out of the mean (it arrives as not contributing and sends weight 0), and at the commit it takes the
        run's new weights like every member, with fresh optimizer state. Agreed across the node's local ranks."""
        if self._diverged_at_boundary:  # overlap: found (and repaired) on the main thread at the boundary
            self._diverged_at_boundary = False
            return True
        bad = self._local_any(not bool(torch.isfinite(pgrad).all()))
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
        if self._pgrad_ready:  # overlap: taken at the boundary, before the round went to the background
            self._pgrad_ready = False
            return self.bufs.pgrad
        with self._phase("pseudo_gradient"):
            return self.bufs.pseudo_gradient(self.inner.outer_params())

    def _timings(self, stats: compression.ReduceStats | None, *, checksum: str) -> dict[str, Any]:
        """The outer_step event's seconds (docs/telemetry.md) and its checksum, computed first so outer_s
        covers it. allreduce_s = wire_s + codec_s (kept for older readers)."""
        wire, codec = (stats.wire_s, stats.codec_s) if stats else (0.0, 0.0)
        self.last_phases.update(wire=wire, codec=codec)
        now = time.perf_counter()
        began = self._boundary_at if self._boundary_at is not None else now
        compute = began - self._round_started if self._round_started is not None else 0.0
        if self._in_flight():
            compute = self._flight_compute
        return {"allreduce_s": wire + codec, "wire_s": wire, "codec_s": codec, "compute_s": max(0.0, compute),
                "outer_s": now - began, "checksum": checksum}

    def _apply(self) -> None:
        """The committed update, in place: snapshot and momentum from the mean, then the parameters. A round in
        flight (overlap) leaves the new weights in bufs.mean: the boundary after it puts them in place."""
        if self._in_flight():
            with self._phase("optimizer"):
                self.opt.step_(self.bufs.snapshot, self.bufs.mean, out=self.bufs.mean)
            return
        with self._phase("optimizer"):
            self.opt.step_(self.bufs.snapshot, self.bufs.mean)
        with self._phase("write_back"):
            self.bufs.write_back(self.inner.outer_params())
            self.inner.after_outer_update()

    def _adopt(self, params: torch.Tensor, handoff: list[torch.Tensor] | None = None) -> None:
        """Make params this node's weights and snapshot (and, from a hand-off, the outer momentum too)."""
        if handoff is not None and self.opt.keeps_momentum:
            if self.opt.momentum is None:
                self.opt.momentum = handoff[1].to(self.bufs.device, torch.float32, copy=True)
            else:
                self.opt.momentum.copy_(handoff[1])
        if self._in_flight():  # overlap: the weights land at the next boundary, like an update
            if params.data_ptr() != self.bufs.mean.data_ptr():
                self.bufs.mean.copy_(params)
            return
        self.bufs.snapshot.copy_(params)
        self.bufs.write_back(self.inner.outer_params())
        self.inner.after_outer_update()

    # ------------------------------------------------------------------ overlap (diloco.overlap)
    #
    # At boundary t the round's pseudo-gradient d_t = anchor - params is taken, the weights are rebased on the
    # newest agreed weights (params = snapshot - d_t: the agreed weights plus this round's own progress, which is
    # also the next round's anchor), and the whole outer step of round t (mesh boundary, exchange, commit,
    # retries, hand-offs) runs in a background thread while round t+1 trains. Its result (the outer optimizer's
    # new weights, or a hand-off's) lands in bufs.mean; snapshot and parameters move only on the main thread, at
    # the next boundary or at flush(). So each node's progress is averaged one round late, and no progress is
    # lost or counted twice: after every landing, params = agreed weights + the node's not yet exchanged progress.

    def _in_flight(self) -> bool:
        """True on the background thread of overlap."""
        return self._flight is not None and threading.current_thread() is self._flight

    def _agreed(self) -> torch.Tensor:
        """The weights the members agreed on last: the round in flight's result once it committed there."""
        return self.bufs.mean if self._in_flight() else self.bufs.snapshot

    def _flight_timeout(self) -> float:
        m = self.mesh_cfg
        return self.cfg.max_attempts * (self.cfg.allreduce_timeout + m.store_timeout + m.join_timeout
                                        + 2 * m.heartbeat_timeout) + m.start_timeout

    def _launch(self, progress: Any) -> None:
        frozen = copy.copy(progress)  # the round's own counters (engine.outer imports this module: no import back)
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

    def _overlap_boundary(self) -> None:
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

    def flush(self) -> None:
        """Overlap: land the round in flight into the parameters now (before a checkpoint or the export). This
        round's progress so far stays in the parameters and is exchanged at its boundary."""
        if self._settle():
            self._rebase(True)
            self._anchored = False  # the round's anchor, rebased, is the new snapshot itself

    # ------------------------------------------------------------------ state hand-off to joiners

    def _handoff_tensors(self, progress: Any, *, source: bool) -> list[torch.Tensor]:
        """In order: parameters, outer momentum (when kept), progress. The source sends its own state; the others
        receive into host tensors (the parameters into the free mean buffer when it is on the host). Gloo moves
        host tensors only, so on a GPU these are host copies (a hand-off is rare: joins and a run's first step)."""
        on_host = self.bufs.device.type == "cpu" and not self._in_flight()  # in flight, bufs.mean holds the result
        if source:
            out = [self._agreed().cpu()]
            if self.opt.keeps_momentum:
                mom = self.opt.momentum
                out.append(mom.cpu() if mom is not None else torch.zeros(self.bufs.numel))
        else:
            out = [self.bufs.mean if on_host else torch.empty(self.bufs.numel)]
            if self.opt.keeps_momentum:
                out.append(torch.empty(self.bufs.numel))
        out.append(torch.tensor([progress.step, progress.outer_step, progress.tokens], dtype=torch.int64))
        return out

    def _broadcast(self, plan: Any, tensors: list[torch.Tensor]) -> None:
        pg = self._group(plan)
        assert pg is not None, "a plan with joiners has more than one member"
        opts = dist.BroadcastOptions()
        opts.rootRank = plan.rank_of(plan.source)

        def send_all() -> None:
            for t in tensors:
                pg.broadcast([t], opts).wait()
        self._bounded(plan, "state hand-off", send_all, until_decided=False)

    def _send_state(self, plan: Any, progress: Any) -> None:
        """Every member takes part in the broadcast; a member that is not the source compares what it got with
        its own state, a free check that the members agree, and adopts the source's state where it differs."""
        tensors = self._handoff_tensors(progress, source=self.node_id == plan.source)
        try:
            self._broadcast(plan, tensors)
        except _GROUP_ERRORS as e:
            # already committed here: a joiner that missed its state fails on its side and is dropped later
            self._emit("warning", message=f"state hand-off to {list(plan.joiners)} failed: {str(e)[:200]}")
            return
        if self.node_id != plan.source and not torch.equal(tensors[0], self._agreed().cpu()):
            self._emit("warning", message=f"outer step {plan.outer_step}: parameters differed from source "
                                          f"{plan.source}'s; adopted the source's")
            self._adopt(tensors[0], tensors)

    def _receive_state(self, plan: Any, progress: Any) -> None:
        tensors = self._handoff_tensors(progress, source=False)
        try:
            self._broadcast(plan, tensors)
        except _GROUP_ERRORS as e:
            raise RuntimeError(f"join: state from {plan.source} did not arrive: {str(e)[:200]}") from None
        self._adopt(tensors[0], tensors)
        counters = tensors[-1].tolist()
        progress.step, progress.outer_step, progress.tokens = (int(c) for c in counters)
