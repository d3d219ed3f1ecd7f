"""The cluster controller, end to end through LocalTransport.

Most tests run a small stand-in engine (an `engine` package in a temporary workdir, which `python -m engine.train`
finds first) so that every path is quick and deterministic: start, kill, drain, restart, add, attach after a
console restart, stop, an engine that exits at start, a missing python, garbage on the event stream. The last
test runs the real engine on configs/debug-diloco.toml.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from console.cluster import Cluster
from console.engine_config import engine_env
from console.launch import engine_argv
from console.fleet import Fleet, HostState, NodeState
from console.profile import load_profile, parse_profile
from procs import free_port, kill_recorded_groups

ROOT = Path(__file__).resolve().parent.parent

FAKE_TRAIN = r'''
import json, os, signal, sys, time
node = os.environ["GLOBAL_UNIQUE_ID"]
mode = os.environ.get("FAKE_MODE", "")
args = dict(a[2:].split("=", 1) for a in sys.argv[2:])
drain = json.loads(args["mesh.drain_file"])  # strings come TOML-quoted, as the real engine reads them
if mode == "exit-at-start":
    print("error: data.path: no such corpus", file=sys.stderr)
    sys.exit(2)
if mode == "slow-start":  # a SIGTERM now ends it as a signal does (status 143): its handler is not there yet
    time.sleep(60)
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
def emit(type_, **f):
    print(json.dumps({"v": 1, "type": type_, "ts": time.time(), "node": node, "rank": 0, **f}), flush=True)
emit("run_start", pid=os.getpid(), host="h", world_size=1, config_digest="d", strategy="ddp", max_steps=100000)
emit("warning", message="rank %s/%s resume %s" % (os.environ["GLOBAL_RANK"], os.environ["GLOBAL_WORLD_SIZE"],
                                                  args.get("ckpt.resume")))
emit("state", state="training")
step = 0
while True:
    step += 1
    emit("step", step=step, loss=1.0 / step, lr=1e-3, tokens_per_s=100.0, grad_norm=None)
    if mode == "garbage" and step % 2 == 0:
        print("this is not json {", flush=True)
    if stop:
        emit("run_end", status="stopped", step=step)
        sys.exit(0)
    if os.path.exists(drain):
        emit("state", state="draining")
        emit("drained", outer_step=step // 5, step=step)
        emit("run_end", status="drained", step=step)
        sys.exit(0)
    time.sleep(0.1)
'''

FAKE_STORE = r'''
import json, os, signal, sys, time
stop = []
signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
ready = {"v": 1, "type": "state", "ts": time.time(), "node": "store", "rank": -1, "state": "ready"}
print(json.dumps(ready), flush=True)
for _ in range(6000):  # gone after 10 minutes whatever happens: a test's stand-in never outlives it for long
    if stop:
        break
    time.sleep(0.1)
'''


def write_fake_engine(root: Path) -> None:
    """Stand-in engine and store (no torch) under root/engine. engine.store is a package, as in the project:
    `python -m engine.store.probe` (the console starts the store's health probe) then fails to import instead of
    running the fake store's code a second time (as a module engine/store.py, it did: a second fake store that
    nobody stopped, left running after the SSH tests)."""
    (root / "engine" / "store").mkdir(parents=True)
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "train.py").write_text(FAKE_TRAIN)
    (root / "engine" / "store" / "__init__.py").write_text("")
    (root / "engine" / "store" / "__main__.py").write_text(FAKE_STORE)


PROFILE = """\
# a test cluster
[run]
name = "t"
dir = "runs/t"

[store]
port = {port}

[engine]
config = "configs/fake.toml"

[console]
poll_interval = 0.2
stop_timeout = 10

[defaults]
transport = "local"
python = "{python}"
workdir = "{workdir}"

[hosts.node-a]

[hosts.node-b]
{b_extra}

