"""Whole mesh nodes driven by one thread over a store, on a fake clock whose sleeps beat the hearts of the nodes
that are "alive": deaths are simply nodes that stop beating (tests/test_mesh_protocol.py, tests/test_mesh_cost.py)."""

from __future__ import annotations

from engine.config import MeshConfig
from engine.mesh import MemoryStore, Mesh, Plan
from engine.telemetry import make_event

CFG = MeshConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5, store_timeout=3.0, start_timeout=5.0,
                 join_timeout=10.0, polling_interval=0.1, store_lost_timeout=20.0)



class Sim:
    """A fake clock whose sleeps beat every live node's heart."""

    def __init__(self, store=None) -> None:
        self.t = 1000.0
        self.store = MemoryStore() if store is None else store
        self.nodes: dict[str, Mesh] = {}
        self.alive: set[str] = set()
        self.events: list[dict] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt
        for name in sorted(self.alive):
            self.nodes[name].heartbeat.beat()  # a heartbeat thread's loop body: store errors are handled, not raised

    def advance(self, seconds: float) -> None:
        for _ in range(round(seconds / CFG.heartbeat_interval)):
            self.sleep(CFG.heartbeat_interval)

    def node(self, name: str, *, digest: str = "d1", min_nodes: int = 1, key: str | None = None,
             interrupt=None, store=None, **rounds) -> Mesh:
        def emit(type_: str, **fields) -> None:
            self.events.append(make_event(type_, name, 0, **fields))  # validates the telemetry schema
        mesh = Mesh(self.store if store is None else store, name, CFG, digest=digest, info={"host": "h", "pid": 1},
                    min_nodes=min_nodes,
                    emit=emit, clock=self.clock, sleep=self.sleep, heartbeat_thread=False, interrupt=interrupt,
                    reconnect=lambda: self.store, wall=self.clock, **rounds)
        self.nodes[key or name] = mesh
        return mesh

    def start(self, *names: str, **kw) -> list[bool]:
        out = []
        for name in names:
            mesh = self.node(name, **kw)
            out.append(mesh.start())
            self.alive.add(name)
        self.advance(0.2)
        return out

    def kill(self, name: str) -> None:
        self.alive.discard(name)

    def leader(self) -> str:
        leaders = [n for n in self.alive if self.nodes[n].is_leader]
        assert len(leaders) == 1, leaders
        return leaders[0]

    def boundary(self, k: int, a: int, names, **flags) -> dict[str, Plan]:
        """Every named node arrives, then all poll (leader first) until each has a plan, like boundary()."""
        for n in names:
            self.nodes[n].arrive(k, a, **flags.get(n, {}))
        plans: dict[str, Plan] = {}
        for _ in range(200):
            for n in sorted(names, key=lambda n: not self.nodes[n].is_leader):
                if n not in plans:
                    plan = self.nodes[n].poll_plan(k, a)
                    if plan is not None:
                        plans[n] = plan
            if len(plans) == len(names):
                return plans
            self.sleep(CFG.polling_interval)
        raise AssertionError(f"no plan for {names} at ({k}, {a})")

    def commit(self, plan: Plan, results: dict[str, bool]) -> dict[str, str]:
        for n, ok in results.items():
            self.nodes[n].post(plan, ok)
        out: dict[str, str] = {}
        for _ in range(100):
            for n in results:
                d = out.get(n) or self.nodes[n].poll_decision(plan)
                if d:
                    out[n] = d
            if len(out) == len(results):
                return out
            self.sleep(CFG.polling_interval)
        raise AssertionError("no decision")

    def changes(self, change: str) -> set[tuple[str, str]]:
        return {(e["node"], e["subject"]) for e in self.events if e["type"] == "membership" and e["change"] == change}


def _post_all_ok(sim: Sim, plan: Plan, names) -> None:
    """Every node posts before any blocks in commit() (one thread plays them all)."""
    for n in names:
        sim.nodes[n].post(plan, True)


def _run_committed(sim: Sim, k: int, names, **flags) -> Plan:
    plans = sim.boundary(k, 0, names, **flags)
    plan = plans[names[0]]
    assert all(p == plan for p in plans.values())
    _post_all_ok(sim, plan, names)
    for n in names:
        assert sim.nodes[n].commit(plan, True) is True
    return plan
