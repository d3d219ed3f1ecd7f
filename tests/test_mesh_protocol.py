"""The membership protocol without processes: pure rules, then whole nodes over an in-memory store and a fake
clock. One thread drives every node through the non-blocking steps (arrive, poll_plan, poll_decision); each fake
sleep beats the hearts of the nodes that are "alive", so deaths are simply nodes that stop beating."""

from __future__ import annotations

import pytest

from engine.config import MeshConfig
from engine.mesh import (ABORT, COMMIT, Arrival, BoundaryView, Excluded, Liveness, MemoryStore, Mesh, MeshError,
                         Plan, compute_plan, decide)
from engine.telemetry import make_event

CFG = MeshConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5, store_timeout=3.0, start_timeout=5.0,
                 join_timeout=10.0, polling_interval=0.1)


# ---- pure rules -----------------------------------------------------------------------------------------------

def test_liveness_counts_silence_on_the_observers_clock():
    live = Liveness(timeout=1.5)
    live.observe("a", 7, now=100.0)
    assert not live.is_dead("a", 101.4) and not live.moved("a")  # first sight: a full timeout of grace
    live.observe("a", 7, now=101.4)
    assert live.is_dead("a", 101.6)
    live.observe("a", 8, now=101.7)  # the counter moved again: alive, age restarts
    assert live.moved("a") and not live.is_dead("a", 103.1) and live.age("a", 102.2) == pytest.approx(0.5)
    live.observe("a", 8, now=102.0, gone=True)  # bye: dead at once
    assert live.is_dead("a", 102.0)
    assert not live.is_dead("never-seen", 1e9)


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
    with pytest.raises(Excluded):
        plan.rank_of("z")


# ---- whole nodes over a MemoryStore -----------------------------------------------------------------------------

class Sim:
    """A fake clock whose sleeps beat every live node's heart."""

    def __init__(self) -> None:
        self.t = 1000.0
        self.store = MemoryStore()
        self.nodes: dict[str, Mesh] = {}
        self.alive: set[str] = set()
        self.events: list[dict] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt
        for name in sorted(self.alive):
            self.nodes[name].tick()

    def advance(self, seconds: float) -> None:
        for _ in range(round(seconds / CFG.heartbeat_interval)):
            self.sleep(CFG.heartbeat_interval)

    def node(self, name: str, *, digest: str = "d1", min_nodes: int = 1, key: str | None = None) -> Mesh:
        def emit(type_: str, **fields) -> None:
            self.events.append(make_event(type_, name, 0, **fields))  # validates the telemetry schema
        mesh = Mesh(self.store, name, CFG, digest=digest, info={"host": "h", "pid": 1}, min_nodes=min_nodes,
                    emit=emit, clock=self.clock, sleep=self.sleep, heartbeat_thread=False)
        self.nodes[key or name] = mesh
        return mesh

    def start(self, *names: str, **kw) -> list[bool]:
        out = []
        for name in names:
            mesh = self.node(name, **kw)
            out.append(mesh.start())
            self.alive.add(name)
        self.advance(0.2)
        return out

    def kill(self, name: str) -> None:
        self.alive.discard(name)

    def leader(self) -> str:
        leaders = [n for n in self.alive if self.nodes[n].is_leader]
        assert len(leaders) == 1, leaders
        return leaders[0]

    def boundary(self, k: int, a: int, names, **flags) -> dict[str, Plan]:
        """Every named node arrives, then all poll (leader first) until each has a plan, like boundary()."""
        for n in names:
            self.nodes[n].arrive(k, a, **flags.get(n, {}))
        plans: dict[str, Plan] = {}
        for _ in range(200):
            for n in sorted(names, key=lambda n: not self.nodes[n].is_leader):
                if n not in plans:
                    plan = self.nodes[n].poll_plan(k, a)
                    if plan is not None:
                        plans[n] = plan
            if len(plans) == len(names):
                return plans
            self.sleep(CFG.polling_interval)
        raise AssertionError(f"no plan for {names} at ({k}, {a})")

    def commit(self, plan: Plan, results: dict[str, bool]) -> dict[str, str]:
        k = self.store
        for n, ok in results.items():
            k.set(self.nodes[n].keys.ok(plan.epoch, plan.outer_step, plan.attempt, n), "ok" if ok else "fail")
        out: dict[str, str] = {}
        for _ in range(100):
            for n in results:
                d = out.get(n) or self.nodes[n].poll_decision(plan)
                if d:
                    out[n] = d
            if len(out) == len(results):
                return out
            self.sleep(CFG.polling_interval)
        raise AssertionError("no decision")

    def changes(self, change: str) -> set[tuple[str, str]]:
        return {(e["node"], e["subject"]) for e in self.events if e["type"] == "membership" and e["change"] == change}


