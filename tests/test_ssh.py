"""SshTransport against a real OpenSSH sshd on loopback (tests/sshd.py): commands, detached start + tail, host
keys (strict, changed, opt-in accept-new), unreachable hosts, wrong credentials, dropped and frozen links."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from console.transport import TransportError, make_transport
from console.transport import commands as C
from console.transport.base import collect
from console.transport.ssh import MAX_CHANNELS, SshTransport
from procs import free_port, kill_recorded_groups
from sshd import SSHD, Sshd

WRITER = ("import sys, time\n"
          "for i in range(int(sys.argv[1])):\n"
          "    print('{\"i\": %d}' % i, flush=True); time.sleep(float(sys.argv[2]))\n"
          "time.sleep(60)\n")
NASTY_DIR = "run 'x' $(touch PWNED) \"q\"/node; b"


@pytest.fixture
def sshd():
    server = Sshd.start_new()
    server.trust()
    yield server
    server.close()


def writer(sshd: Sshd) -> str:
    path = sshd.home / "w.py"
    path.write_text(WRITER)
    return str(path)


def pid_alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/status").read_text().split("State:")[1][:4]
    except (FileNotFoundError, IndexError):
        return False


async def test_run_commands_as_the_remote_user(sshd):
    t = make_transport(sshd.host_spec("node a"))
    assert isinstance(t, SshTransport)
    try:
        rc, out, err = await t.run("id -un; echo err >&2; exit 4")
        assert (rc, out, err) == (4, f"{sshd.user}\n", "err\n")
        nasty = "it's \"$(touch PWNED)\"; `x` | & ~ $HOME"
        assert (await t.run(f"printf %s {C.q(nasty)}"))[1] == nasty
        # more commands at once than OpenSSH's MaxSessions (10): the channel bound queues them, none fails
        results = await asyncio.gather(*(t.run(f"sleep 0.2; echo {i}") for i in range(3 * MAX_CHANNELS)))
        assert [r[1] for r in results] == [f"{i}\n" for i in range(3 * MAX_CHANNELS)]
        assert not list(sshd.home.rglob("PWNED"))
    finally:
        await t.close()


async def test_closing_the_test_server_ends_what_was_left_running_through_it():
    """Defect: a stand-in store that the console started as its health probe ran on after the SSH tests, the store it
    watched long gone. Whatever a test leaves detached through the server (the console's engines, store and probe
    are) is ended by PID when the server closes."""
    server = Sshd.start_new()
    server.trust()
    try:
        t = make_transport(server.host_spec("node a"))
        try:
            pid = await t.start_detached(["sleep", "300"], "left")
            assert await t.alive(pid)
        finally:
            await t.close()
        assert server.left_behind() and pid_alive(pid)
    finally:
        server.close()
    assert not pid_alive(pid)


async def test_start_detached_tail_and_kill_with_metacharacters(sshd):
    t = make_transport(sshd.host_spec("node 'b' $(x)"))
    try:
        pid = await t.start_detached([sshd.user_python(), writer(sshd), "5", "0.05"], NASTY_DIR,
                                     env={"ZB_X": "a 'b' $(c)"})
        assert await t.alive(pid)
        # the environment went over the channel's stdin: in the process's environment, in no command line
        children, env_file = Path(f"/proc/{pid}/task/{pid}/children"), sshd.home / NASTY_DIR / "env"
        want = b"ZB_X=a 'b' $(c)\0"

        def holder() -> int | None:
            """The wrapper's child that holds the environment (it may first fork short helpers, e.g. rm)."""
            for kid in children.read_text().split():
                try:
                    if want in Path(f"/proc/{kid}/environ").read_bytes():
                        return int(kid)
                except OSError:
                    pass  # a helper that just ended
            return None
        for _ in range(200):  # the wrapper reads the environment file, removes it, then starts its child
            if holder() is not None and not env_file.exists():
                break
            await asyncio.sleep(0.05)
        child = holder()
        assert child is not None, children.read_text()
        assert not any(b"$(c)" in Path(f"/proc/{p}/cmdline").read_bytes() for p in (pid, child))
        assert not env_file.exists()
        tail = t.tail(f"{NASTY_DIR}/events.jsonl")
        assert await asyncio.wait_for(collect(tail, 5), 20) == [b'{"i": %d}' % i for i in range(5)]
        await tail.aclose()
        assert (await t.read_text(f"{NASTY_DIR}/pid")).strip() == str(pid)  # type: ignore[union-attr]
        owner = Path(f"/proc/{pid}").stat().st_uid
        assert owner != 0  # it runs as the non-root user...
        assert await t.signal(pid, "KILL")  # ...and `kill` by process group over the link reaches it
        await asyncio.sleep(0.3)
        assert not await t.alive(pid) and not pid_alive(pid)
        assert not list(sshd.home.rglob("PWNED"))
        assert (sshd.home / NASTY_DIR / "events.jsonl").exists()
    finally:
        await t.close()


