"""The dashboard's CPU share with 64 simulated nodes each sending 10 events/s (goal: under 10% of one core).

    .venv/bin/python bench/console_app_cpu.py [--nodes 64] [--rate 10] [--seconds 20]

Each case runs the real app (make_app, the real Fleet, the real widgets) in a child process on a pseudo-terminal
of 160x50, with Textual's real terminal driver writing real escape sequences that the parent drains. The child's
CPU time (user + system, psutil) over the measured window, after a warm-up, divided by the wall time, is its
share of one core. In the same run:

    idle       the same app and 64 nodes, no events: the reference (timers, cursor, the age column)
    load       64 nodes x 10 events/s through Fleet.ingest, redrawn at 2 Hz (the shipped setting)
    load@10Hz  the same load redrawn at 10 Hz: what batching at 2 Hz saves

The simulated events are encoded before the window (only their timestamp is stamped as they are sent), so
the figure is the console's cost (parse, ingest, render), not the producer's.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# ---- child: the app under load ------------------------------------------------------------------------------
TS = 1111111111.111111  # a placeholder timestamp of fixed width, stamped with the clock as each line is sent
TS_TEXT = f"{TS:.6f}"


def _event_pool(names: list[str], per_node: int) -> dict[str, list[str]]:
    from engine.telemetry import encode, make_event

    pool: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        lines = []
        for k in range(per_node):
            ts = TS
            kind = k % 5
            if kind == 3:
                lines.append(encode(make_event("resource", name, 0, ts=ts, device="cpu", util=40.0 + k % 30,
                                               mem_used=(300 + k) << 20, mem_total=16 << 30)))
            elif kind == 4:
                lines.append(encode(make_event("heartbeat", name, 0, ts=ts, seq=k,
                                               peers={n: 0.5 for n in names[:8]})))
            else:
                lines.append(encode(make_event("step", name, 0, ts=ts, step=k, loss=4.0 - k * 0.001 - i * 0.01,
                                               lr=1e-3, tokens_per_s=1000.0 + (k * 37 + i) % 200, grad_norm=0.5)))
        pool[name] = lines
    return pool


@dataclass(frozen=True)
class Outcome:
    """An action's answer, as console/control.py's Outcome (its Answer); the console is imported
    only in the child."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok


class SimCluster:
    """Feeds pre-encoded lines into the fleet at `rate` events/s per node; the same seam as the real Cluster. The
    count of lines sent so far is kept at the start of the file `count_fd` (when given), for the parent to read."""

    def __init__(self, fleet, names: list[str], rate: float, pool: dict[str, list[str]], count_fd: int | None = None):
        self.fleet, self.names, self.rate, self.pool, self.count_fd = fleet, names, rate, pool, count_fd
        self.sent = 0
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        for name in self.names:
            self.fleet.ingest(name, self.pool[name][0].replace(TS_TEXT, f"{time.time():.6f}", 1))
        if self.rate > 0:
            self._task = asyncio.create_task(self._produce())

    async def _produce(self) -> None:
        tick = 0.1  # one batch per node per tick, like a tail reading a file every 100 ms
        k, due = 1, 0.0
        while True:
            started = time.monotonic()
            due += self.rate * tick  # the fraction left over carries into the next tick: rate 1 is one line a second
            per_tick = int(due + 1e-9)  # ten ticks of 0.1 add up to 0.999...
            due -= per_tick
            now = f"{time.time():.6f}"  # fresh timestamps, as a live engine writes them (ages stay honest)
            for name in self.names:
                lines = self.pool[name]
                for j in range(per_tick):
                    self.fleet.ingest(name, lines[(k + j) % len(lines)].replace(TS_TEXT, now, 1))
            k += per_tick
            self.sent += per_tick * len(self.names)
            if self.count_fd is not None:
                os.pwrite(self.count_fd, f"{self.sent:<20d}".encode(), 0)
            await asyncio.sleep(max(0.0, tick - (time.monotonic() - started)))

    async def attach(self, *, steer_store: bool = True) -> None:
        await self.start()

    def nothing_runs(self) -> str | None:
        return None

    def running(self) -> list[str]:
        return list(self.names)

    async def stop(self) -> Outcome:
        if self._task:
            self._task.cancel()
        return Outcome(True, "")

    async def close(self) -> None:
        return None

    # the dashboard's keys are not pressed in this benchmark (console/control.py: the seam the app drives)
    async def add(self, target: str) -> Outcome:
        return Outcome(False, "the benchmark adds no node")

    async def drain(self, name: str) -> Outcome:
        return Outcome(False, "the benchmark drains no node")

    async def kill(self, name: str) -> Outcome:
        return Outcome(False, "the benchmark kills no node")

    async def restart(self, name: str) -> Outcome:
        return Outcome(False, "the benchmark restarts no node")


