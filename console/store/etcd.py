"""The etcd store: one member per `store.etcd_hosts` host, run by the console (console/etcd.py starts and stops
them), or `etcd_endpoints` of an etcd run by someone else; the engines reach it with the run's client certificate.

    backend = EtcdStore(profile)          # console/store/__init__.py's store_backend(profile) makes it
    store = backend.host(hosts, on_failed)
    reason = await store.start()          # the members run, a quorum answers, the run's key prefix is empty
    left, said = await store.stop()       # the members this console runs, ended

There is no store process of the run's folder to watch or restart: the members answer for themselves, and their
health (up, leader) is polled for the header every console poll interval.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Sequence

from console import etcd as E
from console.hosts import Hosts
from console.profile import Profile, etcd_endpoint, key_where
from console.store.base import Endpoint, Server, bind_errors
from console.transport import Transport, TransportError
from console.transport import commands as C


class EtcdStore:
    """A replicated etcd: one member per `store.etcd_hosts` host (the console runs them), or `etcd_endpoints` of a
    cluster run by someone else. The engines dial every member with the run's client certificate."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def servers(self) -> list[Server]:
        if not self.profile.store.etcd_hosts:
            return []  # etcd_endpoints: a cluster the console does not run
        return [Server(m.host, "etcd", (Endpoint(m.address, m.client_port, f"etcd member {m.name} (clients)"),
                                        Endpoint(m.address, m.peer_port, f"etcd member {m.name} (peers)")))
                for m in E.plan_members(self.profile)]

    def links(self) -> list[Endpoint]:
        return [Endpoint(*etcd_endpoint(ep), "etcd") for ep in E.endpoints(self.profile)]

    async def runs(self, transport_of: Callable[[str], Transport]) -> bool:
        return False  # the members are not one process of the run's folder: the check binds no port of theirs

    def engine_overrides(self, node: str) -> dict[str, str]:
        return E.engine_store_overrides(self.profile, node)

    def header_address(self) -> str | None:
        return None  # the header shows the members' health instead (fleet.store_status)

    def open_listener(self) -> str | None:
        return None  # the members take only clients with the run's certificate

    async def client_files_unreadable(self, transport_of: Callable[[str], Transport],
                                      hosts: Sequence[str]) -> list[str]:
        """etcd_endpoints: the client certificate files the console and each engine host need (the members the
        console runs get theirs from it at start)."""
        if not self.profile.store.etcd_endpoints:
            return []
        return await E.tls_unreadable(self.profile, transport_of, hosts)

    def host(self, hosts: Hosts, on_failed: Callable[[str], None]) -> EtcdStoreHost:
        return EtcdStoreHost(hosts)


class EtcdStoreHost:
    """The etcd members during a session: started (when the console runs them) and polled for the header."""

    def __init__(self, hosts: Hosts):
        self.hosts = hosts
        self.fleet = hosts.fleet
        self.error: str | None = None  # the members answer for themselves: a start that fails says so at once
        self.health_task: asyncio.Task | None = None
        # the etcd members this console runs (etcd_hosts), else None (etcd_endpoints: someone else's)
        self.etcd = E.cluster_of(hosts.profile, hosts.transport, E.pki_root(hosts.profile))

    @property
    def profile(self) -> Profile:
        return self.hosts.profile

    async def attach(self, *, steer: bool, engines_running: bool) -> None:
        self.watch_health()  # the members answer for themselves: only their health is followed

    async def end_stale(self) -> str | None:
        """The members this console runs, left by an earlier run: ended (the start checks their ports before it
        starts them again)."""
        if self.etcd is not None:
            await self.etcd.stop()
        return None

    async def unstartable(self, hosts: Sequence[str]) -> list[str]:
        """Members this console runs: every member's ports are free and its binary runs on its host. An etcd that
        runs already: the client certificate files are readable here (the console probes etcd with them) and on
        each host in `hosts` (its engine). One `FILE:LINE: KEY: ...` line each; [] when nothing was found."""
        try:
            if not self.profile.store.etcd_hosts:
                return await E.tls_unreadable(self.profile, self.hosts.transport, hosts)
            members = E.plan_members(self.profile)
            binds = [(m.host, m.address, port, key, f"etcd member {m.name}" + (f" ({key} + {2 * i})" if i else ""))
                     for i, m in enumerate(members)
                     for port, key in ((m.client_port, "etcd_client_port"), (m.peer_port, "etcd_peer_port"))]
            names = list(dict.fromkeys(m.host for m in members))
            found = await asyncio.gather(*(bind_errors(self.hosts, host, [(a, p, k, n) for h, a, p, k, n in binds
                                                                         if h == host]) for host in names),
                                         *(self._etcd_missing(host) for host in names))
            return [line for lines in found for line in lines]
        except TransportError as e:  # the host does not answer: nothing of the run can start there
            at = key_where(self.profile, ("store", "backend"), ("store",))
            return [f"{at}: the store's host cannot be asked before the start: {e}"]

    async def _etcd_missing(self, name: str) -> list[str]:
        """The etcd binary runs on member host `name` (its workdir's PATH, as the member will start there)."""
        binary, host = self.profile.store.etcd_binary, self.profile.hosts[name]
        rc, _, _ = await self.hosts.transport(name).run(f"cd {C.qpath(host.workdir)} 2>/dev/null; "
                                                        f"command -v {C.qpath(binary)} >/dev/null")
        if rc == 0:
            return []
        at = key_where(self.profile, ("store", "etcd_binary"), ("store", "etcd_hosts"))
        return [f"{at}: {binary} is not found on {name} (an etcd member runs there; Debian: apt install etcd-server, "
                f"or set store.etcd_binary to its path)"]

    async def start(self) -> str | None:
        reason = await E.prepare(self.profile, self.etcd)
        self.watch_health()
        return reason

    async def ensure(self, engines_running: Callable[[], Awaitable[bool]]) -> tuple[bool, str | None]:
        return False, None  # the members answer for themselves: a node dials them as they are

    async def prepare_node(self, name: str) -> None:
        """The run's client certificate, mode 0600, in the node's folder (members this console runs)."""
        if self.etcd is not None:
            await self.etcd.hand_client_certs(name, E.client_pki_dir(self.profile, name))

    async def refresh(self) -> None:
        if self.fleet.store_status is None:  # not polled yet: ask once
            self.fleet.store_status = await E.health_label(self.profile)

    def watch_health(self) -> None:
        """Poll the members (up, leader) for the header, every console poll interval."""
        if self.health_task is not None:
            return

        async def poll() -> None:
            while True:
                self.fleet.store_status = await E.health_label(self.profile)
                await asyncio.sleep(max(1.0, self.profile.console.poll_interval))
        self.health_task = asyncio.ensure_future(poll())

    async def runs(self) -> bool:
        """Whether a member this console runs runs; a host that cannot be asked may run one (True)."""
        try:
            return self.etcd is not None and bool(await self.etcd.running())
        except TransportError:
            return True

    async def mark_stopped(self) -> None:
        return None  # no store process that another console would restart

    async def run_stopped(self) -> bool:
        return False  # only the TCP store's folder records a stop

    async def stop(self) -> tuple[list[str], list[str]]:
        """The members this console runs, ended; what etcd had to say."""
        return [], (await self.etcd.stop() if self.etcd is not None else [])

    def tasks(self) -> list[asyncio.Task]:
        return [self.health_task] if self.health_task is not None else []
