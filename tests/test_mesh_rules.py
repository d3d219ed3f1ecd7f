"""The membership protocol's pure rules: liveness on the observer's clock, the decision, the plans (who is awaited,
admitted, dropped), as functions of what the store holds (engine/mesh/protocol.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.mesh import (ABORT, COMMIT, Arrival, BoundaryView, Excluded, Liveness, MeshError, Plan, compute_plan,
                         decide)


# ---- pure rules -----------------------------------------------------------------------------------------------

def test_liveness_counts_silence_on_the_observers_clock():
    live = Liveness(timeout=1.5, slack=1.5)  # sparse looks here count in full (see the blind-spell test)

    def see(counter: int, now: float, **kw) -> None:
        live.look(now)
        live.observe("a", counter, now, **kw)
    see(7, now=100.0)
    assert not live.is_dead("a", 101.4) and not live.moved("a")  # first sight: a full timeout of grace
    see(7, now=101.4)
    assert live.is_dead("a", 101.6)
    see(8, now=101.7)  # the counter moved again: alive, age restarts
    assert live.moved("a") and not live.is_dead("a", 103.1) and live.age("a", 102.2) == pytest.approx(0.5)
    see(8, now=102.0, gone=True)  # left: dead at once
    assert live.is_dead("a", 102.0)
    assert not live.is_dead("never-seen", 1e9)
    live.look(200.0)
    live.observe("b", 3, now=200.0)
    live.look(200.5)
    live.expire("b", now=200.5)  # its leased heartbeat key vanished (etcd): dead at once, but not a clean exit
    assert live.is_dead("b", 200.5) and not live.is_gone("b")
    live.look(201.0)
    live.observe("b", 1, now=201.0)  # the key written again (the process woke up): alive
    assert not live.is_dead("b", 201.0)
    live.expire("c", now=202.0)  # never seen, already gone from the store: dead, and prunable from now on
    assert live.is_dead("c", 202.0) and live.silent_for("c", 204.0) == pytest.approx(0.5)


def test_a_stale_observer_declares_no_one_dead_and_regrants_grace():
    """An observer frozen for 2x the timeout must not judge from its old table (it would plan healthy nodes out)."""
    live = Liveness(timeout=1.5, slack=1.5)  # sparse looks here count in full (see the blind-spell test)
    live.look(100.0)
    live.observe("a", 7, 100.0)
    assert not live.is_dead("a", 103.0)  # 3 s since the observer last looked: its table says nothing
    assert live.look(103.0) is False  # the look after the blind spell
    live.observe("a", 7, 103.0)  # a's counter may not have moved in the observer's poll yet
    live.look(104.0)
    live.observe("a", 7, 104.0)
    assert not live.is_dead("a", 104.4) and live.is_dead("a", 104.6)  # a fresh timeout of grace from 103.0


def test_a_blind_spell_shorter_than_the_timeout_is_not_counted_against_the_peers():
    """An etcd leader election: every node's writes fail for a few seconds. The observer's first tick that gets
    through sees the peers' counters unchanged since before the election (their writes are still in a retry
    pause); counting its own blind spell as their silence, it called both peers dead (the leader-kill e2e test,
    2 of 16 runs). Their silence is counted on the time it watched; a peer that stays silent is still dead."""
    live = Liveness(timeout=4.0, slack=1.5)

    def see(counter: int, now: float) -> None:
        live.look(now)
        live.observe("a", counter, now)
    see(1, 100.0)
    see(2, 100.5)  # the last beat before the election
    see(2, 101.0)
    see(2, 104.4)  # 3.4 s blind (under the timeout): a's counter has not moved yet
    assert not live.is_dead("a", 104.4)
    see(2, 104.9)
    assert not live.is_dead("a", 104.9) and live.age("a", 104.9) == pytest.approx(2.5)  # 4.4 - 1.9 blind
    see(2, 106.2)  # looks within the slack again: every second of silence counts
    assert not live.is_dead("a", 106.2)
    see(2, 106.7)
    assert live.is_dead("a", 106.7)  # 4.3 s of watched silence: a stays silent, it is dead
    calm = Liveness(timeout=4.0, slack=1.5)  # looks within the slack: every second counts, as before
    for t, counter in ((100.0, 7), (100.5, 8)):
        calm.look(t)
        calm.observe("a", counter, t)
    for t in (101.5, 102.9, 104.3):
        calm.look(t)
        calm.observe("a", 8, t)
    assert calm.is_dead("a", 104.6) and not calm.is_dead("a", 104.4)


@pytest.mark.parametrize("grace", [0.5, 2.0])
def test_time_rounds_wait_for_a_member_until_the_plans_deadline_plus_the_grace_not_after(grace):
    """diloco.straggler_grace on both sides of its bound, against the deadline the last plan carries: written by
    b, whose clock ran 3.75 s behind a's, where a would have put it at 1010 (its own clock plus a round). At 10 ms
    before deadline + grace a still waits; at 10 ms after it plans without the latecomer. Never for a retry of that
    plan's own outer step (its deadline is the next round's), nor for a plan of another epoch."""
    from types import SimpleNamespace

    from engine.mesh.planner import Planner
    from engine.mesh.protocol import Keys
    now = [0.0]
    planner = Planner(SimpleNamespace(epoch=3), "a", Keys(), min_nodes=1, clock=lambda: now[0], round_seconds=10.0,
                      grace=grace, wall=lambda: now[0])
    latest = Plan(5, 7, 0, ("a", "b", "c"), (), "b", (), ("a", "b", "c"), epoch=3, deadline=1006.25)
    for offset, past in ((-0.01, False), (0.01, True)):
        now[0] = 1006.25 + grace + offset
        assert planner.past_grace(latest, 8) is past, (grace, offset)
    assert not planner.past_grace(latest, 7) and not planner.past_grace(replace(latest, epoch=2), 8)


def test_decision_rule():
    m = ["a", "b", "c"]
    assert decide(m, {"a": True, "b": True}, dead=[]) is None
    assert decide(m, {"a": True, "b": True, "c": True}, dead=[]) == COMMIT
    assert decide(m, {"a": True, "b": False}, dead=[]) == ABORT  # one fail: abort at once
    assert decide(m, {"a": True, "b": True}, dead=["c"]) == ABORT  # dead before posting
    assert decide(m, {"a": True, "b": True, "c": True}, dead=["c"]) == COMMIT  # posted ok, then died: it counted


def _prev(members, gen=3, k=4, a=0, joiners=(), leaving=()):
    return Plan(generation=gen, outer_step=k, attempt=a, members=tuple(members), joiners=tuple(joiners),
                source=members[0], leaving=tuple(leaving), contributors=tuple(members))


def test_a_re_formation_makes_a_node_with_no_round_to_give_a_joiner_of_a_node_that_has_one():
    """A joiner whose admission a store restart voided arrives at the re-formation with no state of the run. It
    was a member there, and the source when its id sorted first: its stale weights became everyone's."""
    arrived = {"a": Arrival(outer_step=4, contributing=False), "b": Arrival(outer_step=4),
               "c": Arrival(outer_step=4)}
    plan = compute_plan(BoundaryView(epoch=1, outer_step=4, attempt=0, prev=None, prev_committed=False,
                                     arrived=arrived, min_nodes=2))
    assert (plan.members, plan.joiners, plan.source, plan.contributors) == (("a", "b", "c"), ("a",), "b", ("b", "c"))
    # nobody with a round (every node diverged): they stay members, as before
    alone = {n: Arrival(outer_step=4, contributing=False) for n in "ab"}
    plan = compute_plan(BoundaryView(epoch=1, outer_step=4, attempt=0, prev=None, prev_committed=False,
                                     arrived=alone, min_nodes=2))
    assert plan.joiners == () and plan.source == "a"


