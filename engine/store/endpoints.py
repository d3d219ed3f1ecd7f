"""An etcd member's client endpoint, `host:port`, read once and checked: the engine's mesh.etcd_endpoints and the
console's profile (store.etcd_endpoints) both go through parse_endpoint. The standard library only: the console
imports it without torch or httpx.

    parse_endpoint("10.0.0.1:2379")          -> Endpoint(scheme=None, host="10.0.0.1", port=2379)
    parse_endpoint("https://[fd00::1]:2379") -> Endpoint(scheme="https", host="fd00::1", port=2379)
    parse_endpoint("notaport")               -> ValueError("'notaport' has no port (host:port, e.g. 10.0.0.1:2379)")

An endpoint without a port, with a port outside 1-65535, or an IPv6 address outside brackets was taken as it was and
failed later, as a DNS or connection error that named neither the key nor the value.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

SCHEMES = ("http", "https")
EXAMPLE = "host:port, e.g. 10.0.0.1:2379"


class Endpoint(NamedTuple):
    scheme: str | None  # "http" / "https" when written; None: TLS or not decides
    host: str  # a name or an address; an IPv6 address without its brackets
    port: int

    def url(self, tls: bool) -> str:
        """http(s)://host:port, the scheme as written or else by TLS, an IPv6 host in brackets."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme or ('https' if tls else 'http')}://{host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """`[http(s)://]host:port[/]`, an IPv6 host in brackets; a ValueError naming the value and what is wrong."""
    said = repr(text)
    rest = text.strip().rstrip("/")
    scheme = None
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme not in SCHEMES:
            raise ValueError(f"{said}: unknown scheme {scheme!r} (http:// or https://, or none: {EXAMPLE})")
    if "/" in rest:
        raise ValueError(f"{said}: an endpoint has no path ({EXAMPLE})")
    if rest.startswith("["):
        host, bracket, after = rest[1:].partition("]")
        if not bracket:
            raise ValueError(f"{said}: no closing ] after the IPv6 address ([address]:port)")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{said}: {host!r} in brackets is not an IPv6 address") from None
        if not after.startswith(":"):
            raise ValueError(f"{said} has no port ([address]:port, e.g. [fd00::1]:2379)")
        port_text = after[1:]
    else:
        if rest.count(":") > 1:
            raise ValueError(f"{said}: an IPv6 address goes in brackets ([address]:port, e.g. [fd00::1]:2379)")
        host, colon, port_text = rest.partition(":")
        if not colon:
            raise ValueError(f"{said} has no port ({EXAMPLE})")
    if not host:
        raise ValueError(f"{said} has no host ({EXAMPLE})")
    if not port_text.isdigit() or not port_text.isascii():
        raise ValueError(f"{said}: port {port_text!r} is not a number ({EXAMPLE})")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"{said}: port {port} is outside 1-65535")
    return Endpoint(scheme, host, port)
