"""Where this process stands: its ranks inside the node, the node's id, the hints about the global run.

The only module of the engine that reads os.environ. It is read once, by read_world(), into a frozen value that
is passed down explicitly; config.load_config receives the environment from here too.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class World:
    rank: int  # rank inside this node's torchrun group
    world_size: int  # processes on this node
    local_rank: int
    hostname: str
    pid: int
    # GLOBAL_RANK / GLOBAL_WORLD_SIZE are ZeroBand's hints about the initial cross-node layout; membership itself
    # comes from the mesh. None when not given.
    global_rank: int | None = None
    global_world_size: int | None = None
    log_level: str = "INFO"
    launched_by_torchrun: bool = False
    # CUDA_VISIBLE_DEVICES as listed (indices or GPU UUIDs); None when unset. CUDA renumbers the visible GPUs
    # from 0, NVML does not: cuda:i is the NVML device visible_gpus[i]
    visible_gpus: tuple[str, ...] | None = None
    # TORCHELASTIC_ERROR_FILE: where torchrun reads a failed worker's reason for its summary (engine/train.py)
    error_file: str | None = None
    env: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def is_node_leader(self) -> bool:
        """Local rank 0 speaks for the node: it talks to the mesh store and emits node-level telemetry."""
        return self.rank == 0

    def default_node_id(self) -> str:
        return f"{self.hostname}-{self.pid}"


def _int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment: {name}={raw!r} is not an integer") from None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # ZERO_BAND_LOG_LEVEL: which progress lines reach stderr


def _visible(raw: str | None) -> tuple[str, ...] | None:
    if raw is None:
        return None
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def read_world(environ: Mapping[str, str] | None = None) -> World:
    environ = dict(os.environ if environ is None else environ)
    world_size = _int(environ, "WORLD_SIZE", 1)
    rank = _int(environ, "RANK", 0)
    local_rank = _int(environ, "LOCAL_RANK", rank)
    assert world_size is not None and rank is not None and local_rank is not None
    if not 0 <= rank < world_size:
        raise ValueError(f"environment: RANK={rank} is outside WORLD_SIZE={world_size}")
    log_level = environ.get("ZERO_BAND_LOG_LEVEL", "INFO").upper()
    if log_level not in LOG_LEVELS:
        raise ValueError(f"environment: ZERO_BAND_LOG_LEVEL={environ['ZERO_BAND_LOG_LEVEL']!r} is not one of "
                         f"{', '.join(LOG_LEVELS)}")
    # pass on only what the config layer looks at (GLOBAL_* and ZERO_BAND_*)
    relevant = {k: v for k, v in environ.items() if k.startswith(("ZERO_BAND_", "GLOBAL_"))}
    return World(
        rank=rank, world_size=world_size, local_rank=local_rank,
        hostname=socket.gethostname(), pid=os.getpid(),
        global_rank=_int(environ, "GLOBAL_RANK", None),
        global_world_size=_int(environ, "GLOBAL_WORLD_SIZE", None),
        log_level=log_level,
        launched_by_torchrun="TORCHELASTIC_RUN_ID" in environ or "MASTER_ADDR" in environ,
        visible_gpus=_visible(environ.get("CUDA_VISIBLE_DEVICES")),
        error_file=environ.get("TORCHELASTIC_ERROR_FILE") or None,
        env=relevant,
    )
