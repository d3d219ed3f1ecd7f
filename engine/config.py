"""One typed config tree, parsed once at the edge: a TOML file, then `--section.key=value` overrides, then the
ZeroBand-compatible environment variables. Every rule is checked here, once; the rest of the engine trusts it.

    cfg = load_config("configs/debug.toml", ["--optim.lr=1e-3"], environ=world_env)

Errors are one line naming where the bad value came from: `configs/debug.toml: optim.lr: Input should be a valid
number`, `environment: GLOBAL_PORT='abc': mesh.store_port: ...`, `command line: optim.lrr: unknown key (did you mean
optim.lr?)`.
"""

from __future__ import annotations

import difflib
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic.fields import FieldInfo

from engine.config_env import env_overrides, variable_of
from engine.errors import ConfigError
from engine.sparse_rules import SPARSE_KEYS, sparse_problem
from engine.store.endpoints import parse_endpoint
from engine.toml_text import toml_value


class _Section(BaseModel):
    # inf and nan are no setting: an infinite timeout overflowed timedelta deep in the mesh, after training began.
    # strict: a number, a boolean or a name is taken only as TOML types it (a float takes an integer too); a TOML
    # string "8" for train.batch_size, 1 for a boolean or 8.0 for an integer is refused, as docs/config.md says.
    # The command line and the environment are text by nature: load_config reads their values as TOML first
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)


class ModelConfig(_Section):
    preset: Literal["debug", "15m", "150m", "1b"] = "debug"
    # a local folder in transformers format (config.json, optionally weights); overrides the preset's shape
    path: str | None = None
    # None: taken from the tokenizer (byte-level: 258)
    vocab_size: int | None = Field(default=None, gt=0)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"


class DataConfig(_Section):
    fake: bool = False
    # a file, folder or glob of .txt/.md/.jsonl files; required unless fake
    path: str | None = None
    text_field: str = "text"
    # a local transformers tokenizer folder; None: the built-in byte-level tokenizer
    tokenizer: str | None = None
    seq_len: int = Field(default=256, gt=1)
    # percent of documents (chosen by a hash of their text) held out for eval
    eval_percent: float = Field(default=2.0, ge=0, lt=100)


class TrainConfig(_Section):
    micro_batch_size: int = Field(default=8, gt=0)  # sequences per device per forward
    batch_size: int = Field(default=8, gt=0)  # sequences per optimizer step across this node's workers
    max_steps: int = Field(default=100, gt=0)  # inner optimizer steps in total
    # numpy's generators refuse a negative seed, and a TOML integer is signed 64-bit (torch takes [-2**63, 2**64))
    seed: int = Field(default=1337, ge=0, lt=2**63)
    # the model's initialisation alone, when it must differ from node to node (the nodes of a run share `seed`: it
    # orders the data they read their shares of); None: seed
    init_seed: int | None = Field(default=None, ge=0, lt=2**63)
    precision: Literal["fp32", "bf16-mixed", "fp16-mixed"] = "fp32"
    # torch.compile each decoder layer: "auto" on a CUDA device unless the strategy refuses it (zero3), off on a CPU
    # (engine/inner/transforms.py compile_wanted); a first step that fails to compile runs on eager, with one warning
    compile: Literal["auto", True, False] = "auto"
    activation_checkpointing: bool = False
    log_interval: int = Field(default=1, gt=0)
    eval_interval: int = Field(default=0, ge=0)  # 0: no periodic eval
    eval_batches: int = Field(default=4, gt=0)

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_is_a_boolean_or_auto(cls, value: Any) -> Any:
        # a Literal takes 1 for True; a TOML boolean or the word "auto" only, as for every boolean key
        if isinstance(value, bool) or value == "auto":
            return value
        quoted = f", not the string {toml_value(value)} (write it without quotes)" if isinstance(value, str) and \
            value in ("true", "false") else ""
        raise ValueError(f"Input should be true, false or \"auto\"{quoted}")


