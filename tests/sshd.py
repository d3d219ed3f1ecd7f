"""A real OpenSSH sshd on loopback for tests: generated host and user keys, a non-root user, a free port.

    with Sshd.start_new() as sshd:
        host = sshd.host_spec("node-a")          # a HostSpec that reaches it (strict known_hosts)
        sshd.drop_connections()                  # kill every connection process: the link drops
        sshd.stop(); sshd.start()                # an outage, then the same server again
        sshd.start(new_host_key=True)            # the server's key changes

Everything runs as root here (and in CI), but OpenSSH delivers channel signals only to non-root sessions and
the console must not need root, so the tests log in as a non-root user (created with useradd if missing).
(Never as root: killing a root login mid-startup left a stale pyenv lock that stalled every later root shell.)
sshd is started with `-D` and killed by PID; the connection processes are found by walking /proc from it.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from procs import free_port

USER = "zbtest"
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def ensure_user(name: str = USER, shell: str = "/bin/sh") -> pwd.struct_passwd:
    """The login user of the SSH tests and labs, created once, with that login shell. Two test workers may ask at
    once on a fresh machine: the first creates it under a lock, the second then finds it (useradd would fail on
    /etc/passwd's lock)."""
    with open("/run/zbtest-user.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held for a useradd at most
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
        subprocess.run(["useradd", "--create-home", "--shell", shell, name], check=True, capture_output=True,
                       timeout=30)
        # useradd leaves the password field "!" (locked); sshd without PAM refuses locked accounts even for keys
        subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True, timeout=30)
        return pwd.getpwnam(name)


def _others_can_run(path: str) -> bool:
    real = Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & 0o001:
        return False
    return all(parent.stat().st_mode & 0o001 for parent in real.parents)


def keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True,
                   capture_output=True, timeout=30)


class Sshd:
    def __init__(self, root: Path, port: int, user: str = USER):
        self.root = root
        self.port = port
        self.user = user
        self.proc: subprocess.Popen | None = None
        self.log_path = root / "sshd.log"
        self.user_key = root / "user_key"
        self.known_hosts = root / "known_hosts"
        self.home = root / "home"  # a directory the non-root user may write (run dirs live here)
        self.extra_config: list[str] = []  # more sshd_config lines, in effect from the next start()

    @classmethod
    def start_new(cls, user: str = USER, shell: str = "/bin/sh") -> "Sshd":
        """A server that lets `user` in (created with that login shell if missing)."""
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        ensure_user(user, shell)
        root = Path(tempfile.mkdtemp(prefix="zb-sshd-"))
        root.chmod(0o755)  # the user reads authorized_keys here
        sshd = cls(root, free_port(), user)
        keygen(sshd.user_key, "console@test")
        (root / "authorized_keys").write_text((root / "user_key.pub").read_text())
        (root / "authorized_keys").chmod(0o644)
        sshd.home.mkdir()
        shutil.chown(sshd.home, sshd.user, sshd.user)
        sshd.start(new_host_key=True)
        return sshd

    def _config(self) -> Path:
        config = self.root / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.root / 'host_key'}",
            f"PidFile {self.root / 'sshd.pid'}", f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
            "StrictModes no",  # the key files live under /tmp, which is world-writable
            "UsePAM no", "PasswordAuthentication no", "KbdInteractiveAuthentication no", "PubkeyAuthentication yes",
            "PermitRootLogin no", f"AllowUsers {self.user}", "MaxSessions 10",
            "LogLevel VERBOSE", "UseDNS no",
            "Subsystem sftp internal-sftp", *self.extra_config, ""]))  # console sync sends files over SFTP
        return config

    def start(self, new_host_key: bool = False) -> None:
        assert self.proc is None or self.proc.poll() is not None, "sshd already running"
        if new_host_key:
            for suffix in ("", ".pub"):
                (self.root / f"host_key{suffix}").unlink(missing_ok=True)
            keygen(self.root / "host_key", "host@test")
        log = open(self.log_path, "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self._config())], stdout=log, stderr=log,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd did not start:\n{self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.05)

    def known_hosts_line(self) -> str:
        algorithm, blob = (self.root / "host_key.pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {algorithm} {blob}\n"

    def trust(self, path: Path | None = None) -> Path:
        """Write the current host key into a known_hosts file (the default one of this fixture)."""
        path = path or self.known_hosts
        path.write_text(self.known_hosts_line())
        return path

    def host_spec(self, name: str, **overrides):
        from console.profile import HostSpec  # the console is what is under test; keep this module standalone

        fields = dict(name=name, transport="ssh", address="127.0.0.1", port=self.port, user=self.user,
                      identity_file=str(self.user_key), known_hosts=str(self.known_hosts), connect_timeout=5.0,
                      workdir=str(self.home))
        fields.update(overrides)
        return HostSpec(**fields)

    def user_python(self) -> str:
        """An interpreter the non-root user may run (this venv's may live under /root)."""
        for candidate in (sys.executable, "/usr/bin/python3", shutil.which("python3") or ""):
            if candidate and _others_can_run(candidate):
                return candidate
        raise RuntimeError("no python3 that a non-root user can run")

    def user_python_env(self) -> tuple[str, dict[str, str]]:
        """An interpreter and environment with which the non-root user runs this venv's packages (torch...).

        This venv's interpreter may sit under /root (pyenv); a system python of the same minor version runs
        the same wheels from the venv's site-packages.
        """
        if _others_can_run(sys.executable):
            return sys.executable, {}
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        system = shutil.which(version, path="/usr/bin:/usr/local/bin:/bin")
        if system is None or not _others_can_run(system):
            raise RuntimeError(f"no {version} that a non-root user can run")
        packages = sysconfig.get_paths()["purelib"]
        return system, {"PYTHONPATH": packages}

    def connection_pids(self) -> list[int]:
        """Every process below the listening sshd: one monitor and one user process per connection, their shells."""
        assert self.proc is not None
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.proc.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                out.append(child)
                todo.append(child)
        return out

    def drop_connections(self) -> int:
        """Kill every connection process (by PID): clients see the link drop; detached processes live on."""
        pids = self.connection_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.drop_connections()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def left_behind(self) -> list[int]:
        """The user's processes that outlived their connection in this server's folder (detached ones: the console's
        engines, store and probe), by working folder or command line."""
        uid, root, out = pwd.getpwnam(self.user).pw_uid, str(self.root), []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                if "Z" in Path(f"/proc/{entry}/status").read_text().split("State:")[1][:4]:
                    continue  # ended, not yet reaped
                cwd = os.readlink(f"/proc/{entry}/cwd")
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError):
                continue
            if cwd.startswith(root) or root in cmd:
                out.append(int(entry))
        return out

    def close(self) -> None:
        """Stop the server and end, by PID, whatever the tests started through it and left running: again until none
        is left (a wrapper may start a child while it is being ended; a kill lands a moment later), for 10 s at most."""
        self.stop()
        deadline = time.monotonic() + 10
        while (pids := self.left_behind()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "Sshd":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
