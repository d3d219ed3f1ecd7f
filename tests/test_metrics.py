"""TensorBoard event files and the optional W&B sink (engine/metrics.py): a real DiLoCo node (store, one node)
writes event files, read back with TensorBoard's own EventAccumulator and compared with the JSON events on stdout;
with wandb hidden, telemetry.wandb is one warning and the run completes. The JSON stream is unchanged."""

from __future__ import annotations

import sys

import pytest

from engine.metrics import scalars
from engine.telemetry import make_event
from procs import PYTHON, free_port
from test_diloco_e2e import CONFIG, FAST, Node, finish, start_store

# sys.modules["wandb"] = None is what an environment without the package looks like to `import wandb`
HIDE_WANDB = ("import runpy, sys; sys.modules['wandb'] = None; sys.argv[0] = 'engine.train'; "
              "runpy.run_module('engine.train', run_name='__main__')")


def test_scalars_picked_from_events():
    step = make_event("step", "a", 0, step=5, loss=2.5, lr=1e-3, tokens_per_s=100.0, grad_norm=None)
    assert scalars(step) == [("train/loss", 2.5), ("train/lr", 1e-3), ("train/tokens_per_s", 100.0)]
    assert ("train/grad_norm", 0.5) in scalars({**step, "grad_norm": 0.5})
    assert scalars(make_event("eval", "a", 0, step=5, loss=3.0)) == [("eval/loss", 3.0)]
    outer = make_event("outer_step", "a", 0, outer_step=1, step=3, generation=0, members=["a", "b"], pgrad_norm=0.2,
                       bytes_sent=10, allreduce_s=0.5, checksum="x", contributors=["a"], weights=[1.0])
    assert scalars(outer) == [("outer/pgrad_norm", 0.2), ("outer/bytes_sent", 10), ("outer/allreduce_s", 0.5),
                              ("outer/contributors", 1)]
    assert scalars(make_event("warning", "a", 0, message="m")) == []


def test_wandb_points_go_at_steps_that_never_fall(tmp_path):
    """Defect: with diloco.overlap (or fragment_delay) an outer step's event comes after later inner steps were
    logged, and W&B ignores a point at a lower step than the last (quietly: the sink runs it silent), so every
    outer/* series was empty. The sink puts such a point at the latest step. W&B's own side is not installed here:
    the run object records what it is given (the sink's contract is the order of its steps)."""
    from types import SimpleNamespace

    from engine.metrics import WandbSink
    logged = []
    run = SimpleNamespace(log=lambda values, step: logged.append((step, sorted(values))), finish=lambda: None)
    fake = SimpleNamespace(Settings=lambda **kw: kw, init=lambda **kw: run)
    sink = WandbSink(fake, tmp_path, "r", "a")
    for s in (4, 5, 6):
        sink(make_event("step", "a", 0, step=s, loss=2.5, lr=1e-3, tokens_per_s=100.0, grad_norm=None))
    sink(make_event("outer_step", "a", 0, outer_step=1, step=3, generation=0, members=["a", "b"], pgrad_norm=0.2,
                    bytes_sent=10, allreduce_s=0.5, checksum="x"))
    sink(make_event("step", "a", 0, step=7, loss=2.4, lr=1e-3, tokens_per_s=100.0, grad_norm=None))
    assert [s for s, _ in logged] == [4, 5, 6, 6, 7]
    assert logged[3][1] == ["outer/allreduce_s", "outer/bytes_sent", "outer/contributors", "outer/pgrad_norm"]


@pytest.mark.slow
def test_tensorboard_event_files_hold_the_run_and_wandb_absent_is_a_warning(procs, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    port = free_port()
    start_store(procs, port)
    tb = tmp_path / "tb"
    node = Node(procs, "solo", [PYTHON, "-c", HIDE_WANDB, CONFIG, *FAST, f"--mesh.store_port={port}",
                                "--mesh.node_id=solo", f"--run.dir={tmp_path / 'run'}", "--train.max_steps=6",
                                "--diloco.min_nodes=1", "--train.eval_interval=3", "--train.eval_batches=1",
                                f"--telemetry.tensorboard_dir={tb}", "--telemetry.wandb=true"])
    assert finish(node, 180, [node]) == 0, node.report()
    assert node.of("run_end")[-1]["status"] == "completed"
    warnings = [e["message"] for e in node.of("warning") if "wandb" in e["message"]]
    assert warnings == ["telemetry.wandb: the wandb package is not installed; running without Weights & Biases "
                        "(pip install wandb)"], node.report()

    acc = EventAccumulator(str(tb / "solo"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/grad_norm", "eval/loss", "outer/pgrad_norm",
            "outer/bytes_sent", "outer/allreduce_s", "outer/contributors"} <= tags, tags

    def series(tag: str) -> dict[int, float]:
        return {s.step: s.value for s in acc.Scalars(tag)}

    # the same numbers as the JSON events (float32 in the event file), at the same inner steps
    steps = {e["step"]: e for e in node.of("step")}
    assert sorted(series("train/loss")) == sorted(steps) == list(range(1, 7))
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/tokens_per_s", "tokens_per_s")):
        got = series(tag)
        assert all(got[k] == pytest.approx(steps[k][key], rel=1e-6) for k in steps), (tag, got)
    assert series("eval/loss") == pytest.approx({e["step"]: e["loss"] for e in node.of("eval")}, rel=1e-6)
    assert sorted(series("eval/loss")) == [3, 6]
    outer = {e["step"]: e for e in node.of("outer_step")}
    assert sorted(series("outer/pgrad_norm")) == sorted(outer) == [3, 6]
    for tag, key in (("outer/pgrad_norm", "pgrad_norm"), ("outer/bytes_sent", "bytes_sent"),
                     ("outer/allreduce_s", "allreduce_s")):
        assert series(tag) == pytest.approx({k: e[key] for k, e in outer.items()}, rel=1e-6, abs=1e-9), tag
    assert all(v > 0 for v in series("outer/pgrad_norm").values())
    assert series("outer/contributors") == {3: 1.0, 6: 1.0}


@pytest.mark.slow
def test_unwritable_tensorboard_dir_is_one_line_and_exit_2(procs, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    done = procs.run([sys.executable, "-m", "engine.train", "configs/debug.toml", "--data.fake=true",
                      "--data.seq_len=32", "--train.max_steps=1", "--telemetry.human=false",
                      f"--run.dir={tmp_path / 'run'}", f"--telemetry.tensorboard_dir={blocker / 'tb'}"], timeout=90)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(f"error: telemetry.tensorboard_dir: cannot create {blocker}"), \
        done.stderr[-2000:]
    assert "Traceback" not in done.stderr
