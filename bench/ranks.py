"""What the multi-process benches share: a free loopback port, and `run_ranks`, which runs `worker(rank, port,
args, queue)` in n spawned processes and gathers what each put on the queue (a pickled result, or its traceback)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import socket
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
