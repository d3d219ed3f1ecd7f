#!/usr/bin/env bash
# Idempotent set-up of everything the project needs on a fresh Debian/Ubuntu machine:
# system packages (OpenSSH server for the SSH tests, tmux, iproute2), a virtual environment in .venv,
# torch (the CPU build, pinned, where there is no NVIDIA driver), and the project with its extras.
# Re-running it is cheap: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

say() { printf '[setup] %s\n' "$*" >&2; }

need_apt=()
for pkg in openssh-server openssh-client tmux iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing system packages: ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    say "missing system packages (install them as root): ${need_apt[*]}"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

# Install again only when the dependency list changed.
stamp="$VENV/.zeroband-setup"
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH_SPEC=${TORCH_SPEC:-torch}
else
  # the CPU build; an unpinned torch would pull a multi-GB CUDA build
  TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
fi
say "installing $TORCH_SPEC"
"$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
say "installing the project and its extras (dev, deepspeed)"
"$PY" -m pip install -q --disable-pip-version-check -e ".[dev,deepspeed]"
echo "$want" > "$stamp"
say "done"
