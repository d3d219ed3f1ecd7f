"""Rounds by time on real engines (diloco.round = "time"): a node half as fast trains fewer steps in each round,
ends it at the same deadline, and weighs by the tokens it trained; the checksums stay identical."""

from __future__ import annotations

import sys

import test_diloco_e2e as e2e

# Test-side slowdown, no hook in the engine: every inner step of this node sleeps `s` seconds more
SLOW = """import sys, time
import engine.session as session, engine.train as t
_step = session.train_step
def _slow(*a, **k):
    time.sleep({s})
    return _step(*a, **k)
session.train_step = _slow
sys.argv = ["engine.train"] + sys.argv[1:]
t.cli()
"""
ROUND_S = 2.0
TIMED = ["--diloco.round=time", f"--diloco.round_seconds={ROUND_S}", "--diloco.min_nodes=2",
         "--train.max_steps=12"]  # H = 3: 4 rounds, whatever each node's speed


def test_time_rounds_end_together_and_weigh_each_node_by_its_tokens(procs, port, tmp_path):
    e2e.start_store(procs, port)
    fast = e2e.start_node(procs, port, "a", tmp_path, *TIMED)
    args = [e2e.CONFIG, *e2e.FAST, f"--mesh.store_port={port}", "--mesh.node_id=b", f"--run.dir={tmp_path / 'b'}",
            *TIMED]
    slow = e2e.Node(procs, "b", [sys.executable, "-c", SLOW.format(s=0.25), *args])
    nodes = [fast, slow]
    for n in nodes:
        assert e2e.finish(n, 240, nodes) == 0, n.report()
        assert n.of("run_end")[-1]["status"] == "completed"
    e2e.assert_identical(nodes)
    a, b = fast.outer(), slow.outer()
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]  # the run is measured in rounds, the same on both
    assert fast.of("run_start")[0]["rounds"] == 4  # and says so, for the console's progress and ETA
    for k in (2, 3, 4):  # the first round also holds the start-up, the formation's wait
        ea, eb = a[k], b[k]
        assert ea["contributors"] == ["a", "b"] and ea["weights"] == eb["weights"]
        wa, wb = ea["weights"]
        # each weight is the tokens that node trained in its round: 64 per step (2 x 32)
        assert wa == 64 * (ea["step"] - a[k - 1]["step"]) and wb == 64 * (eb["step"] - b[k - 1]["step"])
        assert wa > 1.5 * wb, (k, wa, wb)  # the fast node trained more in the same time, and counts for more
    # the rounds end at the deadline the plan set: one round apart, on both nodes
    gaps = [a[k]["ts"] - a[k - 1]["ts"] for k in (3, 4)]
    assert all(0.6 * ROUND_S < g < 2.0 * ROUND_S for g in gaps), gaps
    assert abs(a[4]["ts"] - b[4]["ts"]) < 1.0


