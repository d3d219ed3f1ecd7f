"""The run's hosts as this console reaches them, shared by the cluster's parts (console/cluster.py composes them).

    hosts = Hosts(profile, fleet, make_transport)
    hosts.transport("node-a")                    one transport (one connection) per profile host, made on first use
    hosts.path("node-a", C.PID)                  RUN_DIR/node-a/pid on that host
    await hosts.live_pid(STORE, store_host)      the recorded pid, if that process still runs
    await hosts.end_groups([(host, pgid)], 30)   wait for process groups to be empty, KILL them after 30 s
    new_host_target(profile, "user@10.0.0.7")    what `add` of a name the profile lacks would write, or UnknownHost
    hosts.stopping, hosts.closed                 what every watcher asks before its next turn

`profile` is replaced when `add` writes a new host into the profile file: the parts read it from here each time
and never keep their own copy.
"""

from __future__ import annotations

import asyncio
import difflib
import ipaddress
import time
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from console.fleet import Fleet, HostState
from console.profile import HostSpec, Profile, add_host, remove_host
from console.transport import Transport, TransportError
from console.transport import commands as C

KILLED = "killed"  # written by kill(): any console that settles the node later knows the operator did it
STOPPED = "stopped"  # written into the store's folder by stop(): another console watching it does not restart it
STORE = "_store"  # the store's directory under the run dir (not a valid-looking node name)
PROBE = "_store_probe"  # its health probe's (engine/store/probe.py)
HEALTH = "health.json"  # the probe's latest sample, replaced whole each time
ARCHIVE = "_archive"  # earlier runs' folders, moved here by a fresh start
SETTLE_S = 0.3  # after a process is gone: let its last lines land before reading them
GONE_POLL_S = 0.2  # how often stop() looks whether a process group it ended is empty yet
KILL_WAIT_S = 5.0  # how long a group KILLed by stop() may take to be gone (a process in uninterruptible I/O)
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)


def resting_state(host: HostSpec) -> HostState:
    """A host with nothing running: a spare (`standby = true`) waits to be added; a host of the run is simply off."""
    return HostState.SPARE if host.standby else HostState.OFF


def host_label(host: HostSpec) -> str:
    return "local" if host.transport == "local" else host.target


class UnknownHost(ValueError):
    """A name that is neither a host of the profile nor an address: `add` changes nothing (a typo, most likely)."""