[hosts.node-c]
standby = true
"""


@pytest.fixture
def workdir(tmp_path):
    write_fake_engine(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "fake.toml").write_text("[data]\nfake = true\n")
    return tmp_path


def make_profile(workdir: Path, b_extra: str = ""):
    path = workdir / "p.toml"
    path.write_text(PROFILE.format(port=free_port(), python=sys.executable, workdir=workdir, b_extra=b_extra))
    return load_profile(path)


async def until(predicate, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def kill_everything(workdir: Path) -> None:
    """Teardown: every pid file under the run dir names a process group we started."""
    kill_recorded_groups([*workdir.glob("runs/*/*/pid"), *workdir.glob("run/*/pid")])


@pytest.fixture
def cleanup(workdir):
    yield
    kill_everything(workdir)


def states(fleet: Fleet) -> dict[str, str]:
    return {n.name: n.state.value for n in fleet.nodes.values()}


@contextlib.asynccontextmanager
async def running(workdir: Path):
    """A cluster of the stand-ins, started, its store up and node-a training; closed after (the engines run on)."""
    fleet = Fleet()
    cluster = Cluster(make_profile(workdir), fleet)
    try:
        await cluster.start()
        await until(lambda: fleet.store.state == "up" and states(fleet)["node-a"] == "training", what="up")
        yield cluster, fleet
    finally:
        await cluster.close()


# ---- pure builders --------------------------------------------------------------------------------------------
def test_engine_command_and_environment():
    profile = load_profile(ROOT / "profiles" / "lab.toml")
    a, b = profile.hosts["node-a"], profile.hosts["node-c"]
    argv = engine_argv(profile, b)  # 8 workers, no rendezvous port given: torchrun --standalone
    assert argv[:5] == ["/usr/bin/python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8"]
    assert argv[5:8] == ["-m", "engine.train", "configs/1b-diloco.toml"]
    local = load_profile(ROOT / "profiles" / "local.toml")  # one worker: the engine itself, no launcher
    assert engine_argv(local, local.hosts["node-a"])[1:4] == ["-m", "engine.train", "configs/debug-diloco.toml"]
    assert "--train.max_steps=10000" in argv and '--data.path="corpus/stdlib_docstrings.jsonl"' in argv
    assert argv[-1] == '--mesh.drain_file="runs/lab-1b/node-c/drain"' and '--run.dir="runs/lab-1b/node-c"' in argv
    multi = engine_argv(profile, a)  # 8 workers, an explicit rendezvous port
    assert multi[1:3] == ["-m", "torch.distributed.run"] and "--nproc_per_node=8" in multi
    assert "--rdzv-endpoint=127.0.0.1:29500" in multi and multi.index("engine.train") > multi.index("-m", 3)
    env = engine_env(profile, b, rank=2, world_size=4)
    assert {k: env[k] for k in ("GLOBAL_ADDR", "GLOBAL_PORT", "GLOBAL_UNIQUE_ID", "GLOBAL_RANK",
                                "GLOBAL_WORLD_SIZE")} == {"GLOBAL_ADDR": "10.0.0.1", "GLOBAL_PORT": "29600",
                                                          "GLOBAL_UNIQUE_ID": "node-c", "GLOBAL_RANK": "2",
                                                          "GLOBAL_WORLD_SIZE": "4"}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    text = (ROOT / "profiles" / "lab.toml").read_text().replace("rdzv_port = 29500", "")
    standalone = parse_profile(text, "lab.toml")
    assert "--standalone" in engine_argv(standalone, standalone.hosts["node-a"])  # a free port by default


# ---- the controller with the stand-in engine ---------------------------------------------------------------
async def test_start_kill_drain_restart_add_stop(workdir, cleanup):
    profile = make_profile(workdir)
    fleet = Fleet(run="t")
    cluster = Cluster(profile, fleet)
    assert states(fleet) == {"node-a": "off", "node-b": "off", "node-c": "spare"}
    await cluster.start()
    await until(lambda: states(fleet) == {"node-a": "training", "node-b": "training", "node-c": "spare"},
                what="training")
    assert (workdir / "runs/t/_store/events.jsonl").read_text().count('"ready"') == 1
    await until(lambda: (fleet.nodes["node-b"].step or 0) >= 3, what="steps")

    assert await cluster.kill("node-b")
    assert fleet.nodes["node-b"].state is NodeState.DEAD and "operator" in fleet.nodes["node-b"].reason
    step_a = fleet.nodes["node-a"].step

    assert not await cluster.restart("node-a")  # still running
    old_pid = fleet.nodes["node-b"].pid
    assert await cluster.restart("node-b")  # at once, as the k key then r: it waits for the kill to settle
    await until(lambda: fleet.nodes["node-a"].step > step_a, what="node-a's next step")  # it went on
    assert fleet.nodes["node-a"].state is NodeState.TRAINING
    await until(lambda: fleet.nodes["node-b"].state is NodeState.TRAINING and fleet.nodes["node-b"].pid != old_pid,
                what="restart")
    # added twice at once (the a key pressed again, a shell's add beside the dashboard): one engine, not two
    twice = await asyncio.gather(cluster.add("node-c"), cluster.add("node-c"), cluster.kill("node-c"))
    assert twice[2].message == "node-c: being started; kill it once it runs"  # not "not running", then it runs
    twice = twice[:2]
    assert sorted(o.ok for o in twice) == [False, True], twice
    assert next(o for o in twice if not o.ok).message == "node-c: already being started"
    await until(lambda: fleet.nodes["node-c"].state is NodeState.TRAINING, what="add")
    # data shards by GLOBAL_RANK / GLOBAL_WORLD_SIZE: each host its own place in the profile, standbys included
    assert [next(line for line in fleet.nodes[n].log if "rank " in line).split("WARNING: ")[1]
            for n in ("node-a", "node-b", "node-c")] == ["rank 0/3 resume None", "rank 1/3 resume None",
                                                         'rank 2/3 resume "auto"']  # a new run; c added later
    assert any('rank 1/3 resume "auto"' in line for line in fleet.nodes["node-b"].log)  # restarted: its own ckpt
    # a new address beside running nodes: its shard (1 of 4) overlaps theirs (1 of 3), and the console says so
    out = await cluster.add("tester@127.0.0.1:1")  # nothing listens there: not started (nor kept in the profile)
    assert not out and out.message.endswith("taken out of " + str(profile.path) + " again"), out
    new = next(n for n in fleet.nodes if n not in ("node-a", "node-b", "node-c"))
    assert any("its data shard is 1 of 4, the running nodes' 1 of 3: they overlap until those restart" in str(line)
               for line in fleet.nodes[new].log), list(fleet.nodes[new].log)

    assert await cluster.drain("node-a")
    await until(lambda: fleet.nodes["node-a"].state is NodeState.LEFT, what="drained")
    assert fleet.nodes["node-a"].reason == "drained"
    # a kill of an ended node: nothing to kill (it said "kill failed", and left a marker saying the operator killed it)
    await until(lambda: "node-a" not in cluster.running(), what="node-a's process ended")
    assert (await cluster.kill("node-a")).message == "node-a: not running"
    assert fleet.nodes["node-a"].reason == "drained" and not (workdir / "runs/t/node-a/killed").exists()
    assert not (await cluster.drain("nope")) and not (await cluster.kill("nope"))

    assert await cluster.stop()
    assert states(fleet) == {"node-a": "left", "node-b": "left", "node-c": "left", new: "off"}  # a failed add: off
    assert {fleet.nodes[n].reason for n in ("node-b", "node-c")} == {"stopped"}
    store_pid = int((workdir / "runs/t/_store/pid").read_text())
    await until(lambda: not Path(f"/proc/{store_pid}").exists() or "Z" in
                Path(f"/proc/{store_pid}/status").read_text().split("State:")[1][:4], what="store stopped")

    # nothing of the run runs now, not even its store: a restart starts the store first, and says "restarted" only
    # once it is ready (it said so with no store, and the engine died 30 s later: "membership store unreachable")
    assert await cluster.restart("node-b")
    assert fleet.store.state == "up" and int((workdir / "runs/t/_store/pid").read_text()) != store_pid
    await until(lambda: fleet.nodes["node-b"].state is NodeState.TRAINING, what="b restarted after the stop")
    await cluster.close()  # the console goes; node-b and the store run on
    os.killpg(int((workdir / "runs/t/_store/pid").read_text()), signal.SIGKILL)  # the store dies, unwatched
    shell = Cluster(profile, Fleet())  # `add node-c` from a shell: node-b runs without a store, so it is refused
    await shell.attach(steer_store=False)
    refused = await shell.add("node-c")
    assert not refused and refused.message.startswith(
        "node-c: not started: the run's store is not running on node-a while engines of the run are"), refused
    assert not (workdir / "runs/t/_store/stopped").exists()  # and no store was started
    assert await shell.stop()
    await shell.close()


async def test_bad_nodes_do_not_stop_the_others(workdir, cleanup):
    text = PROFILE.format(port=free_port(), python=sys.executable, workdir=workdir,
                          b_extra='env = { FAKE_MODE = "exit-at-start" }')
    text += '\n[hosts.node-d]\npython = "/no/such/python3"\n\n[hosts.node-e]\nenv = { FAKE_MODE = "garbage" }\n'
    (workdir / "p.toml").write_text(text)
    fleet = Fleet()
    cluster = Cluster(load_profile(workdir / "p.toml"), fleet)
    await cluster.start()
    await until(lambda: fleet.nodes["node-b"].state is HostState.FAILED, what="node-b failed")
    b, d, e = fleet.nodes["node-b"], fleet.nodes["node-d"], fleet.nodes["node-e"]
    assert b.reason == "exited with status 2: error: data.path: no such corpus"
    assert d.state is HostState.FAILED and d.reason == "python not found on the host: /no/such/python3"
    await until(lambda: e.malformed >= 3 and (e.step or 0) >= 6, what="garbage counted")
    assert e.state is NodeState.TRAINING and fleet.nodes["node-a"].state is NodeState.TRAINING
    await cluster.stop()
    await cluster.close()


async def test_console_restart_attaches_and_catches_up(workdir, cleanup):
    profile = make_profile(workdir)
    fleet = Fleet()
    first = Cluster(profile, fleet)
    await first.start()
    await until(lambda: (fleet.nodes["node-a"].step or 0) >= 3, what="steps")
    pids = {n: fleet.nodes[n].pid for n in ("node-a", "node-b")}
    await first.close()  # the console goes away; the engines do not
    await asyncio.sleep(0.5)
    fresh = Fleet()
    second = Cluster(profile, fresh)
    await second.start()  # finds them running: attaches instead of starting again
    assert {n: fresh.nodes[n].pid for n in pids} == pids
    assert fresh.nodes["node-a"].step >= 5 and fresh.nodes["node-a"].malformed == 0  # history read from the top
    assert len(fresh.nodes["node-a"].loss_history) == fresh.nodes["node-a"].step
    assert fresh.nodes["node-c"].state is HostState.SPARE
    step = fresh.nodes["node-a"].step
    await until(lambda: fresh.nodes["node-a"].step > step + 2, what="following")
    await second.kill("node-a")
    await asyncio.sleep(0.5)
    third_fleet = Fleet()
    third = Cluster(profile, third_fleet)
    await third.attach()
    node_a = third_fleet.nodes["node-a"]  # a console started after the kill still knows who ended it
    assert node_a.state is NodeState.DEAD and node_a.reason.startswith("killed by the operator")
    assert third_fleet.nodes["node-b"].state is NodeState.TRAINING
    await second.stop()
    await asyncio.gather(second.close(), third.close())


async def test_bad_engine_config_starts_nothing(workdir, cleanup):
    profile = make_profile(workdir)
    (workdir / "configs" / "fake.toml").write_text("[train]\nmax_steps = -1\n[data]\nfake = true\n")
    fleet = Fleet()
    cluster = Cluster(profile, fleet)
    await cluster.start()
    assert fleet.nodes["node-a"].state is HostState.FAILED
    assert "train.max_steps: Input should be greater than 0" in fleet.nodes["node-a"].reason
    # add and restart refuse it too, in one line (add said "added", then the engine died)
    for name, outcome in (("node-c", await cluster.add("node-c")), ("node-a", await cluster.restart("node-a"))):
        assert not outcome and outcome.message.startswith(f"{name}: not started: {profile.path}:10: engine.config: ")
        assert "train.max_steps: Input should be greater than 0" in outcome.message
    assert not (workdir / "runs").exists()  # nothing was started
    await cluster.close()


async def test_store_that_cannot_start_fails_every_node(workdir, cleanup):
    profile = make_profile(workdir)
    (workdir / "engine" / "store" / "__main__.py").write_text(
        "import sys\nprint('cannot listen: port in use', file=sys.stderr)\nsys.exit(2)\n")
    fleet = Fleet()
    cluster = Cluster(profile, fleet)
    await cluster.start()
    await until(lambda: fleet.nodes["node-a"].state is HostState.FAILED, what="store failure")
    assert "store exited: cannot listen: port in use" in fleet.nodes["node-a"].reason
    await until(lambda: fleet.nodes["node-b"].state is HostState.FAILED, what="store failure b")
    await cluster.close()


async def test_add_a_new_address_writes_it_into_the_profile_and_out_again_when_it_does_not_start(workdir, cleanup):
    profile = make_profile(workdir)
    fleet = Fleet()
    cluster = Cluster(profile, fleet)
    before = (workdir / "p.toml").read_text()
    out = await cluster.add("tester@127.0.0.1:1")  # nothing listens on port 1: written, unreachable, taken out
    assert not out and "refused" in out.message and out.message.endswith(f"127.0.0.1: taken out of {profile.path} "
                                                                          "again"), out.message
    node = fleet.nodes["127.0.0.1"]  # off, not unreachable: that counts as running (a stop then exited 130)
    assert node.state is HostState.OFF and node.reason.startswith("not added: connection refused by tester@")
    assert fleet.store.state == "stopped", fleet.store  # started for it alone, and stopped again
    # a typo'd address left in the file would be a host every later start checks, and a place in every data shard
    assert (workdir / "p.toml").read_text() == before
    assert "127.0.0.1" not in load_profile(workdir / "p.toml").hosts and "127.0.0.1" not in cluster.profile.hosts
    checked = Cluster(load_profile(workdir / "p.toml"), Fleet(), preflight=True)  # refused by the check, the same
    out = await checked.add("tester@127.0.0.1:1")
    assert not out and "not added: the preflight found 1 problem(s)" in out.message, out.message
    assert (workdir / "p.toml").read_text() == before
    await checked.close()
    name, written = cluster._hosts.add_address("tester@127.0.0.1:1")  # what add writes before it starts the engine
    host = load_profile(workdir / "p.toml").hosts[name]
    assert written and (workdir / "p.toml").read_text().startswith(before)  # the file kept, the host appended
    assert (host.user, host.port, host.transport, host.python) == ("tester", 1, "ssh", sys.executable)
    bad = await cluster.add("not a host!")
    assert not bad and fleet.nodes["not a host!"].state is HostState.FAILED
    assert fleet.nodes["node-a"].state is HostState.OFF  # nothing else touched
    await cluster.close()


# ---- the real engine -----------------------------------------------------------------------------------------
REAL = """\
[run]
name = "e2e"
dir = "{run_dir}"

