"""The cluster's outer rounds, folded from each node's `outer_step` reports: the chart's bars and the headless lines.

    fold_round(fleet.outer_rounds, node, event)  # one node's report of outer step N, into round N (slowest node's)

A round keeps the slowest node's times (compute, wire, codec, idle), the members and the bytes sent. Rounds are
kept in outer-step order, at most OUTER_ROUNDS of them. Pure: no I/O; the fleet owns the dict.
"""

from __future__ import annotations

from typing import Any

from console.nodes import Node, OuterRound

OUTER_ROUNDS = 240  # outer steps kept for the chart and the headless line


def fold_round(rounds: dict[int, OuterRound], node: Node, event: dict[str, Any]) -> None:
    """Fold one node's report of an outer step into the cluster's round (the slowest node's times)."""
    number, ts = event["outer_step"], event["ts"]
    rnd = rounds.get(number)
    if rnd is None:
        rnd = _new_round(rounds, number, ts, len(event["members"]))
        if rnd is None:
            node._outer_ts = ts
            return
    allreduce = float(event["allreduce_s"])
    rnd.reporters += 1
    rnd.members = max(rnd.members, len(event["members"]))
    rnd.bytes_sent += event["bytes_sent"]
    if isinstance(event.get("fp32_bytes"), int):
        rnd.fp32_bytes += event["fp32_bytes"]
        rnd.fp32_reporters += 1
    rnd.shares = shares(event) or rnd.shares
    rnd.allreduce_s = max(rnd.allreduce_s, allreduce)
    compute = num(event.get("compute_s"))
    if compute is None and node._outer_ts is not None:  # today's engines: the node's own clock
        compute, rnd.derived = max(0.0, ts - node._outer_ts - allreduce), True
    if compute is not None:
        rnd.compute_s = max(rnd.compute_s or 0.0, compute)
    wire, codec, outer = num(event.get("wire_s")), num(event.get("codec_s")), num(event.get("outer_s"))
    if wire is not None:
        rnd.wire_s = max(rnd.wire_s or 0.0, wire)
    if codec is not None:
        rnd.codec_s = max(rnd.codec_s or 0.0, codec)
    if outer is not None:
        idle = max(0.0, outer - (wire if wire is not None else allreduce) - (codec or 0.0))
        rnd.idle_s = max(rnd.idle_s or 0.0, idle)
    node._outer_ts = ts


def _new_round(rounds: dict[int, OuterRound], number: int, ts: float, members: int) -> OuterRound | None:
    """A round for an outer step not seen yet, kept in outer-step order (the chart and the headless lines read
    it so); beyond OUTER_ROUNDS the lowest step goes. None for a step older than every kept one: --attach reads
    one node's file, then the next, whose early reports would otherwise evict good rounds for rounds of one."""
    if len(rounds) >= OUTER_ROUNDS and number < next(iter(rounds)):
        return None
    in_order = not rounds or number > next(reversed(rounds))
    rnd = rounds[number] = OuterRound(number, ts, members)
    if not in_order:  # a file replayed after a longer one (a late joiner's steps come first): sorted in place
        ordered = sorted(rounds.items())
        rounds.clear()
        rounds.update(ordered)
    while len(rounds) > OUTER_ROUNDS:
        del rounds[next(iter(rounds))]
    return rnd


def shares(event: dict[str, Any]) -> dict[str, float] | None:
    """{contributor: its share of the mean} from an outer_step event's weights (the tokens of each round), or None
    for an engine that does not report them."""
    names, weights = event.get("contributors"), event.get("weights")
    if not isinstance(names, list) or not isinstance(weights, list) or len(names) != len(weights):
        return None
    total = sum(float(w) for w in weights)
    return {str(n): float(w) / total for n, w in zip(names, weights)} if total > 0 else {}


def num(value: Any) -> float | None:
    """A number from an optional event field (a bool or a string is not one)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
