"""The presets' own combination, end to end: DiLoCo over 2 nodes x 2 workers (torchrun) with an inner strategy
that shards (FSDP2, DeepSpeed ZeRO 2/3), held-out eval and checkpoints, then a resume of both nodes.

configs/150m-diloco.toml and configs/1b-diloco.toml are FSDP + eval + checkpoints under DiLoCo; before issue 9
every such run died at its first outer step after an eval (a forward without backward left the FSDP root
unsharded). The schedule below puts an eval right before an outer step (step 6) and right before a mid-round
checkpoint (steps 2 and 4), and resumes from the mid-round one (step 4: snapshot != parameters, momentum set).
No DS_ACCELERATOR in the environment: engine/inner/zero.py picks DeepSpeed's CPU accelerator from inner.device itself.
"""

from __future__ import annotations

import pytest

from engine.config import load_config
from procs import ROOT, free_port
from test_diloco_e2e import H, assert_identical, finish, start_node, start_store

PRESETS = ["configs/150m-diloco.toml", "configs/1b-diloco.toml"]
# H=3, 6 steps: outer steps at 3 and 6; eval and checkpoint every 2 steps (2, 4, 6)
STEPS = ["--train.max_steps=6", "--diloco.min_nodes=2", "--train.batch_size=4", "--train.eval_interval=2",
         "--train.eval_batches=1", "--ckpt.interval=2", "--ckpt.keep=5"]
# FSDP as configs/1b-diloco.toml runs it: bf16-mixed and activation checkpointing. ZeRO 2 and 3: stage 1 takes
# every path of engine/inner/zero.py that stage 2 takes (only stage 3 branches), and tests/test_zero.py runs it
# against a single process; its own copy here cost 40 s of the suite's 20-minute budget
STRATEGIES = {"fsdp": ["--inner.strategy=fsdp", "--train.precision=bf16-mixed",
                       "--train.activation_checkpointing=true"],
              # the presets' Muon is refused under ZeRO (engine/config.py): ZeRO runs them with AdamW
              **{z: [f"--inner.strategy={z}", "--optim.name=adamw"] for z in ("zero2", "zero3")}}


def test_presets_are_the_combination_tested_here():
    """What the end-to-end test below runs is what the DiLoCo presets ship: a sharding strategy, eval, checkpoints."""
    assert H == 3
    for preset in PRESETS:
        cfg = load_config(str(ROOT / preset), [])
        assert cfg.diloco.enabled and cfg.inner.strategy == "fsdp", preset
        assert cfg.train.eval_interval > 0 and cfg.ckpt.interval > 0, preset
        # eval lands right before some outer step, as it does in the test (step 6)
        assert cfg.train.eval_interval % cfg.diloco.inner_steps == 0, preset
        assert cfg.train.precision == "bf16-mixed", preset  # as the fsdp case below runs
        assert cfg.optim.name == "muon", preset  # FSDP2 with Muon's whole-matrix step, as the fsdp case runs
    # the fsdp case adds activation checkpointing, as the 1B preset has it
    assert load_config(str(ROOT / "configs/1b-diloco.toml"), []).train.activation_checkpointing


def _run(procs, run_dir, strategy: str, extra):
    port = free_port()
    start_store(procs, port)
    nodes = [start_node(procs, port, n, run_dir, *STEPS, *STRATEGIES[strategy], *extra(n), workers=2)
             for n in "ab"]
    for n in nodes:
        assert finish(n, 240, nodes) == 0, n.report()
    return nodes


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_diloco_two_workers_eval_checkpoint_resume(procs, tmp_path, strategy):
    full = _run(procs, tmp_path / "full", strategy, lambda n: [])
    assert_identical(full)
    # each local rank sends its own shard or partition; int8 (FAST) sends ~2 bytes per parameter in all
    assert full[0].outer()[1]["bytes_sent"] == full[1].outer()[1]["bytes_sent"] > 0
    for n in full:
        assert sorted(n.outer()) == [1, 2], n.report()
        assert [e["step"] for e in n.of("eval")] == [2, 4, 6]
        assert [e["step"] for e in n.of("checkpoint")] == [2, 4, 6]
        assert n.of("run_end")[-1]["status"] == "completed"
    # both nodes resume from their step-4 checkpoints (mid-round) on a fresh store: the same outer step 2 and the
    # same eval at step 6 as the uninterrupted run
    resumed = _run(procs, tmp_path / "resumed", strategy,
                   lambda n: [f"--ckpt.resume={tmp_path / 'full' / n / 'checkpoints' / 'step-00000004'}"])
    for before, after in zip(full, resumed):
        assert sorted(after.outer()) == [2], after.report()
        assert after.outer()[2]["checksum"] == before.outer()[2]["checksum"], (before.report(), after.report())
        assert after.of("eval")[-1]["step"] == 6
        assert after.of("eval")[-1]["loss"] == pytest.approx(before.of("eval")[-1]["loss"], abs=1e-6)
