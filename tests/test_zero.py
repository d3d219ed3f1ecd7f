"""DeepSpeed ZeRO 1/2/3 as an inner strategy (engine/inner/zero.py).

Pure units run in the test process. The numbers come from 2-process gloo runs on CPU: this file is also the
driver (`python -m torch.distributed.run --nproc_per_node=2 tests/test_zero.py STAGE ...`), which trains a
tiny Llama under ZeRO and, on every rank, a plain single-process replica on the same global batch, then checks
the DiLoCo hooks and a DCP checkpoint round trip, and prints one JSON line of numbers for the test to judge.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from procs import PYTHON, engine_env  # noqa: E402

from engine.inner.zero import INSTALL_HINT, deepspeed_config, import_deepspeed, zero_stage  # noqa: E402

# fp32 on CPU: ZeRO reduces gradients in a different order than one process sums them; after a few AdamW
# steps the losses still agree to ~1e-6. bf16 keeps bf16 working weights: 2e-2 relative is the bound.
FP32_TOL = 1e-4
BF16_TOL = 2e-2


# -- units -------------------------------------------------------------------------------------------------

def test_stage_names():
    assert [zero_stage(s) for s in ("zero1", "zero2", "zero3")] == [1, 2, 3]
    with pytest.raises(ValueError, match="inner.strategy: 'fsdp' is not a ZeRO strategy"):
        zero_stage("fsdp")


def test_config_maps_engine_keys():
    cfg = deepspeed_config(3, micro_batch_size=4, grad_accum=2, precision="bf16-mixed", clip_norm=1.0,
                           offload_optimizer=True, offload_params=True)
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 2
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["zero_optimization"]["offload_param"]["device"] == "cpu"
    # a torch optimizer, never one named in the config (that JIT-builds the fused CPU Adam)
    assert "optimizer" not in cfg and cfg["zero_force_ds_cpu_optimizer"] is False
    fp16 = deepspeed_config(1, micro_batch_size=1, grad_accum=1, precision="fp16-mixed", clip_norm=0.0)
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0 and "bf16" not in fp16
    assert fp16["gradient_clipping"] == 0.0 and "offload_optimizer" not in fp16["zero_optimization"]


def test_buckets_follow_the_hidden_size():
    # DeepSpeed's defaults (5e8-element reduce buckets) would be most of a small model's memory
    zero = deepspeed_config(3, micro_batch_size=1, grad_accum=1, precision="fp32", clip_norm=1.0,
                            hidden_size=192)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 192 * 192
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 192 * 192)
    assert zero["stage3_param_persistence_threshold"] == 1920
    zero1 = deepspeed_config(1, micro_batch_size=1, grad_accum=1, precision="fp32", clip_norm=1.0,
                             hidden_size=192)["zero_optimization"]
    assert "stage3_prefetch_bucket_size" not in zero1 and zero1["reduce_bucket_size"] == 192 * 192
    assert "reduce_bucket_size" not in deepspeed_config(2, micro_batch_size=1, grad_accum=1, precision="fp32",
                                                        clip_norm=1.0)["zero_optimization"]


def test_config_rejects_param_offload_below_stage3():
    with pytest.raises(ValueError, match="inner.offload_params: parameter offload needs ZeRO stage 3"):
        deepspeed_config(2, micro_batch_size=1, grad_accum=1, precision="fp32", clip_norm=1.0, offload_params=True)


def test_missing_deepspeed_says_how_to_install(monkeypatch):
    import torch
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # what an environment without the extra looks like
    with pytest.raises(ValueError) as err:
        import_deepspeed("zero2", torch.device("cpu"))
    assert str(err.value) == f"inner.strategy=zero2 needs DeepSpeed, which is not installed: {INSTALL_HINT}"
    assert "\n" not in str(err.value)


# -- 2 processes: ZeRO against a single-process replica on the same global batch ----------------------------

def _run_driver(procs, port, stage: int, *overrides: str) -> dict:
    env = engine_env(DS_ACCELERATOR="cpu")
    args = [PYTHON, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", __file__, str(stage), *overrides]
    done = procs.run(args, timeout=120, env=env)
    assert done.returncode == 0, f"driver failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def _check(out: dict, tol: float) -> None:
    assert out["zero"] == pytest.approx(out["ref"], rel=tol)
    assert out["zero_norm"] == pytest.approx(out["ref_norm"], rel=max(tol, 1e-5))
    assert [a for a, _ in out["lr"]] == pytest.approx([b for _, b in out["lr"]])
    # resuming from the DCP checkpoint repeats the same two steps exactly
    assert out["resume"][0] == out["resume"][1]
    # partitions cover the model once (no padding in this model), and DiLoCo's per-rank pseudo-gradients
    # add up to the whole model's displacement
    assert out["numel"][0] == out["numel"][1]
    assert out["pgrad_sq"][0] == pytest.approx(out["pgrad_sq"][1], rel=1e-9) and out["pgrad_sq"][0] > 0
    # an outer step that writes the snapshot back restores the initial weights, and forward sees them
    assert out["rollback_max_diff"] == 0.0
    assert out["rollback_eval"][0] == pytest.approx(out["rollback_eval"][1], rel=tol)


@pytest.mark.slow
@pytest.mark.parametrize("stage,overrides", [
    (1, []),
    (2, ["--inner.offload_optimizer=true"]),
    (3, ["--inner.offload_optimizer=true", "--inner.offload_params=true"]),
], ids=["zero1", "zero2-offload-optimizer", "zero3-offload-all"])
def test_zero_matches_single_process_fp32(procs, port, stage, overrides):
    out = _run_driver(procs, port, stage, *overrides)
    _check(out, FP32_TOL)
    assert out["start_diff"] == 0.0  # fp32: ZeRO starts from exactly the model's weights


@pytest.mark.slow
def test_zero2_bf16_tracks_fp32(procs, port):
    out = _run_driver(procs, port, 2, "--train.precision=bf16-mixed")
    _check(out, BF16_TOL)
    assert out["zero"] != out["ref"]  # bf16 working weights really were used
    assert 0 < out["start_diff"] < 1e-2  # ... and DeepSpeed made its fp32 masters from the bf16-cast model


# -- the real engine: `torchrun -m engine.train --inner.strategy=zeroN` against FSDP2 --------------------------

# FSDP2 and ZeRO see the same global batch each step (engine/data.py shards it by rank); in fp32 only the order
# of reductions differs, so the losses agree to 1e-4 (absolute), the bound test_train.py uses between layouts.
PARITY_TOL = 1e-4
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "engine.train",
            "configs/debug.toml"]
SMALL = ["--data.seq_len=64", "--train.micro_batch_size=2", "--train.batch_size=8", "--train.log_interval=1",
         "--train.eval_interval=0", "--optim.warmup_steps=2", "--train.max_steps=6", "--telemetry.human=false",
         "--telemetry.resource_interval=60"]


def _engine(procs, run_dir: Path, *extra: str) -> tuple[dict[int, float], list[dict]]:
    from engine.telemetry import parse_line
    done = procs.run([*TORCHRUN, *SMALL, f"--run.dir={run_dir}", *extra], timeout=120,
                     env=engine_env(DS_ACCELERATOR="cpu"))
    assert done.returncode == 0, done.stderr[-4000:]
    events = [parse_line(line) for line in done.stdout.splitlines() if line.strip()]  # stdout: events only
    assert [e["status"] for e in events if e["type"] == "run_end"] == ["completed"]
    return {e["step"]: e["loss"] for e in events if e["type"] == "step"}, events


@pytest.fixture(scope="module")
def fsdp_losses(tmp_path_factory):
    from procs import ProcessTracker
    tracker = ProcessTracker()
    try:
        return _engine(tracker, tmp_path_factory.mktemp("fsdp") / "run", "--inner.strategy=fsdp")[0]
    finally:
        tracker.kill_all()


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_engine_zero_matches_fsdp2(procs, tmp_path, fsdp_losses, stage):
    losses, events = _engine(procs, tmp_path / "run", f"--inner.strategy=zero{stage}")
    assert losses.keys() == fsdp_losses.keys() == set(range(1, 7))
    worst = max(abs(losses[s] - fsdp_losses[s]) for s in losses)
    assert worst < PARITY_TOL, (worst, losses, fsdp_losses)
    assert losses[6] < losses[1] - 1.0
    start = next(e for e in events if e["type"] == "run_start")
    assert start["strategy"] == f"zero{stage}" and start["world_size"] == 2


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """zero3 for 6 steps with checkpoints at 3 and 6 and an export at the end."""
    from procs import ProcessTracker
    tracker, root = ProcessTracker(), tmp_path_factory.mktemp("zero3")
    try:
        losses, events = _engine(tracker, root / "a", "--inner.strategy=zero3", "--ckpt.interval=3",
                                 f"--ckpt.export_dir={root / 'export'}")
    finally:
        tracker.kill_all()
    return {"losses": losses, "events": events, "root": root}


@pytest.mark.slow
def test_engine_zero3_matches_fsdp2(zero3_run, fsdp_losses):
    losses = zero3_run["losses"]
    assert losses.keys() == fsdp_losses.keys()
    worst = max(abs(losses[s] - fsdp_losses[s]) for s in losses)
    assert worst < PARITY_TOL, (worst, losses, fsdp_losses)
    assert [e["step"] for e in zero3_run["events"] if e["type"] == "checkpoint"] == [3, 6]


@pytest.mark.slow
def test_engine_zero3_resume_repeats_the_uninterrupted_run(procs, zero3_run):
    root = zero3_run["root"]
    resumed, _ = _engine(procs, root / "b", "--inner.strategy=zero3",
                         f"--ckpt.resume={root / 'a' / 'checkpoints' / 'step-00000003'}")
    assert sorted(resumed) == [4, 5, 6]
    losses = zero3_run["losses"]
    assert max(abs(resumed[s] - losses[s]) for s in resumed) < 1e-6, (resumed, losses)


@pytest.mark.slow
def test_engine_zero3_export_is_the_whole_model(zero3_run):
    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import ModelConfig
    from engine.model import build_model
    model = AutoModelForCausalLM.from_pretrained(zero3_run["root"] / "export")
    fresh = build_model(ModelConfig(preset="debug"), 258, 64, seed=1337)  # the same shapes, untrained
    trained, start = model.state_dict(), fresh.state_dict()
    assert trained.keys() == start.keys()
    assert all(trained[k].shape == start[k].shape for k in start)  # gathered, not ZeRO-3's empty partitions
    assert all(torch.isfinite(v).all() for v in trained.values())
    moved = sum(float((trained[k] - start[k]).abs().max()) > 0 for k in start if k.endswith("proj.weight"))
    assert moved == len([k for k in start if k.endswith("proj.weight")])  # every layer was trained


@pytest.mark.slow
def test_engine_zero2_exports_a_model_with_tied_embeddings(procs, tmp_path):
    """Defect: a model folder whose embeddings and output layer share one tensor (tie_word_embeddings, as many
    small pretrained models) trained under ZeRO, then its export failed after training: the parameters by name
    named the shared tensor once, and the export's strict load missed lm_head.weight (exit 1)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.presets import PRESETS
    folder = tmp_path / "tied"
    LlamaConfig(**PRESETS["debug"], vocab_size=258, max_position_embeddings=256, tie_word_embeddings=True,
                use_cache=False).save_pretrained(folder)
    _, events = _engine(procs, tmp_path / "run", "--inner.strategy=zero2", f"--model.path={folder}",
                        f"--ckpt.export_dir={tmp_path / 'export'}", "--train.max_steps=3")
    assert [e["step"] for e in events if e["type"] == "export"] == [3]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still one tensor
    assert torch.isfinite(model.lm_head.weight).all()


