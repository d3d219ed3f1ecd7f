"""Data benchmark: prepare throughput, read rate against what the 150m preset consumes, and memory flat in corpus
size, all in one run on corpora generated here (never downloaded).

    python bench/data.py                         # 100 MB and 1 GB corpora under /tmp/zb-data-bench (~10 min, 2 cores)
    python bench/data.py --small-mb 20 --large-mb 200 --no-raw     # a quick look

1. Corpora: the shipped docstrings plus this Python's own standard-library sources, as JSONL documents, repeated
   with a copy number in each document (so the held-out hash varies) up to --small-mb and --large-mb of text.
   Kept in --work between runs; prepared folders too (delete --work to start over).
2. Prepare: `python -m engine.data prepare` (worker processes: all cores) on both; MB/s of source text.
3. Read: one worker's TokenStream over the large prepared corpus at the 150m preset's shape (seq_len 1024,
   micro-batch 16), tokens/s. Consume: the 150m preset's training tokens/s per worker, measured here (forward,
   backward and AdamW on this machine's device) and estimated for an H100 (bf16 989 TFLOP/s dense at 50% MFU,
   6 N + 12 L d s FLOPs per token); the ratio R1 is taken against the larger of the two. Goal R1 >= 10.
4. Memory: `python -m engine.train configs/debug.toml --data.path=PREPARED --train.max_steps=N` for both sizes, a
   fresh process each, --repeats times alternating; peak RSS (VmHWM) and the time from launch to the first step
   event. Also the time build_data takes to open each prepared folder in this process.
   Goal: RSS ratio R2 <= 1.1 and start-up that does not grow with the corpus. With --raw (default) the 100 MB
   corpus is also trained from its raw files, the path that tokenizes everything in every worker, for contrast.

Last line: `data read / train consume R1; rss 1GB / 100MB R2`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.config import DataConfig, InnerConfig, ModelConfig, OptimConfig, TrainConfig  # noqa: E402
from engine.data import build_data  # noqa: E402
from engine.model import PRESETS, build_model, count_params  # noqa: E402
from engine.inner.ddp_fsdp import build_inner  # noqa: E402
from engine.world import World  # noqa: E402

H100_BF16_FLOPS = 989e12
MFU = 0.5
WORLD = World(rank=0, world_size=1, local_rank=0, hostname="bench", pid=os.getpid())


def source_texts() -> list[str]:
    """The shipped docstrings and the standard library's .py files (no site-packages): ~30-40 MB of text."""
    texts = [json.loads(line)["text"] for line in (ROOT / "corpus" / "stdlib_docstrings.jsonl").open()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(stdlib.rglob("*.py")):
        if "site-packages" not in f.parts and "dist-packages" not in f.parts:
            texts.append(f.read_text(encoding="utf-8", errors="replace"))
    return texts


def make_corpus(path: Path, megabytes: int, texts: list[str]) -> Path:
    target = megabytes * 1_000_000
    if path.is_file() and path.stat().st_size >= target:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    written, copy = 0, 0
    with tmp.open("w") as fh:
        while written < target:
            for text in texts:
                line = json.dumps({"text": f"# copy {copy}\n{text}"}) + "\n"
                fh.write(line)
                written += len(line)
                if written >= target:
                    break
            copy += 1
    os.replace(tmp, path)
    return path


def run_prepare(corpus: Path, out: Path) -> tuple[float, float]:
    """(seconds of the whole command, seconds it spent tokenizing and writing, from the manifest); zeros when the
    folder is already complete from an earlier run."""
    if (out / "manifest.json").is_file():
        return 0.0, 0.0
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "engine.data", "prepare", str(corpus), "--out", str(out), "--quiet"],
                   cwd=ROOT, check=True, env=env())
    return time.monotonic() - t0, json.loads((out / "manifest.json").read_text())["seconds"]


def env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("ZERO_BAND_", "GLOBAL_"))},
            "PYTHONPATH": str(ROOT)}


def read_rate(prepared: Path, seconds: float) -> float:
    """Tokens/s one worker's stream yields at the 150m shape (seq_len 1024, micro-batch 16)."""
    data = build_data(DataConfig(path=str(prepared), seq_len=1024), WORLD, seed=0)
    data.train.next_batch(16)
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        x, _ = data.train.next_batch(16)
        n += x.numel()
    return n / (time.monotonic() - t0)


def consume_rate(steps: int) -> tuple[float, str, float]:
    """(measured tokens/s of one 150m training worker on this machine's device, the device, H100 estimate)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    micro = 16 if device.type == "cuda" else 1
    model = build_model(ModelConfig(preset="150m"), 258, 1024, device, seed=0)
    shape = PRESETS["150m"]
    flops_per_token = 6 * count_params(model) + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * 1024
    train = TrainConfig(micro_batch_size=micro, batch_size=micro, max_steps=1000,
                        precision="bf16-mixed" if device.type == "cuda" else "fp32")
    inner = build_inner(model, InnerConfig(strategy="ddp"), train, OptimConfig(), WORLD, device)
    x = torch.randint(0, 258, (micro, 1024))
    warmup = 1 if device.type == "cuda" else 0  # a CPU step is slow enough that a warm-up changes nothing
    times = []
    for _ in range(steps + warmup):
        t0 = time.monotonic()
        inner.micro_step(x, x, last=True)
        inner.optimizer_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.monotonic() - t0)
    measured = micro * 1024 / sorted(times[warmup:])[len(times[warmup:]) // 2]
    return measured, str(device), H100_BF16_FLOPS * MFU / flops_per_token


def peak_rss(pid: int) -> int | None:
    """VmHWM: the peak RSS of the process's current address space. Not wait4's ru_maxrss, which on Linux keeps
    the high-water mark from before exec, i.e. this (much larger) bench process's."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:  # the process has just exited: keep the last sample
        return None
    return None


