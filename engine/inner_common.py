"""What every inner strategy builds the same way: the optimizer, the LR schedule, the model transformations.

Imported by engine/parallel.py (one process, DDP, FSDP2) and engine/zero.py (DeepSpeed ZeRO), which otherwise
would import each other: parallel.py dispatches to zero.py, and zero.py needs these pieces.
"""

from __future__ import annotations

import math

import torch

from engine.config import OptimConfig
from engine.model import decoder_layers


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of optim.lr before optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    done = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    decay = 0.5 * (1.0 + math.cos(math.pi * done)) if cfg.schedule == "cosine" else 1.0 - done
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on vectors (norm scales), as in Llama/nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    # transformers' own per-layer checkpointing keeps state-dict keys unchanged (a checkpoint_wrapper would not);
    # transformers 5 renamed it (the old name warns on every run), 4.x only has the old one
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_compile(model: torch.nn.Module) -> None:
    for layer in decoder_layers(model):
        layer.compile()  # in place: no OptimizedModule wrapper, so names and checkpoints are unaffected
