"""The inner optimizer and its learning-rate schedule, the same for every inner strategy (DDP, FSDP2, ZeRO)."""

from __future__ import annotations

import math

import torch

from engine.config import OptimConfig


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


def schedule_at(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put the schedule at `step` (DiLoCo time rounds: the round clock's step, not this node's own count)."""
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)
    scheduler.last_epoch = step
