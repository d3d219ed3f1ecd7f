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

The controller is composed of its parts, each in its own room (the arrows run one way, down this list):

    console/hosts.py        Hosts: the profile, one transport per host, the run's folders, pid files, signals
    console/launch.py       the command lines and environment each host runs (pure; console.recipes writes them too)
    console/watchers.py     Watchers: one watcher task per node follows its events and settles its final state
    console/store/          StoreHost: the store's life by its backend, TCP (start, watch, restart, probe, stop)
                            or etcd (its members, their health)
    console/attach.py       Attacher: coming back to a running cluster from its pid files
    console/node_start.py   NodeStarter: one node's launch; --resume's nodes; a fresh start's archive of the last run
    console/run_stop.py     RunStop: the run's stop (every engine, then the store), waited for on every host
    console/cluster.py      Cluster: start, the operator's actions (drain, kill, restart, add, stop), close

Hosts with nothing running at start or attach are watched too: another console may start a node there.

Nothing here raises to the caller for a node's trouble: a bad host, a refused key, a dead link, a missing python,
an engine that exits at start all become that node's state and reason, and the other nodes go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

from console.attach import Attacher
from console.control import Outcome
from console.engine_config import check_engine_config
from console.fleet import Fleet, HostState, NodeState
from console.nodes import Summary
from console.hosts import KILLED, Hosts, UnknownHost, host_label, resting_state
from console.node_start import NodeStarter
from console.exit_codes import run_outcome
from console.preflight import PreflightFailed
from console.profile import HostSpec, Profile, ProfileError
from console.run_stop import RunStop
from console.store import store_backend
from console.transport import Transport, make_transport
from console.transport.base import without_backoff
from console.transport import TransportError
from console.transport import commands as C
from console.watchers import Watchers


class StartRefused(PreflightFailed):
    """A start refused before anything was moved or started, by what no start can get past (--no-check skips the
    preflight, not this): one `FILE:LINE: KEY: ...` line each."""

    hint = ""  # no "nothing started (... check ...)" after the lines: no check would say more

    def __init__(self, lines: list[str]):
        Exception.__init__(self, " | ".join(lines))
        self.problems, self.lines = [], list(lines)


