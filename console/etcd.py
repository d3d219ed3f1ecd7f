"""The etcd backend's cluster, as the console runs it: three etcd members on three profile hosts, TLS everywhere.

    members = plan_members(profile)                      # [Member(name, host, address, client_port, peer_port)]
    argv = member_argv(profile.store, m, members, data_dir=..., pki_dir=..., token=run)   # pure, tested
    etcd = EtcdCluster(profile, transport_of)            # start(), stop(), health(), upload of the certificates

Each member is started detached like an engine (transport/commands.py: setsid + nohup, pid file, outlives the
console) with its folder RUN_DIR/_etcd/NAME/ on its host: data/ (the Raft log and snapshots), pki/ (mode 0700:
ca.crt, member.crt, member.key, 0600 each), events.jsonl and engine.log (etcd's own log, on stderr). Engines get
ca.crt, client.crt and client.key in RUN_DIR/NODE/pki/ (0600) and dial every member's client URL over https with
that client certificate; a member refuses a client without one (--client-cert-auth) and a peer without one
(--peer-client-cert-auth). The CA's key stays in the console's own folder for the run.

Every value reaches the remote shell through transport/commands.py (shlex.quote); certificates travel on the
channel's stdin, never in a command line.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from console.etcd_pki import Pki, fits, make_pki
from console.profile import dial_address, key_where
from console.transport import TransportError
from console.transport import commands as C
from engine.errors import first_line

ETCD_DIR = "_etcd"  # the members' folders under the run dir
PKI_DIR = "pki"
MEMBER_FILES = ("ca.crt", "member.crt", "member.key")
CLIENT_FILES = ("ca.crt", "client.crt", "client.key")


@dataclass(frozen=True)
class Member:
    name: str  # the etcd member name: the profile host's name
    host: str  # the profile host that runs it
    address: str  # what the engines and the other members dial
    client_port: int
    peer_port: int

    @property
    def client_url(self) -> str:
        return f"https://{self.address}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"https://{self.address}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.client_port}"


MAX_TXN_OPS = 4096  # ranges in one txn: a run of up to this many nodes reads every heartbeat in one round trip


def initial_cluster(members: Sequence[Member]) -> str:
    return ",".join(f"{m.name}={m.peer_url}" for m in members)


def member_argv(binary: str, member: Member, members: Sequence[Member], *, data_dir: str, pki_dir: str,
                token: str, heartbeat_ms: int = 100, election_ms: int = 1000) -> list[str]:
    """`etcd ...` for one member of a new cluster with mutual TLS on both the client and the peer port. It listens
    only on its own address (never every interface): whoever reaches etcd with a certificate can steer the run."""
    pki = pki_dir.rstrip("/")
    tls = {
        "--cert-file": f"{pki}/member.crt", "--key-file": f"{pki}/member.key", "--trusted-ca-file": f"{pki}/ca.crt",
        "--peer-cert-file": f"{pki}/member.crt", "--peer-key-file": f"{pki}/member.key",
        "--peer-trusted-ca-file": f"{pki}/ca.crt",
    }
    return [binary, "--name", member.name, "--data-dir", data_dir,
            "--listen-client-urls", member.client_url, "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url, "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", initial_cluster(members), "--initial-cluster-token", token,
            # "new" on the first start; a restarted member finds its data dir and ignores the initial flags
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(heartbeat_ms), "--election-timeout", str(election_ms),
            "--client-cert-auth", "--peer-client-cert-auth",
            # the mesh's heartbeat and planner read one key per node in one txn (etcd's default cap: 128 ops)
            "--max-txn-ops", str(MAX_TXN_OPS),
            *(w for pair in tls.items() for w in pair),
            "--logger", "zap", "--log-outputs", "stderr"]


def write_private_command(folder: str, name: str, workdir: str = ".") -> str:
    """A command that writes its stdin to folder/name (mode 0600; folder mode 0700): a file's content never
    appears in a command line."""
    if "/" in name or not name or name.startswith("."):
        raise ValueError(f"write_private_command: bad file name {name!r}")
    path = C.qpath(C.join(folder, name))
    return (f"cd {C.qpath(workdir)} && umask 077 && mkdir -p {C.qpath(folder)} && chmod 700 {C.qpath(folder)}"
            f" && rm -f {path} && cat > {path}")


class EtcdCluster:
    """Start, stop and probe the run's etcd members through the console's transports (one per profile host)."""

    def __init__(self, *, binary: str, members: Sequence[Member], run_dir: str, pki: Pki, token: str,
                 transport: Callable[[str], Any], heartbeat_ms: int = 100, election_ms: int = 1000) -> None:
        self.binary = binary
        self.members = list(members)
        self.run_dir = run_dir
        self.pki = pki
        self.token = token
        self.transport = transport
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.pids: dict[str, int] = {}

    def member_dir(self, member: Member) -> str:
        return C.join(self.run_dir, ETCD_DIR, member.name)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    async def upload(self, host: str, folder: str, files: dict[str, bytes]) -> None:
        t = self.transport(host)
        for name, data in files.items():
            rc, _, err = await t.run(write_private_command(folder, name, t.workdir), stdin=data)
            if rc != 0:
                raise TransportError(f"could not write {folder}/{name} on {host}: {err.strip() or f'status {rc}'}")

    async def start_member(self, member: Member) -> int:
        folder = self.member_dir(member)
        await self.upload(member.host, C.join(folder, PKI_DIR), self.pki.member_files())
        argv = member_argv(self.binary, member, self.members, data_dir=C.join(folder, "data"),
                           pki_dir=C.join(folder, PKI_DIR), token=self.token, heartbeat_ms=self.heartbeat_ms,
                           election_ms=self.election_ms)
        pid = await self.transport(member.host).start_detached(argv, folder, append=True)
        self.pids[member.name] = pid
        return pid

    def renew(self, run: str, margin_days: float = 30.0) -> None:
        """Before a start (every member is started anew, every engine handed a client certificate after it): a
        PKI that would expire within margin_days, or does not name every member's address, is made anew. Not on
        an attach: members that run trust the CA they were started with."""
        addresses = [m.address for m in self.members]
        if not fits(self.pki, addresses, margin_days=margin_days):
            self.pki = make_pki(self.pki.folder, addresses, run=run)

    async def start(self) -> None:
        """Start every member at once (a new cluster waits for a quorum of its members to come up)."""
        await asyncio.gather(*(self.start_member(m) for m in self.members))

    async def stop(self, timeout: float = 10.0) -> list[str]:
        """TERM every member's process group (etcd flushes and exits), KILL what outlives `timeout`. Returns what
        could not be done ("node-b: <why>"), empty when every member is down."""
        async def one(member: Member) -> str | None:
            t = self.transport(member.host)
            try:
                text = await t.read_text(C.join(self.member_dir(member), C.PID))
                if not (text and text.strip().isdigit() and await t.alive(int(text), C.TAG)):
                    return None
                pid = int(text)
                await t.signal(pid, "TERM")
                # the whole group: TERM ends the wrapper shell at once, while etcd may still hold its ports for a
                # moment (the next start's check then found them taken)
                for _ in range(int(timeout / 0.1)):
                    if not await t.group_alive(pid):
                        return None
                    await asyncio.sleep(0.1)
                await t.signal(pid, "KILL")
                for _ in range(50):
                    if not await t.group_alive(pid):
                        return None
                    await asyncio.sleep(0.1)
            except TransportError as e:
                return f"{member.name}: {e}"
            return None
        results = await asyncio.gather(*(one(m) for m in self.members))
        return [r for r in results if r]

    async def running(self) -> list[str]:
        """The members whose pid file names a live process (TransportError when a host cannot be asked)."""
        async def one(member: Member) -> bool:
            t = self.transport(member.host)
            text = await t.read_text(C.join(self.member_dir(member), C.PID))
            return bool(text and text.strip().isdigit() and await t.alive(int(text), C.TAG))
        alive = await asyncio.gather(*(one(m) for m in self.members))
        return [m.name for m, up in zip(self.members, alive) if up]

    async def exited(self) -> list[str]:
        """"member NAME exited: LAST LOG LINE" for each member started here that no longer runs."""
        out = []
        for member in self.members:
            pid = self.pids.get(member.name)
            t = self.transport(member.host)
            if pid is None or await t.alive(pid, C.TAG):
                continue
            log = (await t.last_lines(C.join(self.member_dir(member), C.LOG), 1)).strip()
            out.append(f"member {member.name} exited: {log or 'no output'}")
        return out

    async def hand_client_certs(self, host: str, folder: str) -> None:
        missing = no_ca(self.pki)
        if missing:
            raise TransportError(missing)
        await self.upload(host, folder, self.pki.client_files())


def pki_paths(folder: str) -> dict[str, str]:
    """The engine's mesh.etcd_ca / etcd_cert / etcd_key for the client files in folder."""
    return {"mesh.etcd_ca": C.join(folder, "ca.crt"), "mesh.etcd_cert": C.join(folder, "client.crt"),
            "mesh.etcd_key": C.join(folder, "client.key")}


