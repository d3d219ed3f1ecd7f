"""Eager overlap (diloco.overlap_update = "eager", arXiv 2502.12996): while the mean of round t is in flight, the
node's own fresh pseudo-gradient stands in for its share of it; the agreed snapshot stays identical everywhere."""

from __future__ import annotations

import datetime
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist

from engine.mesh.protocol import Stopped
from engine.outer import Progress
from engine.outer.buffers import fingerprint
from engine.outer.optimizer import build_outer_optimizer
from procs import spawned_ranks
from test_diloco_math import FakeMesh, TinyInner, _group, make_outer, make_plan


@pytest.mark.parametrize("kind,momentum", [("nesterov", 0.9), ("nesterov", 0.0), ("sgd", 0.9), ("average", 0.0)])
def test_preview_is_the_step_the_optimizer_would_take_and_changes_nothing(kind, momentum):
    gen = torch.Generator().manual_seed(3)
    for first in (True, False):
        opt = build_outer_optimizer(kind, 0.7, momentum)
        if not first and opt.check_tensor() is None and kind != "average" and momentum > 0:
            opt.load_state_dict({"kind": kind, "momentum": torch.randn(50, generator=gen)})
        kept = None if opt.check_tensor() is None else opt.check_tensor().clone()
        snapshot, g = torch.randn(50, generator=gen), torch.randn(50, generator=gen)
        step = opt.preview(g, out=torch.empty(50))
        now = opt.check_tensor()
        assert (now is None) == (kept is None) and (kept is None or torch.equal(now, kept))
        expected = snapshot.clone()
        opt.step_(expected, g.clone())
        torch.testing.assert_close(snapshot - step, expected, rtol=0, atol=1e-6)


def _flat(inner) -> torch.Tensor:
    return torch.cat([t.reshape(-1).clone() for t in inner.outer_params()])


def _two_nodes(rank: int, port: int, prefix: str, **diloco):
    """Node a or b (rank 0 or 1) of a two-node overlapped run with plain averaging over a real gloo group: its
    inner and its outer loop, started."""
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    inner = TinyInner(0)
    plans = [make_plan(1, k, 0, ["a", "b"], source="a") for k in (1, 2, 3)]
    outer = make_outer(inner, FakeMesh(plans, [True] * 3), node="ab"[rank], min_nodes=2, outer_optimizer="average",
                       overlap=True, group_factory=lambda p, n, r: _group(store, p.rank_of(n), p.size, prefix),
                       **diloco)
    return inner, outer


def _eager_worker(rank: int, port: int, queue) -> None:
    """Two nodes, H = 1, plain averaging: the working weights after each boundary are snapshot - d / 2."""
    try:
        torch.set_num_threads(1)
        inner, outer = _two_nodes(rank, port, "eager/", inner_steps=1, overlap_update="eager",
                                  overlap_delay=1)  # at the next boundary
        progress = Progress()
        outer.start(progress)
        s0 = outer.bufs.snapshot.clone()
        out: dict = {"s0": s0}
        for step in (1, 2):
            before = _flat(inner)
            inner.train_step(100 * rank + step)
            d = before - _flat(inner)  # this round's own progress (the round trained from `before`)
            progress.step = step
            outer.after_inner_step(progress)  # lands the previous round (if any), launches this one
            out[f"d{step}"], out[f"work{step}"] = d, _flat(inner)
            out[f"snap{step}"] = outer.bufs.snapshot.clone()
        outer.flush()
        out["final_snapshot"] = fingerprint(outer.bufs.snapshot)
        queue.put((rank, pickle.dumps(out)))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


def test_eager_working_weights_take_the_nodes_share_and_the_snapshot_stays_agreed():
    got = spawned_ranks(_eager_worker, 2, timeout=60)
    a, b = got[0], got[1]
    for r in (a, b):
        # boundary 1: nothing landed yet; the node's own progress stands in for its half of the mean
        torch.testing.assert_close(r["snap1"], r["s0"], rtol=0, atol=0)
        torch.testing.assert_close(r["work1"], r["s0"] - r["d1"] / 2, rtol=0, atol=1e-6)
        # boundary 2: round 1's mean landed: the agreed weights are the synchronous ones, on both nodes
        torch.testing.assert_close(r["snap2"], r["s0"] - (a["d1"] + b["d1"]) / 2, rtol=0, atol=1e-5)
        torch.testing.assert_close(r["work2"], r["snap2"] - r["d2"] / 2, rtol=0, atol=1e-5)
    assert torch.equal(a["snap2"], b["snap2"]) and a["final_snapshot"] == b["final_snapshot"]