@pytest.mark.parametrize("shell", ["/usr/bin/fish", "/usr/bin/tcsh"])
async def test_a_login_shell_that_is_not_sh_runs_every_command(shell):
    """sshd runs a command through the user's login shell. Defect: a host user whose shell is fish or tcsh could run
    none of the console's commands (`if ...; then ... fi`, `$(...)`, `2>/dev/null` are sh's). Every command now
    reaches sh whatever the login shell, and does what it does under sh."""
    assert os.access(shell, os.X_OK), f"{shell} missing: scripts/test.sh installs fish and tcsh"
    server = Sshd.start_new(user=f"zb{Path(shell).name}", shell=shell)
    server.trust()
    try:
        t = make_transport(server.host_spec("node f"))
        try:
            conn = await t._connection()  # the command as the login shell reads it: sh's syntax fails there
            raw = await conn.run("if true; then echo sh; fi 2>/dev/null", check=False)
            assert raw.stdout != "sh\n", raw  # (fish even says status 0 after its parse error)
            rc, out, err = await t.run(f"if cd {C.qpath(str(server.home))} 2>/dev/null; then export X=$(echo 1); fi; "
                                       "echo \"${X:-0}\" $0; echo err >&2; exit 3")
            assert (rc, out, err) == (3, "1 sh\n", "err\n")
            nasty = "it's \"$(touch PWNED)\"; `x` | & ~ $HOME \\ !1 %s\nline two"
            assert (await t.run(f"printf %s {C.q(nasty)}"))[1] == nasty
            assert (await t.run("cat", stdin=b"through stdin"))[1] == "through stdin"
            await t.write_text("a dir/f.txt", nasty)
            assert await t.read_text("a dir/f.txt") == nasty
            pid = await t.start_detached([server.user_python(), writer(server), "3", "0.05"], NASTY_DIR,
                                         env={"ZB_X": "a 'b' $(c)"})
            assert await t.alive(pid)
            tail = t.tail(f"{NASTY_DIR}/events.jsonl")
            assert await asyncio.wait_for(collect(tail, 3), 20) == [b'{"i": %d}' % i for i in range(3)]
            await tail.aclose()
            assert await t.signal(pid, "KILL")
            for _ in range(100):
                if not await t.alive(pid):
                    break
                await asyncio.sleep(0.05)
            assert not pid_alive(pid)
            assert await t.preflight() is None
            assert not list(server.home.rglob("PWNED"))
        finally:
            await t.close()
    finally:
        server.close()


async def test_a_host_that_cannot_decode_the_commands_is_an_error_not_a_yes(sshd):
    """A host without base64 (every command travels as base64: console/transport/commands.py) ran an empty command,
    status 0: every process alive, every kill delivered, the preflight fine. Now each command is an error naming
    the host and what it lacks. (sshd's SetEnv gives the session a PATH with sh and no base64.)"""
    bare = sshd.root / "bare-bin"
    bare.mkdir()
    (bare / "sh").symlink_to("/bin/sh")
    sshd.stop()
    sshd.extra_config = [f"SetEnv PATH={bare}"]
    sshd.start()
    t = make_transport(sshd.host_spec("node z"))
    try:
        for ask in (t.run("true"), t.alive(os.getpid()), t.preflight()):
            with pytest.raises(TransportError, match=r"^node z: zeroband: cannot decode a command of the console: "
                                                     r"base64 -d failed \(the host needs coreutils or busybox\)$"):
                await ask
    finally:
        await t.close()


