"""How fast the console's cluster model ingests events, against this machine's own reference in the same run.

    .venv/bin/python bench/console_ingest.py [--events 200000] [--nodes 64] [--repeat 3]

Lines are what engines write (engine.telemetry.encode of step / heartbeat / resource / outer_step / state
events, 64 nodes interleaved). Three figures, each the best of --repeat runs, in CPU seconds of this process
(one core; time.process_time, so other load on the machine does not count against it):

    json.loads        the reference: parsing the same lines and nothing else
    Fleet.ingest      parse + validate (engine.telemetry.parse_line) + update the model    goal >= 100,000/s
    tail + ingest     the same through LocalTail reading an events file from disk, as the console does

The ratio to json.loads makes the figure comparable across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ranks import at_least  # noqa: E402  (bench/ is the script's folder, first on sys.path)
from console.fleet import Fleet  # noqa: E402
from console.transport.local import LocalTail  # noqa: E402
from engine.telemetry import encode, make_event  # noqa: E402

GOAL = 100_000


def make_lines(count: int, nodes: int) -> list[tuple[str, str]]:
    """A mix like a live run's: mostly steps, a heartbeat per node per second, resources, outer steps."""
    names = [f"node-{i:02d}" for i in range(nodes)]
    out: list[tuple[str, str]] = []
    t0 = time.time()
    for i in range(count):
        name = names[i % nodes]
        k, ts = i % 20, t0 + i * 1e-3
        if k < 12:
            event = make_event("step", name, 0, ts=ts, step=i, loss=3.0 - i * 1e-6, lr=3e-4,
                               tokens_per_s=12345.6, grad_norm=0.75)
        elif k < 16:
            event = make_event("heartbeat", name, 0, ts=ts, seq=i, peers={n: 0.4 for n in names[:8]})
        elif k < 18:
            event = make_event("resource", name, 0, ts=ts, device="gpu", util=87.5, mem_used=40 << 30,
                               mem_total=80 << 30)
        elif k == 18:
            event = make_event("outer_step", name, 0, ts=ts, outer_step=i // 100, step=i, generation=3,
                               members=names[:8], pgrad_norm=0.12, bytes_sent=1 << 20, allreduce_s=0.8, wire_s=0.6,
                               codec_s=0.2, compute_s=9.0, outer_s=1.0, checksum="abc123", contributors=names[:8],
                               weights=[1.0] * 8)
        else:
            event = make_event("state", name, 0, ts=ts, state="training")
        out.append((name, encode(event)))
    return out


def bench_json(lines: list[tuple[str, str]]) -> float:
    import json

    loads = json.loads
    start = time.process_time()
    for _, line in lines:
        loads(line)
    return time.process_time() - start


def bench_fleet(lines: list[tuple[str, str]]) -> float:
    fleet = Fleet()
    ingest = fleet.ingest
    start = time.process_time()
    for name, line in lines:
        ingest(name, line)
    elapsed = time.process_time() - start
    assert sum(n.malformed for n in fleet.nodes.values()) == 0
    return elapsed


def bench_tail(lines: list[tuple[str, str]], folder: Path) -> float:
    """One node's file holding every line: LocalTail reads it back and the fleet ingests each line."""
    path = folder / "events.jsonl"
    path.write_text("".join(line + "\n" for _, line in lines))
    total = len(lines)

    async def run() -> float:
        fleet = Fleet()
        tail = LocalTail(path, 0)
        start = time.process_time()
        seen = 0
        async for line in tail:
            fleet.ingest("node-00", line)
            seen += 1
            if seen == total:
                break
        elapsed = time.process_time() - start
        await tail.aclose()
        return elapsed

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=at_least(1), default=200_000)
    parser.add_argument("--nodes", type=at_least(1), default=64)
    parser.add_argument("--repeat", type=at_least(1), default=3)
    args = parser.parse_args(argv)
    lines = make_lines(args.events, args.nodes)
    n = len(lines)
    with tempfile.TemporaryDirectory() as folder:
        ref = min(bench_json(lines) for _ in range(args.repeat))
        fleet = min(bench_fleet(lines) for _ in range(args.repeat))
        tail = min(bench_tail(lines, Path(folder)) for _ in range(args.repeat))
    avg = sum(len(line) for _, line in lines) / n
    print(f"console ingest: {n:,} events from {args.nodes} nodes, {avg:.0f} bytes/line, best of {args.repeat}, "
          f"CPU time of one core (pid {os.getpid()})")
    print(f"  json.loads (reference)  {n / ref:>12,.0f} events/s")
    print(f"  Fleet.ingest            {n / fleet:>12,.0f} events/s  ({ref / fleet:.2f}x json.loads)  "
          f"goal >= {GOAL:,}: {'met' if n / fleet >= GOAL else 'NOT met'}")
    print(f"  LocalTail + ingest      {n / tail:>12,.0f} events/s  ({ref / tail:.2f}x json.loads)")
    return 0 if n / fleet >= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
