"""A setting's value as the user writes it in a TOML file or on the command line: what the config's refusals,
the digest's differences and the checkpoint's mismatches quote. The standard library only: hosts' engines need no
TOML writer, and the console imports the config that uses it."""

from __future__ import annotations

import json
import math
import re


def toml_value(value: object) -> str:
    """A setting's value as the user writes it in a TOML file or an override (true, "int8", [1, 2], nan,
    {a = 1}); unset for None, which TOML has no word for. The standard library only: hosts' engines need no
    TOML writer."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return _toml_string(str(value))


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml_string(key)


def _toml_string(text: str) -> str:
    # JSON's escapes are TOML's; TOML also wants DEL escaped, and takes other characters as they are
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
