"""The planner's inputs and outputs: what a boundary looks like in the store, the one plan write, the decision of an
attempt, and the cleanup.

Planning reads O(1) round trips whatever the number of nodes: the registry, every registered node's `state/<id>`
in one multi_get (its arrival, join request and lifecycle are all in that one key), `plan/latest` and the previous
plan's decision. Liveness comes from the heartbeat's table (no store operation). The plan is written with one
compare_set on `plan/latest` against the value the planner read, so two would-be leaders still make one plan per
boundary, and `plan/latest` only moves forward. Deciding an attempt is one multi_get of `plan/latest` and the
members' states, and one compare_set of its decision key.

The planner reads and writes through the caller's store client (`Membership.store`); it never waits: the waits
that loop over it are Mesh's (node.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from engine.mesh.membership import Membership, Registry, text
from engine.mesh.protocol import ABORT, COMMIT, BoundaryView, Excluded, Keys, Plan, StateRecord, compute_plan, decide
from engine.states import NodeState

KEEP_STEPS = 3  # decisions of this many recent outer steps stay in the store


def moved_past(plan: Plan, latest: Plan | None) -> bool:
    """The run planned a later boundary of this epoch than the plan this node waits to hear about: that
    attempt was decided (a next plan needs it decided) and its decision may be collected already (a node cut
    off for several outer steps). This node cannot know which way it went; it takes it as an abort for itself
    only, and its next boundary finds the run moved past it: it re-joins and receives the state. Writing the
    abort could contradict a commit the others applied."""
    return latest is not None and latest.epoch == plan.epoch \
        and (latest.outer_step, latest.attempt) > (plan.outer_step, plan.attempt)


class Planner:
    """One node's planner: it reads a boundary, writes its plan when asked to, and decides attempts."""

    def __init__(self, m: Membership, node_id: str, keys: Keys, *, min_nodes: int,
                 clock: Callable[[], float], round_seconds: float = 0.0, grace: float = 0.0,
                 wall: Callable[[], float] = time.time) -> None:
        self.round_seconds = round_seconds  # time rounds: every plan sets the next round's deadline
        self.grace, self.wall = grace, wall
        self.m = m
        self.node_id = node_id
        self.keys = keys
        self.min_nodes = min_nodes
        self.clock = clock

    def read(self, key: str) -> str:
        """One round trip for a key that may be absent: absent reads "" (and is created empty, which every
        reader of these keys takes as absent)."""
        return text(self.m.store.compare_set(key, "", ""))

    def latest(self) -> tuple[str, Plan | None]:
        raw = self.read(self.keys.latest())
        return raw, (Plan.from_json(raw) if raw else None)

    def states(self, nodes: list[str]) -> dict[str, StateRecord | None]:
        if not nodes:
            return {}
        raws = self.m.store.multi_get([self.keys.state(n) for n in nodes])
        return {n: StateRecord.from_json(text(r)) for n, r in zip(nodes, raws)}

    def states_now(self, nodes: list[str]) -> dict[str, StateRecord | None]:
        """As states(), without waiting: None for a node whose state key is gone (the leader pruned it). TCPStore's
        multi_get would wait mesh.store_timeout for that key and then fail, and a wait that fails on the store
        starts over (Polling.resilient): a joiner that read a pruned member's state so waited forever."""
        keys, store = [self.keys.state(n) for n in nodes], self.m.store
        if hasattr(store, "multi_get_or_none"):  # a store with leases: one round trip
            raws = store.multi_get_or_none(keys)
        else:
            raws = [store.get(key) if store.check([key]) else None for key in keys]
        return {n: None if r is None else StateRecord.from_json(text(r)) for n, r in zip(nodes, raws)}

    def past_grace(self, latest: Plan | None, outer_step: int) -> bool:
        """Time rounds: the round that ended had a deadline (the last plan's) and its grace is over: plan with
        whoever arrived; a member that arrives later is left out (it re-joins, its round not counted). Not for a
        retry of an aborted outer step: its latest plan is that step's own, whose deadline (the next round's) may
        have passed while the attempt failed, and the survivors, which arrive again as they see the abort, are
        awaited as in a step round."""
        if latest is None or latest.deadline is None or latest.epoch != self.m.epoch \
                or latest.outer_step >= outer_step:
            return False
        return self.wall() > latest.deadline + self.grace

    def try_plan(self, outer_step: int, attempt: int, raw: str, latest: Plan | None, *, timed_out: bool) -> None:
        """Write the plan of (outer_step, attempt) if the boundary is ready (compare_set against `raw`)."""
        epoch = self.m.epoch
        prev = latest if latest is not None and latest.epoch == epoch else None
        view = self._view(outer_step, attempt, prev, timed_out)
        plan = compute_plan(view)
        if plan is None:
            return
        if self.round_seconds:
            plan = replace(plan, deadline=round(self.wall() + self.round_seconds, 3))
        mine = plan.to_json()
        if text(self.m.store.compare_set(self.keys.latest(), raw, mine)) != mine:
            return  # another node planned first: the caller reads its plan
        if prev is None and latest is not None:
            self._collect_decisions(latest.epoch, latest.outer_step, KEEP_STEPS + 1)  # the previous life's
        elif plan.attempt == 0:
            self._collect_decisions(epoch, plan.outer_step - KEEP_STEPS, 1)

    def _view(self, outer_step: int, attempt: int, prev: Plan | None, timed_out: bool) -> BoundaryView:
        m = self.m
        _, reg = Registry.read(m.store, self.keys)
        nodes = sorted(set(reg.ids) | {self.node_id})
        states = self.states(nodes)
        with m.lock:
            dead = m.liveness.dead([n for n in nodes if n != self.node_id], self.clock())
        if prev is not None:
            # a member of the last plan that is no longer registered was pruned (it left, or was dead for two
            # timeouts): gone, never awaited. (A drain that lands during the round leaves after the commit
            # without being in `leaving`; once pruned, nothing else would tell the planner it is gone.)
            dead = dead | frozenset(set(prev.members) - set(nodes))
        here = (m.epoch, outer_step, attempt)

        def arrived_here(st: StateRecord) -> bool:
            if st.at is None or st.state in (NodeState.LEFT, NodeState.JOINING, NodeState.STANDBY):
                return False
            if prev is None:  # formation: every outer step of this epoch and attempt (see compute_plan)
                return st.at[0] == m.epoch and st.at[2] == attempt
            return tuple(st.at) == here

        arrived = {n: st.arrival() for n, st in states.items() if st is not None and arrived_here(st)}
        joining = frozenset(n for n, st in states.items() if st is not None and st.state == NodeState.JOINING
                            and n not in dead)
        starting = frozenset(n for n, st in states.items() if st is not None and st.state == NodeState.STARTING
                             and n not in dead)
        standby = frozenset(n for n, st in states.items() if st is not None and st.state == NodeState.STANDBY)
        prev_committed = prev is not None and self.read(
            self.keys.decision(prev.epoch, prev.outer_step, prev.attempt)) == COMMIT
        return BoundaryView(epoch=m.epoch, outer_step=outer_step, attempt=attempt, prev=prev,
                            prev_committed=prev_committed, arrived=arrived, dead=dead, joining=joining,
                            starting=starting, standby=standby, min_nodes=self.min_nodes, timed_out=timed_out,
                            base_generation=m.base_generation)

    def _collect_decisions(self, epoch: int, last_step: int, steps: int) -> None:
        """Delete the decisions of outer steps last_step-steps+1 .. last_step (every attempt) of an epoch: the
        plan writer does it for the step KEEP_STEPS back, and for the previous life when a run re-forms."""
        k, store = self.keys, self.m.store
        for step in range(max(0, last_step - steps + 1), last_step + 1):
            attempt = 0
            while store.check([k.decision(epoch, step, attempt)]):
                store.delete_key(k.decision(epoch, step, attempt))
                attempt += 1

    def plan_for(self, latest: Plan | None, outer_step: int, attempt: int) -> Plan | None:
        """Whether `plan/latest` answers this node's wait at (outer_step, attempt): the plan, None (not yet), or
        raise Excluded (the run moved on without it, or re-formed in a newer epoch)."""
        epoch = self.m.epoch
        if latest is None or latest.epoch < epoch:
            return None
        if latest.epoch > epoch:
            self._stale(outer_step, attempt, latest, "the run re-formed (a newer epoch) while this node was away")
        mine = self.m.plan
        if (latest.outer_step, latest.attempt) == (outer_step, attempt):
            return latest
        if (latest.outer_step, latest.attempt) > (outer_step, attempt):
            newer = mine is None or mine.epoch != latest.epoch or latest.generation > mine.generation \
                or (latest.outer_step, latest.attempt) > (mine.outer_step, mine.attempt)
            if newer and self.node_id in latest.joiners:
                return latest  # formed at a newer outer step than this node's checkpoint: it catches up
            self._stale(outer_step, attempt, latest, "the run moved past this boundary")
        return None

    def _stale(self, outer_step: int, attempt: int, latest: Plan, why: str) -> None:
        raise Excluded(f"node {self.node_id}: arrived at outer step {outer_step} attempt {attempt} but {why} "
                       f"(outer step {latest.outer_step} attempt {latest.attempt}, epoch {latest.epoch}): re-join "
                       f"as a joiner")

    def dead_members(self, plan: Plan) -> list[str]:
        """Members of the plan this node sees dead now (no store operation: the heartbeat's table)."""
        with self.m.lock:
            return sorted(self.m.liveness.dead([n for n in plan.members if n != self.node_id], self.clock()))

    def decision(self, plan: Plan) -> str | None:
        """Decide the plan's attempt from every member's posted outcome and the members this node sees dead: the
        decision written (or the one another node wrote first), or None while it is open."""
        k = self.keys
        key = k.decision(plan.epoch, plan.outer_step, plan.attempt)
        raws = self.m.store.multi_get([k.latest()] + [k.state(n) for n in plan.members])
        latest = Plan.from_json(text(raws[0])) if text(raws[0]) else None
        posted: dict[str, bool] = {}
        for node, raw in zip(plan.members, raws[1:]):
            st = StateRecord.from_json(text(raw))
            if st is not None and st.at is not None and tuple(st.at) == (plan.epoch, plan.outer_step, plan.attempt) \
                    and st.ok is not None:
                posted[node] = bool(st.ok)
        if latest is not None and latest.epoch > plan.epoch:
            decision: str | None = ABORT  # the run re-formed without this plan: it must never commit (split brain)
        elif moved_past(plan, latest):
            return self.read(key) or ABORT  # see moved_past: this node's answer only, never written
        else:
            decision = decide(plan.members, posted, self.dead_members(plan))
        if decision is None:
            return None
        return text(self.m.store.compare_set(key, "", decision))
