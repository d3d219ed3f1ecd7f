"""Elasticity benchmark: how long a DiLoCo run stalls when a node dies, and how long a new node takes to count.

    python bench/elastic.py                                     # 3 debug nodes, heartbeat 0.2 s / timeout 1.5 s
    python bench/elastic.py --hb 1 --hb-timeout 6 --victim leader    # INTELLECT-1's heartbeat settings

A real `python -m engine.store` and real `python -m engine.train configs/debug-diloco.toml` nodes on this machine.
Timestamps come from the nodes' telemetry (one host, one clock). Measured:

  outer period   median seconds between committed outer steps before anything happens (one outer step)
  kill           a node (a follower, or the leader) is SIGKILLed just before a boundary, so that the survivors
                 arrive and wait: detection = first "dead" event - kill (and - the victim's last heartbeat,
                 which is what the timeout counts from); recovery = the survivors' next committed
                 outer step - kill, and that minus detection (the rebuild: plan, new gloo group, all-reduce)
  join           a node started mid-run, its imports done beforehand (the go-file): admitted = its first outer
                 step (state received) - go; contributes = the outer step after that - go

Goals (issue 3): detection within the heartbeat timeout of the victim's last heartbeat (plus one interval: observers
tick once per interval), recovery within one more second. A joiner's time is stated in outer steps.

    python bench/elastic.py --store-share                      # the store's share of an outer step: tcp vs etcd

  store share    3 nodes, no fault, on each backend (a TCPStore process; a 3-member etcd with TLS on loopback, its
                 data on tmpfs when there is one). Each node's Mesh store is wrapped (from outside, before the engine
                 starts) to time every store call of the training thread: per outer step, the wall time of
                 boundary() (arrive + wait for the plan; the leader computes and writes it) and of commit() (vote +
                 wait for the decision), and the seconds of store calls inside them. The heartbeat thread's calls
                 are not counted (they overlap the inner steps).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRIMED = """import os, sys, time
