"""The chaos lab (tests/lab, scripts/chaos.py): its schedule and its verdict (pure), its network faults (real
namespaces and nftables), and the short run that CI makes: every fault kind once on a fixed seed, then the goals
of issue 13: every fault survived, no committed outer step lost, the survivors' checksums agree, no stall above
heartbeat_timeout + 2 s outside store outages, nothing left behind."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lab import net
from lab.lab import holding_lock as holding_lab_lock
from lab.schedule import KINDS, LEADER, Timing, make_schedule
from lab.verdict import agreement, frontier, judge, losses, stalls

ROOT = Path(__file__).resolve().parent.parent
HOSTS = ["a", "b", "c"]


# ---- the schedule ---------------------------------------------------------------------------------------------
def test_schedule_is_seeded_and_starts_with_every_kind_once():
    timing = Timing(heartbeat_timeout=2.0)
    first = make_schedule(7, 30, HOSTS, timing)
    assert [(f.kind, f.target, f.hold_s, f.percent) for f in first] == \
        [(f.kind, f.target, f.hold_s, f.percent) for f in make_schedule(7, 30, HOSTS, timing)]
    assert [f.kind for f in first] != [f.kind for f in make_schedule(8, 30, HOSTS, timing)]
    assert sorted(f.kind for f in first[:len(KINDS)]) == sorted(KINDS)
    assert len(first) == 30 and [f.index for f in first] == list(range(1, 31))
    for f in first:
        assert f.target == {"kill-leader": LEADER, "store": "store", "console": "console"}.get(f.kind, f.target)
        if f.kind in ("freeze", "link", "loss", "blackhole"):
            assert f.target in HOSTS and 1.0 <= f.hold_s <= 6.0
        if f.kind == "loss":
            assert 10 <= f.percent <= 40
        assert 2.0 <= f.gap_s <= 6.0
    assert [f.kind for f in make_schedule(7, 4, HOSTS, timing)] == [f.kind for f in first[:4]]


def test_a_shorter_gap_keeps_the_rest_of_the_seeds_schedule():
    """--gap narrows the quiet time only (the CI run's): the same kinds, targets, holds and losses, in order."""
    usual, short = (make_schedule(13, 12, HOSTS, Timing(2.0, gap=gap)) for gap in ((2.0, 6.0), (0.5, 1.5)))
    assert [(f.kind, f.target, f.hold_s, f.percent) for f in usual] == \
        [(f.kind, f.target, f.hold_s, f.percent) for f in short]
    assert all(0.5 <= f.gap_s <= 1.5 for f in short) and all(2.0 <= f.gap_s <= 6.0 for f in usual)


def test_schedule_kinds_can_be_narrowed_and_bad_input_is_one_line():
    only = make_schedule(3, 12, HOSTS, Timing(2.0), kinds=("kill", "drain"))
    assert {f.kind for f in only} == {"kill", "drain"}
    with pytest.raises(ValueError, match="--kinds: unknown reboot; known: kill"):
        make_schedule(3, 2, HOSTS, Timing(2.0), kinds=("kill", "reboot"))
    with pytest.raises(ValueError, match="--faults: must be >= 0"):
        make_schedule(3, -1, HOSTS, Timing(2.0))


def test_bad_arguments_are_one_line_each(capsys):
    from lab.cli import main

    assert main(["--kinds", "kill,reboot"]) == 2
    assert capsys.readouterr().err == ("chaos: --kinds: unknown reboot; known: kill, kill-leader, freeze, link, loss, "
                                       "blackhole, store, console, drain\n")
    assert main(["--faults", "-1"]) == 2 and capsys.readouterr().err == "chaos: --faults: must be >= 0, got -1\n"
    assert main(["--hosts", "1"]) == 2 and capsys.readouterr().err == "chaos: --hosts must be in 2..20, got 1\n"
    assert main(["--gap", "3,1"]) == 2
    assert capsys.readouterr().err == "chaos: --gap '3,1': expected LOW,HIGH seconds with 0 <= LOW <= HIGH\n"
    # values every engine refuses: the lab waited out its start (300 s) before it said anything
    assert main(["--inner-steps", "0"]) == 2 and capsys.readouterr().err == "chaos: --inner-steps must be >= 1, got 0\n"
    assert main(["--heartbeat-timeout", "-1"]) == 2
    assert capsys.readouterr().err == "chaos: --heartbeat-timeout must be > 0, got -1\n"
    # an --out that cannot be made: said first (a soak lost its report and logs to a traceback at its end)
    assert main(["--out", __file__]) == 2 and capsys.readouterr().err.startswith(f"chaos: --out {__file__}: ")


# ---- the verdict ----------------------------------------------------------------------------------------------
def outer(ts: float, index: int, checksum: str, members=("a", "b")) -> dict:
    return {"type": "outer_step", "ts": ts, "outer_step": index, "checksum": checksum, "members": list(members)}


def healthy_run(n: int = 6) -> dict[str, list[dict]]:
    return {node: [outer(100.0 + i, i, f"s{i}") for i in range(1, n + 1)] for node in ("a", "b")}


def commits(events):
    from lab.verdict import commits_of
    return commits_of(events)


def test_a_healthy_run_loses_nothing_and_agrees():
    events = healthy_run()
    events["c"] = [{"type": "run_start", "ts": 101.5}, outer(104.0, 4, "s4", "abc"), outer(105.0, 5, "s5", "abc")]
    lost = losses(commits(events))
    assert (lost.lost, lost.conflicts, lost.regressions, lost.skipped) == (set(), {}, [], [])
    assert agreement(commits(events), ["a", "b", "c"]) == (True, "a, b, c at outer step 5: s5")


def test_a_rollback_is_counted_as_lost_steps():
    events = healthy_run(6)
    # every node restarted from outer step 2's state (the store died, no checkpoint): 3..6 are redone
    for node in ("a", "b"):
        events[node] += [outer(120.0, 3, "t3"), outer(121.0, 4, "t4")]
    lost = losses(commits(events))
    assert lost.lost == {3, 4, 5, 6}
    assert sorted(lost.conflicts) == [3, 4] and lost.conflicts[3] == {"s3", "t3"}
    assert lost.regressions == [("a", 120.0, 6, 3), ("b", 120.0, 6, 3)]  # once per going back, not per redo
    text = "\n".join(judge(events, [], ["a", "b"], 122.0, [], 4.0).lines(t0=100.0))
    assert ("committed outer steps lost: 4 (conflicting commits: 3: ['s3', 't3'], 4: ['s4', 't4']; regressions: "
            "a 6->3 at +20.0s, b 6->3 at +20.0s; skipped indices: 0)") in text
    # the same rollback replayed bit for bit (no conflicting checksum) is still lost work
    replay = healthy_run(6)
    replay["a"] += [outer(120.0, 5, "s5")]
    assert losses(commits(replay)).lost == {5, 6}


def test_split_brain_and_disagreeing_survivors():
    events = {"a": [outer(1.0, 1, "x1"), outer(2.0, 2, "x2")], "b": [outer(1.0, 1, "x1"), outer(2.1, 2, "y2")]}
    assert losses(commits(events)).lost == {2}
    ok, line = agreement(commits(events), ["a", "b"])
    assert not ok and line == "at outer step 2: a x2, b y2"
    assert agreement(commits({"a": [outer(1.0, 1, "x")], "b": [outer(2.0, 2, "y")]}), ["a", "b"]) == \
        (False, "no outer step committed by every survivor (a, b)")
    assert agreement(commits(events), []) == (False, "no survivors")


def test_stalls_excuse_only_store_outages():
    events = {"a": [outer(10.0, 1, "s"), outer(11.0, 2, "s"), outer(20.0, 3, "s"), outer(22.0, 4, "s")],
              "b": [outer(21.0, 3, "s")]}  # a later copy of a commit does not advance the frontier
    front = frontier(commits(events))
    assert front == [(10.0, 1), (11.0, 2), (20.0, 3), (22.0, 4)]
    every = stalls(front, end=23.5, store_down=[(12.0, 17.0)])
    assert [(s.start, s.seconds, s.excused) for s in every] == [(10.0, 1.0, 0.0), (11.0, 9.0, 5.0),
                                                               (20.0, 2.0, 0.0), (22.0, 1.5, 0.0)]
    verdict = judge(events, [], ["a", "b"], 23.5, [(12.0, 17.0)], stall_limit=4.0)
    assert verdict.worst is not None and verdict.worst.counted == 4.0 and verdict.ok
    strict = judge(events, [], ["a", "b"], 23.5, [(12.0, 14.0)], stall_limit=4.0)
    assert not strict.ok and strict.reasons == ["a stall of 7.0s exceeds 4.0s"]
    # each kind of fault is charged with the longest counted stall that overlaps it (injection to recovery)
    from lab.schedule import Fault
    loss = Fault(1, "loss", "a", 2.0, 1.0, percent=20, start=12.5, healed=14.5, recovered=20.0)
    kill = Fault(2, "kill", "b", 0.0, 1.0, start=21.0, recovered=21.5)
    charged = judge(events, [loss, kill], ["a", "b"], 23.5, [(12.0, 17.0)], stall_limit=4.0)
    assert charged.by_kind() == {"loss": 4.0, "kill": 2.0}
    assert "longest stall by fault kind: kill 2.0s, loss 4.0s" in "\n".join(charged.lines(t0=10.0))


def test_verdict_fails_on_each_goal_and_says_which():
    from lab.schedule import Fault

    survived = Fault(1, "store", "store", 0.0, 1.0, start=1.0, survived=True, info=["the lab restarted the store"])
    failed = Fault(2, "store", "store", 3.0, 1.0, start=5.0, survived=False, notes=["a exited (run_end failed)"])
    never = Fault(3, "drain", "b", 0.0, 1.0)
    verdict = judge(healthy_run(), [survived, failed, never], ["a", "b"], 107.0, [], 4.0, ["the console exited"])
    assert verdict.reasons == ["1 fault(s) not survived", "1 fault(s) never injected", "the console exited"]
    text = "\n".join(verdict.lines(t0=100.0))
    assert "faults injected 2 of 3, survived 1" in text
    assert "NOT SURVIVED #2 store store for 3.0s: a exited (run_end failed)" in text
    assert "\n  #1 store store: the lab restarted the store\n" in text  # what a fault found, though survived
    assert "never injected: #3 drain b" in text
    assert "committed outer steps lost: 0" in text and "survivors' checksums agree: yes" in text
    assert text.endswith("verdict: FAIL: 1 fault(s) not survived; 1 fault(s) never injected; the console exited")
    assert judge({"a": []}, [], ["a"], 1.0, [], 4.0).reasons == ["survivors' checksums differ",
                                                                 "no outer step was ever committed"]


# ---- the network faults, for real (root, ip netns, nftables) ---------------------------------------------------
@pytest.fixture
def lab_lock():
    with holding_lab_lock():
        yield


def reachable(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((address, port), timeout=timeout).close()
        return True
    except OSError:
        return False


@pytest.mark.timeout(900)  # up to 600 s waiting for another test worker's lab to give up the lock
def test_link_loss_and_blackhole_in_a_namespace_and_nothing_left_behind(lab_lock):
    net.cleanup_leftovers()
    host = net.NetHost("t", 10)
    listener = None
    try:
        net.create_bridge()
        net.create_host(host)
        listener = subprocess.Popen(host.exec_args(sys.executable, "-c", (
            "import socket, time\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('{host.address}', 7001)); s.listen(64)\n"
            "while True:\n    c, _ = s.accept(); c.close()\n")), start_new_session=True)
        deadline = time.monotonic() + 20
        while not reachable(host.address, 7001):
            assert time.monotonic() < deadline and listener.poll() is None, "listener in the namespace"
            time.sleep(0.1)
        net.drop(host, 100)
        assert not reachable(host.address, 7001)  # blackhole: the link is up, nothing passes
        net.clear_drop(host)
        assert reachable(host.address, 7001)
        net.drop(host, 50)  # half the SYNs and half the answers dropped: a quarter of quick tries get through
        ok = sum(reachable(host.address, 7001, timeout=0.3) for _ in range(20))
        assert 0 < ok < 16, ok  # P(0) = 0.3%, P(>= 16) < 1e-6
        net.clear_drop(host)
        net.link(host, up=False)
        assert not reachable(host.address, 7001)
        net.link(host, up=True)
        deadline = time.monotonic() + 10
        while not reachable(host.address, 7001):
            assert time.monotonic() < deadline, "reachable again after the link came up"
            time.sleep(0.1)
        with pytest.raises(ValueError, match="percent must be in 1..100, got 0"):
            net.drop(host, 0)
    finally:
        gone = net.cleanup_leftovers()
        if listener is not None:
            listener.wait(timeout=10)  # killed with its namespace
    assert "zbc-t" in gone and "zbc-br" in gone
    assert net.leftovers() == ([], [])
    assert listener.returncode == -9


# ---- the short chaos run ----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1200)  # 480 s of lab, and up to 600 s waiting for a lab another test run started
def test_short_chaos_run_meets_every_goal(tmp_path):
    """scripts/chaos.py on a fixed seed with one fault of each kind (about 1.5 minutes alone on 2 cores; the quiet
    after each recovery drawn from 0.5-1.5 s instead of 2-6 s), the engines on diloco.compression = "sparse": the
    codec with the most state (each node's accumulator, reset on every hand-off) goes through every fault kind. The
    same kinds on the dense codec: tests/test_diloco_e2e.py (join, a follower's and the leader's SIGKILL, a death
    inside the all-reduce, a drain, a stalled node), tests/test_mesh_end.py (a freeze), tests/test_mesh_live.py (the
    store killed and restarted), tests/test_etcd_e2e.py (an etcd member lost), and the soaks of docs/reliability.md."""
    out, started = tmp_path / "out", time.time()
    # The stall limit here is three times the lab's default (heartbeat_timeout + 2 s = 4 s, which the soak keeps
    # and this schedule met alone on 2 cores: 3.9 s): a loaded 2-core CI machine can stretch a leader kill or 21%
    # packet loss by a few seconds. It still catches a wait for a timeout (the drain-then-add defect stalled the
    # run 30 s, the store restart 20 s). docs/reliability.md records the stalls measured.
    args = [sys.executable, str(ROOT / "scripts" / "chaos.py"), "--seed", "13", "--faults", str(len(KINDS)),
            "--deadline", "480", "--lock-wait", "600", "--stall-limit", "12", "--gap", "0.5,1.5", "--out", str(out),
            "--compression", "sparse"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1150, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    report = done.stdout + done.stderr
    with holding_lab_lock():  # (no other lab is running now)
        assert net.leftovers() == ([], []), report  # namespaces, veths and the bridge are gone
        assert not [p for p in Path("/tmp").glob("zbc-lab-*") if p.stat().st_mtime >= started], report
    injected = re.search(r"seed 13: (.*)", report)
    assert injected is not None, report
    assert sorted(re.findall(r"#\d+ ([a-z-]+)", injected.group(1))) == sorted(KINDS)
    assert "committed outer steps lost: 0 " in report, report
    assert "survivors' checksums agree: yes" in report, report
    assert f"faults injected {len(KINDS)} of {len(KINDS)}, survived {len(KINDS)}" in report, report
    assert "verdict: PASS" in report and done.returncode == 0, report
    assert "compression sparse" in (out / "report.txt").read_text()
    # the engines ran it: every outer step of every node carries its accumulator's norm
    steps = [e for path in (out / "logs").glob("*-events.jsonl") for e in _events(path) if e["type"] == "outer_step"]
    assert len(steps) > 20 and all("residual_norm" in e for e in steps), len(steps)
    assert (out / "timeline.png").stat().st_size > 10_000 and (out / "report.txt").read_text()


def _events(path: Path) -> list[dict]:
    """A node's events, less a line a kill tore (the verdict counts those)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


@pytest.mark.timeout(900)  # up to 600 s waiting for another test worker's lab to give up the lock
def test_cleanup_removes_what_a_killed_lab_left(capsys):
    """`scripts/chaos.py --cleanup`: namespaces with what runs in them, links, the lab's consoles, its temp dirs. It
    refuses while a lab holds the lock. The test holds the lock throughout (the tests run two at a time: a cleanup
    between a release and the removal would take another worker's running lab apart), so the removal under it is
    remove_leftovers, what --cleanup runs once it has the lock."""
    from lab.cli import main
    from lab.lab import remove_leftovers

    with holding_lab_lock():
        net.cleanup_leftovers()
        net.sh(["ip", "netns", "add", "zbc-left"])
        net.sh(["ip", "link", "add", "zbc-lbr", "type", "bridge"])  # a link in the root namespace
        lab_dir = Path(tempfile.mkdtemp(prefix="zbc-lab-"))
        console = subprocess.Popen(["sh", "-c", "sleep 600", str(lab_dir / "chaos.toml")], start_new_session=True)
        stranger = subprocess.Popen(["sleep", "600"], start_new_session=True)  # not the lab's: must survive
        sleeper = subprocess.Popen(["ip", "netns", "exec", "zbc-left", "sleep", "600"], start_new_session=True)
        (lab_dir / "console.pids").write_text(f"{console.pid}\n{stranger.pid}\n")
        try:
            assert net.leftovers() == (["zbc-left"], ["zbc-lbr"])
            time.sleep(0.3)  # the sleeper has entered the namespace
            assert main(["--cleanup"]) != 0  # a lab (this test) holds the lock: nothing removed
            assert "a chaos lab is running" in capsys.readouterr().err
            assert net.leftovers() == (["zbc-left"], ["zbc-lbr"]) and lab_dir.exists() and console.poll() is None
            # a second lab refused by the lock touches nothing (it took the running lab's namespaces away)
            assert main(["--faults", "0", "--out", str(lab_dir / "out")]) == 2
            assert "another lab is running" in capsys.readouterr().err
            assert net.leftovers() == (["zbc-left"], ["zbc-lbr"]) and console.poll() is None
            gone = remove_leftovers()
            assert {"zbc-left", "zbc-lbr", f"console {console.pid}", str(lab_dir)} <= set(gone), gone
            assert net.leftovers() == ([], [])
            assert not lab_dir.exists()
            assert console.wait(timeout=10) == -9 and sleeper.wait(timeout=10) == -9
            assert stranger.poll() is None
        finally:
            for proc in (console, stranger, sleeper):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
            net.cleanup_leftovers()


def test_with_time_rounds_the_stall_limit_is_one_round_longer():
    """A commit comes once a round with diloco.round = "time": a gap of a round is the run's pace, not a stall."""
    from lab.lab import Options

    assert Options().limit == 4.0
    assert Options(round_seconds=1.5).limit == 5.5
    assert Options(round_seconds=1.5, stall_limit=12.0).limit == 12.0
