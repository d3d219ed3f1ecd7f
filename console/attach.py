"""Attaching to a cluster that runs without this console (the console restarted, or a one-shot shell command).

    attacher = Attacher(hosts, watchers, store)
    if await attacher.engines_running(): await attacher.attach()

Every node's pid file says which process to follow: its events file is read from the top (the fleet catches up on
the run), then its watcher follows it. A host that does not answer is marked unreachable and attached again, with
backoff, once it does. The store is found the same way (console/store/).
"""

from __future__ import annotations

import asyncio
import itertools

from console.fleet import HostState, NodeState
from console.hosts import BACKOFF_S, Hosts, resting_state
from console.profile import HostSpec, Profile
from console.store.base import StoreHost
from console.transport import TransportError
from console.transport import commands as C
from console.watchers import Watchers


class Attacher:
    def __init__(self, hosts: Hosts, watchers: Watchers, store: StoreHost):
        self.hosts, self.watchers, self.store = hosts, watchers, store
        self.fleet = hosts.fleet
        self.retries: dict[str, asyncio.Task] = {}  # attach again to hosts that were down at attach

    @property
    def profile(self) -> Profile:
        return self.hosts.profile

    async def engines_running(self) -> bool:
        """Whether any engine of the profile runs (its pid file names a live process), on the hosts that answer."""
        found = await self.hosts.gather(*(self.hosts.live_pid(h.name) for h in self.profile.hosts.values()))
        return any(isinstance(pid, int) for pid in found)

    async def attach(self, *, steer_store: bool = True) -> None:
        """Re-attach to a running cluster from its pid files: catch up on every events file, then follow.

        steer_store: watch the store and restart it if it dies (the dashboard, --headless); a one-shot command
        (`status`, `kill`...) only looks at whether it runs."""
        await self.hosts.gather(*(self._attach_node(h) for h in self.profile.hosts.values()))
        self.watchers.watch_others(self.retries)
        await self.store.attach(steer=steer_store, engines_running=bool(self.watchers.running()))

    async def _attach_node(self, host: HostSpec) -> None:
        name, t = host.name, self.hosts.transport(host.name)
        try:
            text = await t.read_text(self.hosts.path(name, C.PID))
        except TransportError as e:
            # the host is down as the console comes up: say so, and attach once it answers again
            self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
            if name not in self.retries or self.retries[name].done():
                self.retries[name] = asyncio.ensure_future(self._attach_later(host))
            return
        if not text or not text.strip().isdigit():
            self.watchers.await_others(name)  # never started: it stays off (or standby) until a start elsewhere
            return
        proc = self.watchers.proc(name)
        proc.pid, proc.offset = int(text.strip()), 0
        self.fleet.set_state(name, NodeState.STARTING)
        await self.watchers.catch_up(name)
        try:
            running = await t.alive(proc.pid, C.TAG)
        except TransportError as e:
            self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
            running = True  # it may well run: follow it and let the watcher find out
        if running:
            self.watchers.watch(name)
        else:
            await self.watchers.settle(name)
            proc.done.set()
            self.watchers.watch(name, alive=False)  # another console may start it again

    async def _attach_later(self, host: HostSpec) -> None:
        for failures in itertools.count():
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
            try:
                await self.hosts.transport(host.name).connect()
            except TransportError as e:
                self.fleet.set_state(host.name, HostState.UNREACHABLE, str(e))
                continue
            self.fleet.set_reachable(host.name)
            if self.fleet.nodes[host.name].state is NodeState.STARTING:
                self.fleet.set_state(host.name, resting_state(host))  # until its pid file says otherwise
            await self._attach_node(host)
            return
