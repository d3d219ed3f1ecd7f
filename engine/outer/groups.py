"""The outer loop's link to the mesh: the Mesh (local rank 0 only), every local rank's store client, the process
group of each generation, and collectives that no frozen, partitioned or dead peer can hold up.

    links = MeshLinks(cfg.diloco, cfg.mesh, local, node_id, emit, interrupted, digest=..., info=...)
    links.connect()                                  # on every local rank; an error on one is raised on all
    pg = links.group(plan)                           # None for a plan of one member
    out = links.bounded(plan, "all-reduce", fn)      # fn() given up (PeerLost) on a death, a decision or a stop
    links.failed(plan, err)                          # after a failed collective: its group is never reused
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Collection

import torch
import torch.distributed as dist

from engine.mesh.protocol import MeshError, Stopped
from engine.outer.local import LocalRanks
from engine.outer.schedule import Schedule

GROUP_ERRORS = (RuntimeError, TimeoutError, ConnectionError, OSError)



class LinkFailed(MeshError):
    """A local rank could not connect to the mesh: every local rank raises it with the same text."""

    node_wide = True  # engine/train.py prints it once, from local rank 0

class PeerLost(RuntimeError):
    """A collective or group rendezvous was given up: a member stopped beating, or the attempt was decided."""


def run_sliced(fn: Callable[[], Any], name: str, slice_s: float, give_up: Callable[[], str | None]) -> Any:
    """fn() in a helper thread; a watcher thread asks give_up() every slice_s, and a reason ends the wait (PeerLost).
    The caller waits on an event that fn's end sets, so it goes on the moment fn is done, not once a give_up() under
    way returns (its store round trip waits behind the collective's own bytes on a busy link: 0.08 s of every outer
    step at 200 Mbit/s, bench/wan.py --phases). give_up() runs on the watcher thread, so it must not act: it says
    why. gloo cannot cancel a collective: an abandoned one ends in its helper thread at its own timeout
    (diloco.allreduce_timeout), its result unused, its group never used again. On a GPU fn runs on the caller's
    CUDA stream, as it would on the caller's thread: an overlapped outer step's side stream, not the helper's
    default stream, whose copies waited behind the training's queued kernels (docs/performance.md, "GPU")."""
    box: dict[str, Any] = {}
    done = threading.Event()
    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

    def work() -> None:
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread below
            box["err"] = e
        done.set()

    def watch() -> None:
        try:
            while not done.wait(slice_s):
                reason = give_up()
                if reason:
                    box["lost"] = PeerLost(reason)
                    break
        except BaseException as e:  # noqa: BLE001 - a stop (Stopped), raised on the waiting thread
            box["lost"] = e
        done.set()

    threading.Thread(target=work, name=name, daemon=True).start()
    threading.Thread(target=watch, name=f"{name}-watch", daemon=True).start()
    done.wait()
    if "out" in box:
        return box["out"]
    if "err" in box:
        raise box["err"]
    raise box["lost"]  # given up while fn still runs


