"""The environment the engine reads (engine/world.py, engine/config.py): a mistake is one error line, and every
variable it reads does something."""

from __future__ import annotations

import io
import sys

import pytest

from engine.config import ConfigError
from engine.config_env import env_overrides
from engine.train import make_telemetry
from engine.world import read_world
from procs import engine_env


def test_a_mistyped_global_variable_is_one_error_naming_it():
    """Defect: GLOBAL_ADRR was silently ignored, and the node dialled the default store."""
    assert env_overrides({"GLOBAL_ADDR": "10.0.0.1", "GLOBAL_RANK": "1", "GLOBAL_WORLD_SIZE": "3"}) == {
        "mesh.store_addr": "10.0.0.1"}
    with pytest.raises(ConfigError, match=r"^environment: unknown variable GLOBAL_ADRR \(did you mean GLOBAL_ADDR\? "
                                          r"known: GLOBAL_ADDR"):
        env_overrides({"GLOBAL_ADRR": "10.0.0.1"})


def test_a_bad_rank_is_one_line_and_exit_2(procs):
    """Defect: a bad RANK printed a traceback before main() could turn it into one line."""
    done = procs.run([sys.executable, "-m", "engine.train", "configs/debug.toml"],
                     env=engine_env(RANK="5", WORLD_SIZE="2"), timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: environment: RANK=5 is outside WORLD_SIZE=2"]


def test_log_level_decides_which_progress_lines_reach_stderr(monkeypatch):
    """Defect: ZERO_BAND_LOG_LEVEL was read and never used. The JSON events on stdout are never filtered."""
    def lines(level: str) -> tuple[str, str]:
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        telemetry = make_telemetry(None, read_world({"ZERO_BAND_LOG_LEVEL": level}))
        telemetry._json_out = out
        telemetry.emit("step", step=3, loss=2.5, lr=1e-3, tokens_per_s=100.0, grad_norm=None)
        telemetry.emit("warning", message="disk almost full")
        return out.getvalue(), err.getvalue()

    out, err = lines("info")
    assert out.count("\n") == 2 and "step      3" in err and "WARNING: disk almost full" in err
    out, err = lines("WARNING")
    assert out.count("\n") == 2 and "step" not in err and "WARNING: disk almost full" in err
    out, err = lines("ERROR")
    assert out.count("\n") == 2 and err == ""
    with pytest.raises(ValueError, match=r"ZERO_BAND_LOG_LEVEL='loud' is not one of DEBUG, INFO, WARNING, ERROR"):
        read_world({"ZERO_BAND_LOG_LEVEL": "loud"})
