"""What one GPU (or one CPU worker) will hold, estimated from the config alone, before anything starts.

    shape = model_shape(cfg.model, vocab_size(cfg))           # the Llama's tensor shapes, as plain numbers
    est = estimate(cfg, workers=8, device="cuda")             # parts per process: resident and transient
    est.per_gpu                                               # the peak in bytes: resident + the largest transient
    est.lines()                                               # the table `python -m engine.train CFG --dry-run` prints
    fitting(cfg, workers, budget)                             # the first setting that would fit, or None

No torch and no transformers here: the console imports this module (its `check` and the start's preflight compare
the estimate with each host's GPU memory), and engine/model.py's presets are shapes in engine/presets.py.
tests/test_memory.py checks the element counts against the real model for every preset, each sharded term against
what every rank of a 2-rank gloo run really holds (FSDP2, ZeRO 1/2/3), and the activation terms against the bytes
autograd saves on a CPU; scripts/gpu_checks.sh compares the total with the CUDA allocator's peak.

The parts (docs/performance.md, "Memory estimate", says how to read the table):

    params      the fp32 parameters a process keeps (FSDP2 and ZeRO-3: its shard; offload: on the host)
    low-prec    the bf16/fp16 working copy: DeepSpeed's bit16 weights (ZeRO 1/2: whole, ZeRO-3: a partition); under
                autocast (one process, DDP) the cast copies autocast caches for the forward, transient
    grads       fp32 gradients (DDP adds its bucket copies: gradient_as_bucket_view is off); ZeRO: bit16 grads and
                the fp32 gradient partition the optimizer steps with
    optimizer   AdamW: 2 fp32 states per parameter; Muon: 1 momentum for the hidden matrices, AdamW's 2 for the rest
                (embeddings, head, norms); sharded as the strategy shards it
    master      ZeRO's fp32 master partition (the model is fp32 elsewhere: no separate master)
    diloco      snapshot, pseudo-gradient and mean (3 fp32 copies of what this process trains, engine/outer/
                buffers.py), + the outer momentum (nesterov or sgd with momentum > 0), + the codec's device buffers
                (engine/outer/allreduce.py Exchange; "none" on a GPU goes through pinned host memory); "sparse":
                + its accumulator (one more fp32 copy), its messages and the top-k's scratch (sparse_parts)
    activations saved for backward, for one micro-batch: per token and layer, coefficients measured on this
                model with autograd's saved-tensor hooks (tests/test_memory.py re-measures them); with activation
                checkpointing only each layer's input, plus one layer recomputed in backward
    transients  the largest of: the logits' backward, an FSDP2 layer gathered (two with prefetch; all of them with
                reshard_after_forward off), ZeRO's buckets, the export's gather of the largest tensor, the overlapped
                outer step's copies (diloco.overlap: snapshot and momentum cloned while the next round trains)

What is not counted: the CUDA context (~0.5 GiB per process, not in the allocator's peak), the allocator's
fragmentation, NCCL's buffers, torch.compile's workspace. `HEADROOM` is left for them in the verdict.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.presets import PRESETS, config_json

GiB = 2**30
BYTE_VOCAB = 258  # the built-in byte-level tokenizer: 256 bytes + bos + eos (engine/data/tokenizer.py)
HEADROOM = 0.9  # the share of a GPU's memory the estimate may fill (context, fragmentation, NCCL, compile)
CUDA_CONTEXT = int(0.5 * GiB)  # per process, outside the allocator: in the verdict, not in the table's parts

# Activations saved for backward, in bytes per token, as a function of the shape (tests/test_memory.py measures
# them with torch.autograd.graph.saved_tensors_hooks on a CPU; SDPA attention keeps no seq x seq matrix):
#   per layer:  d x hidden + f x intermediate + k x kv_dim + h x heads;  once: v x vocab (logits) + e x hidden
ACT_PER_LAYER = {"fp32": (32.0, 16.0, 8.0, 4.0), "mixed": (28.0, 8.5, 5.0, 4.0)}
ACT_ONCE = {"fp32": (4.0, 12.0), "mixed": (2.5, 12.0)}
AC_PER_LAYER = 4.0  # activation checkpointing: each layer keeps its fp32 input (bytes per token x hidden)
LOGITS_BACKWARD = 8.0  # bytes per token x vocab: the loss's gradient and the logits' in backward


@dataclass(frozen=True)
class Shape:
    """A Llama decoder's sizes (engine/presets.py, or a local folder's config.json)."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def layer_tensors(self) -> list[tuple[int, ...]]:
        d, f, kv = self.hidden, self.intermediate, self.kv_dim
        # q, k, v, o; gate, up, down; input and post-attention norms (no biases: Llama's attention_bias is off)
        return [(d, d), (kv, d), (kv, d), (d, d), (f, d), (f, d), (d, f), (d,), (d,)]

    def root_tensors(self) -> list[tuple[int, ...]]:
        """What FSDP2's root group holds: embeddings, the final norm, the head (unless tied)."""
        return [(self.vocab, self.hidden), (self.hidden,)] + ([] if self.tied else [(self.vocab, self.hidden)])

    def tensors(self) -> list[tuple[int, ...]]:
        return self.root_tensors() + self.layer_tensors() * self.layers

    @property
    def numel(self) -> int:
        return sum(math.prod(t) for t in self.tensors())

    @property
    def layer_numel(self) -> int:
        return sum(math.prod(t) for t in self.layer_tensors())

    @property
    def hidden_matrices(self) -> int:
        """Elements of the 2-D tensors inside the layers: what Muon steps (embeddings and head stay on AdamW)."""
        return sum(math.prod(t) for t in self.layer_tensors() if len(t) == 2) * self.layers

    @property
    def largest(self) -> int:
        return max(math.prod(t) for t in self.tensors())


