"""What the benches share: a free loopback port; `run_ranks`, which runs `worker(rank, port, args, queue)` in n
spawned processes and gathers what each put on the queue (a pickled result, or its traceback); `run_torchrun`, which
never leaves torchrun's workers behind; and argparse types that turn a bad value into argparse's one-line error."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import signal
import socket
import subprocess
import sys
import traceback
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report_to(queue: Any, rank: int, produce: Callable[[], Any]) -> None:
    """In a worker: put (rank, pickled result) on the queue, or (rank, traceback) when `produce` raises."""
    try:
        queue.put((rank, pickle.dumps(produce())))
    except Exception:  # reported by the parent with the traceback
        queue.put((rank, traceback.format_exc()))


def run_ranks(worker: Callable[..., None], n: int, args: Any, what: str = "rank",
              timeout: float = 1800.0) -> list[Any] | None:
    """The n results in rank order; None after printing the traceback of the first rank that failed."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(n)]
    for proc in procs:
        proc.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in range(n))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    for rank, r in sorted(results.items()):
        if not isinstance(r, bytes):
            print(f"{what} {rank} failed:\n{r}", file=sys.stderr)
            return None
    return [pickle.loads(results[r]) for r in range(n)]


def run_torchrun(cmd: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """Run torchrun (in a session of its own), its output captured. On a timeout (TimeoutExpired goes on), Ctrl-C or
    any other exception, torchrun is sent SIGTERM, which takes its workers down (they sit in sessions of their own,
    out of reach of a kill of torchrun's group), given 30 s, then SIGKILLed with any worker still alive."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        workers = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except BaseException:  # a second Ctrl-C, or torchrun hangs in its own shutdown
            proc.kill()
            proc.communicate()
        finally:
            for child in workers:
                try:
                    child.kill()
                except Exception:  # psutil.NoSuchProcess: gone already, as it should be
                    pass
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _children(pid: int) -> list:
    try:
        import psutil
        return psutil.Process(pid).children(recursive=True)
    except Exception:  # psutil missing, or torchrun already gone
        return []


def worker_errors(stderr: str, lines: int = 60) -> str:
    """What the first failing worker wrote (torchrun prefixes a worker's lines `[rankN]:`), from its first
    traceback on; torchrun's own last lines when no worker wrote any."""
    ranked = [line for line in stderr.splitlines() if line.startswith("[rank")]
    if not ranked:
        return "\n".join(stderr.splitlines()[-lines:])
    failed = next((line for line in ranked if "Traceback (most recent call last)" in line), ranked[0])
    mine = [line for line in ranked if line.startswith(failed.split(":", 1)[0] + ":")]
    start = next((i for i, line in enumerate(mine) if "Traceback (most recent call last)" in line), 0)
    return "\n".join(mine[start:][-lines:])


def at_least(low: float, kind: type = int) -> Callable[[str], Any]:
    """An argparse type: a finite `kind` (int or float) no smaller than `low`."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, not "
                                             f"{text!r}") from None
        if not low <= value < float("inf"):  # nan and inf too
            raise argparse.ArgumentTypeError(f"must be {'a finite number ' if kind is float else ''}at least {low}, "
                                             f"not {text}")
        return value
    return parse


def comma_list(item: Callable[[str], Any] | tuple[str, ...]) -> Callable[[str], list]:
    """An argparse type: comma-separated values, at least one, each parsed by `item` or one of its choices."""
    def parse(text: str) -> list:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated values, not {text!r}")
        if isinstance(item, tuple):
            unknown = [v for v in values if v not in item]
            if unknown:
                raise argparse.ArgumentTypeError(f"unknown {unknown[0]!r} (choose from {', '.join(item)})")
            return values
        return [item(v) for v in values]
    return parse
