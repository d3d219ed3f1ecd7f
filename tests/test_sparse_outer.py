"""diloco.compression = "sparse" wired into the outer loop (issue 43, items 1, 3, 4): the Sparse codec's state moves
with the outer step (engine/outer/codec.py), is checkpointed and restored, and two real engines over a real store
train with it (gloo): the same checksums on both nodes, the bytes of the gathered messages on the wire, far fewer
than fp32's, and a loss that goes down. With diloco.overlap (item 4; docs/sparse.md, "Overlap"): every inner step's
progress is counted once, in the agreed weights or in e (a retry, a stop, fragments in flight), eager's stand-in is
the node's own decoded message times its agreed share, a left-out node keeps its round in e, a checkpoint saved in
flight resumes exactly, and the two engines overlap after diloco.overlap_after outer steps (issue 46)."""

from __future__ import annotations

import io

import pytest
import torch

from engine.config import DilocoConfig
from engine.mesh.protocol import Stopped
from engine.outer import Progress, gather
from engine.outer.allreduce import Exchange
from engine.outer.codec import Sparse, build_codec, slice_numels
from engine.outer.sparse import SparseSpec
from test_diloco_math import FakeMesh, TinyInner, make_outer, make_plan

SPEC = SparseSpec(chunk=16, density=1 / 16, bits=2, beta=0.5)  # k = 1 of every 16 values


def _codec(numels=(40, 8)) -> Sparse:
    return Sparse(SPEC, list(numels), [(0, sum(numels))], lambda step: 0)


def _mean(codec: Sparse, weight: float = 1.0) -> torch.Tensor:
    out = torch.zeros(sum(codec.efs[0].layout.numels))
    codec.mean(out, weight, None, out=out, wire=Exchange())
    return out


def test_slices_of_the_parameters_never_cross_one():
    assert slice_numels([10, 20, 5], 0, 35) == [10, 20, 5]
    assert slice_numels([10, 20, 5], 5, 32) == [5, 20, 2]
    assert slice_numels([10, 20, 5], 10, 30) == [20]
    cfg = DilocoConfig(enabled=True, compression="sparse", sparse_chunk=16, density=0.0625)
    codec = build_codec(cfg, [10, 20, 5], [(0, 17), (17, 35)], lambda s: (s - 1) % 2)
    assert isinstance(codec, Sparse) and [ef.layout.numels for ef in codec.efs] == [[10, 7], [13, 5]]
    assert build_codec(DilocoConfig(enabled=True, compression="int8"), [4]).name == "int8"


def test_a_retry_encodes_the_same_e_prime_and_a_commit_takes_what_was_sent():
    codec, g = _codec(), torch.Generator().manual_seed(0)
    d1, d2 = torch.randn(48, generator=g), torch.randn(48, generator=g)
    codec.stage(d1, 1, 0)
    first = _mean(codec)
    codec.abort()  # the attempt aborted: a retry of step 1 must not add d1 again
    codec.stage(d1, 1, 1)
    again = _mean(codec)
    assert torch.equal(first, again)
    codec.commit()
    e = codec.efs[0].layout.unpack(codec.efs[0].e)
    torch.testing.assert_close(e, d1 - first, rtol=0, atol=0)  # e = e' - sent (a mean of one: its message exactly)
    assert int((first != 0).sum()) == 4  # one value of each of the 4 chunks (40 = 16 + 16 + 8, then 8)
    codec.stage(d2, 2, 0)
    _mean(codec)
    codec.commit()
    e_prime = 0.5 * e + d2
    assert torch.allclose(codec.efs[0].layout.unpack(codec.efs[0].e) + _last_sent(codec, e_prime), e_prime)


def _last_sent(codec: Sparse, e_prime: torch.Tensor) -> torch.Tensor:
    """What a fresh codec staged with e_prime sends (the same encode)."""
    other = _codec()
    other.stage(e_prime, 1, 0)
    return _mean(other)


