#!/usr/bin/env bash
# Rewrite requirements.lock: the exact versions of the project's Python dependencies (with the extras setup.sh
# installs), which scripts/setup.sh installs with `pip install -c requirements.lock` (docs/operations.md,
# "Dependencies and the lock").
#
#   scripts/lock.sh              resolve again: the newest versions pyproject.toml allows (minutes)
#   scripts/lock.sh --from VENV  lock what VENV has installed (a venv the suite has just passed with)
#
# The first makes a venv in a temporary folder, installs torch's CPU build there as setup.sh does (torch decides
# some versions of what it shares with the project), then the project's requirements without the lock (pip as
# configured here: its indexes, its constraints), writes what was installed and removes the venv. Either way torch
# is left out, and so is what only torch needs (sympy, networkx, the CUDA build's nvidia-* wheels): setup.sh picks
# torch by the host's driver, and its own dependencies with it. Then run the whole suite (scripts/test.sh) and
# commit the new lock only if it passes.
#
# Environment: PYTHON (the interpreter the throwaway venv is made from), TORCH_VERSION, TORCH_SPEC, TORCH_CPU_INDEX
# (as in setup.sh), TMPDIR (where the throwaway venv goes).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_SPEC=${TORCH_SPEC:-torch==$TORCH_VERSION+cpu}
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
EXTRAS=dev,deepspeed  # setup.sh's: pip install -e ".[dev,deepspeed]"
LOCK=requirements.lock

say() { printf '[lock] %s\n' "$*" >&2; }

from=""
case "${1:-}" in
  "") ;;
  --from)
    from=${2:-}
    if [ -z "$from" ] || [ ! -x "$from/bin/python" ]; then
      say "--from: '${from}' is not a venv (no ${from:-VENV}/bin/python)"
      exit 2
    fi
    if [ $# -gt 2 ]; then
      say "unexpected argument after --from $from: '$3' (usage: scripts/lock.sh [--from VENV])"
      exit 2
    fi
    ;;
  *) say "unknown argument '$1' (usage: scripts/lock.sh [--from VENV])"; exit 2 ;;
esac

tmp=$(mktemp -d "${TMPDIR:-/tmp}/zeroband-lock.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
if [ -n "$from" ]; then
  py="$from/bin/python"
  made="scripts/lock.sh --from $from"
else
  say "making a throwaway venv in $tmp"
  "$PYTHON" -m venv "$tmp/venv"
  py="$tmp/venv/bin/python"
  pip=("$py" -m pip install -q --disable-pip-version-check)
  say "installing $TORCH_SPEC"
  if ! first=$("${pip[@]}" "$TORCH_SPEC" 2>&1); then
    say "pip's configured indexes do not offer $TORCH_SPEC: trying the PyTorch CPU index $TORCH_CPU_INDEX"
    if ! "${pip[@]}" --index-url "$TORCH_CPU_INDEX" "$TORCH_SPEC"; then
      say "the first try said: $first"
      exit 1
    fi
  fi
  # the project's requirements, not the project: nothing is built in this checkout
  mapfile -t wanted < <("$py" -c '
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + [r for e in sys.argv[1].split(",") for r in project["optional-dependencies"][e]]:
    print(req)' "$EXTRAS")
  say "installing the newest versions of ${#wanted[@]} requirements (extras $EXTRAS) without the lock"
  "${pip[@]}" "${wanted[@]}"
  made="scripts/lock.sh"
fi

# What the project needs, walked from pyproject.toml through each installed package's requirements (their markers
# and extras as pip reads them), torch not entered: name==version of each, sorted as pip freeze sorts.
"$py" - "$EXTRAS" > "$tmp/pins" <<'PYEOF'
import importlib.metadata as md
import re
import sys
import tomllib
try:
    from packaging.requirements import Requirement
except ImportError:  # a venv without packaging: pip's copy
    from pip._vendor.packaging.requirements import Requirement

def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = sys.argv[1].split(",")
roots = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
dists = {}
for d in md.distributions():
    dists.setdefault(canon(d.metadata["Name"]), d)  # the first on sys.path: the one an import finds
OUT = {"torch"}  # setup.sh picks it, by the driver
TOOLS = {"pip", "setuptools", "wheel", "distribute"}  # the venv's own, as pip freeze leaves them out

def wanted(req, extras_of_parent):
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in ("", *extras_of_parent))

pinned, seen, todo = {}, set(), [(Requirement(r), ()) for r in roots]
while todo:
    req, parent_extras = todo.pop()
    name = canon(req.name)
    if name in OUT or not wanted(req, parent_extras) or (name, frozenset(req.extras)) in seen:
        continue
    seen.add((name, frozenset(req.extras)))
    if name not in dists:
        sys.exit(f"{req.name} is required (by {req}) but not installed in {sys.prefix}: install the project first")
    dist = dists[name]
    if name not in TOOLS:
        pinned[name] = f"{dist.metadata['Name']}=={dist.version}"
    todo += [(Requirement(r), tuple(req.extras)) for r in dist.requires or []]
left = sorted(f"{d.metadata['Name']} {d.version}" for n, d in dists.items()
              if n not in pinned and n not in TOOLS and n != canon(project["name"]))
print("\n".join(sorted(pinned.values(), key=lambda pin: pin.split("==")[0].lower())))
print("[lock] left out: " + (", ".join(left) or "nothing"), file=sys.stderr)
PYEOF

pyver=$("$py" -c 'import platform, sys; print(f"{platform.python_version()} ({sys.platform}, {platform.machine()})")')
{
  echo "# The exact versions of the Python packages the test suite passed with: the project's dependencies and those"
  echo "# of its extras $EXTRAS, and theirs. scripts/setup.sh installs with \`pip install -c $LOCK ...\`: pip"
  echo "# installs only what is asked for, at these versions. torch is not here: setup.sh picks it (by the host's"
  echo "# driver), and what only torch needs comes with it."
  echo "# Made $(date -u '+%Y-%m-%d %H:%M UTC') with Python $pyver by: $made"
  echo "# New releases: scripts/lock.sh, then scripts/test.sh; commit the new lock only if every test passed."
  cat "$tmp/pins"
} > "$tmp/lock"
mv "$tmp/lock" "$LOCK"
say "wrote $LOCK: $(grep -c '==' "$LOCK") packages"
