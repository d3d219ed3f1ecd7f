"""DiLoCo end to end: a real `python -m engine.store` and real `python -m engine.train configs/debug-diloco.toml`
nodes (plain processes, or torchrun with 2 FSDP workers), a tiny model and short timeouts (heartbeat 0.2 s,
timeout 1.5 s). The oracle is the telemetry: every node's "outer_step" events carry a checksum of all its
parameters, which must be identical on every node for every outer step, joiners included.

Three runs, each asserted from several angles:
    three_nodes   a, b, c train; d joins mid-run; x (another H) is rejected; c is SIGKILLed; a, b, d finish
    leader_drain  a, b, c train; the leader is SIGKILLed; then one survivor drains (SIGUSR1); the last finishes
    fsdp          2 nodes x 2 FSDP workers (torchrun): per-shard exchange, identical checksums
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import defaultdict

import pytest

from procs import engine_env, free_port

HB, HB_TIMEOUT = 0.2, 1.5
H = 3
# tiny and fast: 2 sequences of 32 tokens per step; generous store waits (a loaded CI machine), short heartbeats
FAST = ["--train.micro_batch_size=2", "--train.batch_size=2", "--data.seq_len=32", "--train.eval_interval=0",
        "--train.log_interval=1", "--telemetry.human=false", "--telemetry.resource_interval=60",
        f"--diloco.inner_steps={H}", "--diloco.allreduce_timeout=10", "--diloco.compression=int8",
        f"--mesh.heartbeat_interval={HB}", f"--mesh.heartbeat_timeout={HB_TIMEOUT}", "--mesh.store_timeout=20",
        "--mesh.start_timeout=60", "--mesh.join_timeout=60", "--mesh.polling_interval=0.05"]
CONFIG = "configs/debug-diloco.toml"


class Node:
    """A started engine (or store) process; a thread collects its JSON events, another its stderr."""

    def __init__(self, procs, name: str, args: list[str]) -> None:
        self.name = name
        self.proc = procs.start(args, env=engine_env())
        self.events: list[dict] = []
        self.err = ""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err += line

    def of(self, type_: str) -> list[dict]:
        return [e for e in self.events if e["type"] == type_]

    def outer(self) -> dict[int, dict]:
        return {e["outer_step"]: e for e in self.of("outer_step")}

    def last_step(self) -> int:
        steps = self.of("step")
        return steps[-1]["step"] if steps else 0

    def report(self) -> str:
        keep = [e for e in self.events if e["type"] not in ("heartbeat", "resource", "step")]
        return f"--- {self.name} rc={self.proc.poll()}\n{self.err[-2500:]}\n" + "\n".join(
            json.dumps(e) for e in keep[-25:])


def wait_for(pred, timeout: float, what: str, nodes) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n" +
                                 "\n".join(n.report() for n in nodes))
        time.sleep(0.05)


def start_store(procs, port: int) -> Node:
    store = Node(procs, "store", [sys.executable, "-m", "engine.store", "--host", "127.0.0.1", "--port", str(port)])
    wait_for(lambda: any(e.get("state") == "ready" for e in store.events), 60, "the store", [store])
    return store


# Imports take most of an engine's start-up (~20 s on a loaded 2-core machine). A node that must join at a chosen
# moment is started early with this launcher: it imports the engine, waits for its go-file, then runs main().
PRIMED = """import os, sys, time
import engine.train
print("primed", file=sys.stderr, flush=True)
go, deadline = sys.argv[1], time.monotonic() + 600
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.argv = ["engine.train"] + sys.argv[2:]
engine.train.cli()
"""


def start_node(procs, port: int, name: str, run_dir, *extra: str, workers: int = 1, go=None) -> Node:
    args = [CONFIG, *FAST, f"--mesh.store_port={port}", f"--mesh.node_id={name}", f"--run.dir={run_dir / name}",
            *extra]
    if go is not None:
        return Node(procs, name, [sys.executable, "-c", PRIMED, str(go), *args])
    if workers == 1:
        return Node(procs, name, [sys.executable, "-m", "engine.train", *args])
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={workers}",
                f"--master_port={free_port()}", "--master_addr=127.0.0.1", "-m", "engine.train"]
    return Node(procs, name, launcher + args)


def finish(node: Node, timeout: float, nodes) -> int:
    try:
        return node.proc.wait(timeout=timeout)
    except Exception:
        raise AssertionError(f"{node.name} did not finish in {timeout}s\n" + "\n".join(n.report() for n in nodes))


def checksums_agree(nodes: list[Node]) -> dict[int, set[str]]:
    """outer step -> the set of checksums the nodes reported for it (one element when they agree)."""
    seen: dict[int, set[str]] = defaultdict(set)
    for n in nodes:
        for k, e in n.outer().items():
            seen[k].add(e["checksum"])
    return seen


def assert_identical(nodes: list[Node]) -> None:
    seen = checksums_agree(nodes)
    bad = {k: v for k, v in seen.items() if len(v) != 1}
    assert seen and not bad, f"checksums differ at outer steps {bad}\n" + "\n".join(n.report() for n in nodes)


def primed(node: Node) -> None:
    """Wait until a primed node has imported the engine and sleeps on its go-file."""
    wait_for(lambda: "primed\n" in node.err, 120, f"{node.name} primed", [node])


def kill(node: Node) -> None:
    os.killpg(node.proc.pid, signal.SIGKILL)
    node.proc.wait(timeout=10)


# ------------------------------------------------------------------------------------------ run 1: three nodes

@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """a, b, c (min_nodes 3, 45 steps = 15 outer steps). After outer step 2: d joins, x with H=4 is rejected
    (both started early and primed, so that they arrive mid-run). Two outer steps after d's admission a follower
    (c, or b if c leads) is SIGKILLed inside its inner round."""
    from procs import ProcessTracker
    procs, port, run_dir = ProcessTracker(), free_port(), tmp_path_factory.mktemp("three")
    try:
        start_store(procs, port)
        steps = ["--train.max_steps=45", "--diloco.min_nodes=3"]
        go = run_dir / "go"
        d = start_node(procs, port, "d", run_dir, *steps, go=go)
        x = start_node(procs, port, "x", run_dir, *steps, "--diloco.inner_steps=4", go=go)
        a, b, c = (start_node(procs, port, n, run_dir, *steps) for n in "abc")
        nodes = [a, b, c, d, x]
        primed(d)
        primed(x)
        wait_for(lambda: 2 in a.outer(), 180, "outer step 2", nodes)
        go.touch()
        wait_for(lambda: d.outer(), 120, "d admitted", nodes)
        # a follower dies between outer steps (inside an inner step), after d is a member
        leader = [e for e in a.of("membership") if e["change"] == "leader"][-1]["subject"]
        victim = c if leader != "c" else b
        after = min(d.outer()) + 2
        wait_for(lambda: max(victim.outer(), default=0) >= after and victim.last_step() > after * H, 120,
                 "the follower two outer steps past the join", nodes)
        killed = max(victim.outer())
        kill(victim)
        survivors = [n for n in (a, b, c, d) if n is not victim]
        codes = {n.name: finish(n, 180, nodes) for n in (*survivors, x)}
        yield {"a": a, "b": b, "c": c, "d": d, "x": x, "codes": codes, "killed_after": killed, "victim": victim,
               "survivors": survivors}
    finally:
        procs.kill_all()


def test_three_nodes_identical_checksums_after_every_outer_step(three_nodes):
    a, b, c, d = (three_nodes[n] for n in "abcd")
    assert all(three_nodes["codes"][n.name] == 0 for n in three_nodes["survivors"])
    assert sorted(a.outer()) == list(range(1, 16))  # 45 steps / H=3
    assert_identical([a, b, c, d])
    first = a.outer()[1]
    assert first["members"] == ["a", "b", "c"] and first["bytes_sent"] > 0 and first["pgrad_norm"] > 0
    assert a.of("run_end")[-1]["status"] == "completed"


def test_joiner_mid_run_receives_state_and_matches(three_nodes):
    a, d = three_nodes["a"], three_nodes["d"]
    assert three_nodes["codes"]["d"] == 0, d.report()
    joined = min(d.outer())
    assert joined >= 3  # admitted at a boundary after it started, not at the beginning
    assert d.outer()[joined]["checksum"] == a.outer()[joined]["checksum"]
    assert "d" in a.outer()[joined]["members"]
    assert d.of("run_end")[-1]["step"] == 45  # took over the progress (step counter) and trained on to the end
    assert sorted(d.outer()) == list(range(joined, 16))
    assert any(e["state"] == "joining" for e in d.of("state"))
    assert any(e["change"] == "joined" and e["subject"] == "d" for e in a.of("membership"))


def test_config_mismatch_rejected_without_disturbing_the_run(three_nodes):
    a, x = three_nodes["a"], three_nodes["x"]
    assert three_nodes["codes"]["x"] != 0
    assert "digest" in x.err and "inner_steps" in x.err, x.report()
    assert not x.of("outer_step")
    assert all("x" not in e["members"] for e in a.of("outer_step"))
    assert not any("x" in json.dumps(e) for e in a.of("warning"))


def test_follower_sigkill_survivors_redo_without_it_and_finish(three_nodes):
    survivors, victim = three_nodes["survivors"], three_nodes["victim"]
    after = three_nodes["killed_after"] + 1
    names = sorted(n.name for n in survivors)
    for n in survivors:
        assert n.outer()[after]["members"] == names, n.report()
        assert n.of("run_end")[-1]["status"] == "completed" and max(n.outer()) == 15
    assert any(e["change"] == "dead" and e["subject"] == victim.name for e in survivors[0].of("membership"))
    assert_identical(survivors)


# ------------------------------------------------------------------------------------------ run 2: leader + drain

@pytest.fixture(scope="module")
def leader_drain(tmp_path_factory):
    """a, b, c with 30 steps (10 outer steps). After outer step 2 the leader is SIGKILLed; after the survivors'
    outer step 4 one of them gets SIGUSR1 and drains; the other finishes alone."""
    from procs import ProcessTracker
    procs, port, run_dir = ProcessTracker(), free_port(), tmp_path_factory.mktemp("leader")
    try:
        start_store(procs, port)
        steps = ["--train.max_steps=30", "--diloco.min_nodes=3"]
        nodes = [start_node(procs, port, n, run_dir, *steps) for n in "abc"]
        by_name = {n.name: n for n in nodes}
        wait_for(lambda: all(2 in n.outer() for n in nodes), 180, "outer step 2 everywhere", nodes)
        leader_name = [e for e in nodes[0].of("membership") if e["change"] == "leader"][-1]["subject"]
        leader = by_name.pop(leader_name)
        killed_at = time.time()
        kill(leader)
        survivors = sorted(by_name.values(), key=lambda n: n.name)
        wait_for(lambda: all(4 in n.outer() for n in survivors), 120, "outer step 4 after the kill", nodes)
        drainer, stayer = survivors
        os.kill(drainer.proc.pid, signal.SIGUSR1)
        codes = {n.name: finish(n, 180, nodes) for n in survivors}
        yield {"leader": leader, "drainer": drainer, "stayer": stayer, "codes": codes, "killed_at": killed_at}
    finally:
        procs.kill_all()


def test_leader_sigkill_survivors_take_over_and_stay_identical(leader_drain):
    drainer, stayer, leader = leader_drain["drainer"], leader_drain["stayer"], leader_drain["leader"]
    takeover = [e for e in stayer.of("membership") if e["change"] == "leader" and e["ts"] > leader_drain["killed_at"]]
    assert takeover and takeover[0]["subject"] != leader.name
    assert_identical([drainer, stayer, leader])
    firsts = [e for e in stayer.of("outer_step") if e["ts"] > leader_drain["killed_at"]]
    assert firsts and leader.name not in firsts[0]["members"]


def test_drain_contributes_last_round_then_exits_zero(leader_drain):
    drainer, stayer = leader_drain["drainer"], leader_drain["stayer"]
    assert leader_drain["codes"][drainer.name] == 0, drainer.report()
    drained = drainer.of("drained")
    assert len(drained) == 1 and drainer.of("run_end")[-1]["status"] == "drained"
    last = drained[0]["outer_step"]
    # its last round counted: the outer step it drained at lists it as a member, and the others agree on it
    assert drainer.name in stayer.outer()[last]["members"]
    assert stayer.outer()[last]["checksum"] == drainer.outer()[last]["checksum"]
    assert stayer.outer()[last + 1]["members"] == [stayer.name]
    assert stayer.outer()[last + 1]["outer_step"] == last + 1 and leader_drain["codes"][stayer.name] == 0
    assert stayer.of("run_end")[-1]["status"] == "completed" and max(stayer.outer()) == 10


# ------------------------------------------------------------------------------------------ run 3: FSDP

def test_two_nodes_of_two_fsdp_workers_identical_checksums(procs, tmp_path):
    port = free_port()
    start_store(procs, port)
    steps = ["--train.max_steps=9", "--diloco.min_nodes=2", "--inner.strategy=fsdp", "--train.batch_size=4"]
    nodes = [start_node(procs, port, n, tmp_path, *steps, workers=2) for n in "ab"]
    for n in nodes:
        assert finish(n, 240, nodes) == 0, n.report()
    assert_identical(nodes)
    assert sorted(nodes[0].outer()) == [1, 2, 3]
    # bytes of both local ranks (each sends its own shard): int8 sends ~2 bytes per parameter in all
    assert nodes[0].outer()[1]["bytes_sent"] == nodes[1].outer()[1]["bytes_sent"] > 0
