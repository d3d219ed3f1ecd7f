"""The outer step's parts hold the next rule without a change to its story (issue 42): a codec with state that is
staged per attempt and committed or dropped with the outer step, whose messages are gathered (not reduced), and no
outer momentum (outer optimizer "none"). A stub of that codec (error feedback in miniature: it sends half of what it
holds, the rest stays) is given to the real outer loop through the seam build_parts takes its parts by, over real
gloo groups in 2 spawned processes; the mesh is scripted (an abort, then commits)."""

from __future__ import annotations

import pickle
import traceback

import pytest
import torch

from engine.outer import Progress
from engine.outer.allreduce import NothingToAverage, ReduceStats
from engine.outer.codec import GatheredCodec
from engine.outer.optimizer import build_outer_optimizer, flat_params
from procs import spawned_ranks
from test_diloco_math import FakeMesh, TinyInner, _group, make_outer, make_plan


class HalfFeedback:
    """A stateful gathered codec: e' = e + pgrad at each attempt's stage; the message is e' / 2 (fp32, the whole
    slice: a stub, not a compressor); commit keeps what was not sent (e = e' - message); abort keeps e as it was."""

    name = "stub-half"
    gathers = True

    def __init__(self) -> None:
        self.e: torch.Tensor | None = None
        self.staged: torch.Tensor | None = None
        self.calls: list[tuple] = []
        self.messages: list[list[torch.Tensor]] = []

    def prepare(self, exchange, numel: int, size: int) -> None:
        pass

    def stage(self, pgrad: torch.Tensor | None, outer_step: int, attempt: int) -> bool:
        self.calls.append(("stage", outer_step, attempt, pgrad is not None))
        if pgrad is None:
            self.staged = None
            return True
        self.staged = pgrad.clone() if self.e is None else self.e + pgrad
        return True

    def mean(self, send: torch.Tensor, weight: float, pg, *, out: torch.Tensor, wire) -> ReduceStats:
        """Every member's weight and message to every member (two all-gathers, group-rank order), then their
        weighted mean, added in rank order: the same bits on every rank."""
        msg = self.staged * 0.5 if weight and self.staged is not None else torch.zeros_like(send)
        size = 1 if pg is None else pg.size()
        mine = torch.tensor([weight], dtype=torch.float64)
        rows = torch.empty(size, 1, dtype=torch.float64)
        pg.allgather([[rows[i] for i in range(size)]], [mine]).wait()
        messages = [torch.empty_like(msg) for _ in range(size)]
        pg.allgather([messages], [msg]).wait()
        weights = rows[:, 0].tolist()
        if not sum(weights) > 0:
            raise NothingToAverage("every rank of the mean had weight 0")
        self.messages.append([m.clone() for m in messages])
        acc = torch.zeros_like(out)
        for m, w in zip(messages, weights):  # rank order: the same bits on every rank
            acc.add_(m, alpha=w)
        torch.div(acc, torch.tensor(sum(weights), dtype=out.dtype), out=out)
        sent = (size - 1) * (msg.numel() * msg.element_size() + mine.element_size())
        return ReduceStats(sent, 0.0, float(sum(weights)), weights)

    def commit(self) -> None:
        self.calls.append(("commit",))
        assert self.staged is not None
        self.e = self.staged * 0.5  # what was not sent stays

    def abort(self) -> None:
        self.calls.append(("abort",))
        self.staged = None

    def reject(self, pgrad) -> None:
        self.calls.append(("reject",))
        self.staged = None

    def reset(self) -> None:
        self.calls.append(("reset",))
        self.e = self.staged = None

    def unsent(self, pgrad, outer_step: int) -> None:
        self.calls.append(("unsent", outer_step))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _node(rank: int, port: int, queue) -> None:
    try:
        torch.set_num_threads(1)
        import datetime

        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
        node = "ab"[rank]
        inner = TinyInner(0)
        plans = [make_plan(1, 1, 0, ["a", "b"], source="a"), make_plan(2, 1, 1, ["a", "b"], source="a"),
                 make_plan(2, 2, 0, ["a", "b"], source="a")]
        codec = HalfFeedback()
        assert isinstance(codec, GatheredCodec)
        outer = make_outer(inner, FakeMesh(plans, [False, True, True]), node=node, inner_steps=1, min_nodes=2,
                           opt=build_outer_optimizer("none", 0.8, 0.0), codec=codec,
                           group_factory=lambda p, n, r: _group(store, p.rank_of(n), p.size, f"g{p.generation}/"))
        progress = Progress()
        outer.start(progress)
        snapshots, pgrads = [outer.bufs.snapshot.clone()], []
        for step in (1, 2):
            inner.train_step(10 * step + rank)
            pgrads.append(outer.bufs.snapshot - flat_params(inner.outer_params()))
            progress.step, progress.tokens = step, 64 * step
            outer.after_inner_step(progress)
            snapshots.append(outer.bufs.snapshot.clone())
        result = {"calls": codec.calls, "snapshots": snapshots, "pgrads": pgrads, "messages": codec.messages,
                  "e": codec.e, "momentum": outer.opt.state_dict()["momentum"], "outer_step": progress.outer_step,
                  "params": flat_params(inner.outer_params())}
        queue.put((rank, pickle.dumps(result)))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def nodes():
    return spawned_ranks(_node, 2, timeout=60)


def test_a_stateful_codec_is_staged_per_attempt_and_committed_or_dropped_with_the_outer_step(nodes):
    for rank in (0, 1):
        assert nodes[rank]["calls"] == [("stage", 1, 0, True), ("abort",), ("stage", 1, 1, True), ("commit",),
                                        ("stage", 2, 0, True), ("commit",)]
        assert nodes[rank]["outer_step"] == 2
        assert nodes[rank]["momentum"] is None  # outer optimizer "none": no state
    # the aborted attempt sent e' / 2 and changed nothing: the retry sent the same message
    a = nodes[0]
    assert torch.equal(a["messages"][0][0], a["messages"][1][0])
    # outer step 2 sends (e + pgrad_2) / 2 with e the half of step 1 that was not sent: the state moved with the commit
    torch.testing.assert_close(a["messages"][2][0], (a["pgrads"][0] * 0.5 + a["pgrads"][1]) * 0.5, rtol=0, atol=1e-7)
    assert torch.equal(a["e"], a["messages"][2][0])


def test_the_gathered_mean_is_the_same_bits_on_both_nodes_and_moves_the_snapshot_by_lr(nodes):
    a, b = nodes[0], nodes[1]
    for k in range(3):  # every rank decoded the same messages
        assert all(torch.equal(x, y) for x, y in zip(a["messages"][k], b["messages"][k]))
    for s in (1, 2):
        assert torch.equal(a["snapshots"][s], b["snapshots"][s])
        mean = (a["messages"][s][0] * 64 + a["messages"][s][1] * 64) / 128  # weights: each round's 64 tokens
        torch.testing.assert_close(a["snapshots"][s], a["snapshots"][s - 1] - 0.8 * mean, rtol=0, atol=1e-6)
    assert torch.equal(a["params"], b["params"]) and torch.equal(a["params"], a["snapshots"][2])