def pki_root(profile: Any) -> Path:
    """Where the console keeps each run's CA, beside the profile (the CA key never leaves this machine)."""
    return Path(profile.path).resolve().parent / ".zeroband-pki"


# ---- the profile's [store] on the etcd backend -----------------------------------------------------------------
def run_prefix(profile: Any) -> str:
    return profile.store.etcd_prefix or f"zeroband/{profile.run.name}/"


def plan_members(profile: Any) -> list[Member]:
    """One member per etcd host, named after it; member i on client_port + 2i and peer_port + 2i, so several
    members can share one machine (a local profile) and a machine's two ports never collide."""
    s = profile.store
    out = []
    for i, name in enumerate(s.etcd_hosts):
        host = profile.hosts[name]
        out.append(Member(name, name, dial_address(host), s.etcd_client_port + 2 * i, s.etcd_peer_port + 2 * i))
    return out


def endpoints(profile: Any) -> list[str]:
    return list(profile.store.etcd_endpoints) or [m.endpoint for m in plan_members(profile)]


def client_pki_dir(profile: Any, node: str) -> str:
    """Where a node's client certificate goes on its host: its own folder, mode 0700."""
    return C.join(profile.run.dir, node, PKI_DIR)


def engine_store_overrides(profile: Any, node: str) -> dict[str, str]:
    """The engine's mesh.* keys for the profile's etcd (console/store/etcd.py's EtcdStore.engine_overrides)."""
    s = profile.store
    if s.etcd_endpoints:
        files = {"mesh.etcd_ca": s.etcd_ca, "mesh.etcd_cert": s.etcd_cert, "mesh.etcd_key": s.etcd_key}
    else:
        files = pki_paths(client_pki_dir(profile, node))
    return {"mesh.store_backend": "etcd", "mesh.etcd_endpoints": ",".join(endpoints(profile)),
            "mesh.etcd_prefix": run_prefix(profile), **files}


