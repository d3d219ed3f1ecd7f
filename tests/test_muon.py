"""optim.name = "muon": torch.optim.Muon for the decoder layers' matrices, AdamW for the rest, one schedule for both.
Units first (the split, the step against torch's own Muon, the schedule, the config's refusals, the digest), then real
engines: one process, DDP x2 and FSDP2 x2 train the same model to the same weights (Newton-Schulz on the whole matrix
under FSDP2, not on each rank's shard), a resumed run continues the uninterrupted one, and a checkpoint of one
optimizer is not resumed as the other."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from engine.config import ConfigError, OptimConfig, load_config

from engine.digests import digest, run_digest
from engine.inner.optim import MuonAdamW, WholeMatrixMuon, lr_factor, make_optimizer, muon_params
from engine.model import build_model, decoder_layers
from procs import PYTHON, ROOT, engine_env
from test_train import Result, assert_bad_input, parse_events, run_engine

torch.set_num_threads(1)
DEBUG = ROOT / "configs" / "debug.toml"
MUON = ["--optim.name=muon", "--optim.lr=3e-3"]
WEIGHT_TOL = 1e-5  # fp32: the shards' gradients are summed in another order than one process's


def debug_model() -> torch.nn.Module:
    return build_model(load_config(DEBUG).model, vocab_size=258, seq_len=64)


# ------------------------------------------------------------------------------------------ units

def test_muon_takes_the_decoder_matrices_and_adamw_the_rest():
    model = debug_model()
    opt = make_optimizer(model, OptimConfig(name="muon"))
    assert isinstance(opt, MuonAdamW) and isinstance(opt.muon, torch.optim.Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in opt.muon.param_groups for p in g["params"]}
    adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert muon and not muon & adamw and muon | adamw == set(names.values())
    layers = {id(p) for layer in decoder_layers(model) for p in layer.parameters() if p.ndim == 2}
    assert {id(p) for p in muon_params(model)} == layers
    assert all(n.startswith("model.layers.") and n.endswith(".weight") and "norm" not in n for n in muon), muon
    # the embedding and the head (2-D, outside the layers) and every norm stay with AdamW
    assert "model.embed_tokens.weight" in adamw and all(n in adamw for n in names.values() if "norm" in n)
    assert opt.param_groups == [*opt.adamw.param_groups, *opt.muon.param_groups]
    assert opt.muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert opt.muon.param_groups[0]["momentum"] == 0.95 and opt.muon.param_groups[0]["ns_steps"] == 5
    assert isinstance(make_optimizer(model, OptimConfig()), torch.optim.AdamW)  # the default


def test_the_step_on_a_plain_tensor_is_torchs_muon():
    """WholeMatrixMuon re-states torch's step so that a DTensor shard can be gathered: on plain tensors the same
    numbers, bit for bit, over steps with momentum, Nesterov and weight decay (a matrix taller than wide too)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 16), (24, 8)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=0.01, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw")
    a, b = WholeMatrixMuon(ours, **kw), torch.optim.Muon(theirs, **kw)
    for _ in range(4):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def test_one_schedule_drives_both_optimizers():
    model = debug_model()
    cfg = OptimConfig(name="muon", lr=1e-3, warmup_steps=2)
    opt = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg, 10))
    for step in range(5):
        factor = lr_factor(step, cfg, 10)
        for group in [*opt.adamw.param_groups, *opt.muon.param_groups]:
            assert group["lr"] == pytest.approx(1e-3 * factor)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        sched.step()
    # a reloaded state (a resume): the inner optimizers step the reloaded groups, and share one state
    opt.load_state_dict(opt.state_dict())
    assert opt.muon.param_groups[0] is opt.param_groups[-1] and opt.adamw.state is opt.muon.state is opt.state
    assert all("momentum_buffer" in opt.state[p] for p in muon_params(model))


def test_muon_config_keys_and_refusals(monkeypatch):
    cfg = load_config(DEBUG, ["--optim.name=muon", "--optim.muon_ns_steps=3", "--optim.muon_adjust_lr=original"])
    assert (cfg.optim.name, cfg.optim.muon_ns_steps, cfg.optim.muon_adjust_lr) == ("muon", 3, "original")
    with pytest.raises(ConfigError, match=r"^command line: optim\.name: Input should be 'adamw' or 'muon'"):
        load_config(DEBUG, ["--optim.name=sgd"])
    for zero in ("zero1", "zero2", "zero3"):
        with pytest.raises(ConfigError, match=rf'optim\.name = "muon" is not supported with inner\.strategy {zero} '
                                              r".*use --inner\.strategy=fsdp"):
            load_config(DEBUG, ["--optim.name=muon", f"--inner.strategy={zero}"])
    assert load_config(DEBUG, ["--inner.strategy=zero2"]).optim.name == "adamw"  # AdamW under ZeRO, as before
    for bad in ("--optim.muon_momentum=1", "--optim.muon_ns_steps=0", "--optim.muon_ns_steps=100"):
        with pytest.raises(ConfigError, match=bad.split("=")[0][2:].replace(".", r"\.")):
            load_config(DEBUG, ["--optim.name=muon", bad])
    assert load_config(DEBUG, ["--optim.muon_ns_steps=99", "--optim.muon_momentum=0"]).optim.muon_ns_steps == 99
    # a torch without torch.optim.Muon: the loaded class is asked
    monkeypatch.delattr(torch.optim, "Muon")
    lacks = rf'optim\.name = "muon" needs torch\.optim\.Muon, which torch {re.escape(torch.__version__)} lacks '
    with pytest.raises(ConfigError, match=lacks + r".*\(optim\.name from --optim\.name=muon\)$"):
        load_config(DEBUG, ["--optim.name=muon"])
    assert load_config(DEBUG).optim.name == "adamw"


