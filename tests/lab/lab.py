"""The chaos lab run: set up hosts, start the console over SSH, inject the schedule, judge, tear everything down.

    lab = Lab(Options(seed=7, faults=9), out=Path("chaos-out"))
    verdict = lab.run()          # never leaves a namespace, a process or a temp dir behind (finally + atexit)

Each fault: inject, hold, heal, then wait (bounded by `recovery_s`) until every engine host commits an outer step
past the run's frontier at the heal. A node process that ended by itself, a run that did not move on, or a node
that did not come back is a fault NOT survived (one line saying which and why). Before the next fault the lab
repairs what is missing (restarts the store, the console, dead nodes) and says so; if even that does not bring
every node back the schedule is aborted. docs/reliability.md has the definitions and the last soak.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab import net
from lab.hosts import HostSshd, prepare_user, write_profile, write_ssh_config
from lab.schedule import KINDS, Fault, Timing, make_schedule
from lab.verdict import Verdict, judge

ROOT = Path(__file__).resolve().parents[2]
LOCK = Path("/run/zbc-lab.lock")
CLI_TIMEOUT_S = 90.0
CONSOLE_PIDS = "console.pids"
POLL_S = 0.2
ENGINE_NAMES = "abcdefghijklmnopqrstuvwxyz"


@dataclass
class Options:
    seed: int = 1
    faults: int = 9
    hosts: int = 3
    heartbeat_timeout: float = 2.0
    inner_steps: int = 3
    round_seconds: float = 0.0  # > 0: rounds by time (diloco.round = "time"), each this long
    compression: str = "none"  # diloco.compression of the engines ("sparse": the codec with the most state)
    recovery_s: float = 60.0  # per fault: from the heal until every node commits again
    startup_s: float = 300.0  # until every node committed its first outer step
    deadline_s: float = 1800.0  # the whole lab, set-up to teardown
    stall_limit: float | None = None  # default heartbeat_timeout + 2 s (the soak goal), + a time round
    kinds: tuple[str, ...] = KINDS  # the fault kinds to draw from
    gap: tuple[float, float] = Timing.gap  # the bounds of the quiet time drawn after each recovery
    lock_wait_s: float = 0.0  # how long to wait for another lab to end
    keep: bool = False  # keep the lab's temp dir (profile, keys, run dirs) for a post-mortem

    @property
    def limit(self) -> float:
        """The longest gap between commits the lab accepts. With time rounds a commit comes once a round by design,
        so the limit is one round longer: the fault may hold the run heartbeat_timeout + 2 s past that."""
        if self.stall_limit is not None:
            return self.stall_limit
        return self.heartbeat_timeout + 2.0 + self.round_seconds

    def overrides(self) -> dict[str, object]:
        """The engine settings: tests/procs.py FAST_LOCAL's quick debug run, with this lab's heartbeat timeout."""
        return {"data.path": "corpus/stdlib_docstrings.jsonl", "inner.device": "cpu", "train.max_steps": 10_000_000,
                "train.micro_batch_size": 2, "train.batch_size": 2, "data.seq_len": 32, "train.log_interval": 5,
                "train.eval_interval": 0, "telemetry.resource_interval": 5.0,
                "diloco.inner_steps": self.inner_steps, "diloco.allreduce_timeout": 20.0,
                "diloco.min_nodes": self.hosts, "mesh.heartbeat_interval": 0.25,
                "mesh.heartbeat_timeout": self.heartbeat_timeout, "mesh.store_timeout": 30.0,
                "mesh.start_timeout": 120.0, "mesh.join_timeout": 120.0, "mesh.polling_interval": 0.05,
                **({"diloco.round": "time", "diloco.round_seconds": self.round_seconds} if self.round_seconds else {}),
                **({"diloco.compression": self.compression} if self.compression != "none" else {})}


class LabError(RuntimeError):
    """The lab itself could not go on (set-up failed, the deadline passed): one line."""


@dataclass
class NodeView:
    """What the lab reads from one node's events file (followed by offset, like the console)."""

    path: Path
    offset: int = 0
    events: list[dict] = field(default_factory=list)
    bad: int = 0

    def refresh(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a half-written last line waits for the next read
        self.offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                self.bad += 1
                continue
            self.events.append(event)

    def highest(self) -> int:
        return max((int(e["outer_step"]) for e in self.events if e.get("type") == "outer_step"), default=-1)

    def last(self, type_: str) -> dict | None:
        return next((e for e in reversed(self.events) if e.get("type") == type_), None)


class Lab:
    def __init__(self, options: Options, out: Path, say=print):
        self.o, self.out, self.say = options, out, say
        self.t0 = time.time()
        self.deadline = time.monotonic() + options.deadline_s
        self.dir: Path | None = None
        self.netns: list[net.NetHost] = []
        self.sshds: list[HostSshd] = []
        self.engines = [ENGINE_NAMES[i] for i in range(options.hosts)]
        self.views: dict[str, NodeView] = {}
        self.console: subprocess.Popen | None = None
        self.consoles: list[subprocess.Popen] = []
        self.console_logs = 0
        self.problems: list[str] = []
        self.store_down: list[tuple[float, float]] = []
        self.drained: set[str] = set()
        self.faults: list[Fault] = []
        self._lock_file = None
        self._locked = False  # the lab holds the machine: only then is anything of a lab's its own to remove
        self._torn_down = False

    # ---- the whole run -------------------------------------------------------------------------------------
    def run(self) -> Verdict:
        atexit.register(self.teardown)
        previous = {s: signal.signal(s, _raise_exit) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self.setup()
            timing = Timing(heartbeat_timeout=self.o.heartbeat_timeout, gap=self.o.gap)
            self.faults = make_schedule(self.o.seed, self.o.faults, self.engines, timing, self.o.kinds)
            self.say(f"[lab] seed {self.o.seed}: " + ", ".join(f.describe() for f in self.faults))
            self.start_console(attach=False)
            self.wait_all_commit(-1, self.o.startup_s, "the first outer step on every node", fail_fast=True)
            self.say(f"[lab] training on {', '.join(self.engines)} at +{self.now():.1f}s")
            self.play()
            survivors = self.finish()
            return self.judge(survivors)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.teardown()

    def play(self) -> None:
        for fault in self.faults:
            if time.monotonic() > self.deadline - self.o.recovery_s:  # keep time to stop and judge the run
                self.problems.append(f"the lab's deadline ({self.o.deadline_s:.0f}s) came before fault #{fault.index}")
                self.say(f"[lab] {self.problems[-1]}")
                return
            fault.start = time.time()
            self.say(f"[lab] +{self.now():.1f}s inject {fault.describe()}")
            try:
                getattr(self, "fault_" + fault.kind.replace("-", "_"))(fault)
            except (LabError, net.NetError, OSError, subprocess.SubprocessError) as e:
                fault.survived = False
                fault.notes.append(f"the lab could not inject or heal it: {e}")
            if fault.survived is None:
                fault.survived = not fault.notes
            self.say(f"[lab] +{self.now():.1f}s {fault.describe()}: "
                     + ("survived" if fault.survived else "NOT SURVIVED: " + "; ".join(fault.notes)))
            if not self.repair(fault):
                self.problems.append(f"aborted after fault #{fault.index}: the cluster could not be brought back")
                self.say(f"[lab] {self.problems[-1]}")
                return
            time.sleep(fault.gap_s)

    def finish(self) -> list[str]:
        """Stop the run through the console; the survivors are the nodes running just before."""
        self.refresh()
        survivors = [n for n in self.engines if self.alive(n)]
        self.check_console()
        self.end = time.time()
        rc, text = self.cli("stop")
        if rc != 0:
            self.problems.append(f"`stop` failed (exit {rc}): {text}")
        if self.console is not None:
            try:
                self.console.wait(timeout=self.o.heartbeat_timeout + 60)
            except subprocess.TimeoutExpired:
                self.problems.append("the console did not exit after the run was stopped")
        self.refresh()
        return survivors

    def judge(self, survivors: list[str]) -> Verdict:
        self.refresh()
        events = {n: self.views[n].events for n in self.engines}
        verdict = judge(events, self.faults, survivors, self.end, self.store_down, self.o.limit, self.problems)
        lines = verdict.lines(self.t0)
        bad = {n: v.bad for n, v in self.views.items() if v.bad}
        if bad:  # the engines' stream must stay parseable through every fault; worth a look, not a goal
            counts = ", ".join(f"{n} {k}" for n, k in bad.items())
            lines.insert(-1, f"lines of events.jsonl that were not JSON: {counts}")
        for line in lines:
            self.say(line)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "report.txt").write_text("\n".join(self.header() + lines) + "\n")
        try:
            from lab.timeline import draw
            draw(self.out / "timeline.png", events, self.faults, self.store_down, self.t0, self.end)
            self.say(f"[lab] wrote {self.out / 'report.txt'} and {self.out / 'timeline.png'}")
        except ImportError as e:
            self.say(f"[lab] no timeline: {e} (pip install matplotlib)")
        self.save_logs()
        return verdict

    def header(self) -> list[str]:
        o = self.o
        return [f"chaos lab: seed {o.seed}, {o.faults} faults, {o.hosts} engine hosts, heartbeat_timeout "
                f"{o.heartbeat_timeout}s, inner_steps {o.inner_steps}"
                + (f", rounds by time of {o.round_seconds:g}s" if o.round_seconds else "")
                + (f", compression {o.compression}" if o.compression != "none" else "") + f", ran {self.now():.0f}s"]

    # ---- set-up and teardown -------------------------------------------------------------------------------
    def setup(self) -> None:
        self.take_lock()
        gone = net.cleanup_leftovers()
        if gone:
            self.say(f"[lab] removed leftovers of an earlier lab: {', '.join(gone)}")
        self.dir = Path(tempfile.mkdtemp(prefix="zbc-lab-"))
        self.dir.chmod(0o755)
        key = prepare_user(self.dir)
        net.create_bridge()
        names = self.engines + ["store"]
        self.netns = [net.NetHost(name, 10 + i) for i, name in enumerate(names)]
        for host in self.netns:
            net.create_host(host)
            self.sshds.append(HostSshd(host, self.dir, key))
            self.sshds[-1].start()
        known = self.dir / "known_hosts"
        known.write_text("".join(s.known_hosts_line() for s in self.sshds))
        ssh_config = self.dir / "ssh_config"
        write_ssh_config(ssh_config, self.sshds, key, known)
        self.port = free_port()
        self.profile = self.dir / "chaos.toml"
        write_profile(self.profile, engines=self.sshds[:-1], store=self.sshds[-1], run_dir=self.dir / "runs",
                      store_port=self.port, overrides=self.o.overrides(), ssh_config=ssh_config,
                      known_hosts=known, workdir=ROOT)
        self.views = {n: NodeView(self.dir / "runs" / n / "events.jsonl") for n in self.engines}
        self.say(f"[lab] {len(self.netns)} namespaces up ({', '.join(h.netns for h in self.netns)}); "
                 f"profile {self.profile}")

    def take_lock(self) -> None:
        """One lab at a time (they share the names and the subnet): wait up to lock_wait_s for another to end."""
        self._lock_file = open(LOCK, "a+")  # noqa: SIM115 (held for the whole run)
        wait_for_lock(self._lock_file, self.o.lock_wait_s, on_wait=lambda: self.say(
            f"[lab] waiting up to {self.o.lock_wait_s:.0f}s for another lab to end ({LOCK})"))
        self._locked = True
        self.t0 = time.time()  # the run's clock and deadline start once the lab has the machine
        self.deadline = time.monotonic() + self.o.deadline_s

    def teardown(self) -> None:
        """Idempotent: every process, namespace, link and (unless --keep) the temp dir. Nothing when the lab never
        had the lock: the namespaces and links of that name are the running lab's (a refused second lab removed
        them). A second Ctrl-C does not cut it short (links and the temp dir, the user's key in it, were left)."""
        if self._torn_down:
            return
        if not self._locked:
            self._torn_down = True
            if self._lock_file is not None:
                self._lock_file.close()
            return
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self._teardown()
            self._torn_down = True
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)

    def _teardown(self) -> None:
        for proc in self.consoles:
            _kill_group(proc)
        for host in self.netns:
            net.remove_host(host.netns)  # sshd, the engines and the store run in there
        for sshd in self.sshds:
            if sshd.proc is not None:
                sshd.proc.wait(timeout=10)
        net.cleanup_leftovers()
        if self.dir is not None and not self.o.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock_file is not None:
            self._lock_file.close()

    def save_logs(self) -> None:
        """Copy each node's events and log, the store's, and the consoles' output next to the report."""
        assert self.dir is not None
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for src in list((self.dir / "runs").glob("*/events.jsonl")) + list((self.dir / "runs").glob("*/engine.log")):
            shutil.copy(src, logs / f"{src.parent.name}-{src.name}")
        for src in self.dir.glob("console-*.log"):
            shutil.copy(src, logs / src.name)

    # ---- reading the run -----------------------------------------------------------------------------------
    def now(self) -> float:
        return time.time() - self.t0

    def refresh(self) -> None:
        for view in self.views.values():
            view.refresh()

    def frontier(self) -> int:
        self.refresh()
        return max((v.highest() for v in self.views.values()), default=-1)

    def pgid(self, name: str) -> int | None:
        assert self.dir is not None
        try:
            text = (self.dir / "runs" / name / "pid").read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else None

    def alive(self, name: str) -> bool:
        pgid = self.pgid(name)
        if pgid is None or (self.dir / "runs" / name / "rc").exists():  # type: ignore[operator]
            return False
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def leader(self) -> str | None:
        self.refresh()
        changes = [e for v in self.views.values() for e in v.events
                   if e.get("type") == "membership" and e.get("change") == "leader"]
        holder = max(changes, key=lambda e: e["ts"], default=None)
        return holder.get("subject") if holder else None

    def why_gone(self, name: str) -> str:
        view = self.views[name]
        end = view.last("run_end")
        error = view.last("error")
        assert self.dir is not None
        log = (self.dir / "runs" / name / "engine.log")
        last = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        said = f"run_end {end['status']}" if end else "no run_end"
        return (f"{name} exited ({said}" + (f", error: {error['message'][:160]}" if error else "")
                + (f", log: {last[0][:160]}" if last else "") + ")")

    # ---- waiting -------------------------------------------------------------------------------------------
    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise LabError(f"the lab's deadline ({self.o.deadline_s:.0f}s) passed")

    def wait_all_commit(self, above: int, timeout: float, what: str, nodes: list[str] | None = None,
                        fail_fast: bool = False) -> float:
        """Until every node (default: every engine host not drained) committed an index above `above`. fail_fast
        (the start): as soon as every node still behind has exited, its status written (a config every engine
        refused waited 300 s)."""
        nodes = nodes if nodes is not None else [n for n in self.engines if n not in self.drained]
        end = time.monotonic() + timeout
        while True:
            self.refresh()
            behind = [n for n in nodes if self.views[n].highest() <= above]
            if not behind:
                return time.time()
            self.check_deadline()
            ended = fail_fast and all((self.dir / "runs" / n / "rc").exists() for n in behind)  # type: ignore[operator]
            if ended or time.monotonic() > end:
                gone = [self.why_gone(n) for n in behind if not self.alive(n)]
                if ended:
                    raise LabError(f"every node behind ended before {what}: {'; '.join(gone)}")
                raise LabError(f"timed out after {timeout:.0f}s waiting for {what}: behind {behind}"
                               + (f"; {'; '.join(gone)}" if gone else ""))
            time.sleep(POLL_S)

    def recover(self, fault: Fault, above: int) -> None:
        """After the heal: every node commits past `above`, and none ended by itself meanwhile."""
        fault.healed = fault.healed or time.time()
        try:
            fault.recovered = self.wait_all_commit(above, self.o.recovery_s, "every node to commit again")
        except LabError as e:
            fault.notes.append(str(e))
        for name in self.engines:
            if name not in self.drained and not self.alive(name):
                note = self.why_gone(name)
                if not any(name + " exited" in n for n in fault.notes):
                    fault.notes.append(note)

    # ---- the faults ----------------------------------------------------------------------------------------
    def host(self, name: str) -> net.NetHost:
        return next(h for h in self.netns if h.name == name)

    def signal_node(self, name: str, sig: int) -> None:
        pgid = self.pgid(name)
        if pgid is None:
            raise LabError(f"{name}: no pid file")
        os.killpg(pgid, sig)

    def fault_kill(self, fault: Fault) -> None:
        """SIGKILL the engine's process group; the others go on; `add` brings it back and it re-joins."""
        name = fault.resolved = fault.resolved or fault.target
        before = self.frontier()
        self.signal_node(name, signal.SIGKILL)
        fault.healed = time.time()
        others = [n for n in self.engines if n != name and n not in self.drained]
        try:
            self.wait_all_commit(before, self.o.heartbeat_timeout + self.o.recovery_s / 2,
                                 f"the others to go on without {name}", nodes=others)
        except LabError as e:
            fault.notes.append(str(e))
        self.restart(name, fault)
        self.recover(fault, self.frontier())

    def fault_kill_leader(self, fault: Fault) -> None:
        leader = self.leader()
        if leader not in self.engines:
            fault.notes.append(f"no leader known from the membership events (got {leader!r})")
            leader = self.engines[0]
        fault.resolved = leader
        self.fault_kill(fault)

    def fault_freeze(self, fault: Fault) -> None:
        fault.resolved = fault.target
        self.signal_node(fault.target, signal.SIGSTOP)
        try:
            time.sleep(fault.hold_s)
        finally:
            self.signal_node(fault.target, signal.SIGCONT)
        self.recover(fault, self.frontier())

    def fault_link(self, fault: Fault) -> None:
        self.outage(fault, lambda h: net.link(h, False), lambda h: net.link(h, True))

    def fault_loss(self, fault: Fault) -> None:
        self.outage(fault, lambda h: net.drop(h, fault.percent), net.clear_drop)

    def fault_blackhole(self, fault: Fault) -> None:
        self.outage(fault, lambda h: net.drop(h, 100), net.clear_drop)

    def outage(self, fault: Fault, down, up) -> None:
        fault.resolved = fault.target
        host = self.host(fault.target)
        down(host)
        try:
            time.sleep(fault.hold_s)
        finally:
            up(host)
        self.recover(fault, self.frontier())

    def fault_store(self, fault: Fault) -> None:
        """SIGKILL the store; after hold_s start it again, unless the console already did."""
        fault.resolved = "store"
        pgid = self.pgid("_store")
        if pgid is None:
            raise LabError("the store has no pid file")
        os.killpg(pgid, signal.SIGKILL)
        down, gone, back = time.time(), False, None
        end = time.monotonic() + fault.hold_s
        while time.monotonic() < end:  # only the time it was down is excused: not the rest of the hold once the
            answers = self.store_answers()  # console restarted it (that hid up to the hold's length of a stall)
            gone = gone or not answers
            if gone and answers:
                back = time.time()
                break
            time.sleep(0.1)
        if back is not None:
            fault.info.append("the console had restarted the store")
        else:
            self.start_store()
            fault.info.append("the lab restarted the store")
        self.store_down.append((down, back or time.time()))
        self.recover(fault, self.frontier())

    def fault_console(self, fault: Fault) -> None:
        """SIGKILL the console, start it again with --attach; it must see every node training."""
        fault.resolved = "console"
        assert self.console is not None
        self.check_console()
        _kill_group(self.console)
        self.start_console(attach=True)
        fault.healed = time.time()
        want = len([n for n in self.engines if n not in self.drained])
        if not self.console_sees_training(want, self.o.recovery_s):
            fault.notes.append(f"the re-attached console did not show {want} nodes training within "
                               f"{self.o.recovery_s:.0f}s (last status line: {self.console_tail(status=True)!r})")
        self.recover(fault, self.frontier())

    def fault_drain(self, fault: Fault) -> None:
        """`drain NODE`: it must leave with run_end "drained" and exit 0; then `add NODE` brings it back."""
        name = fault.resolved = fault.target
        rc, text = self.cli("drain", name)
        if rc != 0:
            fault.notes.append(f"`drain {name}` failed (exit {rc}): {text}")
            return
        self.drained.add(name)
        end = time.monotonic() + self.o.recovery_s
        while self.alive(name) and time.monotonic() < end:
            time.sleep(POLL_S)
        self.refresh()
        said = self.views[name].last("run_end")
        if self.alive(name) or not said or said.get("status") != "drained":
            fault.notes.append(f"{name} did not drain within {self.o.recovery_s:.0f}s ("
                               + (f"run_end {said['status']}" if said else "no run_end") + ")")
        fault.healed = time.time()
        self.drained.discard(name)
        if not self.alive(name):
            self.restart(name, fault)
        self.recover(fault, self.frontier())

    # ---- repairs -------------------------------------------------------------------------------------------
    def restart(self, name: str, fault: Fault | None = None) -> bool:
        rc, text = self.cli("add", name)
        if rc != 0 and fault is not None:
            fault.notes.append(f"`add {name}` failed (exit {rc}): {text}")
        return rc == 0

    def repair(self, fault: Fault) -> bool:
        """Bring back what the fault left broken (store, nodes, console); False if the run cannot go on."""
        fixed = []
        console_gone = not self.check_console()
        if not self.store_answers():
            self.start_store()
            fixed.append("store restarted")
        for name in self.engines:
            if not self.alive(name) and self.restart(name):
                fixed.append(f"{name} restarted")
        if fixed:
            self.say(f"[lab] repair after #{fault.index}: {', '.join(fixed)}")
        if fixed or not fault.survived:
            try:
                self.wait_all_commit(self.frontier(), self.o.recovery_s + self.o.startup_s / 2,
                                     "every node to commit after the repair")
            except LabError as e:
                self.say(f"[lab] {e}")
                return False
        if console_gone:
            # last, once every node trains: a console attached while a node restarts reads the old process's
            # run_end as the new one's state, and a console that sees no running node stops the run
            self.start_console(attach=True)
            self.say(f"[lab] repair after #{fault.index}: console restarted")
        return True

    def store_answers(self) -> bool:
        address = self.host("store").address
        try:
            socket.create_connection((address, self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def start_store(self) -> None:
        """Start the store as the console does (detached, its pid file under RUN_DIR/_store) inside its host."""
        from console.hosts import STORE
        from console.store.tcp import store_argv
        from console.profile import load_profile
        from console.transport import commands as C

        profile = load_profile(self.profile)
        host = profile.store_host
        command = C.detached_command(store_argv(profile), workdir=host.workdir,
                                     run_dir=C.join(profile.run.dir, STORE), env=host.env, append=True)
        net.sh(self.host("store").exec_args("runuser", "-u", "zbtest", "--", "sh", "-c", command))
        end = time.monotonic() + 60
        while not self.store_answers():
            if time.monotonic() > end:
                raise LabError("the restarted store did not answer within 60s")
            time.sleep(POLL_S)

    # ---- the console ---------------------------------------------------------------------------------------
    def start_console(self, attach: bool) -> None:
        assert self.dir is not None
        self.console_logs += 1
        log = open(self.dir / f"console-{self.console_logs}.log", "wb")  # noqa: SIM115 (handed to the child)
        args = [sys.executable, "-m", "console", str(self.profile), "--headless", "--interval", "1"]
        self.console = subprocess.Popen(args + (["--attach"] if attach else []), cwd=self.dir, env=lab_env(),
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.consoles.append(self.console)
        with open(self.dir / CONSOLE_PIDS, "a") as f:  # for --cleanup, should this lab be killed
            f.write(f"{self.console.pid}\n")

    def check_console(self) -> bool:
        """True while the console runs; a console that ended by itself is a problem (it must never crash)."""
        if self.console is None or self.console.poll() is None:
            return self.console is not None
        self.problems.append(f"the console exited by itself with status {self.console.returncode} at "
                             f"+{self.now():.1f}s: {self.console_tail()[:120]!r}")
        self.say(f"[lab] {self.problems[-1]}")
        self.console = None
        return False

    def console_tail(self, status: bool = False) -> str:
        """The console log's last line; with status, its last status line (the headless console prints a line per
        outer step after each status line, indented, so the very last line is seldom the status)."""
        assert self.dir is not None
        lines = (self.dir / f"console-{self.console_logs}.log").read_text(errors="replace").strip().splitlines()
        if status:
            lines = [line for line in lines if " | " in line and not line.startswith(" ")]
        return lines[-1] if lines else ""

    def console_sees_training(self, want: int, timeout: float) -> bool:
        import re

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            match = re.search(r"\| .*\btraining (\d+)", self.console_tail(status=True))
            if match and int(match.group(1)) >= want:
                return True
            if self.console is not None and self.console.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def cli(self, *command: str) -> tuple[int, str]:
        """A console subcommand (status, drain, add, stop) as an operator runs it: (exit status, its output)."""
        args = [sys.executable, "-m", "console", str(self.profile), *command]
        try:
            done = subprocess.run(args, cwd=self.dir, env=lab_env(), capture_output=True, text=True,
                                  timeout=CLI_TIMEOUT_S, start_new_session=True)
        except subprocess.TimeoutExpired:
            return 124, f"timed out after {CLI_TIMEOUT_S:.0f}s"
        text = (done.stdout + done.stderr).strip().replace("\n", " | ")
        self.say(f"[lab] +{self.now():.1f}s `{' '.join(command)}` -> {done.returncode}: {text[:200]}")
        return done.returncode, text[:400]


def wait_for_lock(file, wait_s: float, on_wait=None) -> None:
    """Take the labs' lock on an open `file` of LOCK, waiting up to wait_s for the lab that holds it (on_wait() is
    called once, when it first has to wait). One lab at a time: they share the names and the subnet."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise LabError(f"another lab is running (lock {LOCK}; waited {wait_s:.0f}s)") from None
            if on_wait is not None:
                on_wait()
                on_wait = None
            time.sleep(1)


@contextlib.contextmanager
def holding_lock(wait_s: float = 600.0):
    """The labs' lock, held for the block: nothing of another lab (a chaos run, the wan bench, the preflight lab, a
    test of either, in this or another test worker) is half set up or half torn down meanwhile."""
    with open(LOCK, "a+") as file:
        wait_for_lock(file, wait_s)
        yield


def cleanup_leftovers() -> list[str]:
    """What a killed lab left (remove_leftovers). Refuses while a lab holds the lock."""
    with open(LOCK, "a+") as file:
        try:
            wait_for_lock(file, 0)
        except LabError:
            raise LabError(f"a chaos lab is running (lock {LOCK}): nothing removed") from None
        return remove_leftovers()


def remove_leftovers() -> list[str]:
    """Namespaces and links (net), the labs' consoles (by the pids each recorded, checked against their command
    line), their temp dirs. The caller holds the lock: without it this would take a running lab apart."""
    gone = net.cleanup_leftovers()
    for lab_dir in Path(tempfile.gettempdir()).glob("zbc-lab-*"):
        pids = lab_dir / CONSOLE_PIDS
        for word in (pids.read_text().split() if pids.exists() else []):
            try:
                cmdline = Path(f"/proc/{int(word)}/cmdline").read_bytes()
            except (FileNotFoundError, ValueError):
                continue
            if str(lab_dir).encode() in cmdline:  # its profile lives in that dir: not a reused pid
                os.killpg(int(word), signal.SIGKILL)
                gone.append(f"console {word}")
        shutil.rmtree(lab_dir, ignore_errors=True)
        gone.append(str(lab_dir))
    return gone


def lab_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_BAND_", "GLOBAL_"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through run()'s finally: teardown
