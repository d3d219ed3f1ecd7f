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

`--against REV` measures the codec of engine/outer/sparse.py as of git revision REV side by side, in the same
process and the same rounds (old and new alternate on the same pseudo-gradients), and prints its figures first
(`REV: encode E s + decode D s = C s`): on a shared machine only numbers measured side by side compare. Each round
both encode from the same accumulators (REV's hosts take this tree's before it), and both must send the same
magnitudes of e' in every chunk (checked every round): the same top k, where a tie at a chunk's k-th magnitude may
pick another position of that magnitude (the module's docstring allows it; two selections may break a tie
differently, and from there their accumulators would part).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
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
    p.add_argument("--beta", type=float, default=SparseSpec.beta, help="the accumulator's decay (both codecs, with "
                   "--against: a revision's own default may differ)")
    p.add_argument("--rounds", type=int, default=6, help="measured rounds, after one warm-up round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the lab's engines run one each)")
    p.add_argument("--against", metavar="REV", help="also measure engine/outer/sparse.py of this git revision, "
                   "side by side")
    a = p.parse_args(argv)
    if a.hosts < 1 or a.rounds < 1 or a.threads < 1:
        p.error("--hosts, --rounds and --threads must be at least 1")
    try:
        SparseSpec(chunk=a.chunk, density=a.density, bits=a.bits, beta=a.beta)
    except ValueError as e:
        p.error(str(e))
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    return a


def shapes(preset: str) -> list[torch.Size]:
    model = build_model(ModelConfig(preset=preset), VOCAB, 512, device="meta")
    return [p.shape for p in model.parameters()]


def _timed(device: torch.device, fn):
    """fn's result and its seconds: wall clock, and this thread's CPU time (on a machine shared with other work the
    wall clock counts the time the scheduler gave others; the CPU time does not)."""
    t, c = time.perf_counter(), time.thread_time()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t, time.thread_time() - c)


