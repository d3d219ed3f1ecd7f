"""Engines for the tests, forked from one process that imported them once.

Each `python -m engine.train` spends 5-10 s of one core importing torch, transformers and the strategies before it
trains (engine/session.py), and the suite starts over a hundred of them on two cores. A test that starts engines
through ProcessTracker gets them forked from this server instead, which did those imports once, like
multiprocessing's forkserver: each is a real process of its own (own pid, session and process group, own
environment, working folder and pipes), running the same `engine.train.cli()` that `python -m engine.train`
runs, in a copy of a process that has imported and done nothing else.

    server = ForkServer.shared(env)               # started on first use, for the whole session; None if it failed
    proc = server.start(args, env=, cwd=, stdout=, stderr=, text=)   # args: [PYTHON, "-m", "engine.train", ...]
                                                  #   or [PYTHON, "-c", CODE, ...] whose CODE runs engine.train.cli()
    args, env = server.torchrun(args, env)        # a torchrun of the engine, its workers forkclient.py
    proc.stdout, proc.poll(), proc.wait(t), proc.communicate(timeout=t), proc.kill(), os.killpg(proc.pid, sig)

Only commands that would behave alike are forked (`forkable`): the plain interpreter with no -X or -W option, this
checkout on PYTHONPATH, and an environment that differs from the server's only in variables read at run time (not
the TORCH_*, HF_*, TRANSFORMERS_*, OMP_* or PYTHON* ones that imports read). The command line, --help and an
environment that cannot import are still tested by real interpreter starts (test_bad_inputs.py), and so is every
engine the console starts.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOCKET_ENV = "ZEROBAND_TEST_FORKSERVER"  # the server's socket, for forkclient.py under torchrun
CLIENT = str(Path(__file__).with_name("forkclient.py"))
READY_TIMEOUT = 180.0  # seconds the server may take for its imports on a loaded machine
# variables that imports read (a fork would keep the server's): a command that changes one starts for real
IMPORT_READ = ("TORCH_", "PYTORCH_", "HF_", "TRANSFORMERS_", "TRITON_", "OMP_", "MKL_", "KMP_", "PYTHON", "LD_",
               "CUDA_", "NCCL_", "GLOO_", "TOKENIZERS_", "HOME", "XDG_", "TMPDIR", "LANG", "LC_")

SERVER = r'''
import ctypes, json, os, selectors, signal, socket, sys
path, parent = sys.argv[1], int(sys.argv[2])
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: gone with the test session
if os.getppid() != parent:
    sys.exit("the test session ended before the fork server started")
import engine.train, engine.session  # the seconds every child is spared
import gc, threading
gc.collect()
gc.freeze()
assert threading.active_count() == 1, threading.enumerate()  # a fork copies only the forking thread
assert len(os.listdir("/proc/self/task")) == 1, "the imports started a native thread: forking is not safe"
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind("\0" + path[1:])  # "@name": the abstract name (address())
listener.listen(128)
# Every wait is one epoll on file descriptors, no signal handler: a SIGCHLD that lands between a handler's last
# check and the blocking call waits for the next event (a status lost for minutes, once in a few thousand forks).
# A pidfd of each child becomes readable when it exits; until this process reaps it there, its pid and process
# group cannot be reused, so killing the group of a child whose client died never reaches a stranger.
events = selectors.DefaultSelector()
events.register(listener, selectors.EVENT_READ, None)


def child(req, fds):
    try:
        os.setsid()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        os.closerange(3, 1 << 16)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = req["argv"]
        sys.path[0] = os.getcwd() if req["code"] is None else ""  # as `python -m` and `python -c` set it
        if req["code"] is None:
            engine.train.cli()
        else:
            exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as e:  # as the interpreter ends on it
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:  # the interpreter ends by the signal
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def kill(pid):
    """SIGKILL a child and its process group. The child itself first: until its setsid() the group does not exist
    yet. Its pid is safe to use until this process reaps it."""
    for send in (os.kill, os.killpg):
        try:
            send(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def serve(conn):
    conn.settimeout(10)  # a client that connects and says nothing must not hold up every exit status
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    watch = None
    try:
        size = int.from_bytes(data[:8], "big")
        while len(data) < 8 + size:
            more = conn.recv(1 << 16)
            if not more:
                raise ConnectionError("the request ended early")
            data += more
        conn.settimeout(None)
        req = json.loads(data[8:])
        watch = os.pidfd_open(req["watch"]) if req.get("watch") else None
        pid = os.fork()
        if pid == 0:
            try:
                child(req, fds)
            finally:
                os._exit(1)  # never back into this loop, whatever child() raised on its way out
        try:
            ended = os.pidfd_open(pid)
        except OSError:  # untracked, it could never report: it ends here
            kill(pid)
            os.waitpid(pid, 0)
            raise
        events.register(ended, selectors.EVENT_READ, ("ended", pid, conn, watch))
        if watch is not None:
            events.register(watch, selectors.EVENT_READ, ("client gone", pid))
            watch = None  # the event owns it now
        try:
            conn.sendall(f"{pid}\n".encode())
        except OSError:  # the asker is gone: so is what it asked for
            kill(pid)
    finally:
        for fd in fds:
            os.close(fd)
        if watch is not None:
            os.close(watch)


def drop(fd):
    events.unregister(fd)
    os.close(fd)


signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an inherited SIG_IGN would reap the children before waitpid
os.close(os.pidfd_open(os.getpid()))  # no pidfds (Linux < 5.3): fail now, and the tests start real interpreters
print("ready", flush=True)
while True:
    for key, _ in events.select():
        if events.get_map().get(key.fd) is not key:  # dropped by an earlier event of this batch
            continue
        if key.data is None:
            try:
                conn, _ = listener.accept()
            except OSError:  # the asker left before it was heard
                continue
            try:
                serve(conn)
            except Exception as e:  # one bad request costs that request only
                print(f"forkserver: a request failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                conn.close()
        elif key.data[0] == "ended":
            _, pid, conn, watch = key.data
            _, status = os.waitpid(pid, 0)
            drop(key.fd)
            watched = events.get_map().get(watch) if watch is not None else None
            if watched is not None and watched.data == ("client gone", pid):  # not a number reused since
                drop(watch)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()
        elif key.data[0] == "client gone":  # its forkclient.py ended (torchrun's SIGKILL too): the engine goes too
            kill(key.data[1])
            drop(key.fd)
'''


def address(path: str) -> str:
    """The socket address of a server path "@name": the abstract name (a leading NUL), as ss(8) writes it."""
    return "\0" + path[1:]


def child_argv(args: list[str]) -> tuple[str | None, list[str]]:
    """(the -c script or None for -m engine.train, sys.argv as that interpreter would set it) of an engine command."""
    if args[1] == "-m":
        return None, [str(ROOT / "engine" / "train.py"), *args[3:]]
    return args[2], ["-c", *args[3:]]


def through_torchrun(args: list[str]) -> list[str] | None:
    """A torchrun command of the engine whose workers are forked: each worker is forkclient.py, which asks the
    server for the engine and stands for it (signals in, exit status out); None for any other command."""
    if args[1:3] != ["-m", "torch.distributed.run"]:
        return None
    for i in range(3, len(args) - 1):
        if args[i:i + 2] == ["-m", "engine.train"]:
            return [*args[:i], "--no-python", sys.executable, CLIENT, "-m", "engine.train", *args[i + 2:]]
        if not args[i].startswith("-"):
            return None  # the script came first: not the engine
    return None


class Forked:
    """A forked engine, as much of subprocess.Popen as the tests use."""

    def __init__(self, path: str, args: list[str], code: str | None, argv: list[str], env: dict[str, str],
                 cwd: str, stdout: Any, stderr: Any, text: bool, watch: int | None = None):
        self.args, self.returncode = args, None
        self.stdout = self.stderr = None
        self._lock = threading.Lock()  # one reader of the server's lines at a time
        mine: list[int] = []  # the ends this process keeps closed after handing them over
        ends = [os.open(os.devnull, os.O_RDONLY)]
        mine.append(ends[0])
        for which, target in (("stdout", stdout), ("stderr", stderr)):
            if target == subprocess.PIPE:
                r, w = os.pipe()
                setattr(self, which, open(r, "r" if text else "rb"))
                ends.append(w)
                mine.append(w)
            elif target == subprocess.STDOUT:
                ends.append(ends[1])
            elif target is None or target == subprocess.DEVNULL:
                fd = os.dup(1 if which == "stdout" else 2) if target is None else os.open(os.devnull, os.O_WRONLY)
                ends.append(fd)
                mine.append(fd)
            else:  # a file
                ends.append(target.fileno() if hasattr(target, "fileno") else int(target))
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._conn.connect(address(path))
            request = json.dumps({"argv": argv, "code": code, "env": env, "cwd": cwd, "watch": watch}).encode()
            request = len(request).to_bytes(8, "big") + request
            sent = socket.send_fds(self._conn, [request], ends)
            self._conn.sendall(request[sent:])
            self._buf = b""
            pid = self._line(timeout=30)
            if pid is None:
                raise ConnectionError(f"the fork server refused {args}")
            self.pid = int(pid)
        finally:
            for fd in mine:
                os.close(fd)
        self._readers: list[threading.Thread] | None = None
        self._out: dict[str, list] = {}

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line; None when the server is gone (its connection ended)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self._conn.recv(64)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def _status(self, timeout: float | None) -> int:
        """The exit status, once the server reported it (TimeoutExpired until then). A server that died took the
        status with it: then the process's end is watched in /proc, and its status reads 255."""
        line = self._line(timeout)
        if line is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while os.path.exists(f"/proc/{self.pid}"):
                if deadline is not None and time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                time.sleep(0.05)
            line = "255"
        self._conn.close()
        return int(line)

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):  # not while another thread waits
            try:
                if self.returncode is None:
                    self.returncode = self._status(0)
            except subprocess.TimeoutExpired:
                pass
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            if self.returncode is None:
                self.returncode = self._status(None if deadline is None else max(0.0, deadline - time.monotonic()))
        finally:
            self._lock.release()
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        if self._readers is None:
            self._readers = []
            for which in ("stdout", "stderr"):
                stream = getattr(self, which)
                if stream is not None:
                    self._out[which] = []
                    t = threading.Thread(target=lambda s=stream, o=self._out[which]: o.append(s.read()), daemon=True)
                    t.start()
                    self._readers.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        got = {w: (o[0] if o else None) for w, o in self._out.items()}
        return got.get("stdout"), got.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    _shared: "ForkServer | None | bool" = False  # False: not tried yet; None: it failed, start real processes

    def __init__(self, env: dict[str, str]):
        self.env = env
        # an abstract socket ("@" for the leading NUL, which no environment variable can hold) and an unlinked log:
        # a server killed with the session leaves no file behind
        self.path = f"@zb-fork-{os.getpid()}-{os.urandom(6).hex()}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, self.path, str(os.getpid())], env=env, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     start_new_session=True)
        ready = ""
        if select.select([self.proc.stdout], [], [], READY_TIMEOUT)[0]:
            ready = self.proc.stdout.readline()  # an empty line: the server exited (its imports failed)
        if ready.strip() != "ready":
            self.log.seek(0)
            why = self.log.read()[-2000:]  # before close(), which closes the log
            self.close()
            raise RuntimeError(f"the fork server did not start: {why}")

    @classmethod
    def shared(cls, env: dict[str, str]) -> "ForkServer | None":
        if cls._shared is False:
            try:
                cls._shared = cls(env)
                atexit.register(cls._shared.close)
            except (OSError, RuntimeError) as e:
                print(f"forkserver: {e}; engines start as real interpreters", file=sys.stderr)
                cls._shared = None
        return cls._shared or None

    @staticmethod
    def engine_command(args: list[str]) -> bool:
        """args run the engine's command line (`python -m engine.train ...` or a -c script that ends in it), or
        torchrun runs it in its workers."""
        return len(args) >= 3 and args[0] == sys.executable and (
            args[1:3] == ["-m", "engine.train"] or (args[1] == "-c" and "engine.train.cli()" in args[2])
            or through_torchrun(args) is not None)

    def forkable(self, args: list[str], env: dict[str, str]) -> tuple[str | None, list[str]] | None:
        """(code, argv) for a command the server can fork alike, or None (torchrun's included: see torchrun())."""
        if not self.engine_command(args) or through_torchrun(args) is not None or self.proc.poll() is not None:
            return None
        code, argv = child_argv(args)
        if any(env.get(k) != self.env.get(k) for k in {*env, *self.env} if k.startswith(IMPORT_READ)):
            return None  # PYTHONPATH among them: the server's is this checkout
        return code, argv

    def start(self, args: list[str], *, env: dict[str, str], cwd: str, stdout: Any, stderr: Any,
              text: bool) -> Forked | None:
        how = self.forkable(args, env)
        if how is None:
            return None
        return Forked(self.path, args, *how, env, cwd, stdout, stderr, text)

    def torchrun(self, args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]] | None:
        """(args, env) of a torchrun command of the engine whose workers are forked, or None."""
        rewritten = through_torchrun(args)
        if rewritten is None or self.forkable([sys.executable, "-m", "engine.train"], env) is None:
            return None
        return rewritten, {**env, SOCKET_ENV: self.path}

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()
