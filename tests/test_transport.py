"""Command builders (pure, quoted) and the LocalTransport: start detached, tail, resume, signal, alive."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from console.profile import HostSpec
from console.transport import LocalTransport, TransportError, make_transport
from console.transport import commands as C
from console.transport.base import collect


async def gone(t, pid: int, timeout: float = 10.0) -> None:
    """Wait until the transport no longer sees pid alive (a loaded machine reaps a killed group late)."""
    deadline = time.monotonic() + timeout
    while await t.alive(pid):
        assert time.monotonic() < deadline, f"pid {pid} still alive after {timeout}s"
        await asyncio.sleep(0.05)

NASTY = ["a b", "it's", 'say "hi"', "$(touch PWNED)", "`touch PWNED`", "; touch PWNED;", "x|y&z", "~", "*", "\\n",
         "$HOME", "--flag=1"]


def sh(cmd: str, cwd: Path, stdin: str | None = None, home: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home)} if home else None
    return subprocess.run(["sh", "-c", cmd], cwd=cwd, capture_output=True, text=True, timeout=30, input=stdin, env=env)


def local_host(workdir: Path, **kw) -> HostSpec:
    return HostSpec(name="n", transport="local", workdir=str(workdir), **kw)


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


# ---- pure builders -------------------------------------------------------------------------------------------
def test_detached_command_quotes_every_value(tmp_path):
    workdir = tmp_path / "work dir 'q' $(x)"
    workdir.mkdir()
    run_dir = "run; $(touch PWNED) 'n'/node \"b\""
    argv = [sys.executable, "-c", "import json,os,sys; print(json.dumps([sys.argv[1:], os.environ['ZB_V']]))", *NASTY]
    env = {"ZB_V": "v $(x) 'y'\nz"}
    cmd = C.detached_command(argv, workdir=str(workdir), run_dir=run_dir, with_env=True)
    assert "v $(x)" not in cmd  # the environment goes on stdin, never into the command text
    done = sh(cmd, tmp_path, stdin=C.env_file_text(env))
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.strip())
    out = workdir / run_dir
    wait_until(lambda: (out / "rc").exists())
    assert json.loads((out / "events.jsonl").read_text()) == [NASTY, "v $(x) 'y'\nz"]
    assert not (out / C.ENV_FILE).exists()  # the wrapper removed it once read
    assert (out / "pid").read_text().strip() == str(pid) and (out / "rc").read_text().strip() == "0"
    assert not list(tmp_path.rglob("PWNED")), "a value reached the shell unquoted"


def test_through_sh_runs_the_command_as_written_or_says_it_could_not_decode_it(tmp_path):
    """What an SSH channel carries (console/transport/ssh.py): the command, as base64 that sh decodes. A host without
    base64 (a bare container) would have run an empty command, status 0 for every alive and kill; it says so."""
    cmd = "if true; then echo \"$0 ok\"; fi; printf '%s|' 'a\\b !x' \"$(echo nested)\"; cat; exit 3"
    done = subprocess.run(["sh", "-c", C.through_sh(cmd)], input="in", capture_output=True, text=True, timeout=10)
    assert (done.returncode, done.stdout, done.stderr) == (3, "sh ok\na\\b !x|nested|in", "")
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "sh").symlink_to("/bin/sh")  # sh, and no base64
    done = subprocess.run(["/bin/sh", "-c", C.through_sh("echo ran")], capture_output=True, text=True, timeout=10,
                          env={"PATH": str(bare)})
    assert done.returncode == C.UNDECODED and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1] == (f"{C.UNDECODED_SAYS}: base64 -d failed (the host needs "
                                                    "coreutils or busybox)")


def test_a_program_under_home_is_the_host_users(tmp_path):
    """hosts.X.venv = "~/v": the check expands ~ on the host, so the start does too (it ran `~/v/bin/python`)."""
    (tmp_path / "v w" / "bin").mkdir(parents=True)
    (tmp_path / "v w" / "bin" / "python").symlink_to(sys.executable)
    cmd = C.detached_command(["~/v w/bin/python", "-c", "print('ran')"], workdir=".", run_dir="run")
    done = sh(cmd, tmp_path, home=tmp_path)
    assert done.returncode == 0, done.stderr
    wait_until(lambda: (tmp_path / "run" / "rc").exists())
    assert (tmp_path / "run" / "rc").read_text().strip() == "0", (tmp_path / "run" / "engine.log").read_text()
    assert (tmp_path / "run" / "events.jsonl").read_text() == "ran\n"


def test_builders_are_pure_and_reject_bad_values():
    assert C.kill_command(1234, "TERM") == "kill -s TERM -- -1234"
    assert C.kill_command(1234, "KILL", group=False) == "kill -s KILL -- 1234"
    assert "kill -s KILL -- -1234; rc=$?" in C.kill_command(1234, "KILL")  # and its descendants: see below
    assert C.kill_command(1234, "sigterm", group=False) == "kill -s TERM -- 1234"
    assert C.tail_command("r/a b.jsonl", 10) == "exec tail -c +11 -F 'r/a b.jsonl' 2>/dev/null"
    assert C.qpath("~/x y") == "\"$HOME\"/'x y'" and C.qpath("~") == '"$HOME"' and C.qpath("a~b") == "'a~b'"
    assert C.read_command("p'id", "w") == "cd w && cat 'p'\"'\"'id' 2>/dev/null"
    for bad in (0, 1, -5, "12; rm -rf /", True, 3.5):
        with pytest.raises(ValueError, match="not a process id"):
            C.kill_command(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown signal"):
        C.kill_command(42, "TERM; reboot")
    with pytest.raises(ValueError, match="bad environment variable name"):
        C.env_file_text({"A;B": "1"})
    with pytest.raises(ValueError, match="empty argv"):
        C.detached_command([], workdir=".", run_dir="r")


def test_launch_check_reasons(tmp_path):
    (tmp_path / "c.toml").write_text("")
    assert sh(C.launch_check_command(workdir=str(tmp_path), python="sh", config="c.toml"), tmp_path).returncode == 0
    cases = [({"workdir": str(tmp_path / "nope"), "python": "sh"}, 3, "working directory"),
             ({"workdir": str(tmp_path), "python": "/no/python 'x'"}, 4, "python not found on the host: /no/python"),
             ({"workdir": str(tmp_path), "python": "sh", "config": "missing.toml"}, 5, "engine config missing.toml")]
    for kw, rc, text in cases:
        assert sh(C.launch_check_command(**kw), tmp_path).returncode == rc
        assert text in C.launch_check_reason(rc, **kw)  # type: ignore[operator]


def test_alive_command_sees_through_zombies(tmp_path):
    proc = subprocess.Popen(["sleep", "0"])
    wait_until(lambda: "Z" in Path(f"/proc/{proc.pid}/status").read_text().split("State:")[1][:4])
    assert sh(C.alive_command(proc.pid), tmp_path).returncode == 1  # exited, not yet reaped: not alive
    proc.wait()
    assert sh(C.alive_command(os.getpid()), tmp_path).returncode == 0


def test_alive_command_looks_again_at_a_process_in_the_middle_of_an_exec(tmp_path):
    # a detached start execs setsid, nohup, then the tagged wrapper: the store's watcher looked once while the
    # command line did not have the tag yet, and said of a store just started "store exited: no output"
    go = tmp_path / "go"
    code = ("import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.005)\n"
            "os.execv('/bin/sh', ['sh', '-c', 'sleep 30', os.environ['T']])\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(go)], env={**os.environ, "T": C.TAG},
                            start_new_session=True)
    try:
        wait_until(lambda: b"-c" in Path(f"/proc/{proc.pid}/cmdline").read_bytes())  # python, no tag yet
        check = subprocess.Popen(["sh", "-c", C.alive_command(proc.pid, C.TAG)])
        time.sleep(0.1)  # its first look is at python's command line
        go.touch()
        assert check.wait(10) == 0
        assert sh(C.alive_command(os.getpid(), C.TAG), tmp_path).returncode == 1  # alive, not ours: still no
    finally:
        proc.kill()
        proc.wait()


def test_teardown_kills_a_recorded_group_but_not_a_reused_number(tmp_path):
    from procs import kill_recorded_groups

    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        stale, ours = tmp_path / "stale-pid", tmp_path / "pid"
        for f in (stale, ours):
            f.write_text(f"{proc.pid}\n")
        os.utime(stale, (time.time() - 100, time.time() - 100))  # written before this process began: a reused pid
        kill_recorded_groups([stale, tmp_path / "missing", tmp_path])
        time.sleep(0.2)
        assert proc.poll() is None
        kill_recorded_groups([ours])
        assert proc.wait(5) == -9
    finally:
        proc.kill()
        proc.wait()


# ---- LocalTransport ------------------------------------------------------------------------------------------
WRITER = ("import sys, time\n"
          "for i in range(int(sys.argv[1])):\n"
          "    print('{\"i\": %d}' % i, flush=True); time.sleep(float(sys.argv[2]))\n"
          "time.sleep(float(sys.argv[3]))\n")


async def test_local_start_tail_resume_kill(tmp_path):
    t = make_transport(local_host(tmp_path))
    assert isinstance(t, LocalTransport)
    (tmp_path / "w.py").write_text(WRITER)
    pid = await t.start_detached([sys.executable, "w.py", "6", "0.05", "60"], "run/it's a node")
    assert await t.alive(pid)
    tail = t.tail("run/it's a node/events.jsonl")
    first = await asyncio.wait_for(collect(tail, 3), 10)
    assert first == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
    offset = tail.offset
    assert offset == sum(len(x) + 1 for x in first)
    await tail.aclose()
    resumed = t.tail("run/it's a node/events.jsonl", offset)  # a new tail picks up exactly where the old stopped
    assert await asyncio.wait_for(collect(resumed, 3), 10) == [b'{"i": 3}', b'{"i": 4}', b'{"i": 5}']
    assert await t.read_text("run/it's a node/pid") == f"{pid}\n"
    assert await t.signal(pid, "KILL")  # the whole process group
    await gone(t, pid)
    assert await t.read_text("run/it's a node/rc") is None  # killed with its group: no exit status written


LAUNCHER = ("import os, subprocess, sys, time\n"
            "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
            "open(sys.argv[1], 'w').write(str(kid.pid)); time.sleep(60)\n")


async def test_a_kill_reaches_workers_in_sessions_of_their_own(tmp_path):
    """Defect: `kill NODE` of a host with workers = 2 SIGKILLed torchrun's process group, but torchrun starts its
    workers in sessions of their own and cannot forward a KILL: the workers trained on in the run, the node shown
    dead. A KILL of a group reaches every process descended from it."""
    t = make_transport(local_host(tmp_path))
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    pid = await t.start_detached([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "kid")], "run")
    wait_until(lambda: (tmp_path / "kid").is_file() and (tmp_path / "kid").read_text())
    kid = int((tmp_path / "kid").read_text())
    assert os.getpgid(kid) == kid != pid  # a group of its own, out of reach of a kill of the node's group
    try:
        assert await t.signal(pid, "KILL")
        await gone(t, pid)
        await gone(t, kid)
    finally:
        for p in (kid, pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, 9)


async def test_local_tail_waits_for_the_file_and_skips_partial_lines(tmp_path):
    t = LocalTransport(local_host(tmp_path))
    tail = t.tail("later.jsonl")
    reader = asyncio.ensure_future(collect(tail, 2))
    await asyncio.sleep(0.3)
    assert not reader.done()
    path = tmp_path / "later.jsonl"
    with open(path, "wb") as f:
        f.write(b"one\ntw")
        f.flush()
        await asyncio.sleep(0.3)
        assert not reader.done()  # "tw" is not a line yet
        f.write(b"o\nthr")
        f.flush()
        assert await asyncio.wait_for(reader, 5) == [b"one", b"two"]
    assert tail.offset == 8
    path.write_bytes(b"new\n")  # truncated and rewritten (a fresh start): read from the top
    assert await asyncio.wait_for(collect(tail, 1), 5) == [b"new"]


async def test_local_run_exit_status_timeout_and_exit_code(tmp_path):
    t = LocalTransport(local_host(tmp_path))
    assert await t.run("echo out; echo err >&2; exit 3") == (3, "out\n", "err\n")
    started = time.monotonic()
    with pytest.raises(TransportError, match="timed out after 0.5s"):
        await t.run("sleep 30", timeout=0.5)
    assert time.monotonic() - started < 5
    pid = await t.start_detached(["sh", "-c", "echo boom >&2; exit 7"], "r")
    await gone(t, pid)
    assert (await t.read_text("r/rc")).strip() == "7"
    assert "boom" in await t.last_lines("r/engine.log")
    await t.touch("r/drain")
    assert (tmp_path / "r" / "drain").exists()
    assert await t.launch_check() is None
    missing = LocalTransport(local_host(tmp_path, python="/nowhere/python3"))
    assert await missing.launch_check() == "python not found on the host: /nowhere/python3"


async def test_detached_survives_its_starter(tmp_path):
    """The engine must outlive the console: start it from a shell that then exits, and it keeps running."""
    t = LocalTransport(local_host(tmp_path))
    (tmp_path / "w.py").write_text(WRITER)
    pid = await t.start_detached([sys.executable, "w.py", "1", "0", "60"], "r")
    try:
        wait_until(lambda: os.getsid(pid) == pid)  # setsid runs a moment after the starting shell forked it
        assert os.getpgid(pid) == pid  # its own session and process group: `kill -- -PID` reaches all of it
        assert os.getsid(pid) != os.getsid(os.getpid())
    finally:
        await t.signal(pid, "KILL")


async def test_read_from_offset_alive_tag_and_rc_after_term(tmp_path):
    t = LocalTransport(local_host(tmp_path))
    (tmp_path / "f.jsonl").write_bytes(b"a\nbb\n\xff\xfe garbage\nparti")
    lines, offset = await t.read_from("f.jsonl", 2)
    assert lines == [b"bb", b"\xff\xfe garbage"] and offset == 16  # bytes kept exact; the partial line waits
    assert await t.read_from("f.jsonl", offset) == ([], 16)
    assert await t.read_from("missing.jsonl", 0) == ([], 0)
    # a TERM to the whole group (stop) still lets the wrapper record the engine's exit status
    script = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\ntime.sleep(60)\n"
    pid = await t.start_detached([sys.executable, "-c", script], "r")
    await asyncio.sleep(0.5)
    assert await t.alive(pid, tag=C.TAG)
    assert not await t.alive(os.getpid(), tag=C.TAG)  # alive, but not one of ours (a reused pid)
    assert await t.signal(pid, "TERM")
    for _ in range(100):
        if await t.read_text("r/rc"):
            break
        await asyncio.sleep(0.05)
    assert (await t.read_text("r/rc")) == "0\n"
    assert not await t.alive(pid, tag=C.TAG)
