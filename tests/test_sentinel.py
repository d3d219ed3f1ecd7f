"""The poisoned-update sentinel (engine/outer/sentinel.py): a finite but wrong pseudo-gradient (x100, a flipped
sign) is left out of the mean; clean ones never are, nor is a node that trained more tokens, nor every node."""

from __future__ import annotations

import datetime
import math
import pickle
import threading
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from engine.outer import Progress
from engine.outer.local import LocalRanks
from engine.outer.sentinel import SAMPLE, Sentinel, outliers, row
from procs import spawned_ranks
from test_diloco_math import FakeMesh, TinyInner, _group, make_outer, make_plan

RATIO, MIN_COS = 10.0, -0.1


class Inner(TinyInner):
    resets = 0
    reset_elsewhere = 0  # resets off the training thread, where the optimizer is in use

    def reset_optimizer_state(self) -> None:
        self.resets += 1
        self.reset_elsewhere += threading.current_thread() is not threading.main_thread()


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


def test_a_large_sign_flipped_node_is_left_out_and_only_it():
    """-k times a legitimate pseudo-gradient among rounds whose directions agree (cosine 0.8): with the plain mean of
    the others as the yardstick, the flipped row dragged it against every legitimate node (two of three from k = 2,
    seven of eight from k = 9) and all were left out: nothing to average, every node exited."""
    for seed in range(5):
        for n in (2, 3, 4, 7):
            xs = pgrads(n + 1, seed, shared=2.0)  # pairwise cosine 4 / 5
            for k in (1, 2, 3, 5, 9, 20, 100):
                assert outliers(rows([*xs[:n], -k * xs[n]]), RATIO, MIN_COS) == [n], (seed, n, k)
            if n >= 4:  # two flipped, left out one at a time
                assert outliers(rows([*xs[:n - 1], -xs[n - 1], -3 * xs[n]]), RATIO, MIN_COS) == [n - 1, n]


def test_norms_are_judged_per_token():
    """Time rounds on mixed hardware: a host 20x faster trains 20x the steps of a round, and a round's norm grows
    with its steps (as steps^0.7-0.95 on the debug model; linear at worst, sqrt at best). Per token, neither the
    fast nor the slow node is a scale gone wrong; a x100 one still is, whatever its tokens."""
    for seed in range(5):
        xs = pgrads(4, seed)
        assert outliers(rows([xs[0], xs[1], 20 * xs[2]], weights=[100, 100, 2000]), RATIO, MIN_COS) == []
        assert outliers(rows([xs[0], 20 * xs[1]], weights=[100, 2000]), RATIO, MIN_COS) == []
        slow = xs[3] / math.sqrt(20)  # 1/20 of the tokens, the norm only 1/sqrt(20): x4.5 per token
        assert outliers(rows([*xs[:3], slow], weights=[2000, 2000, 2000, 100]), RATIO, MIN_COS) == []
        assert outliers(rows([xs[0], xs[1], 2000 * xs[2]], weights=[100, 100, 2000]), RATIO, MIN_COS) == [2]
        assert outliers(rows([xs[0], xs[1], 100 * xs[2]], weights=[2000, 2000, 2000]), RATIO, MIN_COS) == [2]


def table(weights: list[float], per_token: list[float], directions: list[tuple[float, float]] | None = None):
    """Rows as the all_gather hands them over, built to the digit: member i's weight (its round's tokens), a norm
    of per_token[i] x its weight, and a sample along directions[i] in a plane (all along one axis by default)."""
    out = torch.zeros(len(weights), SAMPLE + 2, dtype=torch.float64)
    for i, (w, pt) in enumerate(zip(weights, per_token)):
        out[i, 0], out[i, 1] = w, (pt * w) ** 2
        out[i, 2:4] = torch.tensor(directions[i] if directions else (1.0, 0.0), dtype=torch.float64)
    return out


