"""The transport interface: run a command, start one detached, follow a file, signal and probe processes.

Every method is async and knows nothing of Textual or of the fleet. Failures of the host or the link surface as
TransportError with a one-line reason, which the cluster turns into a node state; nothing else escapes.
"""

from __future__ import annotations

import abc
import re
from typing import Mapping, Sequence

from console.dependency_warnings import without_dependency_warnings
from console.profile import HostSpec
from console.transport import commands as C


class TransportError(Exception):
    """The host or the link failed; str() is the reason shown on the node.

    `link` is True when the host could not be reached at all (connect, host key, login, a dropped link), as
    opposed to a command that ran there and failed.
    """

    def __init__(self, reason: str, link: bool = False):
        super().__init__(reason)
        self.link = link


SAID_SPARE = 40  # lines read beyond what last_said() returns: room for twenty two-line warnings after the reason
_BACKOFF = re.compile(r" \(retrying in [\d.]+s\)")


def backoff_note(seconds: float) -> str:
    """What a call failed fast during a reconnect's backoff adds to the last reason (live, on the node's row)."""
    return f" (retrying in {seconds:.1f}s)"


def without_backoff(reason: str) -> str:
    """The reason without the backoff note: a verdict (check, a failed add) that nothing will retry."""
    return _BACKOFF.sub("", reason)


class Tail(abc.ABC):
    """An async iterator over the complete lines (bytes, without the newline) of a growing file.

    `offset` is the byte offset just past the last line handed out: a new tail from it resumes exactly there.
    Raises TransportError when the link fails; the caller re-tails from `offset`.
    """

    offset: int

    def __aiter__(self) -> "Tail":
        return self

    @abc.abstractmethod
    async def __anext__(self) -> bytes: ...

    async def aclose(self) -> None:
        return None


