"""What the console runs on a host for an engine: its command line. Pure functions of the profile
(console/node_start.py starts it; `python -m console.recipes launcher` writes the same lines into a script). The
engine's environment is console/engine_config.py's (data_shard, engine_env): the profile check loads each engine's
config with it.

    engine_argv(profile, host, fresh)           python -m engine.train CONFIG --k=v ... (or torch.distributed.run)

The store's own command lines are its backend's (console/store/tcp.py: store_argv, probe_argv).
"""

from __future__ import annotations

from console.profile import HostSpec, Profile, engine_overrides, override_args
from console.store import store_backend
from console.transport import commands as C


def engine_argv(profile: Profile, host: HostSpec, fresh: bool = False) -> list[str]:
    """`python -m engine.train CONFIG --k=v ...` (torch.distributed.run when the host runs several workers)."""
    node_dir = C.join(profile.run.dir, host.name)
    # ckpt.resume=auto: a node restarted (or added back) continues from its own last checkpoint, and a DiLoCo
    # joiner then takes the run's state anyway. A fresh start() moves the previous run's folders aside, and starts
    # each engine without it: checkpoints kept elsewhere (ckpt.dir) were resumed, the old run silently continued;
    # the engine moves them aside too
    resume = {} if fresh else {"ckpt.resume": "auto"}
    overrides = {**resume, **engine_overrides(profile, host), "run.name": profile.run.name,
                 "run.dir": node_dir, **store_backend(profile).engine_overrides(host.name),
                 "mesh.drain_file": C.join(node_dir, C.DRAIN)}
    args = [profile.engine.config, *override_args(overrides)]
    if host.workers == 1:
        return [host.python_path, "-m", "engine.train", *args]
    if host.rdzv_port is not None:
        rdzv = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{host.rdzv_port}",
                f"--rdzv-id={host.name}"]
    else:
        rdzv = ["--standalone"]  # its own rendezvous on a free port: nodes sharing a machine never collide
    return [host.python_path, "-m", "torch.distributed.run", *rdzv, f"--nproc_per_node={host.workers}",
            "-m", "engine.train", *args]
