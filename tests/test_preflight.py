"""Before anything starts: `check`, the same preflight before every start, and `sync` (console/preflight/,
console/sync.py).

    pure rules            facts in, one line per problem out (GPUs against workers with the fake count, disk,
                          clock, interfaces, manifests, links, host keys)
    on this machine       the probe through the local transport: planted problems named, a clean profile's table;
                          a start refused with nothing started (headless, and the dashboard's rows); sync of
                          HEAD into other folders, idempotent, never into the console's own checkout
    in the lab            network namespaces with a real sshd each (tests/lab): nine planted problems, each one
                          line before anything starts; sync fixes another commit and a venv without torch (and
                          says when a host cannot reach the package registry); after the other fixes check is
                          clean and a headless run trains
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from console import cli
from console.checkout import Checkout
from console.fleet import Fleet, NodeState
from console.preflight import PreflightFailed, probe
from console.preflight.rules import Expect, HostPlan, HostResult, Target, clock_skew, ifname_matches, judge
from console.profile import ProfileError, load_profile, parse_profile
from procs import ROOT, free_port, kill_recorded_groups

PY = ".venv/bin/python"


# ---- pure rules -------------------------------------------------------------------------------------------------
def facts(**over) -> dict:
    base = {"python": [3, 11, 7], "executable": "/x/python", "machine": "m2", "workdir": "/w", "config": True,
            "engine": "e1", "engine_files": 40, "git": None, "packages": dict.fromkeys(
                ("torch", "transformers", "pydantic", "numpy"), "1.0") | {"torch": "2.13.0+cu128"},
            "stamp": None, "stamp_want": "s", "gpus": {"count": 8, "source": "nvml", "note": None}, "cpus": 64,
            "disk": {"path": "/w/runs", "free": 500e9, "error": None}, "data": [], "interfaces": ["eth0", "lo"],
            "binds": [], "time": 100.0}
    base.update(over)
    return base


def plan(name="node-a", **over) -> HostPlan:
    fields = dict(name=name, roles=frozenset({"engine"}), python="/v/bin/python", venv="/v", workdir="/w",
                  run_dir="runs", config="configs/x.toml", device="auto", workers=8)
    fields.update(over)
    return HostPlan(**fields)


EXPECT = Expect(profile="p.toml", engine="e1", label="commit abc", torch="2.13.0+cpu", machine="m1", root="/c")


def lines(plans, results, expect=EXPECT) -> list[str]:
    return [p.line() for p in judge(plans, {r.name: r for r in results}, expect)]


def test_a_clean_host_has_no_problem_and_a_build_suffix_is_the_same_torch():
    assert lines([plan()], [HostResult("node-a", facts=facts(), sent=99.5, received=100.5)]) == []


def test_workers_against_the_gpus_nvml_sees_or_the_fake_count():
    few = {"count": 7, "source": "fake (ZEROBAND_FAKE_GPUS)", "note": None}
    assert lines([plan()], [HostResult("node-a", facts=facts(gpus=few), sent=100, received=100)]) == [
        "node-a: workers = 8 on inner.device auto but fake (ZEROBAND_FAKE_GPUS) sees 7 GPUs; fix: set "
        "hosts.node-a.workers to at most 7 (the same on every host of a DiLoCo run), fix the GPUs (nvidia-smi), or "
        "set inner.device = \"cpu\""]
    none = {"count": 0, "source": "nvml", "note": "NVML Shared Library Not Found"}
    assert lines([plan(device="cuda", workers=1)], [HostResult("node-a", facts=facts(gpus=none), sent=100,
                                                               received=100)])[0].startswith(
        "node-a: workers = 1 on inner.device cuda but nvml sees 0 GPUs (NVML Shared Library Not Found)")
    # torch's CPU build where GPUs are: auto would train on the CPU, cuda would fail
    cpu_build = facts(packages=facts()["packages"] | {"torch": "2.13.0+cpu"})
    assert lines([plan()], [HostResult("node-a", facts=cpu_build, sent=100, received=100)]) == [
        "node-a: torch 2.13.0+cpu for /v/bin/python is the CPU build, but inner.device auto and nvml sees 8 GPUs; fix: "
        "zeroband-console p.toml sync installs the CUDA build where nvidia-smi works (or set hosts.node-a.venv to a "
        "venv with it)"]
    assert lines([plan(device="cpu", workers=2)], [HostResult("node-a", facts=cpu_build, sent=100, received=100)]) == []
    # auto without a GPU trains on the CPU: then the CPUs count
    assert lines([plan(workers=2)], [HostResult("node-a", facts=facts(gpus=none, cpus=2), sent=100,
                                                received=100)]) == []
    assert "on the CPU but the host has 2 CPUs" in lines([plan(workers=3, device="cpu")], [
        HostResult("node-a", facts=facts(cpus=2), sent=100, received=100)])[0]


def test_disk_clock_interfaces_and_python():
    result = HostResult("node-a", facts=facts(disk={"path": "/w/runs", "free": 1.5e9, "error": None}, time=90.0,
                                              python=[3, 11, 1]), sent=100.0, received=100.2)
    found = lines([plan(ifnames=(("NCCL_SOCKET_IFNAME", "ib"), ("GLOO_SOCKET_IFNAME", "eth0")))], [result])
    assert found == [
        "node-a: 1.5 GB free under /w/runs (check.min_free_gb = 2); fix: free some space there, or point run.dir at "
        "a larger disk",
        "node-a: the clock is 10.0 s behind the console's (check.max_clock_skew = 3 s; time-based rounds compare "
        "clocks); fix: sync it with NTP (timedatectl set-ntp true, or chrony)",
        "node-a: NCCL_SOCKET_IFNAME=ib names no interface of the host (it has eth0, lo); fix: set "
        "hosts.node-a.env.NCCL_SOCKET_IFNAME to the interface on the route to the other hosts"]
    old = HostResult("node-a", facts=facts(python=[3, 9, 2]), sent=100, received=100)
    assert "is Python 3.9.2, the engine needs 3.11+" in lines([plan()], [old])[0]
    assert clock_skew(100.0, 99.0, 101.0) == 0.0 and clock_skew(104.0, 99.0, 101.0) == 3.0
    assert ifname_matches("NCCL_SOCKET_IFNAME", "^docker,lo", ["docker0", "eth0", "lo"]) == ["eth0"]
    assert ifname_matches("NCCL_SOCKET_IFNAME", "=eth", ["eth0"]) == []
    assert ifname_matches("GLOO_SOCKET_IFNAME", "eth0,eth1", ["eth1"]) == ["eth1"]


def test_version_packages_manifests_and_links():
    plans = [plan("a", data=(("data.path", "/d"),), links=(Target("10.0.0.1", 29600, "the store"),)),
             plan("b", data=(("data.path", "/d"),), links=(Target("10.0.0.1", 29600, "the store"),)),
             plan("c", data=(("data.path", "/d"),), links=(Target("10.0.0.1", 29600, "the store"),))]
    prepared = [{"path": "/d", "exists": True, "manifest": m} for m in ("m1", "m1", "m2")]
    a = HostResult("a", facts=facts(data=[prepared[0]], workdir="/c", machine="m1", engine="old"), sent=100,
                   received=100, links=[["10.0.0.1", 29600, "connected", None]])
    b = HostResult("b", facts=facts(data=[prepared[1]], engine="old", git="f" * 40,
                                    packages={"torch": None, "transformers": None, "pydantic": "2", "numpy": "1"}),
                   sent=100, received=100, links=[["10.0.0.1", 29600, "timeout", "no answer"]],
                   listening={"10.0.0.1:29600"})
    c = HostResult("c", facts=facts(data=[prepared[2]], packages=dict(facts()["packages"], torch="2.5.1")),
                   sent=100, received=100, links=[["10.0.0.1", 29600, "refused", "ECONNREFUSED"]])
    found = lines(plans, [a, b, c])
    assert found == [
        # a is the console's own checkout: no sync puts the commit there. Its engine files differ from the commit
        # (edits not committed) while b and c get the commit: a would run other code than theirs
        "a: the console's checkout /c has engine files that differ from its commit abc (engine old on disk, e1 "
        "committed): this node would run them, and the other hosts the commit; fix: commit them and sync, or stash "
        "them",
        "b: torch, transformers not installed for /v/bin/python; fix: zeroband-console p.toml sync (it runs "
        "scripts/setup.sh in the venv)",
        "b: the project in /w is not the console's (host: commit ffffffffff, engine old; console: commit abc, engine "
        "e1); fix: zeroband-console p.toml sync",
        "b: cannot reach the store at 10.0.0.1:29600: no answer (a firewall drops it?); fix: open TCP 29600 from this "
        "host to 10.0.0.1 (firewall, security group), or set store.address to an address this host reaches",
        "c: torch 2.5.1 for /v/bin/python, the console's is 2.13.0+cpu; fix: zeroband-console p.toml sync (it runs "
        "scripts/setup.sh in the venv)",
        # c's refusal is no problem: no listener of the check held that port (the store's host has its own line)
        "c: data.path /d differs from a's /d (manifest m2 vs m1): not the same prepared data; fix: copy one prepared "
        "folder to every host (python -m engine.data verify DIR checks a copy)"]
    # alone (every engine in the console's checkout) its edits are what the run runs: no problem
    assert lines(plans[:1], [a]) == []


def test_unreachable_hosts_carry_the_transport_reason_and_a_fix():
    unknown = ("host key of u@10.0.0.9:22 is unknown: not in /k; add it (ssh-keyscan) or set accept_new_host_key = "
               "true in the profile")
    assert lines([plan("n")], [HostResult("n", reach=unknown)]) == [
        "n: host key of u@10.0.0.9:22 is unknown: not in /k; fix: add it (ssh-keyscan) or set accept_new_host_key = "
        "true in the profile"]
    assert lines([plan("n")], [HostResult("n", reach="authentication failed for u@h: wrong user or key (x)")]) == [
        "n: authentication failed for u@h: wrong user or key (x); fix: check hosts.n.user and identity_file (its "
        "public key must be in the host's authorized_keys)"]
    # a jump host's failure sends the user to jump_host (it sent them to the host's own address); the transport's
    # backoff note is no part of a verdict; a .pub named as the key, a missing ssh_config: what to do about each
    reasons = {"jump host j:22: unknown host j: Name or service not known (retrying in 0.4s)":
               "n: jump host j:22: unknown host j: Name or service not known; fix: check hosts.n.jump_host (try ssh "
               "to it)",
               "hosts.n.identity_file: /k.pub is not a private key (Invalid private key)":
               "n: hosts.n.identity_file: /k.pub is not a private key (Invalid private key); fix: point "
               "hosts.n.identity_file at the private key (the file without .pub)",
               "hosts.n.ssh_config: ~/.ssh/config does not exist on this machine (where the alias g would be)":
               "n: hosts.n.ssh_config: ~/.ssh/config does not exist on this machine (where the alias g would be); "
               "fix: create it or fix hosts.n.ssh_config"}
    for reason, line in reasons.items():
        assert lines([plan("n")], [HostResult("n", reach=reason)]) == [line]


def test_the_probe_parses_on_old_pythons_and_never_imports_torch():
    source = Path(probe.__file__).read_text()
    import ast

    tree = ast.parse(source, feature_version=(3, 6))  # old pythons must be able to say they are old
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "transformers", "numpy", "engine", "console"}, imported
    assert not any(isinstance(n, ast.AnnAssign) or getattr(n, "returns", None) for n in ast.walk(tree))


def test_the_console_digest_of_head_equals_the_probe_digest_of_heads_files(tmp_path):
    here = Checkout.find()
    assert here is not None and here.is_git and here.engine
    engine = [f for f in here.files if f.path.startswith("engine/")]
    for f, data in here.read(engine).items():
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes(data)
    assert probe.engine_digest(str(tmp_path))[0] == here.engine
    (tmp_path / "engine" / "stray.py").write_text("x = 1\n")
    assert probe.engine_digest(str(tmp_path))[0] != here.engine


# ---- the profile keys -------------------------------------------------------------------------------------------
PROFILE = """\
[run]
name = "pf"
dir = "{run_dir}"

