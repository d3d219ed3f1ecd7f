"""The sparse messages' collective (engine/outer/gather.py) on real gloo groups of 2 and 3 processes: every rank's
mean is the same bytes, equal to the mean one process computes from the same messages in rank order, token-weighted
(divided by the total weight of the contributors, not by the members), a member of weight 0 ignored whatever it
sends, and the bytes counted are the bytes of the messages sent (weight included)."""

from __future__ import annotations

import datetime
import traceback

import pytest
import torch
import torch.distributed as dist

from procs import spawned_ranks

from engine.outer import allreduce
from engine.outer.gather import GatherPieces, bytes_sent, gather_mean, gather_pieces
from engine.outer.sparse import ChunkLayout, ErrorFeedback, SparseCodec, SparseSpec, gathered_mean

SHAPES = [(48, 64), (300,), (7,), (1,), (129, 16)]  # whole chunks, a tensor's short last chunk, tensors under k
SPEC = SparseSpec(chunk=64, density=0.2, bits=4, beta=0.9)
PIECES = {"whole": 64 * 1024, "pieces": 97}  # allreduce.PIECE_BYTES: one piece, or many with a short last one
# per rank; None: a member of weight 0 that has no message (a joiner) and sends zeros. "left-out" is a member of
# weight 0 that sends its real message (the sentinel left it out): it must not count either
CASES = {
    "unequal": (2.0, 1.0, 0.5),
    "joiner": (3.0, None, 1.5),
    "left-out": (3.0, 0.0, 1.5),
    "past-2^24": (2.0**24 + 1, 3.0, 7.0),  # tokens of a large round: not an fp32; every rank must see the one sent
    "nobody": (0.0, None, 0.0),
}


def _codec() -> SparseCodec:
    return SparseCodec(SPEC, ChunkLayout(SHAPES, SPEC))


def _message(codec: SparseCodec, rank: int, rnd: int):
    """Rank's message of round rnd: its accumulator after rnd + 1 rounds of pseudo-gradients that share a
    common part, so that the members' supports overlap (where the order of the sum shows in the last bits)."""
    ef = ErrorFeedback(codec)
    for r in range(rnd + 1):
        g = torch.Generator().manual_seed(100 * r)
        common = torch.randn(codec.layout.numel, generator=g)
        own = torch.randn(codec.layout.numel, generator=torch.Generator().manual_seed(1000 * r + rank))
        ef.stage(common + 0.7 * own * (1 + rank))
        msg, sent = ef.encode()
        if r < rnd:
            ef.commit(sent)
    return msg, sent


def _group(store, name: str, rank: int, size: int) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore(f"{name}/", store)
    pg = dist.ProcessGroup(prefixed, rank, size)
    backend = dist.ProcessGroupGloo(prefixed, rank, size, datetime.timedelta(seconds=20))
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


def _run(rank: int, port: int, queue, size: int) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=30))
        codec, out = _codec(), {}
        ex = allreduce.Exchange("cpu")
        for name, weights in CASES.items():
            pg = _group(store, name, rank, size)
            w = weights[rank]
            for cut, piece_bytes in PIECES.items():
                allreduce.PIECE_BYTES = piece_bytes
                for rnd in range(2):
                    msg, sent = _message(codec, rank, rnd)
                    mean = torch.full((codec.layout.padded,), float("nan"))
                    try:
                        stats = gather_mean(codec, None if w is None else msg, w or 0.0, pg, out=mean,
                                            own=None if w is None else sent, exchange=ex)
                    except allreduce.NothingToAverage as e:
                        out[name, cut, rnd] = ("nothing", str(e))
                        continue
                    out[name, cut, rnd] = (mean, stats.total_weight, stats.weights, stats.bytes_sent, msg.numel())
        queue.put((rank, __import__("pickle").dumps(out)))
    except BaseException:  # noqa: BLE001 - the parent fails with the traceback
        queue.put((rank, traceback.format_exc()))


def _run2(rank, port, queue):
    _run(rank, port, queue, 2)


def _run3(rank, port, queue):
    _run(rank, port, queue, 3)


@pytest.fixture(scope="module")
def results():
    return {2: spawned_ranks(_run2, 2, timeout=120), 3: spawned_ranks(_run3, 3, timeout=120)}


def _fp32(w: float) -> float:
    return float(torch.tensor(w, dtype=torch.float32))  # as it travels


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", CASES)
def test_every_rank_has_the_same_bytes_as_one_process_computes(results, size, name):
    codec = _codec()
    weights = [_fp32(w or 0.0) for w in CASES[name][:size]]
    for cut in PIECES:
        for rnd in range(2):
            got = [results[size][r][name, cut, rnd] for r in range(size)]
            if not any(weights):  # nobody contributed: every rank says so, none computes a mean
                assert all(g == ("nothing", "every rank of the group has weight 0") for g in got), got
                continue
            msgs = [_message(codec, r, rnd)[0] for r in range(size)]
            ref = torch.empty(codec.layout.padded)
            total = gathered_mean(codec, msgs, weights, ref)
            for r, g in enumerate(got):
                assert torch.equal(g[0], ref), f"{name}/{cut}/round {rnd}: rank {r} differs from the reference"
                # every rank saw every rank's weight, as it travelled, and the total of the contributors
                assert g[1] == total == sum(w for w in weights if w > 0) and g[2] == weights, (name, g[1:])
                # the bytes counted are the bytes sent: its weight and its message to each other rank
                assert g[4] == codec.bytes and g[3] == (size - 1) * (4 + g[4]) == bytes_sent(codec, size)