def train_run(data_path: Path, run_dir: Path, steps: int) -> tuple[int, float, float]:
    """(peak RSS bytes, seconds from launch to the first step event, total seconds) of one engine process.
    VmHWM is sampled at every event line the engine prints, the last one being run_end (before tear-down).
    The run's folder (its final checkpoint, ~22 MB with configs/debug.toml) is removed afterwards."""
    args = [sys.executable, "-m", "engine.train", "configs/debug.toml", f"--data.path={data_path}",
            f"--train.max_steps={steps}", f"--run.dir={run_dir}", "--train.log_interval=1",
            "--train.eval_interval=0", "--ckpt.interval=0", "--telemetry.human=false"]
    t0 = time.monotonic()
    proc = subprocess.Popen(args, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    first, peak = None, 0
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            peak = max(peak, peak_rss(proc.pid) or 0)
            if first is None and '"type":"step"' in line:
                first = time.monotonic() - t0
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"engine run on {data_path} failed (rc {proc.returncode})")
    return peak, first, time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="/tmp/zb-data-bench")
    parser.add_argument("--small-mb", type=int, default=100)
    parser.add_argument("--large-mb", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=10, help="training steps of each memory run")
    parser.add_argument("--repeats", type=int, default=2, help="memory runs per corpus size (load on a shared "
                        "machine makes one start-up time noisy)")
    parser.add_argument("--read-seconds", type=float, default=5.0)
    parser.add_argument("--consume-steps", type=int, default=3)
    parser.add_argument("--raw", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    work = Path(args.work)
    texts = source_texts()
    sizes = {"small": args.small_mb, "large": args.large_mb}
    corpora = {k: make_corpus(work / f"corpus-{mb}mb" / "docs.jsonl", mb, texts) for k, mb in sizes.items()}
    prepared = {k: work / f"prepared-{mb}mb" for k, mb in sizes.items()}

    print(f"prepare ({os.cpu_count()} worker processes):")
    for k in sizes:
        mb = corpora[k].stat().st_size / 1e6
        wall, seconds = run_prepare(corpora[k], prepared[k])
        shards = sum(f.stat().st_size for f in prepared[k].glob("*.bin")) / 1e6
        rate = f"{mb / seconds:6.1f} MB/s ({seconds:.0f} s; {mb / wall:.1f} MB/s counting start-up)" if seconds \
            else "(prepared by an earlier run)"
        print(f"  {mb:7.0f} MB of text -> {shards:7.0f} MB of shards   {rate}")

    read = read_rate(prepared["large"], args.read_seconds)
    measured, device, h100 = consume_rate(args.consume_steps)
    consume = max(measured, h100)
    print(f"read: {read:,.0f} tokens/s from one worker's stream ({args.large_mb} MB corpus, seq_len 1024, "
          f"micro-batch 16)")
    print(f"consume (150m preset, one worker): {measured:,.0f} tokens/s measured on {device}; "
          f"{h100:,.0f} tokens/s estimated for an H100 at {MFU:.0%} MFU")

    for k in sizes:  # in this process: what start-up costs the data itself, without interpreter and torch
        best = float("inf")
        for _ in range(3):  # the best of three: the first call of a process also pays one-time imports
            t0 = time.monotonic()
            build_data(DataConfig(path=str(prepared[k]), seq_len=128), WORLD, seed=0)
            best = min(best, time.monotonic() - t0)
        print(f"open the prepared {sizes[k]} MB corpus (build_data): {1000 * best:.1f} ms")

    print(f"train {args.steps} steps of configs/debug.toml, {args.repeats} runs each, alternating (the largest peak "
          f"RSS, the fastest launch to first step):")
    results: dict[str, tuple[int, float, float]] = {}
    for _ in range(args.repeats):
        for k in sizes:
            rss, first, total = train_run(prepared[k], work / f"run-{k}-{time.time_ns()}", args.steps)
            was = results.get(k, (0, float("inf"), float("inf")))
            results[k] = (max(rss, was[0]), min(first, was[1]), min(total, was[2]))
    for k in sizes:
        rss, first, total = results[k]
        print(f"  prepared {sizes[k]:>5} MB: {rss / 2**20:7.0f} MiB   first step {first:5.1f} s   total {total:5.1f} s")
    if args.raw:
        rss, first, total = train_run(corpora["small"], work / f"run-raw-{time.time_ns()}", args.steps)
        print(f"  raw      {sizes['small']:>5} MB: {rss / 2**20:7.0f} MiB   first step {first:5.1f} s   "
              f"total {total:5.1f} s   (tokenized in the process)")
    r1 = read / consume
    r2 = results["large"][0] / results["small"][0]
    print(f"start-up large / small {results['large'][1] / results['small'][1]:.2f}; goals: R1 >= 10, R2 <= 1.1")
    large = f"{args.large_mb / 1000:g}GB" if args.large_mb >= 1000 else f"{args.large_mb}MB"
    print(f"data read / train consume {r1:.1f}; rss {large} / {args.small_mb}MB {r2:.3f}")


if __name__ == "__main__":
    main()
