"""SshTransport against a real OpenSSH sshd on loopback (tests/sshd.py): commands, detached start + tail, host
keys (strict, changed, opt-in accept-new), unreachable hosts, wrong credentials, dropped and frozen links."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from console.transport import TransportError, make_transport
from console.transport import commands as C
from console.transport.base import collect
from console.transport.ssh import MAX_CHANNELS, SshTransport
from procs import free_port
from sshd import Sshd

WRITER = ("import sys, time\n"
          "for i in range(int(sys.argv[1])):\n"
          "    print('{\"i\": %d}' % i, flush=True); time.sleep(float(sys.argv[2]))\n"
          "time.sleep(60)\n")
NASTY_DIR = "run 'x' $(touch PWNED) \"q\"/node; b"


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
            assert await t.launch_check() is None
            assert not list(server.home.rglob("PWNED"))
        finally:
            await t.close()
    finally:
        server.close()


async def test_a_host_that_cannot_decode_the_commands_is_an_error_not_a_yes(sshd):
    """A host without base64 (every command travels as base64: console/transport/commands.py) ran an empty command,
    status 0: every process alive, every kill delivered, the launch check fine. Now each command is an error naming
    the host and what it lacks. (sshd's SetEnv gives the session a PATH with sh and no base64.)"""
    bare = sshd.root / "bare-bin"
    bare.mkdir()
    (bare / "sh").symlink_to("/bin/sh")
    sshd.stop()
    sshd.extra_config = [f"SetEnv PATH={bare}"]
    sshd.start()
    t = make_transport(sshd.host_spec("node z"))
    try:
        for ask in (t.run("true"), t.alive(os.getpid()), t.launch_check()):
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
    with pytest.raises(TransportError,
                       match=r"host key of .* is unknown \(ssh-ed25519 SHA256:.*\): not in .*--accept-new-host-keys"):
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
        assert await t.launch_check() == "python not found on the host: /opt/none/bin/python3"
        assert await make_transport(sshd.host_spec("n", python=sshd.user_python())).launch_check() is None
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
