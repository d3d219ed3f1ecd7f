"""The mesh with real processes: a `python -m engine.store` process and one process per node running a small
outer loop (this file run as a script: `python tests/test_mesh_live.py node ...`), with gloo all-reduces over
make_group. Short timeouts (heartbeat 0.2 s / timeout 1.5 s) keep it fast.

Each node prints its telemetry events (JSON lines) and one `RESULT {...}` line per decided outer step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HB, HB_TIMEOUT = 0.2, 1.5
MESH_ARGS = dict(heartbeat_interval=HB, heartbeat_timeout=HB_TIMEOUT, store_timeout=5.0, start_timeout=30.0,
                 join_timeout=40.0, polling_interval=0.05)


# ---- the node program --------------------------------------------------------------------------------------------

def node_main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from engine.config import MeshConfig
    from engine.mesh import Mesh, MeshError, connect_store, forget_groups
    from engine.telemetry import Telemetry

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--min-nodes", type=int, default=1)
    p.add_argument("--step-s", type=float, default=0.3)
    p.add_argument("--digest", default="d1")
    p.add_argument("--drain-at", type=int, default=-1)
    p.add_argument("--start-after", type=int, default=-1, help="start once the run's plan reached this outer step")
    p.add_argument("--hb-timeout", type=float, default=HB_TIMEOUT)
    args = p.parse_args(argv)
    cfg = MeshConfig(**{**MESH_ARGS, "heartbeat_timeout": args.hb_timeout})
    tel = Telemetry(args.id, 0, json_out=sys.stdout)
    mesh = None
    try:
        store = connect_store("127.0.0.1", args.port, cfg.store_timeout)
        # a test joiner starts with its imports done, at a known point of the run
        while args.start_after >= 0 and not (store.check(["zb/plan/latest"]) and store.get("zb/plan/latest") and
                                             json.loads(store.get("zb/plan/latest"))["outer_step"] >= args.start_after):
            time.sleep(0.05)
        mesh = Mesh(store, args.id, cfg, digest=args.digest, info={"host": "local", "pid": os.getpid()},
                    min_nodes=args.min_nodes, emit=tel.emit)
        joiner = mesh.start()
        return outer_loop(args, store, mesh, joiner)
    except MeshError as e:
        print(f"ERROR {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        # a daemon heartbeat thread caught inside a store call at interpreter exit aborts the process
        # ("terminate called without an active exception"): stop it, and drop the groups, before exiting
        if mesh is not None:
            mesh.close()
        forget_groups()


def outer_loop(args, store, mesh, joiner: bool) -> int:
    """What engine/outer/diloco.py does around the mesh, with a one-number all-reduce for the pseudo-gradient."""
    from engine.mesh import Excluded, forget_groups, make_group

    k, attempt = 0, 0
    while k < args.steps:
        if attempt >= 5:
            print(f"ERROR outer step {k}: 5 attempts failed", file=sys.stderr, flush=True)
            mesh.leave("failed")
            return 4
        draining = k == args.drain_at
        try:
            if joiner:
                plan = mesh.wait_admission()
                joiner = False
                k, attempt = plan.outer_step, plan.attempt
            else:
                plan = mesh.boundary(k, attempt, contributing=True, draining=draining)
        except Excluded:
            joiner = True
            continue
        total, ok = 0.0, True
        try:
            import torch
            group = make_group(store, plan, args.id, 0, timeout=5.0)
            t = torch.tensor([float(plan.rank_of(args.id) + 1)])
            group.allreduce([t]).wait()
            total = float(t.item())
        except Exception as e:  # noqa: BLE001 - a failed collective is an abort vote, reported in the result
            ok = False
            forget_groups()
            print(f"allreduce failed: {str(e).splitlines()[0]}", file=sys.stderr, flush=True)
        committed = mesh.commit(plan, ok)
        # one write, as the telemetry's lines are: print() writes the text and its newline apart, and the
        # heartbeat thread's event could land between them
        sys.stdout.write("RESULT " + json.dumps({"k": k, "attempt": attempt, "generation": plan.generation,
                                                 "members": list(plan.members), "joiners": list(plan.joiners),
                                                 "leaving": list(plan.leaving), "sum": total,
                                                 "committed": committed, "leader": mesh.is_leader,
                                                 "t": time.monotonic()}) + "\n")
        sys.stdout.flush()
        if not committed:
            attempt += 1
            continue
        if draining:
            mesh.leave("drained")
            return 0
        k, attempt = k + 1, 0
        time.sleep(args.step_s)
    mesh.leave("completed")
    mesh.close()
    return 0


# ---- test helpers --------------------------------------------------------------------------------------------------

class Node:
    """A started process whose stdout is collected by a thread: events (JSON) and RESULT lines."""

    def __init__(self, procs, args: list[str]) -> None:
        self.proc = procs.start(args)
        self.events: list[dict] = []
        self.results: list[dict] = []
        self.lines: list[str] = []
        self.err = ""
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            try:
                if line.startswith("RESULT "):
                    self.results.append(json.loads(line[7:]))
                elif line.startswith("{"):
                    self.events.append(json.loads(line))
            except ValueError:  # kept in lines for the report; the reader goes on, or the node blocks on its pipe
                self.err += f"(test reader) not one JSON line: {line!r}\n"

    def _read_err(self) -> None:
        for line in self.proc.stderr:
            self.err += line

    def committed(self) -> list[dict]:
        return [r for r in self.results if r["committed"]]

    def membership(self, change: str) -> list[dict]:
        return [e for e in self.events if e["type"] == "membership" and e["change"] == change]


def wait_for(pred, timeout: float, what: str, nodes=()) -> float:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            logs = "\n".join(f"--- {i}: rc={n.proc.poll()}\n{n.err[-3000:]}\n" + "".join(
                [l for l in n.lines if not l.startswith('{"v":1,"type":"heartbeat"')][-15:])
                for i, n in enumerate(nodes))
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")
        time.sleep(0.05)
    return time.monotonic()


def start_store(procs, port: int) -> Node:
    store = Node(procs, [sys.executable, "-m", "engine.store", "--host", "127.0.0.1", "--port", str(port)])
    wait_for(lambda: any(e.get("state") == "ready" for e in store.events), 60, "store ready", [store])
    return store


def start_node(procs, port: int, node_id: str, *extra: str) -> Node:
    return Node(procs, [sys.executable, __file__, "node", "--port", str(port), "--id", node_id, *extra])


# ---- tests ---------------------------------------------------------------------------------------------------------

def test_join_then_leader_sigkill_survivors_take_over_and_finish(procs, port):
    """3 processes all-reduce over make_group; a joiner is admitted mid-run; SIGKILL of the leader: another node
    takes the lease within about one heartbeat timeout, the next plan excludes the dead node, the run finishes."""
    start_store(procs, port)
    a = start_node(procs, port, "a", "--steps", "14", "--min-nodes", "2")
    b = start_node(procs, port, "b", "--steps", "14", "--min-nodes", "2")
    c = start_node(procs, port, "c", "--steps", "14", "--start-after", "2")
    nodes = [a, b, c]
    wait_for(lambda: len(a.committed()) >= 2 and len(b.committed()) >= 2, 90, "two outer steps of a and b", nodes)
    first = a.committed()[0]
    assert first["members"] == ["a", "b"] and first["sum"] == 3.0  # ranks 1 + 2
    wait_for(lambda: len(c.committed()) >= 2, 90, "c admitted and trained", nodes)
    admitted = c.committed()[0]
    assert admitted["joiners"] == ["c"], (c.results, a.results[-6:])
    assert admitted["joiners"] == ["c"] and admitted["members"] == ["a", "b", "c"] and admitted["sum"] == 6.0
    assert any(e["subject"] == "c" for e in a.membership("joined"))

    leader_name = a.membership("leader")[-1]["subject"]
    by_name = {"a": a, "b": b, "c": c}
    leader = by_name.pop(leader_name)
    survivors = list(by_name.values())
    killed_at = time.time()
    os.killpg(leader.proc.pid, signal.SIGKILL)

    def takeovers() -> list[float]:
        return [e["ts"] for s in survivors for e in s.membership("leader")
                if e["subject"] != leader_name and e["ts"] >= killed_at]
    wait_for(lambda: takeovers(), 30, "a new leader", nodes)
    # detection needs heartbeat_timeout of silence; the takeover happens at the next beat (CPU-loaded machine: slack)
    assert min(takeovers()) - killed_at < HB_TIMEOUT + 2 * HB + 2.5
    for s in survivors:
        assert s.proc.wait(timeout=120) == 0, s.err
    names = sorted(by_name)
    for s in survivors:
        last = s.committed()[-1]
        assert last["k"] == 13 and last["members"] == names and last["sum"] == 3.0
        assert any(e["subject"] == leader_name for e in s.membership("dead"))
    # survivors agreed on every decided step: same members, same sums, same outcome
    decided = [{(r["k"], r["attempt"]): (r["members"], r["sum"], r["committed"]) for r in s.results}
               for s in survivors]
    common = set(decided[0]) & set(decided[1])
    assert common and all(decided[0][key] == decided[1][key] for key in common)


def test_drained_node_leaves_and_the_next_plan_excludes_it_at_once(procs, port):
    start_store(procs, port)
    # a long heartbeat timeout: had the plan waited for b's heartbeat to stop, step 3 would come 10 s late
    slow = ("--hb-timeout", "10")
    a = start_node(procs, port, "a", "--steps", "6", "--min-nodes", "2", "--step-s", "0.5", *slow)
    b = start_node(procs, port, "b", "--steps", "6", "--min-nodes", "2", "--drain-at", "2", "--step-s", "0.5", *slow)
    assert b.proc.wait(timeout=120) == 0, b.err
    drained = b.committed()[-1]
    assert drained["k"] == 2 and drained["leaving"] == ["b"] and drained["sum"] == 3.0
    assert a.proc.wait(timeout=60) == 0, a.err
    after = [r for r in a.committed() if r["k"] == 3][0]
    assert after["members"] == ["a"]
    # no heartbeat timeout was waited: step 3 came within one step pause plus a rendezvous, well under 10 s
    step2 = [r for r in a.committed() if r["k"] == 2][0]
    assert after["t"] - step2["t"] < 6.0 and after["attempt"] == 0
    assert any(e["subject"] == "b" for e in a.membership("drained"))


def test_duplicate_live_id_and_other_digest_are_rejected_without_disturbing_the_run(procs, port):
    start_store(procs, port)
    a = start_node(procs, port, "a", "--steps", "100000", "--step-s", "0.1")  # ended by the fixture
    wait_for(lambda: len(a.committed()) >= 1, 60, "a running", [a])
    dup = start_node(procs, port, "a", "--steps", "3")
    t0 = time.monotonic()
    assert dup.proc.wait(timeout=60) == 3
    assert "node id 'a' is in use by a live node (host local" in dup.err
    other = start_node(procs, port, "x", "--digest", "d2")
    assert other.proc.wait(timeout=60) == 3
    assert "config digest d2 differs from the run's d1" in other.err
    before = len(a.committed())
    wait_for(lambda: len(a.committed()) > before + 2, 30, "a still committing", [a])
    assert a.proc.poll() is None and all(r["members"] == ["a"] for r in a.results)
    assert time.monotonic() - t0 < 60


# ---- the engine (python -m engine.train) in the mesh's hard cases: stop in a wait, a frozen peer, store loss -------

def _engine():
    import test_diloco_e2e as e2e  # its helpers: engine nodes with short heartbeats, primed launchers
    return e2e


def _a_b_and_faulty_c(procs, port: int, tmp_path, fault: str, steps: list[str]):
    """Nodes a and b, and c with `fault` (Python run before the engine) primed first and released once a and b
    are started, so that all three form the run together."""
    e2e = _engine()
    go = tmp_path / "go"
    args = [e2e.CONFIG, *e2e.FAST, *steps, f"--mesh.store_port={port}", "--mesh.node_id=c",
            f"--run.dir={tmp_path / 'c'}"]
    c = e2e.Node(procs, "c", [sys.executable, "-c", fault + e2e.PRIMED, str(go), *args])
    a, b = (e2e.start_node(procs, port, n, tmp_path, *steps) for n in "ab")
    e2e.primed(c)
    go.touch()
    return a, b, c


def test_sigterm_while_waiting_for_min_nodes_exits_0_within_2s_with_a_checkpoint(procs, port, tmp_path):
    e2e = _engine()
    e2e.start_store(procs, port)
    a = e2e.start_node(procs, port, "a", tmp_path, "--train.max_steps=30", "--diloco.min_nodes=2",
                       "--mesh.start_timeout=120")
    wait_for(lambda: a.last_step() >= e2e.H, 120, "a at its first boundary", [a])
    time.sleep(1.0)  # inside the formation's wait for a second node
    signalled = time.time()
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0, a.report()
    end = a.of("run_end")[-1]
    assert end["status"] == "stopped" and end["step"] == e2e.H
    assert end["ts"] - signalled < 2.0, end["ts"] - signalled
    assert [c["step"] for c in a.of("checkpoint")] == [e2e.H]  # the round it could not send is saved
    assert "Traceback" not in a.err


# the drain (SIGUSR1) comes while the node waits in the round of outer step N, after it arrived as a contributor
DRAIN_IN_BOUNDARY_WAIT = """import os, signal
from engine.mesh.node import Mesh
_arrive = Mesh.arrive
def _arriving(self, outer_step, attempt, **kw):
    _arrive(self, outer_step, attempt, **kw)
    if outer_step == {n} and attempt == 0:
        os.kill(os.getpid(), signal.SIGUSR1)
