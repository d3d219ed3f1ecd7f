"""engine.outer.allreduce.weighted_mean divides by the sum of the weights, not by the group size: 3 real gloo processes
with weight sets whose sum is not 3 (two members and a joiner: 1, 1, 0; unequal weights: 2, 1, 0.5; the tokens of
a large round, 2^24 + 1, 3, 1). The weights reported back (ReduceStats.weights, what the outer_step event's
`weights` come from) are the senders' own, as the fp32 they travel as, the same on every rank.

Each mean runs twice: whole (each chunk one piece, as for any small model) and cut into many small pieces in codec
batches of a few (PIECE_BYTES and BATCH_PIECES made small here, as a large model's outer step cuts them), with a
last piece that is partial: the same bounds, identical on every rank, and the bytes of every piece counted."""

from __future__ import annotations

import datetime
import pickle
import traceback

import pytest
import torch
import torch.distributed as dist

from engine.outer import allreduce as compression
from procs import spawned_ranks

SIZE = 3
NUMEL = 1_001  # not a multiple of 3: the padded chunk is divided as well
PIECES = {"whole": (64 * 1024, 16), "pieces": (40, 3)}  # (PIECE_BYTES, BATCH_PIECES)
# the tokens of a large round: past 2^24 a weight is not an fp32, and every rank must see the one that travelled;
# times the inputs it is past fp16's 65504, which the pieces must not carry
WEIGHT_SETS = {"member-member-joiner": (1.0, 1.0, 0.0), "unequal": (2.0, 1.0, 0.5),
               "past-2^24": (2.0**24 + 1, 3.0, 1.0)}


def _inputs(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(7 + rank)) + rank


def _worker(rank: int, port: int, queue) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, SIZE, rank == 0, timeout=datetime.timedelta(seconds=30))
        out = {}
        for name, weights in WEIGHT_SETS.items():
            prefixed = dist.PrefixStore(f"{name}/", store)
            pg = dist.ProcessGroup(prefixed, rank, SIZE)
            backend = dist.ProcessGroupGloo(prefixed, rank, SIZE, datetime.timedelta(seconds=20))
            pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
            pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            for cut, (piece_bytes, batch) in PIECES.items():
                compression.PIECE_BYTES, compression.BATCH_PIECES = piece_bytes, batch
                for codec in compression.COMPRESSIONS:
                    mean, stats = compression.weighted_mean(_inputs(rank), weights[rank], pg, codec)
                    out[name, codec, cut] = (mean, stats.total_weight, stats.weights, stats.bytes_sent)
        queue.put((rank, pickle.dumps(out)))
    except Exception:  # the parent reports the child's traceback
        queue.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def results():
    return spawned_ranks(_worker, SIZE, timeout=90)


@pytest.mark.parametrize("cut", PIECES)
@pytest.mark.parametrize("name", WEIGHT_SETS)
def test_mean_is_divided_by_the_sum_of_the_weights(results, name, cut):
    weights = [float(torch.tensor(w, dtype=torch.float32)) for w in WEIGHT_SETS[name]]  # as they travel
    exact = sum(w * _inputs(r) for r, w in enumerate(weights)) / sum(weights)
    by_size = sum(w * _inputs(r) for r, w in enumerate(weights)) / SIZE  # the bug this test exists for
    assert float((exact - by_size).abs().max()) > 0.1  # the two differ by far more than any codec's error
    for codec in compression.COMPRESSIONS:
        got = [results[r][name, codec, cut] for r in range(SIZE)]
        assert all(torch.equal(got[0][0], g[0]) for g in got[1:]), f"{name}/{codec}: ranks disagree"
        # every rank saw every rank's weight, in group-rank order, and their sum
        assert all(g[1] == sum(weights) and g[2] == list(weights) for g in got), (name, codec, got[0][1:])
        # fp32 exact; int8 within two half-bins of the weighted inputs' range over the weight sum; halves ~1e-2
        ranges = sum(float((w * _inputs(r)).max() - (w * _inputs(r)).min()) for r, w in enumerate(weights))
        bound = {"none": 1e-6, "bf16": 0.05, "fp16": 0.01, "int8": ranges / (255 * sum(weights)) + 1e-6}[codec]
        err = float((got[0][0] - exact).abs().max())
        assert err <= bound, (name, codec, err, bound)


def test_every_piece_is_counted_and_a_large_model_is_cut_into_many(results):
    """bytes_sent: both steps move every piece (payload, int8's scale/offset) to each peer, the reduce-scatter's
    pieces with the sender's weight; here int8's chunk of 334 bytes goes as 9 pieces of 38 and bf16's as 17 of 20."""
    for rank in range(SIZE):
        for name in WEIGHT_SETS:
            sent = {codec: results[rank][name, codec, "pieces"][3] for codec in ("int8", "bf16")}
            assert sent["int8"] == (SIZE - 1) * 9 * (2 * (38 + 8) + 4), sent
            assert sent["bf16"] == (SIZE - 1) * 17 * (2 * 20 * 2 + 4), sent
            whole = results[rank][name, "int8", "whole"][3]
            assert whole == (SIZE - 1) * (2 * (334 + 8) + 4), whole