class Transport(abc.ABC):
    kind = "abstract"

    def __init__(self, host: HostSpec):
        self.host = host

    @property
    def workdir(self) -> str:
        return self.host.workdir

    async def run(self, cmd: str, timeout: float | None = 30.0, stdin: bytes | None = None) -> tuple[int, str, str]:
        """Run shell text on the host; (exit status, stdout, stderr). -1 when it died of a signal.
        stdin: bytes fed to the command (secrets go this way, never into the command text)."""
        rc, out, err = await self.run_bytes(cmd, timeout, stdin)
        return rc, out.decode(errors="replace"), err

    @abc.abstractmethod
    async def run_bytes(self, cmd: str, timeout: float | None = 30.0,
                        stdin: bytes | None = None) -> tuple[int, bytes, str]:
        """run() with stdout as bytes: event files are read byte-exact, so offsets stay true."""

    @abc.abstractmethod
    def tail(self, path: str, from_offset: int = 0) -> Tail:
        """Follow path (relative to the workdir unless absolute) from a byte offset."""

    async def connect(self) -> None:
        """Make sure the host can be reached (a no-op where there is nothing to connect)."""

    async def put_files(self, root: str, files: Sequence[tuple[str, bytes, int]]) -> None:
        """Write (relative path, content, mode) files under the absolute folder root, each to a temporary name then
        renamed over the old one (a reader never sees half a file); folders are made as needed (console/sync.py)."""
        raise TransportError(f"{self.kind} transport cannot send files")

    async def close(self) -> None:
        """Drop connections. Detached processes keep running."""

    # ---- built on run() ----------------------------------------------------------------------------------
    async def start_detached(self, argv: Sequence[str], run_dir: str, env: Mapping[str, str] | None = None,
                             append: bool = False) -> int:
        """Start argv detached (setsid + nohup) with its output in run_dir; returns its pid (= its process group).
        env reaches argv through a 0600 file fed on stdin, never through a command line (see commands.py)."""
        text = C.env_file_text(env) if env else None
        cmd = C.detached_command(argv, workdir=self.workdir, run_dir=run_dir, with_env=text is not None,
                                 append=append)
        rc, out, err = await self.run(cmd, stdin=None if text is None else text.encode())
        last = out.strip().splitlines()[-1:] if out.strip() else []
        if rc != 0 or not last or not last[0].isdigit():
            raise TransportError(f"could not start {argv[0]}: {(err or out).strip() or f'status {rc}'}")
        return int(last[0])

    async def signal(self, pid: int, sig: str = "TERM", group: bool = True) -> bool:
        """Send sig to pid (group: to its whole process group) with `kill`; False if there was no such process."""
        rc, _, _ = await self.run(C.kill_command(pid, sig, group))
        return rc == 0

    async def alive(self, pid: int, tag: str | None = None) -> bool:
        """Whether pid runs (and, with tag, is ours: its command line contains the tag)."""
        rc, _, _ = await self.run(C.alive_command(pid, tag))
        return rc == 0

    async def group_alive(self, pgid: int) -> bool:
        """Whether any process of the process group pgid (a detached start's pid) still runs."""
        rc, _, _ = await self.run(C.group_alive_command(pgid))
        return rc == 0

    async def read_from(self, path: str, offset: int) -> tuple[list[bytes], int]:
        """The complete lines of a file from offset to its current end, and the offset after them."""
        rc, out, _ = await self.run_bytes(C.read_from_command(path, offset, self.workdir))
        if rc != 0 or not out:
            return [], offset
        lines, partial = lines_of(out, b"")
        return lines, offset + len(out) - len(partial)

    async def read_text(self, path: str) -> str | None:
        """A small file's text, or None if it is not there."""
        rc, out, _ = await self.run(C.read_command(path, self.workdir))
        return out if rc == 0 else None

    async def size(self, path: str) -> int | None:
        """A file's size in bytes, or None if it is not there."""
        rc, out, _ = await self.run(C.size_command(path, self.workdir))
        return int(out.strip()) if rc == 0 and out.strip().isdigit() else None

    async def last_lines(self, path: str, lines: int = 5) -> str:
        rc, out, _ = await self.run(C.tail_lines_command(path, lines, self.workdir))
        return out if rc == 0 else ""

    async def write_text(self, path: str, text: str) -> None:
        rc, _, err = await self.run(C.write_command(path, self.workdir), stdin=text.encode())
        if rc != 0:
            raise TransportError(f"could not write {path}: {err.strip()}")

    async def touch(self, path: str) -> None:
        rc, _, err = await self.run(C.touch_command(path, self.workdir))
        if rc != 0:
            raise TransportError(f"could not create {path}: {err.strip()}")

    async def remove(self, path: str) -> None:
        await self.run(C.remove_command(path, self.workdir))

    async def archive(self, path: str, archive_dir: str) -> None:
        rc, _, err = await self.run(C.archive_command(path, archive_dir, self.workdir))
        if rc != 0:
            raise TransportError(f"could not move {path} to {archive_dir}: {err.strip()}")

    async def launch_check(self, config: str | None = None) -> str | None:
        """None when the host can run the engine; else why not (missing workdir, python or config)."""
        python = self.host.python_path
        rc, _, err = await self.run(C.launch_check_command(workdir=self.workdir, python=python, config=config))
        reason = C.launch_check_reason(rc, workdir=self.workdir, python=python, config=config)
        return reason if rc in C.LAUNCH_CHECK_REASONS or rc == 0 else f"{reason}: {err.strip()}"


async def last_said(t: Transport, path: str, lines: int = 3) -> list[str]:
    """The last lines of a process's log (its stderr) as a reason quotes them: without a dependency's deprecation
    warnings (console/dependency_warnings.py), so a node never reads "exited: <a library's source line>". The log
    itself keeps them."""
    text = await t.last_lines(path, lines + SAID_SPARE)
    return without_dependency_warnings(text).strip().splitlines()[-lines:]


async def collect(tail: Tail, limit: int) -> list[bytes]:
    """Read `limit` lines from a tail (tests and one-shot readers)."""
    out: list[bytes] = []
    async for line in tail:
        out.append(line)
        if len(out) >= limit:
            break
    return out


def lines_of(chunk: bytes, partial: bytes) -> tuple[list[bytes], bytes]:
    """Split a chunk into complete lines, carrying an unfinished line over to the next chunk."""
    data = partial + chunk
    parts = data.split(b"\n")
    return parts[:-1], parts[-1]

