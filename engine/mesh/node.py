"""One node's side of the membership protocol: the API the outer loop calls, and its bounded waits.

The node's local rank 0 owns one Mesh. Its heartbeat (engine/mesh/heartbeat.py, a thread) beats, watches every
registered peer (liveness), takes the leader lease and survives store loss; its planner (engine/mesh/planner.py)
reads a boundary and writes plans. The caller's thread does the boundary, admission and commit waits here.

Every wait is a bounded polling loop with a deadline from MeshConfig, and every poll first checks, in this order:
the heartbeat gave up (MeshError), the store restarted empty (Reformed), a stop or drain was requested
(`interrupt()` returns "stopped" or "drained": Stopped). A store error in a wait is not fatal: the wait pauses
until the heartbeat has the store back (bounded by mesh.store_lost_timeout, interruptible) and starts over.
docs/mesh.md is the protocol description.

For tests the clock and sleep are injectable, and with heartbeat_thread=False each wait loop runs one heartbeat
tick per poll instead, so a single thread can drive several nodes over a MemoryStore deterministically.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import uuid
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from engine.errors import first_line
from engine.mesh.heartbeat import STORE_ERRORS, Heartbeat, Outbox, Registry, text
from engine.mesh.planner import KEEP_STEPS, Planner
from engine.mesh.protocol import (ABORT, COMMIT, LEAVE_REASONS, Excluded, Keys, Liveness, MeshError, NodeState,
                                  Plan, Reformed, Stopped, decide)

__all__ = ["KEEP_STEPS", "Mesh"]

_running: "weakref.WeakSet[Mesh]" = weakref.WeakSet()  # meshes whose heartbeat thread runs
_exit_hook = False


def _stop_at_exit() -> None:
    # a daemon thread still inside a C++ store call when the interpreter finalizes aborts the whole process
    # ("terminate called without an active exception"); atexit runs before daemon threads are torn down
    for mesh in list(_running):
        mesh.close()


class _StoreDown(Exception):
    """A store call of the caller's thread failed: wait for the heartbeat to get the store back, then retry."""


