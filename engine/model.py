"""Llama models built from a transformers `LlamaConfig`: named presets, or a local transformers folder.

Nothing is downloaded. The vocabulary size comes from the tokenizer (byte-level by default: 256 bytes + bos +
eos = 258) unless model.vocab_size says otherwise. This module never imports torch.distributed: parallelism is
applied afterwards by engine.inner.ddp_fsdp over the plain model returned here.

Presets (shapes in engine/presets.py, which the console reads without torch; parameter counts with the
258-token byte vocabulary):

    debug   hidden 192, 4 layers, 4 heads            ~1.9M   trains in seconds on a CPU
    15m     hidden 384, 8 layers, 6 heads            ~14M
    150m    hidden 1024, 12 layers, 16 heads         ~150M   the DiLoCo / OpenDiLoCo "150M" shape
    1b      hidden 2048, 22 layers, 32 heads, 4 kv   ~1B     the TinyLlama-1.1B shape OpenDiLoCo used
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from engine.config import ModelConfig
from engine.presets import PRESETS, config_json


def model_config(cfg: ModelConfig, vocab_size: int, seq_len: int) -> LlamaConfig | Any:
    """The transformers config of the model to train. `vocab_size` is the tokenizer's."""
    if cfg.path is not None:
        hf_config = AutoConfig.from_pretrained(config_json(cfg.path).parent, local_files_only=True)
    else:
        hf_config = LlamaConfig(**PRESETS[cfg.preset], vocab_size=vocab_size,
                                max_position_embeddings=max(2048, seq_len), rms_norm_eps=1e-5,
                                tie_word_embeddings=False, use_cache=False)  # training; the export turns it on
    if cfg.vocab_size is not None:
        hf_config.vocab_size = cfg.vocab_size
    if hf_config.vocab_size < vocab_size:
        raise ValueError(f"model: vocab_size {hf_config.vocab_size} is smaller than the tokenizer's {vocab_size}")
    if getattr(hf_config, "max_position_embeddings", seq_len) < seq_len:
        raise ValueError(f"data.seq_len {seq_len} exceeds the model's max_position_embeddings "
                         f"{hf_config.max_position_embeddings}")
    hf_config._attn_implementation = cfg.attn_implementation
    return hf_config


def has_weights(folder: Path) -> bool:
    """A transformers folder with weights (safetensors or PyTorch bins), not only a config."""
    return any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))


def tokenizer_note(model_path: str | None, tokenizer: str | None, fake: bool) -> str | None:
    """A warning when pretrained weights would train on the built-in byte tokenizer's ids, which they never saw."""
    if model_path is None or tokenizer is not None or fake or not has_weights(Path(model_path)):
        return None
    hint = (f"; the folder has a tokenizer: --data.tokenizer={model_path}"
            if any((Path(model_path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")) else "")
    return (f"model.path {model_path} has pretrained weights but data.tokenizer is unset: they train on the "
            f"byte tokenizer's ids, which they never saw{hint}")


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int, device: torch.device | str = "cpu",
                seed: int = 0) -> PreTrainedModel:
    """A plain (unwrapped) causal LM on `device`, in fp32, initialised from `seed` (or the folder's weights)."""
    hf_config = model_config(cfg, vocab_size, seq_len)
    torch.manual_seed(seed)  # every rank starts from the same weights without a broadcast
    folder = Path(cfg.path) if cfg.path is not None else None
    if folder is not None and has_weights(folder):
        model = AutoModelForCausalLM.from_pretrained(folder, config=hf_config, local_files_only=True,
                                                     dtype=torch.float32)
    elif isinstance(hf_config, LlamaConfig):
        model = LlamaForCausalLM(hf_config)
    else:
        model = AutoModelForCausalLM.from_config(hf_config)
    return model.to(device=device, dtype=torch.float32)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks that FSDP shards one by one and that compile/checkpointing treat as units."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"model: {type(model).__name__} has no .model.layers (not a Llama-like decoder)")
    return list(layers)


def causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. `labels` are already shifted (labels[t] is the token after input_ids[t])."""
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
