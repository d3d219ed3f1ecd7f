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


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """optim.name "adamw": AdamW, no weight decay on vectors (norm scales), as in Llama/nanoGPT. "muon": MuonAdamW,
    Muon for the 2-D weight matrices of the decoder layers, this AdamW for everything else."""
    if cfg.name == "muon":
        return MuonAdamW(model, cfg)
    return _adamw([p for p in model.parameters() if p.requires_grad], cfg)


def _adamw(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def muon_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What Muon steps: the 2-D weight matrices of the decoder layers (attention and MLP projections). The token
    embedding and the output head stay with AdamW, though 2-D: Muon's authors and torch's docs keep them out (an
    embedding's rows are looked up, not multiplied; the head's update wants AdamW's per-coordinate scale)."""
    from engine.model import decoder_layers  # engine.model imports transformers: only where Muon is built
    return [p for layer in decoder_layers(model) for p in layer.parameters() if p.requires_grad and p.ndim == 2]


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: Muon (WholeMatrixMuon) for muon_params(model), AdamW for the rest. One optimizer to
    the rest of the engine: the LR schedule scales every param group (both optimizers' lr alike), the grad scaler
    unscales and steps it, zero_grad, state.clear() and DCP's get/set_state_dict see every group and all state.

    Both inner optimizers hold this optimizer's param-group dicts and its one state dict (their parameters are
    disjoint), so a group's lr set here is the lr they step with. Groups: AdamW's two first (decayed matrices,
    undecayed vectors), Muon's last."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig):
        matrices = muon_params(model)
        chosen = {id(p) for p in matrices}
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
        self.adamw = _adamw(rest, cfg)
        # match_rms_adamw: Muon's update is scaled to AdamW's RMS (0.2 sqrt(max(A, B))), so it takes optim.lr and
        # optim.weight_decay as they are (docs/config.md, "Muon")
        self.muon = WholeMatrixMuon(matrices, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                                    nesterov=True, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr)
        super().__init__([*self.adamw.param_groups, *self.muon.param_groups], {})
        self._share()

    def _share(self) -> None:
        """The inner optimizers step this optimizer's groups and state (load_state_dict replaces both)."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.adamw.state = self.muon.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonAdamW takes no closure"
        self.adamw.step()
        self.muon.step()


class WholeMatrixMuon(torch.optim.Muon if hasattr(torch.optim, "Muon") else torch.optim.Optimizer):
    """torch.optim.Muon whose Newton-Schulz runs on the whole matrix also when a parameter is an FSDP2 shard (a
    DTensor): the update is all-gathered, orthogonalized on every rank, and each rank keeps its own rows. On a plain
    tensor the step is torch's (_single_tensor_muon), line for line. Orthogonalizing each shard alone would still
    train, but as another optimizer: each rank's rows made orthogonal among themselves only.

    The momentum buffer, weight decay and the update itself stay sharded (elementwise); the gather is of one matrix
    at a time, in the gradient's dtype (torch's Newton-Schulz casts to bf16 after the gather)."""

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "WholeMatrixMuon takes no closure"
        from torch.optim._muon import _adjust_lr
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)
            lr, wd, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
            for param, grad, buf in zip(params, grads, bufs):
                buf.lerp_(grad, 1 - momentum)
                update = grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = self._orthogonalized(update, group)
                param.mul_(1 - lr * wd)
                param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))

    @staticmethod
    def _orthogonalized(update: torch.Tensor, group: dict) -> torch.Tensor:
        from torch.optim._muon import _zeropower_via_newtonschulz
        from torch.distributed.tensor import DTensor, Replicate

        def ns(matrix: torch.Tensor) -> torch.Tensor:
            return _zeropower_via_newtonschulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if not isinstance(update, DTensor):
            return ns(update)
        whole = ns(update.full_tensor())  # an all-gather over the shard's mesh: every rank orthogonalizes it all
        # Replicate -> the parameter's placements is a local slice, no communication
        replicated = DTensor.from_local(whole, update.device_mesh, [Replicate()] * update.device_mesh.ndim,
                                        run_check=False)
        return replicated.redistribute(update.device_mesh, update.placements)


def schedule_at(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put the schedule at `step` (DiLoCo time rounds: the round clock's step, not this node's own count)."""
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(step)
    scheduler.last_epoch = step
