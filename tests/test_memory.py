"""The memory estimate (engine/memory.py) against what the real model and the real strategies hold.

    element counts   the torch-free shape of every preset against the model transformers builds (on the meta device)
    sharded terms    each rank of a 2-rank gloo run of the debug model after one step: FSDP2's local shards of
                     parameters, gradients and AdamW states; DeepSpeed ZeRO 1/2/3's fp32 master partitions and states
    activations      the bytes autograd saves for backward on a CPU (saved-tensor hooks), fp32 and bf16 autocast,
                     with and without activation checkpointing, at two presets and two micro-batch shapes
    the dry run      `python -m engine.train CONFIG --dry-run` prints the table, ends with `per GPU:`, exits 0, and
                     imports no torch
    the verdict      fitting(): a GPU just large enough takes the config, one just too small names a setting
"""

from __future__ import annotations

import datetime
import math
import os
import pickle
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import PYTHON, ROOT, engine_env, spawned_ranks  # noqa: E402

from engine.config import Config, load_config  # noqa: E402
from engine.memory import (BYTE_VOCAB, GiB, activation_bytes, budget, estimate, fitting, fsdp_local,  # noqa: E402
                           model_shape, zero_local)
from engine.presets import PRESETS  # noqa: E402


def _cfg(**over) -> Config:
    return load_config(None, {"model.preset": "debug", "data.fake": True, "data.seq_len": 64,
                              "train.micro_batch_size": 2, "train.batch_size": 4, **over})


# ---- element counts --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_torch_free_shape_counts_what_the_model_holds(preset):
    import torch
    from engine.config import ModelConfig
    from engine.model import model_config
    from transformers import LlamaForCausalLM

    with torch.device("meta"):  # no memory: the 1b preset's shapes without its 4 GB
        model = LlamaForCausalLM(model_config(ModelConfig(preset=preset), BYTE_VOCAB, 1024))
    shape = model_shape(ModelConfig(preset=preset), BYTE_VOCAB)
    assert shape.numel == sum(p.numel() for p in model.parameters())
    assert sorted(shape.tensors()) == sorted(tuple(p.shape) for p in model.parameters())
    assert shape.hidden_matrices == sum(p.numel() for n, p in model.named_parameters()
                                        if p.ndim == 2 and ".layers." in n)


# ---- sharded terms: what each rank really holds ------------------------------------------------------------------
def _rank_worker(rank: int, port: int, queue) -> None:
    try:
        import torch
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_RANK=str(rank))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        out = {}
        for strategy in ("fsdp", "zero1", "zero2", "zero3"):
            out[strategy] = _held(strategy, rank)
            dist.barrier()
        queue.put((rank, pickle.dumps(out)))
    except Exception:  # noqa: BLE001 - the test reports it
        queue.put((rank, traceback.format_exc()))


def _held(strategy: str, rank: int) -> dict[str, int]:
    """Elements this rank holds after one step: parameters, gradients, optimizer states (and ZeRO's master)."""
    import torch
    from engine.inner.ddp_fsdp import build_inner
    from engine.model import build_model
    from engine.data import FakeSource, TokenStream
    from engine.world import World

    cfg = _cfg(**{"inner.strategy": strategy, "inner.device": "cpu"})
    world = World(rank=rank, world_size=2, local_rank=rank, hostname="t", pid=os.getpid())
    model = build_model(cfg.model, BYTE_VOCAB, cfg.data.seq_len, "cpu", seed=0)
    inner = build_inner(model, cfg.inner, cfg.train, cfg.optim, world, torch.device("cpu"))
    x, y = TokenStream(FakeSource(BYTE_VOCAB, cfg.data.seq_len, 0), rank, 2, seed=0).next_batch(2)

    def local(t) -> int:
        return t.to_local().numel() if hasattr(t, "to_local") else t.numel()
    inner.micro_step(x, y, last=True)
    grads = sum(local(p.grad) for p in inner.model.parameters() if p.grad is not None)
    inner.optimizer_step()  # the step zeroes the gradients (set to None): counted before it
    states = sum(local(v) for s in inner.optimizer.state.values() for k, v in s.items()
                 if k in ("exp_avg", "exp_avg_sq"))
    if strategy == "fsdp":
        return {"params": sum(local(p) for p in inner.model.parameters()),
                "grads": grads,
                "states": states}
    held = {"master": sum(t.numel() for t in inner.outer_params()), "states": states}
    if strategy == "zero3":
        held["params"] = sum(p.ds_tensor.numel() for p in inner.model.parameters())
    del inner
    return held


