"""Watching the nodes' processes: one watcher task per node follows its events file into the fleet and settles it.

    watchers = Watchers(hosts)
    watchers.watch("node-a")                 follow the process in node-a's pid file until it is gone, then settle
    watchers.await_others("node-b")          nothing of this console's runs there: wait for a start by another one

A watcher follows the node's events file (re-tailing from the last offset after a dropped link) and polls its
liveness; when the process is gone it reads the rest of the file and settles the node's final state from the
engine's last word, the operator's action, or the exit status and the log's last line. Then it keeps reading the
node's pid file: another console (a shell's `add NODE`) may start the node again, and the watcher follows that
process too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Container
from dataclasses import dataclass, field

from console.fleet import HostState, NodeState
from console.hosts import BACKOFF_S, KILLED, SETTLE_S, Hosts
from console.profile import Profile
from console.transport import TransportError, last_said
from console.transport import commands as C


@dataclass
class Proc:
    """What the console knows about the process it started (or found) for one node."""

    pid: int | None = None
    offset: int = 0  # bytes of events.jsonl already ingested
    watcher: asyncio.Task | None = None
    killed: bool = False  # the operator killed it: DEAD, whatever the exit looked like
    stopping: bool = False  # stop() asked it to end: a plain exit is "stopped"
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Watchers:
    def __init__(self, hosts: Hosts, run_stopped: Callable[[], Awaitable[bool]] | None = None):
        self.hosts = hosts
        self._run_stopped = run_stopped  # whether a stop (any console's) ended the run: the store's marker
        self.fleet = hosts.fleet
        self.procs: dict[str, Proc] = {}

    @property
    def profile(self) -> Profile:
        return self.hosts.profile

    def proc(self, name: str) -> Proc:
        return self.procs.setdefault(name, Proc())

    def watch(self, name: str, alive: bool = True) -> None:
        """Follow the node's process (alive), or wait for one to appear in its pid file (a start by another
        console) and follow that."""
        proc = self.proc(name)
        if alive:
            proc.done.clear()
        proc.watcher = asyncio.ensure_future(self._watcher(name, proc, alive))

    def watch_others(self, retrying: Container[str]) -> None:
        """Hosts this console runs nothing on (off, standby, failed to start, unreachable at attach and not being
        `retrying`): notice a process another console starts there. A done Proc without a pid is what restart/add
        expect of a free node."""
        for name in self.profile.hosts:
            if name not in self.procs and name not in retrying:
                self.await_others(name)

    def await_others(self, name: str) -> None:
        """Nothing of this console's runs on the node: watch its pid file for a process another console starts."""
        proc = self.proc(name)
        proc.done.set()
        self.watch(name, alive=False)

    async def _watcher(self, name: str, proc: Proc, alive: bool = True) -> None:
        while True:
            if alive:
                await self._follow_to_end(name, proc)
            if not await self._next_process(name, proc):
                return
            alive = await self._adopted_alive(name, proc)

    async def _next_process(self, name: str, proc: Proc) -> bool:
        """Wait until the node's pid file names another process than the one followed (another console started
        it). False once this console starts one itself, stops the run, or closes."""
        t = self.hosts.transport(name)
        while True:
            await asyncio.sleep(self.profile.console.poll_interval)
            if self.hosts.closed or self.hosts.stopping or self.procs.get(name) is not proc:
                return False
            try:
                text = await t.read_text(self.hosts.path(name, C.PID))
            except TransportError:
                continue  # unreachable: the follower (or the next look) says so
            pid = int(text.strip()) if text and text.strip().isdigit() else None
            if pid is None or pid <= 1 or pid == proc.pid:
                continue
            if proc.pid is None:  # a pid file this console never followed may be an older run's: only a live one
                try:
                    if not await t.alive(pid, C.TAG):
                        continue
                except TransportError:
                    continue
            proc.pid, proc.killed, proc.stopping = pid, False, False
            return True

    async def _adopted_alive(self, name: str, proc: Proc) -> bool:
        """A process started by another console: read its events from where this console stopped (from the top if
        the file was started anew), and say whether it still runs; one already gone is settled at once."""
        assert proc.pid is not None  # _next_process read it from the pid file
        t = self.hosts.transport(name)
        self.fleet.set_state(name, NodeState.STARTING, f"started by another console (pid {proc.pid})")
        try:
            size = await t.size(self.hosts.path(name, C.EVENTS))
            if size is not None and size < proc.offset:
                proc.offset = 0  # a fresh file (a fresh start archived the old one)
            running = await t.alive(proc.pid, C.TAG)
        except TransportError as e:
            self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
            running = True  # it may well run: follow it and let the watcher find out
        if running:
            proc.done.clear()
            return True
        try:
            await self.catch_up(name)
            await self.settle(name)
        except TransportError as e:
            self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
        return False

    async def _follow_to_end(self, name: str, proc: Proc) -> None:
        """Follow the events file until the process is gone, then settle the node; `done` is set at the end."""
        follow = asyncio.ensure_future(self._follow(name, proc))
        try:
            await self._until_gone(name, proc)
        finally:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
        try:
            await asyncio.sleep(SETTLE_S)
            await self.catch_up(name)
            await self.settle(name)
        except TransportError as e:  # the link went as the process did: say so rather than leave a stale state
            self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
        finally:
            proc.done.set()

    async def _follow(self, name: str, proc: Proc) -> None:
        """Feed the events file into the fleet; after a dropped link, re-tail from the last offset."""
        t, failures = self.hosts.transport(name), 0
        path = self.hosts.path(name, C.EVENTS)
        while True:
            tail = t.tail(path, proc.offset)
            try:
                if failures:
                    await t.connect()
                    self.fleet.set_reachable(name)
                    failures = 0
                async for line in tail:
                    proc.offset = tail.offset
                    self.fleet.ingest(name, line)
            except TransportError as e:
                self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
                failures += 1
            finally:
                await tail.aclose()
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1] if failures else 0.1)

    async def _until_gone(self, name: str, proc: Proc) -> None:
        t = self.hosts.transport(name)
        assert proc.pid is not None
        while True:
            await asyncio.sleep(self.profile.console.poll_interval)
            try:
                if not await t.alive(proc.pid, C.TAG):
                    return
            except TransportError:
                continue  # unreachable is the follower's to report; the engine may well run on

    async def catch_up(self, name: str) -> None:
        """Ingest what the events file holds beyond the offset (attach, or after the process ended)."""
        proc = self.proc(name)
        try:
            lines, proc.offset = await self.hosts.transport(name).read_from(self.hosts.path(name, C.EVENTS),
                                                                            proc.offset)
        except TransportError as e:
            self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
            return
        for line in lines:
            self.fleet.ingest(name, line)

    async def settle(self, name: str) -> None:
        """The process is gone: decide its final state from what is known, most specific first."""
        node, proc, t = self.fleet.nodes[name], self.proc(name), self.hosts.transport(name)
        if proc.killed:
            if node.state is not HostState.FAILED:  # a store failure already said why
                self.fleet.set_state(name, NodeState.DEAD, "killed by the operator (SIGKILL to its process group)")
            return
        if node.run_ended and (node.state is not NodeState.DEAD or self.fleet.process_ended(name)):
            return  # the engine said how it ended (run_end); a mesh "dead" after that is moot
        try:
            rc = await t.read_text(self.hosts.path(name, C.RC))
            log = await last_said(t, self.hosts.path(name, C.LOG))
            killed = await t.read_text(self.hosts.path(name, KILLED)) is not None
        except TransportError as e:
            self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
            return
        if killed and rc is None:
            self.fleet.set_state(name, NodeState.DEAD, "killed by the operator (SIGKILL to its process group)")
            return
        last = log[-1] if log else "no output"
        status = rc.strip() if rc and rc.strip().lstrip("-").isdigit() else None
        if status is None:
            self.fleet.set_state(name, NodeState.DEAD, f"process gone without an exit status (killed?): {last}")
        elif status == "0":
            # a clean exit after `drained` or `state left` without its run_end line (lost with the pipe): its word
            # stands; a non-zero one after them (killed writing its last checkpoint) did not end as it said
            if node.engine_state in (NodeState.LEFT, HostState.FAILED) and (node.state is not NodeState.DEAD
                                                                             or self.fleet.process_ended(name)):
                return
            self.fleet.set_state(name, NodeState.LEFT, "stopped" if proc.stopping else "exited")
        elif proc.stopping or (self._run_stopped is not None and await self._run_stopped()):
            # a stop ended it before its engine took SIGTERM as a stop (still starting: status 143), or its last
            # checkpoint: the run was stopped, not failed (the status stays in the log)
            self.fleet.note(name, f"exited with status {status} as the run was stopped: {last}")
            self.fleet.set_state(name, NodeState.LEFT, "stopped")
        else:
            self.fleet.set_state(name, HostState.FAILED, f"exited with status {status}: {last}")

    # ---- what the cluster's actions ask ------------------------------------------------------------------------
    def running(self) -> list[str]:
        """The nodes whose process the console follows and has not seen end (a mesh "dead" label is not an end)."""
        return [n for n, p in self.procs.items() if p.pid is not None and not p.done.is_set()]

    async def poke(self, name: str, proc: Proc) -> None:
        """Ask whether the node's process still runs; one just gone is left to its watcher to settle."""
        if proc.pid is None or proc.done.is_set():
            return
        try:
            gone = not await self.hosts.transport(name).alive(proc.pid, C.TAG)
        except TransportError:
            return
        if gone and proc.watcher is not None:
            try:  # let its watcher settle it (read the last lines, the exit status)
                await asyncio.wait_for(asyncio.shield(proc.done.wait()), self.profile.console.poll_interval * 3 + 5)
            except asyncio.TimeoutError:
                pass

    def fail_all(self, reason: str) -> None:
        """The store died before it was ready: no mesh can form, so fail (and end) every node started with it."""
        for name, proc in self.procs.items():
            if proc.pid is None or proc.done.is_set():
                continue
            self.fleet.set_state(name, HostState.FAILED, reason)
            proc.killed = True
            asyncio.ensure_future(self.hosts.signal_quietly(name, proc.pid, "KILL"))

    def tasks(self) -> list[asyncio.Task]:
        return [p.watcher for p in self.procs.values() if p.watcher is not None]