@pytest.mark.slow
def test_engine_without_deepspeed(procs, tmp_path):
    """DeepSpeed absent (an import of it fails): DDP still trains, and zero2 is one line saying how to install it."""
    hide = ("import runpy, sys; sys.modules['deepspeed'] = None; sys.argv[0] = 'engine.train'; "
            "runpy.run_module('engine.train', run_name='__main__')")
    base = [PYTHON, "-c", hide, "configs/debug.toml", "--data.fake=true", "--data.seq_len=32", "--train.max_steps=1",
            "--train.eval_interval=0", "--telemetry.human=false"]
    ddp = procs.run([*base, f"--run.dir={tmp_path / 'ddp'}"], timeout=60)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    zero = procs.run([*base, "--inner.strategy=zero2", f"--run.dir={tmp_path / 'zero'}"], timeout=60)
    assert zero.returncode == 2
    errors = [line for line in zero.stderr.splitlines() if line.startswith("error")]
    assert errors == [f"error: inner.strategy=zero2 needs DeepSpeed, which is not installed: {INSTALL_HINT}"], \
        zero.stderr[-2000:]


# DiLoCo over ZeRO 1/2/3 on 2 nodes x 2 workers, with eval, checkpoints and resume: tests/test_presets_e2e.py


@pytest.mark.slow
def test_engine_fp16_on_cpu_is_refused_in_one_line(procs, tmp_path):
    """DeepSpeed's CPU accelerator has fp16 only on CPUs with AVX512-FP16; elsewhere the engine says so up front
    (exit 2, one line) instead of failing inside DeepSpeed. Where the CPU has it, the run must complete."""
    done = procs.run([PYTHON, "-m", "engine.train", "configs/debug.toml", "--data.fake=true", "--data.seq_len=32",
                      "--train.max_steps=2", "--train.eval_interval=0", "--telemetry.human=false",
                      "--inner.strategy=zero1", "--train.precision=fp16-mixed", f"--run.dir={tmp_path}"],
                     timeout=90, env=engine_env(DS_ACCELERATOR="cpu"))
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    if done.returncode == 0:
        assert not errors and '"status": "completed"' in done.stdout.replace('":"', '": "')
    else:
        assert done.returncode == 2 and errors == [
            "error: train.precision: fp16-mixed is not supported by DeepSpeed on this cpu (use bf16-mixed)"], \
            done.stderr[-2000:]