[store]
port = {port}

[engine]
config = "configs/debug-diloco.toml"

[engine.overrides]
"data.path" = "corpus/stdlib_docstrings.jsonl"
"inner.device" = "cpu"
"train.max_steps" = 400
"train.log_interval" = 1
"mesh.heartbeat_timeout" = 6.0  # the default: node-a goes on once node-b is this long silent

[console]
poll_interval = 0.5
stop_timeout = 30

[defaults]
transport = "local"
python = "{python}"
workdir = "{root}"
env = {{ OMP_NUM_THREADS = "1" }}

[hosts.node-a]

[hosts.node-b]
"""


@pytest.mark.slow
async def test_real_engine_two_nodes_kill_one_the_other_goes_on(tmp_path):
    path = tmp_path / "e2e.toml"
    path.write_text(REAL.format(run_dir=tmp_path / "run", port=free_port(), python=sys.executable, root=ROOT))
    fleet = Fleet(run="e2e")
    cluster = Cluster(load_profile(path), fleet)
    try:
        await cluster.start()
        await until(lambda: all(fleet.nodes[n].state is NodeState.TRAINING and (fleet.nodes[n].step or 0) >= 1
                                for n in ("node-a", "node-b")), timeout=240, what=f"training: {states(fleet)}")
        assert await cluster.kill("node-b")
        assert fleet.nodes["node-b"].state is NodeState.DEAD
        step = fleet.nodes["node-a"].step
        await until(lambda: (fleet.nodes["node-a"].step or 0) >= step + 10, timeout=180,
                    what=f"node-a goes on: {states(fleet)} {fleet.nodes['node-a'].reason}")
        assert fleet.nodes["node-a"].state is NodeState.TRAINING
        assert fleet.nodes["node-b"].state is NodeState.DEAD
        assert fleet.nodes["node-a"].malformed == 0 and fleet.nodes["node-a"].loss is not None
        assert "GLOBAL_RANK and GLOBAL_WORLD_SIZE" not in (tmp_path / "run/node-a/events.jsonl").read_text()  # set
    finally:
        await cluster.stop()
        await cluster.close()
        kill_everything(tmp_path)


async def test_start_ends_a_stale_store_and_restart_continues_the_file(workdir, cleanup):
    from console.transport import LocalTransport

    profile = make_profile(workdir)
    t = LocalTransport(profile.hosts["node-a"])
    stale = await t.start_detached([sys.executable, "-m", "engine.store"], "runs/t/_store")  # left by a past run
    fleet = Fleet()
    cluster = Cluster(profile, fleet)
    await cluster.start()
    await until(lambda: fleet.nodes["node-a"].state is NodeState.TRAINING, what="training")
    assert not await t.alive(stale) and int((workdir / "runs/t/_store/pid").read_text()) != stale
    await until(lambda: (fleet.nodes["node-b"].step or 0) >= 2, what="steps")
    await cluster.kill("node-b")
    await until(lambda: not await_free(cluster, "node-b"), what="settled")
    lines = (workdir / "runs/t/node-b/events.jsonl").read_text().count("\n")
    assert await cluster.restart("node-b")
    await until(lambda: fleet.nodes["node-b"].state is NodeState.TRAINING, what="restarted")
    text = (workdir / "runs/t/node-b/events.jsonl").read_text()
    assert text.count('"run_start"') == 2 and text.count("\n") > lines  # appended, not replaced
    assert fleet.nodes["node-b"].malformed == 0
    await cluster.stop()
    await cluster.close()


def await_free(cluster: Cluster, name: str) -> bool:
    """Whether the node's watcher is still running (it settles the node when its process is gone)."""
    proc = cluster._procs[name]
    return not proc.done.is_set()


