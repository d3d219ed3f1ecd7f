"""Inner strategies applied to a plain model: the `Inner` that owns model, optimizer, LR schedule and grad scaler.

    inner = build_inner(model, cfg.inner, cfg.train, cfg.optim, world, device)

Transformations, always in this order (torchtitan's `parallelize_llama` order):

    1. activation checkpointing   train.activation_checkpointing: recompute each decoder layer in backward
    2. torch.compile              train.compile ("auto": on CUDA): each decoder layer compiled in place
    3. data parallelism           one process: none; inner.strategy "ddp": DistributedDataParallel;
                                  "fsdp": FSDP2 `fully_shard` on each decoder layer, then on the root;
                                  "zero1/2/3": engine.inner.zero.build_zero_inner (DeepSpeed) takes over entirely

Classes: `Inner` (one process, no wrapper) <- `DDPInner` (no_sync between micro-steps) and `FSDPInner`
(requires-gradient-sync toggling, DTensor shards). Each overrides only what differs.

Process groups: `setup_distributed` picks the device (inner.device "auto": CUDA when present) and the backend
(inner.backend "auto": NCCL with a gloo side for CPU tensors on CUDA, gloo on CPU) and always creates the default
group, from torchrun's environment, or a one-member in-memory store when the process runs alone.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from datetime import timedelta
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from engine.config import InnerConfig, OptimConfig, TrainConfig, grad_accum_steps
# shared with engine/inner/zero.py: both import them from below, so neither imports the other at module level
from engine.inner.optim import lr_factor, make_optimizer, schedule_at
from engine.inner.transforms import apply_activation_checkpointing, apply_compile, compile_wanted
from engine.model import causal_lm_loss, decoder_layers
from engine.world import World

PG_TIMEOUT = timedelta(minutes=10)  # torch's default; a hung peer fails the collective instead of waiting forever


def resolve_device(cfg: InnerConfig, world: World) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("inner.device: cuda was asked for but no CUDA device is visible")
        if world.local_rank >= torch.cuda.device_count():
            raise ValueError(f"inner.device: local rank {world.local_rank} has no GPU "
                             f"({torch.cuda.device_count()} visible)")
        torch.cuda.set_device(world.local_rank)
        return torch.device("cuda", world.local_rank)
    return torch.device("cpu")


def resolve_backend(cfg: InnerConfig, device: torch.device) -> str:
    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("inner.backend: nccl needs inner.device cuda")
    # NCCL for CUDA tensors plus gloo for CPU ones (CPU offload, DiLoCo snapshots kept on the host)
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"


def setup_distributed(cfg: InnerConfig, world: World) -> tuple[torch.device, dist.ProcessGroup]:
    """The device of this rank and the node's process group (the default group)."""
    device = resolve_device(cfg, world)
    if not dist.is_initialized():
        backend = resolve_backend(cfg, device)
        if world.launched_by_torchrun:
            try:
                dist.init_process_group(backend, timeout=PG_TIMEOUT,
                                        device_id=device if device.type == "cuda" else None)
            except dist.DistNetworkError as e:  # e.g. MASTER_PORT taken by another program: bad input
                reason = str(e).split("message: ")[-1].strip() or type(e).__name__
                raise ValueError(f"process group: cannot open the rendezvous store at MASTER_ADDR/MASTER_PORT "
                                 f"({reason}; {str(e).split('.')[0]})") from None
        else:
            if world.world_size != 1:
                raise ValueError(f"environment: WORLD_SIZE={world.world_size} without a torchrun rendezvous "
                                 f"(MASTER_ADDR); launch several ranks with torchrun")
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=PG_TIMEOUT)
    return device, dist.group.WORLD


