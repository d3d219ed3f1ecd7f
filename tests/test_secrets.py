"""Secrets in a profile's `env` reach the engine and nothing else: no process's command line (every user of a shared
host reads those in `ps`), no log, no events file, nothing the console prints. A real engine under a real headless
console."""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import pytest
import tomlkit

from procs import fast_local_profile, kill_recorded_groups


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _cmdlines_with(secret: bytes) -> list[str]:
    hits = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:  # gone meanwhile, or another user's
                continue
            if secret in cmdline:
                words = cmdline.replace(b"\0", b" ")[:200]
                hits.append(f"{entry.name}: {words!r}")
    return hits


def _environs_with(secret: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if secret in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _one_node_profile(tmp_path: Path, secret: str) -> Path:
    path = fast_local_profile(tmp_path)
    doc = tomlkit.parse(path.read_text())
    for name in ("node-b", "node-c", "node-d"):
        del doc["hosts"][name]
    doc["engine"]["overrides"]["diloco.min_nodes"] = 1
    doc["defaults"]["env"]["HF_TOKEN"] = secret
    del doc["defaults"]["venv"]
    doc["defaults"]["python"] = sys.executable  # this interpreter, wherever the checkout's venv lives
    path.write_text(tomlkit.dumps(doc))
    return path


@pytest.mark.timeout(300)
def test_a_secret_in_env_reaches_the_engine_and_no_command_line_log_or_screen(tmp_path, procs):
    secret = f"hf_{uuid.uuid4().hex}"
    raw = secret.encode()
    profile = _one_node_profile(tmp_path, secret)
    console = [sys.executable, "-m", "console", str(profile)]
    # the headless console's screen goes to a file, so the test can wait until it has shown the node training
    screen = tmp_path / "headless.out"
    with screen.open("w") as sink:
        headless = procs.start([*console, "--headless", "--interval", "1"], stdout=sink)
    seen_cmdlines: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            seen_cmdlines += _cmdlines_with(raw)  # sampled all along: start-up is when a wrapper's argv shows
            status = procs.run([*console, "status"], timeout=60)
            if "training 1" in status.stdout.splitlines()[0] and "training 1" in screen.read_text():
                break
            if headless.poll() is not None:
                raise AssertionError(f"console exited {headless.returncode}: {headless.communicate()}")
            assert time.monotonic() < deadline, status.stdout + status.stderr
            time.sleep(0.5)
        seen_cmdlines += _cmdlines_with(raw)
        holders = _environs_with(raw)
        # delivered: the engine holds it in its environment (the store too: it gets the host's env), nothing else
        groups = {name: int((tmp_path / "runs" / name / "pid").read_text()) for name in ("node-a", "_store")}
        assert {name: [p for p in holders if os.getpgid(p) == g] != [] for name, g in groups.items()} == \
            {"node-a": True, "_store": True}
        # and the store's health probe, which runs beside the store with the same host environment
        probe = tmp_path / "runs" / "_store_probe" / "pid"
        allowed = set(groups.values()) | ({int(probe.read_text())} if probe.exists() else set())
        assert all(os.getpgid(p) in allowed for p in holders), (holders, [_cmdline(p) for p in holders])
        assert not (tmp_path / "runs" / "node-a" / "env").exists()  # the 0600 file is gone once read
        stopped = procs.run([*console, "stop"], timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        _, err = headless.communicate(timeout=60)
        out = screen.read_text()
    finally:
        kill_recorded_groups((tmp_path / "runs").glob("*/pid"))
    assert seen_cmdlines == []
    shown = out + err + status.stdout + status.stderr + stopped.stdout + stopped.stderr
    assert "training 1" in out and secret not in shown
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert any(p.name == "engine.log" for p in files) and any(p.name == "events.jsonl" for p in files)
    assert [str(p) for p in files if raw in p.read_bytes()] == []
