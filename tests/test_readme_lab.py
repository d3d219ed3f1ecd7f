"""The README's "From this machine to your cluster", read from README.md itself and done in the namespace lab
(tests/lab): two machines, each a network namespace with its own sshd, reached over SSH from a fresh HOME whose known_hosts is
empty. Nothing of the section is copied here: its commands and its profile edit are parsed out of README.md
(tests/test_readme.py: cluster_section, edit_profile), each command runs as written in bash in a stand-in for the
repository's root (every top-level entry of the checkout linked, profiles/ copied, so the `cp` makes a file of the
test's own), after the section's own `source .venv/bin/activate`.

What the test fills in, as a reader would, and what it changes for the lab (no more):

    HOST-A, HOST-B     the two namespaces' addresses; USER: the lab's login user (zbtest); /opt/zeroband: a
                       folder the login user owns (both namespaces share this file system)
    ~/.ssh/id_ed25519  the lab's key, in the fresh HOME the commands run with (~/.ssh/known_hosts starts absent)
    the lab's overlay  one CPU worker per machine (as the section's comment says for a machine without GPUs); the
                       interpreter the login user can run with this venv's packages, in place of the venv `sync`
                       would make; [sync] shared_fs (one file system); a tiny run of configs/debug-diloco.toml; a
                       low [check] min_free_gb; a 1 s poll

The dashboard line (`--readonly`) needs a terminal and is only parsed (tests/test_readme.py); `hostkeys` gets a
terminal of its own, and the `yes` typed on it. Then: sync, check (a table, exit 0), the headless start in the
background, `status` until both nodes report a step and its loss, `drain node-b` (node-b's run_end says drained),
`stop` (node-a's says stopped), and the headless start exits 3 (stopped).
"""

from __future__ import annotations

import json
import os
import pty
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import tomlkit

from procs import ROOT, kill_recorded_groups
from test_readme import cluster_section, edit_profile

LAB_HOSTS = ("a", "b")
OVERRIDES = {"inner.device": "cpu", "data.path": "corpus/stdlib_docstrings.jsonl", "train.max_steps": 100000,
             "train.micro_batch_size": 2, "train.batch_size": 2, "data.seq_len": 32, "train.log_interval": 1,
             "train.eval_interval": 0, "diloco.inner_steps": 3, "diloco.min_nodes": 2,
             "diloco.allreduce_timeout": 30.0, "mesh.heartbeat_interval": 0.5, "mesh.heartbeat_timeout": 6.0,
             "mesh.store_timeout": 30.0, "mesh.start_timeout": 120.0, "mesh.polling_interval": 0.05}
DASHBOARD = "--readonly"  # the one line of the section that needs a terminal: parsed, not run


def stand_in_root(root: Path) -> Path:
    """The repository's root as the commands see it: every top-level entry linked, profiles/ a copy."""
    repo = root / "repo"
    repo.mkdir()
    for entry in ROOT.iterdir():
        if entry.name == "profiles":
            shutil.copytree(entry, repo / "profiles")
        elif entry.name != ".git":
            (repo / entry.name).symlink_to(entry)
    return repo


def lab_overlay(path: Path, python: str, python_env: dict[str, str]) -> None:
    """What the lab changes beyond the section's edit (the module's docstring says why each)."""
    doc = tomlkit.parse(path.read_text())
    doc["defaults"]["workers"] = 1
    doc["defaults"]["venv"] = ""
    doc["defaults"]["python"] = python
    for key, value in {"OMP_NUM_THREADS": "1", **python_env}.items():
        doc["defaults"]["env"][key] = value
    doc["sync"]["shared_fs"] = True
    doc["check"]["min_free_gb"] = 0.5
    doc["console"]["poll_interval"] = 1.0
    doc["console"]["stop_timeout"] = 30.0
    doc["engine"]["config"] = "configs/debug-diloco.toml"
    doc["engine"]["overrides"] = OVERRIDES
    path.write_text(tomlkit.dumps(doc))


class Shell:
    """Each command as typed, in bash, in the stand-in root, after the section's own set-up lines."""

    def __init__(self, repo: Path, home: Path, prelude: list[str]):
        from lab.lab import lab_env

        self.repo, self.prelude = repo, prelude
        self.env = {**lab_env(), "HOME": str(home)}

    def argv(self, line: str) -> list[str]:
        return ["bash", "-c", " && ".join([*self.prelude, line])]

    def run(self, line: str, timeout: float = 120, stdin=subprocess.DEVNULL) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(line), cwd=self.repo, env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=stdin, start_new_session=True)

    def on_a_terminal(self, line: str, answer: str) -> subprocess.CompletedProcess:
        leader, follower = pty.openpty()
        try:
            os.write(leader, answer.encode() + b"\n")
            return self.run(line, stdin=follower)
        finally:
            os.close(follower)
            os.close(leader)

    def start(self, line: str, log: Path) -> subprocess.Popen:
        with open(log, "w") as out:
            return subprocess.Popen(self.argv(line), cwd=self.repo, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)


