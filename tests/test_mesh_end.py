"""A node left out near the end of a run (frozen, a slow link) asks to join again. When every member of the run
completes it meanwhile, nobody will admit it: it ends at once, completed, instead of waiting out
mesh.join_timeout (600 s by default) and failing with "is any member of the run alive?"."""

from __future__ import annotations

import json

import pytest

from engine.mesh import Excluded, MeshError, Stopped
from mesh_sim import CFG, Sim, _post_all_ok, _run_committed


def _left_out(sim: Sim) -> None:
    """a, b and c commit outer step 0; c is late for outer step 1, which a and b commit without it."""
    sim.start("a", "b", "c")
    _run_committed(sim, 0, ["a", "b", "c"])
    for n in "ab":
        sim.nodes[n].arrive(1, 0)
    plan = None
    while plan is None:  # c keeps beating but does not arrive: planned without it after store_timeout
        plan = sim.nodes["a"].poll_plan(1, 0)
        sim.sleep(CFG.polling_interval)
    assert plan.members == ("a", "b")
    _post_all_ok(sim, plan, "ab")
    for n in "ab":
        assert sim.nodes[n].commit(plan, True)
    sim.nodes["c"].arrive(1, 0)
    with pytest.raises(Excluded):
        sim.nodes["c"].poll_plan(1, 0)


def test_a_node_waiting_to_join_a_run_every_member_completed_ends_at_once():
    sim = Sim()
    _left_out(sim)
    for n in "ab":
        sim.nodes[n].leave("completed")
        sim.kill(n)
    t0 = sim.t
    with pytest.raises(Stopped, match="ended while waiting for admission") as stopped:
        sim.nodes["c"].wait_admission()
    assert stopped.value.reason == "ended" and sim.t - t0 <= 1.0
    warning = [e["message"] for e in sim.events if e["type"] == "warning" and e["node"] == "c"][-1]
    assert warning.startswith("the run completed at outer step 1 (a, b left it) while node c waited to join: it "
                              "ends with its own weights of outer step 0"), warning


@pytest.mark.timeout(60)  # before the fix this wait never ended: each pass failed on a deleted key and started over
def test_a_joiner_whose_own_heartbeat_pruned_the_completed_members_still_ends_at_once():
    """The race of the real run below: a woken node's heartbeat takes the lease and, once the members that left are
    silent for two heartbeat timeouts, prunes them (their keys deleted one prune later) before its loop asks to join;
    it then waited on a deleted key (TCPStore: mesh.store_timeout, then a store error, and the wait started over,
    again and again). A node outside the latest plan leaves that plan's members registered: their states say that
    the run completed, and it ends at once."""
    sim = Sim()
    _left_out(sim)
    for n in "ab":
        sim.nodes[n].leave("completed")
        sim.kill(n)
    sim.advance(4 * CFG.heartbeat_timeout)  # c leads, its loop still busy elsewhere
    assert sim.leader() == "c"
    assert json.loads(sim.store.get("zb/ids"))["ids"] == ["a", "b", "c"]  # not pruned: members of the latest plan
    t0 = sim.t
    with pytest.raises(Stopped, match="ended while waiting for admission"):
        sim.nodes["c"].wait_admission()
    assert sim.t - t0 <= 1.0


@pytest.mark.timeout(60)  # before the fix this wait never ended (as above)
def test_a_joiner_that_finds_a_members_state_gone_waits_out_join_timeout_not_forever():
    """A member of the latest plan pruned by another member (its state key deleted): the joiner cannot tell how it
    left, so it waits on as for a drained member, and fails at mesh.join_timeout; it does not wait on the deleted key
    (TCPStore: mesh.store_timeout, then a store error, and the wait started over)."""
    sim = Sim()
    _left_out(sim)
    for n in "ab":
        sim.nodes[n].leave("completed")
        sim.kill(n)
    sim.store.delete_key("zb/state/a")
    t0 = sim.t
    with pytest.raises(MeshError, match="not admitted within mesh.join_timeout"):
        sim.nodes["c"].wait_admission()
    assert CFG.join_timeout <= sim.t - t0 <= CFG.join_timeout + 1.0


def test_a_node_waiting_to_join_waits_on_while_a_member_only_drained():
    """A drained member may be started again and admit it: the joiner waits as before (up to join_timeout)."""
    sim = Sim()
    _left_out(sim)
    sim.nodes["a"].leave("drained")
    sim.nodes["b"].leave("completed")
    for n in "ab":
        sim.kill(n)
    t0 = sim.t
    with pytest.raises(MeshError, match="not admitted within mesh.join_timeout"):
        sim.nodes["c"].wait_admission()
    assert sim.t - t0 >= CFG.join_timeout


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_node_frozen_until_the_run_completed_ends_completed_without_an_export(procs, port, tmp_path, mode):
    """Real engines: b is frozen (SIGSTOP) past the heartbeat timeout after outer step 2, and a completes the run
    alone. Woken, b is left out and asks to join: it ends at once with exit 0, run_end completed, a warning that
    says why, its checkpoint, and no export (its weights are not the run's final model); a exported. With
    diloco.overlap the ask happens in the outer step in flight, and reaches the loop when it lands."""
    import os
    import signal
    import time

    import test_diloco_e2e as e2e
    e2e.start_store(procs, port)
    steps = ["--diloco.min_nodes=2", "--train.max_steps=15",  # H = 3: 5 outer steps
             *(["--diloco.overlap=true"] if mode == "overlap" else [])]
    nodes = [e2e.start_node(procs, port, n, tmp_path, *steps, f"--ckpt.export_dir={tmp_path / n / 'export'}")
             for n in "ab"]
    a, b = nodes
    e2e.wait_for(lambda: 2 in b.outer(), 180, "outer step 2", nodes)
    os.killpg(b.proc.pid, signal.SIGSTOP)
    try:
        assert e2e.finish(a, 120, nodes) == 0, a.report()
    finally:
        os.killpg(b.proc.pid, signal.SIGCONT)
    woken = time.monotonic()
    assert e2e.finish(b, 60, nodes) == 0, b.report()
    assert time.monotonic() - woken < 30, b.report()  # not mesh.join_timeout (60 s here)
    assert max(a.outer()) == 5 and a.outer()[5]["members"] == ["a"] and max(b.outer()) < 5, b.report()
    assert b.of("run_end")[-1]["status"] == "completed"
    warnings = " | ".join(e["message"] for e in b.of("warning"))
    assert "the run completed at outer step 5 (a left it) while node b waited to join" in warnings, warnings
    assert "nothing exported" in warnings and not (tmp_path / "b" / "export").exists(), warnings
    assert (tmp_path / "a" / "export" / "model.safetensors").is_file()
    assert b.of("checkpoint")[-1]["step"] == b.of("run_end")[-1]["step"]
