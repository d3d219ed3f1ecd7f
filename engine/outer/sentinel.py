"""The poisoned-update sentinel: before the mean is taken, a contributor whose pseudo-gradient is far larger than
the others' or points against them is left out of that outer step, like a node whose round diverged.

A diverged round (NaN) is caught by its own node. A finite but wrong pseudo-gradient (a bug, bad data, a flipped
sign, a x100 scale, a compromised host) would poison every member's weights. So every member puts a small row on
the wire first, one all_gather over the outer step's group:

    [weight, squared norm, a fixed strided sample of SAMPLE coordinates]      (4 * (SAMPLE + 2) bytes)

and every member computes the same verdict from the same rows (`outliers`, pure): a contributor is left out when

    norm > diloco.sentinel_ratio x the median norm of the other contributors          (a scale gone wrong)
    cos(its sample, the mean of the others' samples) < diloco.sentinel_min_cosine      (it points against them;
                                                                                         needs 2 others or more)

A node left out sends weight 0, is named in a warning and in the outer_step event (left_out), and takes the run's
weights at the commit with fresh optimizer state. With one other contributor only the scale can be judged (two
nodes that disagree cannot tell who is wrong). diloco.sentinel_ratio = 0 turns the check off.
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
    """This member's row: its weight, the squared norm of its pseudo-gradient and a strided sample (the row in fp64).
    The norm is taken in the tensor's own fp32, one pass (an fp64 norm converts every element first: 65 ms of a
    15m model's outer step on one core, against 6 ms); squared in fp64, so only a norm beyond fp32's range, which
    no sane pseudo-gradient has, reads as inf, and an inf is left out like any non-finite norm."""
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
    """The group ranks of the contributors to leave out (the same on every member: a pure function of rows)."""
    active = [i for i in range(rows.shape[0]) if rows[i, 0] > 0]
    if ratio <= 0 or len(active) < 2:
        return []
    norms = rows[:, 1].clamp(min=0).sqrt()
    out = []
    for i in active:
        others = [j for j in active if j != i]
        median = statistics.median(norms[others].tolist())
        if not math.isfinite(float(norms[i])) or (median > 0 and float(norms[i]) > ratio * median):
            out.append(i)
            continue
        if len(others) >= 2:
            cos = torch.nn.functional.cosine_similarity(rows[i, 2:], rows[others, 2:].mean(0), dim=0)
            if float(cos) < min_cosine:
                out.append(i)
    return out


class Sentinel:
    def __init__(self, ratio: float, min_cosine: float, local: LocalRanks, emit: Callable[..., Any]):
        self.ratio, self.min_cosine, self.local, self.emit = ratio, min_cosine, local, emit

    def screen(self, plan: Any, group: dist.ProcessGroup | None, pgrad: torch.Tensor | None,
               zeros: torch.Tensor) -> list[str]:
        """The members to leave out of this outer step, the same on every member. Every member takes part where
        the plan has two contributors or more (the plan is the same everywhere); pgrad None: this member does not
        contribute (zeros: a free buffer it may zero)."""
        if group is None or self.ratio <= 0 or len(plan.contributors) < 2:
            return []
        weight = 1.0 if pgrad is not None else 0.0
        rows = gather(group, row(pgrad if pgrad is not None else zeros.zero_(), weight), plan.size)
        flagged = outliers(rows, self.ratio, self.min_cosine)
        # each local rank judged its own shards: a node is left out where any of its shards was
        judged = self.local.any_of([i in flagged for i in range(plan.size)])
        out = [m for m, bad in zip(plan.members, judged) if bad]
        if out:
            self.emit("warning", message=f"outer step {plan.outer_step}: left out of the mean by the sentinel: "
                                         f"{', '.join(out)} (pseudo-gradient over diloco.sentinel_ratio x the "
                                         f"others' median norm, or against their direction); they take the run's "
                                         f"weights")
        return out

