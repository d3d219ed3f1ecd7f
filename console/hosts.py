"""The run's hosts as this console reaches them, shared by the cluster's parts (console/cluster.py composes them).

    hosts = Hosts(profile, fleet, make_transport)
    hosts.transport("node-a")                    one transport (one connection) per profile host, made on first use
    hosts.path("node-a", C.PID)                  RUN_DIR/node-a/pid on that host
    await hosts.live_pid(STORE, store_host)      the recorded pid, if that process still runs
    hosts.stopping, hosts.closed                 what every watcher asks before its next turn

`profile` is replaced when `add` writes a new host into the profile file: the parts read it from here each time
and never keep their own copy.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from console.fleet import Fleet, NodeState
from console.profile import HostSpec, Profile
from console.transport import Transport, TransportError
from console.transport import commands as C

KILLED = "killed"  # written by kill(): any console that settles the node later knows the operator did it
STORE = "_store"  # the store's directory under the run dir (not a valid-looking node name)
PROBE = "_store_probe"  # its health probe's (engine/store/probe.py)
HEALTH = "health.json"  # the probe's latest sample, replaced whole each time
ARCHIVE = "_archive"  # earlier runs' folders, moved here by a fresh start
SETTLE_S = 0.3  # after a process is gone: let its last lines land before reading them
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)


def resting_state(host: HostSpec) -> NodeState:
    """A host with nothing running: a standby waits to be added; a host of the run is simply off."""
    return NodeState.STANDBY if host.standby else NodeState.OFF


def host_label(host: HostSpec) -> str:
    return "local" if host.transport == "local" else host.target


class Hosts:
    def __init__(self, profile: Profile, fleet: Fleet, make_transport: Callable[[HostSpec], Transport]):
        self.profile = profile
        self.fleet = fleet
        self._make_transport = make_transport
        self.transports: dict[str, Transport] = {}
        self.stopping = False  # stop() ends the run on purpose: the store is not restarted, watchers end
        self.closed = False  # close(): stop watching

    def node_dir(self, name: str) -> str:
        return C.join(self.profile.run.dir, name)

    def path(self, name: str, file: str) -> str:
        return C.join(self.node_dir(name), file)

    def transport(self, name: str) -> Transport:
        """One transport (one connection) per profile host, made on first use."""
        if name not in self.transports:
            self.transports[name] = self._make_transport(self.profile.hosts[name])
        return self.transports[name]

    async def live_pid(self, name: str, host: str | None = None) -> int | None:
        """The pid recorded for a node (or the store) if that process still runs; None otherwise."""
        t = self.transport(host or name)
        try:
            text = await t.read_text(self.path(name, C.PID))
            pid = int(text.strip()) if text and text.strip().isdigit() else None
            return pid if pid is not None and pid > 1 and await t.alive(pid, C.TAG) else None
        except TransportError:
            return None

    async def signal_quietly(self, name: str, pid: int, sig: str) -> bool:
        try:
            return await self.transport(name).signal(pid, sig, group=True)
        except TransportError as e:
            self.fleet.note(name, f"{sig} failed: {e}")
            return False

    async def gather(self, *coros: Any) -> list[Any]:
        """Fan out; a bug in one branch is reported, not raised, so the other nodes go on."""
        results = await asyncio.gather(*coros, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                for host in self.profile.active_hosts():
                    self.fleet.note(host.name, f"console error: {type(result).__name__}: {result}")
        return results

    async def close(self) -> None:
        await asyncio.gather(*(t.close() for t in self.transports.values()), return_exceptions=True)
