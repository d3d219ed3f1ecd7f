"""The console's own checkout: what `check` compares every host with, and what `sync` sends them.

    here = Checkout.find()               # the folder holding console/ and engine/; None outside a checkout
    here.commit, here.engine             # HEAD's commit and the digest of its engine/**/*.py
                                         # (host_script.engine_digest)
    here.files                           # HEAD's tracked files: [TrackedFile(path, mode, blob, size)]
    here.read(files)                     # their content at HEAD (git cat-file --batch), never the working tree's
    here.changed()                       # tracked files edited since HEAD (sync warns: the hosts get HEAD)

The version of the project is HEAD's content: sync sends each tracked file as it is at the commit, and a host
whose engine/**/*.py have the blob ids of HEAD's has the console's version, with or without git on the host.
Outside a git checkout (an installed console) the digest is that of the engine files on disk and there is
nothing to sync from.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from console.preflight import host_script

GIT_TIMEOUT_S = 30.0


class CheckoutError(RuntimeError):
    """git failed on the console's checkout: one line."""


@dataclass(frozen=True)
class TrackedFile:
    path: str  # relative, '/'-separated
    mode: int  # 0o644 or 0o755
    blob: str  # git blob id
    size: int


class Checkout:
    def __init__(self, root: Path):
        self.root = root

    @classmethod
    def find(cls) -> "Checkout | None":
        root = Path(__file__).resolve().parents[2]  # console/preflight/checkout.py -> the checkout
        return cls(root) if (root / "engine").is_dir() else None

    @property
    def is_git(self) -> bool:
        return (self.root / ".git").exists()

    @cached_property
    def machine(self) -> str:
        return host_script.machine_id()

    @cached_property
    def commit(self) -> str | None:
        if not self.is_git:
            return None
        return self._git("rev-parse", "HEAD").decode().strip() or None

    @cached_property
    def files(self) -> list[TrackedFile]:
        """HEAD's tracked files (links and submodules are not files and are left out)."""
        if not self.is_git:
            return []
        out = []
        for record in self._git("ls-tree", "-r", "-l", "-z", "--full-tree", "HEAD").split(b"\0"):
            if not record:
                continue
            meta, path = record.split(b"\t", 1)
            mode, kind, blob, size = meta.split()
            if kind != b"blob" or mode not in (b"100644", b"100755"):
                continue
            out.append(TrackedFile(path.decode(), 0o755 if mode == b"100755" else 0o644, blob.decode(), int(size)))
        return out

    @cached_property
    def engine(self) -> str | None:
        """The digest of the engine's source at HEAD (on disk outside git): what every host must have."""
        if not self.is_git:
            return host_script.engine_digest(str(self.root))[0]
        entries = [(f.path, f.blob) for f in self.files if f.path.startswith("engine/") and f.path.endswith(".py")]
        return host_script.digest_of(entries) if entries else None

    def label(self) -> str:
        return f"commit {self.commit[:10]}" if self.commit else f"engine {self.engine}"

    def read(self, files: list[TrackedFile]) -> dict[str, bytes]:
        """The content of the given files at HEAD, by path, in one `git cat-file --batch`."""
        if not files:
            return {}
        out = self._git("cat-file", "--batch", stdin="".join(f"{f.blob}\n" for f in files).encode())
        contents: dict[str, bytes] = {}
        pos = 0
        for f in files:
            end = out.index(b"\n", pos)
            header = out[pos:end].split()
            if len(header) != 3 or header[0].decode() != f.blob:
                raise CheckoutError(f"git cat-file: unexpected answer for {f.path}: {out[pos:end][:80]!r}")
            size = int(header[2])
            contents[f.path] = out[end + 1:end + 1 + size]
            pos = end + 1 + size + 1  # the content, then a newline
        return contents

    def changed(self) -> list[str]:
        """Tracked files whose working copy differs from HEAD (sync sends HEAD's, so these stay behind)."""
        if not self.is_git:
            return []
        return [p for p in self._git("diff", "--name-only", "-z", "HEAD", "--").decode().split("\0") if p]

    def is_this(self, machine: str | None, folder: str | None) -> bool:
        """Whether a host's folder is this very checkout (same machine, same real path)."""
        return machine == self.machine and folder is not None and \
            os.path.realpath(folder) == os.path.realpath(self.root)

    def _git(self, *args: str, stdin: bytes | None = None) -> bytes:
        try:
            done = subprocess.run(["git", "-C", str(self.root), *args], input=stdin, capture_output=True,
                                  timeout=GIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CheckoutError(f"git {args[0]} in {self.root}: {e}") from None
        if done.returncode != 0:
            raise CheckoutError(f"git {args[0]} in {self.root}: {done.stderr.decode(errors='replace').strip()}")
        return done.stdout