def _post_all_ok(sim: Sim, plan: Plan, names) -> None:
    """Every node posts before any blocks in commit() (one thread plays them all)."""
    for n in names:
        sim.store.set(sim.nodes[n].keys.ok(plan.epoch, plan.outer_step, plan.attempt, n), "ok")


def _run_committed(sim: Sim, k: int, names, **flags) -> Plan:
    plans = sim.boundary(k, 0, names, **flags)
    plan = plans[names[0]]
    assert all(p == plan for p in plans.values())
    _post_all_ok(sim, plan, names)
    for n in names:
        assert sim.nodes[n].commit(plan, True) is True
    return plan


def test_formation_one_leader_one_plan_and_commit():
    sim = Sim()
    assert sim.start("a", "b", "c") == [False, False, False]
    assert sim.leader() == "a"
    plan = _run_committed(sim, 0, ["a", "b", "c"])
    assert plan.members == ("a", "b", "c") and plan.generation == 1 and plan.epoch == 0
    assert {n: sim.nodes[n].state for n in "abc"} == dict.fromkeys("abc", "training")
    beats = [e for e in sim.events if e["type"] == "heartbeat" and e["node"] == "a"]
    assert set(beats[-1]["peers"]) == {"b", "c"} and max(beats[-1]["peers"].values()) < CFG.heartbeat_timeout


def test_dead_follower_is_evicted_and_its_missing_vote_aborts():
    sim = Sim()
    sim.start("a", "b", "c")
    _run_committed(sim, 0, ["a", "b", "c"])
    plan = sim.boundary(1, 0, ["a", "b", "c"])["a"]
    sim.kill("c")  # dies inside the all-reduce, before posting
    t0 = sim.t
    assert sim.commit(plan, {"a": True, "b": True}) == {"a": ABORT, "b": ABORT}
    assert sim.t - t0 <= CFG.heartbeat_timeout + 2 * CFG.heartbeat_interval
    retry = sim.boundary(1, 1, ["a", "b"])["a"]
    assert retry.members == ("a", "b") and retry.generation == plan.generation + 1
    assert ("a", "c") in sim.changes("dead")


def test_one_failed_allreduce_aborts_everyone():
    sim = Sim()
    sim.start("a", "b")
    plan = sim.boundary(0, 0, ["a", "b"])["a"]
    assert sim.commit(plan, {"a": True, "b": False}) == {"a": ABORT, "b": ABORT}


def test_leader_death_hands_the_lease_over_within_a_timeout_and_the_run_goes_on():
    sim = Sim()
    sim.start("a", "b", "c")
    first = _run_committed(sim, 0, ["a", "b", "c"])
    sim.kill("a")
    t0 = sim.t
    while not any(sim.nodes[n].is_leader for n in ("b", "c")):
        sim.sleep(CFG.heartbeat_interval)
        assert sim.t - t0 <= CFG.heartbeat_timeout + 2 * CFG.heartbeat_interval
    assert sim.leader() in ("b", "c")
    plan = _run_committed(sim, 1, ["b", "c"])
    assert plan.members == ("b", "c") and plan.generation == first.generation + 1
    assert sim.changes("leader") >= {("b", sim.leader()), ("c", sim.leader())}


def test_drained_node_contributes_then_leaves_without_a_heartbeat_wait():
    sim = Sim()
    sim.start("a", "b", "c")
    _run_committed(sim, 0, ["a", "b", "c"])
    plan = _run_committed(sim, 1, ["a", "b", "c"], b={"draining": True})
    assert plan.leaving == ("b",) and "b" in plan.contributors and sim.nodes["b"].state == "draining"
    sim.nodes["b"].leave("drained")
    sim.kill("b")
    t0 = sim.t
    nxt = sim.boundary(2, 0, ["a", "c"])["a"]
    assert nxt.members == ("a", "c") and sim.t - t0 < 0.5  # no heartbeat timeout waited
    assert ("a", "b") in sim.changes("drained") and sim.nodes["b"].state == "left"