async def test_a_fresh_start_archives_the_previous_run_and_resume_keeps_it(workdir, cleanup, capsys):
    """Starting the same profile again begins a new run (old folders to _archive/; no ckpt.resume: checkpoints
    elsewhere go aside too); --resume starts on top of the previous run's folders, each engine told resume=auto."""
    from console import cli

    profile = make_profile(workdir)
    fleet = Fleet(run="t")  # `--headless --attach` with nothing running: one line, exit 1 (it printed "off" for ever)
    code = await asyncio.wait_for(cli.run_headless(Cluster(profile, fleet), fleet, attach=True, interval=0.1,
                                                   out=io.StringIO()), 20)
    assert code == 1 and capsys.readouterr().err == (f"zeroband-console: nothing runs for {profile.path} (run t): "
                                                     "nothing to attach to (start it without --attach)\n")
    first = Cluster(profile, Fleet(run="t"))
    await first.start()
    await until(lambda: first.fleet.nodes["node-a"].state is NodeState.TRAINING, what="first run")
    assert await first.stop()
    await first.close()
    old_events = (workdir / "runs/t/node-a/events.jsonl").read_text()
    assert '"run_end"' in old_events

    second = Cluster(profile, Fleet(run="t"))
    await second.start()
    await until(lambda: second.fleet.nodes["node-a"].state is NodeState.TRAINING, what="second run")
    archived = list((workdir / "runs/t/_archive").glob("*/node-a/events.jsonl"))
    assert len(archived) == 1 and archived[0].read_text() == old_events
    assert (workdir / "runs/t/_archive" / archived[0].parts[-3] / "_store").is_dir()
    # the probe's folder too: its last health sample showed the previous store's figures in the new header
    assert (workdir / "runs/t/_archive" / archived[0].parts[-3] / "_store_probe").is_dir()
    assert '"run_end"' not in (workdir / "runs/t/node-a/events.jsonl").read_text()  # a new file, a new run
    assert any("resume None" in line for line in second.fleet.nodes["node-a"].log)  # not "auto": ckpt.dir's kept
    assert await second.stop()
    await second.close()

    third = Cluster(profile, Fleet(run="t"), resume=True)
    await third.start()
    await until(lambda: third.fleet.nodes["node-a"].state is NodeState.TRAINING, what="resumed run")
    assert len(list((workdir / "runs/t/_archive").iterdir())) == 1  # nothing moved this time
    assert any('resume "auto"' in line for line in third.fleet.nodes["node-a"].log)
    assert await third.stop()
    await third.close()


