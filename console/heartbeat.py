"""How long a node's heartbeat may be silent before the dashboard, `status` and `--headless` colour its age: the
mesh's heartbeat timeout, from the profile's overrides or its engine config.

    heartbeat_timeout_of(profile)     the profile's mesh.heartbeat_timeout; DEFAULT_HEARTBEAT_TIMEOUT when unknown

Importing it costs nothing: the engine config (and the profile's own module) are read only when a profile is asked.
"""

from __future__ import annotations

from typing import Any

DEFAULT_HEARTBEAT_TIMEOUT = 6.0  # the engine's mesh.heartbeat_timeout default, where its config is not readable here


def heartbeat_timeout_of(profile: Any) -> float:
    """The mesh's heartbeat timeout the ages are coloured against: the engine config with the profile's overrides."""
    overrides = getattr(getattr(profile, "engine", None), "overrides", {}) or {}
    value = overrides.get("mesh.heartbeat_timeout")
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    from engine.config import ConfigError, load_config

    from console.profile import override_args

    try:
        words = override_args(overrides)  # the engine's command line
        return float(load_config(profile.engine.config, words).mesh.heartbeat_timeout)
    except (ConfigError, OSError, AttributeError):  # a remote-only config is not readable here: the default
        return DEFAULT_HEARTBEAT_TIMEOUT
