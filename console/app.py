"""The Textual app: owns the fleet and the cluster controller, renders at 2 Hz, runs the cluster's I/O in workers.

    app = make_app(profile, cluster, readonly=False, attach=False)
    app.run()

The dashboard posts what its keys ask for (`DashboardScreen.Drain(names)`, `.Kill`, `.Restart`, `.AddNode`, ...);
the app handles each message against the cluster's typed interface (console/control.py).

Rendering is batched: events land in the fleet (no Textual involved); a timer redraws from the fleet only
when `fleet.version` moved, updating table cells in place. Every cluster call runs in an async worker, one
worker group per host, and an exception that escapes the cluster becomes a line in that node's log and a
notification, never a crash.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Iterable, Sequence

from textual.app import App, SystemCommand
from textual.css.query import NoMatches
from textual.screen import Screen

from console.control import Answer, ClusterControl
from console.exit_codes import EXIT_INTERRUPTED, run_outcome
from console.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT, heartbeat_timeout_of
from console.fleet import Fleet, HostState, NodeState
from console.screens.dashboard import DashboardScreen
from console.screens.detail import NodeDetailScreen
from console.screens.help import HelpScreen
from console.screens.logs import LogScreen
from console.screens.modals import QUIT_LEAVE, QUIT_STOP, AddNodeScreen, ConfirmScreen, QuitScreen

REFRESH_INTERVAL = 0.5  # 2 Hz: a 64-row table redrawn at 10 Hz cost 29% of a core here, at 2 Hz 6%
AGE_INTERVAL = 1.0  # heartbeat ages move with the clock even when no event arrives
CHART_INTERVAL = 2.0  # the chart is the costliest redraw (plotext rebuilds the whole plot): every 2 s

# which nodes each action makes sense for; the others are skipped with a notice
ACTION_STATES: dict[str, frozenset[NodeState | HostState]] = {
    "drain": frozenset({NodeState.STARTING, NodeState.JOINING, NodeState.TRAINING}),
    "kill": frozenset({NodeState.STARTING, NodeState.JOINING, NodeState.TRAINING, NodeState.DRAINING,
                       HostState.UNREACHABLE}),
    "restart": frozenset({NodeState.DEAD, HostState.FAILED, NodeState.LEFT}),
}
CONFIRM = {"drain": "Drain", "kill": "Kill"}  # restart brings a node back: no confirmation needed


class ConsoleApp(App[int]):
    TITLE = "ZeroBand Console"
    ENABLE_COMMAND_PALETTE = True

    def __init__(self, profile: Any, cluster: ClusterControl, fleet: Fleet, *, readonly: bool = False,
                 attach: bool = False, start: bool = True, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                 standby: Callable[[], Sequence[str]] | None = None,
                 refresh_interval: float = REFRESH_INTERVAL) -> None:
        super().__init__()
        self.profile = profile
        self.cluster = cluster
        self.fleet = fleet
        self.readonly = readonly
        self._quitting = False  # a quit without asking is under way (request_quit)
        self.attach = attach
        self.autostart = start
        self.heartbeat_timeout = heartbeat_timeout
        self._standby = standby or (lambda: ())
        self.refresh_interval = refresh_interval
        self.dashboard = DashboardScreen(fleet, heartbeat_timeout, readonly=readonly)
        self._drawn_version = -1
        self._ages_drawn = 0.0
        self._chart_version = -1
        self._chart_drawn = 0.0
        self.redraws = 0  # full redraws done (the benchmark and tests read it)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def on_mount(self) -> None:
        self.push_screen(self.dashboard)
        self.set_interval(self.refresh_interval, self.tick)
        if self.autostart and (self.attach or self.readonly):  # read-only never starts: it watches what runs
            self.call_cluster("attach", self._attach_cluster, group="cluster")
        elif self.autostart:
            self.call_cluster("start", self.cluster.start, group="cluster")

    async def _attach_cluster(self) -> None:  # not _attach: Textual's MessagePump has one
        """Attach to what runs; where no engine of the profile does, say so (the watchers still notice a start by
        another console)."""
        await (self.cluster.attach(steer_store=False) if self.readonly else self.cluster.attach())  # watch only
        said = self.cluster.nothing_runs()
        if said:
            what = "watching for a start by another console" if self.readonly else "start it without --attach"
            self.notify(f"{said}: {what}", severity="warning", timeout=10, markup=False)

    def tick(self) -> None:
        """Redraw from the fleet when it changed; otherwise only the heartbeat ages, once a second."""
        if not self.dashboard.is_mounted or not self.is_running:
            return
        try:
            self._draw()
        except NoMatches:  # the app is shutting down and the dashboard's widgets are already gone
            return

    def _draw(self) -> None:
        now = time.monotonic()
        if self.fleet.version != self._drawn_version or self.dashboard.table.needs_sync():
            self._drawn_version = self.fleet.version
            self.dashboard.render_fleet(self.fleet)
            self._ages_drawn = now
            self.redraws += 1
        elif now - self._ages_drawn >= AGE_INTERVAL:
            self.dashboard.render_ages(self.fleet)
            self._ages_drawn = now
        if self._chart_version != self.fleet.version and now - self._chart_drawn >= CHART_INTERVAL:
            self._chart_version = self.fleet.version
            self._chart_drawn = now
            self.dashboard.render_chart(self.fleet)

    # ---- cluster calls (workers) ---------------------------------------------------------------------
    def call_cluster(self, what: str, method: Callable[..., Awaitable[Answer | None]], *args: str, group: str,
                     node: str | None = None) -> None:
        """Run one cluster coroutine in an async worker of `group` (one group per host)."""
        self.run_worker(self._guarded(what, method, args, node), group=group, name=f"{what} {node or ''}".strip(),
                        exit_on_error=False)

    async def _guarded(self, what: str, method: Callable[..., Awaitable[Answer | None]], args: tuple[str, ...],
                       node: str | None) -> Answer | None:
        try:
            result = await method(*args)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- the worker boundary: a failed call is shown, never fatal
            self._report(node, f"{what} failed: {type(e).__name__}: {e}", ok=False)
            return None
        # the cluster answers actions with an Outcome(ok, message) instead of raising for a node's trouble
        if result is not None and result.message:
            self._report(node, result.message, ok=bool(result))
        return result

    def _report(self, node: str | None, message: str, ok: bool) -> None:
        if not ok and node in self.fleet.nodes:
            self.fleet.note(node, message)  # the log pane shows it on the next tick
        # markup=False: cluster messages carry node names, paths and error text, any of which may hold "[...]"
        self.notify(message, severity="information" if ok else "error", timeout=4 if ok else 8, markup=False)

    def _host_group(self, name: str) -> str:
        node = self.fleet.nodes.get(name)
        return f"host:{node.host if node else name}"

    # ---- the dashboard's messages ----------------------------------------------------------------------
    def on_dashboard_screen_drain(self, message: DashboardScreen.Drain) -> None:
        self.request(message.verb, message.names, self.cluster.drain)

    def on_dashboard_screen_kill(self, message: DashboardScreen.Kill) -> None:
        self.request(message.verb, message.names, self.cluster.kill)

    def on_dashboard_screen_restart(self, message: DashboardScreen.Restart) -> None:
        self.request(message.verb, message.names, self.cluster.restart)

    def on_dashboard_screen_add_node(self, message: DashboardScreen.AddNode) -> None:
        self.request_add()

    def on_dashboard_screen_show_logs(self, message: DashboardScreen.ShowLogs) -> None:
        self.show_logs(message.node)

    def on_dashboard_screen_show_detail(self, message: DashboardScreen.ShowDetail) -> None:
        self.show_detail(message.node)

    def on_dashboard_screen_show_help(self, message: DashboardScreen.ShowHelp) -> None:
        self.show_help()

    def on_dashboard_screen_quit(self, message: DashboardScreen.Quit) -> None:
        self.request_quit()

    def on_dashboard_screen_ready(self, message: DashboardScreen.Ready) -> None:
        self.tick()

    def request(self, action: str, names: Iterable[str], method: Callable[[str], Awaitable[Answer]]) -> None:
        """`method` (the cluster's drain / kill / restart) on the given nodes, after a confirmation where `action`
        is destructive; nodes in a state the action does not fit are skipped with a notice."""
        if self.readonly:
            return
        names = list(names)
        allowed = ACTION_STATES[action]
        ok = [n for n in names if n in self.fleet.nodes and self.fleet.nodes[n].state in allowed]
        skipped = [n for n in names if n not in ok]
        if skipped:
            states = ", ".join(f"{n} ({self.fleet.nodes[n].state})" for n in skipped if n in self.fleet.nodes)
            self.notify(f"{action}: skipped {states or ', '.join(skipped)}", severity="warning", timeout=4,
                        markup=False)
        if not ok:
            return

        def go(confirmed: bool | None = True) -> None:
            if not confirmed:
                return
            for name in ok:
                self.call_cluster(action, method, name, group=self._host_group(name), node=name)
            self.dashboard.unmark(ok)

        if action in CONFIRM:
            self.push_screen(ConfirmScreen(f"{CONFIRM[action]} {', '.join(ok)}?", CONFIRM[action]), go)
        else:
            go()

    def request_add(self) -> None:
        if self.readonly:
            return

        def add(host: str | None) -> None:
            if host:
                self.call_cluster("add", self.cluster.add, host, group=f"host:{host}", node=host)

        self.push_screen(AddNodeScreen(self.standby_hosts()), add)

    def standby_hosts(self) -> list[str]:
        """Standby nodes the fleet knows, then any the profile lists that the fleet does not show yet."""
        names = [n.name for n in self.fleet.nodes.values() if n.state in (HostState.SPARE, HostState.OFF)]
        return names + [h for h in self._standby() if h not in names and h not in self.fleet.nodes]

    def show_logs(self, name: str) -> None:
        self.push_screen(LogScreen(name, self.fleet.nodes.get, self.refresh_interval))

    def show_detail(self, name: str) -> None:
        self.push_screen(NodeDetailScreen(name, self.fleet.nodes.get, self.refresh_interval))

    def show_help(self) -> None:
        self.push_screen(HelpScreen(self.readonly))

    async def action_quit(self) -> None:
        """ctrl+q too asks whether to leave training running or stop it."""
        if isinstance(self.screen, QuitScreen):
            return
        self.request_quit()

    def request_quit(self) -> None:
        if self._run_over():  # nothing trains: nothing to leave running or stop, so nothing to ask (the store stops)
            if not self._quitting:  # once: a second q while the first one's stop runs
                self._quitting = True
                self.run_worker(self._quit(stop=False), group="cluster", exit_on_error=False)
            return

        def answer(choice: str | None) -> None:
            if choice in (QUIT_LEAVE, QUIT_STOP):
                if choice == QUIT_STOP:
                    self.notify("stopping training on every node...", timeout=30)
                self.run_worker(self._quit(stop=choice == QUIT_STOP), group="cluster", exit_on_error=False)

        self.push_screen(QuitScreen(self.readonly), answer)

    async def _quit(self, stop: bool) -> None:
        """Stop the engines (if asked), then stop watching them: tails and connections close, engines live on.

        The exit status follows --headless's rules (console/exit_codes.py): the run's outcome once every node has
        ended (0 completed or drained, 1 a node failed or died, 3 stopped), 130 while training is left running.
        """
        if stop or (not self.readonly and self._run_over()):
            # asked to, or every engine has ended (as --headless does): the store and its probe would otherwise
            # outlive the run for ever
            await self._guarded("stop", self.cluster.stop, (), None)
        await self._guarded("close", self.cluster.close, (), None)
        outcome = run_outcome(self.fleet)
        code = EXIT_INTERRUPTED if outcome is None else outcome
        self.exit(code, return_code=code)

    def _run_over(self) -> bool:
        """Every node this run started has ended, and the cluster follows no live engine process."""
        return run_outcome(self.fleet) is not None and not self.cluster.running()

    # ---- command palette ----------------------------------------------------------------------------
    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        if screen is not self.dashboard:
            return
        dash = self.dashboard
        if not self.readonly:
            yield SystemCommand("Add node", "Start a spare host or a new address and join it",
                                self.request_add)
            yield SystemCommand("Drain node", "Finish the outer round and leave (marked or selected)",
                                lambda: self.request("drain", dash.targets(), self.cluster.drain))
            yield SystemCommand("Kill node", "End the process group now (marked or selected)",
                                lambda: self.request("kill", dash.targets(), self.cluster.kill))
            yield SystemCommand("Restart node", "Start a dead, failed or left node again",
                                lambda: self.request("restart", dash.targets(), self.cluster.restart))
        yield SystemCommand("Node logs", "The selected node's full log", dash.action_logs)
        yield SystemCommand("Node detail", "The selected node in full: GPUs, ranks, command, checkpoints (enter)",
                            lambda: self.show_detail(dash.table.selected_name() or ""))
        yield SystemCommand("Filter nodes", "By name, host or state", dash.action_filter)
        yield SystemCommand("Toggle sparkline", "tokens/s or loss", dash.action_trend)
        yield SystemCommand("Help", "Keys and colours", self.show_help)
        yield SystemCommand("Quit console", "Leave training running, or stop it", self.request_quit)


def make_app(profile: Any, cluster: ClusterControl, *, fleet: Fleet | None = None, readonly: bool = False,
             attach: bool = False, start: bool = True, heartbeat_timeout: float | None = None,
             refresh_interval: float = REFRESH_INTERVAL) -> ConsoleApp:
    """Build the app with its dependencies injected (posting's make_posting), so tests build the same app."""
    fleet = fleet if fleet is not None else cluster.fleet
    if heartbeat_timeout is None:
        heartbeat_timeout = heartbeat_timeout_of(profile)

    def standby() -> list[str]:
        hosts = profile.standby_hosts() if hasattr(profile, "standby_hosts") else ()
        return [str(getattr(h, "name", h)) for h in hosts]

    return ConsoleApp(profile, cluster, fleet, readonly=readonly, attach=attach, start=start,
                      heartbeat_timeout=heartbeat_timeout, standby=standby, refresh_interval=refresh_interval)
