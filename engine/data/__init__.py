"""Token streams for training and eval: fake data, a prepared folder of memory-mapped shards, or raw text files.

Sources (data.path)
    fake            deterministic synthetic sequences (a random short pattern repeated), learnable, endless
    prepared folder written by `python -m engine.data prepare SOURCE... --out DIR` (engine/data/prepare.py):
                    token shards read through numpy.memmap (engine/data/shards.py). Memory and start-up do not
                    grow with the corpus; every worker of a host shares the kernel's page cache. Use it for
                    anything beyond a few hundred MB of text.
    raw files       a file, folder (searched recursively) or glob of .txt/.md, .jsonl (data.text_field) and
                    .parquet/.arrow files (engine/data/documents.py), tokenized by every worker at start-up and
                    held in memory (int32): fine for small corpora, about 15x the text in RSS per worker.

Tokenizer: the byte-level default or a local transformers folder (data.tokenizer; engine/data/tokenizer.py).
Documents become bos + text + eos, concatenated. A prepared folder must have been prepared with the configured
tokenizer (compared by vocabulary fingerprint and size): a mismatch is one error line.

Held-out split: a document goes to eval when a hash of its text falls in the first data.eval_percent percent
(a prepared folder fixes its own split at prepare time: --eval-percent).

Packing, order and sharding (engine/data/stream.py): sequences of seq_len + 1 tokens with stride seq_len, cut on
the fly; a seeded per-epoch permutation computed index by index; the k-th sequence of the global order belongs to
shard k % num_shards, with

    shard = node_index * world.world_size + world.rank,   num_shards = num_nodes * world.world_size

(node_index/num_nodes from World.global_rank/global_world_size, default 0/1). So no two workers see the same
sequence, and for one global batch the union of what the workers read is the same whatever the layout: one
process with gradient accumulation reads exactly the sequences that two DDP ranks read together.

Position: the number of global sequences consumed (`state_dict()["position"]`), saved in checkpoints. It is
layout-free, so a node's checkpoint resumes under another number of nodes (a worker then skips rather than repeats
sequences); the number of workers of the node may not change, since each one's model and optimizer shards and
rank file are its own (engine.checkpoint refuses another). A joiner is handed the mesh's step and reads on from
there (engine.session.follow_handoff).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.config import DataConfig
from engine.data.documents import find_files, is_eval_document, read_documents
from engine.data.shards import ShardedTokens, fingerprint, is_prepared, manifest_name, read_manifest
from engine.data.stream import FakeSource, PackedSource, Permutation, Source, TokenStream
from engine.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, describe, frame_documents, load_tokenizer
from engine.world import World

__all__ = ["ByteTokenizer", "Data", "FakeSource", "HFTokenizer", "PackedSource", "Permutation", "TokenStream",
           "build_data", "dataset_name", "find_files", "is_eval_document", "load_tokenizer", "read_documents",
           "shard_of", "tokenize_split"]


@dataclass
class Data:
    train: TokenStream
    eval: TokenStream | None
    vocab_size: int
    tokenizer: Tokenizer
    notes: list[str]  # things worth a warning event (e.g. an empty eval split)
    dataset: str | None = field(default=None)  # the prepared dataset's name; None for raw files and fake data


def shard_of(world: World) -> tuple[int, int]:
    """(shard, num_shards) of this worker across all nodes."""
    node_index = world.global_rank if world.global_rank is not None else 0
    num_nodes = world.global_world_size if world.global_world_size is not None else 1
    if not 0 <= node_index < num_nodes:
        raise ValueError(f"environment: GLOBAL_RANK={node_index} is outside GLOBAL_WORLD_SIZE={num_nodes}")
    return node_index * world.world_size + world.rank, num_nodes * world.world_size


def dataset_name(cfg: DataConfig) -> str | None:
    """The prepared dataset's name (for run_start, before build_data runs), or None for raw files and fake data."""
    return None if cfg.fake else manifest_name(cfg.path)