class MeshLinks:
    def __init__(self, cfg, mesh_cfg, local: LocalRanks, node_id: str, emit: Callable[..., Any],
                 interrupted: Callable[[], str | None], *, digest: str, info: dict[str, Any],
                 mesh_factory: Callable[[], Any] | None = None,
                 group_factory: Callable[..., dist.ProcessGroup] | None = None):
        # mesh_factory / group_factory replace engine.mesh in unit tests
        self.cfg, self.mesh_cfg, self.local, self.node_id = cfg, mesh_cfg, local, node_id
        self.emit, self.interrupted, self.digest, self.info = emit, interrupted, digest, info
        self._mesh_factory, self._group_factory = mesh_factory, group_factory
        self.mesh: Any = None  # local rank 0 only
        self.store: Any = None
        self._groups: dict[int, dist.ProcessGroup] = {}
        self._store_stale = False  # a group build failed: reconnect this rank's store client before the next
        # (outer step, attempt, monotonic time) of this node's last arrival at a boundary: its peers can have been
        # held in that attempt's collectives since then, not only since this node entered them (bounded)
        self.arrived: tuple[int, int, float] | None = None
        self.recent_wire: collections.deque[float] = collections.deque(maxlen=5)  # seconds of recent all-reduces
        self._watch: tuple[Any, Any] | None = None  # (a store client, the clone bounded collectives' watcher reads)
        self._peers: Any = None  # local ranks > 0: their own view of the members' heartbeats (dead())
        self._peers_read: tuple[float, list[str]] = (-float("inf"), [])
        self._peers_lock = threading.Lock()

    # ---- connection -------------------------------------------------------------------------------------------

    def connect(self) -> None:
        """The store client on every local rank (each builds its own global group) and the Mesh on local rank 0;
        an error on any local rank is raised on every one."""
        err: str | None = None
        try:
            self._connect()
        except Exception as e:  # agreed on below, then raised on every rank
            err = f"{type(e).__name__}: {e}"
            if self.local.group is None:
                raise
        bad = self.local.every(err)
        if bad:
            raise LinkFailed(f"mesh: {bad[0]}")

    def _connect(self) -> None:
        if self._mesh_factory is not None:
            self.mesh = self._mesh_factory() if self.local.leader else None
            return
        from engine.mesh import Mesh, open_store
        m = self.mesh_cfg
        self.store = open_store(m)
        if self.local.leader:
            schedule = Schedule(self.cfg)  # time rounds: the planner sets each plan's deadline, a round on
            timed = schedule.timed
            self.mesh = Mesh(self.store, self.node_id, m, digest=self.digest, info=self.info,
                             min_nodes=self.cfg.min_nodes, emit=self.emit, interrupt=self.interrupted,
                             reconnect=lambda: open_store(m, probe_timeout=m.heartbeat_interval, like=self.store),
                             round_seconds=schedule.seconds if timed else 0.0,
                             grace=self.cfg.grace if timed else 0.0)

    def close(self, status: str | None) -> None:
        """Drop the groups, say goodbye under the run_end status (None: none), close the mesh."""
        self.forget()
        if self.mesh is None:
            return
        try:
            if status is not None:  # run_end statuses -> mesh leave reasons; a stop is not a completion
                self.mesh.leave({"completed": "completed", "drained": "drained"}.get(status, "failed"))
        except MeshError as e:  # the store is gone: the peers see this node's silence instead of a goodbye
            self.emit("warning", message=f"no goodbye to the mesh: {e}")
        finally:
            self.mesh.close()
            self.mesh = None

    # ---- groups -----------------------------------------------------------------------------------------------

    def group(self, plan: Any) -> dist.ProcessGroup | None:
        if plan.size == 1:
            return None
        pg = self._groups.get(plan.generation)
        if pg is None:
            # an older generation's group is never used again; dropping it frees its sockets
            self._groups.clear()
            if self._group_factory is not None:
                pg = self._group_factory(plan, self.node_id, self.local.rank)
            else:
                from engine.mesh import make_group, open_store
                if self._store_stale:  # the store went away under this rank's client: a fresh one
                    self.store = self.mesh.store if self.mesh is not None else open_store(self.mesh_cfg)
                    self._store_stale = False
                # a client of its own: a rendezvous given up stays blocked in its wait on that client, and a
                # shared client would block every store call of this rank (the mesh's included) behind it
                store = (self.mesh.store if self.mesh is not None else self.store).clone()
                pg = self.bounded(plan, "group rendezvous", lambda: make_group(
                    store, plan, self.node_id, self.local.rank, self.cfg.allreduce_timeout))
            self._groups[plan.generation] = pg
        return pg

    def failed(self, plan: Any, err: BaseException) -> None:
        """A collective on the plan's group failed: the group is never reused; a failure that was not a give-up
        may have been the store going away under this rank's client."""
        self._groups.pop(plan.generation, None)
        self._store_stale = self._group_factory is None and not isinstance(err, PeerLost)
        self._forget_cached()

    def after_reform(self) -> None:
        """The store restarted empty: every group of the old store is gone, and so is every rank's client."""
        self._groups.clear()
        self._store_stale = self._group_factory is None
        self._forget_cached(store_restarted=True)

    def forget(self) -> None:
        self._groups.clear()
        self._forget_cached()

    def _forget_cached(self, store_restarted: bool = False) -> None:
        if self._group_factory is None:
            from engine.mesh import forget_groups
            forget_groups(store_restarted)

    # ---- bounded collectives ----------------------------------------------------------------------------------

    def bounded(self, plan: Any, what: str, fn: Callable[[], Any], *, until_decided: bool = True,
                watch: Collection[str] | None = None) -> Any:
        """A collective or rendezvous that a frozen, partitioned or dead peer cannot hold up for longer than the
        heartbeat timeout (plus a poll): given up when local rank 0's heartbeat sees a member dead (of `watch`
        only, when given: the hand-off's chain, where a death downstream leaves this rank's part intact; there a
        local rank > 0 reads the members' heartbeats itself, dead()), or when
        the attempt was decided without this rank (read from the store by every rank; until_decided=False for
        the hand-off, which runs after the decision), or on a stop."""
        if self.store is None:
            return fn()  # unit tests with an injected mesh: no store to watch
        from engine.mesh import attempt_decided
        began, overdue = time.monotonic(), self.straggler_timeout()
        if self.arrived is not None and self.arrived[:2] == (plan.outer_step, plan.attempt):
            # the plan needed this node's arrival, so its peers were held from (at the earliest) then: a node whose
            # slow link delayed its arrival or its reading of the plan has used up that much of the budget already
            began = min(began, self.arrived[2])

        stepped_out: list[str] = []
        watch_store = self._watch_store()

        def give_up() -> str | None:  # on run_sliced's watcher thread: it reads, and says why; acting is ours
            if self.local.size == 1:  # several local ranks leave together, through the mesh calls
                reason = self.interrupted()
                if reason:
                    raise Stopped(reason, what)
            if self.mesh is not None:
                dead = [m for m in self.mesh.dead_members(plan) if watch is None or m in watch]
                if dead:
                    return f"{what}: {', '.join(dead)} stopped beating (mesh.heartbeat_timeout)"
            elif watch is not None:  # the hand-off runs after the decision: no decision key says the state is lost
                dead = [m for m in self.dead(plan) if m in watch]
                if dead:
                    return (f"{what}: {', '.join(dead)} stopped beating (mesh.heartbeat_timeout, as local rank "
                            f"{self.local.rank} read it)")
            if not until_decided:
                return None
            if self.mesh is not None and time.monotonic() - began > overdue and self.mesh.link_slow():
                # this node is the straggler: its own store round trips are being retransmitted while the
                # collective is overdue. It steps out (and aborts the attempt) rather than hold its peers for as
                # long as the fault lasts; its other local ranks see the abort at their next poll
                why = f"{what} overdue ({overdue:.1f}s, diloco.straggler_timeout) on a slow link (mesh.slow_tick)"
                stepped_out.append(why)
                return why
            try:
                decided = attempt_decided(watch_store, plan)
            except GROUP_ERRORS:
                decided = False  # the store is away: the collective may still finish; the mesh handles the store
            return f"{what}: outer step {plan.outer_step} attempt {plan.attempt} was decided" if decided else None
        try:
            return run_sliced(fn, f"diloco-{what.replace(' ', '-')}", self.mesh_cfg.polling_interval, give_up)
        except PeerLost:
            if stepped_out:
                self.mesh.step_out(plan, stepped_out[0])
            raise

    def dead(self, plan: Any) -> list[str]:
        """Members of the plan seen dead now: local rank 0's heartbeat table. A local rank > 0 holds no heartbeat:
        it reads the members' counters itself (PeerWatch), at most once per mesh.polling_interval, so that its
        hand-off chain can give up on a death as rank 0's does instead of waiting for gloo's timeout."""
        if self.mesh is not None:
            return self.mesh.dead_members(plan)
        if self.store is None:
            return []
        with self._peers_lock:  # the bounded wait's watcher thread and the chain's forwarding both ask
            now = time.monotonic()
            if self._peers is None:
                from engine.mesh.group import PeerWatch
                self._peers = PeerWatch(self._watch_store(), self.mesh_cfg.heartbeat_timeout)
            if now - self._peers_read[0] >= self.mesh_cfg.polling_interval:
                try:
                    self._peers_read = (now, self._peers.dead([m for m in plan.members if m != self.node_id]))
                except GROUP_ERRORS:
                    pass  # the store is away: the last read stands
            return self._peers_read[1]

    def _watch_store(self) -> Any:
        """The store client the watcher of a bounded collective reads the decision with: a clone of this rank's own
        (one per client, made once), so that a read under way never shares a socket with this thread's next call."""
        src = self.mesh.store if self.mesh is not None else self.store
        if self._watch is None or self._watch[0] is not src:
            try:
                self._watch = (src, src.clone() if hasattr(src, "clone") else src)
            except GROUP_ERRORS:
                return src  # the store is away now: the next collective makes the clone
        return self._watch[1]

    def straggler_timeout(self) -> float:
        """How long a collective may run before a member on a slow link steps out (diloco.straggler_timeout)."""
        if self.cfg.straggler_timeout:
            return self.cfg.straggler_timeout
        return max(self.mesh_cfg.heartbeat_timeout / 2, 4 * max(self.recent_wire, default=0.0))