async def test_changed_host_key_is_refused_clearly(sshd):
    t = make_transport(sshd.host_spec("n", accept_new_host_key=True))  # even with the opt-in: changed != new
    await t.connect()
    await t.close()
    sshd.stop()
    sshd.start(new_host_key=True)
    t = make_transport(sshd.host_spec("n", accept_new_host_key=True))
    with pytest.raises(TransportError) as info:
        await t.connect()
    reason = str(info.value)
    assert "host key CHANGED" in reason and f"127.0.0.1:{sshd.port}" in reason and "known_hosts" in reason
    assert sshd.known_hosts.read_text() != sshd.known_hosts_line()  # nothing was written over the old key


async def test_unknown_host_key_strict_by_default_and_opt_in(sshd):
    empty = sshd.root / "empty_known_hosts"
    strict = make_transport(sshd.host_spec("n", known_hosts=str(empty)))
    with pytest.raises(TransportError, match=r"host key of .* is unknown: not in .*accept_new_host_key = true"):
        await strict.connect()
    assert not empty.exists()
    trusting = make_transport(sshd.host_spec("n", known_hosts=str(empty), accept_new_host_key=True))
    try:
        assert (await trusting.run("echo ok"))[1] == "ok\n"
    finally:
        await trusting.close()
    assert empty.read_text() == sshd.known_hosts_line()  # recorded as `[127.0.0.1]:PORT alg key`
    again = make_transport(sshd.host_spec("n", known_hosts=str(empty)))  # now strict mode trusts it
    try:
        assert (await again.run("echo ok"))[0] == 0
    finally:
        await again.close()


async def test_a_key_in_a_global_known_hosts_file_is_trusted_as_ssh_trusts_it(sshd):
    """Clusters hand out their hosts' keys in a global file (/etc/ssh/ssh_known_hosts, or ssh_config's
    GlobalKnownHostsFile): ssh connects, and the console said "host key ... is unknown", having read the profile's
    known_hosts alone."""
    global_file = sshd.root / "global_known_hosts"
    global_file.write_text(sshd.known_hosts_line())
    config = sshd.root / "ssh_config_global"
    config.write_text(f"Host *\n  GlobalKnownHostsFile {global_file}\n")
    nothing = sshd.root / "nothing_known_here"
    t = make_transport(sshd.host_spec("n", known_hosts=str(nothing), ssh_config=str(config)))
    try:
        assert (await t.run("echo ok"))[0] == 0
    finally:
        await t.close()
    assert not nothing.exists()  # trusted as it was, nothing recorded


async def test_unreachable_host_fails_fast_and_backs_off():
    from console.profile import HostSpec

    port = free_port()  # nothing listens there
    t = make_transport(HostSpec(name="n", address="127.0.0.1", port=port, user="nobody", connect_timeout=5))
    started = time.monotonic()
    with pytest.raises(TransportError, match=f"connection refused by nobody@127.0.0.1:{port}"):
        await t.run("true")
    with pytest.raises(TransportError, match=r"retrying in \d"):  # backoff: no new attempt right away
        await t.run("true")
    assert time.monotonic() - started < 3
    unknown = make_transport(HostSpec(name="n", address="no-such-host.invalid", connect_timeout=5))
    with pytest.raises(TransportError, match="unknown host no-such-host.invalid"):
        await unknown.connect()


async def test_wrong_credentials(sshd):
    from sshd import keygen

    keygen(sshd.root / "other_key", "stranger")
    t = make_transport(sshd.host_spec("n", identity_file=str(sshd.root / "other_key")))
    with pytest.raises(TransportError, match=f"authentication failed for {sshd.user}@127.0.0.1"):
        await t.connect()
    t = make_transport(sshd.host_spec("n", user="nosuchuser"))
    with pytest.raises(TransportError, match="authentication failed for nosuchuser@"):
        await t.connect()


