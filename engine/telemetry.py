"""The telemetry contract between the engine and the console: one JSON object per line.

This module is imported by the console, so it must never import torch (or anything heavy).

Every event carries the common fields

    v     schema version (SCHEMA_VERSION); a reader rejects lines of a newer major version
    type  one of EVENT_FIELDS
    ts    unix time (float, seconds) on the emitting host
    node  the node id (GLOBAL_UNIQUE_ID)
    rank  the process rank inside its node (torchrun's RANK); -1 for node-level processes (the store)

plus the fields listed for its type below. Extra fields are allowed (forward compatible); missing or
mistyped required fields make a line malformed. Add a field: keep SCHEMA_VERSION. Remove or retype one: bump it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Callable, Iterable, TextIO

from engine.states import EVENT_STATES, NodeState

SCHEMA_VERSION = 1

_num = (int, float)
_opt_num = (int, float, type(None))

# type -> {field: accepted python types}. The docs (docs/telemetry.md) list what each field means.
EVENT_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    # a training process started: identity and the shape of the run
    "run_start": {"pid": (int,), "host": (str,), "world_size": (int,), "config_digest": (str,),
                  "strategy": (str,), "max_steps": (int,)},
    # one optimizer step of the inner loop (logged every log_interval steps)
    # (loss and grad_norm are null when not finite: JSON has no NaN, and a diverged step must still be reported)
    "step": {"step": (int,), "loss": _opt_num, "lr": _num, "tokens_per_s": _num, "grad_norm": _opt_num},
    # held-out loss (null when not finite)
    "eval": {"step": (int,), "loss": _opt_num},
    # a checkpoint was committed (path is the finished folder)
    "checkpoint": {"step": (int,), "path": (str,), "seconds": _num},
    # final weights exported in transformers format
    "export": {"step": (int,), "path": (str,)},
    # resource sample: device is "gpu" (NVML) or "cpu" (psutil); util in percent; memory in bytes
    "resource": {"device": (str,), "util": _num, "mem_used": (int,), "mem_total": (int,)},
    # node lifecycle as the node itself sees it: one of NODE_STATES (engine/states.py says what each means); the
    # store's own lines (rank -1) say ready or stopped (STORE_STATES)
    "state": {"state": (str,)},
    # one DiLoCo outer step committed
    "outer_step": {"outer_step": (int,), "step": (int,), "generation": (int,), "members": (list,),
                   "pgrad_norm": _num, "bytes_sent": (int,), "allreduce_s": _num, "checksum": (str,)},
    # a membership change seen by this node: joined, drained, left, dead, leader
    "membership": {"change": (str,), "subject": (str,), "generation": (int,), "members": (list,)},
    # this node's heartbeat and its view of every peer's heartbeat age in seconds
    "heartbeat": {"seq": (int,), "peers": (dict,)},
    # the node finished draining: its last round was contributed and it is leaving
    "drained": {"outer_step": (int,), "step": (int,)},
    "warning": {"message": (str,)},
    "error": {"message": (str,)},
    # the process is about to exit; status is completed, drained, stopped or failed
    "run_end": {"status": (str,), "step": (int,)},
}

# fields added after SCHEMA_VERSION 1 shipped: checked when present, never required, so that a reader still takes
# the lines of an engine from before them (a console attached to an older run)
# (and facts that only some producers have: the store's own state lines, a GPU's index and temperature)
OPTIONAL_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "run_start": {"rounds": (int,), "run": (str,), "diloco": (bool,), "dataset": (str, type(None))},
    "state": {"step": (int,), "params": (int,), "device": (str,), "grad_accum": (int,), "resumed_from": (str,),
              "resumed_step": (int,), "host": (str,), "port": (int,), "pid": (int,),
              # train.compile: the first step compiles (compiling), then what it took (compile_s; compiled false:
              # the compiler failed and the run trains on eager)
              "compiling": (bool,), "compile_s": _num, "compiled": (bool,)},
    "step": {"tokens": (int,), "outer_step": (int,), "epoch": _opt_num},
    "resource": {"index": (int, str), "temp_c": _num, "power_w": _num},
    "heartbeat": {"keys": (int,), "rtt_ms": _num},
    "outer_step": {"wire_s": _num, "codec_s": _num, "compute_s": _num, "outer_s": _num, "contributors": (list,),
                   "weights": (list,), "left_out": (list,), "fragment": (int,), "fragments": (int,),
                   # what the same exchange would have sent uncompressed (compression "none"): the factor the
                   # console shows; with diloco.compression = "sparse", the norms of the node's error-feedback
                   # accumulator after the step and of the agreed weights it covers (a residual that keeps growing
                   # against the weights says the density is too low)
                   "fp32_bytes": (int,), "residual_norm": _num, "weights_norm": _num,
                   # with diloco.overlap or fragment_delay: whether this outer step ran in flight (false: it landed
                   # at its boundary, as the first diloco.overlap_after steps and a draining node's last do)
                   "overlapped": (bool,)},
}

NODE_STATES = tuple(s.value for s in NodeState if s in EVENT_STATES)  # a node's `state` event (rank >= 0)
STORE_STATES = ("ready", "stopped")  # the store's own `state` lines (node "store", rank -1): not node states
RUN_END_STATUSES = ("completed", "drained", "stopped", "failed")
MEMBERSHIP_CHANGES = ("joined", "drained", "left", "dead", "leader", "rejected")


class BadEvent(ValueError):
    """A line on an event stream that is not a valid event of this schema."""


def make_event(type_: str, node: str, rank: int, ts: float | None = None, **fields: Any) -> dict[str, Any]:
    """Build an event dict; raises BadEvent if a required field is missing or mistyped."""
    event = {"v": SCHEMA_VERSION, "type": type_, "ts": time.time() if ts is None else ts,
             "node": node, "rank": rank, **fields}
    validate(event)
    # what a node says of itself is a word of the one vocabulary (a reader takes any string: an older engine's)
    allowed = STORE_STATES if rank < 0 else NODE_STATES
    if type_ == "state" and fields["state"] not in allowed:
        raise BadEvent(f"state: {fields['state']!r} is not one of {', '.join(allowed)}")
    return event


def validate(event: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(event, dict):
        raise BadEvent("event is not a JSON object")
    version = event.get("v")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BadEvent("missing schema version 'v'")
    if version > SCHEMA_VERSION:
        raise BadEvent(f"schema version {version} is newer than this reader's {SCHEMA_VERSION}")
    type_ = event.get("type")
    spec = EVENT_FIELDS.get(type_)  # type: ignore[arg-type]
    if spec is None:
        raise BadEvent(f"unknown event type {type_!r}")
    if not isinstance(event.get("ts"), _num) or not isinstance(event.get("node"), str) \
            or not isinstance(event.get("rank"), int):
        raise BadEvent(f"{type_}: common fields ts/node/rank missing or mistyped")
    for name, types in spec.items():
        value = event.get(name, _MISSING)
        if value is _MISSING:
            raise BadEvent(f"{type_}: missing field {name!r}")
        if _mistyped(value, types):
            raise BadEvent(f"{type_}: field {name!r} has type {type(value).__name__}")
    for name, types in OPTIONAL_FIELDS.get(type_, {}).items():
        value = event.get(name, _MISSING)
        if value is not _MISSING and _mistyped(value, types):
            raise BadEvent(f"{type_}: field {name!r} has type {type(value).__name__}")
    return event


_MISSING = object()


def _mistyped(value: Any, types: tuple[type, ...]) -> bool:
    # bool is an int subclass; a bool where a number belongs is a producer bug
    return not isinstance(value, types) or (isinstance(value, bool) and bool not in types)


def encode(event: dict[str, Any]) -> str:
    return json.dumps(event, separators=(",", ":"), allow_nan=False, default=str)


def parse_line(line: str | bytes) -> dict[str, Any]:
    """Parse and validate one line of an event stream. Raises BadEvent for anything else."""
    try:
        event = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadEvent(f"not JSON: {e}") from None
    return validate(event)


def _loss_text(loss: float | None) -> str:
    return f"{loss:.4f}" if loss is not None else "not finite"


def _outer_times(event: dict[str, Any]) -> str:
    """An outer step's seconds: compute_s, outer_s, wire_s and codec_s are optional (an engine from before them, read
    by a console attached to its run), so each shows only when sent; the all-reduce (always sent) stands in for the
    outer step without outer_s, and for its split without wire_s and codec_s."""
    compute, outer, wire, codec = (event.get(k) for k in ("compute_s", "outer_s", "wire_s", "codec_s"))
    text = "" if compute is None else f" compute {compute:.2f}s"
    text += f" allreduce {event['allreduce_s']:.2f}s" if outer is None else f" outer {outer:.2f}s"
    if wire is not None and codec is not None:
        text += f" (wire {wire:.2f}s codec {codec:.2f}s)"
    elif outer is not None:
        text += f" (allreduce {event['allreduce_s']:.2f}s)"
    return text


def members_after(change: str, subject: str, members: Iterable[str]) -> int:
    """How many members a membership change leaves. `members` is the plan's: a node that left or drained is still
    in it (it contributed that round), where "dead" already leaves it out; "left node-0 -> 3 members" read as three
    staying when two did."""
    return sum(1 for m in members if not (change in ("left", "drained") and m == subject))


def format_human(event: dict[str, Any]) -> str | None:
    """The one-line progress text for a person watching stderr; None for events not worth a line."""
    t = event["type"]
    who = f"[{event['node']}:{event['rank']}]"
    if t == "step":
        gn = event["grad_norm"]
        gn_text = f" gnorm {gn:.3f}" if gn is not None else ""
        return (f"{who} step {event['step']:>6} loss {_loss_text(event['loss'])} lr {event['lr']:.2e}"
                f" {event['tokens_per_s']:,.0f} tok/s{gn_text}")
    if t == "eval":
        return f"{who} eval  step {event['step']:>6} loss {_loss_text(event['loss'])}"
    if t == "outer_step":
        return (f"{who} outer {event['outer_step']:>4} gen {event['generation']} members {len(event['members'])}"
                f" pgrad {event['pgrad_norm']:.4f}{_outer_times(event)} sum {event['checksum']}")
    if t == "membership":
        after = members_after(event["change"], event["subject"], event["members"])
        return f"{who} membership {event['change']} {event['subject']} -> {after} members"
    if t in ("checkpoint", "export"):
        return f"{who} {t} step {event['step']} -> {event['path']}"
    if t in ("warning", "error"):
        return f"{who} {t.upper()}: {event['message']}"
    if t == "run_start":
        return f"{who} start pid {event['pid']} on {event['host']} ({event['strategy']}, {event['max_steps']} steps)"
    if t == "run_end":
        return f"{who} end {event['status']} at step {event['step']}"
    if t == "state" and "resumed_from" in event:  # the one line that says a run continues a checkpoint
        step = event.get("resumed_step", event.get("step"))
        return f"{who} state {event['state']}, resumed from {event['resumed_from']} at step {step}"
    if t == "state" and "compile_s" in event:
        how = "compiled" if event.get("compiled", True) else "failed to compile, eager"
        return f"{who} state {event['state']}: the first step {how} in {event['compile_s']:.1f} s"
    if t == "state" and event.get("compiling"):
        return f"{who} state {event['state']}, compiling (the first step compiles the model)"
    if t in ("state", "drained"):
        return f"{who} {t} {event.get('state', '')}".rstrip()
    return None


class Telemetry:
    """Emits events to sinks: JSON lines on stdout (the contract), the lines for a person (human_out, human_sinks)
    and any other sinks (metrics). Setting `human` to False silences the lines for a person only: after a bad input
    the engine's one `error:` line says it all, and the closing events go to the JSON lines alone.

    Thread-safe: the heartbeat and resource threads emit alongside the training loop.
    """

    def __init__(self, node: str, rank: int, *, json_out: TextIO | None = None, human_out: TextIO | None = None,
                 enabled: bool = True, extra_sinks: Iterable[Callable[[dict[str, Any]], None]] = (),
                 human_sinks: Iterable[Callable[[dict[str, Any]], None]] = ()):
        self.node = node
        self.rank = rank
        self.enabled = enabled
        self.human = True
        self._json_out = json_out if json_out is not None else sys.stdout
        self._human_out = human_out
        self._human_sinks = list(human_sinks)
        self._sinks = list(extra_sinks)
        self._lock = threading.Lock()

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = make_event(type_, self.node, self.rank, **fields)
        if not self.enabled:
            return event
        line = encode(event)
        with self._lock:
            self._json_out.write(line + "\n")
            self._json_out.flush()
            if self._human_out is not None and self.human:
                text = format_human(event)
                if text is not None:
                    self._human_out.write(text + "\n")
                    self._human_out.flush()
            for sink in self._human_sinks if self.human else ():
                sink(event)
            for sink in self._sinks:
                sink(event)
        return event
