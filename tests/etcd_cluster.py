"""A real 3-member etcd cluster on loopback ports for tests: Debian's `etcd` binary (scripts/setup.sh installs
etcd-server), the run's PKI from console/etcd_pki.py, argv from console/etcd.py, each member its own process group.

    with EtcdTestCluster(tmp_path) as etcd:
        etcd.endpoints, etcd.tls            # what an EtcdStore needs
        etcd.kill("m1"); etcd.restart("m1") # SIGKILL a member and bring it back on its data dir
        etcd.leader()                       # the member name the cluster reports as leader
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from console.etcd import Member, member_argv
from console.etcd_pki import make_pki
from engine.store.etcd_gateway import Tls, cluster_health
from procs import free_ports

ETCD = "etcd"
HEARTBEAT_MS, ELECTION_MS = 100, 1000  # etcd's defaults: a leader's loss costs about one election timeout


class EtcdTestCluster:
    def __init__(self, folder: Path, size: int = 3) -> None:
        self.folder = folder
        ports = free_ports(2 * size)
        self.members = [Member(f"m{i}", "local", "127.0.0.1", ports[2 * i], ports[2 * i + 1]) for i in range(size)]
        self.pki = make_pki(folder / "pki", ["127.0.0.1"], run="test")
        self.tls = Tls(str(self.pki.path("ca.crt")), str(self.pki.path("client.crt")),
                       str(self.pki.path("client.key")))
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def start_member(self, m: Member) -> None:
        data = self.folder / m.name
        argv = member_argv(ETCD, m, self.members, data_dir=str(data / "data"), pki_dir=str(self.pki.folder),
                           token="test", heartbeat_ms=HEARTBEAT_MS, election_ms=ELECTION_MS)
        data.mkdir(parents=True, exist_ok=True)
        with open(data / "etcd.log", "ab") as log:
            self.procs[m.name] = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                                  start_new_session=True)

    def start(self, timeout: float = 60.0) -> "EtcdTestCluster":
        for m in self.members:
            self.start_member(m)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 60.0, up: int | None = None) -> None:
        want = len(self.members) if up is None else up
        deadline = time.monotonic() + timeout
        while True:
            health = cluster_health(self.endpoints, self.tls, timeout=1.0)
            if health.up >= want and health.leader:
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None and up is None:
                    log = (self.folder / name / "etcd.log").read_text()[-2000:]
                    raise AssertionError(f"etcd member {name} exited {proc.returncode}:\n{log}")
            assert time.monotonic() < deadline, f"etcd not healthy within {timeout}s: {health}"
            time.sleep(0.2)

    def leader(self) -> str | None:
        return cluster_health(self.endpoints, self.tls, timeout=1.0).leader

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        self.start_member(self.member(name))

    def stop(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def __enter__(self) -> "EtcdTestCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