import engine.train
import engine.session  # the imports that take the seconds (engine.train imports it once the config passed)
print("primed", file=sys.stderr, flush=True)
go, deadline = sys.argv[1], time.monotonic() + 900
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.01)
sys.argv = ["engine.train"] + sys.argv[2:]
engine.train.cli()
"""


class Proc:
    def __init__(self, name: str, args: list[str], started: list["Proc"]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_BAND_", "GLOBAL_"))}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.name = name
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        started.append(self)
        self.events: list[dict] = []
        self.err, self.stopped = "", False
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=self._errs, daemon=True).start()

    def _out(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.events.append(json.loads(line))

    def _errs(self) -> None:
        for line in self.proc.stderr:
            self.err += line

    def of(self, type_: str, **match) -> list[dict]:
        return [e for e in self.events if e["type"] == type_ and all(e.get(k) == v for k, v in match.items())]

    def outer_times(self) -> dict[int, float]:
        return {e["outer_step"]: e["ts"] for e in self.of("outer_step")}

    def step(self) -> int:
        steps = self.of("step")
        return steps[-1]["step"] if steps else 0

    def stop(self) -> None:
        self.stopped = True  # on purpose: not a failure for wait_for
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def wait_for(pred, timeout: float, what: str, procs: list[Proc]) -> None:
    """Until pred(); fails at once when a process exited that nobody stopped (a config error at start)."""
    deadline = time.monotonic() + timeout
    while not pred():
        dead = [p for p in procs if not p.stopped and p.proc.poll() not in (None, 0)]
        if dead or time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name} rc={p.proc.poll()}\n{p.err[-1500:]}" for p in procs)
            why = f"{dead[0].name} exited {dead[0].proc.returncode}" if dead else f"timed out after {timeout}s"
            raise SystemExit(f"{why} waiting for {what}\n{tails}")
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_args(args, port: int, name: str, run_dir: str) -> list[str]:
    return ["configs/debug-diloco.toml", "--train.micro_batch_size=2", "--train.batch_size=2", "--data.seq_len=32",
            "--train.eval_interval=0", "--train.log_interval=1", "--telemetry.human=false",
            f"--train.max_steps={args.max_steps}", f"--diloco.inner_steps={args.h}", "--diloco.min_nodes=3",
            f"--diloco.compression={args.compression}", "--diloco.allreduce_timeout=10",
            f"--mesh.heartbeat_interval={args.hb}", f"--mesh.heartbeat_timeout={args.hb_timeout}",
            "--mesh.store_timeout=30", "--mesh.start_timeout=120", "--mesh.join_timeout=120",
            "--mesh.polling_interval=0.02", f"--mesh.store_port={port}", f"--mesh.node_id={name}",
            f"--run.dir={run_dir}/{name}", "--ckpt.interval=0"]


def measure(args, procs: list[Proc]) -> dict:
    port, run_dir = free_port(), tempfile.mkdtemp(prefix="elastic-")
    store = Proc("store", [sys.executable, "-m", "engine.store", "--host", "127.0.0.1", "--port", str(port)], procs)
    wait_for(lambda: any(e.get("state") == "ready" for e in store.events), 60, "the store", procs)
    go = Path(run_dir) / "go"
    joiner = Proc("d", [sys.executable, "-c", PRIMED, str(go), *node_args(args, port, "d", run_dir)], procs)
    nodes = [Proc(n, [sys.executable, "-m", "engine.train", *node_args(args, port, n, run_dir)], procs)
             for n in "abc"]
    wait_for(lambda: "primed" in joiner.err and len(nodes[0].outer_times()) >= 4, 300, "4 outer steps", procs)
    times = sorted(nodes[0].outer_times().items())
    period = statistics.median(b[1] - a[1] for a, b in zip(times, times[1:]))

    # join: the go-file releases the primed node
    t_go = time.time()
    go.touch()
    wait_for(lambda: len(joiner.outer_times()) >= 2, 120, "the joiner's second outer step", procs)
    jt = sorted(joiner.outer_times().items())
    admitted, contributed = jt[0][1] - t_go, jt[1][1] - t_go

    # kill: just before a boundary (the victim has finished H-1 steps of its round), survivors then wait on it
    leader = [e for e in nodes[0].of("membership", change="leader")][-1]["subject"]
    everyone = {p.name: p for p in [*nodes, joiner]}
    victim = everyone[leader] if args.victim == "leader" else next(p for p in nodes if p.name != leader)
    survivors = [p for p in everyone.values() if p is not victim]
    wait_for(lambda: victim.step() % args.h == args.h - 1 and victim.step() > jt[1][0] * args.h, 120,
             "the victim one step before a boundary", procs)
    t_kill = time.time()
    victim.stop()
    done_before = max(survivors[0].outer_times())
    wait_for(lambda: all(max(p.outer_times()) > done_before for p in survivors), 120, "the survivors' next outer step",
             procs)
    t_next = min(p.outer_times()[done_before + 1] for p in survivors)
    dead = [e["ts"] for p in survivors for e in p.of("membership", change="dead", subject=victim.name)
            if e["ts"] >= t_kill]
    detection = (min(dead) - t_kill) if dead else None
    # silence starts at the victim's last heartbeat, a fraction of an interval before the kill
    beats = [e["ts"] for e in victim.of("heartbeat") if e["ts"] <= t_kill]
    silent = (min(dead) - beats[-1]) if dead and beats else None
    return {"heartbeat_interval": args.hb, "heartbeat_timeout": args.hb_timeout, "H": args.h,
            "outer_period_s": period, "victim": f"{args.victim} ({victim.name})", "detection_s": detection,
            "detection_after_last_beat_s": silent,
            "recovery_s": t_next - t_kill, "rebuild_s": None if detection is None else t_next - t_kill - detection,
            "join_admitted_s": admitted, "join_contributes_s": contributed}


# Times the Mesh's store calls from the training thread: wraps the store the Mesh is given, before engine.train runs.
TIMED = """import json, sys, threading, time
import engine.mesh.node as _node
class _Timed:
    def __init__(self, inner):
        self._inner, self.spent = inner, 0.0
    def clone(self):
        return self._inner.clone()  # the heartbeat thread's own client: not counted
    def __getattr__(self, name):
        fn = getattr(self._inner, name)
        if not callable(fn):
            return fn
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.spent += time.perf_counter() - t0
        return timed
_init = _node.Mesh.__init__
def _wrapped_init(self, store, *a, **k):
    _init(self, _Timed(store), *a, **k)
_node.Mesh.__init__ = _wrapped_init
def _timing(name, fn):
    def run(self, *a, **k):
        spent0, t0 = self.store.spent, time.perf_counter()
        try:
            return fn(self, *a, **k)
        finally:
            print(json.dumps({"type": "bench_mesh", "call": name, "wall_s": time.perf_counter() - t0,
                              "store_s": self.store.spent - spent0, "ts": time.time()}), flush=True)
    return run
_node.Mesh.boundary = _timing("boundary", _node.Mesh.boundary)
_node.Mesh.commit = _timing("commit", _node.Mesh.commit)
import engine.train
sys.argv = ["engine.train"] + sys.argv[1:]
engine.train.cli()
"""


def steady_rows(nodes: list[Proc], call: str) -> list[dict]:
    """Every node's timings of `call` but its first (the formation: it waits for every node to start)."""
    return [e for p in nodes for e in p.of("bench_mesh", call=call)[1:]]


