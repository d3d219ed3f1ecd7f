"""The console runs without torch: no file under console/ imports torch, transformers or deepspeed (not even
inside a function), and every console module imports, with every engine module the console names, in a Python
where those three packages cannot be imported. What needs torch runs on the engine side (engine/presets.py and
engine/inner/deepspeed_config.py are the torch-free pieces the console reads; the store probe runs as a process)."""

from __future__ import annotations

import ast
import json
import subprocess
import textwrap
from pathlib import Path

from procs import PYTHON, ROOT

TORCH_SIDE = ("torch", "transformers", "deepspeed")

# runs in a fresh interpreter: a finder first on sys.meta_path refuses the torch side, then every module is imported
CHECK = textwrap.dedent("""\
    import importlib, json, sys, traceback

    BLOCKED = set(sys.argv[1].split(","))

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is blocked: the console must import without it")
            return None

    sys.meta_path.insert(0, Refuse())
    failed = {}
    for name in BLOCKED:  # the oracle: the finder really refuses them
        try:
            importlib.import_module(name)
            failed[name] = "imported although blocked"
        except ImportError:
            pass
    for name in sys.argv[2:]:
        try:
            importlib.import_module(name)
        except BaseException:
            failed[name] = traceback.format_exc(limit=-3)
    print(json.dumps(failed))
    """)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str) -> set[str]:
    """Every absolute module an import statement names, at module level or inside a function; `from a import b`
    names both a and a.b (b may be a submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def torch_side(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in TORCH_SIDE}


def console_files() -> list[Path]:
    return sorted((ROOT / "console").rglob("*.py"))


def engine_modules_named_by_the_console() -> set[str]:
    """The engine modules the console imports (a `from engine.x import name` counts as engine.x, and as
    engine.x.name where that is a module)."""
    names = set().union(*(imported_modules(p.read_text()) for p in console_files()))
    return {n for n in names if n.split(".")[0] == "engine" and _is_module(n)}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def test_no_console_file_imports_the_torch_side():
    found = {str(p.relative_to(ROOT)): sorted(torch_side(imported_modules(p.read_text()))) for p in console_files()}
    assert {path: names for path, names in found.items() if names} == {}


def test_the_console_and_the_engine_modules_it_names_import_without_torch():
    # __main__ modules run the program when imported; their imports are checked statically above
    console = [module_name(p) for p in console_files() if p.stem != "__main__"]
    engine = sorted(engine_modules_named_by_the_console())
    assert "engine.telemetry" in engine and "engine.config" in engine  # the collector sees what the console uses
    done = subprocess.run([PYTHON, "-c", CHECK, ",".join(TORCH_SIDE), *console, *engine], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.splitlines()[-1])
    assert failed == {}, "\n".join(f"{name}:\n{trace}" for name, trace in failed.items())


def test_the_checker_sees_lazy_and_submodule_imports():
    """The oracle itself: an import inside a function, and a `from` import of a submodule, are both found."""
    source = "def f():\n    import torch.distributed as dist\n\ndef g():\n    from transformers import AutoConfig\n"
    assert torch_side(imported_modules(source)) == {"torch.distributed", "transformers", "transformers.AutoConfig"}
    assert imported_modules("from engine.store import probe") == {"engine.store", "engine.store.probe"}
    assert _is_module("engine.store.probe") and not _is_module("engine.config.load_config")