def test_a_node_that_rejoins_keeps_its_own_step_count_and_its_checkpoints(procs, port, tmp_path):
    """Defect: with time rounds each node counts its own steps, and a joiner took its source's counters. b, the
    fast node, frozen past the heartbeat timeout and left out, re-joined from a, the slow one: its step went back
    to a's, and its next periodic checkpoint met a folder it had saved before ("step-N already exists": exit 2).
    b keeps its own count now: its steps and its checkpoints only go forward, and both finish identical."""
    import os
    import signal
    e2e.start_store(procs, port)
    # 12 rounds: a busy machine (CI) takes a few rounds to wake b and re-admit it
    timed = [*TIMED[:-1], "--diloco.round_seconds=1.2", "--train.max_steps=36", "--ckpt.interval=4",
             "--ckpt.keep=50"]
    args = [e2e.CONFIG, *e2e.FAST, f"--mesh.store_port={port}", "--mesh.node_id=a", f"--run.dir={tmp_path / 'a'}",
            *timed]
    slow = e2e.Node(procs, "a", [sys.executable, "-c", SLOW.format(s=0.25), *args])
    fast = e2e.start_node(procs, port, "b", tmp_path, *timed)
    nodes = [slow, fast]
    # b is frozen right after an outer step of both from step 2 on: on a loaded machine a, the slow node, may be left
    # out of step 2 itself (past its round's deadline; a clean-clone run saw it), and a joiner whose only source
    # then froze has nobody to take the run's state from: not what this test is about
    def both() -> list[int]:
        return [k for k, e in fast.outer().items() if k >= 2 and e["members"] == ["a", "b"]]
    e2e.wait_for(lambda: both(), 180, "an outer step of a and b from step 2 on", nodes)
    os.killpg(fast.proc.pid, signal.SIGSTOP)
    frozen = max(fast.outer())
    try:
        e2e.wait_for(lambda: any(e["members"] == ["a"] for e in slow.of("outer_step")), 60, "a alone", nodes)
    finally:
        os.killpg(fast.proc.pid, signal.SIGCONT)
    for n in nodes:
        assert e2e.finish(n, 240, nodes) == 0, n.report()
    back = min(k for k, e in fast.outer().items() if k > frozen)
    assert slow.outer().get(back, {}).get("members") == ["a", "b"], fast.report()  # it re-joined and is a member again
    # it counts its own steps: one after another through the freeze and the re-join (taking a's counters, it
    # jumped to a's count, back or forward: whether b was ahead of a there depends on the machine's load)
    steps = [e["step"] for e in fast.of("step")]
    saved = [e["step"] for e in fast.of("checkpoint")]
    assert steps == list(range(1, len(steps) + 1)) and saved == sorted(set(saved)), (steps, saved)
    latest = (tmp_path / "b" / "checkpoints" / "latest").read_text().strip()
    assert (tmp_path / "b" / "checkpoints" / latest).is_dir() and latest == f"step-{saved[-1]:08d}"
    e2e.assert_identical(nodes)
    # b missed the rounds a ran alone while b was frozen, and both ran to the last one (before the freeze a may
    # have missed a round of its own, step 2 on a loaded machine: only the rounds after the freeze are compared)
    missed = {k for k in slow.outer() if k > frozen} - set(fast.outer())
    assert missed and min(missed) < back and max(fast.outer()) == max(slow.outer()) == 12, (missed, back)


def test_time_rounds_with_overlap_end_on_the_agreed_model(procs, port, tmp_path):
    """Time rounds with diloco.overlap: the run ends at its last round's boundary, as with step rounds, and every
    node saves and exports the agreed model (the same weights on both). Before, finished() looked only at the
    committed outer steps, so each node trained on past the last boundary until the round in flight landed, and
    each exported its own weights."""
    import torch
    from safetensors.torch import load_file
    e2e.start_store(procs, port)
    timed = [*TIMED, "--diloco.overlap=true", "--diloco.round_seconds=1"]
    nodes = [e2e.start_node(procs, port, n, tmp_path, *timed, f"--ckpt.export_dir={tmp_path / n / 'export'}")
             for n in "ab"]
    for n in nodes:
        assert e2e.finish(n, 240, nodes) == 0, n.report()
    e2e.assert_identical(nodes)
    a, b = (load_file(tmp_path / n / "export" / "model.safetensors") for n in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the nodes exported other weights"
    for n in nodes:  # no inner step after the last boundary
        assert n.of("run_end")[-1]["step"] == max(e["step"] for e in n.of("outer_step")), n.report()
        # the LR follows the round clock, the round in flight counted: past the warm-up (5 steps, 2 rounds of 3)
        # the cosine only falls (it went back up by a round at each boundary until the round in flight landed)
        lrs = [e["lr"] for e in n.of("step") if e["outer_step"] >= 2]
        assert lrs and all(b <= a * (1 + 1e-9) for a, b in zip(lrs, lrs[1:])), lrs
