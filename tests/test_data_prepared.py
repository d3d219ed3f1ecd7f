"""Prepared data: `python -m engine.data prepare` output equals the raw stream, parallel equals inline, Parquet and
Arrow through `datasets`, bad shards and tokenizer mismatches are one line naming the file, an interrupted prepare
is detected and resumes, sharding stays disjoint across nodes x workers and layout changes, and a run trained from
a prepared folder resumes with identical losses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.config import DataConfig
from engine.data import Permutation, build_data, dataset_name, load_tokenizer
from engine.data.prepare import main as prepare_main
from engine.world import World
from procs import PYTHON, ROOT, kill_group
from test_train import run_engine


def world(rank=0, size=1, grank=None, gsize=None) -> World:
    return World(rank=rank, world_size=size, local_rank=rank, hostname="h", pid=1, global_rank=grank,
                 global_world_size=gsize)


def write_corpus(folder: Path, copies: int, repo_root: Path) -> Path:
    """The shipped docstrings, `copies` times, each copy's documents made distinct (so the split varies)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = (repo_root / "corpus" / "stdlib_docstrings.jsonl").read_text().splitlines()
    with (folder / "docs.jsonl").open("w") as fh:
        for copy in range(copies):
            for line in lines:
                fh.write(json.dumps({"text": f"[{copy}] " + json.loads(line)["text"]}) + "\n")
    (folder / "readme.txt").write_text("A plain text document, one per file.\n" * 30)
    return folder


def prepare(*args: str | Path, workers: int = 0) -> int:
    return prepare_main(["prepare", *map(str, args), f"--workers={workers}", "--quiet"])


def tokens_of(data) -> np.ndarray:
    t = data.train.source.tokens
    return np.asarray(t[0:len(t)])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """corpus/ prepared into 3 train shards (so sequences cross shard boundaries)."""
    out = tmp_path_factory.mktemp("prepared") / "docstrings"
    assert prepare(ROOT / "corpus", "--out", out, "--shard-tokens=300000", "--chunk-mb=0.25") == 0
    return out


def test_permutation_is_a_seeded_bijection_without_a_table():
    for n in (1, 2, 3, 7, 1000, 4097):
        p = Permutation(n, seed=5, epoch=0)
        assert sorted(p(i) for i in range(n)) == list(range(n))
    a = [Permutation(1000, 5, 0)(i) for i in range(50)]
    assert a == [Permutation(1000, 5, 0)(i) for i in range(50)]
    assert a != [Permutation(1000, 5, 1)(i) for i in range(50)] != [Permutation(1000, 6, 0)(i) for i in range(50)]
    assert a != sorted(a)  # shuffled


def test_prepared_folder_reads_exactly_the_raw_stream(prepared, repo_root):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["name"] == "docstrings" and manifest["dtype"] == "uint16"
    assert len(manifest["splits"]["train"]["shards"]) >= 3 and manifest["tokenizer"]["vocab_size"] == 258
    assert not (prepared / "prepare.json").exists()
    raw = build_data(DataConfig(path=str(repo_root / "corpus"), seq_len=64), world(), seed=3)
    mapped = build_data(DataConfig(path=str(prepared), seq_len=64), world(), seed=3)
    assert isinstance(mapped.train.source.tokens.arrays[0], np.memmap)
    assert np.array_equal(tokens_of(raw), tokens_of(mapped))
    assert manifest["splits"]["train"]["tokens"] == len(tokens_of(raw))
    for _ in range(5):
        assert all(torch.equal(a, b) for a, b in zip(raw.train.next_batch(16), mapped.train.next_batch(16)))
    assert torch.equal(raw.eval.next_batch(4)[0], mapped.eval.next_batch(4)[0])
    assert mapped.dataset == "docstrings" and mapped.train.state_dict()["dataset"] == "docstrings"
    assert dataset_name(DataConfig(path=str(prepared))) == "docstrings"  # what run_start carries
    assert dataset_name(DataConfig(path=str(repo_root / "corpus"))) is None
    assert dataset_name(DataConfig(path=str(prepared), fake=True)) is None
    assert mapped.train.epoch == pytest.approx(80 / mapped.train.source.num_sequences)
    idx = np.fromfile(prepared / "train-00000.idx", dtype="<u8")  # document ends: each doc is bos ... eos
    shard = np.fromfile(prepared / "train-00000.bin", dtype="<u2")
    assert idx[-1] == len(shard) and shard[0] == 256 and all(shard[idx[:-1]] == 256) and all(shard[idx - 1] == 257)