def test_plan_waits_for_every_live_member_then_drops_the_dead():
    prev = _prev(["a", "b", "c"])
    arrived = {"a": Arrival(), "b": Arrival()}
    base = dict(epoch=0, outer_step=5, attempt=0, prev=prev, prev_committed=True, arrived=arrived)
    assert compute_plan(BoundaryView(**base)) is None  # c is alive and not here yet
    plan = compute_plan(BoundaryView(**base, dead=frozenset({"c"})))
    assert plan.members == ("a", "b") and plan.generation == 4 and plan.source == "a"
    assert plan.rank_of("b") == 1 and plan.size == 2
    straggled = compute_plan(BoundaryView(**base, timed_out=True))  # c alive but late: planned without it
    assert straggled.members == ("a", "b")


def test_a_formation_plan_is_forming_until_an_attempt_of_it_commits():
    """plan.forming tells every member of a (re)formed run's first outer step to align its state on the source's
    after the commit (engine/outer/handoff.py): the formation's plan, its retries after an abort, and never a
    plan after a commit. It travels in the plan's JSON."""
    arrived = {"a": Arrival(outer_step=4), "b": Arrival(outer_step=4)}
    formed = compute_plan(BoundaryView(epoch=0, outer_step=4, attempt=0, prev=None, prev_committed=False,
                                       arrived=arrived, min_nodes=2))
    assert formed.forming and formed.members == ("a", "b")
    retry = compute_plan(BoundaryView(epoch=0, outer_step=4, attempt=1, prev=formed, prev_committed=False,
                                      arrived=arrived))
    assert retry.forming and retry.attempt == 1
    after = compute_plan(BoundaryView(epoch=0, outer_step=5, attempt=0, prev=retry, prev_committed=True,
                                      arrived=arrived))
    assert not after.forming
    assert not compute_plan(BoundaryView(epoch=0, outer_step=5, attempt=1, prev=after, prev_committed=False,
                                         arrived=arrived)).forming
    assert Plan.from_json(formed.to_json()) == formed and Plan.from_json(after.to_json()) == after