def test_zero_without_torchrun_trains_on_cpu(procs, tmp_path):
    """One process, no launcher: no LOCAL_RANK, RANK or WORLD_SIZE in the environment (DeepSpeed insists on
    LOCAL_RANK; engine/inner/zero.py hands it the World's)."""
    from engine.telemetry import parse_line
    env = {k: v for k, v in engine_env(DS_ACCELERATOR="cpu").items()
           if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    done = procs.run([PYTHON, "-m", "engine.train", "configs/debug.toml", *SMALL, "--train.max_steps=3",
                      "--inner.strategy=zero1", "--inner.device=cpu", f"--run.dir={tmp_path / 'run'}"],
                     timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    events = [parse_line(line) for line in done.stdout.splitlines() if line.strip()]
    assert [e["status"] for e in events if e["type"] == "run_end"] == ["completed"]
    assert sorted(e["step"] for e in events if e["type"] == "step") == [1, 2, 3]


# -- the CUDA side (skipped only where no GPU is present; the CPU path of each is tested above) --------------

def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU (the CPU path is tested above)")
@pytest.mark.parametrize("extra", [
    ["--inner.strategy=zero2", "--inner.offload_optimizer=true", "--train.precision=bf16-mixed"],  # DeepSpeedCPUAdam
    ["--inner.strategy=zero3", "--train.precision=fp16-mixed"],  # dynamic loss scaling
], ids=["zero2-offload-bf16", "zero3-fp16"])
def test_gpu_zero_trains(procs, tmp_path, extra):
    from engine.telemetry import parse_line
    done = procs.run([PYTHON, "-m", "engine.train", "configs/debug.toml", *SMALL, "--train.max_steps=12",
                      "--inner.device=cuda", f"--run.dir={tmp_path / 'run'}", *extra], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    events = [parse_line(line) for line in done.stdout.splitlines() if line.strip()]
    losses = {e["step"]: e["loss"] for e in events if e["type"] == "step"}
    assert losses[12] < losses[1] - 0.5, losses


def _batch(step: int, n: int, seq: int, vocab: int):
    import torch
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _driver(stage: int, overrides: list[str]) -> None:
    import copy
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from engine.config import load_config
    from engine.model import build_model
    from engine.inner.ddp_fsdp import Inner, setup_distributed
    from engine.world import World, read_world
    from engine.inner.zero import build_zero_inner

    world = read_world()
    cfg = load_config(None, ["--data.fake=true", "--data.seq_len=32", "--train.micro_batch_size=2",
                             "--train.batch_size=8", "--train.max_steps=20", "--optim.warmup_steps=2",
                             "--optim.lr=3e-3", "--optim.clip_norm=0.5", f"--inner.strategy=zero{stage}",
                             "--inner.device=cpu", *overrides])
    device, _ = setup_distributed(cfg.inner, world)
    vocab, seq, mb, gb = 258, cfg.data.seq_len, cfg.train.micro_batch_size, cfg.train.batch_size
    ref_model = build_model(cfg.model, vocab, seq, seed=cfg.train.seed)
    initial = {k: v.clone() for k, v in ref_model.state_dict().items()}
    solo = World(rank=0, world_size=1, local_rank=0, hostname="ref", pid=0)
    ref_train = cfg.train.model_copy(update={"precision": "fp32"})
    ref = Inner(ref_model, cfg.inner, ref_train, cfg.optim, solo, device)
    inner = build_zero_inner(build_model(cfg.model, vocab, seq, seed=cfg.train.seed), cfg.inner, cfg.train,
                             cfg.optim, world, device)
    accum = gb // (mb * world.world_size)
    snapshot = [p.detach().clone() for p in inner.outer_params()]  # what DiLoCo keeps at an outer step
    # what ZeRO starts from: the model's weights (bf16: rounded to bf16, DeepSpeed casts before making masters)
    start = inner.full_model_state_dict()
    out_start_diff = max((start[k] - initial[k]).abs().max().item() for k in start)

    def zero_step(step: int) -> tuple[float, float]:
        x, y = _batch(step, gb, seq, vocab)
        losses = []
        for j in range(accum):  # rank r takes micro-batches r, r + W, ... of the global batch
            k = (j * world.world_size + world.rank) * mb
            losses.append(inner.micro_step(x[k:k + mb], y[k:k + mb], last=j == accum - 1))
        norm = float(inner.optimizer_step())
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss)
        return float(loss) / world.world_size, norm

    def ref_step(step: int) -> tuple[float, float]:
        x, y = _batch(step, gb, seq, vocab)
        n = gb // mb
        losses = [ref.micro_step(x[i * mb:(i + 1) * mb], y[i * mb:(i + 1) * mb], last=i == n - 1) for i in range(n)]
        return float(torch.stack(losses).mean()), float(ref.optimizer_step())

    out: dict = {"zero": [], "ref": [], "zero_norm": [], "ref_norm": [], "lr": []}
    for step in range(4):
        zl, zn = zero_step(step)
        rl, rn = ref_step(step)
        out["zero"].append(zl), out["ref"].append(rl), out["zero_norm"].append(zn), out["ref_norm"].append(rn)
        out["lr"].append([inner.current_lr(), ref.current_lr()])

    # checkpoint round trip through DCP: two steps, restore, the same two steps again
    ckpt = tempfile.mkdtemp(prefix="zero-ckpt-") if world.rank == 0 else None
    box = [ckpt]
    dist.broadcast_object_list(box)
    saved = inner.state_dict()  # as engine/checkpoint.py does: model/optim through DCP, the rest per rank
    dcp.save({"model": saved["model"], "optim": saved["optim"]}, checkpoint_id=box[0])
    extras = copy.deepcopy({"scheduler": saved["scheduler"], "scaler": saved["scaler"]})
    after = [zero_step(s)[0] for s in (4, 5)]
    template = inner.state_dict()
    dcp.load({"model": template["model"], "optim": template["optim"]}, checkpoint_id=box[0])
    template.update(extras)
    inner.load_state_dict(template)
    out["resume"] = [after, [zero_step(s)[0] for s in (4, 5)]]

    # DiLoCo: each rank's partitions hold its share of the weights, once: the squared pseudo-gradients of all
    # ranks add up to the squared distance of the whole model from its start
    current = inner.full_model_state_dict()
    partitions = inner.outer_params()
    local_sq = sum(float((s - p).double().pow(2).sum()) for s, p in zip(snapshot, partitions))
    total = torch.tensor([local_sq, float(sum(p.numel() for p in partitions))], dtype=torch.float64)
    dist.all_reduce(total)
    out["pgrad_sq"] = [float(total[0]), sum(float((start[k] - current[k]).double().pow(2).sum()) for k in current)]
    out["numel"] = [int(total[1]), sum(v.numel() for v in initial.values())]
    out["start_diff"] = out_start_diff
    # ... and writing the snapshot back (an outer step that rolls back) gives back exactly the initial model
    with torch.no_grad():
        for s, p in zip(snapshot, partitions):
            p.copy_(s)
    inner.after_outer_update()
    full = inner.full_model_state_dict()
    out["rollback_max_diff"] = max((full[k] - start[k]).abs().max().item() for k in full)
    reference = Inner(build_model(cfg.model, vocab, seq, seed=cfg.train.seed), cfg.inner, ref_train, cfg.optim,
                      solo, device)
    x, y = _batch(0, mb, seq, vocab)
    out["rollback_eval"] = [float(inner.eval_loss(x, y)), float(reference.eval_loss(x, y))]
    if world.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _driver(int(sys.argv[1]), sys.argv[2:])
