"""The planner's inputs and outputs: what a boundary looks like in the store, the one plan write, and the cleanup.

Planning reads O(1) round trips whatever the number of nodes: the registry, every registered node's `state/<id>`
in one multi_get (its arrival, join request and lifecycle are all in that one key), `plan/latest` and the previous
plan's decision. Liveness comes from the heartbeat's table (no store operation). The plan is written with one
compare_set on `plan/latest` against the value the planner read, so two would-be leaders still make one plan per
boundary, and `plan/latest` only moves forward.
"""

from __future__ import annotations


from engine.mesh.heartbeat import Registry, text
from engine.mesh.protocol import COMMIT, BoundaryView, NodeState, Plan, compute_plan

KEEP_STEPS = 3  # decisions of this many recent outer steps stay in the store


class Planner:
    """The planning half of Mesh (engine/mesh/node.py), which provides the attributes used here."""

    def _read_latest(self) -> tuple[str, Plan | None]:
        raw = text(self.store.compare_set(self.keys.latest(), "", ""))
        return raw, (Plan.from_json(raw) if raw else None)

    def _read_states(self, nodes: list[str]) -> dict[str, NodeState | None]:
        if not nodes:
            return {}
        raws = self.store.multi_get([self.keys.state(n) for n in nodes])
        return {n: NodeState.from_json(text(r)) for n, r in zip(nodes, raws)}

    def _try_plan(self, outer_step: int, attempt: int, raw: str, latest: Plan | None, *, timed_out: bool) -> None:
        """Write the plan of (outer_step, attempt) if the boundary is ready (compare_set against `raw`)."""
        prev = latest if latest is not None and latest.epoch == self.epoch else None
        view = self._view(outer_step, attempt, prev, timed_out)
        plan = compute_plan(view)
        if plan is None:
            return
        mine = plan.to_json()
        if text(self.store.compare_set(self.keys.latest(), raw, mine)) != mine:
            return  # another node planned first: the caller reads its plan
        if prev is None and latest is not None:
            self._collect_decisions(latest.epoch, latest.outer_step, KEEP_STEPS + 1)  # the previous life's
        elif plan.attempt == 0:
            self._collect_decisions(self.epoch, plan.outer_step - KEEP_STEPS, 1)

    def _view(self, outer_step: int, attempt: int, prev: Plan | None, timed_out: bool) -> BoundaryView:
        _, reg = Registry.read(self.store, self.keys)
        nodes = sorted(set(reg.ids) | {self.node_id})
        states = self._read_states(nodes)
        with self._lock:
            dead = self._liveness.dead([n for n in nodes if n != self.node_id], self.clock())
        if prev is not None:
            # a member of the last plan that is no longer registered was pruned (it left, or was dead for two
            # timeouts): gone, never awaited. (A drain that lands during the round leaves after the commit
            # without being in `leaving`; once pruned, nothing else would tell the planner it is gone.)
            dead = dead | frozenset(set(prev.members) - set(nodes))
        here = (self.epoch, outer_step, attempt)

        def arrived_here(st: NodeState) -> bool:
            if st.at is None or st.state in ("left", "joining", "standby"):
                return False
            if prev is None:  # formation: every outer step of this epoch and attempt (see compute_plan)
                return st.at[0] == self.epoch and st.at[2] == attempt
            return tuple(st.at) == here

        arrived = {n: st.arrival() for n, st in states.items() if st is not None and arrived_here(st)}
        joining = frozenset(n for n, st in states.items() if st is not None and st.state == "joining"
                            and n not in dead)
        starting = frozenset(n for n, st in states.items() if st is not None and st.state == "starting"
                             and n not in dead)
        standby = frozenset(n for n, st in states.items() if st is not None and st.state == "standby")
        prev_committed = prev is not None and self._read(
            self.keys.decision(prev.epoch, prev.outer_step, prev.attempt)) == COMMIT
        return BoundaryView(epoch=self.epoch, outer_step=outer_step, attempt=attempt, prev=prev,
                            prev_committed=prev_committed, arrived=arrived, dead=dead, joining=joining,
                            starting=starting, standby=standby, min_nodes=self.min_nodes, timed_out=timed_out,
                            base_generation=self._base_generation)

    def _collect_decisions(self, epoch: int, last_step: int, steps: int) -> None:
        """Delete the decisions of outer steps last_step-steps+1 .. last_step (every attempt) of an epoch: the
        plan writer does it for the step KEEP_STEPS back, and for the previous life when a run re-forms."""
        k = self.keys
        for step in range(max(0, last_step - steps + 1), last_step + 1):
            attempt = 0
            while self.store.check([k.decision(epoch, step, attempt)]):
                self.store.delete_key(k.decision(epoch, step, attempt))
                attempt += 1

    def _read(self, key: str) -> str:
        """One round trip for a key that may be absent: absent reads "" (and is created empty, which every
        reader of these keys takes as absent)."""
        return text(self.store.compare_set(key, "", ""))

    def _plan_for(self, latest: Plan | None, outer_step: int, attempt: int) -> Plan | None:
        """Whether `plan/latest` answers this node's wait at (outer_step, attempt): the plan, None (not yet), or
        raise Excluded (the run moved on without it, or re-formed in a newer epoch)."""
        if latest is None or latest.epoch < self.epoch:
            return None
        if latest.epoch > self.epoch:
            self._stale(outer_step, attempt, latest, "the run re-formed (a newer epoch) while this node was away")
        mine = self._plan
        if (latest.outer_step, latest.attempt) == (outer_step, attempt):
            return latest
        if (latest.outer_step, latest.attempt) > (outer_step, attempt):
            newer = mine is None or mine.epoch != latest.epoch or latest.generation > mine.generation \
                or (latest.outer_step, latest.attempt) > (mine.outer_step, mine.attempt)
            if newer and self.node_id in latest.joiners:
                return latest  # formed at a newer outer step than this node's checkpoint: it catches up
            self._stale(outer_step, attempt, latest, "the run moved past this boundary")
        return None
