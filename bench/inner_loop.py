"""Inner-loop benchmark: engine.train's step (engine.inner.ddp_fsdp Inner + engine.data stream) against a plain
hand-written PyTorch loop over the same model, batch and data, in the same run; then DDP and FSDP2 on N processes.

    python bench/inner_loop.py                                   # debug model, small sizes, < 2 min on 2 cores
    python bench/inner_loop.py --preset 150m --seq-len 1024 --micro-batch 8 --steps 30 --nproc 0   # a GPU
    python bench/inner_loop.py --optimizer muon --preset 15m --seq-len 256 --micro-batch 8   # Muon's cost

Both single-process loops run in this process, one step each in alternation, so that drift in machine load hits
both alike; each reports tokens/s from its median step time, and the peak memory it adds while running (CUDA:
max_memory_allocated; CPU: RSS sampled every 2 ms; both above the level when the loop starts). The multi-process
part launches torchrun and reports per-worker throughput relative to the one-process engine: overhead = 1 - that ratio.
The last line is the engine/plain ratio (goal >= 0.95).

--optimizer muon measures what Muon costs instead: the engine's step with optim.name "adamw" and with "muon", one
step each in alternation, each step's optimizer step (clip, step, zero_grad, schedule: Newton-Schulz for Muon)
timed on its own beside the whole step; then the same on N processes under each of --strategies (FSDP2: the
all-gather of each matrix Newton-Schulz needs whole). The last line: `muon/adamw: ...` with both times of both.

On CUDA every line also gives MFU: model FLOPs per token (6 x the matmul parameters, lm_head included and the
input embedding not, + 12 x layers x hidden x seq_len for attention scores and values, PaLM's appendix B count
without a causal discount) x tokens/s per GPU / the GPU's dense peak, looked up from the device name (bf16/fp16
tensor-core peak for mixed precision, TF32 for fp32; --peak-tflops overrides, an unknown GPU prints no MFU).
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

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.config import InnerConfig, ModelConfig, OptimConfig, TrainConfig  # noqa: E402
from engine.data import FakeSource, TokenStream  # noqa: E402
from engine.model import build_model  # noqa: E402
from engine.inner.ddp_fsdp import build_inner, resolve_device, setup_distributed  # noqa: E402
from engine.inner.optim import lr_factor, make_optimizer  # noqa: E402
from engine.inner.transforms import apply_compile  # noqa: E402
from engine.session import train_step  # noqa: E402
from engine.world import World, read_world  # noqa: E402

VOCAB = 258


def configs(args, world_size: int, strategy: str, optimizer: str = "adamw"
            ) -> tuple[TrainConfig, OptimConfig, InnerConfig]:
    train = TrainConfig(micro_batch_size=args.micro_batch, batch_size=args.micro_batch * args.accum * world_size,
                        max_steps=10_000, precision=args.precision, compile=args.compile)
    return (train, OptimConfig(lr=1e-3, warmup_steps=0, name=optimizer),
            InnerConfig(strategy=strategy, device=args.device))


class PeakMemory:
    """Peak memory a block adds above the level when it starts (activations, gradients, temporaries): the CUDA
    allocator's peak, or RSS sampled every 2 ms on CPU. Both loops' models and optimizer states live in this
    process at once, so the level at rest would say nothing about either loop."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self.base = device, 0, 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            self.base = psutil.Process().memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
        self.peak = max(0, self.peak - self.base)


# dense peak TFLOP/s per GPU: (bf16/fp16 tensor cores, tf32), by a substring of torch.cuda.get_device_name
PEAK_TFLOPS = [("H200", (989.0, 494.7)), ("H100 PCIe", (756.0, 378.0)), ("H100", (989.0, 494.7)),
               ("GH200", (989.0, 494.7)), ("A100", (312.0, 156.0)), ("A10G", (70.0, 35.0)), ("A10", (125.0, 62.5)),
               ("L40S", (362.0, 183.0)), ("L4", (121.0, 60.0)), ("RTX 4090", (165.0, 82.6)),
               ("RTX 3090", (71.0, 35.6)), ("V100", (125.0, 15.7))]


def flops_per_token(preset: str, seq_len: int) -> float:
    """Training FLOPs per token of a preset (forward + backward = 3 x forward)."""
    from engine.model import PRESETS
    shape = PRESETS[preset]
    d, ff, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = d * shape["num_key_value_heads"] // shape["num_attention_heads"]
    matmul = layers * (2 * d * d + 2 * d * kv + 3 * d * ff) + d * VOCAB  # q, o, k, v; gate, up, down; lm_head
    return 6.0 * matmul + 12.0 * layers * d * seq_len


