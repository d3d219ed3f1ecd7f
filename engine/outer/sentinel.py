"""The poisoned-update sentinel: before the mean is taken, a contributor whose pseudo-gradient is far larger than
the others' or points against them is left out of that outer step, like a node whose round diverged.

A diverged round (NaN) is caught by its own node. A finite but wrong pseudo-gradient (a bug, bad data, a flipped
sign, a x100 scale, a compromised host) would poison every member's weights. So every member puts a small row on
the wire first, one all_gather over the outer step's group:

    [weight, squared norm, a fixed strided sample of SAMPLE coordinates]      (fp64: 8 * (SAMPLE + 2) bytes)

The weight is the tokens of the member's round, its weight in the mean (0: it does not contribute); every member
gets every row. (Engines before the weight was the tokens sent 1.0 for every contributor and judged raw norms: a
run's engines must be of one version, as for the mean's own wire.) Every member computes the same verdict from the
same rows (`outliers`, pure), so a contributor is left out on every member or on none. It is left out when

    norm / weight > diloco.sentinel_ratio x the median of the others'        (a scale gone wrong)
    cos(its sample, the others' mean direction) < diloco.sentinel_min_cosine  (it points against them;
                                                                               needs 2 others or more)

The norm is judged per token: a round's norm grows with its steps, and with time rounds (diloco.round = "time") a
host 10x faster trains 10x the steps. On the debug model with AdamW at the defaults the norm grew as steps^0.95
over rounds of 1 to 5 steps and as steps^0.7-0.8 over 5 to 400; per token, a faster host reads a little smaller
and a slower one a little larger (at steps^0.75 a x100 speed gap reads x3.2), so an error leaves out the node
with fewer tokens, not the one with more.

The direction is judged on unit-length samples (every contributor's direction counts once, whatever its norm or
tokens), among the contributors the scale rule kept, worst first and one at a time: the one whose cosine with the
sum of the others' is lowest is left out when it is under the bound, and then is no yardstick for the rest. (With
the plain mean of all others, one large sign-flipped row dragged it against every legitimate node, and a -2x node
among three left out all three: the mean then had nothing to average and every node exited.)

The verdict never leaves out every contributor: where it would (diloco.sentinel_ratio under 1, or the local ranks
of a node of several each left out another node's shards), it leaves out none, with a warning; only a norm beyond
fp32's range stays out even then, since it would make every member's weights inf. A node left out sends weight 0,
is named in a warning and in the outer_step event (left_out), and takes the run's weights at the commit with fresh
optimizer state. With one other contributor only the scale can be judged (two nodes that disagree cannot tell who
is wrong). diloco.sentinel_ratio = 0 turns the check off.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.outer.buffers import norm
from engine.outer.local import LocalRanks

SAMPLE = 1024


def row(pgrad: torch.Tensor, weight: float) -> torch.Tensor:
    """This member's row: its weight (its round's tokens), the squared norm of its pseudo-gradient and a strided
    sample (the row in fp64). The norm is taken in the tensor's own fp32, one pass (an fp64 norm converts every
    element first: 65 ms of a 15m model's outer step on one core, against 6 ms); squared in fp64, so only a norm
    beyond fp32's range, which no sane pseudo-gradient has, reads as inf, and an inf is left out like any non-finite
    norm."""
    n = pgrad.numel()
    sample = pgrad[::max(1, n // SAMPLE)][:SAMPLE].detach().to("cpu", torch.float64)
    out = torch.zeros(SAMPLE + 2, dtype=torch.float64)
    out[0] = weight
    out[1] = norm(pgrad) ** 2 if weight > 0 else 0.0  # the finiteness check's pass, remembered (buffers.norm)
    out[2:2 + sample.numel()] = sample
    return out


def gather(pg: dist.ProcessGroup, mine: torch.Tensor, size: int) -> torch.Tensor:
    """Every member's row, in group-rank order (one small all_gather)."""
    rows = torch.empty(size, mine.numel(), dtype=mine.dtype)
    pg.allgather([[rows[i] for i in range(size)]], [mine]).wait()
    return rows


