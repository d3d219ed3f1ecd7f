"""The DeepSpeed JSON config for ZeRO stage 1, 2 or 3: a plain dict, built without torch or DeepSpeed.

    config = deepspeed_config(2, micro_batch_size=8, grad_accum=1, precision="bf16-mixed", clip_norm=1.0,
                              hidden_size=hidden_size(cfg.model))     # engine.presets.hidden_size

One builder, two readers: engine/inner/zero.py passes it to deepspeed.initialize, and the console's
`python -m console.recipes deepspeed` writes it to a file (the console never imports torch-side engine code).
It lives beside engine/inner/ rather than in it because importing engine.inner builds the inner strategies,
torch included.
"""

from __future__ import annotations

from typing import Any


def deepspeed_config(stage: int, *, micro_batch_size: int, grad_accum: int, precision: str, clip_norm: float,
                     offload_optimizer: bool = False, offload_params: bool = False,
                     pin_memory: bool = False, hidden_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed JSON config the engine passes to deepspeed.initialize (and `console.recipes deepspeed` writes).

    No "optimizer"/"scheduler" sections: the engine hands DeepSpeed a torch optimizer and its own LR schedule.
    With the model's hidden_size, communication buckets are sized from it (what transformers' "auto" values
    do): DeepSpeed's defaults (5e8-element reduce buckets, 5e7-element stage-3 prefetch) are sized for
    billion-parameter models and would be most of a small model's memory.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"zero stage: {stage} is not 1, 2 or 3")
    if offload_params and stage != 3:
        raise ValueError(f"inner.offload_params: parameter offload needs ZeRO stage 3 (inner.strategy=zero3), "
                         f"not stage {stage}")
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    if hidden_size is not None:
        bucket = hidden_size * hidden_size
        zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
        if stage == 3:
            zero.update(stage3_prefetch_bucket_size=int(0.9 * bucket),
                        stage3_param_persistence_threshold=10 * hidden_size)
    if stage == 3:
        # gather whole parameters for the export and for the transformers-format state dict at the end
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": float(clip_norm),  # 0.0: no clipping
        "zero_optimization": zero,
        # a torch AdamW is fine with offload on CPU hosts; DeepSpeed would otherwise insist on DeepSpeedCPUAdam
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # progress is the engine's telemetry, not DeepSpeed's log lines
        "wall_clock_breakdown": False,
    }
    if precision == "bf16-mixed":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16-mixed":
        # dynamic loss scaling: loss_scale 0 means "dynamic" in DeepSpeed
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    elif precision != "fp32":
        raise ValueError(f"train.precision: {precision!r} is not fp32, bf16-mixed or fp16-mixed")
    return config
