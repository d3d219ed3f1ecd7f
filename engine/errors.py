"""How an exception reads in one line (events, warnings, the console's node states), and the bad input that every
rank of a node finds alike (engine/train.py reports it once, from local rank 0)."""

from __future__ import annotations

import contextlib


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first line of the exception's text (at most `limit` characters); its type's name when it has no text."""
    text = str(err).strip()
    return text.splitlines()[0][:limit] if text else type(err).__name__


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


class ConfigError(ValueError):
    """A bad config: the message names the file and the key."""
