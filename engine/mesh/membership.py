"""What the parts of one node's mesh share: the registry's value, and this node's membership state.

A Mesh (node.py) is composed of its registration (registration.py: the id, its keys, start-up), its heartbeat
(heartbeat.py: a thread) and its planner (planner.py: the boundary's reads and the plan write). Each owns its own
state; what more than one of them reads or writes lives in one `Membership` object, each field named below with
who writes it. The heartbeat thread and the caller's thread both touch it: `liveness` only under `lock`; every
other field is one reference written whole (the GIL keeps each read and write atomic), as before the split.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.mesh.protocol import Keys, Liveness, MeshError, Plan, StateRecord
from engine.states import NodeState

UPDATE_WITHIN_S = 120.0  # how long Registry.update keeps losing races before it gives up
STORE_ERRORS = (RuntimeError, OSError, LookupError)  # TCPStore: RuntimeError (DistStoreError); MemoryStore: OSError


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RegistryBusy(MeshError):
    """Registry.update kept losing the compare_set race for its whole time: other nodes change `ids` as fast."""


@dataclass
class Registry:
    """The value of `ids`: registered ids, and ids pruned from it whose keys are deleted at the next prune
    (id -> the (generation, rank) of its last process group, for its rendezvous keys)."""

    ids: list[str] = field(default_factory=list)
    gone: dict[str, list[int] | None] = field(default_factory=dict)

    @classmethod
    def read(cls, store: Any, keys: Keys) -> tuple[str, "Registry"]:
        raw = text(store.compare_set(keys.ids(), "", ""))  # one round trip; an absent key reads (and becomes) ""
        return raw, cls.parse(raw)

    @classmethod
    def parse(cls, raw: str) -> "Registry":
        if not raw:
            return cls()
        d = json.loads(raw)
        return cls(list(d["ids"]), dict(d["gone"]))

    def to_json(self) -> str:
        return json.dumps({"ids": self.ids, "gone": self.gone}, separators=(",", ":"))

    @classmethod
    def update(cls, store: Any, keys: Keys, change: Callable[["Registry"], None],
               within: float = UPDATE_WITHIN_S) -> "Registry":
        """Read-modify-compare_set, retried while other nodes change it at the same time: each lost race waits a
        random pause that doubles (up to a second), for `within` seconds. Every try has one winner, so N nodes at
        once all get through; 50 tries without a pause let only the first 50 of a mass start (or of the
        re-registrations after a store restart) through, and the rest failed."""
        deadline, pause = time.monotonic() + within, 0.005
        while True:
            raw, reg = cls.read(store, keys)
            change(reg)
            new = reg.to_json()
            if new == raw or text(store.compare_set(keys.ids(), raw, new)) == new:
                return reg
            if time.monotonic() > deadline:
                raise RegistryBusy(f"the registry key {keys.ids()} kept changing under this node's updates for "
                                   f"{within:g}s")
            time.sleep(random.uniform(0, pause))
            pause = min(1.0, pause * 2)


@dataclass(eq=False)
class Membership:
    """This node's standing in the run, shared by its waits, registration, heartbeat and planner."""

    store: Any  # the caller thread's store client (the heartbeat's is its own clone); a reconnect replaces it
    node_state: StateRecord  # the value of this node's state/<id> as last written (Registration.write_state)
    liveness: Liveness  # every registered peer's counter as the heartbeat last saw it; read and written under lock
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: NodeState = NodeState.STARTING  # the lifecycle: the waits set it; the heartbeat's lease check reads it
    epoch: int = 0  # the life of the run this node takes part in: set by the start-up and the waits
    forming: bool = True  # no plan of this run accepted yet: the waits give a formation mesh.start_timeout
    base_generation: int = 0  # a run (re)formed by this node counts its generations from here
    plan: Plan | None = None  # the last plan this node accepted (the waits); the heartbeat reports from it
    # every node that was a member of a plan this node accepted (for death reports): outer steps can be faster
    # than heartbeats, so "the last two plans" may already have dropped a node when its death is seen
    recent: frozenset[str] = frozenset()
    ready: bool = False  # start() decided joiner or member: only then may this node take the lease
    is_leader: bool = False  # the heartbeat takes the lease; a node left out of a plan gives it back
    leader_seen: str = ""  # the last lease holder the heartbeat saw
    last_look: float | None = None  # when the heartbeat last read every peer's counter (planning needs it fresh)
    reset: bool = False  # the heartbeat registered this node in a restarted (empty) store: the waits re-form
    store_life: str = ""  # the store's life (Keys.life) this node registered in: another one = a restart

    def forget_run(self) -> None:
        """The store restarted empty: this node's view of the run is void; it forms the run anew."""
        self.reset = False
        self.epoch = self.base_generation = 0
        self.forming = True
        self.plan = None
        self.state = NodeState.STARTING
