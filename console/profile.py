"""Profiles: which hosts run the cluster, how to reach them, and what they train. TOML, read and written with tomlkit.

    profile = load_profile("profiles/lab.toml")   # a Profile, or ProfileError("profiles/lab.toml:14: hosts.x.port")
    add_host("profiles/lab.toml", "node-d", address="10.0.0.4")   # comments and layout of the file are kept

Layout (profiles/lab.toml documents every option):

    [run]       name, dir (relative to each host's workdir unless absolute)
    [store]     backend (tcp | etcd); tcp: host (the profile host that runs it), address (what engines dial), bind,
                port; etcd: etcd_hosts (the console runs the members) or etcd_endpoints + etcd_ca/cert/key,
                etcd_client_port, etcd_peer_port, etcd_binary, etcd_prefix (console/etcd.py)
    [engine]    config (an engine TOML, relative to the workdir), overrides = { "train.max_steps" = 200 }
    [console]   poll_interval, stop_timeout
    [check]     timeout, link_timeout, min_free_gb, max_clock_skew (the preflight: console/preflight/)
    [sync]      shared_fs, setup_env, setup_timeout, timeout (console/sync.py)
    [defaults]  any host option; each host inherits what it does not set ([defaults.env] merges per key)
    [hosts.NAME] transport, address, port, user, identity_file, jump_host, ssh_alias, ssh_config, known_hosts,
                accept_new_host_key, connect_timeout, python | venv, workdir, env, workers, rdzv_port, standby,
                overrides

A bad profile is one line naming the file, the line and the key; nothing starts from it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Literal

import tomlkit
import tomlkit.exceptions
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.store.endpoints import parse_endpoint  # the standard library only: no torch here

DEFAULT_STORE_PORT = 29600


class ProfileError(ValueError):
    """A bad profile: `FILE:LINE: KEY: what is wrong`."""


class _Spec(BaseModel):
    # strict: a number or a boolean only as TOML types it (a float takes an integer too): `port = "29710"` was
    # taken for 29710, and `standby = 1` for true, though docs/config.md promises a type error
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RunSpec(_Spec):
    name: str = Field(default="run", min_length=1)
    dir: str = "runs/run"


class StoreSpec(_Spec):
    backend: Literal["tcp", "etcd"] = "tcp"  # tcp: python -m engine.store on `host`; etcd: a replicated etcd
    host: str | None = None  # the profile host that runs the store; None: the first non-standby host
    address: str | None = None  # what engines dial; None: that host's address (127.0.0.1 for a local host)
    bind: str | None = None  # the store's listen address; None: the address
    port: int = Field(default=DEFAULT_STORE_PORT, gt=0, lt=65536)
    # etcd, started by the console: one member per host named here (3 survive the loss of any one)
    etcd_hosts: list[str] = []
    etcd_client_port: int = Field(default=2379, gt=0, lt=65000)  # member i listens on client_port + 2i
    etcd_peer_port: int = Field(default=2380, gt=0, lt=65000)  # and peer_port + 2i
    etcd_binary: str = "etcd"  # on each etcd host (Debian: apt install etcd-server)
    # etcd that runs already: its members' client endpoints, and the client certificate files on every host
    etcd_endpoints: list[str] = []
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    etcd_prefix: str | None = None  # the run's key prefix; None: zeroband/<run.name>/

    @field_validator("etcd_endpoints")
    @classmethod
    def _endpoints(cls, value: list[str]) -> list[str]:
        for endpoint in value:
            etcd_endpoint(endpoint)
        return value


def etcd_endpoint(text: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `https://host:port` -> (host, port); ValueError naming the value when it is not
    one: without a port it failed later, as a DNS or connection error. The engine's parser (the same forms as
    --mesh.etcd_endpoints), and one rule of the console's own: the etcd a profile names is reached over TLS."""
    endpoint = parse_endpoint(text)
    if endpoint.scheme == "http":
        raise ValueError(f"{text!r}: etcd here is reached over TLS (https://host:port, or host:port), not http://")
    return endpoint.host, endpoint.port