class Inner:
    """One process, no wrapper. Subclasses change how the model is wrapped and how gradients are synced."""

    strategy = "single"

    def __init__(self, model: torch.nn.Module, inner_cfg: InnerConfig, train_cfg: TrainConfig,
                 optim_cfg: OptimConfig, world: World, device: torch.device):
        self.inner_cfg, self.train_cfg, self.optim_cfg = inner_cfg, train_cfg, optim_cfg
        self.world, self.device = world, device
        self.grad_accum = grad_accum_steps(train_cfg, world.world_size)
        self.model = model  # the module whose forward we call and whose state dict we save
        self.module = self.wrap(model)  # what forward/backward goes through (DDP wrapper, or model itself)
        self.optimizer = make_optimizer(self.model, optim_cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, optim_cfg, train_cfg.max_steps))
        fp16 = train_cfg.precision == "fp16-mixed"
        self.scaler = torch.amp.GradScaler(device.type, enabled=fp16)
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(train_cfg.precision)

    # -- the parts subclasses override
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm

    # -- the Inner interface
    def micro_step(self, input_ids: torch.Tensor, labels: torch.Tensor, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients are synced only when `last`. Returns the loss."""
        input_ids = input_ids.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        with self.grad_sync(last):
            with self.autocast():
                loss = causal_lm_loss(self.module, input_ids, labels)
            self.scaler.scale(loss / self.grad_accum).backward()
        return loss.detach()

    def optimizer_step(self) -> torch.Tensor:
        """Unscale (fp16), clip, step, zero grads, advance the schedule. Returns the pre-clip grad norm
        (a 0-dim tensor: float() it only when logging, it is a device sync point)."""
        self.scaler.unscale_(self.optimizer)
        max_norm = self.optim_cfg.clip_norm if self.optim_cfg.clip_norm > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return self._total_norm(norm).detach()

    @torch.no_grad()
    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.model.eval()
        try:
            with self.autocast():
                return causal_lm_loss(self.model, input_ids.to(self.device), labels.to(self.device))
        finally:
            self.model.train()

    def outer_params(self) -> list[torch.Tensor]:
        """The local tensors DiLoCo reads and writes in place (same storage as the parameters)."""
        return [p.detach() for p in self.model.parameters()]

    def after_outer_update(self) -> None:
        """Called after DiLoCo wrote into outer_params(); nothing to refresh for plain, DDP or FSDP2 params."""

    def reset_optimizer_state(self) -> None:
        """Forget the optimizer's moments (a diverged node restarting from the run's weights: NaN moments would
        make its next step NaN again). AdamW builds fresh state at its next step."""
        self.optimizer.state.clear()

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def schedule_at(self, step: int) -> None:
        """The LR schedule at `step` for the next optimizer step (DiLoCo time rounds)."""
        schedule_at(self.scheduler, step)

    def state_dict(self) -> dict:
        """model and optim hold (possibly sharded) tensors for DCP; scheduler and scaler are small and plain."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:  # empty: the run that saved it had no loss scaler (fp32, bf16); this one starts fresh
            self.scaler.load_state_dict(state["scaler"])

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded weights on CPU, for export (a collective under FSDP: every rank must call it)."""
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class DDPInner(Inner):
    strategy = "ddp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP
        ids = [self.device.index] if self.device.type == "cuda" else None
        # Llama's only buffer (rotary inv_freq) is identical everywhere: skip the per-forward broadcast. torch 2.13
        # deprecates broadcast_buffers (a warning per worker) for forward_sync_buffers (the one sync it still does
        # at init is harmless here); older torch has only the first
        no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                   else {"broadcast_buffers": False})
        return DDP(model, device_ids=ids, **no_sync)

    def grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.module.no_sync()


class FSDPInner(Inner):
    strategy = "fsdp"

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        mesh = init_device_mesh(self.device.type, (self.world.world_size,))
        mp = MixedPrecisionPolicy()
        if self.train_cfg.precision == "bf16-mixed":
            # compute in bf16, reduce gradients in fp32 (the optimizer keeps fp32 master weights)
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy() if self.inner_cfg.cpu_offload else OffloadPolicy()
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload,
                  reshard_after_forward=self.inner_cfg.reshard_after_forward)
        for layer in decoder_layers(model):
            fully_shard(layer, **kw)
        # the root holds embeddings, final norm and head; it is needed right after forward, keep it unsharded
        fully_shard(model, **{**kw, "reshard_after_forward": False})
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # MixedPrecisionPolicy casts instead

    def grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        self.module.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _total_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        try:
            return super().eval_loss(input_ids, labels)
        finally:
            # a forward without backward never reaches the post-backward reshard: the root (built with
            # reshard_after_forward=False) would stay unsharded, its parameters plain tensors instead of DTensor
            # shards, and the next outer step, checkpoint or export would read the wrong tensors
            self.reshard()

    def reshard(self) -> None:
        """Register the sharded parameters on every FSDP module again (a no-op where already sharded)."""
        from torch.distributed.fsdp import FSDPModule
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def outer_params(self) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor
        params = list(self.model.parameters())
        plain = [name for name, p in self.model.named_parameters() if not isinstance(p, DTensor)]
        assert not plain, f"FSDP parameters not sharded at an outer step (a forward without reshard?): {plain[:3]}"
        return [p.detach().to_local() for p in params]


def build_inner(model: torch.nn.Module, inner_cfg: InnerConfig, train_cfg: TrainConfig, optim_cfg: OptimConfig,
                world: World, device: torch.device):
    """The documented order: activation checkpointing -> compile -> DDP / FSDP2 (or DeepSpeed ZeRO)."""
    if inner_cfg.strategy.startswith("zero"):
        try:
            from engine.inner.zero import build_zero_inner
        except ModuleNotFoundError as e:
            if e.name != "engine.inner.zero":
                raise
            raise ValueError(f"inner.strategy {inner_cfg.strategy}: engine/inner/zero.py is not available in this "
                             f"checkout") from None
        return build_zero_inner(model, inner_cfg, train_cfg, optim_cfg, world, device)
    if inner_cfg.cpu_offload and (inner_cfg.strategy != "fsdp" or device.type != "cuda"):
        raise ValueError("inner.cpu_offload: needs inner.strategy fsdp on a CUDA device (on a CPU the parameters "
                         "already live in host memory)")
    if train_cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    compiled = apply_compile(model) if compile_wanted(train_cfg.compile, inner_cfg.strategy, device.type) else None
    kind = FSDPInner if inner_cfg.strategy == "fsdp" else DDPInner if world.world_size > 1 else Inner
    inner = kind(model, inner_cfg, train_cfg, optim_cfg, world, device)
    inner.compiled = compiled  # the first step compiles (engine/inner/transforms.py first_step)
    return inner
