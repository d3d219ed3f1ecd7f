"""The TCP store: `python -m engine.store` on the profile's store host, and its health probe beside it.

    backend = TcpStore(profile)           # console/store/__init__.py's store_backend(profile) makes it
    backend.links()                       # what every engine dials: the store's address and port
    store = backend.host(hosts, on_failed=watchers.fail_all)
    reason = await store.start()          # None, or why it could not start (then no node starts)
    await store.attach(steer=True, engines_running=...)   # a console that comes back to a running cluster
    left, _ = await store.stop()          # end the store and its probe, waited for

The store runs detached under RUN_DIR/_store/ on the profile's store host; its health probe (engine/store/probe.py)
runs beside it under RUN_DIR/_store_probe/ and writes one sample, health.json, which the watcher reads into the
fleet with the store's own events. A store that dies after it was ready is started again (the engines wait for it).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
from typing import Awaitable, Callable, Sequence

from console.hosts import BACKOFF_S, HEALTH, PROBE, SETTLE_S, STOPPED, STORE, Hosts
from console.profile import Profile, key_where
from console.store.base import Endpoint, Server, bind_errors
from console.transport import Transport, TransportError, last_said
from console.transport import commands as C

OWNER = "owner"  # in the store's folder: which console's profile started it (owner_of)
STORE_READY_S = 60.0  # how long a store started for a restart may take to say ready (its imports, a loaded host)


def store_argv(profile: Profile, bind: str | None = None) -> list[str]:
    return [profile.store_host.python_path, "-m", "engine.store", "--host", bind or profile.store_bind,
            "--port", str(profile.store.port)]


def probe_argv(profile: Profile, bind: str | None, store_pid: int | None, out: str) -> list[str]:
    """The store's health probe: samples the store every other poll interval into `out`, ends with the store."""
    return [profile.store_host.python_path, "-m", "engine.store.probe", bind or profile.store_bind,
            str(profile.store.port), "--store-pid", str(store_pid),
            "--interval", str(profile.console.poll_interval * 2), "--out", out]


class TcpStore:
    """`python -m engine.store` on the profile's store host, dialled by every engine at its address and port."""

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

    def engine_overrides(self, node: str) -> dict[str, str]:
        return {}  # GLOBAL_ADDR and GLOBAL_PORT in the engine's environment say where it is (engine_config.py)

    def header_address(self) -> str | None:
        return f"{self.profile.store_address}:{self.profile.store.port}"

    def open_listener(self) -> str | None:
        return self.bind()  # the TCP store takes any client that reaches it

    async def client_files_unreadable(self, transport_of: Callable[[str], Transport],
                                      hosts: Sequence[str]) -> list[str]:
        return []  # no client files

    def host(self, hosts: Hosts, on_failed: Callable[[str], None]) -> TcpStoreHost:
        return TcpStoreHost(hosts, on_failed)

    def fixed_bind(self) -> str | None:
        """What the store listens on when the profile says it ([store] bind or address, the host's address, a
        local host); None when only its host can tell (TcpStoreHost.bind asks it)."""
        p = self.profile
        host = p.store_host
        if p.store.bind or p.store.address or host.address or host.transport == "local":
            return p.store_bind
        return None

    def bind(self) -> str:
        """What the store will listen on, as far as the profile tells (TcpStoreHost.bind asks the host): an
        ssh_config alias's HostName may not be an address of the host itself, and then the store listens on every
        interface."""
        return self.fixed_bind() or "0.0.0.0"


