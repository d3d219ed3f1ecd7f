"""Accepting the host keys of new hosts (console/hostkeys.py), against a real sshd (tests/sshd.py), through the CLI as a
user types it: `hostkeys` (the fingerprints, then an explicit yes on a terminal) and --accept-new-host-keys.

    test_an_unknown_key_is_refused_without_the_option    check names the key's fingerprint; known_hosts untouched
    test_check_with_the_option_records_the_new_key       the line ssh would write, and check then connects
    test_hostkeys_shows_the_fingerprint_and_asks         no terminal: nothing recorded; a typed "no": nothing; "yes":
                                                         recorded, and the next look says known
    test_a_changed_key_is_refused_even_with_the_option   hostkeys, check and a start: one line naming both keys
"""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

import pytest

from procs import ROOT, engine_env
from sshd import Sshd

PROFILE = """\
[run]
name = "hostkeys"
dir = "{run_dir}"

[engine]
config = "configs/debug.toml"

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

[hosts.node-a]
"""


def write_profile(sshd: Sshd, known_hosts) -> str:
    path = sshd.root / "profile.toml"
    path.write_text(PROFILE.format(run_dir=sshd.home / "runs", port=sshd.port, user=sshd.user, key=sshd.user_key,
                                   known_hosts=known_hosts, python=sshd.user_python(), workdir=sshd.home))
    return str(path)


def console(*args: str, stdin=subprocess.DEVNULL, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console", *args], cwd=ROOT, env=engine_env(), stdin=stdin,
                          capture_output=True, text=True, timeout=timeout)


def fingerprint(sshd: Sshd) -> str:
    """`ssh-ed25519 SHA256:...` as ssh-keygen -l prints the server's key: what the user compares with."""
    bits, fp, _comment, kind = subprocess.run(["ssh-keygen", "-lf", str(sshd.root / "host_key.pub")],
                                              capture_output=True, text=True, check=True, timeout=30).stdout.split()
    assert kind == "(ED25519)"
    return f"ssh-ed25519 {fp}"


def on_a_terminal(args: list[str], answer: str) -> tuple[int, str]:
    """The command with a terminal as its stdin (the answer typed ahead, as a user would at the question)."""
    leader, follower = pty.openpty()
    try:
        os.write(leader, answer.encode() + b"\n")
        done = subprocess.run([sys.executable, "-m", "console", *args], cwd=ROOT, env=engine_env(), stdin=follower,
                              capture_output=True, text=True, timeout=90)
    finally:
        os.close(follower)
        os.close(leader)
    return done.returncode, done.stdout


def test_an_unknown_key_is_refused_without_the_option(sshd):
    known = sshd.root / "fresh_known_hosts"
    profile = write_profile(sshd, known)
    done = console(profile, "check")
    assert done.returncode == 1, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if "host key" in x)
    assert line == (f"node-a: host key of {sshd.user}@127.0.0.1:{sshd.port} is unknown ({fingerprint(sshd)}): not in "
                    f"{known}; fix: compare it with the host's own, then accept it: zeroband-console PROFILE "
                    "hostkeys (asks yes), or add --accept-new-host-keys (or accept_new_host_key = true in the "
                    "profile)"), line
    assert not known.exists()


def test_check_with_the_option_records_the_new_key(sshd):
    known = sshd.root / "fresh_known_hosts"
    profile = write_profile(sshd, known)
    done = console(profile, "check", "--accept-new-host-keys")
    assert "host key" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert known.read_text() == sshd.known_hosts_line()  # `[127.0.0.1]:PORT ssh-ed25519 KEY`, as ssh writes it
    again = console(profile, "hostkeys")  # strict again: the recorded key is trusted
    assert again.returncode == 0 and again.stdout == f"node-a: known    {fingerprint(sshd)}\n", again.stdout
    assert known.read_text() == sshd.known_hosts_line()  # nothing written twice
    # the option before the command (a start's place) means the same
    assert console(profile, "--accept-new-host-keys", "hostkeys").returncode == 0


def test_hostkeys_shows_the_fingerprint_and_asks(sshd):
    known = sshd.root / "fresh_known_hosts"
    profile = write_profile(sshd, known)
    new_line = f"node-a: new      {fingerprint(sshd)}  ([127.0.0.1]:{sshd.port})"
    piped = console(profile, "hostkeys")  # no terminal to answer on: nothing recorded
    assert piped.returncode == 1 and piped.stdout.splitlines() == [
        new_line, "1 new host key(s) not recorded: answer yes on a terminal, or add --accept-new-host-keys"], \
        piped.stdout
    assert not known.exists()
    code, out = on_a_terminal([profile, "hostkeys"], "no")
    assert code == 1 and out.splitlines()[0] == new_line and out.rstrip().endswith("nothing recorded"), out
    assert not known.exists()
    code, out = on_a_terminal([profile, "hostkeys"], "y")  # only the word itself is a yes
    assert code == 1 and not known.exists(), out
    code, out = on_a_terminal([profile, "hostkeys"], "yes")
    assert code == 0 and out.splitlines()[0] == new_line, out
    assert re.search(rf"Record 1 new host key\(s\) in {re.escape(str(known))}\? .*Type yes", out), out
    assert out.rstrip().endswith(f"node-a: recorded in {known}"), out
    assert known.read_text() == sshd.known_hosts_line()
    assert console(profile, "hostkeys").stdout == f"node-a: known    {fingerprint(sshd)}\n"


@pytest.mark.timeout(180)
def test_a_changed_key_is_refused_even_with_the_option(sshd):
    old = fingerprint(sshd)
    sshd.stop()
    sshd.start(new_host_key=True)  # the known_hosts line (sshd.trust()) is the old key's
    new = fingerprint(sshd)
    assert new != old
    before = sshd.known_hosts.read_text()
    profile = write_profile(sshd, sshd.known_hosts)
    refusal = (rf"host key CHANGED for {sshd.user}@127\.0\.0\.1:{sshd.port}: it offers {re.escape(new)}, known_hosts "
               rf"has {re.escape(old)}: refused; (fix: )?if the host was reinstalled, check its new key, then remove "
               rf"the old one \(ssh-keygen -R '\[127\.0\.0\.1\]:{sshd.port}' -f {re.escape(str(sshd.known_hosts))}\)")
    for args in (["hostkeys", "--accept-new-host-keys"], ["hostkeys"], ["check", "--accept-new-host-keys"]):
        done = console(profile, *args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert re.fullmatch(rf"node-a: {refusal}", done.stdout.strip()), (args, done.stdout)
    code, out = on_a_terminal([profile, "hostkeys"], "yes")  # a yes changes nothing: there was no question
    assert code == 1 and "Record" not in out, out
    start = console(profile, "--accept-new-host-keys", "--headless", timeout=120)
    assert start.returncode == 1 and re.search(rf"node-a: {refusal}", start.stderr + start.stdout), \
        start.stdout + start.stderr
    assert sshd.known_hosts.read_text() == before  # nothing written over (or beside) the old key
