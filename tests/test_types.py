"""The type checker in the test command: `python -m mypy` over what pyproject.toml's [tool.mypy] names (console/ and
engine/outer/) finds no error. A wrong call across the app's seam to the cluster (console/control.py), a part that does
not fit the outer step's seams (engine/outer/) or a `None` used as a value fails the suite here, before any screen is
drawn."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600  # a cold run (no .mypy_cache) took ~60 s on a loaded 2-core machine


def mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def have_mypy() -> None:
    if subprocess.run([sys.executable, "-c", "import mypy"], capture_output=True).returncode != 0:
        pytest.fail(f"mypy is not installed in {sys.prefix}: it is in the dev extra and requirements.lock "
                    f"(scripts/setup.sh installs it)")


def test_the_console_type_checks(have_mypy):
    done = mypy()
    assert done.returncode == 0, f"mypy found errors:\n{done.stdout}{done.stderr}"
    assert "no issues found" in done.stdout


def test_the_checker_sees_a_wrong_call_across_the_seam(have_mypy, tmp_path):
    """The oracle: a cluster whose drain takes no node is not a ClusterControl, and mypy with the project's
    settings says so (an app built on it would fail at the first `d`)."""
    bad = tmp_path / "bad_cluster.py"
    bad.write_text(
        "from console.app import make_app\n"
        "from console.fleet import Fleet\n"
        "from console.control import Answer\n"
        "class Bad:\n"
        "    fleet = Fleet(run='r')\n"
        "    async def start(self) -> None: ...\n"
        "    async def attach(self, *, steer_store: bool = True) -> None: ...\n"
        "    def nothing_runs(self) -> str | None: ...\n"
        "    def running(self) -> list[str]: ...\n"
        "    async def stop(self) -> Answer: ...\n"
        "    async def close(self) -> None: ...\n"
        "    async def add(self, target: str) -> Answer: ...\n"
        "    async def drain(self) -> Answer: ...\n"
        "    async def kill(self, name: str) -> Answer: ...\n"
        "    async def restart(self, name: str) -> Answer: ...\n"
        "make_app(None, Bad())\n")
    # no cache (/dev/null: mypy writes none): the suite's other mypy run may be writing the shared one now
    done = mypy("--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", "/dev/null", str(bad))
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'Argument 2 to "make_app" has incompatible type "Bad"' in done.stdout, done.stdout
    assert "drain" in done.stdout, done.stdout


def test_no_type_ignore_in_the_console():
    """The types are fixed, not silenced: a `# type: ignore` would hide what the check above is for."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "console").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "type: ignore" in line]
    assert found == []


def test_the_checker_sees_a_codec_that_does_not_fit_the_outer_steps_seam(have_mypy, tmp_path):
    """engine/outer is checked too (pyproject.toml): a codec without abort() given to the outer loop's seam is not a
    Codec, and mypy says so (the outer step would call it after the first aborted attempt)."""
    bad = tmp_path / "bad_codec.py"
    bad.write_text(
        "from typing import Any\n"
        "import torch\n"
        "from engine.outer.diloco import DilocoOuter\n"
        "from engine.outer.allreduce import Exchange\n"
        "class Bad:\n"
        "    name = 'bad'\n"
        "    gathers = False\n"
        "    def prepare(self, exchange: Exchange, numel: int, size: int) -> None: ...\n"
        "    def stage(self, pgrad: torch.Tensor | None, outer_step: int, attempt: int) -> bool: ...\n"
        "    def commit(self) -> None: ...\n"
        "    def reject(self, pgrad: torch.Tensor) -> None: ...\n"
        "    def reset(self) -> None: ...\n"
        "    def unsent(self, pgrad: torch.Tensor | None, outer_step: int) -> None: ...\n"
        "    def state_dict(self) -> dict[str, Any]: ...\n"
        "    def load_state_dict(self, state: dict[str, Any]) -> None: ...\n"
        "def build(cfg: Any) -> DilocoOuter:\n"
        "    return DilocoOuter(cfg, cfg, cfg, cfg, cfg, config_digest='d', codec=Bad())\n")
    done = mypy("--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", "/dev/null", str(bad))
    assert done.returncode == 1, done.stdout + done.stderr
    assert 'Argument "codec" to "DilocoOuter" has incompatible type "Bad"' in done.stdout, done.stdout
    assert "abort" in done.stdout, done.stdout


def test_no_type_ignore_in_the_outer_loop():
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "engine" / "outer").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "type: ignore" in line]
    assert found == []