async def test_keys_are_read_as_ssh_reads_them(sshd):
    """Defects: a .pub named as identity_file crashed `check` with asyncssh's KeyImportError (a ValueError the
    transport did not catch) and left a headless console waiting on the node for ever; a key with a passphrase did
    the same, where ssh leaves it to the agent; an ssh_config IdentityFile that is not there stopped the login,
    where ssh skips it and tries the next."""
    with pytest.raises(TransportError, match=r"^hosts\.n\.identity_file: .*user_key\.pub is not a private key"):
        await make_transport(sshd.host_spec("n", identity_file=f"{sshd.user_key}.pub")).connect()
    locked = sshd.root / "locked_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(locked)], check=True,
                   capture_output=True, timeout=30)
    with pytest.raises(TransportError, match=r"authentication failed .*locked_key has a passphrase: add it to "
                                             r"ssh-agent"):
        await make_transport(sshd.host_spec("n", identity_file=str(locked))).connect()
    with pytest.raises(TransportError, match=r"^hosts\.n\.ssh_config: .*/nowhere does not exist on this machine"):
        await make_transport(sshd.host_spec("n", ssh_config=str(sshd.root / "nowhere"))).connect()
    config = sshd.root / "ssh_config_keys"
    config.write_text(f"Host zb-keys\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
                      f"  IdentityFile {sshd.root / 'not_there'}\n  IdentityFile {sshd.user_key}\n")
    t = make_transport(sshd.host_spec("n", address=None, port=None, user=None, identity_file=None,
                                      ssh_alias="zb-keys", ssh_config=str(config)))
    try:
        assert await t.run("echo ok") == (0, "ok\n", "")
    finally:
        await t.close()


async def test_a_jump_hosts_failure_names_the_jump_host(sshd):
    """Defect: a jump host whose key was unknown was reported as the target's key CHANGED (the lookup used the
    target's name, whose key was known), and the fix offered was to delete a good known_hosts line."""
    known = sshd.root / "known_target_only"  # the target is dialled as localhost; the jump as 127.0.0.1
    known.write_text(sshd.known_hosts_line().replace("[127.0.0.1]", "[localhost]"))
    t = make_transport(sshd.host_spec("n", address="localhost", known_hosts=str(known),
                                      jump_host=f"{sshd.user}@127.0.0.1:{sshd.port}"))
    with pytest.raises(TransportError) as info:
        await t.connect()
    assert str(info.value).startswith(f"jump host {sshd.user}@127.0.0.1:{sshd.port}: host key of "
                                      f"{sshd.user}@127.0.0.1:{sshd.port} is unknown"), info.value
    assert "CHANGED" not in str(info.value) and "localhost" not in str(info.value)


async def test_a_jump_host_logs_in_with_its_own_ssh_config_key(sshd):
    """Defect: the jump host was given the target's IdentityFile (from the target's ssh_config block) and so never
    read its own: a bastion that takes another key refused the login. Two servers, each with its own key."""
    bastion = Sshd.start_new()
    try:
        known = sshd.root / "both_known"
        known.write_text(sshd.known_hosts_line() + bastion.known_hosts_line())
        config = sshd.root / "ssh_config_two_keys"
        config.write_text(f"Host zb-target\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
                          f"  IdentityFile {sshd.user_key}\n  ProxyJump zb-bastion\n"
                          f"Host zb-bastion\n  HostName 127.0.0.1\n  Port {bastion.port}\n  User {bastion.user}\n"
                          f"  IdentityFile {bastion.user_key}\n")
        t = make_transport(sshd.host_spec("n", address=None, port=None, user=None, identity_file=None,
                                          ssh_alias="zb-target", ssh_config=str(config), known_hosts=str(known)))
        try:
            assert await t.run("echo ok") == (0, "ok\n", "")
        finally:
            await t.close()
    finally:
        bastion.close()


async def test_a_line_longer_than_the_channel_window_is_followed(sshd):
    """Defect: asyncssh's readline hands back part of a line longer than the channel's window (~2 MiB); the tail
    took it for the end of the file and reopened at the same offset for ever: the console saw no event again."""
    t = make_transport(sshd.host_spec("n"))
    big = b"x" * 3_000_000
    (sshd.home / "big.jsonl").write_bytes(b'{"i": 0}\n' + big + b'\n{"i": 1}\n')
    try:
        tail = t.tail("big.jsonl")
        lines = await asyncio.wait_for(collect(tail, 3), 30)
        await tail.aclose()
        assert [len(x) for x in lines] == [8, len(big), 8] and lines[2] == b'{"i": 1}'
        assert tail.offset == (sshd.home / "big.jsonl").stat().st_size
    finally:
        await t.close()


