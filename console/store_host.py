"""The membership store's lifecycle on its host: start, watch, restart, probe, health, stop.

    store = StoreHost(hosts, on_failed=watchers.fail_all)
    reason = await store.start()         # None, or why it could not start (then no node starts)
    await store.attach(steer=True, engines_running=...)   # a console that comes back to a running cluster
    left, said = await store.stop()      # end the store and its probe, waited for (and the etcd members)

The store runs detached under RUN_DIR/_store/ on the profile's store host; its health probe (engine/store/probe.py)
runs beside it under RUN_DIR/_store_probe/ and writes one sample, health.json, which the watcher reads into the
fleet with the store's own events. With store.backend etcd the members are the business of console/etcd.py; here
only their health is polled for the header.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import time
from typing import Awaitable, Callable, Sequence

from console import etcd as E
from console.hosts import BACKOFF_S, HEALTH, PROBE, SETTLE_S, STOPPED, STORE, Hosts
from console.launch import probe_argv, store_argv
from console.profile import Profile, key_where
from console.transport import TransportError, last_said
from console.transport import commands as C

OWNER = "owner"  # in the store's folder: which console's profile started it (owner_of)
STORE_READY_S = 60.0  # how long a store started for a restart may take to say ready (its imports, a loaded host)


class StoreHost:
    def __init__(self, hosts: Hosts, on_failed: Callable[[str], None]):
        self.hosts = hosts
        self.fleet = hosts.fleet
        self._on_failed = on_failed  # the store died before it was ready: the nodes started with it must fail
        self.pid: int | None = None
        self.task: asyncio.Task | None = None
        self.error: str | None = None  # why it died before it was ever ready: a node started after that fails too
        self.bind_used: str | None = None  # what the running store was started to listen on
        self.health_task: asyncio.Task | None = None
        self._ensuring = asyncio.Lock()  # two restarts at once (marked nodes, r) start one store, not two
        # held while a store is being started after a death: stop() waits for it, so a store whose start was in
        # flight when the run was stopped is found and ended (it was left running: the stop had looked already)
        self._restarting = asyncio.Lock()
        # the etcd members this console runs (store.backend etcd with etcd_hosts), else None
        self.etcd = E.cluster_of(hosts.profile, hosts.transport, E.pki_root(hosts.profile))

    @property
    def profile(self) -> Profile:
        return self.hosts.profile

    async def attach(self, *, steer: bool, engines_running: bool) -> None:
        """A console that comes back: find the store from its pid file. steer: watch it, and restart it if it is
        dead while engines run (they wait for it); else only say whether it runs. On etcd there is no such store:
        the members answer for themselves (watch_health polls them for the header)."""
        if self.profile.store.backend == "etcd":
            self.watch_health()
            return
        self.pid = await self.hosts.live_pid(STORE, self.profile.store_host.name)
        if self.pid is not None:
            self.fleet.store.set("up", None, pid=self.pid)
        elif engines_running:
            self.fleet.store.set("down", "not running while engines are")
        self.watch_health()
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
        """A store left running by an earlier run whose engines are all gone: end it, so its port is free (on etcd,
        the members this console runs: the preflight checks their ports before start would end them). A store that
        another profile started in this run dir is not this profile's to end (its engines are not this profile's
        nodes, so nothing here says they are gone): the reason the start must not go on, else None."""
        if self.profile.store.backend == "etcd":
            if self.etcd is not None:
                await self.etcd.stop()
            return None
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
        if profile.store.bind or profile.store.address or host.address or host.transport == "local":
            return address
        code = ("import socket,sys; f,_,_,_,a=socket.getaddrinfo(sys.argv[1],0,0,socket.SOCK_STREAM)[0]; "
                "socket.socket(f).bind(a)")
        rc, _, _ = await self.hosts.transport(host.name).run(f"{C.q(host.python_path)} -c {C.q(code)} "
                                                             f"{C.q(address)}")
        return address if rc == 0 else "::" if ":" in address else "0.0.0.0"  # every interface, of its family

    async def unstartable(self, hosts: Sequence[str]) -> list[str]:
        """What would make the store (or etcd) fail once started, checked before a start moves or starts anything
        (--no-check skips the preflight, not this): one `FILE:LINE: KEY: ...` line each, naming the value and the
        host; [] when nothing was found. tcp: the store's host runs its python and can listen on the store's port;
        etcd run by the console: every member's ports are free; etcd that runs already: the client certificate
        files are readable here (the console probes etcd with them) and on each host in `hosts` (its engine)."""
        s = self.profile.store
        try:
            if s.backend == "tcp":
                return await self._tcp_unstartable()
            if s.etcd_hosts:
                members = E.plan_members(self.profile)
                binds = [(m.host, m.address, port, key, f"etcd member {m.name}" + (f" ({key} + {2 * i})" if i else ""))
                         for i, m in enumerate(members)
                         for port, key in ((m.client_port, "etcd_client_port"), (m.peer_port, "etcd_peer_port"))]
                names = list(dict.fromkeys(m.host for m in members))
                found = await asyncio.gather(*(self._bind_errors(host, [(a, p, k, n) for h, a, p, k, n in binds
                                                                        if h == host]) for host in names),
                                             *(self._etcd_missing(host) for host in names))
                return [line for lines in found for line in lines]
            return await E.tls_unreadable(self.profile, self.hosts.transport, hosts)
        except TransportError as e:  # the host does not answer: nothing of the run can start there
            at = key_where(self.profile, ("store", "host" if s.backend == "tcp" else "backend"), ("store",))
            return [f"{at}: the store's host cannot be asked before the start: {e}"]

    async def _tcp_unstartable(self) -> list[str]:
        host = self.profile.store_host
        reason = await self.hosts.transport(host.name).preflight()
        if reason is not None:
            at = key_where(self.profile, ("store", "host"), ("store",))
            return [f"{at}: the store's host {host.name} cannot run it: {reason}"]
        return await self._bind_errors(host.name, [(await self.bind(), self.profile.store.port, "port", "the store")])

    async def _etcd_missing(self, name: str) -> list[str]:
        """The etcd binary runs on member host `name` (its workdir's PATH, as the member will start there)."""
        binary, host = self.profile.store.etcd_binary, self.profile.hosts[name]
        rc, _, _ = await self.hosts.transport(name).run(f"cd {C.qpath(host.workdir)} 2>/dev/null; "
                                                        f"command -v {C.qpath(binary)} >/dev/null")
        if rc == 0:
            return []
        at = key_where(self.profile, ("store", "etcd_binary"), ("store", "etcd_hosts"))
        return [f"{at}: {binary} is not found on {name} (an etcd member runs there; Debian: apt install etcd-server, "
                f"or set store.etcd_binary to its path)"]

    async def _bind_errors(self, name: str, binds: Sequence[tuple[str, int, str, str]]) -> list[str]:
        """Whether host `name` can listen on each (address, port) now, as the store and etcd will; a line per one
        it cannot, at the profile key that sets it."""
        host = self.profile.hosts[name]
        args = " ".join(f"{C.q(a)} {p}" for a, p, _, _ in binds)
        rc, out, err = await self.hosts.transport(name).run(
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
                keys = [k for k in ("bind", "address") if getattr(self.profile.store, k)] if key == "port" else []
                at = key_where(self.profile, ("store", keys[0]) if keys else ("hosts", name, "address"),
                               ("hosts", name))
                lines.append(f"{at}: {address} is not an address of {name} ({what} cannot listen on it: {error})")
            else:
                at = key_where(self.profile, ("store", key), ("store",))
                lines.append(f"{at}: {port} is taken on {name} ({what} cannot listen on {address}:{port}: {error}); "
                             f"end what listens there (ss -ltnp 'sport = :{port}') or choose another store.{key}")
        return lines

    async def ensure(self, engines_running: Callable[[], Awaitable[bool]]) -> tuple[bool, str | None]:
        """Before a node starts alone (restart, add): the store it dials runs. One that does not (the run ended, or
        its start was refused) is started when no engine of the run runs, and waited for until it is ready; while
        engines run without it, the node is refused (they wait for a store of their run, with its keys). (whether
        a store was started now, None or why the node must not start). On etcd the members answer for themselves."""
        if self.profile.store.backend != "tcp":
            return False, None
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
        if self.profile.store.backend == "etcd":
            reason = await E.prepare(self.profile, self.etcd)
            self.watch_health()
            return reason
        host = self.profile.store_host
        t = self.hosts.transport(host.name)
        try:
            reason = await t.preflight()
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

    async def sample_once(self) -> None:
        """The probe's latest sample, read once, for a running store nobody here follows (a one-shot `status`
        showed "rtt - | - keys" beside "up")."""
        if self.profile.store.backend != "tcp" or self.fleet.store.state != "up" or self.fleet.store.rtt_ms:
            return
        try:
            sample = await self.hosts.transport(self.profile.store_host.name).read_text(self.hosts.path(PROBE, HEALTH))
        except TransportError:
            return
        if sample:
            self.fleet.store.ingest(sample)

    def watch_health(self) -> None:
        """etcd: poll the members (up, leader) for the header, every console poll interval."""
        if self.profile.store.backend != "etcd" or self.health_task is not None:
            return

        async def poll() -> None:
            while True:
                self.fleet.store_status = await E.health_label(self.profile)
                await asyncio.sleep(max(1.0, self.profile.console.poll_interval))
        self.health_task = asyncio.ensure_future(poll())

    def failed(self, reason: str) -> None:
        """The store died before it was ready: no mesh can form, so every node started with it fails (and ends)."""
        self.error = reason
        self._on_failed(reason)

    async def runs(self) -> bool:
        """Whether anything of the run's store runs: the store or its probe (tcp), a member this console runs (etcd);
        a host that cannot be asked may run it (True)."""
        try:
            if self.profile.store.backend == "tcp":
                host = self.profile.store_host.name
                return (await self.hosts.running_pid(STORE, host) is not None
                        or await self.hosts.running_pid(PROBE, host) is not None)
            return self.etcd is not None and bool(await self.etcd.running())
        except TransportError:
            return True

    async def mark_stopped(self) -> None:
        """The run's stop, said in the store's folder until a store starts again: a console watching the store does
        not restart it, and one watching a node that a stop ends settles it "stopped", whatever its exit status."""
        if self.profile.store.backend != "tcp":
            return
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
        are empty, KILL after console.stop_timeout; then the etcd members. Returns what may still run (a host that
        did not answer) and what etcd had to say."""
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
        return running, (await self.etcd.stop() if self.etcd is not None else [])

    def tasks(self) -> list[asyncio.Task]:
        return [t for t in (self.task, self.health_task) if t is not None]


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


def owner_of(profile: Profile, resolve: Callable[[str], str] = os.path.realpath) -> str:
    """This console's profile, as the store's folder records it: the machine and the profile file's resolved path
    (the same profile reached through a symlink or another relative path is the same owner)."""
    return f"{socket.gethostname()}:{resolve(profile.path)}"
