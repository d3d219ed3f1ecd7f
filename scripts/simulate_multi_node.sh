#!/usr/bin/env bash
# A local multi-node DiLoCo run on this machine: the membership store plus NODES nodes of WORKERS workers each.
#
#   scripts/simulate_multi_node.sh [--timeout SECONDS] [--store-port PORT] [--run-dir DIR] NODES WORKERS CONFIG [overrides...]
#   scripts/simulate_multi_node.sh 3 2 configs/debug-diloco.toml --train.max_steps=20
#
# Each node is `torchrun --standalone --nproc_per_node=WORKERS -m engine.train CONFIG` (its own local rendezvous on
# a port it binds itself) with GLOBAL_ADDR / GLOBAL_PORT / GLOBAL_UNIQUE_ID=node-<i> / GLOBAL_RANK=<i> /
# GLOBAL_WORLD_SIZE=NODES, and its own run directory (<run-dir>/node-<i>). Every line of output is prefixed with
# [store] or [node-<i>] (stdout and stderr alike, so the JSON events of every node come out in one stream).
#
# Every component runs in its own process group (setsid). Ctrl-C, SIGTERM, the timeout, or the end of the run
# stops them all: SIGTERM to each group (the engine checkpoints and exits), SIGKILL to whatever is left after a
# grace period, so no process stays behind. Exit status: 0 if every node exited 0, 124 on timeout, 130 on
# Ctrl-C, else the first failing node's status.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '4,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

timeout_s=0
store_port=""
run_dir="runs/sim"
grace_s=${SIM_GRACE_SECONDS:-15}
while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) timeout_s=${2:?--timeout needs seconds}; shift 2 ;;
    --timeout=*) timeout_s=${1#*=}; shift ;;
    --store-port) store_port=${2:?--store-port needs a port}; shift 2 ;;
    --store-port=*) store_port=${1#*=}; shift ;;
    --run-dir) run_dir=${2:?--run-dir needs a folder}; shift 2 ;;
    --run-dir=*) run_dir=${1#*=}; shift ;;
    -h|--help) usage ;;
    *) break ;;
  esac
done
[ $# -ge 3 ] || usage
nodes=$1 workers=$2 config=$3
shift 3
for v in "$nodes" "$workers" "$timeout_s"; do
  case "$v" in ''|*[!0-9]*) echo "simulate_multi_node: '$v' is not a non-negative integer" >&2; exit 2 ;; esac
done
[ "$nodes" -ge 1 ] && [ "$workers" -ge 1 ] || { echo "simulate_multi_node: NODES and WORKERS must be >= 1" >&2; exit 2; }
[ -f "$config" ] || { echo "simulate_multi_node: config file $config not found" >&2; exit 2; }

py=.venv/bin/python
torchrun=.venv/bin/torchrun
[ -x "$py" ] || py=python3
[ -x "$torchrun" ] || torchrun=torchrun

# a free port for the store, unless given. Each node's torchrun runs --standalone: its rendezvous binds port 0
# itself, so no port is picked here and taken by another process before the node binds it
[ -n "$store_port" ] || store_port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

groups=()      # process group ids (= the setsid'd leader pids) of everything started
node_pids=()
stopping=0

# run a command in its own session / process group, every output line prefixed with its name (a line the engine
# already prefixed with it, "[node-0:1] step ...", is left as it is); the prefixing sed ignores TERM/INT so that
# the engine's last lines (checkpoint, run_end) still come through on a stop
start_group() {
  local name=$1; shift
  setsid bash -c 'name=$1; shift; "$@" 2>&1 | (trap "" TERM INT; exec sed -u "/^\[$name[]:]/!s/^/[$name] /"); exit "${PIPESTATUS[0]}"' \
    _ "$name" "$@" &
  groups+=("$!")
}

alive() { kill -0 "$1" 2>/dev/null; }

# every descendant of the given pids (torchrun starts its workers in new sessions: a group kill misses them)
descendants() {
  ps -eo pid=,ppid= | awk -v roots="$*" '
    { parent[$1] = $2 }
    END { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1
          do { grew = 0; for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; grew = 1 } } while (grew)
          for (p in keep) print p }'
}

any_alive() { local p; for p in "$@"; do alive "$p" && return 0; done; return 1; }

# TERM a list of groups (and remember their whole trees), wait up to the grace period, KILL what is left
stop_groups() {
  [ $# -gt 0 ] || return 0
  local pg p deadline tree
  tree=$(descendants "$@")
  for pg in "$@"; do kill -TERM -- "-$pg" 2>/dev/null; done
  deadline=$((SECONDS + grace_s))
  # shellcheck disable=SC2086
  while any_alive $tree && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
  for pg in "$@"; do kill -KILL -- "-$pg" 2>/dev/null; done
  # shellcheck disable=SC2086
  for p in $tree; do alive "$p" && kill -KILL "$p" 2>/dev/null; done
}

# nodes first (the engine stops after its current step, checkpoints and says bye to the store), the store last
stop_all() {
  [ "$stopping" = 1 ] && return
  stopping=1
  stop_groups "${node_pids[@]}"
  stop_groups "${groups[@]}"
  wait 2>/dev/null
}

on_signal() {
  [ "$stopping" = 1 ] && return
  [ "$1" = 130 ] && echo "[sim] interrupted: stopping every node" >&2
  stop_all
  exit "$1"
}

status=0
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'stop_all' EXIT

start_group store "$py" -m engine.store --host 127.0.0.1 --port "$store_port"
store_pg=${groups[-1]}
# wait for the store to accept connections (bounded), so that no node meets a missing store
for _ in $(seq 1 150); do
  "$py" -c "import socket,sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 0.2).close()" \
    "$store_port" 2>/dev/null && break
  alive "$store_pg" || { echo "[sim] the store did not start" >&2; exit 2; }
  sleep 0.2
done

for ((i = 0; i < nodes; i++)); do
  start_group "node-$i" env GLOBAL_ADDR=127.0.0.1 GLOBAL_PORT="$store_port" GLOBAL_UNIQUE_ID="node-$i" \
    GLOBAL_RANK="$i" GLOBAL_WORLD_SIZE="$nodes" PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    "$torchrun" --nnodes=1 --nproc_per_node="$workers" --standalone \
    -m engine.train "$config" --run.dir="$run_dir/node-$i" --diloco.min_nodes="$nodes" "$@"
  node_pids+=("${groups[-1]}")
done

start=$SECONDS
while :; do
  running=0
  for pid in "${node_pids[@]}"; do alive "$pid" && running=1; done
  [ $running = 0 ] && break
  if [ "$timeout_s" -gt 0 ] && [ $((SECONDS - start)) -ge "$timeout_s" ]; then
    echo "[sim] timeout after ${timeout_s}s: stopping every node" >&2
    stop_all
    exit 124
  fi
  sleep 0.5
done
for pid in "${node_pids[@]}"; do
  wait "$pid"; rc=$?
  [ $status = 0 ] && [ $rc != 0 ] && status=$rc
done
stop_all
exit $status
