"""DeepSpeed ZeRO stages 1, 2 and 3 as an `Inner` (the interface of engine/inner/ddp_fsdp.py, docs/architecture.md).

    inner = build_zero_inner(model, cfg.inner, cfg.train, cfg.optim, world, device)   # inner.strategy zero1/2/3

What ZeRO partitions, and what DiLoCo therefore works on (`outer_params()`):

    stage 1   optimizer state                       -> the rank's fp32 master partition (one flat tensor per group)
    stage 2   + gradients                           -> the same
    stage 3   + parameters                          -> the rank's fp32 partition of the parameters

Each rank hands DiLoCo its own fp32 master partition, so pseudo-gradients are taken per rank (as with FSDP2's
local shards) and the partitions of one local rank line up across nodes that share a layout. After the outer
step wrote into them, `after_outer_update()` pushes the masters into the working (bf16/fp16/fp32) weights that
forward reads, all-gathering them where the stage keeps full copies (1 and 2).

The optimizer is always a torch AdamW handed to `deepspeed.initialize` (no "optimizer" section in the DeepSpeed
config): naming the optimizer in the config JIT-builds DeepSpeed's fused CPU Adam (~60 s on a first run). With
optimizer offload on a GPU run, DeepSpeedCPUAdam is used instead (it is what makes offload fast there).

The LR schedule, the loss and the batch arithmetic are the same as the other strategies': train.batch_size and
train.micro_batch_size give DeepSpeed's gradient_accumulation_steps (engine.config.grad_accum_steps), and the
engine, not DeepSpeed's counter, says which micro-step is the last one.

DeepSpeed is an optional extra (`pip install 'zeroband-console[deepspeed]'`); it is imported only here, and only
when a ZeRO strategy is chosen.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

from engine.config import InnerConfig, OptimConfig, TrainConfig, grad_accum_steps
from engine.inner.deepspeed_config import deepspeed_config
from engine.model import causal_lm_loss
from engine.inner.optim import lr_factor, make_optimizer, schedule_at
from engine.inner.transforms import apply_activation_checkpointing, apply_compile, compile_wanted
from engine.world import World

INSTALL_HINT = "pip install 'zeroband-console[deepspeed]'"
STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


def zero_stage(strategy: str) -> int:
    if strategy not in STAGES:
        raise ValueError(f"inner.strategy: {strategy!r} is not a ZeRO strategy (one of {', '.join(STAGES)})")
    return STAGES[strategy]


def import_deepspeed(strategy: str, device: torch.device) -> Any:
    """Import DeepSpeed for a ZeRO run, with the CPU accelerator when the run is on CPU.

    DeepSpeed chooses its accelerator once, from DS_ACCELERATOR, the first time it is asked; a CPU run on a host
    with a GPU must still get the CPU one. So a CPU run sets DS_ACCELERATOR=cpu here, before the import: one of
    the engine's two writes to os.environ (with LOCAL_RANK in build_zero_inner; it is read only in
    engine/world.py), and it only tells DeepSpeed what inner.device already said.
    """
    if device.type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        raise ValueError(f"inner.strategy={strategy} needs DeepSpeed, which is not installed: {INSTALL_HINT}") from None
    accel = get_accelerator().device_name()
    if (device.type == "cpu") != (accel == "cpu"):
        raise ValueError(f"inner.device: the run is on {device.type} but DeepSpeed was already set up for {accel} "
                         f"in this process (DS_ACCELERATOR)")
    # The shared-memory kernel serves only DeepSpeed's inference all-reduce, and building it is a ~35 s JIT
    # compile inside init_distributed on a first CPU run. Training all-reduces go through gloo/NCCL anyway.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _build_optimizer(model: torch.nn.Module, inner: InnerConfig, optim: OptimConfig,
                     device: torch.device) -> torch.optim.Optimizer:
    optimizer = make_optimizer(model, optim)  # the same AdamW and weight-decay split as every strategy
    if inner.offload_optimizer and device.type == "cuda":
        # the optimizer steps on the host: DeepSpeed's vectorised CPU Adam is what makes offload fast there
        # (JIT-built once per machine)
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        return DeepSpeedCPUAdam(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                adamw_mode=True)
    return optimizer


def build_zero_inner(model: torch.nn.Module, inner: InnerConfig, train: TrainConfig, optim: OptimConfig,
                     world: World, device: torch.device | str) -> "ZeroInner":
    """Wrap a plain fp32 model in a DeepSpeed engine at the ZeRO stage inner.strategy names."""
    device = torch.device(device)
    stage = zero_stage(inner.strategy)
    accum = grad_accum_steps(train, world.world_size)
    config = deepspeed_config(stage, micro_batch_size=train.micro_batch_size, grad_accum=accum,
                              precision=train.precision, clip_norm=optim.clip_norm,
                              offload_optimizer=inner.offload_optimizer, offload_params=inner.offload_params,
                              pin_memory=device.type == "cuda",
                              hidden_size=getattr(getattr(model, "config", None), "hidden_size", None))
    deepspeed = import_deepspeed(inner.strategy, device)
    if train.precision == "fp16-mixed":
        from deepspeed.accelerator import get_accelerator
        if not get_accelerator().is_fp16_supported():
            raise ValueError(f"train.precision: fp16-mixed is not supported by DeepSpeed on this {device.type} "
                             f"(use bf16-mixed)")
    assert dist.is_initialized(), "engine.inner.ddp_fsdp.setup_distributed creates the process group first"
    if train.activation_checkpointing:
        apply_activation_checkpointing(model)
    compiled = None
    if compile_wanted(train.compile, inner.strategy, device.type):  # "auto" leaves zero3 eager
        if stage == 3:
            raise ValueError("train.compile: not supported with inner.strategy=zero3 (DeepSpeed gathers each "
                             "parameter in module hooks); use zero1/zero2 or compile=false")
        compiled = apply_compile(model)
    optimizer = _build_optimizer(model, inner, optim, device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, optim, train.max_steps))
    # DeepSpeed takes its local rank from LOCAL_RANK, which only launchers set: a one-process run without torchrun
    # stopped with "DeepSpeed requires the LOCAL_RANK environment variable". Tell it the World's (read from the
    # environment in engine/world.py, defaulting to RANK): equal to what a launcher set, so nothing is overridden.
    os.environ["LOCAL_RANK"] = str(world.local_rank)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                      config=config, dist_init_required=False)
    zero = ZeroInner(engine, ds_optimizer, optimizer, scheduler, stage, world, device)
    zero.compiled = compiled
    return zero


class ZeroInner:
    """A DeepSpeed engine behind the Inner interface. See the module docstring for what each stage partitions."""

    def __init__(self, engine: Any, ds_optimizer: Any, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, stage: int, world: World,
                 device: torch.device) -> None:
        self.strategy = f"zero{stage}"
        self.device = device
        self.engine = engine
        self.model = engine.module
        self.ds_optimizer = ds_optimizer  # DeepSpeed's ZeRO wrapper around `optimizer`
        self.optimizer = optimizer  # the torch optimizer that steps the fp32 master partitions
        self.scheduler = scheduler
        self.stage = stage
        self.world = world
        self._init_optimizer_state()

    # -- the inner loop ------------------------------------------------------------------------------------

    def micro_step(self, input_ids: torch.Tensor, labels: torch.Tensor, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients are reduced only when `last`. Returns the loss."""
        # the engine, not DeepSpeed's micro-step counter, says where the accumulation boundary is; backward
        # scales the loss by 1/gradient_accumulation_steps like the other strategies
        self.engine.set_gradient_accumulation_boundary(last)
        loss = causal_lm_loss(self.engine, input_ids.to(self.device, non_blocking=True),
                              labels.to(self.device, non_blocking=True))
        self.engine.backward(loss)
        return loss.detach()

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step, zero grads, advance the schedule (skipped by DeepSpeed on an fp16 overflow).
        Returns the pre-clip global grad norm as a 0-dim tensor (NaN where DeepSpeed computed none)."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return torch.as_tensor(float("nan") if norm is None else norm).detach()

    @torch.no_grad()
    def eval_loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.engine.eval()
        try:  # through the engine: stage 3 gathers the parameters in its forward hooks
            return causal_lm_loss(self.engine, input_ids.to(self.device), labels.to(self.device))
        finally:
            self.engine.train()

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def schedule_at(self, step: int) -> None:
        """The LR schedule at `step` for the next optimizer step (DiLoCo time rounds)."""
        schedule_at(self.scheduler, step)

    # -- DiLoCo --------------------------------------------------------------------------------------------

    def outer_params(self) -> list[torch.Tensor]:
        """This rank's fp32 master partitions (flat, padded to DeepSpeed's alignment; padding stays zero)."""
        if self.stage == 3:
            return list(self.ds_optimizer.fp32_partitioned_groups_flat)
        return list(self.ds_optimizer.single_partition_of_fp32_groups)

    def reset_optimizer_state(self) -> None:
        """Forget the moments of the optimizer that steps the fp32 masters (see Inner.reset_optimizer_state): back
        to the zeros of step 0 that __init__ creates, which a checkpoint template expects to find."""
        self.optimizer.state.clear()
        self._init_optimizer_state()

    @torch.no_grad()
    def after_outer_update(self) -> None:
        """Push the fp32 masters DiLoCo wrote into the working weights forward reads (collective in stage 1/2)."""
        if self.stage == 3:
            # what DeepSpeed's own step (stage3.py step/_post_step) does around updating the masters: release
            # the gathered parameters, copy each master into its working partition and re-point the parameters'
            # partitions at it, then re-gather the small parameters that stay whole ("persistent", below
            # stage3_param_persistence_threshold)
            opt = self.ds_optimizer
            opt._partition_all_parameters()  # drop gathered copies, so the re-gather below is not skipped
            for sub_group in range(len(opt.fp32_partitioned_groups_flat)):
                assert opt.fp16_partitioned_groups_flat[sub_group] is not None, "NVMe swapping is not offered"
                opt._reassign_or_swap_out_partitioned_parameters(sub_group)
            if opt.persistent_parameters:
                opt.persistent_parameters[0].all_gather(opt.persistent_parameters)
            opt.invalidate_secondary_tensor()
        else:
            self.ds_optimizer.update_lp_params()  # copy into the bit16 partition, then all-gather the full copies

    # -- checkpoints ---------------------------------------------------------------------------------------

    def _init_optimizer_state(self) -> None:
        """Create AdamW's state now (zeros, step 0: exactly what its first step would create) so that a
        checkpoint template built before the first step already holds every tensor DCP must fill."""
        # torch AdamW counts steps in a float tensor; DeepSpeedCPUAdam (offload on GPU runs) in an int
        first_step = (lambda: torch.tensor(0.0)) if isinstance(self.optimizer, torch.optim.AdamW) else (lambda: 0)
        for p in self.outer_params():  # the tensors the torch optimizer steps, keyed by identity
            if not self.optimizer.state[p]:
                self.optimizer.state[p] = {"step": first_step(), "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                                           "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}

    @contextlib.contextmanager
    def _optimizer_groups(self):
        """Stage 3 hands its partitions to the torch optimizer only while stepping; show them for (de)serialising."""
        if self.stage != 3:
            yield
            return
        self.ds_optimizer._set_fp32_optimizer_param_groups()
        try:
            yield
        finally:
            self.ds_optimizer._clear_fp32_optimizer_param_groups()

    def _rank_key(self) -> str:
        # DCP keeps one copy of a plain tensor saved under the same key by several ranks (it assumes replicas);
        # partitions differ per rank, so each rank saves under its own key. Resuming needs the same layout.
        return f"zero{self.stage}_rank{self.world.rank}_of_{self.world.world_size}"

    def state_dict(self) -> dict[str, Any]:
        """The shape engine/checkpoint.py saves: "model" and "optim" through DCP, "scheduler" and "scaler" per rank.

        The tensors are the live ones (DCP loads in place), under this rank's own key."""
        with self._optimizer_groups():
            opt = self.optimizer.state_dict()
        key = self._rank_key()
        return {
            "model": {key: {str(i): t for i, t in enumerate(self.outer_params())}},
            "optim": {key: {"state": {str(k): v for k, v in opt["state"].items()},
                            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]}},
            "scheduler": self.scheduler.state_dict(),
            # DeepSpeed's own counters and its fp16 loss scale (1.0 and unused in fp32/bf16)
            "scaler": {"global_steps": self.engine.global_steps, "global_samples": self.engine.global_samples,
                       "loss_scale": float(getattr(self.ds_optimizer, "cur_scale", 1.0))},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        key = self._rank_key()
        if key not in state["model"] or key not in state["optim"]:
            found = ", ".join(sorted(state["model"])) or "nothing"
            raise ValueError(f"checkpoint: no ZeRO state for {key} (found {found}); resume with the same "
                             f"inner.strategy and workers per node")
        for i, master in enumerate(self.outer_params()):
            saved = state["model"][key][str(i)]
            if saved is not master:  # DCP already loaded in place when it was handed our own tensors
                master.copy_(saved)
        saved_opt = state["optim"][key]
        with self._optimizer_groups():
            opt = self.optimizer.state_dict()
            opt["state"] = {int(k): v for k, v in saved_opt["state"].items()}
            for group, saved in zip(opt["param_groups"], saved_opt["groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})
            self.optimizer.load_state_dict(opt)
        self.scheduler.load_state_dict(state["scheduler"])
        self.engine.global_steps = int(state["scaler"]["global_steps"])
        self.engine.global_samples = int(state["scaler"]["global_samples"])
        if hasattr(self.ds_optimizer, "cur_scale"):
            self.ds_optimizer.cur_scale = state["scaler"]["loss_scale"]
        self.after_outer_update()  # the working weights follow the restored masters

    def full_model_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole fp32 parameters by name, on CPU, on every rank (a collective in stage 3): for export."""
        from deepspeed.utils import safe_get_full_fp32_param
        out: dict[str, torch.Tensor] = {}
        by_tensor: dict[int, torch.Tensor] = {}
        # every name of a shared tensor (tied embeddings: embed_tokens and lm_head), each gathered once
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in by_tensor:
                full = safe_get_full_fp32_param(p)
                by_tensor[id(p)] = (full if full is not None else p.detach()).float().cpu().clone()
            out[name] = by_tensor[id(p)]
        return out
