"""`python -m engine.store.probe HOST PORT --store-pid PID --out FILE`: the store's health, measured on its host.

The console starts it (detached, beside the store, with the host's python) once the store is ready. It is one
client of the membership store: every `--interval` seconds it times one round trip (`num_keys`) and replaces
FILE with one telemetry line (type "heartbeat", node "store", rank -1, with `keys` and `rtt_ms`) that the console
reads into the dashboard's header. One line replaced, never appended: a probe of a week-long run writes nothing
that grows. A store that stops answering is one `warning` line on stdout when it starts and when it ends. The
probe exits when the store process is gone, so it never outlives the store it watches.
Run on the host, it needs nothing the engines do not already have there (torch); the console never imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

from engine.errors import first_line
from engine.telemetry import encode, make_event


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.store.probe", description=__doc__.splitlines()[0])
    parser.add_argument("host", help="the address the store listens on (0.0.0.0: probed on 127.0.0.1)")
    parser.add_argument("port", type=int)
    parser.add_argument("--store-pid", type=int, required=True, help="exit when this process is gone")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between probes")
    parser.add_argument("--out", required=True, help="the file each sample replaces")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        print(f"store_probe: --interval: must be positive, got {args.interval}", file=sys.stderr)
        return 2
    import torch.distributed as dist  # seconds to import: after the arguments are known to be good

    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    store, seq, failing = None, 0, False
    while alive(args.store_pid):
        try:
            if store is None:
                store = dist.TCPStore(host, args.port, None, False, timedelta(seconds=max(5.0, args.interval)),
                                      wait_for_workers=False)
            started = time.perf_counter()
            keys = store.num_keys()  # one round trip
            rtt_ms = (time.perf_counter() - started) * 1000.0
            seq += 1
            sample = make_event("heartbeat", "store", -1, seq=seq, peers={}, keys=int(keys), rtt_ms=round(rtt_ms, 3))
            write_atomic(args.out, encode(sample) + "\n")
            if failing:
                failing = False
                print(encode(make_event("warning", "store", -1, message="store probe: answering again")), flush=True)
        except RuntimeError as e:  # the store does not answer (restarting, overloaded): say so once, try again
            store = None
            if not failing:
                failing = True
                reason = first_line(e)
                print(encode(make_event("warning", "store", -1, message=f"store probe: {reason}")), flush=True)
        time.sleep(args.interval)
    return 0


def write_atomic(path: str, text: str) -> None:
    """Replace the file whole: a reader sees the previous sample or this one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
