"""A node outside the run's plan, and its way in: stepping out of an attempt, and being admitted (again).

    step_out       the node leaves an attempt (its own link too slow, or it missed the state it needs): state
                   standby, the attempt's plan aborted if it is out with this node in it, the lease given back
    wait           a joiner (new, excluded, or stepped out) waits for its link, posts `joining` and waits for a
                   plan that lists it in `joiners`; or learns that the run completed without it (Stopped("ended"))

Mesh (node.py) calls these from its public API (step_out, wait_admission) and reads `stepped_out` at each
boundary: a node that stepped out is excluded there and re-joins as a joiner. The waits are bounded by
mesh.join_timeout and poll by Polling's rules.
"""

from __future__ import annotations

from typing import Any, Callable

from engine.errors import first_line
from engine.mesh.heartbeat import Heartbeat
from engine.mesh.membership import STORE_ERRORS, Membership
from engine.mesh.planner import Planner
from engine.mesh.polling import Polling
from engine.mesh.protocol import ABORT, Keys, MeshError, Plan, Stopped
from engine.mesh.registration import Registration
from engine.states import NodeState

SLOW_LINK = "its link is slow"  # step_out()'s usual cause: the straggler rule (Mesh.poll_plan, groups.bounded)


class Admission:
    """Whether this node stepped out (and why), and the waits that bring it back in."""

    def __init__(self, m: Membership, planner: Planner, registration: Registration, heartbeat: Heartbeat,
                 polling: Polling, node_id: str, keys: Keys, cfg: Any, *, clock: Callable[[], float],
                 emit: Callable[..., Any]) -> None:
        self.m = m
        self.planner = planner
        self.registration = registration
        self.heartbeat = heartbeat
        self.polling = polling
        self.node_id = node_id
        self.keys = keys
        self.cfg = cfg
        self.clock = clock
        self.emit = emit
        self.stepped_out: str | None = None  # step_out()'s cause: the next boundary excludes this node; it re-joins
        # a joiner that stepped out of the plan that admitted it, after its commit: (epoch, outer step) of that plan
        self.rejoin_after: tuple[int, int] | None = None

    def step_out(self, epoch: int, outer_step: int, attempt: int, why: str, cause: str = SLOW_LINK) -> None:
        """Leave the attempt: standby first (the re-plan the abort starts must find it out already), then abort the
        attempt's plan if it is out with this node in it, and give the lease back. (A run that moved on decided this
        attempt already, and may have collected its decision; a plan without this node is not its own.)"""
        self.stepped_out = cause
        try:
            self.registration.announce(NodeState.STANDBY)
            latest = self.planner.latest()[1]
            if latest is not None and latest.epoch == epoch and (latest.outer_step, latest.attempt) == (
                    outer_step, attempt) and self.node_id in latest.members:
                self.m.store.compare_set(self.keys.decision(epoch, outer_step, attempt), "", ABORT)
            self.heartbeat.release_lease()
        except STORE_ERRORS as e:  # cut off for good: its peers see its heartbeat stop instead
            why += f" (the store did not answer: {first_line(e)})"
        then = "once its link is healthy" if cause == SLOW_LINK else "at a later boundary"
        self.emit("warning", message=f"node {self.node_id}: stepped out of outer step {outer_step} attempt "
                                     f"{attempt}: {why}; it asks to join again {then}")

    def wait(self) -> Plan:
        """Post `joining` and wait for a plan that lists this node in `joiners` (not yet decided): the plan, its
        epoch taken. The caller accepts it (Mesh._accept)."""
        what = "waiting for admission"
        self.heartbeat.release_lease()
        if self.stepped_out:
            self.await_link()
        self.registration.announce(NodeState.JOINING)
        deadline = self.clock() + self.cfg.join_timeout
        look = self.clock()  # when to look next whether the run completed without this node
        while True:
            self.polling.check(what)
            _, plan = self.planner.latest()
            if plan is not None and self.node_id in plan.joiners and plan.epoch >= self.m.epoch \
                    and not self.planner.read(self.keys.decision(plan.epoch, plan.outer_step, plan.attempt)):
                self.m.epoch = plan.epoch
                self.m.forming = False
                return plan
            if plan is not None and self.clock() >= look:
                look = self.clock() + 1.0
                self.ended_without_me(plan)
            if self.clock() > deadline:
                raise MeshError(f"node {self.node_id}: not admitted within mesh.join_timeout "
                                f"({self.cfg.join_timeout:g}s); is any member of the run alive?")
            self.polling.idle(what)

    def ended_without_me(self, plan: Plan) -> None:
        """Raise Stopped("ended") when every member of the run's latest plan has left it completed: nobody
        will admit this node, which would otherwise wait out mesh.join_timeout and fail (a node left out of the
        last rounds). A member that drained or failed may be restarted: the node waits on for it."""
        others = [m for m in plan.members if m != self.node_id]  # it may be in the plan it stepped out of
        states = self.planner.states_now(others) if others else {}  # a pruned member: None, never waited for
        if states and all(st is not None and st.state == NodeState.LEFT and st.reason == "completed"
                          for st in states.values()):
            mine = f" of outer step {self.m.plan.outer_step}" if self.m.plan else ""
            why = (f"the run completed at outer step {plan.outer_step} ({', '.join(others)} left it) while "
                   f"node {self.node_id} waited to join: it ends with its own weights{mine}, not the run's final "
                   f"model (that is on the nodes that finished)")
            self.emit("warning", message=why)
            raise Stopped("ended", "waiting for admission")

    def await_link(self) -> None:
        """A node that stepped out stays in standby until its heartbeat ticks are on time again (bounded by
        mesh.join_timeout; then it asks to join anyway), so that it is not admitted over the link that made it
        step out: a joiner takes part in the next collective and receives the state. A joiner that missed its state
        also waits for a plan past the one that admitted it (Mesh.step_out)."""
        what = "waiting for its link to recover (stepped out)"
        deadline = self.clock() + self.cfg.join_timeout
        while not (self.heartbeat.link_healthy() and self.planned_past(self.rejoin_after)) \
                and self.clock() < deadline:
            self.polling.idle(what)
        self.stepped_out, self.rejoin_after = None, None

    def planned_past(self, point: tuple[int, int] | None) -> bool:
        """Whether the run has a plan later than (epoch, outer step) (or no plan at all: the store restarted)."""
        if point is None:
            return True
        latest = self.planner.latest()[1]
        return latest is None or (latest.epoch, latest.outer_step) > point
