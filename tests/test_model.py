"""Model presets and the single-process Inner: shapes, vocab, local folders, schedule, in-place outer params."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaForCausalLM

from engine.config import InnerConfig, ModelConfig, OptimConfig, TrainConfig
from engine.model import build_model, causal_lm_loss, count_params, model_config, tokenizer_note
from engine.outer import NoOuter, Progress
from engine.inner.ddp_fsdp import Inner, build_inner
from engine.inner.optim import lr_factor
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


def _count_layer_forwards(inner) -> list[int]:
    """Forward calls of each decoder layer's MLP, counted by hooks. transformers checkpoints the layer's forward
    (the layer's own hooks stay outside the checkpoint): a recompute in backward shows on the modules inside it."""
    from engine.model import decoder_layers
    calls = [0] * len(decoder_layers(inner.model))
    for i, layer in enumerate(decoder_layers(inner.model)):
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def test_activation_checkpointing_recomputes_each_layer_with_the_same_gradients():
    x = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(1))
    norms, forwards = [], []
    for ac in (False, True):
        inner = _inner(activation_checkpointing=ac)
        calls = _count_layer_forwards(inner)
        inner.micro_step(x, x, last=False)
        inner.micro_step(x, x, last=True)
        norms.append(float(inner.optimizer_step()))
        forwards.append(calls)
    # two micro-steps: one forward per layer each, plus one recompute per layer in each backward with checkpointing
    assert forwards[0] == [2] * len(forwards[0]) and forwards[1] == [4] * len(forwards[1]), forwards
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_cpu_offload_needs_fsdp_on_cuda():
    world = World(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)
    with pytest.raises(ValueError, match="inner.cpu_offload: needs inner.strategy fsdp on a CUDA device"):
        build_inner(build_model(ModelConfig(), 258, 16), InnerConfig(cpu_offload=True), TrainConfig(),
                    OptimConfig(), world, torch.device("cpu"))


def _matmul_dtypes(model) -> list[torch.dtype]:
    """The dtype of every decoder Linear's output, recorded by forward hooks: what the matmuls computed in."""
    seen: list[torch.dtype] = []
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    return seen


def test_bf16_mixed_computes_in_bf16_and_keeps_fp32_weights():
    inner = _inner(precision="bf16-mixed")
    seen = _matmul_dtypes(inner.model)
    x = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(2))
    loss = inner.micro_step(x, x, last=True)
    assert seen and set(seen) == {torch.bfloat16}, set(seen)  # autocast really ran the matmuls in bf16
    assert loss.dtype == torch.float32 and math.isfinite(float(loss))
    inner.optimizer_step()
    assert {p.dtype for p in inner.model.parameters()} == {torch.float32}  # the optimizer keeps fp32 weights
    seen.clear()
    bf16_eval = float(inner.eval_loss(x, x))
    assert set(seen) == {torch.bfloat16}, set(seen)  # eval under the same autocast
    fp32 = _inner(precision="fp32")
    fp32.load_state_dict(inner.state_dict())
    fp32_seen = _matmul_dtypes(fp32.model)
    fp32_eval = float(fp32.eval_loss(x, x))
    assert set(fp32_seen) == {torch.float32}
    # the same weights give a visibly different loss in bf16 (rounding), but not a wrong one
    assert bf16_eval != fp32_eval and bf16_eval == pytest.approx(fp32_eval, rel=2e-2)


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
    from engine.session import follow_handoff
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


# FSDP2 casts through MixedPrecisionPolicy instead of autocast, and checkpointing must survive fully_shard's
# subclassing of the layer: both checked in one process (world size 1, in-memory store), in a child process so
# that this test process never holds a default process group.
FSDP_DRIVER = """
import json, torch
from engine.config import InnerConfig, ModelConfig, OptimConfig, TrainConfig
from engine.model import build_model, decoder_layers
from engine.inner.ddp_fsdp import build_inner, setup_distributed
from engine.world import World
torch.set_num_threads(1)
world = World(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)
icfg = InnerConfig(strategy="fsdp", device="cpu")
device, _ = setup_distributed(icfg, world)
tcfg = TrainConfig(micro_batch_size=2, batch_size=2, max_steps=4, precision="bf16-mixed", activation_checkpointing=True)
inner = build_inner(build_model(ModelConfig(), 258, 16, seed=0), icfg, tcfg, OptimConfig(warmup_steps=0), world, device)
dtypes, calls = set(), [0]
for layer in decoder_layers(inner.model):
    layer.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    layer.mlp.down_proj.register_forward_hook(lambda m, a, out: dtypes.add(str(out.dtype)))
x = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(3))
inner.micro_step(x, x, last=True)
inner.optimizer_step()
masters = sorted({str(p.dtype) for p in inner.model.parameters()})
print("RESULT " + json.dumps({"dtypes": sorted(dtypes), "calls": calls[0], "layers": len(decoder_layers(inner.model)),
                              "masters": masters}))
"""


def test_fsdp_bf16_mixed_computes_in_bf16_and_recomputes_layers(procs):
    from procs import PYTHON
    done = procs.run([PYTHON, "-c", FSDP_DRIVER], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(next(l for l in done.stdout.splitlines() if l.startswith("RESULT ")).removeprefix("RESULT "))
    assert out["dtypes"] == ["torch.bfloat16"]  # MixedPrecisionPolicy(param_dtype=bf16) really applied
    assert out["masters"] == ["torch.float32"]  # sharded fp32 parameters for the optimizer
    assert out["calls"] == 2 * out["layers"]  # one forward and one recompute per layer: checkpointing is on


def test_pretrained_weights_on_the_byte_tokenizer_are_a_warning(tmp_path):
    """A folder with weights and no data.tokenizer would fine-tune on byte ids the model never saw: a warning,
    which names the folder's own tokenizer when it has one. A folder of a config only (a shape to train from
    scratch), a tokenizer given, or fake data: nothing to say."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert tokenizer_note(str(folder), None, False) is None
    (folder / "model.safetensors").write_bytes(b"")
    note = tokenizer_note(str(folder), None, False)
    assert note.startswith(f"model.path {folder} has pretrained weights but data.tokenizer is unset") and \
        "--data.tokenizer" not in note
    (folder / "tokenizer.json").write_text("{}")
    assert tokenizer_note(str(folder), None, False).endswith(f"the folder has a tokenizer: --data.tokenizer={folder}")
    assert tokenizer_note(str(folder), str(folder), False) is None and tokenizer_note(str(folder), None, True) is None
    assert tokenizer_note(None, None, False) is None
