"""DiLoCo end to end: a real `python -m engine.store` and real `python -m engine.train configs/debug-diloco.toml`
nodes (plain processes, or torchrun with 2 FSDP workers), a tiny model and short timeouts (heartbeat 0.2 s,
timeout 1.5 s). The oracle is the telemetry: every node's "outer_step" events carry a checksum of all its
parameters, which must be identical on every node for every outer step, joiners included.

Three runs, each asserted from several angles:
    three_nodes   a, b, c train; d joins mid-run; x (another H) is rejected; c is SIGKILLed, a, b, d go on;
                  c restarts with the same id and rejoins; all finish with identical weights
    leader_drain  a, b, c, e train; c dies inside the all-reduce (abort, redo without it); the leader is SIGKILLed;
                  then one survivor drains (SIGUSR1); the last finishes
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
ROUND_TOKENS = float(H * 2 * 32)  # a node's weight in the mean: the tokens of its round (engine/outer/rounds.py)


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
import engine.session  # the imports that take the seconds (engine.train imports it once the config passed)
print("primed", file=sys.stderr, flush=True)
go, deadline = sys.argv[1], time.monotonic() + 600
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.02)
sys.argv = ["engine.train"] + sys.argv[2:]
engine.train.cli()
"""


# Fault injection from the test side, no hook in the engine: the node SIGKILLs itself inside the all-reduce of
# outer step N, after the reduce-scatter (its chunks are out) and before the all-gather.
DIE_IN_ALLREDUCE = """import os, signal
import engine.outer.allreduce as comp
_gather, _calls = comp._all_gather, [0]
def _dying(pg, mine):
    _calls[0] += 1
    if _calls[0] == {n}:
        os.kill(os.getpid(), signal.SIGKILL)
    return _gather(pg, mine)
comp._all_gather = _dying
"""


# The source of a join's state hand-off SIGKILLs itself as it passes piece 8 of the state to its sending thread
# (the joiner gets a part or none of it). Once per run: the MARK file says it happened (the survivor is the
# source of the next hand-off and must live).
DIE_IN_HANDOFF = """import os, signal
import engine.outer.handoff as handoff
_put = handoff._Forward.put
def _dying(self, item):
    if item is not None and item[0] == 8 and not os.path.exists({mark!r}):
        open({mark!r}, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    _put(self, item)
handoff._Forward.put = _dying
"""


def start_node(procs, port: int, name: str, run_dir, *extra: str, workers: int = 1, go=None,
               die_at_outer_step: int | None = None, fault: str = "") -> Node:
    """fault: Python run before the engine (go must be given: the primed launcher runs it)."""
    args = [CONFIG, *FAST, f"--mesh.store_port={port}", f"--mesh.node_id={name}", f"--run.dir={run_dir / name}",
            *extra]
    if go is not None:
        fault += DIE_IN_ALLREDUCE.format(n=die_at_outer_step) if die_at_outer_step else ""
        return Node(procs, name, [sys.executable, "-c", fault + PRIMED, str(go), *args])
    if workers == 1:
        return Node(procs, name, [sys.executable, "-m", "engine.train", *args])
    # --standalone: torchrun binds its own rendezvous port (a port picked here could be taken before it binds)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={workers}", "-m",
                "engine.train"]
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
    """Every outer step's checksum is the same on every node that reported it, and no two outer steps share one.
    Agreement alone says nothing: a checksum that never changes agrees everywhere (a constant fingerprint passed
    every end-to-end test but one). Every committed outer step moves the weights, so its checksum is new."""
    seen = checksums_agree(nodes)
    bad = {k: v for k, v in seen.items() if len(v) != 1}
    assert seen and not bad, f"checksums differ at outer steps {bad}\n" + "\n".join(n.report() for n in nodes)
    assert_checksums_move(nodes)


def assert_checksums_move(nodes: list[Node]) -> None:
    """No checksum is reported for two different outer steps: the weights moved at every one."""
    steps_of: dict[str, set[int]] = defaultdict(set)
    for n in nodes:
        for k, e in n.outer().items():
            steps_of[e["checksum"]].add(k)
    repeated = {c: sorted(ks) for c, ks in steps_of.items() if len(ks) > 1}
    assert not repeated, f"one checksum for several outer steps (the fingerprint does not follow the weights): " \
                         f"{repeated}\n" + "\n".join(n.report() for n in nodes)