Mesh.arrive = _arriving
"""


def test_a_drain_that_comes_during_the_boundary_wait_contributes_that_round_then_leaves(procs, port, tmp_path):
    """Before, a drain requested while the node waited in a round it had arrived at as a contributor ended the
    wait at once: it left without its pseudo-gradient, and its peers waited out the all-reduce timeout for it,
    then redid the step without it (the chaos lab's `drain` fault: a 30 s stall). Now the round finishes and the
    node leaves right after its commit."""
    e2e = _engine()
    e2e.start_store(procs, port)
    n_drain = 3
    steps = ["--train.max_steps=24", "--diloco.allreduce_timeout=60", "--diloco.min_nodes=2"]  # formed by both
    go = tmp_path / "go"
    args = [e2e.CONFIG, *e2e.FAST, *steps, f"--mesh.store_port={port}", "--mesh.node_id=b",
            f"--run.dir={tmp_path / 'b'}"]
    b = e2e.Node(procs, "b", [sys.executable, "-c", DRAIN_IN_BOUNDARY_WAIT.format(n=n_drain) + e2e.PRIMED, str(go),
                              *args])
    e2e.primed(b)
    a = e2e.start_node(procs, port, "a", tmp_path, *steps)
    go.touch()
    nodes = [a, b]
    assert e2e.finish(b, 180, nodes) == 0, b.report()
    assert e2e.finish(a, 180, nodes) == 0, a.report()
    assert b.of("run_end")[-1]["status"] == "drained"
    assert [d["outer_step"] for d in b.of("drained")] == [n_drain]
    for n in (a, b):  # its pseudo-gradient entered the mean of outer step N, in both nodes' view
        e = n.outer()[n_drain]
        assert sorted(e["contributors"]) == ["a", "b"] and e["weights"] == [e2e.ROUND_TOKENS] * 2, e
    assert a.outer()[n_drain]["checksum"] == b.outer()[n_drain]["checksum"]
    assert b.of("checkpoint")[-1]["step"] == n_drain * e2e.H  # nothing trained after the round it contributed
    assert a.outer()[n_drain + 1]["members"] == ["a"]
    # no all-reduce timeout waited out, no step redone
    assert not [w for w in a.of("warning") if "aborted" in w["message"]], a.report()


FREEZE_IN_ALLREDUCE = """import os, signal, sys, time
import engine.outer.allreduce as comp
_gather, _calls = comp._all_gather, [0]
def _freezing(pg, mine):
    _calls[0] += 1
    if _calls[0] == {n}:
        print(f"FROZEN {{time.time()}}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return _gather(pg, mine)
comp._all_gather = _freezing
"""


FREEZE_IN_RENDEZVOUS = """import os, signal, sys, time
import engine.mesh
_make = engine.mesh.make_group
def _freezing(*args, **kw):
    print(f"FROZEN {time.time()}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    return _make(*args, **kw)
engine.mesh.make_group = _freezing
"""


# A lossy link, emulated in the process (tc netem is absent; the chaos lab does it with nftables over SSH): from the
# all-gather of outer step 2 for SLOW_S seconds, every store round trip of the node's heartbeat costs a TCP
# retransmission timeout and the collective cannot make progress.
SLOW_LINK_IN_ALLREDUCE = """import os, sys, time
import engine.outer.allreduce as comp
import engine.mesh.heartbeat as hb
_gather, _tick, _calls, _until = comp._all_gather, hb.Heartbeat.tick, [0], [0.0]
def _slow_tick(self):
    if time.monotonic() < _until[0]:
        time.sleep(0.45)  # a lost packet: one retransmission timeout (200 ms and up) per tick
    return _tick(self)
def _slow_gather(pg, mine):
    _calls[0] += 1
    if _calls[0] == {n}:
        _until[0] = time.monotonic() + {slow_s}
        print(f"SLOW {{time.time()}}", file=sys.stderr, flush=True)
        time.sleep({slow_s})
    return _gather(pg, mine)
hb.Heartbeat.tick = _slow_tick
comp._all_gather = _slow_gather
"""


def test_a_member_on_a_lossy_link_steps_out_and_the_others_go_on_then_it_rejoins(procs, port, tmp_path):
    """c's link turns lossy inside the all-reduce of outer step 2 for 6 s: its heartbeats still get through (late),
    so nobody declares it dead, and its collective would hold a and b for the whole fault. Its own ticks are slow
    while the collective is overdue (diloco.straggler_timeout: half the heartbeat timeout here): it steps out and
    aborts the attempt; a and b commit step 2 without it within heartbeat_timeout + about a second. Once its link is
    healthy it asks to join, takes the state and the three finish with identical weights."""
    e2e = _engine()
    e2e.start_store(procs, port)
    slow_s, k = 6.0, 2
    # a ceiling (the run is stopped once c is back): a and b alone run about four outer steps a second here
    steps = ["--train.max_steps=600", "--diloco.min_nodes=3", "--diloco.allreduce_timeout=60"]
    a, b, c = _a_b_and_faulty_c(procs, port, tmp_path, SLOW_LINK_IN_ALLREDUCE.format(n=k, slow_s=slow_s), steps)
    nodes = [a, b, c]
    e2e.wait_for(lambda: "SLOW" in c.err, 180, "c's link slow in the all-reduce of outer step 2", nodes)
    slow = float(c.err.split("SLOW ")[1].split()[0])
    e2e.wait_for(lambda: all(k in n.outer() for n in (a, b)), 40, f"the others' outer step {k}", nodes)
    stall = max(n.outer()[k]["ts"] for n in (a, b)) - slow
    print(f"stall {stall:.2f}s")
    assert stall < e2e.HB_TIMEOUT + 2.5, stall  # without the step-out: the whole 6 s fault
    assert all(n.outer()[k]["members"] == ["a", "b"] for n in (a, b))
    assert any("stepped out of outer step 2" in w["message"] for w in c.of("warning")), c.report()
    # c comes back: admitted as a joiner after its link healed, then a member of two more outer steps; the run is
    # stopped there (SIGTERM: each node ends its step and stops), not trained on to max_steps
    back = _member_again(e2e, a, "c", nodes)
    stop_all(e2e, nodes)
    joined = [e for e in a.of("membership") if e["change"] == "joined" and e["subject"] == "c"]
    assert joined and joined[0]["ts"] > slow + slow_s - 1.0, joined
    assert a.outer()[back]["members"] == ["a", "b", "c"] and back > k
    e2e.assert_identical(nodes)


def _member_again(e2e, a, name: str, nodes) -> int:
    """Wait until `name` has been a member of two outer steps after its join: the second of them."""
    def again() -> list[int]:
        joined = [e["ts"] for e in a.of("membership") if e["change"] == "joined" and e["subject"] == name]
        return sorted(s for s, e in a.outer().items() if joined and e["ts"] > joined[0] and name in e["members"])
    e2e.wait_for(lambda: len(again()) >= 2, 180, f"{name} back and a member of two outer steps", nodes)
    return again()[1]


def stop_all(e2e, nodes) -> None:
    """SIGTERM every node: each ends as a stop does (its step, a checkpoint, exit 0)."""
    for n in nodes:
        os.kill(n.proc.pid, signal.SIGTERM)
    assert all(e2e.finish(n, 120, nodes) == 0 for n in nodes), "\n".join(n.report() for n in nodes)


# The same link turning lossy a little earlier: as the node arrives at the boundary of outer step 2. Its arrival
# (a store write) is retransmitted for late_s seconds, and the collective then cannot make progress until the fault
# ends: its peers have been held since its arrival, not since it entered the collective.
SLOW_LINK_AT_ARRIVAL = """import sys, time
import engine.outer.allreduce as comp
import engine.mesh.heartbeat as hb
import engine.mesh.registration as reg
_gather, _tick, _write, _until = comp._all_gather, hb.Heartbeat.tick, reg.Registration.write_state, [0.0]
def _slow_tick(self):
    if time.monotonic() < _until[0]:
        time.sleep(0.45)
    return _tick(self)
def _slow_write(self, st, store):
    if not _until[0] and st.at is not None and tuple(st.at[1:]) == ({n}, 0):  # the arrival's write crawls
        _until[0] = time.monotonic() + {slow_s}
        print(f"SLOW {{time.time()}}", file=sys.stderr, flush=True)
        time.sleep({late_s})
    return _write(self, st, store)
def _slow_gather(pg, mine):
    if time.monotonic() < _until[0]:
        print(f"GATHER {{time.time()}}", file=sys.stderr, flush=True)
        time.sleep(max(0.0, _until[0] - time.monotonic()))
    return _gather(pg, mine)
hb.Heartbeat.tick = _slow_tick
reg.Registration.write_state = _slow_write
comp._all_gather = _slow_gather
"""


def test_a_member_whose_arrival_crawled_on_a_lossy_link_steps_out_at_the_boundary(procs, port, tmp_path):
    """c's link turns lossy as it arrives at outer step 2: the arrival takes 1.5 s, and a and b wait for it. Its
    straggler budget counts from the start of its arrival (its peers were held since then), so it steps out at the
    boundary, before it reads the plan, instead of crawling on through the plan's read, its state write and the
    rendezvous into the collective (the chaos lab's seed-21 residual: 4.5 s); a and b commit step 2 without it."""
    e2e = _engine()
    e2e.start_store(procs, port)
    slow_s, late_s, k = 5.0, 1.5, 2
    # a ceiling (the run is stopped once c is back): a and b alone run about four outer steps a second here
    steps = ["--train.max_steps=600", "--diloco.min_nodes=3", "--diloco.allreduce_timeout=60"]
    fault = SLOW_LINK_AT_ARRIVAL.format(n=k, slow_s=slow_s, late_s=late_s)
    a, b, c = _a_b_and_faulty_c(procs, port, tmp_path, fault, steps)
    nodes = [a, b, c]
    e2e.wait_for(lambda: "SLOW" in c.err, 180, "c's slow arrival at outer step 2", nodes)
    slow = float(c.err.split("SLOW ")[1].split()[0])
    e2e.wait_for(lambda: all(k in n.outer() for n in (a, b)), 40, f"the others' outer step {k}", nodes)
    assert all(n.outer()[k]["members"] == ["a", "b"] for n in (a, b))
    out = [w for w in c.of("warning") if "stepped out of outer step 2" in w["message"]]
    assert out and "no plan read within its straggler budget" in out[0]["message"], c.report()
    assert "GATHER" not in c.err  # it never went on to the collective
    # from the start of c's arrival: the arrival's 1.5 s and the step-out's store writes, then a and b's re-plan;
    # going on to the collective cost a rendezvous and a gather's poll more (and over a real lossy link each of
    # them crawls through retransmissions)
    stall = max(n.outer()[k]["ts"] for n in (a, b)) - slow
    print(f"a and b committed step {k} {stall:.2f}s after c's arrival began")
    assert stall < late_s + 2.5, stall  # as its siblings: a loaded 2-core machine's slack
    _member_again(e2e, a, "c", nodes)  # c back once its link is healthy; then the run is stopped
    stop_all(e2e, nodes)
    e2e.assert_identical(nodes)


@pytest.mark.parametrize("phase", ["rendezvous", "all-reduce"])
def test_a_peer_frozen_in_the_rendezvous_or_the_all_reduce_stalls_the_survivors_one_heartbeat_timeout(
        procs, port, tmp_path, phase):
    """SIGSTOP of c as the first plan appears (before its gloo rendezvous of outer step 1), or inside the all-reduce
    of outer step 2 (after the reduce-scatter): the survivors' rendezvous or collective would wait
    diloco.allreduce_timeout (60 s here); they give it up when c's heartbeat stops and commit that step without it
    within heartbeat_timeout + about a second."""
    e2e = _engine()
    e2e.start_store(procs, port)
    steps = ["--train.max_steps=18", "--diloco.min_nodes=3", "--diloco.allreduce_timeout=60"]
    fault, k = (FREEZE_IN_RENDEZVOUS, 1) if phase == "rendezvous" else (FREEZE_IN_ALLREDUCE.format(n=2), 2)
    a, b, c = _a_b_and_faulty_c(procs, port, tmp_path, fault, steps)
    nodes = [a, b, c]
    e2e.wait_for(lambda: "FROZEN" in c.err, 180, f"c frozen in the {phase} of outer step {k}", nodes)
    frozen = float(c.err.split("FROZEN ")[1].split()[0])
    e2e.wait_for(lambda: all(k in n.outer() for n in (a, b)), 40, f"the survivors' outer step {k}", nodes)
    stall = max(n.outer()[k]["ts"] for n in (a, b)) - frozen
    assert stall < e2e.HB_TIMEOUT + 2.5, stall  # goal: heartbeat_timeout + 1 s (a loaded 2-core machine: slack)
    assert all(n.outer()[k]["members"] == ["a", "b"] for n in (a, b))
    assert all(e2e.finish(n, 120, nodes) == 0 for n in (a, b))
    e2e.assert_identical([a, b])


def test_every_node_stopped_then_restarted_with_the_store_running_resumes_as_one_run(procs, port, tmp_path):
    """Both nodes get SIGTERM a moment apart (their checkpoints may be an outer step apart); restarted under their
    ids with the store still running, each sees the other's new process beating: they must form one new life of
    the run together (before: each waited to join the other, and both failed after minutes)."""
    e2e = _engine()
    e2e.start_store(procs, port)
    steps = ["--train.max_steps=45", "--diloco.min_nodes=2", "--ckpt.resume=auto"]
    a, b = (e2e.start_node(procs, port, n, tmp_path, *steps) for n in "ab")
    e2e.wait_for(lambda: all(2 in n.outer() for n in (a, b)), 180, "outer step 2", [a, b])
    for n in (a, b):
        n.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    for n in (a, b):
        assert n.proc.wait(timeout=60) == 0, n.report()
        assert n.of("run_end")[-1]["status"] == "stopped"
    saved = {n.name: n.of("checkpoint")[-1]["step"] for n in (a, b)}
    a2, b2 = (e2e.start_node(procs, port, n, tmp_path, *steps) for n in "ab")
    nodes = [a2, b2]
    for n in nodes:
        assert e2e.finish(n, 240, nodes) == 0, n.report()
        assert n.of("run_end")[-1]["status"] == "completed"
    # A node stopped mid-round checkpoints its inner steps past its last committed outer step (a stop while
    # its peer was already gone leaves outer step k+1 uncommitted): the new life goes on from the last outer step
    # committed before the stop, neither redone nor skipped, and from the checkpoints, not from step 0.
    committed = max(max(a.outer()), max(b.outer()))
    resumed = set(a2.outer()) & set(b2.outer())
    assert max(resumed) == 15 and min(resumed) == committed + 1, (committed, sorted(resumed))
    assert min(a2.outer()) > max(a.outer()) and min(b2.outer()) > max(b.outer())
    assert all(n.of("step")[0]["step"] > 1 for n in (a2, b2)), saved
    e2e.assert_identical(nodes)


# a store restarted at a chosen moment: its imports (seconds on a loaded machine) are done beforehand
PRIMED_STORE = """import os, sys, time
import torch.distributed
print("primed", file=sys.stderr, flush=True)
go, deadline = sys.argv[1], time.monotonic() + 600
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.02)
from engine.store.server import main
sys.exit(main(sys.argv[2:]))
"""


def test_store_killed_and_restarted_the_nodes_go_on_then_store_gone_for_good_they_checkpoint_and_fail(
        procs, port, tmp_path):
    e2e = _engine()
    store = e2e.start_store(procs, port)
    steps = ["--train.max_steps=3000", "--diloco.min_nodes=2", "--mesh.store_lost_timeout=8"]
    a, b = (e2e.start_node(procs, port, n, tmp_path, *steps) for n in "ab")
    nodes = [a, b, store]
    e2e.wait_for(lambda: all(2 in n.outer() for n in (a, b)), 180, "outer step 2", nodes)
    go = tmp_path / "go-store"
    again = e2e.Node(procs, "store (restarted)", [sys.executable, "-c", PRIMED_STORE, str(go), "--host", "127.0.0.1",
                                                  "--port", str(port)])
    wait_for(lambda: "primed" in again.err, 120, "the second store's imports", [again])
    os.killpg(store.proc.pid, signal.SIGKILL)
    before = {n.name: max(n.outer()) for n in (a, b)}
    time.sleep(2.0)
    trained = a.last_step()
    time.sleep(1.0)
    assert a.proc.poll() is None and b.proc.poll() is None, a.report() + b.report()
    go.touch()  # the same port, an empty store
    store = again
    nodes = [a, b, store]
    e2e.wait_for(lambda: all(max(n.outer()) >= max(before.values()) + 3 for n in (a, b)), 120,
                 "three more outer steps in the re-formed run", nodes)
    assert a.last_step() > trained  # inner steps went on while the store was away or right after
    common = set(a.outer()) & set(b.outer())
    after = [k for k in common if k > max(before.values()) + 1]
    assert after and all(a.outer()[k]["checksum"] == b.outer()[k]["checksum"] for k in after)
    assert any("restarted empty" in w["message"] for w in a.of("warning"))

    os.killpg(store.proc.pid, signal.SIGKILL)  # now for good
    lost = time.time()
    for n in (a, b):
        assert n.proc.wait(timeout=60) == 1, n.report()
        end = n.of("run_end")[-1]
        assert end["status"] == "failed" and end["ts"] - lost < 8 + 10
        assert n.of("checkpoint")[-1]["step"] == end["step"]  # nothing trained is lost
        assert "Traceback" not in n.err and "store_lost_timeout" in n.err


def _tree(root: int) -> set[int]:
    """root and every descendant (the script's nodes run torchrun, whose workers start new sessions)."""
    import subprocess
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    parent = {int(a): int(b) for a, b in (line.split() for line in out.splitlines())}
    keep, grew = {root}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in keep and p not in keep}
        keep |= new
        grew = bool(new)
    return keep


def test_simulate_script_prefixes_every_node_and_ctrl_c_leaves_no_process(procs, tmp_path):
    """scripts/simulate_multi_node.sh with the real engine: 2 nodes x 1 worker; SIGINT (Ctrl-C) stops all."""
    script = Node(procs, ["bash", str(ROOT / "scripts/simulate_multi_node.sh"), "--timeout", "240", "--run-dir",
                          str(tmp_path / "sim"), "2", "1", "configs/debug-diloco.toml", "--train.max_steps=400",
                          "--train.eval_interval=0"])

    def outer_steps(node: str) -> list[str]:
        return [l for l in script.lines if l.startswith(f"[{node}] {{") and '"type":"outer_step"' in l]
    try:
        wait_for(lambda: outer_steps("node-0") and outer_steps("node-1"), 180, "an outer step of both nodes",
                 [script])
    except AssertionError as e:  # each part's own last lines: one node's failure can hide behind another's
        tails = {p: [l for l in script.lines if l.startswith(f"[{p}") and '"type":"heartbeat"' not in l][-8:]
                 for p in ("sim", "store", "node-0", "node-1")}
        raise AssertionError(f"{e}\n" + "".join(f"--- {p}:\n{''.join(t)}" for p, t in tails.items())) from None
    tree = _tree(script.proc.pid)
    assert len(tree) >= 8  # script, store, 2 x (wrapper, sed, torchrun, worker)
    script.proc.send_signal(signal.SIGINT)  # the script alone, as a terminal's Ctrl-C reaches the foreground
    assert script.proc.wait(timeout=60) == 130
    deadline = time.monotonic() + 10  # the script waits for its children; their own reaping may trail it a little
    while left := [p for p in tree if os.path.exists(f"/proc/{p}") and p != script.proc.pid]:
        assert time.monotonic() < deadline, f"processes left behind: {left}"
        time.sleep(0.1)
    ends = {l.split("]")[0][1:]: json.loads(l.split("] ", 1)[1]) for l in script.lines
            if '"type":"run_end"' in l and l.startswith("[node-")}
    assert {n: e["status"] for n, e in ends.items()} == {"node-0": "stopped", "node-1": "stopped"}
    assert any(l.startswith("[store] ") and '"state":"stopped"' in l for l in script.lines)
    sums = {json.loads(l.split("] ", 1)[1])["checksum"] for l in outer_steps("node-0")[:1] + outer_steps("node-1")[:1]}
    assert len(sums) == 1  # the first outer step left both nodes with the same weights


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        sys.exit(node_main(sys.argv[2:]))
    sys.exit("usage: python tests/test_mesh_live.py node --port P --id ID [--steps N] [--min-nodes M]")