def test_a_node_left_out_keeps_e_prime_whole_and_sends_it_decayed_next_step():
    codec, g = _codec(), torch.Generator().manual_seed(1)
    d1, d2 = torch.randn(48, generator=g), torch.randn(48, generator=g)
    codec.stage(d1, 1, 0)
    _mean(codec)
    codec.abort()  # step 1 committed without this node (the sentinel left it out, a straggler)
    codec.unsent(d2, 2)  # step 2 failed before its stage: nothing of it to take back, and step 1's e' stays
    assert torch.equal(codec.efs[0].layout.unpack(codec.efs[0].e), d1)
    codec.stage(d2, 2, 0)  # the next step releases e = e' whole, then stages beta * e' + d2
    got = codec.efs[0].layout.unpack(codec.efs[0].e)
    torch.testing.assert_close(got, 0.5 * d1 + d2, rtol=0, atol=0)
    # the same at a checkpoint: the state saved is e' whole
    codec2 = _codec()
    codec2.stage(d1, 1, 0)
    _mean(codec2)
    codec2.abort()
    assert torch.equal(codec2.state_dict()["accumulators"][0]["e"], d1)
    # weight 0 (a joiner, left out before the mean): no message of its own, and a commit changes nothing
    codec3 = _codec()
    codec3.stage(None, 1, 0)
    with pytest.raises(Exception, match="weight 0"):
        _mean(codec3, weight=0.0)


def test_a_reset_drops_the_accumulator_and_a_state_restores_it():
    codec = _codec()
    codec.stage(torch.arange(48, dtype=torch.float32), 1, 0)
    _mean(codec)
    codec.commit()
    saved = codec.state_dict()
    other = _codec()
    other.load_state_dict(saved)
    assert torch.equal(other.efs[0].e, codec.efs[0].e) and codec.efs[0].e.abs().sum() > 0
    codec.reset()
    assert codec.efs[0].e.abs().sum() == 0
    with pytest.raises(ValueError, match="slices"):
        _codec((40, 9)).load_state_dict(saved)


def test_the_bytes_on_the_wire_are_the_gathered_message_and_far_under_fp32():
    codec = Sparse(SparseSpec(), [4096 * 64], [(0, 4096 * 64)], lambda s: 0)
    sent = gather.bytes_sent(codec.efs[0].codec, 2)
    from engine.outer.allreduce import bytes_sent
    assert sent == 4 + codec.efs[0].codec.bytes and sent * 50 < bytes_sent(4096 * 64, 2, "none")


# ------------------------------------------------------------------------------------------ resume, one node

H, ROUNDS, CUT = 2, 3, 3


def _outer(inner, first_round: int, fragments: int):
    plans = [make_plan(1, k, 0, ["a"], source="a") for k in range(first_round, ROUNDS * fragments + 1)]
    events: list[dict] = []
    outer = make_outer(inner, FakeMesh(plans, [True] * len(plans)), events=events, inner_steps=H,
                       compression="sparse", sparse_chunk=16, density=0.0625, sparse_beta=0.9, fragments=fragments)
    return outer, events


def _train(outer, inner, progress: Progress, steps) -> dict[int, torch.Tensor]:
    after = {}
    for step in steps:
        inner.train_step(step)
        progress.step, progress.tokens = step, 64 * step
        before = progress.outer_step
        outer.after_inner_step(progress)
        if progress.outer_step != before:
            after[progress.outer_step] = torch.cat([p.reshape(-1).clone() for p in inner.outer_params()])
    return after


def _checkpoint(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False, map_location="cpu")


@pytest.mark.parametrize("fragments", [1, 2])
def test_resume_restores_the_accumulator_and_continues_the_uninterrupted_run(fragments):
    full_inner = TinyInner(0)
    full, full_events = _outer(full_inner, 1, fragments)
    full.start(Progress())
    want = _train(full, full_inner, Progress(), range(1, H * ROUNDS + 1))

    first_inner = TinyInner(0)
    first, _ = _outer(first_inner, 1, fragments)
    progress = Progress()
    first.start(progress)
    _train(first, first_inner, progress, range(1, CUT + 1))
    saved = _checkpoint({"model": first_inner.model.state_dict(), "optim": first_inner.opt.state_dict(),
                         "progress": progress.state_dict(), "outer": first.state_dict()})
    assert all(a["e"].abs().sum() > 0 for a in saved["outer"]["codec"]["accumulators"][:1])

    inner = TinyInner(99)
    inner.model.load_state_dict(saved["model"])
    inner.opt.load_state_dict(saved["optim"])
    resumed, events = _outer(inner, progress.outer_step + 1, fragments)
    resumed_progress = Progress()
    resumed_progress.load_state_dict(saved["progress"])
    resumed.load_state_dict(saved["outer"])
    resumed.start(resumed_progress)
    got = _train(resumed, inner, resumed_progress, range(CUT + 1, H * ROUNDS + 1))
    assert sorted(got) == list(range(progress.outer_step + 1, ROUNDS * fragments + 1))
    for k, params in got.items():
        assert torch.equal(params, want[k]), f"outer step {k}: parameters differ from the uninterrupted run's"
    sums = {e["outer_step"]: e["checksum"] for e in events if e["type"] == "outer_step"}
    full_sums = {e["outer_step"]: e["checksum"] for e in full_events if e["type"] == "outer_step"}
    assert sums == {k: full_sums[k] for k in got}
    last = [e for e in full_events if e["type"] == "outer_step"][-1]
    assert last["residual_norm"] > 0 and last["weights_norm"] > 0


