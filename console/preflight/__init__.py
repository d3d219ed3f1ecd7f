"""Before anything starts: a preflight of every host (`zeroband-console PROFILE check`, and before every start).

    host_script.py  runs on each host with the host's python (standard library only, never torch): one JSON of facts
    rules.py     pure: facts and the console's expectations -> one Problem (host, what, fix) per thing to fix
    checkout.py  the console's own version (commit, engine digest) and HEAD's files, for `check` and `sync`
    runner.py    every host at once over its transport, bounded in time; the store link test; a Report

docs/operations.md, "Before the first run", explains each line.
"""

from __future__ import annotations

from typing import Any, Sequence


class PreflightFailed(Exception):
    """A start refused by the preflight; `lines` has one line per problem (the nodes carry them too)."""

    def __init__(self, problems: Sequence[Any]):
        self.problems = list(problems)
        self.lines = [p.line() for p in self.problems]
        super().__init__(f"{len(self.problems)} problem(s) before start: " + " | ".join(self.lines))
