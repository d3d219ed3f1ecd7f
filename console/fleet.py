"""The cluster model: every node, its state and its recent history, fed by event lines. No I/O here.

    fleet = Fleet(run="demo")
    fleet.add_node("node-a", "127.0.0.1")
    fleet.ingest("node-a", line)          # one JSON line of the node's events file
    fleet.set_state("node-b", NodeState.UNREACHABLE, "ssh: connection refused")
    fleet.summary()                       # the header: members, outer step, tokens/s, loss, ETA

A node's displayed state has two sources:

* what the engine says about itself (`state`, `run_end`, `drained` events; mesh `membership` events about it);
* facts only the console knows (`set_state`): the host is unreachable, the process is dead, it failed to start.

A console fact wins over the engine's word until something newer settles it: any event from an UNREACHABLE
node proves the link is back; a `run_start` proves a new process after DEAD or FAILED. That way the last lines
of a killed engine, read after the kill, do not bring it back to life on the screen.

`version` is bumped on every change, so the UI redraws only when something changed. Ingest is on the hot path
(>= 100,000 events/s on one core): one dict dispatch per event, no formatting until a log line is read.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from engine.telemetry import BadEvent, format_human, parse_line

HISTORY = 512  # points per node in the loss / tokens-per-second charts
LOG_LINES = 500  # human-readable lines kept per node
TIMELINE = 500  # membership events kept for the whole cluster
_STEP_WINDOW = 32  # (ts, step) points per node used for the ETA


class NodeState(str, Enum):
    STANDBY = "standby"  # in the profile, ready to be added, nothing running
    STARTING = "starting"
    JOINING = "joining"
    TRAINING = "training"
    DRAINING = "draining"
    LEFT = "left"  # finished, drained or stopped: it exited on purpose
    DEAD = "dead"  # the process is gone (killed, crashed) or the mesh declared it dead
    UNREACHABLE = "unreachable"  # the host cannot be reached; the engine may well still run
    FAILED = "failed"  # it could not start or ended with an error

    def __str__(self) -> str:
        return self.value


# states the console asserts over the engine's own word (see the module docstring)
_CONSOLE_FACTS = frozenset({NodeState.DEAD, NodeState.UNREACHABLE, NodeState.FAILED})
_ENGINE_STATES = {s.value: s for s in (NodeState.STARTING, NodeState.JOINING, NodeState.TRAINING,
                                       NodeState.DRAINING, NodeState.LEFT)}
_ACTIVE = frozenset({NodeState.TRAINING, NodeState.DRAINING})
_GONE = frozenset({NodeState.LEFT, NodeState.DEAD, NodeState.FAILED, NodeState.STANDBY})
_RUN_END_STATE = {"completed": NodeState.LEFT, "drained": NodeState.LEFT, "stopped": NodeState.LEFT,
                  "failed": NodeState.FAILED}


class _LazyLine:
    """A log line formatted only when someone reads it: formatting every step event would halve ingest speed."""

    __slots__ = ("event",)

    def __init__(self, event: dict[str, Any]):
        self.event = event

    def __str__(self) -> str:
        return format_human(self.event) or ""


class LogBuffer(deque):
    """A bounded deque of log lines that hands out plain strings (engine events are formatted on read)."""

    def __iter__(self):
        return (str(line) for line in deque.__iter__(self))

    def __getitem__(self, index):  # type: ignore[override]
        return str(deque.__getitem__(self, index))


@dataclass(eq=False)
class Node:
    name: str
    host: str
    state: NodeState = NodeState.STANDBY
    reason: str | None = None
    device: str | None = None  # "gpu" (NVML) or "cpu" (psutil); None until the first resource sample
    util: float | None = None  # percent
    mem_used: int | None = None  # bytes
    mem_total: int | None = None
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    outer_step: int | None = None
    pid: int | None = None
    max_steps: int | None = None
    malformed: int = 0  # lines on its event stream that were not valid events
    last_ts: float | None = None  # the node's own clock at its latest event
    peers: dict[str, float] = field(default_factory=dict)  # its view of each peer's heartbeat age
    loss_history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    tps_history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    log: LogBuffer = field(default_factory=lambda: LogBuffer(maxlen=LOG_LINES))
    marked: bool = False
    # the engine's own latest word on its state; `state` differs from it while a console fact holds
    engine_state: NodeState | None = None
    _steps: deque = field(default_factory=lambda: deque(maxlen=_STEP_WINDOW), repr=False)

    @property
    def heartbeat_age(self) -> float | None:
        """Seconds since the node's latest event by its own clock (clamped at 0 against clock skew)."""
        if self.last_ts is None:
            return None
        return max(0.0, time.time() - self.last_ts)


@dataclass(frozen=True)
class MembershipEvent:
    ts: float
    change: str  # joined, drained, left, dead, leader, rejected; or a console fact (unreachable, failed, ...)
    subject: str  # the node it is about
    generation: int | None
    members: tuple[str, ...]
    source: str  # the node that reported it, or "console"
    reason: str | None = None


