"""Sources of fixed-length sequences and the per-worker stream over them (packing, shuffling, sharding, position).

Packing: a token array (in memory, or the memory-mapped shards of a prepared folder) is cut on the fly into
sequences of seq_len + 1 tokens with stride seq_len (input = the first seq_len, labels = the last seq_len, so every
token is a target once). Nothing is copied up front: a sequence is sliced when it is read.

Order: a seeded pseudo-random permutation per epoch, computed index by index (a Feistel network with cycle
walking), so no table of num_sequences entries is ever built: memory and start-up do not grow with the corpus.
The seed is train.seed, which every node of a run must share, or their shares of two orders overlap (the mesh
compares it: engine.digests.run_digest).

Sharding: the k-th sequence of that global order belongs to shard k % num_shards (see engine.data.shard_of).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import numpy as np
import torch

_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash of an integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class Permutation:
    """A seeded bijection of range(n), evaluated per index in O(1) memory.

    A balanced 4-round Feistel network permutes range(2**bits) (bits even, 2**bits >= n); indices that land at or
    above n are walked on until they fall inside (cycle walking), which keeps it a bijection of range(n). Since
    2**bits < 4n, a walk takes under 4 rounds on average."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        assert n > 0
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits & 1
        self.half, self.mask = bits // 2, (1 << (bits // 2)) - 1
        base = _mix((seed & _M64) ^ _mix(epoch))
        self.keys = [_mix(base + r) for r in range(self.ROUNDS)]

    def _feistel(self, i: int) -> int:
        left, right = i >> self.half, i & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, i: int) -> int:
        assert 0 <= i < self.n
        while True:
            i = self._feistel(i)
            if i < self.n:
                return i


class Source(Protocol):
    num_sequences: int | None  # None: endless
    fingerprint: str

    def sequence(self, index: int) -> np.ndarray: ...  # seq_len + 1 tokens


class PackedSource:
    """A token array cut into sequences of seq_len + 1 tokens with stride seq_len.

    `tokens` is a numpy array or anything with len() and slicing (engine.data.shards.ShardedTokens). A caller
    that knows the tokens' identity cheaply passes `fingerprint`; otherwise it is a hash of the array."""

    def __init__(self, tokens, seq_len: int, fingerprint: str | None = None):
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_sequences = max(0, (len(tokens) - 1) // seq_len)
        self.fingerprint = fingerprint or hashlib.blake2b(np.ascontiguousarray(tokens).tobytes(),
                                                          digest_size=8).hexdigest()

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

    def __init__(self, source: Source, shard: int, num_shards: int, seed: int, shuffle: bool = True,
                 dataset: str | None = None):
        assert 0 <= shard < num_shards
        if source.num_sequences is not None and source.num_sequences < num_shards:
            raise ValueError(f"data: only {source.num_sequences} sequences of seq_len+1 tokens, fewer than the "
                             f"{num_shards} workers (use more text or a shorter data.seq_len)")
        self.source, self.shard, self.num_shards = source, shard, num_shards
        self.seed, self.shuffle, self.dataset = seed, shuffle, dataset
        self.consumed = 0  # sequences this worker has read
        self._perm: Permutation | None = None

    def _global_index(self, k: int) -> int:
        n = self.source.num_sequences
        if n is None:
            return k
        epoch, within = divmod(k, n)
        if not self.shuffle:
            return within
        if self._perm is None or self._perm_epoch != epoch:
            self._perm, self._perm_epoch = Permutation(n, self.seed, epoch), epoch
        return self._perm(within)

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

    @property
    def epoch(self) -> float | None:
        """Epochs of this node's shard consumed (1.0 = every sequence of the shard once); None when endless.
        Every worker advances at the same rate, so one worker's count stands for its node."""
        n = self.source.num_sequences
        return None if n is None else self.consumed * self.num_shards / n

    def state_dict(self) -> dict:
        # layout-free: how many sequences of the global order all workers together have consumed
        return {"position": self.consumed * self.num_shards, "fingerprint": self.source.fingerprint,
                "dataset": self.dataset, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        theirs, ours = str(state.get("fingerprint")), self.source.fingerprint
        if theirs != ours:
            # fake data is made from the seed ("fake-VOCAB-SEQ_LEN-SEED"): name the seed when only it changed
            if theirs.startswith("fake-") and ours.startswith("fake-") and \
                    theirs.rpartition("-")[0] == ours.rpartition("-")[0]:
                raise ValueError(f"checkpoint: the fake data differs from the run that wrote it: train.seed = "
                                 f"{ours.rpartition('-')[2]} here, {theirs.rpartition('-')[2]} in the checkpoint "
                                 f"(fake data is generated from the seed: resume with the run's)")
            was = f" (it read {state['dataset']})" if state.get("dataset") else ""
            now = f"; this run reads {self.dataset}" if self.dataset else ""
            raise ValueError(f"checkpoint: the data differs from the run that wrote it{was}{now} (data.path, "
                             f"tokenizer, eval_percent or seq_len changed)")
        seed = state.get("seed")  # absent in checkpoints written before it was kept
        if seed is not None and seed != self.seed and self.shuffle and self.source.num_sequences is not None:
            # the position counts into the order the seed draws: another seed repeats some sequences, skips others
            raise ValueError(f"checkpoint: train.seed = {self.seed} here, {seed} in the checkpoint: the data order is "
                             f"drawn from it and the position counts into that order (resume with the run's seed)")
        # round up: after a change of layout a worker skips rather than repeats sequences
        self.consumed = -(-int(state["position"]) // self.num_shards)