[store]
host = "node-a"
port = {port}

[engine]
config = "configs/debug-diloco.toml"

[engine.overrides]
"data.path" = "corpus/stdlib_docstrings.jsonl"
"inner.device" = "cpu"
{extra_overrides}
[check]
link_timeout = 2.0

[sync]
setup_env = {{ BASE_SITE = "{site}" }}

[defaults]
transport = "local"
python = "{python}"
workdir = "{workdir}"
env = {{ OMP_NUM_THREADS = "1" }}

[hosts.node-a]

[hosts.node-b]
{node_b}
"""


def write_profile(tmp_path: Path, *, workdir: Path = ROOT, node_b: str = "", extra: str = "", port=None) -> Path:
    path = tmp_path / "pf.toml"
    path.write_text(PROFILE.format(run_dir=tmp_path / "runs", port=port or free_port(), workdir=workdir,
                                   python=sys.executable, site=sysconfig.get_paths()["purelib"], node_b=node_b,
                                   extra_overrides=extra))
    return path


def test_profile_keys_are_validated_at_their_line(tmp_path):
    good = write_profile(tmp_path).read_text()
    p = parse_profile(good, "pf.toml")
    assert (p.check.link_timeout, p.check.min_free_gb, p.sync.shared_fs) == (2.0, 2.0, False)
    with pytest.raises(ProfileError, match=r"^pf.toml:17: check.link_timeout: Input should be greater than 0"):
        parse_profile(good.replace("link_timeout = 2.0", "link_timeout = 0"), "pf.toml")
    with pytest.raises(ProfileError, match=r"^pf.toml:20: sync.setup_env: 'A B' is not an environment variable"):
        parse_profile(good.replace('{ BASE_SITE', '{ "A B" = "x", BASE_SITE'), "pf.toml")
    with pytest.raises(ProfileError, match=r"^pf.toml:20: sync.shared: unknown key"):
        parse_profile(good.replace("[sync]\n", "[sync]\nshared = true\n"), "pf.toml")
    shared = good.replace("[sync]\n", "[sync]\nshared_fs = true\n").replace("[hosts.node-b]\n",
                                                                         '[hosts.node-b]\nworkdir = "/elsewhere"\n')
    with pytest.raises(ProfileError, match=r"^pf.toml:32: hosts.node-b.workdir: '/elsewhere' differs from node-a's"):
        parse_profile(shared, "pf.toml")


# ---- on this machine (local transport) --------------------------------------------------------------------------
def run_console(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


@contextlib.contextmanager
def squatter(address: str, port: int, netns: str | None = None):
    """Something else listening on address:port (in a namespace when given); ended by its pid."""
    code = ("import socket, sys, time\ns = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64)\n"
            "print('up', flush=True); time.sleep(600)\n")
    argv = [sys.executable, "-c", code, address, str(port)]
    proc = subprocess.Popen((["ip", "netns", "exec", netns] if netns else []) + argv, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_check_names_each_planted_problem_on_this_machine(tmp_path):
    port = free_port()
    profile = write_profile(tmp_path, port=port, node_b=textwrap.dedent("""\
        env = { GLOO_SOCKET_IFNAME = "ib0", ZEROBAND_FAKE_GPUS = "0" }
        overrides = { "data.path" = "no/such/data", "inner.device" = "cuda" }
        venv = "/nonexistent/venv"
        """))
    with squatter("127.0.0.1", port):
        done = run_console(str(profile), "check")
    out = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout + done.stderr
    assert out[0].startswith(f"node-a: cannot listen on 127.0.0.1:{port} for the store: EADDRINUSE")
    # the host's interfaces as the check listed them (a lab test beside this one may add some meanwhile)
    listed = re.search(r"\(it has ([^)]*)\)", out[-1])
    assert listed and "lo" in listed[1].split(", "), out[-1]
    out[-1] = out[-1].replace(listed[1], "INTERFACES")
    assert out[1:] == [
        "node-b: the venv /nonexistent/venv does not exist (no /nonexistent/venv/bin/python); fix: zeroband-console "
        f"{profile} sync (scripts/setup.sh makes it), or fix hosts.node-b.venv",
        f"node-b: data.path no/such/data does not exist on the host ({ROOT}/no/such/data); fix: copy it there (the "
        "same folder on every host), or set hosts.node-b.overrides.\"data.path\"",
        "node-b: workers = 1 on inner.device cuda but fake (ZEROBAND_FAKE_GPUS) sees 0 GPUs; fix: set "
        "hosts.node-b.workers to at most 0 (the same on every host of a DiLoCo run), fix the GPUs (nvidia-smi), or set "
        "inner.device = \"cpu\"",
        "node-b: GLOO_SOCKET_IFNAME=ib0 names no interface of the host (it has INTERFACES); fix: set "
        "hosts.node-b.env.GLOO_SOCKET_IFNAME to the interface on the route to the other hosts"]
    clean = run_console(str(write_profile(tmp_path)), "check")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    table = clean.stdout.splitlines()
    assert table[0].split() == ["host", "roles", "python", "torch", "project", "devices", "free", "disk", "data",
                                "links", "clock"]
    assert [row.split()[:2] for row in table[1:]] == [["node-a", "engine,store"], ["node-b", "engine"]]
    assert all("this checkout" in row and "connected" in row for row in table[1:])


async def test_a_port_taken_before_the_checks_listener_is_a_note_not_a_link_problem(tmp_path, monkeypatch):
    """Defect: the facts probe finds a free port for each engine host's collectives, and the link test's listener
    binds it a probe later. A port taken in between left nothing of the check listening there, and every other
    host's refusal read as a link problem ("refused while the check listened there"). Now that port is a note:
    not tested. Here the port is taken by a socket bound without listening (what refuses a connection)."""
    from console.preflight import runner
    from console.transport import make_transport

    listen, squat, squat_ports = runner._listen, [], []

    async def taken_first(host, binds, *args):
        if host.name == "node-b":
            for address, port in binds:
                sock = socket.socket()
                sock.bind((address, port))  # no SO_REUSEADDR: the listener's bind fails with EADDRINUSE
                squat.append(sock)
                squat_ports.append(port)
        return await listen(host, binds, *args)
    monkeypatch.setattr(runner, "_listen", taken_first)
    try:
        report = await runner.check_profile(load_profile(write_profile(tmp_path)), make_transport)
    finally:
        for sock in squat:
            sock.close()
    assert len(squat) == 1  # node-b's collectives (the store's port is node-a's)
    taken = f"127.0.0.1:{squat_ports[0]}"
    assert report.problems == [], report.lines()
    assert report.notes == [f"node-b: {taken} was taken before the check's listener started there: that link was "
                            f"not tested (run the check again)"]
    assert [status for *_, status, _ in report.results["node-a"].links] == ["connected", "refused"]


def test_a_start_with_a_problem_starts_nothing(tmp_path):
    """--headless: one line per problem, exit 1, no process started anywhere (a disk fuller than the profile
    allows: the engines would not mind, the check does); --no-check builds the cluster without it."""
    profile = write_profile(tmp_path)
    profile.write_text(profile.read_text().replace("link_timeout = 2.0", "link_timeout = 2.0\nmin_free_gb = 1e9"))
    done = run_console(str(profile), "--headless", "--interval", "0.5")
    assert done.returncode == 1, done.stdout + done.stderr
    said = [re.sub(r"\d+\.\d GB free under \S+", "N GB free under RUNS", line) for line in done.stderr.splitlines()]
    assert said == [f"zeroband-console: {node}: N GB free under RUNS (check.min_free_gb = 1e+09); fix: free some "
                    "space there, or point run.dir at a larger disk" for node in ("node-a", "node-b")] + [
        "zeroband-console: nothing started (zeroband-console PROFILE check; --no-check skips it)"]
    assert not list((tmp_path / "runs").glob("*/pid"))  # not even the store
    built = []

    def factory(profile, fleet, **kw):
        built.append(kw)
        raise SystemExit(0)  # built is all this test wants to see
    for argv in (["--headless"], ["--headless", "--no-check"], ["--no-check", "add", "node-b"]):
        with pytest.raises(SystemExit):
            cli.main([str(profile), *argv], cluster_factory=factory, out=io.StringIO())
    assert built == [{}, {"check": False}, {"check": False}]
    assert cli.make_cluster(load_profile(profile), Fleet(run="pf")).preflight is True  # the CLI's default: on


async def test_a_refused_start_shows_on_each_nodes_row(tmp_path):
    """The dashboard: the start worker's failure leaves each node with a problem failed, its reason and log lines
    saying what and how to fix; the others are told why they did not start."""
    from console.app import make_app
    from console.cluster import Cluster

    profile = load_profile(write_profile(tmp_path, node_b='overrides = { "data.path" = "no/such/data" }\n'))
    fleet = Fleet(run=profile.run.name)
    cluster = Cluster(profile, fleet, preflight=True)
    app = make_app(profile, cluster, fleet=fleet)
    async with app.run_test(size=(160, 40)) as pilot:
        deadline = time.monotonic() + 60
        while fleet.nodes["node-b"].state is not NodeState.FAILED:
            assert time.monotonic() < deadline, {n.name: n.state for n in fleet.nodes.values()}
            await pilot.pause(0.2)
        await pilot.pause(1.0)  # a redraw
        row = app.dashboard.table.get_row("node-b")
        assert "failed" in [getattr(cell, "plain", str(cell)) for cell in row]
        b, a = fleet.nodes["node-b"], fleet.nodes["node-a"]
        assert b.reason.startswith("preflight: data.path no/such/data does not exist on the host")
        assert any("preflight: data.path no/such/data" in str(line) for line in b.log)
        assert a.state is NodeState.OFF and any("the preflight found problems on node-b" in str(line)
                                                for line in a.log)
        await cluster.close()
    assert not list((tmp_path / "runs").glob("*/pid"))


async def test_a_cluster_start_raises_with_every_line(tmp_path):
    from console.cluster import Cluster

    port = free_port()
    profile = load_profile(write_profile(tmp_path, port=port))
    fleet = Fleet(run=profile.run.name)
    cluster = Cluster(profile, fleet, preflight=True)
    with squatter("127.0.0.1", port):
        with pytest.raises(PreflightFailed) as info:
            await cluster.start()
    await cluster.close()
    assert [line.split(";")[0] for line in info.value.lines] == [
        f"node-a: cannot listen on 127.0.0.1:{port} for the store: EADDRINUSE: Address already in use"]
    assert fleet.nodes["node-a"].state is NodeState.FAILED and fleet.nodes["node-b"].state is NodeState.OFF


def test_sync_puts_head_into_other_folders_once_and_never_into_the_checkout(tmp_path):
    """Two hosts on this machine in two folders (one of them the console's own checkout, which is never written),
    a second sync moves nothing, a stray engine file goes, an edited file comes back; shared folders are one."""
    work = tmp_path / "w"
    profile = write_profile(tmp_path, node_b=f'workdir = "{work}"\n')
    first = run_console(str(profile), "sync")
    assert first.returncode == 0, first.stdout + first.stderr
    here = Checkout.find()
    assert here is not None
    assert f"node-a: {ROOT} is the console's own checkout: nothing to send" in first.stdout
    assert re.search(rf"node-b: sending {len(here.files)} of {len(here.files)} files \(.*\) to {work}", first.stdout)
    for f in here.files[::17]:  # HEAD's content, HEAD's mode
        assert (work / f.path).read_bytes() == here.read([f])[f.path]
        assert (work / f.path).stat().st_mode & 0o777 == f.mode
    # python has no venv here: the packages are checked, nothing is set up
    assert f"node-b: {sys.executable} is set up" in first.stdout
    (work / "engine" / "stray.py").write_text("x = 1\n")
    (work / "README.md").write_text("edited on the host\n")
    second = run_console(str(profile), "sync")
    assert second.returncode == 0 and f"node-b: sending 1 of {len(here.files)} files" in second.stdout, second.stdout
    assert "node-b: removed 1 engine file(s) the commit does not have: engine/stray.py" in second.stdout
    assert not (work / "engine" / "stray.py").exists()
    third = run_console(str(profile), "sync")
    assert f"node-b: {work} is up to date ({len(here.files)} files of {here.label()})" in third.stdout, third.stdout
    assert "sending" not in third.stdout
    # a relative workdir is the folder's under where the console runs (the login folder over SSH), for the check too
    relative = write_profile(tmp_path, workdir=work, node_b='workdir = "w"\n')  # not this checkout: its edits
    checked = run_console(str(relative), "check", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert [row.split()[0] for row in checked.stdout.splitlines()[1:]] == ["node-a", "node-b"], checked.stdout
    both = write_profile(tmp_path, node_b="")
    both.write_text(both.read_text().replace(f'workdir = "{ROOT}"', f'workdir = "{work}"'))
    once = run_console(str(both), "sync")
    assert once.returncode == 0 and f"node-a+node-b: {work} is up to date" in once.stdout, once.stdout


async def test_sync_sets_up_a_venv_with_torchs_cpu_build_on_a_host_with_gpus(tmp_path):
    """check names torch's CPU build where GPUs are, and its fix is sync: sync took the venv for set up (the
    version is the console's; same_torch ignores the build), so the check failed for ever."""
    from console.profile import HostSpec
    from console.sync import _setup_due
    from console.transport import make_transport

    torch = __import__("importlib.metadata").metadata.version("torch")
    host = HostSpec(name="g", transport="local", workdir=str(ROOT), python=sys.executable,
                    env={"ZEROBAND_FAKE_GPUS": "2"})
    t = make_transport(host)
    try:
        due = await _setup_due(t, host)
        plain = await _setup_due(t, host.model_copy(update={"env": {}}))
    finally:
        await t.close()
    if torch.endswith("+cpu"):  # this machine's: the CPU build
        assert due == f"has torch {torch}, the CPU build, on a host with 2 GPU(s)"
    else:
        assert due is None
    assert plain is None


def test_sync_writes_a_shared_folder_once_and_every_other_host_apart():
    from console.sync import destinations

    text = textwrap.dedent("""\
        [engine]
        config = "configs/debug-diloco.toml"
        [sync]
        shared_fs = SHARED
        [defaults]
        workdir = "/nfs/zeroband"
        [hosts.a]
        [hosts.b]
        [hosts.c]
        """)
    shared = destinations(parse_profile(text.replace("SHARED", "true")))
    assert [(d.label, [h.name for h in d.hosts]) for d in shared] == [("a+b+c", ["a", "b", "c"])]
    apart = destinations(parse_profile(text.replace("SHARED", "false")))
    assert [d.label for d in apart] == ["a", "b", "c"]
    # two nodes of one machine in one folder: written once (two writes raced on each file, two set-ups on one venv)
    one_machine = text.replace("SHARED", "false").replace("[hosts.a]\n", '[hosts.a]\naddress = "gpu1"\n').replace(
        "[hosts.b]\n", '[hosts.b]\naddress = "gpu1"\n')
    assert [d.label for d in destinations(parse_profile(one_machine))] == ["a+b", "c"]
    other_user = one_machine.replace('[hosts.b]\naddress = "gpu1"\n', '[hosts.b]\naddress = "gpu1"\nuser = "bob"\n')
    assert [d.label for d in destinations(parse_profile(other_user))] == ["a", "b", "c"]


# ---- in the lab: network namespaces, a real sshd in each --------------------------------------------------------
LAB_HOSTS = ("a", "b", "c", "d", "store")
LAB_PROFILE = """\
# tests/test_preflight.py: four engine hosts and a store host, each a network namespace with its own sshd
[run]
name = "preflight"
dir = "{run_dir}"

[store]
host = "store"
address = "{store_address}"
bind = "{store_address}"
port = {port}

[engine]
config = "configs/debug-diloco.toml"

[engine.overrides]
"data.path" = "data/prep"
"inner.device" = "cpu"
"train.max_steps" = 9
"train.micro_batch_size" = 2
"train.batch_size" = 2
"data.seq_len" = 32
"train.log_interval" = 1
"train.eval_interval" = 0
"diloco.inner_steps" = 3
"diloco.min_nodes" = 4
"diloco.allreduce_timeout" = 30.0
"mesh.heartbeat_interval" = 0.5
"mesh.heartbeat_timeout" = 6.0
"mesh.store_timeout" = 30.0
"mesh.start_timeout" = 120.0
"mesh.polling_interval" = 0.05

[console]
poll_interval = 1.0

[check]
link_timeout = 3.0

[sync]
setup_env = {{ BASE_SITE = "{site}" }}

[defaults]
transport = "ssh"
ssh_config = "{ssh_config}"
known_hosts = "{known_hosts}"
connect_timeout = 5.0
python = "{python}"

{hosts}
"""


class PreflightLab:
    """Namespaces zbc-a .. zbc-store on one bridge, an sshd in each, a workdir per host (one file system)."""

    def __init__(self, root: Path):
        from lab import net
        from lab.hosts import HostSshd, prepare_user, user_python_env, write_ssh_config

        self.root, self.net = root, net
        key = prepare_user(root)
        self.key = key
        net.create_bridge()
        self.hosts = {name: net.NetHost(name, 20 + i) for i, name in enumerate(LAB_HOSTS)}
        self.sshds = []
        for host in self.hosts.values():
            net.create_host(host)
            self.sshds.append(HostSshd(host, root, key))
            self.sshds[-1].start()
        self.known = root / "known_hosts"
        self.known.write_text("".join(s.known_hosts_line() for s in self.sshds))
        self.ssh_config = root / "ssh_config"
        write_ssh_config(self.ssh_config, self.sshds, key, self.known)
        self.python, self.python_env = user_python_env()
        self.port = free_port()
        self.work = {name: root / f"w-{name}" for name in LAB_HOSTS}
        self.profile = root / "preflight.toml"

    def workdir_at(self, name: str, commit: str) -> None:
        """The project as it is at `commit`, in the host's workdir, owned by the login user."""
        work = self.work[name]
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True,
                                 timeout=60).stdout
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True, timeout=60)
        self.own(work)

    def own(self, path: Path) -> None:
        subprocess.run(["chown", "-R", "zbtest:zbtest", str(path)], check=True, timeout=60)

    def as_user(self, *argv: str) -> None:
        subprocess.run(["runuser", "-u", "zbtest", "--", *argv], check=True, capture_output=True, timeout=120)

    def write_profile(self, hosts: dict[str, str], envs: dict[str, dict[str, str]], setup_env: bool = True) -> None:
        tables = []
        for name in LAB_HOSTS:
            env = dict(self.python_env) if name != "b" else {}  # b's python is its own venv's
            env.update(OMP_NUM_THREADS="1", **envs.get(name, {}))
            lines = [f"[hosts.{name}]", f'ssh_alias = "zbc-{name}"', f'workdir = "{self.work[name]}"',
                     "env = { " + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + " }"]
            tables.append("\n".join(lines) + "\n" + textwrap.dedent(hosts.get(name, "")))
        text = LAB_PROFILE.format(run_dir=self.root / "runs", store_address=self.hosts["store"].address,
                                  port=self.port, site=sysconfig.get_paths()["purelib"], ssh_config=self.ssh_config,
                                  known_hosts=self.known, python=self.python, hosts="\n".join(tables))
        if not setup_env:
            text = text.replace(f'setup_env = {{ BASE_SITE = "{sysconfig.get_paths()["purelib"]}" }}\n', "")
        self.profile.write_text(text)

    def console(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        from lab.lab import lab_env

        return subprocess.run([sys.executable, "-m", "console", str(self.profile), *args], cwd=ROOT, env=lab_env(),
                              capture_output=True, text=True, timeout=timeout, start_new_session=True)

    def block_port(self, name: str, address: str, port: int) -> None:
        """An nftables rule in the host's namespace that drops what it sends to address:port (and nothing else)."""
        rules = (f"table inet zbc_preflight {{\n  chain out {{ type filter hook output priority 0; "
                 f"ip daddr {address} tcp dport {port} drop; }}\n}}\n")
        self.net.sh(self.hosts[name].exec_args("nft", "-f", "-"), stdin=rules)

    def block_new_connections(self, name: str, address: str) -> None:
        """The same table: a rule that drops every new TCP connection the host opens to address (replies pass)."""
        rules = (f"table inet zbc_preflight {{\n  chain out {{ type filter hook output priority 0; "
                 f"ct state new ip daddr {address} tcp dport 1024-65535 drop; }}\n}}\n")
        self.net.sh(self.hosts[name].exec_args("nft", "-f", "-"), stdin=rules)

    def unblock_port(self, name: str) -> None:
        self.net.sh(self.hosts[name].exec_args("nft", "delete", "table", "inet", "zbc_preflight"))

    def close(self) -> None:
        for host in self.hosts.values():
            self.net.remove_host(host.netns)  # sshd, the engines and the store run in there
        for sshd in self.sshds:
            if sshd.proc is not None:
                sshd.proc.wait(timeout=10)
        self.net.cleanup_leftovers()


def expect_lines(text: str, patterns: list[str]) -> None:
    """Every line matches one pattern, in order, and every pattern one line."""
    lines = [line.removeprefix("zeroband-console: ") for line in text.strip().splitlines()]
    assert len(lines) == len(patterns) and all(re.match(p, line) for p, line in zip(patterns, lines)), \
        "\n".join(["got:", *lines, "wanted:", *patterns])


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 80 s alone on 2 cores (230 s on one loaded by others); up to 600 s for another lab's lock
def test_lab_check_names_every_planted_problem_then_sync_and_fixes_make_it_train():
    from lab import net

    here = Checkout.find()
    assert here is not None and here.commit
    older = subprocess.run(["git", "-C", str(ROOT), "log", "-n", "2", "--format=%H", "HEAD", "--", "engine"],
                           capture_output=True, text=True, check=True, timeout=30).stdout.split()[-1]
    from lab.lab import holding_lock

    with holding_lock():
        net.cleanup_leftovers()
        root = Path(tempfile.mkdtemp(prefix="zbc-lab-preflight-"))  # lab cleanup (scripts/chaos.py) knows the prefix
        root.chmod(0o755)
        lab = None
        try:
            lab = PreflightLab(root)
            started = time.monotonic()
            _plant_and_check(lab, here, older)
            _sync_fixes_commit_and_venv(lab)
            _fix_the_rest_and_train(lab)
            print(f"preflight lab: {time.monotonic() - started:.0f}s after set-up")
        finally:
            if lab is not None:
                lab.close()
            net.cleanup_leftovers()
            shutil.rmtree(root, ignore_errors=True)
        assert net.leftovers() == ([], [])


def _plant_and_check(lab: PreflightLab, here: Checkout, older: str) -> None:
    prepared = lab.root / "prep"
    subprocess.run([sys.executable, "-m", "engine.data", "prepare", "corpus/stdlib_docstrings.jsonl", "--out",
                    str(prepared), "--workers", "0", "--quiet"], cwd=ROOT, check=True, timeout=120,
                   capture_output=True)
    for name in LAB_HOSTS:
        lab.workdir_at(name, older if name == "b" else "HEAD")  # 1. another commit on b
        if name not in ("c", "store"):  # 3. the data folder missing on c
            shutil.copytree(prepared, lab.work[name] / "data" / "prep")
    manifest = lab.work["b"] / "data" / "prep" / "manifest.json"  # 4. b's prepared folder is another one
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "name": "another-prepare"}))
    for name in LAB_HOSTS:
        lab.own(lab.work[name])
    lab.as_user(lab.python, "-m", "venv", "--without-pip", str(lab.work["b"] / ".venv"))  # 2. a venv without torch
    store = lab.hosts["store"].address
    lab.block_port("a", store, lab.port)  # 5. the store's port dropped on its way from a
    c_address = lab.hosts["c"].address
    lab.block_new_connections("a", c_address)  # 5b. and a's connections to c, whose gloo it dials for collectives
    # 7. a missing identity file (d); 8. more workers than devices: c's one worker on cuda, where NVML (faked: the
    # same answer on a machine with a GPU) sees none; 9. an interface c does not have
    lab.write_profile(*_planted_hosts(lab))
    w = {name: re.escape(str(path)) for name, path in lab.work.items()}
    wanted = [
        rf"a: cannot reach the store at {store}:{lab.port}: no answer \(a firewall drops it\?\); fix: open TCP "
        rf"{lab.port} from this host to {store}",
        rf"a: cannot reach c's outer-step collectives \(gloo\) at {re.escape(c_address)}:\d+: no answer \(a "
        rf"firewall drops it\?\); fix: open TCP from this host to {re.escape(c_address)} on every port",
        r"b: torch, transformers, pydantic, numpy not installed for \.venv/bin/python; fix: "
        r"zeroband-console .* sync \(it runs scripts/setup.sh in the venv\)",
        rf"b: the project in {w['b']} is not the console's \(host: engine \w+; console: commit \w+, engine \w+\); "
        r"fix: zeroband-console .* sync",
        # d cannot vote: of the two prepared folders the check sees, the first host's is the reference
        r"b: data.path data/prep differs from a's data/prep \(manifest \w+ vs \w+\): not the same prepared data; "
        r"fix: copy one prepared folder",
        rf"c: data.path data/prep does not exist on the host \({w['c']}/data/prep\); fix: copy it there",
        r"c: workers = 1 on inner.device cuda but fake \(ZEROBAND_FAKE_GPUS\) sees 0 GPUs; fix: set "
        r"hosts.c.workers to at most 0",
        r"c: GLOO_SOCKET_IFNAME=ib0 names no interface of the host \(it has eth0, lo\); fix: set "
        r"hosts.c.env.GLOO_SOCKET_IFNAME",
        rf"d: identity_file {re.escape(str(lab.root / 'no_such_key'))} does not exist on this machine; fix: create "
        r"the key \(ssh-keygen\) or point hosts.d.identity_file at an existing one",
        rf"store: cannot listen on {store}:{lab.port} for the store: EADDRINUSE: Address already in use; fix: end "
        rf"what listens there \(ss -ltnp 'sport = :{lab.port}'\) or choose another port in \[store\]",
    ]
    with squatter(store, lab.port, lab.hosts["store"].netns):  # 6. the store's port taken on its host
        check = lab.console("check")
        assert check.returncode == 1, check.stdout + check.stderr
        expect_lines(check.stdout, wanted)
        # a start: the same lines, and nothing starts anywhere (with d's key back: a shell command refuses a missing
        # identity file itself, before it reaches any host)
        hosts, envs = _planted_hosts(lab)
        lab.write_profile({**hosts, "d": f'identity_file = "{lab.key}"\n'}, envs)
        start = lab.console("--headless", "--interval", "1")
        assert start.returncode == 1, start.stdout + start.stderr
        expect_lines(start.stderr, [p for p in wanted if not p.startswith("d:")] +
                     [r"nothing started \(zeroband-console PROFILE check; --no-check"])
        assert not list((lab.root / "runs").glob("*/pid")) and not list((lab.root / "runs").glob("*/events.jsonl"))