def measure_store_share(args, backend: str, procs: list[Proc], outer_steps: int = 12) -> dict:
    """3 nodes on one backend for `outer_steps` outer steps; medians per outer step of boundary and commit."""
    run_dir = tempfile.mkdtemp(prefix="elastic-store-")
    extra: list[str] = []
    etcd = None
    port = free_port()
    if backend == "tcp":
        store = Proc("store", [sys.executable, "-m", "engine.store", "--host", "127.0.0.1", "--port", str(port)],
                     procs)
        wait_for(lambda: any(e.get("state") == "ready" for e in store.events), 60, "the store", procs)
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from etcd_cluster import EtcdTestCluster  # the tests' 3-member loopback cluster (TLS, client certificates)

        shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
        etcd = EtcdTestCluster(Path(tempfile.mkdtemp(prefix="zb-etcd-bench-", dir=shm))).start()
        tls = etcd.tls
        extra = ["--mesh.store_backend=etcd", f"--mesh.etcd_endpoints={','.join(etcd.endpoints)}",
                 "--mesh.etcd_prefix=bench/", f"--mesh.etcd_ca={tls.ca}", f"--mesh.etcd_cert={tls.cert}",
                 f"--mesh.etcd_key={tls.key}"]
    try:
        h = args.h
        nodes = [Proc(n, [sys.executable, "-c", TIMED, *node_args(args, port, n, run_dir),
                          f"--train.max_steps={(outer_steps + 1) * h}", *extra], procs) for n in "abc"]
        wait_for(lambda: all(len(p.outer_times()) >= outer_steps for p in nodes), 600,
                 f"{outer_steps} outer steps on {backend}", procs)
        times = sorted(nodes[0].outer_times().items())
        period = statistics.median(b[1] - a[1] for a, b in zip(times[1:], times[2:]))  # the first includes start-up
        out: dict = {"backend": backend, "outer_period_s": period}
        for call in ("boundary", "commit"):
            rows = steady_rows(nodes, call)
            out[f"{call}_wall_s"] = statistics.median(e["wall_s"] for e in rows)
            out[f"{call}_store_s"] = statistics.median(e["store_s"] for e in rows)
        out["store_share"] = (out["boundary_store_s"] + out["commit_store_s"]) / period
        return out
    finally:
        for proc in reversed(procs):
            proc.stop()
        procs.clear()
        if etcd is not None:
            etcd.stop()
            shutil.rmtree(etcd.folder, ignore_errors=True)


def store_share_main(args) -> int:
    rows = [measure_store_share(args, backend, []) for backend in ("tcp", "etcd")]
    print(f"per outer step (H={args.h}, 3 nodes, medians): boundary = arrive + plan, commit = vote + decision")
    print(f"{'backend':8} {'outer s':>8} {'boundary s':>11} {'in store':>9} {'commit s':>9} {'in store':>9} "
          f"{'store share':>11}")
    for r in rows:
        print(f"{r['backend']:8} {r['outer_period_s']:8.3f} {r['boundary_wall_s']:11.3f} {r['boundary_store_s']:9.3f}"
              f" {r['commit_wall_s']:9.3f} {r['commit_store_s']:9.3f} {100 * r['store_share']:10.1f}%")
    print(json.dumps(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hb", type=float, default=0.2, help="mesh.heartbeat_interval")
    p.add_argument("--hb-timeout", type=float, default=1.5, help="mesh.heartbeat_timeout")
    p.add_argument("--h", type=int, default=5, help="diloco.inner_steps")
    p.add_argument("--victim", choices=("follower", "leader"), default="follower")
    p.add_argument("--compression", default="int8")
    p.add_argument("--max-steps", type=int, default=2000, help="long enough to outlast the measurements")
    p.add_argument("--json", help="also write the result to this file")
    p.add_argument("--store-share", action="store_true", help="the store's share of an outer step, tcp vs etcd")
    args = p.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind through the finally blocks: no node is left behind
        signal.signal(sig, _raise_exit)
    if args.store_share:
        return store_share_main(args)
    procs: list[Proc] = []
    try:
        r = measure(args, procs)
    finally:
        for proc in reversed(procs):
            proc.stop()
    # the observers tick once per interval: a silence of `timeout` is noticed at most one interval later
    detect_goal = args.hb_timeout + args.hb
    print(f"heartbeat {args.hb:g}s / timeout {args.hb_timeout:g}s; one outer step (H={args.h}) "
          f"takes {r['outer_period_s']:.2f}s here")
    if r["detection_s"] is not None:
        silent = r["detection_after_last_beat_s"]
        print(f"SIGKILL {r['victim']}: detected {r['detection_s']:.2f}s after the kill, {silent:.2f}s after its last "
              f"heartbeat (goal: timeout + one interval <= {detect_goal:.2f}s: "
              f"{'met' if silent <= detect_goal else 'MISSED'})")
        print(f"  next committed outer step {r['recovery_s']:.2f}s after the kill, {r['rebuild_s']:.2f}s after "
              f"detection (goal <= 1s: {'met' if r['rebuild_s'] <= 1.0 else 'MISSED'})")
    else:
        print(f"SIGKILL {r['victim']}: no dead event seen; next outer step {r['recovery_s']:.2f}s after the kill")
    print(f"joiner: state received {r['join_admitted_s']:.2f}s after its go, first contribution "
          f"{r['join_contributes_s']:.2f}s after (= {r['join_contributes_s'] / r['outer_period_s']:.1f} outer steps)")
    print(json.dumps(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


def _raise_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