class TcpStoreHost:
    """The TCP store's life on its host: `python -m engine.store` detached under RUN_DIR/_store/, its health probe
    beside it under RUN_DIR/_store_probe/."""

    def __init__(self, hosts: Hosts, on_failed: Callable[[str], None]):
        self.hosts = hosts
        self.fleet = hosts.fleet
        self._on_failed = on_failed  # the store died before it was ready: the nodes started with it must fail
        self.pid: int | None = None
        self.task: asyncio.Task | None = None
        self.error: str | None = None  # why it died before it was ever ready: a node started after that fails too
        self.bind_used: str | None = None  # what the running store was started to listen on
        self._ensuring = asyncio.Lock()  # two restarts at once (marked nodes, r) start one store, not two
        # held while a store is being started after a death: stop() waits for it, so a store whose start was in
        # flight when the run was stopped is found and ended (it was left running: the stop had looked already)
        self._restarting = asyncio.Lock()

    @property
    def profile(self) -> Profile:
        return self.hosts.profile

    async def attach(self, *, steer: bool, engines_running: bool) -> None:
        """A console that comes back: find the store from its pid file. steer: watch it, and restart it if it is
        dead while engines run (they wait for it); else only say whether it runs."""
        self.pid = await self.hosts.live_pid(STORE, self.profile.store_host.name)
        if self.pid is not None:
            self.fleet.store.set("up", None, pid=self.pid)
        elif engines_running:
            self.fleet.store.set("down", "not running while engines are")
        if not steer:
            return
        try:
            self.bind_used = await self.bind()
        except TransportError:  # its host does not answer: the address the engines dial, until it does
            self.bind_used = self.profile.store_bind
        if self.pid is None and self.fleet.store.state == "down":
            # the store this run started: bring it back, in the background (its host may not answer for a while:
            # the attach returns, the status shows the retries, and Ctrl-C still ends the console)
            self.task = asyncio.ensure_future(self._restart_then_watch("found dead at attach"))
        elif self.pid is not None:
            self.task = asyncio.ensure_future(self.watch(ready=True))

    async def _restart_then_watch(self, reason: str) -> None:
        found = await self.restart(reason)
        await self.watch(ready=found, had_store=True)

    async def end_stale(self) -> str | None:
        """A store left running by an earlier run whose engines are all gone: end it, so its port is free. A store
        that another profile started in this run dir is not this profile's to end (its engines are not this
        profile's nodes, so nothing here says they are gone): the reason the start must not go on, else None."""
        host = self.profile.store_host.name
        pid = await self.hosts.live_pid(STORE, host)
        if pid is None:
            return None
        try:
            owner = (await self.hosts.transport(host).read_text(self.hosts.path(STORE, OWNER)) or "").strip()
        except TransportError:
            owner = ""
        # the unresolved path too: consoles before wrote the owner so
        if owner and owner not in (owner_of(self.profile), owner_of(self.profile, os.path.abspath)):
            return (f"{self.hosts.node_dir(STORE)} on {host} holds a running store started from another profile "
                    f"or machine ({owner}): two profiles cannot share [run] dir; give this one its own, or stop "
                    f"that run first (zeroband-console THAT_PROFILE stop)")
        await self.hosts.signal_quietly(host, pid, "TERM")
        for _ in range(50):
            if await self.hosts.live_pid(STORE, host) is None:
                return None
            await asyncio.sleep(0.1)
        await self.hosts.signal_quietly(host, pid, "KILL")
        return None

    async def bind(self) -> str:
        """The address the store listens on: [store] bind, else the one the engines dial when the store's host can
        bind it; an address from this machine's ssh_config may not be one of the host's own (NAT, a jump host),
        and then the store listens on every interface (the dashboard says so)."""
        profile, host = self.profile, self.profile.store_host
        address = profile.store_bind
        fixed = TcpStore(profile).fixed_bind()
        if fixed is not None:  # the profile says where it listens: nothing to ask the host
            return fixed
        code = ("import socket,sys; f,_,_,_,a=socket.getaddrinfo(sys.argv[1],0,0,socket.SOCK_STREAM)[0]; "
                "socket.socket(f).bind(a)")
        rc, _, _ = await self.hosts.transport(host.name).run(f"{C.q(host.python_path)} -c {C.q(code)} "
                                                             f"{C.q(address)}")
        return address if rc == 0 else "::" if ":" in address else "0.0.0.0"  # every interface, of its family

    async def unstartable(self, hosts: Sequence[str]) -> list[str]:
        """What would make the store fail once started, checked before a start moves or starts anything
        (--no-check skips the preflight, not this): one `FILE:LINE: KEY: ...` line each, naming the value and the
        host; [] when nothing was found. The store's host runs its python and can listen on the store's port."""
        host = self.profile.store_host
        try:
            reason = await self.hosts.transport(host.name).launch_check()
            if reason is not None:
                at = key_where(self.profile, ("store", "host"), ("store",))
                return [f"{at}: the store's host {host.name} cannot run it: {reason}"]
            return await bind_errors(self.hosts, host.name,
                                     [(await self.bind(), self.profile.store.port, "port", "the store")])
        except TransportError as e:  # the host does not answer: nothing of the run can start there
            at = key_where(self.profile, ("store", "host"), ("store",))
            return [f"{at}: the store's host cannot be asked before the start: {e}"]

    async def ensure(self, engines_running: Callable[[], Awaitable[bool]]) -> tuple[bool, str | None]:
        """Before a node starts alone (restart, add): the store it dials runs. One that does not (the run ended, or
        its start was refused) is started when no engine of the run runs, and waited for until it is ready; while
        engines run without it, the node is refused (they wait for a store of their run, with its keys). (whether
        a store was started now, None or why the node must not start)."""
        host = self.profile.store_host.name
        async with self._ensuring:
            try:
                if await self.hosts.running_pid(STORE, host) is not None:
                    return False, None
            except TransportError:
                return False, None  # cannot tell from here: the node's check (or its engine) says if it reaches it
            if await engines_running():
                return False, (f"the run's store is not running on {host} while engines of the run are (a "
                               f"dashboard on the run restarts it; or stop the run and start it again)")
            if self.task is not None and not self.task.done():
                self.task.cancel()  # the last store's watcher: this one gets its own
            self.hosts.stopping = False  # a new store, after the run's stop: its watcher must not end at once
            reason = await self.start()
            return True, reason if reason is not None else await self._until_ready()

    async def _until_ready(self) -> str | None:
        """Wait for the store just started to say it is ready (its watcher reads that line); why not, if it died
        first or stayed silent for STORE_READY_S."""
        deadline = time.monotonic() + STORE_READY_S
        while self.fleet.store.state != "up":
            if self.error is not None:
                return f"the run's store could not start: {self.error}"
            if self.task is None or self.task.done() or time.monotonic() > deadline:
                return f"the run's store did not say it was ready within {STORE_READY_S:g}s (see its engine.log)"
            await asyncio.sleep(0.1)
        return None

    async def start(self) -> str | None:
        """Start the store detached and watch it; the reason if it could not start."""
        self.error = None  # a new store: an earlier one's death before it was ready is over
        host = self.profile.store_host
        t = self.hosts.transport(host.name)
        try:
            reason = await t.launch_check()
            if reason is None:
                bind = await self.bind()
                address = f"{self.profile.store_address}:{self.profile.store.port}"
                self.fleet.store.set("starting", None, address=address,
                                     bind=None if bind == self.profile.store_address else bind)
                await t.remove(self.hosts.path(STORE, STOPPED))  # a stop of an earlier run (resumed) is over
                await t.write_text(self.hosts.path(STORE, OWNER), owner_of(self.profile))  # first: no unowned store
                self.pid = await t.start_detached(store_argv(self.profile, bind), self.hosts.node_dir(STORE),
                                                  env=host.env)
                self.bind_used = bind
        except TransportError as e:
            reason = str(e)
        if reason is not None:
            self.fleet.store.set("down", f"could not start on {host.name}: {reason}")
            return f"store on {host.name} could not start: {reason}"
        self.task = asyncio.ensure_future(self.watch(ready=False))
        return None

    async def watch(self, ready: bool, had_store: bool = False) -> None:
        """Follow the store: its ready line, its probe's samples, its death. Dead before it was ever ready: no mesh
        can form, fail the nodes (failed()). Dead after: the console restarts it (the engines wait for it)."""
        t = self.hosts.transport(self.profile.store_host.name)
        offset = 0  # of the store's events file; restarts append to it
        ever_ready = ready or had_store  # once the run had a store, a death is restarted, never a reason to fail
        if ready:  # attached to a running store: only what it writes from now on, and a probe of our own
            _, offset = await t.read_from(self.hosts.path(STORE, C.EVENTS), 0)  # small: ready, stopped, warnings
            await self._start_probe()
        while True:
            try:
                lines, offset = await t.read_from(self.hosts.path(STORE, C.EVENTS), offset)
                for line in lines:
                    was_up = self.fleet.store.state == "up"
                    self.fleet.store.ingest(line)
                    if not was_up and self.fleet.store.state == "up":
                        ready = ever_ready = True
                        await self._start_probe()
                sample = await t.read_text(self.hosts.path(PROBE, HEALTH))
                if sample:
                    self.fleet.store.ingest(sample)
                # the probe samples every other poll interval: three missed samples and a poll say it
                self.fleet.store.check_samples(self.profile.console.poll_interval * 7)
                if self.hosts.stopping or self.hosts.closed or self.pid is None:
                    return  # stop() ends it, and says so; close() leaves it running
                if not await t.alive(self.pid, C.TAG):
                    await asyncio.sleep(SETTLE_S)
                    if await t.read_text(self.hosts.path(STORE, STOPPED)) is not None:
                        self.fleet.store.set("stopped", None)  # another console's stop(): it ends the run
                        return
                    log = await last_said(t, self.hosts.path(STORE, C.LOG))
                    reason = f"store exited: {log[-1] if log else 'no output'}"
                    if not ever_ready:
                        self.fleet.store.set("down", reason)
                        self.failed(reason)
                        return
                    if self.hosts.stopping:
                        self.fleet.store.set("stopped", None)
                        return
                    await self.restart(reason)
                    ready = False
            except TransportError as e:  # the node watchers report the link; say it here too, and keep looking
                if self.fleet.store.state == "up":
                    self.fleet.store.set("unreachable", str(e))
            await asyncio.sleep(self.profile.console.poll_interval)

    async def restart(self, reason: str) -> bool:
        """The store died after it was ready: start it again where it was (its events file appended), with backoff
        between failed tries, until it runs. Its keys are gone; the engines re-form the run with their state.
        True when it was found running after all (a host that did not answer at attach): nothing was started."""
        host = self.profile.store_host
        self.fleet.store.set("down", f"{reason}; restarting it")
        probe = await self.hosts.live_pid(PROBE, host.name)
        if probe is not None:  # it watched the dead store and ends by itself; do not let it block the new one's
            await self.hosts.signal_quietly(host.name, probe, "TERM")
        try:
            await self.hosts.transport(host.name).remove(self.hosts.path(PROBE, HEALTH))  # the dead store's sample
        except TransportError:
            pass  # the restart below says whether the host answers
        for failures in itertools.count():
            async with self._restarting:
                if self.hosts.stopping or self.hosts.closed:
                    return False
                try:
                    live = await self.hosts.running_pid(STORE, host.name)
                    if live is not None:  # it ran all along: its host did not answer when it was looked for
                        self.pid = live
                        self.fleet.store.set("up", None, pid=live)
                        return True
                    self.pid = await self.hosts.transport(host.name).start_detached(
                        store_argv(self.profile, self.bind_used), self.hosts.node_dir(STORE), env=host.env,
                        append=True)
                    error = None
                except TransportError as e:
                    error = e
            if error is not None:
                self.fleet.store.set("down", f"{reason}; restart {failures + 1} failed: {error} (check "
                                             f"{host.name}; the console keeps trying)")
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                continue
            self.fleet.store.set("restarting", f"after: {reason}", restarts=self.fleet.store.restarts + 1,
                                 pid=self.pid)
            return False
        return False  # (the loop only ends by a return)

    async def _start_probe(self) -> None:
        """The health probe beside the store (engine/store/probe.py); it ends when the store does. One per store:
        a console that attaches again finds the one already running."""
        host = self.profile.store_host
        if await self.hosts.live_pid(PROBE, host.name) is not None:
            return
        argv = probe_argv(self.profile, self.bind_used, self.pid, self.hosts.path(PROBE, HEALTH))
        try:
            await self.hosts.transport(host.name).start_detached(argv, self.hosts.node_dir(PROBE), env=host.env,
                                                                 append=True)
        except TransportError as e:
            self.fleet.store.say(f"no health probe: {e}")

    async def prepare_node(self, name: str) -> None:
        return None  # the engines dial the store with nothing of their own

    async def refresh(self) -> None:
        """The probe's latest sample, read once, for a running store nobody here follows (a one-shot `status`
        showed "rtt - | - keys" beside "up")."""
        if self.fleet.store.state != "up" or self.fleet.store.rtt_ms:
            return
        try:
            sample = await self.hosts.transport(self.profile.store_host.name).read_text(self.hosts.path(PROBE, HEALTH))
        except TransportError:
            return
        if sample:
            self.fleet.store.ingest(sample)

    def failed(self, reason: str) -> None:
        """The store died before it was ready: no mesh can form, so every node started with it fails (and ends)."""
        self.error = reason
        self._on_failed(reason)

    async def runs(self) -> bool:
        """Whether anything of the run's store runs: the store or its probe; a host that cannot be asked may run it
        (True)."""
        host = self.profile.store_host.name
        try:
            return (await self.hosts.running_pid(STORE, host) is not None
                    or await self.hosts.running_pid(PROBE, host) is not None)
        except TransportError:
            return True

    async def mark_stopped(self) -> None:
        """The run's stop, said in the store's folder until a store starts again: a console watching the store does
        not restart it, and one watching a node that a stop ends settles it "stopped", whatever its exit status."""
        host = self.profile.store_host.name
        try:
            await self.hosts.transport(host).touch(self.hosts.path(STORE, STOPPED))
        except TransportError:
            pass  # the signals that follow say whether the host answers

    async def run_stopped(self) -> bool:
        """Whether a stop (this console's or another's) ended the run: its marker stays in the store's folder until
        a store starts again."""
        try:
            return await self.hosts.transport(self.profile.store_host.name).read_text(
                self.hosts.path(STORE, STOPPED)) is not None
        except TransportError:
            return False

    async def stop(self) -> tuple[list[str], list[str]]:
        """End the store and its probe (stop() has ended the engines first): TERM, wait until their process groups
        are empty, KILL after console.stop_timeout. Returns what may still run (a host that did not answer), and
        nothing to say."""
        host = self.profile.store_host.name
        async with self._restarting:  # a restart in flight ends first: its store is found below (none starts after)
            store = await self.hosts.live_pid(STORE, host)
        probe = await self.hosts.live_pid(PROBE, host)  # it ends with the store, but only at its next look
        if store is not None:  # first: a console watching the store must not take its end for a crash and restart it
            await self.mark_stopped()
        groups = [(host, pid) for pid in (store, probe) if pid is not None]
        await asyncio.gather(*(self.hosts.signal_quietly(host, pid, "TERM") for _, pid in groups))
        left, _ = await self.hosts.end_groups(groups, self.profile.console.stop_timeout)
        if store is not None:
            self.pid = None
            self.fleet.store.set("stopped", None)
        running = [f"{host}: the store's process group {pid} (no answer)" for host, pid in left]
        return running, []

    def tasks(self) -> list[asyncio.Task]:
        return [self.task] if self.task is not None else []


def owner_of(profile: Profile, resolve: Callable[[str], str] = os.path.realpath) -> str:
    """This console's profile, as the store's folder records it: the machine and the profile file's resolved path
    (the same profile reached through a symlink or another relative path is the same owner)."""
    return f"{socket.gethostname()}:{resolve(profile.path)}"
