"""scripts/setup.sh installs the CPU build of torch where there is no NVIDIA driver, whatever pip is offered (issue
24, item 12), and everything else at the versions of requirements.lock (issue 41, item 2).

Defect: it pinned `torch==2.13.0` only. That is the CPU build on this machine because a local wheel folder holds
`torch-2.13.0+cpu`; on a machine without it, pip takes PyPI's 2.13.0, the CUDA build with GBs of nvidia-* wheels.
Now the spec names the CPU build (`+cpu`), asked first of whatever pip is configured with (this machine's local
wheels), then of the PyTorch CPU index.

setup.sh runs against stubs: a venv whose python records each call (pip answers as the stub is told), `dpkg-query`
that has every package installed, `nvidia-smi` that finds no GPU. Nothing is installed.

The lock: every line `name==version`, the project's requirements all in it (torch not), passed to pip with -c, and
covered by the venv's set-up stamp, which is the digest sync compares (console/preflight/host_script.py's setup_digest):
a changed lock makes setup.sh install again and sync take a host's venv for stale.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from console.preflight.host_script import setup_digest

ROOT = Path(__file__).resolve().parent.parent
LOCK = "requirements.lock"

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


def _setup(tmp_path: Path, local_wheel: bool, gpu: bool = False, stamped: bool = False, root: Path = ROOT,
           **extra: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """setup.sh of root (this checkout, or a copy of its set-up files) against the stubs in tmp_path."""
    venv, bin_dir, log = tmp_path / "venv", tmp_path / "bin", tmp_path / "calls.jsonl"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(STUB_PYTHON.format(python=sys.executable))
    for path, text in ((python, None), (bin_dir / "dpkg-query", "#!/bin/sh\nprintf installed\n"),
                       (bin_dir / "nvidia-smi", f"#!/bin/sh\nexit {0 if gpu else 9}\n")):
        if text is not None:
            path.write_text(text)
        path.chmod(0o755)
    if stamped:  # set up from this pyproject.toml, lock and setup.sh, as far as the stamp knows
        (venv / ".zeroband-setup").write_text(setup_digest(str(root)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("BASE_SITE", "TORCH_SPEC", "TORCH_CPU_INDEX", "FORCE",
                                                             "TORCH_VERSION")}
    env.update({"VENV": str(venv), "PATH": f"{bin_dir}:{env['PATH']}", "STUB_LOG": str(log),
                "STUB_LOCAL_CPU_WHEEL": "1" if local_wheel else "0", **extra})
    done = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], capture_output=True, text=True, env=env,
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
    assert installs[-1][-4:] == ["-c", LOCK, "-e", ".[dev,deepspeed]"]  # then the project, at the lock's versions


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


# ---- the lock ---------------------------------------------------------------------------------------------------
def _pins(text: str) -> dict[str, str]:
    """requirements.lock's pins by canonical name; every line a comment or exactly `name==version`."""
    pins: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier  # one specifier, and it is ==, of a whole version: nothing for pip to choose
        assert spec.operator == "==" and "*" not in spec.version and not req.marker and not req.extras, \
            f"{LOCK}:{number}: {line!r} is not name==version"
        assert str(req) == line, f"{LOCK}:{number}: {line!r}"
        assert canonicalize_name(req.name) not in pins, f"{LOCK}:{number}: {req.name} twice"
        pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_the_lock_pins_every_requirement_of_the_project_but_torch():
    import tomllib

    text = (ROOT / LOCK).read_text()
    pins = _pins(text)
    assert len(pins) > 50  # the project's dependencies, its extras' (dev, deepspeed) and theirs
    assert {"cryptography", "asyncssh", "textual", "pytest", "deepspeed"} <= pins.keys()
    assert "torch" not in pins and not [name for name in pins if name.startswith(("nvidia-cu", "triton"))], \
        "setup.sh picks torch by the host's driver: the lock must not"
    assert "torch is not here: setup.sh picks it" in " ".join(text.split())  # the header says why
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for line in project["dependencies"] + extras["dev"] + extras["deepspeed"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in pins, f"pyproject.toml asks for {line} but {LOCK} has no {req.name}: run scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"pyproject.toml asks for {line} but {LOCK} pins {req.name}=={pins[name]}: run scripts/lock.sh"


def test_the_lock_reader_refuses_what_is_not_a_pin():
    """_pins is the oracle of the test above: both sides of it."""
    assert _pins("# header\n\ncryptography==51.0.1\nasyncssh==2.24.1\n") == {
        "cryptography": "51.0.1", "asyncssh": "2.24.1"}
    for bad in ("cryptography>=42", "cryptography", "cryptography==51.*", "cryptography==51.0.1; python_version>'3'",
                "cryptography==51.0.1\nCryptography==50.0.0"):
        with pytest.raises((AssertionError, ValueError)):
            _pins(bad)


def _setup_files(root: Path) -> Path:
    """A copy of what setup.sh reads (the project's root for it): pyproject.toml, the lock, setup.sh."""
    (root / "scripts").mkdir(parents=True)
    for rel in ("pyproject.toml", LOCK, "scripts/setup.sh"):
        (root / rel).write_bytes((ROOT / rel).read_bytes())
    return root


def _bump(lock: Path) -> None:
    """The lock as scripts/lock.sh would rewrite it after a release: one version changed."""
    text = lock.read_text()
    assert "\ncryptography==" in text
    lock.write_text(re.sub(r"(?m)^cryptography==.*$", "cryptography==99.0.0", text))


def test_a_changed_lock_sets_up_again_and_its_stamp_is_the_one_sync_compares(tmp_path):
    root = _setup_files(tmp_path / "checkout")
    stamp = tmp_path / "venv" / ".zeroband-setup"
    done, installs = _setup(tmp_path, local_wheel=True, root=root)
    assert done.returncode == 0, done.stderr
    assert installs[-1][-4:] == ["-c", LOCK, "-e", ".[dev,deepspeed]"]
    first = stamp.read_text().strip()
    assert first == setup_digest(str(root))  # what sync's probe wants for this workdir
    (tmp_path / "calls.jsonl").unlink()
    done, installs = _setup(tmp_path, local_wheel=True, root=root)
    assert done.returncode == 0 and installs == [], installs  # the same lock: current, nothing installed
    _bump(root / LOCK)
    done, installs = _setup(tmp_path, local_wheel=True, root=root)
    assert done.returncode == 0, done.stderr
    assert installs and installs[-1][-4:] == ["-c", LOCK, "-e", ".[dev,deepspeed]"], installs  # installed again
    second = stamp.read_text().strip()
    assert second != first and second == setup_digest(str(root))


def test_setup_without_the_lock_is_one_line_and_touches_nothing(tmp_path):
    root = _setup_files(tmp_path / "checkout")
    (root / LOCK).unlink()
    done, installs = _setup(tmp_path, local_wheel=True, root=root)
    assert done.returncode == 1 and installs == []
    assert done.stderr.strip() == (f"[setup] {root}/{LOCK} is missing or empty: restore it (git checkout -- {LOCK}) "
                                   "or make it with scripts/lock.sh")
    assert not (tmp_path / "calls.jsonl").exists()  # not even the corpus step ran
    assert setup_digest(str(root)) is None  # and sync takes such a workdir's venv for stale: it runs setup, which says


async def test_sync_takes_a_venv_set_up_from_another_lock_for_stale(tmp_path):
    """sync decides from the probe's stamp_want (setup_digest of the host's workdir, after the files are sent)."""
    from console.profile import HostSpec
    from console.sync import _setup_due
    from console.transport import make_transport

    work = _setup_files(tmp_path / "work")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # this python's packages
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".zeroband-setup").write_text(setup_digest(str(work)) + "\n")  # as setup.sh writes it (test above)
    host = HostSpec(name="h", transport="local", workdir=str(work), venv=str(venv))
    t = make_transport(host)
    try:
        current = await _setup_due(t, host)
        _bump(work / LOCK)
        stale = await _setup_due(t, host)
    finally:
        await t.close()
    assert current is None
    assert stale == "was set up from another pyproject.toml, requirements.lock or setup.sh"