@pytest.fixture(scope="module")
def held() -> dict[int, dict]:
    pytest.importorskip("deepspeed")
    return spawned_ranks(_rank_worker, 2, timeout=300)


def test_fsdp_shards_are_what_each_rank_holds(held):
    shape = model_shape(_cfg().model, BYTE_VOCAB)
    for rank in (0, 1):
        got = held[rank]["fsdp"]
        want = fsdp_local(shape, 2, rank)
        assert got == {"params": want, "grads": want, "states": 2 * want}, rank
    est = {p.name: p.bytes for p in estimate(_cfg(**{"inner.strategy": "fsdp"}), workers=2).parts}
    assert est["params"] == est["grads"] == 4 * fsdp_local(shape, 2, 0)
    assert est["optimizer"] == 8 * fsdp_local(shape, 2, 0)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_partitions_are_what_each_rank_holds(held, strategy):
    shape = model_shape(_cfg().model, BYTE_VOCAB)
    want = zero_local(shape, 2)
    for rank in (0, 1):
        got = held[rank][strategy]
        assert got["master"] == want and got["states"] == 2 * want, (rank, got, want)
        if strategy == "zero3":
            assert got["params"] == want, (rank, got)
    est = {p.name: p.bytes for p in estimate(_cfg(**{"inner.strategy": strategy}), workers=2).parts}
    assert est["master"] == 4 * want and est["optimizer"] == 8 * want


