"""Documents from local files: which files a source names, how each kind is read, and the held-out split.

    .txt .md          one document per file
    .jsonl            one document per line, the text in a string field (data.text_field / --text-field)
    .parquet .arrow   one document per row, read with Hugging Face `datasets` in streaming mode from local
                      files only (the packaged parquet/arrow builders; the hub is never asked)

Two readers share these rules: `read_documents` streams documents in order (the raw-folder path of training),
and `plan_tasks` cuts the same documents, in the same order, into chunks of roughly `chunk_bytes` that prepare's
worker processes read and tokenize on their own (`read_task`). A .jsonl file is cut into byte ranges at line
starts, so workers parse it in parallel; a table file is streamed by the planner and its rows sent as text.

Decoding, the same in both readers so that a prepared folder and its raw files give the same tokens: UTF-8, a
byte-order mark dropped (a .jsonl line's too, as where files were concatenated), each invalid byte as U+FFFD; in
a .jsonl text, each unpaired UTF-16 surrogate escape (`"\\ud83d"`, an emoji cut in half by a web scrape, which JSON
accepts) as U+FFFD too, since it has no UTF-8 form and the tokenizers refuse it.

Binary input: a .txt/.md file is refused, with one line naming it, when its first 8 KiB (SNIFF_BYTES) hold a NUL
byte (as git and grep decide; UTF-16 text has them too) or more than a tenth of characters that are not text
(invalid UTF-8 and control characters other than tab, newline, carriage return, form feed and vertical tab). A
Latin-1 `é` now and then stays text. Random bytes named `.txt` trained and prepared without a word.

Held-out split: a document goes to eval when a hash of its text falls in the first eval_percent percent, so the
split does not depend on file order, chunking or the number of workers.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import re
from pathlib import Path
from typing import Iterator

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
TABLE_SUFFIXES = (".parquet", ".arrow")
SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES

# ("file", path) | ("jsonl", path, start, end) | ("texts", path, [text, ...]): plain tuples, cheap to pickle
Task = tuple

SNIFF_BYTES = 8192  # how much of a .txt/.md file is looked at for binary content
NOT_TEXT_SHARE = 0.10  # more than this share of the sniffed characters not text: binary
# control characters that are no part of text (tab, newline, vertical tab, form feed and carriage return are)
CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")

# what json.loads leaves of a "\udXXX" escape without its pair (a pair becomes the one character it encodes)
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def find_files(path: str, what: str = "data.path") -> list[Path]:
    """The corpus files named by a file, a folder (recursive) or a glob, in a stable (sorted) order."""
    p = Path(path)
    if p.is_file():
        candidates = [p]
    elif p.is_dir():
        candidates = [f for f in p.rglob("*") if f.is_file()]
    else:
        candidates = [Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file()]
        if not candidates:
            raise ValueError(f"{what}: {path} does not exist (expected a file, folder or glob of "
                             f".txt/.md/.jsonl/.parquet/.arrow files)")
    files = sorted(f for f in candidates if f.suffix.lower() in SUFFIXES)
    if not files:
        raise ValueError(f"{what}: no .txt, .md, .jsonl, .parquet or .arrow files in {path}")
    return files


def is_eval_document(text: str, eval_percent: float) -> bool:
    """Stable across runs, file orders and worker counts: decided by the text alone."""
    bucket = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little") % 10_000
    return bucket < eval_percent * 100


# ---------------------------------------------------------------------------------------------- one file kind each

def read_text_file(path: Path, what: str = "data.path") -> str:
    check_text(path, what)
    return path.read_text(encoding="utf-8-sig", errors="replace")


def check_text(path: Path, what: str) -> None:
    """A ValueError naming the file when its first SNIFF_BYTES look binary (the module's docstring)."""
    with path.open("rb") as fh:
        sample = fh.read(SNIFF_BYTES)
    nul = sample.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{what}: {path} is not text: a NUL byte at byte {nul} (binary, or UTF-16: a .txt/.md file "
                         f"is read as UTF-8)")
    # a character cut at the sample's end is not counted as invalid (final only when the sample is the whole file)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text = decoder.decode(sample, final=len(sample) < SNIFF_BYTES)
    bad = text.count("\ufffd") + len(CONTROL.findall(text))
    if text and bad > NOT_TEXT_SHARE * len(text):
        raise ValueError(f"{what}: {path} is not text: {bad} of the first {len(text)} characters are invalid UTF-8 or "
                         f"control characters (over {NOT_TEXT_SHARE:.0%}; a .txt/.md file is read as UTF-8 text)")


def _record_text(path: Path, lineno: int, line: bytes, text_field: str) -> str:
    try:
        record = json.loads(line.decode("utf-8-sig", errors="replace"))
    except ValueError:
        raise ValueError(f"{path}:{lineno}: not a JSON object") from None
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        raise ValueError(f"{path}:{lineno}: no string field {text_field!r} (set data.text_field / --text-field)")
    if not text.isascii():  # O(1) for the common all-ASCII text
        text = LONE_SURROGATE.sub("\ufffd", text)
    return text


def _line_number(path: Path, offset: int) -> int:
    """The 1-based line at byte `offset`: only computed for an error message."""
    count, done = 1, 0
    with path.open("rb") as fh:
        while done < offset:
            block = fh.read(min(1 << 20, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count


def jsonl_range(path: Path, start: int, end: int, text_field: str) -> list[str]:
    with path.open("rb") as fh:
        fh.seek(start)
        blob = fh.read(end - start)
    texts, offset = [], start
    for line in blob.split(b"\n"):
        if line.strip():
            try:
                texts.append(_record_text(path, 0, line, text_field))
            except ValueError as e:
                lineno = _line_number(path, offset)
                raise ValueError(str(e).replace(f"{path}:0:", f"{path}:{lineno}:", 1)) from None
        offset += len(line) + 1
    return texts


def jsonl_ranges(path: Path, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Byte ranges of about chunk_bytes that start and end at line starts."""
    size = path.stat().st_size
    start = 0
    with path.open("rb") as fh:
        while start < size:
            if start + chunk_bytes >= size:
                end = size
            else:
                fh.seek(start + chunk_bytes)
                fh.readline()  # to the end of the line that crosses the boundary
                end = fh.tell()
            yield start, end
            start = end


class _TableError(ValueError):
    """Our own message about a table file (pyarrow's ArrowInvalid is a ValueError too, and gets wrapped)."""


def table_batches(path: Path, text_field: str, batch_rows: int = 1024) -> Iterator[list[str]]:
    """Rows of a local .parquet/.arrow file through `datasets` (streaming: memory does not grow with the file)."""
    import logging

    import datasets
    datasets.config.HF_HUB_OFFLINE = True  # belt and braces: the packaged builders read local files only
    datasets.utils.logging.set_verbosity(logging.CRITICAL)  # its own error lines would double our one line
    builder = "parquet" if path.suffix.lower() == ".parquet" else "arrow"
    try:
        ds = datasets.load_dataset(builder, data_files=[str(path)], split="train", streaming=True)
        columns = list(ds.features) if ds.features is not None else None
        if columns is not None and text_field not in columns:
            raise _TableError(f"{path}: no column {text_field!r} (columns: {', '.join(columns)}; set "
                              f"data.text_field / --text-field)")
        for batch in ds.iter(batch_size=batch_rows):
            texts = batch.get(text_field)
            if texts is None or not all(isinstance(t, str) for t in texts):
                raise _TableError(f"{path}: column {text_field!r} is not a string column")
            yield texts
    except _TableError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow and datasets raise many types for an unreadable file
        raise ValueError(f"{path}: not a readable {builder} file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:160]})") from None


# ---------------------------------------------------------------------------------------------- in order

def read_documents(files: list[Path], text_field: str, what: str = "data.path") -> Iterator[str]:
    for f in files:
        suffix = f.suffix.lower()
        if suffix in TEXT_SUFFIXES:
            yield read_text_file(f, what)
        elif suffix in JSONL_SUFFIXES:
            with f.open("rb") as fh:  # lines of bytes, as jsonl_range cuts them
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        yield _record_text(f, lineno, line, text_field)
        else:
            for texts in table_batches(f, text_field):
                yield from texts


# ---------------------------------------------------------------------------------------------- in chunks

def plan_tasks(files: list[Path], text_field: str, chunk_bytes: int) -> Iterator[Task]:
    """The chunks of work, in corpus order. Deterministic for the same files, so a resumed prepare can skip the
    first K tasks it already wrote."""
    for f in files:
        suffix = f.suffix.lower()
        if suffix in TEXT_SUFFIXES:
            yield ("file", str(f))
        elif suffix in JSONL_SUFFIXES:
            for start, end in jsonl_ranges(f, chunk_bytes):
                yield ("jsonl", str(f), start, end)
        else:
            pending, size = [], 0
            for texts in table_batches(f, text_field):
                pending.extend(texts)
                size += sum(len(t) for t in texts)
                if size >= chunk_bytes:
                    yield ("texts", str(f), pending)
                    pending, size = [], 0
            if pending:
                yield ("texts", str(f), pending)


def read_task(task: Task, text_field: str) -> tuple[list[str], int]:
    """(documents, source bytes they came from) of one task."""
    kind, path = task[0], Path(task[1])
    if kind == "file":
        return [read_text_file(path, "prepare")], path.stat().st_size
    if kind == "jsonl":
        return jsonl_range(path, task[2], task[3], text_field), task[3] - task[2]
    return task[2], sum(len(t.encode("utf-8")) for t in task[2])
