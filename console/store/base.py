"""The store's backend, the interface: what the console runs for the store, and how it starts, watches and stops it.

Two implementations (console/store/tcp.py, console/store/etcd.py); `store_backend(profile)` in console/store/
picks one, the only place that reads `store.backend`. Two faces:

    StoreBackend   the store as the profile says it (the preflight's plans, the engines' command lines): pure
    StoreHost      the store's life on its hosts during a session (start, attach, watch, stop): I/O, one per Cluster
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, NamedTuple, Protocol, Sequence

from console.hosts import Hosts
from console.profile import key_where
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


class StoreHost(Protocol):
    """The store during a session: console/cluster.py and its parts drive it; each implementation owns its state."""

    # why the store died before it was ever ready (a node started after that fails too); None while it is fine
    error: str | None

    async def attach(self, *, steer: bool, engines_running: bool) -> None:
        """A console that comes back: find the store; steer: watch it and bring it back if it dies."""

    async def end_stale(self) -> str | None:
        """Before a fresh start: end what an earlier run of this profile left running; why the start must not go
        on (another profile's store in this run dir), else None."""

    async def unstartable(self, hosts: Sequence[str]) -> list[str]:
        """What would make the store fail once started, one `FILE:LINE: KEY: ...` line each ([] when nothing)."""

    async def start(self) -> str | None:
        """Start the store (and watch it); the reason if it could not start."""

    async def ensure(self, engines_running: Callable[[], Awaitable[bool]]) -> tuple[bool, str | None]:
        """Before a node starts alone (restart, add): the store it dials runs. (whether a store was started now,
        None or why the node must not start)"""

    async def prepare_node(self, name: str) -> None:
        """What a node's folder needs from the store before its engine starts (TransportError if its host fails)."""

    async def refresh(self) -> None:
        """Once, for a one-shot `status`: the store's latest figures for the header."""

    async def runs(self) -> bool:
        """Whether anything of the run's store runs (a host that cannot be asked may run it: True)."""

    async def mark_stopped(self) -> None:
        """The run's stop, said where another console watching the run reads it."""

    async def run_stopped(self) -> bool:
        """Whether a stop (this console's or another's) ended the run."""

    async def stop(self) -> tuple[list[str], list[str]]:
        """End what the console runs for the store, waited for: (what may still run, what the store had to say)."""

    def tasks(self) -> list[asyncio.Task]:
        """The watchers this store runs (close() cancels them)."""


class StoreBackend(Protocol):
    """The store as the profile says it: the processes the console runs for it, what the engines dial."""

    def servers(self) -> list[Server]:
        """What the console runs for it, by host, and the ports each must bind."""

    def links(self) -> list[Endpoint]:
        """What every engine host must be able to dial before a start."""

    async def runs(self, transport_of: Callable[[str], Transport]) -> bool:
        """Whether the console's own store process runs now (a check leaves it be)."""

    def engine_overrides(self, node: str) -> dict[str, str]:
        """The engine's mesh.* keys for this store on node `node`'s command line."""

    def header_address(self) -> str | None:
        """What the header shows as the store's address (None: the store's health line says it all)."""

    def open_listener(self) -> str | None:
        """The address of a listener of the store that takes anyone (no certificate), for the exposure warning."""

    async def client_files_unreadable(self, transport_of: Callable[[str], Transport],
                                      hosts: Sequence[str]) -> list[str]:
        """The client files an engine on each of `hosts` needs to reach the store, where unreadable: one line each."""

    def host(self, hosts: Hosts, on_failed: Callable[[str], None]) -> StoreHost:
        """The store's life during a session; on_failed: it died before it was ready, the nodes started with it
        must fail."""


async def bind_errors(hosts: Hosts, name: str, binds: Sequence[tuple[str, int, str, str]]) -> list[str]:
    """Whether host `name` can listen on each (address, port) now, as the store and etcd will; a line per one
    it cannot, at the profile key that sets it. binds: (address, port, the [store] key of the port, what listens)."""
    host = hosts.profile.hosts[name]
    args = " ".join(f"{C.q(a)} {p}" for a, p, _, _ in binds)
    rc, out, err = await hosts.transport(name).run(
        f"cd {C.qpath(host.workdir)} && {C.qpath(host.python_path)} -c {C.q(BIND_CHECK)} {args}")
    if rc not in (0, 1):
        raise TransportError(f"{host.python_path} could not check its ports: {err.strip() or f'status {rc}'}")
    said = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    lines = []
    for address, port, key, what in binds:
        error = said.get(f"{address}:{port}")
        if error is None:
            continue
        if "EADDRNOTAVAIL" in error:
            keys = [k for k in ("bind", "address") if getattr(hosts.profile.store, k)] if key == "port" else []
            at = key_where(hosts.profile, ("store", keys[0]) if keys else ("hosts", name, "address"),
                           ("hosts", name))
            lines.append(f"{at}: {address} is not an address of {name} ({what} cannot listen on it: {error})")
        else:
            at = key_where(hosts.profile, ("store", key), ("store",))
            lines.append(f"{at}: {port} is taken on {name} ({what} cannot listen on {address}:{port}: {error}); "
                         f"end what listens there (ss -ltnp 'sport = :{port}') or choose another store.{key}")
    return lines



# run on a host with its python: address port pairs; prints "address:port ERRNAME: why" for each it cannot listen on
# (SO_REUSEADDR as the store sets it: a port in TIME_WAIT after the last run is free for it)
BIND_CHECK = """\
import errno, socket, sys
bad = 0
for address, port in zip(sys.argv[1::2], sys.argv[2::2]):
    s = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((address, int(port)))
        s.listen(1)
    except OSError as e:
        bad = 1
        print("%s:%s %s: %s" % (address, port, errno.errorcode.get(e.errno or 0, "?"), e.strerror or e))
    finally:
        s.close()
sys.exit(bad)
"""
