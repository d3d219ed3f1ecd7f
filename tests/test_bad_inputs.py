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