def tokenize_split(docs, tokenizer: Tokenizer, eval_percent: float, batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, eval tokens) of raw documents, held in memory: each document as bos + tokens + eos."""
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    pending: list[str] = []

    def flush() -> None:
        for text, ids in zip(pending, frame_documents(tokenizer, pending) if pending else []):
            parts[is_eval_document(text, eval_percent)].append(ids)
        pending.clear()

    for doc in docs:
        if doc.strip():
            pending.append(doc)
        if len(pending) >= batch:
            flush()
    flush()
    empty = np.zeros(0, dtype=np.int32)
    return (np.concatenate(parts[False]) if parts[False] else empty,
            np.concatenate(parts[True]) if parts[True] else empty)


def open_prepared(cfg: DataConfig, tokenizer: Tokenizer,
                  notes: list[str]) -> tuple[PackedSource, PackedSource, str, float]:
    """(train, eval, name, eval_percent) of a prepared folder, after checking it was prepared with this tokenizer."""
    folder = Path(cfg.path)  # type: ignore[arg-type]
    manifest = read_manifest(folder)
    theirs, ours = manifest["tokenizer"], tokenizer.identity
    if (theirs.get("fingerprint"), theirs.get("vocab_size")) != (ours["fingerprint"], ours["vocab_size"]):
        raise ValueError(f"data.tokenizer: {folder} was prepared with {describe(theirs)}, this run uses "
                         f"{describe(ours)} (set data.tokenizer to the tokenizer it was prepared with, or "
                         f"prepare again)")
    if cfg.eval_percent != manifest["eval_percent"]:
        notes.append(f"data: {folder} holds out {manifest['eval_percent']}% of documents (fixed at prepare "
                     f"time); data.eval_percent = {cfg.eval_percent} does not apply")
    dtype, vocab = np.dtype(manifest["dtype"]), int(theirs["vocab_size"])
    sources = []
    for split in ("train", "eval"):
        tokens = ShardedTokens(folder, manifest["splits"][split]["shards"], dtype, vocab)
        sources.append(PackedSource(tokens, cfg.seq_len, fingerprint=fingerprint(manifest, split)))
    return sources[0], sources[1], str(manifest["name"]), float(manifest["eval_percent"])


def build_data(cfg: DataConfig, world: World, seed: int) -> Data:
    tokenizer = load_tokenizer(cfg.tokenizer)
    shard, num_shards = shard_of(world)
    notes: list[str] = []
    name = None
    if cfg.fake:
        train_src: Source = FakeSource(tokenizer.vocab_size, cfg.seq_len, seed)
        eval_src: Source | None = FakeSource(tokenizer.vocab_size, cfg.seq_len, seed + 1_000_003)
    else:
        assert cfg.path is not None  # config rule
        if is_prepared(cfg.path):
            train_src, eval_src, name, eval_percent = open_prepared(cfg, tokenizer, notes)
        else:
            train_tok, eval_tok = tokenize_split(read_documents(find_files(cfg.path), cfg.text_field),
                                                 tokenizer, cfg.eval_percent)
            train_src, eval_src, eval_percent = (PackedSource(train_tok, cfg.seq_len),
                                                 PackedSource(eval_tok, cfg.seq_len), cfg.eval_percent)
        if train_src.num_sequences == 0:
            raise ValueError(f"data.path: {cfg.path} holds {len(train_src.tokens)} training tokens, fewer than "
                             f"data.seq_len + 1 = {cfg.seq_len + 1}")
        if eval_src.num_sequences < world.world_size:
            if eval_percent != 0:
                notes.append("data: the held-out split has too few tokens for eval; eval is off")
            eval_src = None
    return Data(train=TokenStream(train_src, shard, num_shards, seed, dataset=name),
                # eval is split between this node's workers only: every node evaluates the same held-out batches,
                # so nodes (and runs of any layout) report comparable eval losses
                eval=TokenStream(eval_src, world.rank, world.world_size, seed, shuffle=False) if eval_src else None,
                vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, notes=notes, dataset=name)