def new_host_target(profile: Profile, target: str) -> tuple[str | None, str, int | None]:
    """`add TARGET` of a name the profile does not have: (user, address, port) of the new machine, or UnknownHost
    naming the hosts it may have meant (a plain ValueError when it is not even `[user@]host[:port]`).

    Only what is unmistakably a machine is new: an IP address, a dotted host name, `user@` or `:port` given, or an
    alias an ssh config gives a HostName. A bare word is a typo until then: `add node-ee` wrote [hosts.node-ee]
    into the profile and tried to SSH to it."""
    from console.sshconfig import split_target, ssh_hostname  # reads the ssh config only for a bare word

    parts = split_target(target)
    if parts is None:
        raise ValueError(f"not a host name or [user@]address[:port]: {target!r}")
    user, name, port = parts
    if user is not None or port is not None or "." in name or name == "localhost":
        return parts
    try:
        ipaddress.ip_address(name)
        return parts
    except ValueError:
        pass
    configs = {h.ssh_config for h in profile.hosts.values()} | {None}  # the profile's, and ~/.ssh/config
    if any(ssh_hostname(SimpleNamespace(ssh_config=c, target=name)) for c in configs):
        return parts
    names = list(profile.hosts)
    ratio = {n: difflib.SequenceMatcher(None, name, n).ratio() for n in names}
    best = max(ratio.values(), default=0.0)
    close = [n for n in names if ratio[n] == best and best >= 0.6]  # the nearest, all of them when they tie
    guess = f": did you mean {' or '.join(filter(None, [', '.join(close[:-1]), close[-1]]))}?" if close else ""
    raise UnknownHost(f"{name} is not a host of {profile.path}{guess} (its hosts: {', '.join(names)}; a new "
                      "machine is given by its address: 10.0.0.7, user@host:port, a full host name or an "
                      "~/.ssh/config alias)")


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

    def add_address(self, target: str) -> tuple[str, bool]:
        """`add` of `[user@]address[:port]` or a host's name: the host's name, and whether it was written into the
        profile file now (a new address; UnknownHost for what looks like a typo of a host, nothing written)."""
        user, name, port = new_host_target(self.profile, target)
        if name in self.profile.hosts:
            return name, False
        # a new address is another machine: reached over SSH, whatever [defaults] says for the others
        fields = {"transport": "ssh", "address": name, "user": user, "port": port}
        self.profile = add_host(self.profile.path, name, **fields)  # every part reads the new one
        self.fleet.add_node(name, host_label(self.profile.hosts[name]), HostState.SPARE)
        self.fleet.note(name, f"added to {self.profile.path}")
        return name, True

    def take_out(self, name: str) -> None:
        """A new address that did not start, out of the profile file again (ProfileError, OSError if it cannot)."""
        self.profile = remove_host(self.profile.path, name)
        self.fleet.note(name, f"taken out of {self.profile.path} again")

    def path(self, name: str, file: str) -> str:
        return C.join(self.node_dir(name), file)

    def transport(self, name: str) -> Transport:
        """One transport (one connection) per profile host, made on first use."""
        if name not in self.transports:
            self.transports[name] = self._make_transport(self.profile.hosts[name])
        return self.transports[name]

    async def live_pid(self, name: str, host: str | None = None) -> int | None:
        """The pid recorded for a node (or the store) if that process still runs; None otherwise."""
        try:
            return await self.running_pid(name, host)
        except TransportError:
            return None

    async def running_pid(self, name: str, host: str | None = None) -> int | None:
        """live_pid, but a host that cannot be asked raises TransportError instead of reading as "not running"."""
        t = self.transport(host or name)
        text = await t.read_text(self.path(name, C.PID))
        pid = int(text.strip()) if text and text.strip().isdigit() else None
        return pid if pid is not None and pid > 1 and await t.alive(pid, C.TAG) else None

    async def signal_quietly(self, name: str, pid: int, sig: str) -> bool:
        try:
            return await self.transport(name).signal(pid, sig, group=True)
        except TransportError as e:
            self.fleet.note(name, f"{sig} failed: {e}")
            return False

    async def end_groups(self, groups: Sequence[tuple[str, int]],
                         timeout: float) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """Wait until no process is left in each (host, process group), which were asked to end; KILL the groups
        still there after `timeout`, and wait KILL_WAIT_S more. (What is left: a host that does not answer, which
        stop() names rather than return while a process of the run may still run; the groups a KILL reached.)"""
        left = await self._until_gone(groups, timeout)
        sent = await asyncio.gather(*(self.signal_quietly(host, pgid, "KILL") for host, pgid in left))
        killed = [group for group, reached in zip(left, sent) if reached]  # not a host that did not answer
        if left:
            left = await self._until_gone(left, KILL_WAIT_S)
        return left, killed

    async def _until_gone(self, groups: Sequence[tuple[str, int]], timeout: float) -> list[tuple[str, int]]:
        deadline = time.monotonic() + timeout
        left = list(groups)
        while left:
            alive = await asyncio.gather(*(self._group_alive(host, pgid) for host, pgid in left))
            left = [group for group, live in zip(left, alive) if live]
            if not left or time.monotonic() >= deadline:
                break
            await asyncio.sleep(GONE_POLL_S)
        return left

    async def _group_alive(self, host: str, pgid: int) -> bool:
        try:
            return await self.transport(host).group_alive(pgid)
        except TransportError:
            return True  # cannot tell: not gone as far as stop() knows

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
