"""Checkpoints: exact resume parity, the latest pointer survives a crash during save, keep-last-K, clear errors
for corrupt or mismatched checkpoints, and no accidental overwrite of data on disk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.checkpoint import CheckpointFailed, Checkpointer
from engine.config import CkptConfig, DataConfig, InnerConfig, ModelConfig, OptimConfig, TrainConfig
from engine.data import build_data
from engine.model import build_model
from engine.outer import NoOuter, Progress
from engine.inner.ddp_fsdp import build_inner
from engine.world import World
from test_train import run_engine

torch.set_num_threads(1)  # as conftest does for engine processes: tiny models on shared cores
WORLD = World(rank=0, world_size=1, local_rank=0, hostname="h", pid=1)


def test_resumed_run_logs_the_same_losses(procs, tmp_path):
    """8 steps straight through vs. 4 steps, then a new process resuming from the step-4 checkpoint."""
    common = ["--train.max_steps=8", "--train.eval_interval=2", "--data.eval_percent=20"]
    full = run_engine(procs, tmp_path / "full", *common, "--ckpt.interval=4", "--ckpt.keep=3")
    assert full.rc == 0, full.stderr[-3000:]
    assert [e["step"] for e in full.of("checkpoint")] == [4, 8]
    step4 = tmp_path / "full" / "checkpoints" / "step-00000004"
    resumed = run_engine(procs, tmp_path / "resumed", *common, f"--ckpt.resume={step4}")
    assert resumed.rc == 0, resumed.stderr[-3000:]
    a, b = full.losses(), resumed.losses()
    assert sorted(b) == [5, 6, 7, 8]
    assert all(abs(a[s] - b[s]) < 1e-6 for s in b), (a, b)
    evals_a = {e["step"]: e["loss"] for e in full.of("eval")}
    evals_b = {e["step"]: e["loss"] for e in resumed.of("eval")}
    assert all(abs(evals_a[s] - evals_b[s]) < 1e-6 for s in evals_b) and sorted(evals_b) == [6, 8]
    assert resumed.of("step")[-1]["tokens"] == full.of("step")[-1]["tokens"]


def test_resume_auto_starts_fresh_then_continues(tmp_path):
    """ckpt.resume=auto (what the console passes): nothing on disk -> fresh; a finished checkpoint -> resume it."""
    ck, inner, data = parts(tmp_path, resume="auto")
    assert ck.check_start() is None
    progress = Progress()
    step(inner, data, progress)
    saved, _ = ck.save(progress.step, inner, data, progress, NoOuter())
    again, _, _ = parts(tmp_path, resume="auto")
    assert again.check_start() == saved
    fresh, _, _ = parts(tmp_path)  # no resume asked: the folder's checkpoints are moved aside, never reused
    assert fresh.check_start() is None and not fresh.dir.exists()
    assert (fresh.archived / saved.name / "meta.json").is_file()


def parts(tmp_path: Path, **ckpt):
    torch.manual_seed(0)
    tcfg = TrainConfig(micro_batch_size=2, batch_size=2, max_steps=10)
    data = build_data(DataConfig(fake=True, seq_len=16), WORLD, seed=0)
    model = build_model(ModelConfig(), data.vocab_size, 16, seed=0)
    inner = build_inner(model, InnerConfig(), tcfg, OptimConfig(), WORLD, torch.device("cpu"))
    cfg = CkptConfig(dir=str(tmp_path / "ck"), **ckpt)
    return Checkpointer(cfg, "unused", WORLD, "digest1", "ddp", torch.device("cpu")), inner, data


def step(inner, data, progress):
    x, y = data.train.next_batch(2)
    inner.micro_step(x, y, last=True)
    inner.optimizer_step()
    progress.step += 1


def test_crash_during_save_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    ck, inner, data = parts(tmp_path, keep=2)
    progress, outer = Progress(), NoOuter()
    step(inner, data, progress)
    ck.save(1, inner, data, progress, outer)

    def crash(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr("engine.checkpoint.dcp.save", crash)
    step(inner, data, progress)
    with pytest.raises(CheckpointFailed, match="rank 0 while writing: OSError: disk full; latest names step-00000001"):
        ck.save(2, inner, data, progress, outer)
    assert (ck.dir / "latest").read_text().strip() == "step-00000001" and ck.failed_step == 2
    assert sorted(p.name for p in ck.dir.iterdir()) == ["latest", "step-00000001"]  # the partial folder is gone
    monkeypatch.undo()
    for n in (2, 3, 4):  # keep=2 prunes the oldest
        if n > 2:
            step(inner, data, progress)
        ck.save(n, inner, data, progress, outer)
    assert ck.steps_on_disk() == [3, 4] and (ck.dir / "latest").read_text().strip() == "step-00000004"
    with pytest.raises(ValueError, match="already exists"):
        ck.save(4, inner, data, progress, outer)


@pytest.mark.parametrize("zip_writer", [False, True])
def test_a_full_disk_in_the_dcp_write_is_an_ordinary_error(tmp_path, monkeypatch, zip_writer):
    """Defect: DCP reports a failed write as CheckpointException, a BaseException: it escaped every handler of
    engine/train.py (no error event, no run_end). It is a CheckpointFailed naming the cause. On a real full disk
    (a 30 MB tmpfs) DCP said only torch's zip writer's "unexpected pos 704 vs 598": the free space says why."""
    import errno
    from collections import namedtuple

    ck, inner, data = parts(tmp_path)
    progress = Progress()
    step(inner, data, progress)
    ck.save(1, inner, data, progress, NoOuter())

    def full(*a, **k):
        if zip_writer:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("torch.distributed.checkpoint.filesystem._write_item", full)  # inside DCP's own writer
    usage = namedtuple("usage", "total used free")(2**30, 2**30 - 2**19, 2**19)
    monkeypatch.setattr("engine.checkpoint.shutil.disk_usage", lambda path: usage)
    step(inner, data, progress)
    with pytest.raises(CheckpointFailed) as failed:
        ck.save(2, inner, data, progress, NoOuter())
    assert isinstance(failed.value, Exception)
    cause = ("RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598 "
             f"({ck.dir} has 0.5 MiB free: the disk is full)") if zip_writer else \
        "OSError: [Errno 28] No space left on device"  # it says so itself
    assert str(failed.value) == (f"checkpoint step-00000002 failed on rank 0 while writing: {cause}; latest names "
                                 "step-00000001")
    assert sorted(p.name for p in ck.dir.iterdir()) == ["latest", "step-00000001"]


def test_the_first_save_removes_what_crashed_saves_left(tmp_path):
    """Defect: a .step-N.tmp folder left by a crash was removed only by a later save of the same step N. The first
    save of a process removes every one no live process writes: ownerless (a crash before its owner file) or owned
    by a process of this host that is gone; a live process's, or another host's, stays."""
    import os

    ck, inner, data = parts(tmp_path)
    progress = Progress()
    step(inner, data, progress)
    ck.save(1, inner, data, progress, NoOuter())
    owners = {7: None, 8: "h 999999999", 9: f"h {os.getpid()}", 10: "g 123"}  # WORLD is pid 1 on host h
    for n, owner in owners.items():
        left = ck.dir / f".step-{n:08d}.tmp"
        left.mkdir()
        (left / "__0_0.distcp").write_bytes(b"partial")
        if owner:
            (left / "owner").write_text(owner + "\n")
    later, _, _ = parts(tmp_path, resume="latest")  # another process of the node, resuming
    assert later.check_start() == ck.dir / "step-00000001"
    later.save(2, inner, data, progress, NoOuter())
    assert sorted(p.name for p in ck.dir.glob(".step-*")) == [".step-00000009.tmp", ".step-00000010.tmp"]
    assert (ck.dir / "step-00000002" / "owner").read_text() == "h 1\n"


def test_resume_latest_takes_a_complete_checkpoint_the_pointer_missed(tmp_path):
    """Defect: a crash between a save's rename and the pointer's update left `latest` on step N-1 beside a complete
    step N, and --ckpt.resume=latest (or auto) was refused as overwriting newer checkpoints. latest and auto take
    the complete step N, with a warning; naming the older folder is still refused."""
    ck, inner, data = parts(tmp_path)
    progress = Progress()
    for n in (1, 2):
        step(inner, data, progress)
        ck.save(n, inner, data, progress, NoOuter())
    (ck.dir / "latest").write_text("step-00000001\n")  # the pointer as the crash left it
    for resume in ("latest", "auto"):
        again, _, _ = parts(tmp_path, resume=resume)
        assert again.check_start() == ck.dir / "step-00000002"
        assert again.notes == [f"ckpt.resume: latest names step-00000001, but step-00000002 is complete and newer (a "
                               f"save ended between its commit and the pointer's update): resuming from "
                               f"{ck.dir / 'step-00000002'}"]
    older, _, _ = parts(tmp_path, resume=str(ck.dir / "step-00000001"))
    with pytest.raises(ValueError, match="would overwrite newer checkpoints"):
        older.check_start()
    (ck.dir / "latest").unlink()  # the crash came in the first save, before there was a pointer
    first, _, _ = parts(tmp_path, resume="auto")
    assert first.check_start() == ck.dir / "step-00000002" and "there is no latest pointer" in first.notes[0]


def test_load_restores_weights_optimizer_data_and_progress(tmp_path):
    ck, inner, data = parts(tmp_path)
    progress = Progress()
    for _ in range(3):
        step(inner, data, progress)
    progress.tokens = 96
    ck.save(3, inner, data, progress, NoOuter())
    expected_next = data.train.next_batch(2)
    weights = [p.detach().clone() for p in inner.model.parameters()]
    ck2, inner2, data2 = parts(tmp_path, resume="latest")
    path = ck2.check_start()
    progress2 = Progress()
    assert ck2.load(path, inner2, data2, progress2, NoOuter()) == 3
    assert progress2 == Progress(step=3, outer_step=0, tokens=96)
    assert all(torch.equal(a, b) for a, b in zip(weights, inner2.model.parameters()))
    assert inner2.scheduler.last_epoch == 3 and inner2.current_lr() == inner.current_lr()
    assert torch.equal(data2.train.next_batch(2)[0], expected_next[0])
    state = inner2.optimizer.state[next(inner2.model.parameters())]
    assert float(state["step"]) == 3
    # a resume that turns fp16's loss scaling on: the fp32 run saved a disabled scaler's empty state, and loading
    # it was a traceback ("The source state dict is empty"); it starts with a fresh scale
    fp16 = build_inner(build_model(ModelConfig(), data.vocab_size, 16, seed=0), InnerConfig(),
                       TrainConfig(micro_batch_size=2, batch_size=2, max_steps=10, precision="fp16-mixed"),
                       OptimConfig(), WORLD, torch.device("cpu"))
    assert ck2.load(path, fp16, data2, Progress(), NoOuter()) == 3
    assert all(torch.equal(a, b) for a, b in zip(weights, fp16.model.parameters()))
    assert fp16.scaler.is_enabled() and fp16.scaler.get_scale() == 2.0 ** 16


def test_corrupt_or_mismatched_checkpoints_are_clear_errors(tmp_path):
    ck, inner, data = parts(tmp_path)
    progress = Progress()
    step(inner, data, progress)
    folder, _ = ck.save(1, inner, data, progress, NoOuter())
    (folder / "rank-0.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"rank-0\.pt is missing or corrupt"):
        ck.load(folder, inner, data, Progress(), NoOuter())
    torch.save({}, folder / "rank-0.pt")
    with pytest.raises(ValueError, match=r"rank-0\.pt is corrupt \(expected keys"):
        ck.load(folder, inner, data, Progress(), NoOuter())
    ck.save(2, inner, data, progress, NoOuter())  # a good rank file again, then break the tensor shards
    folder = ck.dir / "step-00000002"
    for f in folder.glob("*.distcp"):
        f.write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="cannot load model/optimizer"):
        ck.load(folder, inner, data, Progress(), NoOuter())
    other = Checkpointer(ck.cfg, "unused", WORLD, "digest2", "ddp", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"written with another config: digest digest1 there, digest2 here"):
        other.read_meta(folder)  # a checkpoint that does not keep its settings: the digests, at least
    # one that keeps them: the settings that differ, by name (the refusal gave two hashes and nothing to act on)
    ck.settings = {"data.seq_len": 128, "model.n_layers": 2, "diloco.inner_steps": 5}
    kept, _ = ck.save(3, inner, data, progress, NoOuter())
    other.settings = {"data.seq_len": 64, "model.n_layers": 2, "diloco.inner_steps": 5, "diloco.overlap": True}
    with pytest.raises(ValueError, match=r"another config: data\.seq_len = 128 there, 64 here; diloco\.overlap "
                                         r"= absent there, true here$"):
        other.read_meta(kept)
    # a setting kept as None (unset) and one an older engine did not keep read apart: "unset" is not "absent"
    other.settings = {**ck.settings, "diloco.overlap": None}
    with pytest.raises(ValueError, match=r"another config: diloco\.overlap = absent there, unset here$"):
        other.read_meta(kept)
    fsdp = Checkpointer(ck.cfg, "unused", WORLD, "digest1", "fsdp", torch.device("cpu"))
    with pytest.raises(ValueError, match="inner.strategy ddp"):
        fsdp.read_meta(folder)
    (kept / ".metadata").unlink()  # found before the model is built, not after two torch tracebacks
    with pytest.raises(ValueError, match=r"step-00000003 is not a complete checkpoint \(no \.metadata: the index"):
        ck.read_meta(kept)
    (folder / "meta.json").write_text("{")
    with pytest.raises(ValueError, match="meta.json is corrupt"):
        ck.read_meta(folder)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ck.read_meta(tmp_path)


def test_a_fresh_run_moves_an_older_runs_checkpoints_aside(tmp_path):
    """README defect: a second `python -m engine.train configs/debug.toml` stopped with "already holds
    checkpoints". A fresh run moves the older checkpoints to <parent>/_archive/<time>/ whole; nothing is deleted."""
    ck, inner, data = parts(tmp_path)
    progress = Progress()
    step(inner, data, progress)
    ck.save(1, inner, data, progress, NoOuter())
    fresh, _, _ = parts(tmp_path)  # a new run pointed at a folder that holds another run's checkpoints
    before = sorted(p.relative_to(fresh.dir) for p in fresh.dir.rglob("*"))
    assert fresh.check_start() is None  # a fresh start: the old run moves aside, whole
    assert fresh.archived.parent.parent == fresh.dir.parent / "_archive"
    assert sorted(p.relative_to(fresh.archived) for p in fresh.archived.rglob("*")) == before
    again, _, _ = parts(tmp_path)
    again.save(1, inner, data, progress, NoOuter())
    third, _, _ = parts(tmp_path)  # twice in the same second: a second archive folder, nothing merged or lost
    assert third.check_start() is None and third.archived != fresh.archived
    assert (fresh.archived / "latest").is_file() and (third.archived / "latest").is_file()


