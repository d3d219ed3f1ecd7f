"""The cluster over SSH against real OpenSSH sshds (tests/sshd.py): an outage it survives and catches up from, the real
engine, ssh_config aliases and jump hosts (one that alone reaches its target, in a network namespace), and bad hosts
that each get a reason while the good one trains."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from console.transport import TransportError, make_transport
from procs import free_port, kill_recorded_groups
from sshd import SSHD, Sshd

SSH_PROFILE = """\
[run]
name = "ssh"
dir = "{run_dir}"

[store]
host = "node-a"
address = "127.0.0.1"
port = {store_port}

[engine]
config = "{config}"
{overrides}
[console]
poll_interval = 0.3
stop_timeout = 30

[defaults]
transport = "ssh"
address = "127.0.0.1"
port = {port}
user = "{user}"
identity_file = "{key}"
known_hosts = "{known_hosts}"
connect_timeout = 5.0
python = "{python}"
workdir = "{workdir}"
env = {{ OMP_NUM_THREADS = "1"{env} }}

[hosts.node-a]

[hosts."node 'b' $(x)"]
"""


def ssh_profile(sshd: Sshd, *, user: str, python: str, workdir: Path, run_dir: Path, config: str,
                overrides: str = "", env: dict[str, str] | None = None):
    from console.profile import load_profile

    path = sshd.root / "profile.toml"
    path.write_text(SSH_PROFILE.format(run_dir=run_dir, store_port=free_port(), config=config, overrides=overrides,
                                       port=sshd.port, user=user, key=sshd.user_key, known_hosts=sshd.known_hosts,
                                       python=python, workdir=workdir,
                                       env="".join(f', {k} = "{v}"' for k, v in (env or {}).items())))
    return load_profile(path)


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def kill_run(run_dir: Path) -> None:
    kill_recorded_groups(run_dir.glob("*/pid"))


async def test_cluster_over_ssh_survives_an_outage_and_catches_up(sshd):
    """Stand-in engines (no torch) as the non-root user: start, link outage, re-attach, kill, stop."""
    from console.cluster import Cluster
    from console.fleet import Fleet, HostState, NodeState
    from test_cluster import write_fake_engine

    work = sshd.home / "work dir"
    write_fake_engine(work)
    (work / "fake.toml").write_text("[data]\nfake = true\n")
    run_dir = sshd.home / "runs"
    run_dir.mkdir()
    shutil.chown(run_dir, sshd.user, sshd.user)
    profile = ssh_profile(sshd, user=sshd.user, python=sshd.user_python(), workdir=work, run_dir=run_dir,
                          config="fake.toml")
    b = "node 'b' $(x)"
    fleet = Fleet()
    cluster = Cluster(profile, fleet)
    try:
        await cluster.start()
        await until(lambda: all(n.state is NodeState.TRAINING and (n.step or 0) >= 3 for n in fleet.nodes.values()),
                    30, "training over ssh")
        sshd.stop()  # an outage: every connection dropped, no server
        await until(lambda: all(n.state is HostState.UNREACHABLE for n in fleet.nodes.values()), 20, "unreachable")
        assert "link" in fleet.nodes["node-a"].reason or "refused" in fleet.nodes["node-a"].reason
        await asyncio.sleep(1.5)
        written = (run_dir / b / "events.jsonl").read_text().count('"type": "step"')
        assert written > fleet.nodes[b].step  # training went on without the console
        sshd.start()
        try:
            await until(lambda: all(n.state is NodeState.TRAINING for n in fleet.nodes.values()), 40, "re-attached")
        except AssertionError as e:
            states = {n.name: (n.state.value, n.reason, list(map(str, n.log))[-4:]) for n in fleet.nodes.values()}
            raise AssertionError(f"{e}: {states}") from None
        await until(lambda: fleet.nodes[b].step >= written, 20, "caught up")
        steps = [e["step"] for e in map(json.loads, (run_dir / b / "events.jsonl").read_text().splitlines())
                 if e["type"] == "step"]
        history = [v for _, v in fleet.nodes[b].loss_history]
        assert history == [1.0 / s for s in steps[:len(history)]]  # every step once, in order, across the outage
        assert await cluster.kill(b)
        assert fleet.nodes[b].state is NodeState.DEAD
        step = fleet.nodes["node-a"].step
        await until(lambda: fleet.nodes["node-a"].step > step + 3, 20, "node-a goes on")
        # the console restarts while the host is down: the node shows unreachable, then attaches when it is back
        await cluster.close()
        sshd.stop()
        later = Fleet()
        cluster = Cluster(profile, later)
        await cluster.attach()  # `zeroband-console PROFILE --attach`
        assert later.nodes["node-a"].state is HostState.UNREACHABLE and "refused" in later.nodes["node-a"].reason
        # a shell's `stop` meanwhile cannot reach the engines: it says so and fails (it said "stopped 0 node(s)",
        # exit 0, while they trained on)
        shell = Cluster(profile, Fleet())
        try:
            await shell.attach(steer_store=False)
            said = await shell.stop()
        finally:
            await shell.close()
        assert not said.ok and "node-a: its host did not answer" in said.message, said
        sshd.start()
        await until(lambda: later.nodes["node-a"].state is NodeState.TRAINING and later.nodes[b].state is
                    NodeState.DEAD, 30, "attached after the outage")
        assert later.nodes[b].reason.startswith("killed by the operator")
        assert later.nodes["node-a"].step >= fleet.nodes["node-a"].step
        await cluster.stop()
        assert later.nodes["node-a"].state is NodeState.LEFT and later.nodes["node-a"].reason == "stopped"
    finally:
        await cluster.close()
        kill_run(run_dir)


@pytest.mark.slow
async def test_real_engine_over_ssh(sshd, repo_root):
    """The real engine through sshd as the non-root user: start, a dropped link, kill one, the other goes on."""
    from console.cluster import Cluster
    from console.fleet import Fleet, NodeState

    python, env = sshd.user_python_env()
    run_dir = sshd.home / "runs"
    overrides = ('\n[engine.overrides]\n"data.path" = "corpus/stdlib_docstrings.jsonl"\n"inner.device" = "cpu"\n'
                 '"train.max_steps" = 400\n"train.log_interval" = 1\n"mesh.heartbeat_timeout" = 20.0\n')
    profile = ssh_profile(sshd, user=sshd.user, python=python, workdir=repo_root, run_dir=run_dir,
                          config="configs/debug-diloco.toml", overrides=overrides, env=env)
    b = "node 'b' $(x)"
    fleet = Fleet()
    cluster = Cluster(profile, fleet)
    try:
        await cluster.start()
        await until(lambda: all(n.state is NodeState.TRAINING and (n.step or 0) >= 1 for n in fleet.nodes.values()),
                    240, f"training: {[(n.name, n.state.value, n.reason) for n in fleet.nodes.values()]}")
        sshd.drop_connections()  # the link drops (the server stays up): the console reconnects by itself
        await asyncio.sleep(2.0)
        step = fleet.nodes["node-a"].step
        await until(lambda: fleet.nodes["node-a"].step > step + 5 and fleet.nodes["node-a"].state is
                    NodeState.TRAINING, 120, "following again after the drop")
        assert await cluster.kill(b)
        step = fleet.nodes["node-a"].step
        await until(lambda: fleet.nodes["node-a"].step >= step + 10, 180, "node-a goes on")
        assert fleet.nodes[b].state is NodeState.DEAD and fleet.nodes["node-a"].state is NodeState.TRAINING
    finally:
        await cluster.stop()
        await cluster.close()
        kill_run(run_dir)


async def test_ssh_config_alias_and_jump_host(sshd):
    """~/.ssh/config is honoured (an alias gives address, port, user and key); a jump host works like ssh -J."""
    config = sshd.root / "ssh_config"
    config.write_text(f"Host zb-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
                      f"  IdentityFile {sshd.user_key}\n")
    alias = make_transport(sshd.host_spec("n", address=None, port=None, user=None, identity_file=None,
                                          ssh_alias="zb-alias", ssh_config=str(config)))
    jumped = make_transport(sshd.host_spec("n", jump_host=f"{sshd.user}@127.0.0.1:{sshd.port}"))
    try:
        assert await alias.run("id -un") == (0, f"{sshd.user}\n", "")
        rc, out, _ = await jumped.run("echo $SSH_CONNECTION")
        assert rc == 0 and out.split()[0] == "127.0.0.1"
        assert len(sshd.connection_pids()) >= 4  # two connections: the jump and the one through it
    finally:
        await asyncio.gather(alias.close(), jumped.close())
    bad_jump = make_transport(sshd.host_spec("n", jump_host=f"{sshd.user}@127.0.0.1:{free_port()}"))
    with pytest.raises(TransportError, match=r"^jump host .*: connection refused"):
        await bad_jump.connect()


async def test_cluster_bad_hosts_each_get_a_reason_and_the_good_one_trains(sshd):
    """Wrong key, unknown host key, closed port, missing python: each node says why; the good node trains."""
    from console.cluster import Cluster
    from console.fleet import Fleet, HostState, NodeState
    from console.profile import load_profile
    from sshd import keygen
    from test_cluster import write_fake_engine

    work = sshd.home / "work"
    write_fake_engine(work)
    (work / "fake.toml").write_text("[data]\nfake = true\n")
    run_dir = sshd.home / "runs"
    run_dir.mkdir()
    shutil.chown(run_dir, sshd.user, sshd.user)
    keygen(sshd.root / "stranger", "stranger")
    profile_path = sshd.root / "bad.toml"
    ssh_profile(sshd, user=sshd.user, python=sshd.user_python(), workdir=work, run_dir=run_dir, config="fake.toml")
    text = (sshd.root / "profile.toml").read_text().replace("[hosts.\"node 'b' $(x)\"]\n", "")
    text += (f'\n[hosts.wrong-key]\nidentity_file = "{sshd.root / "stranger"}"\n'
             f'\n[hosts.unknown-key]\nknown_hosts = "{sshd.root / "nothing_known"}"\n'
             f'\n[hosts.closed-port]\nport = {free_port()}\n'
             f'\n[hosts.no-python]\npython = "/opt/nowhere/bin/python3"\n')
    profile_path.write_text(text)
    fleet = Fleet()
    cluster = Cluster(load_profile(profile_path), fleet)
    try:
        await cluster.start()
        await until(lambda: fleet.nodes["node-a"].state is NodeState.TRAINING, 30, "node-a trains")
        got = {n.name: (n.state, n.reason) for n in fleet.nodes.values()}
        assert got["wrong-key"][0] is HostState.UNREACHABLE and "authentication failed" in got["wrong-key"][1]
        assert got["unknown-key"][0] is HostState.UNREACHABLE and "host key of" in got["unknown-key"][1]
        assert got["closed-port"][0] is HostState.UNREACHABLE and "connection refused" in got["closed-port"][1]
        assert got["no-python"] == (HostState.FAILED, "python not found on the host: /opt/nowhere/bin/python3")
        step = fleet.nodes["node-a"].step or 0
        await until(lambda: fleet.nodes["node-a"].step > step + 3, 20, "node-a goes on")
    finally:
        await cluster.stop()
        await cluster.close()
        kill_run(run_dir)


# ---- a target only the jump host can reach, and hosts named only by ~/.ssh/config aliases ----------------------
class NetnsSshd(Sshd):
    """An sshd inside its own network namespace (`zbqc-*`, a veth pair to this one): it listens on the veth address
    (what this namespace reaches: the jump host) and on the namespace's own loopback (what only processes inside
    it reach: the target). Connecting to the target's port on this namespace's loopback finds nothing."""

    def __init__(self, root: Path, port: int, target_port: int):
        super().__init__(root, port)
        tag = f"{os.getpid() % 10000}{port % 100:02d}"
        self.netns, self.veth = f"zbqc-{tag}", f"zbqc{tag}"
        third = os.getpid() % 250
        # per test process (two test workers may each run one), and never the chaos labs' 10.213.77 (tests/lab/net.py)
        self.subnet = f"10.213.{third if third != 77 else 251}"
        self.jump_address, self.target_port = f"{self.subnet}.2", target_port

    @classmethod
    def start_in_netns(cls) -> "NetnsSshd":
        plain = Sshd.start_new()  # keys, user, home; its own server is not used
        plain.stop()
        server = cls(plain.root, free_port(), free_port())
        run = lambda *a: subprocess.run(a, check=True, capture_output=True, timeout=30)  # noqa: E731
        run("ip", "netns", "add", server.netns)
        try:
            run("ip", "link", "add", f"{server.veth}a", "type", "veth", "peer", "name", f"{server.veth}b")
            run("ip", "link", "set", f"{server.veth}b", "netns", server.netns)
            run("ip", "addr", "add", f"{server.subnet}.1/30", "dev", f"{server.veth}a")
            run("ip", "link", "set", f"{server.veth}a", "up")
            inside = ("ip", "netns", "exec", server.netns)
            run(*inside, "ip", "addr", "add", f"{server.jump_address}/30", "dev", f"{server.veth}b")
            run(*inside, "ip", "link", "set", f"{server.veth}b", "up")
            run(*inside, "ip", "link", "set", "lo", "up")
            server.start()
        except BaseException:
            server.close()
            raise
        return server

    def _config(self) -> Path:
        config = super()._config()
        text = config.read_text().replace("ListenAddress 127.0.0.1\n", "").replace(f"Port {self.port}\n", "")
        config.write_text(f"ListenAddress {self.jump_address}:{self.port}\n"
                          f"ListenAddress 127.0.0.1:{self.target_port}\n" + text)
        return config

    def start(self, new_host_key: bool = False) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.netns, SSHD, "-D", "-e", "-f", str(self._config())],
                                     stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection((self.jump_address, self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not start:\n{self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.05)

    def trust(self, path: Path | None = None) -> Path:
        path = path or self.known_hosts
        algorithm, blob = (self.root / "host_key.pub").read_text().split()[:2]
        path.write_text(f"[{self.jump_address}]:{self.port} {algorithm} {blob}\n"
                        f"[127.0.0.1]:{self.target_port} {algorithm} {blob}\n")
        return path

    def close(self) -> None:
        super().close()
        subprocess.run(["ip", "link", "del", f"{self.veth}a"], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)


async def test_jump_host_reaches_a_target_only_it_can_reach():
    """Defect: the jump-host test passed with the jump host ignored. Here the target (the namespace's loopback) is
    out of reach from this machine: only a connection through the jump host gets there."""
    sshd = NetnsSshd.start_in_netns()
    try:
        sshd.trust()
        target = dict(address="127.0.0.1", port=sshd.target_port)
        direct = make_transport(sshd.host_spec("n", **target))
        with pytest.raises(TransportError, match="connection refused"):
            await direct.connect()  # the target is not reachable without the jump host
        jumped = make_transport(sshd.host_spec("n", **target,
                                               jump_host=f"{sshd.user}@{sshd.jump_address}:{sshd.port}"))
        try:
            rc, out, _ = await jumped.run("echo $SSH_CONNECTION")
            # the target saw the connection arrive on its own loopback, from the jump host inside the namespace
            assert rc == 0 and out.split()[0] == "127.0.0.1" and out.split()[3] == str(sshd.target_port), out
        finally:
            await asyncio.gather(direct.close(), jumped.close())
        # the same through ~/.ssh/config: an alias whose ProxyJump is another alias
        config = sshd.root / "ssh_config"
        config.write_text(f"Host zbq-jump\n  HostName {sshd.jump_address}\n  Port {sshd.port}\n"
                          f"Host zbq-target\n  HostName 127.0.0.1\n  Port {sshd.target_port}\n  ProxyJump zbq-jump\n"
                          f"Host zbq-*\n  User {sshd.user}\n  IdentityFile {sshd.user_key}\n")
        aliased = make_transport(sshd.host_spec("n", address=None, port=None, user=None, identity_file=None,
                                                ssh_alias="zbq-target", ssh_config=str(config)))
        try:
            rc, out, _ = await aliased.run("echo $SSH_CONNECTION")
            assert rc == 0 and out.split()[3] == str(sshd.target_port), out
        finally:
            await aliased.close()
    finally:
        sshd.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_profile_of_ssh_config_aliases_starts_and_trains(sshd, repo_root):
    """Defect: hosts named only by ssh_alias could not host the store (engines dialled the alias). A profile with
    no address anywhere: the store runs on h1, the engines dial its HostName, and the two nodes train together."""
    from console.cluster import Cluster
    from console.fleet import Fleet, HostState, NodeState
    from console.profile import load_profile

    python, env = sshd.user_python_env()
    run_dir = sshd.home / "runs"
    config = sshd.root / "ssh_config"
    config.write_text(f"Host zbl-1 zbl-2\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
                      f"  IdentityFile {sshd.user_key}\n")
    env_text = "".join(f', {k} = "{v}"' for k, v in env.items())
    path = sshd.root / "aliases.toml"
    path.write_text(f"""[run]
name = "aliases"
dir = "{run_dir}"
[store]
host = "h1"
port = {free_port()}
[engine]
config = "configs/debug-diloco.toml"
[engine.overrides]
"data.path" = "corpus/stdlib_docstrings.jsonl"
"inner.device" = "cpu"
"train.micro_batch_size" = 2
"train.batch_size" = 2
"data.seq_len" = 32
"train.log_interval" = 1
"diloco.inner_steps" = 3
"diloco.min_nodes" = 2
"train.max_steps" = 100000
[console]
poll_interval = 0.5
[defaults]
transport = "ssh"
ssh_config = "{config}"
known_hosts = "{sshd.known_hosts}"
python = "{python}"
workdir = "{repo_root}"
env = {{ OMP_NUM_THREADS = "1"{env_text} }}
[hosts.h1]
ssh_alias = "zbl-1"
[hosts.h2]
ssh_alias = "zbl-2"
""")
    profile = load_profile(path)
    assert all(h.address is None for h in profile.hosts.values()) and profile.store.address is None
    fleet = Fleet()
    cluster = Cluster(profile, fleet)
    try:
        await cluster.start()
        await until(lambda: all((n.outer_step or 0) >= 1 for n in fleet.nodes.values())
                    or any(n.state is HostState.FAILED for n in fleet.nodes.values()), 300,
                    "an outer step on both alias hosts")
        assert all(n.state is NodeState.TRAINING for n in fleet.nodes.values()), \
            {n.name: (n.state.value, n.reason) for n in fleet.nodes.values()}
        assert fleet.members is not None and set(fleet.members) == {"h1", "h2"}
    finally:
        await cluster.stop()
        await cluster.close()
        kill_run(run_dir)