def test_plan_keeps_generation_when_membership_is_unchanged_and_bumps_it_on_retry():
    prev = _prev(["a", "b"])
    arrived = {"a": Arrival(), "b": Arrival(contributing=False)}
    same = compute_plan(BoundaryView(epoch=0, outer_step=5, attempt=0, prev=prev, prev_committed=True,
                                     arrived=arrived))
    assert same.generation == 3 and same.contributors == ("a",)
    retry = compute_plan(BoundaryView(epoch=0, outer_step=4, attempt=1, prev=prev, prev_committed=False,
                                      arrived=arrived))
    assert retry.generation == 4 and retry.attempt == 1


def test_plan_admits_joiners_and_drops_drained_at_once():
    prev = _prev(["a", "b", "c"], leaving=["c"])
    view = BoundaryView(epoch=0, outer_step=5, attempt=0, prev=prev, prev_committed=True,
                        arrived={"a": Arrival(), "b": Arrival(draining=True)}, joining=frozenset({"d"}))
    plan = compute_plan(view)  # c drained after the last commit: no wait for its heartbeat to stop
    assert plan.members == ("a", "b", "d") and plan.joiners == ("d",) and plan.leaving == ("b",)
    assert plan.source == "a" and plan.contributors == ("a", "b") and plan.generation == 4
    # the drained node's step was aborted: it is still expected (its work must not be lost)
    assert compute_plan(BoundaryView(epoch=0, outer_step=4, attempt=1, prev=prev, prev_committed=False,
                                     arrived={"a": Arrival(), "b": Arrival()})) is None


def test_a_member_that_restarted_and_asks_to_join_is_a_joiner_not_awaited_as_a_member():
    """b was a member of the last committed plan, left (a drain, a crash) and its new process asks to join. Before,
    every join request of a member of that plan was read as an admission by the commit: b was awaited as a member
    until the boundary timed out (a 30 s stall of the chaos lab's `drain` fault), and only then admitted."""
    prev = _prev(["a", "b", "c"], joiners=["c"])
    view = BoundaryView(epoch=0, outer_step=5, attempt=0, prev=prev, prev_committed=True,
                        arrived={"a": Arrival(), "c": Arrival()}, joining=frozenset({"b", "c"}))
    plan = compute_plan(view)  # c's state still says joining: the commit admitted it, it is a member now
    assert plan is not None and plan.members == ("a", "b", "c") and plan.joiners == ("b",)
    assert plan.contributors == ("a", "c") and plan.source == "a"
    # c, admitted by the commit, is awaited as a member like any other
    assert compute_plan(replace(view, arrived={"a": Arrival()})) is None
    # b's new process has not asked to join yet (starting): the step goes on without it, not after a timeout
    early = compute_plan(replace(view, joining=frozenset({"c"}), starting=frozenset({"b"})))
    assert early is not None and early.members == ("a", "c") and early.joiners == ()


def test_a_member_that_stepped_out_is_neither_awaited_nor_admitted():
    """c stepped out of the aborted attempt (its link is slow, state standby): the retry is planned without it at
    once, not after a wait for its arrival (the stall a lossy member caused), and c is not admitted meanwhile."""
    prev = _prev(["a", "b", "c"])
    view = BoundaryView(epoch=0, outer_step=4, attempt=1, prev=prev, prev_committed=False,
                        arrived={"a": Arrival(), "b": Arrival()}, standby=frozenset({"c"}))
    plan = compute_plan(view)
    assert plan is not None and plan.members == ("a", "b") and plan.joiners == () and plan.generation == 4
    assert compute_plan(replace(view, standby=frozenset())) is None  # a member still in the round: awaited


def test_formation_waits_for_min_nodes_and_fails_clearly_below_it():
    one = {"a": Arrival()}
    view = dict(epoch=0, outer_step=0, attempt=0, prev=None, prev_committed=False, min_nodes=2)
    assert compute_plan(BoundaryView(**view, arrived=one, starting=frozenset({"a"}))) is None
    with pytest.raises(MeshError, match="only 1 of diloco.min_nodes=2"):
        compute_plan(BoundaryView(**view, arrived=one, timed_out=True))
    # a registered starting node is waited for even when min_nodes is met
    two = {"a": Arrival(), "b": Arrival()}
    assert compute_plan(BoundaryView(**view, arrived=two, starting=frozenset({"a", "b", "c"}))) is None
    plan = compute_plan(BoundaryView(**view, arrived=two, starting=frozenset({"a", "b"}), base_generation=9))
    assert plan.members == ("a", "b") and plan.generation == 10


def test_plan_json_round_trip():
    plan = Plan(7, 3, 1, ("a", "b"), ("b",), "a", (), ("a",), epoch=2)
    assert Plan.from_json(plan.to_json()) == plan
    timed = Plan(7, 3, 1, ("a", "b"), ("b",), "a", (), ("a",), epoch=2, deadline=1234.5)
    assert Plan.from_json(timed.to_json()) == timed
    with pytest.raises(Excluded):
        plan.rank_of("z")
