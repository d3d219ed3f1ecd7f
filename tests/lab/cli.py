"""`python scripts/chaos.py`: arguments, the run, the exit status (0 only when every goal is met)."""

from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path

from engine.config import DilocoConfig

from lab import net
from lab.lab import Lab, LabError, Options, cleanup_leftovers
from lab.schedule import KINDS, Timing, make_schedule

EXIT_PASS, EXIT_FAIL, EXIT_LAB = 0, 1, 2
# diloco.compression's values, as the engine's config takes them (engine.config imports no torch)
COMPRESSIONS = typing.get_args(DilocoConfig.model_fields["compression"].annotation)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/chaos.py", description="Inject a seeded schedule of faults into a "
                                "DiLoCo run on network-namespace hosts driven by the console over SSH, and judge it.",
                                epilog="exit: 0 every goal met, 1 a goal missed (the report says which), "
                                       "2 the lab itself failed (set-up, deadline, not root)")
    d = Options()
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--faults", type=int, default=d.faults, help="how many (the first 9 are one of each kind)")
    p.add_argument("--hosts", type=int, default=d.hosts, help="engine hosts (a store host is added)")
    p.add_argument("--heartbeat-timeout", type=float, default=d.heartbeat_timeout)
    p.add_argument("--inner-steps", type=int, default=d.inner_steps)
    p.add_argument("--round-seconds", type=float, default=d.round_seconds,
                   help="rounds by time of this many seconds (diloco.round = time); 0: rounds of --inner-steps steps")
    p.add_argument("--compression", default=d.compression, choices=COMPRESSIONS,
                   help="diloco.compression of the engines (sparse keeps an accumulator per node: the most state)")
    p.add_argument("--recovery", type=float, default=d.recovery_s, help="seconds each fault may take to heal")
    p.add_argument("--deadline", type=float, default=d.deadline_s, help="seconds for the whole lab")
    p.add_argument("--gap", default=",".join(f"{x:g}" for x in d.gap),
                   help="LOW,HIGH: the quiet seconds after each recovery are drawn between these (the draws, and so "
                        "the rest of a seed's schedule, stay the same)")
    p.add_argument("--stall-limit", type=float, default=None,
                   help="default: heartbeat timeout + 2 s (+ --round-seconds: a commit comes once a round)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"fault kinds to draw from (default all: {','.join(KINDS)})")
    p.add_argument("--out", default="chaos-out", help="report.txt, timeline.png and logs/ go here")
    p.add_argument("--lock-wait", type=float, default=0.0, help="seconds to wait for another lab to end")
    p.add_argument("--keep", action="store_true", help="keep the lab's temp dir (keys, profile, run dirs)")
    p.add_argument("--cleanup", action="store_true", help="only remove leftovers of earlier labs and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.geteuid() != 0:
        print("chaos: needs root (network namespaces, nftables)", file=sys.stderr)
        return EXIT_LAB
    if args.cleanup:
        try:
            gone = cleanup_leftovers()
        except LabError as e:
            print(f"chaos: {e}", file=sys.stderr)
            return EXIT_LAB
        print("chaos: removed " + (", ".join(gone) if gone else "nothing"))
        return EXIT_PASS
    if args.hosts < 2 or args.hosts > 20:
        print(f"chaos: --hosts must be in 2..20, got {args.hosts}", file=sys.stderr)
        return EXIT_LAB
    bad = [f"--{name} must be {rule}, got {value:g}" for name, value, ok, rule in (
        ("heartbeat-timeout", args.heartbeat_timeout, args.heartbeat_timeout > 0, "> 0"),
        ("inner-steps", args.inner_steps, args.inner_steps >= 1, ">= 1"),
        ("round-seconds", args.round_seconds, args.round_seconds >= 0, ">= 0"),
        ("recovery", args.recovery, args.recovery > 0, "> 0"),
        ("deadline", args.deadline, args.deadline > 0, "> 0"),
        ("stall-limit", args.stall_limit or 1.0, args.stall_limit is None or args.stall_limit > 0, "> 0"),
        ("lock-wait", args.lock_wait, args.lock_wait >= 0, ">= 0")) if not ok or value != value]
    if bad:  # every engine would refuse it, and the lab waited out its start
        print(f"chaos: {bad[0]}", file=sys.stderr)
        return EXIT_LAB
    try:  # before anything is set up: a soak's report must have somewhere to go
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"chaos: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_LAB
    try:
        low, high = (float(x) for x in args.gap.split(","))
        if not 0 <= low <= high:
            raise ValueError
    except ValueError:
        print(f"chaos: --gap {args.gap!r}: expected LOW,HIGH seconds with 0 <= LOW <= HIGH", file=sys.stderr)
        return EXIT_LAB
    options = Options(seed=args.seed, faults=args.faults, hosts=args.hosts, heartbeat_timeout=args.heartbeat_timeout,
                      inner_steps=args.inner_steps, round_seconds=args.round_seconds,
                      compression=args.compression, recovery_s=args.recovery,
                      deadline_s=args.deadline,
                      stall_limit=args.stall_limit, keep=args.keep, lock_wait_s=args.lock_wait, gap=(low, high),
                      kinds=tuple(k.strip() for k in args.kinds.split(",") if k.strip()))
    try:  # a bad --kinds or --faults is one line before anything is set up
        make_schedule(options.seed, options.faults, ["a"], Timing(options.heartbeat_timeout, gap=options.gap),
                      options.kinds)
    except ValueError as e:
        print(f"chaos: {e}", file=sys.stderr)
        return EXIT_LAB
    try:
        verdict = Lab(options, Path(args.out), say=lambda line: print(line, flush=True)).run()
    except (LabError, net.NetError, ValueError) as e:
        print(f"chaos: {e}", file=sys.stderr)
        return EXIT_LAB
    except KeyboardInterrupt:
        print("chaos: interrupted (the lab is taken down)", file=sys.stderr)
        return EXIT_LAB
    except Exception as e:  # noqa: BLE001 -- the lab itself failed (an sshd that did not start, a file): not a goal
        print(f"chaos: lab error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_LAB
    return EXIT_PASS if verdict.ok else EXIT_FAIL
