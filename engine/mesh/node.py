"""One node's side of the membership protocol: the I/O around the pure rules of protocol.py.

The node's local rank 0 owns one Mesh. A heartbeat thread bumps this node's counter, watches every registered
peer's counter (liveness), takes over the leader lease when the leader is dead, and emits heartbeat events. The
caller's thread does the boundary and commit waits. Every wait is a bounded polling loop with a deadline taken
from MeshConfig; nothing recurses. docs/mesh.md is the protocol description.

For tests the clock and sleep are injectable, and with heartbeat_thread=False each wait loop runs one heartbeat
tick per poll instead, so a single thread can drive several nodes over a MemoryStore deterministically.
"""

from __future__ import annotations

import atexit
import json
import threading
import weakref
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from engine.mesh.protocol import (ABORT, COMMIT, LEAVE_REASONS, Arrival, BoundaryView, Excluded, Keys, Liveness,
                                  MeshError, Plan, compute_plan, decide)


_running: "weakref.WeakSet[Mesh]" = weakref.WeakSet()  # meshes whose heartbeat thread runs
_exit_hook = False


def _stop_at_exit() -> None:
    # a daemon thread still inside a C++ store call when the interpreter finalizes aborts the whole process
    # ("terminate called without an active exception"); atexit runs before daemon threads are torn down
    for mesh in list(_running):
        mesh.close()


