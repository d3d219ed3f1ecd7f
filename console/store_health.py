"""The membership store as the console sees it: its process's state, and the probe's samples beside it. No I/O.

    fleet.store.set("up", None, pid=77)          # a fact the console knows (console/tcp_store.py's watcher)
    fleet.store.ingest(line)                     # a line of the store's or its probe's events (ready, samples)
    fleet.store.check_samples(limit)             # no new sample for `limit` seconds: up, but it does not answer

The fleet owns one (`fleet.store`), with its clock and its timeline: a change of state goes on the timeline, and
`changes` moves with every change, so the fleet's `version` (what the dashboard redraws on) includes the store's.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from console.nodes import MembershipEvent
from engine.telemetry import BadEvent, parse_line

NO_SAMPLE = "no new health sample"  # the store's reason while its probe's samples stay old


class StoreHealth:
    """The store's process and the probe beside it (engine/store/probe.py)."""

    def __init__(self, clock: Callable[[], float] = time.time,
                 record: Callable[[MembershipEvent], None] = lambda event: None):
        self.address: str | None = None  # host:port the engines dial
        self.bind: str | None = None  # what it listens on, when that differs from the address
        self.state = "off"  # off, starting, up, down, restarting, stopped
        self.reason: str | None = None  # why it is down; what the console is doing about it
        self.rtt_ms: float | None = None  # one store round trip, measured on its host
        self.keys: int | None = None
        self.last_ts: float | None = None  # the probe's clock at its latest sample
        self.sampled_at: float | None = None  # the console's clock when that sample was new (a stale one flags it)
        self.restarts = 0  # restarts done by the console in this session
        self.pid: int | None = None
        self.changes = 0  # bumped on every change (the fleet's version counts it)
        self._clock = clock
        self._record = record

    def set(self, state: str, reason: str | None = None, **facts: Any) -> None:
        """A fact about the store process (starting, up, down, restarting, stopped); changes go on the timeline."""
        for key, value in facts.items():
            if not hasattr(self, key) or key.startswith("_"):
                raise AttributeError(f"the store has no fact {key!r}")
            setattr(self, key, value)
        if state != self.state:
            self._record(MembershipEvent(self._clock(), state, "store", None, (), "console", reason))
            if state in ("down", "stopped", "off"):
                self.rtt_ms = self.keys = None  # a gone store has no current figures
        self.state, self.reason = state, reason
        self.changes += 1

    def say(self, reason: str | None) -> None:
        """A reason beside the state (a probe that could not start), the state unchanged."""
        self.reason = reason
        self.changes += 1

    def ingest(self, line: str | bytes) -> None:
        """One line of the store's or its probe's event stream: ready/stopped states, probe samples, warnings."""
        try:
            event = parse_line(line)
        except BadEvent:
            return  # the store's own stream has no reader to tell; its log keeps the line
        kind = event["type"]
        if kind == "heartbeat" and self.state == "up":
            if event["ts"] == self.last_ts:
                return  # the same sample read again: nothing to redraw
            rtt, keys = event.get("rtt_ms"), event.get("keys")
            self.rtt_ms = float(rtt) if isinstance(rtt, (int, float)) else None
            self.keys = int(keys) if isinstance(keys, int) else None
            self.last_ts, self.sampled_at = event["ts"], self._clock()
            if self.reason and self.reason.startswith(NO_SAMPLE):
                self.reason = None  # it answers again
            self.changes += 1
        elif kind == "state" and event["state"] == "ready":
            self.set("up", None, pid=event.get("pid", self.pid))
        elif kind == "warning" and self.state == "up":
            self.say(event["message"])  # the probe could not reach it this time

    def check_samples(self, limit: float) -> None:
        """A store whose probe wrote no new sample for `limit` seconds (its own clock) is up but does not answer:
        hung, stopped (SIGSTOP), swapping. The header showed its last figures as current."""
        if self.state != "up" or self.sampled_at is None:
            return
        age = self._clock() - self.sampled_at
        if age > limit and not (self.reason or "").startswith(NO_SAMPLE):
            self.say(f"{NO_SAMPLE} for {age:.0f}s: it does not answer its probe (hung? overloaded?)")
