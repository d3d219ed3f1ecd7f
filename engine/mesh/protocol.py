"""The pure part of the membership protocol: store keys, plans, liveness from counters, plan and decision rules.

No I/O and no clock here: every function takes what it needs (a snapshot, `now`) as arguments, so the rules are
unit-tested directly and the node (engine/mesh/node.py) only gathers snapshots and writes results. docs/mesh.md
describes the protocol as a whole; the key layout is in `Keys`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from engine.states import NodeState

NODE_STATES = tuple(s.value for s in NodeState)  # the values of `state/<id>` and their meanings: engine/states.py
LEAVE_REASONS = ("drained", "completed", "failed")
COMMIT, ABORT = "commit", "abort"


class MeshError(RuntimeError):
    """The mesh cannot go on for this node: the message says what happened and what to do."""


class Excluded(Exception):
    """This node is not in the plan it waited for (it arrived late): re-join with Mesh.wait_admission()."""


class Stopped(Exception):
    """A stop or drain was requested while the node waited in the mesh. reason: "stopped" or "drained"; or
    "ended": every member of the run completed it while this node waited to join (Mesh.wait_admission), and the
    node ends completed, without the run's final model (engine/session.py)."""

    def __init__(self, reason: str, what: str) -> None:
        super().__init__(f"{reason} while {what}")
        self.reason = reason


class Reformed(Exception):
    """The store came back empty (it was restarted) while this node waited: the outer step in flight is void;
    arrive again (Mesh.boundary) to form the run anew with this node's state."""


class Keys:
    """Every key of the protocol (docs/mesh.md explains each). The key count is bounded by the live nodes: three
    keys per registered id (pruned once the id is dead), a few run-wide keys, and decisions of the last
    KEEP_STEPS outer steps of the current epoch `r/<epoch>/`."""

    PREFIX = "zb/"

    def __init__(self, prefix: str = PREFIX) -> None:
        self.p = prefix

    # run-wide
    def digest(self) -> str: return f"{self.p}digest"
    def life(self) -> str: return f"{self.p}life"
    def leader(self) -> str: return f"{self.p}leader"
    def ids(self) -> str: return f"{self.p}ids"
    def latest(self) -> str: return f"{self.p}plan/latest"
    # per node: who holds the id, its heartbeat counter (negative: left), its state and boundary (StateRecord)
    def info(self, node: str) -> str: return f"{self.p}info/{node}"
    def hb(self, node: str) -> str: return f"{self.p}hb/{node}"
    def state(self, node: str) -> str: return f"{self.p}state/{node}"
    # per boundary (epoch, outer step, attempt)
    def decision(self, e: int, k: int, a: int) -> str: return f"{self.p}r/{e}/decision/{k}/{a}"

    def group_prefix(self, generation: int, local_rank: int) -> str:
        """The process group of one generation, one per local rank (FSDP shard i talks to shard i elsewhere)."""
        return f"{self.p}pg/{generation}/{local_rank}"

    def group_key(self, generation: int, local_rank: int, rank: int) -> str:
        """The one rendezvous key gloo writes for `rank` under a group prefix (its addresses)."""
        return f"{self.group_prefix(generation, local_rank)}/0/{rank}"


