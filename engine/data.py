"""Token streams for training and eval: fake data, or local text corpora packed into fixed-length sequences.

Sources
    fake        deterministic synthetic sequences (a random short pattern repeated), learnable, endless
    data.path   a file, folder (searched recursively) or glob of .txt/.md (one document per file) and .jsonl
                (one document per line, text in data.text_field) files

Tokenizer: the byte-level default (256 bytes + bos 256 + eos 257 = 258 ids) or a local transformers tokenizer
folder (data.tokenizer). Documents are tokenized as bos + text + eos and concatenated into one token array.

Held-out split: a document goes to eval when a hash of its text falls in the first data.eval_percent percent,
so the split does not depend on file order or on the number of workers.

Packing and sharding: the train array is cut into sequences of seq_len + 1 tokens with stride seq_len (input =
the first seq_len, labels = the last seq_len, so every token is a target once). Sequence order is a seeded
permutation per epoch; the k-th sequence of that global order belongs to shard k % num_shards, with

    shard = node_index * world.world_size + world.rank,   num_shards = num_nodes * world.world_size

(node_index/num_nodes from World.global_rank/global_world_size, default 0/1). So no two workers see the same
sequence, and for one global batch the union of what the workers read is the same whatever the layout: one
process with gradient accumulation reads exactly the sequences that two DDP ranks read together.

Position: the number of global sequences consumed (`state_dict()["position"]`), saved in checkpoints. It is
layout-free, so a run can resume with a different number of workers.

Limitation: the whole tokenized corpus is held in memory (int32); fine up to a few hundred MB of text.
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

import numpy as np
import torch

from engine.config import DataConfig
from engine.world import World

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus bos and eos. Needs no files."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]


class HFTokenizer:
    """A local transformers tokenizer folder (nothing downloaded)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer
        if not Path(path).is_dir():
            raise ValueError(f"data.tokenizer: {path} is not a folder (expected a local transformers tokenizer)")
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"data.tokenizer: cannot load a tokenizer from {path}: {e}") from None
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path)


# ---------------------------------------------------------------------------------------------- reading files

def find_files(path: str) -> list[Path]:
    """The corpus files named by a file, a folder (recursive) or a glob, in a stable (sorted) order."""
    suffixes = TEXT_SUFFIXES + JSONL_SUFFIXES
    p = Path(path)
    if p.is_file():
        candidates = [p]
    elif p.is_dir():
        candidates = [f for f in p.rglob("*") if f.is_file()]
    else:
        candidates = [Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file()]
        if not candidates:
            raise ValueError(f"data.path: {path} does not exist (expected a file, folder or glob of "
                             f".txt/.md/.jsonl files)")
    files = sorted(f for f in candidates if f.suffix.lower() in suffixes)
    if not files:
        raise ValueError(f"data.path: no .txt, .md or .jsonl files in {path}")
    return files


def read_documents(files: list[Path], text_field: str) -> Iterator[str]:
    for f in files:
        if f.suffix.lower() in TEXT_SUFFIXES:
            yield f.read_text(encoding="utf-8", errors="replace")
            continue
        with f.open(encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise ValueError(f"data.path: {f}:{lineno}: not a JSON object") from None
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"data.path: {f}:{lineno}: no string field {text_field!r} "
                                     f"(set data.text_field)")
                yield text


def is_eval_document(text: str, eval_percent: float) -> bool:
    """Stable across runs, file orders and worker counts: decided by the text alone."""
    bucket = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") % 10_000
    return bucket < eval_percent * 100