# ---- activations: the bytes autograd saves -----------------------------------------------------------------------
def _saved_bytes(preset: str, batch: int, seq: int, mixed: bool, checkpointing: bool) -> int:
    import torch
    from engine.config import ModelConfig
    from engine.inner.transforms import apply_activation_checkpointing
    from engine.model import build_model, causal_lm_loss

    model = build_model(ModelConfig(preset=preset), BYTE_VOCAB, seq)
    if checkpointing:
        apply_activation_checkpointing(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t
    x = torch.randint(0, BYTE_VOCAB, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            causal_lm_loss(model, x, x)
    weights = sum(p.numel() for p in model.parameters()) * 2 if mixed and not checkpointing else 0
    # the bf16 copies of the weights autocast made are saved too: the estimate counts them as their own part
    return sum(v for k, v in seen.items() if k not in params) - weights


@pytest.mark.parametrize("preset,batch,seq", [("debug", 2, 64), ("debug", 4, 128), ("15m", 2, 96)])
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_the_bytes_autograd_saves(preset, batch, seq, mixed, checkpointing):
    shape = model_shape(_cfg(**{"model.preset": preset}).model, BYTE_VOCAB)
    want, _ = activation_bytes(shape, batch * seq, mixed, checkpointing)
    got = _saved_bytes(preset, batch, seq, mixed, checkpointing)
    tolerance = 0.15 if mixed else 0.03  # autocast's copies vary with the ops' order; fp32 is exact arithmetic
    assert abs(want - got) <= tolerance * got, (want, got)


# ---- the parts that follow the settings -------------------------------------------------------------------------
def test_checkpointing_and_micro_batch_scale_the_activations():
    big = estimate(load_config(ROOT / "configs/1b.toml", {"train.activation_checkpointing": False}), workers=8)
    ac = estimate(load_config(ROOT / "configs/1b.toml"), workers=8)
    half = estimate(load_config(ROOT / "configs/1b.toml", {"train.activation_checkpointing": False,
                                                              "train.micro_batch_size": 4}), workers=8)
    a_big, a_ac, a_half = (next(p.bytes for p in e.parts if p.name == "activations") for e in (big, ac, half))
    assert a_half * 2 == pytest.approx(a_big, rel=1e-6)
    assert a_ac < a_big / 5
    assert big.per_gpu > half.per_gpu > ac.per_gpu


def test_muon_keeps_one_buffer_for_the_hidden_matrices():
    cfg = load_config(ROOT / "configs/1b.toml", {"inner.strategy": "ddp"})
    shape = model_shape(cfg.model, BYTE_VOCAB)
    adamw = next(p.bytes for p in estimate(cfg, workers=2, optim="adamw").parts if p.name == "optimizer")
    muon = next(p.bytes for p in estimate(cfg, workers=2, optim="muon").parts if p.name == "optimizer")
    assert adamw == 8 * shape.numel
    assert muon == 4 * shape.hidden_matrices + 8 * (shape.numel - shape.hidden_matrices)
    with pytest.raises(ValueError, match="optim.name: 'sgd'"):
        estimate(cfg, workers=2, optim="sgd")


def test_diloco_counts_snapshot_momentum_and_the_codec():
    cfg = load_config(ROOT / "configs/1b-diloco.toml")
    shape = model_shape(cfg.model, BYTE_VOCAB)
    parts = {p.name: p for p in estimate(cfg, workers=8).parts}
    local = fsdp_local(shape, 8)
    assert parts["diloco buffers"].bytes == 12 * local
    assert parts["outer momentum"].bytes == 4 * local
    plain = {p.name: p for p in estimate(load_config(ROOT / "configs/1b-diloco.toml", {
        "diloco.compression": "none", "diloco.outer_momentum": 0.0}), workers=8).parts}
    assert "outer momentum" not in plain and plain["exchange"].host  # pinned host memory beside a GPU


# ---- the dry run ----------------------------------------------------------------------------------------------------
def test_dry_run_prints_the_table_and_imports_no_torch(tmp_path):
    code = ("import sys, engine.train as t; rc = t.main(sys.argv[1:]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    done = subprocess.run([PYTHON, "-c", code, "configs/1b.toml", "--dry-run", "--inner.device=cuda",
                           "--train.micro_batch_size=4"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=engine_env(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "fsdp x 8 workers" in lines[0] and "micro-batch 4 x seq 1024" in lines[0]
    cfg = load_config(ROOT / "configs/1b.toml", {"train.micro_batch_size": 4})
    want = estimate(cfg, workers=8).per_gpu
    assert lines[-1].startswith(f"per GPU: {want / GiB:.2f} GiB")
    assert not list(tmp_path.iterdir())
    bad = subprocess.run([PYTHON, "-m", "engine.train", "configs/1b.toml", "--dry-run", "--train.micro_batch=4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, env=engine_env())
    assert bad.returncode == 2 and bad.stderr.startswith("error: command line: train.micro_batch: unknown key")


# ---- the verdict: both sides of the threshold ------------------------------------------------------------------------
def _gpu_for(need: int) -> int:
    """The smallest GPU (bytes) whose budget takes `need` bytes."""
    from engine.memory import CUDA_CONTEXT, HEADROOM
    return math.ceil((need + CUDA_CONTEXT) / HEADROOM) + 1


def test_a_config_fits_a_gpu_just_large_enough_and_not_one_just_smaller():
    cfg = load_config(ROOT / "configs/1b.toml", {"train.activation_checkpointing": False, "inner.strategy": "ddp"})
    need = estimate(cfg, workers=8).per_gpu
    gpu = _gpu_for(need)
    assert budget(gpu) >= need > budget(gpu - 2)
    # just too small: the first setting that fits is activation checkpointing, named as it is written
    assert fitting(cfg, 8, gpu - 2) == "train.activation_checkpointing = true"
    # nothing fits a tiny GPU
    assert fitting(cfg, 8, 2 * GiB) is None
    # with checkpointing on, a smaller micro-batch that divides the batch is offered instead
    ac = cfg.model_copy(deep=True)
    ac.train.activation_checkpointing = True
    need_ac = estimate(ac, workers=8).per_gpu
    assert fitting(ac, 8, _gpu_for(need_ac) - 2) == f"train.micro_batch_size = {ac.train.micro_batch_size // 2}"


# ---- the GPU check's script, on a CPU with tiny settings ----------------------------------------------------------
def test_memory_check_bench_runs_each_strategy_in_its_own_process_on_a_cpu():
    done = subprocess.run([PYTHON, "bench/memory_check.py", "--device", "cpu", "--preset", "debug", "--seq-len",
                           "32", "--micro-batch", "2", "--steps", "1", "--strategies", "single,fsdp"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=engine_env())
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout.splitlines()
    cfg = load_config(ROOT / "configs/debug.toml", {"data.fake": True, "data.seq_len": 32, "train.micro_batch_size": 2,
                                                    "train.batch_size": 2, "inner.device": "cpu"})
    want = estimate(cfg, workers=1, device="cpu").per_gpu / GiB
    assert [ln.split()[0] for ln in out[1:3]] == ["single", "fsdp"]
    assert f"estimate {want:8.3f} GiB" in out[1] and "(CPU RSS: not judged)" in out[1]
    assert out[-1] == "memory estimate: 0 of 0 strategies within 15%"
