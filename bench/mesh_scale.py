"""How the membership protocol scales: the real Mesh of every node over one MemoryStore, on simulated time.

    python bench/mesh_scale.py                        # 4 .. 1024 nodes at 60 ms per store round trip
    python bench/mesh_scale.py --rtt 0.1 --nodes 16 256 2048

Each node is a real engine.mesh.Mesh (heartbeat_thread=False) with its own simulated clock; its store is the
shared MemoryStore wrapped to count operations and to add one round-trip time (--rtt) to that node's clock per
operation, as a store across a wide-area link would. A discrete-event loop runs every node's heartbeat tick each
mesh.heartbeat_interval (a tick that takes longer delays the next one, as a heartbeat thread would) and, at a
boundary, every node's arrival and polls (each mesh.polling_interval). Default MeshConfig timings.

Per N it forms the run (min_nodes = N), lets it beat for a while, then measures one steady outer step (1):

  ops/tick/node   store round trips of one heartbeat tick (one node)
  ops/step/node   round trips per node for outer step 1: arrival, waiting for the plan, posting, the decision
  tick s          one tick at the given RTT (ops/tick x RTT)
  boundary s      outer step 1: last node's arrival -> the plan is in the store (the leader's poll and planning)
  decided s       last arrival -> every node read the decision
  members         the plan's size (every node must be in it: healthy nodes declared dead are left out)
  false deaths    "dead" membership events about healthy nodes, over the whole simulation

The last line is the largest N with every node in both plans and no false death. Goal (issue 13): >= 1024 at 60 ms.
The simulation itself costs O(N^2) Python per simulated second (every node reads every counter): about a minute
for 1024 nodes on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ranks import at_least  # noqa: E402  (bench/ is the script's folder, first on sys.path)
from engine.config import MeshConfig  # noqa: E402
from engine.mesh import MemoryStore, Mesh  # noqa: E402

OPS = ("set", "get", "add", "compare_set", "check", "delete_key", "multi_get", "multi_set", "wait", "num_keys")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class RemoteStore:
    """One node's view of the shared store: every operation costs one round trip on that node's clock."""

    def __init__(self, inner: MemoryStore, clock: Clock, rtt: float, counts: dict[str, int]) -> None:
        self.inner, self.clock, self.rtt, self.counts = inner, clock, rtt, counts

    def __getattr__(self, name: str):
        fn = getattr(self.inner, name)
        if name not in OPS:
            return fn

        def call(*args, **kw):
            self.counts["ops"] += 1
            self.clock.t += self.rtt
            return fn(*args, **kw)
        return call

    def clone(self) -> "RemoteStore":
        return self


class Cluster:
    def __init__(self, n: int, rtt: float, cfg: MeshConfig) -> None:
        self.cfg, self.rtt = cfg, rtt
        self.store = MemoryStore()
        self.clocks = [Clock() for _ in range(n)]
        self.counts = [{"ops": 0} for _ in range(n)]
        self.deaths: list[tuple[str, str]] = []
        self.names = [f"n{i:04d}" for i in range(n)]
        self.meshes = [Mesh(RemoteStore(self.store, self.clocks[i], rtt, self.counts[i]), self.names[i], cfg,
                            digest="d", info={"host": "sim", "pid": i}, min_nodes=n, emit=self._emit(i),
                            clock=self.clocks[i], sleep=lambda s: None, heartbeat_thread=False)
                       for i in range(n)]
        self.events: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.now = 0.0
        self.tick_ops = 0  # round trips spent in heartbeat ticks (the rest is boundaries and commits)

    def _emit(self, i: int):
        def emit(type_: str, **fields) -> None:
            if type_ == "membership" and fields["change"] == "dead":
                self.deaths.append((self.names[i], fields["subject"]))
        return emit

    def at(self, t: float, i: int, what: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, i, what))

    def start(self) -> None:
        for i, mesh in enumerate(self.meshes):
            self.clocks[i].t = i * 1e-4  # a staggered start; start() beats once itself
            mesh.start()
            self.at(self.clocks[i].t + self.cfg.heartbeat_interval, i, "tick")

    def run_until(self, end: float, on_event=None, done=lambda: False) -> None:
        while self.events and self.events[0][0] <= end and not done():
            t, _, i, what = heapq.heappop(self.events)
            self.now = t
            clock = self.clocks[i]
            clock.t = max(clock.t, t)
            if what == "tick":
                before = self.counts[i]["ops"]
                self.meshes[i].heartbeat.tick()
                self.tick_ops += self.counts[i]["ops"] - before
                self.at(max(t + self.cfg.heartbeat_interval, clock.t), i, "tick")
            elif on_event is not None:
                on_event(t, i, what)

    def outer_step(self, k: int, arrive_at: float, limit: float) -> dict:
        """Every node arrives at (k, 0) around arrive_at, polls for its plan, posts ok, polls the decision."""
        plans: dict[int, object] = {}
        decided: dict[int, float] = {}
        ops_before, ticks_before = sum(c["ops"] for c in self.counts), self.tick_ops
        planned_at: list[float] = []
        arrivals: list[float] = []

        def on_event(t: float, i: int, what: str) -> None:
            mesh, clock = self.meshes[i], self.clocks[i]
            if what == "arrive":
                mesh.arrive(k, 0)
                arrivals.append(clock.t)
                self.at(clock.t + self.cfg.polling_interval, i, "plan")
            elif what == "plan":
                plan = mesh.poll_plan(k, 0)
                if plan is None:
                    self.at(clock.t + self.cfg.polling_interval, i, "plan")
                    return
                if not planned_at:
                    planned_at.append(clock.t)  # the first node to get it: the leader, after its poll
                plans[i] = plan
                mesh.post(plan, True)
                self.at(clock.t, i, "decision")
            elif what == "decision":
                if mesh.poll_decision(plans[i]) is None:
                    self.at(clock.t + self.cfg.polling_interval, i, "decision")
                    return
                decided[i] = clock.t
        n = len(self.meshes)
        for i in range(n):
            self.at(arrive_at + (i % 97) * 1e-3, i, "arrive")
        self.run_until(arrive_at + limit, on_event, done=lambda: len(decided) == n)
        ops = sum(c["ops"] for c in self.counts) - ops_before - (self.tick_ops - ticks_before)
        members = {len(p.members) for p in plans.values()}
        return {"plans": len(plans), "members": max(members) if members else 0, "decided": len(decided),
                "boundary_s": (planned_at[0] - max(arrivals)) if planned_at and arrivals else float("nan"),
                "decided_s": (max(decided.values()) - max(arrivals)) if len(decided) == n else float("nan"),
                "ops_per_node": ops / n}


def measure(n: int, rtt: float) -> dict:
    cfg = MeshConfig()
    c = Cluster(n, rtt, cfg)
    wall = time.perf_counter()
    c.start()
    c.run_until(3.0)
    first = c.outer_step(0, 3.0, limit=cfg.start_timeout)
    t1 = c.now + 5 * cfg.heartbeat_interval
    c.run_until(t1)
    # one tick of a follower, counted alone
    probe = 1 if n > 1 else 0
    before = c.counts[probe]["ops"]
    c.meshes[probe].heartbeat.tick()
    tick_ops = c.counts[probe]["ops"] - before
    second = c.outer_step(1, t1 + 0.05, limit=cfg.store_timeout)  # steady state: the one measured
    ok = first["members"] == n and second["members"] == n and second["decided"] == n and not c.deaths
    return {"n": n, "tick_ops": tick_ops, "step_ops": second["ops_per_node"], "tick_s": tick_ops * rtt,
            "boundary_s": second["boundary_s"], "decided_s": second["decided_s"], "members": second["members"],
            "deaths": len(c.deaths), "ok": ok, "wall_s": time.perf_counter() - wall,
            "keys": len(c.store.keys())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rtt", type=at_least(0.0, float), default=0.06,
                   help="seconds per store round trip (default 0.06)")
    p.add_argument("--nodes", type=at_least(1), nargs="+", default=[4, 16, 64, 256, 1024])
    args = p.parse_args(argv)
    print(f"# store round trip {args.rtt * 1000:g} ms; MeshConfig defaults (heartbeat 1 s, timeout 6 s, poll 0.1 s)")
    print(f"{'nodes':>6} {'ops/tick/node':>13} {'ops/step/node':>13} {'tick s':>7} {'boundary s':>10} "
          f"{'decided s':>9} {'members':>7} {'false deaths':>12} {'keys':>6} {'sim wall s':>10}")
    best = 0
    for n in args.nodes:
        r = measure(n, args.rtt)
        print(f"{r['n']:>6} {r['tick_ops']:>13} {r['step_ops']:>13.1f} {r['tick_s']:>7.2f} {r['boundary_s']:>10.2f} "
              f"{r['decided_s']:>9.2f} {r['members']:>7} {r['deaths']:>12} {r['keys']:>6} {r['wall_s']:>10.1f}",
              flush=True)
        if r["ok"]:
            best = max(best, n)
    print(f"largest N with every healthy node in the plan at {args.rtt * 1000:g} ms RTT: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