def revision(rev: str) -> types.ModuleType:
    """engine/outer/sparse.py as of git revision `rev`, loaded as a module of its own."""
    try:
        source = subprocess.run(["git", "show", f"{rev}:engine/outer/sparse.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"sparse_codec.py: error: --against {rev}: no engine/outer/sparse.py there "
                         f"({(getattr(e, 'stderr', '') or str(e)).strip()})") from None
    # the settings' rules moved from engine/config.py to engine/sparse_rules.py: an older revision imports them from
    # where they are now (the rest of its imports are this tree's, as before)
    source = source.replace("from engine.config import SPARSE_BITS", "from engine.sparse_rules import SPARSE_BITS")
    module = types.ModuleType(f"sparse_at_{rev}")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:engine/outer/sparse.py", "exec"), module.__dict__)
    return module


class Arm:
    """One implementation's codec and hosts, and its times."""

    def __init__(self, mod: types.ModuleType, a: argparse.Namespace, device: torch.device):
        spec = mod.SparseSpec(chunk=a.chunk, density=a.density, bits=a.bits, beta=a.beta)
        self.mod, self.layout = mod, mod.ChunkLayout(shapes(a.preset), spec)
        self.codec = mod.SparseCodec(spec, self.layout, device)
        self.hosts = [mod.ErrorFeedback(self.codec) for _ in range(a.hosts)]
        self.mean = torch.zeros(self.layout.padded, dtype=torch.float32, device=device)
        self.times: dict[str, list[float]] = {"stage": [], "encode": [], "decode": [], "commit": []}
        self.cpu: dict[str, list[float]] = {k: [] for k in self.times}

    def round(self, device: torch.device, deltas: list[torch.Tensor], weights: list[float], keep: bool) -> torch.Tensor:
        others = []
        for ef, d in zip(self.hosts[1:], deltas[1:]):  # the other hosts' messages, untimed
            ef.stage(d)
            msg, sent = ef.encode()
            ef.commit(sent)
            others.append(msg)
        me = self.hosts[0]
        _, t_stage = _timed(device, lambda: me.stage(deltas[0]))
        (msg, sent), t_enc = _timed(device, me.encode)
        self.picked = picked_magnitudes(self.layout, me.e, sent)  # untimed: what the check compares
        # this host's own message as its Sent (the same values, bit for bit, without unpacking its bytes)
        _, t_dec = _timed(device, lambda: self.mod.gathered_mean(self.codec, [sent, *others], weights, self.mean))
        _, t_commit = _timed(device, lambda: me.commit(sent))
        if keep:
            for k, (wall, cpu) in zip(self.times, (t_stage, t_enc, t_dec, t_commit)):
                self.times[k].append(wall)
                self.cpu[k].append(cpu)
        return msg


def picked_magnitudes(layout, e_prime: torch.Tensor, sent) -> torch.Tensor:
    """|e'| at the positions a message sends, sorted within each chunk (a message sends chunk after chunk)."""
    mag = e_prime.abs()[sent.pos]
    chunk = sent.pos // layout.spec.chunk
    by_value = torch.sort(mag).indices
    order = by_value[torch.sort(chunk[by_value], stable=True).indices]
    return mag[order]


def same_values(a: argparse.Namespace, rnd: int, ours: tuple, theirs: tuple) -> None:
    """This tree's message and the revision's, encoded from the same e': the same magnitudes picked in every chunk,
    and the same decoded value at every position both send."""
    (codec, msg, picked), (their_codec, their_msg, their_picked) = ours, theirs
    if not torch.equal(picked, their_picked):
        raise SystemExit(f"sparse_codec.py: error: round {rnd}: this tree's message sends other magnitudes than "
                         f"{a.against}'s (not the same top k of each chunk)")
    mine, other = codec.decode(msg), their_codec.decode(their_msg)
    both = (mine != 0) & (other != 0)
    if not torch.equal(mine[both], other[both]):
        raise SystemExit(f"sparse_codec.py: error: round {rnd}: this tree's message says other values than "
                         f"{a.against}'s")


def run(a: argparse.Namespace) -> list[Arm]:
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    arms = [Arm(sys.modules["engine.outer.sparse"], a, device)]
    if a.against:
        arms.append(Arm(revision(a.against), a, device))
    weights = [float(1000 + 7 * h) for h in range(a.hosts)]
    g = torch.Generator(device=device).manual_seed(0)
    for rnd in range(a.rounds + 1):
        deltas = [torch.randn(arms[0].layout.numel, generator=g, device=device).mul_(1e-3) for _ in range(a.hosts)]
        if len(arms) == 2:
            for ours, theirs in zip(arms[0].hosts, arms[1].hosts):
                theirs.e.copy_(ours.e)  # the revision encodes from this tree's accumulators (untimed)
        order = arms if rnd % 2 else arms[::-1]  # each goes first in every other round
        msgs = {id(arm): arm.round(device, deltas, weights, keep=rnd > 0) for arm in order}  # round 0 warms up
        if len(arms) == 2:
            same_values(a, rnd, *((arm.codec, msgs[id(arm)], arm.picked) for arm in arms))
    return arms


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    arms = run(a)
    times = arms[0].times
    spec = SparseSpec(chunk=a.chunk, density=a.density, bits=a.bits)
    layout = ChunkLayout(shapes(a.preset), spec)
    print(f"{a.preset}: {layout.numel:,} values in {len(layout.numels)} tensors, {layout.chunks:,} chunks of "
          f"{spec.chunk}, k {spec.k}, {spec.bits} bits; message {SparseCodec(spec, layout).bytes:,} bytes "
          f"(B {bytes_ratio(spec, layout):.4f}); {a.hosts} hosts, {a.device}, {a.threads} thread(s)")
    for k, v in times.items():
        print(f"  {k:7s} min {min(v):.4f} s  median {statistics.median(v):.4f} s  (CPU time: min "
              f"{min(arms[0].cpu[k]):.4f} s)")
    for name, arm in zip((a.against, "this tree"), arms[::-1]) if a.against else ():
        w, c = arm.times, arm.cpu
        print(f"{name}: encode {min(w['encode']):.4f} s + decode {min(w['decode']):.4f} s = "
              f"{min(w['encode']) + min(w['decode']):.4f} s (median {statistics.median(w['encode']) + statistics.median(w['decode']):.4f} s; "
              f"CPU time {min(c['encode']):.4f} + {min(c['decode']):.4f} = {min(c['encode']) + min(c['decode']):.4f} s)")
    enc, dec = min(times["encode"]), min(times["decode"])
    goal = GOALS[a.device]
    codec = enc + dec
    print(f"sparse codec {a.preset} {a.hosts}x: encode {enc:.4f} s + decode {dec:.4f} s = {codec:.4f} s per outer "
          f"step (goal {goal} s: C/G {codec / goal:.2f}); B {bytes_ratio(spec, layout):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
