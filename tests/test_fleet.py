"""The fleet model: numbers from events, malformed lines counted and skipped, state transitions."""

from __future__ import annotations

import time

import pytest

from console.fleet import Fleet, NodeState
from engine.telemetry import encode, make_event


def line(type_: str, node: str = "a", rank: int = 0, ts: float | None = None, **fields) -> str:
    return encode(make_event(type_, node, rank, ts=ts, **fields))


def step(n: int, loss: float, tps: float, node: str = "a", ts: float | None = None) -> str:
    return line("step", node, ts=ts, step=n, loss=loss, lr=1e-3, tokens_per_s=tps, grad_norm=None)


def start(node: str, pid: int = 100, max_steps: int = 100) -> str:
    return line("run_start", node, pid=pid, host="h", world_size=1, config_digest="x", strategy="ddp",
                max_steps=max_steps)


def test_ingest_numbers_and_summary():
    fleet = Fleet(run="demo")
    fleet.add_node("a", "h1")
    fleet.add_node("b", "h2")
    t0 = time.time() - 10
    for name in ("a", "b"):
        fleet.ingest(name, start(name, max_steps=100))
        fleet.ingest(name, line("state", name, state="training"))
    fleet.ingest("a", step(10, 3.0, 1000.0, ts=t0))
    fleet.ingest("a", step(20, 2.0, 1500.0, ts=t0 + 5))  # 10 steps in 5 s: 80 steps left -> 40 s
    fleet.ingest("b", step(12, 4.0, 500.0, "b", ts=t0 + 5).encode())  # bytes are accepted too
    fleet.ingest("a", line("resource", device="cpu", util=42.5, mem_used=10, mem_total=100))
    fleet.ingest("a", line("outer_step", outer_step=3, step=20, generation=2, members=["a", "b"],
                           pgrad_norm=0.1, bytes_sent=10, allreduce_s=0.1, checksum="c"))
    a = fleet.nodes["a"]
    assert (a.step, a.loss, a.tokens_per_s, a.outer_step, a.pid) == (20, 2.0, 1500.0, 3, 100)
    assert (a.device, a.util, a.mem_used, a.mem_total) == ("cpu", 42.5, 10, 100)
    assert list(a.loss_history) == [(t0, 3.0), (t0 + 5, 2.0)]
    assert [v for _, v in a.tps_history] == [1000.0, 1500.0]
    assert a.state is NodeState.TRAINING and a.malformed == 0
    s = fleet.summary()
    assert (s.run, s.members, s.outer_step, s.step, s.max_steps) == ("demo", 2, 3, 20, 100)
    assert s.tokens_per_s == 2000.0
    assert s.loss == pytest.approx(3.0)
    assert s.eta_s == pytest.approx(40.0)
    assert any("step     20 loss 2.0000" in text for text in a.log)  # log lines are plain strings
    assert all(isinstance(text, str) for text in a.log) and isinstance(a.log[-1], str)
    fleet.ingest("a", line("heartbeat", ts=time.time() - 12, seq=1, peers={"b": 0.5}))
    assert 11 < a.heartbeat_age < 30 and a.peers == {"b": 0.5}  # type: ignore[operator]


def test_malformed_lines_counted_and_skipped():
    fleet = Fleet()
    fleet.add_node("a", "h")
    bad = ["not json", "{", '{"v": 1, "type": "step"}', '{"v": 99, "type": "step"}', "[1, 2]", b"\xff\xfe",
           line("step", step=1, loss=1.0, lr=1.0, tokens_per_s=1.0, grad_norm=None).replace('"step":1', '"step":"1"')]
    v0 = fleet.version
    for text in bad:
        fleet.ingest("a", text)
    fleet.ingest("a", step(5, 1.5, 10.0))
    a = fleet.nodes["a"]
    assert a.malformed == len(bad)
    assert a.step == 5 and a.loss == 1.5  # the good line after the garbage still counts
    assert fleet.version > v0
    assert sum("malformed line" in text for text in a.log) == 3  # the first few are explained, not all