def _sync_fixes_commit_and_venv(lab: PreflightLab) -> None:
    lab.write_profile(*_planted_hosts(lab), setup_env=False)
    offline = lab.console("sync", timeout=300)  # without BASE_SITE, setup would download: b cannot reach pypi
    assert offline.returncode == 1, offline.stdout + offline.stderr
    out = offline.stdout
    assert re.search(rf"^b: sending \d+ of \d+ files \(.*\) to {re.escape(str(lab.work['b']))}$", out, re.M), out
    for name in ("a", "c", "store"):  # (what a commit made meanwhile by another hand would bring, nothing else)
        assert re.search(rf"^{name}: ({re.escape(str(lab.work[name]))} is up to date|sending \d+ of)", out, re.M), out
        assert f"{name}: {lab.python} is set up" in out, out
    assert re.search(r"^b: cannot reach the package registry pypi\.org:443 \((unresolved|unreachable|timeout): .*\) "
                     r"to set up \.venv \(does not|lacks torch.*\); give the host a route or a proxy", out, re.M), out
    assert f"d: cannot reach it: identity_file {lab.root / 'no_such_key'} does not exist on this machine" in out, out
    lab.write_profile(*_planted_hosts(lab))  # BASE_SITE: the venv links this machine's packages (setup.sh)
    fixed = lab.console("sync", timeout=300)
    assert re.search(rf"^b: {re.escape(str(lab.work['b']))} is up to date|^b: sending \d+ of", fixed.stdout, re.M), \
        fixed.stdout
    assert re.search(r"^b: \.venv: lacks torch, transformers, pydantic, numpy: running scripts/setup.sh", fixed.stdout,
                     re.M), fixed.stdout
    assert "b:   [setup] using the packages of " in fixed.stdout and "b: .venv set up in " in fixed.stdout, fixed.stdout
    assert fixed.returncode == 1  # d still cannot be reached


