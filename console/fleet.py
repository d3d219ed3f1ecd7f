"""The cluster model: every node, its state and its recent history, fed by event lines. No I/O here.

    fleet = Fleet(run="demo")
    fleet.add_node("node-a", "127.0.0.1")
    fleet.ingest("node-a", line)          # one JSON line of the node's events file
    fleet.set_state("node-b", HostState.UNREACHABLE, "ssh: connection refused")
    fleet.summary()                       # the header: members, outer step, tokens/s, loss, ETA

A node's displayed state has two sources:

* what the engine says about itself (`state`, `run_end`, `drained` events; mesh `membership` events about it);
* facts only the console knows (`set_state`): the host is unreachable, the process is dead, it failed to start.

A console fact wins over the engine's word until something newer settles it: any event from an UNREACHABLE
node proves the link is back; a `run_start` proves a new process after DEAD or FAILED. That way the last lines
of a killed engine, read after the kill, do not bring it back to life on the screen.

A mesh `membership dead` about a node is weaker: it is the peers' word that they stopped hearing it, and a node
cut off by a link fault, a blackhole or a long freeze comes back as the same process and re-joins without a new
`run_start`. So it marks the node DEAD with `mesh_dead_ts` set, and a later event of the node itself that shows
it in the mesh again (by `ts`, not by arrival: --attach replays one events file after another) shows its own state
again: a heartbeat (its beat reached the store), an outer step, a state change, `drained`, its own `joined`; or
its process's own last word (`run_end`), or a new process's `run_start`. Its steps and resource samples do not: a
node cut off by a link fault trains and samples on until its next outer step finds it out. A dead report older
than the node's latest such event is history and changes nothing. Only the console's own facts (the process is
gone, killed) end a node for good (see console/exit_codes.py).

Two parts hold their own rules: the store's process and its probe's samples (`fleet.store`, console/store_health.py)
and the outer rounds folded from every node's reports (`fleet.outer_rounds`, console/rounds.py).

`version` is bumped on every change, so the UI redraws only when something changed. Ingest is on the hot path
(>= 100,000 events/s on one core): one dict dispatch per event, no formatting until a log line is read.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterable

from console.nodes import (Device, HostState, LazyLine, MembershipEvent, Node, NodeState, OuterRound, RankFigures,
                           Shown, Summary, shown)
from console.exit_codes import ENDED, run_outcome
from console.rounds import fold_round, num, shares
from console.store_health import StoreHealth
from engine.states import EVENT_STATES
from engine.telemetry import BadEvent, parse_line

TIMELINE = 500  # membership events kept for the whole cluster


# states the console asserts over the engine's own word (see the module docstring)
_CONSOLE_FACTS = frozenset({NodeState.DEAD, HostState.UNREACHABLE, HostState.FAILED})
_ENGINE_STATES = {s.value: s for s in EVENT_STATES}  # what a node's `state` event may say
_ACTIVE = frozenset({NodeState.TRAINING, NodeState.DRAINING})
_GONE = frozenset({NodeState.LEFT, NodeState.DEAD, HostState.FAILED, HostState.SPARE, HostState.OFF})
_RUN_END_STATE: dict[str, Shown] = {"completed": NodeState.LEFT, "drained": NodeState.LEFT,
                                    "stopped": NodeState.LEFT, "failed": HostState.FAILED}
# a node's own events that overrule an older mesh "dead" report about it: they show it in the mesh again (so does
# its own `membership joined`), or are its process's own word on how it ends or that it is new. Not its steps or
# resource samples: a node cut off from the mesh trains and samples on until its next outer step finds it out
_OVERRULES_DEAD = frozenset({"heartbeat", "outer_step", "state", "drained", "run_end", "run_start"})


class Fleet:
    def __init__(self, run: str = "run", clock: Callable[[], float] = time.time):
        self.run = run
        self.nodes: dict[str, Node] = {}
        self.timeline: deque[MembershipEvent] = deque(maxlen=TIMELINE)
        self.members: tuple[str, ...] | None = None  # the mesh's latest member list, as any node reported it
        self.store_status: str | None = None  # set by the cluster's store health probe (etcd backend)
        self.generation: int = -1
        self.store = StoreHealth(clock, self._record)  # the store's process and its probe's samples
        self.outer_rounds: dict[int, OuterRound] = {}  # outer step -> the round, oldest first, bounded
        self.dataset: str | None = None  # the prepared dataset the run trains on (engines that report it)
        self._changes = 0
        self._clock = clock
        self._handlers: dict[str, Callable[[Node, dict[str, Any]], None]] = {
            "run_start": self._on_run_start, "step": self._on_step, "eval": self._on_log_only,
            "checkpoint": self._on_checkpoint, "export": self._on_log_only, "resource": self._on_resource,
            "state": self._on_state, "outer_step": self._on_outer_step, "membership": self._on_membership,
            "heartbeat": self._on_heartbeat, "drained": self._on_drained, "warning": self._on_log_only,
            "error": self._on_error, "run_end": self._on_run_end,
        }

    @property
    def version(self) -> int:
        """Bumped on every change (the store's included): the UI redraws only when it moved."""
        return self._changes + self.store.changes

    # ---- nodes -------------------------------------------------------------------------------------------
    def add_node(self, name: str, host: str, state: Shown = HostState.SPARE) -> Node:
        """Add (or return) a node; insertion order is the table's order."""
        node = self.nodes.get(name)
        if node is None:
            node = self.nodes[name] = Node(name=name, host=host, state=state)
            self._changes += 1
        return node

    def _node(self, name: str) -> Node:
        node = self.nodes.get(name)
        return node if node is not None else self.add_node(name, "?", NodeState.STARTING)

    def set_state(self, node_name: str, state: Shown, reason: str | None = None) -> None:
        """A transport-level fact about a node (unreachable, dead, failed to start, starting again)."""
        node = self._node(node_name)
        state = shown(state)
        # the same fact again (a retry's new wording): no new log or timeline entry; a console fact over the
        # mesh's "dead" is new (it is final)
        if node.state is state and node.mesh_dead_ts is None:
            if node.reason != reason:
                node.reason = reason
                self._changes += 1
            return
        node.state = state
        node.reason = reason
        node.mesh_dead_ts = None  # a console fact replaces the mesh's word
        if state is NodeState.STARTING:  # a new process: the old one's last word no longer counts
            node.engine_state, node.run_ended, node.error = None, False, None
        if reason:
            node.log.append(f"[console] {state.value}: {reason}")
        if state in _CONSOLE_FACTS or state in (NodeState.STARTING, HostState.SPARE, HostState.OFF):
            self._record(MembershipEvent(self._clock(), state.value, node_name, None, (), "console", reason))
        self._changes += 1

    def set_reachable(self, node_name: str) -> None:
        """The link to the node's host is back: an UNREACHABLE node shows the engine's own state again."""
        node = self.nodes.get(node_name)
        if node is not None and node.state is HostState.UNREACHABLE:
            node.state = node.engine_state or NodeState.STARTING
            node.reason = None
            node.log.append("[console] reachable again")
            self._changes += 1

    def process_ended(self, node_name: str) -> bool:
        """The node's process is gone after the engine said how it ended (run_end): a mesh "dead" reported after
        that word is moot; show the engine's word. False when the node is not dead on the mesh's word only."""
        node = self.nodes.get(node_name)
        if node is None or node.mesh_dead_ts is None or node.engine_state is None:
            return False
        node.state, node.reason, node.mesh_dead_ts = node.engine_state, node.engine_reason, None
        self._changes += 1
        return True

    def note(self, node_name: str, text: str) -> None:
        """A console line in the node's log (an action taken, a check's result)."""
        self._node(node_name).log.append(f"[console] {text}")
        self._changes += 1

    # ---- ingest ------------------------------------------------------------------------------------------
    def ingest(self, node_name: str, line: str | bytes) -> None:
        """One line of a node's event stream; a malformed line is counted on that node and skipped."""
        try:
            event = parse_line(line)
        except BadEvent as e:
            node = self._node(node_name)
            node.malformed += 1
            if node.malformed <= 3 or node.malformed % 1000 == 0:  # say why, without flooding the log
                node.log.append(f"[console] malformed line #{node.malformed}: {e}: {_excerpt(line)}")
            self._changes += 1
            return
        self.ingest_event(node_name, event)

    def ingest_event(self, node_name: str, event: dict[str, Any]) -> None:
        node = self.nodes.get(node_name)
        if node is None:
            node = self._node(node_name)
        ts = event["ts"]
        node.last_ts = ts
        node._own_ts = ts if node._own_ts is None else max(node._own_ts, ts)
        kind = event["type"]
        proof = kind in _OVERRULES_DEAD or (kind == "membership" and event["change"] == "joined"
                                            and event["subject"] == node.name)
        if proof:
            node._proof_ts = ts if node._proof_ts is None else max(node._proof_ts, ts)
        if node.state is HostState.UNREACHABLE:  # a line arrived: the link is back
            node.state = node.engine_state or NodeState.STARTING
            node.reason = None
        elif proof and node.mesh_dead_ts is not None and ts > node.mesh_dead_ts:  # heard after the report
            node.state = node.engine_state or NodeState.STARTING
            node.reason = None
            node.mesh_dead_ts = None
        self._handlers[kind](node, event)
        self._changes += 1

    def _engine_says(self, node: Node, state: Shown, reason: str | None = None) -> None:
        node.engine_state, node.engine_reason = state, reason
        if node.state not in _CONSOLE_FACTS:
            node.state = state
            node.reason = reason

    def _on_log_only(self, node: Node, event: dict[str, Any]) -> None:
        node.log.append(LazyLine(event))

    def _on_run_start(self, node: Node, event: dict[str, Any]) -> None:
        if event["rank"] > 0:
            node.log.append(LazyLine(event))
            return
        node.pid = event["pid"]
        node.max_steps = event["max_steps"]
        node.run_info = {k: event.get(k) for k in ("host", "world_size", "config_digest", "strategy", "run",
                                                   "diloco", "dataset", "rounds") if k in event}
        if isinstance(event.get("dataset"), str):
            self.dataset = event["dataset"]
        node.engine_state, node.run_ended, node.error = NodeState.STARTING, False, None
        if node.mesh_dead_ts is None:  # a new process: it settles any DEAD/FAILED of the old one
            node.state = NodeState.STARTING  # (a mesh dead report newer than this start is about this process)
            node.reason = None
        node.log.append(LazyLine(event))

    def _on_step(self, node: Node, event: dict[str, Any]) -> None:
        node.ranks[event["rank"]] = RankFigures(event["rank"], event["step"], event["tokens_per_s"], event["loss"],
                                                event["ts"])
        if event["rank"] > 0:  # with telemetry.all_ranks the node's figures are still local rank 0's
            return
        tokens, epoch = event.get("tokens"), event.get("epoch")
        node.tokens = tokens if isinstance(tokens, int) else node.tokens
        node.epoch = float(epoch) if isinstance(epoch, (int, float)) and not isinstance(epoch, bool) else node.epoch
        ts = event["ts"]
        node.step = step = event["step"]
        node.loss = loss = event["loss"]
        node.tokens_per_s = tps = event["tokens_per_s"]
        if loss is not None:  # null: the step's loss was not finite (a diverged round); nothing to plot
            node.loss_history.append((ts, loss))
        node.tps_history.append((ts, tps))
        node._steps.append((ts, step))
        node._step_seen = self._clock()
        node.log.append(LazyLine(event))

    def _on_resource(self, node: Node, event: dict[str, Any]) -> None:
        kind = event["device"]
        index = event.get("index")
        key = f"gpu {index}" if kind == "gpu" and index is not None else f"{kind} r{max(event['rank'], 0)}"
        node.devices[key] = Device(key, kind, float(event["util"]), event["mem_used"], event["mem_total"],
                                   num(event.get("temp_c")), num(event.get("power_w")), event["ts"])
        if event["rank"] > 0:
            return
        node.device = kind
        node.util = event["util"]
        node.mem_used = event["mem_used"]
        node.mem_total = event["mem_total"]

    def _on_checkpoint(self, node: Node, event: dict[str, Any]) -> None:
        if event["rank"] <= 0:
            node.checkpoints.append((event["step"], event["path"], event["seconds"]))
        node.log.append(LazyLine(event))

    def _on_state(self, node: Node, event: dict[str, Any]) -> None:
        state = _ENGINE_STATES.get(event["state"])
        if state is None:
            node.log.append(f"[console] unknown state {event['state']!r}")
            return
        self._engine_says(node, state)
        if state is NodeState.TRAINING and event["rank"] <= 0:
            node._outer_ts = event["ts"]  # the first round's compute time counts from here
            node.compile = compile_text(event) or node.compile
        node.log.append(LazyLine(event))

    def _on_outer_step(self, node: Node, event: dict[str, Any]) -> None:
        node.outer_step = event["outer_step"]
        node._outer_steps.append((event["ts"], event["outer_step"]))
        share = shares(event)
        if share is not None:
            weights = dict(zip(event["contributors"], event["weights"]))
            node.round_tokens = float(weights.get(node.name, 0.0))
            node.round_share = share.get(node.name, 0.0)
        residual, norm = num(event.get("residual_norm")), num(event.get("weights_norm"))
        if residual is not None and norm:
            node.residual_ratio = residual / norm
            node.residual_history.append(node.residual_ratio)
        self._set_members(event["generation"], event["members"])
        if event["rank"] <= 0:
            fold_round(self.outer_rounds, node, event)
        node.log.append(LazyLine(event))

    def _on_membership(self, node: Node, event: dict[str, Any]) -> None:
        generation, subject, change = event["generation"], event["subject"], event["change"]
        self._set_members(generation, event["members"])
        if change == "dead" and subject in self.nodes:
            subj, ts = self.nodes[subject], event["ts"]
            heard_since = subj._proof_ts is not None and subj._proof_ts >= ts  # an old report, replayed late
            if subj.mesh_dead_ts is not None:  # dead on the mesh's word already: the latest report counts
                subj.mesh_dead_ts = max(subj.mesh_dead_ts, ts)
            elif not heard_since and subj.state not in _GONE:
                subj.state = NodeState.DEAD
                subj.reason = f"declared dead by the mesh (seen by {node.name})"
                subj.mesh_dead_ts = ts
        elif change in ("drained", "left") and subject in self.nodes:
            subj = self.nodes[subject]
            # a peer's report of an earlier life, replayed after the subject's own newer events (a console that
            # attaches reads one events file after another): the subject's restarted process counts, not this
            if subject == node.name or subj._own_ts is None or subj._own_ts < event["ts"]:
                self._engine_says(subj, NodeState.LEFT, change)
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
        node.log.append(LazyLine(event))

    def _on_heartbeat(self, node: Node, event: dict[str, Any]) -> None:
        node.peers = event["peers"]

    def _on_drained(self, node: Node, event: dict[str, Any]) -> None:
        node.outer_step = event["outer_step"]
        self._engine_says(node, NodeState.LEFT, "drained")
        node.log.append(LazyLine(event))

    def _on_error(self, node: Node, event: dict[str, Any]) -> None:
        node.reason = event["message"]
        if node.error is None:
            node.error = event["message"]
        node.log.append(LazyLine(event))

    def _on_run_end(self, node: Node, event: dict[str, Any]) -> None:
        if event["rank"] > 0:
            return
        status = event["status"]
        state: Shown = _RUN_END_STATE.get(status, HostState.FAILED)
        reason = node.error if state is HostState.FAILED and node.error else status
        self._engine_says(node, state, reason)
        node.run_ended = True
        node.step = event["step"]
        node.log.append(LazyLine(event))

    def _set_members(self, generation: int, members: list) -> None:
        if generation >= self.generation:
            self.generation = generation
            self.members = tuple(members)

    def _record(self, entry: MembershipEvent) -> None:
        self.timeline.append(entry)

    # ---- the header ----------------------------------------------------------------------------------------
    def summary(self) -> Summary:
        active = [n for n in self.nodes.values() if n.state in _ACTIVE]
        ended = ENDED.get(run_outcome(self))
        last = _at_the_end(self.nodes.values()) if ended and not active else active
        losses = [n.loss for n in last if n.loss is not None]
        outer = [n.outer_step for n in self.nodes.values() if n.outer_step is not None]
        steps = [n for n in self.nodes.values() if n.step is not None]
        lead = max(steps, key=lambda n: n.step or 0) if steps else None  # each has a step
        max_steps = max((n.max_steps for n in self.nodes.values() if n.max_steps), default=None)
        if self.members is None:
            members = len(active)
        else:  # the mesh's latest list, less the nodes known to be gone since (it lags a death or a stop)
            members = sum(1 for m in self.members if m not in self.nodes or self.nodes[m].state not in _GONE)
        rounds = max((n.run_info.get("rounds") or 0 for n in self.nodes.values()), default=0) or None
        if rounds:  # time rounds: the run lasts `rounds` outer steps, whatever each node's own step count
            ahead = max((n for n in self.nodes.values() if n.outer_step is not None),
                        key=lambda n: n.outer_step or 0, default=None)
            eta = _eta(ahead._outer_steps if ahead else None, rounds)
        else:
            eta = _eta(lead._steps if lead else None, max_steps)
        return Summary(
            run=self.run, members=members, outer_step=max(outer) if outer else None,
            tokens_per_s=float(sum(n.tokens_per_s_now or 0.0 for n in active)),
            loss=sum(losses) / len(losses) if losses else None,
            eta_s=None if ended else eta, step=lead.step if lead else None, max_steps=None if rounds else max_steps,
            store=self.store_status, rounds=rounds, ended=ended)

    def marked(self) -> list[str]:
        return [n.name for n in self.nodes.values() if n.marked]


def _at_the_end(nodes: Iterable[Node]) -> list[Node]:
    """The nodes whose last loss is the run's final one: those that left at its furthest outer step (its furthest
    step without DiLoCo). A node drained long before the end is not one (its old loss moved the mean 2.0 -> 4.5)."""
    left = [n for n in nodes if n.state is NodeState.LEFT and n.loss is not None]
    if any(n.outer_step is not None for n in left):  # time rounds too: each node counts its own steps
        top = max(n.outer_step for n in left if n.outer_step is not None)
        return [n for n in left if n.outer_step == top]
    last = max((n.step for n in left if n.step is not None), default=None)
    return [n for n in left if n.step == last]


def _excerpt(line: str | bytes, limit: int = 120) -> str:
    """A malformed line as the log shows it: a user's stray print should be recognisable, not flood the pane."""
    text = (line.decode("utf-8", "replace") if isinstance(line, bytes) else line).strip()
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def _eta(points: deque | None, last: int | None) -> float | None:
    """Seconds left to `last` at the furthest node's recent pace: its last _STEP_WINDOW (ts, step) points (outer
    steps with time rounds)."""
    if points is None or last is None or len(points) < 2:
        return None
    (t0, s0), (t1, s1) = points[0], points[-1]
    if s1 <= s0 or t1 <= t0:
        return None
    return max(0.0, (last - s1) * (t1 - t0) / (s1 - s0))


def compile_text(event: dict[str, Any]) -> str | None:
    """What the node's detail says of train.compile from a "training" state event (fields optional: None)."""
    seconds = event.get("compile_s")
    if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
        return f"compiled in {seconds:.0f} s (the first step)" if event.get("compiled", True) else \
            f"failed to compile in {seconds:.0f} s: eager (its warning says why)"
    return "compiling (the first step; a minute or more on a GPU)" if event.get("compiling") is True else None
