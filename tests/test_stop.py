"""`stop` returns only when nothing of the run is left on any host (issue 24, item 10).

Defect: right after `zeroband-console PROFILE stop` returned, the store's wrapper shell, the store's health probe and
the probe's wrapper still ran: Cluster.stop sent TERM to the store without waiting for it and never ended the probe.
Now every process of the run (engines, store, probe, the wrappers, and whatever they forked into their process
groups) is waited for, and KILLed after console.stop_timeout; a watching console does not start the store again.

The stand-ins (no torch) keep the shape of the real processes: a wrapper shell per process group (transport/commands
.py), an engine that takes a moment to end on TERM, a worker in an engine's group that ignores TERM (a hung rank),
a store that ends on TERM and a probe that polls the store's pid and ends on its own only at its next look.
Checked from /proc: no live process in any group the run's pid files name, none with its working directory in the
run's workdir.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import free_port, kill_recorded_groups

FAKE_ENGINE = r'''
import json, os, signal, sys, time
node = os.environ["GLOBAL_UNIQUE_ID"]
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
if os.environ.get("FAKE_MODE") == "stubborn-engine":  # a node hung in a collective: only a KILL ends it
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ.get("FAKE_MODE") == "stubborn-worker" and os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker of the node's group that ignores TERM: a hung rank
    time.sleep(300)
    os._exit(0)
def emit(type_, **f):
    print(json.dumps({"v": 1, "type": type_, "ts": time.time(), "node": node, "rank": 0, **f}), flush=True)
emit("run_start", pid=os.getpid(), host="h", world_size=1, config_digest="d", strategy="ddp", max_steps=100000)
emit("state", state="training")
step = 0
while not stop and step < 3000:
    step += 1
    emit("step", step=step, loss=1.0 / step, lr=1e-3, tokens_per_s=100.0, grad_norm=None)
    time.sleep(0.1)
time.sleep(0.5)  # a checkpoint on the way out
emit("run_end", status="stopped", step=step)
'''

FAKE_STORE = r'''
import json, signal, time
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
print(json.dumps({"v": 1, "type": "state", "ts": time.time(), "node": "store", "rank": -1, "state": "ready"}),
      flush=True)
for _ in range(3000):
    if stop:
        break
    time.sleep(0.1)
'''

FAKE_PROBE = r'''
import argparse, json, os, time
ap = argparse.ArgumentParser()
ap.add_argument("host"); ap.add_argument("port")
ap.add_argument("--store-pid", type=int); ap.add_argument("--interval", type=float); ap.add_argument("--out")
args = ap.parse_args()
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
for seq in range(1, 3000):
    if not alive(args.store_pid):  # like engine/store/probe.py: it ends only once it sees the store gone
        break
    sample = {"v": 1, "type": "heartbeat", "ts": time.time(), "node": "store", "rank": -1, "seq": seq, "peers": {},
              "keys": 1, "rtt_ms": 0.1}
    with open(args.out + ".tmp", "w") as f:
        f.write(json.dumps(sample) + "\n")
    os.replace(args.out + ".tmp", args.out)
    time.sleep(args.interval)
'''


def stand_ins(work: Path) -> None:
    (work / "engine" / "store").mkdir(parents=True)
    (work / "engine" / "__init__.py").write_text("")
    (work / "engine" / "train.py").write_text(FAKE_ENGINE)
    (work / "engine" / "store" / "__init__.py").write_text("")
    (work / "engine" / "store" / "__main__.py").write_text(FAKE_STORE)
    (work / "engine" / "store" / "probe.py").write_text(FAKE_PROBE)
    (work / "fake.toml").write_text("[data]\nfake = true\n")


def _live(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a live process; None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[2]))


def _below(roots: set[int]) -> set[int]:
    """Every process descending from one of roots, the roots included."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = set(roots), list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def leftovers(work: Path, run_dir: Path, consoles: tuple[int, ...] = ()) -> list[str]:
    """Every live process of the run: in a process group a pid file of the run names, or working in its workdir.
    The consoles' own short commands (`cd WORKDIR && cat ...`, below this test or below sshd) are not the run's:
    the run's processes are detached, their parent long gone."""
    groups = set()
    for pid_file in run_dir.glob("*/pid"):
        text = pid_file.read_text().strip()
        if text.isdigit():
            groups.add(int(text))
    consoles_own = _below({os.getpid(), *consoles})
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in consoles_own:
            continue
        live = _live(int(entry))
        if live is None:
            continue
        try:
            cwd = os.readlink(f"/proc/{entry}/cwd")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if live[1] in groups or cwd == str(work) or cwd.startswith(f"{work}/"):
            found.append(f"pid {entry} group {live[1]}: {cmd.strip()[:160]}")
    return found