def outliers(rows: torch.Tensor, ratio: float, min_cosine: float) -> list[int]:
    """The group ranks of the contributors the two rules leave out (the same on every member: a pure function of
    rows). Sentinel.screen then makes sure that not every contributor is (see the top)."""
    active = [i for i in range(rows.shape[0]) if rows[i, 0] > 0]
    if ratio <= 0 or len(active) < 2:
        return []
    per_token = {i: math.sqrt(float(rows[i, 1])) / float(rows[i, 0]) for i in active}  # a square: never below 0
    broken = [i for i in active if not math.isfinite(per_token[i])]
    finite = [i for i in active if i not in broken]
    big = []
    for i in finite:
        others = [per_token[j] for j in finite if j != i]
        median = statistics.median(others) if others else 0.0
        if median > 0 and per_token[i] > ratio * median:
            big.append(i)
    return sorted(broken + big + against(rows, [i for i in finite if i not in big], min_cosine))


def against(rows: torch.Tensor, kept: list[int], min_cosine: float) -> list[int]:
    """Of the kept contributors, those whose direction points against the others' (see the top), worst first."""
    samples = rows[kept, 2:]
    unit = samples / samples.norm(dim=1, keepdim=True).clamp(min=torch.finfo(samples.dtype).tiny)
    pool, out = list(range(len(kept))), []
    while len(pool) >= 3:  # two others at least: two nodes that disagree cannot tell who is wrong
        others = unit[pool].sum(0) - unit[pool]
        cos = torch.nn.functional.cosine_similarity(unit[pool], others, dim=1).tolist()
        worst = min(range(len(pool)), key=lambda k: (cos[k], k))
        if not cos[worst] < min_cosine:
            break
        out.append(kept[pool.pop(worst)])
    return out


class Sentinel:
    def __init__(self, ratio: float, min_cosine: float, local: LocalRanks, emit: Callable[..., Any]):
        self.ratio, self.min_cosine, self.local, self.emit = ratio, min_cosine, local, emit

    def screen(self, plan: Any, group: dist.ProcessGroup | None, pgrad: torch.Tensor | None, weight: float,
               zeros: torch.Tensor) -> list[str]:
        """The members to leave out of this outer step, the same on every member. Every member takes part where
        the plan has two contributors or more (the plan is the same everywhere); weight: the tokens pgrad stands
        for, its weight in the mean; pgrad None: this member does not contribute (zeros: a free buffer it may
        zero)."""
        if group is None or self.ratio <= 0 or len(plan.contributors) < 2:
            return []
        mine = row(pgrad, weight) if pgrad is not None else row(zeros.zero_(), 0.0)
        rows = gather(group, mine, plan.size)
        flagged = outliers(rows, self.ratio, self.min_cosine)
        size = plan.size
        beyond = [not math.isfinite(float(rows[i, 1])) for i in range(size)]  # a norm past fp32's range
        # each local rank judged its own shards: a node is left out where any of its shards was (one collective)
        judged = self.local.any_of([i in flagged for i in range(size)] + beyond)
        bad, beyond = judged[:size], judged[size:]
        counted = [i for i in range(size) if rows[i, 0] > 0]
        if all(bad[i] for i in counted) and not all(beyond[i] for i in counted):
            # the mean needs one, and the rules cannot tell who is wrong (see the top); only an inf norm stays out
            bad = beyond
            self.emit("warning", message=f"outer step {plan.outer_step}: the sentinel would have left every "
                                         f"contributor out of the mean (diloco.sentinel_ratio under 1, or local "
                                         f"ranks that each judged another node's shards): it leaves out none but a "
                                         f"norm beyond fp32's range")
        out = [m for m, b in zip(plan.members, bad) if b]
        if out:
            self.emit("warning", message=f"outer step {plan.outer_step}: left out of the mean by the sentinel: "
                                         f"{', '.join(out)} (pseudo-gradient per token over diloco.sentinel_ratio x "
                                         f"the others' median, or against their direction); they take the run's "
                                         f"weights")
        return out
