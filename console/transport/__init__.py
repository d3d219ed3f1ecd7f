"""Transports: one async interface (run, start_detached, tail, signal, alive) over local subprocesses and SSH."""

from __future__ import annotations

from console.profile import HostSpec
from console.transport.base import Tail, Transport, TransportError, last_said
from console.transport.local import LocalTransport


def make_transport(host: HostSpec) -> Transport:
    """The transport a profile host asks for (asyncssh is imported only when a host needs it)."""
    if host.transport == "local":
        return LocalTransport(host)
    from console.transport.ssh import SshTransport
    return SshTransport(host)


__all__ = ["LocalTransport", "Tail", "Transport", "TransportError", "last_said", "make_transport"]