def test_straggler_is_excluded_and_rejoins_as_a_joiner():
    sim = Sim()
    sim.start("a", "b", "c")
    _run_committed(sim, 0, ["a", "b", "c"])
    for n in ("a", "b"):
        sim.nodes[n].arrive(1, 0)
    plan = None
    while plan is None:  # c keeps beating but does not arrive: planned without it after store_timeout
        plan = sim.nodes["a"].poll_plan(1, 0)
        sim.sleep(CFG.polling_interval)
    assert plan.members == ("a", "b") and sim.t - 1000 > CFG.store_timeout
    sim.nodes["c"].arrive(1, 0)
    with pytest.raises(Excluded, match="re-join"):
        sim.nodes["c"].poll_plan(1, 0)
    _post_all_ok(sim, plan, "ab")
    for n in ("a", "b"):
        sim.nodes[n].commit(plan, True)
    sim.store.set(sim.nodes["c"].keys.join("c"), "1")  # what wait_admission() posts first
    sim.nodes["c"]._set_state("joining")
    admitted = sim.boundary(2, 0, ["a", "b"])["a"]
    assert admitted.members == ("a", "b", "c") and admitted.joiners == ("c",) and admitted.source == "a"
    assert sim.nodes["c"].wait_admission() == admitted
    _post_all_ok(sim, admitted, "abc")
    assert all(sim.nodes[n].commit(admitted, True) for n in "abc")
    assert sim.nodes["c"].state == "training"
    again = sim.boundary(3, 0, ["a", "b", "c"])["a"]
    assert again.joiners == () and again.generation == admitted.generation  # same group: no rebuild


def test_joiner_stays_a_joiner_across_an_aborted_attempt():
    sim = Sim()
    sim.start("a", "b")
    _run_committed(sim, 0, ["a", "b"])
    assert sim.start("j") == [True]
    sim.store.set(sim.nodes["j"].keys.join("j"), "1")
    sim.nodes["j"]._set_state("joining")
    plan = sim.boundary(1, 0, ["a", "b"])["a"]
    assert plan.joiners == ("j",)
    assert sim.commit(plan, {"a": True, "b": True, "j": False})["a"] == ABORT
    retry = sim.boundary(1, 1, ["a", "b", "j"])["a"]
    assert retry.joiners == ("j",) and retry.generation == plan.generation + 1


def test_duplicate_live_id_is_rejected_without_disturbing_the_run():
    sim = Sim()
    sim.start("a", "b")
    plan = _run_committed(sim, 0, ["a", "b"])
    intruder = sim.node("b", key="b2")
    with pytest.raises(MeshError, match="'b' is in use by a live node"):
        intruder.start()
    assert sim.t - 1000 < CFG.heartbeat_timeout + 1
    assert ("b", "b") in sim.changes("rejected")
    assert _run_committed(sim, 1, ["a", "b"]).members == plan.members


def test_restart_with_a_dead_nodes_id_rejoins_as_a_joiner():
    sim = Sim()
    sim.start("a", "b")
    _run_committed(sim, 0, ["a", "b"])
    sim.kill("b")
    assert sim.start("b") == [True]  # the old b is silent: its id is taken over, and the run is alive
    assert sim.nodes["b"].state == "joining"


def test_a_node_declared_dead_that_wakes_up_stops_beating_under_its_taken_id():
    sim = Sim()
    sim.start("a", "b")
    _run_committed(sim, 0, ["a", "b"])
    old_b = sim.nodes["b"]
    sim.kill("b")  # stopped (SIGSTOP, swapped out), not gone
    sim.start("b")
    with pytest.raises(MeshError, match="node b was declared dead and a newer process"):
        old_b.tick()


def test_digest_mismatch_is_rejected():
    sim = Sim()
    sim.start("a")
    with pytest.raises(MeshError, match="digest d2 differs from the run's d1"):
        sim.node("x", digest="d2").start()


def test_run_reforms_in_a_new_epoch_when_every_member_is_gone():
    sim = Sim()
    sim.start("a", "b")
    old = _run_committed(sim, 0, ["a", "b"])
    for n in ("a", "b"):
        sim.nodes[n].leave("completed")
        sim.kill(n)
    assert sim.start("a") == [False]  # resumes: forms a new life of the run, not a joiner
    plan = sim.boundary(1, 0, ["a"])["a"]
    assert plan.members == ("a",) and plan.epoch == old.generation and plan.generation == old.generation + 1


def test_old_boundary_keys_are_collected():
    sim = Sim()
    sim.start("a", "b")
    for k in range(6):
        _run_committed(sim, k, ["a", "b"])
    steps = {key.split("/")[4] for key in sim.store.keys() if key.startswith("zb/r/0/")}
    assert steps == {"3", "4", "5"}  # the last KEEP_STEPS outer steps only


def test_lost_store_is_one_clear_error():
    sim = Sim()
    sim.start("a")
    sim.store.down = True
    with pytest.raises(MeshError, match="node a: outer step 0 attempt 0: lost the membership store"):
        sim.nodes["a"].boundary(0, 0)