@dataclass(frozen=True)
class Plan:
    """Who takes part in one outer step (one attempt). members are sorted; their order is the group rank.

    joiners: members that contribute nothing (weight 0) and receive the state from `source` first.
    leaving: draining members that contribute this time and leave after the commit.
    contributors: members whose pseudo-gradient counts (not joiners, arrived with contributing=True);
    the mean divides by len(contributors). epoch: the run's life (see Keys); generation names the group.
    deadline: with time rounds (diloco.round = "time"), when the round after this outer step ends, in the
    planner's wall-clock seconds: every member, and a joiner this plan admits, ends that round then.
    forming: the first outer step of a (re)formed run, until an attempt of it commits. Its members may come from
    checkpoints (or a store restart) that left them on different weights: after the commit every member aligns its
    state on the source's (engine/outer/handoff.py). Read from the plan, so every member agrees on it.
    """

    generation: int
    outer_step: int
    attempt: int
    members: tuple[str, ...]
    joiners: tuple[str, ...] = ()
    source: str | None = None
    leaving: tuple[str, ...] = ()
    contributors: tuple[str, ...] = ()
    epoch: int = 0
    deadline: float | None = None
    forming: bool = False

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, node_id: str) -> int:
        try:
            return self.members.index(node_id)
        except ValueError:
            raise Excluded(f"node {node_id} is not a member of generation {self.generation}") from None

    def to_json(self) -> str:
        return json.dumps({"generation": self.generation, "outer_step": self.outer_step, "attempt": self.attempt,
                           "members": list(self.members), "joiners": list(self.joiners), "source": self.source,
                           "leaving": list(self.leaving), "contributors": list(self.contributors),
                           "epoch": self.epoch, "deadline": self.deadline, "forming": self.forming},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        d = json.loads(text)
        return cls(generation=d["generation"], outer_step=d["outer_step"], attempt=d["attempt"],
                   members=tuple(d["members"]), joiners=tuple(d["joiners"]), source=d["source"],
                   leaving=tuple(d["leaving"]), contributors=tuple(d.get("contributors", ())),
                   epoch=d.get("epoch", 0), deadline=d.get("deadline"), forming=d.get("forming", False))


@dataclass(frozen=True)
class Arrival:
    contributing: bool = True
    draining: bool = False
    outer_step: int | None = None  # the boundary it arrived at (formation takes nodes at different outer steps)


@dataclass(frozen=True)
class StateRecord:
    """The value of `state/<id>`, written only by the node itself (one key: the planner reads every node's in
    one multi_get). `state` is its NodeState (engine/states.py): a value outside it is refused on write and read.
    `at` is the boundary (epoch, outer step, attempt) it arrived at, with its arrival flags; `ok` its outcome of
    that boundary's all-reduce (None: not posted yet); `group` the (generation, rank) of the last process group it
    was planned into, so that a pruner can delete its rendezvous keys."""

    state: NodeState
    token: str = ""
    at: tuple[int, int, int] | None = None
    contributing: bool = True
    draining: bool = False
    ok: bool | None = None
    group: tuple[int, int] | None = None
    reason: str = ""  # state left: why (LEAVE_REASONS), so a node waiting to join tells a completed run

    def arrival(self) -> Arrival:
        return Arrival(self.contributing, self.draining, self.at[1] if self.at else None)

    def to_json(self) -> str:
        d = {"s": NodeState(self.state).value, "t": self.token, "at": self.at, "c": self.contributing,
             "d": self.draining, "ok": self.ok, "g": self.group}
        if self.reason:
            d["r"] = self.reason
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "StateRecord | None":
        """None for an empty value (a key created empty by a read, see Mesh._read)."""
        if not text:
            return None
        d = json.loads(text)
        if d["s"] not in NODE_STATES:  # only a node of another protocol writes another word (docs/mesh.md)
            raise MeshError(f"a node's state key holds state {d['s']!r}, not one of {', '.join(NODE_STATES)}: "
                            "a node of another wire protocol writes to this store")
        return cls(state=NodeState(d["s"]), token=d.get("t", ""), at=tuple(d["at"]) if d.get("at") else None,
                   contributing=bool(d.get("c", True)), draining=bool(d.get("d", False)), ok=d.get("ok"),
                   group=tuple(d["g"]) if d.get("g") else None, reason=d.get("r", ""))


class Liveness:
    """Clock-independent liveness: a peer is alive while its heartbeat counter keeps changing.

    Observers record, on their own monotonic clock, when they last saw a peer's counter change; wall clocks of
    different hosts are never compared. A peer first seen now gets a full timeout of grace. A negative counter
    (written by a clean exit) is final until the counter is seen again (a node that restarted with the same id).
    On a store with leases a vanished heartbeat key (`expire`) is death at once, until the counter is seen again.

    The table is only as fresh as the observer's last look: an observer that was itself frozen (SIGSTOP, swapped
    out, partitioned from the store) for more than the timeout knows nothing about the meantime. It declares no
    one dead until it has looked again, and its next look gives every peer a fresh timeout of grace. A shorter
    blind spell (a look more than `slack` after the one before: the observer's own store calls failed or
    crawled) is not counted against the peers either: their silence is counted on the time it was watching.
    During an etcd leader election every node's writes fail for a second or more; the first node whose tick
    gets through after it would otherwise see every peer's counter as old as the election plus a tick, and call
    them all dead (tests/test_etcd_e2e.py's leader kill, 2 of 16 runs).
    """

    def __init__(self, timeout: float, slack: float | None = None) -> None:
        self.timeout = timeout
        self.slack = timeout / 4 if slack is None else slack  # the longest gap between looks counted in full
        self._last: dict[str, tuple[int, float]] = {}  # node -> (counter, local time it last changed)
        self._first: dict[str, int] = {}  # node -> the counter when first observed
        self._gone: set[str] = set()
        self._expired: set[str] = set()  # heartbeat key vanished with its lease (stores with leases: etcd)
        self._looked: float | None = None  # when the observer last looked at the table

    def look(self, now: float) -> bool:
        """Start one look at the table. False (and every peer gets a fresh grace) after a blind spell."""
        gap = None if self._looked is None else now - self._looked
        fresh = gap is None or gap <= self.timeout
        if not fresh:
            self._last = {n: (c, now) for n, (c, _) in self._last.items()}
        elif gap is not None and gap > self.slack:  # a blind spell: the peers' silence excludes it
            blind = gap - self.slack
            self._last = {n: (c, min(now, t + blind)) for n, (c, t) in self._last.items()}
        self._looked = now
        return fresh

    def observe(self, node: str, counter: int, now: float, *, gone: bool = False) -> None:
        prev = self._last.get(node)
        self._first.setdefault(node, counter)
        if prev is None or prev[0] != counter:
            self._last[node] = (counter, now)
        self._expired.discard(node)
        if gone:
            self._gone.add(node)
        else:
            self._gone.discard(node)

    def see(self, node: str, counter: int | None, now: float) -> None:
        """One look's reading of a node's heartbeat counter (negative: it left); None: its key is gone (a lease that
        expired, or an id the leader pruned)."""
        if counter is None:
            self.expire(node, now)
        else:
            self.observe(node, counter, now, gone=counter < 0)

    def expire(self, node: str, now: float) -> None:
        """The node's leased heartbeat key vanished: it stopped renewing its lease for a whole TTL. Dead now, but
        not gone (a death, not a clean exit); its counter seen again (a frozen process woke up) revives it."""
        self._first.setdefault(node, 0)
        self._last.setdefault(node, (0, now))  # counters start at 1: a key created again reads as a change
        self._expired.add(node)

    def forget(self, node: str) -> None:
        self._last.pop(node, None)
        self._first.pop(node, None)
        self._gone.discard(node)
        self._expired.discard(node)

    def known(self) -> list[str]:
        return list(self._last)

    def moved(self, node: str) -> bool:
        """The counter changed since this observer first saw it: the node is beating right now."""
        seen = self._last.get(node)
        return seen is not None and seen[0] != self._first[node]

    def is_gone(self, node: str) -> bool:
        return node in self._gone

    def stale(self, now: float) -> bool:
        """The observer has not looked for longer than the timeout: its table says nothing about now."""
        return self._looked is None or now - self._looked > self.timeout

    def age(self, node: str, now: float) -> float | None:
        seen = self._last.get(node)
        return None if seen is None else max(0.0, now - seen[1])

    def silent_for(self, node: str, now: float) -> float:
        """Seconds past the timeout a node has been silent (0 while alive or unknown); gone counts as forever."""
        if node in self._gone:
            return float("inf")
        seen = self._last.get(node)
        return 0.0 if seen is None else max(0.0, now - seen[1] - self.timeout)

    def is_dead(self, node: str, now: float) -> bool:
        """Left or silent past the timeout. A node never observed is not (yet) dead; nor is anyone while the
        observer's own table is stale."""
        if node in self._gone or node in self._expired:
            return True
        if self.stale(now):
            return False
        seen = self._last.get(node)
        return seen is not None and now - seen[1] > self.timeout

    def dead(self, nodes: Iterable[str], now: float) -> frozenset[str]:
        return frozenset(n for n in nodes if self.is_dead(n, now))


@dataclass(frozen=True)
class BoundaryView:
    """What the planner saw of one boundary (epoch, outer_step, attempt) in the store."""

    epoch: int
    outer_step: int
    attempt: int
    prev: Plan | None  # the latest plan of this epoch; None: the run (re)forms here
    prev_committed: bool  # whether prev ended in "commit"
    arrived: Mapping[str, Arrival] = field(default_factory=dict)
    dead: frozenset[str] = frozenset()  # dead or left, among every node the planner knows
    joining: frozenset[str] = frozenset()  # nodes with a join request
    starting: frozenset[str] = frozenset()  # nodes in state starting (formation candidates; restarted members)
    standby: frozenset[str] = frozenset()  # members in state standby (stepped out): neither awaited nor admitted
    min_nodes: int = 1
    timed_out: bool = False  # the planner's wait for this boundary is over: plan with whoever arrived
    base_generation: int = 0  # first generation of a (re)formed run is base_generation + 1


def compute_plan(v: BoundaryView) -> Plan | None:
    """The plan for a boundary, or None while it is still worth waiting. Raises MeshError when a forming run
    timed out below min_nodes. Pure: the same view always gives the same plan."""
    joiners = set(v.joining) - set(v.dead)
    outer_step = v.outer_step
    if v.prev is None:
        core = {n for n in v.arrived if n not in v.dead and n not in joiners}
        waiting_for = (set(v.starting) - set(v.dead) - joiners) - core
        if not v.timed_out and (len(core) < v.min_nodes or waiting_for):
            return None
        if len(core) < v.min_nodes:
            raise MeshError(f"only {len(core)} of diloco.min_nodes={v.min_nodes} nodes arrived at the first "
                            f"outer step within mesh.start_timeout ({sorted(core)})")
        # nodes resumed from checkpoints of different ages arrive at different outer steps: the run forms at the
        # newest, and the ones behind take part as joiners (they receive the state; their round is not counted)
        steps = {n: v.arrived[n].outer_step for n in core}
        outer_step = max([s for s in steps.values() if s is not None], default=v.outer_step)
        behind = {n for n, s in steps.items() if s is not None and s < outer_step}
        core -= behind
        joiners |= behind
        # and nodes that arrive with no round to give (a joiner whose admission a store restart voided: it has no
        # state of the run) take the state too, from a node that has one; it was a member, and the source when its
        # id sorted first, its stale weights everyone's
        stateless = {n for n in core if not v.arrived[n].contributing}
        if core - stateless:
            core -= stateless
            joiners |= stateless
        generation = v.base_generation + 1
        forming = True
    else:
        prev = v.prev
        if v.prev_committed:
            # admitted by that commit: full members now (their state may still say joining for a moment). A
            # member of it that asks to join again restarted (or was left out): a joiner, not awaited as a member
            joiners -= set(prev.joiners)
            gone_clean = set(prev.leaving)  # drained: excluded at once, no heartbeat wait
        else:
            gone_clean = set()
        # joiners need not arrive: the planner admits them from their join request. A member in state starting is
        # a new process under its id (a restart): it cannot arrive as a member, it will ask to join
        # a member that stepped out (standby) is not waited for: its peers re-plan without it at once
        expected = set(prev.members) - gone_clean - set(v.dead) - joiners - set(v.starting) - set(v.standby)
        if not v.timed_out and expected - set(v.arrived):
            return None
        core = expected & set(v.arrived)
        members_now = tuple(sorted(core | joiners))
        changed = (members_now != prev.members or v.attempt > 0 or not v.prev_committed
                   or prev.outer_step >= v.outer_step)
        generation = prev.generation + (1 if changed else 0)
        forming = prev.forming and not v.prev_committed  # a formation's aborted attempt: the retry still forms
    members = tuple(sorted(core | joiners))
    leaving = tuple(sorted(n for n in core if v.arrived[n].draining))
    contributors = tuple(sorted(n for n in core if n not in joiners and v.arrived[n].contributing))
    holders = sorted(n for n in core if n not in joiners)
    staying = [n for n in holders if n not in leaving]
    source = (staying or holders or [None])[0]
    return Plan(generation=generation, outer_step=outer_step, attempt=v.attempt, members=members,
                joiners=tuple(sorted(joiners)), source=source, leaving=leaving, contributors=contributors,
                epoch=v.epoch, forming=forming)


def decide(members: Iterable[str], posted: Mapping[str, bool], dead: Iterable[str]) -> str | None:
    """The commit rule: commit iff every member posted ok; abort as soon as one posted fail or one is dead
    without having posted; None while it is still open."""
    members = list(members)
    dead = set(dead)
    if any(posted.get(m) is False for m in members):
        return ABORT
    if any(m in dead and m not in posted for m in members):
        return ABORT
    if all(posted.get(m) is True for m in members):
        return COMMIT
    return None