def child(nodes: int, rate: float, hz: float, count_file: str) -> None:
    from console.app import make_app
    from console.fleet import Fleet, NodeState
    from engine.telemetry import encode, make_event

    names = [f"node-{i:02d}" for i in range(nodes)]
    fleet = Fleet(run="bench")
    for name in names:
        fleet.add_node(name, f"10.0.{nodes // 256}.{len(fleet.nodes)}")
        fleet.ingest(name, encode(make_event("state", name, 0, state="training")))
    fleet.set_state(names[0], NodeState.TRAINING)
    cluster = SimCluster(fleet, names, rate, _event_pool(names, 200), os.open(count_file, os.O_WRONLY))
    app = make_app(None, cluster, fleet=fleet, refresh_interval=1.0 / hz)
    app.run()


# ---- parent: measure ----------------------------------------------------------------------------------------
def measure(nodes: int, rate: float, hz: float, warmup: float, seconds: float) -> tuple[float, float]:
    """(the app's share of one core, the events/s the simulated nodes really sent) over the measured window."""
    import psutil
    import tempfile

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "PYTHONPATH": str(ROOT), "COLUMNS": "160", "LINES": "50"}
    env.pop("CI", None)
    counts = tempfile.NamedTemporaryFile(prefix="zb-app-cpu-")
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(nodes), str(rate), str(hz), counts.name],
                            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    sent = lambda: int(Path(counts.name).read_text() or 0)  # noqa: E731
    try:
        ps = psutil.Process(proc.pid)
        _drain(master, warmup)
        before, t0, sent0 = ps.cpu_times(), time.monotonic(), sent()
        _drain(master, seconds)
        after, t1, sent1 = ps.cpu_times(), time.monotonic(), sent()
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited early with {proc.returncode}")
        return ((after.user - before.user) + (after.system - before.system)) / (t1 - t0), (sent1 - sent0) / (t1 - t0)
    finally:
        counts.close()
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
        os.close(master)


def _drain(fd: int, seconds: float) -> None:
    """Read the terminal output (as a terminal would) so the app never blocks on a full pty."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], min(left, 0.2))
        if ready:
            try:
                os.read(fd, 65536)
            except OSError:
                return


def main() -> None:
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--rate", type=float, default=10.0, help="events per second per node")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per case")
    parser.add_argument("--warmup", type=float, default=5.0)
    args = parser.parse_args()
    cases = [("idle", 0.0, 2.0), ("load", args.rate, 2.0), ("load@10Hz", args.rate, 10.0)]
    results = {}
    load = os.getloadavg()[0]
    print(f"console app CPU share: {args.nodes} nodes, 160x50 pty, {args.seconds:.0f}s per case "
          f"(cpu count {os.cpu_count()}, load average {load:.1f} at start: contention inflates every figure)")
    for label, rate, hz in cases:
        share, events = measure(args.nodes, rate, hz, args.warmup, args.seconds)
        results[label] = share
        print(f"  {label:<10} {events:6.0f} events/s  redraw {hz:4.1f} Hz  {share * 100:6.2f}% of a core")
    idle, load = results["idle"], results["load"]
    verdict = "PASS" if load < 0.10 else "FAIL"
    print(f"load at 2 Hz: {load * 100:.2f}% of a core ({load / idle if idle > 0 else float('inf'):.1f}x the idle "
          f"reference {idle * 100:.2f}%); goal < 10%: {verdict}")
    print(f"batching: 10 Hz costs {results['load@10Hz'] / load if load > 0 else float('inf'):.1f}x the 2 Hz redraw")


if __name__ == "__main__":
    main()
