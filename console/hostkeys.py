"""Host keys of a profile's SSH hosts: `zeroband-console PROFILE hostkeys` and the --accept-new-host-keys option.

Host keys are checked strictly (console/transport/ssh.py), so the first `check` of new hosts fails with "host key ...
is unknown". Two ways to trust them, both only for a host known_hosts has no key for:

    hostkeys                        one line per host: `known`, `new` or `CHANGED`, with the key's type and SHA256
                                    fingerprint; new keys are written to known_hosts after an explicit `yes` typed on
                                    a terminal (compare each with the host's own: `ssh-keygen -lf
                                    /etc/ssh/ssh_host_ed25519_key.pub` on it)
    --accept-new-host-keys          on check, sync, hostkeys, add and a start: trust on first use, no question

A CHANGED key (known_hosts records another key for the host) is never written, whatever the option says: its line
names both keys and exit status is 1. Exit status: 0 every key known or recorded, 1 otherwise. A host behind a jump
host whose key is new shows (and records) the jump's key first; run `hostkeys` again for the host's own.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from typing import Any, Callable, TextIO

OPTION = "--accept-new-host-keys"


def add_arguments(parser: argparse.ArgumentParser, sub: Any) -> None:
    """The option on the main parser (a start) and on check, sync, add and the `hostkeys` subcommand this adds. On a
    subcommand its default is SUPPRESS: argparse would otherwise reset a value given before the command."""
    what = "trust and record the key of a host that known_hosts has none for (a changed key is always refused)"
    parser.add_argument(OPTION, action="store_true", help=what)
    sub.add_parser("hostkeys", help="show every host's key; record new ones after an explicit yes")
    for name in ("check", "sync", "add", "hostkeys"):
        sub.choices[name].add_argument(OPTION, action="store_true", default=argparse.SUPPRESS, help=what)


def accepting_new_keys(profile: Any) -> Any:
    """The profile with accept_new_host_key on every host (for this command only; the file is not changed)."""
    hosts = {name: h.model_copy(update={"accept_new_host_key": True}) for name, h in profile.hosts.items()}
    return profile.model_copy(update={"hosts": hosts})


@dataclass
class Seen:
    name: str
    verdict: str  # known, new, changed, unreachable, local
    line: str
    transport: Any = None


async def _look(host: Any, make: Callable[[Any], Any]) -> Seen:
    from console.transport import TransportError
    from console.transport.ssh import fingerprint

    if host.transport != "ssh":
        return Seen(host.name, "local", f"{host.name}: runs on this machine (no host key)")
    t = make(host.model_copy(update={"accept_new_host_key": False}))  # only looks: records after the yes
    try:
        await t.connect()
    except TransportError as e:
        if t.offered_verdict == "new" and t.offered is not None:
            name, port, key = t.offered
            where = name if port == 22 else f"[{name}]:{port}"
            return Seen(host.name, "new", f"{host.name}: new      {fingerprint(key)}  ({where})", t)
        verdict = "changed" if t.offered_verdict == "changed" else "unreachable"
        await t.close()
        return Seen(host.name, verdict, f"{host.name}: {str(e)}")
    key = t.server_host_key
    await t.close()
    return Seen(host.name, "known", f"{host.name}: known    {fingerprint(key) if key else '(no key)'}")


async def run_hostkeys(profile: Any, accept: bool, out: TextIO, ask: Callable[[str], str] | None = None) -> int:
    """`hostkeys`: a line per host, then (for new keys) the question, or the option's answer."""
    from console.transport import make_transport

    seen = await asyncio.gather(*(_look(h, make_transport) for h in profile.hosts.values()))
    for s in seen:
        print(s.line, file=out, flush=True)
    new = [s for s in seen if s.verdict == "new"]
    try:
        if new and not accept:
            files = sorted({s.transport.known_hosts_path for s in new})
            if ask is None and not sys.stdin.isatty():
                print(f"{len(new)} new host key(s) not recorded: answer yes on a terminal, or add {OPTION}",
                      file=out)
                return 1
            answer = (ask or input)(f"Record {len(new)} new host key(s) in {', '.join(files)}? Compare each "
                                    "fingerprint with the host's own (on it: ssh-keygen -lf "
                                    "/etc/ssh/ssh_host_ed25519_key.pub). Type yes to record them: ")
            accept = answer.strip().lower() == "yes"
            if not accept:
                print("nothing recorded", file=out)
                return 1
        for s in new:
            name, port, key = s.transport.offered
            s.transport.record_key(name, port, key)
            print(f"{s.name}: recorded in {s.transport.known_hosts_path}", file=out, flush=True)
    finally:
        await asyncio.gather(*(s.transport.close() for s in new), return_exceptions=True)
    return 0 if all(s.verdict in ("known", "new", "local") for s in seen) else 1