@pytest.mark.parametrize("version, refused", [("2.8.1", True), ("2.9.0", False), ("2.13.0+cpu", False),
                                               ("1.13.1", True), ("3.0", False)])
def test_without_torch_loaded_the_installed_version_decides(monkeypatch, version, refused):
    """The engine reads its config before it imports torch, the console never imports it."""
    from importlib import metadata
    import sys
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setattr(metadata, "version", lambda name: version)
    if refused:
        with pytest.raises(ConfigError, match=f"which torch {re.escape(version)} lacks"):
            load_config(None, {"data.fake": True, "optim.name": "muon"})
    else:
        assert load_config(None, {"data.fake": True, "optim.name": "muon"}).optim.name == "muon"


def test_the_digest_carries_the_inner_optimizer():
    base = load_config(DEBUG)
    muon = load_config(DEBUG, ["--optim.name=muon"])
    assert digest(muon) != digest(base) and run_digest(muon) != run_digest(base)
    # AdamW, the only optimizer before optim.name: the digest of every older checkpoint, still resumed
    import hashlib
    old = {"model": base.model.model_dump(), "data.seq_len": base.data.seq_len,
           "diloco": {k: v for k, v in base.diloco.model_dump().items()
                      if k in ("enabled", "inner_steps", "outer_optimizer", "outer_lr", "outer_momentum",
                               "compression", "overlap")}}
    assert digest(base) == hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()[:12]
    # the Muon keys count with Muon only; lr and betas never (a resume may change them)
    assert digest(load_config(DEBUG, ["--optim.muon_ns_steps=3"])) == digest(base)
    for knob in ("--optim.muon_ns_steps=3", "--optim.muon_momentum=0.9", "--optim.muon_adjust_lr=original"):
        assert digest(load_config(DEBUG, ["--optim.name=muon", knob])) != digest(muon), knob
    assert digest(load_config(DEBUG, ["--optim.name=muon", "--optim.lr=1e-2", "--optim.beta2=0.99"])) == \
        digest(muon)


# ------------------------------------------------------------------------------------------ engines

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """8 steps of Muon three ways (one process, DDP x2, FSDP2 x2), checkpoints at 4 and 8, exported weights; then
    each of them resumed from its step-4 checkpoint."""
    from procs import ProcessTracker
    tracker, root = ProcessTracker(), tmp_path_factory.mktemp("muon")
    common = [*MUON, "--train.max_steps=8", "--ckpt.interval=4", "--ckpt.keep=3"]
    out = {}
    try:
        for name, extra, nproc in (("single", [], 1), ("ddp", [], 2), ("fsdp", ["--inner.strategy=fsdp"], 2)):
            out[name] = run_engine(tracker, root / name, *common, *extra, f"--ckpt.export_dir={root / name}-export",
                                   nproc=nproc)
        for name, extra, nproc in (("single", [], 1), ("ddp", [], 2), ("fsdp", ["--inner.strategy=fsdp"], 2)):
            step4 = root / name / "checkpoints" / "step-00000004"
            out[f"{name}-resumed"] = run_engine(tracker, root / f"{name}-resumed", *common, *extra,
                                                f"--ckpt.resume={step4}", nproc=nproc)
    finally:
        tracker.kill_all()
    out["root"] = root
    return out


def exported(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(f))
    assert weights, folder
    return weights


@pytest.mark.parametrize("name", ["single", "ddp", "fsdp"])
def test_muon_trains_in_every_inner_strategy(runs, name):
    result = runs[name]
    assert result.rc == 0, result.stderr[-3000:]
    assert result.end()["status"] == "completed" and result.end()["step"] == 8
    losses = result.losses()
    assert losses[8] < losses[1] - 1.0, losses


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_two_ranks_train_as_one_process(runs, name):
    """Losses as close as AdamW's across layouts (tests/test_train.py); weights as close as torch's Newton-Schulz
    in bf16 lets them be: the ranks' gradients are summed in another order, a last-bit difference that bf16 rounds
    either way (~3e-3 of a matrix after 8 steps, DDP alike; per-shard Newton-Schulz under FSDP2 parts them by far
    more). The exact check is test_fsdp2_shards_step_as_one_process, on the same gradients."""
    single, other = exported(runs["root"] / "single-export"), exported(runs["root"] / f"{name}-export")
    assert single.keys() == other.keys()
    worst = max(((single[k] - other[k]).norm() / single[k].norm()).item() for k in single)
    assert worst < 1e-2, worst
    a, b = runs["single"].losses(), runs[name].losses()
    assert max(abs(a[s] - b[s]) for s in a) < 1e-4, (a, b)


