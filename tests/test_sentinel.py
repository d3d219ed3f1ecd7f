"""The poisoned-update sentinel (engine/outer/sentinel.py): a finite but wrong pseudo-gradient (x100, a flipped
sign) is left out of the mean; clean ones never are."""

from __future__ import annotations

import datetime
import pickle
import traceback

import torch
import torch.distributed as dist

from engine.outer import Progress
from engine.outer.sentinel import SAMPLE, outliers, row
from procs import spawned_ranks
from test_diloco_math import FakeMesh, TinyInner, _group, make_outer, make_plan

RATIO, MIN_COS = 10.0, -0.1


class Inner(TinyInner):
    resets = 0

    def reset_optimizer_state(self) -> None:
        self.resets += 1


def pgrads(n: int, seed: int = 0, shared: float = 0.5) -> list[torch.Tensor]:
    """n pseudo-gradients that share a direction (as rounds on shards of one corpus do) plus their own noise."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(20000, generator=g)
    return [shared * common + torch.randn(20000, generator=g) for _ in range(n)]


def rows(xs: list[torch.Tensor], weights=None) -> torch.Tensor:
    return torch.stack([row(x, 1.0 if weights is None else weights[i]) for i, x in enumerate(xs)])


def test_clean_rounds_are_never_left_out():
    for seed in range(20):
        for n in (2, 3, 4, 8):
            assert outliers(rows(pgrads(n, seed)), RATIO, MIN_COS) == [], (seed, n)


def test_a_scaled_or_flipped_contributor_is_left_out_and_only_it():
    for seed in range(10):
        xs = pgrads(4, seed)
        assert outliers(rows([*xs[:3], 100 * xs[3]]), RATIO, MIN_COS) == [3]
        assert outliers(rows([*xs[:3], -xs[3]]), RATIO, MIN_COS) == [3]
        assert outliers(rows([xs[0], 100 * xs[1]]), RATIO, MIN_COS) == [1]  # two nodes: the scale is judged
        assert outliers(rows([xs[0], -xs[1]]), RATIO, MIN_COS) == []  # ... the direction cannot be (who is wrong?)
        bad = xs[2].clone()
        bad[7] = float("inf")
        assert outliers(rows([xs[0], xs[1], bad]), RATIO, MIN_COS) == [2]


def test_members_that_do_not_contribute_are_neither_judged_nor_a_yardstick():
    xs = pgrads(4, 3)
    joiner = torch.zeros(20000)
    assert outliers(rows([*xs[:3], joiner], weights=[1, 1, 1, 0]), RATIO, MIN_COS) == []
    assert outliers(rows([xs[0], 100 * xs[1], joiner], weights=[1, 1, 0]), RATIO, MIN_COS) == [1]
    assert outliers(rows(xs), 0.0, MIN_COS) == []  # diloco.sentinel_ratio = 0: off
    assert row(xs[0], 1.0).numel() == SAMPLE + 2


def _poisoned_worker(rank: int, port: int, queue) -> None:
    """a, b, c train from the same weights on their own batches; c's pseudo-gradient is scaled x100 before the
    exchange. Plain averaging: the outer step must make everyone the mean of a and b only."""
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
        node = "abc"[rank]
        inner = Inner(0)
        events: list[dict] = []
        plan = make_plan(1, 1, 0, ["a", "b", "c"], source="a")
        outer = make_outer(inner, FakeMesh([plan], [True]), node=node, events=events, inner_steps=1,
                           outer_optimizer="average", min_nodes=3,
                           group_factory=lambda p, n, r: _group(store, p.rank_of(n), p.size, "poison/"))
        progress = Progress()
        outer.start(progress)
        start = torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])
        inner.train_step(10 + rank)  # different data: pseudo-gradients that share a direction, not equal ones
        inner.train_step(20 + rank)
        trained = torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])
        if node == "c":  # the poison: a x100 pseudo-gradient (start - 100 * (start - trained))
            with torch.no_grad():
                for p, s, t in zip(inner.outer_params(), start.split([p.numel() for p in inner.outer_params()]),
                                   trained.split([p.numel() for p in inner.outer_params()])):
                    p.copy_((s - 100 * (s - t)).reshape(p.shape))
        progress.step, progress.tokens = 1, 100
        outer.after_inner_step(progress)
        after = torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])
        step = [e for e in events if e["type"] == "outer_step"][0]
        warned = [e["message"] for e in events if e["type"] == "warning"]
        queue.put((rank, pickle.dumps({"trained": trained, "after": after, "event": step, "warned": warned,
                                       "resets": inner.resets})))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


def test_a_x100_node_is_left_out_of_the_mean_named_and_takes_the_runs_weights():
    got = spawned_ranks(_poisoned_worker, 3, timeout=90)
    expected = (got[0]["trained"] + got[1]["trained"]) / 2
    for rank in range(3):
        e = got[rank]["event"]
        assert e["left_out"] == ["c"] and e["contributors"] == ["a", "b"] and e["weights"] == [100.0, 100.0], e
        torch.testing.assert_close(got[rank]["after"], expected, rtol=0, atol=1e-6)  # c too: the run's weights
        assert any("left out of the mean by the sentinel: c (" in w for w in got[rank]["warned"]), got[rank]
    assert got[0]["event"]["checksum"] == got[1]["event"]["checksum"] == got[2]["event"]["checksum"]
    assert [got[r]["resets"] for r in range(3)] == [0, 0, 1]  # c starts over with fresh optimizer state
