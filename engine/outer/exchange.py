"""The exchange, a part of the outer loop: one member's part of an attempt's collective. The sentinel's screen, then
the weighted mean into bufs.mean, with the codec's bytes on the wire: reduced (allreduce.weighted_mean) or, for a
codec that gathers (codec.py), all-gathered and decoded on every rank (the codec's mean(): gather.py for sparse).

Nothing of the node's state (parameters, momentum, snapshot, a codec's state) changes here: only the mean buffer
and the wire buffers are written, so an attempt that aborts leaves everything as it was and the same
pseudo-gradient is sent again (the outer step's story retries it, at most diloco.max_attempts times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.errors import first_line
from engine.mesh.protocol import MeshError
from engine.outer import allreduce
from engine.outer.codec import Codec, GatheredCodec
from engine.outer.groups import GROUP_ERRORS, MeshLinks, PeerLost
from engine.outer.sentinel import Sentinel
from engine.outer.timing import Stopwatch


@dataclass
class Exchanged:
    stats: allreduce.ReduceStats | None  # None: the collective failed (reason says why)
    left_out: list[str] = field(default_factory=list)  # members the sentinel left out of this mean
    reason: str = ""


def exchange(plan: Any, pgrad: torch.Tensor | None, weight: float, *, node_id: str, links: MeshLinks,
             sentinel: Sentinel, bufs: Any, codec: Codec, judged: torch.Tensor | None = None) -> Exchanged:
    """A contributor sends pgrad with its weight; a joiner, a diverged node and one the sentinel leaves out send
    zeros with weight 0 (out of the mean buffer: pgrad stays intact for a retry that counts it). A failed collective
    is reported, not raised (the attempt aborts at the commit); allreduce.NothingToAverage is raised.

    The buffers are this attempt's, taken before the collective starts: an abandoned attempt's thread goes on (gloo
    cannot cancel a collective) and must write into them, never into the fresh ones renew_scratch gives the next
    attempt. (Read inside run(), a thread given up in the sentinel's gather read bufs.mean only when it went on to
    the mean, after the renewal, and wrote its old mean into an outer step in progress: the seed-44 soak.)
    judged: what the sentinel judges in pgrad's place (the node's own progress, landing.judged), in the mean buffer
    until the collective overwrites it."""
    mean, wire = bufs.mean, bufs.exchange

    def run() -> Exchanged:
        w = weight
        mine = judged if judged is not None else pgrad
        left_out = sentinel.screen(plan, group, mine if w else None, w, mean)  # w: the sentinel judges per token
        if node_id in left_out:
            w = 0.0
        send = pgrad if w and pgrad is not None else mean.zero_()
        if codec.gathers:
            assert isinstance(codec, GatheredCodec), f"codec {codec.name!r} gathers but has no mean()"
            return Exchanged(codec.mean(send, w, group, out=mean, wire=wire), left_out)
        _, stats = allreduce.weighted_mean(send, w, group, codec.name, out=mean, exchange=wire)
        return Exchanged(stats, left_out)
    try:
        group = links.group(plan)
        return links.bounded(plan, "all-reduce", run)
    except GROUP_ERRORS as e:
        links.failed(plan, e)  # a group whose collective failed is never reused
        if isinstance(e, PeerLost):
            bufs.renew_scratch()  # the abandoned collective's thread may still write into the mean and wire buffers
        return Exchanged(None, reason=first_line(e, 300))


@dataclass
class Agreed:
    """An attempt's exchange as the node's local ranks agree on it."""
    stats: allreduce.ReduceStats | None
    reason: str  # why the collective failed ("" when it did not)
    left_out: list[str]  # members the sentinel left out
    ok: bool  # every local rank's collective succeeded
    nbytes: int  # bytes the node's local ranks sent
    sq: float  # the mean's squared norm, over the node's local ranks
    fp32_bytes: int = 0  # what the node's local ranks would have sent for this mean with compression "none"


class MeanExchange:
    """The exchange part: one attempt's collective over the plan's group (exchange()), with the codec's bytes on
    the wire, and what the node's local ranks agree of it (local.stats: ok, bytes, the mean's norm)."""

    def __init__(self, links: MeshLinks, sentinel: Sentinel, codec: Codec, watch: Stopwatch):
        self.links, self.sentinel, self.codec, self.watch = links, sentinel, codec, watch

    def attempt(self, plan: Any, pgrad: torch.Tensor | None, weight: float, bufs: Any, *,
                judged: torch.Tensor | None = None) -> Agreed:
        """The mean into bufs.mean. A mean of finite pseudo-gradients that is not finite is a MeshError, raised on
        every member alike (the same bits everywhere) before its vote; NothingToAverage is raised."""
        out = exchange(plan, pgrad, weight, node_id=self.links.node_id, links=self.links, sentinel=self.sentinel,
                       bufs=bufs, codec=self.codec, judged=judged)
        with self.watch.phase("norm"):
            sq = float(torch.linalg.vector_norm(bufs.mean)) ** 2 if out.stats is not None else 0.0
        ok, nbytes, sq = self.links.local.stats(out.stats is not None, out.stats.bytes_sent if out.stats else 0, sq)
        # the same mean in fp32 (allreduce.py's ring), the yardstick of the codec's bytes (docs/telemetry.md)
        fp32 = allreduce.bytes_sent(bufs.mean.numel(), plan.size, "none") if out.stats is not None else 0
        fp32 = int(self.links.local.sums([float(fp32)])[0])
        if ok and not math.isfinite(sq):
            # every contributor's pseudo-gradient was finite, yet the mean is not: a value beyond the codec's range
            # (fp16: 65504); a commit would have put inf into every member's snapshot
            raise MeshError(f"outer step {plan.outer_step}: the mean of finite pseudo-gradients is not finite: a "
                            f"value beyond diloco.compression = {self.codec.name!r}'s range (fp16 ends at "
                            f"65504); use \"bf16\" or \"int8\" (scaled per chunk), then resume")
        return Agreed(out.stats, out.reason, out.left_out, ok, nbytes, sq, fp32)
