"""The run's stop: every engine ends (TERM, then KILL after console.stop_timeout), then the store and its probe.

    outcome = await RunStop(hosts, watchers, store, attacher).stop()   # console/cluster.py's stop() calls it

Every process group is waited for on every host that answers; what a host did not answer for is named, and the
outcome is then a failure (the engines may train on until mesh.store_lost_timeout). Nothing running at all is a
failure too, and nothing is written.
"""

from __future__ import annotations

import asyncio
import time

from console.attach import Attacher
from console.control import Outcome
from console.hosts import Hosts
from console.profile import Profile
from console.store.base import StoreHost
from console.transport import Transport, TransportError
from console.transport import commands as C
from console.watchers import Watchers


class RunStop:
    def __init__(self, hosts: Hosts, watchers: Watchers, store: StoreHost, attacher: Attacher):
        self._hosts, self._watchers, self._store, self._attacher = hosts, watchers, store, attacher
        self.fleet = hosts.fleet

    @property
    def profile(self) -> Profile:
        return self._hosts.profile

    def transport(self, name: str) -> Transport:
        return self._hosts.transport(name)

    async def stop(self) -> Outcome:
        """TERM every engine's group, wait, KILL what outlives console.stop_timeout, then the store and its probe
        (console/cluster.py's stop() says what the outcome promises)."""
        running = {n: p for n, p in self._watchers.procs.items() if p.pid is not None and not p.done.is_set()}
        asking = any(not retry.done() for retry in self._attacher.retries.values())  # a host that did not answer
        if not running and not asking and not await self._store.runs():
            # a profile mistyped, a run already over: "stopped 0 node(s)" read as a success; nothing is written
            hosts = ", ".join(self.profile.hosts)
            return Outcome(False, f"nothing to stop: no engine or store of {self.profile.path} runs (run "
                                  f"{self.profile.run.name}; looked in {self.profile.run.dir} on {hosts})")
        self._hosts.stopping = True  # the store ends on purpose: its watcher must not restart it
        await self._store.mark_stopped()  # before the engines end: another console watching them reads it
        for proc in running.values():
            proc.stopping = True
        await self._hosts.gather(*(self._hosts.signal_quietly(n, p.pid, "TERM") for n, p in running.items()
                                   if p.pid is not None))  # every one has a pid: the test narrows its type
        timeout = self.profile.console.stop_timeout
        started = time.monotonic()
        try:  # the watchers settle each node ("stopped") as its engine ends
            await asyncio.wait_for(asyncio.gather(*(p.done.wait() for p in running.values())), timeout)
        except asyncio.TimeoutError:
            pass
        left, killed = await self._hosts.end_groups([(n, p.pid) for n, p in running.items() if p.pid is not None],
                                                    max(0.0, timeout - (time.monotonic() - started)))
        late = await asyncio.gather(*(self._killed_line(n, timeout) for n, _ in killed))  # one look per host at once
        store_left, etcd_said = await self._store.stop()
        # a node whose host did not answer when this console looked for its engine (an attach still retrying) has
        # no process here to signal: it may well train on (until mesh.store_lost_timeout): say so, not a clean stop
        # (a standby host, a spare that is often off, is named without failing the stop)
        unseen = {n: f"{n}: its host did not answer ({self.fleet.nodes[n].reason or 'unreachable'})"
                  for n, retry in self._attacher.retries.items() if not retry.done() and n not in running}
        spares = [line for n, line in unseen.items() if self.profile.hosts[n].standby]
        unseen_active = [line for n, line in unseen.items() if not self.profile.hosts[n].standby]
        running_still = [f"{n}: process group {pid} (no answer)" for n, pid in left] + unseen_active + store_left
        message = f"stopped {len(running)} node(s)" + (f"; {'; '.join(late)}" if late else "")
        message += f"; etcd: {'; '.join(etcd_said)}" if etcd_said else ""
        if spares:
            message += f"; spare hosts not reached: {'; '.join(spares)}"
        if running_still:
            return Outcome(False, f"{message}, but these may still run: {'; '.join(running_still)}")
        return Outcome(True, message)

    async def _killed_line(self, name: str, timeout: float) -> str:
        """What a KILL at the end of stop_timeout cost a node, said rather than hidden in a clean-looking stop. The
        wrapper writes the engine's exit status when the engine ends: without it, the engine itself was KILLed and
        saved nothing on its way out; with it, a process the engine left in its group (a hung worker) was."""
        try:
            ended = await self.transport(name).read_text(self._hosts.path(name, C.RC)) is not None
        except TransportError:
            return f"{name}: KILLed after stop_timeout ({timeout:g}s)"
        if ended:
            return f"{name}: a process of its group outlived stop_timeout ({timeout:g}s) and was KILLed"
        return f"{name}: KILLed after stop_timeout ({timeout:g}s), no checkpoint on the way out"