@pytest.mark.parametrize("ratio", [3.0, RATIO])
def test_the_scale_rule_leaves_out_just_over_the_ratio_and_keeps_just_under(ratio):
    """norm / tokens against diloco.sentinel_ratio x the median of the others', 1 % either side of the bound, with
    tokens that differ from node to node: judged on raw norms, c (few tokens, 1 % over per token) would stay in,
    and a node with many tokens, 1 % under, would be left out; against the others' mean (4/3 of their median
    below) one 1 % over would stay in."""
    weights = [100.0, 400.0, 50.0]
    for factor, expected in ((1.01, [2]), (0.99, [])):
        assert outliers(table(weights, [1.0, 1.0, factor * ratio]), ratio, MIN_COS) == expected, (ratio, factor)
        # a node with 40x the others' tokens: its raw norm is 40 x ratio x theirs either way
        many = [100.0, 100.0, 4000.0]
        assert outliers(table(many, [1.0, 1.0, factor * ratio]), ratio, MIN_COS) == expected, (ratio, factor)
        # the median of the others (1), not their mean (4/3)
        four = [100.0, 200.0, 300.0, 50.0]
        assert outliers(table(four, [1.0, 1.0, 2.0, factor * ratio]), ratio, MIN_COS) == [i + 1 for i in expected], \
            (ratio, factor)


@pytest.mark.parametrize("min_cos", [MIN_COS, 0.3])
def test_the_direction_rule_leaves_out_just_under_the_bound_and_keeps_just_over(min_cos):
    """c's cosine with the others' direction 0.01 either side of diloco.sentinel_min_cosine (a and b point one
    way; each of them has cosine 0.6 or more with the rest); the tokens differ and do not count (unit samples)."""
    weights = [100.0, 300.0, 50.0]
    for cos, expected in ((min_cos - 0.01, [2]), (min_cos + 0.01, [])):
        c = (cos, math.sqrt(1 - cos * cos))
        got = outliers(table(weights, [1.0, 1.0, 1.0], [(1.0, 0.0), (1.0, 0.0), c]), RATIO, min_cos)
        assert got == expected, (min_cos, cos, got)


class _Gathered:
    """A group whose all_gather hands back the other members' rows as given, this member's own in its place."""

    def __init__(self, table: torch.Tensor, rank: int):
        self.table, self.rank = table, rank

    def allgather(self, outputs, inputs):
        for i, out in enumerate(outputs[0]):
            out.copy_(inputs[0] if i == self.rank else self.table[i])
        return SimpleNamespace(wait=lambda: None)


class _TwoShards(LocalRanks):
    """Local rank 0 of a node of two processes, whose local rank 1 judged its own shards: `theirs` are its flags
    (left out, then norm beyond fp32's range, per member)."""

    def __init__(self, theirs: list[bool]):
        super().__init__(0, 1, None)
        self.theirs = theirs

    def any_of(self, flags: list[bool]) -> list[bool]:
        return [a or b for a, b in zip(flags, self.theirs)]


def test_the_verdict_never_leaves_out_every_contributor():
    """The mean needs one: where the verdict would leave out every contributor (diloco.sentinel_ratio under 1, or
    local ranks that each left out another node's shards) it leaves out none, and says so; only a norm beyond
    fp32's range stays out even then."""
    xs = pgrads(2, 5)
    plan = make_plan(1, 4, 0, ["a", "b"])
    beyond = rows(xs)
    beyond[1, 1] = math.inf  # b's norm past fp32's range (its elements all finite)
    for ratio, local, table, expected in [
            (0.5, LocalRanks(0, 1, None), rows(xs), []),  # every norm over half the other's
            (RATIO, _TwoShards([True, False, False, False]), rows([xs[0], 100 * xs[1]]), []),  # a's other shard
            (RATIO, _TwoShards([True, False, False, False]), beyond, ["b"])]:
        warned: list[str] = []
        sentinel = Sentinel(ratio, MIN_COS, local, lambda kind, message: warned.append(message))
        assert sentinel.screen(plan, _Gathered(table, 0), xs[0], 1.0, torch.zeros(20000)) == expected, ratio
        assert any("would have left every contributor out" in w for w in warned), warned


def test_members_that_do_not_contribute_are_neither_judged_nor_a_yardstick():
    xs = pgrads(4, 3)
    joiner = torch.zeros(20000)
    assert outliers(rows([*xs[:3], joiner], weights=[1, 1, 1, 0]), RATIO, MIN_COS) == []
    assert outliers(rows([xs[0], 100 * xs[1], joiner], weights=[1, 1, 0]), RATIO, MIN_COS) == [1]
    assert outliers(rows(xs), 0.0, MIN_COS) == []  # diloco.sentinel_ratio = 0: off
    assert row(xs[0], 1.0).numel() == SAMPLE + 2


