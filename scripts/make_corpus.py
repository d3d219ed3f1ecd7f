"""Build corpus/: English text for offline training runs, from the docstrings of CPython's standard library.

The text is Python's own documentation, distributed under the PSF License Agreement (which permits
redistribution). Sources are parsed with `ast`, never imported, so building has no side effects. The output is
deterministic for a given Python version: modules in sorted order, one JSON line per docstring.

    python scripts/make_corpus.py [--out corpus/stdlib_docstrings.jsonl] [--max-bytes 1900000]
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

MIN_CHARS = 200  # shorter docstrings are mostly signatures, not prose


def docstrings(path: Path, module: str):
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    nodes = [(module, tree)] + [(f"{module}.{n.name}", n) for n in ast.walk(tree)
                                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    for name, node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc and len(doc) >= MIN_CHARS:
            yield name, doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="corpus/stdlib_docstrings.jsonl")
    ap.add_argument("--max-bytes", type=int, default=1_900_000)
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo")
    files = sorted(p for p in stdlib.rglob("*.py") if not set(p.relative_to(stdlib).parts) & set(skip))
    out, size, seen = [], 0, set()
    for path in files:
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
        for name, doc in docstrings(path, module):
            if doc in seen:
                continue
            line = json.dumps({"text": doc, "source": f"cpython:{name}"}, ensure_ascii=False)
            if size + len(line.encode()) + 1 > args.max_bytes:
                break
            seen.add(doc)
            out.append(line)
            size += len(line.encode()) + 1
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(out) + "\n", encoding="utf-8")
    print(f"{args.out}: {len(out)} documents, {size} bytes")


if __name__ == "__main__":
    main()