def test_fsdp2_shards_step_as_one_process(procs, tmp_path):
    """Two FSDP2 ranks, each holding half of every matrix, and one process step the debug model's MuonAdamW with the
    same gradients (set, not computed: the ranks' reduce-scatter sums in another order): after 3 steps the weights
    agree to fp32 rounding. Newton-Schulz on each rank's shard alone instead parts them by ~1e-2."""
    out = tmp_path / "fsdp.pt"
    done = procs.run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                      str(out)], timeout=180, env=engine_env(PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    sharded = torch.load(out)
    model = debug_model()
    opt = make_optimizer(model, SHARD_OPTIM)
    for step in range(SHARD_STEPS):
        for name, p in model.named_parameters():
            p.grad = shard_test_grad(step, name, p.shape)
        opt.step()
    worst = {name: (p.detach() - sharded[name]).abs().max().item() for name, p in model.named_parameters()}
    assert max(worst.values()) < 1e-6, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    moved = max((p.detach() - debug_model().state_dict()[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 1e-3  # the steps did move the weights


SHARD_OPTIM = OptimConfig(name="muon", lr=1e-2, warmup_steps=0)
SHARD_STEPS = 3


def shard_test_grad(step: int, name: str, shape: torch.Size) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * 1000 + sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def shard_worker(out: str) -> None:
    """One torchrun rank of test_fsdp2_shards_step_as_one_process: the engine's FSDP2 Inner, the given gradients
    placed as each parameter's shard, MuonAdamW's steps, the whole weights saved by rank 0."""
    from torch.distributed.tensor import distribute_tensor
    from engine.config import InnerConfig, TrainConfig
    from engine.inner.ddp_fsdp import build_inner, setup_distributed
    from engine.world import read_world
    world = read_world()
    device, _ = setup_distributed(InnerConfig(device="cpu"), world)
    inner = build_inner(debug_model(), InnerConfig(strategy="fsdp", device="cpu"),
                        TrainConfig(micro_batch_size=1, batch_size=2), SHARD_OPTIM, world, device)
    assert isinstance(inner.optimizer, MuonAdamW)
    for step in range(SHARD_STEPS):
        for name, p in inner.model.named_parameters():
            whole = shard_test_grad(step, name, p.shape)
            p.grad = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
        inner.optimizer.step()
    full = inner.full_model_state_dict()
    if world.rank == 0:
        torch.save(full, out)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name", ["single", "ddp", "fsdp"])
def test_a_resumed_muon_run_continues_the_uninterrupted_one(runs, name):
    """The Muon momentum buffers (FSDP2: sharded DTensors) are in the checkpoint: without them step 5 differs."""
    full, resumed = runs[name], runs[f"{name}-resumed"]
    assert resumed.rc == 0, resumed.stderr[-3000:]
    a, b = full.losses(), resumed.losses()
    assert sorted(b) == [5, 6, 7, 8]
    assert all(abs(a[s] - b[s]) < 1e-6 for s in b), (a, b)


def test_a_checkpoint_of_one_optimizer_is_not_resumed_as_the_other(runs, tmp_path, capsys, monkeypatch):
    """Its moments are another optimizer's: one line naming optim.name and both values, nothing touched."""
    from test_train import SMALL
    monkeypatch.chdir(ROOT)
    muon_ckpt = runs["root"] / "single" / "checkpoints" / "step-00000004"
    adamw = run_engine_in_process(capsys, [*SMALL, f"--run.dir={tmp_path / 'adamw'}", "--train.max_steps=1"])
    assert adamw.rc == 0, adamw.stderr
    adamw_ckpt = tmp_path / "adamw" / "checkpoints" / "step-00000001"
    for ckpt, there, here, extra in ((adamw_ckpt, "adamw", "muon", MUON), (muon_ckpt, "muon", "adamw", [])):
        before = sorted(p.name for p in ckpt.parent.iterdir())
        result = run_engine_in_process(capsys, [*SMALL, f"--run.dir={tmp_path / here}", "--train.max_steps=8",
                                                f"--ckpt.resume={ckpt}", *extra])
        assert_bad_input(result, f'optim.name = "{there}" there, "{here}" here')
        assert sorted(p.name for p in ckpt.parent.iterdir()) == before


def run_engine_in_process(capsys, args: list[str]) -> Result:
    from engine.train import main
    code = main(["configs/debug.toml", *args])
    out, err = capsys.readouterr()
    return Result(code, parse_events(out), err)


if __name__ == "__main__":  # a rank of test_fsdp2_shards_step_as_one_process, under torchrun
    import sys
    shard_worker(sys.argv[1])