FLAKY_STORE = r'''
import json, os, sys, time
if os.path.exists("store-fails-once"):  # the test's switch: this start dies before it is ready
    os.remove("store-fails-once")
    print("cannot listen: address in use", file=sys.stderr)
    sys.exit(2)
print(json.dumps({"v": 1, "type": "state", "ts": time.time(), "node": "store", "rank": -1, "state": "ready",
                  "pid": os.getpid()}), flush=True)
time.sleep(600)
'''


async def test_a_stop_while_nodes_start_is_a_stop_not_a_failure(workdir, cleanup):
    """A stop that lands before an engine installed its SIGTERM handler ends it with status 143: that node was
    stopped, not failed (exit 1 instead of 3), for the console that stops and for one that watches (the store's
    stopped marker, written before the engines are signalled, says so)."""
    from console.exit_codes import EXIT_STOPPED, run_outcome

    profile = make_profile(workdir, b_extra='env = { FAKE_MODE = "slow-start" }')
    fleet = Fleet()
    watching = Cluster(profile, fleet)
    await watching.start()
    await until(lambda: states(fleet)["node-a"] == "training" and "node-b" in watching.running(), what="a trains")
    assert fleet.nodes["node-b"].state is NodeState.STARTING
    shell = Cluster(profile, Fleet())  # `zeroband-console PROFILE stop` from a shell
    await shell.attach(steer_store=False)
    assert await shell.stop()
    await until(lambda: states(fleet)["node-b"] == "left", what="the watching console settles b")
    for view in (shell.fleet, fleet):
        assert (view.nodes["node-b"].state, view.nodes["node-b"].reason) == (NodeState.LEFT, "stopped")
        assert any("exited with status 143" in line for line in view.nodes["node-b"].log)
        await until(lambda: run_outcome(view) is not None, what="the outcome")
        assert run_outcome(view) == EXIT_STOPPED
    await asyncio.gather(shell.close(), watching.close())


