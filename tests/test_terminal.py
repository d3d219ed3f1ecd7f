"""An engine run in a terminal shows the readable lines only; its JSON events go to the run folder, said once.
On a pipe (the console, the tests) the JSON contract on stdout is unchanged."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ["configs/debug.toml", "--train.max_steps=2", "--train.micro_batch_size=2", "--train.batch_size=2",
       "--data.seq_len=32", "--train.log_interval=1", "--data.path=corpus/stdlib_docstrings.jsonl"]


def read_all(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return out.decode(errors="replace")


def test_in_a_terminal_only_readable_lines_and_the_events_go_to_the_run_folder(tmp_path):
    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "engine.train", *RUN, f"--run.dir={tmp_path}"], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=sub, stderr=sub, start_new_session=True)
    os.close(sub)
    try:
        text = read_all(main, proc, 180)
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, text
    assert '{"v":' not in text, text  # no JSON line on the terminal
    files = list(tmp_path.glob("events-*.jsonl"))
    assert len(files) == 1 and f"JSON events -> {files[0]}" in text, text
    assert "step      2 loss" in text and "end completed at step 2" in text
    events = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert events[0]["type"] == "run_start" and events[-1]["type"] == "run_end"


def test_on_a_pipe_the_events_stay_on_stdout(tmp_path):
    done = subprocess.run([sys.executable, "-m", "engine.train", *RUN, f"--run.dir={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    types = [json.loads(line)["type"] for line in done.stdout.splitlines()]
    assert types[0] == "run_start" and types[-1] == "run_end"
    assert not list(tmp_path.glob("events-*.jsonl")) and "JSON events ->" not in done.stderr