def test_nothing_on_disk_is_overwritten_by_accident(tmp_path):
    ck, inner, data = parts(tmp_path)
    progress = Progress()
    step(inner, data, progress)
    ck.save(1, inner, data, progress, NoOuter())
    export = tmp_path / "export"
    export.mkdir()
    (export / "keep.txt").write_text("precious")
    exporting, _, _ = parts(tmp_path, resume="latest", export_dir=str(export))
    with pytest.raises(ValueError, match="exists and is not empty"):
        exporting.check_start()
    assert (export / "keep.txt").read_text() == "precious"
    step(inner, data, progress)
    ck.save(2, inner, data, progress, NoOuter())
    older, _, _ = parts(tmp_path, resume=str(ck.dir / "step-00000001"))  # would overwrite step 2 later on
    with pytest.raises(ValueError, match="would overwrite newer checkpoints"):
        older.check_start()
    elsewhere = tmp_path / "other"
    parts(elsewhere)[0].save(1, inner, data, progress, NoOuter())
    into_other_run, _, _ = parts(elsewhere, resume=str(ck.dir / "step-00000002"))
    with pytest.raises(ValueError, match="holds checkpoints of another run"):
        into_other_run.check_start()


def test_export_into_a_folder_another_node_filled_and_after_a_crashed_export(tmp_path):
    """An export's temporary folder is its own process's: one left by a crashed export of this host is removed,
    another host's (a shared filesystem) is not. Into a folder another node of the run filled meanwhile: the run's
    agreed model is there, this one is dropped; without an agreed model it is an error naming where it was left."""
    import dataclasses
    import os

    from engine.checkpoint import export
    from engine.data.tokenizer import ByteTokenizer
    from engine.model import model_config
    model = build_model(ModelConfig(preset="debug"), 258, 64, seed=0)
    inner = type("Inner", (), {"full_model_state_dict": lambda self: model.state_dict()})()
    hf, tok = model_config(ModelConfig(preset="debug"), 258, 64), ByteTokenizer()
    world = dataclasses.replace(WORLD, hostname="h", pid=os.getpid())
    crashed, other_host = tmp_path / ".out.tmp-h-999999999", tmp_path / ".out.tmp-g-123"
    for folder in (crashed, other_host):
        folder.mkdir()
    assert export(inner, hf, tok, str(tmp_path / "out"), world) == tmp_path / "out"
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not crashed.exists() and other_host.exists()  # pid 999999999 runs nowhere; host g is not ours
    before = (tmp_path / "out" / "model.safetensors").stat().st_mtime_ns
    export(inner, hf, tok, str(tmp_path / "out"), world, agreed=True)  # another node of the run was first
    assert (tmp_path / "out" / "model.safetensors").stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.tmp-g-123", "out"]
    with pytest.raises(ValueError, match=r"ckpt\.export_dir: .*out was written by another process during this "
                                         r"run; this run's export is in .*\.out\.tmp-h-"):
        export(inner, hf, tok, str(tmp_path / "out"), world)
    # a node of the same config whose run ended before this one joined it: another model in the folder. It was
    # dropped as "the same agreed model", and the node reported an export it did not have; it keeps its own now
    other = build_model(ModelConfig(preset="debug"), 258, 64, seed=1)
    stranger = type("Inner", (), {"full_model_state_dict": lambda self: other.state_dict()})()
    kept = export(stranger, hf, tok, str(tmp_path / "out"), world, agreed=True)
    assert kept.name == f"out-h-{os.getpid()}" and (kept / "model.safetensors").is_file()
    assert (tmp_path / "out" / "model.safetensors").stat().st_mtime_ns == before
    # kept out of the names the next export sweeps as a crashed export's folder (it deleted the one it named)
    export(inner, hf, tok, str(tmp_path / "out"), dataclasses.replace(world, pid=999999999), agreed=True)
    assert (kept / "model.safetensors").is_file()


