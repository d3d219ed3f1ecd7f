"""Launch recipes: `python -m console.recipes KIND ... --output FILE` writes one file a user would otherwise hand-write.

    python -m console.recipes deepspeed --zero-stage 2 --offload-optimizer --bf16 --output configs/ds_zero2.json
    python -m console.recipes fsdp --sharding FULL_SHARD --mixed-precision bf16 --output configs/fsdp.json
    python -m console.recipes launcher profiles/lab.toml --node-rank 1 --output scripts/run_node1.sh
    python -m console.recipes slurm profiles/lab.toml --nodes 4 --gpus-per-node 8 --time 48:00:00 --output job.sbatch
    python -m console.recipes hostfile profiles/lab.toml --output hostfile

What each file is:

    deepspeed  the DeepSpeed JSON config engine/inner/zero.py passes to deepspeed.initialize for those settings (same
               builder, engine/inner/deepspeed_config.py), with batch sizes from an engine config (--config, default the
               engine's defaults) and buckets sized from its model's hidden size (engine/presets.py)
    fsdp       an FSDP2 description in the accelerate/transformers `fsdp_config` vocabulary, plus the engine
               overrides that select the same layout (`engine_overrides`, "section.key": value)
    launcher   a bash script for one profile host (node rank N among the hosts that are not standby): the same
               environment and command line the console uses (console/launch.py), and the store on the host
               that runs it
    slurm      an sbatch script: the store on the first node of `scontrol show hostnames`, then `srun` runs one
               torchrun per node. --layout diloco (default): every node is a DiLoCo node with its own torchrun
               group; --layout global: one torchrun world over all nodes (c10d rendezvous on the first node),
               one DiLoCo node, for FSDP/ZeRO across nodes. NCCL's multi-node variables are set
    hostfile   DeepSpeed's `HOST slots=N` lines, one per host that is not standby

Profiles are read by console/profile.py (one parser for the console and these recipes). Every value that
reaches a shell script goes through shlex.quote. No secrets are written: identity files, ssh users and jump
hosts never appear, and an environment variable whose name contains TOKEN, SECRET, PASSW, KEY, PRIVATE, CREDENTIAL
or AUTH (in any case) is required from the launching environment instead of being copied into the file. An existing
output is never replaced unless --force.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

# a name that contains one of these, in any case, is a credential (DB_KEY, SSH_KEYFILE, hf_token...); the docs say
# exactly this list (docs/strategies.md, tests/test_console_inputs.py)
SECRET_WORDS = ("TOKEN", "SECRET", "PASSW", "KEY", "PRIVATE", "CREDENTIAL", "AUTH")
SECRET_NAME = re.compile("|".join(SECRET_WORDS), re.IGNORECASE)
SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d{2}){0,2}")
HOSTFILE_LINE = re.compile(r"(\S+) slots=(\d+)")
# what a multi-node NCCL job needs, unless the environment or the profile already says otherwise
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # a dead peer fails the collective instead of hanging the job
    "NCCL_DEBUG": "WARN",
    "NCCL_IB_DISABLE": "0",  # use InfiniBand where the nodes have it
    "NCCL_SOCKET_FAMILY": "AF_INET",
}
q = shlex.quote


# -- writing -----------------------------------------------------------------------------------------------

def write_output(path: str, text: str, force: bool, executable: bool = False) -> Path:
    out = Path(path)
    if out.exists() and not force:
        raise ValueError(f"--output: {out} exists (refusing to overwrite; add --force)")
    if out.parent and not out.parent.is_dir():
        out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    if executable:
        tmp.chmod(0o755)
    os.replace(tmp, out)
    return out


# -- deepspeed and fsdp configs ----------------------------------------------------------------------------

def deepspeed_json(stage: int, offload_optimizer: bool, offload_params: bool, precision: str,
                   config_path: str | None, workers: int) -> dict[str, Any]:
    # the engine's own builder and shapes, from its torch-free modules (the console never imports torch)
    from engine.config import grad_accum_steps, load_config
    from engine.inner.deepspeed_config import deepspeed_config
    from engine.presets import hidden_size
    if workers < 1:
        raise ValueError(f"--workers: {workers} is not a positive number of processes per node")
    cfg = load_config(config_path, ["--data.fake=true"])  # the data source plays no part in a DeepSpeed config
    accum = grad_accum_steps(cfg.train, workers, source=config_path or "engine defaults")
    hidden = hidden_size(cfg.model)  # sizes the communication buckets
    return deepspeed_config(stage, micro_batch_size=cfg.train.micro_batch_size, grad_accum=accum,
                            precision=precision, clip_norm=cfg.optim.clip_norm,
                            offload_optimizer=offload_optimizer, offload_params=offload_params, hidden_size=hidden)


def fsdp_json(sharding: str, mixed_precision: str, cpu_offload: bool) -> dict[str, Any]:
    """FSDP2 in accelerate's words, and the engine overrides for the same layout (NO_SHARD is DDP)."""
    if sharding == "NO_SHARD" and cpu_offload:
        raise ValueError("--cpu-offload: needs sharding FULL_SHARD or SHARD_GRAD_OP (NO_SHARD runs DDP)")
    precision = {"bf16": "bf16-mixed", "no": "fp32"}[mixed_precision]
    engine: dict[str, Any] = {"inner.strategy": "ddp" if sharding == "NO_SHARD" else "fsdp",
                              "train.precision": precision}
    if sharding != "NO_SHARD":
        engine["inner.reshard_after_forward"] = sharding == "FULL_SHARD"
        engine["inner.cpu_offload"] = cpu_offload
    fsdp_config = {
        "fsdp_version": 2,
        "fsdp_sharding_strategy": sharding,
        "fsdp_reshard_after_forward": sharding == "FULL_SHARD",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",  # engine.inner.ddp_fsdp shards each decoder layer
        "fsdp_offload_params": cpu_offload,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",  # what engine/checkpoint.py writes through DCP
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": False,
    }
    return {"distributed_type": "FSDP" if sharding != "NO_SHARD" else "MULTI_GPU",
            "mixed_precision": mixed_precision, "fsdp_config": fsdp_config, "engine_overrides": engine}


