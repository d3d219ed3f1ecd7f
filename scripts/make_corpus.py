"""Build the offline corpora from CPython's standard library, which is on every machine that runs this project.

    python scripts/make_corpus.py [--out corpus/stdlib_docstrings.jsonl] [--max-bytes 1900000]
    python scripts/make_corpus.py --sources [--out corpus-large/stdlib_sources.jsonl] [--max-bytes 12000000]

The default: English prose, the docstrings of the standard library (the shipped corpus/, committed). --sources:
the standard library's own source files, one document per module (code, comments and docstrings), a second,
larger and different corpus for the learning study; scripts/setup.sh builds it into corpus-large/ (not
committed: it depends on the Python version, and any machine can rebuild it in seconds).

The text is Python's own, distributed under the PSF License Agreement (which permits redistribution). Sources
are parsed with `ast` (docstrings) or read as text, never imported, so building has no side effects. The output
is deterministic for a given Python version: modules in sorted order, one JSON line per document.
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


def sources(path: Path, module: str):
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return
    if len(text) >= MIN_CHARS:
        yield module, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sources", action="store_true", help="whole source files instead of docstrings")
    ap.add_argument("--out")
    ap.add_argument("--max-bytes", type=int)
    args = ap.parse_args()
    args.out = args.out or ("corpus-large/stdlib_sources.jsonl" if args.sources else "corpus/stdlib_docstrings.jsonl")
    args.max_bytes = args.max_bytes or (12_000_000 if args.sources else 1_900_000)
    documents = sources if args.sources else docstrings
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "lib2to3", "site-packages", "ensurepip", "turtledemo")
    files = sorted(p for p in stdlib.rglob("*.py") if not set(p.relative_to(stdlib).parts) & set(skip))
    out, size, seen = [], 0, set()
    for path in files:
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
        for name, doc in documents(path, module):
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