def test_the_export_generates_with_a_kv_cache_and_holds_the_trained_fp32_weights(tmp_path):
    """Defect: the export carried training's use_cache=false into config.json and generation_config.json (generate()
    on it ran without a KV cache), and a model.path whose config says bfloat16 was exported in bf16, the trained fp32
    weights rounded without a word. The export is what save_pretrained of the trained model writes: fp32, cached."""
    import dataclasses
    import json
    import os

    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.checkpoint import export
    from engine.data.tokenizer import ByteTokenizer
    from engine.model import model_config
    from engine.presets import PRESETS
    bf16 = tmp_path / "bf16"
    LlamaConfig(**PRESETS["debug"], vocab_size=258, max_position_embeddings=256, dtype="bfloat16").save_pretrained(bf16)
    world = dataclasses.replace(WORLD, pid=os.getpid())
    for name, cfg in (("preset", ModelConfig(preset="debug")), ("bf16", ModelConfig(path=str(bf16)))):
        model = build_model(cfg, 258, 64, seed=0)
        inner = type("Inner", (), {"full_model_state_dict": lambda self, m=model: m.state_dict()})()
        out = export(inner, model_config(cfg, 258, 64), ByteTokenizer(), str(tmp_path / f"out-{name}"), world)
        assert json.loads((out / "generation_config.json").read_text())["use_cache"] is True, name
        assert json.loads((out / "config.json").read_text())["dtype"] == "float32", name
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert loaded.config.use_cache and loaded.dtype == torch.float32, name
        exported = loaded.state_dict()
        assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items()), name