def run_end(events: Path) -> str | None:
    if not events.is_file():
        return None
    ends = [json.loads(line) for line in events.read_text().splitlines()
            if line.startswith("{") and '"run_end"' in line]
    return ends[-1]["status"] if ends else None


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 2 minutes alone; up to 600 s waiting for another lab's lock
def test_the_readme_cluster_section_runs_as_written_in_the_lab():
    from lab import net
    from lab.hosts import HostSshd, prepare_user, user_python_env
    from lab.lab import holding_lock

    (setup, first_shell, second_shell), edit = cluster_section()
    prelude = [line for line in setup if line.startswith("source ")]
    with holding_lock():
        net.cleanup_leftovers()
        root = Path(tempfile.mkdtemp(prefix="zbc-lab-readme-"))  # lab cleanup (scripts/chaos.py) knows the prefix
        root.chmod(0o755)
        hosts, sshds, headless = [], [], None
        work = root / "work"
        try:
            key = prepare_user(root)
            net.create_bridge()
            for i, name in enumerate(LAB_HOSTS):
                hosts.append(net.NetHost(name, 40 + i))
                net.create_host(hosts[-1])
                sshds.append(HostSshd(hosts[-1], root, key))
                sshds[-1].start()
            home = root / "home"
            (home / ".ssh").mkdir(parents=True)
            shutil.copy(key, home / ".ssh" / "id_ed25519")
            (home / ".ssh" / "id_ed25519").chmod(0o600)
            work.mkdir()
            shutil.chown(work, "zbtest", "zbtest")
            repo = stand_in_root(root)
            shell = Shell(repo, home, prelude)
            started = time.monotonic()

            for line in setup:  # source, then cp
                done = shell.run(line)
                assert done.returncode == 0, (line, done.stdout, done.stderr)
            profile = repo / "profiles" / "mine.toml"
            edit_profile(profile, edit, {"HOST-A": hosts[0].address, "HOST-B": hosts[1].address, "USER": "zbtest",
                                         "/opt/zeroband": str(work)})
            python, python_env = user_python_env()
            if python_env:  # every site folder of this venv: one that a .pth adds (a venv built on another) too
                python_env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p.endswith("site-packages"))}
            lab_overlay(profile, python, python_env)

            hostkeys, sync, check, start = first_shell
            assert shlex.split(hostkeys)[2:] == ["hostkeys"] and shlex.split(start)[2:] == ["--headless"]
            known = home / ".ssh" / "known_hosts"
            done = shell.on_a_terminal(hostkeys, "yes")
            assert done.returncode == 0, done.stdout + done.stderr
            assert re.findall(r"^node-[ab]: new +ssh-ed25519 SHA256:\S+", done.stdout, re.M), done.stdout
            assert known.is_file() and len(known.read_text().splitlines()) == 2, done.stdout  # one line per machine
            done = shell.run(sync, timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr
            done = shell.run(check)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "host key" not in done.stdout + done.stderr
            headless = shell.start(start, root / "headless.log")

            status, dashboard, drain, stop = second_shell
            assert DASHBOARD in shlex.split(dashboard)
            deadline, rows = time.monotonic() + 240, {}
            while time.monotonic() < deadline:
                assert headless.poll() is None, (root / "headless.log").read_text()[-3000:]
                done = shell.run(status)
                found = re.findall(r"^\s+(node-[ab]) .* step (\d+)\s+loss (\d\S*)", done.stdout, re.M)
                rows = {name: (int(step), loss) for name, step, loss in found}  # a step, and its loss a number
                if len(rows) == 2 and all(step >= 1 for step, _ in rows.values()):
                    break
                time.sleep(2)
            assert len(rows) == 2, (done.stdout, (root / "headless.log").read_text()[-3000:])
            run_dir = work / "runs" / "lab-1b"
            done = shell.run(drain)
            assert done.returncode == 0 and "node-b" in shlex.split(drain), done.stdout + done.stderr
            deadline = time.monotonic() + 120
            while run_end(run_dir / "node-b" / "events.jsonl") is None and time.monotonic() < deadline:
                time.sleep(1)
            assert run_end(run_dir / "node-b" / "events.jsonl") == "drained"
            done = shell.run(stop)
            assert done.returncode == 0, done.stdout + done.stderr
            assert headless.wait(timeout=120) == 3, (root / "headless.log").read_text()[-3000:]
            assert run_end(run_dir / "node-a" / "events.jsonl") == "stopped"
            events = [json.loads(line) for line in (run_dir / "node-a" / "events.jsonl").read_text().splitlines()
                      if line.startswith("{")]
            steps = [e for e in events if e["type"] == "step"]
            assert steps and all(isinstance(s["loss"], float) for s in steps), steps[-3:]
            print(f"readme lab: {time.monotonic() - started:.0f}s after set-up")
        finally:
            if headless is not None and headless.poll() is None:
                os.killpg(headless.pid, 9)
                headless.wait(timeout=10)
            kill_recorded_groups((work / "runs").glob("*/*/pid"))
            for host in hosts:
                net.remove_host(host.netns)  # sshd, the engines and the store run in there
            for sshd in sshds:
                if sshd.proc is not None:
                    sshd.proc.wait(timeout=10)
            net.cleanup_leftovers()
            shutil.rmtree(root, ignore_errors=True)
        assert net.leftovers() == ([], [])
