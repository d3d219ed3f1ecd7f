"""The house's arrows: the engine never imports the console, and no two modules import each other (directly or
around a longer circle). Every import counts, at module level or inside a function: a lazy import is still an
arrow a reader has to follow."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "console")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` of a submodule counts as that module)."""
    modules = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                targets.update(subs)
                if len(subs) < len(node.names):  # names from the module itself, not only its submodules
                    targets.add(node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_engine_never_imports_the_console():
    upward = sorted(f"{m} -> {t}" for m, ts in import_graph().items() if m.startswith("engine")
                    for t in ts if t.startswith("console"))
    assert upward == []


def test_no_module_circles():
    assert cycles(import_graph()) == []


def test_the_checker_sees_circles_and_lazy_imports():
    """The oracle itself: a function-level import closing a circle is found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    graph = import_graph()
    assert "engine.session" in graph["engine.train"]  # imported inside main(), once the config passed
    assert "engine.inner.ddp_fsdp" in graph["engine.session"]
    assert "engine.inner.zero" in import_graph()["engine.inner.ddp_fsdp"]  # imported inside build_inner: still an arrow


# The engine's parts (docs/architecture.md) and the arrows that must never exist between them. A part is a folder
# (or a module); an arrow into a part counts for every module in it.
FORBIDDEN = {
    # the inner loop never asks whether DiLoCo is on; the outer loop wraps it
    "engine.inner": ["engine.outer", "engine.mesh", "engine.store", "engine.data", "engine.train", "engine.session",
                     "engine.checkpoint"],
    # the outer loop sees the inner strategy through its methods only (outer_params, after_outer_update, ...)
    "engine.outer": ["engine.inner", "engine.data", "engine.train", "engine.session", "engine.checkpoint",
                     "engine.model"],
    # membership knows nothing of training
    "engine.mesh": ["engine.outer", "engine.inner", "engine.data", "engine.train", "engine.session",
                    "engine.checkpoint", "engine.model"],
    # the stores are below the mesh: they know no keys, plans or states
    "engine.store": ["engine.mesh", "engine.outer", "engine.inner", "engine.data", "engine.train", "engine.session",
                     "engine.checkpoint", "engine.model"],
    "engine.data": ["engine.outer", "engine.mesh", "engine.inner", "engine.store", "engine.train", "engine.session"],
}

# the console starts engines and reads their events: it imports only these torch-free engine modules (the config
# rules, the event schema and the node states, errors, the preset shapes and the DeepSpeed config its recipes
# write, etcd's gateway and its endpoints' parser, the memory estimate the preflight compares with each host's GPUs)
CONSOLE_MAY_IMPORT = {"engine.config", "engine.digests", "engine.telemetry", "engine.states", "engine.errors",
                      "engine.presets",
                      "engine.inner.deepspeed_config", "engine.store.etcd_gateway", "engine.store.endpoints",
                      "engine.memory"}


def _in(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {t}" for part, banned in FORBIDDEN.items() for m, ts in graph.items() if _in(m, part)
                  for t in ts for b in banned if _in(t, b))


def test_no_forbidden_arrow_between_the_engines_parts():
    assert forbidden_arrows(import_graph()) == []


def test_the_console_imports_only_the_engines_torch_free_modules():
    graph = import_graph()
    used = {t for m, ts in graph.items() if _in(m, "console") for t in ts if _in(t, "engine")}
    assert used - CONSOLE_MAY_IMPORT == set()
    # and the arrows inside the console run one way: only the CLI builds the cluster controller
    assert sorted(m for m, ts in graph.items() if "console.cluster" in ts) == ["console.cli"]


def test_the_parts_are_folders_a_newcomer_finds():
    """Each part named above is a folder of the engine, and the engine's root holds no part's files."""
    for part in ("inner", "outer", "store", "mesh", "data"):
        assert (ROOT / "engine" / part / "__init__.py").is_file(), part
    flat = {p.stem for p in (ROOT / "engine").glob("*.py")}
    assert not flat & {"diloco", "compression", "outer_buffers", "parallel", "zero", "store", "etcd_store"}


def test_the_forbidden_arrow_checker_sees_one():
    graph = {"engine.inner.zero": {"engine.outer.diloco"}, "engine.outer.diloco": {"engine.mesh"}}
    assert forbidden_arrows(graph) == ["engine.inner.zero -> engine.outer.diloco"]


# The console's layers, lowest first (docs/architecture.md, "Console modules"). A module imports its own layer or
# those below it, never one above: the pure model knows no transport, a transport no host, the hosts no preflight,
# the preflight no controller, the controller no screen, and only the CLI wires the controller to the app. A part is
# a folder or a module; the longest part that names a module places it, and every console module must be placed.
CONSOLE_LAYERS: list[tuple[str, ...]] = [
    # pure: the profile, the model of the fleet and its nodes, the interface the app drives (no I/O)
    ("console", "console.profile", "console.sshconfig", "console.nodes", "console.exit_codes", "console.heartbeat",
     "console.rounds", "console.store_health", "console.fleet", "console.engine_config", "console.dependency_warnings",
     "console.etcd_pki", "console.control"),
    # one interface, two implementations: local subprocesses and asyncssh
    ("console.transport",),
    # the hosts and what runs on them: the store, etcd, the engines' commands, watchers, attaching
    ("console.hosts", "console.etcd", "console.launch", "console.watchers", "console.store", "console.attach",
     "console.recipes"),
    # before anything starts: the checks, the hosts' keys, and bringing the hosts up to the console's checkout
    ("console.preflight", "console.hostkeys", "console.sync"),
    # the controller, and the parts only it drives (a node's start, the run's stop)
    ("console.cluster", "console.node_start", "console.run_stop"),
    # what the app renders
    ("console.widgets",),
    ("console.screens",),
    ("console.app",),
    # the edge: parse arguments, build the controller and the app, run
    ("console.cli", "console.__main__"),
]


def console_layer(module: str) -> int | None:
    """The layer of the longest part naming `module`; "console" names only the package itself (its __init__)."""
    best = max(((len(part), i) for i, parts in enumerate(CONSOLE_LAYERS) for part in parts
                if (module == part if part == "console" else _in(module, part))), default=None)
    return None if best is None else best[1]


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Each console import into a higher layer than its own, as `module (layer) -> target (layer)`."""
    out = []
    for m, ts in graph.items():
        if not _in(m, "console"):
            continue
        low = console_layer(m)
        for t in ts:
            high = console_layer(t)
            if low is not None and high is not None and high > low:
                out.append(f"{m} ({low}) -> {t} ({high})")
    return sorted(out)


def test_every_console_module_has_a_layer():
    assert sorted(m for m in import_graph() if _in(m, "console") and console_layer(m) is None) == []


def test_no_console_import_runs_up_a_layer():
    assert upward_arrows(import_graph()) == []


def test_the_layer_checker_sees_an_upward_arrow():
    """The oracle: an arrow like the one this rule was written for (console/checkout.py, beside the hosts, reaching
    into the preflight's host script) is found, and the same arrow downward is not; a module no layer names is found."""
    graph = {"console.hosts": {"console.preflight.host_script"}, "console.preflight.runner": {"console.hosts"}}
    assert upward_arrows(graph) == ["console.hosts (2) -> console.preflight.host_script (3)"]
    assert console_layer("console.checkout") is None and console_layer("console") == 0
    assert console_layer("console.widgets.cells") == 5 and console_layer("console.transport.commands") == 1
