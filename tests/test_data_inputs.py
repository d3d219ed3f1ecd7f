"""Awkward inputs to the data pipeline: the nodes of a run share the seed that orders the data, raw files and the
folder prepared from them decode the same bytes alike (a lone surrogate escape, a byte-order mark, a Latin-1 byte),
preparing a damaged folder again repairs it, a manifest verify passes is one training opens, and one .txt file
cannot grow a prepare worker's memory without bound."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.config import Config, DataConfig

from engine.digests import digest, mesh_settings, run_digest
from engine.data import TokenStream, build_data
from engine.data.prepare import main as prepare_main
from engine.data.shards import verify
from test_data_prepared import prepare, tiny_tokenizer, tokens_of, world


# ------------------------------------------------------------------------------------------ 1: the seed is run-wide

def test_the_nodes_of_a_run_must_share_the_seed_that_orders_their_data(tmp_path):
    """Node k of a run reads the k-th sequences of one seeded order: two nodes of other seeds read two orders, and
    their shares overlap. The mesh compares the seed; the checkpoint's digest does not (a resume keeps working)."""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(400)))
    cfg = DataConfig(path=str(corpus), seq_len=16, eval_percent=0)
    shares = [build_data(cfg, world(0, 1, node, 2), seed).train for node, seed in ((0, 1337), (1, 7))]
    n = shares[0].source.num_sequences
    read = [{shares[i]._global_index(k * 2 + i) for k in range(n // 2)} for i in range(2)]
    assert read[0] & read[1]  # what the mesh must refuse: the two nodes train on the same sequences

    def config(seed: int) -> Config:
        return Config.model_validate({"data": {"fake": True}, "train": {"seed": seed}, "diloco": {"enabled": True}})
    run, other = config(1337), config(7)
    assert run_digest(other) != run_digest(run) and run_digest(config(7)) == run_digest(other)
    assert digest(other) == digest(run)  # the checkpoint's digest: every existing checkpoint still resumes
    assert run_digest(run) == digest(run)  # at its default the seed leaves the mesh's digest as it was
    from engine.mesh.registration import differences
    value = lambda cfg: f"{run_digest(cfg)}/w1/p5 {json.dumps(mesh_settings(cfg), sort_keys=True)}"  # noqa: E731
    assert differences(value(other), value(run)) == "train.seed = 7 here, 1337 in the run"


def test_a_resume_of_fake_data_with_another_seed_names_the_seed():
    written = build_data(DataConfig(fake=True, seq_len=16), world(), seed=1337).train
    written.next_batch(3)
    resumed = build_data(DataConfig(fake=True, seq_len=16), world(), seed=7).train
    with pytest.raises(ValueError, match=r"^checkpoint: the fake data differs from the run that wrote it: train\.seed "
                                         r"= 7 here, 1337 in the checkpoint"):
        resumed.load_state_dict(written.state_dict())
    with pytest.raises(ValueError, match=r"data\.path, tokenizer, eval_percent or seq_len changed"):  # not the seed
        build_data(DataConfig(fake=True, seq_len=32), world(), seed=1337).train.load_state_dict(written.state_dict())
    same = TokenStream(written.source, 0, 1, seed=1337)
    same.load_state_dict(written.state_dict())
    assert same.consumed == 3


# ------------------------------------------------------------------------------------------ 2, 3: decoding

FILLER = "plain words to make the document long enough " * 3

AWKWARD = {
    # an emoji cut in half by a scrape: JSON accepts the escape, UTF-8 has no form for it
    "lone surrogate": ("x.jsonl", ('{"text": "emoji cut \\ud83d here ' + FILLER + '"}\n').encode(), "cut \ufffd here"),
    "paired surrogates": ("x.jsonl", ('{"text": "whole \\ud83d\\ude00 emoji ' + FILLER + '"}\n').encode(),
                          "whole \U0001F600 emoji"),
    "jsonl byte-order mark": ("x.jsonl", b'\xef\xbb\xbf{"text": "after a BOM ' + FILLER.encode() + b'"}\n',
                              "after a BOM"),
    "jsonl Latin-1 byte": ("x.jsonl", b'{"text": "caf\xe9 au lait ' + FILLER.encode() + b'"}\n', "caf\ufffd au lait"),
    "txt byte-order mark and Latin-1 byte": ("x.txt", b"\xef\xbb\xbfna\xefve text " + FILLER.encode(),
                                             "na\ufffdve text"),
}


@pytest.mark.parametrize("case", list(AWKWARD))
def test_raw_files_and_their_prepared_folder_decode_awkward_bytes_alike(tmp_path, case):
    """Both paths read the same bytes the same way (UTF-8, a BOM dropped, invalid bytes and lone surrogate escapes
    as U+FFFD), so the prepared folder gives the raw stream, the held-out split included."""
    name, blob, expected = AWKWARD[case]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / name).write_bytes(blob)
    (corpus / "more.jsonl").write_text("".join(json.dumps({"text": f"{i} {FILLER}"}) + "\n" for i in range(60)))
    assert prepare(corpus, "--out", tmp_path / "out", "--eval-percent=20") == 0
    raw, prepared = (build_data(DataConfig(path=str(p), seq_len=16, eval_percent=20), world(), 0)
                     for p in (corpus, tmp_path / "out"))
    assert np.array_equal(tokens_of(raw), tokens_of(prepared))
    assert np.array_equal(raw.eval.source.tokens, np.asarray(prepared.eval.source.tokens[0:]))
    both = np.concatenate([tokens_of(raw), raw.eval.source.tokens])
    text = raw.tokenizer.decode(both.tolist())
    assert expected in text and "\ufeff" not in text


def test_a_lone_surrogate_reaches_a_transformers_tokenizer_as_a_replacement_character(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "the quick \\ud83d brown fox"}\n' * 20)
    tok = tiny_tokenizer(tmp_path / "tok", "the quick brown fox")
    cfg = DataConfig(path=str(tmp_path / "c.jsonl"), tokenizer=str(tok), seq_len=4, eval_percent=0)
    data = build_data(cfg, world(), 0)
    unk = data.tokenizer.tok.unk_token_id
    assert tokens_of(data)[:5].tolist() == [data.tokenizer.bos_id, *data.tokenizer.tok.encode("the quick"), unk,
                                            *data.tokenizer.tok.encode("brown")]


# ------------------------------------------------------------------------------------------ 4: prepare again repairs

def small_corpus(folder: Path) -> Path:
    folder.mkdir()
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": f"{i} {FILLER}"}) + "\n" for i in range(300)))
    return folder


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes", "missing index"])
def test_preparing_a_damaged_folder_again_repairs_it(tmp_path, capsys, damage):
    corpus = small_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    args = (corpus, "--out", out, "--shard-tokens=4000", "--chunk-mb=0.005")
    assert prepare(*args) == 0
    good = {f.name: f.read_bytes() for f in out.iterdir() if f.name != "manifest.json"}
    manifest = json.loads((out / "manifest.json").read_text())
    capsys.readouterr()
    assert prepare(*args) == 0 and "nothing to do" in capsys.readouterr().err
    if damage == "truncated":
        with open(out / "train-00001.bin", "r+b") as fh:
            fh.truncate(100)
    elif damage == "same size, other bytes":  # what training reports as a token outside the vocabulary
        (out / "train-00001.bin").write_bytes(b"\xff" * len(good["train-00001.bin"]))
    else:
        (out / "train-00000.idx").unlink()
    assert prepare(*args) == 0
    err = capsys.readouterr().err
    assert f"prepare: preparing {out} again from the start: it is damaged ({out}/train-0000" in err, err
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.name != "manifest.json"} == good
    assert json.loads((out / "manifest.json").read_text())["splits"] == manifest["splits"]
    verify(out)


# ------------------------------------------------------------------------------------------ 5: verify = what trains

@pytest.mark.parametrize("key", ["identity", "name", "eval_percent", "dtype", "tokenizer.vocab_size",
                                 "splits.eval.shards", "splits.train.shards.1.blake2b", "splits.train.shards.0.tokens"])
def test_a_manifest_without_a_key_the_reader_uses_is_one_line_in_verify_and_training(tmp_path, capsys, key):
    corpus = small_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    assert prepare(corpus, "--out", out, "--shard-tokens=4000", "--chunk-mb=0.005") == 0
    manifest = json.loads((out / "manifest.json").read_text())
    *parents, last = key.split(".")
    node = manifest
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    del node[last]
    (out / "manifest.json").write_text(json.dumps(manifest))
    shown = key.replace(".shards.1.", ".shards[1].").replace(".shards.0.", ".shards[0].")
    capsys.readouterr()
    assert prepare_main(["verify", str(out)]) == 2
    assert capsys.readouterr().err == f"error: verify: {out}/manifest.json is corrupt: no '{shown}'\n"
    with pytest.raises(ValueError, match=rf"^data\.path: {out}/manifest\.json is corrupt: no '{shown}'$".replace(
            "[", r"\[").replace("]", r"\]")):
        build_data(DataConfig(path=str(out), seq_len=16), world(), 0)


def test_verify_checksums_the_document_index_where_the_manifest_has_its_checksum(tmp_path, capsys):
    corpus = small_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    assert prepare(corpus, "--out", out, "--shard-tokens=4000", "--chunk-mb=0.005") == 0
    older = tmp_path / "older"  # a folder prepared before the index had a checksum still verifies
    shutil.copytree(out, older)
    manifest = json.loads((older / "manifest.json").read_text())
    for shard in manifest["splits"]["train"]["shards"] + manifest["splits"]["eval"]["shards"]:
        del shard["index_blake2b"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    for folder in (out, older):
        (folder / "train-00001.idx").write_bytes(b"\0" * (folder / "train-00001.idx").stat().st_size)
    verify(older)
    capsys.readouterr()
    assert prepare_main(["verify", str(out)]) == 2
    assert capsys.readouterr().err == f"error: verify: {out}/train-00001.idx is corrupt: its checksum differs " \
                                      f"from {out}/manifest.json\n"


def test_out_naming_a_file_is_one_line(tmp_path, capsys):
    corpus = small_corpus(tmp_path / "corpus")
    (tmp_path / "taken").write_text("not a folder")
    assert prepare(corpus, "--out", tmp_path / "taken") == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out: {tmp_path / 'taken'} is a file, not a folder (name a folder for the prepared dataset)"]


# ------------------------------------------------------------------------------------------ 6: one large .txt

def test_a_txt_file_over_the_limit_is_refused_before_anything_is_written(tmp_path, capsys):
    """A .txt is one document, tokenized whole by one worker at ~12x its size: past --max-text-mb prepare stops
    with one line saying how to split it, and writes nothing. One at the limit prepares."""
    big = tmp_path / "big.txt"
    big.write_bytes(b"a line of text\n" * (3 * (1 << 20) // 15))  # 3 MiB
    out = tmp_path / "out"
    assert prepare(big, "--out", out, "--max-text-mb=2") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: prepare: {big} holds 3.0 MiB, over --max-text-mb 2 (a .txt/.md file is one "
                          f"document") and "split -C 32M --additional-suffix=.txt FILE PREFIX" in err, err
    assert not out.exists()
    assert prepare(big, "--out", out, "--max-text-mb=3") == 0
    from engine.data.prepare import parse_args
    assert parse_args(["prepare", "x", "--out", "y"]).max_text_bytes == 32 << 20  # the documented default


# ------------------------------------------------------------------------------------------ issue 41: binary input

def _binary_refused(tmp_path, capsys, corpus: Path, fragment: str) -> str:
    """Training on the raw files and preparing them both refuse, in one line naming the file, writing nothing."""
    with pytest.raises(ValueError) as e:
        build_data(DataConfig(path=str(corpus), seq_len=16, eval_percent=0), world(), 0)
    head = f"data.path: {corpus} is not text: "
    assert str(e.value).startswith(head + fragment), str(e.value)
    capsys.readouterr()
    out = tmp_path / "out"
    assert prepare_main(["prepare", str(corpus), "--out", str(out), "--workers=0", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: prepare: {corpus} is not text: {str(e.value)[len(head):]}"], err
    assert not out.exists()
    return str(e.value)


def test_random_bytes_named_txt_are_refused_in_training_and_in_prepare(tmp_path, capsys):
    """Defect: a file of random bytes named .txt trained and prepared without a word."""
    rng = np.random.default_rng(0)
    noise = tmp_path / "noise.txt"
    blob = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    noise.write_bytes(blob)
    _binary_refused(tmp_path, capsys, noise, f"a NUL byte at byte {blob.index(0)} (binary, or UTF-16")
    nonul = tmp_path / "nonul.txt"  # the same noise without its NUL bytes: the share of what is not text
    nonul.write_bytes(blob.replace(b"\0", b""))
    line = _binary_refused(tmp_path, capsys, nonul, "")
    assert line.endswith("characters are invalid UTF-8 or control characters (over 10%; a .txt/.md file is read "
                         "as UTF-8 text)"), line
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text("plain words " * 50, encoding="utf-16")
    _binary_refused(tmp_path, capsys, utf16, "a NUL byte at byte 3 (binary, or UTF-16: a .txt/.md file is read as "
                                             "UTF-8)")


@pytest.mark.parametrize("blob, refused", [
    ((b"a" * 9 + b"\xe9") * 10, False),  # 10 invalid bytes of 100 characters: a tenth, still text (Latin-1)
    (b"\xe9" * 11 + b"a" * 89, True),  # 11 of 100: over a tenth
    (b"\x01" * 10 + b"a" * 90, False),  # control characters count alike
    (b"\x01" * 11 + b"a" * 89, True),
    (b"\t\n\r\f\v" * 20, False),  # the whitespace controls are text
    (b"a" * 8191 + b"\0", True),  # a NUL in the first 8 KiB
    (b"a" * 8192 + b"\0", False),  # past it: not looked at
    ("\u00e9".encode() * 4095 + b"a\xc3\xa9", False),  # a character cut at the sniffed 8 KiB is not invalid
])
def test_the_binary_rule_on_both_sides_of_its_thresholds(tmp_path, blob, refused):
    from engine.data.documents import check_text
    path = tmp_path / "x.txt"
    path.write_bytes(blob)
    if refused:
        with pytest.raises(ValueError, match=rf"^data\.path: {path} is not text: "):
            check_text(path, "data.path")
    else:
        check_text(path, "data.path")