def kill_groups(run_dir: Path) -> None:
    """Teardown: whatever a failing test left, by the process groups the run's pid files name."""
    kill_recorded_groups(run_dir.glob("*/pid"))


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _probe_runs(run_dir: Path) -> bool:
    pid = run_dir / "_store_probe" / "pid"
    return pid.is_file() and pid.read_text().strip().isdigit() and _live(int(pid.read_text())) is not None \
        and (run_dir / "_store_probe" / "health.json").is_file()


LOCAL = """\
[run]
name = "stop"
dir = "{run_dir}"
[store]
port = {port}
[engine]
config = "fake.toml"
[console]
poll_interval = 0.2
stop_timeout = 3
[defaults]
transport = "local"
python = "{python}"
workdir = "{work}"
[hosts.node-a]
[hosts.node-b]
env = {{ FAKE_MODE = "stubborn-worker" }}
[hosts.node-c]
env = {{ FAKE_MODE = "stubborn-engine" }}
"""


async def test_stop_waits_for_every_process_of_the_run(tmp_path):
    """Local hosts: stop() returns once the engines, the hung worker and the hung engine (KILLed after
    stop_timeout, and said so), the store, the probe and their wrappers are all gone."""
    from console.cluster import Cluster
    from console.fleet import Fleet, NodeState
    from console.profile import load_profile

    work, run_dir = tmp_path / "work", tmp_path / "work" / "runs"
    stand_ins(work)
    path = tmp_path / "p.toml"
    path.write_text(LOCAL.format(run_dir=run_dir, port=free_port(), python=sys.executable, work=work))
    fleet, watching = Fleet(), Fleet()
    cluster = Cluster(load_profile(path), fleet)
    dashboard = Cluster(load_profile(path), watching)  # another console on the run: it restarts a store that dies
    try:
        await cluster.start()
        await until(lambda: all(n.state is NodeState.TRAINING for n in fleet.nodes.values()) and
                    _probe_runs(run_dir), 30, "training, and the store's probe")
        await dashboard.attach()
        await until(lambda: watching.store.state == "up", 10, "the other console sees the store")
        assert len(leftovers(work, run_dir)) >= 11  # 3 engines + a worker, the store, the probe, and 5 wrappers
        started = time.monotonic()
        out = await cluster.stop()
        assert out, out.message
        # a KILL is said, and what it cost: the hung engine saved nothing on its way out
        assert out.message.startswith("stopped 3 node(s); ") and "node-a" not in out.message, out.message
        assert "node-b: a process of its group outlived stop_timeout (3s) and was KILLed" in out.message
        assert "node-c: KILLed after stop_timeout (3s), no checkpoint on the way out" in out.message
        assert leftovers(work, run_dir) == []  # at once: nothing of the run is left
        assert time.monotonic() - started < 3 + 15  # the hung worker cost stop_timeout, then a KILL
        assert fleet.store.state == "stopped"
        # the other console saw the store end: a stop, not a crash, so it does not start it again
        await until(lambda: watching.store.state == "stopped", 10, "the other console sees the stop")
        await asyncio.sleep(1.0)
        assert leftovers(work, run_dir) == [] and watching.store.restarts == 0
    finally:
        await asyncio.gather(cluster.close(), dashboard.close())
        kill_groups(run_dir)


async def test_a_kill_at_the_end_of_stop_timeout_names_only_the_groups_it_reached(tmp_path):
    """A host that does not answer was named both "KILLed, no checkpoint" and "may still run": its KILL reached
    nothing. end_groups says which groups a KILL reached (a group of ours here, nobody on port 1 of the other)."""
    from console.cluster import Cluster
    from console.fleet import Fleet
    from console.profile import load_profile

    path = tmp_path / "p.toml"
    path.write_text(LOCAL.format(run_dir=tmp_path / "runs", port=free_port(), python=sys.executable, work=tmp_path)
                    + '[hosts.far]\ntransport = "ssh"\naddress = "127.0.0.1"\nport = 1\n')
    cluster = Cluster(load_profile(path), Fleet())
    ours = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        left, killed = await asyncio.wait_for(cluster._hosts.end_groups([("far", 4242), ("node-a", ours.pid)], 0.3),
                                              60)
        assert left == [("far", 4242)] and killed == [("node-a", ours.pid)], (left, killed)
        assert ours.wait(5) == -signal.SIGKILL
    finally:
        ours.kill()
        ours.wait()
        await cluster.close()