class OptimConfig(_Section):
    lr: float = Field(default=4e-4, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=10, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(default=0.1, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-8, gt=0)
    clip_norm: float = Field(default=1.0, ge=0)  # 0: no clipping
    # "muon": torch.optim.Muon for the 2-D weight matrices of the decoder layers, AdamW (the keys above) for the
    # embedding, the head, norms and biases; one schedule drives both (docs/config.md, "Muon")
    name: Literal["adamw", "muon"] = "adamw"
    # Muon's learning-rate scaling: "match_rms_adamw" (Moonshot) makes Muon's update as large as AdamW's, so that
    # it reuses optim.lr and optim.weight_decay; "original" (Keller Jordan) needs a learning rate ~50x larger
    muon_adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    muon_momentum: float = Field(default=0.95, ge=0, lt=1)  # Nesterov momentum of the Muon matrices
    muon_ns_steps: int = Field(default=5, gt=0, lt=100)  # Newton-Schulz iterations per step (torch allows < 100)

    @model_validator(mode="after")
    def _muon_needs_torch_muon(self) -> "OptimConfig":
        missing = torch_without_muon() if self.name == "muon" else None
        if missing:
            raise ValueError(f"optim.name = \"muon\" needs torch.optim.Muon, which {missing} lacks (it came with "
                             f"torch 2.9): use optim.name = \"adamw\" or a newer torch")
        return self


def torch_without_muon() -> str | None:
    """"torch X" when the torch of this Python has no torch.optim.Muon, else None. Where torch is loaded (the
    engine's inner strategies, tests) the class itself is asked; else its installed version, so that reading a
    config imports no torch (the engine reads it first, to refuse bad input in a second; the console never has
    torch). No torch installed at all (a console host): None, the engine's host decides."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "optim"):
        return None if hasattr(torch.optim, "Muon") else f"torch {torch.__version__}"
    from importlib import metadata
    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None
    major, minor = (int(x) for x in re.findall(r"\d+", version)[:2])
    return None if (major, minor) >= (2, 9) else f"torch {version}"


class InnerConfig(_Section):
    strategy: Literal["ddp", "fsdp", "zero1", "zero2", "zero3"] = "ddp"
    # FSDP2: free unsharded parameters after forward (FULL_SHARD) or keep them (SHARD_GRAD_OP)
    reshard_after_forward: bool = True
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy
    offload_optimizer: bool = False  # DeepSpeed ZeRO
    offload_params: bool = False  # DeepSpeed ZeRO-3
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"


class DilocoConfig(_Section):
    enabled: bool = False
    inner_steps: int = Field(default=50, gt=0)  # H
    # Nesterov with no momentum at lr 1.0 is the plain mean of the members' models: what learned best in every run
    # shorter than ~100 outer steps that docs/learning.md measured. The DiLoCo paper's 0.7 / 0.9 pays off only in
    # long runs (its 150M runs had 176 outer steps); configs/150m-diloco.toml and 1b-diloco.toml set it.
    outer_optimizer: Literal["nesterov", "sgd", "average"] = "nesterov"
    outer_lr: float = Field(default=1.0, gt=0)
    outer_momentum: float = Field(default=0.0, ge=0, lt=1)
    # "sparse" (SparseLoCo, docs/sparse.md): each node sends the top density x sparse_chunk values of every chunk of
    # its error-feedback accumulator, sparse_bits bits each; the accumulator (decay sparse_beta) keeps the rest and
    # plays the outer momentum's part, so the default outer step (nesterov, outer_momentum 0) is the paper's rule
    compression: Literal["none", "bf16", "fp16", "int8", "sparse"] = "none"
    sparse_chunk: int = 4096  # values per chunk (a power of two, 16 to 65536); a chunk never crosses a tensor
    density: float = 0.0156  # the fraction of each chunk sent, in (0, 1]: the paper's 64 of 4096
    sparse_bits: int = 2  # bits of a sent value: 2, 4 or 8
    sparse_beta: float = 0.9  # the accumulator's decay, in [0, 1]: e' = beta * e + pseudo-gradient (docs/learning.md)
    min_nodes: int = Field(default=1, gt=0)  # nodes the first outer step waits for (bounded by mesh.start_timeout)
    allreduce_timeout: float = Field(default=30.0, gt=0)
    max_attempts: int = Field(default=5, gt=0)  # redo an outer step at most this often after failures
    # a collective (group rendezvous, all-reduce) running longer than this while this node's own store round trips
    # are being retransmitted (mesh.slow_tick) steps the node out of the round, so that a lossy link stalls its
    # peers for seconds, not for the whole fault (docs/mesh.md, "Stragglers"). 0: half mesh.heartbeat_timeout, or
    # four times the slowest of the last five all-reduces if that is longer
    straggler_timeout: float = Field(default=0.0, ge=0)
    # the outer step of round t runs in a background thread while round t+1 trains; its update lands one round
    # late (docs/architecture.md, "Overlap"). Nodes of one process only.
    overlap: bool = False
    # what the working weights take at an overlapped boundary while the mean is in flight: "delayed", the node
    # trains on from its own weights; "eager" (arXiv 2502.12996): its own fresh pseudo-gradient stands in for its
    # share of the mean (1/contributors, through the outer optimizer). Landing one step in, eager cost ~8x more
    # held-out loss than delayed here (docs/learning.md, "Overlap"); "projected": its own pseudo-gradient scaled by
    # the least-squares fit of the last landed outer step on its own last one, between delayed (1) and eager
    # (docs/learning.md, "Overlap on a second corpus")
    overlap_update: Literal["eager", "delayed", "projected"] = "delayed"
    # when the round in flight lands (its agreed weights, with this node's progress since the boundary carried over
    # onto them): 0, at the first inner step after its outer step is done; N >= 1, exactly N inner steps into the
    # next round, waiting for it there if need be (reproducible); inner_steps: at the next boundary, a whole round
    # late. The fewer steps the working weights miss the others' round, the less overlap costs (docs/learning.md)
    overlap_delay: int = Field(default=0, ge=0)
    # the first N outer steps land synchronously (each completes at its boundary), the later ones overlap. With
    # the first 20 inner steps synchronous the mean cost was as without, the spread between seeds half
    # (docs/learning.md, "Synchronous early rounds"). Counted in outer steps; 0: every outer step overlaps.
    # Needs overlap
    overlap_after: int = Field(default=0, ge=0)
    # streaming DiLoCo (arXiv 2501.18512): the model in `fragments` contiguous pieces of about equal size, synced
    # in turn, one every inner_steps / fragments steps (fragment p at step (p + 1) * inner_steps / fragments, then
    # every inner_steps steps, as in DiLoCo): each outer step sends 1/fragments of the model. A synced
    # fragment's weights become (1 - fragment_alpha) x the agreed ones + fragment_alpha x the node's own. 1: off
    fragments: int = Field(default=1, gt=0)
    fragment_alpha: float = Field(default=0.0, ge=0, lt=1)
    # a fragment's outer step runs in the background for this many inner steps, then lands (mixed as above, and the
    # node's progress on it since the boundary carried over). 0: synchronous. At most inner_steps / fragments (it
    # lands before the next fragment's boundary). Nodes of one process only, as diloco.overlap
    fragment_delay: int = Field(default=0, ge=0)
    # the poisoned-update sentinel (engine/outer/sentinel.py): before the mean, a contributor whose pseudo-gradient
    # norm per token is over sentinel_ratio x the others' median, or whose direction has a cosine under
    # sentinel_min_cosine with the others' (the worst first, one at a time), is left out of that outer step; never
    # every contributor. 0 turns it off
    sentinel_ratio: float = Field(default=10.0, ge=0)
    sentinel_min_cosine: float = Field(default=-0.1, ge=-1, le=1)
    # "steps": a round is inner_steps steps on every node. "time": a round ends at a deadline the plan sets
    # (round_seconds after it was planned), whatever each node's speed: a fast host never waits for a slow one,
    # and each node's pseudo-gradient counts by the tokens it trained (docs/learning.md, "Mixed hardware"). Then
    # train.max_steps / inner_steps is the number of rounds and the LR schedule follows the round clock
    round: Literal["steps", "time"] = "steps"
    round_seconds: float = Field(default=0.0, ge=0)
    # time rounds: the planner waits for a member this long past the deadline, then plans without it (it
    # contributes at a later outer step, or re-joins); 0: a quarter of round_seconds
    straggler_grace: float = Field(default=0.0, ge=0)

    @field_validator(*SPARSE_KEYS)
    @classmethod
    def _sparse_rules(cls, value: Any, info: ValidationInfo) -> Any:
        # run for a key that was given only (a default is not validated): a sparse setting beside another
        # compression would be ignored without a word
        compression = info.data.get("compression")
        if compression is not None and compression != "sparse":
            raise ValueError(f"{toml_value(value)} is a setting of diloco.compression = \"sparse\", but "
                             f"diloco.compression is \"{compression}\" (set it to \"sparse\", or leave "
                             f"diloco.{info.field_name} out)")
        problem = sparse_problem(str(info.field_name), value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _time_rounds_need_seconds(self) -> "DilocoConfig":
        if self.round == "time" and not self.round_seconds > 0:
            raise ValueError("diloco.round = \"time\" needs diloco.round_seconds > 0 (the length of a round)")
        return self

    @model_validator(mode="after")
    def _overlap_after_needs_overlap(self) -> "DilocoConfig":
        if self.overlap_after and not self.overlap:
            raise ValueError(f"diloco.overlap_after ({self.overlap_after}) needs diloco.overlap = true (the outer "
                             f"steps after the first {self.overlap_after} overlap; without overlap every one is "
                             f"synchronous already)")
        return self

    @model_validator(mode="after")
    def _overlap_lands_inside_the_round(self) -> "DilocoConfig":
        if self.round == "steps" and self.overlap_delay > self.inner_steps:
            raise ValueError(f"diloco.overlap_delay ({self.overlap_delay}) must be at most diloco.inner_steps "
                             f"({self.inner_steps}): the round in flight lands before the next boundary")
        return self

    @model_validator(mode="after")
    def _fragments_split_the_round(self) -> "DilocoConfig":
        if self.fragments == 1:
            if self.fragment_delay:
                raise ValueError("diloco.fragment_delay needs diloco.fragments > 1 (the whole model's outer step "
                                 "in the background is diloco.overlap)")
            return self
        if self.inner_steps % self.fragments:
            raise ValueError(f"diloco.fragments ({self.fragments}) must divide diloco.inner_steps "
                             f"({self.inner_steps}): one fragment is synced every inner_steps / fragments steps")
        if self.round != "steps":
            raise ValueError("diloco.fragments needs diloco.round = \"steps\" (fragments are synced at step "
                             "offsets within the round)")
        if self.overlap:
            raise ValueError("diloco.fragments and diloco.overlap are two ways to stream the outer step: choose one "
                             "(docs/learning.md, \"Fragments\": when to use which)")
        if self.fragment_delay > self.inner_steps // self.fragments:
            raise ValueError(f"diloco.fragment_delay ({self.fragment_delay}) must be at most diloco.inner_steps / "
                             f"diloco.fragments ({self.inner_steps // self.fragments}): a fragment lands before the "
                             f"next one's boundary")
        return self

    @property
    def grace(self) -> float:
        """Seconds past a time round's deadline the planner waits for a member (diloco.straggler_grace)."""
        return self.straggler_grace or self.round_seconds / 4


class MeshConfig(_Section):
    store_addr: str = "127.0.0.1"
    store_port: int = Field(default=29600, gt=0, lt=65536)
    node_id: str | None = None  # None: hostname-pid
    heartbeat_interval: float = Field(default=1.0, gt=0)
    heartbeat_timeout: float = Field(default=6.0, gt=0)
    store_timeout: float = Field(default=30.0, gt=0)  # connecting to and waiting on the store
    polling_interval: float = Field(default=0.1, gt=0)
    # a heartbeat tick this much slower than the node's fastest recent one had a packet retransmitted (TCP's
    # minimum retransmission timeout is 200 ms on Linux): two such ticks of the last eight mark the node's own link
    # slow, which lets it step out of an overdue collective (diloco.straggler_timeout)
    slow_tick: float = Field(default=0.2, gt=0)
    start_timeout: float = Field(default=60.0, gt=0)  # how long the first boundary waits for diloco.min_nodes
    join_timeout: float = Field(default=600.0, gt=0)  # how long a joiner waits to be admitted
    # how long a node that lost the store keeps training and waits for it to come back before it gives up
    # (checkpoint, run_end "failed")
    store_lost_timeout: float = Field(default=600.0, gt=0)
    drain_file: str | None = None  # a file whose appearance requests a drain (for hosts without signals)
    # "tcp": the TCPStore at store_addr:store_port (one process); "etcd": a replicated etcd cluster (docs/mesh.md)
    store_backend: Literal["tcp", "etcd"] = "tcp"
    etcd_endpoints: list[str] = []  # host:port of every member's client URL
    etcd_prefix: str = "zeroband/run/"  # every key of this run lives under it: one prefix per run (the console sets it)
    etcd_ca: str | None = None  # the run's CA certificate (PEM), which signed the members' certificates
    etcd_cert: str | None = None  # this client's certificate and key: etcd refuses clients without one
    etcd_key: str | None = None
    etcd_insecure: bool = False  # plain http, no client certificate: only for an etcd nobody else can reach

    @model_validator(mode="after")
    def _timeout_exceeds_interval(self) -> "MeshConfig":
        if self.heartbeat_timeout <= 2 * self.heartbeat_interval:
            raise ValueError("heartbeat_timeout must exceed twice heartbeat_interval")
        return self

    @field_validator("etcd_endpoints", mode="before")
    @classmethod
    def _endpoint_list(cls, value: Any) -> Any:
        # "a:2379,b:2379" as well as a TOML list: one command-line override carries them all
        return [e.strip() for e in value.split(",") if e.strip()] if isinstance(value, str) else value

    @field_validator("etcd_endpoints")
    @classmethod
    def _endpoints_parse(cls, value: list[str]) -> list[str]:
        # host:port each (engine/store/endpoints.py): "notaport" or port 99999 failed later as a DNS or connection
        # error that named neither the key nor the value
        for endpoint in value:
            parse_endpoint(endpoint)
        return value

    @field_validator("etcd_endpoints", "etcd_prefix", "etcd_ca", "etcd_cert", "etcd_key", "etcd_insecure")
    @classmethod
    def _etcd_only(cls, value: Any, info: ValidationInfo) -> Any:
        # run for a key that was given only (a default is not validated): with the tcp store an etcd setting was
        # ignored without a word on the command line (the console's profile refuses it)
        backend = info.data.get("store_backend")
        if backend is not None and backend != "etcd":
            raise ValueError(f"{toml_value(value)} is an etcd setting, but mesh.store_backend is {backend} (set "
                             f"mesh.store_backend = \"etcd\", or leave mesh.{info.field_name} out)")
        return value

    @model_validator(mode="after")
    def _etcd_complete(self) -> "MeshConfig":
        if self.store_backend != "etcd":
            return self
        if not self.etcd_endpoints:
            raise ValueError("store_backend etcd needs mesh.etcd_endpoints (host:port of each member)")
        if not self.etcd_prefix.strip("/"):
            raise ValueError("etcd_prefix must name the run (e.g. 'zeroband/run-1/'), not the whole keyspace")
        tls = [self.etcd_ca, self.etcd_cert, self.etcd_key]
        if not self.etcd_insecure and not all(tls):
            raise ValueError("store_backend etcd needs mesh.etcd_ca, etcd_cert and etcd_key (TLS with a client "
                             "certificate: whoever reaches the store can steer the run), or etcd_insecure = true")
        return self


class CkptConfig(_Section):
    dir: str | None = None  # None: <run.dir>/checkpoints
    interval: int = Field(default=0, ge=0)  # steps; 0: only at the end
    keep: int = Field(default=2, gt=0)
    # a checkpoint folder, "latest", or "auto" (latest when ckpt.dir has a checkpoint, else a fresh start)
    resume: str | None = None
    export_dir: str | None = None  # transformers folder for the final weights; None: no export


class TelemetryConfig(_Section):
    resource_interval: float = Field(default=5.0, gt=0)
    human: bool = True  # progress lines on stderr
    all_ranks: bool = False  # JSON events from every rank, not only local rank 0
    tensorboard_dir: str = ""  # TensorBoard event files under <dir>/<node id> (empty: none); engine/metrics.py
    wandb: bool = False  # Weights & Biases, offline, under <run.dir>/wandb, when the wandb package is installed


class RunConfig(_Section):
    name: str = "run"
    dir: str = "runs/run"


class Config(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    inner: InnerConfig = InnerConfig()
    diloco: DilocoConfig = DilocoConfig()
    mesh: MeshConfig = MeshConfig()
    ckpt: CkptConfig = CkptConfig()
    telemetry: TelemetryConfig = TelemetryConfig()

    @model_validator(mode="after")
    def _cross_rules(self) -> "Config":
        if not self.data.fake and not self.data.path:
            raise ValueError("data.path is required unless data.fake = true")
        if self.train.batch_size % self.train.micro_batch_size:
            raise ValueError(f"train.batch_size ({self.train.batch_size}) is not a multiple of "
                             f"train.micro_batch_size ({self.train.micro_batch_size})")
        strategy = self.inner.strategy
        if self.inner.cpu_offload and strategy != "fsdp":
            raise ValueError(f"inner.cpu_offload is FSDP2's offload: it needs inner.strategy fsdp, not {strategy} "
                             f"(DeepSpeed: inner.offload_optimizer / inner.offload_params)")
        if self.inner.offload_optimizer and not strategy.startswith("zero"):
            raise ValueError(f"inner.offload_optimizer is DeepSpeed's: it needs inner.strategy zero1/zero2/zero3, "
                             f"not {strategy}")
        if self.inner.offload_params and strategy != "zero3":
            raise ValueError(f"inner.offload_params needs inner.strategy zero3 (parameters are partitioned only "
                             f"there), not {strategy}")
        if self.optim.name == "muon" and strategy.startswith("zero"):
            raise ValueError(f"optim.name = \"muon\" is not supported with inner.strategy {strategy} (DeepSpeed owns "
                             f"its optimizer): use --inner.strategy=fsdp, which shards the same way")
        if self.train.precision == "fp16-mixed" and self.inner.strategy == "fsdp":
            raise ValueError("train.precision fp16-mixed is not supported with inner.strategy fsdp (use bf16-mixed)")
        return self


def grad_accum_steps(train: TrainConfig, local_world_size: int, source: str = "config") -> int:
    """Micro-steps per optimizer step so that batch_size sequences are seen across this node's workers."""
    per_round = train.micro_batch_size * local_world_size
    if train.batch_size % per_round:
        fits = train.batch_size // local_world_size if train.batch_size % local_world_size == 0 else None
        raise ConfigError(f"{source}: train.batch_size ({train.batch_size}) is not divisible by "
                          f"train.micro_batch_size x workers ({train.micro_batch_size} x {local_world_size}): make "
                          f"train.batch_size a multiple of {per_round}"
                          + (f" or train.micro_batch_size {fits}" if fits else ""))
    return train.batch_size // per_round


def parse_overrides(args: list[str]) -> dict[str, str]:
    """`--section.key=value` or `--section.key value` -> {"section.key": "value"}; a bare `--section.key` is true,
    for a boolean key only (a bare `--train.max_steps` read as true was 1 step). A key given twice: the last wins, so
    that a run can layer its own values over a shared list of them."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"command line: expected --section.key=value, got {arg!r}")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            key, value = arg[2:], "true"
            field = _field(key)
            if field is not None and field.annotation is not bool and True not in getattr(field.annotation, "__args__",
                                                                                    ()):  # unknown: the validation names it
                raise ConfigError(f"command line: {key}: needs a value (--{key}=VALUE)")
        out[key] = value
        i += 1
    return out


def _field(key: str) -> FieldInfo | None:
    """The config field of a dotted key (`optim.lr`), or None if there is none."""
    model: Any = Config
    field = None
    for part in key.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        model = field.annotation
    return field


def _is_text(key: str) -> bool:
    """A key whose value is free text (run.name, mesh.node_id, data.path): `str` or `str | None`."""
    field = _field(key)
    return field is not None and field.annotation in (str, str | None)


def _coerce(key: str, text: str) -> Any:
    """A command-line or environment value as TOML would read it (1e-3 -> float, true -> bool), else the plain
    string. A text key takes the text as written unless it is a TOML string ("x", as the console quotes every string
    it passes): a run named 2024-06-01 or a node id 0 is text, not a date or a number."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return text if _is_text(key) and not isinstance(value, str) else value


def _set_dotted(tree: dict[str, Any], key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _close_key(loc: tuple) -> str | None:
    """The known key closest to the unknown one at `loc` (`optim.lrr` -> `optim.lr`), or None if none is close."""
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return ".".join([*map(str, loc[:-1]), close[0]]) if close else None


def _format_error(err: ValidationError, source: str, origins: Mapping[str, tuple[str, str]]) -> str:
    """One line for the first error, named after where the bad value came from: the file, the environment variable
    or the command line (origins: key -> (where, as written) for the keys the file did not set). The key stays
    `: key:` in the line: the console points at a profile's override by it (console/profile.py)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    extra = f" ({len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if first["type"] == "extra_forbidden":  # an unknown key, or a key of an unknown section
        typed = next((key for key in origins if f"{key}.".startswith(f"{loc}.")), loc)
        close = _close_key(first["loc"])
        hint = f" (did you mean {close}{typed[len(loc):]}?)" if close else ""
        return f"{'command line' if typed in origins else source}: {typed}: unknown key{hint}{extra}"
    if first["type"] in ("int_type", "float_type", "bool_type") and isinstance(first["input"], str) \
            and loc not in origins:  # a TOML string where a number or boolean belongs (strict: see _Section)
        msg += f", not the string {toml_value(first['input'])} (write it without quotes)"
    if loc in origins:
        where, written = origins[loc]
        if where == "environment":
            return f"environment: {written}: {loc}: {msg}{extra}"
        return f"command line: {loc}: {msg} ({written}){extra}"
    # a rule over several keys (loc is their section, or empty for the whole tree): name the keys it mentions that
    # the environment or the command line set, so that the file is not blamed for them
    named = [(key, written) for key, (_, written) in origins.items() if key.startswith(f"{loc}." if loc else "")]
    blamed = [f"{key} from {written}" for key, written in named
              if re.search(r"\b" + re.escape(key.rsplit(".", 1)[-1]) + r"\b", msg)]
    also = f" ({'; '.join(blamed)})" if blamed else ""
    return f"{source}: {loc + ': ' if loc else ''}{msg}{also}{extra}"


def load_config(path: str | Path | None, overrides: list[str] | Mapping[str, Any] = (),
                environ: Mapping[str, str] | None = None) -> Config:
    """File, then environment, then command line (the command line wins). Overrides are command-line words, read as
    TOML reads a value, or a mapping of typed values (the console's profile, a TOML file itself): there a str is a
    TOML string, taken as it is, so that `"train.batch_size" = "8"` is refused as in a config file (the console
    passes it on as --train.batch_size="8", which the engine refuses too)."""
    source = str(path) if path is not None else "defaults"
    tree = _read_file(Path(path), source) if path is not None else {}
    origins: dict[str, tuple[str, str]] = {}  # keys not set by the file: who set them, as they wrote it
    for key, value in env_overrides(environ or {}).items():
        _set_dotted(tree, key, _coerce(key, value), "environment")
        origins[key] = ("environment", f"{variable_of(key)}={value!r}")
    typed = isinstance(overrides, Mapping)
    pairs = overrides if typed else parse_overrides(list(overrides))
    for key, value in pairs.items():
        if isinstance(value, str) and not typed:
            value = _coerce(key, value)
        _set_dotted(tree, key, value, "command line")
        origins[key] = ("command line", f"--{key}={toml_value(value) if typed else pairs[key]}")
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source, origins)) from None


def _read_file(path: Path, source: str) -> dict[str, Any]:
    """The config file's tree; each way it cannot be read is one line naming it (a folder was a traceback)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{source}: config file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: not a file (a folder)") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"{source}: not UTF-8 text: byte 0x{data[e.start]:02x} on line {line}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
