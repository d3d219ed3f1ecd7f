"""What the nodes of a run must share, and its digests: the settings a checkpoint is resumed with (`digest`), those
the nodes of a running run must agree on (`run_digest`, `mesh_settings`), and their flat form for a refusal that names
the setting (`flat_settings`). Read from a parsed `Config` (engine/config.py); docs/mesh.md, "digest"."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from engine.config import Config, DilocoConfig, TrainConfig
from engine.sparse_rules import SPARSE_KEYS


# the diloco settings a checkpoint's run is resumed with (digest); min_nodes, timeouts and how each node lands
# an overlapped round or mixes a fragment (overlap_update, overlap_delay, fragment_alpha, fragment_delay) may differ
# between nodes without harm
DILOCO_SHARED = ("enabled", "inner_steps", "outer_optimizer", "outer_lr", "outer_momentum", "compression", "overlap")
# and with compression "sparse" its settings (they shape the wire, and beta the accumulator a checkpoint holds). They
# count only with sparse, as the Muon keys with Muon: every other run's digest stays as it was before they existed
DILOCO_SPARSE = SPARSE_KEYS
# and those the nodes of a run must share while they run together (run_digest), or their outer steps disagree: the
# fragment each outer step syncs and its size, when a round ends, the sentinel's verdict, which every member
# computes from the same rows, and which outer steps overlap (overlap_after: the run's recipe, every member
# landing its early steps alike, as docs/learning.md measured it). A resume may change them: the checkpoint's state
# is the same whatever they are.
DILOCO_RUN_WIDE = ("fragments", "round", "round_seconds", "sentinel_ratio", "sentinel_min_cosine", "overlap_after")
# the nodes read one seeded order of the data, the k-th sequence on node k % num_nodes (engine.data.shard_of): nodes
# of different seeds read overlapping sequences. Not in the checkpoint's digest: every checkpoint would be refused.
TRAIN_RUN_WIDE = ("seed",)
# the inner optimizer a checkpoint's state belongs to (its moments are AdamW's or Muon's): a resume may not change
# it. The Muon keys count only with Muon; AdamW, the only optimizer before optim.name existed, leaves the digest as it
# was then (a checkpoint of that time resumes), though the settings shown for a refusal name it
OPTIM_SHARED = ("name",)
OPTIM_MUON = ("muon_adjust_lr", "muon_momentum", "muon_ns_steps")


def shared_settings(cfg: Config, sections: tuple[str, ...] = ("model", "data.seq_len", "diloco", "optim"), *,
                    run_wide: bool = False) -> dict[str, Any]:
    """The parts of the config a checkpoint is resumed with: the model, data.seq_len, the DILOCO_SHARED settings
    (and DILOCO_SPARSE with compression "sparse") and the inner optimizer (OPTIM_SHARED, and OPTIM_MUON with Muon); with run_wide also the DILOCO_RUN_WIDE ones
    (what the nodes of a running run must share)."""
    dumped = cfg.model_dump()
    picked: dict[str, Any] = {}
    for name in sections:
        head, _, tail = name.partition(".")
        picked[name] = dumped[head][tail] if tail else dumped[head]
    if "diloco" in picked:
        defaults = DilocoConfig()
        shared = DILOCO_SHARED + (DILOCO_SPARSE if cfg.diloco.compression == "sparse" else ())
        picked["diloco"] = {k: v for k, v in picked["diloco"].items() if k in shared or (
            # a run-wide setting at its default leaves the digest as it was before run-wide settings counted
            run_wide and k in DILOCO_RUN_WIDE and v != getattr(defaults, k))}
    if "optim" in picked:
        keys = OPTIM_SHARED + (OPTIM_MUON if cfg.optim.name == "muon" else ())
        picked["optim"] = {k: v for k, v in picked["optim"].items() if k in keys}
    return picked


def _hashed(settings: dict[str, Any]) -> dict[str, Any]:
    """What the digests hash: shared_settings() less optim.name "adamw", the only optimizer before the key existed,
    so that a checkpoint of that time (and a running node of that version) still agrees."""
    if settings.get("optim") == {"name": "adamw"}:
        settings = {k: v for k, v in settings.items() if k != "optim"}
    return settings


def digest(cfg: Config, sections: tuple[str, ...] = ("model", "data.seq_len", "diloco", "optim"), *,
           run_wide: bool = False) -> str:
    """A short hash of shared_settings()."""
    return _hash(_hashed(shared_settings(cfg, sections, run_wide=run_wide)))


def _hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(_canonical(settings), sort_keys=True).encode()).hexdigest()[:12]


def _canonical(value: Any) -> Any:
    """-0.0 as 0.0, so that two settings the nodes would compare equal hash the same."""
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return 0.0 if isinstance(value, float) and value == 0 else value


def run_digest(cfg: Config) -> str:
    """What the mesh compares (with the workers per node and the wire protocol): digest() and the diloco and train
    settings every node of a running run must share."""
    settings = _hashed(shared_settings(cfg, run_wide=True))
    defaults = TrainConfig()
    # at its default a run-wide train setting leaves the digest as it was before it counted, as the diloco ones do
    settings.update({f"train.{k}": getattr(cfg.train, k) for k in TRAIN_RUN_WIDE
                     if getattr(cfg.train, k) != getattr(defaults, k)})
    return _hash(settings)


def mesh_settings(cfg: Config) -> dict[str, Any]:
    """What run_digest covers, flat ("diloco.inner_steps": 5), the run-wide settings at their defaults included:
    what the mesh shows a refused node (engine/mesh/registration.py, differences)."""
    settings = flat_settings(shared_settings(cfg, run_wide=True))
    settings.update({f"diloco.{k}": getattr(cfg.diloco, k) for k in DILOCO_RUN_WIDE})
    settings.update({f"train.{k}": getattr(cfg.train, k) for k in TRAIN_RUN_WIDE})
    return settings


def flat_settings(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"diloco": {"inner_steps": 5}, "data.seq_len": 128} -> {"diloco.inner_steps": 5, "data.seq_len": 128}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flat_settings(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