def primed(node: Node) -> None:
    """Wait until a primed node has imported the engine and sleeps on its go-file."""
    wait_for(lambda: "primed\n" in node.err, 120, f"{node.name} primed", [node])


def kill(node: Node) -> None:
    os.killpg(node.proc.pid, signal.SIGKILL)
    node.proc.wait(timeout=10)


# ------------------------------------------------------------------------------------------ run 1: three nodes

THREE_STEPS = 120  # the three_nodes run's max_steps


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """a, b, c (min_nodes 3, 120 steps = 40 outer steps). c starts once a or b holds the leader lease, so c is a
    follower. After outer step 2: d joins and x (H=4) is rejected. Two outer steps after d's admission c is
    SIGKILLed inside its inner round; once the survivors committed the next outer step, c restarts with the same
    id and rejoins. Nodes that must start at a chosen moment are primed (imports done) and released by a go-file.
    The run is long enough that the survivors cannot finish before the restarted c is admitted: with 60 steps and
    the mesh's waits down to milliseconds they once did (about 2.4 s after the restart), and c then waited alone."""
    from procs import ProcessTracker
    procs, port, run_dir = ProcessTracker(), free_port(), tmp_path_factory.mktemp("three")
    try:
        start_store(procs, port)
        steps = [f"--train.max_steps={THREE_STEPS}", "--diloco.min_nodes=3"]
        go_c, go_late, go_again = run_dir / "go-c", run_dir / "go-late", run_dir / "go-again"
        c = start_node(procs, port, "c", run_dir, *steps, go=go_c)
        d = start_node(procs, port, "d", run_dir, *steps, go=go_late)
        x = start_node(procs, port, "x", run_dir, *steps, "--diloco.inner_steps=4", go=go_late)
        again = start_node(procs, port, "c", run_dir / "again", *steps, go=go_again)
        again.name = "c (restarted)"
        a, b = (start_node(procs, port, n, run_dir, *steps) for n in "ab")
        nodes = [a, b, c, d, x, again]
        for n in (c, d, x, again):
            primed(n)
        wait_for(lambda: any(e["change"] == "leader" for n in (a, b) for e in n.of("membership")), 120,
                 "a leader among a and b", nodes)
        go_c.touch()
        wait_for(lambda: 2 in a.outer(), 180, "outer step 2", nodes)
        go_late.touch()
        wait_for(lambda: d.outer(), 120, "d admitted", nodes)
        after = min(d.outer()) + 2
        wait_for(lambda: max(c.outer(), default=0) >= after and c.last_step() > after * H, 120,
                 "c two outer steps past the join", nodes)
        killed = max(c.outer())
        kill(c)
        survivors = [a, b, d]
        wait_for(lambda: all(killed + 1 in n.outer() for n in survivors), 120, "the survivors' next outer step",
                 nodes)
        go_again.touch()
        codes = {n.name: finish(n, 180, nodes) for n in (*survivors, again, x)}
        yield {"a": a, "b": b, "c": c, "d": d, "x": x, "again": again, "codes": codes, "killed_after": killed,
               "survivors": survivors}
    finally:
        procs.kill_all()