def test_state_transitions_engine_and_console_facts():
    fleet = Fleet()
    fleet.add_node("a", "h")
    assert fleet.nodes["a"].state is NodeState.STANDBY
    fleet.set_state("a", NodeState.STARTING)
    fleet.ingest("a", start("a"))
    for state in ("joining", "training", "draining"):
        fleet.ingest("a", line("state", state=state))
        assert fleet.nodes["a"].state.value == state
    fleet.ingest("a", line("drained", outer_step=4, step=20))
    fleet.ingest("a", line("run_end", status="drained", step=20))
    assert fleet.nodes["a"].state is NodeState.LEFT and fleet.nodes["a"].reason == "drained"

    # unreachable holds until any line arrives (the link is back), then the engine's own state shows again
    fleet.ingest("a", start("a", pid=200))
    fleet.ingest("a", line("state", state="training"))
    fleet.set_state("a", NodeState.UNREACHABLE, "ssh: keepalive timeout")
    assert (fleet.nodes["a"].state, fleet.nodes["a"].reason) == (NodeState.UNREACHABLE, "ssh: keepalive timeout")
    fleet.ingest("a", step(21, 1.0, 1.0))
    assert fleet.nodes["a"].state is NodeState.TRAINING and fleet.nodes["a"].reason is None
    fleet.set_state("a", NodeState.UNREACHABLE, "ssh: connection refused")
    fleet.set_reachable("a")  # reconnected, nothing new to read yet
    assert fleet.nodes["a"].state is NodeState.TRAINING and fleet.nodes["a"].reason is None

    # dead holds against the old process's late lines; a new process (run_start) settles it
    fleet.set_state("a", NodeState.DEAD, "killed (SIGKILL)")
    fleet.ingest("a", line("state", state="training"))
    assert fleet.nodes["a"].state is NodeState.DEAD
    fleet.ingest("a", start("a", pid=300))
    assert fleet.nodes["a"].state is NodeState.STARTING and fleet.nodes["a"].pid == 300
    console_facts = [e.change for e in fleet.timeline if e.source == "console"]
    assert console_facts == ["starting", "unreachable", "unreachable", "dead"]


def test_failed_run_end_keeps_the_error_as_reason():
    fleet = Fleet()
    fleet.ingest("a", start("a"))
    fleet.ingest("a", line("error", message="CUDA out of memory"))
    fleet.ingest("a", line("run_end", status="failed", step=3))
    assert (fleet.nodes["a"].state, fleet.nodes["a"].reason) == (NodeState.FAILED, "CUDA out of memory")


def test_membership_timeline_dedup_and_dead_peer():
    fleet = Fleet()
    for name in ("a", "b", "c"):
        fleet.add_node(name, "h", NodeState.STARTING)
        fleet.ingest(name, line("state", name, state="training"))
    # both survivors report c's death: one timeline entry, c is dead, members shrink
    for reporter in ("a", "b"):
        fleet.ingest(reporter, line("membership", reporter, change="dead", subject="c", generation=3,
                                    members=["a", "b"]))
    assert fleet.nodes["c"].state is NodeState.DEAD and "mesh" in fleet.nodes["c"].reason
    mesh_events = [e for e in fleet.timeline if e.source != "console"]
    assert [(e.change, e.subject, e.generation) for e in mesh_events] == [("dead", "c", 3)]
    assert fleet.summary().members == 2
    fleet.ingest("a", line("membership", change="joined", subject="d", generation=4, members=["a", "b", "d"]))
    assert [e.change for e in fleet.timeline if e.source != "console"] == ["dead", "joined"]
    assert fleet.members == ("a", "b", "d")
    assert fleet.summary().members == 3  # d is not a node of this fleet (yet): the mesh's word counts
    fleet.set_state("b", NodeState.DEAD, "killed")
    assert fleet.summary().members == 2  # the mesh has not said so yet, the console knows


def test_version_bumps_only_on_change():
    fleet = Fleet()
    v = fleet.version
    fleet.add_node("a", "h")
    assert fleet.version == v + 1
    fleet.add_node("a", "h")  # already there
    fleet.set_state("a", NodeState.STANDBY)  # same state, same reason
    assert fleet.version == v + 1
    fleet.ingest("a", step(1, 1.0, 1.0))
    assert fleet.version == v + 2


def test_unknown_node_is_created_and_bounded_history():
    fleet = Fleet()
    for i in range(2000):
        fleet.ingest("x", step(i, 1.0, 1.0))
    x = fleet.nodes["x"]
    assert x.host == "?" and x.step == 1999
    assert len(x.loss_history) == x.loss_history.maxlen and len(x.log) == x.log.maxlen