def _three_nodes(rank: int, port: int, queue, *, scale: float = 100.0, tokens: int = 100,
                 overlap: bool = False) -> None:
    """a, b, c train from the same weights on their own batches; c's pseudo-gradient is scaled before the exchange
    (start - scale x (start - trained)) and its round weighs `tokens` (a's and b's: 100). Plain averaging. With
    diloco.overlap the outer step runs in the background and lands at flush()."""
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
        node = "abc"[rank]
        inner = Inner(0)
        events: list[dict] = []
        plan = make_plan(1, 1, 0, ["a", "b", "c"], source="a")
        outer = make_outer(inner, FakeMesh([plan], [True]), node=node, events=events, inner_steps=1,
                           outer_optimizer="average", min_nodes=3, overlap=overlap,
                           group_factory=lambda p, n, r: _group(store, p.rank_of(n), p.size, "poison/"))
        progress = Progress()
        outer.start(progress)
        start = torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])
        inner.train_step(10 + rank)  # different data: pseudo-gradients that share a direction, not equal ones
        inner.train_step(20 + rank)
        trained = torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])
        if node == "c":
            trained = start - scale * (start - trained)
            with torch.no_grad():
                for p, t in zip(inner.outer_params(), trained.split([p.numel() for p in inner.outer_params()])):
                    p.copy_(t.reshape(p.shape))
        progress.step, progress.tokens = 1, tokens if node == "c" else 100
        outer.after_inner_step(progress)
        outer.flush()  # overlap: the round lands now, on this (the training) thread
        after = torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])
        step = [e for e in events if e["type"] == "outer_step"][0]
        warned = [e["message"] for e in events if e["type"] == "warning"]
        queue.put((rank, pickle.dumps({"trained": trained, "after": after, "event": step, "warned": warned,
                                       "resets": inner.resets, "reset_elsewhere": inner.reset_elsewhere})))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


def _poisoned_worker(rank: int, port: int, queue) -> None:
    _three_nodes(rank, port, queue)


def _poisoned_overlap_worker(rank: int, port: int, queue) -> None:
    _three_nodes(rank, port, queue, overlap=True)


def _fast_worker(rank: int, port: int, queue) -> None:
    _three_nodes(rank, port, queue, scale=20.0, tokens=2000)  # 20x the tokens, a norm grown linearly with them


@pytest.mark.parametrize("worker", [_poisoned_worker, _poisoned_overlap_worker], ids=["synchronous", "overlap"])
def test_a_x100_node_is_left_out_of_the_mean_named_and_takes_the_runs_weights(worker):
    """...with fresh optimizer state, reset on the training thread: with diloco.overlap the reset had been left to
    the boundary, which only repairs a diverged round, so the node left out kept its optimizer's moments."""
    got = spawned_ranks(worker, 3, timeout=90)
    expected = (got[0]["trained"] + got[1]["trained"]) / 2
    for rank in range(3):
        e = got[rank]["event"]
        assert e["left_out"] == ["c"] and e["contributors"] == ["a", "b"] and e["weights"] == [100.0, 100.0], e
        torch.testing.assert_close(got[rank]["after"], expected, rtol=0, atol=1e-6)  # c too: the run's weights
        assert any("left out of the mean by the sentinel: c (" in w for w in got[rank]["warned"]), got[rank]
    assert got[0]["event"]["checksum"] == got[1]["event"]["checksum"] == got[2]["event"]["checksum"]
    assert [got[r]["resets"] for r in range(3)] == [0, 0, 1]  # c starts over with fresh optimizer state
    assert got[2]["reset_elsewhere"] == 0


def test_a_node_that_trained_more_tokens_is_counted_by_them():
    """The row carries the round's tokens: c trained 20x the tokens of a and b, its pseudo-gradient 20x theirs (a
    fast host on time rounds). It is not a scale gone wrong, and the mean weighs it by its tokens."""
    got = spawned_ranks(_fast_worker, 3, timeout=90)
    expected = (100 * got[0]["trained"] + 100 * got[1]["trained"] + 2000 * got[2]["trained"]) / 2200
    for rank in range(3):
        e = got[rank]["event"]
        assert "left_out" not in e and e["weights"] == [100.0, 100.0, 2000.0], e
        torch.testing.assert_close(got[rank]["after"], expected, rtol=0, atol=1e-5)
    assert [got[r]["resets"] for r in range(3)] == [0, 0, 0]