KEEP_STEPS = 3  # per-boundary keys of this many recent outer steps stay in the store


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Mesh:
    def __init__(self, store: Any, node_id: str, cfg: Any, *, digest: str, info: dict[str, Any], min_nodes: int,
                 emit: Callable[..., Any], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, heartbeat_thread: bool = True) -> None:
        if not node_id or "/" in node_id:
            raise ValueError(f"mesh.node_id {node_id!r}: must be non-empty and contain no '/'")
        self.store = store
        self.node_id = node_id
        self.cfg = cfg
        self.digest = digest
        self.info = dict(info)
        self.min_nodes = min_nodes
        self.emit = emit
        self.clock = clock
        self.sleep = sleep
        self.keys = Keys()
        self.state = "starting"
        self.epoch = 0
        self._base_generation = 0
        self._forming = True
        self._plan: Plan | None = None  # the last plan this node accepted
        # every node that was a member of a plan this node accepted (for death reports): outer steps can be faster
        # than heartbeats, so "the last two plans" may already have dropped a node when its death is seen
        self._recent: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._liveness = Liveness(cfg.heartbeat_timeout)
        self._registry: list[str] = []
        self._reg_seen = 0
        self._seq = 0
        self._is_leader = False
        self._leader_seen = ""
        self._reported: set[str] = set()  # peers whose death/exit this node already emitted
        self._use_thread = heartbeat_thread
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._hb_store: Any = None
        self._hb_error: str | None = None
        self._arrived_at = 0.0
        self._draining = False
        self._ready = False  # start() decided joiner or member: only then may this node take the lease

    # ---- public API -------------------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self._is_leader

    @property
    def plan(self) -> Plan | None:
        return self._plan

    def start(self) -> bool:
        """Register, check digest and id, start heartbeats. True if this node must join a running run."""
        with self._guard("start"):
            self._check_digest()
            rejoin = self._claim_id()
            k = self.keys
            self.store.add(k.hb(self.node_id), 1)
            if rejoin:
                self.store.delete_key(k.bye(self.node_id))
            else:
                n = self.store.add(k.reg_count(), 1)
                self.store.set(k.reg(n), self.node_id)
            self._set_state("starting")
            self._hb_store = self.store.clone() if self._use_thread else self.store
            if self._use_thread:
                global _exit_hook
                if not _exit_hook:
                    atexit.register(_stop_at_exit)
                    _exit_hook = True
                _running.add(self)
                self._thread = threading.Thread(target=self._beat_loop, name=f"mesh-heartbeat-{self.node_id}",
                                                daemon=True)
                self._thread.start()
            joiner = self._must_join()
            self._forming = not joiner
            if joiner:
                self._set_state("joining")
            self._ready = True
            return joiner

    def boundary(self, outer_step: int, attempt: int, *, contributing: bool = True, draining: bool = False) -> Plan:
        """Arrive at (outer_step, attempt) and wait for its plan. Raises Excluded if the plan left this node out."""
        with self._guard(f"outer step {outer_step} attempt {attempt}"):
            self.arrive(outer_step, attempt, contributing=contributing, draining=draining)
            wait = self.cfg.start_timeout if self._forming else self.cfg.store_timeout
            limit = self._arrived_at + wait + self.cfg.store_timeout + 2 * self.cfg.heartbeat_timeout
            while True:
                plan = self.poll_plan(outer_step, attempt)
                if plan is not None:
                    return plan
                if self.clock() > limit:
                    raise MeshError(f"node {self.node_id}: no plan for outer step {outer_step} attempt {attempt} "
                                    f"within {limit - self._arrived_at:.1f}s (leader {self._leader_seen or 'none'})"
                                    f"; is mesh.store_timeout shorter than the slowest node's inner round?")
                self._idle()

    def wait_admission(self) -> Plan:
        """A joiner (or an excluded node) asks to be admitted and waits for a plan that lists it in `joiners`."""
        with self._guard("waiting for admission"):
            self._release_lease()
            self._set_state("joining")
            self.store.set(self.keys.join(self.node_id), self.info.get("token", "1"))
            deadline = self.clock() + self.cfg.join_timeout
            while True:
                plan = self._read_plan(self.keys.latest())
                if plan is not None and self.node_id in plan.joiners and not self._decided(plan):
                    self.epoch = plan.epoch
                    self._forming = False
                    self._plan = plan
                    self._recent = self._recent | frozenset(plan.members)
                    return plan
                if self.clock() > deadline:
                    raise MeshError(f"node {self.node_id}: not admitted within mesh.join_timeout "
                                    f"({self.cfg.join_timeout:g}s); is any member of the run alive?")
                self._idle()

    def commit(self, plan: Plan, succeeded: bool) -> bool:
        """Post this node's outcome of the outer step and obey the single decision: True = commit, False = abort."""
        with self._guard(f"commit of outer step {plan.outer_step} attempt {plan.attempt}"):
            k = self.keys
            self.store.set(k.ok(plan.epoch, plan.outer_step, plan.attempt, self.node_id), "ok" if succeeded else "fail")
            deadline = self.clock() + self.cfg.store_timeout
            while True:
                decision = self.poll_decision(plan)
                if decision is None and self.clock() > deadline:
                    # a member alive by heartbeat but silent (hung collective): give up on this attempt
                    key = k.decision(plan.epoch, plan.outer_step, plan.attempt)
                    decision = _text(self.store.compare_set(key, "", ABORT))
                if decision is not None:
                    break
                self._idle()
            self._after_decision(plan, decision)
            return decision == COMMIT

    def leave(self, reason: str) -> None:
        """A clean exit: peers see `bye` and drop this node at once. Stops the heartbeat."""
        if reason not in LEAVE_REASONS:
            raise ValueError(f"mesh.leave: reason {reason!r} is not one of {', '.join(LEAVE_REASONS)}")
        if self.state == "left":
            return
        self._stop_thread()
        self.state = "left"  # locally at once: a second leave() after a store failure is a no-op
        with self._guard("leave"):
            self._release_lease()
            self.store.set(self.keys.bye(self.node_id), reason)
            self.store.delete_key(self.keys.join(self.node_id))
            self._set_state("left")
        members = list(self._plan.members) if self._plan else []
        self._emit_membership("drained" if reason == "drained" else "left", self.node_id, members)

    def close(self) -> None:
        """Stop the heartbeat thread (without a bye: call leave() first for a clean exit)."""
        self._stop_thread()

    def peer_ages(self) -> dict[str, float]:
        now = self.clock()
        with self._lock:
            return {n: round(self._liveness.age(n, now) or 0.0, 3) for n in self._liveness.known()
                    if n != self.node_id and not self._liveness.is_gone(n)}

    def is_dead(self, node: str) -> bool:
        with self._lock:
            return self._liveness.is_dead(node, self.clock())

    # ---- non-blocking steps (the blocking calls above loop over these; tests drive them directly) -------------

    def arrive(self, outer_step: int, attempt: int, *, contributing: bool = True, draining: bool = False) -> None:
        self._draining = draining
        if draining and self.state == "training":
            self._set_state("draining")
        key = self.keys.arrive(self.epoch, outer_step, attempt, self.node_id)
        self.store.set(key, Arrival(contributing, draining).to_json())
        self._arrived_at = self.clock()

    def poll_plan(self, outer_step: int, attempt: int) -> Plan | None:
        """The plan of (outer_step, attempt) if there is one (writing it when this node leads), else None."""
        self._check_heartbeat()
        k = self.keys
        key = k.plan(self.epoch, outer_step, attempt)
        plan = self._read_plan(key)
        if plan is None:
            wait = self.cfg.start_timeout if self._forming else self.cfg.store_timeout
            now = self.clock()
            # the lease holder plans; any waiting node does once the leader is overdue by a heartbeat timeout
            if self._is_leader or now > self._arrived_at + wait + self.cfg.heartbeat_timeout:
                plan = self._try_plan(outer_step, attempt, timed_out=now > self._arrived_at + wait)
        if plan is None:
            return None
        self._bump_latest(plan)
        return self._accept(plan)

    def poll_decision(self, plan: Plan) -> str | None:
        k = self.keys
        key = k.decision(plan.epoch, plan.outer_step, plan.attempt)
        current = self._get(key)
        if current:
            return current
        posted: dict[str, bool] = {}
        for m in plan.members:
            value = self._get(k.ok(plan.epoch, plan.outer_step, plan.attempt, m))
            if value is not None:
                posted[m] = value == "ok"
        with self._lock:
            dead = self._liveness.dead([m for m in plan.members if m != self.node_id], self.clock())
        decision = decide(plan.members, posted, dead)
        if decision is None:
            return None
        return _text(self.store.compare_set(key, "", decision))

    def tick(self) -> None:
        """One heartbeat: bump the counter, watch the peers, check the lease, emit a heartbeat event."""
        s = self._hb_store if self._hb_store is not None else self.store
        self._check_still_me(s)
        self._seq = s.add(self.keys.hb(self.node_id), 1)
        self._watch_peers(s)
        self._check_lease(s)
        self.emit("heartbeat", seq=self._seq, peers=self.peer_ages())

    # ---- start-up checks --------------------------------------------------------------------------------------

    def _check_digest(self) -> None:
        current = _text(self.store.compare_set(self.keys.digest(), "", self.digest))
        if current != self.digest:
            message = (f"node {self.node_id}: config digest {self.digest} differs from the run's {current}: every "
                       f"node must use the same model, data.seq_len and diloco settings (e.g. inner_steps H)")
            self._emit_membership("rejected", self.node_id, [])
            raise MeshError(message)

    def _claim_id(self) -> bool:
        """Claim the node id. True: the id belonged to a dead node and this one takes its place (a rejoin)."""
        k = self.keys
        self.info.setdefault("token", uuid.uuid4().hex[:12])
        mine = json.dumps({**self.info, "node": self.node_id}, sort_keys=True, default=str)
        current = _text(self.store.compare_set(k.info(self.node_id), "", mine))
        if current == mine:
            return False
        if not self.store.check([k.bye(self.node_id)]) and self._counter_moves(self.node_id):
            try:
                old = json.loads(current)
                where = f" (host {old.get('host')}, pid {old.get('pid')})"
            except ValueError:
                where = ""
            self._emit_membership("rejected", self.node_id, [])
            raise MeshError(f"node id {self.node_id!r} is in use by a live node{where}: give this node another "
                            f"GLOBAL_UNIQUE_ID / mesh.node_id")
        self.store.set(k.info(self.node_id), mine)
        return True

    def _counter_moves(self, node: str) -> bool:
        """Watch a heartbeat counter for one timeout (plus a beat): True as soon as it changes."""
        key = self.keys.hb(node)
        first = self.store.add(key, 0)
        deadline = self.clock() + self.cfg.heartbeat_timeout + self.cfg.heartbeat_interval
        while self.clock() <= deadline:
            if self.store.add(key, 0) != first:
                return True
            self.sleep(self.cfg.polling_interval)
        return False

    def _must_join(self) -> bool:
        """Join a running run, or (re)form one: the latter when there is no plan yet or all its members are gone.
        Decided on evidence only: a member's counter moving (join) or every member dead or left (re-form)."""
        latest = self._read_plan(self.keys.latest())
        if latest is None:
            return False
        others = [m for m in latest.members if m != self.node_id]
        limit = 2 * self.cfg.heartbeat_timeout + self.cfg.store_timeout
        deadline = self.clock() + limit
        while True:
            with self._lock:
                now = self.clock()
                if any(self._liveness.moved(m) and not self._liveness.is_dead(m, now) for m in others):
                    self.epoch = latest.epoch
                    return True
                all_gone = all(self._liveness.is_dead(m, now) for m in others)
            if all_gone:
                # every member of the last plan is gone: this node (re)forms the run in a new epoch
                self.epoch = self._base_generation = latest.generation
                return False
            if self.clock() > deadline:
                raise MeshError(f"node {self.node_id}: could not tell within {limit:g}s whether the run's members "
                                f"{others} are alive (their heartbeats were not observed)")
            self._idle()

    # ---- planning ---------------------------------------------------------------------------------------------

    def _try_plan(self, outer_step: int, attempt: int, *, timed_out: bool) -> Plan | None:
        k = self.keys
        latest = self._read_plan(k.latest())
        prev = latest if latest is not None and latest.epoch == self.epoch else None
        if prev is not None and (prev.outer_step, prev.attempt) >= (outer_step, attempt):
            # the run moved past this boundary while this node was away: it was left out
            return self._read_plan(k.plan(self.epoch, outer_step, attempt)) or self._stale(outer_step, attempt, prev)
        view = self._view(outer_step, attempt, prev, timed_out)
        plan = compute_plan(view)
        if plan is None:
            return None
        mine = plan.to_json()
        stored = _text(self.store.compare_set(k.plan(self.epoch, outer_step, attempt), "", mine))
        if stored == mine and attempt == 0:
            self._collect_garbage(outer_step - KEEP_STEPS)
        return Plan.from_json(stored)

    def _collect_garbage(self, old_step: int) -> None:
        """The plan writer deletes the per-boundary keys of an outer step long past, so the store stays small
        over a long run. A node that far behind finds no plan and is excluded, as it would be anyway."""
        if old_step < 0:
            return
        k = self.keys
        nodes = set(self._registry) | {self.node_id}
        attempt = 0
        while self.store.check([k.plan(self.epoch, old_step, attempt)]):
            for n in nodes:
                self.store.delete_key(k.arrive(self.epoch, old_step, attempt, n))
                self.store.delete_key(k.ok(self.epoch, old_step, attempt, n))
            self.store.delete_key(k.decision(self.epoch, old_step, attempt))
            self.store.delete_key(k.plan(self.epoch, old_step, attempt))
            attempt += 1

    def _stale(self, outer_step: int, attempt: int, latest: Plan) -> Plan:
        self._release_lease()
        raise Excluded(f"node {self.node_id}: arrived at outer step {outer_step} attempt {attempt} but the run is "
                       f"at outer step {latest.outer_step} attempt {latest.attempt}: re-join as a joiner")

    def _view(self, outer_step: int, attempt: int, prev: Plan | None, timed_out: bool) -> BoundaryView:
        k = self.keys
        nodes = sorted(set(self._registry) | {self.node_id})
        arrived = {}
        for n in nodes:
            raw = self._get(k.arrive(self.epoch, outer_step, attempt, n))
            if raw is not None:
                arrived[n] = Arrival.from_json(raw)
        with self._lock:
            dead = self._liveness.dead([n for n in nodes if n != self.node_id], self.clock())
        joining = frozenset(n for n in nodes if n not in dead and self.store.check([k.join(n)]))
        starting = frozenset(n for n in nodes if prev is None and n not in dead and self._get(k.state(n)) == "starting")
        prev_committed = prev is not None and self._get(k.decision(prev.epoch, prev.outer_step, prev.attempt)) == COMMIT
        return BoundaryView(epoch=self.epoch, outer_step=outer_step, attempt=attempt, prev=prev,
                            prev_committed=prev_committed, arrived=arrived, dead=dead, joining=joining,
                            starting=starting, min_nodes=self.min_nodes, timed_out=timed_out,
                            base_generation=self._base_generation)

    def _bump_latest(self, plan: Plan) -> None:
        """plan/latest only moves forward, whoever writes it (bounded retries on a concurrent writer)."""
        key = self.keys.latest()
        mine = plan.to_json()
        order = (plan.generation, plan.outer_step, plan.attempt)
        for _ in range(5):
            raw = self._get(key)
            if raw is not None:
                cur = Plan.from_json(raw)
                if (cur.generation, cur.outer_step, cur.attempt) >= order:
                    return
            if _text(self.store.compare_set(key, raw or "", mine)) == mine:
                return

    def _accept(self, plan: Plan) -> Plan:
        if self.node_id not in plan.members:
            self._release_lease()
            raise Excluded(f"node {self.node_id}: left out of outer step {plan.outer_step} attempt {plan.attempt} "
                           f"(generation {plan.generation}, members {list(plan.members)}): re-join as a joiner")
        self._recent = self._recent | frozenset(plan.members)
        self._plan = plan
        self._forming = False
        if self.node_id not in plan.joiners:
            self._set_state("draining" if self._draining else "training")
        return plan

    def _after_decision(self, plan: Plan, decision: str) -> None:
        if decision != COMMIT:
            return
        for j in plan.joiners:
            self._emit_membership("joined", j, list(plan.members), plan.generation)
        for d in plan.leaving:
            self._emit_membership("drained", d, list(plan.members), plan.generation)
        if self.node_id in plan.joiners:
            self.store.delete_key(self.keys.join(self.node_id))
            self._set_state("draining" if self._draining else "training")

    def _decided(self, plan: Plan) -> bool:
        return self._get(self.keys.decision(plan.epoch, plan.outer_step, plan.attempt)) is not None

    # ---- heartbeat, liveness, lease ---------------------------------------------------------------------------

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - recorded and raised in the caller's thread at its next wait
                self._hb_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                return
            self._stop.wait(self.cfg.heartbeat_interval)

    def _check_still_me(self, s: Any) -> None:
        """A node that was silent long enough to be declared dead (stopped, swapped out) may find that a newer
        process took its id over: it must not beat under that id again."""
        holder = json.loads(_text(s.get(self.keys.info(self.node_id))))
        if holder.get("token") != self.info.get("token"):
            raise MeshError(f"node {self.node_id} was declared dead and a newer process (pid {holder.get('pid')}) "
                            f"took its id over: this process must exit")

    def _watch_peers(self, s: Any) -> None:
        k = self.keys
        count = s.add(k.reg_count(), 0)
        while self._reg_seen < count:
            n = self._reg_seen + 1
            if not s.check([k.reg(n)]):
                break  # registered a moment ago, its id is not written yet
            node = _text(s.get(k.reg(n)))
            if node not in self._registry:
                self._registry.append(node)
            self._reg_seen = n
        for node in list(self._registry):
            if node == self.node_id:
                continue
            counter = s.add(k.hb(node), 0)
            gone = s.check([k.bye(node)])
            with self._lock:
                self._liveness.observe(node, counter, self.clock(), gone=gone)
                dead = self._liveness.is_dead(node, self.clock())
            self._report_peer(node, dead, gone)

    def _report_peer(self, node: str, dead: bool, gone: bool) -> None:
        """Emit a peer's death once, if it was a member of a plan this node accepted."""
        if not dead:
            self._reported.discard(node)
            return
        plan = self._plan
        if node in self._reported or plan is None or node not in self._recent:
            return
        self._reported.add(node)
        if not gone:  # a clean exit is reported by its plan (drained) or by the node itself
            self._emit_membership("dead", node, [m for m in plan.members if m != node], plan.generation)

    def _check_lease(self, s: Any) -> None:
        key = self.keys.leader()
        raw = s.check([key]) and _text(s.get(key))
        holder = raw or ""
        if not self._ready or self.state not in ("starting", "training", "draining"):
            if holder == self.node_id:  # a joiner cannot lead: it may not even hold the state yet
                holder = _text(s.compare_set(key, self.node_id, ""))
        elif holder != self.node_id:
            with self._lock:
                free = holder == "" or self._liveness.is_dead(holder, self.clock())
            if free:
                holder = _text(s.compare_set(key, holder, self.node_id))
        self._is_leader = holder == self.node_id
        if holder and holder != self._leader_seen:
            self._leader_seen = holder
            members = list(self._plan.members) if self._plan else []
            self._emit_membership("leader", holder, members)

    def _release_lease(self) -> None:
        self._is_leader = False
        self.store.compare_set(self.keys.leader(), self.node_id, "")

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _idle(self) -> None:
        """One poll interval. Without a heartbeat thread the wait loops beat themselves (tests)."""
        self._check_heartbeat()
        if not self._use_thread and self.state != "left":
            self.tick()
        self.sleep(self.cfg.polling_interval)

    def _check_heartbeat(self) -> None:
        if self._hb_error is not None:
            raise MeshError(f"node {self.node_id}: heartbeat stopped, lost the membership store ({self._hb_error})")

    def _stop_thread(self) -> None:
        self._stop.set()
        _running.discard(self)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.cfg.heartbeat_interval + self.cfg.store_timeout)

    def _set_state(self, state: str) -> None:
        self.state = state
        self.store.set(self.keys.state(self.node_id), state)

    def _get(self, key: str) -> str | None:
        return _text(self.store.get(key)) if self.store.check([key]) else None

    def _read_plan(self, key: str) -> Plan | None:
        raw = self._get(key)
        return Plan.from_json(raw) if raw else None

    def _emit_membership(self, change: str, subject: str, members: list[str], generation: int | None = None) -> None:
        if generation is None:
            generation = self._plan.generation if self._plan else 0
        self.emit("membership", change=change, subject=subject, generation=generation, members=members)

    @contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Store failures become one MeshError line naming this node and what it was doing."""
        try:
            yield
        except (MeshError, Excluded, ValueError):
            raise
        except (RuntimeError, OSError, LookupError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise MeshError(f"node {self.node_id}: {what}: lost the membership store ({first})") from None
