"""A node's local ranks taking every branch of the outer loop together.

Only local rank 0 talks to the mesh; it hands each answer (a Plan, a decision, or the error it raised) to the other
local ranks by a broadcast on the node's own group. A node of one process has no group: every call is a no-op.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.mesh.protocol import Excluded, MeshError, Reformed, Stopped


class LeaderFailed(MeshError):
    """Local rank 0's mesh call raised; every local rank raises this with its text."""

    node_wide = True  # every local rank has it: engine/train.py prints it once, from local rank 0


class LocalRanks:
    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None):
        assert size == 1 or group is not None, "a node of several processes needs its group"
        self.rank, self.size = rank, size
        self.group = group if size > 1 else None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, obj: Any) -> Any:
        """Local rank 0's obj on every local rank."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group_src=0, group=self.group)
        return box[0]

    def on_leader(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a mesh call on local rank 0; every local rank gets its result or raises its error (a stop, a
        re-formation and an exclusion as themselves, anything else as LeaderFailed)."""
        out: Any = None
        if self.leader:
            try:
                out = ("ok", fn())
            except Excluded as e:
                out = ("excluded", str(e), e)
            except Stopped as e:
                out = ("stopped", e.reason, e)
            except Reformed as e:
                out = ("reformed", str(e), e)
            except Exception as e:  # handed to the other ranks, then raised on every rank below
                out = ("error", f"{what}: {type(e).__name__}: {e}", e)
        shared = self.share(out if out is None or out[0] == "ok" else out[:2])
        if shared[0] == "ok":
            return shared[1]
        if self.leader:
            raise out[2]
        kind, text = shared
        if kind == "stopped":
            raise Stopped(text, what)
        raise {"excluded": Excluded, "reformed": Reformed}.get(kind, LeaderFailed)(text)

    def every_ok(self, ok: bool) -> bool:
        """True on every local rank when it is true on all of them."""
        return not self.any(not ok)

    def any(self, flag: bool) -> bool:
        """True on every local rank when it is true on one."""
        return self.any_of([flag])[0]

    def any_of(self, flags: list[bool]) -> list[bool]:
        """Each flag true on every local rank when it is true on one (one collective)."""
        if self.group is None or not flags:
            return list(flags)
        t = torch.tensor([int(f) for f in flags])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [bool(v) for v in t.tolist()]

    def every(self, error: str | None) -> list[str]:
        """Every local rank's error text (None: no error), gathered on every rank."""
        if self.group is None:
            return [error] if error else []
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, error, group=self.group)
        return [e for e in gathered if e]

    def stats(self, ok: bool, nbytes: int, sq_norm: float) -> tuple[bool, int, float]:
        """(every local rank ok, bytes sent by the node, squared norm over the node's shards)."""
        if self.group is None:
            return ok, nbytes, sq_norm
        mine = torch.tensor([float(ok), float(nbytes), sq_norm], dtype=torch.float64)
        rows = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(rows, mine, group=self.group)
        table = torch.stack(rows)
        return bool(table[:, 0].min() > 0), int(table[:, 1].sum()), float(table[:, 2].sum())

    def sums(self, values: list[float]) -> list[float]:
        """Each value summed over the node's local ranks (one collective), in float64."""
        if self.group is None or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return [float(v) for v in t.tolist()]

    def joined_fingerprint(self, mine: str) -> str:
        """One fingerprint of the node from each local rank's (of its shards)."""
        if self.group is None:
            return mine[:12]
        parts: list[Any] = [None] * self.size
        dist.all_gather_object(parts, mine, group=self.group)
        return hashlib.blake2b("".join(parts).encode(), digest_size=6).hexdigest()