async def test_missing_python_on_the_host(sshd):
    t = make_transport(sshd.host_spec("n", python="/opt/none/bin/python3"))
    try:
        assert await t.preflight() == "python not found on the host: /opt/none/bin/python3"
        assert await make_transport(sshd.host_spec("n", python=sshd.user_python())).preflight() is None
    finally:
        await t.close()


async def test_dropped_link_detached_process_lives_and_tail_catches_up(sshd):
    t = make_transport(sshd.host_spec("n"))
    pid = await t.start_detached([sshd.user_python(), writer(sshd), "60", "0.05"], "run/n")
    try:
        tail = t.tail("run/n/events.jsonl")
        seen = await asyncio.wait_for(collect(tail, 5), 20)
        sshd.stop()  # every connection process killed and the server down: an outage
        with pytest.raises(TransportError):
            await asyncio.wait_for(collect(tail, 1000), 20)
        with pytest.raises(TransportError):
            await t.run("true")  # no server: the transport says so instead of hanging
        await asyncio.sleep(1.0)
        assert pid_alive(pid)  # the engine outlives the link
        sshd.start()  # the same server (same host key) is back
        deadline = time.monotonic() + 30
        while True:  # reconnect (the transport's backoff spaces the attempts)
            try:
                await t.connect()
                break
            except TransportError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.5)
        resumed = t.tail("run/n/events.jsonl", tail.offset)
        seen += await asyncio.wait_for(collect(resumed, 60 - len(seen)), 30)
        assert seen == [b'{"i": %d}' % i for i in range(60)]  # caught up: no gap, no duplicate
        await resumed.aclose()
    finally:
        os.killpg(pid, signal.SIGKILL)
        await t.close()


async def test_frozen_link_is_noticed_by_keepalive(sshd):
    """A link that goes silent (no FIN, no RST) is noticed by keepalive (1 s x 3), not after minutes."""
    t = make_transport(sshd.host_spec("n"))
    try:
        await t.run("true")
        tail = t.tail("never.jsonl")
        reader = asyncio.ensure_future(collect(tail, 1))
        await asyncio.sleep(0.5)
        frozen = sshd.connection_pids()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TransportError, match="link lost|link closed|tail of"):
            await asyncio.wait_for(reader, 20)
        assert time.monotonic() - started < 10
    finally:
        for pid in sshd.connection_pids():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        await t.close()


# ---- the cluster over SSH ------------------------------------------------------------------------------------
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
    from console.fleet import Fleet, NodeState
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
        await until(lambda: all(n.state is NodeState.UNREACHABLE for n in fleet.nodes.values()), 20, "unreachable")
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
        assert later.nodes["node-a"].state is NodeState.UNREACHABLE and "refused" in later.nodes["node-a"].reason
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
    from console.fleet import Fleet, NodeState
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
        assert got["wrong-key"][0] is NodeState.UNREACHABLE and "authentication failed" in got["wrong-key"][1]
        assert got["unknown-key"][0] is NodeState.UNREACHABLE and "host key of" in got["unknown-key"][1]
        assert got["closed-port"][0] is NodeState.UNREACHABLE and "connection refused" in got["closed-port"][1]
        assert got["no-python"] == (NodeState.FAILED, "python not found on the host: /opt/nowhere/bin/python3")
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
    from console.fleet import Fleet, NodeState
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
                    or any(n.state is NodeState.FAILED for n in fleet.nodes.values()), 300,
                    "an outer step on both alias hosts")
        assert all(n.state is NodeState.TRAINING for n in fleet.nodes.values()), \
            {n.name: (n.state.value, n.reason) for n in fleet.nodes.values()}
        assert fleet.members is not None and set(fleet.members) == {"h1", "h2"}
    finally:
        await cluster.stop()
        await cluster.close()
        kill_run(run_dir)