def peak_flops(device: torch.device, precision: str, override: float | None) -> float | None:
    """FLOP/s of one GPU at this precision, or None (CPU, or a GPU not in the table)."""
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32) in PEAK_TFLOPS:
        if key in name:
            return (tf32 if precision == "fp32" else half) * 1e12
    return None


def mfu_text(tokens_per_s: float, args) -> str:
    if args._peak is None:
        return ""
    return f", MFU {tokens_per_s * flops_per_token(args.preset, args.seq_len) / args._peak:.1%}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, steps: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)  # the GPU may still be working on the last step
    return time.perf_counter() - t0


class PlainLoop:
    """What a person would write by hand: forward, cross-entropy, backward, clip, AdamW, LambdaLR."""

    def __init__(self, args, device: torch.device):
        train, optim, _ = configs(args, 1, "ddp")
        self.args, self.device = args, device
        self.model = build_model(ModelConfig(preset=args.preset), VOCAB, args.seq_len, device, seed=0)
        if args.compile:  # the same per-layer compile as the engine's, so that the ratio compares loops
            apply_compile(self.model)
        self.opt = make_optimizer(self.model, optim)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, optim, train.max_steps))
        self.stream = TokenStream(FakeSource(VOCAB, args.seq_len, 0), 0, 1, seed=0)
        dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(args.precision)
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else None

    def step(self) -> None:
        for _ in range(self.args.accum):
            x, y = self.stream.next_batch(self.args.micro_batch)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if self.autocast:
                with self.autocast():
                    logits = self.model(input_ids=x).logits
            else:
                logits = self.model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
            (loss / self.args.accum).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()


class EngineLoop:
    """engine.train's inner loop: train_step over an Inner from build_inner and a TokenStream."""

    def __init__(self, args, device: torch.device, world: World, strategy: str = "ddp", optimizer: str = "adamw"):
        train, optim, inner_cfg = configs(args, world.world_size, strategy, optimizer)
        self.args = args
        model = build_model(ModelConfig(preset=args.preset), VOCAB, args.seq_len, device, seed=0)
        self.inner = build_inner(model, inner_cfg, train, optim, world, device)
        self.stream = TokenStream(FakeSource(VOCAB, args.seq_len, 0), world.rank, world.world_size, seed=0)
        self.optimizer_seconds: list[float] = []  # each optimizer step's own time, once time_optimizer_steps()

    def time_optimizer_steps(self, device: torch.device) -> None:
        """Time each optimizer step apart from the whole step (synced before and after: on a GPU, that sync
        is what the whole step pays anyway at its end)."""
        step = self.inner.optimizer_step

        def timed_step():
            sync(device)
            t0 = time.perf_counter()
            norm = step()
            sync(device)
            self.optimizer_seconds.append(time.perf_counter() - t0)
            return norm
        self.inner.optimizer_step = timed_step

    def step(self) -> None:
        train_step(self.inner, self.stream, self.args.micro_batch, self.args.accum)


def measure(loop, args, device: torch.device) -> tuple[float, int]:
    """(seconds for args.steps steps, peak memory) after args.warmup untimed steps."""
    for _ in range(args.warmup):
        loop.step()
    with PeakMemory(device) as mem:
        seconds = timed(loop.step, args.steps, device)
    return seconds, mem.peak


