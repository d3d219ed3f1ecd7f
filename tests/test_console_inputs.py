"""Bad inputs to the console's shell commands (issue 24): a typo given to `add`, a drain of a node that does not
run, a missing identity file, and the recipes' rule for secrets. Each one either changes nothing or says exactly
what is wrong, in one line, with a non-zero exit."""

from __future__ import annotations

import asyncio
import io
import os
import re
import socket
import sys
from pathlib import Path

import pytest

from console import cli
from console.fleet import Fleet, NodeState
from console.profile import load_profile
from procs import free_port
from test_cluster import PROFILE, cleanup, make_profile, until, workdir  # noqa: F401 -- fixtures

ROOT = Path(__file__).resolve().parent.parent


def _cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main(argv, out=out), out.getvalue()


# ---- item 1: `add` of a name the profile does not have ---------------------------------------------------------
def _five_hosts(workdir: Path) -> Path:
    path = workdir / "p.toml"
    path.write_text(PROFILE.format(port=free_port(), python=sys.executable, workdir=workdir, b_extra="")
                    + "\n[hosts.node-e]\nstandby = true\n")
    return path


def test_add_of_a_typo_changes_nothing_and_names_the_hosts(workdir, capsys):
    """Defect: `add node-ee` wrote an active [hosts.node-ee] with transport = "ssh" into the profile, said
    "retrying" and exited 1; the next start tried to SSH to it."""
    path = _five_hosts(workdir)
    before = path.read_bytes()
    code, out = _cli([str(path), "add", "node-ee"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE and out == ""
    assert path.read_bytes() == before  # byte-identical: nothing written
    assert not (workdir / "runs").exists()  # nothing started, no folder made
    assert len(err.strip().splitlines()) == 1, err
    assert "node-ee is not a host of" in err and "node-a, node-b, node-c, node-e" in err
    assert "did you mean node-e?" in err and "retrying" not in err
    assert "user@host:port" in err  # how to give a new machine instead


async def test_cluster_add_of_an_unknown_name_refuses_and_touches_nothing(workdir, cleanup):  # noqa: F811
    """The dashboard's add goes through Cluster.add: the same refusal, no row added, the file untouched."""
    from console.cluster import Cluster

    path = _five_hosts(workdir)
    before = path.read_bytes()
    fleet = Fleet()
    cluster = Cluster(load_profile(path), fleet)
    try:
        out = await cluster.add("nodee")
        assert not out and "did you mean node-e?" in out.message
        assert path.read_bytes() == before and set(fleet.nodes) == {"node-a", "node-b", "node-c", "node-e"}
        assert set(cluster.profile.hosts) == set(fleet.nodes)
    finally:
        await cluster.close()


def test_what_add_takes_for_a_new_machine(workdir):
    """An address (IP, a dotted name, user@ or :port) or an alias the ssh config gives a HostName is a new machine;
    a bare name that is none of these is refused with the hosts it may have meant."""
    from console.hosts import UnknownHost, new_host_target

    config = workdir / "ssh_config"
    config.write_text("Host gpu7\n  HostName 10.0.0.7\n")
    path = workdir / "p.toml"
    path.write_text(PROFILE.format(port=free_port(), python=sys.executable, workdir=workdir, b_extra="")
                    .replace('transport = "local"', f'transport = "local"\nssh_config = "{config}"'))
    profile = load_profile(path)
    assert new_host_target(profile, "10.0.0.9") == (None, "10.0.0.9", None)
    assert new_host_target(profile, "box.example.org") == (None, "box.example.org", None)
    assert new_host_target(profile, "bob@box") == ("bob", "box", None)
    assert new_host_target(profile, "box:2222") == (None, "box", 2222)
    assert new_host_target(profile, "gpu7") == (None, "gpu7", None)  # an ~/.ssh/config alias
    # IPv6: bare, or in brackets with a port (ssh -J's form); "not a host name" before
    assert new_host_target(profile, "2001:db8::5") == (None, "2001:db8::5", None)
    assert new_host_target(profile, "bob@[2001:db8::5]:2222") == ("bob", "2001:db8::5", 2222)
    with pytest.raises(UnknownHost, match=r"gpu8 is not a host of [^:]*p\.toml \(its hosts: node-a, node-b, node-c;"):
        new_host_target(profile, "gpu8")
    with pytest.raises(ValueError, match="node-x is not a host of .*did you mean node-a, node-b or node-c\\?"):
        new_host_target(profile, "node-x")
    with pytest.raises(ValueError, match="not a host name or"):
        new_host_target(profile, "not a host!")


# ---- item 4: drain of a node that does not run -----------------------------------------------------------------
async def test_drain_of_a_node_that_does_not_run_says_so(workdir, cleanup):  # noqa: F811
    """Defect: a stopped node whose folder exists answered "drain requested" (exit 0), one never started
    "touch: cannot touch ..."; both now say the node is not running, like kill, and leave no drain file."""
    from console.cluster import Cluster

    profile = make_profile(workdir)
    fleet = Fleet()
    cluster = Cluster(profile, fleet)
    try:
        never = await cluster.drain("node-b")
        assert not never and never.message == "node-b: not running (nothing to drain)"
        stopped = workdir / "runs" / "t" / "node-a"
        stopped.mkdir(parents=True)
        (stopped / "pid").write_text("999999999\n")  # the pid file of a process long gone
        (stopped / "rc").write_text("0\n")
        gone = await cluster.drain("node-a")
        assert not gone and gone.message == "node-a: not running (nothing to drain)"
        assert not (stopped / "drain").exists() and not (workdir / "runs" / "t" / "node-b").exists()
    finally:
        await cluster.close()


def test_drain_from_the_shell_of_a_stopped_node_exits_1(workdir, capsys):
    profile = make_profile(workdir)
    code, out = _cli([profile.path, "drain", "node-b"])
    err = capsys.readouterr().err
    assert (code, out) == (cli.EXIT_FAILED, "")
    assert err.strip() == "zeroband-console: node-b: not running (nothing to drain)"


# ---- item 6: a missing identity file ---------------------------------------------------------------------------
SSH_PROFILE = """\
[run]
name = "keys"
dir = "runs/keys"

[store]
host = "node-a"
port = {port}

[engine]
config = "configs/fake.toml"

[defaults]
transport = "ssh"
address = "127.0.0.1"
port = 1
{defaults}
[hosts.node-a]
{node_a}
[hosts.node-b]
"""


def test_status_with_a_missing_identity_file_names_it(tmp_path, capsys):
    """Defect: `unreachable (cannot reach 127.0.0.1: No such file or directory)` on the node, and exit 0."""
    path = tmp_path / "keys.toml"
    path.write_text(SSH_PROFILE.format(port=free_port(), defaults="", node_a=f'identity_file = "{tmp_path}/gone"'))
    code, out = _cli([str(path), "status"])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_USAGE and out == ""
    assert err == (f"zeroband-console: {path}:18: hosts.node-a.identity_file: {tmp_path}/gone does not exist on "
                   "this machine (the key this console logs in to node-a with)")


def test_a_missing_identity_file_from_defaults_points_at_defaults(tmp_path, capsys):
    path = tmp_path / "keys.toml"
    path.write_text(SSH_PROFILE.format(port=free_port(), defaults='identity_file = "~/no/such/key_zb"', node_a=""))
    code, _ = _cli([str(path), "stop"])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_USAGE and len(err.splitlines()) == 1
    assert err.startswith(f"zeroband-console: {path}:16: hosts.node-a.identity_file: ~/no/such/key_zb does not exist")


async def test_the_ssh_transport_names_a_missing_identity_file(tmp_path):
    """Where the key goes missing under a running dashboard: the node's reason names it, not ENOENT."""
    from console.transport import TransportError, make_transport

    path = tmp_path / "keys.toml"
    path.write_text(SSH_PROFILE.format(port=free_port(), defaults="", node_a=f'identity_file = "{tmp_path}/gone"'))
    t = make_transport(load_profile(path).hosts["node-a"])
    with pytest.raises(TransportError) as caught:
        await t.connect()
    assert str(caught.value) == (f"hosts.node-a.identity_file: {tmp_path}/gone does not exist on this machine "
                                 "(the key this console logs in to node-a with)")
    assert caught.value.link
    await t.close()


# ---- item 13: the recipes never write a variable named like a credential ---------------------------------------
def test_recipes_never_write_a_variable_named_like_a_credential():
    """Defect: the docs say "KEY included", but DB_KEY was written into the script."""
    from console.recipes import SECRET_WORDS, env_lines

    env = {"DB_KEY": "k1", "SSH_KEYFILE": "k2", "hf_token": "k3", "MY_PASSWD": "k4", "OAUTH_X": "k5",
           "GCP_CREDENTIALS": "k6", "PRIVATE_THING": "k7", "APP_SECRET": "k8", "NCCL_DEBUG": "INFO"}
    text = "\n".join(env_lines(env, "p"))
    assert all(f"k{i}" not in text for i in range(1, 9)), text
    assert "export NCCL_DEBUG=INFO" in text
    for key in env.keys() - {"NCCL_DEBUG"}:
        assert f'"${{{key}:?{key} must be set in the environment' in text
    # the docs say exactly the rule: the same words, in the same order
    words = ", ".join(SECRET_WORDS[:-1]) + f" or {SECRET_WORDS[-1]}"
    for doc in (ROOT / "docs" / "strategies.md", ROOT / "console" / "recipes.py"):
        flat = re.sub(r"\s+", " ", doc.read_text())
        assert f"whose name contains {words} (in any case" in flat, doc


# ---- issue 41: etcd endpoints, a missing ssh_config ------------------------------------------------------------
ETCD_ENDPOINTS = """\
[run]
name = "e"
dir = "runs/e"

[store]
backend = "etcd"
etcd_endpoints = [{endpoints}]
etcd_ca = "ca.crt"
etcd_cert = "client.crt"
etcd_key = "client.key"

[engine]
config = "configs/fake.toml"

[hosts.node-a]
transport = "local"
"""


@pytest.mark.parametrize("endpoints, said", [
    ('"notaport"', "'notaport' has no port (host:port, e.g. 10.0.0.1:2379)"),
    ('"10.0.0.1:2379", "10.0.0.2:99999"', "'10.0.0.2:99999': port 99999 is outside 1-65535"),
    ('"10.0.0.1:0"', "'10.0.0.1:0': port 0 is outside 1-65535"),
    ('"http://10.0.0.1:2379"', "'http://10.0.0.1:2379': etcd here is reached over TLS (https://host:port, or "
                               "host:port), not http://"),
])
def test_a_bad_etcd_endpoint_is_one_line_at_its_profile_line(tmp_path, capsys, endpoints, said):
    """Defect: `check` raised ValueError from preflight/runner.py ("notaport"); port 99999 failed later as a
    connection error. Both are the profile's line now, exit 2, and no host is asked."""
    path = tmp_path / "e.toml"
    path.write_text(ETCD_ENDPOINTS.format(endpoints=endpoints))
    for command in ("check", "status"):
        code, out = _cli([str(path), command])
        err = capsys.readouterr().err
        assert (code, out) == (cli.EXIT_USAGE, ""), err
        assert err == f"zeroband-console: {path}:7: store.etcd_endpoints: {said}\n"
    assert not (tmp_path / "runs").exists()


def test_good_etcd_endpoints_are_read_as_written(tmp_path):
    from console.profile import etcd_endpoint

    eps = '"10.0.0.1:2379", "[fd00::1]:2381", "https://etcd.example.org:65535/", "h:1"'
    path = tmp_path / "e.toml"
    path.write_text(ETCD_ENDPOINTS.format(endpoints=eps))
    assert load_profile(path).store.etcd_endpoints == ["10.0.0.1:2379", "[fd00::1]:2381",
                                                       "https://etcd.example.org:65535/", "h:1"]
    assert [etcd_endpoint(e) for e in load_profile(path).store.etcd_endpoints] == [
        ("10.0.0.1", 2379), ("fd00::1", 2381), ("etcd.example.org", 65535), ("h", 1)]


@pytest.mark.parametrize("command", ["status", "stop", "kill node-a", "add node-b"])
def test_a_missing_ssh_config_is_one_line_naming_it_and_exit_2(tmp_path, capsys, command):
    """Defect: `status` showed every node "unreachable (hosts.node-a.ssh_config: ... does not exist)" and exited 0."""
    path = tmp_path / "keys.toml"
    path.write_text(SSH_PROFILE.format(port=free_port(), defaults=f'ssh_config = "{tmp_path}/no_config"',
                                       node_a="") + "standby = true\n")
    code, out = _cli([str(path), *command.split()])
    err = capsys.readouterr().err
    assert (code, out) == (cli.EXIT_USAGE, "")
    assert err == (f"zeroband-console: {path}:16: hosts.node-a.ssh_config: {tmp_path}/no_config does not exist on "
                   "this machine (the ssh config this console reaches node-a with)\n")
    assert not (tmp_path / "runs").exists()


# ---- issue 41: a start moves nothing before what can be checked has been -------------------------------------
def _previous_run(workdir: Path) -> dict[str, bytes]:
    """A previous run's folders, a checkpoint among them; what the tree holds, to compare after."""
    ckpt = workdir / "runs" / "t" / "node-a" / "ckpt" / "step_5"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text('{"step": 5}')
    (workdir / "runs" / "t" / "node-b").mkdir()
    (workdir / "runs" / "t" / "node-b" / "events.jsonl").write_text("")
    return _tree(workdir / "runs")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else b"/" for p in sorted(root.rglob("*"))}


def test_a_start_with_the_store_port_taken_moves_nothing_and_names_the_port(workdir, capsys, cleanup):  # noqa: F811
    """Defect: `--headless --no-check` with the store's port taken moved the previous run's checkpoints into
    _archive/, started the engines, then failed them all with "store exited ... engines keep their state"."""
    path = workdir / "p.toml"
    port = free_port()
    path.write_text(PROFILE.format(port=port, python=sys.executable, workdir=workdir, b_extra=""))
    before = _previous_run(workdir)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        code, out = _cli([str(path), "--headless", "--no-check", "--interval", "0.2"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED and out == ""
    assert err == (f"zeroband-console: {path}:7: store.port: {port} is taken on node-a (the store cannot listen on "
                   f"127.0.0.1:{port}: EADDRINUSE: Address already in use); end what listens there (ss -ltnp "
                   f"'sport = :{port}') or choose another store.port\n")
    assert _tree(workdir / "runs") == before  # nothing archived, no engine or store folder made


async def test_with_the_port_free_the_same_start_archives_and_starts(workdir, cleanup):  # noqa: F811
    """The other side: the port free, the previous run moves to _archive/ and the run starts."""
    from console.cluster import Cluster

    profile = make_profile(workdir)
    _previous_run(workdir)
    cluster = Cluster(profile, Fleet(run="t"))
    try:
        await cluster.start()
        assert (next((workdir / "runs/t/_archive").iterdir()) / "node-a/ckpt/step_5/meta.json").is_file()
        assert sorted(cluster.running()) == ["node-a", "node-b"]
        assert await cluster.stop()
    finally:
        await cluster.close()


async def test_an_address_the_store_host_does_not_have_is_its_profile_line(workdir, cleanup):  # noqa: F811
    from console.cluster import Cluster, StartRefused

    path = workdir / "p.toml"
    path.write_text(PROFILE.format(port=free_port(), python=sys.executable, workdir=workdir, b_extra="")
                    .replace("[store]\n", '[store]\nbind = "192.0.2.1"\n'))  # TEST-NET-1: no host has it
    before = _previous_run(workdir)
    fleet = Fleet(run="t")
    cluster = Cluster(load_profile(path), fleet)
    try:
        with pytest.raises(StartRefused) as refused:
            await cluster.start()
    finally:
        await cluster.close()
    assert refused.value.lines == [f"{path}:7: store.bind: 192.0.2.1 is not an address of node-a (the store cannot "
                                   "listen on it: EADDRNOTAVAIL: Cannot assign requested address)"]
    assert {n.name: (n.state.value, n.reason) for n in fleet.nodes.values()} == {
        "node-a": ("failed", refused.value.lines[0]), "node-b": ("failed", refused.value.lines[0]),
        "node-c": ("spare", None)}
    assert _tree(workdir / "runs") == before


ETCD_RUNNING = """\
[run]
name = "t"
dir = "runs/t"

[store]
backend = "etcd"
etcd_endpoints = ["127.0.0.1:{port}"]
etcd_ca = "{pki}/ca.crt"
etcd_cert = "{pki}/client.crt"
etcd_key = "{pki}/client.key"

[engine]
config = "configs/fake.toml"

[defaults]
transport = "local"
python = "{python}"
workdir = "{workdir}"

[hosts.node-a]

[hosts.node-b]
workdir = "{workdir}/b"
"""


def _etcd_running_profile(workdir: Path, pki: str) -> Path:
    path = workdir / "e.toml"
    path.write_text(ETCD_RUNNING.format(port=free_port(), pki=pki, python=sys.executable, workdir=workdir))
    (workdir / "b" / "configs").mkdir(parents=True, exist_ok=True)
    (workdir / "b" / "configs" / "fake.toml").write_text((workdir / "configs" / "fake.toml").read_text())
    return path


def test_a_missing_etcd_client_file_moves_nothing_and_names_file_and_key(workdir, capsys, cleanup):  # noqa: F811
    """Defect: the previous run was archived first, then every node failed with "etcd is not usable: [Errno 2] No
    such file or directory", naming no file and no key."""
    from console.etcd_pki import make_pki

    make_pki(workdir / "pki", ["127.0.0.1"])
    (workdir / "pki" / "client.key").unlink()
    path = _etcd_running_profile(workdir, str(workdir / "pki"))
    before = _previous_run(workdir)
    code, out = _cli([str(path), "--headless", "--no-check", "--interval", "0.2"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED and out == ""
    assert err == (f"zeroband-console: {path}:10: store.etcd_key: {workdir}/pki/client.key is not a readable file on "
                   "this machine (the console reaches etcd with it)\n")
    assert _tree(workdir / "runs") == before
    code, out = _cli([str(path), "check"])  # `check` names it too (it said nothing: the table, exit 0)
    assert code == cli.EXIT_FAILED and out.splitlines()[0] == (
        f"profile: {path}:10: store.etcd_key: {workdir}/pki/client.key is not a readable file on this machine (the "
        "console reaches etcd with it); fix: copy the file there, or fix the path in [store]")


async def test_etcd_client_files_relative_to_a_hosts_workdir_are_looked_for_there(workdir, cleanup):  # noqa: F811
    """Relative paths are each host's workdir's: a file node-b's workdir lacks is named on node-b; the files all
    there, nothing is said (the other side)."""
    from console.etcd import tls_unreadable
    from console.etcd_pki import make_pki
    from console.hosts import Hosts
    from console.transport import make_transport

    make_pki(workdir / "pki", ["127.0.0.1"])
    make_pki(workdir / "b" / "pki", ["127.0.0.1"])
    profile = load_profile(_etcd_running_profile(workdir, "pki"))
    hosts = Hosts(profile, Fleet(), make_transport)
    try:
        here = os.getcwd()
        os.chdir(workdir)  # the console's own relative paths are its working folder's
        try:
            assert await tls_unreadable(profile, hosts.transport, ["node-a", "node-b"]) == []
            (workdir / "b" / "pki" / "ca.crt").unlink()
            assert await tls_unreadable(profile, hosts.transport, ["node-a", "node-b"]) == [
                f"{profile.path}:8: store.etcd_ca: pki/ca.crt is not a readable file on node-b (relative paths are "
                "from each host's workdir)"]
        finally:
            os.chdir(here)
    finally:
        await hosts.close()


ETCD_HOSTS = """\
[run]
name = "t"
dir = "runs/t"

[store]
backend = "etcd"
etcd_hosts = ["node-a", "node-b", "node-c"]
etcd_client_port = {client}
etcd_peer_port = {peer}

[engine]
config = "configs/fake.toml"

[defaults]
transport = "local"
python = "{python}"
workdir = "{workdir}"

[hosts.node-a]

[hosts.node-b]

[hosts.node-c]
"""


async def test_an_etcd_members_port_taken_moves_nothing_and_names_it(workdir, cleanup):  # noqa: F811
    from console.cluster import Cluster, StartRefused

    client = free_port()
    path = workdir / "h.toml"
    path.write_text(ETCD_HOSTS.format(client=client, peer=client + 1, python=sys.executable, workdir=workdir))
    before = _previous_run(workdir)
    cluster = Cluster(load_profile(path), Fleet(run="t"))
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", client + 2))  # member node-b's client port
            taken.listen()
            with pytest.raises(StartRefused) as refused:
                await cluster.start()
    finally:
        await cluster.close()
    assert refused.value.lines == [
        f"{path}:8: store.etcd_client_port: {client + 2} is taken on node-b (etcd member node-b (etcd_client_port + "
        f"2) cannot listen on 127.0.0.1:{client + 2}: EADDRINUSE: Address already in use); end what listens there "
        f"(ss -ltnp 'sport = :{client + 2}') or choose another store.etcd_client_port"]
    assert _tree(workdir / "runs") == before
    (workdir / "h.toml").write_text(path.read_text().replace("[engine]", 'etcd_binary = "no-such-etcd"\n\n[engine]'))
    cluster = Cluster(load_profile(path), Fleet(run="t"))
    try:
        with pytest.raises(StartRefused) as refused:
            await cluster.start()
    finally:
        await cluster.close()
    assert refused.value.lines == [  # once per member host, in the profile's order
        f"{path}:11: store.etcd_binary: no-such-etcd is not found on {host} (an etcd member runs there; Debian: apt "
        "install etcd-server, or set store.etcd_binary to its path)" for host in ("node-a", "node-b", "node-c")]
    assert _tree(workdir / "runs") == before


# ---- issue 41: stop with nothing running, add on a completed run -----------------------------------------------
def test_stop_with_nothing_running_says_so_names_the_run_folder_and_exits_1(workdir, capsys, cleanup):  # noqa: F811
    """Defect: `stop` of a profile with nothing running (mistyped, or a run long over) said "stopped 0 node(s)" and
    exited 0; it also wrote RUN_DIR/_store/stopped, making the folder. The other side: a running cluster's stop."""
    profile = make_profile(workdir)
    code, out = _cli([profile.path, "stop"])
    err = capsys.readouterr().err
    nothing = (f"zeroband-console: nothing to stop: no engine or store of {profile.path} runs (run t; looked in "
               "runs/t on node-a, node-b, node-c)\n")
    assert (code, out, err) == (cli.EXIT_FAILED, "", nothing)
    assert not (workdir / "runs").exists()  # nothing written
    asyncio.run(_start_and_leave(profile))
    code, out = _cli([profile.path, "stop"])
    assert (code, out) == (cli.EXIT_OK, "stopped 2 node(s)\n"), capsys.readouterr().err
    code, out = _cli([profile.path, "stop"])  # again: nothing left
    assert (code, out, capsys.readouterr().err) == (cli.EXIT_FAILED, "", nothing)


async def _start_and_leave(profile) -> None:
    """Start the cluster and leave it running, as a console that ends leaves it."""
    from console.cluster import Cluster

    fleet = Fleet(run="t")
    cluster = Cluster(profile, fleet)
    try:
        await cluster.start()
        await until(lambda: fleet.store.state == "up" and all(
            fleet.nodes[n].state is NodeState.TRAINING for n in ("node-a", "node-b")), what="training")
    finally:
        await cluster.close()


def _completed_run(workdir: Path, status: str = "completed") -> None:
    """The folders a run leaves when its engines ended with run_end `status` (the store ended with it)."""
    from engine.telemetry import encode, make_event

    for node in ("node-a", "node-b"):
        folder = workdir / "runs" / "t" / node
        folder.mkdir(parents=True)
        events = [make_event("run_start", node, 0, pid=1, host="h", world_size=1, config_digest="d",
                             strategy="ddp", max_steps=10),
                  make_event("step", node, 0, step=10, loss=1.0, lr=1e-3, tokens_per_s=1.0, grad_norm=None),
                  make_event("run_end", node, 0, status=status, step=10)]
        (folder / "events.jsonl").write_text("".join(encode(e) + "\n" for e in events))
        (folder / "pid").write_text("999999999\n")  # long gone
        (folder / "rc").write_text("0\n")


@pytest.mark.parametrize("target", ["node-a", "node-c"])
def test_add_on_a_completed_run_is_refused_and_starts_no_store(workdir, capsys, cleanup, target):  # noqa: F811
    """Defect: `add node-a` on a completed run said "added", exit 0; the engine resumed at train.max_steps and ended
    at once, and the store the add had started for it ran on. A run that completed is over: refused, nothing
    started (a stopped run's add starts the node, as before: tests/test_cluster.py)."""
    profile = make_profile(workdir)
    _completed_run(workdir)
    before, text = _tree(workdir / "runs"), Path(profile.path).read_bytes()
    code, out = _cli([profile.path, "--no-check", "add", target])
    err = capsys.readouterr().err
    assert (code, out) == (cli.EXIT_FAILED, "")
    assert err == (f"zeroband-console: {target}: not started: run t completed (node-a, node-b reached "
                   f"train.max_steps); start a new run (zeroband-console {profile.path}), or raise train.max_steps "
                   "and start it with --resume\n")
    assert _tree(workdir / "runs") == before and Path(profile.path).read_bytes() == text  # no store, no folder


async def test_a_run_that_was_stopped_takes_an_add(workdir, cleanup):  # noqa: F811
    """The other side: the same folders with run_end "stopped": add starts the node (and the store it dials)."""
    from console.cluster import Cluster

    profile = make_profile(workdir)
    _completed_run(workdir, status="stopped")
    fleet = Fleet(run="t")
    cluster = Cluster(profile, fleet)
    try:
        await cluster.attach(steer_store=False)
        added = await cluster.add("node-c")
        assert added and added.message == "node-c: added", added.message
        assert (workdir / "runs/t/_store/pid").is_file()
        assert await cluster.stop()
    finally:
        await cluster.close()
