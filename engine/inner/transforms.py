"""Model transformations every inner strategy applies the same way, before wrapping: activation checkpointing
and per-layer compilation (torchtitan's order: checkpointing -> compile -> FSDP)."""

from __future__ import annotations

import torch

from engine.model import decoder_layers


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
