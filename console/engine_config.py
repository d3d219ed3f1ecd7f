"""The engine side of a profile: each host's engine config loaded as its engine will load it (its overrides, its
environment), checked before anything starts, and the environment the console gives each engine.

    check_engine_config(profile)                  ProfileError at the profile line of the first problem
    data_shard(profile, name)                     (GLOBAL_RANK, GLOBAL_WORLD_SIZE): the host's place in the profile
    engine_env(profile, host, rank, world)        GLOBAL_* for the mesh, the host's [env], unbuffered output
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import tomlkit

from console.profile import HostSpec, Profile, ProfileError, engine_overrides, key_lines


def check_engine_config(profile: Profile) -> None:
    """Load the engine config with each host's overrides and environment, as its engine will; a ProfileError if it
    fails, before anything starts. A local host's config is its workdir's; a remote host's is read through this
    checkout's copy (which sync puts there): a bad override of a remote host only failed on that node, after the
    store and the other nodes had started."""
    from engine.config import ConfigError, load_config  # the engine's own rules, not a copy
    from engine.digests import mesh_settings

    lines = key_lines(Path(profile.path).read_text()) if Path(profile.path).is_file() else {}
    diloco: bool | None = None
    shared: dict[str, dict[str, Any]] = {}  # host -> the settings every node of a DiLoCo run must share
    for host in profile.hosts.values():
        config = _engine_config_path(profile, host)
        if host.transport != "local" and not config.is_file():
            continue  # no copy here: the host's own engine says what is wrong, on its node
        try:
            cfg = load_config(config, engine_overrides(profile, host),
                              environ=engine_env(profile, host, *data_shard(profile, host.name)))
        except ConfigError as e:
            raise ProfileError(_engine_error(str(e), profile, host, lines)) from None
        diloco = cfg.diloco.enabled if diloco is None else diloco
        shared[host.name] = mesh_settings(cfg)
    if diloco:
        _check_equal_workers(profile, lines)
        _check_shared_settings(profile, shared, lines)


def _check_equal_workers(profile: Profile, lines: dict[tuple[str, ...], int]) -> None:
    """DiLoCo pairs local rank r of every node (FSDP: shard r), so the engines refuse a node whose worker count
    differs from the run's; say so here, at the host's line, before anything starts."""
    first, *rest = profile.hosts.values()
    for host in rest:
        if host.workers != first.workers:
            line = lines.get(("hosts", host.name, "workers")) or lines.get(("hosts", host.name), 0)
            raise ProfileError(f"{profile.path}:{line}: hosts.{host.name}.workers: {host.workers} differs from "
                               f"{first.name}'s {first.workers}; every node of a DiLoCo run needs the same number "
                               f"of workers (local rank r of each node exchanges with local rank r of the others)")


def _engine_config_path(profile: Profile, host: HostSpec) -> Path:
    """The engine config a host's engine reads, as this machine can read it: a local host's in its workdir (as the
    transports expand it), a remote host's through this checkout's copy (which sync puts there)."""
    if host.transport == "local":
        return Path(host.workdir).expanduser() / profile.engine.config
    return Path(profile.engine.config)


def _check_shared_settings(profile: Profile, shared: dict[str, dict[str, Any]],
                           lines: dict[tuple[str, ...], int]) -> None:
    """The mesh refuses a node whose model, data.seq_len or run-wide diloco settings differ from the run's
    (engine.digests.mesh_settings; docs/mesh.md, the digest key): say so here, at the override that makes the
    difference, before a half-cluster starts."""
    if len(shared) < 2:
        return
    first, *rest = shared
    for name in rest:
        key = next((k for k in sorted(set(shared[first]) | set(shared[name]))
                    if shared[first].get(k) != shared[name].get(k)), None)
        if key is None:
            continue
        # point at the host whose own overrides set it (the other one follows [engine] or [defaults])
        own = {n: _written_in(profile, n, key)[0] == "hosts" for n in (first, name)}
        here, there = (first, name) if own[first] and not own[name] else (name, first)
        why = ("every node of a DiLoCo run must share the model, data.seq_len, the run-wide diloco settings and "
               "train.seed (the mesh would refuse this node)")
        mine, theirs = shared[here].get(key), shared[there].get(key)
        if own[here]:
            where = ("hosts", here, "overrides")
            line = lines.get(where + (key,)) or lines.get(where) or lines.get(("hosts", here), 0)
            raise ProfileError(f"{profile.path}:{line}: hosts.{here}.overrides.{key}: {mine!r} differs from "
                               f"{there}'s {theirs!r}; {why}")
        # neither host's own table sets it: their engine config files differ (local hosts of other workdirs)
        config = _engine_config_path(profile, profile.hosts[here])
        raise ProfileError(f"{profile.path}:{lines.get(('hosts', here), 0)}: hosts.{here}: {key} is {mine!r} in "
                           f"{config}, {theirs!r} for {there}; {why}")


def data_shard(profile: Profile, name: str) -> tuple[int, int]:
    """GLOBAL_RANK and GLOBAL_WORLD_SIZE, which shard the data by node: the host's place among the profile's hosts,
    standbys included, so every host keeps its own shard however the cluster grows and shrinks."""
    return list(profile.hosts).index(name), len(profile.hosts)


def engine_env(profile: Profile, host: HostSpec, rank: int, world_size: int) -> dict[str, str]:
    return {**host.env, "GLOBAL_ADDR": profile.store_address, "GLOBAL_PORT": str(profile.store.port),
            "GLOBAL_UNIQUE_ID": host.name, "GLOBAL_RANK": str(rank), "GLOBAL_WORLD_SIZE": str(world_size),
            "PYTHONUNBUFFERED": "1"}


def _written_in(profile: Profile, host: str, key: str) -> tuple[str, ...]:
    """The table a host's override `key` is written in: the host's own, [defaults] (merged into every host's) or
    [engine]."""
    try:
        doc = tomlkit.parse(Path(profile.path).read_text()).unwrap()
    except (OSError, tomlkit.exceptions.TOMLKitError):
        doc = {}
    own = ((doc.get("hosts") or {}).get(host) or {}).get("overrides") or {}
    if key in own:
        return ("hosts", host, "overrides")
    if key in ((doc.get("defaults") or {}).get("overrides") or {}):
        return ("defaults", "overrides")
    return ("engine", "overrides")


def _engine_error(message: str, profile: Profile, host: HostSpec, lines: dict[tuple[str, ...], int]) -> str:
    """Point at the override that broke the engine config when there is one (the host's own table, [defaults] or
    [engine]), in the profile's words; else at engine.config, or at the host's env for a variable of it."""
    for key in engine_overrides(profile, host):
        said = f"command line: {key}: "
        if said not in message:
            continue
        where = _written_in(profile, host.name, key)
        line = lines.get(where + (key,), lines.get(where, 0))
        what = message.split(said, 1)[1]
        what = re.sub(rf" \(--{re.escape(key)}=[^)]*\)$", "", what)  # the command line the console would write
        return f"{profile.path}:{line}: {'.'.join(where)}.{key}: {what}"
    if message.startswith("environment: "):
        return f"{profile.path}:{lines.get(('hosts', host.name, 'env'), lines.get(('hosts', host.name), 0))}: " \
               f"hosts.{host.name}.env: {message.removeprefix('environment: ')}"
    return f"{profile.path}:{lines.get(('engine', 'config'), 0)}: engine.config: {message}"