# -- profile-driven scripts --------------------------------------------------------------------------------

def _load_profile(path: str):
    from console.profile import load_profile  # the console's parser: one reading of a profile
    return load_profile(path)


def env_lines(env: dict[str, str], where: str) -> list[str]:
    """`export K=V` lines; a credential-like name is required from the environment, never written."""
    from console.profile import ENV_NAME

    lines = []
    for key, value in env.items():
        if not ENV_NAME.fullmatch(key):
            raise ValueError(f"{where}: env: {key!r} is not a valid environment variable name")
        if SECRET_NAME.search(key):
            lines.append(f': "${{{key}:?{key} must be set in the environment (not written into this file)}}"')
            lines.append(f"export {key}")
        else:
            lines.append(f"export {key}={q(value)}")
    return lines


def _node_index(profile, node_rank: int):
    hosts = profile.active_hosts()
    if not 0 <= node_rank < len(hosts):
        names = ", ".join(f"{i}={h.name}" for i, h in enumerate(hosts))
        raise ValueError(f"--node-rank: {node_rank} is not a node of {profile.path} ({names})")
    return hosts[node_rank], len(hosts)


def launcher_script(profile, node_rank: int, source: str) -> str:
    from console.launch import engine_argv
    from console.store.tcp import store_argv
    from console.engine_config import data_shard, engine_env
    from console.transport.commands import qpath
    host, world = _node_index(profile, node_rank)
    env = engine_env(profile, host, *data_shard(profile, host.name))  # the console's shard, standbys counted
    node_dir = f"{profile.run.dir.rstrip('/')}/{host.name}"
    lines = [
        "#!/usr/bin/env bash",
        f"# Generated by: python -m console.recipes launcher {q(source)} --node-rank {node_rank}",
        f"# Node {node_rank} of {world}: host {host.name}. Events (JSON lines) go to {node_dir}/events.jsonl,",
        "# progress lines to stderr. Ctrl-C (SIGINT) stops after the current step with a checkpoint.",
        "set -euo pipefail",
        f"cd {qpath(host.workdir)}",
        *env_lines(env, f"{source}: hosts.{host.name}"),
        f"mkdir -p {q(node_dir)}",
    ]
    if profile.store_host.name == host.name:
        lines += [
            "# this host runs the membership store every node dials; it ends with this script. setsid: Ctrl-C",
            "# stops the engine (which still says goodbye to the store), not the store",
            f"setsid {' '.join(q(a) for a in store_argv(profile))} &",
            "store_pid=$!",
            'trap \'kill "$store_pid" 2>/dev/null || true\' EXIT',
        ]
    lines.append(f"{' '.join(q(a) for a in engine_argv(profile, host))} > {q(node_dir + '/events.jsonl')}")
    return "\n".join(lines) + "\n"


