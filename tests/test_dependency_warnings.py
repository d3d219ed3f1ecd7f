"""A dependency's deprecation warning is never a line of the console's (console/dependency_warnings.py).

With cryptography 51 (DSA deprecated), importing asyncssh 2.24 printed ten `CryptographyDeprecationWarning` lines
that `check` and a headless start showed among their report lines. The routing sends such warnings to the debug log
by category and origin; the project's own warnings, and a dependency's warning of another kind, still show. Where a
host's python prints them on stderr and the console quotes that stderr, the same rule leaves them out.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import console
from console import dependency_warnings as D
from procs import ROOT


ROUTE = """\
import sys, warnings
from cryptography.utils import CryptographyDeprecationWarning
from console.dependency_warnings import route_dependency_warnings

route_dependency_warnings()  # as console/cli.py main() does first
for module, folder, category, message in CASES:
    code = compile(f"import warnings\\nwarnings.warn({message!r}, CATEGORY)\\n", folder + "/x.py", "exec")
    exec(code, {"__name__": module, "CATEGORY": eval(category)})  # a stand-in module's body warns, as on import
print("done")
"""


def package_folder(name: str) -> str:
    """Where an installed package's modules live (found, not imported: asyncssh's import warns by itself)."""
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations
    return list(spec.submodule_search_locations)[0]


def route(tmp_path: Path, cases: list[tuple[str, str, str, str]], *python_options: str) -> tuple[str, str]:
    """A fresh python with the routing installed warns from each (module, its folder, category, message); (its
    stderr, the debug log)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(XDG_STATE_HOME=str(tmp_path / "state"), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, *python_options, "-c", f"CASES = {cases!r}\n{ROUTE}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout == "done\n", done.stderr
    log = tmp_path / "state" / "zeroband-console" / "debug.log"
    return done.stderr, log.read_text() if log.exists() else ""


def test_a_dependency_deprecation_goes_to_the_debug_log_and_the_consoles_own_warning_to_stderr(tmp_path):
    """By category (a deprecation, whatever its base: cryptography's is a UserWarning) and origin (the module): the
    project's own deprecations show (a DeprecationWarning of its own stays hidden, as Python's filters have it)."""
    asyncssh, crypto, ours = package_folder("asyncssh"), package_folder("cryptography"), package_folder("console")
    err, log = route(tmp_path, [("asyncssh.x", asyncssh, "DeprecationWarning", "asyncssh's old API"),
                                ("cryptography.x", crypto, "CryptographyDeprecationWarning", "DSA is old"),
                                ("console.x", ours, "CryptographyDeprecationWarning", "the console's own"),
                                ("engine.x", package_folder("engine"), "FutureWarning", "the engine's own")])
    assert f"{asyncssh}/x.py:2: DeprecationWarning: asyncssh's old API" in log
    assert f"{crypto}/x.py:2: CryptographyDeprecationWarning: DSA is old" in log
    assert err.splitlines() == [f"{ours}/x.py:2: CryptographyDeprecationWarning: the console's own",
                                f"{package_folder('engine')}/x.py:2: FutureWarning: the engine's own"]
    assert "own" not in log


def test_a_dependency_warning_of_another_category_still_shows(tmp_path):
    """The rule is category and origin: a UserWarning from asyncssh may be about this machine's set-up."""
    err, log = route(tmp_path, [("asyncssh.x", package_folder("asyncssh"), "UserWarning", "your key is odd")])
    assert err.splitlines() == [f"{package_folder('asyncssh')}/x.py:2: UserWarning: your key is odd"] and log == ""


def test_warning_options_given_to_python_leave_every_warning_on_stderr(tmp_path):
    """`python -W default` (or PYTHONWARNINGS): the user asked to see them, the routing steps aside."""
    err, log = route(tmp_path, [("asyncssh.x", package_folder("asyncssh"), "DeprecationWarning", "old API")],
                     "-W", "default")
    assert err.splitlines() == [f"{package_folder('asyncssh')}/x.py:2: DeprecationWarning: old API"] and log == ""


def test_origin_places_the_projects_own_files_by_their_folder_and_the_rest_by_the_import_path():
    assert D.origin(f"{package_folder('console')}/cli.py") == "console.cli"
    assert D.origin(f"{package_folder('asyncssh')}/crypto/misc.py") == "asyncssh.crypto.misc"
    assert D.origin("<frozen importlib._bootstrap>") is None
    assert D.module_of("/opt/app/pkg/__init__.py", ["/opt", "/opt/app"]) == "pkg"


# ---- a host's stderr ---------------------------------------------------------------------------------------------
def asyncssh_import_stderr() -> str:
    """What a python with these asyncssh and cryptography prints on stderr when it imports asyncssh."""
    return subprocess.run([sys.executable, "-c", "import asyncssh"], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}).stderr