class Mesh(Heartbeat, Planner):
    def __init__(self, store: Any, node_id: str, cfg: Any, *, digest: str, info: dict[str, Any], min_nodes: int,
                 emit: Callable[..., Any], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, heartbeat_thread: bool = True,
                 interrupt: Callable[[], str | None] | None = None,
                 reconnect: Callable[[], Any] | None = None) -> None:
        if not node_id or "/" in node_id:
            raise ValueError(f"mesh.node_id {node_id!r}: must be non-empty and contain no '/'")
        self.store = store
        self.node_id = node_id
        self.cfg = cfg
        self.digest = digest
        self.info = dict(info)
        self.info.setdefault("token", uuid.uuid4().hex[:12])
        self.min_nodes = min_nodes
        self.emit = emit
        self.clock = clock
        self.sleep = sleep
        self.interrupt = interrupt  # polled by every wait: "stopped" / "drained" ends the wait (Stopped)
        self._reconnect = reconnect  # a fresh store client, for the heartbeat while the store is lost
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
        self._ids: list[str] = []
        self._reg_cache: tuple[str | None, Any, list[str], list[str]] = (None, None, [], [])  # see _read_registry
        self._seq = 0
        self._is_leader = False
        self._leader_seen = ""
        self._reported: set[str] = set()  # peers whose death this node already emitted
        self._gone_seen: set[str] = set()  # pruned ids seen at this node's last prune (deleted at its next)
        self._gone_groups: dict[str, Any] = {}
        self._use_thread = heartbeat_thread
        self._thread: threading.Thread | None = None
        self._outbox = Outbox(emit)
        self._stop = threading.Event()
        self._hb_store: Any = None
        self._hb_error: str | None = None
        self._lost_since: float | None = None
        self._last_look: float | None = None
        self._reset = False  # the heartbeat registered this node in a restarted (empty) store
        self._store_life = ""  # the store's life (Keys.life) this node registered in: another one = a restart
        self._arrived_at = 0.0
        self._posted_at = 0.0
        self._node_state = NodeState("starting", self.info["token"])
        # a store with leases (etcd) deletes a dead node's heartbeat key by itself: its absence is death
        self._leased = bool(getattr(store, "has_leases", lambda: False)())
        self._ready = False  # start() decided joiner or member: only then may this node take the lease
        self._ticks: deque[float] = deque(maxlen=32)  # durations of the last heartbeat ticks (link_slow)
        self._tick_began: float | None = None  # when the tick under way began
        self._stepped_out = False  # step_out(): the next boundary excludes this node; it re-joins when healthy

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
            self._check_digest(self.store)
            self._claim_id()
            if self._leased:  # etcd: the heartbeat key dies with this process, a lease TTL after its last renewal
                self.store.lease_key(self.keys.hb(self.node_id))
            self._register(self.store)
            self._hb_store = self.store.clone() if self._use_thread else self.store
            if self._use_thread:
                global _exit_hook
                if not _exit_hook:
                    atexit.register(_stop_at_exit)
                    _exit_hook = True
                _running.add(self)
                self._outbox.start(f"mesh-telemetry-{self.node_id}")
                self._thread = threading.Thread(target=self._beat_loop, name=f"mesh-heartbeat-{self.node_id}",
                                                daemon=True)
                self._thread.start()
            else:
                self.tick()
            joiner = self._must_join()
            self._forming = not joiner
            if joiner:
                self._set_state("joining")
            self._ready = True
            return joiner

    def boundary(self, outer_step: int, attempt: int, *, contributing: bool = True, draining: bool = False) -> Plan:
        """Arrive at (outer_step, attempt) and wait for its plan. Raises Excluded if the plan left this node out.
        A formation may answer with a plan of a newer outer step that lists this node as a joiner."""
        what = f"outer step {outer_step} attempt {attempt}"
        return self._resilient(what, lambda: self._boundary(outer_step, attempt, contributing, draining, what))

    def wait_admission(self) -> Plan:
        """A joiner (or an excluded node) asks to be admitted and waits for a plan that lists it in `joiners`."""
        return self._resilient("waiting for admission", self._wait_admission)

    def commit(self, plan: Plan, succeeded: bool) -> bool:
        """Post this node's outcome of the outer step and obey the single decision: True = commit, False = abort."""
        what = f"commit of outer step {plan.outer_step} attempt {plan.attempt}"
        decision = self._resilient(what, lambda: self._commit(plan, succeeded))
        self._after_decision(plan, decision)
        return decision == COMMIT

    def step_out(self, plan: Plan, why: str) -> None:
        """Leave the plan's attempt because this node's own link is too slow for the run (link_slow while a
        collective of the attempt is overdue). In state `standby` the planner neither waits for it nor admits it;
        the abort it writes (the attempt cannot commit without this node's ok anyway) ends its peers' wait at their
        next poll, and they re-plan without it. Its pseudo-gradient of this round is not counted. Its next
        boundary raises Excluded; wait_admission asks to join again once the link is healthy."""
        self._stepped_out = True
        try:
            self._set_state("standby")  # first: the re-plan the abort starts must find it out already
            latest = self._read_latest()[1]
            if latest is not None and latest.epoch == plan.epoch and not self._moved_past(plan, latest):
                # (a run that moved on decided this attempt already, and may have collected its decision)
                self.store.compare_set(self.keys.decision(plan.epoch, plan.outer_step, plan.attempt), "", ABORT)
            self._release_lease()
        except STORE_ERRORS as e:  # cut off for good: its peers see its heartbeat stop instead
            why += f" (the store did not answer: {first_line(e)})"
        self.emit("warning", message=f"node {self.node_id}: stepped out of outer step {plan.outer_step} attempt "
                                     f"{plan.attempt}: {why}; it asks to join again once its link is healthy")

    def leave(self, reason: str) -> None:
        """A clean exit: the counter goes negative, peers drop this node at once. Stops the heartbeat."""
        if reason not in LEAVE_REASONS:
            raise ValueError(f"mesh.leave: reason {reason!r} is not one of {', '.join(LEAVE_REASONS)}")
        if self.state == "left":
            return
        self._stop_thread()
        if self._hb_error is not None or self._lost_since is not None:
            # the store is lost: a call on the dead client only adds a C++ stack dump to stderr
            self.state = "left"
            raise MeshError(f"node {self.node_id}: leave: the membership store is lost")
        self.state = "left"  # locally at once: a second leave() after a store failure is a no-op
        with self._guard("leave"):
            self._release_lease()
            if self._leased:  # the goodbye outlives this process (until pruned): a clean exit, not a death
                self.store.unlease_key(self.keys.hb(self.node_id))
            self.store.set(self.keys.hb(self.node_id), "-1")
            self._set_state("left")
        members = list(self._plan.members) if self._plan else []
        self._emit_membership("drained" if reason == "drained" else "left", self.node_id, members)

    def close(self) -> None:
        """Stop the heartbeat thread (without a goodbye: call leave() first for a clean exit)."""
        self._stop_thread()

    def peer_ages(self) -> dict[str, float]:
        now = self.clock()
        with self._lock:
            return {n: round(self._liveness.age(n, now) or 0.0, 3) for n in self._liveness.known()
                    if n != self.node_id and not self._liveness.is_gone(n)}

    def is_dead(self, node: str) -> bool:
        with self._lock:
            return self._liveness.is_dead(node, self.clock())

    def dead_members(self, plan: Plan) -> list[str]:
        """Members of the plan this node sees dead now (no store operation: the heartbeat's table)."""
        with self._lock:
            return sorted(self._liveness.dead([m for m in plan.members if m != self.node_id], self.clock()))

    # ---- non-blocking steps (the blocking calls above loop over these; tests drive them directly) -------------

    def arrive(self, outer_step: int, attempt: int, *, contributing: bool = True, draining: bool = False) -> None:
        if draining and self.state == "training":
            self.state = "draining"
        self._node_state = NodeState(self.state, self.info["token"], (self.epoch, outer_step, attempt),
                                     contributing, draining, None, self._node_state.group)
        self._write_state(self._node_state, self.store)
        self._arrived_at = self.clock()

    def poll_plan(self, outer_step: int, attempt: int) -> Plan | None:
        """The plan of (outer_step, attempt) if there is one (writing it when this node leads), else None."""
        self._poll_checks(f"outer step {outer_step} attempt {attempt}")
        raw, latest = self._read_latest()
        plan = self._plan_for(latest, outer_step, attempt)
        if plan is None and self._may_plan():
            wait = self.cfg.start_timeout if self._forming else self.cfg.store_timeout
            self._try_plan(outer_step, attempt, raw, latest, timed_out=self.clock() > self._arrived_at + wait)
            raw, latest = self._read_latest()
            plan = self._plan_for(latest, outer_step, attempt)
        return None if plan is None else self._accept(plan)

    def post(self, plan: Plan, succeeded: bool) -> None:
        """Post this node's outcome of the plan's all-reduce (in its state key)."""
        st = self._node_state
        self._write_state(NodeState(st.state, st.token, (plan.epoch, plan.outer_step, plan.attempt),
                                    st.contributing, st.draining, succeeded, st.group), self.store)
        self._posted_at = self.clock()

    def poll_decision(self, plan: Plan) -> str | None:
        """The decision of the plan's attempt, writing it when this node can decide. The leader decides; the
        others only read the decision key (one round trip, whatever the size of the run), unless the leader is
        overdue by a heartbeat timeout (it died: the lease moves within that time anyway)."""
        k = self.keys
        key = k.decision(plan.epoch, plan.outer_step, plan.attempt)
        current = self._read(key)
        if current:
            return current
        if not self._is_leader and self.clock() < self._posted_at + self.cfg.heartbeat_timeout:
            return None
        raws = self.store.multi_get([k.latest()] + [k.state(m) for m in plan.members])
        latest = Plan.from_json(text(raws[0])) if text(raws[0]) else None
        posted: dict[str, bool] = {}
        for m, raw in zip(plan.members, raws[1:]):
            st = NodeState.from_json(text(raw))
            if st is not None and st.at is not None and tuple(st.at) == (plan.epoch, plan.outer_step, plan.attempt) \
                    and st.ok is not None:
                posted[m] = bool(st.ok)
        if latest is not None and latest.epoch > plan.epoch:
            decision: str | None = ABORT  # the run re-formed without this plan: it must never commit (split brain)
        elif self._moved_past(plan, latest):
            return self._read(key) or ABORT  # see _moved_past: this node's answer only, never written
        else:
            decision = decide(plan.members, posted, self.dead_members(plan))
        if decision is None:
            return None
        return text(self.store.compare_set(key, "", decision))

    # ---- the waits ----------------------------------------------------------------------------------------------

    def _boundary(self, outer_step: int, attempt: int, contributing: bool, draining: bool, what: str) -> Plan:
        if self._reset:  # the store restarted while this node trained: this boundary forms the run anew
            self._forget_run()
        if self._stepped_out:
            raise Excluded(f"node {self.node_id}: stepped out at {what} (its link is slow): re-join as a joiner")
        self.arrive(outer_step, attempt, contributing=contributing, draining=draining)
        wait = self.cfg.start_timeout if self._forming else self.cfg.store_timeout
        limit = self._arrived_at + wait + self.cfg.store_timeout + 2 * self.cfg.heartbeat_timeout
        while True:
            plan = self.poll_plan(outer_step, attempt)
            if plan is not None:
                return plan
            if self.clock() > limit:
                raise MeshError(f"node {self.node_id}: no plan for {what} within {limit - self._arrived_at:.1f}s "
                                f"(leader {self._leader_seen or 'none'}); is mesh.store_timeout shorter than the "
                                f"slowest node's inner round?")
            self._idle(what)

    def _wait_admission(self) -> Plan:
        what = "waiting for admission"
        self._release_lease()
        if self._stepped_out:
            self._await_link()
        self._set_state("joining")
        deadline = self.clock() + self.cfg.join_timeout
        while True:
            self._poll_checks(what)
            _, plan = self._read_latest()
            if plan is not None and self.node_id in plan.joiners and plan.epoch >= self.epoch \
                    and not self._read(self.keys.decision(plan.epoch, plan.outer_step, plan.attempt)):
                self.epoch = plan.epoch
                self._forming = False
                return self._accept(plan)
            if self.clock() > deadline:
                raise MeshError(f"node {self.node_id}: not admitted within mesh.join_timeout "
                                f"({self.cfg.join_timeout:g}s); is any member of the run alive?")
            self._idle(what)

    def _await_link(self) -> None:
        """A node that stepped out stays in standby until its heartbeat ticks are on time again (bounded by
        mesh.join_timeout; then it asks to join anyway), so that it is not admitted over the link that made it
        step out: a joiner takes part in the next collective and receives the state."""
        what = "waiting for its link to recover (stepped out)"
        deadline = self.clock() + self.cfg.join_timeout
        while not self.link_healthy() and self.clock() < deadline:
            self._idle(what)
        self._stepped_out = False

    def _commit(self, plan: Plan, succeeded: bool) -> str:
        what = f"commit of outer step {plan.outer_step} attempt {plan.attempt}"
        self.post(plan, succeeded)
        deadline = self.clock() + self.cfg.store_timeout
        while True:
            self._poll_checks(what)
            decision = self.poll_decision(plan)
            if decision is None and self.clock() > deadline:
                # a member alive by heartbeat but silent (hung collective): give up on this attempt
                key = self.keys.decision(plan.epoch, plan.outer_step, plan.attempt)
                if self._moved_past(plan, self._read_latest()[1]):
                    return self._read(key) or ABORT
                decision = text(self.store.compare_set(key, "", ABORT))
            if decision:
                return decision
            self._idle(what)

    @staticmethod
    def _moved_past(plan: Plan, latest: Plan | None) -> bool:
        """The run planned a later boundary of this epoch than the plan this node waits to hear about: that
        attempt was decided (a next plan needs it decided) and its decision may be collected already (a node cut
        off for several outer steps). This node cannot know which way it went; it takes it as an abort for itself
        only, and its next boundary finds the run moved past it: it re-joins and receives the state. Writing the
        abort could contradict a commit the others applied."""
        return latest is not None and latest.epoch == plan.epoch \
            and (latest.outer_step, latest.attempt) > (plan.outer_step, plan.attempt)

    def _resilient(self, what: str, call: Callable[[], Any]) -> Any:
        """Run a wait; a store error pauses it until the store is back, then it starts over (bounded by
        mesh.store_lost_timeout through the heartbeat, and interruptible)."""
        while True:
            try:
                with self._guard(what, resumable=True):
                    return call()
            except _StoreDown:
                self._await_store(what)

    def _await_store(self, what: str) -> None:
        while True:
            self._poll_checks(what)
            if not self._use_thread:
                self._beat()
            elif not self._thread or not self._thread.is_alive():
                self._check_heartbeat()
                raise MeshError(f"node {self.node_id}: {what}: lost the membership store (heartbeat stopped)")
            if self._lost_since is None and self._store_answers():
                return
            self.sleep(self.cfg.polling_interval)

    def _store_answers(self) -> bool:
        try:
            self.store.check([self.keys.ids()])
            return True
        except STORE_ERRORS:
            return False

    # ---- start-up -----------------------------------------------------------------------------------------------

    def _check_digest(self, s: Any) -> None:
        current = text(s.compare_set(self.keys.digest(), "", self.digest))
        if current != self.digest:
            message = (f"node {self.node_id}: config digest {self.digest} differs from the run's {current}: every "
                       f"node must use the same model, data.seq_len and diloco settings (e.g. inner_steps H), the "
                       f"same workers per node (/wN) and an engine of the same wire protocol (/pN)")
            self._emit_membership("rejected", self.node_id, [])
            raise MeshError(message)

    def _info_json(self) -> str:
        return json.dumps({**self.info, "node": self.node_id}, sort_keys=True, default=str)

    def _claim_id(self) -> None:
        """Claim the node id. An id held by a process whose counter still moves is refused; one held by a dead
        or departed process (a restart after a crash or a stop) is taken over."""
        k = self.keys
        self._await_pending_prune()
        mine = self._info_json()
        current = text(self.store.compare_set(k.info(self.node_id), "", mine))
        if current == mine:
            return
        # on a store with leases a vanished heartbeat key is proof enough: its holder stopped renewing its lease
        held = not self._leased or self.store.check([k.hb(self.node_id)])
        counter = int(text(self.store.add(k.hb(self.node_id), 0))) if held else 0
        if held and counter >= 0 and self._counter_moves(self.node_id):
            try:
                old = json.loads(current)
                where = f" (host {old.get('host')}, pid {old.get('pid')})"
            except ValueError:
                where = ""
            self._emit_membership("rejected", self.node_id, [])
            raise MeshError(f"node id {self.node_id!r} is in use by a live node{where}: give this node another "
                            f"GLOBAL_UNIQUE_ID / mesh.node_id")
        self.store.set(k.info(self.node_id), mine)

    def _register(self, s: Any) -> None:
        """Keys first, then the registry entry: whoever finds the id registered finds its keys."""
        k = self.keys
        counter = int(text(s.add(k.hb(self.node_id), 1)))
        if counter <= 0:  # the id left cleanly before (negative counter): beat from 1 again
            s.set(k.hb(self.node_id), "1")
        self._write_state(NodeState("starting", self.info["token"]), s)
        s.compare_set(k.leader(), "", "")  # created empty: every tick reads it in one multi_get
        s.compare_set(k.latest(), "", "")
        self._store_life = text(s.compare_set(k.life(), "", uuid.uuid4().hex))

        def add_me(reg: Registry) -> None:
            reg.gone.pop(self.node_id, None)
            if self.node_id not in reg.ids:
                reg.ids.append(self.node_id)
        Registry.update(s, k, add_me)

    def _await_pending_prune(self) -> None:
        """An id the leader pruned from the registry (listed in `gone`) has its keys deleted at the leader's next
        prune. A process restarted under that id waits for that deletion before it claims the id: claimed first,
        its fresh keys would be deleted under it (and a deletion seen mid-claim reads as a moving counter). A
        leader that is gone too never deletes them: after a few beats the id is taken back from `gone` here."""
        deadline = self.clock() + self.cfg.heartbeat_timeout + 3 * self.cfg.heartbeat_interval
        while self.node_id in Registry.read(self.store, self.keys)[1].gone:
            self._poll_checks("waiting for the leader to finish pruning this id's old keys")
            if self.clock() > deadline:
                Registry.update(self.store, self.keys, lambda reg: reg.gone.pop(self.node_id, None))
                return
            self.sleep(self.cfg.polling_interval)

    def _counter_moves(self, node: str) -> bool:
        """Watch a heartbeat counter for one timeout (plus a beat): True as soon as it goes up. Only a live
        process raises it; a deleted key (a prune) reads 0 and a clean leave writes it negative."""
        key = self.keys.hb(node)
        first = int(text(self.store.add(key, 0)))
        deadline = self.clock() + self.cfg.heartbeat_timeout + self.cfg.heartbeat_interval
        while self.clock() <= deadline:
            self._poll_checks("checking whether the node id is in use")
            if int(text(self.store.add(key, 0))) > first:
                return True
            self.sleep(self.cfg.polling_interval)
        return False

    def _must_join(self) -> bool:
        """Join a running run, or (re)form one. Join iff a member of the last plan is beating and is running the
        run (training or draining); re-form when every member is dead, gone, or itself restarted (starting,
        joining): after a stop of every node, their restarted processes form a new life of the run together."""
        _, latest = self._read_latest()
        if latest is None:
            return False
        others = [m for m in latest.members if m != self.node_id]
        limit = 2 * self.cfg.heartbeat_timeout + self.cfg.store_timeout
        deadline = self.clock() + limit
        while True:
            _, reg = Registry.read(self.store, self.keys)
            listed = [m for m in others if m in reg.ids]
            states = self._read_states(listed)
            with self._lock:
                now = self.clock()
                running = [m for m in listed if self._liveness.moved(m) and not self._liveness.is_dead(m, now)
                           and states[m] is not None and states[m].state in ("training", "draining", "standby")]
                idle = all(self._liveness.is_dead(m, now) or (states[m] is not None and
                                                              states[m].state in ("starting", "joining", "left"))
                           for m in listed)
            if running:
                self.epoch = latest.epoch
                return True
            if idle:
                # no member runs the run: this node (re)forms it in a new epoch, with any restarted member
                self.epoch = self._base_generation = latest.generation
                return False
            if self.clock() > deadline:
                raise MeshError(f"node {self.node_id}: could not tell within {limit:g}s whether the run's members "
                                f"{others} are alive (their heartbeats were not observed)")
            self._idle("deciding whether to join or form the run")

    # ---- after a plan and a decision ----------------------------------------------------------------------------

    def _may_plan(self) -> bool:
        """The lease holder plans; any waiting node does once the leader is overdue by a heartbeat timeout.
        Never from a stale liveness table (this node was frozen or cut off): it would plan the others out."""
        if self._last_look is None or self.clock() - self._last_look > self.cfg.heartbeat_timeout:
            return False
        wait = self.cfg.start_timeout if self._forming else self.cfg.store_timeout
        return self._is_leader or self.clock() > self._arrived_at + wait + self.cfg.heartbeat_timeout

    def _stale(self, outer_step: int, attempt: int, latest: Plan, why: str) -> None:
        self._release_lease()
        raise Excluded(f"node {self.node_id}: arrived at outer step {outer_step} attempt {attempt} but {why} "
                       f"(outer step {latest.outer_step} attempt {latest.attempt}, epoch {latest.epoch}): re-join "
                       f"as a joiner")

    def _accept(self, plan: Plan) -> Plan:
        if self.node_id not in plan.members:
            self._release_lease()
            raise Excluded(f"node {self.node_id}: left out of outer step {plan.outer_step} attempt {plan.attempt} "
                           f"(generation {plan.generation}, members {list(plan.members)}): re-join as a joiner")
        self._recent = self._recent | frozenset(plan.members)
        self._plan = plan
        self._forming = False
        st = self._node_state
        group = (plan.generation, plan.rank_of(self.node_id))
        state = "joining" if self.node_id in plan.joiners else ("draining" if st.draining else "training")
        self.state = state
        self._node_state = NodeState(state, st.token, st.at, st.contributing, st.draining, st.ok, group)
        self._write_state(self._node_state, self.store)
        return plan

    def _after_decision(self, plan: Plan, decision: str) -> None:
        if decision != COMMIT:
            return
        for j in plan.joiners:
            self._emit_membership("joined", j, list(plan.members), plan.generation)
        for d in plan.leaving:
            self._emit_membership("drained", d, list(plan.members), plan.generation)
        if self.node_id in plan.joiners:
            with self._guard("admission"):
                self._set_state("draining" if self._node_state.draining else "training")

    def _forget_run(self) -> None:
        """The store restarted empty: this node's view of the run is void; it forms the run anew."""
        self._reset = False
        self.epoch = self._base_generation = 0
        self._forming = True
        self._plan = None
        self.state = "starting"

    # ---- helpers ------------------------------------------------------------------------------------------------

    def _poll_checks(self, what: str) -> None:
        """What every wait checks at every poll: the heartbeat's fate, a restarted store, a stop or drain."""
        self._check_heartbeat()
        if self._reset:
            self._forget_run()
            raise Reformed(f"node {self.node_id}: {what}: the membership store restarted empty; the run re-forms")
        reason = self.interrupt() if self.interrupt is not None else None
        if reason:
            raise Stopped(reason, what)

    def _idle(self, what: str) -> None:
        """One poll interval. Without a heartbeat thread the wait loops beat themselves (tests)."""
        self._poll_checks(what)
        if not self._use_thread and self.state != "left":
            self._beat()
            self._check_heartbeat()
        self.sleep(self.cfg.polling_interval)

    def _check_heartbeat(self) -> None:
        if self._hb_error is not None:
            raise MeshError(f"node {self.node_id}: heartbeat stopped: {self._hb_error}")

    def _stop_thread(self) -> None:
        self._stop.set()
        _running.discard(self)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.cfg.heartbeat_interval + self.cfg.store_timeout)
        self._outbox.close(timeout=self.cfg.heartbeat_interval)

    def _set_state(self, state: str) -> None:
        self.state = state
        st = self._node_state
        self._node_state = NodeState(state, st.token, st.at, st.contributing, st.draining, st.ok, st.group)
        self._write_state(self._node_state, self.store)

    def _write_state(self, st: NodeState, s: Any) -> None:
        self._node_state = st
        s.set(self.keys.state(self.node_id), st.to_json())

    def _release_lease(self) -> None:
        self._is_leader = False
        self.store.compare_set(self.keys.leader(), self.node_id, "")

    def _emit_membership(self, change: str, subject: str, members: list[str], generation: int | None = None) -> None:
        if generation is None:
            generation = self._plan.generation if self._plan else 0
        self.emit("membership", change=change, subject=subject, generation=generation, members=members)

    @contextmanager
    def _guard(self, what: str, resumable: bool = False) -> Iterator[None]:
        """Store failures: in a resumable wait, a pause until the heartbeat has the store back (_StoreDown);
        else one MeshError line naming this node and what it was doing."""
        try:
            yield
        except (MeshError, Excluded, Stopped, Reformed, ValueError):
            raise
        except STORE_ERRORS as e:
            if resumable and self._reconnect is not None and self._ready and self._hb_error is None:
                raise _StoreDown(first_line(e)) from None
            raise MeshError(f"node {self.node_id}: {what}: lost the membership store ({first_line(e)})") from None