class Cluster:
    def __init__(self, profile: Profile, fleet: Fleet,
                 transports: Callable[[HostSpec], Transport] = make_transport, *, resume: bool = False,
                 preflight: bool = False):
        self.resume = resume  # start() continues the previous run's checkpoints instead of archiving them
        self.preflight = preflight  # start() and add() check their hosts first (console/preflight/)
        self.fleet = fleet
        self._hosts = Hosts(profile, fleet, transports)
        self._watchers = Watchers(self._hosts, run_stopped=lambda: self._store.run_stopped())
        self._procs = self._watchers.procs  # the same dict: what the console knows of each node's process
        self._starting: set[str] = set()  # nodes an add or restart is starting now
        self._stop_under_way = False  # stop() runs: an add or restart now would start what it is ending
        self._store_started_for: str | None = None  # the node an add started the run's store for
        self.warnings: list[str] = []  # what the preflight warned of (rules.exposure_warning), once each
        backend = store_backend(profile)
        self._store = backend.host(self._hosts, on_failed=self._watchers.fail_all)
        self._attacher = Attacher(self._hosts, self._watchers, self._store)
        self._starter = NodeStarter(self._hosts, self._watchers, self._store)
        self._stopper = RunStop(self._hosts, self._watchers, self._store, self._attacher)
        fleet.store.address = backend.header_address()  # etcd: none, the members' health (fleet.store_status)
        for host in profile.hosts.values():
            fleet.add_node(host.name, host_label(host), resting_state(host))

    @property
    def profile(self) -> Profile:
        """The profile as it stands (`add` of a new address writes it into the file and replaces it)."""
        return self._hosts.profile

    def node_dir(self, name: str) -> str:
        return self._hosts.node_dir(name)

    def transport(self, name: str) -> Transport:
        """One transport (one connection) per profile host, made on first use."""
        return self._hosts.transport(name)

    # ---- start and attach --------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the store and every non-standby node; attach instead if any engine of the profile already runs.

        Only hosts that answer can be checked: after an outage, `attach()` (--attach) is the safe way back.
        """
        try:
            check_engine_config(self.profile)  # the whole profile is valid before anything starts
        except ProfileError as e:
            for host in self.profile.active_hosts():
                self.fleet.set_state(host.name, HostState.FAILED, str(e))
            return
        self._hosts.stopping = False
        if await self._attacher.engines_running():
            await self.attach()
            return
        reason = await self._store.end_stale()
        if reason is not None:  # another profile's run: nothing of this one starts, nothing of that one is touched
            for host in self.profile.active_hosts():
                self.fleet.set_state(host.name, HostState.FAILED, reason)
            return
        starting = await self._starter.resumed_nodes() if self.resume else self.profile.active_hosts()
        if self.preflight:  # a problem on any host: nothing starts anywhere
            await self._check_before("start", hosts=[h.name for h in starting])
        # what would end the start at once (the store's port taken, a certificate file missing): before a previous
        # run's checkpoints are moved to _archive/ or anything starts, whether or not the preflight ran
        refused = await self._store.unstartable([h.name for h in starting])
        if refused:
            for host in starting:
                self.fleet.set_state(host.name, HostState.FAILED, refused[0])
            raise StartRefused(refused)
        blocked = set() if self.resume else await self._starter.archive_previous()
        active = [h for h in starting if h.name not in blocked]
        if not active:
            return
        reason = await self._store.start()
        if reason is not None:  # no store, no mesh: say so on every node and start none
            for host in active:
                self.fleet.set_state(host.name, HostState.FAILED, reason)
            return
        await self._hosts.gather(*(self._starter.launch(h, fresh=not self.resume) for h in active))
        self._watchers.watch_others(self._attacher.retries)

    async def _check_before(self, mode: str, host: str | None = None, hosts: list[str] | None = None) -> None:
        """The preflight of the hosts a start (or an add) uses; PreflightFailed, with each host's node failed and
        its lines in the node's log, when anything is wrong (docs/operations.md, "Before the first run")."""
        from console.preflight.runner import mark_refused, preflight

        report = await preflight(self.profile, self.transport, mode=mode, hosts=[host] if host else hosts)
        for warning in report.warnings:  # listeners beyond a private network: said once, in the first host's log
            if warning not in self.warnings:
                self.warnings.append(warning)
                self.fleet.note(report.plans[0].name, warning)
        if report.problems:
            mark_refused(self.fleet, report)
            raise PreflightFailed(report.problems)

    async def attach(self, *, steer_store: bool = True) -> None:
        """Re-attach to a running cluster from its pid files: catch up on every events file, then follow.

        steer_store: watch the store and restart it if it dies (the dashboard, --headless); a one-shot command
        (`status`, `kill`...) only looks at whether it runs."""
        await self._attacher.attach(steer_store=steer_store)

    def nothing_runs(self) -> str | None:
        """After attach: a line saying so when no engine of the profile runs (none followed, and no host that did
        not answer is still being asked again), else None."""
        if self.running() or any(not t.done() for t in self._attacher.retries.values()):
            return None
        if any(n.state not in (HostState.OFF, HostState.SPARE) for n in self.fleet.nodes.values()):
            return None  # a run that ended: the attach found its nodes' ends, the outcome says how it went
        return f"nothing runs for {self.profile.path} (run {self.profile.run.name})"

    # ---- actions ---------------------------------------------------------------------------------------------
    async def drain(self, name: str) -> Outcome:
        """Touch the node's drain file: the engine finishes its outer round and leaves. A node that does not run has
        nothing to drain: that is said, like kill says it, and no file is left to drain its next start at once."""
        if name not in self.profile.hosts:
            return Outcome(False, f"no node named {name!r}")
        proc = self._procs.get(name)
        try:
            if (proc is None or proc.pid is None or proc.done.is_set()) and await self._hosts.running_pid(name) is None:
                return Outcome(False, f"{name}: not running (nothing to drain)")
            await self.transport(name).touch(self._hosts.path(name, C.DRAIN))
        except TransportError as e:
            self.fleet.set_state(name, HostState.UNREACHABLE, str(e))
            return Outcome(False, f"{name}: drain failed: {e}")
        self.fleet.note(name, "drain requested")
        return Outcome(True, f"{name}: drain requested")

    async def kill(self, name: str) -> Outcome:
        """SIGKILL the node's whole process group (the engine and any workers it forked)."""
        if name not in self.profile.hosts:
            return Outcome(False, f"no node named {name!r}")
        proc = self._watchers.proc(name)
        # the group this console follows while it runs, or while anything of it runs after its wrapper ended (the
        # workers it forked); else the pid file's, if that process lives. A group that is gone is not killed
        pid = proc.pid
        if pid is not None and proc.done.is_set():
            try:
                pid = pid if await self.transport(name).group_alive(pid) else None
            except TransportError:
                pass  # cannot tell: the kill below says whether the host answers
        if pid is None:
            pid = await self._hosts.live_pid(name)
        if pid is None:
            if name in self._starting:  # its launch is under way: "not running" would be true now, false in a second
                return Outcome(False, f"{name}: being started; kill it once it runs")
            return Outcome(False, f"{name}: not running")
        proc.killed = True
        try:
            await self.transport(name).touch(self._hosts.path(name, KILLED))
        except TransportError:
            pass  # the kill itself will say whether the host can be reached
        if not await self._hosts.signal_quietly(name, pid, "KILL"):
            return Outcome(False, f"{name}: kill failed (already gone, or unreachable)")
        self.fleet.set_state(name, NodeState.DEAD, "killed by the operator (SIGKILL to its process group)")
        return Outcome(True, f"{name}: killed")

    async def restart(self, name: str) -> Outcome:
        """Start a dead, failed or left node again (its events file is appended to)."""
        host = self.profile.hosts.get(name)
        if host is None:
            return Outcome(False, f"no node named {name!r}")
        refused = self._refused(name)
        if refused is not None:
            return refused
        if name in self._starting:  # an add or restart of it is under way (its checks take seconds): one engine
            return Outcome(False, f"{name}: already being started")
        self._starting.add(name)
        try:
            return await self._restart(name, host)
        finally:
            self._starting.discard(name)

    async def _restart(self, name: str, host: HostSpec) -> Outcome:
        proc = self._procs.get(name)
        if proc is not None and proc.killed and proc.watcher is not None and not proc.done.is_set():
            # killed a moment ago (the k key, then r): its watcher sees it gone within a poll, then settles it
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.done.wait()),
                                       self.profile.console.poll_interval * 3 + 5)
        if proc is not None and proc.watcher is not None and not proc.done.is_set():
            return Outcome(False, f"{name}: still running (kill or drain it first)")
        if await self._hosts.live_pid(name) is not None:
            return Outcome(False, f"{name}: still running (kill or drain it first)")
        _, refused = await self._store_refused(name)
        if refused is not None:
            return refused
        ok = await self._starter.launch(host, append=True)
        if not ok:
            return Outcome(False, f"{name}: could not restart: {self.fleet.nodes[name].reason}")
        return Outcome(True, f"{name}: restarted")

    async def add(self, target: str) -> Outcome:
        """Start a standby (or stopped) profile host, or a new `[user@]address[:port]` written into the profile."""
        note, written = None, False
        refused = self._refused(target)
        if refused is not None:  # before the profile or any host is touched
            return refused
        if target not in self.profile.hosts:
            try:
                target, written = self._hosts.add_address(target)
                note = self._shard_overlap(target)
            except UnknownHost as e:  # a typo of a host, most likely: the profile and the table stay as they are
                return Outcome(False, str(e))
            except (ProfileError, ValueError, OSError) as e:
                self.fleet.add_node(target, target, HostState.FAILED)
                self.fleet.set_state(target, HostState.FAILED, f"cannot add: {e}")
                return Outcome(False, f"{target}: cannot add: {e}")
        if self._procs.get(target) and not self._procs[target].done.is_set():
            return Outcome(False, f"{target}: already running")
        if target in self._starting:
            return Outcome(False, f"{target}: already being started")
        if self.preflight:
            self._starting.add(target)  # a second add while this one's checks run is refused above
            try:
                _, refused = await self._store_refused(target)  # the check dials it: it must run first
                if refused is not None:
                    return await self._not_added(target, written, refused.message)
                await self._check_before("add", target)  # it must reach the running store, among the rest
            except PreflightFailed as e:
                message = "\n".join([f"{target}: not added: the preflight found {len(e.lines)} problem(s)",
                                     *e.lines])
                if written:
                    self.fleet.set_state(target, HostState.FAILED, message.splitlines()[0])
                return await self._not_added(target, written, message)
            finally:
                self._starting.discard(target)
        started = await self.restart(target)
        message = started.message.replace("restarted", "added", 1).replace("could not restart", "could not add", 1)
        if not started.ok:  # the node's row keeps why (unreachable, failed)
            return await self._not_added(target, written, message)
        self._store_started_for = None  # it runs: the store is the run's again
        return Outcome(True, f"{message}; {note}" if note else message)

    async def _store_refused(self, name: str) -> tuple[bool, Outcome | None]:
        """The store the node dials runs (started again when the run has ended, or its start was refused), or the
        node is refused: "restarted" and "added" mean the node can reach a store. (whether a store was started
        now, the refusal or None)"""
        async def engines_running() -> bool:
            return bool(self.running()) or await self._attacher.engines_running()

        started, reason = await self._store.ensure(engines_running)
        if started:
            self._store_started_for = name  # a new address that then does not start stops it again (_not_added)
        return started, None if reason is None else Outcome(False, f"{name}: not started: {reason}")

    def _refused(self, name: str) -> Outcome | None:
        """Why an add or restart of name must not start anything, or None. While stop() runs: a node started then
        could start the store again after the stop ended it, and outlive it. A run that completed: the node would
        resume at train.max_steps and end at once, leaving the store it needed running. An engine config the engines
        would refuse (a misspelt override): one `file:line: key` line, and nothing starts (the engine would die at
        once, after "added")."""
        if self._stop_under_way:
            return Outcome(False, f"{name}: the run is being stopped")
        completed = self._completed()
        if completed:  # a node started now would resume at train.max_steps and end at once, after "added"
            return Outcome(False, f"{name}: not started: run {self.profile.run.name} completed ({completed} reached "
                                  f"train.max_steps); start a new run (zeroband-console {self.profile.path}), or "
                                  f"raise train.max_steps and start it with --resume")
        try:
            check_engine_config(self.profile)
        except ProfileError as e:
            return Outcome(False, f"{name}: not started: {e}")
        return None

    def _completed(self) -> str | None:
        """The nodes that completed the run, when no node of it runs any more (else None): the run is over."""
        if run_outcome(self.fleet) is None or any(not r.done() for r in self._attacher.retries.values()):
            return None
        done = [n.name for n in self.fleet.nodes.values() if n.state is NodeState.LEFT and n.reason == "completed"]
        return ", ".join(done) or None

    async def _not_added(self, name: str, written: bool, message: str) -> Outcome:
        """A new address that did not start leaves the profile as it was: written there, a typo would be a host
        every later start checks (and fails on), and a place in every node's data shard. Its row is left "off" with
        why (it stayed "unreachable", which counts as running: a stop then exited 130), and a store started for it
        alone is stopped."""
        if self._store_started_for == name and not self.running() and self._starting <= {name}:
            await self._store.stop()
        self._store_started_for = None
        message = without_backoff(message)  # nothing retries a node that was not added
        node = self.fleet.nodes.get(name)
        why = without_backoff(node.reason) if node and node.reason else message
        if written:
            try:
                self._hosts.take_out(name)
            except (ProfileError, OSError) as e:
                return Outcome(False, f"{message}\n{name}: could not take it out of {self.profile.path} again: {e}")
            self.fleet.set_state(name, HostState.OFF, f"not added: {why.splitlines()[0]}")
            message += f"\n{name}: taken out of {self.profile.path} again"
        return Outcome(False, message)

    def _shard_overlap(self, name: str) -> str | None:
        """A node's data shard is its place among the profile's hosts (GLOBAL_RANK / GLOBAL_WORLD_SIZE): nodes that
        run read 1 of the count before `name` was added, so its sequences are also some of theirs until they
        restart. Said in its log (and by add to a shell)."""
        if not [n for n in self.running() if n != name]:
            return None
        note = (f"its data shard is 1 of {len(self.profile.hosts)}, the running nodes' 1 of "
                f"{len(self.profile.hosts) - 1}: they overlap until those restart (standby hosts in the profile grow "
                f"a run without overlap)")
        self.fleet.note(name, note)
        return note

    async def stop(self) -> Outcome:
        """TERM every engine's group (each checkpoints and ends), KILL what outlives stop_timeout, then the store and
        its probe the same way. Returns when no process of the run is left on any host that answers: every process
        group is waited for, the wrappers and whatever an engine forked included (a watcher's "done" is only the
        wrapper's end); a group a host did not answer for is named and the outcome is a failure. With nothing of the
        run running (no engine, no store, every host answered) the outcome is a failure that says so, and nothing is
        written."""
        self._stop_under_way = True
        try:
            return await self._stopper.stop()
        finally:
            self._stop_under_way = False

    def running(self) -> list[str]:
        """The nodes whose process the console follows and has not seen end (a mesh "dead" label is not an end)."""
        return self._watchers.running()

    async def status(self) -> Summary:
        """Refresh what is known (liveness of each started node) and return the fleet's summary."""
        await self._hosts.gather(*(self._watchers.poke(name, proc) for name, proc in self._procs.items()))
        await self._store.refresh()
        return self.fleet.summary()

    async def close(self) -> None:
        """Stop watching and drop connections. The engines and the store keep running."""
        self._hosts.closed = True  # the store's watcher ends at its next turn even if a cancellation is lost
        tasks = self._watchers.tasks() + list(self._attacher.retries.values()) + self._store.tasks()
        for task in tasks:
            task.cancel()
        if tasks:
            # bounded: a cancellation that lands as a transport call completes can be lost (asyncio.wait_for before
            # Python 3.12); a watcher that outlives this is cancelled again with its connection closed under it
            _, late = await asyncio.wait(tasks, timeout=self.profile.console.stop_timeout)
            for task in late:
                task.cancel()
        await self._hosts.close()