def test_the_outer_step_resets_the_accumulator_on_a_hand_off_or_a_diverged_round_and_not_when_left_out():
    inner = TinyInner(0)
    outer, _ = _outer(inner, 1, 1)
    progress = Progress()
    outer.start(progress)
    _train(outer, inner, progress, range(1, H + 1))
    ef = outer.codec.efs[0]
    held = ef.e.clone()
    assert held.abs().sum() > 0
    inner.reset_optimizer_state = lambda: None  # what taking the run's weights asks of the inner loop
    outer.step._discard = False  # left out by the sentinel: it takes the run's weights and keeps e'
    outer.step._discarded()
    assert torch.equal(ef.e, held)
    outer.step._discard = True  # its round diverged
    outer.step._discarded()
    assert ef.e.abs().sum() == 0
    ef.e.copy_(held)
    outer.step._adopt(outer.bufs.snapshot.clone())  # a joiner, a node back after a death: the run's weights
    assert ef.e.abs().sum() == 0


def test_a_non_finite_accumulator_is_reset_and_the_node_sends_nothing_of_its_own():
    """Alone, a node whose accumulator overflowed has no mean to take: it stops on the last committed weights (with
    two or more members it would send weight 0 and take the run's weights, as a diverged round does)."""
    from engine.mesh.protocol import MeshError
    inner = TinyInner(0)
    inner.reset_optimizer_state = lambda: None
    outer, _ = _outer(inner, 1, 1)
    progress = Progress()
    outer.start(progress)
    _train(outer, inner, progress, range(1, H + 1))
    ef = outer.codec.efs[0]
    ef.e.fill_(float("inf"))
    with pytest.raises(MeshError, match="no member had a finite pseudo-gradient"):
        _train(outer, inner, progress, range(H + 1, 2 * H + 1))
    assert ef.e.abs().sum() == 0 and not ef.staged


# ------------------------------------------------------------------------------------------ overlap, one node

class _StopOnce(FakeMesh):
    """FakeMesh whose vote on the listed (outer_step, attempt) meets a stop once: after the exchange, e' staged."""

    def __init__(self, plans, decisions, stop_at=()):
        super().__init__(plans, decisions)
        self.stop_at = set(stop_at)

    def commit(self, plan, succeeded: bool) -> bool:
        if (plan.outer_step, plan.attempt) in self.stop_at:
            self.stop_at.discard((plan.outer_step, plan.attempt))
            raise Stopped("stopped", f"outer step {plan.outer_step} attempt {plan.attempt}")
        return super().commit(plan, succeeded)


def _flat(inner) -> torch.Tensor:
    return torch.cat([p.reshape(-1).clone() for p in inner.outer_params()])


