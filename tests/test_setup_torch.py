"""scripts/setup.sh installs the CPU build of torch where there is no NVIDIA driver, whatever pip is offered (issue
24, item 12).

Defect: it pinned `torch==2.13.0` only. That is the CPU build on this machine because a local wheel folder holds
`torch-2.13.0+cpu`; on a machine without it, pip takes PyPI's 2.13.0, the CUDA build with GBs of nvidia-* wheels.
Now the spec names the CPU build (`+cpu`), asked first of whatever pip is configured with (this machine's local
wheels), then of the PyTorch CPU index.

setup.sh runs against stubs: a venv whose python records each call (pip answers as the stub is told), `dpkg-query`
that has every package installed, `nvidia-smi` that finds no GPU. Nothing is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STUB_PYTHON = """#!{python}
import json, os, sys
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
if args[:1] == ["-c"] and "importlib.metadata" in args[1]:  # is the installed torch the CPU build?
    sys.exit(0 if os.environ.get("STUB_TORCH", "").endswith("+cpu") else 1)
if args[:2] == ["-m", "pip"] and "--index-url" not in args and any(a.startswith("torch") for a in args):
    if os.environ["STUB_LOCAL_CPU_WHEEL"] != "1":
        print("ERROR: No matching distribution found for " + args[-1], file=sys.stderr)
        sys.exit(1)
"""


def _setup(tmp_path: Path, local_wheel: bool, gpu: bool = False, stamped: bool = False,
           **extra: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    venv, bin_dir, log = tmp_path / "venv", tmp_path / "bin", tmp_path / "calls.jsonl"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    python = venv / "bin" / "python"
    python.write_text(STUB_PYTHON.format(python=sys.executable))
    for path, text in ((python, None), (bin_dir / "dpkg-query", "#!/bin/sh\nprintf installed\n"),
                       (bin_dir / "nvidia-smi", f"#!/bin/sh\nexit {0 if gpu else 9}\n")):
        if text is not None:
            path.write_text(text)
        path.chmod(0o755)
    if stamped:  # set up from this pyproject.toml and setup.sh, as far as the stamp knows
        want = subprocess.run("sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16", shell=True,
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
        (venv / ".zeroband-setup").write_text(want + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("BASE_SITE", "TORCH_SPEC", "TORCH_CPU_INDEX", "FORCE",
                                                             "TORCH_VERSION")}
    env.update({"VENV": str(venv), "PATH": f"{bin_dir}:{env['PATH']}", "STUB_LOG": str(log),
                "STUB_LOCAL_CPU_WHEEL": "1" if local_wheel else "0", **extra})
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, [c for c in calls if c[:3] == ["-m", "pip", "install"]]


@pytest.mark.parametrize("local_wheel", [True, False], ids=["local-cpu-wheel", "pypi-only"])
def test_setup_installs_the_cpu_build_without_a_gpu(tmp_path, local_wheel):
    done, installs = _setup(tmp_path, local_wheel)
    assert done.returncode == 0, done.stderr
    torch = [c for c in installs if any(a.startswith("torch") for a in c)]
    assert all(c[-1] == "torch==2.13.0+cpu" for c in torch), torch  # never PyPI's plain (CUDA) 2.13.0
    if local_wheel:  # this machine: its local wheel folder has it; no index is named
        assert len(torch) == 1 and "--index-url" not in torch[0]
    else:
        assert len(torch) == 2 and torch[1][torch[1].index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
        assert "trying the PyTorch CPU index" in done.stderr and "No matching distribution" not in done.stderr
    assert installs[-1][-2:] == ["-e", ".[dev,deepspeed]"]  # then the project


def test_what_sync_runs_installs_the_consoles_torch_over_a_current_stamp_into_a_venv_under_home(tmp_path):
    """console/sync.py runs setup.sh with FORCE=1 (it found a package missing, which the stamp alone does not see),
    TORCH_VERSION (the console's: PyPI's build of it, the CUDA one, where a driver answers) and the profile's venv,
    which may be under ~ (the host user's home, as the check reads it)."""
    done, installs = _setup(tmp_path, local_wheel=True, stamped=True)
    assert done.returncode == 0 and installs == [], installs  # current by its stamp: nothing to do
    for name in ("venv", "bin", "calls.jsonl"):
        subprocess.run(["rm", "-rf", str(tmp_path / name)], check=True)
    done, installs = _setup(tmp_path, local_wheel=True, gpu=True, stamped=True, FORCE="1", TORCH_VERSION="2.9.1",
                            VENV="~/venv", HOME=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert [c[-1] for c in installs] == ["torch==2.9.1", ".[dev,deepspeed]"], installs
    assert not (ROOT / "~").exists()
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert not [c for c in calls if c[:3] == ["-m", "pip", "uninstall"]]  # no CPU build to replace
    # a GPU host whose venv has the CPU build: pip took it for torch==2.13.0 (its local label matches); it goes
    for name in ("venv", "bin", "calls.jsonl"):
        subprocess.run(["rm", "-rf", str(tmp_path / name)], check=True)
    done, installs = _setup(tmp_path, local_wheel=True, gpu=True, FORCE="1", STUB_TORCH="2.13.0+cpu")
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert done.returncode == 0 and ["-m", "pip", "uninstall", "-y", "-q", "torch"] in calls, calls
    assert calls.index(["-m", "pip", "uninstall", "-y", "-q", "torch"]) < calls.index(installs[0])