def tokenize_split(docs: Iterator[str], tokenizer, eval_percent: float,
                   batch: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """(train tokens, eval tokens): each document as bos + tokens + eos, concatenated."""
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    pending: list[str] = []

    def flush() -> None:
        for text, ids in zip(pending, tokenizer.encode_batch(pending)):
            head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
            tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
            parts[is_eval_document(text, eval_percent)].append(
                np.concatenate([np.asarray(head, np.int32), ids, np.asarray(tail, np.int32)]))
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


# ---------------------------------------------------------------------------------------------- sources

class Source(Protocol):
    num_sequences: int | None  # None: endless
    fingerprint: str

    def sequence(self, index: int) -> np.ndarray: ...  # seq_len + 1 tokens


class PackedSource:
    """A token array cut into sequences of seq_len + 1 tokens with stride seq_len."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_sequences = max(0, (len(tokens) - 1) // seq_len)
        self.fingerprint = hashlib.blake2b(tokens.tobytes(), digest_size=8).hexdigest()

    def sequence(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]


class FakeSource:
    """Endless synthetic sequences: a random pattern of 2-16 tokens repeated, so a model can learn to copy."""

    num_sequences = None

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.fingerprint = f"fake-{vocab_size}-{seq_len}-{seed}"

    def sequence(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        pattern = rng.integers(0, self.vocab_size, size=int(rng.integers(2, 17)), dtype=np.int32)
        return np.resize(pattern, self.seq_len + 1)


class TokenStream:
    """One worker's shard of a source, as micro-batches of (input_ids, labels), with a resumable position."""

    def __init__(self, source: Source, shard: int, num_shards: int, seed: int, shuffle: bool = True):
        assert 0 <= shard < num_shards
        if source.num_sequences is not None and source.num_sequences < num_shards:
            raise ValueError(f"data: only {source.num_sequences} sequences of seq_len+1 tokens, fewer than the "
                             f"{num_shards} workers (use more text or a shorter data.seq_len)")
        self.source, self.shard, self.num_shards = source, shard, num_shards
        self.seed, self.shuffle = seed, shuffle
        self.consumed = 0  # sequences this worker has read
        self._perm_epoch, self._perm = -1, np.zeros(0, dtype=np.int64)

    def _global_index(self, k: int) -> int:
        n = self.source.num_sequences
        if n is None:
            return k
        epoch, within = divmod(k, n)
        if not self.shuffle:
            return within
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            self._perm_epoch = epoch
        return int(self._perm[within])

    def next_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = []
        for _ in range(batch_size):
            k = self.consumed * self.num_shards + self.shard  # the k-th sequence of the global order
            rows.append(self.source.sequence(self._global_index(k)))
            self.consumed += 1
        block = torch.from_numpy(np.stack(rows).astype(np.int64))
        return block[:, :-1].contiguous(), block[:, 1:].contiguous()

    def reset(self) -> None:
        self.consumed = 0

    def state_dict(self) -> dict:
        # layout-free: how many sequences of the global order all workers together have consumed
        return {"position": self.consumed * self.num_shards, "fingerprint": self.source.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("fingerprint") != self.source.fingerprint:
            raise ValueError("checkpoint: the data differs from the run that wrote it (data.path, tokenizer, "
                             "eval_percent or seq_len changed)")
        # round up: after a change of layout a worker skips rather than repeats sequences
        self.consumed = -(-int(state["position"]) // self.num_shards)


@dataclass
class Data:
    train: TokenStream
    eval: TokenStream | None
    vocab_size: int
    tokenizer: ByteTokenizer | HFTokenizer
    notes: list[str]  # things worth a warning event (e.g. an empty eval split)


def shard_of(world: World) -> tuple[int, int]:
    """(shard, num_shards) of this worker across all nodes."""
    node_index = world.global_rank if world.global_rank is not None else 0
    num_nodes = world.global_world_size if world.global_world_size is not None else 1
    if not 0 <= node_index < num_nodes:
        raise ValueError(f"environment: GLOBAL_RANK={node_index} is outside GLOBAL_WORLD_SIZE={num_nodes}")
    return node_index * world.world_size + world.rank, num_nodes * world.world_size


def build_data(cfg: DataConfig, world: World, seed: int) -> Data:
    tokenizer = load_tokenizer(cfg.tokenizer)
    shard, num_shards = shard_of(world)
    notes: list[str] = []
    if cfg.fake:
        train_src: Source = FakeSource(tokenizer.vocab_size, cfg.seq_len, seed)
        eval_src: Source | None = FakeSource(tokenizer.vocab_size, cfg.seq_len, seed + 1_000_003)
    else:
        assert cfg.path is not None  # config rule
        train_tok, eval_tok = tokenize_split(read_documents(find_files(cfg.path), cfg.text_field),
                                             tokenizer, cfg.eval_percent)
        train_src = PackedSource(train_tok, cfg.seq_len)
        if train_src.num_sequences == 0:
            raise ValueError(f"data.path: {cfg.path} holds {len(train_tok)} training tokens, fewer than "
                             f"data.seq_len + 1 = {cfg.seq_len + 1}")
        eval_src = PackedSource(eval_tok, cfg.seq_len)
        if eval_src.num_sequences < num_shards:
            if cfg.eval_percent > 0:
                notes.append(f"data: the held-out split ({cfg.eval_percent}% of documents) has too few tokens "
                             f"for eval; eval is off")
            eval_src = None
    return Data(train=TokenStream(train_src, shard, num_shards, seed),
                eval=TokenStream(eval_src, shard, num_shards, seed, shuffle=False) if eval_src else None,
                vocab_size=tokenizer.vocab_size, tokenizer=tokenizer, notes=notes)
