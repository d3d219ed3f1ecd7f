"""The memory estimate with diloco.compression = "sparse" (engine/memory.py, sparse_parts): the accumulator is one
more fp32 copy of what the process trains, the wire buffers and the top-k's scratch are what the real codec keeps."""

from __future__ import annotations

import torch

from procs import ROOT  # noqa: F401 - the tests' path setup

from engine.config import load_config
from engine.memory import estimate
from engine.outer import allreduce
from engine.outer.gather import prepare
from engine.outer.sparse import ChunkLayout, ErrorFeedback, SparseCodec, SparseSpec


def _cfg(*more: str):
    return load_config(None, ["--data.fake=true", "--model.preset=15m", "--diloco.enabled=true",
                              "--diloco.min_nodes=3", *more])


def _parts(cfg, device: str = "cpu") -> dict:
    return {p.name: p for p in estimate(cfg, workers=1, device=device).parts}


def _shapes():
    from engine.model import build_model
    model = build_model(_cfg().model, 258, 64, device="meta")
    return [p.shape for p in model.parameters()]


def test_the_accumulator_its_messages_and_its_scratch_are_what_the_codec_holds():
    sparse, dense = _parts(_cfg("--diloco.compression=sparse")), _parts(_cfg("--diloco.compression=int8"))
    spec = SparseSpec()
    codec = SparseCodec(spec, ChunkLayout(_shapes(), spec))
    ef = ErrorFeedback(codec)
    # one more fp32 copy of the parameters (the real one pads each tensor's last chunk: 0.5 % at 15m)
    real = ef.e.numel() * 4
    assert sparse["sparse accumulator"].bytes == 4 * codec.layout.numel
    assert 0.99 * real <= sparse["sparse accumulator"].bytes <= real
    assert sparse["diloco buffers"].bytes == dense["diloco buffers"].bytes  # snapshot, pseudo-gradient, mean
    assert "outer momentum" not in sparse  # the accumulator plays its part
    assert "sparse accumulator" not in dense
    # the wire: this member's message and one per member, each with its weight (the real buffers of gather.py)
    ex = allreduce.Exchange("cpu")
    prepare(ex, codec, 3)
    assert abs(sparse["exchange"].bytes - ex.nbytes()) <= 0.01 * ex.nbytes() and sparse["exchange"].host
    # the top-k's scratch, kept between steps: on a CPU one block's, exactly
    _, _ = ef.stage(torch.zeros(codec.layout.numel)), ef.encode()
    assert sparse["sparse scratch"].bytes == sum(t.numel() * 4 for t in codec._scratch.values())
    # on a GPU the whole buffer's at once: a quarter of a copy at the defaults
    gpu = _parts(_cfg("--diloco.compression=sparse"), "cuda")
    assert abs(gpu["sparse scratch"].bytes - codec.layout.padded) <= 0.01 * codec.layout.padded
    assert gpu["sparse accumulator"].bytes == sparse["sparse accumulator"].bytes and not gpu["sparse accumulator"].host


def test_nesterov_momentum_with_sparse_is_counted_too():
    parts = _parts(_cfg("--diloco.compression=sparse", "--diloco.outer_momentum=0.9"))
    assert parts["outer momentum"].bytes == parts["sparse accumulator"].bytes
