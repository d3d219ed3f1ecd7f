"""train.compile (engine/inner/transforms.py): "auto" is on for CUDA except under zero3 and off on a CPU; the first
step's compile is timed for the console; a compiler that fails there is one warning, and the run goes on eager with
the very numbers an eager run has. The compiler's failure is real dynamo machinery: a backend that raises, put at
the compile seam (transforms.COMPILE_BACKEND); inductor itself runs on a GPU (scripts/gpu_checks.sh)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from engine.config import load_config
from engine.data import FakeSource, TokenStream
from engine.inner import transforms
from engine.inner.ddp_fsdp import build_inner
from engine.inner.transforms import compile_wanted, first_step, is_compile_error
from engine.model import build_model
from engine.session import first_compiled_step, train_step
from engine.telemetry import format_human, make_event
from engine.world import World
from console.fleet import compile_text

VOCAB = 258


@pytest.mark.parametrize("setting,strategy,device,want", [
    ("auto", "ddp", "cuda", True), ("auto", "fsdp", "cuda", True), ("auto", "zero2", "cuda", True),
    ("auto", "zero3", "cuda", False), ("auto", "ddp", "cpu", False), ("auto", "fsdp", "cpu", False),
    (True, "ddp", "cpu", True), (False, "ddp", "cuda", False), (True, "zero3", "cuda", True)])
def test_auto_compiles_on_cuda_unless_the_strategy_refuses(setting, strategy, device, want):
    assert compile_wanted(setting, strategy, device) is want


def test_the_default_is_auto_and_a_cpu_run_stays_eager():
    cfg = load_config(None, {"data.fake": True, "inner.device": "cpu"})
    assert cfg.train.compile == "auto"
    assert load_config(None, ["--data.fake", "--train.compile"]).train.compile is True  # a bare flag: true
    inner = _inner(cfg)
    assert inner.compiled is None
    assert all(layer._compiled_call_impl is None for layer in inner.model.model.layers)


def _inner(cfg):
    world = World(rank=0, world_size=1, local_rank=0, hostname="t", pid=os.getpid())
    model = build_model(cfg.model, VOCAB, cfg.data.seq_len, "cpu", seed=0)
    return build_inner(model, cfg.inner, cfg.train, cfg.optim, world, torch.device("cpu"))


class Events:
    def __init__(self) -> None:
        self.got: list[tuple[str, dict]] = []

    def emit(self, type_: str, **fields) -> None:
        make_event(type_, "n", 0, **fields)  # valid under the schema
        self.got.append((type_, fields))


def _session(cfg, inner):
    return SimpleNamespace(inner=inner, cfg=cfg, accum=1, telemetry=Events(), progress=SimpleNamespace(step=0),
                           data=SimpleNamespace(train=TokenStream(FakeSource(VOCAB, cfg.data.seq_len, 0), 0, 1,
                                                                  seed=0)))


def _broken_backend(gm, example_inputs):
    raise RuntimeError("no C++ compiler on this host")


def test_a_compile_that_fails_at_the_first_step_is_one_warning_and_the_run_goes_on_eager(monkeypatch):
    cfg = load_config(None, {"data.fake": True, "inner.device": "cpu", "data.seq_len": 32, "train.compile": True,
                             "train.micro_batch_size": 2, "train.batch_size": 2})
    monkeypatch.setattr(transforms, "COMPILE_BACKEND", _broken_backend)
    s = _session(cfg, _inner(cfg))
    assert s.inner.compiled is not None and s.inner.compiled.pending
    losses = [float(first_compiled_step(s, s.inner.compiled)[0])]
    losses += [float(train_step(s.inner, s.data.train, 2, 1)[0]) for _ in range(2)]
    warnings = [f["message"] for t, f in s.telemetry.got if t == "warning"]
    assert len(warnings) == 1 and warnings[0].startswith("train.compile: compiling the first step failed "
                                                         "(BackendCompilerFailed: ") and \
        "no C++ compiler on this host" in warnings[0] and warnings[0].endswith("training on eager (train.compile = "
                                                                                "false skips the attempt)")
    state = [f for t, f in s.telemetry.got if t == "state"]
    assert state[0]["compiled"] is False and state[0]["step"] == 1 and state[0]["compile_s"] >= 0
    assert all(layer._compiled_call_impl is None for layer in s.inner.model.model.layers)
    # the same numbers as a run that never tried: the failed attempt left no gradient and read no data
    eager_cfg = cfg.model_copy(deep=True)
    eager_cfg.train.compile = False
    e = _session(eager_cfg, _inner(eager_cfg))
    assert losses == [float(train_step(e.inner, e.data.train, 2, 1)[0]) for _ in range(3)]
    assert s.data.train.consumed == e.data.train.consumed
    assert "failed to compile, eager" in format_human(make_event("state", "n", 0, **state[0]))
    assert compile_text(state[0]).startswith("failed to compile in ")


def test_a_first_step_that_compiles_is_timed_and_other_errors_are_not_taken_for_the_compiler():
    compiled = transforms.Compiled(layers=[])
    assert first_step(compiled, lambda: 7, undo=lambda: None) == 7
    assert not compiled.pending and compiled.fallback is None and compiled.seconds >= 0
    assert compile_text({"state": "training", "compile_s": 63.4, "compiled": True}) == \
        "compiled in 63 s (the first step)"
    assert compile_text({"state": "training", "compiling": True}).startswith("compiling")
    assert compile_text({"state": "training"}) is None
    other = transforms.Compiled(layers=[])

    def bad_data():
        raise ValueError("data.path: no such file")
    with pytest.raises(ValueError, match="no such file"):
        first_step(other, bad_data, undo=lambda: pytest.fail("not a compiler error: no fallback"))
    assert other.pending and other.fallback is None
    assert not is_compile_error(ValueError("x"))
    class InductorLike(RuntimeError):  # an error of the compiler's own modules, wrapped by another
        __module__ = "torch._inductor.exc"
    try:
        raise RuntimeError("outer") from InductorLike("C++ compile error")
    except RuntimeError as e:
        assert is_compile_error(e)


def test_status_and_the_log_pane_say_a_node_is_compiling_until_its_first_step_is_done():
    """A first compiled step can take a minute: `status` (and the log pane's title, through the same why_text) said
    only `training` with no step, as a hung node would. While it compiles the line says so; once the step is done,
    nothing more (the detail view keeps `compiled in N s`)."""
    from console import cli
    from console.fleet import Fleet
    from console.widgets import cells
    from test_fleet import line, start, step

    fleet = Fleet(run="r")
    fleet.add_node("a", "h")
    fleet.ingest("a", start("a"))
    fleet.ingest("a", line("state", "a", state="training", compiling=True))
    node = fleet.nodes["a"]
    assert cells.why_text(node).startswith("compiling") and "(compiling" in cli.node_line(node)
    fleet.ingest("a", line("state", "a", state="training", compile_s=61.0, compiled=True))
    fleet.ingest("a", step(1, 3.0, 100.0, "a"))
    assert cells.why_text(node) == "" and "compil" not in cli.node_line(node)
    assert node.compile == "compiled in 61 s (the first step)"