def hostfile_text(profile) -> str:
    lines = []
    for host in profile.active_hosts():
        address = host.address or host.target
        lines.append(f"{address} slots={host.workers}")
    return "\n".join(lines) + "\n"


def parse_hostfile(text: str) -> dict[str, int]:
    """DeepSpeed's format, read back (blank lines and # comments allowed)."""
    out = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = HOSTFILE_LINE.fullmatch(line)
        if not m:
            raise ValueError(f"hostfile:{n}: expected 'HOST slots=N', got {raw!r}")
        out[m.group(1)] = int(m.group(2))
    return out


SBATCH_WORD = re.compile(r"[A-Za-z0-9._-]+")  # #SBATCH lines are read by sbatch, not a shell: no quoting there


def _sbatch_word(value: str, flag: str) -> str:
    if not SBATCH_WORD.fullmatch(value):
        raise ValueError(f"{flag}: {value!r} must be letters, digits, '.', '_' or '-' (it goes on an #SBATCH line)")
    return value


def _slurm_engine_args(profile, host, layout: str, nodes: int) -> list[str]:
    """The engine command line words after `-m engine.train`, with the node's name left to the shell."""
    from console.profile import engine_overrides, override_args
    overrides = {**engine_overrides(profile, host), "run.name": profile.run.name}
    if layout == "diloco":  # the job's nodes are the DiLoCo nodes; the first outer step waits for all of them
        overrides.update({"diloco.enabled": True, "diloco.min_nodes": nodes})
    words = [q(profile.engine.config), *(q(word) for word in override_args(overrides))]
    node_dir = q(profile.run.dir.rstrip("/")) + '/"$NODE_NAME"'
    return [*words, f"--run.dir={node_dir}", f"--mesh.drain_file={node_dir}/drain"]


def slurm_script(profile, source: str, *, nodes: int, gpus_per_node: int, time: str, layout: str,
                 partition: str | None, account: str | None, rdzv_port: int) -> str:
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"--nodes/--gpus-per-node: {nodes}/{gpus_per_node} must be positive")
    if not SLURM_TIME.fullmatch(time):
        raise ValueError(f"--time: {time!r} is not a SLURM time (e.g. 48:00:00 or 2-00:00:00)")
    host = profile.store_host  # SLURM nodes are alike: python, workdir, env and overrides come from this host
    from console.transport.commands import qpath
    py = q(host.python_path)
    if layout == "diloco":  # each node its own torchrun group; nodes meet in the DiLoCo mesh through the store
        rdzv = ["--standalone"]
        node_env = ['export GLOBAL_UNIQUE_ID="$NODE_NAME-$SLURM_JOB_ID"', 'export GLOBAL_RANK="$SLURM_NODEID"',
                    'export GLOBAL_WORLD_SIZE="$SLURM_NNODES"']
    else:  # one torchrun world over every node: FSDP/ZeRO across nodes, one DiLoCo node
        rdzv = ['--nnodes="$SLURM_NNODES"', '--node-rank="$SLURM_NODEID"', "--rdzv-backend=c10d",
                f'--rdzv-endpoint="$HEAD_NODE":{rdzv_port}', '--rdzv-id="$SLURM_JOB_ID"']
        node_env = ['export GLOBAL_UNIQUE_ID="job-$SLURM_JOB_ID"', "export GLOBAL_RANK=0", "export GLOBAL_WORLD_SIZE=1"]
    per_node = "\n".join([
        "set -euo pipefail",
        'NODE_NAME="$(hostname -s)"',
        *node_env,
        f'mkdir -p {q(profile.run.dir.rstrip("/"))}/"$NODE_NAME"',
        f"exec {py} -m torch.distributed.run {' '.join(rdzv)} --nproc_per_node={gpus_per_node} -m engine.train "
        f"{' '.join(_slurm_engine_args(profile, host, layout, nodes))} "
        f'> {q(profile.run.dir.rstrip("/"))}/"$NODE_NAME"/events.jsonl',
    ])
    directives = [f"--job-name={_sbatch_word(profile.run.name, 'run.name')}", f"--nodes={nodes}",
                  "--ntasks-per-node=1", f"--gpus-per-node={gpus_per_node}", f"--time={time}",
                  "--output=slurm-%x-%j.out"]
    if partition:
        directives.append(f"--partition={_sbatch_word(partition, '--partition')}")
    if account:
        directives.append(f"--account={_sbatch_word(account, '--account')}")
    nccl = [f'export {k}="${{{k}:-{v}}}"' for k, v in NCCL_DEFAULTS.items()]
    if "NCCL_SOCKET_IFNAME" not in host.env:
        nccl.append("# export NCCL_SOCKET_IFNAME=ib0   # the interface between nodes, when NCCL picks the wrong one")
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        f"# Generated by: python -m console.recipes slurm {q(source)} --nodes {nodes} --gpus-per-node {gpus_per_node}"
        f" --time {time} --layout {layout}",
        "# Submit with sbatch. The batch step runs on the first node: it starts the membership store there, then",
        "# srun starts one torchrun per node; every node writes RUN_DIR/NODE/events.jsonl.",
        "set -euo pipefail",
        f"cd {qpath(host.workdir)}",
        'HEAD_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "export HEAD_NODE",
        *nccl,
        *env_lines(dict(host.env), f"{source}: hosts.{host.name}"),
        'export GLOBAL_ADDR="$HEAD_NODE"',
        f"export GLOBAL_PORT={profile.store.port}",
        "export PYTHONUNBUFFERED=1",
        f'{py} -m engine.store --host "$HEAD_NODE" --port {profile.store.port} &',
        "store_pid=$!",
        'trap \'kill "$store_pid" 2>/dev/null || true\' EXIT',
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c {q(per_node)}",
    ]
    return "\n".join(lines) + "\n"


