"""A DiLoCo run of three real engines on the etcd backend keeps training while etcd members die: a real 3-member
etcd cluster (TLS, client certificates) on loopback ports, a follower member SIGKILLed and restarted, then the Raft
leader SIGKILLed and restarted. The oracle: every node commits every outer step (none lost, none redone by an
eviction), the checksums agree at every outer step, and no outer step waits longer than the run's usual round plus
the heartbeat timeout plus one election timeout."""

from __future__ import annotations

import shutil
import statistics
import sys
import time
import tempfile
import uuid
from pathlib import Path

import pytest

from etcd_cluster import ELECTION_MS, EtcdTestCluster
from procs import ProcessTracker
from test_diloco_e2e import CONFIG, FAST, H, Node, assert_identical, finish, wait_for

OUTER_STEPS = 16
SLACK_S = 1.0  # a loaded 2-core machine: scheduling noise on top of the bound the issue sets
# On etcd every store call is an HTTPS request and every write a Raft commit (three per beat, more around a
# boundary): on a loaded 2-core machine with three members on it a beat can take most of a second, so the tcp
# tests' 0.2 s / 1.5 s would declare healthy nodes dead. A leader's loss delays a beat by up to one election (1-2 s
# at ELECTION_MS) plus one request timeout (a quarter of the timeout): 3 s left a beat that started just before
# the kill no margin (a healthy node declared dead in 1 of 14 runs); docs/operations.md gives the rule
HB, HB_TIMEOUT = 0.5, 4.0


def _etcd_args(etcd: EtcdTestCluster) -> list[str]:
    tls = etcd.tls
    return [f"--mesh.heartbeat_interval={HB}", f"--mesh.heartbeat_timeout={HB_TIMEOUT}",
            "--mesh.store_backend=etcd", f"--mesh.etcd_endpoints={','.join(etcd.endpoints)}",
            f"--mesh.etcd_prefix=e2e/{uuid.uuid4().hex[:8]}/", f"--mesh.etcd_ca={tls.ca}",
            f"--mesh.etcd_cert={tls.cert}", f"--mesh.etcd_key={tls.key}"]


