"""How an exception reads in one line (events, warnings, the console's node states), and the bad input that every
rank of a node finds alike (engine/train.py reports it once, from local rank 0)."""

from __future__ import annotations

import contextlib

import tomlkit


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first line of the exception's text (at most `limit` characters); its type's name when it has no text."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


def toml_value(value: object) -> str:
    """A setting's value as the user writes it in a TOML file or an override (true, "int8", [1, 2], nan,
    {a = 1}); unset for None, which TOML has no word for."""
    if value is None:
        return "unset"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{tomlkit.key(str(k)).as_string()} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return tomlkit.item(value).as_string()


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
