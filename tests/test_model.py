"""Model presets and the single-process Inner: shapes, vocab, local folders, schedule, in-place outer params."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.config import InnerConfig, ModelConfig, OptimConfig, TrainConfig
from engine.model import build_model, causal_lm_loss, count_params, model_config
from engine.outer import NoOuter, Progress
from engine.parallel import Inner, build_inner, lr_factor
from engine.world import World

torch.set_num_threads(1)  # as conftest does for engine processes: tiny models on shared cores


@pytest.mark.parametrize("preset, low, high", [
    ("debug", 1.5e6, 2.5e6), ("15m", 12e6, 18e6), ("150m", 140e6, 170e6), ("1b", 0.9e9, 1.2e9)])
def test_preset_sizes(preset, low, high):
    with torch.device("meta"):  # shapes only: no memory for the 1B
        model = LlamaForCausalLM(model_config(ModelConfig(preset=preset), 258, 1024))
    assert low < count_params(model) < high
    assert model.config.vocab_size == 258


def test_vocab_and_seq_len_rules(tmp_path):
    assert model_config(ModelConfig(vocab_size=300), 258, 64).vocab_size == 300
    with pytest.raises(ValueError, match="smaller than the tokenizer's 258"):
        model_config(ModelConfig(vocab_size=100), 258, 64)
    assert model_config(ModelConfig(), 258, 10_000).max_position_embeddings == 10_000
    short = model_config(ModelConfig(), 258, 64)
    short.max_position_embeddings = 32
    short.save_pretrained(tmp_path / "short")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 32"):
        model_config(ModelConfig(path=str(tmp_path / "short")), 258, 64)
    with pytest.raises(ValueError, match="has no config.json"):
        model_config(ModelConfig(path=str(tmp_path)), 258, 64)


def test_local_folder_with_weights_is_loaded(tmp_path):
    src = build_model(ModelConfig(), 258, 32, seed=3)
    src.save_pretrained(tmp_path)
    loaded = build_model(ModelConfig(path=str(tmp_path)), 258, 32, seed=99)
    for a, b in zip(src.parameters(), loaded.parameters()):
        assert torch.equal(a, b)
    same_seed = build_model(ModelConfig(), 258, 32, seed=3)
    assert torch.equal(next(same_seed.parameters()), next(src.parameters()))


def test_lr_schedule_shapes():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_factor(0, cfg, 110) == pytest.approx(0.1) and lr_factor(9, cfg, 110) == pytest.approx(1.0)
    assert lr_factor(60, cfg, 110) == pytest.approx(0.55)
    assert lr_factor(110, cfg, 110) == pytest.approx(0.1) and lr_factor(500, cfg, 110) == pytest.approx(0.1)
    linear = cfg.model_copy(update={"schedule": "linear"})
    assert lr_factor(35, linear, 110) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_factor(80, cfg.model_copy(update={"schedule": "constant"}), 110) == 1.0


def _inner(**train) -> Inner:
    world = World(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)
    tcfg = TrainConfig(micro_batch_size=2, batch_size=4, max_steps=20, **train)
    model = build_model(ModelConfig(), 258, 16, seed=0)
    return build_inner(model, InnerConfig(), tcfg, OptimConfig(lr=1e-2, warmup_steps=0), world,
                       torch.device("cpu"))


def test_inner_steps_and_outer_params_alias_the_weights():
    torch.manual_seed(0)
    inner = _inner()
    assert type(inner) is Inner and inner.grad_accum == 2
    x = torch.randint(0, 258, (2, 16))
    first = float(inner.micro_step(x, x, last=False))
    inner.micro_step(x, x, last=True)
    norm = inner.optimizer_step()
    assert math.isfinite(float(norm)) and float(norm) > 0
    assert all(p.grad is None for p in inner.model.parameters())
    after = float(inner.eval_loss(x, x))
    assert after < first
    params = inner.outer_params()
    params[0].zero_()  # DiLoCo writes in place: the model must see it
    assert float(next(inner.model.parameters()).abs().sum()) == 0


def test_activation_checkpointing_gives_the_same_gradients():
    x = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(1))
    norms = []
    for ac in (False, True):
        inner = _inner(activation_checkpointing=ac)
        inner.micro_step(x, x, last=False)
        inner.micro_step(x, x, last=True)
        norms.append(float(inner.optimizer_step()))
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_cpu_offload_needs_fsdp_on_cuda():
    world = World(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)
    with pytest.raises(ValueError, match="inner.cpu_offload: needs inner.strategy fsdp on a CUDA device"):
        build_inner(build_model(ModelConfig(), 258, 16), InnerConfig(cpu_offload=True), TrainConfig(),
                    OptimConfig(), world, torch.device("cpu"))


def test_bf16_autocast_runs_on_cpu():
    inner = _inner(precision="bf16-mixed")
    x = torch.randint(0, 258, (2, 16))
    loss = inner.micro_step(x, x, last=True)
    assert loss.dtype == torch.float32 and math.isfinite(float(loss))


def test_causal_lm_loss_is_next_token_cross_entropy():
    model = build_model(ModelConfig(), 258, 16, seed=0)
    x = torch.randint(0, 258, (1, 8))
    expected = model(input_ids=x, labels=x).loss  # transformers shifts internally
    assert float(causal_lm_loss(model, x[:, :-1], x[:, 1:])) == pytest.approx(float(expected), rel=1e-5)


def test_no_outer_drains_at_the_next_step():
    outer, progress = NoOuter(), Progress(step=3)
    outer.start(progress)
    assert outer.after_inner_step(progress) is False
    outer.request_drain()
    assert outer.after_inner_step(progress) is True
    p2 = Progress()
    p2.load_state_dict(Progress(step=4, outer_step=1, tokens=9).state_dict())
    assert p2 == Progress(4, 1, 9)


def test_a_joiner_follows_the_handed_off_progress():
    """After outer.start hands a joiner the mesh's step, its data position and LR match a node that trained."""
    from types import SimpleNamespace

    from engine.data import FakeSource, TokenStream
    from engine.train import follow_handoff
    trained, joiner = _inner(), _inner()
    stream = TokenStream(FakeSource(258, 16, 0), 0, 1, seed=0)
    for _ in range(5):
        for last in (False, True):
            trained.micro_step(*stream.next_batch(2), last=last)
        trained.optimizer_step()
    fresh = TokenStream(FakeSource(258, 16, 0), 0, 1, seed=0)
    session = SimpleNamespace(progress=Progress(step=5), inner=joiner, data=SimpleNamespace(train=fresh),
                              cfg=SimpleNamespace(train=joiner.train_cfg), accum=2)
    follow_handoff(session)
    assert joiner.current_lr() == trained.current_lr() and joiner.scheduler.last_epoch == 5
    assert torch.equal(fresh.next_batch(2)[0], stream.next_batch(2)[0])
