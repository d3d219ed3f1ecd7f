"""The store's backend as the console's checks see it: one interface, an implementation per `store.backend`.

    backend = store_backend(profile)     # the one place that reads store.backend here: TcpStore or EtcdStore
    backend.servers()                    # what the console runs for it, by host, and the ports each must bind
    backend.links()                      # what every engine host must be able to dial before a start
    await backend.runs(transport_of)     # whether the console's own store process runs now (a check leaves it be)

TCP: one `python -m engine.store.server` on the store host (console/store_host.py starts it). etcd: one member per
`store.etcd_hosts` host (console/etcd.py), or none where the profile gives `etcd_endpoints` of a cluster run by
someone else. console/preflight/runner.py asks this; the start and the watch (store_host.py, etcd.py, cluster.py)
still branch on `store.backend` themselves.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

from console import etcd as E
from console.hosts import STORE
from console.profile import Profile, etcd_endpoint
from console.transport import Transport, TransportError
from console.transport import commands as C


class Endpoint(NamedTuple):
    address: str
    port: int
    what: str  # "the store", "etcd member node-a (clients)"...


@dataclass(frozen=True)
class Server:
    """A process the console runs for the store on `host`: role "store" (TCP) or "etcd" (a member)."""

    host: str
    role: str
    binds: tuple[Endpoint, ...]


class StoreBackend(Protocol):
    def servers(self) -> list[Server]: ...

    def links(self) -> list[Endpoint]: ...

    async def runs(self, transport_of: Callable[[str], Transport]) -> bool: ...


class TcpStore:
    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    def servers(self) -> list[Server]:
        p = self.profile
        return [Server(p.store_host.name, "store", (Endpoint(self.bind(), p.store.port, "the store"),))]

    def links(self) -> list[Endpoint]:
        return [Endpoint(self.profile.store_address, self.profile.store.port, "the store")]

    async def runs(self, transport_of: Callable[[str], Transport]) -> bool:
        """Whether this profile's store runs now (its pid file names a live process of ours)."""
        p = self.profile
        t = transport_of(p.store_host.name)
        try:
            text = await asyncio.wait_for(t.read_text(C.join(p.run.dir, STORE, C.PID)),
                                          p.store_host.connect_timeout * 2 + 1)
            pid = int(text.strip()) if text and text.strip().isdigit() else None
            return pid is not None and pid > 1 and await t.alive(pid, C.TAG)
        except (TransportError, asyncio.TimeoutError):
            return False

    def bind(self) -> str:
        """What the store will listen on (console/store_host.py bind()): an ssh_config alias's HostName may not be
        an address of the host itself, and then the store listens on every interface."""
        p = self.profile
        host = p.store_host
        if p.store.bind or p.store.address or host.address or host.transport == "local":
            return p.store_bind
        return "0.0.0.0"


class EtcdStore:
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


def store_backend(profile: Profile) -> StoreBackend:
    return EtcdStore(profile) if profile.store.backend == "etcd" else TcpStore(profile)