def test_a_step_that_fails_part_way_leaves_the_data_position_at_its_start():
    """A CUDA OOM in a step's second micro-batch: the checkpoint saved before exit said step 3 with the position of
    step 3 and a half, and the resume skipped those sequences."""
    import numpy as np

    from engine.data import PackedSource, TokenStream
    from engine.session import train_step

    class Failing:
        calls = 0

        def micro_step(self, input_ids, labels, last):
            Failing.calls += 1
            if Failing.calls == 8:  # the second micro-batch of step 4
                raise RuntimeError("CUDA out of memory")
            return torch.zeros(())

        def optimizer_step(self):
            return torch.zeros(())

    stream = TokenStream(PackedSource(np.arange(8 * 4000 + 1, dtype=np.int32), 8), 0, 1, seed=0)
    steps = 0
    with pytest.raises(RuntimeError, match="out of memory"):
        while True:
            train_step(Failing(), stream, micro_batch_size=4, accum=2)
            steps += 1
    assert steps == 3 and stream.state_dict()["position"] == 3 * 2 * 4  # an uninterrupted run's at step 3


def test_eval_asked_for_with_nothing_held_out_is_said():
    """train.eval_interval with data.eval_percent = 0: no eval event came, and nothing said why."""
    from types import SimpleNamespace

    from engine.session import eval_off_note

    cfg = SimpleNamespace(train=SimpleNamespace(eval_interval=10))
    none_held = SimpleNamespace(eval=None, notes=[])
    assert eval_off_note(cfg, none_held) == ("train.eval_interval = 10, but the data holds nothing out for eval "
                                             "(data.eval_percent = 0, or the prepared folder's): eval is off")
    assert eval_off_note(cfg, SimpleNamespace(eval=object(), notes=[])) is None
    assert eval_off_note(SimpleNamespace(train=SimpleNamespace(eval_interval=0)), none_held) is None
    too_few = SimpleNamespace(eval=None, notes=["data: the held-out split has too few tokens for eval; eval is off"])
    assert eval_off_note(cfg, too_few) is None  # said already