def test_a_hosts_stderr_loses_the_dependency_deprecations_and_keeps_everything_else():
    noise = asyncssh_import_stderr()
    if "Warning" not in noise:  # an older cryptography: build the same lines by hand
        noise = ("/venv/lib/python3.11/site-packages/asyncssh/crypto/misc.py:32: CryptographyDeprecationWarning: "
                 "DSA is deprecated\n  PyCAPrivateKey = Union[dsa.DSAPrivateKey, rsa.RSAPrivateKey,\n")
    ours = "/home/u/zeroband/engine/train.py:9: DeprecationWarning: the engine's own\n  warnings.warn(x)\n"
    other = "/venv/lib/python3.11/site-packages/torch/x.py:3: UserWarning: no GPU\n  warn()\n"
    traceback = "Traceback (most recent call last):\n  File \"<stdin>\", line 1, in <module>\nValueError: bad\n"
    text = "the first line\n" + noise + ours + other + traceback + noise
    assert D.without_dependency_warnings(text) == "the first line\n" + ours + other + traceback
    assert D.without_dependency_warnings(noise) == ""


async def test_a_host_script_that_fails_names_its_error_not_the_warnings_printed_after_it(tmp_path):
    """runner.run_host_script quotes the last line of a failed host script's stderr: a python whose dependencies warn
    as it ends (here: a wrapper that imports the real asyncssh after the error) still says its error."""
    from console.preflight.runner import run_host_script
    from console.transport.local import LocalTransport
    from console.profile import HostSpec

    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\necho 'python: the host script cannot run here' >&2\n"
                       f"{sys.executable} -c 'import asyncssh'\nexit 3\n")
    wrapper.chmod(0o755)
    t = LocalTransport(HostSpec(name="here", transport="local", workdir=str(tmp_path)))
    rc, answer, error = await run_host_script(t, str(tmp_path), str(wrapper), {"mode": "facts"}, 60)
    assert (rc, answer, error) == (3, None, "python: the host script cannot run here")


async def test_a_dead_engines_reason_quotes_its_last_words_not_a_librarys_source_line(tmp_path):
    """The watchers and the store quote the last line of a process's log (console.transport.last_said)."""
    from console.profile import HostSpec
    from console.transport import LocalTransport, last_said

    log = tmp_path / "engine.log"
    log.write_text("step 3 loss 4.1\nerror: the store went away\n" + asyncssh_import_stderr() * 3)
    t = LocalTransport(HostSpec(name="here", transport="local", workdir=str(tmp_path)))
    assert await last_said(t, "engine.log") == ["step 3 loss 4.1", "error: the store went away"]
    assert await last_said(t, "engine.log", 1) == ["error: the store went away"]


# ---- the real console over SSH -------------------------------------------------------------------------------------
def test_check_and_status_over_ssh_print_no_dependency_warning(sshd, tmp_path):
    """The real `zeroband-console PROFILE check` and `status`, with the installed asyncssh and cryptography, against
    hosts behind a real sshd: no line says Warning; the debug log holds what the libraries said."""
    from test_ssh_cluster import ssh_profile

    work = sshd.home / "work"
    work.mkdir()
    profile = ssh_profile(sshd, user=sshd.user, python=sshd.user_python(), workdir=work, run_dir=sshd.home / "runs",
                          config="configs/debug.toml")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(XDG_STATE_HOME=str(tmp_path / "state"), PYTHONPATH=str(ROOT))
    noisy = "Warning" in asyncssh_import_stderr()  # a cryptography that does not deprecate DSA: nothing to route
    for command in ("check", "status"):
        done = subprocess.run([sys.executable, "-m", "console", str(profile.path), command], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120, start_new_session=True)
        lines = (done.stdout + done.stderr).splitlines()
        assert lines and any("node-a" in line for line in lines), (command, done.stdout, done.stderr)
        said = [line for line in lines if "Warning" in line or "dsa." in line]
        assert said == [], (command, "\n".join(lines))
    log = tmp_path / "state" / "zeroband-console" / "debug.log"
    if noisy:
        assert "asyncssh/crypto/dsa.py:38: CryptographyDeprecationWarning: DSA is deprecated" in log.read_text()
    assert console.__file__.startswith(str(ROOT))  # the console under test is this checkout's