def test_three_nodes_identical_checksums_after_every_outer_step(three_nodes):
    a, b, c, d = (three_nodes[n] for n in "abcd")
    assert all(three_nodes["codes"][n.name] == 0 for n in three_nodes["survivors"])
    assert sorted(a.outer()) == list(range(1, THREE_STEPS // H + 1))
    assert_identical([a, b, c, d, three_nodes["again"]])
    first = a.outer()[1]
    assert first["members"] == ["a", "b", "c"] and first["bytes_sent"] > 0 and first["pgrad_norm"] > 0
    assert first["contributors"] == ["a", "b", "c"] and first["weights"] == [ROUND_TOKENS] * 3
    assert a.of("run_end")[-1]["status"] == "completed"
    # started by hand without GLOBAL_RANK / GLOBAL_WORLD_SIZE, every node reads the same sequences: said once
    unset = "GLOBAL_RANK and GLOBAL_WORLD_SIZE are not set"
    assert [sum(unset in e["message"] for e in n.of("warning")) for n in (a, b, c)] == [1, 1, 1]


def test_joiner_mid_run_receives_state_and_matches(three_nodes):
    a, d = three_nodes["a"], three_nodes["d"]
    assert three_nodes["codes"]["d"] == 0, d.report()
    joined = min(d.outer())
    assert joined >= 3  # admitted at a boundary after it started, not at the beginning
    assert d.outer()[joined]["checksum"] == a.outer()[joined]["checksum"]
    assert "d" in a.outer()[joined]["members"]
    # a joiner takes part with weight 0: a member, not a contributor; one round later it counts
    assert "d" not in a.outer()[joined]["contributors"] and len(a.outer()[joined]["weights"]) == 3
    assert "d" in a.outer()[joined + 1]["contributors"]
    assert d.of("run_end")[-1]["step"] == THREE_STEPS  # took over the progress (step counter), trained to the end
    assert sorted(d.outer()) == list(range(joined, THREE_STEPS // H + 1))
    assert any(e["state"] == "joining" for e in d.of("state"))
    assert any(e["change"] == "joined" and e["subject"] == "d" for e in a.of("membership"))


def test_config_mismatch_rejected_without_disturbing_the_run(three_nodes):
    a, x = three_nodes["a"], three_nodes["x"]
    assert three_nodes["codes"]["x"] == 2  # bad input: one line, no traceback
    errors = [line for line in x.err.splitlines() if line.startswith("error: ")]
    # it names what differs, as the run and this node have it
    assert len(errors) == 1 and "digest" in errors[0] and \
        errors[0].endswith(f": diloco.inner_steps = 4 here, {H} in the run (the store keeps its run's settings: a "
                           "run with other settings needs a fresh store)"), x.report()
    assert "Traceback" not in x.err
    assert not x.of("outer_step")
    assert all("x" not in e["members"] for e in a.of("outer_step"))
    assert not any("x" in json.dumps(e) for e in a.of("warning"))


def test_follower_sigkill_survivors_redo_without_it_and_finish(three_nodes):
    survivors = three_nodes["survivors"]
    after = three_nodes["killed_after"] + 1
    for n in survivors:
        assert n.outer()[after]["members"] == ["a", "b", "d"], n.report()
        assert n.of("run_end")[-1]["status"] == "completed" and max(n.outer()) == THREE_STEPS // H
    assert any(e["change"] == "dead" and e["subject"] == "c" for e in survivors[0].of("membership"))
    assert_identical(survivors)


def test_node_restarted_with_same_id_rejoins_with_identical_weights(three_nodes):
    again, a = three_nodes["again"], three_nodes["a"]
    assert three_nodes["codes"][again.name] == 0, again.report()
    rejoined = min(again.outer())
    assert rejoined > three_nodes["killed_after"] + 1
    assert again.outer()[rejoined]["checksum"] == a.outer()[rejoined]["checksum"]
    assert a.outer()[rejoined]["members"] == ["a", "b", "c", "d"]
    assert any(e["state"] == "joining" for e in again.of("state"))
    assert again.of("run_end")[-1] == {**again.of("run_end")[-1], "status": "completed", "step": THREE_STEPS}


# ------------------------------------------------------------------------------------------ run 2: leader + drain

@pytest.fixture(scope="module")
def leader_drain(tmp_path_factory):
    """a, b, e and c with 30 steps (10 outer steps); c starts once one of the others leads. c SIGKILLs itself
    inside the all-reduce of outer step 2: the survivors' collective fails, they abort and redo step 2 without it.
    After outer step 3 the leader is SIGKILLed; after the survivors' outer step 5 one of them gets SIGUSR1 and
    drains; the other finishes alone."""
    from procs import ProcessTracker
    procs, port, run_dir = ProcessTracker(), free_port(), tmp_path_factory.mktemp("leader")
    try:
        start_store(procs, port)
        # a short all-reduce timeout: a survivor whose gloo ring never touches the dead node waits for it
        steps = ["--train.max_steps=30", "--diloco.min_nodes=4", "--diloco.allreduce_timeout=4"]
        go_c = run_dir / "go-c"
        c = start_node(procs, port, "c", run_dir, *steps, go=go_c, die_at_outer_step=2)
        nodes = [start_node(procs, port, n, run_dir, *steps) for n in "abe"]
        primed(c)
        wait_for(lambda: any(e["change"] == "leader" for n in nodes for e in n.of("membership")), 120,
                 "a leader among a, b, e", nodes)
        go_c.touch()
        wait_for(lambda: all(3 in n.outer() for n in nodes), 180, "outer step 3 everywhere", [*nodes, c])
        assert c.proc.wait(timeout=30) == -signal.SIGKILL
        by_name = {n.name: n for n in nodes}
        leader_name = [e for e in nodes[0].of("membership") if e["change"] == "leader"][-1]["subject"]
        leader = by_name.pop(leader_name)
        killed_at = time.time()
        kill(leader)
        survivors = sorted(by_name.values(), key=lambda n: n.name)
        wait_for(lambda: all(5 in n.outer() for n in survivors), 120, "outer step 5 after the kill", nodes)
        drainer, stayer = survivors
        os.kill(drainer.proc.pid, signal.SIGUSR1)
        codes = {n.name: finish(n, 180, nodes) for n in survivors}
        yield {"leader": leader, "drainer": drainer, "stayer": stayer, "codes": codes, "killed_at": killed_at,
               "c": c, "first": nodes}
    finally:
        procs.kill_all()


def test_death_inside_the_allreduce_aborts_and_redoes_the_step_without_it(leader_drain):
    first, c = leader_drain["first"], leader_drain["c"]
    assert sorted(c.outer()) == [1] and c.outer()[1]["members"] == ["a", "b", "c", "e"]
    for n in first:
        aborted = [e for e in n.of("warning") if "outer step 2 attempt 0" in e["message"] and "aborted" in e["message"]]
        assert aborted, n.report()
        redo = n.outer()[2]
        print(f"{n.name}: {aborted[0]['message']}; redo {redo['ts'] - n.outer()[1]['ts']:.2f}s after step 1")
        assert redo["members"] == ["a", "b", "e"] and redo["generation"] > n.outer()[1]["generation"]
    assert_identical([*first, c])


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
    # ... and its pseudo-gradient entered the mean with weight > 0 (no lost work), in both nodes' view
    for n in (drainer, stayer):
        e = n.outer()[last]
        assert sorted(e["contributors"]) == sorted([drainer.name, stayer.name]), e
        assert e["weights"] == [ROUND_TOKENS] * 2, e
    assert stayer.outer()[last + 1]["contributors"] == [stayer.name]
    assert stayer.outer()[last + 1]["members"] == [stayer.name]
    assert leader_drain["codes"][stayer.name] == 0
    assert stayer.of("run_end")[-1]["status"] == "completed" and max(stayer.outer()) == 10


# ------------------------------------------------------------------------------------------ run 3: FSDP

def two_fsdp_nodes(procs, tmp_path, *extra: str, timeout: float = 240) -> list[Node]:
    """Nodes a and b of two FSDP workers each, 9 steps at H = 3, run to their end: identical checksums at outer
    steps 1-3. b starts from other weights (another init seed, as after resuming from an older checkpoint): the
    first outer step of the run's life aligns everyone on the source's state, so checksums agree from step 1 on."""
    port = free_port()
    start_store(procs, port)
    steps = ["--train.max_steps=9", "--diloco.min_nodes=2", "--inner.strategy=fsdp", "--train.batch_size=4", *extra]
    nodes = [start_node(procs, port, "a", tmp_path, *steps, workers=2),
             start_node(procs, port, "b", tmp_path, *steps, "--train.init_seed=7", workers=2)]
    for n in nodes:
        assert finish(n, timeout, nodes) == 0, n.report()
    assert_identical(nodes)
    assert any("adopted the source's" in e["message"] for n in nodes for e in n.of("warning"))
    assert sorted(nodes[0].outer()) == [1, 2, 3]
    return nodes


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_nodes_of_two_fsdp_workers_identical_checksums(procs, tmp_path, optimizer):
    """Muon: each node's ranks orthogonalize whole matrices (gathered from their shards) between outer steps."""
    nodes = two_fsdp_nodes(procs, tmp_path, f"--optim.name={optimizer}")
    # bytes of both local ranks (each sends its own shard): int8 sends ~2 bytes per parameter in all
    assert nodes[0].outer()[1]["bytes_sent"] == nodes[1].outer()[1]["bytes_sent"] > 0


# ------------------------------------------------------------------------------------------ checkpoint and resume

def test_resume_from_mid_round_checkpoint_continues_the_uninterrupted_run(procs, tmp_path):
    """One node, H=3, a checkpoint at step 4 (mid-round: snapshot != parameters, momentum set). The run resumed
    from it reports the same checksums at outer steps 2..4 as the uninterrupted run: the outer state (snapshot and
    Nesterov momentum) was saved and restored with the inner state. The momentum is on here (configs/debug-diloco.toml
    keeps none): a momentum left out of the checkpoint passed this test when it ran with 0. The last checksum is the
    fingerprint of the weights the final checkpoint holds."""
    steps = ["--train.max_steps=12", "--diloco.min_nodes=1", "--ckpt.interval=4", "--ckpt.keep=5",
             "--diloco.outer_lr=0.7", "--diloco.outer_momentum=0.9"]
    port = free_port()
    start_store(procs, port)
    full = start_node(procs, port, "solo", tmp_path / "full", *steps)
    assert finish(full, 180, [full]) == 0, full.report()
    checkpoint = tmp_path / "full" / "solo" / "checkpoints" / "step-00000004"
    assert checkpoint.is_dir(), full.report()
    port2 = free_port()  # a fresh store: the first run's membership keys belong to that run
    start_store(procs, port2)
    resumed = start_node(procs, port2, "solo", tmp_path / "resumed", *steps, f"--ckpt.resume={checkpoint}")
    assert finish(resumed, 180, [resumed]) == 0, resumed.report()
    want = {k: e["checksum"] for k, e in full.outer().items()}
    got = {k: e["checksum"] for k, e in resumed.outer().items()}
    assert sorted(got) == [2, 3, 4] and all(got[k] == want[k] for k in got), (want, got)
    assert_checksums_move([full])
    import torch  # here only: the other tests of this module read nothing but the engines' output

    from engine.outer.buffers import fingerprint
    last = torch.load(tmp_path / "resumed" / "solo" / "checkpoints" / "step-00000012" / "rank-0.pt",
                      weights_only=False, map_location="cpu")
    assert last["outer"]["outer_optimizer"]["momentum"] is not None  # the momentum was on, and is kept
    assert fingerprint(last["outer"]["snapshot"]) == got[4], (fingerprint(last["outer"]["snapshot"]), got)


# ------------------------------------------------------------------------------------------ a node that stalls

def test_stalled_node_left_out_rejoins_and_takes_the_state(procs, tmp_path):
    """b is frozen (SIGSTOP) past the heartbeat timeout: a declares it dead and goes on alone. Thawed, b arrives
    at a boundary the run has passed, is told it was left out (Excluded), re-joins as a joiner and receives the
    state: from its re-admission on, its checksums equal a's, and both finish."""
    port = free_port()
    start_store(procs, port)
    steps = ["--train.max_steps=36", "--diloco.min_nodes=2"]
    a, b = nodes = [start_node(procs, port, n, tmp_path, *steps) for n in "ab"]
    wait_for(lambda: 2 in a.outer() and 2 in b.outer(), 180, "outer step 2", nodes)
    os.killpg(b.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: any(e["change"] == "dead" and e["subject"] == "b" for e in a.of("membership")), 30,
                 "a declares b dead", nodes)
        wait_for(lambda: any(e["members"] == ["a"] for e in a.of("outer_step")), 30, "a alone", nodes)
    finally:
        os.killpg(b.proc.pid, signal.SIGCONT)
    for n in nodes:
        assert finish(n, 180, nodes) == 0, n.report()
    assert any("re-join" in e["message"] for e in b.of("warning")), b.report()
    states = [e["state"] for e in b.of("state")]
    rejoin = max(i for i, st in enumerate(states) if st == "joining")
    assert "training" in states[rejoin:], states  # the console shows it training again, not joining forever
    back = min(k for k, e in b.outer().items() if k > 2)
    assert a.outer()[back]["members"] == ["a", "b"]
    assert_identical(nodes)
    assert b.of("run_end")[-1]["status"] == "completed" and max(b.outer()) == max(a.outer()) == 12


def test_a_joiner_whose_source_dies_in_the_hand_off_steps_out_and_joins_again(procs, tmp_path):
    """c joins a and b; the source of its state (a or b: whichever the plan names) is SIGKILLed in the middle of
    the hand-off. The commit stands without c's state: c steps out, asks to join again, and the survivor hands it
    the state at a later outer step. Both finish with identical weights. (Before, c failed with a traceback and
    exit 1, and the operator had to restart it.)"""
    port = free_port()
    start_store(procs, port)
    steps = ["--train.max_steps=90", "--diloco.min_nodes=2"]
    go_ab, go_c, mark = tmp_path / "go-ab", tmp_path / "go-c", tmp_path / "source-died"
    go_ab.touch()
    c = start_node(procs, port, "c", tmp_path, *steps, go=go_c)
    a, b = (start_node(procs, port, n, tmp_path, *steps, go=go_ab, fault=DIE_IN_HANDOFF.format(mark=str(mark)))
            for n in "ab")
    nodes = [a, b, c]
    primed(c)
    wait_for(lambda: 2 in a.outer() and 2 in b.outer(), 180, "outer step 2", nodes)
    go_c.touch()
    wait_for(lambda: mark.exists(), 120, "the source's death in the hand-off", nodes)
    wait_for(lambda: a.proc.poll() is not None or b.proc.poll() is not None, 30, "the source gone", nodes)
    source, survivor = (a, b) if a.proc.poll() is not None else (b, a)
    assert source.proc.poll() == -signal.SIGKILL, source.report()
    assert finish(survivor, 180, nodes) == 0 and finish(c, 180, nodes) == 0, "\n".join(n.report() for n in nodes)
    missed = [e["message"] for e in c.of("warning") if "stepped out of" in e["message"]]
    assert len(missed) == 1 and f"the state from {source.name} did not arrive" in missed[0], c.report()
    outer = survivor.outer()
    admitted = min(k for k, e in outer.items() if "c" in e["members"])  # the commit whose hand-off broke
    back = min(c.outer())
    # admitted again from the survivor two outer steps later: it stood by while the survivor planned the next one
    # without it (the planner would have waited for it there as a member of the commit, mesh.store_timeout)
    assert back == admitted + 2 and outer[back]["members"] == sorted([survivor.name, "c"]), (admitted, back)
    assert "c" not in outer[admitted + 1]["members"]
    ts = [outer[k]["ts"] for k in sorted(outer) if k >= admitted]
    assert max(b - a for a, b in zip(ts, ts[1:])) < 12, ts  # never held for mesh.store_timeout (20 s)
    assert [e["state"] for e in c.of("state")].count("training") == 1  # said once, after its first join
    assert_identical([survivor, c])
    assert c.of("run_end")[-1]["status"] == "completed" and c.of("run_end")[-1]["step"] == 90
    assert max(c.outer()) == max(survivor.outer()) == 30


def test_nodes_sharing_one_export_folder_both_finish_and_leave_one_model(procs, tmp_path):
    """Defect: nodes of one run given the same ckpt.export_dir (one host, a shared filesystem) wrote into one
    temporary folder, each clearing it under the other, and the second's rename met the first's export: a
    failure after training. Each writes its own now; the first in place is the run's agreed model."""
    from transformers import AutoModelForCausalLM
    port, export = free_port(), tmp_path / "export"
    start_store(procs, port)
    nodes = [start_node(procs, port, n, tmp_path, "--train.max_steps=6", "--diloco.min_nodes=2",
                     f"--ckpt.export_dir={export}") for n in "ab"]
    for n in nodes:
        assert finish(n, 180, nodes) == 0, n.report()
        assert [e["path"] for e in n.of("export")] == [str(export)]
    assert_identical(nodes)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".export")) == []  # no temporary left
    assert AutoModelForCausalLM.from_pretrained(export).num_parameters() > 0


# ------------------------------------------------------------------------------------------ run: overlap

@pytest.mark.parametrize("mode", ["overlap", "time-rounds", "fragments", "muon"])
def test_join_death_in_allreduce_and_drain_stay_identical(procs, tmp_path, mode):
    """diloco.overlap=true (each outer step runs in the background while the next round trains), rounds by time
    (diloco.round = "time": each round ends at the plan's deadline), streaming fragments (diloco.fragments = 3:
    an outer step after every inner step, each syncing a third of the model in the background while the next
    step trains: diloco.fragment_delay = 1), and Muon as the inner optimizer (optim.name = "muon": the joiner's
    Muon momentum starts at zero, as AdamW's moments do): a, b, c form the run; c dies inside
    the all-reduce of outer step 3 (the survivors abort that attempt and redo it without c); d joins; then b drains
    (its last round contributed; with fragments, each of its fragments once more) and a finishes. Every outer
    step's checksum agrees among the nodes that reported it; with time rounds the run still lasts max_steps / H
    rounds."""
    port, run_dir = free_port(), tmp_path
    start_store(procs, port)
    steps = ["--train.max_steps=36", "--diloco.min_nodes=3", "--diloco.allreduce_timeout=4"]
    steps += {"overlap": ["--diloco.overlap=true"], "time-rounds": ["--diloco.round=time", "--diloco.round_seconds=1"],
              "fragments": ["--diloco.fragments=3", "--diloco.fragment_delay=1"], "muon": ["--optim.name=muon"]}[mode]
    per_round = 1 if mode == "fragments" else H  # inner steps between two outer steps
    go_c, go_d = run_dir / "go-c", run_dir / "go-d"
    c = start_node(procs, port, "c", run_dir, *steps, go=go_c, die_at_outer_step=3)
    d = start_node(procs, port, "d", run_dir, *steps, go=go_d)
    a, b = (start_node(procs, port, n, run_dir, *steps) for n in "ab")
    nodes = [a, b, c, d]
    primed(c)
    primed(d)
    go_c.touch()
    wait_for(lambda: 3 in a.outer() and 3 in b.outer(), 180, "outer step 3 without c", nodes)
    assert c.proc.wait(timeout=30) == -signal.SIGKILL
    go_d.touch()
    wait_for(lambda: d.outer(), 120, "d admitted", nodes)
    joined = min(d.outer())
    wait_for(lambda: joined + 1 in b.outer(), 120, "b one outer step past the join", nodes)
    os.kill(b.proc.pid, signal.SIGUSR1)
    codes = {n.name: finish(n, 180, nodes) for n in (a, b, d)}
    assert codes == {"a": 0, "b": 0, "d": 0}, "\n".join(n.report() for n in nodes)
    assert_identical([a, b, c, d])
    # the outer step c died in redone; fragments: the last step syncs the other two fragments too
    assert sorted(a.outer()) == list(range(1, 36 // per_round + 1 + (2 if mode == "fragments" else 0)))
    assert a.outer()[3]["members"] == ["a", "b"] and a.outer()[1]["members"] == ["a", "b", "c"]
    assert d.outer()[joined]["checksum"] == a.outer()[joined]["checksum"]
    if mode == "time-rounds":  # each node counts its own steps: a fresh joiner starts its own (and its data) at 0
        assert d.outer()[joined]["step"] == 0 < a.outer()[joined]["step"], (d.outer()[joined], a.outer()[joined])
    assert b.of("run_end")[-1]["status"] == "drained" and a.of("run_end")[-1]["status"] == "completed"
    assert any("aborted" in e["message"] for e in a.of("warning"))
    if mode == "fragments":
        # b's drain sent each fragment once more, the last three outer steps it took part in, without training
        last = [b.outer()[k] for k in sorted(b.outer())[-3:]]
        assert sorted(e["fragment"] for e in last) == [0, 1, 2] and len({e["step"] for e in last}) == 1, last
        assert all(e["outer_step"] % 3 == (e["fragment"] + 1) % 3 for e in a.of("outer_step"))


@pytest.mark.parametrize("mode", ["overlap", "fragments"])
def test_a_stop_while_an_outer_step_is_in_flight_saves_and_ends_stopped(procs, tmp_path, mode):
    """SIGTERM between two boundaries while the last one's outer step waits in the background (overlap; fragments
    with fragment_delay), here for a second node that never comes (min_nodes 2). The node ends as a stop does: exit
    0, run_end "stopped", a checkpoint (it raised the background step's Stopped out of the save: exit 1, "failed")."""
    port = free_port()
    start_store(procs, port)
    extra = {"overlap": ["--diloco.overlap=true"], "fragments": ["--diloco.fragments=3", "--diloco.fragment_delay=100"]}
    boundary = {"overlap": 300, "fragments": 100}[mode]  # the first boundary; the next one (or the landing) 300 later
    a = start_node(procs, port, "a", tmp_path, "--train.max_steps=3000", "--diloco.inner_steps=300",
                   "--diloco.min_nodes=2", *extra[mode])
    wait_for(lambda: a.last_step() >= boundary + 10, 120, "a training past its first boundary", [a])
    os.kill(a.proc.pid, signal.SIGTERM)
    assert finish(a, 60, [a]) == 0, a.report()
    assert a.of("run_end")[-1]["status"] == "stopped" and not a.of("outer_step"), a.report()
    assert boundary < a.of("checkpoint")[-1]["step"] == a.of("run_end")[-1]["step"] < boundary + 200, a.report()