def _delay_worker(rank: int, port: int, queue, delay: int = 1, update: str = "delayed") -> None:
    """Two nodes, H = 3, diloco.overlap_delay = 1, plain averaging: round 1's mean lands one step into round 2.
    With delay 0 it lands at the first step after its outer step is done: the test waits for that after the
    boundary, so that it lands one step in as well."""
    try:
        torch.set_num_threads(1)
        inner, outer = _two_nodes(rank, port, "delay/", inner_steps=3, overlap_delay=delay, overlap_update=update)
        progress = Progress()
        outer.start(progress)
        out: dict = {"s0": outer.bufs.snapshot.clone()}
        for step in range(1, 7):
            inner.train_step(100 * rank + step)
            out[f"trained{step}"] = _flat(inner)  # before the outer loop sees the step
            progress.step = step
            outer.after_inner_step(progress)
            out[f"work{step}"], out[f"snap{step}"] = _flat(inner), outer.bufs.snapshot.clone()
            if delay == 0 and step == 3:
                out["in_flight_after_boundary"] = outer.flight.busy
                outer.flight.done(timeout=30)  # done before step 4 ends: it lands there
        outer.flush()
        out["final"] = outer.bufs.snapshot.clone()
        out["update"] = update
        queue.put((rank, pickle.dumps(out)))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


def _auto_worker(rank: int, port: int, queue) -> None:
    _delay_worker(rank, port, queue, delay=0)


def _eager_delay_worker(rank: int, port: int, queue) -> None:
    _delay_worker(rank, port, queue, update="eager")


@pytest.mark.parametrize("worker", [_delay_worker, _auto_worker, _eager_delay_worker],
                         ids=["one-step-in", "once-done", "eager-one-step-in"])
def test_a_round_in_flight_lands_overlap_delay_steps_into_the_next_with_the_progress_carried_over(worker):
    got = spawned_ranks(worker, 2, timeout=60)
    a, b = got[0], got[1]
    d1 = {n: r["s0"] - r["trained3"] for n, r in (("a", a), ("b", b))}
    agreed1 = a["s0"] - (d1["a"] + d1["b"]) / 2
    for n, r in (("a", a), ("b", b)):
        # delayed (the default): round 2 trains on from the node's own weights; eager: from its share of round 1
        anchor = r["s0"] - d1[n] / (2 if r["update"] == "eager" else 1)
        torch.testing.assert_close(r["work3"], anchor, rtol=0, atol=1e-6)
        torch.testing.assert_close(r["snap3"], r["s0"], rtol=0, atol=0)  # nothing landed at the boundary
        # one step in: round 1's mean landed, and the step trained meanwhile is carried over onto it
        torch.testing.assert_close(r["snap4"], agreed1, rtol=0, atol=1e-5)
        torch.testing.assert_close(r["work4"], agreed1 + (r["trained4"] - anchor), rtol=0, atol=1e-5)
        # round 2's pseudo-gradient is its whole progress from the agreed weights, the carried-over step included
        d2 = {m: agreed1 - q["trained6"] for m, q in (("a", a), ("b", b))}
        torch.testing.assert_close(r["final"], agreed1 - (d2["a"] + d2["b"]) / 2, rtol=0, atol=1e-5)
    assert torch.equal(a["snap4"], b["snap4"]) and torch.equal(a["final"], b["final"])
    assert a.get("in_flight_after_boundary", True) and b.get("in_flight_after_boundary", True)


def _projected_delay_worker(rank: int, port: int, queue) -> None:
    _delay_worker(rank, port, queue, update="projected")


def test_projected_stand_in_is_the_nodes_own_progress_scaled_by_the_fit_of_the_last_landed_step():
    """diloco.overlap_update = "projected": round 2 trains on from the node's own weights (scale 1: nothing landed
    yet); round 1's landing fits a = <d1, s1> / |d1|^2 (s1 = the step the agreed weights took, here the plain mean of
    the two nodes' d1), and round 3 trains from the agreed weights minus a d2."""
    got = spawned_ranks(_projected_delay_worker, 2, timeout=60)
    a, b = got[0], got[1]
    d1 = {n: r["s0"] - r["trained3"] for n, r in (("a", a), ("b", b))}
    agreed1 = a["s0"] - (d1["a"] + d1["b"]) / 2
    for n, r in (("a", a), ("b", b)):
        torch.testing.assert_close(r["work3"], r["s0"] - d1[n], rtol=0, atol=1e-6)  # as delayed
        torch.testing.assert_close(r["snap4"], agreed1, rtol=0, atol=1e-5)
        torch.testing.assert_close(r["work4"], agreed1 + (r["trained4"] - (r["s0"] - d1[n])), rtol=0, atol=1e-5)
        scale = float(d1[n] @ (r["s0"] - agreed1)) / float(d1[n] @ d1[n])
        assert 0.05 < scale < 0.95  # the two nodes disagree: neither delayed (1) nor clamped
        d2 = agreed1 - r["trained6"]
        torch.testing.assert_close(r["work6"], r["snap6"] - scale * d2, rtol=0, atol=1e-5)
    assert torch.equal(a["snap6"], b["snap6"])


