"""How an exception reads in one line (events, warnings, the console's node states), and the bad input that every
rank of a node finds alike (engine/train.py reports it once, from local rank 0)."""

from __future__ import annotations

import contextlib
import json
import math
import re


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first line of the exception's text (at most `limit` characters); its type's name when it has no text."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


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


class CheckpointFailed(RuntimeError):
    """A checkpoint save that failed on some rank of the node, raised on every rank alike once they agreed on it
    (engine/checkpoint.py): one line, exit 1, nothing of it committed."""


class SameOnEveryRank(ValueError):
    """Bad input found by checks that every rank of the node runs alike, on the same inputs: local rank 0 alone
    reports it (main). Not so for the device and rendezvous of setup_distributed or a rank's own checkpoint file."""


@contextlib.contextmanager
def same_on_every_rank():
    try:
        yield
    except SameOnEveryRank:
        raise
    except ValueError as e:
        raise SameOnEveryRank(str(e)) from None