async def test_a_store_that_dies_under_the_run_is_restarted_and_the_nodes_go_on(workdir, cleanup):
    """Issue 13: the console restarts a store it started. A restart that dies before it is ready is retried; the
    nodes are never failed for a store that the run already had."""
    (workdir / "engine" / "store" / "__main__.py").write_text(FLAKY_STORE)
    async with running(workdir) as (cluster, fleet):
        first = int((workdir / "runs/t/_store/pid").read_text())
        (workdir / "store-fails-once").write_text("")
        os.killpg(first, signal.SIGKILL)
        await until(lambda: fleet.store.restarts >= 1, what="a restart")
        await until(lambda: fleet.store.state == "up" and fleet.store.restarts == 2, 30, what="up after two tries")
        assert not (workdir / "store-fails-once").exists()  # the first restart did die before it was ready
        assert states(fleet) == {"node-a": "training", "node-b": "training", "node-c": "spare"}
        assert int((workdir / "runs/t/_store/pid").read_text()) not in (first,)
        assert (workdir / "runs/t/_store/events.jsonl").read_text().count('"ready"') == 2  # appended, not replaced
        await cluster.stop()
        assert fleet.store.state == "stopped"


async def test_a_stop_while_the_store_is_being_restarted_leaves_no_store(workdir, cleanup):
    """Defect: a stop that came while the console was starting a dead store again looked for the store before that
    start was done, found none, and the new store ran on after the stop. The stop now waits for a restart in flight
    and ends the store it started."""
    async with running(workdir) as (cluster, fleet):
        t = cluster.transport(cluster.profile.store_host.name)
        real_start, in_flight, go_on, started = t.start_detached, asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def slow_start(argv, run_dir, **kw):  # the store's start takes a while (a slow link, a loaded host)
            if run_dir.endswith("_store"):
                in_flight.set()
                await go_on.wait()
            pid = await real_start(argv, run_dir, **kw)
            started.set()
            return pid
        t.start_detached = slow_start  # type: ignore[method-assign]
        os.killpg(int((workdir / "runs/t/_store/pid").read_text()), signal.SIGKILL)
        await asyncio.wait_for(in_flight.wait(), 20)
        stopping = asyncio.ensure_future(cluster.stop())
        # the engines end first; then the stop looks for the store (and, fixed, waits for the start in flight)
        await until(lambda: stopping.done() or all(states(fleet)[n] == "left" for n in ("node-a", "node-b")), 30,
                    what="the engines to end")
        await asyncio.wait({stopping}, timeout=2)
        go_on.set()
        await asyncio.wait_for(started.wait(), 20)
        outcome = await asyncio.wait_for(stopping, 30)
        assert outcome.ok, outcome.message
        restarted = int((workdir / "runs/t/_store/pid").read_text())
        await asyncio.sleep(0.5)
        assert not await t.group_alive(restarted), "the store started during the stop runs on"
        assert fleet.store.state == "stopped"


