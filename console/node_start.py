"""Starting engines on their hosts: one node's launch, and what a start decides before it launches any.

    starter = NodeStarter(hosts, watchers, store)
    await starter.launch(host, fresh=True)       # check the host, start the engine detached, watch it
    await starter.resumed_nodes()                # --resume: the nodes the run had when it ended
    await starter.archive_previous()             # a fresh start: an earlier run's folders to RUN_DIR/_archive/

A node's trouble (a host that does not answer, a python missing, an engine that dies at start) becomes its state
and reason in the fleet; nothing here raises to the caller for it. console/cluster.py decides when to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import time

from console.engine_config import data_shard, engine_env
from console.fleet import HostState, NodeState
from console.hosts import ARCHIVE, KILLED, PROBE, STORE, Hosts
from console.launch import engine_argv
from console.profile import HostSpec, Profile, engine_overrides
from console.store.base import StoreHost
from console.transport import Transport, TransportError
from console.transport import commands as C
from console.watchers import Proc, Watchers
from engine.telemetry import BadEvent, parse_line


class NodeStarter:
    def __init__(self, hosts: Hosts, watchers: Watchers, store: StoreHost):
        self._hosts, self._watchers, self._store = hosts, watchers, store
        self.fleet = hosts.fleet

    @property
    def profile(self) -> Profile:
        return self._hosts.profile

    def transport(self, name: str) -> Transport:
        return self._hosts.transport(name)

    async def launch(self, host: HostSpec, append: bool = False, fresh: bool = False) -> bool:
        """Check the host, start the engine detached, watch it. False (and a node state) if it could not start.
        fresh: the first start of a new run (no ckpt.resume: launch.engine_argv)."""
        name, t = host.name, self.transport(host.name)
        rank, world_size = data_shard(self.profile, name)
        old = self._watchers.procs.get(name)
        if old is not None and old.watcher is not None and old.done.is_set():
            old.watcher.cancel()  # it only waits for a start by another console: this one is ours
        append = append and old is not None and old.pid is not None  # a restart continues the file it followed
        self.fleet.set_state(name, NodeState.STARTING)
        try:
            reason = await t.launch_check(self.profile.engine.config)
            if reason is not None:
                self.fleet.set_state(name, HostState.FAILED, reason)
                self._watchers.await_others(name)
                return False
            for stale in (C.DRAIN, KILLED):  # a drain file left from before would drain it at once
                await t.remove(self._hosts.path(name, stale))
            await self._store.prepare_node(name)  # etcd: the run's client certificate, in the node's folder
            argv = engine_argv(self.profile, host, fresh=fresh)
            pid = await t.start_detached(argv, self._hosts.node_dir(name),
                                         env=engine_env(self.profile, host, rank, world_size), append=append)
        except TransportError as e:
            self.fleet.set_state(name, HostState.UNREACHABLE if e.link else HostState.FAILED, str(e))
            self._watchers.await_others(name)
            return False
        offset = old.offset if append and old is not None else 0  # else a fresh file, read from its start
        self._watchers.procs[name] = Proc(pid=pid, offset=offset, killed=self._store.error is not None)
        if self._store.error is not None:  # the store died while this one was starting
            self.fleet.set_state(name, HostState.FAILED, self._store.error)
            await self._hosts.signal_quietly(name, pid, "KILL")
        node = self.fleet.nodes[name]
        node.command, node.overrides = shlex.join(argv), engine_overrides(self.profile, host)  # the detail view
        self.fleet.note(name, f"started pid {pid}")
        self._watchers.watch(name)
        return True

    async def resumed_nodes(self) -> list[HostSpec]:
        """--resume: the nodes the run had when it ended, as their events files tell. A host that drained stays
        out (it left on purpose: `add` brings it back); a standby host that ran (an add) comes back with its
        checkpoint, one that never ran stays a standby; every other host starts, a fresh one as a joiner."""
        async def last_end(name: str) -> str | None:
            """Its last run_end's status; "" when it ran and wrote none (killed); None when it never ran."""
            try:
                text = await self.transport(name).last_lines(self._hosts.path(name, C.EVENTS), 20)
            except TransportError:
                return None  # it does not answer: as before, a profile host starts and launch() says why not
            for line in reversed(text.splitlines()):
                with contextlib.suppress(BadEvent):  # a stray line: the fleet skips it the same way
                    event = parse_line(line)
                    if event["type"] == "run_end":
                        return str(event.get("status"))
                    if event["type"] == "run_start":  # its last start ended without one (killed)
                        return ""
            return "" if text.strip() else None

        hosts = list(self.profile.hosts.values())
        ends = await asyncio.gather(*(last_end(h.name) for h in hosts))
        chosen = []
        for host, end in zip(hosts, ends):
            if end == "drained":  # left on purpose, and so a success of the run (the outcome reads "drained")
                self.fleet.set_state(host.name, NodeState.LEFT, "drained")
                self.fleet.note(host.name, "drained before the run ended: not resumed (add brings it back)")
            elif end is not None or not host.standby:
                chosen.append(host)
        return chosen

    async def archive_previous(self) -> set[str]:
        """A fresh start: move every node's (and the store's) folder of an earlier run, with its checkpoints, to
        RUN_DIR/_archive/<time>/ on its host, so the new run starts clean and nothing is lost. Returns the nodes
        that must not start: a host that refused the move (starting on top of an old run would mix the two), or
        every node when the store's host refused. An unreachable host is left to launch(), which says so."""
        archive = C.join(self.profile.run.dir, ARCHIVE, time.strftime("%Y%m%d-%H%M%S"))
        store = self.profile.store_host.name  # the store's folder and its probe's (the last health sample)
        names = [(h.name, h.name) for h in self.profile.hosts.values()] + [(STORE, store), (PROBE, store)]
        async def move(name: str, host: str) -> TransportError | None:
            try:
                await self.transport(host).archive(self._hosts.node_dir(name), archive)
            except TransportError as e:
                return e
            return None

        results = await self._hosts.gather(*(move(name, host) for name, host in names))
        blocked: set[str] = set()
        for (name, _), result in zip(names, results):
            if not isinstance(result, TransportError) or result.link:
                continue
            hit = [h.name for h in self.profile.active_hosts()] if name in (STORE, PROBE) else [name]
            for node in hit:
                self.fleet.set_state(node, HostState.FAILED, f"previous run not archived: {result}")
            blocked.update(hit)
        return blocked
