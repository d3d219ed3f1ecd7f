"""The type checker in the test command: `python -m mypy` over what pyproject.toml's [tool.mypy] names (console/ and
engine/outer/) finds no error. A wrong call across the app's seam to the cluster (console/control.py), a part that does
not fit the outer step's seams (engine/outer/) or a `None` used as a value fails the suite here, before any screen is
drawn.

mypy runs once for the whole module (about 35 s cold on 2 cores; three runs took 75 s): over pyproject.toml's files
and the two planted files of the oracle tests below, each error line then judged by the file it names. Under
pytest-xdist the first worker to ask runs it and the others read its answer (a lock beside the workers' temp folders),
so a module split over two workers still runs it once."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600  # a cold run (no .mypy_cache) took ~60 s on a loaded 2-core machine

# The oracles: a cluster whose drain takes no node is not a ClusterControl (an app built on it would fail at the first
# `d`); a codec without abort() given to the outer loop's seam is not a Codec (the outer step would call it after the
# first aborted attempt).
PLANTED = {
    "bad_cluster.py": (
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
        "make_app(None, Bad())\n"),
    "bad_codec.py": (
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
        "    return DilocoOuter(cfg, cfg, cfg, cfg, cfg, config_digest='d', codec=Bad())\n"),
}


def run_mypy(folder: Path) -> dict:
    """One mypy run (the project's settings) over pyproject.toml's files and the planted files, written to folder:
    its exit status, its last line, and its lines by the file they name ("project" for every file not planted)."""
    for name, text in PLANTED.items():
        (folder / name).write_text(text)
    files = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *files,
                           *(str(folder / name) for name in PLANTED)], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    lines: dict[str, list[str]] = {"project": [], **{name: [] for name in PLANTED}}
    out = done.stdout.strip().splitlines()
    for line in out[:-1]:  # the last line is the summary
        # by the file's name: mypy's cache may replay a planted file's errors under the folder of an earlier run
        path = Path(line.split(":", 1)[0])
        named = path.name if path.is_absolute() and path.name in PLANTED else "project"
        lines[named].append(line)
    return {"returncode": done.returncode, "summary": out[-1] if out else "", "lines": lines,
            "stderr": done.stderr}


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> dict:
    if subprocess.run([sys.executable, "-c", "import mypy"], capture_output=True).returncode != 0:
        pytest.fail(f"mypy is not installed in {sys.prefix}: it is in the dev extra and requirements.lock "
                    f"(scripts/setup.sh installs it)")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return run_mypy(tmp_path_factory.mktemp("mypy"))
    shared = tmp_path_factory.getbasetemp().parent  # this session's workers share it (pytest-xdist's own advice)
    answer = shared / "mypy.json"
    with open(shared / "mypy.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this worker fails
        if not answer.is_file():
            answer.write_text(json.dumps(run_mypy(tmp_path_factory.mktemp("mypy"))))
        return json.loads(answer.read_text())


def test_the_console_type_checks(checked):
    """No error in a file pyproject.toml names: the only files mypy finds errors in are the two planted ones."""
    said = "\n".join([*checked["lines"]["project"], checked["summary"], checked["stderr"]])
    assert checked["lines"]["project"] == [], f"mypy found errors:\n{said}"
    assert checked["returncode"] == 1 and checked["summary"].startswith("Found ") \
        and f" errors in {len(PLANTED)} files " in checked["summary"], said


def test_the_checker_sees_a_wrong_call_across_the_seam(checked):
    """The oracle: a cluster whose drain takes no node is not a ClusterControl, and mypy with the project's
    settings says so (an app built on it would fail at the first `d`)."""
    said = "\n".join(checked["lines"]["bad_cluster.py"])
    assert 'Argument 2 to "make_app" has incompatible type "Bad"' in said, said
    assert "drain" in said, said


def test_no_type_ignore_in_the_console():
    """The types are fixed, not silenced: a `# type: ignore` would hide what the check above is for."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "console").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "type: ignore" in line]
    assert found == []


def test_the_checker_sees_a_codec_that_does_not_fit_the_outer_steps_seam(checked):
    """engine/outer is checked too (pyproject.toml): a codec without abort() given to the outer loop's seam is not a
    Codec, and mypy says so (the outer step would call it after the first aborted attempt)."""
    said = "\n".join(checked["lines"]["bad_codec.py"])
    assert 'Argument "codec" to "DilocoOuter" has incompatible type "Bad"' in said, said
    assert "abort" in said, said


def test_no_type_ignore_in_the_outer_loop():
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "engine" / "outer").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "type: ignore" in line]
    assert found == []
