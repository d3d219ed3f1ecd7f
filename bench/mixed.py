"""Mixed speeds: rounds by time and a mean weighted by tokens, with one engine slowed to half speed (issue 22).

    python bench/mixed.py                          # 2 and 4 engines, 3 seeds each: ~50 min on 2 busy cores
    python bench/mixed.py --sizes 2 --seeds 5      # more seeds for the held-out ratio
    python bench/mixed.py --quick                  # CI: 2 engines, 2 rounds of 3 s, one seed (~2 min)
    python bench/mixed.py --grace 5                # diloco.straggler_grace of the time runs (default: S / 4)

Real `python -m engine.train configs/debug-diloco.toml` engines (the debug corpus, fp32, CPU, one torch thread each)
and, for DiLoCo, a real `python -m engine.store`, all on this machine. The last engine (node-{n-1}) is the slow one.
Every engine is started primed (its imports done, as bench/elastic.py's joiner; up to MAX_PRIMED processes wait at
once, so the imports of several runs overlap) and the engines of a run are released together: they start training
within a fraction of a second of each other, and start-up is not measured.

Slowing an engine (Throttle; --throttle picks, auto tries them in this order). A node at speed f gets f times what a
node at full speed gets, by a quota (a cap: it holds when the machine has cores to spare) and a weight (a share: it
holds when the cores are contended, by our own engines or by other work on this machine):
    cgroup2   a cgroup2 mount whose cgroup.controllers lists cpu: a child cgroup per engine under the mount's root
              (`+cpu` written to the root's cgroup.subtree_control if it is not there), cpu.max = "Q 100000" with Q
              = f x min(1, cores / engines) x 100000 ("50000 100000" is half a core), cpu.weight = f x 100, then the
              engine's PID into cgroup.procs
    cgroup1   the cpu controller mounted on its own (/sys/fs/cgroup/cpu, where cgroup2 is mounted without it, as on
              a hybrid host): the same with cpu.cfs_quota_us / cpu.cfs_period_us and cpu.shares = f x 1024
    signals   no writable cgroup (not root, a read-only /sys/fs/cgroup): the engine's process group is stopped
              (SIGSTOP) for 1 - f of every 100 ms and continued (SIGCONT) for the rest; it caps nobody at full speed
The cgroups are named zb-mixed-<bench pid>-<run>-<node> and removed after each run, also on failure. The solo runs
show that the slowdown took (the slow node's solo tokens/s against the others'; its cgroup's throttled seconds).

Runs, per size and seed, one stage after another (the two time runs of the pair side by side):
    solo        every engine at once, each alone (diloco.enabled=false), for --solo-seconds: each one's tokens/s at
                its own speed, on the machine shared the way the cluster runs share it (hosts apart, side by side)
    steps       DiLoCo, step rounds (the default): --rounds rounds of H steps, H = --round-seconds x the mean solo
                steps/s (so a round trains about the tokens of a time round); the slow node at half speed
    time        DiLoCo, --diloco.round=time --diloco.round_seconds=S: the same number of rounds (train.max_steps =
                rounds x H, the engine's rule for time rounds); the slow node at half speed
    time-mixed  the pair, two clusters at once on their own stores: time-mixed is `time` again, time-equal the same
    time-equal  with every node at the mean of those speeds, so both get the same compute in total and, running at
                the same moment, the same share of the machine whatever else runs on it: equal tokens in
                expectation (the bench prints the ratio it got). Run apart, the load of other work moved one
                run's tokens 2.7x against the other's.
    solo-after  solo again: the machine's load drifts, so the reference is the mean of the two solo runs

Figures:
    cluster tokens/s   the tokens the outer steps counted (the sum of each node's `weights`; the tokens a node
                       trained, from its last step event, where the engine sends no weights) / the training part's
                       wall time (the first node's `training` state to the last `outer_step` event)
    R1 (R0)            cluster tokens/s of time (steps) / the sum of the solo tokens/s (each engine's mean of solo
                       and solo-after)
    busy time          per node, its outer steps' compute_s / the wall time; R1 (R0) from the busy time = the sum
                       of solo tokens/s x busy / the sum of solo tokens/s: what the waiting alone costs, a quotient
                       of two durations of one run, so it hardly moves with the load (printed beside, not judged)
    R2                 held-out loss of time-mixed / of time-equal, same seed (same init, data order and held-out
                       split): node-0's final export on the whole held-out split (up to --eval-batches batches of
                       16), evaluated here; mean and spread over --seeds
    shares             each node's share of each outer step: its `weights` entry / their sum (the tokens it trained)
Per size: the means over the seeds. The last line takes the worst size (lowest R1 with that size's R0, highest R2):

    mixed speeds: cluster / sum of solo tokens/s R1 (step rounds R0); held-out loss vs equal speeds R2

Goals (issue 22): R1 >= 0.9 (step rounds give about 0.67 with one of two engines at half speed), R2 <= 1.01. Exit 0
when both are met, 3 when one is not (the lines above say which), 2 when the bench could not measure. This machine
is shared (2 cores, other work comes and goes): the tokens/s move from run to run (a solo sum of 2144 tok/s, then
766 two minutes later, once), so read R1 and R0 with the load averages printed beside them and the busy-time
figures, and R2 with its spread over the seeds.

Measured here (2 shared cores at load 5 to 32, cgroup v1; --sizes 2,4 --seeds 2 --rounds 5, 35 min): R1 0.894
(seeds 0.583 and 1.205: noise) and R0 0.714 at 2 engines, 0.903 and 0.635 at 4; from the busy time R1 0.938 / 0.883
and R0 0.610 / 0.548; R2 0.976 (2 engines) and 0.996 (4) at token ratios of 1.007 and 0.931; the slow node's share
of a time round 0.322 and 0.142, its speed's share of the total being 0.333 and 0.143.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from elastic import Proc, free_port  # noqa: E402 (a process whose JSON events are read as they come)

GOAL_R1, GOAL_R2 = 0.9, 1.01
PERIOD_US = 100_000  # the quota's period: 100 ms, the kernel's default
LAST = "mixed speeds: cluster / sum of solo tokens/s {r1:.3f} (step rounds {r0:.3f}); held-out loss vs equal speeds " \
       "{r2:.3f}"


class BenchFailed(RuntimeError):
    """The bench could not measure (an engine failed or hung, a window too short): one line and a log tail."""


# ---------------------------------------------------------------------------------------------- slowing an engine

def find_cpu_cgroup() -> tuple[str, Path | None, str]:
    """(kind, mount, why): where the cpu controller can be written, or ("signals", None, the reason it cannot)."""
    mounts = [line.split()[:4] for line in Path("/proc/mounts").read_text().splitlines()]
    v2 = [Path(m[1]) for m in mounts if m[2] == "cgroup2"]
    for mount in v2:
        controllers = (mount / "cgroup.controllers").read_text().split()
        if "cpu" in controllers:
            return "cgroup2", mount, ""
    for _dev, mount, fstype, opts in mounts:
        if fstype == "cgroup" and "cpu" in opts.split(","):
            return "cgroup1", Path(mount), ""
    where = ", ".join(str(m) for m in v2) or "none"
    return "signals", None, f"no cgroup mount offers the cpu controller (cgroup2 mounts: {where})"


class Throttle:
    """Gives each engine process of one run its speed (module docstring): place(), then close() (a context)."""

    def __init__(self, kind: str, mount: Path | None, engines: int, cores: int, tag: str = "run"):
        self.kind, self.mount, self.engines, self.cores, self.tag = kind, mount, engines, cores, tag
        self.groups: dict[str, Path] = {}
        self.enabled_cpu = False  # cgroup2: this bench wrote +cpu into the root's subtree_control
        self.stopping: dict[int, float] = {}  # signals: pgid -> speed
        self._stop = threading.Event()
        self._cycler: threading.Thread | None = None

    def __enter__(self) -> "Throttle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def quota_us(self, speed: float) -> int:
        return max(1000, int(speed * min(1.0, self.cores / self.engines) * PERIOD_US))

    def place(self, name: str, pid: int, speed: float) -> None:
        if self.kind == "signals":
            if speed < 1.0:
                self.stopping[pid] = speed
                if self._cycler is None:
                    self._cycler = threading.Thread(target=self._cycle, daemon=True)
                    self._cycler.start()
            return
        group = self.mount / f"zb-mixed-{os.getpid()}-{self.tag}-{name}"
        if self.kind == "cgroup2" and not self.enabled_cpu:
            control = self.mount / "cgroup.subtree_control"
            if "cpu" not in control.read_text().split():
                control.write_text("+cpu")
                self.enabled_cpu = True
        group.mkdir()
        self.groups[name] = group
        if self.kind == "cgroup2":
            (group / "cpu.max").write_text(f"{self.quota_us(speed)} {PERIOD_US}")
            (group / "cpu.weight").write_text(str(max(1, round(100 * speed))))
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(self.quota_us(speed)))
            (group / "cpu.shares").write_text(str(max(2, round(1024 * speed))))
        (group / "cgroup.procs").write_text(str(pid))

    def throttled_s(self, name: str) -> float | None:
        """Seconds the quota held this engine back so far (the cgroup's cpu.stat), None without a cgroup."""
        group = self.groups.get(name)
        if group is None:
            return None
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines() if line.strip())
        if "throttled_usec" in stat:
            return int(stat["throttled_usec"]) / 1e6
        return int(stat.get("throttled_time", 0)) / 1e9

    def _cycle(self, period: float = 0.1) -> None:
        """signals: every period, continue every slowed engine, then stop each one after its speed's share."""
        while not self._stop.is_set():
            start = time.monotonic()
            self._signal_all(signal.SIGCONT)
            for pgid, speed in sorted(self.stopping.items(), key=lambda kv: kv[1]):
                self._stop.wait(max(0.0, start + speed * period - time.monotonic()))
                self._signal(pgid, signal.SIGSTOP)
            self._stop.wait(max(0.0, start + period - time.monotonic()))
        self._signal_all(signal.SIGCONT)

    def _signal_all(self, sig: int) -> None:
        for pgid in self.stopping:
            self._signal(pgid, sig)

    @staticmethod
    def _signal(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:  # the engine has ended: nothing left to slow
            pass

    def close(self) -> None:
        """Stop the cycling (continuing everything), and remove the cgroups: any process still in one is moved
        back to the mount's root first (the engines have normally ended by now)."""
        self._stop.set()
        if self._cycler is not None:
            self._cycler.join(timeout=5)
        for group in self.groups.values():
            if not group.exists():
                continue
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (self.mount / "cgroup.procs").write_text(pid)
                except ProcessLookupError:  # it ended in between
                    pass
            group.rmdir()
        self.groups.clear()
        if self.enabled_cpu:
            try:
                (self.mount / "cgroup.subtree_control").write_text("-cpu")
            except OSError as e:  # another cgroup now uses the controller: leave it on, and say so
                print(f"mixed: left +cpu in {self.mount}/cgroup.subtree_control ({e.strerror})", file=sys.stderr)
            self.enabled_cpu = False


def choose_throttle(wanted: str) -> tuple[str, Path | None, str]:
    """(kind, mount, note). auto: a writable cgroup if there is one, else signals with the reason why."""
    if wanted == "signals":
        return "signals", None, "SIGSTOP/SIGCONT duty cycle (--throttle signals)"
    kind, mount, why = find_cpu_cgroup()
    if kind != "signals":
        probe = mount / f"zb-mixed-{os.getpid()}-probe"
        try:
            probe.mkdir()
            probe.rmdir()
        except OSError as e:
            kind, why = "signals", f"{mount} is not writable ({e.strerror})"
    if wanted != "auto" and kind != wanted:
        raise BenchFailed(f"--throttle {wanted}: not available here ({why or f'the cpu controller is {kind}'})")
    if kind == "signals":
        return kind, None, f"cgroups not writable: {why}; slowing by a SIGSTOP/SIGCONT duty cycle instead"
    files = "cpu.max + cpu.weight" if kind == "cgroup2" else "cpu.cfs_quota_us + cpu.shares"
    return kind, mount, f"{kind} at {mount} ({files})"


# ---------------------------------------------------------------------------------------------- runs

# An engine that imports, says so, and waits for its go file, which holds its arguments (a JSON list: a step run's H
# is known only after the solo run). Written with os.replace, so it is whole when it appears.
PRIMED = """import json, os, sys, time
import engine.train
import engine.session  # the imports that take the seconds (engine.train imports it once the config passed)
print("primed", file=sys.stderr, flush=True)
go, deadline = sys.argv[1], time.monotonic() + 3600
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit("primed engine: no go file within an hour")
    time.sleep(0.01)
with open(go) as f:
    sys.argv = ["engine.train"] + json.load(f)
engine.train.cli()
"""
MAX_PRIMED = 16  # engine and store processes waiting at once (~260 MB each): a group's runs, or a few of them


@dataclass
class Run:
    arm: str  # solo | steps | time | time-mixed | time-equal | solo-after
    size: int
    seed: int
    speeds: list[float]
    events: dict[str, list[dict]] = field(default_factory=dict)  # node -> its state, step, outer_step, run_end
    h: int = 0
    export: str | None = None  # node-0's transformers folder (DiLoCo runs)
    throttled_s: dict[str, float | None] = field(default_factory=dict)
    load: tuple[float, float] = (0.0, 0.0)  # 1-minute load average as the run started and as it ended
    eval_loss: float | None = None

    @property
    def diloco(self) -> bool:
        return not self.arm.startswith("solo")


class Primed:
    """One run's processes, imported and waiting: its store (DiLoCo), its engines (in their cgroups), each engine
    waiting for its go file."""

    def __init__(self, args, run: Run, workdir: Path):
        self.run, self.args = run, args
        self.dir = workdir / f"n{run.size}-s{run.seed}-{run.arm}"
        self.dir.mkdir(parents=True)
        self.procs: list[Proc] = []
        self.nodes: list[Proc] = []
        self.throttle = Throttle(args.throttle_kind, args.throttle_mount, run.size, args.cores, tag=run.arm)
        self.port = None
        try:
            if run.diloco:
                self.port = free_port()
                Proc("store", [sys.executable, "-m", "engine.store", "--host", "127.0.0.1", "--port",
                               str(self.port)], self.procs)  # a Proc adds itself to the list it is given
            for i in range(run.size):
                env = [f"GLOBAL_RANK={i}", f"GLOBAL_WORLD_SIZE={run.size}"]  # node i reads data shard i of size
                self.nodes.append(Proc(f"node-{i}", ["env", *env, sys.executable, "-c", PRIMED,
                                                     str(self.dir / f"go-{i}")], self.procs))
                self.throttle.place(f"node-{i}", self.nodes[-1].proc.pid, run.speeds[i])
        except BaseException:  # the caller never gets this run to close: what was started ends here
            self.close()
            raise

    def ready(self) -> bool:
        store_ready = all(any(e.get("state") == "ready" for e in p.events) for p in self.procs if p.name == "store")
        return store_ready and all("primed" in p.err for p in self.nodes)

    def go(self, h: int) -> None:
        """Release every engine of the run (a few file writes apart)."""
        run = self.run
        run.h, run.load = h, (os.getloadavg()[0], 0.0)
        for i in range(run.size):
            tmp = self.dir / f"go-{i}.tmp"
            tmp.write_text(json.dumps(engine_args(self.args, run, i, self.dir, self.port)))
            os.replace(tmp, self.dir / f"go-{i}")

    def training(self) -> bool:
        return all(p.of("state", state="training") for p in self.nodes)

    def ended(self) -> bool:
        return all(p.proc.poll() is not None for p in self.nodes)

    def finish(self) -> Run:
        """After the run: check a DiLoCo run completed, read the cgroups, stop and clean, keep the events."""
        run = self.run
        try:
            if run.diloco:
                bad = [p for p in self.nodes if not p.of("run_end", status="completed")]
                if bad:
                    raise BenchFailed(f"{run.arm}: {bad[0].name} did not complete\n{tail(self.procs)}")
                run.export = str(self.dir / "export")
            run.throttled_s = {p.name: self.throttle.throttled_s(p.name) for p in self.nodes}
        finally:
            self.close()
        run.load = (run.load[0], os.getloadavg()[0])
        keep = ("state", "step", "outer_step", "run_end")
        run.events = {p.name: [e for e in p.events if e["type"] in keep] for p in self.nodes}
        return run

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.throttle.close()


def release(args, stage: list[Primed], h: int) -> None:
    """Run one stage (one run, or runs that go side by side): go, then solo: --solo-seconds once every engine
    trains; DiLoCo: until every engine has ended. Every run of the stage is finished (stopped, cleaned) after."""
    procs = [p for pr in stage for p in pr.procs]
    try:
        for pr in stage:
            pr.go(h)
        if not stage[0].run.diloco:
            wait_until(lambda: all(pr.training() for pr in stage), 120, "training", procs)
            time.sleep(args.solo_seconds)
            # on a loaded machine a slow engine may take seconds a step: the window needs a few of each
            nodes = {p.name: p.events for pr in stage for p in pr.nodes}
            wait_until(lambda: min(steps_together(nodes).values()) >= SOLO_STEPS, 300,
                       f"{SOLO_STEPS} steps of every engine while all train", procs)
        else:
            limit = 120 + args.rounds * args.round_seconds * 4  # a time run lasts about rounds x S
            names = " and ".join(pr.run.arm for pr in stage)
            wait_until(lambda: all(pr.ended() for pr in stage), limit, f"the end of the {names} run", procs)
    finally:
        errors = []
        for pr in stage:
            try:
                pr.finish()
            except BenchFailed as e:
                errors.append(e)
        if errors:
            raise errors[0]


def engine_args(args, run: Run, node: int, run_dir: Path, port: int | None) -> list[str]:
    over: dict[str, object] = {
        "data.path": str(ROOT / "corpus"), "data.seq_len": args.seq_len, "train.micro_batch_size": args.micro_batch,
        "train.batch_size": args.micro_batch, "train.seed": run.seed, "train.log_interval": 1,
        "train.eval_interval": 0, "telemetry.human": "false", "telemetry.resource_interval": 600.0,
        "ckpt.interval": 0, "run.dir": str(run_dir / f"node-{node}")}
    if not run.diloco:
        over.update({"diloco.enabled": "false", "train.max_steps": 10**7})
    else:
        over.update({"diloco.inner_steps": run.h, "train.max_steps": args.rounds * run.h,
                     "diloco.min_nodes": run.size, "mesh.store_port": port, "mesh.node_id": f"node-{node}",
                     "mesh.heartbeat_timeout": 20.0, "mesh.start_timeout": 300.0, "mesh.store_timeout": 120.0,
                     "diloco.allreduce_timeout": 120.0})
        if run.arm != "steps":
            over.update({"diloco.round": "time", "diloco.round_seconds": args.round_seconds})
            if args.grace is not None:
                over["diloco.straggler_grace"] = args.grace
        if node == 0:
            over["ckpt.export_dir"] = str(run_dir / "export")
    return ["configs/debug-diloco.toml", *(f"--{k}={v}" for k, v in over.items())]


def tail(procs: list[Proc], events: int = 4) -> str:
    """Each process's exit status, stderr tail and last few JSON events but heartbeats and steps (a hang shows
    where it waits)."""
    def short(e: dict) -> str:
        return json.dumps({k: v for k, v in e.items() if k not in ("v", "node", "rank", "checksum")})
    def last(p: Proc) -> list[dict]:
        return [e for e in p.events if e["type"] not in ("heartbeat", "resource", "step")][-events:]
    return "\n".join(f"--- {p.name} rc={p.proc.poll()}\n{p.err[-1500:]}" + "".join(f"  {short(e)}\n" for e in last(p))
                     for p in procs)


def wait_until(pred, timeout: float, what: str, procs: list[Proc]) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        dead = [p for p in procs if p.proc.poll() not in (None, 0)]
        if dead:
            raise BenchFailed(f"{dead[0].name} exited {dead[0].proc.returncode} while waiting for {what}\n"
                              f"{tail(procs)}")
        if time.monotonic() > deadline:
            raise BenchFailed(f"timed out after {timeout:.0f} s waiting for {what}\n{tail(procs)}")
        time.sleep(0.05)


def batches(stages: list[list[Run]], limit: int = MAX_PRIMED) -> list[list[list[Run]]]:
    """Consecutive stages whose processes (engines, and a store per DiLoCo run) are primed together, at most `limit`
    at once (a stage larger than that alone)."""
    out: list[list[list[Run]]] = []
    count = limit
    for stage in stages:
        need = sum(run.size + run.diloco for run in stage)
        if count + need > limit:
            out.append([])
            count = 0
        out[-1].append(stage)
        count += need
    return out


# ---------------------------------------------------------------------------------------------- figures

def of(events: list[dict], type_: str) -> list[dict]:
    return [e for e in events if e["type"] == type_]


SOLO_STEPS, WARM_S = 5, 1.0  # a solo rate needs this many steps of every engine, from WARM_S after the last start


def steps_together(events: dict[str, list[dict]]) -> dict[str, int]:
    """Each engine's step events since every engine trains (plus WARM_S): 0 for all before that."""
    starts = [e["ts"] for ev in events.values() for e in ev if e["type"] == "state" and e["state"] == "training"]
    if len(starts) < len(events):
        return {node: 0 for node in events}
    start = max(starts) + WARM_S
    return {node: sum(1 for e in ev if e["type"] == "step" and e["ts"] >= start) for node, ev in events.items()}


def solo_rates(run: Run) -> dict[str, float]:
    """Each engine's tokens/s while all of them trained: from its step events between the last engine's start
    (plus WARM_S) and the first engine's last step."""
    start = max(e["ts"] for ev in run.events.values() for e in of(ev, "state") if e["state"] == "training") + WARM_S
    end = min(of(ev, "step")[-1]["ts"] for ev in run.events.values())
    rates = {}
    for node, ev in run.events.items():
        steps = [e for e in of(ev, "step") if start <= e["ts"] <= end]
        if len(steps) < 3:
            raise BenchFailed(f"solo: {node} logged {len(steps)} steps in the {end - start:.1f} s all engines "
                              f"trained together: raise --solo-seconds")
        rates[node] = (steps[-1]["tokens"] - steps[0]["tokens"]) / (steps[-1]["ts"] - steps[0]["ts"])
    return rates


def cluster_figures(run: Run) -> dict:
    """The training part's wall time; per node the tokens it trained and those its outer steps counted (their
    `weights`: a round left out of the mean, or trained past the last outer step, is not counted); the cluster's
    tokens/s from the counted tokens (the trained ones if the engine sends no weights); shares, outer_s, busy."""
    t0 = min(e["ts"] for ev in run.events.values() for e in of(ev, "state") if e.get("state") == "training")
    outer = of(run.events["node-0"], "outer_step")  # every committed outer step (node-0 is never the slow one)
    t1 = max(of(ev, "outer_step")[-1]["ts"] for ev in run.events.values())
    trained = {node: of(ev, "step")[-1]["tokens"] for node, ev in run.events.items()}
    counted = {node: 0 for node in run.events}
    for e in outer:
        for node, w in zip(e["contributors"], e.get("weights") or []):
            counted[node] += int(w)
    tokens = counted if sum(counted.values()) else trained
    wall = t1 - t0
    return {"trained": trained, "tokens": tokens, "wall_s": wall, "tokens_per_s": sum(tokens.values()) / wall,
            "outer_steps": len(outer), "shares": shares(outer),
            "outer_s": {node: statistics.fmean(e["outer_s"] for e in of(ev, "outer_step"))
                        for node, ev in run.events.items()},
            # the share of the wall time each node spent in inner steps (not waiting at or in an outer step)
            "busy": {node: sum(e["compute_s"] for e in of(ev, "outer_step")) / wall
                     for node, ev in run.events.items()}}


def shares(outer_events: list[dict]) -> list[dict[str, float]]:
    """Each outer step's {node: its weight / the sum of the weights} (the tokens it trained that round)."""
    out = []
    for e in outer_events:
        weights = e.get("weights") or []
        total = sum(weights)
        out.append({n: w / total for n, w in zip(e["contributors"], weights)} if total else {})
    return out


def mean_share(run_shares: list[dict[str, float]], node: str) -> float:
    return statistics.fmean(s.get(node, 0.0) for s in run_shares) if run_shares else float("nan")


def evaluate(runs: list[Run], args) -> None:
    """node-0's export of each DiLoCo run on the held-out split of its seed (bench/learning.py's helpers)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    import learning

    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)
    splits = {}
    for run in runs:
        if run.export is None:
            continue
        if run.seed not in splits:
            ns = argparse.Namespace(data=ROOT / "corpus", seq_len=args.seq_len, seed=run.seed, micro_batch=16,
                                    device="cpu")
            stream = learning.held_out(ns).eval
            ns.eval_batches = max(1, min(args.eval_batches, stream.source.num_sequences // ns.micro_batch))
            splits[run.seed] = (stream, ns)
        stream, ns = splits[run.seed]
        model = AutoModelForCausalLM.from_pretrained(run.export, local_files_only=True, dtype=torch.float32)
        run.eval_loss = learning.eval_model(model, stream, ns)


# ---------------------------------------------------------------------------------------------- report

def spread(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f} (one seed)"
    return f"{statistics.fmean(xs):.3f} (sd {statistics.stdev(xs):.3f}, min {min(xs):.3f}, max {max(xs):.3f}, " \
           f"{len(xs)} seeds)"


def uncounted(f: dict) -> str:
    """Tokens trained but not counted by any outer step (left out of a mean), if any."""
    lost = {n: f["trained"][n] - f["tokens"][n] for n in f["tokens"] if f["trained"][n] != f["tokens"][n]}
    return f" (trained but not counted: {', '.join(f'{n} {t}' for n, t in lost.items())})" if lost else ""


def busy_ratio(f: dict, solo: dict[str, float]) -> float:
    """R1 as the busy time predicts it: sum over nodes of solo tokens/s x busy share / the sum of solo tokens/s. It
    assumes a node trains at its solo speed while busy, so it misses what the rounds cost besides waiting, but it
    hardly moves with the machine's load (a quotient of two durations of the same run)."""
    return sum(solo[n] * f["busy"][n] for n in solo) / sum(solo.values())


def group_report(runs: dict[str, Run], figs: dict[str, dict], solo: dict[str, float], show_shares: bool) -> list[str]:
    size, seed = runs["solo"].size, runs["solo"].seed
    slow = f"node-{size - 1}"
    lines = [f"{size} engines, seed {seed} ({slow} at speed {runs['time'].speeds[-1]:g}, the others at 1; "
             f"time-equal: all at {runs['time-equal'].speeds[0]:g}):"]
    for arm in ("solo", "solo-after"):
        rates = solo_rates(runs[arm])
        fast = statistics.fmean(r for n, r in rates.items() if n != slow)
        held = runs[arm].throttled_s.get(slow)
        lines.append(f"  {arm:<10} " + " ".join(f"{n} {r:.0f}" for n, r in rates.items()) +
                     f" tok/s, sum {sum(rates.values()):.0f}; {slow} / the others {rates[slow] / fast:.2f}" +
                     (f" (its quota held it back {held:.1f} s)" if held is not None else "") +
                     f"; load {runs[arm].load[0]:.1f}")
    total = sum(solo.values())
    lines.append(f"  {'solo mean':<10} sum {total:.0f} tok/s (the reference of R1 and R0)")
    for arm in ("steps", "time", "time-mixed", "time-equal"):
        f, r = figs[arm], runs[arm]
        vs = f"= {f['tokens_per_s'] / total:.3f} of the solo sum (busy time: {busy_ratio(f, solo):.3f}); " \
            if arm in ("steps", "time") else "(side by side); "
        lines.append(f"  {arm:<10} {f['tokens_per_s']:.0f} tok/s {vs}tokens "
                     f"{' '.join(str(t) for t in f['tokens'].values())}{uncounted(f)} in {f['wall_s']:.1f} s, "
                     f"{f['outer_steps']} outer steps (H {r.h}); {slow}'s share {mean_share(f['shares'], slow):.3f}; "
                     f"held-out {r.eval_loss:.4f}; load {r.load[0]:.1f}")
    tokens = sum(figs["time-mixed"]["tokens"].values()) / sum(figs["time-equal"]["tokens"].values())
    lines.append(f"  time-mixed / time-equal: tokens {tokens:.3f}, held-out loss "
                 f"{runs['time-mixed'].eval_loss / runs['time-equal'].eval_loss:.4f}")
    if show_shares:
        for arm in ("time", "steps"):
            nodes = list(runs[arm].events)
            lines.append(f"  each node's share of each outer step, {arm} rounds (outer_step weights / their sum):")
            lines.append("    outer step " + " ".join(f"{n:>7}" for n in nodes) + "   weights (tokens)")
            for k, (sh, e) in enumerate(zip(figs[arm]["shares"], of(runs[arm].events["node-0"], "outer_step")), 1):
                lines.append(f"    {k:>10} " + " ".join(f"{sh.get(n, 0.0):7.3f}" for n in nodes) +
                             f"   {' '.join(str(int(w)) for w in e.get('weights') or [])}")
        for arm in ("time", "steps"):
            f = figs[arm]
            lines.append(f"  {arm} rounds, per node: busy " + ", ".join(f"{n} {b:.2f}" for n, b in f["busy"].items())
                         + "; mean outer_s (boundary to commit, waits for the others included) "
                         + ", ".join(f"{n} {sec:.2f} s" for n, sec in f["outer_s"].items()))
    return lines


# one stage after another; the runs of a stage go side by side (the pair for R2 shares the machine's load)
STAGES = (("solo",), ("steps",), ("time",), ("time-mixed", "time-equal"), ("solo-after",))


def measure_group(args, size: int, seed: int, workdir: Path) -> tuple[dict[str, Run], dict[str, dict], dict]:
    """The runs of one size and seed, primed in batches; (runs, cluster figures, solo tokens/s per node: the mean of
    the solo runs before and after the DiLoCo runs)."""
    mixed = [1.0] * (size - 1) + [args.slow]
    equal = [statistics.fmean(mixed)] * size
    stages = [[Run(arm, size, seed, equal if arm == "time-equal" else mixed) for arm in stage] for stage in STAGES]
    h = 0
    for batch in batches(stages):
        primed: list[list[Primed]] = []
        t0 = time.monotonic()
        try:
            for stage in batch:
                primed.append([])
                for run in stage:
                    primed[-1].append(Primed(args, run, workdir))
            preload_eval()
            procs = [p for stage in primed for pr in stage for p in pr.procs]
            wait_until(lambda: all(pr.ready() for stage in primed for pr in stage), 600, "the engines' imports",
                       procs)
            say(f"{size} engines, seed {seed}: {len(procs)} processes primed in {time.monotonic() - t0:.0f} s")
            for stage in primed:
                t0 = time.monotonic()
                release(args, stage, h)
                if stage[0].run.arm == "solo":  # a step round: about the tokens of a time round at the mean speed
                    steps_per_s = statistics.fmean(solo_rates(stage[0].run).values()) / (args.micro_batch *
                                                                                        args.seq_len)
                    h = max(2, round(args.round_seconds * steps_per_s))
                say(f"{size} engines, seed {seed}: {' + '.join(pr.run.arm for pr in stage)} in "
                    f"{time.monotonic() - t0:.0f} s")
        finally:
            for stage in primed:
                for pr in stage:
                    pr.close()
    by = {r.arm: r for stage in stages for r in stage}
    before, after = solo_rates(by["solo"]), solo_rates(by["solo-after"])
    solo = {node: (before[node] + after[node]) / 2 for node in before}
    return by, {arm: cluster_figures(r) for arm, r in by.items() if r.diloco}, solo


def say(line: str) -> None:
    """Progress, on stderr: stdout holds the report."""
    print(f"  {line}", file=sys.stderr, flush=True)


def preload_eval() -> None:
    """The eval's imports (torch, transformers), done while the engines do theirs."""
    for name in ("torch", "transformers"):
        importlib.import_module(name)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4", help="engines per run, comma-separated")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per size (1337, 1338, ...)")
    ap.add_argument("--rounds", type=int, default=6, help="outer steps per DiLoCo run")
    ap.add_argument("--round-seconds", type=float, default=10.0, help="diloco.round_seconds of the time runs")
    ap.add_argument("--solo-seconds", type=float, help="each solo run's length once all train (default: half a "
                    "time run, rounds x round seconds / 2)")
    ap.add_argument("--slow", type=float, default=0.5, help="the slow engine's speed (1 = full)")
    ap.add_argument("--grace", type=float, help="diloco.straggler_grace of the time runs (default: the engine's, a "
                    "quarter of a round; --quick: a whole round, since a slow step on a loaded machine outlasts "
                    "a quarter of 3 s and the slow node is then left out of the round)")
    ap.add_argument("--micro-batch", type=int, default=4, help="sequences per step (small: the rounds' step "
                    "granularity, a slow step past the deadline, is time the others wait)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--eval-batches", type=int, default=64, help="at most this many held-out batches of 16")
    ap.add_argument("--throttle", choices=("auto", "cgroup2", "cgroup1", "signals"), default="auto")
    ap.add_argument("--quick", action="store_true", help="CI size: 2 engines, 2 rounds of 3 s, one seed, 6 "
                    "held-out batches")
    ap.add_argument("--json", type=Path, help="also write every figure here")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.seeds, args.rounds, args.round_seconds, args.solo_seconds = "2", 1, 2, 3.0, 4.0
        args.grace = args.round_seconds if args.grace is None else args.grace
        args.eval_batches = min(args.eval_batches, 6)
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes {args.sizes!r}: expected comma-separated integers")
    if not args.sizes or any(n < 2 for n in args.sizes):
        ap.error("--sizes: each size must be at least 2 (one slow engine and one other)")
    if not 0 < args.slow < 1:
        ap.error(f"--slow {args.slow}: a speed between 0 and 1")
    if args.seeds < 1 or args.rounds < 1:
        ap.error("--seeds and --rounds must be at least 1")
    args.solo_seconds = args.solo_seconds or args.rounds * args.round_seconds / 2
    args.cores = len(os.sched_getaffinity(0))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        args.throttle_kind, args.throttle_mount, note = choose_throttle(args.throttle)
    except BenchFailed as e:
        print(f"mixed: {e}", file=sys.stderr)
        return 2
    print(f"slowing: {note}; {args.cores} cores; load average {os.getloadavg()[0]:.1f} at the start "
          f"(the machine is shared: tokens/s are noisy)")
    per_size: dict[int, dict[str, list[float]]] = {}
    record = []
    try:
        with tempfile.TemporaryDirectory(prefix="zb-mixed-") as tmp:
            for size in args.sizes:
                got = per_size.setdefault(size, {k: [] for k in ("r1", "r0", "r2", "r1_busy", "r0_busy",
                                                                  "pair_tokens", "slow_share")})
                for seed in range(1337, 1337 + args.seeds):
                    runs, figs, solo = measure_group(args, size, seed, Path(tmp))
                    t0 = time.monotonic()
                    evaluate(list(runs.values()), args)
                    say(f"{size} engines, seed {seed}: held-out losses in {time.monotonic() - t0:.0f} s")
                    for line in group_report(runs, figs, solo, show_shares=seed == 1337):
                        print(line, flush=True)
                    total = sum(solo.values())
                    got["r1"].append(figs["time"]["tokens_per_s"] / total)
                    got["r0"].append(figs["steps"]["tokens_per_s"] / total)
                    got["r2"].append(runs["time-mixed"].eval_loss / runs["time-equal"].eval_loss)
                    got["r1_busy"].append(busy_ratio(figs["time"], solo))
                    got["r0_busy"].append(busy_ratio(figs["steps"], solo))
                    got["pair_tokens"].append(sum(figs["time-mixed"]["tokens"].values()) /
                                              sum(figs["time-equal"]["tokens"].values()))
                    got["slow_share"].append(mean_share(figs["time"]["shares"], f"node-{size - 1}"))
                    record.append({"size": size, "seed": seed, "solo": solo, "figures": figs,
                                   "runs": {a: {k: v for k, v in asdict(r).items() if k != "events"}
                                            for a, r in runs.items()}})
    except BenchFailed as e:
        print(f"mixed: {e}", file=sys.stderr)
        return 2
    for size, got in per_size.items():
        print(f"{size} engines: R1 {spread(got['r1'])}; R0 {spread(got['r0'])}")
        print(f"  from the busy time: R1 {spread(got['r1_busy'])}; R0 {spread(got['r0_busy'])}")
        print(f"  R2 {spread(got['r2'])}, at a token ratio (mixed / equal) of {spread(got['pair_tokens'])}")
        print(f"  the slow node's mean share of a time round {statistics.fmean(got['slow_share']):.3f} (its speed's "
              f"share of the total: {args.slow / (size - 1 + args.slow):.3f})")
    worst = min(per_size, key=lambda n: statistics.fmean(per_size[n]["r1"]))
    r1, r0 = (statistics.fmean(per_size[worst][k]) for k in ("r1", "r0"))
    r2 = max(statistics.fmean(got["r2"]) for got in per_size.values())
    met1, met2 = r1 >= GOAL_R1, r2 <= GOAL_R2
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print(f"goals (issue 22): R1 >= {GOAL_R1}: {'met' if met1 else 'NOT MET'} ({worst} engines, the worst size); "
          f"R2 <= {GOAL_R2}: {'met' if met2 else 'NOT MET'} (the worst size's mean over "
          f"{args.seeds} seed{'s' if args.seeds > 1 else ''})")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "groups": record,
                                         "r1": r1, "r0": r0, "r2": r2}, indent=1))
    print(LAST.format(r1=r1, r0=r0, r2=r2))
    return 0 if met1 and met2 else 3


if __name__ == "__main__":
    sys.exit(main())