# engine keys the console sets on every engine's command line or environment (console/launch.py): an override of
# one was silently dropped (run.dir) or beat the console's own value (mesh.store_port: every engine dialled a port
# where no store listened). Each points at what sets it.
CONSOLE_KEYS = {
    "run.name": "[run] name", "run.dir": "[run] dir (each node's folder is RUN_DIR/HOST)",
    "mesh.drain_file": "the console (its drain key and command)", "mesh.node_id": "the host's name",
    "mesh.store_addr": "[store] address", "mesh.store_port": "[store] port", "mesh.store_backend": "[store] backend",
    "mesh.etcd_endpoints": "[store] etcd_hosts or etcd_endpoints", "mesh.etcd_prefix": "[store] etcd_prefix",
    "mesh.etcd_ca": "[store] etcd_ca", "mesh.etcd_cert": "[store] etcd_cert", "mesh.etcd_key": "[store] etcd_key",
    "ckpt.resume": "a start (a fresh run) or --resume (the last one's checkpoints); a restarted node resumes its own",
}
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _overrides(value: dict[str, Any]) -> dict[str, Any]:
    for key, item in value.items():
        if "." not in key:
            raise ValueError(f"override {key!r} is not of the form section.key")
        if isinstance(item, (dict, list)):
            raise ValueError(f"override {key!r} must be a single value")
        if key in CONSOLE_KEYS:
            raise ValueError(f"override {key!r}: the console sets it from {CONSOLE_KEYS[key]}; set it there")
    return value


def _env_names(value: dict[str, str]) -> dict[str, str]:
    for key in value:
        if not ENV_NAME.fullmatch(key):
            raise ValueError(f"{key!r} is not an environment variable name")
    return value