@pytest.mark.parametrize("update", ["delayed", "eager", "fragments", "synchronous"])
def test_overlap_counts_every_step_once_in_the_agreed_weights_or_in_e(update):
    """beta 1, outer lr 1, one node: each committed step moves the snapshot by what it sent and leaves the rest in e,
    so snapshot - e = s0 - (every inner step's progress) whatever overlap carried where: nothing twice, nothing lost.
    Outer step 2 aborts once (its retry encodes the same e'); outer step 3 meets a stop after its exchange (its round
    stays in the weights and goes with the next boundary's, so e gives it back: unsent). "fragments": two fragments
    in flight for a step each (fragment_delay), each with its own accumulator; the run's end syncs both.
    "synchronous": no overlap, the same stop (a resume would send the round again: the same rule)."""
    steps = 12
    if update == "fragments":  # a fragment's outer step every inner step; the run's end sends both, whole
        rounds = [(1, 0), (2, 0), (2, 1), (3, 0)] + [(k, 0) for k in range(3, steps)]
        decisions = [True, False] + [True] * (len(rounds) - 3)
        parts = dict(fragments=2, fragment_delay=1)
    else:
        rounds = [(1, 0), (2, 0), (2, 1), (3, 0), (3, 0), (4, 0), (5, 0)]
        decisions = [True, False, True, True, True, True]
        parts = {} if update == "synchronous" else dict(overlap=True, overlap_update=update, overlap_delay=1)
    mesh = _StopOnce([make_plan(1, k, a, ["a"], source="a") for k, a in rounds], decisions, stop_at=[(3, 0)])
    inner = TinyInner(0)
    outer = make_outer(inner, mesh, inner_steps=2, compression="sparse", sparse_chunk=16, density=0.0625,
                       sparse_beta=1.0, **parts)
    outer.step.max_steps = steps
    progress = Progress()
    outer.start(progress)
    s0, trained, stops = outer.bufs.snapshot.clone(), torch.zeros(outer.bufs.numel), 0
    for step in range(1, steps + 1):  # 6 rounds: the stopped one goes with the next, 5 outer steps commit
        before = _flat(inner)
        inner.train_step(step)
        trained += before - _flat(inner)
        progress.step, progress.tokens = step, 64 * step
        try:
            outer.after_inner_step(progress)
        except Stopped:
            stops += 1
    outer.flush()
    assert stops == 1 and progress.outer_step == rounds[-1][0] and not mesh.plans
    e = torch.cat([ef.layout.unpack(ef.e) for ef in outer.codec.efs])  # the slices in order: the whole model
    assert all(not ef.staged and ef.e.abs().sum() > 0 for ef in outer.codec.efs)
    torch.testing.assert_close(outer.bufs.snapshot - e, s0 - trained, rtol=0, atol=2e-5)
    torch.testing.assert_close(_flat(inner), outer.bufs.snapshot, rtol=0, atol=0)  # landed at the boundary


def test_eager_stand_in_is_the_own_decoded_message_times_its_share_of_the_agreed_weights():
    """The stand-in is what the gathered mean adds of this node's message: decode(m) x w / W, W the contributors'
    total weight with the others' weights as the last mean agreed them (6 and 3) plus its own now (4): 4/13, not the
    1/3 a node would take alone from the count of contributors."""
    from engine.outer.sparse import RankOrderedSum
    inner = TinyInner(0)
    outer = make_outer(inner, FakeMesh([], []), inner_steps=2, compression="sparse", sparse_chunk=16,
                       density=0.0625, sparse_beta=0.5, overlap=True, overlap_update="eager")
    codec = outer.codec
    g = torch.Generator().manual_seed(5)
    codec.efs[0].e.copy_(codec.efs[0].layout.pack(torch.randn(outer.bufs.numel, generator=g)))
    e0 = codec.efs[0].layout.unpack(codec.efs[0].e)
    step = outer.step
    step.last_contributors, step.last_weights = 3, {"a": 2.0, "b": 6.0, "c": 3.0}
    share = step._share(Progress(step=4, outer_step=7, tokens=0), tokens=4)
    assert share.contributors == 3
    pgrad = torch.randn(outer.bufs.numel, generator=g)
    got = share.message(pgrad, torch.empty(outer.bufs.numel))
    ef = codec.efs[0]
    assert ef.staged and codec._staged_at[0] == 8  # e' = beta e + pgrad staged for the coming outer step
    torch.testing.assert_close(ef.layout.unpack(ef.e), 0.5 * e0 + pgrad, rtol=0, atol=0)
    # what the gathered mean adds of this node's message (rank 0 of [4, 9]), before the others arrive
    _, sent = ef.encode()
    added = torch.zeros(ef.layout.padded)
    RankOrderedSum(ef.codec, [4.0, 9.0], added).arrive(0, sent)
    assert torch.equal(got, ef.layout.unpack(added))
    assert not torch.allclose(got * 13 / 4, got * 3)  # the count's 1/3 is another stand-in
    # the step's attempts send the message encoded at the boundary, and an unsent step gives e' back
    codec.unsent(pgrad, 8)
    torch.testing.assert_close(ef.layout.unpack(ef.e), e0, rtol=0, atol=1e-6)
    assert not ef.staged


