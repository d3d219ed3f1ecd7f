"""DiLoCo's outer loop (arXiv 2311.08105, INTELLECT-1 arXiv 2412.01152), wrapped around any Inner.

Every H inner steps, on every local rank of every member node:

    pgrad    = snapshot - current                 fp32, on CPU (the snapshot never lives on the accelerator)
    mean     = sum_i(w_i * pgrad_i) / sum_i(w_i)  over "local rank r of every member node"; joiners have w = 0
    proposal = outer optimizer(snapshot, mean)    into temporaries: nesterov | sgd | average
    ok       = MIN over this node's local ranks of "my exchange succeeded"
    commit   = mesh.commit(plan, ok)              the store's decision, the same for every member
    commit:  copy proposal into inner.outer_params(), inner.after_outer_update(), snapshot = proposal,
             then `plan.source` hands parameters, outer momentum and Progress to the plan's joiners
    abort:   nothing changed (params, momentum, snapshot); the same pgrad is retried with attempt + 1 on the
             plan the mesh gives next (without the dead), at most diloco.max_attempts times

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

Every committed outer step emits an "outer_step" event whose checksum hashes all of the node's parameters:
identical on every member, which the end-to-end tests check.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine import compression
from engine.mesh.protocol import Excluded, MeshError

_GROUP_ERRORS = (RuntimeError, TimeoutError, ConnectionError, OSError)


# ---------------------------------------------------------------------------------------------- outer optimizer

@dataclass
class Proposal:
    """An outer step computed but not yet committed."""
    params: torch.Tensor  # new flat fp32 parameters
    momentum: torch.Tensor | None  # new momentum buffer (None: this optimizer keeps none)


class OuterOptimizer:
    """The outer update on flat fp32 CPU tensors. propose() never mutates anything; commit() adopts a proposal.

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
        self.momentum: torch.Tensor | None = None  # created on the first commit, like torch's SGD

    @property
    def keeps_momentum(self) -> bool:
        return self.kind != "average" and self.beta > 0

    def propose(self, snapshot: torch.Tensor, pgrad: torch.Tensor) -> Proposal:
        if self.kind == "average":
            return Proposal(snapshot - pgrad, None)
        if not self.keeps_momentum:
            return Proposal(snapshot - self.lr * pgrad, None)
        buf = pgrad.clone() if self.momentum is None else self.momentum * self.beta + pgrad
        step = pgrad + self.beta * buf if self.kind == "nesterov" else buf
        return Proposal(snapshot - self.lr * step, buf)

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
    """The tensors as one fp32 CPU vector (a copy)."""
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def write_flat(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat fp32 vector back into the tensors, each in its own device and dtype."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape).to(t.device, t.dtype))
            offset += n
    assert offset == flat.numel(), "parameter count changed since the snapshot"


def tensor_digest(flat: torch.Tensor) -> str:
    return hashlib.blake2b(flat.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()


class _Failed(MeshError):
    """Local rank 0's mesh call raised; every local rank raises this with its text."""


# ---------------------------------------------------------------------------------------------- the outer loop

class DilocoOuter:
    """The Outer of a DiLoCo run (see engine/outer.py for the protocol and docs/architecture.md)."""

    def __init__(self, cfg, mesh_cfg, world, inner, telemetry, *, config_digest: str,
                 local_group: dist.ProcessGroup | None = None,
                 mesh_factory: Callable[..., Any] | None = None,
                 group_factory: Callable[..., dist.ProcessGroup] | None = None):
        # mesh_factory / group_factory replace engine.mesh in unit tests
        self.cfg, self.mesh_cfg, self.world, self.inner, self.telemetry = cfg, mesh_cfg, world, inner, telemetry
        assert world.world_size == 1 or local_group is not None, "a node of several processes needs its group"
        self.local_group = local_group if world.world_size > 1 else None
        self.digest = f"{config_digest}/w{world.world_size}"
        self.opt = OuterOptimizer(cfg.outer_optimizer, cfg.outer_lr, cfg.outer_momentum)
        self.node_id: str = mesh_cfg.node_id or telemetry.node
        self.snapshot: torch.Tensor | None = None
        self.mesh: Any = None  # local rank 0 only
        self._store: Any = None
        self._mesh_factory, self._group_factory = mesh_factory, group_factory
        self._groups: dict[int, dist.ProcessGroup] = {}
        self._drain = threading.Event()
        self._left = False
        self._started = False  # mesh.start() succeeded: only then may close() say goodbye under this id
        # committed rounds in this process. Every non-joiner member of a run's first plan (its formation, or a
        # re-formation after all nodes stopped) has none, so they all agree to align their state on the source's:
        # nodes resumed from checkpoints of different ages then start from one set of weights.
        self._rounds = 0
        self.last_outer_step: dict[str, Any] | None = None  # the last "outer_step" event (tests, benchmarks)

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
        """Run a mesh call on local rank 0; every local rank gets its result or raises its error."""
        out: Any = None
        if self._leader:
            try:
                out = ("ok", fn())
            except Excluded as e:
                out = ("excluded", str(e), e)
            except Exception as e:  # handed to the other ranks, then raised on every rank below
                out = ("error", f"{what}: {type(e).__name__}: {e}", e)
        shared = self._share(out if out is None or out[0] == "ok" else out[:2])
        if shared[0] == "ok":
            return shared[1]
        if self._leader:
            raise out[2]
        raise Excluded(shared[1]) if shared[0] == "excluded" else _Failed(shared[1])

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

    def _checksum(self) -> str:
        mine = tensor_digest(flat_params(self.inner.outer_params()))
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
        from engine.mesh import Mesh, connect_store
        m = self.mesh_cfg
        # every local rank needs the store to build its own global group; only rank 0 owns the Mesh
        self._store = connect_store(m.store_addr, m.store_port, m.store_timeout)
        if self._leader:
            info = {"host": self.world.hostname, "pid": self.world.pid, "workers": self.world.world_size}
            self.mesh = Mesh(self._store, self.node_id, m, digest=self.digest, info=info,
                             min_nodes=self.cfg.min_nodes, emit=self.telemetry.emit)

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
                from engine.mesh import make_group
                pg = make_group(self._store, plan, self.node_id, self.world.rank, self.cfg.allreduce_timeout)
            self._groups[plan.generation] = pg
        return pg

    # ------------------------------------------------------------------ the Outer protocol

    def start(self, progress: Any) -> None:
        """Join the mesh. A joiner waits for admission, takes part in that outer step with weight 0 and then
        receives parameters, outer state and progress from the plan's source."""
        self.node_id = self._share(self.node_id)  # local rank 0's id names the node
        self._connect_everywhere()
        joiner = self._on_leader("mesh start", lambda: self.mesh.start())
        self._started = True
        if self.snapshot is None:  # not restored by load_state_dict
            self.snapshot = flat_params(self.inner.outer_params())
        if joiner:
            self._emit("state", state="joining")
            plan = self._on_leader("mesh admission", lambda: self.mesh.wait_admission())
            self._round(progress, plan=plan, draining=False)

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
        draining = self._local_any(self._drain.is_set())
        self._round(progress, plan=None, draining=draining)
        if not draining:
            return False
        if self._leader:
            self.mesh.leave("drained")
        self._left = True
        self._emit("drained", outer_step=progress.outer_step, step=progress.step)
        return True

    def close(self, status: str) -> None:
        """Say goodbye (peers drop this node at once instead of waiting a heartbeat timeout)."""
        self._groups.clear()
        if self._group_factory is None:
            from engine.mesh import forget_groups
            forget_groups()
        if self.mesh is not None:
            if self._started and not self._left:
                # a rejected node (duplicate id, other digest) must not write a goodbye under a live node's id;
                # run_end statuses -> mesh leave reasons; a stop is not a completion
                self.mesh.leave({"completed": "completed", "drained": "drained"}.get(status, "failed"))
            self.mesh.close()
            self.mesh = None
        self._left = True

    def state_dict(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot, "outer_optimizer": self.opt.state_dict()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.snapshot = sd["snapshot"]
        self.opt.load_state_dict(sd["outer_optimizer"])

    # ------------------------------------------------------------------ one outer step, with retries

    def _round(self, progress: Any, *, plan: Any, draining: bool) -> None:
        """One outer step. plan is given for a joiner (its admission); members ask the mesh for it. A member the
        mesh left out (it arrived late, Excluded) re-joins: its pseudo-gradient is stale, it takes the state."""
        joining = plan is not None
        index = plan.outer_step if joining else progress.outer_step + 1
        attempt = plan.attempt if joining else 0
        pgrad = None
        rejoined = False  # left out mid-run and admitted again: say "training" once it has the state
        if not joining:
            assert self.snapshot is not None
            pgrad = self.snapshot - flat_params(self.inner.outer_params())
        for _ in range(self.cfg.max_attempts):
            if plan is None:
                try:
                    plan = self._on_leader("mesh boundary", lambda: self.mesh.boundary(
                        index, attempt, contributing=not joining, draining=draining))
                except Excluded as e:
                    self._emit("warning", message=f"{e}")
                    self._emit("state", state="joining")
                    plan = self._on_leader("mesh admission", lambda: self.mesh.wait_admission())
                    joining, index, rejoined = True, plan.outer_step, True
            if self._attempt(plan, pgrad, progress):
                if rejoined:
                    self._emit("state", state="training")
                return
            attempt, plan = plan.attempt + 1, None
        raise RuntimeError(f"outer step {index}: no attempt committed in {self.cfg.max_attempts} tries "
                           f"(diloco.max_attempts)")

    def _attempt(self, plan: Any, pgrad: torch.Tensor | None, progress: Any) -> bool:
        joiner = self.node_id in plan.joiners
        assert joiner or pgrad is not None, "a member without a pseudo-gradient"
        assert self.snapshot is not None
        # the mesh's contributors: members that are not joiners and arrived with a pseudo-gradient
        contributors = plan.contributors or [m for m in plan.members if m not in plan.joiners]
        weight = 1.0 if self.node_id in contributors and not joiner else 0.0
        send = pgrad if weight else torch.zeros_like(self.snapshot)
        mean, proposal, stats, reason = None, None, None, ""
        try:
            group = self._group(plan)
            mean, stats = compression.weighted_mean(send, weight, group, self.cfg.compression)
            if not joiner:
                proposal = self.opt.propose(self.snapshot, mean)
        except _GROUP_ERRORS as e:
            reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            self._groups.pop(plan.generation, None)  # a group whose collective failed is never reused
            if self._group_factory is None:
                from engine.mesh import forget_groups
                forget_groups()
        sq = float(mean.double().pow(2).sum()) if mean is not None else 0.0
        ok, nbytes, sq = self._local_stats(stats is not None, stats.bytes_sent if stats else 0, sq)
        if not self._on_leader("mesh commit", lambda: self.mesh.commit(plan, ok)):
            why = reason or ("another local rank failed" if not ok else "another member failed")
            self._emit("warning", message=f"outer step {plan.outer_step} attempt {plan.attempt} "
                                          f"(generation {plan.generation}) aborted: {why}")
            return False
        if joiner:
            self._receive_state(plan, progress)
        else:
            assert proposal is not None
            self._apply(proposal)
            progress.outer_step = plan.outer_step
            if plan.joiners or (self._rounds == 0 and plan.size > 1):
                self._send_state(plan, progress)
        self._rounds += 1
        self._emit("outer_step", outer_step=progress.outer_step, step=progress.step, generation=plan.generation,
                   members=list(plan.members), pgrad_norm=sq ** 0.5, bytes_sent=nbytes,
                   allreduce_s=stats.seconds if stats else 0.0, checksum=self._checksum())
        return True

    def _apply(self, proposal: Proposal) -> None:
        self.opt.commit(proposal)
        self._adopt(proposal.params)

    def _adopt(self, params: torch.Tensor, handoff: list[torch.Tensor] | None = None) -> None:
        """Make params this node's weights and snapshot (and, from a hand-off, the outer momentum too)."""
        if handoff is not None and self.opt.keeps_momentum:
            self.opt.momentum = handoff[1]
        self.snapshot = params
        write_flat(self.inner.outer_params(), params)
        self.inner.after_outer_update()

    # ------------------------------------------------------------------ state hand-off to joiners

    def _handoff_tensors(self, progress: Any) -> list[torch.Tensor]:
        """What the source sends, in order: parameters, outer momentum (when kept), progress."""
        assert self.snapshot is not None
        out = [self.snapshot.clone()]
        if self.opt.keeps_momentum:
            mom = self.opt.momentum if self.opt.momentum is not None else torch.zeros_like(self.snapshot)
            out.append(mom.clone())
        out.append(torch.tensor([progress.step, progress.outer_step, progress.tokens], dtype=torch.int64))
        return out

    def _broadcast(self, plan: Any, tensors: list[torch.Tensor]) -> None:
        pg = self._group(plan)
        assert pg is not None, "a plan with joiners has more than one member"
        opts = dist.BroadcastOptions()
        opts.rootRank = plan.rank_of(plan.source)
        for t in tensors:
            pg.broadcast([t], opts).wait()

    def _send_state(self, plan: Any, progress: Any) -> None:
        """Every member takes part in the broadcast; a member that is not the source compares what it got with
        its own state, a free check that the members agree, and adopts the source's state where it differs."""
        tensors = self._handoff_tensors(progress)
        try:
            self._broadcast(plan, tensors)
        except _GROUP_ERRORS as e:
            # already committed here: a joiner that missed its state fails on its side and is dropped later
            self._emit("warning", message=f"state hand-off to {list(plan.joiners)} failed: {str(e)[:200]}")
            return
        if self.node_id != plan.source and not torch.equal(tensors[0], self.snapshot):
            self._emit("warning", message=f"outer step {plan.outer_step}: parameters differed from source "
                                          f"{plan.source}'s; adopted the source's")
            self._adopt(tensors[0], tensors)

    def _receive_state(self, plan: Any, progress: Any) -> None:
        tensors = self._handoff_tensors(progress)
        try:
            self._broadcast(plan, tensors)
        except _GROUP_ERRORS as e:
            raise RuntimeError(f"join: state from {plan.source} did not arrive: {str(e)[:200]}") from None
        self._adopt(tensors[0], tensors)
        counters = tensors[-1].tolist()
        progress.step, progress.outer_step, progress.tokens = (int(c) for c in counters)