async def prepare(profile: Any, etcd: EtcdCluster | None, timeout: float = 60.0) -> str | None:
    """Before the engines start: the run's etcd members run (started here when the console runs them), a quorum
    answers, and the run's key prefix is empty (a TCPStore would be a new process: the same clean slate, resume
    or not). The reason when that cannot be had: a member that exits at start says so at once."""
    from engine.store.etcd_gateway import cluster_health

    eps, tls = endpoints(profile), client_tls(profile, pki_root(profile))
    kind = "could not start" if etcd is not None else "is not usable"
    try:
        if etcd is not None:
            left = await etcd.stop()  # members left by an earlier console: their ports must be free
            if left:
                return f"etcd {kind}: could not end an earlier member ({left[0]})"
            etcd.renew(profile.run.name)  # a run that starts now gets certificates that outlast it
            await etcd.start()
        deadline = time.monotonic() + timeout
        while True:
            health = await asyncio.to_thread(cluster_health, eps, tls, 2.0)
            if health.leader and health.up > health.total // 2:
                break
            exited = await etcd.exited() if etcd is not None else []
            if exited:
                return f"etcd {kind}: {exited[0]}"
            if time.monotonic() > deadline:
                return f"etcd {kind}: no quorum within {timeout:g}s ({health.label()}; {health.reason or 'no answer'})"
            await asyncio.sleep(0.5)
        await asyncio.to_thread(_clear, eps, tls, run_prefix(profile), timeout)
    except (TransportError, RuntimeError, OSError) as e:  # EtcdError is a RuntimeError
        return f"etcd {kind}: {first_line(e)}"
    return None