def single_process(args) -> float:
    """Plain and engine loops, step by step in alternation (ABBA), so load spikes on a shared machine hit both;
    tokens/s from the median step time of each."""
    world = World(rank=0, world_size=1, local_rank=0, hostname="bench", pid=os.getpid())
    device = resolve_device(InnerConfig(device=args.device), world)
    tokens_per_step = args.micro_batch * args.accum * args.seq_len
    kinds = {"plain": PlainLoop, "engine": EngineLoop}
    loops = {name: (kinds[name](args, device) if name == "plain" else kinds[name](args, device, world))
             for name in args.loops.split(",")}
    t0 = time.perf_counter()
    peaks = {name: measure(loop, args, device)[1] for name, loop in loops.items()}  # includes the warm-up
    warm_s = time.perf_counter() - t0  # the first steps: the compile, with --compile
    times: dict[str, list[float]] = {name: [] for name in loops}
    order = list(loops)
    for i in range(args.rounds * args.steps):
        for name in (order if i % 2 == 0 else order[::-1]):
            times[name].append(timed(loops[name].step, 1, device))
    rates = {name: tokens_per_step / statistics.median(t) for name, t in times.items()}
    args._peak = peak_flops(device, args.precision, args.peak_tflops)
    print(f"device {device}, preset {args.preset}, seq_len {args.seq_len}, micro_batch {args.micro_batch} x "
          f"accum {args.accum}, {args.rounds * args.steps} alternating steps each, precision {args.precision}, "
          f"compile {args.compile} (warm-up {warm_s:.1f} s)")
    for name in loops:
        spread = statistics.quantiles(times[name], n=4) if len(times[name]) > 1 else times[name] * 3
        print(f"  {name:<7} {rates[name]:>12,.0f} tok/s (median step {statistics.median(times[name]) * 1e3:.1f} ms, "
              f"quartiles {spread[0] * 1e3:.1f}-{spread[2] * 1e3:.1f} ms)   peak memory +{peaks[name] / 2**20:,.1f} MiB"
              f"{mfu_text(rates[name], args)}")
    if args._peak is not None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "--peak-tflops"
        print(f"  MFU: {flops_per_token(args.preset, args.seq_len) / 1e9:.3f} GFLOP per token, peak "
              f"{args._peak / 1e12:.1f} TFLOP/s ({name}, {args.precision})")
    args._peaks = peaks
    if len(loops) == 2:  # the ratio of each round's median step times, and their median (issue 45: >= 0.98 at 1B)
        per = [statistics.median(times["plain"][r * args.steps:(r + 1) * args.steps]) /
               statistics.median(times["engine"][r * args.steps:(r + 1) * args.steps]) for r in range(args.rounds)]
        args._ratio = rates["engine"] / rates["plain"]
        print(f"  engine/plain per round: {', '.join(f'{r:.3f}' for r in per)}; median of {args.rounds} rounds "
              f"{statistics.median(per):.3f}")
    return rates[list(loops)[-1]]


def optimizer_cost(args) -> dict[str, tuple[float, float]]:
    """--optimizer muon: the engine's step with AdamW and with Muon, one step each in alternation (ABBA); per
    optimizer the median whole step and the median optimizer step, in seconds."""
    world = World(rank=0, world_size=1, local_rank=0, hostname="bench", pid=os.getpid())
    device = resolve_device(InnerConfig(device=args.device), world)
    loops = {name: EngineLoop(args, device, world, optimizer=name) for name in ("adamw", "muon")}
    for loop in loops.values():
        for _ in range(args.warmup):
            loop.step()
        loop.time_optimizer_steps(device)
    whole: dict[str, list[float]] = {name: [] for name in loops}
    order = list(loops)
    for i in range(args.rounds * args.steps):
        for name in (order if i % 2 == 0 else order[::-1]):
            whole[name].append(timed(loops[name].step, 1, device))
    print(f"device {device}, preset {args.preset}, seq_len {args.seq_len}, micro_batch {args.micro_batch} x "
          f"accum {args.accum} ({args.micro_batch * args.accum * args.seq_len:,} tokens per step), "
          f"{args.rounds * args.steps} alternating steps each, precision {args.precision}")
    out = {}
    for name, loop in loops.items():
        out[name] = statistics.median(whole[name]), statistics.median(loop.optimizer_seconds)
        print(f"  {name:<6} whole step {out[name][0] * 1e3:8.1f} ms, optimizer step {out[name][1] * 1e3:7.1f} ms "
              f"({out[name][1] / out[name][0]:.1%} of the step)")
    return out


