"""The seeded fault schedule: pure (a seed and a few numbers in, a list of Fault out).

The first len(KINDS) faults are every kind once in a seeded order, so any run with at least that many faults
covers every kind; later faults are drawn at random. Targets are engine hosts; "kill-leader" is resolved when it
is injected (whoever holds the lease then).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

KINDS = ("kill", "kill-leader", "freeze", "link", "loss", "blackhole", "store", "console", "drain")
HOST_KINDS = frozenset({"kill", "freeze", "link", "loss", "blackhole", "drain"})  # aimed at one engine host
LEADER = "<leader>"


@dataclass
class Fault:
    """One planned fault and, once it ran, what happened."""

    index: int
    kind: str
    target: str  # an engine host name, LEADER, "store" or "console"
    hold_s: float  # how long the fault lasts before it is healed (0: instantaneous, e.g. a SIGKILL)
    gap_s: float  # quiet time after recovery before the next fault
    percent: int = 0  # packet loss
    # filled in by the lab
    resolved: str = ""  # the host it actually hit (the leader's name for kill-leader)
    start: float | None = None
    healed: float | None = None
    recovered: float | None = None
    survived: bool | None = None
    notes: list[str] = field(default_factory=list)  # why it was NOT survived (empty: survived)
    info: list[str] = field(default_factory=list)  # remarks that are not failures

    def describe(self) -> str:
        what = self.resolved or self.target
        extra = f" {self.percent}%" if self.kind == "loss" else ""
        hold = f" for {self.hold_s:.1f}s" if self.hold_s else ""
        return f"#{self.index} {self.kind}{extra} {what}{hold}"


@dataclass(frozen=True)
class Timing:
    """Bounds of the random draws, in seconds; heartbeat_timeout scales the freezes and outages."""

    heartbeat_timeout: float
    gap: tuple[float, float] = (2.0, 6.0)
    store_down: tuple[float, float] = (2.0, 6.0)
    loss_percent: tuple[int, int] = (10, 40)


def make_schedule(seed: int, count: int, hosts: list[str], timing: Timing,
                  kinds: tuple[str, ...] = KINDS) -> list[Fault]:
    """`count` faults drawn from `kinds` (default: all): the first len(kinds) are each kind once."""
    if count < 0:
        raise ValueError(f"--faults: must be >= 0, got {count}")
    if not hosts:
        raise ValueError("make_schedule: no engine hosts")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"--kinds: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(KINDS)}")
    rng = random.Random(seed)
    first = list(kinds)
    rng.shuffle(first)
    kinds = tuple(first + [rng.choice(kinds) for _ in range(max(0, count - len(first)))])[:count]
    hb = timing.heartbeat_timeout
    faults = []
    for i, kind in enumerate(kinds, 1):
        target = {"kill-leader": LEADER, "store": "store", "console": "console"}.get(kind) or rng.choice(hosts)
        # outages from half a heartbeat timeout (noticed by nobody) to three (declared dead for a while)
        hold = {"kill": 0.0, "kill-leader": 0.0, "console": 0.0, "drain": 0.0,
                "store": rng.uniform(*timing.store_down)}.get(kind)
        if hold is None:
            hold = rng.uniform(0.5 * hb, 3.0 * hb)
        percent = rng.randint(*timing.loss_percent) if kind == "loss" else 0
        faults.append(Fault(index=i, kind=kind, target=target, hold_s=round(hold, 2),
                            gap_s=round(rng.uniform(*timing.gap), 2), percent=percent))
    return faults
