"""What the app needs of the cluster controller: the typed seam between the Textual app and console/cluster.py.

    class Cluster: ...                   # console/cluster.py: the real one (local processes or asyncssh)
    make_app(profile, cluster)           # console/app.py: any object with these methods (the benchmark's SimCluster)
    cli.run_command(cluster, ...)        # console/cli.py: a ShellControl, these and the shell's two more

The app calls these and nothing else, each in a worker; an action answers with an `Answer` (the controller's is
`Outcome`, here: true when it went as asked, and a line to show) instead of raising for a node's trouble. Pure: no I/O,
no Textual, so the app, the CLI and a test double all type against it without importing the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from console.fleet import Fleet


class Answer(Protocol):
    """An action's result: truthy when it went as asked; `message` is the line the app shows."""

    @property
    def message(self) -> str: ...

    def __bool__(self) -> bool: ...


@dataclass(frozen=True)
class Outcome:
    """The result of an action, for the UI and the CLI (actions never raise for a node's trouble)."""

    ok: bool
    message: str

    def __bool__(self) -> bool:
        return self.ok


class ClusterControl(Protocol):
    @property
    def fleet(self) -> Fleet: ...

    # the run
    async def start(self) -> None: ...

    async def attach(self, *, steer_store: bool = True) -> None: ...

    def nothing_runs(self) -> str | None: ...

    def running(self) -> Sequence[str]: ...

    async def stop(self) -> Answer: ...

    async def close(self) -> None: ...

    # one node (the dashboard's keys)
    async def add(self, target: str) -> Answer: ...

    async def drain(self, name: str) -> Answer: ...

    async def kill(self, name: str) -> Answer: ...

    async def restart(self, name: str) -> Answer: ...


class ShellControl(ClusterControl, Protocol):
    """What the CLI needs besides (`--headless` and the one-shot commands, console/cli.py): the start's warnings and
    a one-shot refresh of what is known."""

    @property
    def warnings(self) -> Sequence[str]: ...

    async def status(self) -> object: ...
