"""`zeroband-console PROFILE`: the dashboard; `--headless` for a status line per interval; subcommands for shells.

    zeroband-console profiles/local.toml                    # start the cluster and watch it
    zeroband-console profiles/local.toml --attach           # re-attach to engines that are already running
    zeroband-console profiles/local.toml --readonly         # watch only (it attaches): no start, add, drain, kill,
                                                            # restart or stop
    zeroband-console profiles/local.toml --headless         # no screen: a status line per interval, exit = outcome
    zeroband-console profiles/local.toml status             # one line per node
    zeroband-console profiles/local.toml drain NODE         # also: kill NODE, add HOST, stop
    zeroband-console profiles/lab.toml check                # every host, before anything starts (exit 1: a problem)
    zeroband-console profiles/lab.toml sync                 # this checkout (HEAD) and its set-up onto every host
    zeroband-console profiles/lab.toml hostkeys             # every host's key; new ones recorded after a typed yes

A start (the dashboard, --headless, add) runs the same check first and starts nothing when it finds a problem;
--no-check skips it. An engine config the engines would refuse (a misspelt override) is exit 2 before that.
`--headless --attach` with no engine of the profile running says so in one line and exits 1.

Exit codes: 0 the run completed (every node completed or drained) or the command succeeded; 1 a node failed or
died, or the command failed; 2 bad usage or a bad profile (one line naming file:line: key; nothing started);
3 the run was stopped before completing; 130 interrupted (training is left running).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence, TextIO

from console import hostkeys
from console.control import Answer, ShellControl
from console.dependency_warnings import route_dependency_warnings
from console.fleet import Fleet, HostState, Node
from console.preflight import PreflightFailed
from console.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT, heartbeat_timeout_of
from console.exit_codes import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_STOPPED,  # noqa: F401 (tests read it)
                                EXIT_USAGE, run_outcome)
from console.widgets import cells
from console.widgets.cells import summary_text  # pure: shells and --headless never import Textual

if TYPE_CHECKING:  # read when a profile is loaded (pydantic, tomlkit): not for --help or a usage error
    from console.profile import Profile

COMMANDS = ("status", "drain", "kill", "add", "stop", "check", "sync")


# ---- pure pieces (unit-tested) ------------------------------------------------------------------------------
def state_counts(nodes: Sequence[Node]) -> str:
    counts: dict[str, int] = {}
    for node in nodes:
        counts[str(node.state)] = counts.get(str(node.state), 0) + 1
    return " ".join(f"{state} {n}" for state, n in counts.items())


def status_line(fleet: Fleet, now: float | None = None) -> str:
    """One line for logs and shells: time, the header figures, then how many nodes are in each state."""
    stamp = time.strftime("%H:%M:%S", time.localtime(time.time() if now is None else now))
    nodes = [n for n in fleet.nodes.values() if n.state is not HostState.SPARE]
    store = cells.store_text(fleet.store).plain
    parts = [f"{stamp} {summary_text(fleet.summary())}", store, state_counts(nodes) or "no nodes"]
    return " | ".join(p for p in parts if p)


def outer_lines(fleet: Fleet, after: int) -> tuple[list[str], int]:
    """Lines for the outer steps settled since `after` (every member reported, or a newer one began); the newest
    outer step printed, to pass back next time."""
    rounds = list(fleet.outer_rounds.values())
    newest = rounds[-1].outer_step if rounds else after
    done = [r for r in rounds if r.outer_step > after and (r.reporters >= r.members or r.outer_step < newest)]
    return ["  " + cells.outer_line(r) for r in done], (done[-1].outer_step if done else after)


def node_line(node: Node, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT) -> str:
    """One node for `status`: the table's columns as plain text, then the state's reason whole, last."""
    live = cells.shows_figures(node.state)  # a dead or left node's last sample is not a current figure
    util, mem = (live and cells.gpu_cells(node.devices)) or cells.device_cells(
        node.device if live else None, node.util, node.mem_used, node.mem_total)
    quiet = cells.state_name(node.state) in cells.QUIET_STATES  # as the dashboard's row
    age = cells.age_cell(node.heartbeat_age, heartbeat_timeout, live=not quiet).plain
    step = "-" if node.step is None else str(node.step)
    reason = cells.why_text(node)
    return (f"{node.name:<14} {node.host:<16} {cells.state_name(node.state):<11} {util.plain:<14} "
            f"{mem.plain:<16} hb {age:<7} step {step:<7} loss {cells.loss_cell(node.loss):<8} "
            f"{cells.num_cell(node.tokens_per_s_now) if live else '-'} tok/s" + _position(node)
            + (f"  ({reason})" if reason else ""))


def _position(node: Node) -> str:
    """Where the node is in its data: tokens seen and (engines that report it) the fraction of its shard."""
    if node.tokens is None:
        return ""
    return f" | data {cells.num_cell(node.tokens)} tok" + ("" if node.epoch is None else f" epoch {node.epoch:.3f}")


# ---- arguments ----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroband-console", description="Start, watch and steer elastic DiLoCo training across hosts.",
        epilog="exit codes: 0 completed/ok, 1 failed, 2 bad usage or profile, 3 stopped, 130 interrupted")
    parser.add_argument("profile", help="a profile TOML, e.g. profiles/local.toml")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--headless", action="store_true", help="no screen: print a status line per interval")
    mode.add_argument("--readonly", action="store_true", help="watch only: hide add, drain, kill, restart, stop")
    parser.add_argument("--attach", action="store_true", help="re-attach to a running cluster instead of starting")
    parser.add_argument("--resume", action="store_true",
                        help="continue the previous run from each node's checkpoints (default: a fresh run; the "
                             "previous run's folders move to RUN_DIR/_archive/)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between headless status lines")
    parser.add_argument("--no-check", action="store_true",
                        help="start (or add) without the preflight of the hosts (`check`)")
    sub = parser.add_subparsers(dest="command", metavar="[COMMAND]", required=False)
    sub.add_parser("status", help="print every node of the running cluster")
    for name, what in (("drain", "finish the outer round and leave"), ("kill", "end the node's processes now")):
        sub.add_parser(name, help=what).add_argument("node")
    sub.add_parser("add", help="start a spare host (or a new address) and join it").add_argument("host")
    sub.add_parser("stop", help="stop training on every node")
    sub.add_parser("check", help="check every host before a start: one line per problem and its fix")
    sub.add_parser("sync", help="put this checkout (HEAD's tracked files) and its set-up on every host")
    hostkeys.add_arguments(parser, sub)  # --accept-new-host-keys, and `hostkeys`
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.interval <= 0:
        raise SystemExit(_usage_error(f"--interval: must be positive, got {args.interval}"))
    if args.command and (args.headless or args.readonly):
        raise SystemExit(_usage_error(f"{args.command}: --headless and --readonly are for the dashboard"))
    return args


def _usage_error(message: str) -> int:
    print(f"zeroband-console: {message}", file=sys.stderr)
    return EXIT_USAGE


# ---- wiring -------------------------------------------------------------------------------------------------
def load(path: str) -> Profile:
    """The profile, or SystemExit(2) after one line naming file:line: key."""
    from console.profile import ProfileError, load_profile

    try:
        return load_profile(path)
    except ProfileError as e:
        print(f"zeroband-console: {e}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None


async def run_headless(cluster: ShellControl, fleet: Fleet, *, attach: bool, interval: float, out: TextIO,
                       heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT) -> int:
    """Start (or attach), print a status line every `interval`, return the run's outcome.

    Needs no terminal. SIGINT/SIGTERM leave training running (the engines outlive the console) and return 130.
    """
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    try:
        try:
            await (cluster.attach() if attach else cluster.start())
        except PreflightFailed as e:  # one line per problem, each naming its host; nothing was started
            for line in e.lines:
                print(f"zeroband-console: {line}", file=sys.stderr)
            hint = getattr(e, "hint", "nothing started (zeroband-console PROFILE check; --no-check skips it)")
            if hint:  # none after a start's own refusal (console/cluster.py StartRefused): its lines say it all
                print(f"zeroband-console: {hint}", file=sys.stderr)
            return EXIT_FAILED
        except Exception as e:  # noqa: BLE001 -- the boundary: any failure to begin is one line and exit 1
            print(f"zeroband-console: {'attach' if attach else 'start'} failed: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return EXIT_FAILED
        for warning in cluster.warnings:  # the start's preflight: a port open beyond a private net
            print(f"zeroband-console: {warning}", file=sys.stderr)
        said = cluster.nothing_runs() if attach else None
        if said:  # nothing to follow: it would print "off" for ever
            print(f"zeroband-console: {said}: nothing to attach to (start it without --attach)", file=sys.stderr)
            return EXIT_FAILED
        printed_outer = -1
        while True:
            try:
                await asyncio.wait_for(interrupted.wait(), interval)
            except asyncio.TimeoutError:
                pass
            print(status_line(fleet), file=out, flush=True)
            lines, printed_outer = outer_lines(fleet, printed_outer)
            for line in lines:  # each outer step: compute against communication (is H right? compression?)
                print(line, file=out, flush=True)
            outcome = EXIT_INTERRUPTED if interrupted.is_set() else run_outcome(fleet)
            if outcome not in (None, EXIT_INTERRUPTED) and cluster.running():
                outcome = None  # the fleet's view says over, but a process it started runs: never end that one
            if outcome is not None:
                for node in fleet.nodes.values():
                    print("  " + node_line(node, heartbeat_timeout), file=out, flush=True)
                if outcome != EXIT_INTERRUPTED:
                    await cluster.stop()  # every engine has ended: the store would otherwise outlive the run
                return outcome
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await cluster.close()  # stop watching (tails, connections); the engines keep running


# the one-shot actions on a node or the run, each a call of the cluster's typed interface (console/control.py)
ACTIONS: dict[str, Callable[[ShellControl, argparse.Namespace], Awaitable[Answer]]] = {
    "drain": lambda cluster, args: cluster.drain(args.node),
    "kill": lambda cluster, args: cluster.kill(args.node),
    "add": lambda cluster, args: cluster.add(args.host),
    "stop": lambda cluster, args: cluster.stop(),
}


async def run_command(cluster: ShellControl, fleet: Fleet, args: argparse.Namespace, out: TextIO,
                      heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT) -> int:
    """One action on a running cluster: attach (catch up on the events files), act, report, detach.

    The engines keep running whatever happens here; exit 0 when the action was done, 1 when the cluster
    answered that it could not be (the reason on stderr), 2 for a node name the profile does not have.
    """
    try:
        await cluster.attach(steer_store=False)  # a one-shot command looks; the dashboard restarts a dead store
        if args.command == "status":
            await cluster.status()
            print(status_line(fleet), file=out)
            for node in fleet.nodes.values():  # the ages coloured as the dashboard colours them
                print("  " + node_line(node, heartbeat_timeout), file=out)
            return EXIT_OK
        if args.command in ("drain", "kill") and args.node not in fleet.nodes:
            print(f"zeroband-console: {args.command}: unknown node {args.node!r} (nodes: {', '.join(fleet.nodes)})",
                  file=sys.stderr)
            return EXIT_USAGE
        outcome = await ACTIONS[args.command](cluster, args)
    except BrokenPipeError:
        raise  # the reader went away (`| head`): not a failure of the command; main() ends quietly
    except Exception as e:  # noqa: BLE001 -- the boundary: one line, exit 1
        print(f"zeroband-console: {args.command} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        await cluster.close()
    ok, message = bool(outcome), outcome.message or args.command
    print(message if ok else f"zeroband-console: {message}", file=out if ok else sys.stderr)
    return EXIT_OK if ok else EXIT_FAILED


def make_cluster(profile: Profile, fleet: Fleet, resume: bool = False, check: bool = True) -> ShellControl:
    from console.cluster import Cluster

    return Cluster(profile, fleet, resume=resume, preflight=check)


async def run_check(profile: Profile, out: TextIO) -> int:
    """`check`: a line per problem (exit 1), else the table of what every host has (exit 0)."""
    from console.preflight.runner import check_profile
    from console.transport import make_transport

    report = await check_profile(profile, make_transport)
    for line in report.lines() or report.table():
        print(line, file=out, flush=True)
    for note in report.notes:
        print(f"({note})", file=out)
    for warning in report.warnings:
        print(warning, file=out)
    return EXIT_FAILED if report.problems else EXIT_OK


async def run_sync(profile: Profile, out: TextIO) -> int:
    """`sync`: a progress line per host and step; exit 1 when a host could not be brought up to date."""
    from console.sync import sync
    from console.transport import make_transport

    ok = await sync(profile, make_transport, say=lambda line: print(line, file=out, flush=True))
    return EXIT_OK if ok else EXIT_FAILED


def _refused(profile: Profile, args: argparse.Namespace) -> str | None:
    """What makes the command wrong before any host is reached: a missing identity file or ssh_config, or `add` of a
    name that is neither a host of the profile nor an address (a typo: the profile stays byte-identical)."""
    from console.hosts import UnknownHost, new_host_target
    from console.profile import ProfileError, check_identity_files, check_ssh_configs

    try:
        check_identity_files(profile)
        check_ssh_configs(profile)
        if args.command == "add" and args.host not in profile.hosts:
            new_host_target(profile, args.host)
    except (ProfileError, UnknownHost) as e:
        return f"{args.command + ': ' if isinstance(e, UnknownHost) else ''}{e}"
    except ValueError:
        pass  # not even [user@]host[:port]: Cluster.add says so on the node it names
    return None


def engine_config_error(profile: Profile) -> str | None:
    """What makes the engines refuse this profile (a misspelt override, a wrong type), as one `file:line: key`
    line; checked before anything starts (a start, `add`), so nothing is started that would die at once."""
    from console.engine_config import check_engine_config
    from console.profile import ProfileError

    try:
        check_engine_config(profile)
    except ProfileError as e:
        return str(e)
    return None


def main(argv: Sequence[str] | None = None, *, cluster_factory: Callable[..., ShellControl] = make_cluster,
         out: TextIO | None = None) -> int:
    route_dependency_warnings()  # first, before asyncssh is imported: a library's deprecations go to the debug log
    args = parse_args(argv)
    out = out or sys.stdout
    try:
        profile = load(args.profile)
    except SystemExit as e:
        return int(e.code or 0)
    if args.accept_new_host_keys:
        profile = hostkeys.accepting_new_keys(profile)
    if args.command == "hostkeys":
        return asyncio.run(hostkeys.run_hostkeys(profile, args.accept_new_host_keys, out))
    if args.command not in ("check", "sync"):  # `check` lists every problem of every host its own way
        refused = _refused(profile, args)
        if refused is not None:
            print(f"zeroband-console: {refused}", file=sys.stderr)
            return EXIT_USAGE
    starts = args.command == "add" or (not args.command and not args.attach and not args.readonly)
    refused = engine_config_error(profile) if starts else None
    if refused is not None:  # the engines would refuse it: nothing starts (README: exit 2, one line)
        print(f"zeroband-console: {refused}", file=sys.stderr)
        return EXIT_USAGE
    if args.command in ("check", "sync"):  # before anything starts: no cluster, no fleet
        try:
            return asyncio.run((run_check if args.command == "check" else run_sync)(profile, out))
        except BrokenPipeError:
            return EXIT_OK
    fleet = Fleet(run=profile.run.name)
    cluster = cluster_factory(profile, fleet, **({"resume": True} if args.resume else {}),
                              **({"check": False} if args.no_check else {}))
    try:
        if args.command:
            return asyncio.run(run_command(cluster, fleet, args, out, heartbeat_timeout_of(profile)))
        if args.headless:
            return asyncio.run(run_headless(cluster, fleet, attach=args.attach, interval=args.interval, out=out,
                                            heartbeat_timeout=heartbeat_timeout_of(profile)))
    except BrokenPipeError:
        # `zeroband-console P status | head -1`: what the reader wanted was printed. --headless has lost its
        # reader before the run ended: like an interrupt, the engines run on (they outlive the console). Point
        # stdout at /dev/null so the interpreter's last flush cannot fail again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is not a file descriptor (embedded, under a test's capture)
            pass
        return EXIT_OK if args.command else EXIT_INTERRUPTED
    from console.app import make_app

    app = make_app(profile, cluster, fleet=fleet, readonly=args.readonly, attach=args.attach or args.readonly,
                   heartbeat_timeout=heartbeat_timeout_of(profile))
    app.run()
    return app.return_code or 0  # the run's outcome (console/exit_codes.py); Textual sets 1 when the app crashed


if __name__ == "__main__":
    sys.exit(main())