async def tls_unreadable(profile: Any, transport: Callable[[str], Any], hosts: Sequence[str]) -> list[str]:
    """etcd_endpoints (an etcd that runs already): the files of etcd_ca, etcd_cert and etcd_key are readable here
    (the console probes etcd with them) and on each of hosts (its engine dials etcd with them); a `FILE:LINE: KEY`
    line per file that is not, naming where. Asked before a start moves or starts anything, and by `check`."""
    s = profile.store
    files = [(key, path) for key, path in (("etcd_ca", s.etcd_ca), ("etcd_cert", s.etcd_cert),
                                            ("etcd_key", s.etcd_key)) if path]
    here = {k for k, p in files if not (os.path.isfile(os.path.expanduser(p)) and
                                       os.access(os.path.expanduser(p), os.R_OK))}

    async def missing_on(name: str) -> set[str]:
        host = profile.hosts[name]
        if host.transport == "local" and all(os.path.isabs(os.path.expanduser(p)) for _, p in files):
            return set()  # the files this machine has (or has not): said once, as this machine's
        tests = "; ".join(f"test -f {C.qpath(p)} -a -r {C.qpath(p)} || echo {C.q(k)}" for k, p in files)
        try:  # no workdir, no answer: the node's own start says so, and the other nodes go on
            _, out, _ = await transport(name).run(f"cd {C.qpath(host.workdir)} 2>/dev/null || exit 0; {tests}")
        except TransportError:
            return set()
        return set(out.split())
    found = dict(zip(hosts, await asyncio.gather(*(missing_on(n) for n in hosts))))
    lines = []
    for key, path in files:
        on_hosts = [name for name, missing in found.items() if key in missing]
        places = (["this machine (the console reaches etcd with it)"] if key in here else []) + on_hosts
        if places:
            relative = " (relative paths are from each host's workdir)" if on_hosts else ""
            lines.append(f"{key_where(profile, ('store', key), ('store',))}: {path} is not a readable file on "
                         f"{', '.join(places)}{relative}")
    return lines


def _clear(eps: Sequence[str], tls: Any, prefix: str, timeout: float) -> None:
    from engine.store.etcd_gateway import Gateway, b64, range_end

    gw = Gateway(eps, tls=tls, timeout=timeout)
    try:
        gw.call("kv/deleterange", {"key": b64(prefix), "range_end": range_end(prefix)})
    finally:
        gw.close()


async def health_label(profile: Any) -> str:
    """The header's store cell: "etcd 3/3 up, leader node-a" (a probe of every member, 2 s at most each)."""
    from engine.store.etcd_gateway import cluster_health

    if profile.store.etcd_hosts and not profile.store.etcd_endpoints:
        missing = no_ca(Pki(pki_root(profile) / profile.run.name))
        if missing:
            return f"etcd: {missing}"
    health = await asyncio.to_thread(cluster_health, endpoints(profile), client_tls(profile, pki_root(profile)), 2.0)
    return health.label()


def cluster_of(profile: Any, transport: Callable[[str], Any], pki_root: Path) -> EtcdCluster | None:
    """The members the console runs for this profile's etcd (None: an etcd the console does not run; asked by
    console/store/etcd.py only). The run's CA is made once, in pki_root/<run>/, and kept: members that outlive the
    console still trust it on --attach."""
    s = profile.store
    if not s.etcd_hosts:
        return None
    members = plan_members(profile)
    # made or renewed by a start only (EtcdCluster.renew): an attach, a status or a second console with a copy of
    # the profile must not make a CA of its own, which the running members would refuse
    pki = Pki(pki_root / profile.run.name)
    return EtcdCluster(binary=s.etcd_binary, members=members, run_dir=profile.run.dir, pki=pki,
                       token=f"zeroband-{profile.run.name}", transport=transport)


def no_ca(pki: Pki) -> str | None:
    """Why this console has no certificates for a run it did not start here (None when it has them)."""
    if (pki.folder / "client.key").is_file():
        return None
    return (f"no CA for run {pki.folder.name} beside this profile ({pki.folder}): copy that folder from the console "
            "that started the run")


def client_tls(profile: Any, pki_root: Path) -> Any:
    """The console's own TLS files for health probes (the run's client certificate)."""
    from engine.store.etcd_gateway import Tls

    s = profile.store
    if s.etcd_endpoints:
        return Tls(s.etcd_ca, s.etcd_cert, s.etcd_key) if s.etcd_ca else None
    folder = pki_root / profile.run.name
    return Tls(str(folder / "ca.crt"), str(folder / "client.crt"), str(folder / "client.key"))
