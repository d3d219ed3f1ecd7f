"""The prepared format: fixed-width token shards, a document index and a manifest, read through numpy.memmap.

    DIR/
        manifest.json           written last, atomically: its presence means the folder is complete
        train-00000.bin ...     tokens, uint16 when the vocabulary fits (<= 65536 ids), else uint32, little-endian
        train-00000.idx ...     uint64: the end offset of each document inside the shard (cumulative lengths)
        eval-00000.bin/.idx     the held-out documents, the same way (absent when a group held none)
        prepare.json            the journal of a prepare in progress; removed when manifest.json is written

A split is the concatenation of its shards in order; documents are bos + tokens + eos, as in the raw path, so a
prepared folder and the raw files it came from give the same token stream.

manifest.json:
    format          "zeroband-tokens/1"
    name            the dataset's name (prepare --name, default the folder's name); shown by the console
    tokenizer       identity: kind, name, vocab_size, bos_id, eos_id, fingerprint (engine.data.tokenizer)
    dtype           "uint16" or "uint32"
    eval_percent, text_field, sources [{path, bytes}], source_bytes, seconds (tokenizing, this run only)
    splits          {"train"|"eval": {tokens, documents, shards: [{file, index, tokens, documents, blake2b,
                    index_blake2b}]}}: blake2b is the .bin's checksum, index_blake2b the .idx's (absent in folders
                    prepared before it was written; verify then checks the .idx's size only)
    identity        a digest of what was prepared (sources, tokenizer, split, shard size): how a rerun knows it

Checks when training opens a folder (start-up does not grow with the corpus): the manifest parses and holds every
key the reader uses, with its type (check_manifest: a bad one is named), every shard and index exists with exactly
the size the manifest gives (a truncated file is named), and the tokenizer matches.
Every sequence read is checked to lie inside the vocabulary (a corrupt shard is named when it is read); the
per-shard checksums are checked by `python -m engine.data verify DIR`, and by prepare run again on the folder.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "zeroband-tokens/1"
MANIFEST = "manifest.json"
JOURNAL = "prepare.json"
SPLITS = ("train", "eval")


def shard_names(split: str, index: int) -> tuple[str, str]:
    return f"{split}-{index:05d}.bin", f"{split}-{index:05d}.idx"


def is_prepared(path: str | None) -> bool:
    """A folder written by prepare, finished or not (an unfinished one is an error, not a raw corpus)."""
    return path is not None and Path(path).is_dir() and \
        ((Path(path) / MANIFEST).is_file() or (Path(path) / JOURNAL).is_file())


def read_manifest(folder: Path, what: str = "data.path") -> dict[str, Any]:
    """The manifest of a prepared folder, checked for shape. `what` names the setting or command in error lines."""
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        if not folder.exists():
            raise ValueError(f"{what}: {folder} does not exist")
        if not (folder / JOURNAL).is_file():
            raise ValueError(f"{what}: {folder} is not a prepared folder (no {MANIFEST}; write one with `python -m "
                             f"engine.data prepare SOURCE... --out {folder}`)")
        raise ValueError(f"{what}: {folder} is an interrupted prepare ({JOURNAL} but no {MANIFEST}); run "
                         f"`python -m engine.data prepare ... --out {folder}` again to finish it")
    try:
        manifest = json.loads(manifest_file.read_text())
    except ValueError as e:  # UnicodeDecodeError too
        raise ValueError(f"{what}: {manifest_file} is corrupt (not JSON: {e})") from None
    try:
        check_manifest(manifest)
    except ValueError as e:
        raise ValueError(f"{what}: {manifest_file} is corrupt: {e}") from None
    return manifest


def _key(tree: Any, path: str, kind: type | tuple[type, ...], shown: str | None = None) -> Any:
    """The value at a dotted key of the manifest, of type `kind`; a ValueError naming the key (as `shown`, when
    given) otherwise."""
    value = tree
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"no {shown or path!r}")
        value = value[part]
    # a JSON true is a Python bool, which is an int too: not a count
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{shown or path!r} is {json.dumps(value)[:40]}")
    return value


def check_manifest(manifest: Any) -> None:
    """Every key that training, verify and a rerun of prepare read, with its type, so that a folder verify passes
    is one training opens. A ValueError naming the first bad key."""
    if not isinstance(manifest, dict):
        raise ValueError("not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"format {manifest.get('format')!r} is not {FORMAT!r}")
    for key, kind in (("name", str), ("identity", str), ("eval_percent", (int, float)), ("dtype", str),
                      ("tokenizer", dict), ("tokenizer.vocab_size", int)):
        _key(manifest, key, kind)
    if manifest["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"'dtype' is {manifest['dtype']!r}, not uint16 or uint32")
    for split in SPLITS:
        for i, shard in enumerate(_key(manifest, f"splits.{split}.shards", list)):
            for key, kind in (("file", str), ("index", str), ("tokens", int), ("documents", int), ("blake2b", str)):
                value = _key(shard, key, kind, f"splits.{split}.shards[{i}].{key}")
                if kind is int and value < 0:
                    raise ValueError(f"'splits.{split}.shards[{i}].{key}' is {value}")
            if "index_blake2b" in shard:  # absent in folders prepared before it was written
                _key(shard, "index_blake2b", str, f"splits.{split}.shards[{i}].index_blake2b")


def manifest_name(path: str | None) -> str | None:
    """The name in a prepared folder's manifest, or None when `path` is not one. An unreadable manifest also
    gives None here: build_data reports it as the run's one error line a moment later."""
    if not is_prepared(path):
        return None
    try:
        return str(json.loads((Path(path) / MANIFEST).read_text())["name"])  # type: ignore[arg-type]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class ShardedTokens:
    """A split's shards as one read-only token array: len() and [a:b] slicing across shard boundaries.

    Each shard is a numpy.memmap: the pages are the kernel's page cache, shared by every worker of the host, and
    only the pages a sequence touches are read. Every slice is checked against the vocabulary, so a corrupt shard
    is named the first time it is read rather than crashing the embedding."""

    def __init__(self, folder: Path, shards: list[dict[str, Any]], dtype: np.dtype, vocab_size: int):
        self.vocab_size = vocab_size
        self.files: list[Path] = []
        self.arrays: list[np.ndarray] = []
        self.starts = [0]
        for shard in shards:
            if int(shard["tokens"]) == 0:
                continue
            path = folder / shard["file"]
            check_size(path, int(shard["tokens"]) * dtype.itemsize)
            check_size(folder / shard["index"], int(shard["documents"]) * 8)
            self.files.append(path)
            self.arrays.append(np.memmap(path, dtype=dtype, mode="r"))
            self.starts.append(self.starts[-1] + int(shard["tokens"]))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, key: slice) -> np.ndarray:
        assert isinstance(key, slice) and key.step is None
        start, stop = max(0, key.start or 0), min(len(self), len(self) if key.stop is None else key.stop)
        parts = []
        while start < stop:
            i = bisect.bisect_right(self.starts, start) - 1
            end = min(stop, self.starts[i + 1])
            part = self.arrays[i][start - self.starts[i]:end - self.starts[i]]
            if part.size and int(part.max()) >= self.vocab_size:
                bad = int(np.argmax(part >= self.vocab_size))
                raise ValueError(f"data.path: {self.files[i]} is corrupt: token {int(part[bad])} at offset "
                                 f"{start - self.starts[i] + bad} is outside the vocabulary ({self.vocab_size} "
                                 f"ids); check it with `python -m engine.data verify {self.files[i].parent}`")
            parts.append(part)
            start = end
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def check_size(path: Path, expected: int, what: str = "data.path") -> None:
    if not path.is_file():
        raise ValueError(f"{what}: {path} is missing (listed in {path.parent / MANIFEST})")
    size = path.stat().st_size
    if size != expected:
        raise ValueError(f"{what}: {path} is truncated or corrupt: {size} bytes, the manifest says {expected}")


def fingerprint(manifest: dict[str, Any], split: str) -> str:
    """The identity of a split for checkpoints, from the manifest alone (no pass over the tokens)."""
    sums = [s["blake2b"] for s in manifest["splits"][split]["shards"]]
    return hashlib.blake2b(json.dumps([manifest["identity"], split, sums]).encode(), digest_size=8).hexdigest()


def file_checksum(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def verify(folder: Path, what: str = "data.path") -> dict[str, Any]:
    """Every shard's and index's size and checksum against the manifest; the first mismatch is a ValueError naming
    the file. An index is checksummed where the manifest has its checksum (index_blake2b)."""
    manifest = read_manifest(folder, what)
    dtype = np.dtype(manifest["dtype"])
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            files = [(folder / shard["file"], int(shard["tokens"]) * dtype.itemsize, shard["blake2b"]),
                     (folder / shard["index"], int(shard["documents"]) * 8, shard.get("index_blake2b"))]
            for path, size, checksum in files:
                check_size(path, size, what)
                if checksum is not None and file_checksum(path) != checksum:
                    raise ValueError(f"{what}: {path} is corrupt: its checksum differs from {folder / MANIFEST}")
    return manifest
