"""One node's side of the membership protocol: the API the outer loop calls, and its bounded waits.

The node's local rank 0 owns one Mesh, composed of:

    Registration  (registration.py)  its id, token and digest in the store; start-up; its own state/<id>
    Heartbeat     (heartbeat.py)     a thread: beats, watches every registered peer (liveness), takes the leader
                                     lease, prunes, survives store loss
    Planner       (planner.py)       reads a boundary, writes plans, decides attempts
    Polling       (polling.py)       what every wait checks at every poll; the pause while the store is lost
    Admission     (admission.py)     stepping out of an attempt; the wait of a joiner (new or stepped out)
    Membership    (membership.py)    what they share: the store client, epoch, plan, liveness, lease, lifecycle

The caller's thread does the boundary and commit waits here, the admission wait in admission.py: each is a
bounded polling loop with a deadline from MeshConfig that polls by Polling's rules (a stop, a drain, a restarted
store, a lost store). docs/mesh.md is the protocol description.

For tests the clock and sleep are injectable, and with heartbeat_thread=False each wait loop runs one heartbeat
tick per poll instead, so a single thread can drive several nodes over a MemoryStore deterministically. Tests and
benches reach a part by its name (mesh.heartbeat.tick(), mesh.heartbeat.is_dead(peer), mesh.registration.announce
(state)): Mesh itself keeps only the API the outer loop calls.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable

from engine.mesh.admission import SLOW_LINK, Admission
from engine.mesh.heartbeat import Heartbeat
from engine.mesh.membership import Membership, text
from engine.mesh.planner import KEEP_STEPS, Planner, moved_past
from engine.mesh.polling import Polling
from engine.mesh.protocol import (ABORT, COMMIT, LEAVE_REASONS, Excluded, Keys, Liveness, MeshError, StateRecord,
                                  Plan)
from engine.mesh.registration import Registration
from engine.states import NodeState

__all__ = ["KEEP_STEPS", "SLOW_LINK", "Mesh"]


class Mesh:
    def __init__(self, store: Any, node_id: str, cfg: Any, *, digest: str, info: dict[str, Any], min_nodes: int,
                 emit: Callable[..., Any], clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, heartbeat_thread: bool = True,
                 interrupt: Callable[[], str | None] | None = None,
                 reconnect: Callable[[], Any] | None = None, round_seconds: float = 0.0, grace: float = 0.0,
                 wall: Callable[[], float] = time.time) -> None:
        if not node_id or "/" in node_id:
            raise ValueError(f"mesh.node_id {node_id!r}: must be non-empty and contain no '/'")
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
        self.keys = k = Keys()
        # a gap between looks longer than a tick plus a quarter timeout (the observer's own store calls failed or
        # crawled) is not counted against the peers (Liveness.look)
        liveness = Liveness(cfg.heartbeat_timeout, slack=cfg.heartbeat_interval + cfg.heartbeat_timeout / 4)
        self._m = m = Membership(store, StateRecord(NodeState.STARTING, self.info["token"]), liveness)
        leased = bool(getattr(store, "has_leases", lambda: False)())  # etcd: a dead node's heartbeat key vanishes
        # time rounds (diloco.round = "time"): plans carry the next round's deadline, and the planner waits for a
        # member at most `grace` past the deadline of the round that ended (diloco.straggler_grace)
        self.planner = Planner(m, node_id, k, min_nodes=min_nodes, clock=clock, round_seconds=round_seconds,
                               grace=grace, wall=wall)
        self.registration = Registration(m, self.planner, node_id, k, cfg, digest=digest, info=self.info,
                                         leased=leased, clock=clock, sleep=sleep, emit=emit)
        self.heartbeat = Heartbeat(m, self.registration, node_id, k, cfg, workers=int(self.info.get("workers", 1)),
                                   leased=leased, clock=clock, emit=emit, reconnect=reconnect,
                                   thread=heartbeat_thread)
        self.polling = Polling(m, self.heartbeat, node_id, k, cfg, sleep=sleep, interrupt=interrupt,
                               can_resume=reconnect is not None)
        self.admission = Admission(m, self.planner, self.registration, self.heartbeat, self.polling, node_id, k, cfg,
                                   clock=clock, emit=emit)
        self._arrived_at = 0.0
        self._arriving_at = 0.0  # when its last arrival began (before its write): the straggler budget
        self._posted_at = 0.0

    # ---- public API -------------------------------------------------------------------------------------------

    @property
    def store(self) -> Any:
        """The caller thread's store client (a new one after the heartbeat reconnected)."""
        return self._m.store

    @property
    def state(self) -> NodeState:
        return self._m.state

    @property
    def epoch(self) -> int:
        return self._m.epoch

    @property
    def is_leader(self) -> bool:
        return self._m.is_leader

    @property
    def plan(self) -> Plan | None:
        return self._m.plan

    def start(self) -> bool:
        """Register, check digest and id, start heartbeats. True if this node must join a running run."""
        with self.polling.guard("start"):
            self.registration.check_digest(self.store)
            self.registration.claim_id(self.polling.check)
            self.registration.register()
            self.heartbeat.start()
            joiner = self.registration.must_join(self.polling.idle)
            self._m.forming = not joiner
            if joiner:
                self.registration.announce(NodeState.JOINING)
            self._m.ready = True
            return joiner

    def boundary(self, outer_step: int, attempt: int, *, contributing: bool = True, draining: bool = False,
                 budget: float | None = None) -> Plan:
        """Arrive at (outer_step, attempt) and wait for its plan. Raises Excluded if the plan left this node out.
        A formation may answer with a plan of a newer outer step that lists this node as a joiner. `budget`: the
        straggler budget (diloco.straggler_timeout), counted from the arrival: once it is spent while this node's
        own link is slow, the node steps out here (see poll_plan) instead of crawling on to the collective."""
        what = f"outer step {outer_step} attempt {attempt}"
        return self.polling.resilient(
            what, lambda: self._boundary(outer_step, attempt, contributing, draining, what, budget))

    def wait_admission(self) -> Plan:
        """A joiner (or an excluded node) asks to be admitted and waits for a plan that lists it in `joiners`."""
        return self.polling.resilient("waiting for admission", lambda: self._accept(self.admission.wait()))

    def commit(self, plan: Plan, succeeded: bool) -> bool:
        """Post this node's outcome of the outer step and obey the single decision: True = commit, False = abort."""
        what = f"commit of outer step {plan.outer_step} attempt {plan.attempt}"
        decision = self.polling.resilient(what, lambda: self._commit(plan, succeeded))
        self._after_decision(plan, decision)
        return decision == COMMIT

    def step_out(self, plan: Plan, why: str, *, cause: str = SLOW_LINK) -> None:
        """Leave the plan's attempt because this node's own link is too slow for the run (link_slow while a
        collective of the attempt is overdue), or because it missed the state it needs (engine/outer/handoff.py).
        In state `standby` the planner neither waits for it nor admits it; the abort it writes (the attempt cannot
        commit without this node's ok anyway) ends its peers' wait at their next poll, and they re-plan without it.
        Its pseudo-gradient of this round is not counted. Its next boundary raises Excluded; wait_admission asks to
        join again once the link is healthy. A joiner of a committed plan (its state did not arrive) asks only once
        a later plan is out: at that plan's boundary its peers count it a member of the commit whose state may
        still say joining (protocol.compute_plan), and would wait for it."""
        self.admission.step_out(plan.epoch, plan.outer_step, plan.attempt, why, cause)
        if self.node_id in plan.joiners and self.planner.read(
                self.keys.decision(plan.epoch, plan.outer_step, plan.attempt)) == COMMIT:
            self.admission.rejoin_after = (plan.epoch, plan.outer_step)

    def leave(self, reason: str) -> None:
        """A clean exit: the counter goes negative, peers drop this node at once. Stops the heartbeat."""
        if reason not in LEAVE_REASONS:
            raise ValueError(f"mesh.leave: reason {reason!r} is not one of {', '.join(LEAVE_REASONS)}")
        if self.state == NodeState.LEFT:
            return
        self.heartbeat.stop()
        if self.heartbeat.error is not None or self.heartbeat.lost_since is not None:
            # the store is lost: a call on the dead client only adds a C++ stack dump to stderr
            self._m.state = NodeState.LEFT
            raise MeshError(f"node {self.node_id}: leave: the membership store is lost")
        self._m.state = NodeState.LEFT  # locally at once: a second leave() after a store failure is a no-op
        with self.polling.guard("leave"):
            self.heartbeat.release_lease()
            if self.registration.leased:  # the goodbye outlives this process (until pruned): a clean exit
                self.store.unlease_key(self.keys.hb(self.node_id))
            self.store.set(self.keys.hb(self.node_id), "-1")
            self.registration.announce(NodeState.LEFT, reason)
        members = list(self.plan.members) if self.plan else []
        self._emit_membership("drained" if reason == "drained" else "left", self.node_id, members)

    def close(self) -> None:
        """Stop the heartbeat thread (without a goodbye: call leave() first for a clean exit)."""
        self.heartbeat.stop()

    # ---- what the outer loop's collectives ask while they wait (engine/outer/groups.py) --------------------------

    def dead_members(self, plan: Plan) -> list[str]:
        """Members of the plan this node sees dead now (no store operation: the heartbeat's table)."""
        return self.planner.dead_members(plan)

    def link_slow(self) -> bool:
        """This node's own store round trips are being retransmitted (Heartbeat.link_slow)."""
        return self.heartbeat.link_slow()

    # ---- non-blocking steps (the blocking calls above loop over these; tests drive them directly) -------------

    def arrive(self, outer_step: int, attempt: int, *, contributing: bool = True, draining: bool = False) -> None:
        m = self._m
        if draining and m.state == NodeState.TRAINING:
            m.state = NodeState.DRAINING
        self._arriving_at = self.clock()  # before its write, which crawls on a slow link too: the straggler budget
        st = StateRecord(m.state, self.info["token"], (m.epoch, outer_step, attempt), contributing, draining, None,
                       m.node_state.group)
        self.registration.write_state(st, self.store)
        self._arrived_at = self.clock()

    def poll_plan(self, outer_step: int, attempt: int, *, budget: float | None = None) -> Plan | None:
        """The plan of (outer_step, attempt) if there is one (writing it when this node leads), else None.

        With a straggler `budget`: a node whose own link is slow (link_slow) and that arrived more than `budget`
        seconds ago steps out now (state standby; the attempt's plan, if out with this node in it, aborted) and
        raises Excluded. Its peers were held from its arrival; over a lossy link its reading of the plan, its
        state write and its rendezvous each take a retransmission back-off, and it would reach the collective,
        where the same rule holds (engine/outer/groups.py), seconds later (the chaos lab's seed-21 residual)."""
        what = f"outer step {outer_step} attempt {attempt}"
        self.polling.check(what)
        if budget is not None and not self._m.forming and self.clock() - self._arriving_at > budget \
                and self.link_slow():
            self.admission.step_out(self._m.epoch, outer_step, attempt,
                                    f"no plan read within its straggler budget ({budget:.1f}s from its arrival, "
                                    f"diloco.straggler_timeout) on a slow link (mesh.slow_tick)")
            raise self._stepped_out(what)
        raw, latest = self.planner.latest()
        plan = self._plan_for(latest, outer_step, attempt)
        if plan is None and self._may_plan():
            wait = self.cfg.start_timeout if self._m.forming else self.cfg.store_timeout
            overdue = self.clock() > self._arrived_at + wait or self.planner.past_grace(latest, outer_step)
            self.planner.try_plan(outer_step, attempt, raw, latest, timed_out=overdue)
            raw, latest = self.planner.latest()
            plan = self._plan_for(latest, outer_step, attempt)
        return None if plan is None else self._accept(plan)

    def post(self, plan: Plan, succeeded: bool) -> None:
        """Post this node's outcome of the plan's all-reduce (in its state key)."""
        st = self._m.node_state
        self.registration.write_state(StateRecord(st.state, st.token, (plan.epoch, plan.outer_step, plan.attempt),
                                                st.contributing, st.draining, succeeded, st.group), self.store)
        self._posted_at = self.clock()

    def poll_decision(self, plan: Plan) -> str | None:
        """The decision of the plan's attempt, writing it when this node can decide. The leader decides; the
        others only read the decision key (one round trip, whatever the size of the run), unless the leader is
        overdue by a heartbeat timeout (it died: the lease moves within that time anyway)."""
        current = self.planner.read(self.keys.decision(plan.epoch, plan.outer_step, plan.attempt))
        if current:
            return current
        if not self.is_leader and self.clock() < self._posted_at + self.cfg.heartbeat_timeout:
            return None
        return self.planner.decision(plan)

    # ---- the waits ----------------------------------------------------------------------------------------------

    def _boundary(self, outer_step: int, attempt: int, contributing: bool, draining: bool, what: str,
                  budget: float | None = None) -> Plan:
        # before any write: a process whose id was taken over by a new one while it was cut off (its heartbeat
        # found the other's token) overwrote the new one's join request here, which was then never admitted
        self.polling.check_heartbeat()
        if self._m.reset:  # the store restarted while this node trained: this boundary forms the run anew
            self._m.forget_run()
        if self.admission.stepped_out:
            raise self._stepped_out(what)
        self.arrive(outer_step, attempt, contributing=contributing, draining=draining)
        wait = self.cfg.start_timeout if self._m.forming else self.cfg.store_timeout
        limit = self._arrived_at + wait + self.cfg.store_timeout + 2 * self.cfg.heartbeat_timeout
        while True:
            plan = self.poll_plan(outer_step, attempt, budget=budget)
            if plan is not None:
                return plan
            if self.clock() > limit:
                raise MeshError(f"node {self.node_id}: no plan for {what} within {limit - self._arrived_at:.1f}s "
                                f"(leader {self._m.leader_seen or 'none'}); is mesh.store_timeout shorter than "
                                f"the slowest node's inner round?")
            self.polling.idle(what)

    def _commit(self, plan: Plan, succeeded: bool) -> str:
        what = f"commit of outer step {plan.outer_step} attempt {plan.attempt}"
        self.post(plan, succeeded)
        deadline = self.clock() + self.cfg.store_timeout
        while True:
            self.polling.check(what)
            decision = self.poll_decision(plan)
            if decision is None and self.clock() > deadline:
                # a member alive by heartbeat but silent (hung collective): give up on this attempt
                key = self.keys.decision(plan.epoch, plan.outer_step, plan.attempt)
                if moved_past(plan, self.planner.latest()[1]):
                    return self.planner.read(key) or ABORT
                decision = text(self.store.compare_set(key, "", ABORT))
            if decision:
                return decision
            self.polling.idle(what)

    # ---- after a plan and a decision ----------------------------------------------------------------------------

    def _may_plan(self) -> bool:
        """The lease holder plans; any waiting node does once the leader is overdue by a heartbeat timeout.
        Never from a stale liveness table (this node was frozen or cut off): it would plan the others out."""
        last_look = self._m.last_look
        if last_look is None or self.clock() - last_look > self.cfg.heartbeat_timeout:
            return False
        wait = self.cfg.start_timeout if self._m.forming else self.cfg.store_timeout
        return self.is_leader or self.clock() > self._arrived_at + wait + self.cfg.heartbeat_timeout

    def _plan_for(self, latest: Plan | None, outer_step: int, attempt: int) -> Plan | None:
        """Planner.plan_for; a node the run moved on without gives back the lease before it re-joins."""
        try:
            return self.planner.plan_for(latest, outer_step, attempt)
        except Excluded:
            self.heartbeat.release_lease()
            raise

    def _accept(self, plan: Plan) -> Plan:
        m = self._m
        if self.node_id not in plan.members:
            self.heartbeat.release_lease()
            raise Excluded(f"node {self.node_id}: left out of outer step {plan.outer_step} attempt {plan.attempt} "
                           f"(generation {plan.generation}, members {list(plan.members)}): re-join as a joiner")
        m.recent = m.recent | frozenset(plan.members)
        m.plan = plan
        m.forming = False
        st = m.node_state
        group = (plan.generation, plan.rank_of(self.node_id))
        state = (NodeState.JOINING if self.node_id in plan.joiners
                 else NodeState.DRAINING if st.draining else NodeState.TRAINING)
        m.state = state
        self.registration.write_state(StateRecord(state, st.token, st.at, st.contributing, st.draining, st.ok, group),
                                      self.store)
        return plan

    def _after_decision(self, plan: Plan, decision: str) -> None:
        if decision != COMMIT:
            return
        for j in plan.joiners:
            self._emit_membership("joined", j, list(plan.members), plan.generation)
        for d in plan.leaving:
            self._emit_membership("drained", d, list(plan.members), plan.generation)
        if self.node_id in plan.joiners:
            with self.polling.guard("admission"):
                self.registration.announce(NodeState.DRAINING if self._m.node_state.draining
                                           else NodeState.TRAINING)

    # ---- helpers ------------------------------------------------------------------------------------------------

    def _stepped_out(self, what: str) -> Excluded:
        return Excluded(f"node {self.node_id}: stepped out at {what} ({self.admission.stepped_out}): re-join as a "
                        f"joiner")

    def _emit_membership(self, change: str, subject: str, members: list[str], generation: int | None = None) -> None:
        if generation is None:
            generation = self.plan.generation if self.plan else 0
        self.emit("membership", change=change, subject=subject, generation=generation, members=members)
