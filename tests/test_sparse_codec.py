"""The sparse codec with error feedback (engine/outer/sparse.py): settings, layout, wire format, top-k, quantizer,
the accumulator's stage/commit/abort/reset, and the gathered mean's bytes. Pure torch on the CPU, fast; and
bench/sparse_codec.py's plumbing (a debug-preset round, a bad argument)."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from procs import ROOT

from engine.outer import sparse
from engine.outer.bitpack import pack_bits, unpack_bits
from engine.outer.sparse import (ChunkLayout, ErrorFeedback, NothingGathered, RankOrderedSum, SparseCodec, SparseSpec,
                                 bytes_ratio, gathered_mean, message_bytes)


def _codec(shapes, **kw):
    spec = SparseSpec(**kw)
    layout = ChunkLayout(shapes, spec)
    return SparseCodec(spec, layout)


def _buf(codec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return codec.layout.pack([torch.randn(s, generator=g) for s in codec.layout.shapes])


# ---- settings ----

@pytest.mark.parametrize("kw, key", [
    (dict(chunk=8), "diloco.sparse_chunk"), (dict(chunk=4095), "diloco.sparse_chunk"),
    (dict(chunk=1 << 17), "diloco.sparse_chunk"), (dict(chunk=64.0), "diloco.sparse_chunk"),
    (dict(chunk=True), "diloco.sparse_chunk"),
    (dict(density=0), "diloco.density"), (dict(density=1.0001), "diloco.density"),
    (dict(density=float("nan")), "diloco.density"), (dict(density="0.01"), "diloco.density"),
    (dict(bits=3), "diloco.sparse_bits"), (dict(bits=16), "diloco.sparse_bits"),
    (dict(bits=True), "diloco.sparse_bits"),
    (dict(beta=-0.01), "diloco.sparse_beta"), (dict(beta=1.01), "diloco.sparse_beta"),
    (dict(beta=float("inf")), "diloco.sparse_beta"),
])
def test_bad_settings_name_their_key_and_value(kw, key):
    with pytest.raises(ValueError) as e:
        SparseSpec(**kw)
    assert str(e.value).startswith(key + ": ") and repr(next(iter(kw.values())))[:4] in str(e.value)


@pytest.mark.parametrize("kw", [dict(chunk=16), dict(chunk=1 << 16), dict(chunk=4096), dict(density=1.0),
                                dict(density=1e-9), dict(bits=2), dict(bits=4), dict(bits=8), dict(beta=0.0),
                                dict(beta=1.0)])
def test_good_settings_at_the_edges(kw):
    SparseSpec(**kw)


def test_k_is_density_times_chunk_rounded_at_least_one():
    assert SparseSpec(chunk=4096, density=0.0156).k == 64
    assert SparseSpec(chunk=4096, density=0.01).k == 41
    assert SparseSpec(chunk=64, density=0.001).k == 1
    assert SparseSpec(chunk=64, density=1.0).k == 64
    assert SparseSpec(chunk=4096).index_bits == 12 and SparseSpec(chunk=64).index_bits == 6


# ---- packing ----

@pytest.mark.parametrize("width", range(1, 17))
def test_bits_round_trip_at_every_width_in_exactly_ceil_n_w_over_8_bytes(width):
    g = torch.Generator().manual_seed(width)
    for n in (1, 7, 8, 9, 1000, 4097):
        v = torch.randint(0, 1 << width, (n,), generator=g)
        v[0] = (1 << width) - 1  # the top value: every bit set
        b = pack_bits(v, width)
        assert b.dtype == torch.uint8 and b.numel() == math.ceil(n * width / 8)
        assert torch.equal(unpack_bits(b, width, n), v)


# ---- layout: chunks never cross a tensor ----

def test_each_tensor_starts_a_chunk_and_its_last_chunk_is_padded():
    c = 64
    lay = ChunkLayout([(1,), (c + 1,), (c,), (3, 5)], SparseSpec(chunk=c, density=0.05))
    assert lay.offsets == [0, c, 3 * c, 4 * c] and lay.padded == 5 * c and lay.chunks == 5
    assert lay.fill == [1, c, 1, c, 15] and lay.keep == [1, 3, 1, 3, 3] and lay.entries == 11
    buf = lay.pack([torch.full(s, float(i + 1)) for i, s in enumerate(lay.shapes)])
    # every value in its tensor's chunks, the pads zero
    assert [v.unique().tolist() for v in lay.views(buf)] == [[1.0], [2.0], [3.0], [4.0]]
    assert buf.count_nonzero() == lay.numel
    assert torch.equal(lay.unpack(buf), torch.cat([torch.full((s.numel(),), float(i + 1))
                                                    for i, s in enumerate(lay.shapes)]))


@pytest.mark.parametrize("fill", [0.0, 1.0])
def test_padding_is_never_selected_even_against_zeros(fill):
    """A 1-value tensor and a chunk+1-value tensor: each sends only its own values, even when every value is zero
    (a pad and a value tie at 0)."""
    c = 64
    codec = _codec([(1,), (c + 1,)], chunk=c, density=0.1)  # k 6: the short chunks send all they hold
    lay = codec.layout
    buf = lay.pack([torch.full((1,), fill), torch.full((c + 1,), fill)])
    _, sent = codec.encode(buf)
    pos = sent.pos.tolist()
    assert len(pos) == lay.entries == 1 + 6 + 1 and len(set(pos)) == len(pos)
    real = {0} | set(range(c, 2 * c + 1))
    assert set(pos) <= real and {0, 2 * c} <= set(pos)  # both 1-value chunks sent their value


# ---- top-k and the quantizer ----

@pytest.mark.parametrize("chunk, density", [(64, 0.05), (256, 0.02), (4096, 0.0156), (4096, 0.6), (1024, 1.0)])
def test_topk_picks_the_largest_magnitudes_of_each_chunk(chunk, density):
    codec = _codec([(3, chunk), (chunk // 2 + 3,)], chunk=chunk, density=density)
    lay, k = codec.layout, codec.spec.k
    buf = _buf(codec, 1)
    _, sent = codec.encode(buf)
    chunk_of = sent.pos // chunk
    for j in range(lay.chunks):
        row = buf[j * chunk:(j + 1) * chunk].abs()
        n = lay.fill[j]
        picked = buf[sent.pos[chunk_of == j]].abs().sort(descending=True).values
        assert torch.equal(picked, row[:n].topk(min(k, n)).values), f"chunk {j}"


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("chunk", [64, 512, 2048, 4096])
def test_round_trip_message_decodes_to_what_encode_says_it_sent(bits, chunk):
    codec = _codec([(2, chunk), (chunk // 3 + 1,), (5,)], chunk=chunk, density=0.03, bits=bits)
    buf = _buf(codec, bits)
    msg, sent = codec.encode(buf)
    assert msg.dtype == torch.uint8 and msg.numel() == codec.bytes == message_bytes(codec.spec, codec.layout)
    back = codec.read(msg)
    assert torch.equal(back.pos, sent.pos)  # the indices, bit for bit
    assert torch.equal(back.val.view(torch.int32), sent.val.view(torch.int32))  # the values, bit for bit
    assert torch.equal(codec.decode(msg), sent.dense(codec.layout.padded))
    # the quantizer: levels (m + 1) * s / L of each chunk's s (its largest kept magnitude, sent exactly), sign kept
    levels = 1 << (bits - 1)
    s = torch.zeros(codec.layout.chunks).scatter_reduce_(0, sent.pos // chunk, buf[sent.pos].abs(), "amax")
    step = (s / levels)[sent.pos // chunk]
    m = (sent.val.abs() / step).double()
    assert (m - m.round()).abs().max() < 1e-5 and m.round().min() >= 1 and m.round().max() <= levels
    assert torch.equal(torch.sign(sent.val), torch.sign(buf[sent.pos]))
    # the nearest level: within half a step, or a step for values under the lowest level s / L (there is no 0)
    err, v = (sent.val - buf[sent.pos]).abs(), buf[sent.pos].abs()
    assert (err <= torch.where(v >= step / 2, step / 2, step) * (1 + 1e-6)).all()
    assert torch.equal(sent.val.abs().max(), buf.abs().max())


def test_a_message_of_another_size_is_refused_in_one_line():
    codec = _codec([(100,)], chunk=64)
    with pytest.raises(ValueError, match=r"^sparse message of 7 bytes .* this layout's are \d+ bytes"):
        codec.read(torch.zeros(7, dtype=torch.uint8))


# ---- bytes ----

@pytest.mark.parametrize("density, below", [(0.01, True), (0.0156, True), (0.02, True), (0.022, True),
                                            (0.023, False), (0.03, False)])
def test_bytes_ratio_at_2_bits_and_chunk_4096(density, below):
    """B = (4 * chunks + ceil(K * 12 / 8) + ceil(K * 2 / 8)) / (4 * values): ~density * 14 / 32 + 1 / 4096, so
    B <= 0.01 up to density 2.2 % at chunk 4096 (3 % is 0.0134)."""
    spec = SparseSpec(chunk=4096, density=density, bits=2)
    lay = ChunkLayout([(4096 * 25,)], spec)
    k = spec.k * 25
    assert message_bytes(spec, lay) == 4 * 25 + math.ceil(k * 12 / 8) + math.ceil(k * 2 / 8)
    b = bytes_ratio(spec, lay)
    assert abs(b - (density * 14 / 32 + 1 / 4096)) < 3e-4
    assert (b <= 0.01) is below


# ---- error feedback ----

def _ef(**kw):
    codec = _codec([(3, 64), (70,)], chunk=64, density=0.05, **kw)
    return ErrorFeedback(codec)


def _delta(ef, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in ef.layout.shapes]


def test_commit_keeps_the_residual_after_quantization():
    ef = _ef(beta=0.9)
    d0, d1 = _delta(ef, 0), _delta(ef, 1)
    assert ef.stage(d0)
    e0 = ef.e.clone()
    assert torch.equal(e0, ef.layout.pack(d0))  # e was 0: e' = delta
    msg, sent = ef.encode()
    ef.commit(sent)
    assert torch.equal(ef.e, e0 - sent.dense(ef.layout.padded))
    # 2 bits: the residual at the sent positions is the quantization error, not 0 (as pre-quantization values
    # would leave): 0 only at each chunk's largest, which is a level (s itself)
    assert int((ef.e[sent.pos] == 0).sum()) == ef.layout.chunks
    assert torch.equal(ef.e[sent.pos], e0[sent.pos] - sent.val)
    # next step: e' = beta * e + delta
    e1 = ef.e.clone()
    assert ef.stage(d1)
    assert torch.allclose(ef.e, ef.layout.pack(d1) + 0.9 * e1, rtol=1e-6, atol=1e-7)  # one fused pass: maybe an fma


def test_every_attempt_encodes_the_same_message_from_e_prime():
    ef = _ef()
    ef.stage(_delta(ef, 2))
    a, _ = ef.encode()
    b, sent = ef.encode()
    assert torch.equal(a, b)
    with pytest.raises(AssertionError, match="twice"):
        ef.stage(_delta(ef, 3))
    ef.commit(sent)


def test_a_node_left_out_keeps_e_prime_whole():
    ef = _ef(beta=0.5)
    d0, d1 = _delta(ef, 4), _delta(ef, 5)
    ef.stage(d0)
    ef.encode()
    e_prime = ef.e.clone()
    ef.abort()  # left out: nothing subtracted
    assert torch.equal(ef.e, e_prime) and not ef.staged
    ef.stage(d1)
    assert torch.equal(ef.e, ef.layout.pack(d1) + 0.5 * e_prime)


def test_reset_and_a_non_finite_accumulator():
    ef = _ef()
    ef.stage(_delta(ef, 6))
    ef.reset()
    assert ef.e.count_nonzero() == 0 and not ef.staged
    bad = _delta(ef, 7)
    bad[1][3] = float("nan")
    assert ef.stage(bad) is False  # not finite: e = 0, nothing staged, the node sits the step out
    assert ef.e.count_nonzero() == 0 and not ef.staged
    with pytest.raises(AssertionError, match="before stage"):
        ef.encode()
    bad[1][3] = float("inf")
    assert ef.stage(bad) is False and ef.e.count_nonzero() == 0
    assert ef.stage(_delta(ef, 8)) is True


def test_state_dict_round_trip_and_another_model_refused():
    ef = _ef()
    ef.stage(_delta(ef, 9))
    with pytest.raises(AssertionError, match="checkpoint inside an outer step"):
        ef.state_dict()
    _, sent = ef.encode()
    ef.commit(sent)
    state = ef.state_dict()
    assert state["e"].numel() == ef.layout.numel  # pads dropped
    other = _ef()
    other.load_state_dict(state)
    assert torch.equal(other.e, ef.e)
    # another chunk size loads the same values (the residual is the parameters', not the chunks')
    wide = ErrorFeedback(_codec(ef.layout.shapes, chunk=128, density=0.05))
    wide.load_state_dict(state)
    assert torch.equal(wide.layout.unpack(wide.e), ef.layout.unpack(ef.e))
    smaller = ErrorFeedback(_codec([(3, 64)], chunk=64))
    with pytest.raises(ValueError, match="covers 2 tensors of 262 values; this node's parameters are 1 tensors"):
        smaller.load_state_dict(state)


def test_norms_for_telemetry():
    ef = _ef()
    d = _delta(ef, 10)
    ef.stage(d)
    flat = torch.cat([t.reshape(-1) for t in d])
    assert ef.norm() == pytest.approx(float(flat.norm()))
    params = [2 * t for t in d]
    assert ef.norm_ratio(params) == pytest.approx(0.5)


# ---- the gathered mean ----

def _members(n, seed=0, **kw):
    codec = _codec([(4, 64), (100,), (1,)], chunk=64, density=0.2, **kw)  # dense enough that supports overlap
    msgs = []
    for r in range(n):
        msg, _ = codec.encode(_buf(codec, seed + r))
        msgs.append(msg)
    return codec, msgs


def _bits(t):
    return t.view(torch.int32).clone()


def test_gathered_mean_is_the_same_bytes_whatever_the_arrival_order():
    codec, msgs = _members(5)
    weights = [3.0, 1.0, 7.0, 2.0, 5.0]
    ref = torch.empty(codec.layout.padded)
    total = gathered_mean(codec, msgs, weights, ref)
    assert total == 18.0
    rng = random.Random(0)
    arrival_sums = set()
    for _ in range(20):
        order = list(range(5))
        rng.shuffle(order)
        out = torch.empty_like(ref)
        acc = RankOrderedSum(codec, weights, out)
        for r in order:
            acc.arrive(r, msgs[r])
        acc.finish()
        assert torch.equal(_bits(out), _bits(ref)), f"arrival {order}"
        # what an arrival-order sum would have given: other bytes for some orders (the test can see the difference)
        naive = torch.zeros_like(ref)
        for r in order:
            codec.decode_add(msgs[r], naive, weights[r])
        arrival_sums.add(naive.div_(18.0).numpy().tobytes())
    assert len(arrival_sums) > 1


def test_weighted_mean_of_sparse_messages():
    codec, msgs = _members(3, seed=20)
    weights = [1.0, 2.0, 5.0]
    dense = [codec.decode(m).double() for m in msgs]
    out = torch.empty(codec.layout.padded)
    gathered_mean(codec, msgs, weights, out)
    want = sum(w * d for w, d in zip(weights, dense)) / 8.0
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-7)
    plain = sum(dense) / 3
    alone = dense[0]
    assert (out.double() - plain).abs().max() > 1e-2 and (out.double() - alone).abs().max() > 1e-2
    # a member not counted (weight 0, or no message): the mean of the others over their weight alone
    out2 = torch.empty_like(out)
    assert gathered_mean(codec, [msgs[0], None, msgs[2]], [1.0, 0.0, 5.0], out2) == 6.0
    want2 = (dense[0] + 5 * dense[2]) / 6.0
    assert torch.allclose(out2.double(), want2, rtol=1e-6, atol=1e-7)
    with pytest.raises(NothingGathered):
        gathered_mean(codec, [None, None], [0.0, 0.0], out2)


@pytest.mark.parametrize("short", [False, True])
def test_the_first_message_counted_zeroes_the_mean_block_by_block_to_the_same_bytes(short, monkeypatch):
    """The first message counted zeroes the mean in the pass that adds it, a block of chunks at a time on a CPU
    (blocks of 3 chunks here, the last one short): the same bytes as zeroing the whole buffer and adding, whatever
    the buffer held, whichever rank is counted first, a node's own message as its Sent too; with every weight 0 the
    buffer is zeroed and there is no mean."""
    monkeypatch.setattr(sparse, "_BLOCK_BYTES", 3 * 4 * 64)
    # 10 chunks of 64; short: a tensor's last chunk holds 3 values, fewer than k = 6 (the positions' path)
    codec = _codec([(5, 64), (67 if short else 128,), (3, 64)], chunk=64, density=0.1)
    assert codec.layout.chunks == 10 and codec._short == short
    encoded = [codec.encode(_buf(codec, 50 + r)) for r in range(3)]
    msgs = [m for m, _ in encoded]
    for weights, own in (([2.0, 0.0, 3.0], 0), ([0.0, 2.0, 3.0], 1), ([0.0, 0.0, 4.0], 2)):
        total = sum(weights)
        want = torch.zeros(codec.layout.padded)
        for m, w in zip(msgs, weights):
            if w > 0:
                codec.decode_add(m, want, w / total)
        out = torch.full((codec.layout.padded,), float("nan"))
        mine = [encoded[r][1] if r == own else m for r, m in enumerate(msgs)]
        assert gathered_mean(codec, mine, weights, out) == total
        assert torch.equal(_bits(out), _bits(want)), f"weights {weights}"
    out = torch.full((codec.layout.padded,), float("nan"))
    with pytest.raises(NothingGathered):
        gathered_mean(codec, [None, None, None], [0.0, 0.0, 0.0], out)
    assert not out.any()


def test_own_message_in_the_mean_equals_what_was_sent():
    """With one member, the mean is its own sent values (eager overlap's stand-in: this node's own decoded message)."""
    codec, msgs = _members(1, seed=30)
    out = torch.empty(codec.layout.padded)
    gathered_mean(codec, msgs, [123456.0], out)
    assert torch.equal(_bits(out), _bits(codec.decode(msgs[0])))


# ---- bench/sparse_codec.py ----

def test_bench_runs_a_round_and_prints_its_last_line():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sparse_codec.py"), "--preset", "debug", "--rounds", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("sparse codec debug 2x: encode ") and "per outer step (goal 0.05 s: C/G " in last


def test_bench_bad_setting_is_one_line_naming_the_key():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sparse_codec.py"), "--chunk", "1000"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1].startswith(
        "sparse_codec.py: error: diloco.sparse_chunk: 1000 is not an integer power of two")


def test_own_message_as_its_sent_gives_the_same_bytes():
    codec = _codec([(4, 64), (100,)], chunk=64, density=0.2)
    (m0, s0), (m1, _), (m2, _) = (codec.encode(_buf(codec, 40 + r)) for r in range(3))
    weights = [2.5, 3.0, 5.0]
    a, b = torch.empty(codec.layout.padded), torch.empty(codec.layout.padded)
    gathered_mean(codec, [m0, m1, m2], weights, a)
    gathered_mean(codec, [s0, m1, m2], weights, b)
    assert torch.equal(_bits(a), _bits(b))


def test_bench_measures_a_revision_side_by_side():
    """--against REV: that revision's codec in the same rounds (its messages must say the same values), its line
    first; a revision without the codec is one line."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "sparse_codec.py"), "--preset", "debug", "--rounds", "1",
                        "--against", "HEAD"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-3].startswith("HEAD: encode ") and "CPU time " in lines[-3]
    assert lines[-2].startswith("this tree: encode ") and lines[-1].startswith("sparse codec debug 2x: ")
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "sparse_codec.py"), "--preset", "debug", "--against",
                          "no-such-rev"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 1 and bad.stderr.strip().startswith("sparse_codec.py: error: --against no-such-rev: no ")
