"""Bad inputs of issue 24, as a new user meets them: each is one line naming the problem and where (the file and key,
the environment variable, the folder), a non-zero exit, and nothing of the user's changed before the check.

Most run main() in-process (the CLI's code path minus interpreter start-up); the torchrun case and the config error's
"only one line" run real processes, since what a person sees there is the launcher's and the interpreter's too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import ConfigError, load_config
from procs import PYTHON, ROOT

ENGINE = [PYTHON, "-m", "engine.train", "configs/debug.toml"]
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "engine.train",
            "configs/debug.toml"]
SMALL = ["--data.seq_len=64", "--train.micro_batch_size=4", "--train.batch_size=8", "--train.eval_interval=0",
         "--optim.warmup_steps=2"]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def run_main(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    from engine.train import main
    monkeypatch.chdir(ROOT)
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def old_run(run_dir: Path) -> Path:
    """A checkpoints folder as an earlier run leaves it (a fresh run moves it to _archive/)."""
    step = run_dir / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text('{"step": 4}')
    (run_dir / "checkpoints" / "latest").write_text("step-00000004\n")
    return run_dir / "checkpoints"


# ---------------------------------------------------------------------------------------------- item 3

@pytest.mark.parametrize("variable, value, key", [
    ("GLOBAL_PORT", "abc", "mesh.store_port"),
    ("ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS", "abc", "mesh.heartbeat_timeout"),
    ("ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS", "-1", "mesh.store_timeout"),
])
def test_a_bad_environment_value_names_the_variable_not_the_file(variable, value, key):
    """Defect: `GLOBAL_PORT=abc` was reported as `configs/debug.toml: mesh.store_port: ...`."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "debug.toml", [], environ={variable: value})
    assert str(e.value).startswith(f"environment: {variable}={value!r}: {key}: "), str(e.value)
    assert "debug.toml" not in str(e.value)


def test_a_cross_rule_broken_by_the_environment_names_the_variable():
    with pytest.raises(ConfigError, match=r"heartbeat_timeout must exceed twice heartbeat_interval \(mesh\."
                                          r"heartbeat_timeout from ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS='1'\)"):
        load_config(ROOT / "configs" / "debug.toml", [], environ={"ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS": "1"})


def test_a_bad_command_line_value_names_the_command_line():
    with pytest.raises(ConfigError, match=r"^command line: train\.max_steps: Input should be a valid integer.* "
                                          r"\(--train\.max_steps=many\)$"):
        load_config(ROOT / "configs" / "debug.toml", ["--train.max_steps=many"])


# ---------------------------------------------------------------------------------------------- item 5

@pytest.mark.parametrize("content", ["", "\n\n", '{"text": ""}\n{"text": "   "}\n'])
def test_prepare_of_a_corpus_without_text_is_an_error_naming_it(tmp_path, capsys, content):
    """Defect: `prepare empty.jsonl --out DIR` exited 0 with "0 train + 0 eval tokens"."""
    from engine.data.prepare import main as prepare_main
    source = tmp_path / "empty.jsonl"
    source.write_text(content)
    code = prepare_main(["prepare", str(source), "--out", str(tmp_path / "out"), "--workers=0", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and error_lines(err) == [f"error: prepare: {source} holds no text to train on (no "
                                              f"document with text)"], err
    assert not (tmp_path / "out").exists()


def test_prepare_where_every_document_is_held_out_says_so(tmp_path, capsys):
    from engine.data.prepare import main as prepare_main
    source = tmp_path / "one.txt"
    source.write_text("a single short document")
    code = prepare_main(["prepare", str(source), "--out", str(tmp_path / "out"), "--workers=0", "--quiet",
                         "--eval-percent=99.99"])
    err = capsys.readouterr().err
    assert code == 2 and error_lines(err) == [f"error: prepare: {source} holds no text to train on (all 1 document(s) "
                                              f"went to the held-out split: lower --eval-percent)"], err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- item 8

@pytest.mark.parametrize("files", [[], ["config.json"], ["tokenizer_config.json"]])
def test_a_tokenizer_folder_without_a_tokenizer_is_one_line_naming_what_is_missing(tmp_path, files):
    """Defect: a multi-line sentencepiece/tiktoken message from transformers."""
    from engine.data import load_tokenizer
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(folder))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"data.tokenizer: {folder} holds no tokenizer (no tokenizer.json"), message


def test_a_tokenizer_that_fails_to_load_is_one_line(tmp_path):
    from engine.data import load_tokenizer
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(folder))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"data.tokenizer: cannot load a tokenizer from {folder}"), message


@pytest.mark.parametrize("state, message", [
    ("missing", "does not exist"),
    ("empty", "is not a prepared folder (no manifest.json; write one with `python -m engine.data prepare"),
    ("other", "is not a prepared folder (no manifest.json; write one with `python -m engine.data prepare"),
])
def test_verify_of_a_folder_that_is_not_prepared_says_so(tmp_path, capsys, state, message):
    """Defect: verify of an empty or missing folder spoke of an "interrupted prepare"."""
    from engine.data.prepare import main as prepare_main
    folder = tmp_path / "data"
    if state != "missing":
        folder.mkdir()
    if state == "other":
        (folder / "notes.txt").write_text("x")
    code = prepare_main(["verify", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"error: verify: {folder} {message}"), err


def test_store_on_an_address_this_machine_does_not_have_says_so(capsys):
    """Defect: binding 192.0.2.1 (TEST-NET, never a local address) suggested choosing another port."""
    from engine.store.server import main as store_main
    assert store_main(["--host", "192.0.2.1", "--port", "29999"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["engine.store: cannot listen on 192.0.2.1:29999: 192.0.2.1 is not an address of this "
                                "machine (--host: the address of one of its interfaces that the engines dial)"], err


def test_store_on_an_unknown_host_name_says_so(capsys):
    from engine.store.server import main as store_main
    assert store_main(["--host", "no-such-host.invalid", "--port", "29999"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "no-such-host.invalid is not a known host name" in err, err
    assert "another --port" not in err


# ---------------------------------------------------------------------------------------------- item 18

@pytest.mark.parametrize("override, suggestion", [
    ("--optim.lrr=1", "did you mean optim.lr?"),
    ("--optimm.lr=1", "did you mean optim.lr?"),
    ("--train.max_step=3", "did you mean train.max_steps?"),
])
def test_an_unknown_key_gets_a_suggestion(override, suggestion):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "debug.toml", [override])
    assert str(e.value).endswith(f"unknown key ({suggestion})"), str(e.value)


def test_an_unknown_key_in_the_file_names_the_file_and_suggests(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[data]\nfake = true\n[train]\nmicro_batch = 4\n")
    with pytest.raises(ConfigError, match=r"^.*c\.toml: train\.micro_batch: unknown key \(did you mean "
                                          r"train\.micro_batch_size\?\)$"):
        load_config(path)


def test_an_unknown_variable_gets_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown variable GLOBAL_ADRR \(did you mean GLOBAL_ADDR\?"):
        load_config(ROOT / "configs" / "debug.toml", [], environ={"GLOBAL_ADRR": "10.0.0.1"})