def worker(args) -> None:
    """One torchrun rank: the engine loop under DDP or FSDP2; rank 0 prints one JSON line."""
    world = read_world()
    device, group = setup_distributed(InnerConfig(device=args.device), world)
    if args.optimizer == "muon":
        cost_worker(args, world, device)
        return
    loop = EngineLoop(args, device, world, strategy=args.worker)
    seconds, peak = measure(loop, args, device)
    t = torch.tensor([seconds, float(peak)])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    if world.rank == 0:
        tokens = args.steps * args.micro_batch * args.accum * args.seq_len * world.world_size
        print(json.dumps({"strategy": args.worker, "tokens_per_s": tokens / float(t[0]), "peak": int(t[1])}),
              flush=True)
    del loop
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip C++ static destructors (gloo's exit-time abort)


def cost_worker(args, world: World, device: torch.device) -> None:
    """--optimizer muon on one torchrun rank: AdamW's and Muon's engine loops in alternation; rank 0 prints the
    medians (the slowest rank's step each time) as one JSON line."""
    loops = {name: EngineLoop(args, device, world, strategy=args.worker, optimizer=name) for name in ("adamw", "muon")}
    for loop in loops.values():
        for _ in range(args.warmup):
            loop.step()
        loop.time_optimizer_steps(device)
    whole: dict[str, list[float]] = {name: [] for name in loops}
    for i in range(args.steps):
        for name in (list(loops) if i % 2 == 0 else list(loops)[::-1]):
            whole[name].append(timed(loops[name].step, 1, device))
    # the gathers alone (FSDP2): every Muon matrix all-gathered from its shards, as each Muon step does
    matrices = [p for g in loops["muon"].inner.optimizer.muon.param_groups for p in g["params"]]
    gathers = []
    for _ in range(args.steps if args.worker == "fsdp" else 0):
        t0 = time.perf_counter()
        for p in matrices:
            p.detach().full_tensor()
        sync(device)
        gathers.append(time.perf_counter() - t0)
    times = torch.tensor([[whole[n][i], loops[n].optimizer_seconds[i], gathers[i] if gathers else 0.0]
                          for n in loops for i in range(args.steps)])
    torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
    if world.rank == 0:
        per = {n: times[k * args.steps:(k + 1) * args.steps] for k, n in enumerate(loops)}
        print(json.dumps({"strategy": args.worker, **{n: [float(t[:, 0].median()), float(t[:, 1].median())]
                                                       for n, t in per.items()},
                          "gather": float(per["muon"][:, 2].median()),
                          "gather_mb": sum(p.numel() * p.element_size() for p in matrices) / 1e6}), flush=True)
    del loops
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip C++ static destructors (gloo's exit-time abort)


def multi_process_cost(args) -> dict[str, dict[str, list[float]]]:
    """--optimizer muon on args.nproc processes per strategy: {strategy: {optimizer: [whole, optimizer step]}}."""
    out = {}
    for strategy in args.strategies.split(","):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--worker", strategy, *args._passthrough, "--optimizer=muon"]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
        try:
            done = run_torchrun(cmd, args.timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            print(f"  {strategy}: timed out after {args.timeout:.0f}s")
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            print(f"  {strategy}: failed (rc {done.returncode})\n{worker_errors(done.stderr)}")
            continue
        res = json.loads(lines[-1])
        out[strategy] = res
        for name in ("adamw", "muon"):
            w, o = res[name]
            print(f"  {strategy:<5} x{args.nproc} {name:<6} whole step {w * 1e3:8.1f} ms, optimizer step "
                  f"{o * 1e3:7.1f} ms")
        if strategy == "fsdp":
            print(f"  fsdp  x{args.nproc} the gathers alone (every Muon matrix, {res['gather_mb']:.1f} MB whole): "
                  f"{res['gather'] * 1e3:.1f} ms a step")
    return out


def multi_process(args, single_tps: float) -> None:
    for strategy in args.strategies.split(","):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, "--worker", strategy, *args._passthrough]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(args.threads)}
        try:
            done = run_torchrun(cmd, args.timeout, env=env, cwd=ROOT)
        except subprocess.TimeoutExpired:
            print(f"  {strategy}: timed out after {args.timeout:.0f}s")
            continue
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            print(f"  {strategy}: failed (rc {done.returncode})\n{worker_errors(done.stderr)}")
            continue
        res = json.loads(lines[-1])
        per_worker = res["tokens_per_s"] / args.nproc
        print(f"  {strategy:<7} x{args.nproc} {res['tokens_per_s']:>10,.0f} tok/s node, {per_worker:,.0f} per worker,"
              f" overhead vs 1 process {1 - per_worker / single_tps:+.1%}, peak memory +{res['peak'] / 2**20:,.1f} MiB"
              f"{mfu_text(per_worker, args)}")


def auto_micro_batch(args) -> int:
    """The largest power of two (<= 64) whose memory estimate, once per loop run side by side, fits this GPU's
    memory (engine/memory.py budget: 90 % less the CUDA context); 1 on a CPU or when none does."""
    from engine.config import load_config
    from engine.memory import budget, estimate
    if args.device == "cpu" or not torch.cuda.is_available():
        return 1
    total = torch.cuda.get_device_properties(0).total_memory
    loops = len(args.loops.split(","))
    best = 1
    for mb in (1, 2, 4, 8, 16, 32, 64):
        cfg = load_config(None, {"model.preset": args.preset, "data.fake": True, "data.seq_len": args.seq_len,
                                 "train.micro_batch_size": mb, "train.batch_size": mb * args.accum,
                                 "train.precision": args.precision})
        if loops * estimate(cfg, workers=1, device="cuda").per_gpu <= budget(total):
            best = mb
    print(f"micro-batch auto: {best} (the estimate's largest power of two for {loops} loop(s) on "
          f"{total / 2**30:.0f} GiB)")
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug", choices=["debug", "15m", "150m", "1b"])
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", default="8",
                    help="sequences per forward, or auto: the largest power of two the memory estimate fits on "
                         "this GPU beside the other loop (engine/memory.py)")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16-mixed", "fp16-mixed"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="intra-op CPU threads per process")
    ap.add_argument("--nproc", type=int, default=2, help="processes for the DDP/FSDP2 part (0: skip)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--strategies", default="ddp,fsdp",
                    help="comma-separated strategies of the multi-process part (ddp, fsdp, zero1, zero2, zero3)")
    ap.add_argument("--peak-tflops", type=float, help="the GPU's dense peak (default: from the device name)")
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                    help="muon: what Muon costs against AdamW (optimizer step and whole step), not engine vs plain")
    ap.add_argument("--compile", action="store_true", help="train.compile = true for both loops")
    ap.add_argument("--loops", default="plain,engine", choices=["plain,engine", "engine", "plain"],
                    help="the single-process loops to run (one alone leaves the GPU's memory to it)")
    ap.add_argument("--worker", choices=["ddp", "fsdp", "zero1", "zero2", "zero3"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    bad = [s for s in args.strategies.split(",") if s not in ("ddp", "fsdp", "zero1", "zero2", "zero3")]
    if bad:
        ap.error(f"--strategies: unknown {bad[0]!r} (known: ddp, fsdp, zero1, zero2, zero3)")
    if args.optimizer == "muon" and any(s.startswith("zero") for s in args.strategies.split(",")):
        ap.error("--optimizer muon: --strategies takes ddp and fsdp only (Muon is refused under DeepSpeed ZeRO)")
    torch.set_num_threads(args.threads)
    args.micro_batch = auto_micro_batch(args) if args.micro_batch == "auto" else int(args.micro_batch)
    if args.worker:
        worker(args)
        return
    args._passthrough = [*(["--compile"] if args.compile else []), f"--preset={args.preset}",
                         f"--seq-len={args.seq_len}", f"--micro-batch={args.micro_batch}",
                         f"--accum={args.accum}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                         f"--precision={args.precision}", f"--device={args.device}", f"--threads={args.threads}"]
    if args.optimizer == "muon":
        single = optimizer_cost(args)
        if args.nproc > 1:
            print(f"{args.nproc} processes (same micro-batch per worker; medians of the slowest rank's times):")
            multi = multi_process_cost(args)
            if "fsdp" in multi and "ddp" in multi:
                # a DDP rank runs the same Newton-Schulz on the same whole matrices, without gathering them first
                extra = {s: multi[s]["muon"][1] - multi[s]["adamw"][1] for s in ("ddp", "fsdp")}
                print(f"  Muon's extra optimizer time x{args.nproc}: fsdp {extra['fsdp'] * 1e3:.1f} ms, ddp "
                      f"{extra['ddp'] * 1e3:.1f} ms: the gathers cost {(extra['fsdp'] - extra['ddp']) * 1e3:+.1f} ms "
                      f"a step")
        (aw, ao), (mw, mo) = single["adamw"], single["muon"]
        print(f"muon/adamw: optimizer step {mo * 1e3:.1f} ms vs {ao * 1e3:.1f} ms, whole step {mw * 1e3:.1f} ms vs "
              f"{aw * 1e3:.1f} ms ({mw / aw - 1:+.1%})")
        return
    single_tps = single_process(args)
    if args.nproc > 1:
        print(f"{args.nproc} processes (same micro-batch per worker; overhead = 1 - per-worker / one-process tok/s):")
        multi_process(args, single_tps)
    if hasattr(args, "_ratio"):
        print(f"engine/plain tokens/s ratio: {args._ratio:.3f} (goal >= 0.95); peak memory ratio "
              f"{args._peaks['engine'] / max(args._peaks['plain'], 1):.3f}")


if __name__ == "__main__":
    main()