def test_projected_scale_is_the_fit_clamped_to_between_eager_and_delayed():
    from engine.outer.landing import projected_scale
    d, zero = torch.tensor([1.0, 2.0, 0.0]), torch.zeros(3)
    assert projected_scale(d, d * 0.75, zero, 0.3) == pytest.approx(0.75)
    assert projected_scale(d, d, zero, 0.3) == pytest.approx(1.0)
    assert projected_scale(d, d * 1.01, zero, 0.3) == 1.0  # a step past the node's own: clamped to delayed
    assert projected_scale(d, d * 0.01, zero, 0.3) == pytest.approx(0.01)
    assert projected_scale(d, -d * 0.01, zero, 0.3) == 0.0  # against the node's own: clamped to none of it
    assert projected_scale(d, torch.tensor([2.0, -1.0, 5.0]), zero, 0.3) == pytest.approx(0.0)  # orthogonal
    assert projected_scale(zero, d, zero, 0.3) == 0.3  # a round not counted (d zeroed): the last scale stays
    assert projected_scale(d, torch.tensor([float("nan"), 0.0, 0.0]), zero, 0.3) == 0.3
    # summed over chunks: the same fit as in one piece
    g = torch.Generator().manual_seed(5)
    big, step = torch.randn(10_001, generator=g), torch.randn(10_001, generator=g)
    step = 0.4 * big + 0.1 * step
    assert projected_scale(big, step, torch.zeros_like(big), 1.0, chunk=1000) == pytest.approx(
        projected_scale(big, step, torch.zeros_like(big), 1.0), rel=1e-6)


def test_overlap_delay_must_land_by_the_next_boundary():
    from engine.config import DilocoConfig
    with pytest.raises(ValueError, match=r"diloco.overlap_delay \(6\) must be at most diloco.inner_steps \(5\)"):
        DilocoConfig(inner_steps=5, overlap=True, overlap_delay=6)
    assert DilocoConfig(inner_steps=5, overlap=True, overlap_delay=5).overlap_delay == 5


class _StoppingMesh(FakeMesh):
    """A stop arrives while the outer step in flight waits for its plan."""

    def boundary(self, outer_step, attempt, *, contributing, draining, budget=None):
        raise Stopped("stopped", f"outer step {outer_step} attempt {attempt}")


@pytest.mark.parametrize("update", ["delayed", "eager", "projected"])
def test_a_round_in_flight_that_was_stopped_leaves_its_progress_measured_from_the_snapshot(update):
    """Nothing of a stopped round landed: the weights hold its progress and the next round's from the snapshot (so
    a checkpoint saved now, or the next boundary, sends both), weighed by both rounds' tokens. Eager had put the
    stand-in u in the weights instead of the round's own d: a resume then sent u and lost the rest of the round."""
    inner = TinyInner(0)
    outer = make_outer(inner, _StoppingMesh([], []), inner_steps=2, overlap=True, overlap_update=update,
                       outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)  # eager: u is not d
    progress = Progress()
    outer.start(progress)
    s0 = outer.bufs.snapshot.clone()
    for step in (1, 2):
        inner.train_step(step)
        progress.step, progress.tokens = step, progress.tokens + 10
        outer.after_inner_step(progress)  # step 2: the boundary, its outer step goes to the background
    round_end = s0 - outer.bufs.pgrad  # the weights round 1 ended with (its pseudo-gradient d = s0 - them)
    outer.flight.done(timeout=30)
    before = _flat(inner)
    inner.train_step(3)
    progress.step, progress.tokens = 3, progress.tokens + 10
    delta = before - _flat(inner)  # the next round's step, from wherever the boundary left the weights
    with pytest.raises(Stopped):
        outer.flush()
    assert torch.equal(outer.bufs.snapshot, s0)
    torch.testing.assert_close(_flat(inner), round_end - delta, rtol=0, atol=1e-6)
    assert outer.rounds.close(progress) == 30