def _planted_hosts(lab: PreflightLab) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    return ({"b": 'venv = ".venv"\n', "c": 'overrides = { "inner.device" = "cuda" }\n',
             "d": f'identity_file = "{lab.root / "no_such_key"}"\n', "store": "standby = true\n"},
            {"c": {"GLOO_SOCKET_IFNAME": "ib0", "ZEROBAND_FAKE_GPUS": "0"}})


def _fix_the_rest_and_train(lab: PreflightLab) -> None:
    store = lab.hosts["store"].address
    again = lab.console("check")  # sync fixed b: its two lines are gone, the others remain (the squatter left)
    assert [line.split(":")[0] for line in again.stdout.splitlines()] == ["a", "a", "b", "c", "c", "c", "d"], \
        again.stdout
    lab.unblock_port("a")  # both of a's rules
    shutil.rmtree(lab.work["b"] / "data" / "prep")
    for name in ("b", "c"):
        shutil.copytree(lab.work["a"] / "data" / "prep", lab.work[name] / "data" / "prep")
        lab.own(lab.work[name])
    lab.write_profile({"b": 'venv = ".venv"\n', "d": f'identity_file = "{lab.key}"\n', "store": "standby = true\n"},
                      {"c": {"GLOO_SOCKET_IFNAME": "eth0", "ZEROBAND_FAKE_GPUS": "0"}})
    clean = lab.console("check")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    rows = {line.split()[0]: line for line in clean.stdout.splitlines()[1:]}
    assert list(rows) == list(LAB_HOSTS) and all("connected" in rows[n] for n in "abcd"), clean.stdout
    assert rows["store"].split()[1] == "store"  # a standby store host: only the store's checks
    lab.console("sync", timeout=300)  # (brings what a commit made meanwhile by another hand, if one did)
    moved = lab.console("sync", timeout=300)  # a second sync moves nothing
    assert moved.returncode == 0 and "sending" not in moved.stdout and "running scripts/setup.sh" not in moved.stdout, \
        moved.stdout
    run = lab.console("--headless", "--interval", "2", timeout=400)
    try:
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
        for name in "abcd":
            events = [json.loads(line) for line in (lab.root / "runs" / name / "events.jsonl").read_text().splitlines()
                      if line.startswith("{")]
            outer = [e for e in events if e.get("type") == "outer_step"]
            assert len(outer) >= 3 and outer[-1]["members"] and len(outer[-1]["members"]) == 4, (name, outer[-1:])
            assert [e for e in events if e.get("type") == "run_end"][-1]["status"] == "completed"
        assert store in run.stdout
    finally:
        kill_recorded_groups((lab.root / "runs").glob("*/pid"))
