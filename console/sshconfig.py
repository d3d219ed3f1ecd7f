"""What an OpenSSH client config says about a host alias, read the way asyncssh (and ssh) read it; no connection.

    ssh_hostname(host)   the HostName of the host's ssh_alias (or target), or None when the config gives none
    proxy_jump(host)     the ProxyJump the config gives it, or None
    split_target(text)   `[user@]host[:port]` -> (user, host, port): a jump host, an address typed in the dashboard

The console reaches a host by its alias, but the engines on the other hosts dial the store by address: the
alias exists only in this machine's ~/.ssh/config, so the address they dial is its HostName.
"""

from __future__ import annotations

import getpass
import os
import re
from typing import Any

_TARGET = re.compile(r"(?:(?P<user>[^@\s]+)@)?(?P<host>[^@:\s\[\]]+)(?::(?P<port>\d+))?")
# an IPv6 address: in brackets when a port follows (ssh -J's form), else bare (at least two colons, no port)
_TARGET6 = re.compile(r"(?:(?P<user>[^@\s]+)@)?\[(?P<host>[0-9A-Fa-f:.]+(?:%[\w.-]+)?)\](?::(?P<port>\d+))?")
_BARE6 = re.compile(r"(?:(?P<user>[^@\s]+)@)?(?P<host>[0-9A-Fa-f.]*:[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(?:%[\w.-]+)?)"
                    r"(?P<port>)")

DEFAULT_CONFIG = "~/.ssh/config"


def config_paths(host: Any) -> list[str]:
    """The files asyncssh reads for this host that exist here: its ssh_config, else ~/.ssh/config. A missing file
    gives nothing to resolve with; connecting to the host then says the file is missing, on its node."""
    path = os.path.expanduser(host.ssh_config or DEFAULT_CONFIG)
    return [path] if os.path.isfile(path) else []


def split_target(text: str) -> tuple[str | None, str, int | None] | None:
    """`[user@]host[:port]` (as ssh -J and the dashboard's add take it; an IPv6 address bare, or in brackets with a
    port: `[2001:db8::5]:2222`) -> (user, host, port); None if it is not."""
    text = text.strip()
    match = _TARGET.fullmatch(text) or _TARGET6.fullmatch(text) or _BARE6.fullmatch(text)
    if match is None:
        return None
    return match["user"], match["host"], int(match["port"]) if match["port"] else None


def _config(host: Any) -> Any:
    from asyncssh.config import SSHClientConfig

    # load(last_config, paths, reload, canonical, final, local_user, user, host, port); () leaves user/port unset
    return SSHClientConfig.load(None, config_paths(host), False, False, False, getpass.getuser(), (), host.target, ())


def proxy_jump(host: Any) -> str | None:
    """The ProxyJump the config gives the host ("none" means none), so the console opens the jump itself, with
    the profile's known_hosts and keys (asyncssh's own jump would check ~/.ssh/known_hosts instead)."""
    if not config_paths(host):
        return None
    value = _config(host).get("ProxyJump")
    text = " ".join(value) if isinstance(value, (list, tuple)) else str(value or "")
    return None if not text or text.lower() == "none" else text


def known_hosts_files(host: Any) -> tuple[list[str], list[str]]:
    """The known_hosts files ssh consults for the host: (the user's, the global ones). The profile's known_hosts is
    the user's; else ssh_config's UserKnownHostsFile, else ~/.ssh/known_hosts. The global ones: ssh_config's
    GlobalKnownHostsFile, else /etc/ssh/ssh_known_hosts (where clusters hand out their hosts' keys)."""
    config = _config(host) if config_paths(host) else None
    user = [host.known_hosts] if host.known_hosts else \
        list((config.get("UserKnownHostsFile") if config else None) or ["~/.ssh/known_hosts"])
    system = list((config.get("GlobalKnownHostsFile") if config else None) or ["/etc/ssh/ssh_known_hosts"])
    return [os.path.expanduser(p) for p in user], [os.path.expanduser(p) for p in system]


def ssh_port(host: Any) -> int | None:
    """The Port ssh_config gives the host's alias, or None."""
    if not config_paths(host):
        return None
    port = _config(host).get("Port")
    return int(port) if port else None


def ssh_hostname(host: Any) -> str | None:
    """The HostName ssh_config gives the host's alias (Host blocks, Match, %-tokens as ssh evaluates them)."""
    if not config_paths(host):
        return None
    name = _config(host).get("Hostname")
    return str(name) if name else None


def identity_files(host: Any) -> list[str]:
    """The IdentityFile entries ssh_config gives the host, expanded; [] when it gives none."""
    if not config_paths(host):
        return []
    return [os.path.expanduser(str(p)) for p in _config(host).get("IdentityFile", ()) or ()]
