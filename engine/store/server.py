"""The membership store as its own small process, so that no training node is special:

    python -m engine.store --host 10.0.0.1 --port 29600     # the address the engines dial (GLOBAL_ADDR)

Runs a torch.distributed TCPStore server and nothing else. Prints one telemetry line (type "state", state "ready",
node "store", rank -1, with host, port and pid) when it accepts clients, and one (state "stopped") on SIGTERM or
SIGINT, then exits 0. A port in use or a bad address is one line on stderr and exit status 2. The store holds only
membership keys (docs/mesh.md), no training state: restarted on the same address within mesh.store_lost_timeout,
it comes back empty and the nodes, which kept training meanwhile, register again and re-form the run in it.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
from datetime import timedelta

from engine.telemetry import encode, make_event


def resolve(host: str | None, port: int, socktype: int, flags: int = 0) -> tuple[int, tuple]:
    """(family, address) of host: IPv4 where the name has an IPv4 address (a name with both kept what every node
    dialled before), else IPv6 (a literal like ::1, a v6-only name). socket.gaierror when it has neither."""
    try:
        info = socket.getaddrinfo(host, port, socket.AF_INET, socktype, 0, flags)
    except socket.gaierror:
        info = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socktype, 0, flags)
    return info[0][0], info[0][4]


def _listen(host: str, port: int) -> socket.socket | str:
    """A listening socket on host:port only (TCPStore alone would listen on every interface), or why not: one line
    that says what to change."""
    try:  # the address's own family: an IPv6 one (::1, or :: for every interface) as an IPv4 one
        family, address = resolve(None if host in ("0.0.0.0", "") else host, port, socket.SOCK_STREAM,
                                  socket.AI_PASSIVE)
    except socket.gaierror as e:  # before OSError: a name that does not resolve is not a port problem
        return f"{host} is not a known host name ({e.strerror})"
    if host in ("0.0.0.0", ""):
        family, address = socket.AF_INET, ("", port)
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(address)
        s.listen(512)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRNOTAVAIL:
            return f"{host} is not an address of this machine (--host: the address of one of its interfaces that " \
                   f"the engines dial)"
        if e.errno == errno.EADDRINUSE:
            return f"{e.strerror} (another store running? choose another --port)"
        return e.strerror or str(e)
    return s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.store", description=__doc__.splitlines()[0])
    # whoever reaches the store can steer the run (TCPStore has no authentication): bind only the address the
    # engines dial, loopback by default; all interfaces (0.0.0.0) only when asked, with a warning
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind and announce: the one the engines dial (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=29600)
    args = parser.parse_args(argv)
    if not 0 < args.port < 65536:
        print(f"engine.store: --port {args.port}: not a TCP port", file=sys.stderr)
        return 2
    listener = _listen(args.host, args.port)
    if isinstance(listener, str):
        print(f"engine.store: cannot listen on {args.host}:{args.port}: {listener}", file=sys.stderr)
        return 2
    if args.host in ("0.0.0.0", ""):
        print(f"engine.store: warning: listening on every interface: anyone who reaches port {args.port} can steer "
              f"the run (docs/operations.md, threat model); bind the address the engines dial", file=sys.stderr)
    # the stop signals are held back (the store's threads, started below, inherit the mask) and taken by sigwait
    # once the store serves. A handler that set a threading.Event could deadlock: it runs in the main thread, and
    # when that thread holds the Event's lock inside wait(), set() waits for that lock forever (seen in CI)
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)

    import torch.distributed as dist  # after the cheap checks: importing torch takes seconds

    client_host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    try:
        # is_master: this process is the server; wait_for_workers=False: clients come and go for the whole run
        store = dist.TCPStore(client_host, args.port, None, True, timedelta(seconds=30), wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except RuntimeError as e:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # as it was (main() may run in a caller's process)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"engine.store: cannot listen on {args.host}:{args.port}: {first}", file=sys.stderr)
        return 2
    ready = make_event("state", "store", -1, state="ready", host=args.host, port=args.port, pid=os.getpid())
    print(encode(ready), flush=True)
    signal.sigwait(stops)  # (left blocked: a second stop signal while it ends must not cut its last line)
    del store
    print(encode(make_event("state", "store", -1, state="stopped", host=args.host, port=args.port,
                            pid=os.getpid())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