@dataclass(frozen=True)
class Summary:
    run: str
    members: int
    outer_step: int | None
    tokens_per_s: float  # sum over active nodes
    loss: float | None  # mean of the active nodes' latest loss
    eta_s: float | None
    step: int | None  # the furthest node's step
    max_steps: int | None


class Fleet:
    def __init__(self, run: str = "run", clock: Callable[[], float] = time.time):
        self.run = run
        self.nodes: dict[str, Node] = {}
        self.timeline: deque[MembershipEvent] = deque(maxlen=TIMELINE)
        self.members: tuple[str, ...] | None = None  # the mesh's latest member list, as any node reported it
        self.generation: int = -1
        self.version = 0
        self._clock = clock
        self._handlers: dict[str, Callable[[Node, dict[str, Any]], None]] = {
            "run_start": self._on_run_start, "step": self._on_step, "eval": self._on_log_only,
            "checkpoint": self._on_log_only, "export": self._on_log_only, "resource": self._on_resource,
            "state": self._on_state, "outer_step": self._on_outer_step, "membership": self._on_membership,
            "heartbeat": self._on_heartbeat, "drained": self._on_drained, "warning": self._on_log_only,
            "error": self._on_error, "run_end": self._on_run_end,
        }

    # ---- nodes -------------------------------------------------------------------------------------------
    def add_node(self, name: str, host: str, state: NodeState = NodeState.STANDBY) -> Node:
        """Add (or return) a node; insertion order is the table's order."""
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = Node(name=name, host=host, state=state)
            self.version += 1
        return node

    def _node(self, name: str) -> Node:
        node = self.nodes.get(name)
        return node if node is not None else self.add_node(name, "?", NodeState.STARTING)

    def set_state(self, node_name: str, state: NodeState, reason: str | None = None) -> None:
        """A transport-level fact about a node (unreachable, dead, failed to start, starting again)."""
        node = self._node(node_name)
        state = NodeState(state)
        if node.state is state:  # the same fact again (a retry's new wording): no new log or timeline entry
            if node.reason != reason:
                node.reason = reason
                self.version += 1
            return
        node.state = state
        node.reason = reason
        if state is NodeState.STARTING:
            node.engine_state = None  # a new process: the old one's last word no longer counts
        if reason:
            node.log.append(f"[console] {state.value}: {reason}")
        if state in _CONSOLE_FACTS or state in (NodeState.STARTING, NodeState.STANDBY):
            self._record(MembershipEvent(self._clock(), state.value, node_name, None, (), "console", reason))
        self.version += 1

    def set_reachable(self, node_name: str) -> None:
        """The link to the node's host is back: an UNREACHABLE node shows the engine's own state again."""
        node = self.nodes.get(node_name)
        if node is not None and node.state is NodeState.UNREACHABLE:
            node.state = node.engine_state or NodeState.STARTING
            node.reason = None
            node.log.append("[console] reachable again")
            self.version += 1

    def note(self, node_name: str, text: str) -> None:
        """A console line in the node's log (an action taken, a check's result)."""
        self._node(node_name).log.append(f"[console] {text}")
        self.version += 1

    # ---- ingest ------------------------------------------------------------------------------------------
    def ingest(self, node_name: str, line: str | bytes) -> None:
        """One line of a node's event stream; a malformed line is counted on that node and skipped."""
        try:
            event = parse_line(line)
        except BadEvent as e:
            node = self._node(node_name)
            node.malformed += 1
            if node.malformed <= 3 or node.malformed % 1000 == 0:  # say why, without flooding the log
                node.log.append(f"[console] malformed line #{node.malformed}: {e}")
            self.version += 1
            return
        self.ingest_event(node_name, event)

    def ingest_event(self, node_name: str, event: dict[str, Any]) -> None:
        node = self.nodes.get(node_name)
        if node is None:
            node = self._node(node_name)
        node.last_ts = event["ts"]
        if node.state is NodeState.UNREACHABLE:  # a line arrived: the link is back
            node.state = node.engine_state or NodeState.STARTING
            node.reason = None
        self._handlers[event["type"]](node, event)
        self.version += 1

    def _engine_says(self, node: Node, state: NodeState, reason: str | None = None) -> None:
        node.engine_state = state
        if node.state not in _CONSOLE_FACTS:
            node.state = state
            node.reason = reason

    def _on_log_only(self, node: Node, event: dict[str, Any]) -> None:
        node.log.append(_LazyLine(event))

    def _on_run_start(self, node: Node, event: dict[str, Any]) -> None:
        node.pid = event["pid"]
        node.max_steps = event["max_steps"]
        if event["rank"] <= 0:
            node.state = NodeState.STARTING  # a new process: it settles any DEAD/FAILED of the old one
            node.reason = None
            node.engine_state = NodeState.STARTING
        node.log.append(_LazyLine(event))

    def _on_step(self, node: Node, event: dict[str, Any]) -> None:
        if event["rank"] > 0:  # with telemetry.all_ranks the node's figures are still local rank 0's
            return
        ts = event["ts"]
        node.step = step = event["step"]
        node.loss = loss = event["loss"]
        node.tokens_per_s = tps = event["tokens_per_s"]
        node.loss_history.append((ts, loss))
        node.tps_history.append((ts, tps))
        node._steps.append((ts, step))
        node.log.append(_LazyLine(event))

    def _on_resource(self, node: Node, event: dict[str, Any]) -> None:
        if event["rank"] > 0:
            return
        node.device = event["device"]
        node.util = event["util"]
        node.mem_used = event["mem_used"]
        node.mem_total = event["mem_total"]

    def _on_state(self, node: Node, event: dict[str, Any]) -> None:
        state = _ENGINE_STATES.get(event["state"])
        if state is None:
            node.log.append(f"[console] unknown state {event['state']!r}")
            return
        self._engine_says(node, state)
        node.log.append(_LazyLine(event))

    def _on_outer_step(self, node: Node, event: dict[str, Any]) -> None:
        node.outer_step = event["outer_step"]
        self._set_members(event["generation"], event["members"])
        node.log.append(_LazyLine(event))

    def _on_membership(self, node: Node, event: dict[str, Any]) -> None:
        generation, subject, change = event["generation"], event["subject"], event["change"]
        self._set_members(generation, event["members"])
        if change == "dead" and subject in self.nodes:
            subj = self.nodes[subject]
            if subj.state not in (NodeState.LEFT, NodeState.FAILED, NodeState.DEAD):
                subj.state = NodeState.DEAD
                subj.reason = f"declared dead by the mesh (seen by {node.name})"
        elif change in ("drained", "left") and subject in self.nodes:
            self._engine_says(self.nodes[subject], NodeState.LEFT, change)
        for seen in reversed(self.timeline):  # every node reports the same change: keep one
            if seen.generation == generation and seen.subject == subject and seen.change == change:
                break
            if seen.generation is not None and seen.generation < generation:
                self._record(MembershipEvent(event["ts"], change, subject, generation,
                                             tuple(event["members"]), node.name))
                break
        else:
            self._record(MembershipEvent(event["ts"], change, subject, generation, tuple(event["members"]),
                                         node.name))
        node.log.append(_LazyLine(event))

    def _on_heartbeat(self, node: Node, event: dict[str, Any]) -> None:
        node.peers = event["peers"]

    def _on_drained(self, node: Node, event: dict[str, Any]) -> None:
        node.outer_step = event["outer_step"]
        self._engine_says(node, NodeState.LEFT, "drained")
        node.log.append(_LazyLine(event))

    def _on_error(self, node: Node, event: dict[str, Any]) -> None:
        node.reason = event["message"]
        node.log.append(_LazyLine(event))

    def _on_run_end(self, node: Node, event: dict[str, Any]) -> None:
        if event["rank"] > 0:
            return
        status = event["status"]
        state = _RUN_END_STATE.get(status, NodeState.FAILED)
        reason = node.reason if state is NodeState.FAILED and node.reason else status
        self._engine_says(node, state, reason)
        node.step = event["step"]
        node.log.append(_LazyLine(event))

    def _set_members(self, generation: int, members: list) -> None:
        if generation >= self.generation:
            self.generation = generation
            self.members = tuple(members)

    def _record(self, entry: MembershipEvent) -> None:
        self.timeline.append(entry)

    # ---- the header ----------------------------------------------------------------------------------------
    def summary(self) -> Summary:
        active = [n for n in self.nodes.values() if n.state in _ACTIVE]
        losses = [n.loss for n in active if n.loss is not None]
        outer = [n.outer_step for n in self.nodes.values() if n.outer_step is not None]
        steps = [n for n in self.nodes.values() if n.step is not None]
        lead = max(steps, key=lambda n: n.step) if steps else None  # type: ignore[arg-type, return-value]
        max_steps = max((n.max_steps for n in self.nodes.values() if n.max_steps), default=None)
        if self.members is None:
            members = len(active)
        else:  # the mesh's latest list, less the nodes known to be gone since (it lags a death or a stop)
            members = sum(1 for m in self.members if m not in self.nodes or self.nodes[m].state not in _GONE)
        return Summary(
            run=self.run, members=members, outer_step=max(outer) if outer else None,
            tokens_per_s=float(sum(n.tokens_per_s or 0.0 for n in active)),
            loss=sum(losses) / len(losses) if losses else None,
            eta_s=_eta(lead, max_steps), step=lead.step if lead else None, max_steps=max_steps)

    def marked(self) -> list[str]:
        return [n.name for n in self.nodes.values() if n.marked]


def _eta(node: Node | None, max_steps: int | None) -> float | None:
    """Seconds left at the furthest node's recent pace (its last _STEP_WINDOW step events)."""
    if node is None or max_steps is None or len(node._steps) < 2:
        return None
    (t0, s0), (t1, s1) = node._steps[0], node._steps[-1]
    if s1 <= s0 or t1 <= t0:
        return None
    return max(0.0, (max_steps - s1) * (t1 - t0) / (s1 - s0))
