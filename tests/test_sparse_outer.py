"""diloco.compression = "sparse" wired into the outer loop (issue 43, items 1, 3, 4): the Sparse codec's state moves
with the outer step (engine/outer/codec.py), is checkpointed and restored, and two real engines over a real store
train with it (gloo): the same checksums on both nodes, the bytes of the gathered messages on the wire, far fewer
than fp32's, and a loss that goes down."""

from __future__ import annotations

import io

import pytest
import torch

from engine.config import DilocoConfig
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


def test_overlap_with_sparse_is_refused_in_one_line_until_it_is_wired():
    with pytest.raises(ValueError) as e:
        make_outer(TinyInner(0), FakeMesh([], []), inner_steps=2, compression="sparse", overlap=True)
    assert str(e.value) == ('diloco.overlap with diloco.compression = "sparse": not wired yet (docs/sparse.md, '
                            '"What is left"); use one of them')
    make_outer(TinyInner(0), FakeMesh([], []), inner_steps=2, compression="int8", overlap=True)


def test_a_dense_run_writes_no_codec_state():
    outer = make_outer(TinyInner(0), FakeMesh([], []), inner_steps=2, compression="int8")
    assert "codec" not in outer.state_dict()


# ------------------------------------------------------------------------------------------ two real engines

@pytest.fixture(scope="module")
def two_sparse_nodes(tmp_path_factory):
    """a and b: the debug model, 30 inner steps at H = 3 (10 outer steps), compression sparse, a real store."""
    from procs import ProcessTracker, free_port
    from test_diloco_e2e import finish, start_node, start_store
    procs, port, run_dir = ProcessTracker(), free_port(), tmp_path_factory.mktemp("sparse")
    try:
        start_store(procs, port)
        args = ["--train.max_steps=30", "--diloco.min_nodes=2", "--diloco.compression=sparse"]
        nodes = [start_node(procs, port, n, run_dir, *args) for n in "ab"]
        codes = [finish(n, 300, nodes) for n in nodes]
        yield nodes, codes
    finally:
        procs.kill_all()


def test_two_engines_train_with_sparse_and_agree_on_every_outer_step(two_sparse_nodes):
    from engine.config import ModelConfig
    from engine.model import build_model
    nodes, codes = two_sparse_nodes
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
    from procs import free_port
    from test_diloco_e2e import assert_identical, finish, start_node, start_store
    port = free_port()
    start_store(procs, port)
    steps = ["--train.max_steps=9", "--diloco.min_nodes=2", "--inner.strategy=fsdp", "--train.batch_size=4",
             "--diloco.compression=sparse"]
    nodes = [start_node(procs, port, "a", tmp_path, *steps, workers=2),
             start_node(procs, port, "b", tmp_path, *steps, "--train.init_seed=7", workers=2)]
    for n in nodes:
        assert finish(n, 300, nodes) == 0, n.report()
    assert_identical(nodes)
    assert any("adopted the source's" in e["message"] for n in nodes for e in n.of("warning"))
    assert sorted(nodes[0].outer()) == [1, 2, 3]
    for k in (1, 2, 3):
        a, b = nodes[0].outer()[k], nodes[1].outer()[k]
        assert a["bytes_sent"] == b["bytes_sent"] > 0 and a["bytes_sent"] * 50 < a["fp32_bytes"]
        assert a["residual_norm"] > 0