def vocab_size(cfg: Any) -> int | None:
    """The vocabulary the model is built with: model.vocab_size, else the tokenizer's (the byte-level one: 258; a
    transformers tokenizer folder: its tokenizer.json's vocabulary and added tokens), None where unreadable."""
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    if cfg.data.tokenizer is None:
        return BYTE_VOCAB
    try:
        raw = json.loads((Path(cfg.data.tokenizer) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    vocab = raw.get("model", {}).get("vocab") or {}
    ids = [*(vocab.values() if isinstance(vocab, dict) else range(len(vocab))),
           *(t.get("id", -1) for t in raw.get("added_tokens", []))]
    return max(ids) + 1 if ids else None


def model_shape(model_cfg: Any, vocab: int) -> Shape:
    """The shape of the model engine/model.py builds: a preset's, or a Llama-like folder's config.json (a ValueError
    naming the folder for one the estimate cannot read)."""
    if model_cfg.path is None:
        p = PRESETS[model_cfg.preset]
        return Shape(p["hidden_size"], p["intermediate_size"], p["num_hidden_layers"], p["num_attention_heads"],
                     p["num_key_value_heads"], model_cfg.vocab_size or vocab)
    raw = json.loads(config_json(model_cfg.path).read_text())
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in need if not isinstance(raw.get(k), int)]
    if missing:
        raise ValueError(f"model.path: {model_cfg.path}/config.json has no {', '.join(missing)}: the memory estimate "
                         f"reads Llama-like configs only")
    return Shape(raw["hidden_size"], raw["intermediate_size"], raw["num_hidden_layers"], raw["num_attention_heads"],
                 raw.get("num_key_value_heads") or raw["num_attention_heads"],
                 model_cfg.vocab_size or max(vocab, raw.get("vocab_size") or 0), bool(raw.get("tie_word_embeddings")))


# ---- what each rank holds ------------------------------------------------------------------------------------
def fsdp_shard(shape: tuple[int, ...], world: int, rank: int = 0) -> int:
    """Elements of one tensor's FSDP2 shard on `rank`: dim 0 split in ceil(dim0 / world) rows (the last ranks
    fewer, or none)."""
    rows = -(-shape[0] // world)
    mine = max(0, min(rows, shape[0] - rank * rows))
    return mine * math.prod(shape[1:])


def fsdp_local(s: Shape, world: int, rank: int = 0) -> int:
    return sum(fsdp_shard(t, world, rank) for t in s.tensors())


def zero_partition(numel: int, world: int) -> int:
    """Elements of one rank's ZeRO partition of `numel` (DeepSpeed pads a group to a multiple of 2 x world)."""
    align = 2 * world
    return -(-numel // align) * align // world


def zero_local(s: Shape, world: int) -> int:
    """Elements of one rank's ZeRO partition of the whole model (two groups: with and without weight decay)."""
    matrices = sum(math.prod(t) for t in s.tensors() if len(t) == 2)
    return zero_partition(matrices, world) + zero_partition(s.numel - matrices, world)


# ---- the estimate ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    note: str = ""
    transient: bool = False  # at its moment only (the largest one counts), not resident all along
    host: bool = False  # in the host's memory, not the GPU's


@dataclass
class Estimate:
    """One process's memory, by part. per_gpu: the resident parts plus the largest transient, on the device."""
    parts: list[Part]
    setting: dict[str, Any] = field(default_factory=dict)

    @property
    def resident(self) -> int:
        return sum(p.bytes for p in self.parts if not p.transient and not p.host)

    @property
    def peak_transient(self) -> Part | None:
        on_device = [p for p in self.parts if p.transient and not p.host]
        return max(on_device, key=lambda p: p.bytes) if on_device else None

    @property
    def per_gpu(self) -> int:
        top = self.peak_transient
        return self.resident + (top.bytes if top else 0)

    @property
    def host(self) -> int:
        return sum(p.bytes for p in self.parts if p.host)

    def largest(self) -> Part:
        """The largest part on the device (what a refusal names)."""
        return max((p for p in self.parts if not p.host), key=lambda p: p.bytes)

    def lines(self) -> list[str]:
        s = self.setting
        head = (f"memory estimate per process: {s['preset']} ({s['params'] / 1e6:,.1f}M parameters), "
                f"{s['strategy']} x {s['workers']} worker{'s' if s['workers'] != 1 else ''}, {s['precision']}, "
                f"micro-batch {s['micro_batch']} x seq {s['seq_len']}, activation checkpointing "
                f"{'on' if s['ac'] else 'off'}, optimizer {s['optim']}, device {s['device']}")
        rows = [head]
        for p in self.parts:
            where = "host" if p.host else ("peak" if p.transient else "")
            rows.append(f"  {p.name:<22} {gib(p.bytes):>9}  {where:<4}  {p.note}".rstrip())
        top = self.peak_transient
        rows.append(f"per GPU: {self.per_gpu / GiB:.2f} GiB (resident {gib(self.resident)} + the largest transient "
                    f"{gib(top.bytes) if top else '0'}{f' ({top.name})' if top else ''}); host "
                    f"{gib(self.host)}" + ("; device cpu: all of it in the host's memory" if s["device"] == "cpu" else ""))
        return rows


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 100 else f"{n / 2**20:.1f} MiB"


def optim_name(cfg: Any) -> str:
    """optim.name where the config has one (AdamW otherwise)."""
    return str(getattr(cfg.optim, "name", "adamw"))


def activation_bytes(s: Shape, tokens: int, mixed: bool, checkpointing: bool) -> tuple[int, int]:
    """(saved for backward, recomputed in backward) for `tokens` tokens of one micro-batch."""
    key = "mixed" if mixed else "fp32"
    cd, cf, ck, ch = ACT_PER_LAYER[key]
    cv, ce = ACT_ONCE[key]
    layer = cd * s.hidden + cf * s.intermediate + ck * s.kv_dim + ch * s.heads
    once = cv * s.vocab + ce * s.hidden
    if checkpointing:
        return int(tokens * (s.layers * AC_PER_LAYER * s.hidden + once)), int(tokens * layer)
    return int(tokens * (s.layers * layer + once)), 0


class Parts(list[Part]):
    """The parts of an estimate as its terms add them, in the order the table lists them."""

    def add(self, name: str, nbytes: float, note: str = "", *, transient: bool = False, host: bool = False) -> None:
        self.append(Part(name, int(nbytes), note, transient, host))


def estimate(cfg: Any, *, workers: int, device: str = "cuda", optim: str | None = None,
             shape: Shape | None = None) -> Estimate:
    """One process's memory for `cfg` with `workers` processes on the host (torchrun's WORLD_SIZE). `device`:
    "cuda" or "cpu" (a CPU run keeps everything in the host's memory: the parts are the same, all "host").
    `optim`: "adamw" or "muon" (default: the config's optim.name, else adamw). On a CPU the "GPU" parts are the
    worker's share of the host's memory. Each term below adds its parts: a new one is one more call."""
    t, inner = cfg.train, cfg.inner
    vocab = vocab_size(cfg)
    if shape is None:
        if vocab is None:
            raise ValueError(f"data.tokenizer: {cfg.data.tokenizer} has no readable tokenizer.json: set "
                             f"model.vocab_size for the memory estimate")
        shape = model_shape(cfg.model, vocab)
    optim = optim or optim_name(cfg)
    if optim not in ("adamw", "muon"):
        raise ValueError(f"optim.name: {optim!r}: the memory estimate knows adamw and muon")
    n = max(1, workers)
    strategy = inner.strategy if n > 1 or inner.strategy.startswith("zero") else "single"
    if strategy == "ddp" and n == 1:
        strategy = "single"
    mixed = t.precision != "fp32"
    parts = Parts()
    if strategy in ("single", "ddp"):
        local = replicated_terms(parts, shape, strategy, mixed, optim)
    elif strategy == "fsdp":
        local = fsdp_terms(parts, shape, n, inner, mixed, optim)
    else:
        local = zero_terms(parts, shape, n, int(strategy[-1]), inner, mixed, optim)
    activation_terms(parts, shape, t.micro_batch_size, cfg.data.seq_len, mixed, t.activation_checkpointing)
    if cfg.diloco.enabled:
        diloco_terms(parts, cfg.diloco, local, on_host=strategy == "fsdp" and inner.cpu_offload, device=device)
    # the export gathers one whole tensor at a time on the device (FSDP2, ZeRO-3) before moving it to the host
    if strategy == "fsdp" or strategy == "zero3":
        parts.add("export gather", 4 * shape.largest, "the largest tensor gathered whole (checkpoint export)",
                  transient=True)
    est = Estimate(list(parts))
    est.setting = dict(preset=cfg.model.path or cfg.model.preset, params=shape.numel, strategy=strategy, workers=n,
                       precision=t.precision, micro_batch=t.micro_batch_size, seq_len=cfg.data.seq_len,
                       ac=t.activation_checkpointing, optim=optim, device=device)
    return est


def sparse_parts(d: Any, local: float, members: int, device: str) -> list[tuple[str, float, str, bool]]:
    """compression "sparse" (engine/outer/sparse.py, gather.py): (name, bytes, note, on the host) of what it keeps
    for `local` values. Its accumulator is one more fp32 copy of them (each tensor's last chunk padded besides:
    0.5 % at 15m); its wire buffers, this member's message and every member's (pinned beside a GPU), are M =
    4 B bytes a value each; the top-k's group maxima and candidates (SparseCodec._topk) are 1/8 of the values each
    at chunk 4096 and density 1.56 %, kept between steps: on a GPU over the whole buffer, on a CPU a block of
    2 MiB of chunks. The mean's buffer is the "diloco buffers"' own, and the outer momentum is not there unless
    diloco.outer_momentum > 0."""
    c, k = d.sparse_chunk, max(1, round(d.density * d.sparse_chunk))
    chunks = math.ceil(local / c)
    sent = chunks * min(k, c)  # K: the values sent (a shard's short last chunks send fewer: an upper bound)
    message = 4 * chunks + math.ceil(sent * (c.bit_length() - 1) / 8) + math.ceil(sent * d.sparse_bits / 8)
    groups = 1 << max(0, round(math.log2(math.sqrt(k * c))))  # as SparseCodec picks them
    if 2 * k <= c and k <= groups < c:
        block = chunks if device != "cpu" else min(chunks, max(1, (2 << 20) // (4 * c)))
        minima = 0 if (c // groups) * k >= groups else groups  # the group minima share the candidates' buffer
        scratch = 4 * block * (groups + (c // groups) * k + minima)
    else:  # torch.topk over whole chunks: the magnitudes' copy, transient
        scratch = 4 * chunks * c
    return [("sparse accumulator", 4 * local, f"error feedback e, fp32 (decay {d.sparse_beta:g})", False),
            ("exchange", (1 + members) * (4 + message), f"sparse messages of {message / 4 / max(1, local):.4f} x "
             f"fp32 + weight: this member's and one per member ({members}; pinned beside a GPU)", True),
            ("sparse scratch", scratch, "the top-k's group maxima and candidates", False)]


def optimizer_term(parts: Parts, optim: str, shape: Shape, local: float, where: str, *, host: bool = False) -> None:
    """The inner optimizer's states for `local` elements: Muon keeps 1 momentum for the layers' matrices, AdamW 2
    states for everything else."""
    if optim == "adamw":
        elems, states = 2 * local, "2 AdamW states"
    else:
        share = shape.hidden_matrices / shape.numel
        elems, states = local * (share + 2 * (1 - share)), "1 momentum (hidden matrices) + 2 AdamW states (the rest)"
    parts.add("optimizer", 4 * elems, f"{states}, {where}", host=host)


def replicated_terms(parts: Parts, shape: Shape, strategy: str, mixed: bool, optim: str) -> int:
    """One process or DDP: every process holds the whole model. Returns the elements it trains."""
    P = shape.numel
    parts.add("params", 4 * P, "fp32")
    parts.add("grads", 4 * P, "fp32" + (", + DDP's bucket copies" if strategy == "ddp" else ""))
    if strategy == "ddp":
        parts.add("ddp buckets", 4 * P, "gradient_as_bucket_view off: one fp32 copy in buckets")
    optimizer_term(parts, optim, shape, P, "fp32")
    if mixed:
        parts.add("autocast copies", 2 * P, "bf16/fp16 weights cast for the forward, cached until backward",
                  transient=True)
    return P


def fsdp_terms(parts: Parts, shape: Shape, n: int, inner: Any, mixed: bool, optim: str) -> int:
    """FSDP2 over `n` processes: shards of the fp32 state, gathered layers. Returns the elements it trains."""
    local = fsdp_local(shape, n)
    off = inner.cpu_offload
    parts.add("params", 4 * local, f"fp32 shard 1/{n}", host=off)
    parts.add("grads", 4 * local, f"fp32 shard 1/{n}", host=off)
    optimizer_term(parts, optim, shape, local, f"shard 1/{n}", host=off)
    pbytes = 2 if mixed else 4
    root = sum(math.prod(x) for x in shape.root_tensors())
    parts.add("root unsharded", pbytes * root, "embeddings and head stay gathered from forward to backward")
    if inner.reshard_after_forward:
        parts.add("layers gathered", pbytes * 2 * shape.layer_numel + 4 * shape.layer_numel,
                  "two layers (prefetch) + one layer's fp32 grads before reduce-scatter", transient=True)
    else:
        parts.add("layers gathered", pbytes * shape.layers * shape.layer_numel,
                  "reshard_after_forward off: every layer stays gathered until backward")
    return local


def zero_terms(parts: Parts, shape: Shape, n: int, stage: int, inner: Any, mixed: bool, optim: str) -> int:
    """DeepSpeed ZeRO stage 1/2/3 over `n` processes. Returns the elements of this process's partition."""
    P = shape.numel
    local = zero_local(shape, n)
    lp = 2 if mixed else 4
    parts.add("params" if stage == 3 else "params (bit16)" if mixed else "params", lp * (local if stage == 3 else P),
              f"{'bf16/fp16' if mixed else 'fp32'} working weights"
              + (f", partition 1/{n}" if stage == 3 else ", whole"), host=stage == 3 and inner.offload_params)
    off = inner.offload_optimizer
    parts.add("master", 4 * local, f"fp32 master partition 1/{n}", host=off)
    parts.add("grads", (lp * P if stage == 1 else 0) + 4 * local,
              ("bit16 grads whole + " if stage == 1 else "") + f"fp32 partition 1/{n}", host=off and stage > 1)
    optimizer_term(parts, optim, shape, local, f"partition 1/{n}", host=off)
    bucket = shape.hidden * shape.hidden  # engine/inner/deepspeed_config.py sizes buckets from the hidden size
    parts.add("zero buckets", lp * 2 * bucket + (lp * 2 * bucket if stage == 3 else 0),
              "reduce + all-gather buckets (hidden^2 elements each)" + (", stage 3 prefetch" if stage == 3 else ""))
    if stage == 3:
        parts.add("layers gathered", lp * 2 * shape.layer_numel, "two layers gathered for forward/backward",
                  transient=True)
    return local


def activation_terms(parts: Parts, shape: Shape, micro_batch: int, seq_len: int, mixed: bool,
                     checkpointing: bool) -> None:
    """One micro-batch's activations saved for backward, the layer recomputed, the logits' backward."""
    tokens = micro_batch * seq_len
    saved, recompute = activation_bytes(shape, tokens, mixed, checkpointing)
    parts.add("activations", saved, f"{micro_batch} x {seq_len} tokens"
              + (", checkpointed: each layer's input" if checkpointing else ""))
    if recompute:
        parts.add("recompute", recompute, "one layer's activations rebuilt in backward", transient=True)
    parts.add("logits backward", LOGITS_BACKWARD * tokens * shape.vocab, "the loss's and the logits' gradients",
              transient=True)


def diloco_terms(parts: Parts, d: Any, local: int, *, on_host: bool, device: str) -> None:
    """DiLoCo (`d`: cfg.diloco): three flat fp32 copies of the `local` elements this process trains, on its
    parameters' device; the outer momentum; the codec's buffers; the copies of an outer step in flight."""
    momentum = d.outer_optimizer != "average" and d.outer_momentum > 0
    parts.add("diloco buffers", 4 * 3 * local, "snapshot, pseudo-gradient, mean (fp32)", host=on_host)
    if momentum:
        parts.add("outer momentum", 4 * local, f"{d.outer_optimizer} momentum {d.outer_momentum:g}", host=on_host)
    members = max(2, d.min_nodes)
    if d.compression == "sparse":
        for name, nbytes, note, host in sparse_parts(d, local, members, device):
            parts.add(name, nbytes, note, host=host or on_host)
    elif d.compression == "none":
        parts.add("exchange", 4 * local, "the all-reduce's buffer (pinned, on the host beside a GPU)", host=True)
    else:
        width = 1 if d.compression == "int8" else 2
        parts.add("exchange", width * local + (4 + width) * local // members,
                  f"{d.compression} codec: send rows + this rank's chunk ({members} members)", host=on_host)
    if d.overlap or d.fragment_delay:
        parts.add("overlap copies", 4 * (2 + momentum) * local, "the outer step in flight clones snapshot, "
                  "pseudo-gradient and momentum", transient=True, host=on_host)


# ---- the verdict ------------------------------------------------------------------------------------------
def budget(gpu_bytes: int) -> int:
    """What the estimate may fill of a GPU of `gpu_bytes`: HEADROOM of it, less the CUDA context."""
    return max(0, int(gpu_bytes * HEADROOM) - CUDA_CONTEXT)


def fitting(cfg: Any, workers: int, gpu_bytes: int, optim: str | None = None) -> str | None:
    """The first change that would fit on a GPU of `gpu_bytes`, as the setting to write; None when none of them
    does. Tried in this order: activation checkpointing, a smaller micro-batch (halved while it divides the batch),
    reshard/sharding strategies (fsdp, zero2, zero3), optimizer offload."""
    room = budget(gpu_bytes)

    def fits(**changes: Any) -> bool:
        trial = cfg.model_copy(deep=True)
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(trial, section), name, value)
        return estimate(trial, workers=workers, optim=optim).per_gpu <= room

    t = cfg.train
    if not t.activation_checkpointing and fits(train__activation_checkpointing=True):
        return "train.activation_checkpointing = true"
    mb = t.micro_batch_size // 2
    while mb >= 1:
        if t.batch_size % (mb * workers) == 0 and fits(train__micro_batch_size=mb):
            return f"train.micro_batch_size = {mb}"
        mb //= 2
    if workers > 1:
        for strategy in ("fsdp", "zero2", "zero3"):
            if strategy != cfg.inner.strategy and fits(inner__strategy=strategy):
                return f"inner.strategy = \"{strategy}\""
    if fits(train__activation_checkpointing=True, train__micro_batch_size=1):
        return "train.activation_checkpointing = true and train.micro_batch_size = 1"
    if workers > 1 and fits(inner__strategy="zero3", inner__offload_optimizer=True,
                            train__activation_checkpointing=True):
        return "inner.strategy = \"zero3\" with inner.offload_optimizer = true and activation checkpointing"
    return None