def test_an_eager_boundary_puts_the_own_message_in_the_working_weights():
    """One node: its share is 1, so the working weights after an eager boundary are snapshot - outer_lr x its decoded
    message, which is exactly where the agreed weights land (the mean of one is its message), not snapshot - its
    dense pseudo-gradient."""
    plans = [make_plan(1, k, 0, ["a"], source="a") for k in (1, 2)]
    inner = TinyInner(0)
    outer = make_outer(inner, FakeMesh(plans, [True, True]), inner_steps=2, compression="sparse", sparse_chunk=16,
                       density=0.0625, overlap=True, overlap_update="eager", overlap_delay=2, outer_lr=0.7)
    progress = Progress()
    outer.start(progress)
    s0 = outer.bufs.snapshot.clone()
    for step in (1, 2):
        inner.train_step(step)
        progress.step, progress.tokens = step, 64 * step
        outer.after_inner_step(progress)
    working = _flat(inner)
    assert outer.flight.done(timeout=30)
    outer.flush()
    agreed = outer.bufs.snapshot.clone()
    torch.testing.assert_close(working, agreed, rtol=0, atol=1e-6)
    assert (working - s0).abs().max() > 1e-3 and (working != s0).sum() < outer.bufs.numel / 4  # sparse, not dense


@pytest.mark.parametrize("update", ["delayed", "eager"])
def test_an_overlapped_sparse_run_resumed_from_a_checkpoint_saved_in_flight_continues_the_uninterrupted_one(update):
    """A checkpoint at step 4 lands the outer step launched at step 3 (as the session's save flushes it) and saves
    e after its commit; the resumed run equals the uninterrupted one (which flushes at step 4 too) bit for bit."""
    h, rounds, cut = 3, 3, 4

    def run(inner, first, steps, saved=None, cut_off=False):
        plans = [make_plan(1, k, 0, ["a"], source="a") for k in range(first, rounds + 1)]
        events: list[dict] = []
        outer = make_outer(inner, FakeMesh(plans, [True] * len(plans)), events=events, inner_steps=h,
                           compression="sparse", sparse_chunk=16, density=0.0625, sparse_beta=0.9, overlap=True,
                           overlap_update=update, overlap_delay=2)
        progress = Progress()
        if saved is not None:
            progress.load_state_dict(saved["progress"])
            outer.load_state_dict(saved["outer"])
        outer.start(progress)
        after = {}
        for step in steps:
            inner.train_step(step)
            progress.step, progress.tokens = step, 64 * step
            outer.after_inner_step(progress)
            if step == cut:
                outer.flush()  # the checkpoint's save lands the step in flight
                if cut_off:
                    return outer, progress, after
            after[step] = _flat(inner)
        outer.flush()
        return outer, progress, after

    full_inner = TinyInner(0)
    *_, want = run(full_inner, 1, range(1, h * rounds + 1))
    first_inner = TinyInner(0)
    first, progress, _ = run(first_inner, 1, range(1, cut + 1), cut_off=True)
    assert progress.outer_step == 1 and not first.flight.busy
    saved = _checkpoint({"model": first_inner.model.state_dict(), "optim": first_inner.opt.state_dict(),
                         "progress": progress.state_dict(), "outer": first.state_dict()})
    assert saved["outer"]["codec"]["accumulators"][0]["e"].abs().sum() > 0
    inner = TinyInner(99)
    inner.model.load_state_dict(saved["model"])
    inner.opt.load_state_dict(saved["optim"])
    _, _, got = run(inner, 2, range(cut + 1, h * rounds + 1), saved=saved)
    for step, params in got.items():
        assert torch.equal(params, want[step]), f"step {step}: parameters differ from the uninterrupted run's"


