"""Prepare once: tokenize a corpus in parallel worker processes into the shards of engine/data/shards.py.

    python -m engine.data prepare SOURCE... --out DIR [--tokenizer PATH] [--eval-percent P] [--workers N]

The story: list the source files; plan chunks of about --chunk-mb of text in corpus order (documents.plan_tasks);
workers (forked, each with the tokenizer) read and tokenize chunks; the parent takes results back in order, at
most 2 x workers in flight (memory stays flat), appends them to the open train and eval shards, and closes a
shard group once its train shard holds --shard-tokens tokens. The output does not depend on --workers. A .txt/.md
file is one document and one chunk, tokenized whole: one over --max-text-mb (32) is refused, so a worker's memory
stays bounded too (about 12x the largest chunk).

Never a shard that looks complete when it is not: an open shard is `NAME.partial`, renamed only once written and
fsynced; prepare.json (the journal: which groups are final and how many chunks they hold) is replaced atomically
after each group; manifest.json is written last and only then is the journal removed. Training reads only what the
manifest lists and refuses a folder with a journal and no manifest.

Run again on the same DIR: with a journal of the same sources and settings it resumes after the last final group
(stray `.partial` files and unlisted shards are removed); with a journal of other sources or settings it starts
clean; a finished folder of the same inputs is left alone once its shards match the manifest (sizes and
checksums), and prepared again from the start when they do not. It says which on stderr.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable

import numpy as np

from engine.data.documents import TEXT_SUFFIXES, check_text, find_files, is_eval_document, plan_tasks, read_task
from engine.data.shards import FORMAT, JOURNAL, MANIFEST, SPLITS, read_manifest, shard_names, verify
from engine.data.tokenizer import Tokenizer, frame_documents, load_tokenizer, token_dtype

DEFAULT_SHARD_TOKENS = 100_000_000  # ~200 MB of uint16 per train shard
DEFAULT_CHUNK_BYTES = 4 << 20
# a .txt/.md file is one document, read and tokenized whole by one worker at about 12x its size in memory (text,
# int32 ids, framed ids, the chunk's tokens; 31.5 MiB peaked at 377 MiB over the worker's start): a larger one is
# refused, not streamed, since a transformers tokenizer cut into pieces would not give the tokens of the whole
# (merges across a cut, a prefix space per piece), nor the raw path's stream
DEFAULT_MAX_TEXT_BYTES = 32 << 20
OWN_FILE = re.compile(r"^(train|eval)-\d{5}\.(bin|idx)(\.partial)?$")

# what a forked worker tokenizes with: (tokenizer, eval_percent, text_field, dtype), set before the pool forks
_WORKER: tuple[Tokenizer, float, str, np.dtype] | None = None


def tokenize_task(task: tuple) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
    """One chunk -> ([(train tokens, train doc lengths), (eval tokens, eval doc lengths)], source bytes)."""
    assert _WORKER is not None
    tokenizer, eval_percent, text_field, dtype = _WORKER
    texts, nbytes = read_task(task, text_field)
    texts = [t for t in texts if t.strip()]
    framed = frame_documents(tokenizer, texts) if texts else []
    held = [is_eval_document(t, eval_percent) for t in texts]
    out = []
    for want in (False, True):
        docs = [ids for ids, h in zip(framed, held) if h == want]
        tokens = np.concatenate(docs).astype(dtype) if docs else np.zeros(0, dtype)
        out.append((tokens, np.asarray([len(d) for d in docs], dtype=np.int64)))
    return out, nbytes


class SplitWriter:
    """The open shard of one split: tokens and document ends appended, then committed under its final name."""

    def __init__(self, out: Path, split: str, state: dict[str, Any]):
        self.out, self.split, self.state = out, split, state  # state: the journal's entry for this split
        self.files: tuple[Path, Path] | None = None
        self.handles: tuple[Any, Any] | None = None
        self.hash, self.index_hash = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
        self.tokens = self.documents = 0

    def add(self, group: int, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        if self.handles is None:
            names = shard_names(self.split, group)
            self.files = (self.out / names[0], self.out / names[1])
            self.handles = tuple(open(str(f) + ".partial", "wb") for f in self.files)  # type: ignore[assignment]
        tokens.tofile(self.handles[0])
        self.hash.update(memoryview(tokens))
        ends = (self.tokens + np.cumsum(lengths)).astype("<u8")
        ends.tofile(self.handles[1])
        self.index_hash.update(memoryview(ends))
        self.tokens += len(tokens)
        self.documents += len(lengths)

    def commit(self) -> None:
        if self.handles is None:
            return
        assert self.files is not None
        for fh, final in zip(self.handles, self.files):
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(str(final) + ".partial", final)
        self.state["shards"].append({"file": self.files[0].name, "index": self.files[1].name,
                                     "tokens": self.tokens, "documents": self.documents,
                                     "blake2b": self.hash.hexdigest(), "index_blake2b": self.index_hash.hexdigest()})
        self.state["tokens"] += self.tokens
        self.state["documents"] += self.documents
        self.files = self.handles = None
        self.hash, self.index_hash = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
        self.tokens = self.documents = 0


def write_json_atomic(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(value, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def identity(files: list[Path], tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, Any]:
    """What decides the output: a rerun with the same identity may resume; the digest is its short form."""
    sources = [{"path": str(f.resolve()), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
               for f in files]
    ident = {"sources": sources, "tokenizer": tokenizer.identity, "eval_percent": args.eval_percent,
             "text_field": args.text_field, "shard_tokens": args.shard_tokens, "chunk_bytes": args.chunk_bytes}
    ident["digest"] = hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=12).hexdigest()
    return ident


def remove_own_files(out: Path, keep: set[str]) -> int:
    """Delete shard files (final or partial) this command wrote that are not in `keep`; nothing else."""
    removed = 0
    for f in out.iterdir():
        if OWN_FILE.match(f.name) and f.name not in keep:
            f.unlink()
            removed += 1
    return removed


def open_out(out: Path, ident: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any] | None:
    """The journal to continue from (a fresh one when starting), or None when the folder is already complete."""
    fresh = {"identity": ident["digest"], "tasks_done": 0, "bytes_done": 0, "groups": 0,
             "splits": {s: {"tokens": 0, "documents": 0, "shards": []} for s in SPLITS}}
    journal_file = out / JOURNAL
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} is a file, not a folder (name a folder for the prepared dataset)")
    if (out / MANIFEST).is_file():
        if read_manifest(out, "--out")["identity"] != ident["digest"]:
            raise ValueError(f"--out: {out} already holds a prepared dataset of other sources or settings (choose "
                             f"another --out, or delete it)")
        try:
            # sizes and checksums: one read of the shards (blake2b, about 1 s per GiB from the page cache), a
            # fraction of what preparing them took, and a damaged folder's repair is to prepare it again
            verify(out, "prepare")
        except ValueError as e:
            damage = str(e).removeprefix("prepare: ")
        else:
            say(f"prepare: {out} is already prepared from these sources and settings; nothing to do")
            return None
        # the journal first: an interruption from here on resumes this prepare rather than trusting the manifest
        write_json_atomic(journal_file, fresh)
        (out / MANIFEST).unlink()
        removed = remove_own_files(out, set())
        say(f"prepare: preparing {out} again from the start: it is damaged ({damage}; {removed} file(s) removed)")
        return fresh
    if journal_file.is_file():
        try:
            journal = json.loads(journal_file.read_text())
            same = journal.get("identity") == ident["digest"]
        except ValueError:
            journal, same = None, False
        if same and journal is not None:
            keep = {s[k] for split in SPLITS for s in journal["splits"][split]["shards"] for k in ("file", "index")}
            removed = remove_own_files(out, keep)
            say(f"prepare: resuming the interrupted prepare in {out} after {journal['groups']} finished shard "
                f"group(s), {journal['tasks_done']} chunks ({removed} unfinished file(s) removed)")
            return journal
        removed = remove_own_files(out, set())
        say(f"prepare: starting clean: {out} held an interrupted prepare of other sources or settings "
            f"({removed} file(s) removed)")
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"--out: {out} is not empty and holds no prepared dataset (refusing to write into it)")
    else:
        say(f"prepare: starting {out}")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(journal_file, fresh)  # from now on an interruption is recognisable as one
    return fresh


def run_tasks(tasks, workers: int, skip: int, timeout: float):
    """Results of tasks[skip:] in order; forked workers with at most 2 x workers chunks in flight.

    A worker that dies (the OOM killer) breaks the pool at once; one that hangs is given `timeout` seconds per
    chunk. Either way prepare stops with one line, the workers are gone, and a rerun resumes."""
    pending = (t for i, t in enumerate(tasks) if i >= skip)
    if workers == 0:  # in-process: tests and debugging
        for task in pending:
            yield tokenize_task(task)
        return
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    inflight: collections.deque = collections.deque()
    started: dict[int, multiprocessing.Process] = {}  # every worker the pool forked, by pid
    try:
        for task in pending:
            inflight.append((task, pool.submit(tokenize_task, task)))  # raises too once the pool is broken
            started.update((p.pid, p) for p in multiprocessing.active_children())
            if len(inflight) >= 2 * workers:
                yield chunk_result(*inflight[0], timeout, started.values())
                inflight.popleft()
        while inflight:
            yield chunk_result(*inflight[0], timeout, started.values())
            inflight.popleft()
    except BrokenProcessPool:
        raise worker_died(inflight) from None
    finally:
        # stopped early (a failure, or the caller gave up): kill the workers, since a hung one would block
        # shutdown, and do not wait for the executor's threads (Python 3.11's can hang after a worker died);
        # the CLI leaves through os._exit, so no exit-time join waits for them either
        stopped_early = bool(inflight)
        if stopped_early:
            for child in multiprocessing.active_children():  # this process's own workers, by pid
                child.kill()
        pool.shutdown(wait=not stopped_early, cancel_futures=True)


def chunk_result(task: tuple, future, timeout: float, workers) -> Any:
    """The chunk's result, waited for in slices: a worker that died is noticed within a second even when the
    executor is not told (killed in the middle of sending a result, its half-written message blocks the executor's
    reader for good, and every future would wait out `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except FutureTimeout:
            if any(w.exitcode is not None for w in workers):  # workers live until shutdown: any exit is a death
                raise BrokenProcessPool from None
            if time.monotonic() >= deadline:
                raise RuntimeError(f"prepare: no result for a chunk of {task[1]} within {timeout:.0f} s (a worker "
                                   f"hangs; see --task-timeout); run the command again to resume") from None


def worker_died(inflight) -> RuntimeError:
    where = inflight[0][0][1] if inflight else "the corpus"
    return RuntimeError(f"prepare: a worker process died while tokenizing a chunk of {where} (killed, or out of "
                        f"memory?); run the command again to resume")


def prepare(args: argparse.Namespace, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or resume) a prepare; returns the manifest."""
    global _WORKER
    files: list[Path] = []
    for source in args.sources:
        files += find_files(source, "prepare")
    files = list(dict.fromkeys(files))  # a file named by two sources is read once
    for f in files:
        if f.suffix.lower() in TEXT_SUFFIXES:
            check_text(f, "prepare")  # before anything is written, as the size below
        if f.suffix.lower() in TEXT_SUFFIXES and f.stat().st_size > args.max_text_bytes:
            raise ValueError(f"prepare: {f} holds {f.stat().st_size / (1 << 20):.1f} MiB, over --max-text-mb "
                             f"{args.max_text_bytes / (1 << 20):g} (a .txt/.md file is one document, tokenized "
                             f"whole, at about 12x its size in memory): split it into files of whole lines (`split "
                             f"-C 32M --additional-suffix=.txt FILE PREFIX`) or make it a .jsonl of documents")
    tokenizer = load_tokenizer(args.tokenizer, "--tokenizer")
    dtype = token_dtype(tokenizer.vocab_size)
    out = Path(args.out)
    ident = identity(files, tokenizer, args)
    created = not out.exists()
    journal = open_out(out, ident, say)
    if journal is None:
        return read_manifest(out)
    _WORKER = (tokenizer, args.eval_percent, args.text_field, dtype)  # inherited by the forked workers
    writers = {s: SplitWriter(out, s, journal["splits"][s]) for s in SPLITS}
    bar = progress_bar(sum(s["bytes"] for s in ident["sources"]), journal["bytes_done"], args.quiet)
    t0 = time.monotonic()
    tasks = plan_tasks(files, args.text_field, args.chunk_bytes)
    for i, (splits, nbytes) in enumerate(run_tasks(tasks, args.workers, journal["tasks_done"], args.task_timeout),
                                         start=journal["tasks_done"] + 1):
        for split, (tokens, lengths) in zip(SPLITS, splits):
            writers[split].add(journal["groups"], tokens, lengths)
        journal["tasks_done"], journal["bytes_done"] = i, journal["bytes_done"] + nbytes
        bar.update(nbytes)
        if writers["train"].tokens >= args.shard_tokens:
            commit_group(out, writers, journal)
    commit_group(out, writers, journal)
    bar.close()
    if journal["splits"]["train"]["tokens"] == 0:  # nothing to train on: no folder that looks like a dataset
        discard(out, created)
        held = journal["splits"]["eval"]["documents"]
        why = f"all {held} document(s) went to the held-out split: lower --eval-percent" if held else \
            "no document with text"
        raise ValueError(f"prepare: {', '.join(map(str, args.sources))} holds no text to train on ({why})")
    seconds = time.monotonic() - t0
    manifest = {"format": FORMAT, "name": args.name or out.resolve().name, "created": time.time(),
                "identity": ident["digest"], "tokenizer": tokenizer.identity, "dtype": dtype.name,
                "eval_percent": args.eval_percent, "text_field": args.text_field,
                "sources": [{"path": s["path"], "bytes": s["bytes"]} for s in ident["sources"]],
                "source_bytes": journal["bytes_done"], "seconds": round(seconds, 3), "splits": journal["splits"]}
    write_json_atomic(out / MANIFEST, manifest)
    (out / JOURNAL).unlink()
    say(f"prepare: {out}: {manifest['splits']['train']['tokens']} train + {manifest['splits']['eval']['tokens']} "
        f"eval tokens ({dtype.name}) in {len(manifest['splits']['train']['shards'])} train shard(s), "
        f"{seconds:.1f} s")
    return manifest


