"""Sparse codec benchmark (issue 43, item 5): the seconds one node's outer step spends in the sparse codec, for a
preset's parameter shapes, with the messages of N hosts.

    python bench/sparse_codec.py                                 # 15m, 2 hosts, CPU, 1 thread: ~30 s on 2 cores
    python bench/sparse_codec.py --preset 150m --device cuda     # the GPU goal: 0.02 s at 150m

The model is built from the preset (engine.model.build_model) only for its parameters' shapes; the pseudo-gradients
are random normals scaled to 1e-3, a fresh one per host and round. Per round, on one process, for host 0:

    stage    e' = beta * e + delta over the parameters (the accumulator's own pass, not the codec's)
    encode   top-k per chunk, quantize, pack: this host's message
    decode   the weighted mean of all the hosts' messages, decoded and added in rank order into a zeroed fp32
             buffer, divided by the total weight (the other hosts' messages are encoded beforehand, untimed)
    commit   e = e' - sent

The codec's time per outer step is encode + decode (the issue's goal: at most 0.05 s on this CPU for the 15m model
with 2 hosts; on a GPU at 150m, 0.02 s). Figures are the minimum over the rounds after a warm-up (a shared machine
adds time, never removes it) with the median beside it. On CUDA every phase ends in a synchronize.

Its last line: `sparse codec PRESET Nx: encode E s + decode D s = C s per outer step (goal G s: C/G R); B b`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.config import ModelConfig  # noqa: E402
from engine.model import build_model  # noqa: E402
from engine.outer.sparse import (ChunkLayout, ErrorFeedback, SparseCodec, SparseSpec, bytes_ratio,  # noqa: E402
                                 gathered_mean)

VOCAB = 258
GOALS = {"cpu": 0.05, "cuda": 0.02}  # seconds of codec per outer step (issue 43: 15m on this CPU; 150m on a GPU)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="15m")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--chunk", type=int, default=SparseSpec.chunk)
    p.add_argument("--density", type=float, default=SparseSpec.density)
    p.add_argument("--bits", type=int, default=SparseSpec.bits)
    p.add_argument("--rounds", type=int, default=6, help="measured rounds, after one warm-up round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the lab's engines run one each)")
    a = p.parse_args(argv)
    if a.hosts < 1 or a.rounds < 1 or a.threads < 1:
        p.error("--hosts, --rounds and --threads must be at least 1")
    try:
        SparseSpec(chunk=a.chunk, density=a.density, bits=a.bits)
    except ValueError as e:
        p.error(str(e))
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    return a


def shapes(preset: str) -> list[torch.Size]:
    model = build_model(ModelConfig(preset=preset), VOCAB, 512, device="meta")
    return [p.shape for p in model.parameters()]


def _timed(device: torch.device, fn):
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def run(a: argparse.Namespace) -> dict[str, list[float]]:
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    spec = SparseSpec(chunk=a.chunk, density=a.density, bits=a.bits)
    layout = ChunkLayout(shapes(a.preset), spec)
    codec = SparseCodec(spec, layout, device)
    hosts = [ErrorFeedback(codec) for _ in range(a.hosts)]
    mean = torch.zeros(layout.padded, dtype=torch.float32, device=device)
    weights = [float(1000 + 7 * h) for h in range(a.hosts)]
    g = torch.Generator(device=device).manual_seed(0)
    times: dict[str, list[float]] = {"stage": [], "encode": [], "decode": [], "commit": []}
    for rnd in range(a.rounds + 1):
        deltas = [torch.randn(layout.numel, generator=g, device=device).mul_(1e-3) for _ in hosts]
        others = []
        for ef, d in zip(hosts[1:], deltas[1:]):  # the other hosts' messages, untimed
            ef.stage(d)
            msg, sent = ef.encode()
            ef.commit(sent)
            others.append(msg)
        me = hosts[0]
        _, t_stage = _timed(device, lambda: me.stage(deltas[0]))
        (msg, sent), t_enc = _timed(device, me.encode)
        # this host's own message as its Sent (the same values, bit for bit, without unpacking its bytes)
        _, t_dec = _timed(device, lambda: gathered_mean(codec, [sent, *others], weights, mean))
        _, t_commit = _timed(device, lambda: me.commit(sent))
        if rnd:  # round 0 warms the allocator and the code paths up
            for k, v in zip(times, (t_stage, t_enc, t_dec, t_commit)):
                times[k].append(v)
    return times


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    times = run(a)
    spec = SparseSpec(chunk=a.chunk, density=a.density, bits=a.bits)
    layout = ChunkLayout(shapes(a.preset), spec)
    print(f"{a.preset}: {layout.numel:,} values in {len(layout.numels)} tensors, {layout.chunks:,} chunks of "
          f"{spec.chunk}, k {spec.k}, {spec.bits} bits; message {SparseCodec(spec, layout).bytes:,} bytes "
          f"(B {bytes_ratio(spec, layout):.4f}); {a.hosts} hosts, {a.device}, {a.threads} thread(s)")
    for k, v in times.items():
        print(f"  {k:7s} min {min(v):.4f} s  median {statistics.median(v):.4f} s")
    enc, dec = min(times["encode"]), min(times["decode"])
    goal = GOALS[a.device]
    codec = enc + dec
    print(f"sparse codec {a.preset} {a.hosts}x: encode {enc:.4f} s + decode {dec:.4f} s = {codec:.4f} s per outer "
          f"step (goal {goal} s: C/G {codec / goal:.2f}); B {bytes_ratio(spec, layout):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