def _left_out_worker(rank: int, port: int, queue, update: str = "delayed") -> None:
    """Two nodes over a real gloo group, overlapped sparse, H = 2, landing one step in, beta 1: b's round 2 is
    poisoned (its pseudo-gradient 1000x a's per token), so the sentinel leaves b out of outer step 2."""
    import datetime
    import pickle
    import traceback

    import torch.distributed as dist
    from test_diloco_math import _group
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
        inner = TinyInner(0)
        inner.reset_optimizer_state = lambda: None
        plans = [make_plan(1, k, 0, ["a", "b"], source="a") for k in (1, 2, 3)]
        outer = make_outer(inner, FakeMesh(plans, [True] * 3), node="ab"[rank], min_nodes=2, inner_steps=2,
                           compression="sparse", sparse_chunk=16, density=0.0625, sparse_beta=1.0, overlap=True,
                           overlap_update=update, overlap_delay=1,
                           group_factory=lambda p, n, r: _group(store, p.rank_of(n), p.size, f"left/{update}/"),
                           events=(events := []))
        progress = Progress()
        outer.start(progress)
        ef, out = outer.codec.efs[0], {}
        for step in range(1, 7):
            inner.train_step(100 * rank + step)
            if rank == 1 and step == 4:
                with torch.no_grad():
                    for p in inner.model.parameters():
                        p.add_(1000.0)
            progress.step, progress.tokens = step, 64 * step
            outer.after_inner_step(progress)
            if step == 4:
                out["d2"] = ef.layout.pack(outer.bufs.pgrad.clone())  # round 2's pseudo-gradient, in flight
            if step in (3, 5):  # outer steps 1 and 2 landed: their commits are done
                out[f"e{step}"] = ef.e.clone()
        outer.flush()
        out["events"] = [{k: e[k] for k in ("outer_step", "checksum", "contributors", "left_out") if k in e}
                         for e in events if e["type"] == "outer_step"]
        queue.put((rank, pickle.dumps(out)))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


def test_a_node_the_sentinel_leaves_out_of_an_overlapped_sparse_step_drops_the_judged_round_from_e():
    """The sentinel leaves b out of outer step 2 in flight: b's e after it is the e before it (e' - d2: the judged
    round leaves e, as its weights take the agreed ones when the step lands; docs/sparse.md, "In the elastic run"),
    a's is e + d2 - sent; both agree on every checksum."""
    from procs import spawned_ranks
    got = spawned_ranks(_left_out_worker, 2, timeout=120)
    a, b = got[0], got[1]
    assert a["events"] == b["events"] and [e["outer_step"] for e in a["events"]] == [1, 2, 3]
    step2 = a["events"][1]
    assert step2["left_out"] == ["b"] and step2["contributors"] == ["a"], a["events"]
    # e' - d2 with beta 1, to the rounding of e' = e3 + d2 (d2 is poisoned: ~1000, so an ulp of it is ~1e-4); kept
    # whole, e3 + d2, is d2 away: far outside the tolerance
    ulps = 8 * torch.finfo(torch.float32).eps * float(b["d2"].abs().max())
    assert torch.allclose(b["e5"], b["e3"], rtol=0, atol=ulps) and b["d2"].abs().max() > 100 * ulps
    sent = a["e3"] + a["d2"] - a["e5"]  # what a sent of its round: a few values, not all
    assert 0 < int((sent != 0).sum()) < sent.numel() / 4


def test_a_dense_run_writes_no_codec_state():
    outer = make_outer(TinyInner(0), FakeMesh([], []), inner_steps=2, compression="int8")
    assert "codec" not in outer.state_dict()


# ------------------------------------------------------------------------------------------ two real engines

@pytest.fixture(scope="module")
def two_sparse_nodes(tmp_path_factory):
    """a and b: the debug model, 30 inner steps at H = 3 (10 outer steps), compression sparse, a real store,
    overlapped after diloco.overlap_after = 2 outer steps, a landing delayed and b eager (how a node lands may
    differ); then both resumed from their last checkpoint (step 30) for 6 more steps (outer steps 11 and 12)."""
    from procs import ProcessTracker, free_port
    from test_diloco_e2e import finish, start_node, start_store
    procs, run_dir = ProcessTracker(), tmp_path_factory.mktemp("sparse")
    common = ["--diloco.min_nodes=2", "--diloco.compression=sparse", "--diloco.overlap=true",
              "--diloco.overlap_after=2", "--diloco.overlap_delay=1"]
    update = {"a": "--diloco.overlap_update=delayed", "b": "--diloco.overlap_update=eager"}
    try:
        runs = []
        for phase, steps in (("first", 30), ("resumed", 36)):
            port = free_port()  # a fresh store for the resumed run: the first run's keys belong to it
            start_store(procs, port)
            resume = {n: [f"--ckpt.resume={run_dir / 'first' / n / 'checkpoints' / 'step-00000030'}"]
                      if phase == "resumed" else [] for n in "ab"}
            nodes = [start_node(procs, port, n, run_dir / phase, f"--train.max_steps={steps}", *common, update[n],
                                *resume[n]) for n in "ab"]
            runs.append((nodes, [finish(n, 300, nodes) for n in nodes]))
        yield runs
    finally:
        procs.kill_all()


