"""diloco.compression = "sparse" in the elastic run (issue 43, items 3 and 4): the accumulator through the sentinel
and the token weights of three members over real gloo groups, ZeRO's shards in two real engines with a checkpoint
resumed, and the unsent residuals at the run's end (docs/sparse.md, "The accumulator in the elastic run").
The join, drain, death and store faults with sparse: tests/test_chaos.py's short run."""

from __future__ import annotations

import datetime
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist

from engine.outer import Progress
from procs import spawned_ranks
from test_diloco_math import FakeMesh, _group, make_outer, make_plan
from test_sentinel import Inner

SPARSE = {"compression": "sparse", "sparse_chunk": 16, "density": 0.25, "sparse_beta": 0.5}  # k = 4 of each 16


def _flat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1).clone() for t in ts])


def _three_sparse_nodes(rank: int, port: int, queue, *, scale: float, tokens: int, rounds: int = 1) -> None:
    """a, b, c train from the same weights on their own batches, sparse, plain averaging (p = snapshot - mean), for
    `rounds` outer steps of H = 1 (two inner steps each); in the first, c's pseudo-gradient is scaled by `scale` and
    its round weighs `tokens` (a's and b's: 100); later rounds are clean and weigh 100 each."""
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, 3, rank == 0, timeout=datetime.timedelta(seconds=30))
        node = "abc"[rank]
        inner, events, out = Inner(0), [], []
        plans = [make_plan(1, k, 0, ["a", "b", "c"], source="a") for k in range(1, rounds + 1)]
        outer = make_outer(inner, FakeMesh(plans, [True] * rounds), node=node, events=events, inner_steps=1,
                           outer_optimizer="average", min_nodes=3, **SPARSE,
                           group_factory=lambda p, n, r: _group(store, p.rank_of(n), p.size, "sparse/"))
        progress = Progress()
        outer.start(progress)
        ef = outer.codec.efs[0]
        for k in range(1, rounds + 1):
            start, e_before = _flat(inner.outer_params()), ef.layout.unpack(ef.e)
            inner.train_step(10 * k + rank)  # different data: pseudo-gradients that share a direction
            inner.train_step(10 * k + 5 + rank)
            trained = _flat(inner.outer_params())
            if node == "c" and k == 1:
                trained = start - scale * (start - trained)
                with torch.no_grad():
                    for p, t in zip(inner.outer_params(), trained.split([p.numel() for p in inner.outer_params()])):
                        p.copy_(t.reshape(p.shape))
            progress.step, progress.tokens = k, progress.tokens + (tokens if node == "c" and k == 1 else 100)
            outer.after_inner_step(progress)
            out.append({"pgrad": start - trained, "start": start, "after": _flat(inner.outer_params()),
                        "e_before": e_before, "e": ef.layout.unpack(ef.e).clone(), "staged": ef.staged,
                        "resets": inner.resets, "event": [e for e in events if e["type"] == "outer_step"][k - 1],
                        "warned": [e["message"] for e in events if e["type"] == "warning"]})
        queue.put((rank, pickle.dumps(out)))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


def _poisoned(rank: int, port: int, queue) -> None:
    _three_sparse_nodes(rank, port, queue, scale=100.0, tokens=100, rounds=2)


def _fast(rank: int, port: int, queue) -> None:
    _three_sparse_nodes(rank, port, queue, scale=20.0, tokens=2000)