@pytest.mark.parametrize("size", [2, 3])
def test_the_mean_is_token_weighted_over_the_contributors_in_float64_too(results, size):
    """Against an independent float64 mean of the decoded messages: divided by the total weight of those counted
    (not by the members, and a member of weight 0 adds nothing, whatever it sent)."""
    codec = _codec()
    for name in ("unequal", "left-out", "joiner", "past-2^24"):
        weights = [_fp32(w or 0.0) for w in CASES[name][:size]]
        if not any(weights):
            continue
        dense = [_message(codec, r, 1)[1].dense(codec.layout.padded).double() for r in range(size)]
        exact = sum(w * d for w, d in zip(weights, dense)) / sum(weights)
        got = results[size][0][name, "pieces", 1][0].double()
        scale = float(exact.abs().max())
        assert float((got - exact).abs().max()) <= 1e-6 * scale, name
        wrong = sum(w * d for w, d in zip(weights, dense)) / size  # the bug this test exists for
        if name != "unequal" or size == 3:
            assert float((wrong - exact).abs().max()) > 0.01 * scale
        if 0.0 in weights:  # the member of weight 0 sent a message that would show
            counted = [r for r, w in enumerate(weights) if w > 0]
            with_it = (sum(weights[r] * dense[r] for r in counted) + dense[weights.index(0.0)]) / sum(weights)
            assert float((with_it - exact).abs().max()) > 0.01 * scale


def test_the_order_of_the_sum_shows_in_the_bits(results):
    """The reason for rank order: added in another order, the same messages give other bytes here (so a rank that
    added them as they arrived would disagree with the others)."""
    codec = _codec()
    weights = [_fp32(w) for w in CASES["unequal"]]
    msgs = [_message(codec, r, 1)[0] for r in range(3)]
    ref, other = torch.empty(codec.layout.padded), torch.empty(codec.layout.padded)
    gathered_mean(codec, msgs, weights, ref)
    gathered_mean(codec, msgs[1:] + msgs[:1], weights[1:] + weights[:1], other)
    assert not torch.equal(ref, other)
    assert torch.equal(results[3][1]["unequal", "pieces", 1][0], ref)


@pytest.mark.parametrize("length", [4, 5, 96, 97, 98, 1000, 97 * 512, 97 * 512 + 1, 10**6])
def test_pieces_cover_the_message_exactly_none_empty(length, monkeypatch):
    monkeypatch.setattr(allreduce, "PIECE_BYTES", 97)
    codec = _codec()
    monkeypatch.setattr(codec, "bytes", length - 4)
    g = gather_pieces(codec)
    spans = [g.span(c) for c in range(g.pieces)]
    assert sum(s.stop - s.start for s in spans) == length and all(s.stop > s.start for s in spans)
    assert spans[0].start == 0 and all(a.stop == b.start for a, b in zip(spans, spans[1:]))
    # pieces of at most PIECE_BYTES, unless that takes more than MAX_PIECES: then MAX_PIECES at most, as equal as can be
    assert g.pieces <= allreduce.MAX_PIECES and g.pc <= max(97, -(-length // allreduce.MAX_PIECES))
    assert isinstance(g, GatherPieces)


def test_one_member_alone_sends_nothing_and_gets_its_own_update():
    codec = _codec()
    msg, sent = _message(codec, 0, 0)
    mean = torch.empty(codec.layout.padded)
    stats = gather_mean(codec, msg, 5.0, None, out=mean, own=sent)
    assert stats.bytes_sent == 0 and stats.weights == [5.0] and stats.total_weight == 5.0
    assert torch.allclose(mean, codec.decode(msg), rtol=1e-6, atol=0)
    with pytest.raises(allreduce.NothingToAverage):
        gather_mean(codec, None, 0.0, None, out=mean)


def test_prepare_allocates_the_wire_buffers_the_gather_then_uses():
    codec, ex = _codec(), allreduce.Exchange("cpu")
    from engine.outer.gather import prepare
    prepare(ex, codec, 3)
    assert ex.nbytes() == (1 + 3) * (4 + codec.bytes)
    before = ex.buf("gather_recv", (3, 4 + codec.bytes), torch.uint8, host=True).data_ptr()
    ex.prepare(codec.layout.numel, 3, "sparse")  # the dense codecs' prepare leaves sparse to gather.prepare
    assert ex.nbytes() == (1 + 3) * (4 + codec.bytes)
    assert ex.buf("gather_recv", (3, 4 + codec.bytes), torch.uint8, host=True).data_ptr() == before
    prepare(ex, codec, 1)  # a run that may stay one node allocates nothing more
    assert ex.nbytes() == (1 + 3) * (4 + codec.bytes)
