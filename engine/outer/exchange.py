"""One member's part of an outer step's exchange: the sentinel's screen, then the weighted mean, into bufs.mean.

Nothing of the node's state (parameters, momentum, snapshot) changes here: only the mean buffer is written, so an
attempt that aborts leaves everything as it was and the same pseudo-gradient is sent again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import first_line
from engine.outer import allreduce
from engine.outer.buffers import OuterBuffers
from engine.outer.groups import GROUP_ERRORS, MeshLinks, PeerLost
from engine.outer.sentinel import Sentinel


@dataclass
class Exchanged:
    stats: allreduce.ReduceStats | None  # None: the collective failed (reason says why)
    left_out: list[str] = field(default_factory=list)  # members the sentinel left out of this mean
    reason: str = ""


def exchange(plan: Any, pgrad: torch.Tensor | None, weight: float, *, node_id: str, links: MeshLinks,
             sentinel: Sentinel, bufs: OuterBuffers, compression: str) -> Exchanged:
    """A contributor sends pgrad with its weight; a joiner, a diverged node and one the sentinel leaves out send
    zeros with weight 0 (out of the mean buffer: pgrad stays intact for a retry that counts it). A failed collective
    is reported, not raised (the attempt aborts at the commit); allreduce.NothingToAverage is raised.

    The buffers are this attempt's, taken before the collective starts: an abandoned attempt's thread goes on (gloo
    cannot cancel a collective) and must write into them, never into the fresh ones renew_scratch gives the next
    attempt. (Read inside run(), a thread given up in the sentinel's gather read bufs.mean only when it went on to
    the mean, after the renewal, and wrote its old mean into an outer step in progress: the seed-44 soak.)"""
    mean, wire = bufs.mean, bufs.exchange

    def run() -> Exchanged:
        w = weight
        left_out = sentinel.screen(plan, group, pgrad if w else None, w, mean)  # w: the sentinel judges per token
        if node_id in left_out:
            w = 0.0
        send = pgrad if w else mean.zero_()
        _, stats = allreduce.weighted_mean(send, w, group, compression, out=mean, exchange=wire)
        return Exchanged(stats, left_out)
    try:
        group = links.group(plan)
        return links.bounded(plan, "all-reduce", run)
    except GROUP_ERRORS as e:
        links.failed(plan, e)  # a group whose collective failed is never reused
        if isinstance(e, PeerLost):
            bufs.renew_scratch()  # the abandoned collective's thread may still write into the mean and wire buffers
        return Exchanged(None, reason=first_line(e, 300))
