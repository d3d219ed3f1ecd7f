"""The golden table of the outer loop: per-step losses and per-outer-step fingerprints of today's engine, for every
way of training across hosts, recorded once and compared bit for bit after any change (tests/test_golden_outer.py).

    .venv/bin/python tests/golden/record.py            run every golden run, compare with outer.json
    .venv/bin/python tests/golden/record.py --write    run them and write outer.json (its own commit: why it moved)
    .venv/bin/python tests/golden/record.py --only sync-none-poison --out /tmp/x.json

How a run is made: real engines, each a `python -m engine.train` forked from tests/forkserver.py (one import of
torch for all of them) with a small prelude run before engine.train.cli(): 2 or 3 nodes over a real TCPStore (a
master in this process) and real gloo groups, configs/debug-diloco.toml shrunk (2 sequences of 32 tokens a step,
H = 3 to 6, 9 to 12 steps). The prelude changes nothing in the engine; it wraps three seams and records:

    engine.session.train_step            the step's loss (exact: float.hex of the fp32 value); the injected clock
                                         advances by the node's `dt` per step; SIGUSR1 / SIGTERM sent to itself at
                                         a fixed step (a drain, a stop: as the console's signals, at a known step)
    engine.session.run                   hands the prelude the Session: after every outer.after_inner_step it
                                         records the step, and where progress.outer_step moved, the sha256 of the
                                         fp32 bytes of every parameter (inner.outer_params(), in order) and of the
                                         outer state (outer.state_dict(): snapshot, outer optimizer), or "in flight"
                                         where the outer step is still running in the background (state_dict refuses)
    every `clock=time.time` default      (engine.outer.*, engine.mesh.*: the round clock, the planner's deadlines)
                                         is replaced by a virtual clock of 1000 + dt x the node's steps, only for
                                         runs with time rounds: each round ends at the same step on every run

Plus, from each node's telemetry, every "outer_step" event (its checksum of the agreed weights, members,
contributors and their weights, pgrad_norm as float.hex) and the run_end status. The checksums and the outer
state's fingerprints must agree on every node; the recorder refuses a recording where they do not. A rebuild of the
outer loop may move these seams (where the clock is injected, what state_dict() refuses in flight): adapt the
prelude then, never the numbers.

What is deterministic by design here and what was made so: step rounds, plans and the reduce are (the plan is the
same set of members at every boundary as long as no one is late: timeouts are generous); time rounds are made so by
the virtual clock; an overlapped outer step lands at a fixed step (diloco.overlap_delay >= 1, or fragment_delay):
overlap_delay = 0 lands at the first step after the wire finished, which the wire decides, and with a finished wire
it is the same landing as overlap_delay = 1; drains and stops are signals at a fixed step, and a stop comes where
no outer step is in flight (one in flight is unsent or lands, as the wire and the signal race). A death is not
recorded (when its peers notice it depends on heartbeats).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from procs import PYTHON, ProcessTracker, engine_env, free_port  # noqa: E402

TABLE = Path(__file__).with_name("outer.json")
CONFIG = "configs/debug-diloco.toml"
TIMEOUT = 120.0  # seconds one golden run may take on a loaded 2-core machine

# tiny and fast; generous timeouts so that no node is left out for being slow (that would change the plan)
# optim.name: the table was recorded with AdamW, the preset's optimizer then (the preset ships Muon since)
BASE = ["--optim.name=adamw", "--train.micro_batch_size=2", "--train.batch_size=2", "--data.seq_len=32",
        "--train.eval_interval=0",
        "--train.log_interval=1", "--telemetry.human=false", "--telemetry.resource_interval=60",
        "--diloco.allreduce_timeout=60", "--mesh.heartbeat_interval=0.2", "--mesh.heartbeat_timeout=30",
        "--mesh.store_timeout=60", "--mesh.start_timeout=60", "--mesh.join_timeout=60",
        "--mesh.polling_interval=0.02", "--optim.warmup_steps=2"]
MOMENTUM = ["--diloco.outer_optimizer=nesterov", "--diloco.outer_lr=0.7", "--diloco.outer_momentum=0.9"]
SENTINEL_OFF = ["--diloco.sentinel_ratio=0", "--diloco.sentinel_min_cosine=-1"]


def run(name: str, nodes: int, *args: str, steps: int = 12, h: int = 3, codec: str = "none",
        node: dict[int, dict] | None = None, resume_at: int | None = None, note: str = "") -> dict[str, Any]:
    """One golden run: `nodes` nodes, engine arguments, and per node index the prelude's options (dt: the virtual
    clock's seconds per step, time rounds only; drain_at / stop_at: the step a SIGUSR1 / SIGTERM is sent at;
    poison_at: a boundary step before whose outer step 0.5 is added to every weight, so that the sentinel sees an
    outlier). resume_at: every node is stopped (SIGTERM) at that step, then every node resumes from its checkpoint
    (--ckpt.resume=latest) over a fresh store and runs to the end."""
    return {"name": name, "nodes": nodes, "note": note, "resume_at": resume_at,
            "args": [*BASE, f"--train.max_steps={steps}", f"--diloco.inner_steps={h}",
                     f"--diloco.compression={codec}", f"--diloco.min_nodes={nodes}", *args],
            "node": {str(k): v for k, v in (node or {}).items()}}


def time_rounds(seconds: float = 4.0) -> list[str]:
    # the virtual clock gives node a 1 s and node b 2 s per step: a round of 4 s is 4 steps of a and 2 of b, both
    # exactly at the deadline (so the plan's deadline is the same whichever node plans)
    return ["--diloco.round=time", f"--diloco.round_seconds={seconds}"]


SLOW_B = {0: {"dt": 1.0}, 1: {"dt": 2.0}}

# The covering set (docs/reliability.md, "The golden table"): every codec with sync, with an overlap mode and with
# fragments; time rounds with sync and with overlap (fragments refuse time rounds: engine/config.py); the sentinel on
# (the default, and leaving a poisoned node out) and off; outer optimizers nesterov with momentum, sgd and average;
# a resume mid-run for sync, overlap and fragments; a drain at a fixed step (sync and fragments).
RUNS = [
    run("sync-none-poison", 3, *MOMENTUM, node={2: {"poison_at": 6}},
        note="sync, no codec, sentinel on: node c's round 2 is poisoned and left out, then it takes the run's weights"),
    run("sync-bf16-nosentinel", 2, *SENTINEL_OFF, "--diloco.outer_optimizer=sgd", "--diloco.outer_lr=0.8",
        "--diloco.outer_momentum=0.5", codec="bf16"),
    run("sync-fp16-time", 2, *time_rounds(), *MOMENTUM, codec="fp16", steps=12, h=4, node=SLOW_B,
        note="time rounds on a virtual clock: b trains half of a's steps per round and weighs half as much"),
    run("sync-int8-drain", 3, *MOMENTUM, codec="int8", node={2: {"drain_at": 4}},
        note="node c drains at step 4: it contributes round 2 (steps 4-6) and leaves; a and b finish alone"),
    run("sync-int8-resume", 2, *MOMENTUM, codec="int8", resume_at=7,
        note="every node stopped at step 7 (mid-round 3), resumed from its checkpoint over a fresh store"),
    run("overlap-delayed-none-poison", 3, "--diloco.overlap=true", "--diloco.overlap_delay=1", *MOMENTUM,
        node={1: {"poison_at": 6}}, note="overlap delayed, landing 1 step in; node b poisoned at round 2"),
    run("overlap-eager-bf16", 2, "--diloco.overlap=true", "--diloco.overlap_update=eager", "--diloco.overlap_delay=2",
        *MOMENTUM, *SENTINEL_OFF, codec="bf16"),
    run("overlap-delayed-fp16-time", 2, *time_rounds(), "--diloco.overlap=true", "--diloco.overlap_delay=1",
        "--diloco.outer_optimizer=average", codec="fp16", steps=12, h=4, node=SLOW_B),
    run("overlap-eager-int8", 2, "--diloco.overlap=true", "--diloco.overlap_update=eager", "--diloco.overlap_delay=3",
        *MOMENTUM, codec="int8", note="eager, landing at the next boundary (a whole round late)"),
    run("overlap-eager-none-resume", 2, "--diloco.overlap=true", "--diloco.overlap_update=eager",
        "--diloco.overlap_delay=1", *MOMENTUM, h=4, resume_at=6,
        note="stopped at step 6, after round 1 landed (step 5): a stop while an outer step is in flight is not "
             "deterministic (it lands or is unsent, as the wire and the signal race)"),
    run("fragments-none-delay", 2, "--diloco.fragments=2", "--diloco.fragment_delay=1", "--diloco.fragment_alpha=0.5",
        *MOMENTUM, h=4, steps=12),
    run("fragments-bf16-sync", 3, "--diloco.fragments=2", *MOMENTUM, codec="bf16", h=4, steps=12,
        node={2: {"drain_at": 6}}, note="fragments without delay or alpha; node c drains at step 6"),
    run("fragments-fp16-nosentinel", 2, "--diloco.fragments=3", "--diloco.fragment_delay=1",
        "--diloco.fragment_alpha=0.25", *SENTINEL_OFF, "--diloco.outer_optimizer=average", codec="fp16", h=3,
        steps=9),
    run("fragments-int8-poison", 3, "--diloco.fragments=2", "--diloco.fragment_delay=2", "--diloco.fragment_alpha=0.5",
        *MOMENTUM, codec="int8", h=4, steps=12, node={0: {"poison_at": 8}},
        note="node a poisoned before outer step 4 (left out). Re-recorded when the sentinel stopped judging the mix's "
             "own deviation (fragment_alpha > 0: each node's next pseudo-gradient of a fragment held alpha x its "
             "distance from the agreed weights, pointing against the others' by construction): before, it left "
             "unpoisoned node c out at outer step 3"),
    run("fragments-int8-resume", 2, "--diloco.fragments=2", "--diloco.fragment_delay=1", "--diloco.fragment_alpha=0.5",
        *MOMENTUM, codec="int8", h=6, steps=12, resume_at=8,
        note="stopped at step 8, after the fragment synced at step 6 landed (step 7), before the next (step 9)"),
]

# Run before engine.train.cli() in each node (sys.argv[1]: the prelude's options as JSON). Records JSON lines.
PRELUDE = r'''
import hashlib, importlib, inspect, json, os, pkgutil, signal, sys, time
import torch
import engine.session as session, engine.train
opts = json.loads(sys.argv[1])
sys.argv = ["engine.train"] + sys.argv[2:]
out = open(opts["out"], "a")


def put(**rec):
    out.write(json.dumps(rec) + "\n")
    out.flush()


def sha(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def state_of(outer):
    try:
        sd = outer.state_dict()
    except AssertionError:  # an outer step still in flight: only flush() may land it, and that would change the run
        return "in flight"
    opt = sd.get("outer_optimizer") or {}
    momentum = opt.get("momentum")
    return {"snapshot": sha([sd["snapshot"]]), "momentum": None if momentum is None else sha([momentum]),
            "kind": opt.get("kind")}


clock = {"t": 1000.0}
if opts.get("dt"):  # time rounds: every wall clock the outer loop and the mesh take by default becomes the virtual one
    import engine.outer, engine.mesh
    fake = lambda: clock["t"]
    for pkg in (engine.outer, engine.mesh):
        for info in pkgutil.iter_modules(pkg.__path__):
            mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
            for obj in list(vars(mod).values()):
                funcs = [obj] if inspect.isfunction(obj) else \
                    [f for f in vars(obj).values() if inspect.isfunction(f)] if inspect.isclass(obj) else []
                for f in funcs:
                    if f.__defaults__ and any(d is time.time for d in f.__defaults__):
                        f.__defaults__ = tuple(fake if d is time.time else d for d in f.__defaults__)
                    if f.__kwdefaults__ and any(d is time.time for d in f.__kwdefaults__.values()):
                        f.__kwdefaults__ = {k: fake if d is time.time else d for k, d in f.__kwdefaults__.items()}

state = {"s": None, "loss": None}
_train_step, _run = session.train_step, session.run


def train_step(*a, **k):
    loss, grad_norm = _train_step(*a, **k)
    state["loss"] = float(loss).hex()
    clock["t"] += opts.get("dt") or 0.0
    step = state["s"].progress.step + 1  # the step this was (run() counts it next)
    if step == opts.get("drain_at"):
        os.kill(os.getpid(), signal.SIGUSR1)
    if step == opts.get("stop_at"):
        os.kill(os.getpid(), signal.SIGTERM)
    return loss, grad_norm


def run(s):
    state["s"] = s
    after = s.outer.after_inner_step

    def after_inner_step(progress):
        if progress.step == opts.get("poison_at"):
            with torch.no_grad():
                for p in s.inner.outer_params():
                    p.add_(0.5)
        before = progress.outer_step
        left = after(progress)
        rec = {"step": progress.step, "loss": state["loss"], "outer_step": progress.outer_step}
        if progress.outer_step != before:
            rec.update(weights=sha(s.inner.outer_params()), outer_state=state_of(s.outer))
        put(**rec)
        return left

    s.outer.after_inner_step = after_inner_step
    status = _run(s)
    with open(opts["out"] + ".cpu", "a") as f:  # the CPU seconds of this engine (the suite's budget)
        f.write(f"{sum(os.times()[:2])}\n")
    put(end=status, step=s.progress.step, outer_step=s.progress.outer_step, weights=sha(s.inner.outer_params()),
        outer_state=state_of(s.outer))
    return status


session.train_step, session.run = train_step, run
engine.train.cli()
'''


def start_store(port: int):
    import torch.distributed as dist
    # a master in this process, as `python -m engine.store` runs it: clients come and go for the whole run
    return dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)


def run_nodes(spec: dict, work: Path, procs: ProcessTracker, *, phase: str, extra: list[str],
              stop_at: int | None) -> dict[str, dict]:
    """Every node of one phase of a run, to its end: {node: {"lines": prelude records, "events": telemetry}}."""
    port = free_port()
    store = start_store(port)
    names = "abc"[:spec["nodes"]]
    started = []
    for i, name in enumerate(names):
        opts = dict(spec["node"].get(str(i), {}), out=str(work / f"{phase}-{name}.jsonl"))
        if stop_at is not None:
            opts["stop_at"] = stop_at
        args = [CONFIG, *spec["args"], *extra, f"--mesh.store_port={port}", f"--mesh.node_id={name}",
                f"--run.dir={work / name}"]
        env = engine_env(GLOBAL_RANK=str(i), GLOBAL_WORLD_SIZE=str(spec["nodes"]))
        out, err = open(work / f"{phase}-{name}.out", "w"), open(work / f"{phase}-{name}.err", "w")
        proc = procs.start([PYTHON, "-c", PRELUDE, json.dumps(opts), *args], env=env, cwd=ROOT, stdout=out,
                           stderr=err)
        started.append((name, proc, out, err))
    deadline = time.monotonic() + TIMEOUT
    got: dict[str, dict] = {}
    for name, proc, out, err in started:
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
        out.close()
        err.close()
        lines = _jsonl(work / f"{phase}-{name}.jsonl")
        events = [e for e in _jsonl(work / f"{phase}-{name}.out") if e.get("type") in ("outer_step", "run_end")]
        if rc != 0:
            tail = (work / f"{phase}-{name}.err").read_text()[-3000:]
            procs.kill_all()
            raise RuntimeError(f"golden run {spec['name']} ({phase}): node {name} "
                               f"{'timed out' if rc is None else f'exited {rc}'}\n{tail}")
        got[name] = {"lines": lines, "events": events}
    del store
    return got


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


KEEP: str | None = None  # --keep DIR: each run's folder is kept under DIR
CPU: dict[str, float] = {}  # CPU seconds of each run's engines (user + system), as last recorded


def record_run(spec: dict, procs: ProcessTracker) -> dict[str, Any]:
    """One golden run, recorded: {"config", "nodes": {name: {"steps", "outer", "end"}}}."""
    with tempfile.TemporaryDirectory(prefix=f"golden-{spec['name']}-") as tmp:
        # --keep: the engines' folders and output stay for a look
        work = Path(tmp) if KEEP is None else Path(tempfile.mkdtemp(prefix=f"{spec['name']}-", dir=KEEP))
        phases = [("run", [], spec["resume_at"])]
        if spec["resume_at"] is not None:
            phases.append(("resumed", ["--ckpt.resume=latest"], None))
        nodes: dict[str, dict] = {}
        for phase, extra, stop_at in phases:
            for name, got in run_nodes(spec, work, procs, phase=phase, extra=extra, stop_at=stop_at).items():
                mine = nodes.setdefault(name, {"steps": [], "outer": {}, "end": []})
                for rec in got["lines"]:
                    if "end" in rec:
                        mine["end"].append(rec)
                    else:
                        mine["steps"].append(rec)
                for e in got["events"]:
                    if e["type"] == "outer_step":
                        mine["outer"][str(e["outer_step"])] = {
                            "step": e["step"], "checksum": e["checksum"], "members": e["members"],
                            "contributors": e["contributors"], "weights": e["weights"],
                            "pgrad_norm": float(e["pgrad_norm"]).hex(), **({"left_out": e["left_out"]}
                                                                            if e.get("left_out") else {})}
                    else:
                        mine["end"][-1]["status"] = e["status"] if mine["end"] else None
        CPU[spec["name"]] = sum(float(x) for f in work.glob("*.cpu") for x in f.read_text().split())
    check_agreement(spec["name"], nodes)
    return {"config": {k: spec[k] for k in ("nodes", "args", "node", "resume_at", "note")}, "nodes": nodes}


def check_agreement(name: str, nodes: dict[str, dict]) -> None:
    """The agreed weights are the same on every node: each outer step's checksum, and the outer state (snapshot,
    momentum) where a node recorded it at the same outer step."""
    seen: dict[str, dict[str, set]] = {}
    for n, rec in nodes.items():
        for k, e in rec["outer"].items():
            seen.setdefault(k, {}).setdefault("checksum", set()).add(e["checksum"])
        for r in rec["steps"] + rec["end"]:
            if isinstance(r.get("outer_state"), dict):
                key = f"{r['outer_step']}/{'end' if 'end' in r else 'step'}"
                seen.setdefault(key, {}).setdefault("outer_state", set()).add(json.dumps(r["outer_state"]))
    bad = {k: {f: v for f, v in fields.items() if len(v) > 1} for k, fields in seen.items()}
    bad = {k: v for k, v in bad.items() if v}
    # a drained node ends earlier (its end state is of an older outer step: keyed by its outer step, it agrees)
    if bad:
        raise AssertionError(f"golden run {name}: the nodes disagree on the agreed weights: {bad}")
    if not any(rec["outer"] for rec in nodes.values()):
        raise AssertionError(f"golden run {name}: no outer step was committed")


def header() -> dict[str, Any]:
    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"what": "per-step losses (float.hex) and per-outer-step fingerprints of the engine's outer loop, one "
                    "entry per golden run; compared bit for bit by tests/test_golden_outer.py. Re-record "
                    "(tests/golden/record.py --write) only in a commit of its own that says why the numbers changed "
                    "(docs/reliability.md, \"The golden table\")",
            "how": "real engines (python -m engine.train, forked by tests/forkserver.py) over a real TCPStore and "
                   "gloo, with a prelude that records each step's loss, and where the outer step moved the sha256 "
                   "of every parameter's fp32 bytes (inner.outer_params()) and of outer.state_dict()'s snapshot and "
                   "momentum; the outer_step events give the checksum of the agreed weights, members, contributors "
                   "and weights. Time rounds on a virtual clock (1000 + dt x steps); drains and stops are signals "
                   "at a fixed step; overlapped outer steps land at a fixed step (overlap_delay, fragment_delay). "
                   "Each resume run equalled its uninterrupted run bit for bit when recorded",
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "recorded_from": commit.stdout.strip(),
            "config": CONFIG}


def record(names: list[str] | None = None, procs: ProcessTracker | None = None) -> dict[str, Any]:
    own = procs is None
    procs = procs or ProcessTracker()
    try:
        runs = {}
        for spec in RUNS:
            if names and spec["name"] not in names:
                continue
            t0 = time.monotonic()
            runs[spec["name"]] = record_run(spec, procs)
            print(f"golden: {spec['name']}: {time.monotonic() - t0:.1f}s, the engines' CPU {CPU[spec['name']]:.1f}s",
                  file=sys.stderr, flush=True)
        return {"header": header(), "runs": runs}
    finally:
        if own:
            procs.kill_all()


def resumes_continue(got: dict) -> list[str]:
    """Each resume run's steps and outer steps equal those of the same run without the stop (recorded now): the
    table's resumed numbers are then also the uninterrupted run's."""
    problems: list[str] = []
    procs = ProcessTracker()
    try:
        for spec in RUNS:
            if spec["resume_at"] is None:
                continue
            whole = record_run(dict(spec, resume_at=None), procs)
            for node, rec in got["runs"][spec["name"]]["nodes"].items():
                mine = whole["nodes"][node]
                if rec["steps"] != mine["steps"] or rec["outer"] != mine["outer"]:
                    problems += _first_step_difference(f"{spec['name']} (resumed vs whole)", node, mine["steps"],
                                                       rec["steps"]) or [f"{spec['name']}: node {node}: outer steps"]
    finally:
        procs.kill_all()
    return problems


def compare(expected: dict, got: dict) -> list[str]:
    """The differences, one line each, naming the run, the node, the step or outer step, and the fields expected and
    got: per node the first step that differs, the first outer step that differs (and how many more do), the end."""
    out: list[str] = []
    for name, exp in expected["runs"].items():
        if name not in got["runs"]:
            continue
        have = got["runs"][name]
        if exp["config"] != have["config"]:
            keys = sorted(k for k in set(exp["config"]) | set(have["config"])
                          if exp["config"].get(k) != have["config"].get(k))
            out.append(f"{name}: the run's config differs from the recorded one in {', '.join(keys)} (record.py's "
                       f"RUNS changed: re-record with --write, in a commit of its own)")
            continue
        for node in sorted(set(exp["nodes"]) | set(have["nodes"])):
            e, g = exp["nodes"].get(node), have["nodes"].get(node)
            if e is None or g is None:
                out.append(f"{name}: node {node} {'not recorded' if e is None else 'did not run'}")
                continue
            out += _first_step_difference(name, node, e["steps"], g["steps"])
            outer = [k for k in sorted(set(e["outer"]) | set(g["outer"]), key=int)
                     if e["outer"].get(k) != g["outer"].get(k)]
            if outer:
                k = outer[0]
                more = f" ({len(outer) - 1} later outer steps differ too)" if len(outer) > 1 else ""
                out.append(f"{name}: node {node}, outer step {k} (the first that differs): "
                           f"{_fields(e['outer'].get(k), g['outer'].get(k))}{more}")
            for i, (ee, ge) in enumerate(zip(e["end"], g["end"])):
                if ee != ge:
                    out.append(f"{name}: node {node}, at the end of {('the run', 'the resumed run')[min(i, 1)]}: "
                               f"{_fields(ee, ge)}")
            if len(e["end"]) != len(g["end"]):
                out.append(f"{name}: node {node}: {len(e['end'])} phases recorded, {len(g['end'])} ran")
    return out


def _fields(e: dict | None, g: dict | None) -> str:
    """The fields of two records that differ, as 'field expected X got Y' (a loss also as a decimal float)."""
    if e is None or g is None:
        return f"expected {e} got {g}"
    parts = []
    for f in sorted(set(e) | set(g)):
        x, y = e.get(f), g.get(f)
        if x == y:
            continue
        if isinstance(x, dict) and isinstance(y, dict):
            parts.append(f"{f}: {_fields(x, y)}")
            continue
        extra = f" ({float.fromhex(x)!r} vs {float.fromhex(y)!r})" if f == "loss" and x and y else ""
        parts.append(f"{f} expected {x!r} got {y!r}{extra}")
    return "; ".join(parts)


def _first_step_difference(name: str, node: str, exp: list[dict], got: list[dict]) -> list[str]:
    for i in range(max(len(exp), len(got))):
        e = exp[i] if i < len(exp) else None
        g = got[i] if i < len(got) else None
        if e != g:
            where = (e or g)["step"]
            if e is None or g is None:
                return [f"{name}: node {node}, step {where}: expected {e} got {g} (the step counts differ)"]
            return [f"{name}: node {node}, step {where} (the first that differs): {_fields(e, g)}"]
    return []


def torch_note(expected: dict) -> str:
    import torch
    then = expected["header"]["torch"]
    if then == torch.__version__:
        return ""
    return (f"NOTE: the table was recorded with torch {then}, this is torch {torch.__version__}: a difference may be "
            f"the library's, not the engine's (re-record in its own commit if the engine is unchanged)")


def dumps(obj: Any, depth: int = 0) -> str:
    """JSON, one step or outer step a line (a re-recording's diff reads step by step); keys sorted."""
    if depth >= 6 or not isinstance(obj, (dict, list)) or not obj:
        return json.dumps(obj, sort_keys=True)
    pad = " " * (depth + 1)
    if isinstance(obj, dict):
        keys = sorted(obj, key=lambda k: (0, int(k)) if k.isdigit() else (1, k))
        body = ",\n".join(f"{pad}{json.dumps(k)}: {dumps(obj[k], depth + 1)}" for k in keys)
        return "{\n" + body + "\n" + " " * depth + "}" + ("\n" if depth == 0 else "")
    return "[\n" + ",\n".join(pad + dumps(v, depth + 1) for v in obj) + "\n" + " " * depth + "]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write the recording to {TABLE.name}")
    parser.add_argument("--only", action="append", help="this run only (repeatable)")
    parser.add_argument("--out", type=Path, help="also write the recording here (to compare two recordings)")
    parser.add_argument("--keep", type=Path, help="keep each run's engine folders and output under this folder")
    args = parser.parse_args(argv)
    global KEEP
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        KEEP = str(args.keep)
    names = [n for n in args.only or [] if n]
    unknown = sorted(set(names) - {r["name"] for r in RUNS})
    if unknown:
        print(f"record.py: --only {', '.join(unknown)}: no such run (runs: {', '.join(r['name'] for r in RUNS)})",
              file=sys.stderr)
        return 2
    got = record(names)
    text = dumps(got)
    if args.out:
        args.out.write_text(text)
    if args.write:
        if names:
            print("record.py: --write records every run (not with --only)", file=sys.stderr)
            return 2
        problems = resumes_continue(got)
        if problems:
            print("record.py: not written: a resumed run does not continue its uninterrupted one:\n"
                  + "\n".join(problems), file=sys.stderr)
            return 1
        TABLE.write_text(text)
        print(f"wrote {TABLE}", file=sys.stderr)
        return 0
    if not TABLE.exists():
        print(f"record.py: {TABLE} does not exist yet: --write records it", file=sys.stderr)
        return 1
    expected = json.loads(TABLE.read_text())
    diffs = compare(expected, got)
    if diffs:
        print("\n".join([torch_note(expected), *diffs]).strip(), file=sys.stderr)
        return 1
    print(f"the same to the last bit as {TABLE.name}: {', '.join(got['runs'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