def test_two_engines_train_with_sparse_and_agree_on_every_outer_step(two_sparse_nodes):
    from engine.config import ModelConfig
    from engine.model import build_model
    nodes, codes = two_sparse_nodes[0]
    assert codes == [0, 0], "\n".join(n.report() for n in nodes)
    a, b = (n.outer() for n in nodes)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for k in a:
        assert a[k]["checksum"] == b[k]["checksum"], f"outer step {k}: the nodes' weights differ"
        assert a[k]["members"] == ["a", "b"] and a[k]["contributors"] == ["a", "b"]
    # the bytes on the wire: this node's weight and message to the other, nothing more
    model = build_model(ModelConfig(preset="debug"), 258, 32)
    facts = [e for e in nodes[0].of("state") if "params" in e]
    assert facts and facts[0]["params"] == sum(p.numel() for p in model.parameters()), "another model than built here"
    numels = [p.numel() for p in model.parameters()]
    codec = Sparse(SparseSpec(), numels, [(0, sum(numels))], lambda s: 0)
    want = gather.bytes_sent(codec.efs[0].codec, 2)
    for ev in (*a.values(), *b.values()):
        assert ev["bytes_sent"] == want
        assert ev["bytes_sent"] * 50 < ev["fp32_bytes"], (ev["bytes_sent"], ev["fp32_bytes"])
        assert ev["residual_norm"] > 0 and ev["weights_norm"] > 0
    for n in nodes:  # it learns: the last steps' loss well under the first steps'
        losses = [e["loss"] for e in n.of("step") if e.get("loss") is not None]
        assert len(losses) >= 20 and sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses


def test_two_nodes_of_two_fsdp_workers_train_with_sparse_on_their_shards(procs, tmp_path):
    """Each rank keeps the accumulator of the shard it owns (its layout over its own outer buffers); b starts from
    other weights and adopts a's at the run's first outer step (its accumulator reset); the checksums agree."""
    from test_diloco_e2e import two_fsdp_nodes
    nodes = two_fsdp_nodes(procs, tmp_path, "--diloco.compression=sparse", timeout=300)
    for k in (1, 2, 3):
        a, b = nodes[0].outer()[k], nodes[1].outer()[k]
        assert a["bytes_sent"] == b["bytes_sent"] > 0 and a["bytes_sent"] * 50 < a["fp32_bytes"]
        assert a["residual_norm"] > 0


def test_two_engines_overlap_sparse_after_the_first_outer_steps_and_agree_on_every_one(two_sparse_nodes):
    """The first diloco.overlap_after = 2 outer steps land at their boundary, the later ones overlap, the resumed
    run's too (past 2); every checksum agrees, on a sparse wire."""
    for (nodes, codes), steps in zip(two_sparse_nodes, (list(range(1, 11)), [11, 12])):
        assert codes == [0, 0], "\n".join(n.report() for n in nodes)
        a, b = (n.outer() for n in nodes)
        assert sorted(a) == sorted(b) == steps, "\n".join(n.report() for n in nodes)
        for k in steps:
            assert a[k]["checksum"] == b[k]["checksum"], f"outer step {k}: the nodes' weights differ"
            assert a[k]["contributors"] == b[k]["contributors"] == ["a", "b"]
            assert a[k]["overlapped"] is b[k]["overlapped"] is (k > 2), (k, a[k], b[k])
            assert 0 < a[k]["bytes_sent"] * 50 < a[k]["fp32_bytes"] and a[k]["residual_norm"] > 0