def test_worker_processes_write_what_inline_writes(prepared, repo_root, tmp_path):
    """A real pool of 2 forked workers through the CLI process gives byte-identical shards."""
    import subprocess
    out = tmp_path / "parallel"
    done = subprocess.run([PYTHON, "-m", "engine.data", "prepare", str(repo_root / "corpus"), "--out", str(out),
                           "--shard-tokens=300000", "--chunk-mb=0.25", "--workers=2"], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "prepare: 100%" in done.stderr  # the progress bar
    ours, theirs = (json.loads((d / "manifest.json").read_text())["splits"] for d in (out, prepared))
    assert ours == theirs


def test_parquet_and_arrow_through_datasets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    texts = [f"row {i}: " + "parquet text " * (i % 7 + 1) for i in range(600)]
    table = pa.table({"id": list(range(600)), "body": texts})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=100)
    with pa.OSFile(str(tmp_path / "rows.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    cfg = lambda p: DataConfig(path=str(p), seq_len=32, text_field="body", eval_percent=5)  # noqa: E731
    expected = tokens_of(build_data(cfg(tmp_path / "rows.jsonl"), world(), 0))
    for name, chunk_mb in (("rows.parquet", "0.001"), ("rows.arrow", "4")):  # a chunk per batch; one in all
        out = tmp_path / f"out-{name}"
        assert prepare(tmp_path / name, "--out", out, "--text-field=body", "--eval-percent=5",
                       f"--chunk-mb={chunk_mb}") == 0
        assert np.array_equal(tokens_of(build_data(cfg(out), world(), 0)), expected), name
        assert np.array_equal(tokens_of(build_data(cfg(tmp_path / name), world(), 0)), expected), name  # raw
    with pytest.raises(ValueError, match=r"rows\.parquet: no column 'text' \(columns: id, body"):
        build_data(DataConfig(path=str(tmp_path / "rows.parquet"), seq_len=32), world(), 0)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"bad\.parquet: not a readable parquet file"):
        build_data(DataConfig(path=str(tmp_path / "bad.parquet"), seq_len=32), world(), 0)


def copy_of(prepared: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(prepared, target)
    return target


def test_truncated_or_missing_shard_is_one_line_naming_it(prepared, tmp_path):
    folder = copy_of(prepared, tmp_path)
    cfg = DataConfig(path=str(folder), seq_len=64)
    with open(folder / "train-00002.bin", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(ValueError, match=r"train-00002\.bin is truncated or corrupt: 1000 bytes, the manifest "
                                         r"says \d+"):
        build_data(cfg, world(), 0)
    (folder / "train-00002.bin").unlink()
    with pytest.raises(ValueError, match=r"train-00002\.bin is missing"):
        build_data(cfg, world(), 0)
    (folder / "manifest.json").write_text('{"format": "zeroband-tokens/1", "splits": ')
    with pytest.raises(ValueError, match=r"manifest\.json is corrupt"):
        build_data(cfg, world(), 0)


def test_corrupt_shard_is_named_when_read_and_by_verify(prepared, tmp_path):
    folder = copy_of(prepared, tmp_path)
    size = (folder / "train-00001.bin").stat().st_size
    with open(folder / "train-00001.bin", "r+b") as fh:  # garbage over the whole shard, same size
        fh.write(os.urandom(size))
    data = build_data(DataConfig(path=str(folder), seq_len=64), world(), 0)  # sizes still match: starts
    with pytest.raises(ValueError, match=r"train-00001\.bin is corrupt: token \d+ at offset \d+ is outside the "
                                         r"vocabulary \(258 ids\)"):
        for _ in range(200):
            data.train.next_batch(8)
    assert prepare_main(["verify", str(prepared)]) == 0
    with pytest.raises(ValueError, match=r"train-00001\.bin is corrupt: its checksum differs"):
        from engine.data.shards import verify
        verify(folder)


def tiny_tokenizer(folder: Path, text: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder


def test_tokenizer_mismatch_is_one_error_line(tmp_path, repo_root, capsys, monkeypatch):
    text = "the quick brown fox jumps over the lazy dog "
    (tmp_path / "c.txt").write_text(text * 200)
    tok = tiny_tokenizer(tmp_path / "tok", text)
    out = tmp_path / "words"
    assert prepare(tmp_path / "c.txt", "--out", out, "--tokenizer", tok, "--eval-percent=0") == 0
    data = build_data(DataConfig(path=str(out), tokenizer=str(tok), seq_len=8), world(), 0)
    assert data.vocab_size == 11 and tokens_of(data)[:3].tolist() == [1, *data.tokenizer.tok.encode("the quick")]
    with pytest.raises(ValueError, match=r"data.tokenizer: .*words was prepared with tokenizer tok \(vocab 11, "
                                         r"\w+\), this run uses the byte-level tokenizer \(vocab 258\)"):
        build_data(DataConfig(path=str(out), seq_len=8), world(), 0)
    other = tiny_tokenizer(tmp_path / "tok2", text + "plus more words")
    with pytest.raises(ValueError, match=r"prepared with tokenizer tok \(vocab 11.*this run uses tokenizer tok2"):
        build_data(DataConfig(path=str(out), tokenizer=str(other), seq_len=8), world(), 0)
    # the model's vocabulary smaller than the manifest's: one line through the real entry point
    from engine.train import main
    monkeypatch.chdir(repo_root)
    code = main(["configs/debug.toml", f"--data.path={out}", f"--data.tokenizer={tok}", "--model.vocab_size=5",
                 f"--run.dir={tmp_path / 'run'}", "--train.max_steps=1", "--data.seq_len=8"])
    err = capsys.readouterr().err
    assert code == 2 and "error: model: vocab_size 5 is smaller than the tokenizer's 11" in err, err


def test_a_different_tokenizer_of_the_same_size_is_refused(tmp_path):
    """A tokenizer with as many ids as the folder's (other words, or the same words under other ids) would read its
    tokens as other text: the check compares the vocabulary itself, not its size. A copy of the folder's own
    tokenizer elsewhere is the same tokenizer."""
    text = "the quick brown fox jumps over the lazy dog "
    (tmp_path / "c.txt").write_text(text * 50)
    tok = tiny_tokenizer(tmp_path / "tok", text)
    out = tmp_path / "words"
    assert prepare(tmp_path / "c.txt", "--out", out, "--tokenizer", tok, "--eval-percent=0") == 0
    others = [tiny_tokenizer(tmp_path / "other-words", "one slow green cat walks under one sleepy cow "),
              tiny_tokenizer(tmp_path / "other-ids", "dog dog dog lazy lazy over over jumps jumps fox fox brown "
                                                     "brown quick quick the ")]
    mine = load_tokenizer(str(tok))
    for other in others:
        theirs = load_tokenizer(str(other))
        assert theirs.vocab_size == mine.vocab_size == 11 and theirs.tok.get_vocab() != mine.tok.get_vocab()
        with pytest.raises(ValueError, match=rf"prepared with tokenizer tok \(vocab 11, \w+\), this run uses "
                                             rf"tokenizer {other.name} \(vocab 11, \w+\)"):
            build_data(DataConfig(path=str(out), tokenizer=str(other), seq_len=8), world(), 0)
    copy = shutil.copytree(tok, tmp_path / "elsewhere" / "tok-copy")
    assert build_data(DataConfig(path=str(out), tokenizer=str(copy), seq_len=8), world(), 0).vocab_size == 11


def test_disjoint_across_2_nodes_x_2_workers_and_after_a_layout_change(prepared):
    cfg = DataConfig(path=str(prepared), seq_len=512)
    streams = [build_data(cfg, world(r, 2, g, 2), seed=7).train for g in range(2) for r in range(2)]
    n = streams[0].source.num_sequences
    per = n // 4
    seen = [[tuple(x.tolist()) for x in s.next_batch(per)[0]] for s in streams]
    flat = [r for part in seen for r in part]
    assert len(flat) == len(set(flat)) == 4 * per  # disjoint, and together they cover the epoch's first 4*per
    assert [s.epoch for s in streams] == [4 * per / n] * 4  # each node's share of its shard: ~1 epoch read
    # a third node joins (3 x 2) at the position the 2 x 2 layout reached after 10 sequences each
    fresh = [build_data(cfg, world(0, 2, 0, 2), seed=7).train for _ in range(1)][0]
    fresh.next_batch(10)
    state = fresh.state_dict()
    assert state["position"] == 40
    before = {r for part in seen for r in part[:10]}  # what the 4 workers read before the change
    after = []
    for g in range(3):
        for r in range(2):
            s = build_data(cfg, world(r, 2, g, 3), seed=7).train
            s.load_state_dict(state)
            after += [tuple(x.tolist()) for x in s.next_batch(5)[0]]
    assert len(after) == len(set(after)) == 30 and not before & set(after)


def run_prepare_until_killed(procs, corpus: Path, out: Path, *extra: str) -> None:
    """Start a real prepare and SIGKILL it once its journal shows two finished shard groups."""
    proc = procs.start([PYTHON, "-m", "engine.data", "prepare", str(corpus), "--out", str(out), "--quiet",
                        "--workers=1", "--chunk-mb=0.0625", "--shard-tokens=200000", *extra])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if json.loads((out / "prepare.json").read_text())["groups"] >= 2:
                break
        except (OSError, ValueError):  # not written yet, or caught between write and rename
            pass
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    kill_group(proc, signal.SIGKILL)
    assert not (out / "manifest.json").exists()


def test_interrupted_prepare_is_detected_then_resumed_or_restarted(procs, tmp_path, repo_root, capsys):
    corpus = write_corpus(tmp_path / "corpus", copies=8, repo_root=repo_root)  # ~11 MB, ~50 shard groups
    out = tmp_path / "out"
    run_prepare_until_killed(procs, corpus, out)
    with pytest.raises(ValueError, match=r"out is an interrupted prepare \(prepare.json but no manifest.json\); "
                                         r"run `python -m engine.data prepare \.\.\. --out"):
        build_data(DataConfig(path=str(out), seq_len=64), world(), 0)
    restart = tmp_path / "restart"
    shutil.copytree(out, restart)
    # as if killed between a shard's rename and the journal's update: final-looking, but listed nowhere
    (out / "train-00099.bin").write_bytes(b"\0" * 64)
    # resume: the same sources and settings
    assert prepare(corpus, "--out", out, "--chunk-mb=0.0625", "--shard-tokens=200000") == 0
    err = capsys.readouterr().err
    assert "prepare: resuming the interrupted prepare" in err and "starting" not in err, err
    assert not [f for f in out.iterdir() if f.name.endswith((".partial", ".tmp")) or f.name == "prepare.json"]
    clean = tmp_path / "clean"
    assert prepare(corpus, "--out", clean, "--chunk-mb=0.0625", "--shard-tokens=200000") == 0
    resumed, straight = (json.loads((d / "manifest.json").read_text()) for d in (out, clean))
    assert resumed["splits"] == straight["splits"] and len(straight["splits"]["train"]["shards"]) > 10
    listed = {s[k] for sp in resumed["splits"].values() for s in sp["shards"] for k in ("file", "index")}
    assert {f.name for f in out.iterdir()} == listed | {"manifest.json"}
    # other settings over an interrupted prepare: start clean, and say so
    capsys.readouterr()
    assert prepare(corpus, "--out", restart, "--chunk-mb=0.0625", "--shard-tokens=200000",
                   "--eval-percent=10") == 0
    assert "prepare: starting clean" in capsys.readouterr().err
    assert json.loads((restart / "manifest.json").read_text())["eval_percent"] == 10
    # a finished folder: the same inputs are left alone, other inputs refused
    assert prepare(corpus, "--out", out, "--chunk-mb=0.0625", "--shard-tokens=200000") == 0
    assert "nothing to do" in capsys.readouterr().err
    assert prepare(corpus, "--out", out, "--eval-percent=3") == 2
    assert "error: --out: " in capsys.readouterr().err
    assert prepare(corpus, "--out", corpus) == 2
    assert "is not empty and holds no prepared dataset" in capsys.readouterr().err


def test_prepare_train_resume_gives_identical_losses(procs, tmp_path, prepared):
    """8 steps straight through vs. 4 steps, then a new process resuming from the step-4 checkpoint: the data
    position restored from the checkpoint makes steps 5-8 read the same sequences, so the losses agree."""
    common = ["--train.max_steps=8", f"--data.path={prepared}", "--train.eval_interval=4"]
    full = run_engine(procs, tmp_path / "full", *common, "--ckpt.interval=4", "--ckpt.keep=3")
    assert full.rc == 0, full.stderr[-3000:]
    assert full.of("run_start")[0]["dataset"] == "docstrings"
    epochs = [e["epoch"] for e in full.of("step")]
    n = (len(tokens_of(build_data(DataConfig(path=str(prepared), seq_len=64), world(), 0))) - 1) // 64
    assert epochs == pytest.approx([8 * s / n for s in range(1, 9)])  # 8 sequences per step
    step4 = tmp_path / "full" / "checkpoints" / "step-00000004"
    assert json.loads((step4 / "meta.json").read_text())["data"]["position"] == 4 * 8
    resumed = run_engine(procs, tmp_path / "resumed", *common, f"--ckpt.resume={step4}")
    assert resumed.rc == 0, resumed.stderr[-3000:]
    a, b = full.losses(), resumed.losses()
    assert sorted(b) == [5, 6, 7, 8]
    assert all(abs(a[s] - b[s]) < 1e-6 for s in b), (a, b)
    assert [e["epoch"] for e in resumed.of("step")] == epochs[4:]
    # resuming on other data is one error line
    other = run_engine(procs, tmp_path / "other", "--train.max_steps=8", f"--ckpt.resume={step4}",
                       "--data.path=corpus/")
    assert other.rc == 2 and "checkpoint: the data differs from the run that wrote it (it read docstrings)" \
        in other.stderr, other.stderr[-2000:]


def test_a_dead_or_hung_worker_stops_prepare_with_one_line(procs, tmp_path, repo_root):
    """The OOM killer takes a worker, or one hangs: prepare stops with one line instead of waiting forever (as a
    multiprocessing.Pool would), and a rerun resumes."""
    import psutil
    corpus = write_corpus(tmp_path / "corpus", copies=8, repo_root=repo_root)
    out = tmp_path / "out"
    args = [PYTHON, "-m", "engine.data", "prepare", str(corpus), "--out", str(out), "--quiet", "--workers=1",
            "--chunk-mb=0.0625", "--shard-tokens=200000"]

    def groups() -> int:
        try:
            return json.loads((out / "prepare.json").read_text())["groups"]
        except (OSError, ValueError):  # not written yet, or caught between write and rename
            return 0

    # a dead worker is noticed at once (a long timeout proves it); a hung one after --task-timeout
    for sig, message, least, timeout in ((signal.SIGKILL, "a worker process died while tokenizing a chunk of", 1, 90),
                                         (signal.SIGSTOP, "no result for a chunk of", 0, 3)):
        proc = procs.start([*args, f"--task-timeout={timeout}"])
        deadline, start = time.monotonic() + 120, groups()
        while groups() <= start + least - 1 or not psutil.Process(proc.pid).children():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        worker = psutil.Process(proc.pid).children()[0]
        os.kill(worker.pid, sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1 and f"error: prepare: {message}" in err, err
        assert not (out / "manifest.json").exists()
        with pytest.raises(psutil.NoSuchProcess):  # no worker left behind, not even a stopped one
            worker.wait(timeout=10)
            worker.status()
    done = procs.run(args, timeout=120)
    assert done.returncode == 0 and "resuming" in done.stderr, done.stderr