def test_a_resume_of_a_missing_folder_a_typo_or_a_pointer_to_a_removed_step_says_which(tmp_path):
    """Defect: all three said "is not a complete checkpoint (no meta.json)", which sent one looking inside a folder
    that was not there. Each has its own line; a real folder without meta.json still says that."""
    ck, inner, data = parts(tmp_path)
    progress = Progress()
    for n in (1, 2):
        step(inner, data, progress)
        ck.save(n, inner, data, progress, NoOuter())
    missing = tmp_path / "nowhere" / "step-00000009"
    cases = {str(missing): f"ckpt.resume: no such folder: {missing}",
             "lastest": "ckpt.resume: 'lastest' is not a checkpoint folder, 'latest' or 'auto': did you mean 'latest'?",
             "Latest": "ckpt.resume: 'Latest' is not a checkpoint folder, 'latest' or 'auto': did you mean 'latest'?",
             "atuo": "ckpt.resume: 'atuo' is not a checkpoint folder, 'latest' or 'auto': did you mean 'auto'?",
             "nothing-like-it": "ckpt.resume: no such folder: nothing-like-it",
             str(ck.dir / "latest"): f"ckpt.resume: {ck.dir / 'latest'} is a file, not a checkpoint folder"}
    for resume, line in cases.items():
        with pytest.raises(ValueError) as e:
            parts(tmp_path, resume=resume)[0].check_start()
        assert str(e.value) == line
    # latest names step 2, which was removed by hand: said so, with the newest complete one left (step 1)
    import shutil
    shutil.rmtree(ck.dir / "step-00000002")
    for resume in ("latest", "auto"):
        with pytest.raises(ValueError) as e:
            parts(tmp_path, resume=resume)[0].check_start()
        assert str(e.value) == (f"ckpt.resume: latest points to {ck.dir / 'step-00000002'}, which is gone; "
                                f"{ck.dir / 'step-00000001'} is the newest complete one: name it in ckpt.resume")
    assert parts(tmp_path, resume=str(ck.dir / "step-00000001"))[0].check_start() == ck.dir / "step-00000001"
    shutil.rmtree(ck.dir / "step-00000001")
    with pytest.raises(ValueError) as e:
        parts(tmp_path, resume="latest")[0].check_start()
    assert str(e.value) == f"ckpt.resume: latest points to {ck.dir / 'step-00000002'}, which is gone"
    (tmp_path / "empty").mkdir()  # a folder that is there but holds no checkpoint: what the old line was for
    with pytest.raises(ValueError, match=r"empty is not a complete checkpoint \(no meta\.json\)$"):
        parts(tmp_path, resume=str(tmp_path / "empty"))[0].check_start()
    assert (ck.dir / "latest").is_file()  # nothing moved