# -- command line ------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m console.recipes", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="kind", required=True)

    def add(name: str, help_: str, profile: bool = False) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        if profile:
            sp.add_argument("profile", help="a console profile (profiles/*.toml)")
        sp.add_argument("--output", required=True, help="the file to write")
        sp.add_argument("--force", action="store_true", help="replace an existing output file")
        return sp

    ds = add("deepspeed", "a DeepSpeed JSON config for ZeRO stage 1, 2 or 3")
    ds.add_argument("--zero-stage", type=int, required=True, choices=(1, 2, 3))
    ds.add_argument("--offload-optimizer", action="store_true")
    ds.add_argument("--offload-params", action="store_true", help="stage 3 only")
    prec = ds.add_mutually_exclusive_group()
    prec.add_argument("--bf16", action="store_true")
    prec.add_argument("--fp16", action="store_true")
    ds.add_argument("--config", help="engine TOML for batch sizes and clipping (default: engine defaults)")
    ds.add_argument("--workers", type=int, default=1, help="processes per node (for gradient accumulation)")
    fs = add("fsdp", "an FSDP2 config and the engine overrides for it")
    fs.add_argument("--sharding", required=True, choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"))
    fs.add_argument("--mixed-precision", default="no", choices=("bf16", "no"))
    fs.add_argument("--cpu-offload", action="store_true")
    ln = add("launcher", "a bash script that starts one profile host by hand", profile=True)
    ln.add_argument("--node-rank", type=int, required=True, help="index among the profile's non-standby hosts")
    sl = add("slurm", "an sbatch script: srun over torchrun on every node", profile=True)
    sl.add_argument("--nodes", type=int, required=True)
    sl.add_argument("--gpus-per-node", type=int, required=True)
    sl.add_argument("--time", required=True, help="wall-clock limit, e.g. 48:00:00")
    sl.add_argument("--layout", default="diloco", choices=("diloco", "global"))
    sl.add_argument("--partition")
    sl.add_argument("--account")
    sl.add_argument("--rdzv-port", type=int, default=29500, help="torchrun rendezvous port (--layout global)")
    add("hostfile", "a DeepSpeed hostfile", profile=True)
    return p


def generate(args: argparse.Namespace) -> tuple[str, bool]:
    """(file text, executable) for the parsed command line."""
    if args.kind == "deepspeed":
        precision = "bf16-mixed" if args.bf16 else "fp16-mixed" if args.fp16 else "fp32"
        cfg = deepspeed_json(args.zero_stage, args.offload_optimizer, args.offload_params, precision,
                             args.config, args.workers)
        return json.dumps(cfg, indent=2) + "\n", False
    if args.kind == "fsdp":
        return json.dumps(fsdp_json(args.sharding, args.mixed_precision, args.cpu_offload), indent=2) + "\n", False
    profile = _load_profile(args.profile)
    if args.kind == "launcher":
        return launcher_script(profile, args.node_rank, args.profile), True
    if args.kind == "slurm":
        return slurm_script(profile, args.profile, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                            time=args.time, layout=args.layout, partition=args.partition, account=args.account,
                            rdzv_port=args.rdzv_port), True
    return hostfile_text(profile), False


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        text, executable = generate(args)
        out = write_output(args.output, text, args.force, executable)
    except ValueError as e:  # ConfigError and ProfileError are ValueErrors too: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