async def test_an_add_or_restart_while_the_run_is_being_stopped_is_refused(workdir, cleanup):
    """A node started while a stop runs could start the run's store again after the stop had ended it (the store
    then outlived the console). While stop() runs, add and restart say so and start nothing; after it, they work."""
    async with running(workdir) as (cluster, fleet):
        stopping = asyncio.ensure_future(cluster.stop())
        await asyncio.sleep(0)  # the stop has begun
        for outcome, name in ((await cluster.restart("node-a"), "node-a"), (await cluster.add("node-c"), "node-c")):
            assert not outcome.ok and outcome.message == f"{name}: the run is being stopped"
        assert (await stopping).ok
        assert "node-c" not in cluster.running() and fleet.store.state == "stopped"
        assert (await cluster.restart("node-a")).ok  # the stop is over: a node starts, and the store with it
        await until(lambda: fleet.store.state == "up" and states(fleet)["node-a"] == "training", what="again")
        await cluster.stop()


async def test_a_watching_console_follows_a_node_another_console_starts(workdir, cleanup):
    """The chaos lab's way back: a node dies, a shell's `add NODE` (another console process) starts it again, and
    the dashboard watching the run shows it training again; the same for a standby host added from a shell."""
    from console import cli

    profile = make_profile(workdir)
    fleet = Fleet()
    watching = Cluster(profile, fleet)
    await watching.start()
    await until(lambda: states(fleet) == {"node-a": "training", "node-b": "training", "node-c": "spare"},
                what="training")
    old_pid = fleet.nodes["node-b"].pid
    os.killpg(int((workdir / "runs/t/node-b/pid").read_text()), signal.SIGKILL)  # not by this console
    await until(lambda: fleet.nodes["node-b"].state is NodeState.DEAD, what="b settled dead")

    for node in ("node-b", "node-c"):  # `zeroband-console PROFILE add NODE` from a shell
        shell = Cluster(profile, Fleet())
        args = cli.parse_args([str(profile.path), "add", node])
        assert await cli.run_command(shell, shell.fleet, args, io.StringIO()) == 0
    await until(lambda: states(fleet) == {"node-a": "training", "node-b": "training", "node-c": "training"},
                what="the watching console sees both started by the shell")
    b = fleet.nodes["node-b"]
    starts = [e for e in map(json.loads, (workdir / "runs/t/node-b/events.jsonl").read_text().splitlines())
              if e["type"] == "run_start"]
    assert len(starts) == 2 and b.pid == starts[-1]["pid"] != old_pid  # the shell's process, appended
    step_c = fleet.nodes["node-c"].step or 0
    await until(lambda: (fleet.nodes["node-c"].step or 0) > step_c + 2, what="c followed")
    assert sorted(watching.running()) == ["node-a", "node-b", "node-c"]

    # a console attached while the node is dead follows its next start too
    os.killpg(int((workdir / "runs/t/node-a/pid").read_text()), signal.SIGKILL)
    await until(lambda: fleet.nodes["node-a"].state is NodeState.DEAD, what="a settled dead")
    late_fleet = Fleet()
    late = Cluster(profile, late_fleet)
    await late.attach(steer_store=False)
    assert late_fleet.nodes["node-a"].state is NodeState.DEAD
    shell = Cluster(profile, Fleet())
    assert await cli.run_command(shell, shell.fleet, cli.parse_args([str(profile.path), "add", "node-a"]),
                                 io.StringIO()) == 0
    await until(lambda: fleet.nodes["node-a"].state is late_fleet.nodes["node-a"].state is NodeState.TRAINING,
                what="both consoles see a again")
    await late.close()
    assert await watching.stop()  # and it ends what it adopted, as its own
    assert states(fleet) == {"node-a": "left", "node-b": "left", "node-c": "left"}
    await watching.close()
