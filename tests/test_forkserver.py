"""The tests' fork server (tests/forkserver.py): a forked engine behaves as the command line it stands for, in a
process of its own, and commands whose start would differ are not forked."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from forkserver import Forked, ForkServer
from procs import PYTHON, ROOT, engine_env, kill_group

SHOW = """import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "x": os.environ.get("ZB_FORK_X"), "path0": sys.path[0],
                  "sid": os.getsid(0), "pgid": os.getpgid(0), "pid": os.getpid()}), flush=True)
import engine.train
engine.train.cli()
"""


def test_a_forked_engine_says_and_exits_exactly_as_the_real_command_line(procs, monkeypatch):
    args = [PYTHON, "-m", "engine.train", "configs/debug.toml", "--train.max_stepz=3"]
    forked = procs.run(args, timeout=120)
    assert isinstance(procs.procs[-1], Forked)
    monkeypatch.setattr("procs.FORK", False)
    real = procs.run(args, timeout=120)
    assert isinstance(procs.procs[-1], subprocess.Popen)
    assert forked.returncode == real.returncode == 2
    assert forked.stderr == real.stderr == \
        "error: command line: train.max_stepz: unknown key (did you mean train.max_steps?)\n"
    assert forked.stdout.count("\n") == real.stdout.count("\n") == 3  # error, state, run_end


def test_a_forked_engine_has_its_own_session_environment_folder_and_arguments(procs, tmp_path):
    import json
    proc = procs.start([PYTHON, "-c", SHOW, "--help"], env=engine_env(ZB_FORK_X="42"), cwd=tmp_path)
    assert isinstance(proc, Forked)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = json.loads(out.splitlines()[0])
    assert seen["pid"] == proc.pid and seen["sid"] == seen["pgid"] == proc.pid  # killpg(proc.pid) reaches it all
    assert seen["argv"] == ["-c", "--help"] and seen["x"] == "42" and seen["cwd"] == str(tmp_path)
    assert seen["path0"] == ""  # as `python -c` sets it
    assert out.splitlines()[1].startswith("usage: python -m engine.train CONFIG.toml")


def test_a_forked_engine_killed_by_its_group_reports_the_signal(procs):
    proc = procs.start([PYTHON, "-c", "import time\ntime.sleep(60)\nimport engine.train\nengine.train.cli()"])
    assert isinstance(proc, Forked) and proc.poll() is None
    began = time.monotonic()
    try:
        proc.wait(timeout=0.2)
        raise AssertionError("it should still run")
    except subprocess.TimeoutExpired:
        assert time.monotonic() - began < 5
    kill_group(proc, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(f"/proc/{proc.pid}")  # reaped by the server before it reported the status


def test_a_failed_test_can_say_what_its_running_processes_wait_on(procs):
    """procs.describe(), which the procs fixture prints when a test fails: a hung CI test named no process."""
    sleeper = procs.start([PYTHON, "-c", "import time\ntime.sleep(60)\nimport engine.train\nengine.train.cli()"])
    real = procs.start([PYTHON, "-c", "import time; time.sleep(60)"])
    deadline = time.monotonic() + 60
    while True:  # until both are asleep (a real interpreter starts for a while on a loaded machine)
        lines = procs.describe().splitlines()
        mine = {int(line.split()[0]): line for line in lines if not line.startswith(" ")}
        asleep = all(mine.get(p.pid, "0 running").split()[1] == "sleeping" for p in (sleeper, real))
        if asleep or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert mine[sleeper.pid].split()[1] == "sleeping" and "time.sleep(60)" in mine[sleeper.pid], lines
    assert mine[real.pid].split()[1] == "sleeping" and "time.sleep(60)" in mine[real.pid], lines
    assert any("the fork server" in line for line in lines), lines
    pids = [int(line.split()[0]) for line in lines]
    assert len(pids) == len(set(pids)), lines  # a forked engine is a root and the server's child: listed once
    kill_group(sleeper)
    kill_group(real)
    assert procs.describe() == ""


def test_commands_whose_start_would_differ_are_real_interpreters(procs, tmp_path):
    engine = [PYTHON, "-m", "engine.train", "--help"]
    for args, env in ((engine, engine_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")),  # another import path
                      (engine, engine_env(TORCH_LOGS="+dynamo")),  # a variable the imports read
                      ([PYTHON, "-X", "importtime", "-m", "engine.train", "--help"], engine_env()),
                      ([PYTHON, "-c", "print(1)"], engine_env())):  # not the engine
        proc = procs.start(args, env=env)
        assert isinstance(proc, subprocess.Popen), args
        proc.communicate(timeout=120)


def test_under_torchrun_each_worker_is_a_client_and_its_engine_ends_with_it_even_by_sigkill(procs, tmp_path):
    import json

    import psutil

    proc = procs.start([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                        "engine.train", "configs/debug.toml", "--train.max_steps=100000", "--train.eval_interval=0",
                        "--train.log_interval=1", "--data.seq_len=32", "--train.micro_batch_size=2",
                        "--train.batch_size=4", f"--run.dir={tmp_path / 'run'}"])
    assert "--no-python" in proc.args and any(a.endswith("forkclient.py") for a in proc.args)
    engine = None
    for line in proc.stdout:  # rank 0's events
        if line.startswith("{") and json.loads(line)["type"] == "run_start":
            engine = json.loads(line)["pid"]
            break
    assert engine is not None, proc.communicate(timeout=30)
    clients = [c for c in psutil.Process(proc.pid).children() if any("forkclient" in a for a in c.cmdline())]
    assert len(clients) == 2 and engine not in {c.pid for c in clients}  # the engine is the server's fork
    for client in clients:
        client.kill()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(engine) and psutil.Process(engine).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the engine outlived its SIGKILLed client by 10 s"
        time.sleep(0.05)
    proc.communicate(timeout=60)
    assert proc.returncode != 0


def test_a_worker_whose_fork_server_is_gone_starts_the_engine_for_real(procs, tmp_path):
    from forkserver import CLIENT, SOCKET_ENV
    done = procs.run([PYTHON, CLIENT, "-m", "engine.train", "--help"],
                     env=engine_env(**{SOCKET_ENV: f"@zb-fork-no-server-{tmp_path.name}"}), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.startswith("forkclient: ConnectionRefusedError") and "the engine starts for real" in done.stderr
    assert done.stdout.startswith("usage: python -m engine.train CONFIG.toml")


def test_the_server_dies_with_the_session_that_started_it_even_by_sigkill(procs):
    import psutil
    session = procs.start([PYTHON, "-c", "import sys, time\nsys.path.insert(0, 'tests')\n"
                           "from forkserver import ForkServer\nfrom procs import engine_env\n"
                           "print(ForkServer.shared(engine_env()).proc.pid, flush=True)\ntime.sleep(120)\n"])
    server = int(session.stdout.readline())
    assert psutil.pid_exists(server)
    os.kill(session.pid, signal.SIGKILL)  # no atexit, no fixture teardown
    deadline = time.monotonic() + 10
    while psutil.pid_exists(server) and psutil.Process(server).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the fork server outlived its session by 10 s"
        time.sleep(0.05)


def test_a_server_that_cannot_start_says_why_and_engines_start_for_real(monkeypatch):
    """A server whose interpreter fails (here: no standard library under PYTHONHOME) raises RuntimeError with what
    it printed, and shared() falls back to real interpreters. The failure path once closed the log before reading
    it: a ValueError escaped, and every engine test failed without the reason (on a GPU machine)."""
    broken = engine_env(PYTHONHOME="/nonexistent")
    with pytest.raises(RuntimeError, match=r"(?s)the fork server did not start: .*encodings"):
        ForkServer(broken)
    monkeypatch.setattr(ForkServer, "_shared", False)
    assert ForkServer.shared(broken) is None
