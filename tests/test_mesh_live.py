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
        while args.start_after >= 0 and not (store.check(["zb/plan/latest"]) and
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
    """What engine/diloco.py does around the mesh, with a one-number all-reduce for the pseudo-gradient."""
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
        print("RESULT " + json.dumps({"k": k, "attempt": attempt, "generation": plan.generation,
                                      "members": list(plan.members), "joiners": list(plan.joiners),
                                      "leaving": list(plan.leaving), "sum": total, "committed": committed,
                                      "leader": mesh.is_leader, "t": time.monotonic()}), flush=True)
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
            if line.startswith("RESULT "):
                self.results.append(json.loads(line[7:]))
            elif line.startswith("{"):
                self.events.append(json.loads(line))

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
    assert min(takeovers()) - killed_at < HB_TIMEOUT + 2 * HB + 1.5
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
    wait_for(lambda: outer_steps("node-0") and outer_steps("node-1"), 180, "an outer step of both nodes", [script])
    tree = _tree(script.proc.pid)
    assert len(tree) >= 8  # script, store, 2 x (wrapper, sed, torchrun, worker)
    script.proc.send_signal(signal.SIGINT)  # the script alone, as a terminal's Ctrl-C reaches the foreground
    assert script.proc.wait(timeout=60) == 130
    time.sleep(0.5)
    left = [p for p in tree if os.path.exists(f"/proc/{p}") and p != script.proc.pid]
    assert not left, f"processes left behind: {left}"
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
