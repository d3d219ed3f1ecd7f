"""The cluster controller: starts the store and the engines, streams their events into the fleet, steers them.

    cluster = Cluster(profile, fleet)        # transports=make_transport; tests inject their own
    await cluster.start()                    # or attach() to engines that already run (the console restarted)
    await cluster.drain("node-b"); await cluster.kill("node-c"); await cluster.restart("node-c")
    await cluster.add("node-d")              # a standby host, or a new address (written into the profile)
    await cluster.stop(); await cluster.close()

Every process is started detached on its host (setsid + nohup, see transport/commands.py), so engines outlive the
console and the SSH link. On each host, under the workdir:

    RUN_DIR/NODE/events.jsonl   the engine's stdout: the JSON event stream the fleet reads
    RUN_DIR/NODE/engine.log     its stderr
    RUN_DIR/NODE/pid, rc        the process group id; the exit status (absent when it was killed)
    RUN_DIR/NODE/drain          appears on drain: the engine finishes its round and leaves
    RUN_DIR/NODE/killed         written by kill, so a console started later still knows who ended it
    RUN_DIR/_store/...          the same for the membership store

One watcher task per started node follows its events file (re-tailing from the last offset after a dropped
link) and polls its liveness; when the process is gone it reads the rest of the file and settles the node's
final state from the engine's last word, the operator's action, or the exit status and the log's last line.
Then it keeps reading the node's pid file: another console (a shell's `add NODE`) may start the node again, and
the watcher follows that process too. Hosts with nothing running at start or attach are watched the same way.

Nothing here raises to the caller for a node's trouble: a bad host, a refused key, a dead link, a missing python,
an engine that exits at start all become that node's state and reason, and the other nodes go on.
"""

from __future__ import annotations

import asyncio
import itertools
import shlex
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from console import etcd as E
from console.fleet import Fleet, NodeState
from console.sshconfig import split_target
from console.profile import (HostSpec, Profile, ProfileError, add_host, check_engine_config, engine_overrides,
                             toml_value)
from console.transport import Transport, TransportError, make_transport
from console.transport import commands as C

KILLED = "killed"  # written by kill(): any console that settles the node later knows the operator did it
STORE = "_store"  # the store's directory under the run dir (not a valid-looking node name)
PROBE = "_store_probe"  # its health probe's (engine/store/probe.py)
HEALTH = "health.json"  # the probe's latest sample, replaced whole each time
ARCHIVE = "_archive"  # earlier runs' folders, moved here by a fresh start
SETTLE_S = 0.3  # after a process is gone: let its last lines land before reading them
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)


