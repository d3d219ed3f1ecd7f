"""Slow-link lab: real engines on hosts joined by shaped links, DiLoCo's outer step against what the links allow.

    python bench/wan.py --rate 200mbit                    # 15m, 2 hosts, none/bf16/int8: ~6 min on 2 cores (root)
    python bench/wan.py --rate 1gbit --hosts 4 --inner-steps 10
    python bench/wan.py --rate 200mbit --slow-start-after-idle 0 --compressions none,int8 --overlap int8
    python bench/wan.py --rate 200mbit --compressions none,int8,sparse --overlap int8   # SparseLoCo beside them
    python bench/wan.py --rate 1gbit --hosts 4 --compressions none,int8,sparse --sync-only   # outer steps only
    python bench/wan.py --quick                           # CI: debug model, 2 hosts, a few seconds per run

The lab (tests/lab/net.py, the chaos lab's namespaces, under its lock): 2 to 4 hosts, each a network namespace on
one bridge, each host's uplink (eth0's egress) a token bucket, `tc qdisc ... tbf rate RATE burst B latency 50ms`;
optional loss (--loss P: nftables drops P% of the packets in and out of every host, so a path loses ~2P%). Hosts
reach each other only through the bridge, so every byte between them crosses two links and one bucket.

What runs there, one run after another (nothing else shares the 2 cores):
    DiLoCo sync   per compression: `python -m engine.store` on host a, `python -m engine.train` on every host
                  (configs/debug-diloco.toml + the flags below: fake data, fp32, CPU, one thread each)
    overlapped    the same with --diloco.overlap=true (per compression in --overlap): the outer step lands once it
                  is done (--overlap-delay 0, the engine's default) or N inner steps into the next round, and the
                  node trains on from its own weights meanwhile (--overlap-update delayed); or, with --fragments P,
                  streaming DiLoCo instead: diloco.fragments = P, each fragment's outer step in the background for
                  --fragment-delay inner steps (default H / P: it lands at the next fragment's boundary)
    no DiLoCo     the same engines with --diloco.enabled=false: each host trains alone, no wire at all (not with
                  --sync-only, which --quick implies: there the none arm's inner steps between two boundaries stand
                  in, and nothing runs overlapped)
    bare          a gloo all-reduce (ring) of the same bytes per host over the same links, its group built as the
                  engine builds one (engine.mesh.make_group), timed back to back ("warm") and after --idle seconds
                  of quiet ("idle": the gloo connections of an outer step have been idle for a round); the
                  compressed outer step's own pattern on the same bytes ("pieces", after --idle: its reduce-scatter
                  and all-gather as send/recv of PIECE_BYTES pieces, no codec between them); and the pattern before
                  the pieces, one all_to_all and one all_gather (their seconds on a line of their own)

Each run trains max_steps = H x (rounds + 2). Outer step 1 is the run's first: it carries the state hand-off (the
source's fp32 parameters go down a chain to every member). Each host starts from weights of its own seed, as from
checkpoints of different ages, so that the state must move: from one seed the members would find by their
fingerprints that they already hold it, and nothing would. Outer steps 2 on are the measured ones: of each, the event
of the host that arrived last at the boundary (it waited for no peer), and the medians over those steps of
outer_s, wire_s, codec_s and other_s = outer_s - wire_s - codec_s (neither wire nor codec: the mesh's store round
trips and their polling, the passes over the parameters, the commit, the checksum; --phases splits it). Tokens/s
are the whole cluster's from the step events between the boundaries at steps 2H and the last (every round in the
window pays one outer step).

    link bound   bytes_sent of the event (what each host puts on its own uplink) x 8 / rate
    wire rate    link bound / wire_s: the share of its link's rate the wire got (goal >= 90%)
    hand-off     outer step 1's outer_s against (its all-reduce bytes + the state bytes) x 8 / rate, the least any
                 broadcast from one source takes (goal <= 1.2x); "chain" is the hand-off's own part (its phase)

Last line (R2 and R3 are int8's):
    `slow link RATE Nx: int8/none outer step R1; outer step / link bound R2; overlapped / no-DiLoCo tokens/s R3`
and, with sparse among the compressions (SparseLoCo at the engine's defaults, docs/sparse.md), after it:
    `slow link RATE Nx: sparse/none outer step R4; sparse bytes / none bytes B2`
Goals (issue 21, over the dense codecs): R1 <= 0.3; every codec's wire >= 90% of its link; other_s <= 0.05 s;
R3 >= 0.95; hand-off <= 1.2x. Issue 43, with sparse: R4 <= 0.1 with 2 hosts and <= 0.15 with more, at 200mbit or
slower (at a faster rate R4 is reported, no goal); none's outer step <= 1.1x its link bound (R4's denominator is
honest); sparse's wire <= 1.5x its link bound. Sparse is not run overlapped unless --fragments (diloco.overlap
with sparse is refused by the engine until it is wired). Exit status 0 when every goal is met, 3 when one is not
(the lines above say which), 2 when the lab failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the lab's namespace code lives beside the chaos tests

from lab import net  # noqa: E402
from lab.lab import LabError, holding_lock  # noqa: E402

NAMES = "abcd"
STORE_PORT = 29600
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's bit units are decimal
LATENCY = "50ms"
GOAL_R1, GOAL_WIRE, GOAL_OTHER, GOAL_R3, GOAL_HANDOFF = 0.3, 0.9, 0.05, 0.95, 1.2
# issue 43: sparse/none outer step at 200mbit or slower (2 hosts; more), none's outer step and sparse's wire against
# their link bounds
GOAL_R4, GOAL_R4_MORE, GOAL_R4_RATE, GOAL_NONE_BOUND, GOAL_SPARSE_WIRE = 0.1, 0.15, 200e6, 1.1, 1.5
GATHERED = ("sparse",)  # all-gathered, not reduced: issue 43's goals, not issue 21's


class LabFailed(RuntimeError):
    """The lab itself could not measure (set-up, a process that failed or hung): one line and a log tail."""


@dataclass
class Arm:
    compression: str  # "" for the run without DiLoCo
    overlap: bool = False

    @property
    def name(self) -> str:
        if not self.compression:
            return "no-diloco"
        return f"{self.compression}-{'overlap' if self.overlap else 'sync'}"


@dataclass
class ArmResult:
    arm: Arm
    events: dict[str, list[dict]]  # per host
    seconds: float = 0.0
    phases: list[dict] = field(default_factory=list)


# ---- arguments ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/wan.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="exit: 0 every goal met, 3 a goal missed, 2 the lab failed (needs root)")
    p.add_argument("--rate", default="200mbit", help="each host's uplink, tc units: 100mbit ... 10gbit")
    p.add_argument("--hosts", type=int, default=2, help="engine hosts, 2..4 (the store runs on host a)")
    p.add_argument("--loss", type=int, default=0, help="percent of packets dropped in and out of every host")
    p.add_argument("--slow-start-after-idle", type=int, choices=(0, 1), default=None,
                   help="net.ipv4.tcp_slow_start_after_idle in every namespace (default: the kernel's, 1)")
    p.add_argument("--preset", default="15m", help="model preset (debug, 15m, 150m)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step (= batch: no accumulation)")
    p.add_argument("--inner-steps", type=int, default=5, help="H")
    p.add_argument("--rounds", type=int, default=3, help="rounds in the tokens/s window (outer steps measured: +1)")
    p.add_argument("--compressions", default="none,bf16,int8", help="none and int8, and any of bf16, fp16, sparse "
                   "(sparse at the engine's defaults: diloco.sparse_chunk 4096, density 0.0156, 2 bits, beta 0.95)")
    p.add_argument("--overlap", default=None, help="compressions also run overlapped (default: all of them but "
                   "sparse, whose overlap is not wired yet; with --fragments, sparse too)")
    p.add_argument("--overlap-update", choices=("eager", "delayed"), default="delayed",
                   help="diloco.overlap_update of the overlapped runs")
    p.add_argument("--overlap-delay", type=int, default=0,
                   help="diloco.overlap_delay of the overlapped runs: 0 (the engine's default) lands the outer step at "
                        "the first inner step after it is done; N: exactly N steps into the next round")
    p.add_argument("--fragments", type=int, default=1, help="the overlapped runs use diloco.fragments = P instead of "
                   "diloco.overlap (P must divide --inner-steps)")
    p.add_argument("--fragment-delay", type=int, default=None, help="diloco.fragment_delay of the --fragments runs "
                   "(default: --inner-steps / --fragments)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    p.add_argument("--bare-reps", type=int, default=3, help="timed bare all-reduces per size and mode")
    p.add_argument("--idle", type=float, default=1.0, help="seconds of quiet before each idle bare all-reduce")
    p.add_argument("--phases", action="store_true",
                   help="sync runs also print where other_s goes (wraps the mesh's and the outer step's calls)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine override for every run, e.g. --set mesh.polling_interval=0.01 (repeatable)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds one run may take")
    p.add_argument("--keep", action="store_true", help="keep the run dirs (events, logs) and print where")
    p.add_argument("--json", default=None, help="also write every figure here")
    p.add_argument("--sync-only", action="store_true", help="only the sync arms and the bare collectives: no "
                   "overlapped run and none without DiLoCo (R3 is not measured; the none arm's inner steps stand in "
                   "for the run without DiLoCo): the codecs' outer steps in about half the time")
    p.add_argument("--quick", action="store_true", help="CI: debug model, seq 64 x 2, H 5, 1 round, none, int8 "
                   "and sparse, one bare repetition; --sync-only unless --overlap is given (R3 is then not measured)")
    p.add_argument("--bare-worker", default=None, help=argparse.SUPPRESS)  # internal: one rank of the bare run
    return p


def parse_args(argv: list[str] | None):
    args = build_parser().parse_args(argv)
    if args.quick:
        args.preset, args.seq_len, args.micro_batch, args.inner_steps, args.rounds = "debug", 64, 2, 5, 1
        args.compressions, args.bare_reps, args.idle = "none,int8,sparse", 1, 0.3
        args.run_timeout = min(args.run_timeout, 120.0)
        # the sync arms only, unless --overlap says otherwise: the sparse arm took the seconds of the overlapped and
        # the no-DiLoCo runs, whose engines' paths tests/test_diloco_e2e.py (overlap) and every engine test cover
        args.sync_only = args.sync_only or args.overlap is None
    args.compressions = [c for c in args.compressions.split(",") if c]
    if args.sync_only:
        args.overlap = []
    elif args.overlap is None:  # diloco.overlap with sparse is refused by the engine (not wired yet): sparse runs sync
        args.overlap = [c for c in args.compressions if c != "sparse" or args.fragments > 1]
    else:
        args.overlap = [c for c in args.overlap.split(",") if c]
    args.rate_bps = rate_bps(args.rate)
    if not 2 <= args.hosts <= len(NAMES):
        raise ValueError(f"--hosts must be in 2..{len(NAMES)}, got {args.hosts}")
    if not 0 <= args.loss < 100:
        raise ValueError(f"--loss must be in 0..99, got {args.loss}")
    if "none" not in args.compressions or "int8" not in args.compressions:
        raise ValueError("--compressions must include none and int8 (the last line compares them)")
    if "int8" not in args.overlap and not args.sync_only:
        raise ValueError("--overlap must include int8 (the last line's R3)")
    if "sparse" in args.overlap and args.fragments == 1:
        raise ValueError("--overlap sparse: diloco.overlap with compression sparse is not wired yet (the engine "
                         "refuses it); leave sparse out of --overlap, or use --fragments")
    if args.fragments > 1 and args.inner_steps % args.fragments:
        raise ValueError(f"--fragments {args.fragments} must divide --inner-steps {args.inner_steps}")
    if args.fragment_delay is None:
        args.fragment_delay = args.inner_steps // args.fragments if args.fragments > 1 else 0
    return args


def rate_bps(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text.strip().lower())
    if not m:
        raise ValueError(f"--rate: expected a number and kbit, mbit or gbit (tc's units), got {text!r}")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]


def burst_for(rate: float) -> str:
    """tbf needs a bucket of at least rate / HZ bytes to reach its rate: 5 ms of the rate, and never below 256 KiB."""
    return f"{max(256 * 1024, int(rate / 8 * 0.005))}b"


# ---- the lab --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def lab(args):
    """The shaped hosts, under the chaos lab's lock; everything of the lab's prefix is removed before and after."""
    if os.geteuid() != 0:
        raise LabFailed("needs root (network namespaces, tc, nftables)")
    with holding_lock(600):  # one lab at a time: they share the names and the subnet
        net.cleanup_leftovers()
        hosts = [net.NetHost(NAMES[i], 10 + i) for i in range(args.hosts)]
        try:
            net.create_bridge()
            for host in hosts:
                net.create_host(host)
                net.shape(host, args.rate, burst=burst_for(args.rate_bps), latency=LATENCY)
                if args.loss:
                    net.drop(host, args.loss)
                if args.slow_start_after_idle is not None:
                    net.sh(host.exec_args("sysctl", "-qw",
                                          f"net.ipv4.tcp_slow_start_after_idle={args.slow_start_after_idle}"))
            yield hosts
        finally:
            for host in hosts:
                net.remove_host(host.netns)  # the engines and the store run in there: killed first
            net.cleanup_leftovers()


def slow_start_setting(host: net.NetHost) -> str:
    return net.sh(host.exec_args("sysctl", "-n", "net.ipv4.tcp_slow_start_after_idle")).strip()


class Proc:
    """A process in a host's namespace: stdout and stderr into files, its own process group, killed by that id."""

    def __init__(self, host: net.NetHost, argv: list[str], out: Path, threads: int):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_BAND_", "GLOBAL_"))}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        self.out, self.err = out.with_suffix(".jsonl"), out.with_suffix(".log")
        with open(self.out, "wb") as so, open(self.err, "wb") as se:
            self.proc = subprocess.Popen(host.exec_args(*argv), cwd=ROOT, env=env, stdout=so, stderr=se,
                                         start_new_session=True)

    def lines(self) -> list[dict]:
        out = []
        for line in self.out.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out

    def tail(self) -> str:
        return self.err.read_text(errors="replace")[-1500:]

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def wait_all(procs: list[Proc], timeout: float, what: str) -> None:
    """Until every process ended by itself with status 0; a failure or the timeout kills them all."""
    deadline = time.monotonic() + timeout
    while any(p.proc.poll() is None for p in procs):
        failed = [p for p in procs if p.proc.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for p in procs:
                p.stop()
            bad = failed[0] if failed else next(p for p in procs if p.proc.returncode != 0)
            why = f"exit {bad.proc.returncode}" if failed else f"timed out after {timeout:.0f}s"
            raise LabFailed(f"{what}: {bad.out.stem} {why}\n{bad.tail()}")
        time.sleep(0.2)
    bad = [p for p in procs if p.proc.returncode != 0]
    if bad:
        raise LabFailed(f"{what}: {bad[0].out.stem} exit {bad[0].proc.returncode}\n{bad[0].tail()}")


# ---- the engines ----------------------------------------------------------------------------------------------
def engine_overrides(args, arm: Arm, host: net.NetHost, store: net.NetHost, port: int, run_dir: Path,
                     index: int = 0) -> list[str]:
    h = args.inner_steps
    over: dict[str, object] = {
        "train.init_seed": 1234 + index,  # each host its own start: the hand-off moves the state (the docstring)
        "model.preset": args.preset, "data.fake": "true", "data.seq_len": args.seq_len,
        "train.micro_batch_size": args.micro_batch, "train.batch_size": args.micro_batch, "train.precision": "fp32",
        "train.max_steps": h * (args.rounds + 2), "train.log_interval": 1, "train.eval_interval": 0,
        "inner.device": "cpu", "ckpt.interval": 0, "telemetry.human": "false", "telemetry.resource_interval": 600,
        "run.dir": run_dir / host.name, "mesh.node_id": host.name,
        "diloco.enabled": "true" if arm.compression else "false", "diloco.inner_steps": h,
        # a slow link moves a 15m model's fp32 bytes in seconds; the defaults' 30 s would not do at 100mbit x 4
        "diloco.allreduce_timeout": 300, "mesh.start_timeout": 300, "diloco.min_nodes": args.hosts,
        "mesh.store_addr": store.address, "mesh.store_port": port}
    if arm.compression:
        over.update({"diloco.compression": arm.compression, "diloco.overlap": "true" if arm.overlap else "false"})
    if arm.overlap and args.fragments > 1:
        over.update({"diloco.overlap": "false", "diloco.fragments": args.fragments,
                     "diloco.fragment_delay": args.fragment_delay})
    elif arm.overlap:
        over.update({"diloco.overlap_update": args.overlap_update, "diloco.overlap_delay": args.overlap_delay})
    for item in args.set:
        key, _, value = item.partition("=")
        over[key] = value
    return [f"--{k}={v}" for k, v in over.items()]


def run_arm(args, arm: Arm, hosts: list[net.NetHost], work: Path, port: int) -> ArmResult:
    """The store (DiLoCo only) on host a and one engine per host; every one must end with status 0."""
    run_dir = work / arm.name
    run_dir.mkdir(parents=True)
    procs: list[Proc] = []
    store: Proc | None = None
    t0 = time.monotonic()
    try:
        if arm.compression:
            store = Proc(hosts[0], [sys.executable, "-m", "engine.store", "--host", hosts[0].address, "--port",
                                    str(port)], run_dir / "store", 1)
        launch = ["-c", PHASES] if args.phases and arm.compression and not arm.overlap else ["-m", "engine.train"]
        for index, host in enumerate(hosts):
            argv = [sys.executable, *launch, "configs/debug-diloco.toml",
                    *engine_overrides(args, arm, host, hosts[0], port, run_dir, index)]
            procs.append(Proc(host, argv, run_dir / host.name, args.threads))
        wait_all(procs, args.run_timeout, arm.name)  # engines connect to the store as it comes up (store_timeout)
        if store is not None:
            store.stop(signal.SIGTERM)
    finally:
        for p in procs + ([store] if store is not None else []):
            p.stop()
    events = {h.name: [e for e in p.lines() if e.get("type") != "bench_phases"] for h, p in zip(hosts, procs)}
    phases = [e for p in procs for e in p.lines() if e.get("type") == "bench_phases"]
    return ArmResult(arm, events, time.monotonic() - t0, phases)


# Where other_s goes: runs the engine with its mesh calls and the outer step's helpers timed from outside (every
# wrapper is optional, so an engine whose internals moved still runs), and prints one "bench_phases" line per outer
# step: the seconds of each wrapped call since the boundary, the outer's own last_phases, and the CPU seconds the
# process spent in the call to after_inner_step that held the outer step (cpu_s: every thread's, gloo's included;
# what the step's work costs, whatever share of the cores a loaded machine gave it).
PHASES = """import json, sys, time
import engine.mesh.node as _node, engine.outer as _outer
spent, outer, cpu0 = {}, [], [0.0]
def _timed(name, fn):
    def run(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    return run
for _name in ("boundary", "commit"):
    if hasattr(_node.Mesh, _name):
        setattr(_node.Mesh, _name, _timed("mesh_" + _name, getattr(_node.Mesh, _name)))
_build = getattr(_outer, "build_outer", None)
if _build is not None:
    def _capture(*a, **k):
        o = _build(*a, **k)
        outer.append(o)
        for _path, _label in (("_checksum", "checksum"), ("links.group", "group"), ("local.stats", "local_stats"),
                              ("links.bounded", "bounded"), ("_not_finite", "not_finite"),
                              ("sentinel.screen", "sentinel")):
            _owner, _, _attr = ("." + _path).rpartition(".")
            _obj = o
            for _part in filter(None, _owner.split(".")):
                _obj = getattr(_obj, _part, None)
            if _obj is not None and hasattr(_obj, _attr):
                setattr(_obj, _attr, _timed(_label, getattr(_obj, _attr)))
        if hasattr(o, "after_inner_step"):
            _step = o.after_inner_step
            def _after(*a, **k):
                cpu0[0] = time.process_time()
                return _step(*a, **k)
            o.after_inner_step = _after
        return o
    _outer.build_outer = _capture
import engine.telemetry as _tel
_emit = _tel.Telemetry.emit
def _emit_and_phases(self, type_, **fields):
    event = _emit(self, type_, **fields)
    if type_ == "outer_step":
        own = dict(getattr(outer[0], "last_phases", {}) or {}) if outer else {}
        row = {"type": "bench_phases", "outer_step": fields.get("outer_step"), "node": self.node,
               "outer_s": fields.get("outer_s"), "calls": dict(spent), "phases": own,
               "cpu_s": time.process_time() - cpu0[0]}
        spent.clear()
        print(json.dumps(row), flush=True)
    return event
_tel.Telemetry.emit = _emit_and_phases
import engine.train
sys.argv = ["engine.train"] + sys.argv[1:]
engine.train.cli()
"""


# ---- the bare all-reduce --------------------------------------------------------------------------------------
def run_bare(args, hosts: list[net.NetHost], sizes: dict[str, int], work: Path, port: int) -> dict[str, dict]:
    """One gloo all-reduce group over the hosts; per codec's size: seconds back to back and after --idle."""
    spec = {"n": args.hosts, "addr": hosts[0].address, "port": port, "sizes": sizes, "reps": args.bare_reps,
            "idle": args.idle, "timeout": args.run_timeout}
    (work / "bare").mkdir()
    procs = [Proc(host, [sys.executable, str(Path(__file__).resolve()), "--bare-worker",
                         json.dumps({**spec, "rank": r})], work / "bare" / host.name, 1)
             for r, host in enumerate(hosts)]
    try:
        wait_all(procs, args.run_timeout, "bare all-reduce")
    finally:
        for p in procs:
            p.stop()
    return {row["codec"]: row for row in procs[0].lines()}


def bare_worker(spec: dict) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from engine.mesh import make_group
    from engine.mesh.protocol import Plan
    from engine.outer import allreduce

    torch.set_num_threads(1)
    rank, n = spec["rank"], spec["n"]
    store = dist.TCPStore(spec["addr"], spec["port"], n, rank == 0, timedelta(seconds=spec["timeout"]))
    names = tuple(NAMES[:n])
    plan = Plan(generation=1, outer_step=1, attempt=0, members=names, source=names[0], contributors=names)
    pg = make_group(store, plan, names[rank], 0, spec["timeout"])
    tick, slowest = torch.zeros(1), dist.AllreduceOptions()
    slowest.reduceOp = dist.ReduceOp.MAX

    def timed(gap: float, collective) -> tuple[float, int]:
        """The slowest rank's seconds of one collective after `gap` seconds of quiet, and this rank's bytes."""
        time.sleep(gap)
        pg.allreduce([tick]).wait()  # line the ranks up: no one waits for a late peer inside the timing
        w0, t0 = _wchar(), time.perf_counter()
        collective()
        took = torch.tensor([time.perf_counter() - t0])
        wrote = _wchar() - w0
        pg.allreduce([took], slowest).wait()
        return float(took), wrote

    for codec, nbytes in spec["sizes"].items():
        x = torch.zeros(max(1, nbytes // 4))
        # the engine's compressed pattern on the same bytes: all_to_all of n rows, then all_gather of one row
        rows, mine = torch.zeros(n, x.numel() * 4 // n, dtype=torch.uint8), torch.zeros(x.numel() * 4 // n,
                                                                                        dtype=torch.uint8)
        got = torch.empty_like(rows)
        gathered = [torch.empty_like(mine) for _ in range(n)]

        def ring() -> None:
            pg.allreduce([x]).wait()

        def a2a() -> None:
            pg.alltoall_base(got, rows, [], [], dist.AllToAllOptions()).wait()

        def ag() -> None:
            pg.allgather([gathered], [mine]).wait()

        # the engine's compressed pattern (engine/outer/allreduce.py): the rows as pieces, every receive posted
        # before the sends, once for the reduce-scatter and once for the all-gather
        per = rows.shape[1]
        count = max(1, min(allreduce.MAX_PIECES, -(-per // allreduce.PIECE_BYTES)))
        out_pieces = torch.zeros(n, count, -(-per // count), dtype=torch.uint8)
        in_pieces = torch.empty_like(out_pieces)
        peers = [(rank + i) % n for i in range(1, n)]

        def pieces() -> None:
            for step in range(2):
                works = [pg.recv([in_pieces[j, c]], j, step * count + c) for j in peers for c in range(count)]
                works += [pg.send([out_pieces[j, c]], j, step * count + c) for c in range(count) for j in peers]
                for w in works:
                    w.wait()

        ring(), pieces(), a2a(), ag()  # the first ones connect and allocate
        row: dict = {"codec": codec, "bytes": x.numel() * 4}
        idle = spec["idle"]
        for name, collective, gap in (("warm", ring, 0.0), ("idle", ring, idle), ("pattern_idle", pieces, idle),
                                      ("a2a_idle", a2a, idle), ("ag_idle", ag, idle)):
            runs = [timed(gap, collective) for _ in range(spec["reps"])]
            row[f"{name}_s"] = statistics.median(t for t, _ in runs)
            row[f"{name}_wrote"] = statistics.median(w for _, w in runs)
        if rank == 0:
            print(json.dumps(row), flush=True)
    pg.allreduce([tick]).wait()  # rank 0 serves the store: it leaves last


def _wchar() -> int:
    """Bytes this process wrote through write/writev, sockets included (gloo's tcp transport, framing counted)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


# ---- the figures ----------------------------------------------------------------------------------------------
def outer_events(result: ArmResult) -> list[dict]:
    return [e for ev in result.events.values() for e in ev if e.get("type") == "outer_step"]


def last_arrivals(result: ArmResult) -> dict[int, dict]:
    """Per outer step, the event of the host that reached the boundary last (the least outer_s): it waited for
    no peer's compute, so its seconds are the outer step's own, whatever the skew between the hosts' rounds."""
    out: dict[int, dict] = {}
    for e in outer_events(result):
        k = int(e["outer_step"])
        if k not in out or e["outer_s"] < out[k]["outer_s"]:
            out[k] = e
    return out


def median_of(events: list[dict], key: str) -> float:
    return statistics.median(float(e[key]) for e in events)


def tokens_per_s(result: ArmResult, h: int) -> float:
    """The cluster's tokens/s between the boundaries at step 2H and the last one: whole rounds, each paying one
    outer step (the step event of a boundary step comes before its outer step), the hand-off round left out."""
    total = 0.0
    for events in result.events.values():
        steps = {e["step"]: e for e in events if e.get("type") == "step"}
        last = max(s for s in steps if s % h == 0)
        a, b = steps[2 * h], steps[last]
        total += (b["tokens"] - a["tokens"]) / (b["ts"] - a["ts"])
    return total


def inner_tokens_per_s(result: ArmResult, h: int) -> float:
    """The cluster's tokens/s of the inner steps alone: per host, from the step event after the outer step at 2H (of
    step 2H + 1) to the next boundary's (3H, emitted before its outer step): H - 1 steps, no outer step between."""
    total = 0.0
    for events in result.events.values():
        steps = {e["step"]: e for e in events if e.get("type") == "step"}
        a, b = steps[2 * h + 1], steps[3 * h]
        total += (b["tokens"] - a["tokens"]) / (b["ts"] - a["ts"])
    return total


def params_of(result: ArmResult) -> int:
    return next(int(e["params"]) for ev in result.events.values() for e in ev
                if e.get("type") == "state" and e.get("state") == "training" and "params" in e)


def summarize(args, results: dict[str, ArmResult], bare: dict[str, dict]) -> dict:
    h, rate = args.inner_steps, args.rate_bps
    rows: dict[str, dict] = {}
    for codec in args.compressions:
        sync = results[f"{codec}-sync"]
        last = last_arrivals(sync)
        steady = [e for k, e in sorted(last.items()) if k >= 2]
        if not steady or 1 not in last:
            raise LabFailed(f"{codec}-sync: no outer step after the hand-off (outer steps: {sorted(last)})")
        first = [last[1]]
        sent = median_of(steady, "bytes_sent")
        row = {"outer_s": median_of(steady, "outer_s"), "wire_s": median_of(steady, "wire_s"),
               "codec_s": median_of(steady, "codec_s"), "bytes_sent": sent, "link_bound_s": sent * 8 / rate,
               "other_s": statistics.median(e["outer_s"] - e["wire_s"] - e["codec_s"] for e in steady),
               "compute_s": median_of(steady, "compute_s"), "tokens_per_s_sync": tokens_per_s(sync, h),
               "samples": len(steady)}
        row["wire_rate"] = row["link_bound_s"] / row["wire_s"] if row["wire_s"] > 0 else None
        # per step the least wire_s of any host: the host whose codec finished last waited for no peer's codec (a
        # gathered codec's wire_s holds that wait: every host encodes before its message leaves)
        least = {}
        for e in outer_events(sync):
            k = int(e["outer_step"])
            if k >= 2:
                least[k] = min(least.get(k, float("inf")), float(e["wire_s"]))
        row["wire_s_least"] = statistics.median(least.values()) if least else None
        state = params_of(sync) * 4 * (2 if keeps_momentum(args) else 1)
        handoff_bytes = median_of(first, "bytes_sent") + state
        row["handoff"] = {"outer_s": median_of(first, "outer_s"), "wire_s": median_of(first, "wire_s"),
                          "bytes": handoff_bytes, "state_bytes": state, "link_bound_s": handoff_bytes * 8 / rate}
        row["handoff"]["ratio"] = row["handoff"]["outer_s"] / row["handoff"]["link_bound_s"]
        chain = [r["phases"]["handoff"] for r in sync.phases if r.get("outer_step") == 1 and "handoff" in r["phases"]]
        if chain:  # --phases: the hand-off's own part (the fingerprint check and the chain), its slowest member
            row["handoff"].update(chain_s=max(chain), chain_bound_s=state * 8 / rate)
        overlapped = results.get(f"{codec}-overlap")
        row["tokens_per_s_overlap"] = tokens_per_s(overlapped, h) if overlapped else None
        row["bare"] = bare.get(codec)
        rows[codec] = row
    # --sync-only (and --quick) has no run without DiLoCo: the same engines' tokens/s between two boundaries of the
    # none arm stands in, the inner steps alone with nothing on the wire
    base = tokens_per_s(results["no-diloco"], h) if "no-diloco" in results else inner_tokens_per_s(
        results["none-sync"], h)
    r1 = rows["int8"]["outer_s"] / rows["none"]["outer_s"]
    r2 = rows["int8"]["outer_s"] / rows["int8"]["link_bound_s"]
    r3 = None if rows["int8"]["tokens_per_s_overlap"] is None else rows["int8"]["tokens_per_s_overlap"] / base
    # what R1 could be on these links and cores with a codec that cost nothing: gloo's own ring of int8's bytes plus
    # the part of int8's outer step that is neither wire nor codec (docs/performance.md, "The all-gather started
    # inside the reduce-scatter")
    bare8 = rows["int8"]["bare"] or {}
    floor = ((bare8["warm_s"] + rows["int8"]["other_s"]) / rows["none"]["outer_s"]
             if bare8.get("warm_s") is not None else None)
    out = {"rate": args.rate, "hosts": args.hosts, "rows": rows, "tokens_per_s_no_diloco": base,
           "params": params_of(results["none-sync"]), "r1": r1, "r2": r2, "r3": r3, "r1_floor": floor,
           "phases": phase_table(results, args.compressions) if args.phases else None}
    if "sparse" in rows:  # issue 43: the sparse step against none's, and the bytes each host sends
        sparse, none = rows["sparse"], rows["none"]
        out.update(r4=sparse["outer_s"] / none["outer_s"], b2=sparse["bytes_sent"] / none["bytes_sent"],
                   none_bound=none["outer_s"] / none["link_bound_s"],
                   sparse_wire_bound=sparse["wire_s"] / sparse["link_bound_s"])
    return out


def keeps_momentum(args) -> bool:
    """The hand-off carries the outer momentum too when the outer optimizer keeps one (debug-diloco.toml: none)."""
    sets = dict(item.partition("=")[::2] for item in args.set)
    return float(sets.get("diloco.outer_momentum", 0.0)) > 0 and sets.get("diloco.outer_optimizer") != "average"


def phase_table(results: dict[str, ArmResult], codecs: list[str]) -> dict[str, dict[str, float]]:
    """Per codec, the median seconds of each timed call and phase over the outer steps after the hand-off."""
    out: dict[str, dict[str, float]] = {}
    for codec in codecs:
        chosen = {(k, e["node"]) for k, e in last_arrivals(results[f"{codec}-sync"]).items() if k >= 2}
        rows = [r for r in results[f"{codec}-sync"].phases if (r.get("outer_step"), r.get("node")) in chosen]
        for r in rows:
            calls, own = r["calls"], r["phases"]
            if "cpu_s" in r:  # not a part of outer_s: a column of its own (the CPU the outer step's call cost)
                r.setdefault("extra", {})["cpu_s"] = r.pop("cpu_s")
            if "bounded" in calls:  # the collective in its watchdog thread: the sentinel's screen, wire and codec,
                # plus the waiting around them
                calls["bounded_extra"] = (calls.pop("bounded") - own.get("wire", 0.0) - own.get("codec", 0.0)
                                          - calls.get("sentinel", 0.0))
            calls["rest"] = r["outer_s"] - sum(own.values()) - sum(calls.values())  # what nothing timed covers
        names = sorted({k for r in rows for k in (*r["calls"], *r["phases"])}, key=lambda k: (k == "rest", k))
        out[codec] = {k: statistics.median({**r["phases"], **r["calls"]}.get(k, 0.0) for r in rows)
                      for k in names} if rows else {}
        cpu = [r["extra"]["cpu_s"] for r in rows if "cpu_s" in r.get("extra", {})]
        if cpu:
            out[codec]["cpu_s"] = statistics.median(cpu)
    return out


# ---- the report -----------------------------------------------------------------------------------------------
def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def report(args, s: dict, slow_start: str) -> list[str]:
    rows, base = s["rows"], s["tokens_per_s_no_diloco"]
    lines = [f"slow-link lab: {args.hosts} hosts on a bridge, each uplink tbf {args.rate} (burst "
             f"{burst_for(args.rate_bps)}, latency {LATENCY}), loss {args.loss}% in and out of each host, "
             f"tcp_slow_start_after_idle {slow_start}",
             f"engines: {args.preset} ({s['params'] / 1e6:.1f}M params), seq {args.seq_len} x {args.micro_batch}, "
             f"fp32, CPU, {args.threads} thread(s) each, H {args.inner_steps}, medians of "
             f"{rows['none']['samples']} outer steps after the hand-off (the last host to arrive); store on host a"
             + (f"; overrides {' '.join(args.set)}" if args.set else ""),
             f"machine: {os.cpu_count()} cores; 1-min load average {s['load'][0]:.1f} before the lab, "
             f"{s['load'][1]:.1f} at its end (its own engines add about {args.hosts})"
             + ("; OTHER WORK SHARED THE CORES: tokens/s, codec_s and the passes in other_s are not this machine's"
                if s["load"][0] > (os.cpu_count() or 1) else ""),
             "",
             f"{'codec':6} {'outer_s':>8} {'wire_s':>7} {'codec_s':>8} {'other_s':>8} {'bytes/host':>11} "
             f"{'link bound':>10} {'wire rate':>9} {'bare warm':>9} {'bare idle':>9} {'pieces':>7} {'compute_s':>9} "
             f"{'tok/s sync':>10} {'tok/s overlap':>13}"]
    for codec, r in rows.items():
        bare = r["bare"] or {}
        ovl = f"{r['tokens_per_s_overlap']:13.0f}" if r["tokens_per_s_overlap"] is not None else f"{'-':>13}"
        lines.append(f"{codec:6} {r['outer_s']:8.2f} {r['wire_s']:7.2f} {r['codec_s']:8.3f} {r['other_s']:8.3f} "
                     f"{mb(r['bytes_sent']):>11} {r['link_bound_s']:9.2f}s {pct(r['wire_rate']):>9} "
                     f"{secs(bare.get('warm_s')):>9} {secs(bare.get('idle_s')):>9} "
                     f"{secs(bare.get('pattern_idle_s')):>7} {r['compute_s']:9.2f} "
                     f"{r['tokens_per_s_sync']:10.0f} {ovl}")
    lines += [f"no DiLoCo: {base:.0f} tokens/s ({args.hosts} hosts together"
              + ("; the none arm's inner steps between two boundaries, no run of its own" if args.sync_only
                 else "") + "); sync/no-DiLoCo "
              + ", ".join(f"{c} {r['tokens_per_s_sync'] / base:.2f}" for c, r in rows.items())
              + "".join(f"; overlapped/no-DiLoCo {c} {r['tokens_per_s_overlap'] / base:.2f}" if i == 0 else
                        f", {c} {r['tokens_per_s_overlap'] / base:.2f}" for i, (c, r) in enumerate(
                            (c, r) for c, r in rows.items() if r["tokens_per_s_overlap"] is not None)), ""]
    if "sparse" in rows:
        lines.insert(-1, f"sparse: {sparse_settings(args)}, all-gathered"
                     + ("" if "sparse" in args.overlap else "; not run overlapped (diloco.overlap with sparse is "
                        "not wired yet)"))
    lines.append("bare all_to_all and all_gather, the pattern before the pieces (each moves (n-1)/n of the bytes per "
                 "host: half the link bound alone): "
                 + ", ".join(f"{c} all_to_all {secs(r['bare'].get('a2a_idle_s'))}, all_gather "
                             f"{secs(r['bare'].get('ag_idle_s'))}" for c, r in rows.items() if r["bare"]))
    lines.append("hand-off (the run's first outer step: its all-reduce, then the source's fp32 state down a chain):")
    for codec, r in rows.items():
        ho = r["handoff"]
        chain = (f"; the chain alone {ho['chain_s']:.2f} s for the state's {ho['chain_bound_s']:.2f} s "
                 f"({ho['chain_s'] / ho['chain_bound_s']:.2f}x)" if "chain_s" in ho else "")
        lines.append(f"  {codec:6} outer_s {ho['outer_s']:.2f} (all-reduce wire {ho['wire_s']:.2f}); moves "
                     f"{mb(ho['bytes'] - ho['state_bytes'])} + {mb(ho['state_bytes'])} state; link bound "
                     f"{ho['link_bound_s']:.2f} s; {ho['ratio']:.2f}x{chain}")
    if s["phases"]:
        lines += ["", "where an outer step goes (--phases; medians, s; mesh_* = the store round trips and their "
                  "waits, group = fetching the generation's gloo group, sentinel = its screen (a norm, a sample, "
                  "one small all_gather), bounded_extra = the all-reduce's watchdog "
                  "thread beyond wire and codec, rest = what nothing timed covers; cpu_s, not a part: the CPU "
                  "seconds the process spent in the step, all threads):"]
        for codec, table in s["phases"].items():
            lines.append(f"  {codec:6} " + ", ".join(f"{k} {v:.3f}" for k, v in table.items()))
    return lines


def sparse_settings(args) -> str:
    """The sparse arm's settings: the engine's defaults (engine/config.py), or what --set gave."""
    from engine.config import DilocoConfig
    from engine.sparse_rules import SPARSE_KEYS

    sets = dict(item.partition("=")[::2] for item in args.set)
    return ", ".join(f"diloco.{k} {sets.get(f'diloco.{k}', DilocoConfig.model_fields[k].default)}"
                     + ("" if f"diloco.{k}" in sets else " (default)") for k in SPARSE_KEYS)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def secs(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def goals(s: dict) -> tuple[list[str], bool]:
    rows = {c: r for c, r in s["rows"].items() if c not in GATHERED}  # issue 21's goals are the dense codecs'
    worst_wire = min(rows, key=lambda c: rows[c]["wire_rate"] or 0.0)
    worst_other = max(rows, key=lambda c: rows[c]["other_s"])
    worst_ho = max(rows, key=lambda c: rows[c]["handoff"]["ratio"])
    checks = [
        (f"int8/none outer step {s['r1']:.2f} <= {GOAL_R1}"
         + (f" (its floor here: gloo's bare ring of int8's bytes plus int8's other_s, over none's outer step: "
            f"{s['r1_floor']:.2f})" if s.get("r1_floor") is not None else ""), s["r1"] <= GOAL_R1),
        (f"every codec's wire >= {GOAL_WIRE:.0%} of the link: worst {worst_wire} "
         f"{pct(rows[worst_wire]['wire_rate'])} ("
         + ", ".join(f"{c} {pct(r['wire_rate'])}" for c, r in rows.items()) + ")",
         all((r["wire_rate"] or 0.0) >= GOAL_WIRE for r in rows.values())),
        (f"neither wire nor codec <= {GOAL_OTHER} s: worst {worst_other} {rows[worst_other]['other_s']:.3f} s",
         all(r["other_s"] <= GOAL_OTHER for r in rows.values())),
        *([] if s["r3"] is None else [
            (f"overlapped / no-DiLoCo tokens/s (int8) {s['r3']:.2f} >= {GOAL_R3}", s["r3"] >= GOAL_R3)]),
        (f"hand-off <= {GOAL_HANDOFF}x its link bound: worst {worst_ho} {rows[worst_ho]['handoff']['ratio']:.2f}x",
         all(r["handoff"]["ratio"] <= GOAL_HANDOFF for r in rows.values())),
    ]
    lines = ["goals (issue 21):"] + [f"  {'met    ' if ok else 'NOT MET'}  {text}" for text, ok in checks]
    sparse = sparse_checks(s)
    if sparse:
        lines += ["goals (issue 43, sparse):"] + [
            f"  {'       ' if ok is None else 'met    ' if ok else 'NOT MET'}  {text}" for text, ok in sparse]
    return lines, all(ok is not False for _, ok in checks + sparse)


def sparse_checks(s: dict) -> list[tuple[str, bool | None]]:
    """Issue 43's goals on the slow link: R4 (at 200mbit or slower), none's outer step and sparse's wire against
    their link bounds (the last two at every rate: they say the comparison is fair and the wire is not the cost).
    None: a figure with no goal here (R4 faster than 200mbit)."""
    if "r4" not in s:
        return []
    rows, rate = s["rows"], rate_bps(s["rate"])
    goal = GOAL_R4 if s["hosts"] == 2 else GOAL_R4_MORE
    sparse, none = rows["sparse"], rows["none"]
    r4 = (f"sparse/none outer step {s['r4']:.3f} <= {goal} ({sparse['outer_s']:.3f} s against {none['outer_s']:.2f}"
          f" s; sparse's codec_s {sparse['codec_s']:.3f}, wire_s {sparse['wire_s']:.3f}, other_s "
          f"{sparse['other_s']:.3f})", s["r4"] <= goal)
    checks: list[tuple[str, bool | None]] = [r4] if rate <= GOAL_R4_RATE else [
        (f"sparse/none outer step {s['r4']:.3f}: no goal at {s['rate']} (the goal, {goal}, is at 200mbit; "
         f"{sparse['outer_s']:.3f} s against {none['outer_s']:.2f} s)", None)]
    checks += [
        (f"none's outer step <= {GOAL_NONE_BOUND}x its link bound: {s['none_bound']:.2f}x ({none['outer_s']:.2f} s "
         f"for {none['link_bound_s']:.2f} s)", s["none_bound"] <= GOAL_NONE_BOUND),
        (f"sparse's wire <= {GOAL_SPARSE_WIRE}x its link bound: {s['sparse_wire_bound']:.2f}x "
         f"({sparse['wire_s']:.3f} s for {sparse['link_bound_s']:.3f} s; the least of the hosts' "
         f"{sparse['wire_s_least']:.3f} s, {sparse['wire_s_least'] / sparse['link_bound_s']:.2f}x)",
         s["sparse_wire_bound"] <= GOAL_SPARSE_WIRE)]
    return checks


# ---- main -----------------------------------------------------------------------------------------------------
def arms(args) -> list[Arm]:
    return ([Arm(c) for c in args.compressions] + [Arm(c, overlap=True) for c in args.overlap]
            + ([] if args.sync_only else [Arm("")]))


def measure(args, work: Path) -> tuple[dict, str]:
    load = os.getloadavg()[0]
    with lab(args) as hosts:
        slow_start = slow_start_setting(hosts[0])
        results: dict[str, ArmResult] = {}
        for i, arm in enumerate(arms(args)):
            results[arm.name] = run_arm(args, arm, hosts, work, STORE_PORT + i)
            print(f"[wan] {arm.name}: {results[arm.name].seconds:.0f} s", file=sys.stderr, flush=True)
        sizes = {}
        for codec in args.compressions:  # a ring all-reduce of B bytes sends 2 (n-1)/n B per host
            if args.quick and codec in GATHERED:  # CI: not a ring's pattern, and seconds the test does not have
                continue
            sent = median_of(outer_events(results[f"{codec}-sync"]), "bytes_sent")
            sizes[codec] = int(sent * args.hosts / (2 * (args.hosts - 1))) // 4 * 4
        bare = run_bare(args, hosts, sizes, work, STORE_PORT + 99)
        summary = summarize(args, results, bare)
        # on a shared machine other processes take cores from the engines: tokens/s and codec_s say so first
        summary["load"] = (load, os.getloadavg()[0])
        return summary, slow_start


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"wan: {e}", file=sys.stderr)
        return 2
    if args.bare_worker is not None:
        bare_worker(json.loads(args.bare_worker))
        # as engine.train.cli(): no C++ static destructors, where gloo's exit-time abort lives ("terminate called
        # without an active exception", exit -6: one bench run in a few lost all of its arms to it)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    work = Path(tempfile.mkdtemp(prefix="zb-wan-"))
    work.chmod(0o755)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind through lab()'s finally: no namespace is left behind
        signal.signal(sig, _raise_exit)
    try:
        summary, slow_start = measure(args, work)
    except (LabFailed, LabError, net.NetError) as e:
        print(f"wan: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"[wan] run dirs kept in {work}", file=sys.stderr)
        else:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    lines = report(args, summary, slow_start)
    goal_lines, met = goals(summary)
    for line in lines + [""] + goal_lines:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"slow link {args.rate} {args.hosts}x: int8/none outer step {summary['r1']:.2f}; outer step / link bound "
          f"{summary['r2']:.2f}; overlapped / no-DiLoCo tokens/s "
          + ("-" if summary["r3"] is None else f"{summary['r3']:.2f}"), flush=True)
    if "r4" in summary:
        print(f"slow link {args.rate} {args.hosts}x: sparse/none outer step {summary['r4']:.3f}; sparse bytes / none "
              f"bytes {summary['b2']:.4f}", flush=True)
    return 0 if met else 3


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