def test_the_sentinel_leaves_out_a_x100_node_on_its_dense_pseudo_gradient_and_its_round_leaves_the_accumulator():
    """The sentinel judges each member's dense pseudo-gradient, before its top-k (sparse messages of different
    supports would have a cosine near 0): c is left out and takes the run's weights with fresh optimizer state. a
    and b keep what they did not send (e = e' - sent) and the run moved by the mean of what they sent. c keeps its
    accumulator less the round the sentinel rejected (e = e' - delta = beta x e: here 0, its first round): kept
    whole, e' sent the x100 round at the next step, 45x a clean message, past a sentinel that saw a clean round."""
    runs = spawned_ranks(_poisoned, 3, timeout=90)
    a, b, c = (runs[r][0] for r in range(3))
    got = {r: runs[r][0] for r in range(3)}
    sent = {n: got[r]["pgrad"] - got[r]["e"] for r, n in enumerate("ab")}
    for n, r in (("a", a), ("b", b)):
        # a member counted: its accumulator is what it did not send, and it sent k = 4 of each chunk of 16
        assert 0 < int((sent[n] != 0).sum()) <= 4 * 3 and int((sent[n] != 0).sum()) < sent[n].numel()
        assert not r["staged"]
    for r in (a, b, c):
        e = r["event"]
        assert e["left_out"] == ["c"] and e["contributors"] == ["a", "b"] and e["weights"] == [100.0, 100.0], e
        torch.testing.assert_close(r["after"], r["start"] - (sent["a"] + sent["b"]) / 2, rtol=0, atol=1e-6)
        assert any("left out of the mean by the sentinel: c (" in w for w in r["warned"]), r["warned"]
    assert a["event"]["checksum"] == b["event"]["checksum"] == c["event"]["checksum"]
    assert [a["resets"], b["resets"], c["resets"]] == [0, 0, 1]
    assert c["e"].abs().max() == 0 and not c["staged"], "the rejected round stayed in the accumulator"
    # round 2, clean everywhere: every member counted, c's message the size of the others'
    two = [runs[r][1] for r in range(3)]
    sent2 = [0.5 * r["e_before"] + r["pgrad"] - r["e"] for r in two]  # e' - e (beta 0.5)
    for r in two:
        assert "left_out" not in r["event"] and r["event"]["contributors"] == ["a", "b", "c"], r["event"]
        torch.testing.assert_close(r["after"], r["start"] - sum(sent2) / 3, rtol=0, atol=1e-6)
    assert sent2[2].norm() < 3 * min(sent2[0].norm(), sent2[1].norm()), [float(x.norm()) for x in sent2]
    assert len({r["event"]["checksum"] for r in two}) == 1


def test_a_rejected_round_leaves_the_residual_of_the_rounds_before():
    """reject(delta) after a committed step: e = e' - delta = beta x e, what the node had not sent of the rounds
    that passed, released for the next step (which stages beta x e + its next round)."""
    from engine.outer.codec import Sparse
    from engine.outer.sparse import SparseSpec
    spec = SparseSpec(chunk=16, density=1 / 16, bits=2, beta=0.5)
    codec, g = Sparse(spec, [40, 8], [(0, 48)], lambda step: 0), torch.Generator().manual_seed(3)
    d1, d2 = torch.randn(48, generator=g), torch.randn(48, generator=g)
    codec.stage(d1, 1, 0)
    out = torch.zeros(48)
    from engine.outer.allreduce import Exchange
    codec.mean(out, 1.0, None, out=out, wire=Exchange())
    codec.commit()
    ef = codec.efs[0]
    e1 = ef.layout.unpack(ef.e)
    assert e1.abs().sum() > 0
    codec.stage(d2, 2, 0)
    codec.reject(d2)
    assert not ef.staged
    torch.testing.assert_close(ef.layout.unpack(ef.e), 0.5 * e1, rtol=0, atol=1e-6)
    codec.stage(d1, 3, 0)  # the next step stages from it, once
    torch.testing.assert_close(ef.layout.unpack(ef.e), 0.25 * e1 + d1, rtol=0, atol=1e-6)


