"""An OpenSSH sshd in each namespace, the ssh_config and known_hosts that reach them, and the console profile.

Like tests/sshd.py (whose user and key helpers this reuses): the engines run as a non-root user, host keys are
generated per host and checked strictly (known_hosts lists each host's key under its alias and its address),
and sshd runs with -D so it is ended by pid.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from lab.net import NetHost
from sshd import SSHD, USER, _others_can_run, ensure_user, keygen

SSH_PORT = 22
SSHD_START_S = 15.0


class HostSshd:
    """sshd inside one namespace, listening on the host's address."""

    def __init__(self, host: NetHost, root: Path, user_key: Path):
        self.host, self.root, self.user_key = host, root / f"sshd-{host.name}", user_key
        self.proc: subprocess.Popen | None = None

    @property
    def alias(self) -> str:
        return self.host.netns  # "zbc-a": the Host entry of ssh_config

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)
        keygen(self.root / "host_key", f"host@{self.alias}")
        config = self.root / "sshd_config"
        config.write_text("\n".join([
            f"Port {SSH_PORT}", f"ListenAddress {self.host.address}", f"HostKey {self.root / 'host_key'}",
            f"PidFile {self.root / 'sshd.pid'}", f"AuthorizedKeysFile {self.user_key}.pub",
            "StrictModes no", "UsePAM no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes", "PermitRootLogin no", f"AllowUsers {USER}", "MaxSessions 10",
            "MaxStartups 50", "LogLevel INFO", "UseDNS no",
            "Subsystem sftp internal-sftp", ""]))  # console sync sends files over SFTP
        log = open(self.root / "sshd.log", "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen(self.host.exec_args(SSHD, "-D", "-e", "-f", str(config)), stdout=log,
                                     stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + SSHD_START_S
        while True:  # the bridge routes the root namespace to it: the console's view
            try:
                socket.create_connection((self.host.address, SSH_PORT), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    text = (self.root / "sshd.log").read_text()[-1500:]
                    raise RuntimeError(f"sshd in {self.host.netns} did not start:\n{text}") from None
                time.sleep(0.05)

    def known_hosts_line(self) -> str:
        algorithm, blob = (self.root / "host_key.pub").read_text().split()[:2]
        return f"{self.alias},{self.host.address} {algorithm} {blob}\n"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=10)


def user_python_env() -> tuple[str, dict[str, str]]:
    """An interpreter the non-root user may run with this venv's packages (see tests/sshd.py)."""
    if _others_can_run(sys.executable):
        return sys.executable, {}
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/bin:/usr/local/bin:/bin")
    if system is None or not _others_can_run(system):
        raise RuntimeError(f"no {version} that the user {USER} can run")
    return system, {"PYTHONPATH": os.pathsep.join(site_dirs())}


def site_dirs() -> list[str]:
    """This venv's site-packages and the folders its .pth files add (a worktree's venv that sees another venv's
    packages through a .pth line): PYTHONPATH reads no .pth file, so each must be named."""
    purelib = Path(sysconfig.get_paths()["purelib"])
    dirs = [str(purelib)]
    for pth in sorted(purelib.glob("*.pth")):
        for line in pth.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ")) and Path(line).is_dir() and line not in dirs:
                dirs.append(line)
    return dirs


def prepare_user(root: Path) -> Path:
    """The login user, its key (public half readable by sshd as authorized_keys), and a run dir it owns."""
    ensure_user()
    os.makedirs("/run/sshd", exist_ok=True)
    key = root / "user_key"
    keygen(key, "console@chaos")
    (root / "user_key.pub").chmod(0o644)
    runs = root / "runs"
    runs.mkdir()
    shutil.chown(runs, USER, USER)
    return key


def write_ssh_config(path: Path, sshds: list[HostSshd], user_key: Path, known_hosts: Path) -> None:
    blocks = [f"Host {s.alias}\n  HostName {s.host.address}\n  Port {SSH_PORT}\n  User {USER}\n"
              f"  IdentityFile {user_key}\n  UserKnownHostsFile {known_hosts}\n  StrictHostKeyChecking yes\n"
              for s in sshds]
    path.write_text("\n".join(blocks))


PROFILE = """\
# written by the chaos lab (tests/lab): {n} engine hosts and a store host, each a network namespace with sshd
[run]
name = "chaos"
dir = "{run_dir}"

[store]
host = "store"
address = "{store_address}"   # set explicitly: the engines dial the store host's namespace address
bind = "{store_address}"
port = {store_port}

[engine]
config = "configs/debug-diloco.toml"

[engine.overrides]
{overrides}

[console]
poll_interval = 1.0
stop_timeout = 30.0

[defaults]
transport = "ssh"
ssh_config = "{ssh_config}"
known_hosts = "{known_hosts}"
connect_timeout = 5.0
python = "{python}"
workdir = "{workdir}"
env = {{ OMP_NUM_THREADS = "1"{env} }}

{hosts}
"""


def toml_scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_profile(path: Path, *, engines: list[HostSshd], store: HostSshd, run_dir: Path, store_port: int,
                  overrides: dict[str, object], ssh_config: Path, known_hosts: Path, workdir: Path) -> None:
    python, env = user_python_env()
    hosts = [f'[hosts.{s.host.name}]\nssh_alias = "{s.alias}"\n' for s in engines]
    # the store's host: standby, so nothing but the store is ever started there
    hosts.append(f'[hosts.store]\nssh_alias = "{store.alias}"\nstandby = true\n')
    path.write_text(PROFILE.format(
        n=len(engines), run_dir=run_dir, store_address=store.host.address, store_port=store_port,
        overrides="\n".join(f'"{k}" = {toml_scalar(v)}' for k, v in overrides.items()), ssh_config=ssh_config,
        known_hosts=known_hosts, python=python, workdir=workdir,
        env="".join(f', {k} = "{v}"' for k, v in env.items()), hosts="\n".join(hosts)))
