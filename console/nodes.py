"""The cluster model's parts (console/fleet.py puts them together and feeds them events): a node's state and its
recent history, an outer round, the header's summary. Plain data, no I/O (the store's health, with its rules, is
console/store_health.py).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, MutableSequence, SupportsIndex, overload

from engine.states import NodeState
from engine.telemetry import format_human

HISTORY = 512  # points per node in the loss / tokens-per-second charts
LOG_LINES = 500  # human-readable lines kept per node
_STEP_WINDOW = 32  # (ts, step) points per node used for the ETA
CHECKPOINTS = 5  # per node, for the detail view
STALE_STEP_S = 30.0  # a node's tokens/s is no current figure once no step came for this long (or 4 intervals)


class HostState(str, Enum):
    """What the console shows of a host that is no node of the mesh right now: words of the console alone. The
    node states (the mesh's and the events': starting, joining, training, draining, standby, left, dead) are
    engine/states.py's NodeState; no word is in both (tests/test_states.py)."""

    SPARE = "spare"  # in the profile with `standby = true`: ready to be added, nothing running
    OFF = "off"  # a host of the run with nothing running: not started (yet), or found so at attach
    UNREACHABLE = "unreachable"  # the console cannot reach the host; the engine may well still run
    FAILED = "failed"  # its process could not start or ended with an error (run_end failed, a non-zero exit)

    def __str__(self) -> str:
        return self.value


Shown = NodeState | HostState  # what a node's row says: a node state, or the console's word for its host
SHOWN_STATES: tuple[Shown, ...] = (*NodeState, *HostState)


def shown(value: str) -> Shown:
    """The state a word names, from either set (ValueError for a word of neither)."""
    for kind in (NodeState, HostState):
        try:
            return kind(value)
        except ValueError:
            pass
    raise ValueError(f"{value!r} is neither a node state ({', '.join(NodeState)}) nor a host state "
                     f"({', '.join(HostState)})")


class LazyLine:
    """A log line formatted only when someone reads it: formatting every step event would halve ingest speed."""

    __slots__ = ("event",)

    def __init__(self, event: dict[str, Any]):
        self.event = event

    def __str__(self) -> str:
        return format_human(self.event) or ""


class LogBuffer(deque[Any]):
    """A bounded deque of log lines that hands out plain strings (engine events are formatted on read)."""

    def __iter__(self) -> Iterator[str]:
        return (str(line) for line in deque.__iter__(self))

    @overload
    def __getitem__(self, index: SupportsIndex) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> MutableSequence[Any]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> str | MutableSequence[Any]:
        if isinstance(index, slice):  # as a deque: Sequence's signature allows a slice, a deque does not
            raise TypeError("sequence index must be integer, not 'slice'")
        return str(deque.__getitem__(self, index))


@dataclass
class Device:
    """One device's latest sample: a GPU (NVML, one per GPU of the node) or a rank's CPU share (psutil)."""

    key: str  # "gpu 3" (its NVML index) or "cpu r1" (the rank that sampled it)
    kind: str  # gpu or cpu
    util: float
    mem_used: int
    mem_total: int
    temp_c: float | None = None
    power_w: float | None = None
    ts: float = 0.0


@dataclass
class RankFigures:
    """What one rank of the node last said about its inner steps (rank > 0 speaks with telemetry.all_ranks)."""

    rank: int
    step: int
    tokens_per_s: float
    loss: float
    ts: float