class EngineSpec(_Spec):
    config: str  # an engine TOML under configs/, relative to each host's workdir
    overrides: dict[str, Any] = {}  # "section.key" -> value, as `--section.key=value` on the command line

    @field_validator("overrides")
    @classmethod
    def _dotted(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _overrides(value)


class ConsoleSpec(_Spec):
    poll_interval: float = Field(default=1.0, gt=0)  # seconds between liveness checks of each engine
    stop_timeout: float = Field(default=30.0, gt=0)  # how long stop() lets engines end before killing them


class CheckSpec(_Spec):
    """`zeroband-console PROFILE check`, and the same preflight before every start (console/preflight/)."""
    timeout: float = Field(default=30.0, gt=0)  # seconds for one host's check script (connecting has connect_timeout)
    link_timeout: float = Field(default=5.0, gt=0)  # seconds an engine host tries to reach the store's port
    min_free_gb: float = Field(default=2.0, ge=0)  # free disk wanted under the run folder on every host
    max_clock_skew: float = Field(default=3.0, gt=0)  # seconds a host's clock may be off the console's


class SyncSpec(_Spec):
    """`zeroband-console PROFILE sync`: the console's checkout into every host's workdir, then its set-up."""
    shared_fs: bool = False  # the hosts' workdir is one folder on a shared file system: written once
    setup_env: dict[str, str] = {}  # for scripts/setup.sh on the hosts: BASE_SITE, TORCH_SPEC, PIP_INDEX_URL...
    setup_timeout: float = Field(default=1800.0, gt=0)  # seconds scripts/setup.sh may take on one host
    timeout: float = Field(default=600.0, gt=0)  # seconds the files may take to reach one host

    @field_validator("setup_env")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        return _env_names(value)


class HostSpec(_Spec):
    name: str
    transport: Literal["local", "ssh"] = "ssh"
    address: str | None = None  # None: the name itself (or the ssh_alias)
    port: int | None = Field(default=None, gt=0, lt=65536)  # None: ~/.ssh/config or 22
    user: str | None = None  # None: ~/.ssh/config or the local user
    identity_file: str | None = None
    jump_host: str | None = None  # [user@]host[:port], like ssh -J
    ssh_alias: str | None = None  # a Host entry of ~/.ssh/config (HostName, Port, User, ProxyJump come from it)
    ssh_config: str | None = None  # None: ~/.ssh/config when present
    known_hosts: str | None = None  # None: ~/.ssh/known_hosts
    accept_new_host_key: bool = False  # opt-in: trust (and record) the key of a host not yet in known_hosts
    connect_timeout: float = Field(default=10.0, gt=0)
    python: str = "python3"  # the interpreter on the host
    venv: str | None = None  # a virtual environment on the host; wins over python (venv/bin/python)
    workdir: str = "."  # the repository checkout on the host; run dirs and configs are relative to it
    env: dict[str, str] = {}
    workers: int = Field(default=1, gt=0)  # processes per host (torch.distributed.run when > 1)
    rdzv_port: int | None = Field(default=None, gt=0, lt=65536)  # local rendezvous port when workers > 1
    standby: bool = False  # in the profile, ready to be added, not started with the cluster
    overrides: dict[str, Any] = {}  # engine overrides for this host only (e.g. inner.device)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        return _env_names(value)  # a bad name failed at start, after the other hosts had started

    @field_validator("overrides")
    @classmethod
    def _host_overrides(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _overrides(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        # the name becomes a directory under the run dir and the node id on the mesh
        if not value or value in (".", "..") or "/" in value or "\n" in value or "\0" in value:
            raise ValueError("a host name must be non-empty, not . or .., without / or newlines")
        if value.startswith("_"):  # the run dir's own folders (_store, _store_probe, _archive: console/hosts.py)
            raise ValueError("a host name must not begin with _ (the run folder's own folders do)")
        return value

    @model_validator(mode="after")
    def _reachable(self) -> "HostSpec":
        if self.transport == "local" and (self.jump_host or self.ssh_alias):
            raise ValueError("jump_host and ssh_alias need transport = \"ssh\"")
        return self

    @property
    def python_path(self) -> str:
        return f"{self.venv.rstrip('/')}/bin/python" if self.venv else self.python

    @property
    def target(self) -> str:
        """What to connect to: the ssh alias, the address, or the name."""
        return self.ssh_alias or self.address or self.name


class Profile(_Spec):
    path: str
    run: RunSpec = RunSpec()
    store: StoreSpec = StoreSpec()
    engine: EngineSpec
    console: ConsoleSpec = ConsoleSpec()
    check: CheckSpec = CheckSpec()
    sync: SyncSpec = SyncSpec()
    hosts: dict[str, HostSpec]

    @property
    def store_host(self) -> HostSpec:
        if self.store.host is not None:
            return self.hosts[self.store.host]
        return next(h for h in self.hosts.values() if not h.standby)

    @property
    def store_address(self) -> str:
        """What engines dial: [store] address, else the store host's address; an ~/.ssh/config alias exists only
        on this machine, so its HostName (as ssh resolves it) is dialled instead of the alias."""
        if self.store.address:
            return self.store.address
        return dial_address(self.store_host)

    @property
    def store_bind(self) -> str:
        """What the store listens on: [store] bind, else the address the engines dial (the console checks that
        the store's host can bind it before starting, see TcpStoreHost.bind in console/store/tcp.py)."""
        return self.store.bind or self.store_address

    def active_hosts(self) -> list[HostSpec]:
        return [h for h in self.hosts.values() if not h.standby]

    def standby_hosts(self) -> list[HostSpec]:
        return [h for h in self.hosts.values() if h.standby]


# ---- reading ---------------------------------------------------------------------------------------------
def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile; every problem is a ProfileError naming file, line and key."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ProfileError(f"{source}: profile not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{source}: cannot read: {e}") from None
    return parse_profile(text, source)


def parse_profile(text: str, source: str = "<profile>") -> Profile:
    try:
        doc = tomlkit.parse(text).unwrap()
    except tomlkit.exceptions.ParseError as e:
        raise ProfileError(f"{source}:{e.line}: not valid TOML: {_parse_message(e)}") from None
    except tomlkit.exceptions.TOMLKitError as e:  # a key written twice in one table: tomlkit says which, not where
        raise ProfileError(f"{source}:{_repeat_line(text, str(e))}: not valid TOML: {e}") from None
    lines = key_lines(text)
    tree = _merge_defaults(doc, source, lines)
    try:
        profile = Profile.model_validate(tree)
    except ValidationError as e:
        raise ProfileError(_format_error(e, source, lines, tree)) from None
    _check_hosts(profile, lines)
    return profile


def _check_hosts(profile: Profile, lines: dict[tuple[str, ...], int]) -> None:
    """Rules across sections, each reported at the line it concerns."""
    if not profile.hosts:
        raise ProfileError(f"{profile.path}:{lines.get(('hosts',), 0)}: hosts: no hosts")
    if profile.store.host is not None and profile.store.host not in profile.hosts:
        raise ProfileError(f"{profile.path}:{lines.get(('store', 'host'), 0)}: store.host: "
                           f"{profile.store.host!r} is not a host of this profile")
    if not profile.active_hosts():
        raise ProfileError(f"{profile.path}:{lines.get(('hosts',), 0)}: hosts: every host is standby, "
                           "nothing would start")
    _check_store(profile, lines)
    _check_shared_fs(profile, lines)


def _check_shared_fs(profile: Profile, lines: dict[tuple[str, ...], int]) -> None:
    """With one shared folder, sync writes it once: every host must name that same folder."""
    if not profile.sync.shared_fs:
        return
    first, *rest = profile.hosts.values()
    for host in rest:
        if host.workdir != first.workdir:
            line = lines.get(("hosts", host.name, "workdir")) or lines.get(("sync", "shared_fs"), 0)
            raise ProfileError(f"{profile.path}:{line}: hosts.{host.name}.workdir: {host.workdir!r} differs from "
                               f"{first.name}'s {first.workdir!r}, but sync.shared_fs says every host shares one "
                               f"folder (set the same workdir, or shared_fs = false)")


def _check_store(profile: Profile, lines: dict[tuple[str, ...], int]) -> None:
    """The [store] rules of the profile's backend: each backend's own (StoreSpec.backend names one of _STORE_RULES)."""
    _STORE_RULES[profile.store.backend](profile, lines)


def _store_where(profile: Profile, lines: dict[tuple[str, ...], int]) -> str:
    return f"{profile.path}:{lines.get(('store', 'backend'), lines.get(('store',), 0))}: store"


def _check_tcp_store(profile: Profile, lines: dict[tuple[str, ...], int]) -> None:
    s = profile.store
    if s.etcd_hosts or s.etcd_endpoints:
        raise ProfileError(f"{_store_where(profile, lines)}.backend: etcd_hosts / etcd_endpoints are given but "
                           f"backend is {s.backend!r} (set backend = \"etcd\")")


def _check_etcd_store(profile: Profile, lines: dict[tuple[str, ...], int]) -> None:
    s = profile.store
    where = _store_where(profile, lines)
    if bool(s.etcd_hosts) == bool(s.etcd_endpoints):
        raise ProfileError(f"{where}: backend etcd needs either etcd_hosts (the console starts the members) or "
                           f"etcd_endpoints (a running etcd), not {'both' if s.etcd_hosts else 'neither'}")
    for name in s.etcd_hosts:
        if name not in profile.hosts:
            line = lines.get(("store", "etcd_hosts"), 0)
            raise ProfileError(f"{profile.path}:{line}: store.etcd_hosts: {name!r} is not a host of this profile")
    if s.etcd_hosts and (len(s.etcd_hosts) % 2 == 0 or len(set(s.etcd_hosts)) != len(s.etcd_hosts)):
        line = lines.get(("store", "etcd_hosts"), 0)
        raise ProfileError(f"{profile.path}:{line}: store.etcd_hosts: an odd number of distinct hosts (3 survive "
                           f"the loss of any one), not {len(s.etcd_hosts)}")
    if s.etcd_endpoints and not (s.etcd_ca and s.etcd_cert and s.etcd_key):
        raise ProfileError(f"{where}: etcd_endpoints needs etcd_ca, etcd_cert and etcd_key (paths on every "
                           f"host): etcd must refuse clients without the run's certificate")



_STORE_RULES: dict[str, Callable[[Profile, dict[tuple[str, ...], int]], None]] = {
    "tcp": _check_tcp_store, "etcd": _check_etcd_store}  # a key per StoreSpec.backend


def _repeat_line(text: str, message: str) -> int:
    """The line that writes a key tomlkit found twice ('Key "env" already exists.'): its second writing."""
    m = re.search(r'Key "(.+?)" already exists', message)
    if not m:
        return 0
    pattern = re.compile(rf"^\s*{re.escape(m.group(1))}\s*=|^\s*\[[^\]]*\b{re.escape(m.group(1))}\]")
    seen = [i for i, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    return seen[1] if len(seen) > 1 else (seen[0] if seen else 0)


def _parse_message(err: tomlkit.exceptions.ParseError) -> str:
    return re.sub(r" at line \d+ col \d+$", "", str(err))


def _merge_defaults(doc: dict[str, Any], source: str, lines: dict[tuple[str, ...], int]) -> dict[str, Any]:
    """Hosts inherit [defaults]; env and overrides merge key by key. The result is a plain tree for pydantic."""
    tree = dict(doc)
    defaults = tree.pop("defaults", {})
    hosts = tree.get("hosts", {})
    for section, value in (("defaults", defaults), ("hosts", hosts)):
        if not isinstance(value, dict):
            raise ProfileError(f"{source}:{lines.get((section,), 0)}: {section}: must be a table")
    if "name" in defaults:
        raise ProfileError(f"{source}:{lines.get(('defaults', 'name'), 0)}: defaults.name: unknown key")
    merged: dict[str, Any] = {}
    for name, host in hosts.items():
        if not isinstance(host, dict):
            raise ProfileError(f"{source}:{lines.get(('hosts', name), 0)}: hosts.{name}: must be a table")
        entry = {**defaults, **host, "name": name}
        for key in ("env", "overrides"):
            if isinstance(defaults.get(key), dict) and isinstance(host.get(key), dict):
                entry[key] = {**defaults[key], **host[key]}
        merged[name] = entry
    tree["hosts"] = merged
    tree["path"] = source
    tree.setdefault("engine", {})  # a missing [engine] is reported as engine.config: Field required
    return tree


def _format_error(err: ValidationError, source: str, lines: dict[tuple[str, ...], int], tree: dict) -> str:
    first = err.errors()[0]
    loc = tuple(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    line = _line_of(loc, lines, tree)
    where = ".".join(loc)
    more = f" ({len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{source}:{line}: {where + ': ' if where else ''}{msg}{more}"


def _line_of(loc: tuple[str, ...], lines: dict[tuple[str, ...], int], tree: dict) -> int:
    """The line of the longest prefix of loc written in the file; a host key inherited from [defaults] points there."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
        if loc[0] == "hosts" and end >= 3 and ("defaults",) + loc[2:end] in lines:
            return lines[("defaults",) + loc[2:end]]
    return 0


_HEADER = re.compile(r"^\s*\[\[?(?P<key>[^\]]+)\]\]?\s*(#.*)?$")


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Map every key path written in a TOML text to its 1-based line (first occurrence wins)."""
    out: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    in_multiline: str | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        if in_multiline:  # inside a multi-line string: no keys here
            if raw.count(in_multiline) % 2 == 1:
                in_multiline = None
            continue
        header = _HEADER.match(raw)
        if header:
            table = tuple(split_key(header.group("key")))
            for end in range(1, len(table) + 1):
                out.setdefault(table[:end], number)
            continue
        stripped = raw.strip()
        if not stripped or stripped.startswith("#") or "=" not in stripped:
            continue
        key_text = _key_part(stripped)
        if key_text is None:
            continue
        path = table + tuple(split_key(key_text))
        for end in range(len(table) + 1, len(path) + 1):
            out.setdefault(path[:end], number)
        for quote in ('"""', "'''"):
            if raw.count(quote) % 2 == 1:
                in_multiline = quote
    return out


def _key_part(line: str) -> str | None:
    """The key text before the first `=` that is not inside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "=":
            return line[:i]
    return None


def split_key(text: str) -> list[str]:
    """`a."b.c".'d'` -> ["a", "b.c", "d"]."""
    parts: list[str] = []
    buf = ""
    quote = None
    for ch in text.strip():
        if quote:
            if ch == quote:
                quote = None
            else:
                buf += ch
        elif ch in "\"'":
            quote = ch
        elif ch == ".":
            parts.append(buf.strip())
            buf = ""
        else:
            buf += ch
    parts.append(buf.strip())
    return parts


# ---- writing ---------------------------------------------------------------------------------------------
def add_host(path: str | os.PathLike, name: str, **fields: Any) -> Profile:
    """Write a new [hosts.NAME] table into the profile file, keeping its comments and layout.

    The profile as it would be after the write is validated first: a bad host never reaches the file.
    """
    source = str(path)
    text = Path(path).read_text()
    doc = tomlkit.parse(text)
    hosts = doc.get("hosts")
    if hosts is None:
        hosts = tomlkit.table(is_super_table=True)
        doc["hosts"] = hosts
    if name in hosts:
        raise ProfileError(f"{source}:{key_lines(text).get(('hosts', name), 0)}: hosts.{name}: already exists")
    table = tomlkit.table()
    for key, value in fields.items():
        if value is not None:
            table[key] = value
    hosts[name] = table
    new_text = tomlkit.dumps(doc)
    profile = parse_profile(new_text, source)
    tmp = Path(f"{path}.tmp")
    tmp.write_text(new_text)
    tmp.replace(path)  # atomic: a crash mid-write leaves the old profile, never half of one
    return profile


def remove_host(path: str | os.PathLike, name: str) -> Profile:
    """Take [hosts.NAME] out of the profile file again (an add that failed), keeping the rest as it is."""
    text = Path(path).read_text()
    doc = tomlkit.parse(text)
    hosts = doc.get("hosts")
    if hosts is not None and name in hosts:
        del hosts[name]
    new_text = tomlkit.dumps(doc).rstrip("\n") + "\n"  # add_host's blank line before the table goes too
    profile = parse_profile(new_text, str(path))
    tmp = Path(f"{path}.tmp")
    tmp.write_text(new_text)
    tmp.replace(path)
    return profile


# ---- the engine config -----------------------------------------------------------------------------------
def override_args(overrides: dict[str, Any]) -> list[str]:
    """`--key=value` for each override, as the engine's command line takes it (engine/config.py reads each value
    back as TOML: a string stays a string, even "1e-3")."""
    return [f"--{key}={_override_value(value)}" for key, value in overrides.items()]


def _override_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string


def engine_overrides(profile: Profile, host: HostSpec) -> dict[str, Any]:
    """The profile's engine overrides with the host's own on top."""
    return {**profile.engine.overrides, **host.overrides}


def check_identity_files(profile: Profile) -> None:
    """Every ssh host's identity_file exists on this machine (the console logs in with it); a ProfileError at its
    line if not. Asked by the shell commands before they reach any host: a missing key read as "cannot reach
    127.0.0.1: No such file or directory" on the node, and `status` exited 0."""
    lines: dict[tuple[str, ...], int] | None = None
    for host in profile.hosts.values():
        if host.transport != "ssh" or not host.identity_file:
            continue
        if not os.path.exists(os.path.expanduser(host.identity_file)):
            if lines is None:
                lines = key_lines(Path(profile.path).read_text()) if Path(profile.path).is_file() else {}
            line = _line_of(("hosts", host.name, "identity_file"), lines, {})
            raise ProfileError(f"{profile.path}:{line}: hosts.{host.name}.identity_file: {missing_key(host)}")


def check_ssh_configs(profile: Profile) -> None:
    """Every ssh host's ssh_config exists on this machine (the console reads it to reach the host); a ProfileError
    at its line if not. `status` showed every node "unreachable" with the file named, and exited 0."""
    for host in profile.hosts.values():
        if host.transport == "ssh" and host.ssh_config and not os.path.isfile(os.path.expanduser(host.ssh_config)):
            lines = key_lines(Path(profile.path).read_text()) if Path(profile.path).is_file() else {}
            line = _line_of(("hosts", host.name, "ssh_config"), lines, {})
            raise ProfileError(f"{profile.path}:{line}: hosts.{host.name}.ssh_config: {host.ssh_config} does not "
                               f"exist on this machine (the ssh config this console reaches {host.name} with)")


def key_where(profile: Profile, *keys: tuple[str, ...]) -> str:
    """`FILE:LINE: KEY` for the first of keys, at the line of the first of them written in the file (a default has
    no line of its own: the next key's, [store]'s), for lines that refuse a value found wrong after reading."""
    try:
        lines = key_lines(Path(profile.path).read_text())
    except OSError:
        lines = {}
    return f"{profile.path}:{next((lines[k] for k in keys if k in lines), 0)}: {'.'.join(keys[0])}"


def dial_address(host: HostSpec) -> str:
    """The address other machines dial for a host: an ~/.ssh/config alias exists only on this machine, so its
    HostName (as ssh resolves it) is dialled instead of the alias."""
    if host.transport == "local":
        return "127.0.0.1"
    if host.address:
        return host.address
    from console.sshconfig import ssh_hostname  # reads the ssh_config file: only when an alias needs it

    return ssh_hostname(host) or host.target.rsplit("@", 1)[-1]


def missing_key(host: HostSpec) -> str:
    """What is wrong with a host whose identity_file is missing (the profile check and the transport say it)."""
    return f"{host.identity_file} does not exist on this machine (the key this console logs in to {host.name} with)"
