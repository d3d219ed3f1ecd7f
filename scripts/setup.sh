#!/usr/bin/env bash
# Idempotent set-up of everything the project needs on a fresh Debian/Ubuntu machine:
# system packages (OpenSSH server for the SSH tests, tmux, iproute2 and nftables for the chaos lab's network
# namespaces and packet loss, etcd-server for the etcd store backend and its tests), a virtual environment in .venv,
# torch (the CPU build, pinned, where there is no NVIDIA driver), and the project with its extras at the versions of
# requirements.lock (the ones the suite passed with: pip's -c takes only what the project asks for, at those versions;
# scripts/lock.sh rewrites it). Re-running it is cheap: each step is skipped when already done.
#
# Environment: PYTHON (the interpreter the venv is made from), VENV (default .venv; a leading ~ is $HOME),
# TORCH_VERSION (default 2.13.0: the CPU build of it where there is no NVIDIA driver, PyPI's CUDA build where there
# is), TORCH_SPEC (pip's spec, instead), FORCE=1 (install again even when the venv's stamp says it is up to date), and
# BASE_SITE: a site-packages folder on this machine that already has the project's packages (another venv of this
# project, a shared image). The venv then sees them through a .pth file instead of downloading them again.
# APT_EXTRA: more system packages, installed the same way (scripts/test.sh adds the tests' own).
# `zeroband-console PROFILE sync` runs this on each host with FORCE=1, the console's torch version and the profile's
# [sync] setup_env (docs/operations.md, "Before the first run").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
case "$VENV" in "~" | "~/"*) VENV="$HOME${VENV#\~}" ;; esac
case "$PYTHON" in "~/"*) PYTHON="$HOME${PYTHON#\~}" ;; esac
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
LOCK=requirements.lock

say() { printf '[setup] %s\n' "$*" >&2; }

if [ ! -s "$LOCK" ]; then  # a tracked file: sync sends it with the rest; without it pip would take any version
  say "$PWD/$LOCK is missing or empty: restore it (git checkout -- $LOCK) or make it with scripts/lock.sh"
  exit 1
fi

need_apt=()
for pkg in openssh-server openssh-client tmux iproute2 nftables etcd-server ${APT_EXTRA:-}; do
  # installed, not merely known: a removed package keeps a "deinstall ok config-files" status that dpkg -s accepts
  # (and a held one reads "hold ok installed": the installed state alone is asked for)
  [ "$(dpkg-query -W -f '${db:Status-Status}' "$pkg" 2>/dev/null)" = installed ] || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing system packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
    if [[ " ${need_apt[*]} " == *" etcd-server "* ]] && command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
      # the package also starts a system etcd on localhost:2379; the console and the tests run their own members
      systemctl disable --now etcd >/dev/null 2>&1 || say "could not stop the system etcd service (it holds localhost:2379)"
    fi
  else
    say "missing system packages (install them as root): ${need_apt[*]}"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv ${BASE_SITE:+--without-pip} "$VENV"
fi
PY="$VENV/bin/python"

# The second, larger corpus (the standard library's sources) for bench/learning.py: built here, never downloaded.
if [ ! -s corpus-large/stdlib_sources.jsonl ]; then
  say "building corpus-large/ from this Python's standard library"
  "$PY" scripts/make_corpus.py --sources >/dev/null
fi

# Install again only when the dependency list or the lock changed (console/preflight/host_script.py's setup_digest is this
# digest: sync compares the two to decide whether a host's venv is stale).
stamp="$VENV/.zeroband-setup"
want=$(sha256sum pyproject.toml "$LOCK" scripts/setup.sh | sha256sum | cut -c1-16)
if [ -z "${FORCE:-}" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if [ -n "${BASE_SITE:-}" ]; then
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$BASE_SITE" > "$site/zeroband-base.pth"
  # the distributions' metadata, not an import: importing torch takes seconds and proves no more here
  if missing=$("$PY" - <<'PYEOF'
import importlib.metadata as m
need = ("torch", "transformers", "pydantic", "tomlkit", "numpy", "psutil", "tqdm", "textual", "asyncssh", "httpx")
gone = []
for name in need:
    try:
        m.version(name)
    except m.PackageNotFoundError:
        gone.append(name)
print(" ".join(gone))
PYEOF
  ) && [ -z "$missing" ]; then
    say "using the packages of $BASE_SITE"
    echo "$want" > "$stamp"
    say "done"
    exit 0
  fi
  say "BASE_SITE=$BASE_SITE lacks: ${missing:-?} (unset BASE_SITE to install into $VENV from the registry)"
  exit 1
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH_SPEC=${TORCH_SPEC:-torch==$TORCH_VERSION}  # PyPI's build of a version is the CUDA one on Linux
  # pip takes an installed 2.13.0+cpu for torch==2.13.0 (the local label matches): the CPU build goes first
  if "$PY" -c 'import importlib.metadata as m, sys; sys.exit(0 if m.version("torch").endswith("+cpu") else 1)' \
      2>/dev/null; then
    say "removing torch's CPU build: this host has an NVIDIA driver"
    "$PY" -m pip uninstall -y -q torch
  fi
  say "installing $TORCH_SPEC"
  "$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
else
  # The CPU build, named by its local label: PyPI's plain torch==2.13.0 is the CUDA build on Linux (GBs of nvidia-*
  # wheels). Asked first of what pip is configured with (a local wheel folder, a mirror), then of the PyTorch CPU
  # index, which holds CPU builds only (and their dependencies).
  TORCH_SPEC=${TORCH_SPEC:-torch==$TORCH_VERSION+cpu}
  TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
  say "installing $TORCH_SPEC"
  if ! first=$("$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" 2>&1); then
    say "pip's configured indexes do not offer $TORCH_SPEC: trying the PyTorch CPU index $TORCH_CPU_INDEX"
    if ! "$PY" -m pip install -q --disable-pip-version-check --index-url "$TORCH_CPU_INDEX" "$TORCH_SPEC"; then
      say "the first try said: $first"
      exit 1
    fi
  fi
fi
# torch's own dependencies came with it; the lock brings those it shares with the project to the locked versions
say "installing the project and its extras (dev, deepspeed) at the versions of $LOCK"
"$PY" -m pip install -q --disable-pip-version-check -c "$LOCK" -e ".[dev,deepspeed]"
echo "$want" > "$stamp"
say "done"
