"""Model transformations every inner strategy applies the same way, before wrapping: activation checkpointing
and per-layer compilation (torchtitan's order: checkpointing -> compile -> FSDP).

    compiled = apply_compile(model)            # each decoder layer compiled in place; None when nothing was
    loss, norm = first_step(compiled, step, warn, undo)   # the first step: compiles, or falls back to eager

train.compile = "auto" (compile_wanted) compiles on a CUDA device unless the strategy refuses it (zero3: DeepSpeed
gathers each parameter in module hooks), and never on a CPU, where inductor's C++ build costs more than it saves
on small models. Compilation happens at the first step: `first_step` times it (the console shows the seconds),
and a compile that fails there is one warning line, then the step and the run go on eager. The inductor cache
(TORCHINDUCTOR_CACHE_DIR, unless the environment sets it) is the user's ~/.cache/zeroband/inductor: kept between
runs and shared by all of them, since compiled kernels depend on the shapes and the code, not on the run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from engine.model import decoder_layers

# torch.compile's backend: the seam tests replace with one that fails (tests/test_memory.py)
COMPILE_BACKEND: Any = "inductor"
INDUCTOR_CACHE = Path.home() / ".cache" / "zeroband" / "inductor"
# where a compiler error comes from: dynamo's tracing, AOTAutograd, inductor's code generation and C++/Triton build
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "triton")


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    # transformers' own per-layer checkpointing keeps state-dict keys unchanged (a checkpoint_wrapper would not);
    # transformers 5 renamed it (the old name warns on every run), 4.x only has the old one
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_wanted(setting: bool | str, strategy: str, device_type: str) -> bool:
    """train.compile resolved: true and false as written; "auto": on a CUDA device, except under zero3."""
    if setting == "auto":
        return device_type == "cuda" and strategy != "zero3"
    return bool(setting)


@dataclass
class Compiled:
    """The layers compiled in place, and what their first step said: seconds it took (compiling), or why it fell
    back to eager."""
    layers: list[torch.nn.Module]
    pending: bool = True  # the first step has not run yet
    seconds: float | None = None
    fallback: str | None = None
    notes: list[str] = field(default_factory=list)

    def eager(self) -> None:
        for layer in self.layers:
            layer._compiled_call_impl = None  # what nn.Module.compile set: the layer's own forward again


def apply_compile(model: torch.nn.Module) -> Compiled:
    # the compile cache outlives the run: the engine's one write to os.environ besides DeepSpeed's (zero.py), and
    # the user's own TORCHINDUCTOR_CACHE_DIR wins
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(INDUCTOR_CACHE))
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=COMPILE_BACKEND)  # in place: no OptimizedModule wrapper, names and checkpoints unchanged
    return Compiled(layers)


def is_compile_error(err: BaseException) -> bool:
    """An error raised by the compiler stack (or with one as its cause), not by the model or the data."""
    seen: BaseException | None = err
    while seen is not None:
        if type(seen).__module__.startswith(COMPILER_MODULES):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def compile_error_line(err: BaseException) -> str:
    """One line: the compiler's error and, where it wraps one (BackendCompilerFailed: "backend='inductor' raised:"),
    the error at its root."""
    root = err
    while (root.__cause__ or getattr(root, "inner_exception", None)) is not None:
        root = root.__cause__ or root.inner_exception
    first = (str(root).strip().splitlines() or [""])[0]
    line = f"{type(err).__name__}: " + (f"{type(root).__name__}: " if root is not err else "") + first
    return line[:300].rstrip(": ")


def first_step(compiled: Compiled, step: Callable[[], Any], undo: Callable[[], None]) -> Any:
    """Run the first step, which compiles: time it; on a compiler error, go eager (`undo` clears what the failed
    step left: gradients, gathered shards) and run it again. Other errors propagate as they are."""
    t0 = time.perf_counter()
    try:
        out = step()
    except Exception as e:  # noqa: BLE001 - only a compiler's error is taken; the rest is raised again below
        if not is_compile_error(e):
            raise
        compiled.fallback = compile_error_line(e)
        compiled.eager()
        undo()
        out = step()
    compiled.pending = False
    compiled.seconds = time.perf_counter() - t0
    return out