@dataclass
class _Proc:
    """What the console knows about the process it started (or found) for one node."""

    pid: int | None = None
    offset: int = 0  # bytes of events.jsonl already ingested
    watcher: asyncio.Task | None = None
    killed: bool = False  # the operator killed it: DEAD, whatever the exit looked like
    stopping: bool = False  # stop() asked it to end: a plain exit is "stopped"
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True)
class Outcome:
    """The result of an action, for the UI and the CLI (actions never raise for a node's trouble)."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok


def engine_argv(profile: Profile, host: HostSpec) -> list[str]:
    """`python -m engine.train CONFIG --k=v ...` (torch.distributed.run when the host runs several workers)."""
    node_dir = C.join(profile.run.dir, host.name)
    # ckpt.resume=auto: a node restarted (or added back) continues from its own last checkpoint, and a DiLoCo
    # joiner then takes the run's state anyway; a fresh start() moves the previous run's folders aside first
    overrides = {"ckpt.resume": "auto", **engine_overrides(profile, host), "run.name": profile.run.name,
                 "run.dir": node_dir, **E.engine_store_overrides(profile, host.name),
                 "mesh.drain_file": C.join(node_dir, C.DRAIN)}
    args = [profile.engine.config, *(f"--{k}={toml_value(v)}" for k, v in overrides.items())]
    if host.workers == 1:
        return [host.python_path, "-m", "engine.train", *args]
    if host.rdzv_port is not None:
        rdzv = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{host.rdzv_port}",
                f"--rdzv-id={host.name}"]
    else:
        rdzv = ["--standalone"]  # its own rendezvous on a free port: nodes sharing a machine never collide
    return [host.python_path, "-m", "torch.distributed.run", *rdzv, f"--nproc_per_node={host.workers}",
            "-m", "engine.train", *args]


def engine_env(profile: Profile, host: HostSpec, rank: int, world_size: int) -> dict[str, str]:
    return {**host.env, "GLOBAL_ADDR": profile.store_address, "GLOBAL_PORT": str(profile.store.port),
            "GLOBAL_UNIQUE_ID": host.name, "GLOBAL_RANK": str(rank), "GLOBAL_WORLD_SIZE": str(world_size),
            "PYTHONUNBUFFERED": "1"}


def store_argv(profile: Profile, bind: str | None = None) -> list[str]:
    return [profile.store_host.python_path, "-m", "engine.store", "--host", bind or profile.store_bind,
            "--port", str(profile.store.port)]


def resting_state(host: HostSpec) -> NodeState:
    """A host with nothing running: a standby waits to be added; a host of the run is simply off."""
    return NodeState.STANDBY if host.standby else NodeState.OFF


def _host_label(host: HostSpec) -> str:
    return "local" if host.transport == "local" else host.target


class Cluster:
    def __init__(self, profile: Profile, fleet: Fleet,
                 transports: Callable[[HostSpec], Transport] = make_transport, *, resume: bool = False):
        self.profile = profile
        self.resume = resume  # start() continues the previous run's checkpoints instead of archiving them
        self.fleet = fleet
        self._make_transport = transports
        self._transports: dict[str, Transport] = {}
        self._procs: dict[str, _Proc] = {}
        self._store_pid: int | None = None
        self._store_task: asyncio.Task | None = None
        self._store_error: str | None = None
        self._store_bind_used: str | None = None  # what the running store was started to listen on
        self._stopping = False  # stop() ends the store on purpose: no restart
        self._closed = False  # close(): stop watching
        fleet.store.address = f"{profile.store_address}:{profile.store.port}"
        self._retries: dict[str, asyncio.Task] = {}  # attach again to hosts that were down at attach
        # the etcd members this console runs (store.backend etcd with etcd_hosts), else None
        self._etcd = E.cluster_of(profile, self.transport, E.pki_root(profile))
        self._health_task: asyncio.Task | None = None
        for host in profile.hosts.values():
            fleet.add_node(host.name, _host_label(host), resting_state(host))

    # ---- paths and transports --------------------------------------------------------------------------------
    def node_dir(self, name: str) -> str:
        return C.join(self.profile.run.dir, name)

    def _path(self, name: str, file: str) -> str:
        return C.join(self.node_dir(name), file)

    def transport(self, name: str) -> Transport:
        """One transport (one connection) per profile host, made on first use."""
        if name not in self._transports:
            self._transports[name] = self._make_transport(self.profile.hosts[name])
        return self._transports[name]

    def _proc(self, name: str) -> _Proc:
        return self._procs.setdefault(name, _Proc())

    # ---- start and attach --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the store and every non-standby node; attach instead if any engine of the profile already runs.

        Only hosts that answer can be checked: after an outage, `attach()` (--attach) is the safe way back.
        """
        try:
            check_engine_config(self.profile)  # the whole profile is valid before anything starts
        except ProfileError as e:
            for host in self.profile.active_hosts():
                self.fleet.set_state(host.name, NodeState.FAILED, str(e))
            return
        self._stopping = False
        if await self._engines_running():
            await self.attach()
            return
        await self._end_stale_store()
        blocked = set() if self.resume else await self._archive_previous()
        active = [h for h in self.profile.active_hosts() if h.name not in blocked]
        if not active:
            return
        reason = await self._start_store()
        if reason is not None:  # no store, no mesh: say so on every node and start none
            for host in active:
                self.fleet.set_state(host.name, NodeState.FAILED, reason)
            return
        await self._gather(*(self._launch(h) for h in active))
        self._watch_others()

    async def _archive_previous(self) -> set[str]:
        """A fresh start: move every node's (and the store's) folder of an earlier run, with its checkpoints, to
        RUN_DIR/_archive/<time>/ on its host, so the new run starts clean and nothing is lost. Returns the nodes
        that must not start: a host that refused the move (starting on top of an old run would mix the two), or
        every node when the store's host refused. An unreachable host is left to _launch, which says so."""
        archive = C.join(self.profile.run.dir, ARCHIVE, time.strftime("%Y%m%d-%H%M%S"))
        names = [(h.name, h.name) for h in self.profile.hosts.values()] + [(STORE, self.profile.store_host.name)]
        async def move(name: str, host: str) -> TransportError | None:
            try:
                await self.transport(host).archive(self.node_dir(name), archive)
            except TransportError as e:
                return e
            return None

        results = await self._gather(*(move(name, host) for name, host in names))
        blocked: set[str] = set()
        for (name, _), result in zip(names, results):
            if not isinstance(result, TransportError) or result.link:
                continue
            hit = [h.name for h in self.profile.active_hosts()] if name == STORE else [name]
            for node in hit:
                self.fleet.set_state(node, NodeState.FAILED, f"previous run not archived: {result}")
            blocked.update(hit)
        return blocked

    async def _engines_running(self) -> bool:
        found = await self._gather(*(self._live_pid(h.name) for h in self.profile.hosts.values()))
        return any(isinstance(pid, int) for pid in found)

    async def _end_stale_store(self) -> None:
        """A store left running by an earlier run whose engines are all gone: end it, so its port is free."""
        host = self.profile.store_host.name
        pid = await self._live_pid(STORE, host)
        if pid is None:
            return
        await self._signal_quietly(host, pid, "TERM")
        for _ in range(50):
            if await self._live_pid(STORE, host) is None:
                return
            await asyncio.sleep(0.1)
        await self._signal_quietly(host, pid, "KILL")

    async def _live_pid(self, name: str, host: str | None = None) -> int | None:
        """The pid recorded for a node (or the store) if that process still runs; None otherwise."""
        t = self.transport(host or name)
        try:
            text = await t.read_text(self._path(name, C.PID))
            pid = int(text.strip()) if text and text.strip().isdigit() else None
            return pid if pid is not None and pid > 1 and await t.alive(pid, C.TAG) else None
        except TransportError:
            return None

    async def attach(self, *, steer_store: bool = True) -> None:
        """Re-attach to a running cluster from its pid files: catch up on every events file, then follow.

        steer_store: watch the store and restart it if it dies (the dashboard, --headless); a one-shot command
        (`status`, `kill`...) only looks at whether it runs."""
        await self._gather(*(self._attach_node(h) for h in self.profile.hosts.values()))
        self._watch_others()
        self._store_pid = await self._live_pid(STORE, self.profile.store_host.name)
        if self._store_pid is not None:
            self.fleet.set_store("up", None, pid=self._store_pid)
        elif any(p.pid is not None and not p.done.is_set() for p in self._procs.values()):
            self.fleet.set_store("down", "not running while engines are")
        self._watch_health()
        if not steer_store:
            return
        self._store_bind_used = await self._store_bind()
        if self._store_pid is None and self.fleet.store.state == "down":
            await self._restart_store("found dead at attach")  # the store this run started: bring it back
            self._store_task = asyncio.ensure_future(self._watch_store(ready=False, had_store=True))
        elif self._store_pid is not None:
            self._store_task = asyncio.ensure_future(self._watch_store(ready=True))

    async def _attach_node(self, host: HostSpec) -> None:
        name, t = host.name, self.transport(host.name)
        try:
            text = await t.read_text(self._path(name, C.PID))
        except TransportError as e:
            # the host is down as the console comes up: say so, and attach once it answers again
            self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
            if name not in self._retries or self._retries[name].done():
                self._retries[name] = asyncio.ensure_future(self._attach_later(host))
            return
        if not text or not text.strip().isdigit():
            self._await_others(name)  # never started here: it stays off (or standby) until a start elsewhere
            return
        proc = self._proc(name)
        proc.pid, proc.offset = int(text.strip()), 0
        self.fleet.set_state(name, NodeState.STARTING)
        await self._catch_up(name)
        try:
            running = await t.alive(proc.pid, C.TAG)
        except TransportError as e:
            self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
            running = True  # it may well run: follow it and let the watcher find out
        if running:
            self._watch(name)
        else:
            await self._settle(name)
            proc.done.set()
            self._watch(name, alive=False)  # another console may start it again

    async def _attach_later(self, host: HostSpec) -> None:
        for failures in itertools.count():
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
            try:
                await self.transport(host.name).connect()
            except TransportError as e:
                self.fleet.set_state(host.name, NodeState.UNREACHABLE, str(e))
                continue
            self.fleet.set_reachable(host.name)
            if self.fleet.nodes[host.name].state is NodeState.STARTING:
                self.fleet.set_state(host.name, resting_state(host))  # until its pid file says otherwise
            await self._attach_node(host)
            return

    # ---- the store -------------------------------------------------------------------------------------------
    async def _store_bind(self) -> str:
        """The address the store listens on: [store] bind, else the one the engines dial when the store's host can
        bind it; an address from this machine's ssh_config may not be one of the host's own (NAT, a jump host),
        and then the store listens on every interface (the dashboard says so)."""
        profile, host = self.profile, self.profile.store_host
        address = profile.store_bind
        if profile.store.bind or profile.store.address or host.address or host.transport == "local":
            return address
        probe = (f"{C.q(host.python_path)} -c 'import socket,sys; socket.socket().bind((sys.argv[1], 0))' "
                 f"{C.q(address)}")
        rc, _, _ = await self.transport(host.name).run(probe)
        return address if rc == 0 else "0.0.0.0"

    async def _start_store(self) -> str | None:
        """Start the store detached and watch it; the reason if it could not start."""
        if self.profile.store.backend == "etcd":
            reason = await E.prepare(self.profile, self._etcd)
            self._watch_health()
            return reason
        host = self.profile.store_host
        t = self.transport(host.name)
        try:
            reason = await t.preflight()
            if reason is None:
                bind = await self._store_bind()
                self.fleet.set_store("starting", None, address=f"{self.profile.store_address}:{self.profile.store.port}",
                                     bind=None if bind == self.profile.store_address else bind)
                self._store_pid = await t.start_detached(store_argv(self.profile, bind), self.node_dir(STORE),
                                                         env=host.env)
                self._store_bind_used = bind
        except TransportError as e:
            reason = str(e)
        if reason is not None:
            self.fleet.set_store("down", f"could not start on {host.name}: {reason}")
            return f"store on {host.name} could not start: {reason}"
        self._store_task = asyncio.ensure_future(self._watch_store(ready=False))
        return None

    async def _watch_store(self, ready: bool, had_store: bool = False) -> None:
        """Follow the store: its ready line, its probe's samples, its death. Dead before it was ever ready: no mesh
        can form, fail the nodes (_store_failed). Dead after: the console restarts it (the engines wait for it)."""
        t = self.transport(self.profile.store_host.name)
        offset = 0  # of the store's events file; restarts append to it
        ever_ready = ready or had_store  # once the run had a store, a death is restarted, never a reason to fail
        if ready:  # attached to a running store: only what it writes from now on, and a probe of our own
            _, offset = await t.read_from(self._path(STORE, C.EVENTS), 0)  # small: ready, stopped, warnings
            await self._start_probe()
        while True:
            try:
                lines, offset = await t.read_from(self._path(STORE, C.EVENTS), offset)
                for line in lines:
                    was_up = self.fleet.store.state == "up"
                    self.fleet.ingest_store(line)
                    if not was_up and self.fleet.store.state == "up":
                        ready = ever_ready = True
                        await self._start_probe()
                sample = await t.read_text(self._path(PROBE, HEALTH))
                if sample:
                    self.fleet.ingest_store(sample)
                if self._stopping or self._closed or self._store_pid is None:
                    return  # stop() ends it, and says so; close() leaves it running
                if not await t.alive(self._store_pid, C.TAG):
                    await asyncio.sleep(SETTLE_S)
                    log = (await t.last_lines(self._path(STORE, C.LOG), 3)).strip().splitlines()
                    reason = f"store exited: {log[-1] if log else 'no output'}"
                    if not ever_ready:
                        self.fleet.set_store("down", reason)
                        self._store_failed(reason)
                        return
                    if self._stopping:
                        self.fleet.set_store("stopped", None)
                        return
                    await self._restart_store(reason)
                    ready = False
            except TransportError as e:  # the node watchers report the link; say it here too, and keep looking
                if self.fleet.store.state == "up":
                    self.fleet.set_store("unreachable", str(e))
            await asyncio.sleep(self.profile.console.poll_interval)

    async def _restart_store(self, reason: str) -> None:
        """The store died after it was ready: start it again where it was (its events file appended), with backoff
        between failed tries, until it runs. Its keys are gone; the engines re-form the run with their state."""
        host = self.profile.store_host
        self.fleet.set_store("down", f"{reason}; restarting it")
        probe = await self._live_pid(PROBE, host.name)
        if probe is not None:  # it watched the dead store and ends by itself; do not let it block the new one's
            await self._signal_quietly(host.name, probe, "TERM")
        try:
            await self.transport(host.name).remove(self._path(PROBE, HEALTH))  # the dead store's last sample
        except TransportError:
            pass  # the restart below says whether the host answers
        for failures in itertools.count():
            if self._stopping or self._closed:
                return
            try:
                self._store_pid = await self.transport(host.name).start_detached(
                    store_argv(self.profile, self._store_bind_used), self.node_dir(STORE), env=host.env, append=True)
            except TransportError as e:
                self.fleet.set_store("down", f"{reason}; restart {failures + 1} failed: {e} (check {host.name}; "
                                             f"the console keeps trying)")
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                continue
            self.fleet.set_store("restarting", f"after: {reason}", restarts=self.fleet.store.restarts + 1,
                                 pid=self._store_pid)
            return

    async def _start_probe(self) -> None:
        """The health probe beside the store (engine/store/probe.py); it ends when the store does. One per store:
        a console that attaches again finds the one already running."""
        host = self.profile.store_host
        if await self._live_pid(PROBE, host.name) is not None:
            return
        argv = [host.python_path, "-m", "engine.store.probe", self._store_bind_used or self.profile.store_bind,
                str(self.profile.store.port), "--store-pid", str(self._store_pid),
                "--interval", str(self.profile.console.poll_interval * 2),
                "--out", self._path(PROBE, HEALTH)]
        try:
            await self.transport(host.name).start_detached(argv, self.node_dir(PROBE), env=host.env, append=True)
        except TransportError as e:
            self.fleet.store.reason = f"no health probe: {e}"

    def _watch_health(self) -> None:
        """etcd: poll the members (up, leader) for the header, every console poll interval."""
        if self.profile.store.backend != "etcd" or self._health_task is not None:
            return

        async def poll() -> None:
            while True:
                self.fleet.store_status = await E.health_label(self.profile)
                await asyncio.sleep(max(1.0, self.profile.console.poll_interval))
        self._health_task = asyncio.ensure_future(poll())

    def _store_failed(self, reason: str) -> None:
        """The store died before it was ready: no mesh can form, so fail (and end) every node started with it."""
        self._store_error = reason
        for name, proc in self._procs.items():
            if proc.pid is None or proc.done.is_set():
                continue
            self.fleet.set_state(name, NodeState.FAILED, reason)
            proc.killed = True
            asyncio.ensure_future(self._signal_quietly(name, proc.pid, "KILL"))

    # ---- one node ----------------------------------------------------------------------------------------------
    async def _launch(self, host: HostSpec, append: bool = False) -> bool:
        """Check the host, start the engine detached, watch it. False (and a node state) if it could not start."""
        name, t = host.name, self.transport(host.name)
        # GLOBAL_RANK / GLOBAL_WORLD_SIZE shard the data by node: a host's place in the profile, standbys included,
        # so every host keeps its own shard however the cluster grows and shrinks
        rank, world_size = list(self.profile.hosts).index(name), len(self.profile.hosts)
        old = self._procs.get(name)
        if old is not None and old.watcher is not None and old.done.is_set():
            old.watcher.cancel()  # it only waits for a start by another console: this one is ours
        append = append and old is not None and old.pid is not None  # a restart continues the file it followed
        self.fleet.set_state(name, NodeState.STARTING)
        try:
            reason = await t.preflight(self.profile.engine.config)
            if reason is not None:
                self.fleet.set_state(name, NodeState.FAILED, reason)
                self._await_others(name)
                return False
            for stale in (C.DRAIN, KILLED):  # a drain file left from before would drain it at once
                await t.remove(self._path(name, stale))
            if self._etcd is not None:  # the run's client certificate, mode 0600, in the node's folder
                await self._etcd.hand_client_certs(name, E.client_pki_dir(self.profile, name))
            argv = engine_argv(self.profile, host)
            pid = await t.start_detached(argv, self.node_dir(name),
                                         env=engine_env(self.profile, host, rank, world_size), append=append)
        except TransportError as e:
            self.fleet.set_state(name, NodeState.UNREACHABLE if e.link else NodeState.FAILED, str(e))
            self._await_others(name)
            return False
        offset = old.offset if append and old is not None else 0  # else a fresh file, read from its start
        self._procs[name] = _Proc(pid=pid, offset=offset, killed=self._store_error is not None)
        if self._store_error is not None:  # the store died while this one was starting
            self.fleet.set_state(name, NodeState.FAILED, self._store_error)
            await self._signal_quietly(name, pid, "KILL")
        node = self.fleet.nodes[name]
        node.command, node.overrides = shlex.join(argv), engine_overrides(self.profile, host)  # the detail view
        self.fleet.note(name, f"started pid {pid}")
        self._watch(name)
        return True

    def _watch(self, name: str, alive: bool = True) -> None:
        """Follow the node's process (alive), or wait for one to appear in its pid file (a start by another
        console) and follow that."""
        proc = self._proc(name)
        if alive:
            proc.done.clear()
        proc.watcher = asyncio.ensure_future(self._watcher(name, proc, alive))

    def _watch_others(self) -> None:
        """Hosts this console runs nothing on (off, standby, failed to start, unreachable at attach): notice a
        process another console starts there. A done _Proc without a pid is what restart/add expect of a free node."""
        for name in self.profile.hosts:
            if name not in self._procs and name not in self._retries:
                self._await_others(name)

    def _await_others(self, name: str) -> None:
        """Nothing of this console's runs on the node: watch its pid file for a process another console starts."""
        proc = self._proc(name)
        proc.done.set()
        self._watch(name, alive=False)

    async def _watcher(self, name: str, proc: _Proc, alive: bool = True) -> None:
        while True:
            if alive:
                await self._follow_to_end(name, proc)
            if not await self._next_process(name, proc):
                return
            alive = await self._adopted_alive(name, proc)

    async def _next_process(self, name: str, proc: _Proc) -> bool:
        """Wait until the node's pid file names another process than the one followed (another console started
        it). False once this console starts one itself, stops the run, or closes."""
        t = self.transport(name)
        while True:
            await asyncio.sleep(self.profile.console.poll_interval)
            if self._closed or self._stopping or self._procs.get(name) is not proc:
                return False
            try:
                text = await t.read_text(self._path(name, C.PID))
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

    async def _adopted_alive(self, name: str, proc: _Proc) -> bool:
        """A process started by another console: read its events from where this console stopped (from the top if
        the file was started anew), and say whether it still runs; one already gone is settled at once."""
        t = self.transport(name)
        self.fleet.set_state(name, NodeState.STARTING, f"started by another console (pid {proc.pid})")
        try:
            size = await t.size(self._path(name, C.EVENTS))
            if size is not None and size < proc.offset:
                proc.offset = 0  # a fresh file (a fresh start archived the old one)
            running = await t.alive(proc.pid, C.TAG)  # type: ignore[arg-type]
        except TransportError as e:
            self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
            running = True  # it may well run: follow it and let the watcher find out
        if running:
            proc.done.clear()
            return True
        try:
            await self._catch_up(name)
            await self._settle(name)
        except TransportError as e:
            self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
        return False

    async def _follow_to_end(self, name: str, proc: _Proc) -> None:
        """Follow the events file until the process is gone, then settle the node; `done` is set at the end."""
        follow = asyncio.ensure_future(self._follow(name, proc))
        try:
            await self._until_gone(name, proc)
        finally:
            follow.cancel()
            await asyncio.gather(follow, return_exceptions=True)
        try:
            await asyncio.sleep(SETTLE_S)
            await self._catch_up(name)
            await self._settle(name)
        except TransportError as e:  # the link went as the process did: say so rather than leave a stale state
            self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
        finally:
            proc.done.set()

    async def _follow(self, name: str, proc: _Proc) -> None:
        """Feed the events file into the fleet; after a dropped link, re-tail from the last offset."""
        t, failures = self.transport(name), 0
        path = self._path(name, C.EVENTS)
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
                self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
                failures += 1
            finally:
                await tail.aclose()
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1] if failures else 0.1)

    async def _until_gone(self, name: str, proc: _Proc) -> None:
        t = self.transport(name)
        assert proc.pid is not None
        while True:
            await asyncio.sleep(self.profile.console.poll_interval)
            try:
                if not await t.alive(proc.pid, C.TAG):
                    return
            except TransportError:
                continue  # unreachable is the follower's to report; the engine may well run on

    async def _catch_up(self, name: str) -> None:
        """Ingest what the events file holds beyond the offset (attach, or after the process ended)."""
        proc = self._proc(name)
        try:
            lines, proc.offset = await self.transport(name).read_from(self._path(name, C.EVENTS), proc.offset)
        except TransportError as e:
            self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
            return
        for line in lines:
            self.fleet.ingest(name, line)

    async def _settle(self, name: str) -> None:
        """The process is gone: decide its final state from what is known, most specific first."""
        node, proc, t = self.fleet.nodes[name], self._proc(name), self.transport(name)
        if proc.killed:
            if node.state is not NodeState.FAILED:  # a store failure already said why
                self.fleet.set_state(name, NodeState.DEAD, "killed by the operator (SIGKILL to its process group)")
            return
        if node.engine_state in (NodeState.LEFT, NodeState.FAILED) and (node.state is not NodeState.DEAD
                                                                         or self.fleet.process_ended(name)):
            return  # the engine said how it ended (run_end / drained); a mesh "dead" after that is moot
        try:
            rc = await t.read_text(self._path(name, C.RC))
            log = (await t.last_lines(self._path(name, C.LOG), 3)).strip().splitlines()
            killed = await t.read_text(self._path(name, KILLED)) is not None
        except TransportError as e:
            self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
            return
        if killed and rc is None:
            self.fleet.set_state(name, NodeState.DEAD, "killed by the operator (SIGKILL to its process group)")
            return
        last = log[-1] if log else "no output"
        status = rc.strip() if rc and rc.strip().lstrip("-").isdigit() else None
        if status is None:
            self.fleet.set_state(name, NodeState.DEAD, f"process gone without an exit status (killed?): {last}")
        elif status == "0":
            self.fleet.set_state(name, NodeState.LEFT, "stopped" if proc.stopping else "exited")
        else:
            self.fleet.set_state(name, NodeState.FAILED, f"exited with status {status}: {last}")

    async def _signal_quietly(self, name: str, pid: int, sig: str) -> bool:
        try:
            return await self.transport(name).signal(pid, sig, group=True)
        except TransportError as e:
            self.fleet.note(name, f"{sig} failed: {e}")
            return False

    # ---- actions ---------------------------------------------------------------------------------------------
    async def drain(self, name: str) -> Outcome:
        """Touch the node's drain file: the engine finishes its outer round and leaves."""
        if name not in self.profile.hosts:
            return Outcome(False, f"no node named {name!r}")
        try:
            await self.transport(name).touch(self._path(name, C.DRAIN))
        except TransportError as e:
            self.fleet.set_state(name, NodeState.UNREACHABLE, str(e))
            return Outcome(False, f"{name}: drain failed: {e}")
        self.fleet.note(name, "drain requested")
        return Outcome(True, f"{name}: drain requested")

    async def kill(self, name: str) -> Outcome:
        """SIGKILL the node's whole process group (the engine and any workers it forked)."""
        if name not in self.profile.hosts:
            return Outcome(False, f"no node named {name!r}")
        proc = self._proc(name)
        pid = proc.pid or await self._live_pid(name)
        if pid is None:
            return Outcome(False, f"{name}: not running")
        proc.killed = True
        try:
            await self.transport(name).touch(self._path(name, KILLED))
        except TransportError:
            pass  # the kill itself will say whether the host can be reached
        if not await self._signal_quietly(name, pid, "KILL"):
            return Outcome(False, f"{name}: kill failed (already gone, or unreachable)")
        self.fleet.set_state(name, NodeState.DEAD, "killed by the operator (SIGKILL to its process group)")
        return Outcome(True, f"{name}: killed")

    async def restart(self, name: str) -> Outcome:
        """Start a dead, failed or left node again (its events file is appended to)."""
        host = self.profile.hosts.get(name)
        if host is None:
            return Outcome(False, f"no node named {name!r}")
        proc = self._procs.get(name)
        if proc is not None and proc.watcher is not None and not proc.done.is_set():
            return Outcome(False, f"{name}: still running (kill or drain it first)")
        if await self._live_pid(name) is not None:
            return Outcome(False, f"{name}: still running (kill or drain it first)")
        ok = await self._launch(host, append=True)
        if not ok:
            return Outcome(False, f"{name}: could not restart: {self.fleet.nodes[name].reason}")
        return Outcome(True, f"{name}: restarted")

    async def add(self, target: str) -> Outcome:
        """Start a standby (or stopped) profile host, or a new `[user@]address[:port]` written into the profile."""
        if target not in self.profile.hosts:
            try:
                target = self._add_to_profile(target)
            except (ProfileError, ValueError, OSError) as e:
                self.fleet.add_node(target, target, NodeState.FAILED)
                self.fleet.set_state(target, NodeState.FAILED, f"cannot add: {e}")
                return Outcome(False, f"{target}: cannot add: {e}")
        if self._procs.get(target) and not self._procs[target].done.is_set():
            return Outcome(False, f"{target}: already running")
        started = await self.restart(target)
        return Outcome(started.ok, started.message.replace("restarted", "added", 1))

    def _add_to_profile(self, target: str) -> str:
        parts = split_target(target)
        if parts is None:
            raise ValueError(f"not a host name or [user@]address[:port]: {target!r}")
        user, name, port = parts
        if name in self.profile.hosts:
            return name
        # a new address is another machine: reached over SSH, whatever [defaults] says for the others
        fields = {"transport": "ssh", "address": name, "user": user, "port": port}
        self.profile = add_host(self.profile.path, name, **fields)
        self.fleet.add_node(name, _host_label(self.profile.hosts[name]), NodeState.STANDBY)
        self.fleet.note(name, f"added to {self.profile.path}")
        return name

    async def stop(self) -> Outcome:
        """TERM every engine's group (each checkpoints and ends), KILL what outlives stop_timeout, then the store."""
        self._stopping = True  # the store ends on purpose: its watcher must not restart it
        running = {n: p for n, p in self._procs.items() if p.pid is not None and not p.done.is_set()}
        for proc in running.values():
            proc.stopping = True
        await self._gather(*(self._signal_quietly(n, p.pid, "TERM") for n, p in running.items()))  # type: ignore
        waits = [p.done.wait() for p in running.values()]
        try:
            await asyncio.wait_for(asyncio.gather(*waits), self.profile.console.stop_timeout)
        except asyncio.TimeoutError:
            await self._gather(*(self._signal_quietly(n, p.pid, "KILL")  # type: ignore[arg-type]
                                 for n, p in running.items() if not p.done.is_set()))
        store = self._store_pid or await self._live_pid(STORE, self.profile.store_host.name)
        if store is not None:
            await self._signal_quietly(self.profile.store_host.name, store, "TERM")
            self._store_pid = None
            self.fleet.set_store("stopped", None)
        left = await self._etcd.stop() if self._etcd is not None else []
        return Outcome(True, f"stopped {len(running)} node(s)" + (f"; etcd: {'; '.join(left)}" if left else ""))

    def running(self) -> list[str]:
        """The nodes whose process the console follows and has not seen end (a mesh "dead" label is not an end)."""
        return [n for n, p in self._procs.items() if p.pid is not None and not p.done.is_set()]

    async def status(self) -> Any:
        """Refresh what is known (liveness of each started node) and return the fleet's summary."""
        await self._gather(*(self._poke(name, proc) for name, proc in self._procs.items()))
        return self.fleet.summary()

    async def _poke(self, name: str, proc: _Proc) -> None:
        if proc.pid is None or proc.done.is_set():
            return
        try:
            gone = not await self.transport(name).alive(proc.pid, C.TAG)
        except TransportError:
            return
        if gone and proc.watcher is not None:
            try:  # let its watcher settle it (read the last lines, the exit status)
                await asyncio.wait_for(asyncio.shield(proc.done.wait()), self.profile.console.poll_interval * 3 + 5)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        """Stop watching and drop connections. The engines and the store keep running."""
        self._closed = True  # the store's watcher ends at its next turn even if a cancellation is lost
        tasks = [p.watcher for p in self._procs.values() if p.watcher is not None] + list(self._retries.values())
        if self._store_task is not None:
            tasks.append(self._store_task)
        if self._health_task is not None:
            tasks.append(self._health_task)
        for task in tasks:
            task.cancel()
        if tasks:
            # bounded: a cancellation that lands as a transport call completes can be lost (asyncio.wait_for before
            # Python 3.12); a watcher that outlives this is cancelled again with its connection closed under it
            _, late = await asyncio.wait(tasks, timeout=self.profile.console.stop_timeout)
            for task in late:
                task.cancel()
        await asyncio.gather(*(t.close() for t in self._transports.values()), return_exceptions=True)

    async def _gather(self, *coros: Any) -> list[Any]:
        """Fan out; a bug in one branch is reported, not raised, so the other nodes go on."""
        results = await asyncio.gather(*coros, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                for host in self.profile.active_hosts():
                    self.fleet.note(host.name, f"console error: {type(result).__name__}: {result}")
        return results