def test_a_node_that_trained_more_tokens_weighs_its_sparse_message_by_them():
    """Token weights: c trained 20x the tokens of a and b (a fast host on time rounds), a pseudo-gradient 20x
    theirs. Not a scale gone wrong: every member weighs each decoded message by its sender's tokens, the weights as
    they travelled with the messages, so the mean is not the plain one a member would take alone."""
    got = {r: run[0] for r, run in spawned_ranks(_fast, 3, timeout=90).items()}
    sent = [got[r]["pgrad"] - got[r]["e"] for r in range(3)]
    want = got[0]["start"] - (100 * sent[0] + 100 * sent[1] + 2000 * sent[2]) / 2200
    for r in range(3):
        e = got[r]["event"]
        assert "left_out" not in e and e["weights"] == [100.0, 100.0, 2000.0], e
        torch.testing.assert_close(got[r]["after"], want, rtol=0, atol=1e-5)
        assert not got[r]["staged"] and got[r]["resets"] == 0
    plain = got[0]["start"] - sum(sent) / 3
    assert (got[0]["after"] - plain).abs().max() > 1e-3  # the weights moved the mean, visibly
    assert len({got[r]["event"]["checksum"] for r in range(3)}) == 1


# ------------------------------------------------------------------------------------------ ZeRO's shards, resumed

ZERO = ["--train.max_steps=9", "--diloco.min_nodes=2", "--inner.strategy=zero2", "--train.batch_size=4",
        "--optim.name=adamw", "--diloco.compression=sparse", "--ckpt.interval=3", "--ckpt.keep=5"]  # Muon: not ZeRO
STEP6 = "checkpoints/step-00000006"


def _two_zero_nodes(procs, run_dir, resume=None) -> list:
    from procs import free_port
    from test_diloco_e2e import finish, start_node, start_store
    port = free_port()  # a store each: a run's membership keys belong to that run
    start_store(procs, port)
    nodes = [start_node(procs, port, n, run_dir, *ZERO, *([f"--ckpt.resume={resume / n / STEP6}"] if resume else []),
                        workers=2) for n in "ab"]
    for n in nodes:
        assert finish(n, 300, nodes) == 0, n.report()
    return nodes


@pytest.mark.slow
def test_two_nodes_of_two_zero2_workers_keep_their_shards_accumulators_and_a_resume_continues_the_run(procs,
                                                                                                    tmp_path):
    """Each ZeRO-2 rank keeps the accumulator of the fp32 partition it owns (the memory estimate counts one more
    fp32 copy of it); the nodes agree on every checksum; both nodes resumed from their checkpoints of step 6
    (outer step 2) commit outer step 3 with the uninterrupted run's checksum: the accumulators came back."""
    from engine.config import load_config
    from engine.memory import estimate
    from test_diloco_e2e import CONFIG, FAST, assert_identical
    nodes = _two_zero_nodes(procs, tmp_path / "full")
    assert_identical(nodes)
    assert sorted(nodes[0].outer()) == [1, 2, 3]
    for k in (1, 2, 3):
        a, b = nodes[0].outer()[k], nodes[1].outer()[k]
        assert a["bytes_sent"] == b["bytes_sent"] > 0 and a["bytes_sent"] * 50 < a["fp32_bytes"]
        assert a["residual_norm"] > 0
    ranks = [torch.load(tmp_path / "full" / "a" / STEP6 / f"rank-{r}.pt", weights_only=False,
                        map_location="cpu")["outer"] for r in (0, 1)]
    es = [torch.cat([acc["e"].reshape(-1) for acc in o["codec"]["accumulators"]]) for o in ranks]
    # each rank's accumulator covers its own partition, not the model: the snapshot's values, and not the other's
    assert [e.numel() for e in es] == [o["snapshot"].numel() for o in ranks]
    assert all(e.abs().sum() > 0 for e in es) and not torch.equal(es[0], es[1])
    cfg = load_config(CONFIG, [*FAST, *ZERO])
    counted = {p.name: p.bytes for p in estimate(cfg, workers=2, device="cpu").parts}["sparse accumulator"]
    assert counted == 4 * es[0].numel(), (counted, es[0].numel())

    resumed = _two_zero_nodes(procs, tmp_path / "resumed", resume=tmp_path / "full")
    got = {k: {n.outer()[k]["checksum"] for n in resumed} for k in resumed[0].outer()}
    assert got == {3: {nodes[0].outer()[3]["checksum"]}}, (got, nodes[0].outer())
