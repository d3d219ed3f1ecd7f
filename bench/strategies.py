"""Inner strategies side by side: peak memory per rank and tokens/s of DDP, FSDP2 and DeepSpeed ZeRO 1/2/3 on the
same model and global batch, each on N processes (torchrun), one strategy after another in one run of this script;
printed as ratios against DDP.

    python bench/strategies.py                                    # 15m model on 2 CPU processes, ~3 min on 2 cores
    python bench/strategies.py --preset 1b --seq-len 2048 --micro-batch 4 --precision bf16-mixed --nproc 8   # GPUs

Each strategy runs in its own torchrun so that no allocator state leaks from one into the next. "Memory" is the
peak during the timed steps above the level just before the model was built (after the imports): what the
strategy costs a rank while training (weights, gradients, optimizer state, communication buffers, activations),
not the transient copies made while wrapping the model ("init" reports the peak including those). CUDA:
torch.cuda.max_memory_allocated. CPU: resident set size sampled every 2 ms, with glibc told to map every block
of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the RSS and it tracks live memory.
Tokens/s come from the median step time (all ranks step together; rank 0's clock).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from ranks import run_torchrun, worker_errors  # bench/ is the script's folder, first on sys.path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STRATEGIES = ("ddp", "fsdp", "zero1", "zero2", "zero3")
VOCAB = 258


class PeakRSS:
    """Peak resident memory above the level at start, sampled every 2 ms (CPU runs)."""

    def __init__(self) -> None:
        import psutil
        self.proc = psutil.Process()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def reset(self) -> int:
        """The peak so far (above the base); start a new peak from the current level."""
        seen = max(0, self.peak - self.base)
        self.peak = self.proc.memory_info().rss
        return seen

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(0, self.peak - self.base)


def warm_up_code_paths(args, inner_cfg, world, device) -> None:
    """Build and step a 1-layer model under the strategy, then drop it: the modules DeepSpeed/FSDP import lazily
    (DeepSpeed: ~100 MB of them) are then loaded before the baseline, and not counted as training memory."""
    import gc

    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.config import OptimConfig, TrainConfig
    from engine.data import FakeSource, TokenStream
    from engine.inner.ddp_fsdp import build_inner
    from engine.session import train_step

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2)).to(device)
    train = TrainConfig(micro_batch_size=1, batch_size=world.world_size, precision=args.precision)
    inner = build_inner(tiny, inner_cfg, train, OptimConfig(warmup_steps=0), world, device)
    # the engine's own stream: train_step reads and restores its position (a stand-in drifts from that)
    train_step(inner, TokenStream(FakeSource(VOCAB, 8, 0), world.rank, world.world_size, seed=0), 1, 1)
    del inner, tiny
    gc.collect()


def worker(args) -> None:
    """One torchrun rank running one strategy; rank 0 prints one JSON line with every rank's peak."""
    import torch
    import torch.distributed as dist

    from engine.config import InnerConfig, ModelConfig, OptimConfig, TrainConfig
    from engine.data import FakeSource, TokenStream
    from engine.model import build_model
    from engine.inner.ddp_fsdp import build_inner, setup_distributed
    from engine.session import train_step
    from engine.world import read_world

    world = read_world()
    inner_cfg = InnerConfig(strategy=args.worker, device=args.device)
    device, _ = setup_distributed(inner_cfg, world)
    warm_up_code_paths(args, inner_cfg, world, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        rss = PeakRSS()
    train = TrainConfig(micro_batch_size=args.micro_batch, batch_size=args.micro_batch * args.accum * world.world_size,
                        max_steps=10_000, precision=args.precision)
    model = build_model(ModelConfig(preset=args.preset), VOCAB, args.seq_len, device, seed=0)
    inner = build_inner(model, inner_cfg, train, OptimConfig(lr=1e-3, warmup_steps=0), world, device)
    del model  # the inner holds what it needs (ZeRO-3 has partitioned it)
    stream = TokenStream(FakeSource(VOCAB, args.seq_len, 0), world.rank, world.world_size, seed=0)
    times, init_peak = [], 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:  # from here on: the steady state of training
            if device.type == "cuda":
                init_peak = torch.cuda.max_memory_allocated(device) - base
                torch.cuda.reset_peak_memory_stats(device)
            else:
                init_peak = rss.reset()
        dist.barrier()
        t0 = time.perf_counter()
        loss, _ = train_step(inner, stream, args.micro_batch, args.accum)
        float(loss)  # wait for the device
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else rss.stop()
    peaks = [None] * world.world_size
    dist.all_gather_object(peaks, (peak, max(peak, init_peak)))
    if world.rank == 0:
        tokens = args.micro_batch * args.accum * args.seq_len * world.world_size
        print(json.dumps({"strategy": args.worker, "tokens_per_s": tokens / statistics.median(times),
                          "step_s": statistics.median(times), "peaks": [p for p, _ in peaks],
                          "init_peaks": [p for _, p in peaks], "device": str(device.type),
                          "loss": float(loss)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip C++ static destructors (gloo's exit-time abort)


def run_strategy(args, strategy: str) -> dict | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           __file__, "--worker", strategy, *args._passthrough]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads),
           "MALLOC_MMAP_THRESHOLD_": "65536"}
    try:
        done = run_torchrun(cmd, args.timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"  {strategy}: timed out after {args.timeout:.0f}s")
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  {strategy}: failed (rc {done.returncode})\n{worker_errors(done.stderr)}")
        return None
    return json.loads(lines[-1])


def report(args, results: dict[str, dict]) -> None:
    ddp = results.get("ddp")
    print(f"{args.preset} model, seq_len {args.seq_len}, micro-batch {args.micro_batch} x accum {args.accum} per rank, "
          f"{args.nproc} processes, {args.precision}, {args.steps} timed steps after {args.warmup}")
    print(f"  {'strategy':<9}{'peak MiB/rank':>14}{'vs DDP':>8}{'init MiB':>10}{'tokens/s':>11}{'vs DDP':>8}"
          f"{'step ms':>9}")
    for name in STRATEGIES:
        res = results.get(name)
        if res is None:
            continue
        peak = max(res["peaks"])
        mem_ratio = f"{peak / max(max(ddp['peaks']), 1):.2f}" if ddp else "-"
        tps_ratio = f"{res['tokens_per_s'] / ddp['tokens_per_s']:.2f}" if ddp else "-"
        print(f"  {name:<9}{peak / 2**20:>14,.1f}{mem_ratio:>8}{max(res['init_peaks']) / 2**20:>10,.1f}"
              f"{res['tokens_per_s']:>11,.0f}{tps_ratio:>8}"
              f"{res['step_s'] * 1e3:>9,.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="15m", choices=["debug", "15m", "150m", "1b"])
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "fp16-mixed"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="intra-op CPU threads per process")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per strategy")
    ap.add_argument("--worker", choices=STRATEGIES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import torch
        torch.set_num_threads(args.threads)
        worker(args)
        return
    chosen = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(STRATEGIES))
    if unknown:
        ap.error(f"--strategies: unknown {', '.join(unknown)} (choose from {', '.join(STRATEGIES)})")
    args._passthrough = [f"--preset={args.preset}", f"--seq-len={args.seq_len}", f"--micro-batch={args.micro_batch}",
                         f"--accum={args.accum}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                         f"--precision={args.precision}", f"--device={args.device}", f"--threads={args.threads}"]
    results = {}
    for strategy in chosen:
        res = run_strategy(args, strategy)
        if res is not None:
            results[strategy] = res
    report(args, results)
    if not results:
        sys.exit("strategies: no strategy produced a result")


if __name__ == "__main__":
    main()