@pytest.mark.parametrize("setting, there, here", [("outer_lr", "1.0", "0.5"), ("outer_momentum", "0.0", "0.9")])
def test_a_diloco_resume_that_changes_only_the_outer_optimizer_is_refused_naming_it(procs, tmp_path, setting, there,
                                                                                       here):
    """Issue 41: the checkpoint's digest covers diloco.outer_lr and outer_momentum, but no test resumed with either
    changed alone (dropped from the digest, every test stayed green). A checkpoint written as the engine writes a
    configs/debug-diloco.toml run's (its digest and settings from the same config), then the real engine resumes it
    with one outer setting changed: refused before the mesh is asked, one line naming the setting and both values.
    The store's port is 1: a resume let through would fail there instead, with another line."""
    from engine.config import load_config
    from engine.digests import digest, flat_settings, shared_settings
    from procs import PYTHON, ROOT
    run_dir = tmp_path / "run"
    common = ["--data.fake=true", f"--run.dir={run_dir}", "--data.seq_len=16", "--train.micro_batch_size=2",
              "--train.batch_size=2", "--mesh.store_port=1", "--mesh.store_timeout=2"]
    cfg = load_config(ROOT / "configs" / "debug-diloco.toml", common)
    assert cfg.diloco.enabled and str(getattr(cfg.diloco, setting)) == there
    torch.manual_seed(0)
    data = build_data(cfg.data, WORLD, seed=cfg.train.seed)  # the run's fake data: a resume let through goes on
    model = build_model(cfg.model, data.vocab_size, cfg.data.seq_len, seed=0)
    inner = build_inner(model, cfg.inner, cfg.train, cfg.optim, WORLD, torch.device("cpu"))
    ck = Checkpointer(cfg.ckpt, cfg.run.dir, WORLD, digest(cfg), cfg.inner.strategy, torch.device("cpu"),
                      max_steps=cfg.train.max_steps, settings=flat_settings(shared_settings(cfg)))
    progress = Progress()
    step(inner, data, progress)
    saved, _ = ck.save(1, inner, data, progress, NoOuter())
    done = procs.run([PYTHON, "-m", "engine.train", "configs/debug-diloco.toml", *common, "--ckpt.resume=latest",
                      f"--diloco.{setting}={here}"], timeout=150)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and lines == [f"error: ckpt.resume: {saved} was written with another config: "
                                              f"diloco.{setting} = {there} there, {here} here"], done.stderr[-2000:]
