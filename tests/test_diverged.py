"""A run that diverges (NaN or infinite loss) loses no committed work and poisons nothing.

- Under DiLoCo, one node whose round diverged is left out of that outer step's mean (weight 0), takes the run's
  weights at the commit with fresh optimizer state, and trains on; the others never see a NaN.
- When every member's round diverged there is nothing to average: every node stops with one error line, holding and
  saving the last committed weights, from which a resume trains on.
- Alone (no DiLoCo), the run stops at the log step that saw it, with one error line, and saves nothing over the
  last good checkpoint.
- A NaN is reported as null on the JSON lines (JSON has no NaN): before, the step event itself raised.

The fault is injected from the test side (no hook in the engine): a launcher fills one parameter with NaN before
inner step N of one node.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

import test_diloco_e2e as e2e

NAN_BEFORE_STEP = """import sys
import torch
import engine.session as session, engine.train as train
_step, _n = session.train_step, [0]
def _poisoned(inner, *args, **kw):
    _n[0] += 1
    if _n[0] == {n}:
        with torch.no_grad():
            inner.outer_params()[0].fill_(float("nan"))
        print("POISONED", file=sys.stderr, flush=True)
    return _step(inner, *args, **kw)
session.train_step = _poisoned
sys.argv = ["engine.train"] + sys.argv[1:]
train.cli()
"""


def poisoned_node(procs, name: str, n: int, args: list[str]) -> e2e.Node:
    return e2e.Node(procs, name, [sys.executable, "-c", NAN_BEFORE_STEP.format(n=n), *args])


def diloco_args(port: int, name: str, run_dir, *extra: str) -> list[str]:
    return [e2e.CONFIG, *e2e.FAST, f"--mesh.store_port={port}", f"--mesh.node_id={name}", f"--run.dir={run_dir / name}",
            *extra]


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_a_node_whose_round_diverged_is_left_out_of_that_mean_and_takes_the_runs_weights(procs, port, tmp_path,
                                                                                        mode):
    """diloco.overlap too: there the boundary finds the diverged round (the node's own progress is rebased onto
    the landed weights on the training thread) and restarts it from the agreed weights before the round goes out."""
    e2e.start_store(procs, port)
    steps = ["--train.max_steps=15", "--diloco.min_nodes=2"]  # H = 3: outer steps 1..5; b's NaN comes in round 2
    steps += ["--diloco.overlap=true"] if mode == "overlap" else []
    a = e2e.start_node(procs, port, "a", tmp_path, *steps)
    b = poisoned_node(procs, "b", 5, diloco_args(port, "b", tmp_path, *steps))
    nodes = [a, b]
    for n in nodes:
        assert e2e.finish(n, 180, nodes) == 0, n.report()
        assert n.of("run_end")[-1]["status"] == "completed"
    assert "POISONED" in b.err
    # outer step 2 (inner steps 4-6): b's pseudo-gradient is NaN: only a's is counted, by the weights off the wire
    for n in nodes:
        two = n.outer()[2]
        assert two["members"] == ["a", "b"] and two["contributors"] == ["a"], two
        assert two["weights"] == [e2e.ROUND_TOKENS], two
        assert math.isfinite(two["pgrad_norm"])
        assert all(n.outer()[k]["contributors"] == ["a", "b"] for k in (1, 3, 4, 5)), n.outer()
    said = [w["message"] for w in b.of("warning") if "not counted; it takes the run's weights" in w["message"]]
    assert len(said) == 1 and ("outer step 2" in said[0] if mode == "sync" else "last round" in said[0]), said
    # b reported its NaN steps as null, and trains on finite after it took the run's weights (fresh moments)
    losses = {e["step"]: e["loss"] for e in b.of("step")}
    assert losses[5] is None and losses[6] is None
    assert all(losses[s] is not None and math.isfinite(losses[s]) for s in range(7, 16)), losses
    assert all(e["loss"] is not None for e in a.of("step"))
    e2e.assert_identical(nodes)  # every outer step, NaN round included: a never saw it


def test_every_node_diverged_stops_with_the_last_committed_weights_saved_and_a_resume_trains_on(procs, port,
                                                                                                 tmp_path):
    e2e.start_store(procs, port)
    steps = ["--train.max_steps=12", "--diloco.min_nodes=1", "--ckpt.interval=0"]
    a = poisoned_node(procs, "a", 5, diloco_args(port, "a", tmp_path, *steps))
    assert e2e.finish(a, 180, [a]) == 1, a.report()
    assert a.of("run_end")[-1]["status"] == "failed"
    errors = [e["message"] for e in a.of("error")]
    assert len(errors) == 1 and "outer step 2: no member had a finite pseudo-gradient" in errors[0], a.report()
    assert "Traceback" not in a.err
    saved = a.of("checkpoint")
    assert saved and saved[-1]["step"] == 6, a.report()  # the failing round's end, holding outer step 1's weights
    again = e2e.start_node(procs, port, "a", tmp_path, "--train.max_steps=12", "--diloco.min_nodes=1",
                           "--ckpt.resume=latest")
    assert e2e.finish(again, 180, [again]) == 0, again.report()
    losses = [e["loss"] for e in again.of("step")]
    assert losses and all(v is not None and math.isfinite(v) for v in losses), losses
    # the saved weights are exactly outer step 1's: resumed at the boundary of step 6, the run redoes outer step 2
    # from them (a zero pseudo-gradient) and commits the checksum outer step 1 committed; then it trains on
    assert (again.outer()[2]["step"], again.outer()[2]["checksum"]) == (6, a.outer()[1]["checksum"]), again.outer()
    assert again.outer()[3]["checksum"] != a.outer()[1]["checksum"]


def test_alone_a_diverged_run_stops_at_the_log_step_and_saves_nothing_over_the_last_checkpoint(procs, tmp_path):
    run = tmp_path / "single"
    args = ["configs/debug.toml", "--train.max_steps=20", "--train.micro_batch_size=2", "--train.batch_size=2",
            "--data.seq_len=32", "--train.eval_interval=0", "--train.log_interval=2", "--ckpt.interval=4",
            "--telemetry.human=false", f"--run.dir={run}"]
    node = poisoned_node(procs, "single", 7, args)
    assert e2e.finish(node, 180, [node]) == 1, node.report()
    errors = [e["message"] for e in node.of("error")]
    assert len(errors) == 1 and errors[0].startswith("loss is nan at step 8: the run diverged"), node.report()
    assert "Traceback" not in node.err and node.of("run_end")[-1]["status"] == "failed"
    assert [e["step"] for e in node.of("checkpoint")] == [4]  # nothing saved at or after the NaN
    assert [e["loss"] for e in node.of("step") if e["step"] == 8] == [None]


def test_a_step_event_with_a_loss_that_is_not_finite_is_null_on_the_wire():
    from engine.metrics import scalars
    from engine.telemetry import encode, format_human, make_event, parse_line

    event = make_event("step", "n", 0, step=3, loss=None, lr=1e-3, tokens_per_s=10.0, grad_norm=None, tokens=6,
                       outer_step=0)
    line = encode(event)
    assert json.loads(line)["loss"] is None and parse_line(line)["loss"] is None
    assert "loss not finite" in format_human(event)
    assert scalars(event) == [("train/lr", 1e-3), ("train/tokens_per_s", 10.0)]
    assert scalars(make_event("eval", "n", 0, step=3, loss=None)) == []
    with pytest.raises(ValueError):  # the reason the engine maps NaN to null first
        encode({**event, "loss": float("nan")})


def test_the_console_shows_a_null_loss_as_missing_and_leaves_it_out_of_the_means():
    from console.fleet import Fleet
    from console.widgets.cells import loss_cell, sparkline
    from console.widgets.loss_chart import plottable
    from engine.telemetry import encode, make_event

    def step(node: str, n: int, loss: float | None) -> str:
        return encode(make_event("step", node, 0, step=n, loss=loss, lr=1e-3, tokens_per_s=100.0, grad_norm=None))

    fleet = Fleet(run="nan")
    for name in ("a", "b"):
        fleet.add_node(name, "h")
        fleet.ingest(name, encode(make_event("state", name, 0, state="training")))
    fleet.ingest("a", step("a", 1, 3.0))
    fleet.ingest("b", step("b", 1, 2.0))
    fleet.ingest("a", step("a", 2, None))
    a = fleet.nodes["a"]
    assert a.step == 2 and a.loss is None and a.malformed == 0  # taken, not counted as a bad line
    assert loss_cell(a.loss) == loss_cell(None) != loss_cell(3.0)
    assert fleet.summary().loss == pytest.approx(2.0)  # b's loss alone: a has none now
    assert [v for _, v in a.loss_history if plottable(v)] == [3.0]
    assert sparkline([v for _, v in a.loss_history]) == sparkline([3.0])


@pytest.mark.parametrize("strategy", ["fsdp", "zero2"])
def test_two_sharded_workers_agree_that_their_node_diverged_when_one_shard_did(procs, port, tmp_path, strategy):
    """A node of two FSDP or ZeRO-2 workers: only local rank 0's parameter goes NaN (each rank holds its own shard
    of the pseudo-gradient); both ranks leave the node's round out alike and take the run's weights, and their
    optimizer (DeepSpeed's over the fp32 masters for ZeRO) starts afresh."""
    e2e.start_store(procs, port)
    script = tmp_path / "poisoned_rank0.py"
    script.write_text(NAN_BEFORE_STEP.format(n=5).replace(
        "    if _n[0] == 5:", "    if _n[0] == 5 and int(__import__('os').environ['LOCAL_RANK']) == 0:"))
    steps = ["--train.max_steps=12", "--diloco.min_nodes=2", f"--inner.strategy={strategy}", "--train.batch_size=4",
             "--ckpt.interval=6", "--ckpt.keep=5",  # step 6: just after b's optimizer state was reset
             # the preset's Muon is refused under ZeRO (engine/config.py): AdamW there, over DeepSpeed's fp32 masters
             *(["--optim.name=adamw"] if strategy.startswith("zero") else [])]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    a = e2e.start_node(procs, port, "a", tmp_path, *steps, workers=2)
    b = e2e.Node(procs, "b", launcher + diloco_args(port, "b", tmp_path, *steps))
    nodes = [a, b]
    for n in nodes:
        assert e2e.finish(n, 240, nodes) == 0, n.report()
    assert b.err.count("POISONED") == 1
    for n in nodes:
        assert n.outer()[2]["contributors"] == ["a"] and n.outer()[3]["contributors"] == ["a", "b"], n.outer()
    losses = {e["step"]: e["loss"] for e in b.of("step") if e["rank"] == 0}
    # NaN from step 5 on (ZeRO: from step 6, the poisoned fp32 master reaches the working weights at its step)
    first = 5 if strategy == "fsdp" else 6
    assert [s for s in range(1, 7) if losses[s] is None] == list(range(first, 7)), losses
    assert all(math.isfinite(losses[s]) for s in range(7, 13)), losses
    e2e.assert_identical(nodes)
    # the checkpoint taken right after the reset holds a whole optimizer state (zeros), as every other one does:
    # a resume builds its template with every moment and must find each of them
    saved = {e["step"]: e["path"] for e in b.of("checkpoint") if e["rank"] == 0}
    assert sorted(saved) == [6, 12], saved
    keys = {step: _optimizer_keys(path) for step, path in saved.items()}
    assert keys[6] and keys[6] == keys[12], (sorted(keys[6])[:5], sorted(keys[12])[:5])


def _optimizer_keys(path: str) -> set[str]:
    """The optimizer-state tensors a DCP checkpoint holds (moments and step counters)."""
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(path).read_metadata()  # the checkpoint folder is the DCP checkpoint (engine/checkpoint.py)
    return {k for k in meta.state_dict_metadata if k.startswith("optim") and ("exp_avg" in k or "step" in k)}