# ---- over real SSH: a headless console, and `stop` from a shell --------------------------------------------------
ALIASES = """\
[run]
name = "stop"
dir = "{run_dir}"
[store]
host = "h1"
port = {port}
[engine]
config = "fake.toml"
[console]
poll_interval = 0.3
stop_timeout = 3
[defaults]
transport = "ssh"
ssh_config = "{config}"
known_hosts = "{known_hosts}"
python = "{python}"
workdir = "{work}"
[hosts.h1]
ssh_alias = "zbs-1"
[hosts.h2]
ssh_alias = "zbs-2"
env = {{ FAKE_MODE = "stubborn-worker" }}
"""

# the headless console of the CLI (console/cli.py run_headless), without the preflight of the hosts: these stand-ins
# have none of what it looks for (torch, the data)
HEADLESS = ("import sys; from console import cli; from console.cluster import Cluster; "
            "sys.exit(cli.main(sys.argv[1:], cluster_factory=lambda profile, fleet, **_: Cluster(profile, fleet)))")


@pytest.mark.timeout(240)
def test_stop_from_a_shell_over_ssh_leaves_nothing_on_any_host(sshd, procs, repo_root):
    """The issue's run: two hosts named only by ssh_config aliases, `--headless`, then `zeroband-console PROFILE
    stop` from another shell. When it returns nothing of the run runs on any host, and the headless console, which
    watched the store end, does not start it again."""
    work, run_dir = sshd.home / "work", sshd.home / "runs"
    stand_ins(work)
    run_dir.mkdir()
    for folder in (work, *work.rglob("*"), run_dir):
        shutil.chown(folder, sshd.user, sshd.user)
    config = sshd.root / "ssh_config"
    config.write_text(f"Host zbs-1 zbs-2\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
                      f"  IdentityFile {sshd.user_key}\n")
    profile = sshd.root / "aliases.toml"
    profile.write_text(ALIASES.format(run_dir=run_dir, port=free_port(), config=config, known_hosts=sshd.known_hosts,
                                      python=sshd.user_python(), work=work))
    env = {**os.environ, "PYTHONPATH": str(repo_root)}
    try:
        headless = procs.start([sys.executable, "-c", HEADLESS, str(profile), "--headless", "--interval", "0.5"],
                               env=env, cwd=str(repo_root))
        deadline = time.monotonic() + 90
        while not (all((run_dir / h / "events.jsonl").is_file() and
                       '"step"' in (run_dir / h / "events.jsonl").read_text() for h in ("h1", "h2"))
                   and _probe_runs(run_dir)):
            assert headless.poll() is None and time.monotonic() < deadline, headless.communicate(timeout=10)
            time.sleep(0.2)
        assert len(leftovers(work, run_dir, (sshd.proc.pid,))) >= 9  # engines, a worker, store, probe, 4 wrappers
        store_pid = (run_dir / "_store" / "pid").read_text()

        stop = procs.run([sys.executable, "-m", "console", str(profile), "stop"], timeout=90, env=env,
                         cwd=str(repo_root))
        assert stop.returncode == 0, (stop.stdout, stop.stderr)
        assert leftovers(work, run_dir, (sshd.proc.pid,)) == [], stop.stdout  # the moment it returned

        out, err = headless.communicate(timeout=60)
        assert headless.returncode == 3, (out, err)  # the run was stopped
        final = [line for line in out.splitlines() if line.startswith(("  h1 ", "  h2 "))]
        assert len(final) == 2 and all(line.endswith("(stopped)") for line in final), out
        assert (run_dir / "_store" / "pid").read_text() == store_pid  # never started again
        assert leftovers(work, run_dir, (sshd.proc.pid,)) == []
    finally:
        kill_groups(run_dir)
