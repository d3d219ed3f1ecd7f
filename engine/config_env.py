"""The ZeroBand environment variables a node honours (GLOBAL_ADDR, ZERO_BAND_*...) and the config keys they set:
read by load_config (engine/config.py) beneath the command line's overrides."""

from __future__ import annotations

import difflib
from typing import Mapping

from engine.errors import ConfigError


# ZeroBand-compatible environment variables and the config keys they set.
ZERO_BAND_ENV = {
    "ZERO_BAND_LOG_LEVEL": None,  # read by world.py: which progress lines reach stderr (not a config key)
    "ZERO_BAND_GLOBAL_STORE_TIMEOUT_SECONDS": "mesh.store_timeout",
    "ZERO_BAND_GLOBAL_STORE_POLLING_INTERVAL_SECONDS": "mesh.polling_interval",
    "ZERO_BAND_EDM_HEARTBEAT_INTERVAL_SECONDS": "mesh.heartbeat_interval",
    "ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS": "mesh.heartbeat_timeout",
}
GLOBAL_ENV = {
    "GLOBAL_ADDR": "mesh.store_addr",
    "GLOBAL_PORT": "mesh.store_port",
    "GLOBAL_UNIQUE_ID": "mesh.node_id",
}
GLOBAL_HINTS = ("GLOBAL_RANK", "GLOBAL_WORLD_SIZE")  # read by world.py: the data shard of this node


def env_overrides(environ: Mapping[str, str]) -> dict[str, str]:
    """Config keys set by the environment. An unknown ZERO_BAND_* or GLOBAL_* variable is an error (likely a typo:
    a GLOBAL_ADRR silently ignored would send the node to the default store)."""
    out: dict[str, str] = {}
    for name, value in environ.items():
        if name.startswith("ZERO_BAND_"):
            if name not in ZERO_BAND_ENV:
                raise ConfigError(f"environment: unknown variable {name} ({_known(name, ZERO_BAND_ENV)})")
            key = ZERO_BAND_ENV[name]
            if key:
                out[key] = value
        elif name in GLOBAL_ENV:
            out[GLOBAL_ENV[name]] = value
        elif name.startswith("GLOBAL_") and name not in GLOBAL_HINTS:
            raise ConfigError(f"environment: unknown variable {name} ({_known(name, [*GLOBAL_ENV, *GLOBAL_HINTS])})")
    return out


def _known(name: str, names) -> str:
    """`did you mean X? known: A, B` for an unknown variable (the suggestion only when one is close)."""
    close = difflib.get_close_matches(name, list(names), n=1)
    return (f"did you mean {close[0]}? " if close else "") + f"known: {', '.join(sorted(names))}"


def variable_of(key: str) -> str:
    """The environment variable that sets config `key` (each key has one)."""
    return next(name for name, k in {**ZERO_BAND_ENV, **GLOBAL_ENV}.items() if k == key)
