"""Process helpers for tests: every process gets its own process group, a timeout, and is killed by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

from forkserver import ForkServer

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# engines started through ProcessTracker are forked from one process that imported them once (forkserver.py);
# ZEROBAND_TEST_FORK=0 starts each as its own interpreter
FORK = os.environ.get("ZEROBAND_TEST_FORK", "1") != "0"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports: every socket stays bound until all are chosen (one after another, the
    kernel may hand out the same port twice: an etcd member once got one port for its peer and client URLs)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawned_ranks(target, size: int, timeout: float) -> dict[int, object]:
    """Run target(rank, port, queue) in `size` new processes (a gloo group on a free port) and return each
    rank's result, which the target puts on the queue as (rank, pickle.dumps(result)), or (rank, traceback text)
    to fail the caller with it. Plain pickle: torch's queue reducers would share tensors through a server that
    dies with the child."""
    import multiprocessing as mp
    import pickle

    if FORK:  # forked from multiprocessing's fork server, which imported the engine once (as forkserver.py)
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["engine.session"])
    else:
        ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    workers = [ctx.Process(target=target, args=(r, port, queue)) for r in range(size)]
    for w in workers:
        w.start()
    try:
        got = dict(queue.get(timeout=timeout) for _ in range(size))
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
    for rank, r in got.items():
        assert isinstance(r, bytes), f"rank {rank} failed:\n{r}"
    return {rank: pickle.loads(r) for rank, r in got.items()}


def engine_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_BAND_", "GLOBAL_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class ProcessTracker:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | str | None = None,
              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text: bool = True) -> subprocess.Popen:
        env, cwd = env or engine_env(), str(cwd or ROOT)
        server = ForkServer.shared(engine_env()) if FORK and ForkServer.engine_command(args) else None
        proc = None
        if server is not None and (through := server.torchrun(args, env)) is not None:
            args, env = through  # torchrun itself runs for real; its workers are forked
        elif server is not None:
            try:
                proc = server.start(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text)
            except (OSError, subprocess.TimeoutExpired) as e:  # the server is gone or stuck: a real start
                print(f"forkserver: {type(e).__name__}: {e}; {args[:3]} starts for real", file=sys.stderr)
        if proc is None:
            proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, args: list[str], *, timeout: float, **kw) -> subprocess.CompletedProcess:
        """Run to completion; on timeout kill the whole process group and fail loudly with its output."""
        proc = self.start(args, **kw)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate()
            raise AssertionError(f"timed out after {timeout}s: {' '.join(args)}\n--- stdout\n{out}\n--- stderr\n{err}")
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    def describe(self) -> str:
        """The processes of this test that still run: each tracked one, its descendants and the fork server's
        children, with state and kernel wait channel (what a hung test waits on: a worker in ep_poll whose engine
        is a zombie of the server, say). A forked engine is a root and the server's child: listed once."""
        import psutil

        names = {p.pid: " ".join(map(str, p.args)) for p in self.procs if p.poll() is None}
        server = ForkServer._shared
        if names and server:
            names[server.proc.pid] = "the fork server (tests/forkserver.py); its children are forked engines"
        lines: list[str] = []
        seen: set[int] = set()

        def walk(proc: "psutil.Process", depth: int) -> None:
            if proc.pid in seen:
                return
            seen.add(proc.pid)
            try:
                what = " ".join((names.get(proc.pid) or " ".join(proc.cmdline())).split())  # on one line
                wchan = Path(f"/proc/{proc.pid}/wchan").read_text().strip() or "-"
                lines.append(f"{'  ' * depth}{proc.pid} {proc.status()} wchan={wchan} {what[:200]}")
                children = proc.children()
            except (psutil.Error, OSError):  # gone meanwhile
                return
            for c in children:
                walk(c, depth + 1)

        for pid in names:
            try:
                walk(psutil.Process(pid), 0)
            except psutil.NoSuchProcess:
                pass
        return "\n".join(lines)

    def kill_all(self) -> None:
        errors = []
        for proc in self.procs:  # every one, whatever one of them raises
            try:
                kill_group(proc)
            except Exception as e:  # noqa: BLE001 - raised once the others are killed
                errors.append(e)
        if errors:
            raise errors[0]


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL, wait: float = 10.0) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_recorded_groups(pid_files: Iterable[Path]) -> None:
    """Teardown of detached starts (the console's engines, stores, etcd members): SIGKILL the process group each
    pid file names, unless that pid is now a process started after the file was written. Pid numbers wrap (32768
    on this machine, a few minutes of a busy suite), and a stale file's kill could end a store another test had
    just started (a store that dies with no output before it is ready). A group that still has members keeps its
    number: only a leader that is gone can have been replaced."""
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    for pid_file in pid_files:
        try:
            pgid, written = int(pid_file.read_text().strip()), pid_file.stat().st_mtime
        except (ValueError, OSError):
            continue
        try:
            stat = Path(f"/proc/{pgid}/stat").read_text()
        except OSError:
            stat = ""  # the leader is gone; its group may not be
        if stat:  # field 22, after "pid (comm) ": the start in clock ticks since boot (boot time: whole seconds)
            started = boot + int(stat.rsplit(") ", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            if started > written + 2.0:
                continue
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# profiles/local.toml's debug DiLoCo config made quick for a loaded 2-core CI machine: short sequences, a step
# event per step, outer rounds every 3 steps, heartbeats fast enough that a killed node is declared dead in ~2 s
FAST_LOCAL = {"train.micro_batch_size": 2, "train.batch_size": 2, "data.seq_len": 32, "train.log_interval": 1,
              "train.eval_interval": 0, "telemetry.resource_interval": 1.0, "diloco.inner_steps": 3,
              "diloco.allreduce_timeout": 20.0, "mesh.heartbeat_interval": 0.25, "mesh.heartbeat_timeout": 2.0,
              "mesh.store_timeout": 30.0, "mesh.start_timeout": 60.0, "mesh.join_timeout": 120.0,
              "mesh.polling_interval": 0.05, "train.max_steps": 100000,
              "diloco.min_nodes": 3}  # the first outer step waits for all three: a loaded machine starts them unevenly


def fast_local_profile(tmp_path: Path) -> Path:
    """profiles/local.toml, as shipped, with its run dir under tmp_path, a free store port and FAST_LOCAL."""
    import tomlkit

    doc = tomlkit.parse((ROOT / "profiles" / "local.toml").read_text())
    doc["run"]["dir"] = str(tmp_path / "runs")
    doc["store"]["port"] = free_port()
    for key, value in FAST_LOCAL.items():
        doc["engine"]["overrides"][key] = value
    path = tmp_path / "local.toml"
    path.write_text(tomlkit.dumps(doc))
    return path