def test_lock_sh_writes_what_a_venv_has_with_its_header_and_without_torch(tmp_path):
    """scripts/lock.sh --from VENV: the walk and the writing of the lock (the resolving run, `scripts/lock.sh`
    alone, downloads for minutes: docs/operations.md). Here: this test's own venv, into a copy of the checkout."""
    import importlib.metadata as md

    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for rel in ("pyproject.toml", "scripts/lock.sh"):
        (root / rel).write_bytes((ROOT / rel).read_bytes())
    (root / "scripts" / "lock.sh").chmod(0o755)
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    done = subprocess.run([str(root / "scripts" / "lock.sh"), "--from", sys.prefix], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert list(temp.iterdir()) == []  # its temporary folder is gone
    text = (root / LOCK).read_text()
    header = " ".join(line for line in text.splitlines() if line.startswith("#"))
    assert re.search(r"Made \d{4}-\d\d-\d\d \d\d:\d\d UTC with Python "
                     + re.escape(".".join(map(str, sys.version_info[:3]))), header), header
    assert f"by: scripts/lock.sh --from {sys.prefix}" in header and "torch is not here: setup.sh picks it" in header
    pins = _pins(text)
    assert {"cryptography", "asyncssh", "textual", "pytest", "deepspeed"} <= pins.keys()
    assert not {"torch", "sympy", "networkx", "pip", "setuptools", "zeroband-console"} & pins.keys()
    assert all(md.version(name) == version for name, version in pins.items())  # what this venv has
    assert "left out: " in done.stderr and "sympy" in done.stderr.split("left out: ")[1]
    # a bad argument: one line, the lock untouched
    before = (root / LOCK).read_bytes()
    for args, line in ((["--from", str(tmp_path / "nope")], f"--from: '{tmp_path / 'nope'}' is not a venv"),
                       (["--frm"], "unknown argument '--frm'")):
        bad = subprocess.run([str(root / "scripts" / "lock.sh"), *args], capture_output=True, text=True, env=env,
                             timeout=30)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and line in bad.stderr, bad.stderr
    assert (root / LOCK).read_bytes() == before and list(temp.iterdir()) == []