def _kill_and_restart(etcd: EtcdTestCluster, member: str, nodes: list[Node], outer_steps: int) -> float:
    """SIGKILL a member, let the run go on for `outer_steps` outer steps on two members, restart it."""
    before = max(max(n.outer(), default=0) for n in nodes)
    etcd.kill(member)
    wait_for(lambda: all(before + outer_steps in n.outer() for n in nodes), 120,
             f"{outer_steps} outer steps with {member} down", nodes)
    etcd.restart(member)
    etcd.wait_healthy(60)
    return before


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_diloco_keeps_training_through_the_loss_of_any_etcd_member_leader_included():
    procs = ProcessTracker()
    folder = Path(tempfile.mkdtemp(prefix="zb-etcd-e2e-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    etcd = EtcdTestCluster(folder).start()
    run_dir = folder / "run"
    try:
        steps = [f"--train.max_steps={OUTER_STEPS * H}", "--diloco.min_nodes=3", *_etcd_args(etcd)]  # one prefix
        nodes = [Node(procs, name, [sys.executable, "-m", "engine.train", CONFIG, *FAST, *steps,
                                    f"--mesh.node_id={name}", f"--run.dir={run_dir / name}"]) for name in "abc"]
        wait_for(lambda: all(2 in n.outer() for n in nodes), 240, "outer step 2 on every node", nodes)
        leader = etcd.leader()
        follower = next(m.name for m in etcd.members if m.name != leader)
        _kill_and_restart(etcd, follower, nodes, 2)
        leader = etcd.leader()  # may have moved meanwhile: kill whoever leads now
        killed_leader_at = _kill_and_restart(etcd, leader, nodes, 2)
        assert etcd.leader() is not None
        codes = {n.name: finish(n, 240, nodes) for n in nodes}
    finally:
        procs.kill_all()
        etcd.stop()
        shutil.rmtree(folder, ignore_errors=True)
    assert codes == {"a": 0, "b": 0, "c": 0}, "\n".join(n.report() for n in nodes)
    for n in nodes:  # no committed outer step lost, nobody evicted or redone
        assert sorted(n.outer()) == list(range(1, OUTER_STEPS + 1)), n.report()
        assert all(e["members"] == ["a", "b", "c"] for e in n.of("outer_step")), n.report()
        assert not [e for e in n.of("membership") if e["change"] == "dead"], n.report()
    assert_identical(nodes)
    assert killed_leader_at >= 4
    # no stall: each outer step's wall time at most the usual one plus heartbeat timeout plus an election
    for n in nodes:
        ts = [n.outer()[k]["ts"] for k in range(1, OUTER_STEPS + 1)]
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        usual = statistics.median(gaps)
        worst = max(gaps)
        assert worst <= usual + HB_TIMEOUT + ELECTION_MS / 1000 + SLACK_S, (n.name, gaps)
    print("outer-step gaps (s):", [round(g, 2) for g in gaps])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_diloco_waits_out_a_lost_quorum_and_loses_nothing():
    """Two of three members SIGKILLed for 8 s (more than the heartbeat timeout, less than mesh.store_timeout): no
    store call can succeed, inner steps go on, outer steps wait; once the quorum is back the run continues with
    every member (no observer takes the silence it could not see for a death)."""
    procs = ProcessTracker()
    folder = Path(tempfile.mkdtemp(prefix="zb-etcd-e2e-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    etcd = EtcdTestCluster(folder).start()
    run_dir = folder / "run"
    # rounds long enough that the quorum goes while the nodes are inside one: a node waiting at a boundary needs
    # the store, and with the usual H = 3 all three can be there when the members die
    inner, outer_steps = 12, 6
    try:
        # a loaded 2-core machine (three engines, three etcd members) slows every heartbeat tick past mesh.slow_tick,
        # and a member kept 2 s from its group took itself for a straggler on a slow link and stepped out of outer
        # step 1 (CI, stop 27): this test is about the quorum, so no step-outs
        steps = [f"--train.max_steps={outer_steps * inner}", f"--diloco.inner_steps={inner}", "--diloco.min_nodes=3",
                 "--diloco.straggler_timeout=60", *_etcd_args(etcd)]
        nodes = [Node(procs, name, [sys.executable, "-m", "engine.train", CONFIG, *FAST, *steps,
                                    f"--mesh.node_id={name}", f"--run.dir={run_dir / name}"]) for name in "abc"]
        wait_for(lambda: all(2 in n.outer() for n in nodes), 240, "outer step 2 on every node", nodes)
        wait_for(lambda: all(3 in n.outer() for n in nodes), 240, "outer step 3 on every node", nodes)
        lost = [m.name for m in etcd.members[:2]]
        before = max(max(n.outer()) for n in nodes)
        steps_before = {n.name: n.last_step() for n in nodes}
        for name in lost:  # just after a commit: every node has most of a round of inner steps ahead
            etcd.kill(name)
        time.sleep(8.0)  # well past the heartbeat timeout, within mesh.store_timeout (20 s)
        trained_meanwhile = min(n.last_step() - steps_before[n.name] for n in nodes)
        assert max(max(n.outer()) for n in nodes) <= before + 1  # outer steps wait (one may have been past the store)
        for name in lost:
            etcd.restart(name)
        etcd.wait_healthy(60)
        codes = {n.name: finish(n, 240, nodes) for n in nodes}
    finally:
        procs.kill_all()
        etcd.stop()
        shutil.rmtree(folder, ignore_errors=True)
    assert codes == {"a": 0, "b": 0, "c": 0}, "\n".join(n.report() for n in nodes)
    print("inner steps trained by the slowest node while the quorum was gone:", trained_meanwhile)
    assert trained_meanwhile >= 1  # inner steps went on without the store
    for n in nodes:
        assert sorted(n.outer()) == list(range(1, outer_steps + 1)), n.report()
        assert all(e["members"] == ["a", "b", "c"] for e in n.of("outer_step")), n.report()
    assert_identical(nodes)
