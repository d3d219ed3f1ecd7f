"""Tokenizers: the byte-level default (256 bytes + bos 256 + eos 257 = 258 ids) or a local transformers folder.

Each has an `identity` (kind, vocab size, bos/eos and a fingerprint of the vocabulary itself): a prepared folder's
manifest records it, and training refuses a prepared folder whose identity differs from the configured tokenizer.
This module never imports torch, so prepare's worker processes stay light.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus bos and eos. Needs no files."""

    vocab_size = 258
    bos_id = 256
    eos_id = 257

    @property
    def identity(self) -> dict[str, Any]:
        return {"kind": "bytes", "name": "utf-8 bytes", "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "fingerprint": "utf8-bytes-258"}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]


# files that hold a transformers tokenizer's vocabulary: a fast tokenizer.json, or a slow tokenizer's own files
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
               "vocab.txt")


class HFTokenizer:
    """A local transformers tokenizer folder (nothing downloaded). `what` names the setting in error lines."""

    def __init__(self, path: str, what: str = "data.tokenizer"):
        folder = Path(path)
        if not folder.is_dir():
            raise ValueError(f"{what}: {path} is not a folder (expected a local transformers tokenizer)")
        # checked here: without a vocabulary transformers answers with a paragraph about sentencepiece and tiktoken
        if not any((folder / name).is_file() for name in VOCAB_FILES) and not any(folder.glob("*.tiktoken")):
            raise ValueError(f"{what}: {path} holds no tokenizer (no tokenizer.json, nor a vocabulary file: "
                             f"{', '.join(VOCAB_FILES[1:])}); point it at a folder written by save_pretrained()")
        from transformers import AutoTokenizer
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            reason = " ".join(str(e).split())  # transformers' messages run over several lines
            raise ValueError(f"{what}: cannot load a tokenizer from {path}: {reason[:300]}") from None
        self.path = path
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id

    @property
    def identity(self) -> dict[str, Any]:
        # the vocabulary and merges themselves, not the folder's path: a copy of the folder elsewhere matches
        if getattr(self.tok, "is_fast", False):
            blob = self.tok.backend_tokenizer.to_str().encode()
        else:
            blob = repr(sorted(self.tok.get_vocab().items())).encode()
        return {"kind": "transformers", "name": Path(self.path).name, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id,
                "fingerprint": hashlib.blake2b(blob, digest_size=12).hexdigest()}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(path: str | None, what: str = "data.tokenizer") -> Tokenizer:
    return ByteTokenizer() if path is None else HFTokenizer(path, what)


def describe(identity: dict[str, Any]) -> str:
    """`utf-8 bytes (vocab 258)` or `gpt2-small (vocab 50257, 3f2a...)`: for error lines."""
    if identity.get("kind") == "bytes":
        return f"the byte-level tokenizer (vocab {identity.get('vocab_size')})"
    return f"tokenizer {identity.get('name')} (vocab {identity.get('vocab_size')}, {identity.get('fingerprint')})"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest fixed width that holds every id: uint16 up to 65536 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def frame_documents(tokenizer: Tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Each document as bos + tokens + eos (either left out when the tokenizer has none)."""
    head = np.asarray([tokenizer.bos_id] if tokenizer.bos_id is not None else [], np.int32)
    tail = np.asarray([tokenizer.eos_id] if tokenizer.eos_id is not None else [], np.int32)
    return [np.concatenate([head, ids, tail]) for ids in tokenizer.encode_batch(texts)]
