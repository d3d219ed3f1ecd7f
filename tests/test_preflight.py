"""Before anything starts: `check`, the same preflight before every start, and `sync` (console/preflight/,
console/sync.py).

    pure rules            facts in, one line per problem out (GPUs against workers with the fake count, disk,
                          clock, interfaces, manifests, links, host keys)
    on this machine       the host script through the local transport: planted problems named, a clean profile's table;
                          a start refused with nothing started (headless, and the dashboard's rows); sync of
                          HEAD into other folders, idempotent, never into the console's own checkout

The lab (network namespaces, a real sshd in each) is tests/test_preflight_lab.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from console import cli
from console.preflight.checkout import Checkout
from console.fleet import Fleet, HostState
from console.preflight import PreflightFailed, host_script
from console.preflight.rules import Expect, HostPlan, HostResult, Target, clock_skew, exposed, ifname_matches, judge
from console.profile import ProfileError, load_profile, parse_profile
from procs import ROOT, free_port


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


def test_the_host_script_parses_on_old_pythons_and_never_imports_torch():
    source = Path(host_script.__file__).read_text()
    import ast

    tree = ast.parse(source, feature_version=(3, 6))  # old pythons must be able to say they are old
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "transformers", "numpy", "engine", "console"}, imported
    assert not any(isinstance(n, ast.AnnAssign) or getattr(n, "returns", None) for n in ast.walk(tree))


def test_the_console_digest_of_head_equals_the_host_scripts_digest_of_heads_files(tmp_path):
    here = Checkout.find()
    assert here is not None and here.is_git and here.engine
    engine = [f for f in here.files if f.path.startswith("engine/")]
    for f, data in here.read(engine).items():
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes(data)
    assert host_script.engine_digest(str(tmp_path))[0] == here.engine
    (tmp_path / "engine" / "stray.py").write_text("x = 1\n")
    assert host_script.engine_digest(str(tmp_path))[0] != here.engine


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


# ---- over the internet (issue 41, item 7) -----------------------------------------------------------------------
PRIVATE = ["127.0.0.1", "10.1.2.3", "172.16.0.1", "172.31.255.254", "192.168.1.1", "169.254.1.1", "100.64.0.1",
           "100.127.255.254", "fd00::1", "fe80::1", "::1"]


def test_an_address_that_is_not_private_is_one_warning_for_the_run_naming_the_ways_to_close_it():
    """The TCP store and gloo have no authentication and no encryption: a listener beyond a private network is
    said once, whoever listens there, with what closes it. Both sides of each range's edge (8.8.8.8 only as a
    string: nothing dials it)."""
    from console.preflight.rules import exposed, exposure_warning

    assert [a for a in PRIVATE if exposed(a)] == []
    public = ["8.8.8.8", "172.15.255.255", "172.32.0.1", "100.63.255.255", "100.128.0.1", "2001:4860:4860::8888",
              "fe00::1"]
    assert [a for a in public if not exposed(a)] == []
    assert exposed("0.0.0.0") and exposed("::")  # every interface, a public one among them perhaps
    assert exposed("gpu1.example.org") is None  # a name: the runner resolves it first
    assert exposure_warning([("the store (node-a, port 29600)", a) for a in PRIVATE]) is None
    warning = exposure_warning([("the store (node-a, port 29600)", "8.8.8.8"), ("node-b's collectives (gloo)",
                                                                                "10.0.0.2"),
                                ("node-c's collectives (gloo)", "2001:4860:4860::8888")])
    assert warning is not None and warning.count("warning") == 1 and "10.0.0.2" not in warning
    assert ("(the TCP store, gloo): the store (node-a, port 29600) on 8.8.8.8; node-c's collectives (gloo) on "
            "2001:4860:4860::8888. Whoever reaches them can join or steer the run") in warning
    for way in ('etcd with TLS for the store (store.backend = "etcd")', "a VPN between the hosts such as WireGuard",
                "the store bound to a private address (store.bind)", 'docs/operations.md, "Over the internet"'):
        assert way in warning
    assert "(every interface)" in exposure_warning([("the store (node-a, port 1)", "0.0.0.0")])


async def test_the_store_and_each_engines_collectives_are_judged_where_they_listen(tmp_path):
    """The store on its bind address (a name as this machine resolves it), each engine host on the address its
    gloo listens on (the host script's `peer`); etcd members take only the run's certificate and are left out."""
    from console.preflight.runner import build_plans, listeners

    text = write_profile(tmp_path).read_text()
    (tmp_path / "pub.toml").write_text(text.replace("[store]\n", '[store]\naddress = "8.8.8.8"\n'))
    public = load_profile(tmp_path / "pub.toml")
    plans = build_plans(public, "start", None, None, bind=False)
    results = {"node-a": HostResult("node-a", facts={"peer": ["10.0.0.1", 40000]}),
               "node-b": HostResult("node-b", facts={"peer": ["8.8.4.4", 40001]})}
    port = public.store.port
    assert await listeners(public, plans, results) == [(f"the store (node-a, port {port})", "8.8.8.8"),
                                                       ("node-a's collectives (gloo)", "10.0.0.1"),
                                                       ("node-b's collectives (gloo)", "8.8.4.4")]
    (tmp_path / "named.toml").write_text(text.replace("[store]\n", '[store]\naddress = "localhost"\n'))
    named = load_profile(tmp_path / "named.toml")
    found = await listeners(named, build_plans(named, "start", None, None), {})
    assert found and all(what == f"the store (node-a, port {named.store.port}, localhost)" and not exposed(ip)
                         for what, ip in found)
    assert await listeners(named, build_plans(named, "add", ["node-b"], None), {}) == []  # an add: no store


async def test_the_starts_warning_is_said_once_per_run(tmp_path, monkeypatch):
    from console.cluster import Cluster
    from console.preflight import runner

    profile = load_profile(write_profile(tmp_path))
    report = runner.Report(runner.build_plans(profile, "start", None, None), {}, None, [], [], ["warning: W"])

    async def preflight(*args, **kw):
        return report
    monkeypatch.setattr(runner, "preflight", preflight)
    fleet = Fleet(run=profile.run.name)
    cluster = Cluster(profile, fleet, preflight=True)
    await cluster._check_before("start", hosts=["node-a", "node-b"])
    await cluster._check_before("add", "node-b")
    await cluster.close()
    assert cluster.warnings == ["warning: W"]
    assert [line for n in fleet.nodes.values() for line in n.log if "W" in line] == ["[console] warning: W"]


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
    assert "warning" not in clean.stdout + clean.stderr  # the store and gloo on loopback: private (item 7)


async def test_a_port_taken_before_the_checks_listener_is_a_note_not_a_link_problem(tmp_path, monkeypatch):
    """Defect: the host script's facts find a free port for each engine host's collectives, and the link test's
    listener binds it a moment later. A port taken in between left nothing of the check listening there, and every other
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
        while fleet.nodes["node-b"].state is not HostState.FAILED:
            assert time.monotonic() < deadline, {n.name: n.state for n in fleet.nodes.values()}
            await pilot.pause(0.2)
        await pilot.pause(1.0)  # a redraw
        row = app.dashboard.table.get_row("node-b")
        assert "failed" in [getattr(cell, "plain", str(cell)) for cell in row]
        b, a = fleet.nodes["node-b"], fleet.nodes["node-a"]
        assert b.reason.startswith("preflight: data.path no/such/data does not exist on the host")
        assert any("preflight: data.path no/such/data" in str(line) for line in b.log)
        assert a.state is HostState.OFF and any("the preflight found problems on node-b" in str(line)
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
    assert fleet.nodes["node-a"].state is HostState.FAILED and fleet.nodes["node-b"].state is HostState.OFF


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


# ---- the memory estimate against the GPUs' memory (engine/memory.py) ----------------------------------------------
def _one_b(**over):
    from engine.config import load_config
    return load_config(ROOT / "configs/1b.toml", {"inner.strategy": "ddp", "train.activation_checkpointing": False,
                                                  **over})


def _gpu_of(need: int) -> int:
    """The smallest GPU (bytes) whose usable part takes `need` bytes per process."""
    from engine.memory import CUDA_CONTEXT, HEADROOM
    return -(-(need + CUDA_CONTEXT) * 10 // int(HEADROOM * 10)) + 10


def test_a_config_that_cannot_fit_the_gpus_is_one_line_with_the_largest_part_and_a_setting_that_fits():
    from engine.memory import GiB, estimate
    cfg = _one_b()
    need = estimate(cfg, workers=8).per_gpu
    gpu = _gpu_of(need)

    def verdict(memory: int) -> list[str]:
        gpus = {"count": 8, "source": "fake (ZEROBAND_FAKE_GPUS)", "note": None, "memory": memory}
        return lines([plan(engine_config=cfg)], [HostResult("node-a", facts=facts(gpus=gpus), sent=100,
                                                            received=100)])
    assert verdict(gpu) == []  # just large enough
    small = verdict(gpu - 20)  # just too small
    assert small == [f"node-a: the estimate is {need / GiB:.1f} GiB per GPU (largest: activations "
                     f"{next(p.bytes for p in estimate(cfg, workers=8).parts if p.name == 'activations') / GiB:.1f} "
                     f"GiB), more than the {(gpu - 20) * 0.9 / GiB - 0.5:.1f} GiB usable of the {(gpu - 20) / GiB:.0f} "
                     f"GiB GPUs fake (ZEROBAND_FAKE_GPUS) sees; fix: set train.activation_checkpointing = true "
                     f"(python -m engine.train CONFIG --dry-run shows the table)"]
    # nothing fits a 1 GiB GPU (less than the CUDA context and the headroom): the fix says what is left
    assert verdict(GiB)[0].endswith("fix: a larger GPU, more workers with a sharded inner.strategy, or a smaller "
                                        "model")
    # unknown memory (an old host script, nvidia-smi without the query) or the CPU: no verdict
    assert verdict(None) == []
    assert lines([plan(engine_config=cfg, device="cpu", workers=2)], [HostResult(
        "node-a", facts=facts(), sent=100, received=100)]) == []


def test_fake_gpus_carry_a_memory_size():
    assert host_script.gpus("8x80", None) == {"count": 8, "source": "fake (ZEROBAND_FAKE_GPUS)", "note": None,
                                        "memory": 80 * 2**30}
    assert host_script.gpus("2x0.5GiB", "0")["memory"] == 2**29 and host_script.gpus("2x0.5GiB", "0")["count"] == 1
    assert host_script.gpus("2", None)["memory"] is None and host_script.gpus("0x80", None)["memory"] is None


def test_check_refuses_a_config_that_cannot_fit_the_fake_gpus(tmp_path):
    from engine.config import load_config
    from engine.memory import GiB, estimate
    over = {"data.path": "corpus/stdlib_docstrings.jsonl", "inner.device": "cuda", "data.seq_len": 2048}
    need = estimate(load_config(ROOT / "configs/debug-diloco.toml", over), workers=1).per_gpu
    size = (need - 2**20 + int(0.5 * GiB)) / 0.9 / GiB  # GiB: one MiB short of the estimate
    profile = write_profile(tmp_path, node_b=textwrap.dedent(f"""\
        env = {{ ZEROBAND_FAKE_GPUS = "1x{size:.6f}" }}
        overrides = {{ "inner.device" = "cuda", "data.seq_len" = 2048 }}
        """))
    done = run_console(str(profile), "check")
    assert done.returncode == 1, done.stdout + done.stderr
    memory = [ln for ln in done.stdout.splitlines() if "the estimate is" in ln]
    assert len(memory) == 1 and memory[0].startswith("node-b: the estimate is") and \
        "fix: set train.activation_checkpointing = true" in memory[0], done.stdout
    roomy = write_profile(tmp_path, node_b=textwrap.dedent(f"""\
        env = {{ ZEROBAND_FAKE_GPUS = "1x{size + 0.01:.6f}" }}
        overrides = {{ "inner.device" = "cuda", "data.seq_len" = 2048 }}
        """))
    assert "the estimate is" not in run_console(str(roomy), "check").stdout
