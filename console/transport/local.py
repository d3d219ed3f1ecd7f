"""LocalTransport: the host is this machine. Commands run through /bin/sh as asyncio subprocesses; files are
followed by reading them directly (no `tail` process per node)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import deque
from pathlib import Path
from typing import IO, Sequence

from console.transport import commands as C
from console.transport.base import Tail, Transport, TransportError, lines_of

POLL_S = 0.1  # how often a quiet file is looked at again
_CHUNK = 1 << 16


class LocalTransport(Transport):
    kind = "local"

    async def run_bytes(self, cmd: str, timeout: float | None = 30.0,
                        stdin: bytes | None = None) -> tuple[int, bytes, str]:
        try:
            proc = await asyncio.create_subprocess_shell(
                cmd, stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True)  # its own group: a timeout kills it all
        except OSError as e:
            raise TransportError(f"cannot run a shell here: {e}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            _kill_group(proc.pid)
            await proc.wait()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise TransportError(f"command timed out after {timeout}s") from None
        rc = proc.returncode if proc.returncode is not None and proc.returncode >= 0 else -1
        return rc, out, err.decode(errors="replace")

    def tail(self, path: str, from_offset: int = 0) -> Tail:
        return LocalTail(self.resolve(path), from_offset)

    async def put_files(self, root: str, files: Sequence[tuple[str, bytes, int]]) -> None:
        try:
            await asyncio.to_thread(write_files, self.resolve(root), files)
        except OSError as e:
            raise TransportError(f"cannot write under {root}: {e}") from None

    def resolve(self, path: str) -> Path:
        p = Path(os.path.expanduser(path))
        return p if p.is_absolute() else Path(os.path.expanduser(self.workdir)) / p


class LocalTail(Tail):
    def __init__(self, path: Path, offset: int = 0, poll_s: float = POLL_S):
        self.path = path
        self.offset = offset
        self._poll_s = poll_s
        self._pending: deque[bytes] = deque()
        self._partial = b""
        self._file: IO[bytes] | None = None

    async def __anext__(self) -> bytes:
        while not self._pending:
            await self._fill()
        line = self._pending.popleft()
        self.offset += len(line) + 1
        return line

    async def _fill(self) -> None:
        if self._file is None:
            try:
                self._file = open(self.path, "rb")  # noqa: SIM115 (kept open while following)
            except FileNotFoundError:
                await asyncio.sleep(self._poll_s)  # not written yet: wait for it
                return
            except OSError as e:
                raise TransportError(f"cannot read {self.path}: {e}") from None
            self._file.seek(self.offset)
        try:
            size = os.fstat(self._file.fileno()).st_size
            if size < self._file.tell():  # truncated (a fresh start): read it again from the top
                self.offset, self._partial = 0, b""
                self._file.seek(0)
            chunk = self._file.read(_CHUNK)
        except OSError as e:
            raise TransportError(f"cannot read {self.path}: {e}") from None
        if not chunk:
            if not self._replaced():
                await asyncio.sleep(self._poll_s)
            return
        lines, self._partial = lines_of(chunk, self._partial)
        self._pending.extend(lines)

    def _replaced(self) -> bool:
        """The path now names another file (deleted and recreated): follow the new one from its start."""
        assert self._file is not None  # read from just before
        try:
            same = os.path.samestat(os.fstat(self._file.fileno()), os.stat(self.path))
        except FileNotFoundError:
            return False
        if same:
            return False
        self._file.close()
        self._file, self.offset, self._partial = None, 0, b""
        return True

    async def aclose(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_files(root: Path, files: Sequence[tuple[str, bytes, int]]) -> None:
    for rel, data, mode in files:
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + C.SYNC_SUFFIX)
        tmp.write_bytes(data)
        tmp.chmod(mode)
        os.replace(tmp, dst)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