def discard(out: Path, created: bool) -> None:
    """Remove what this prepare wrote (its shards and journal), and the folder too if it made it."""
    remove_own_files(out, set())
    (out / JOURNAL).unlink(missing_ok=True)
    if created and not any(out.iterdir()):
        out.rmdir()


def commit_group(out: Path, writers: dict[str, SplitWriter], journal: dict[str, Any]) -> None:
    if writers["train"].handles is None and writers["eval"].handles is None:
        return
    for writer in writers.values():
        writer.commit()
    journal["groups"] += 1
    write_json_atomic(out / JOURNAL, journal)  # the group is final only once the journal says so


def progress_bar(total: int, done: int, quiet: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=done, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare",
                file=sys.stderr, disable=quiet, mininterval=0.5)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine.data", description="Tokenize a corpus once into "
                                     "memory-mapped shards, or verify a prepared folder.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize SOURCE... into --out DIR")
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="files, folders or globs of .txt/.md/.jsonl/"
                   ".parquet/.arrow")
    p.add_argument("--out", required=True, help="the prepared folder (created; resumed if interrupted)")
    p.add_argument("--tokenizer", default=None, help="a local transformers tokenizer folder (default: bytes)")
    p.add_argument("--eval-percent", type=float, default=2.0, help="percent of documents held out (by hash)")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl records / table columns")
    p.add_argument("--name", default=None, help="the dataset's name in the manifest (default: DIR's name)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (0: inline)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="train tokens per shard")
    p.add_argument("--chunk-mb", type=float, default=DEFAULT_CHUNK_BYTES / (1 << 20),
                   help="text per worker task, MiB")
    p.add_argument("--task-timeout", type=float, default=600.0, help="seconds a worker may take for one chunk")
    p.add_argument("--max-text-mb", type=float, default=DEFAULT_MAX_TEXT_BYTES / (1 << 20),
                   help="the largest .txt/.md file, MiB (one document, tokenized whole: ~12x its size in memory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    v = sub.add_parser("verify", help="check every shard of DIR against the manifest's sizes and checksums")
    v.add_argument("folder", metavar="DIR")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        if not 0 <= args.eval_percent < 100:
            parser.error(f"--eval-percent {args.eval_percent}: expected 0 <= P < 100")
        if args.workers < 0 or args.shard_tokens < 1 or min(args.chunk_mb, args.task_timeout, args.max_text_mb) <= 0:
            parser.error("--workers must be >= 0, --shard-tokens >= 1, --chunk-mb, --task-timeout and --max-text-mb "
                         "> 0")
        args.chunk_bytes = int(args.chunk_mb * (1 << 20))
        args.max_text_bytes = int(args.max_text_mb * (1 << 20))
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 bad input (one `error: ...` line), 1 a worker lost, 130 interrupted (rerun to
    resume)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 - stdout stays free for pipes
    try:
        if args.command == "verify":
            manifest = verify(Path(args.folder), "verify")
            say(f"verify: {args.folder}: {sum(len(manifest['splits'][s]['shards']) for s in SPLITS)} shard(s) "
                f"match {MANIFEST}")
        else:
            prepare(args, say)
    except ValueError as e:
        say(f"error: {e}")
        return 2
    except RuntimeError as e:
        say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        say(f"prepare: interrupted; run the same command again to resume {getattr(args, 'out', '')}")
        return 130
    return 0
