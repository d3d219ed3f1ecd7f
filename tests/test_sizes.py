"""The house's sizes (issue 42): no class in the engine or the console over 350 lines and no function over 80,
counted from the `class`/`def` line to the last line of its body."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "console")
MAX_CLASS, MAX_FUNCTION = 350, 80


def oversized(source: str, where: str) -> list[str]:
    """`where:line kind name lines` for each class over MAX_CLASS and each function over MAX_FUNCTION lines."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "def", MAX_FUNCTION
        else:
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > limit:
            found.append(f"{where}:{node.lineno} {kind} {node.name} {lines}")
    return found


def test_no_class_or_function_of_the_engine_or_the_console_is_oversized():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    found = [hit for p in files for hit in oversized(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert found == []


def test_the_size_checker_sees_both_sides_of_each_limit():
    """The oracle: 80 lines of function and 350 of class pass, one more line fails."""
    def function(lines: int) -> str:
        return "def f():\n" + "    x = 1\n" * (lines - 1)

    def klass(lines: int) -> str:
        return "class C:\n" + "    x = 1\n" * (lines - 1)

    assert oversized(function(80), "a.py") == [] and oversized(function(81), "a.py") == ["a.py:1 def f 81"]
    assert oversized(klass(350), "b.py") == [] and oversized(klass(351), "b.py") == ["b.py:1 class C 351"]