@dataclass
class OuterRound:
    """One DiLoCo outer step as the cluster lived it: each time the largest any reporting node gave (compute from
    one node and the all-reduce from another: each part's worst case, not one node's round), all nodes' bytes.

    compute_s comes from the engine when it reports it, else from the node's clock: the time since its previous
    outer step less this one's all-reduce (`derived` says which). idle_s (waiting for peers, for the plan) needs
    the engine's outer_s; wire_s and codec_s split allreduce_s when the engine reports them."""

    outer_step: int
    ts: float
    members: int
    bytes_sent: int = 0
    # what the same exchanges would have sent uncompressed, summed over the reporters that said (fp32_reporters)
    fp32_bytes: int = 0
    fp32_reporters: int = 0
    allreduce_s: float = 0.0
    compute_s: float | None = None
    wire_s: float | None = None
    codec_s: float | None = None
    idle_s: float | None = None
    derived: bool = False
    reporters: int = 0
    # each contributor's share of the mean: the tokens it trained this round over the round's total (engines
    # weigh by tokens: with time rounds a fast host's share is larger; a joiner or a diverged node has none)
    shares: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class Node:
    name: str
    host: str
    state: Shown = HostState.SPARE
    reason: str | None = None
    device: str | None = None  # "gpu" (NVML) or "cpu" (psutil); None until the first resource sample
    util: float | None = None  # percent
    mem_used: int | None = None  # bytes
    mem_total: int | None = None
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    outer_step: int | None = None
    round_tokens: float | None = None  # the tokens its last round counted for in the mean (0: not counted)
    round_share: float | None = None  # ... and their share of that outer step's total
    # diloco.compression = "sparse": the error-feedback accumulator's norm against the agreed weights', after each
    # outer step (residual_history keeps the last few, to say whether it grows)
    residual_ratio: float | None = None
    residual_history: deque = field(default_factory=lambda: deque(maxlen=8))
    # train.compile: "compiling" while the first step compiles, then "compiled in N s" or "eager (...)"
    compile: str | None = None
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
    engine_state: Shown | None = None
    # set while `state` is DEAD only on the mesh's word: the reporter's ts; a later own event that overrules it
    # (_OVERRULES_DEAD) clears it
    mesh_dead_ts: float | None = None
    engine_reason: str | None = None  # the reason that came with engine_state (run_end's status...)
    # this process said how it ended (run_end): only that is final. `drained` or `state left` is not: the process
    # still writes its last checkpoint, and may die doing it (the watcher's exit status then decides)
    run_ended: bool = False
    # the first `error` of this process: the cause, which run_end "failed" shows (a later error is its aftermath:
    # "checkpoint before exit failed"); kept apart from `reason`, which the `state left` before run_end resets
    error: str | None = None
    devices: dict[str, Device] = field(default_factory=dict)  # every GPU (or rank's CPU) of the node
    ranks: dict[int, RankFigures] = field(default_factory=dict)
    run_info: dict[str, Any] = field(default_factory=dict)  # run_start: digest, strategy, world size, dataset...
    command: str | None = None  # the command line the console started it with
    overrides: dict[str, Any] = field(default_factory=dict)  # the engine overrides it was given
    tokens: int | None = None  # tokens this node has trained on
    epoch: float | None = None  # fraction of its data shard consumed (engines that report it)
    checkpoints: deque = field(default_factory=lambda: deque(maxlen=CHECKPOINTS))  # (step, path, seconds)
    _steps: deque = field(default_factory=lambda: deque(maxlen=_STEP_WINDOW), repr=False)
    _outer_steps: deque = field(default_factory=lambda: deque(maxlen=_STEP_WINDOW), repr=False)  # (ts, outer step)
    _step_seen: float | None = field(default=None, repr=False)  # the console's clock when its latest step came
    _own_ts: float | None = field(default=None, repr=False)  # its newest event's ts (files replay out of order)
    _proof_ts: float | None = field(default=None, repr=False)  # ... of those that overrule a mesh "dead" report
    _outer_ts: float | None = field(default=None, repr=False)  # its previous outer step, by its own clock

    @property
    def tokens_per_s_now(self) -> float | None:
        """The node's latest throughput while it is current: None once no step came for four times its recent
        interval between step events, and at least STALE_STEP_S. A node held at a boundary (a lost store, a
        straggler, a re-formation) still beats and samples its resources, and its last figure was summed into the
        cluster's tokens/s as if it trained."""
        if self.tokens_per_s is None or not self._steps or self._step_seen is None:
            return self.tokens_per_s
        (t0, _), (t1, _) = self._steps[0], self._steps[-1]
        interval = (t1 - t0) / (len(self._steps) - 1) if len(self._steps) > 1 else 0.0
        # by the console's clock (when the step arrived), not the engine's: a host's clock may be off by more
        return self.tokens_per_s if time.time() - self._step_seen <= max(STALE_STEP_S, 4 * interval) else None

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
    loss: float | None  # mean of the active nodes' latest loss; once the run ended, of those left at its end
    eta_s: float | None
    step: int | None  # the furthest node's step
    max_steps: int | None
    store: str | None = None  # the store's health where it is known (etcd: "etcd 3/3 up, leader node-a")
    rounds: int | None = None  # time rounds: the run's length in outer steps (max_steps is then no node's end)
    ended: str | None = None  # once no node of the run runs: "completed", "stopped" or "failed" (console/exit_codes.py)
