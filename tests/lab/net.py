"""Network namespaces on one bridge, links up and down, and nftables loss/blackhole inside a namespace.

Every name starts with PREFIX ("zbc"), so `cleanup_leftovers()` can remove whatever a killed lab left behind
without touching anything else. Layout (one /24 on a bridge in the root namespace, which the console uses):

    root ns: zbc-br 10.213.77.1/24 ── zbcv-<name> ══ veth ══ eth0 10.213.77.<n>/24 in namespace zbc-<name>

tc netem is not available in this kernel; nftables does the packet loss (`numgen random mod 100 < N drop`)
and the blackhole (drop everything on eth0, both ways, while the link itself stays up). A slow link is a token
bucket (`tc ... tbf`) on eth0's egress: the host's uplink (bench/wan.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

PREFIX = "zbc"
BRIDGE = f"{PREFIX}-br"
SUBNET = "10.213.77"
GATEWAY = f"{SUBNET}.1"
TABLE = f"{PREFIX}_chaos"  # the nftables table inside a namespace
CMD_TIMEOUT_S = 20.0


class NetError(RuntimeError):
    """A network command failed: the command and its stderr in one line."""


def sh(args: list[str], *, timeout: float = CMD_TIMEOUT_S, check: bool = True, stdin: str | None = None) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=stdin)
    except subprocess.TimeoutExpired:
        raise NetError(f"{' '.join(args)}: timed out after {timeout:.0f}s") from None
    if check and done.returncode != 0:
        raise NetError(f"{' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[:300]}")
    return done.stdout


@dataclass(frozen=True)
class NetHost:
    name: str  # the lab's short name: "a", "b", "store"
    index: int  # 2..254: the last byte of its address

    @property
    def netns(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def veth(self) -> str:
        return f"{PREFIX}v-{self.name}"[:15]  # the root side; interface names are at most 15 bytes

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index}"

    def exec_args(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]


def create_bridge() -> None:
    sh(["ip", "link", "add", BRIDGE, "type", "bridge"])
    sh(["ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE])
    sh(["ip", "link", "set", BRIDGE, "up"])


def create_host(host: NetHost) -> None:
    """A namespace with loopback and eth0 (a veth whose other end is on the bridge)."""
    sh(["ip", "netns", "add", host.netns])
    sh(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns])
    sh(["ip", "link", "set", host.veth, "master", BRIDGE, "up"])
    sh(host.exec_args("ip", "link", "set", "lo", "up"))
    sh(host.exec_args("ip", "addr", "add", f"{host.address}/24", "dev", "eth0"))
    sh(host.exec_args("ip", "link", "set", "eth0", "up"))


def link(host: NetHost, up: bool) -> None:
    sh(host.exec_args("ip", "link", "set", "eth0", "up" if up else "down"))


def shape(host: NetHost, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
    """Limit what the host sends (eth0's egress, its uplink) to `rate` ("200mbit", tc's units) with a token bucket:
    bursts of at most `burst` bytes, at most `latency` of packets queued. Replaces any earlier shaping."""
    sh(host.exec_args("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst,
                      "latency", latency))


def drop(host: NetHost, percent: int) -> None:
    """Drop `percent`% of the packets in and out of eth0 (100: a blackhole). Replaces any earlier rule."""
    if not 0 < percent <= 100:
        raise ValueError(f"drop: percent must be in 1..100, got {percent}")
    clear_drop(host)
    match = "" if percent == 100 else f"numgen random mod 100 < {percent} "
    rules = (f"table inet {TABLE} {{\n"
             f"  chain in {{ type filter hook input priority 0; iifname \"eth0\" {match}drop; }}\n"
             f"  chain out {{ type filter hook output priority 0; oifname \"eth0\" {match}drop; }}\n"
             f"}}\n")
    sh(host.exec_args("nft", "-f", "-"), stdin=rules)


def clear_drop(host: NetHost) -> None:
    if f"table inet {TABLE}" in sh(host.exec_args("nft", "list", "tables")):
        sh(host.exec_args("nft", "delete", "table", "inet", TABLE))


def namespace_pids(netns: str) -> list[int]:
    out = sh(["ip", "netns", "pids", netns], check=False)
    return [int(word) for word in out.split() if word.isdigit()]


def kill_namespace_processes(netns: str) -> int:
    """SIGKILL every process in a namespace, by pid (sshd, the engines it started, their shells)."""
    pids = namespace_pids(netns)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


def remove_host(netns: str) -> None:
    kill_namespace_processes(netns)
    sh(["ip", "netns", "del", netns], check=False)  # its veth pair and nft tables go with it


def leftovers() -> tuple[list[str], list[str]]:
    """(namespaces, links) of the root namespace whose names carry the prefix."""
    spaces = [line.split()[0] for line in sh(["ip", "netns", "list"]).splitlines()
              if line.strip() and line.split()[0].startswith(PREFIX)]
    links = []
    for line in sh(["ip", "-o", "link", "show"]).splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            links.append(name)
    return spaces, links


def cleanup_leftovers() -> list[str]:
    """Remove every namespace and link with the prefix (and what runs in those namespaces). Returns what went."""
    spaces, links = leftovers()
    for netns in spaces:
        remove_host(netns)
    gone = list(spaces)
    for name in leftovers()[1]:  # veths went with their namespaces; the bridge (and any orphan) remains
        sh(["ip", "link", "del", name], check=False)
        gone.append(name)
    return gone
