"""The console's exit codes, and the one a run came to: shared by the dashboard, `--headless` and shells.

Pure (no Textual, no I/O): console/app.py and console/cli.py both import it, and neither imports the other at
module level (cli builds the app lazily, only when a screen is wanted). The fleet imports it too (its summary says
how the run ended), so it takes a fleet without importing console.fleet: no import circle.

    run_outcome(fleet)            None while a started node still runs; then an exit code (EXIT_*)
"""

from __future__ import annotations

from typing import Any

from console.nodes import HostState, NodeState

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_STOPPED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# the header's word for an outcome
ENDED: dict[int | None, str] = {EXIT_OK: "completed", EXIT_FAILED: "failed", EXIT_STOPPED: "stopped"}
RUNNING = frozenset({NodeState.STARTING, NodeState.JOINING, NodeState.TRAINING, NodeState.DRAINING,
                     HostState.UNREACHABLE})  # unreachable: the engine may well still be training
_SUCCESS_REASONS = frozenset({"completed", "drained"})


def started(fleet: Any) -> list[Any]:
    """The nodes this run started (a standby or off host is not part of it)."""
    return [n for n in fleet.nodes.values() if n.state not in (HostState.SPARE, HostState.OFF)]


def run_outcome(fleet: Any) -> int | None:
    """None while any started node still runs; then 0 if all completed/drained, 3 if stopped, else 1.

    A node DEAD only on the mesh's word (`mesh_dead_ts`) still runs here: a cut-off or frozen engine comes back as
    the same process, and the run ends only when the console saw every process end (run_end, exit, kill)."""
    nodes = started(fleet)
    if not nodes or any(n.state in RUNNING or n.mesh_dead_ts is not None for n in nodes):
        return None
    if any(n.state in (HostState.FAILED, NodeState.DEAD) for n in nodes):
        return EXIT_FAILED
    if all(n.state is NodeState.LEFT and n.reason in _SUCCESS_REASONS for n in nodes):
        return EXIT_OK
    return EXIT_STOPPED
