"""SshTransport: one asyncssh connection per host, shared by every channel, bounded below OpenSSH's MaxSessions.

* connect timeout and keepalive (1 s x 3): asyncssh has neither by default, and without them an unreachable host
  hangs ~130 s and a dead link is never noticed;
* reconnect on demand with exponential backoff: between failed attempts, calls fail fast with the last reason;
* host keys checked strictly against known_hosts; `accept_new_host_key` (an explicit profile opt-in, or the
  command line's --accept-new-host-keys) trusts and records the key of a host that has no entry yet, and the
  `hostkeys` command records the keys it showed after an explicit yes (console/hostkeys.py). A CHANGED key is
  always refused;
* ~/.ssh/config honoured (aliases, HostName, Port, User, IdentityFile, ProxyJump); jump hosts like `ssh -J`;
* signals are `kill` commands (OpenSSH delivers channel signals only to non-root sessions).

(OSError, asyncssh.Error) are caught here, at the boundary, and become TransportError with a one-line reason.
"""

from __future__ import annotations

import asyncio
import os
import posixpath
import socket
import time
from collections import deque
from types import SimpleNamespace
from typing import Any, Sequence

import asyncssh

from console.profile import HostSpec, missing_key
from console.sshconfig import identity_files, known_hosts_files, proxy_jump, split_target, ssh_hostname, ssh_port
from console.transport import commands as C
from console.transport.base import Tail, Transport, TransportError, backoff_note, lines_of

MAX_CHANNELS = 8  # OpenSSH MaxSessions is 10 per connection; keep headroom
KEEPALIVE_S = 1.0
KEEPALIVE_COUNT = 3
CLOSE_WAIT_S = 3.0
CHANNEL_RETRY_S = (0.05, 0.1, 0.2, 0.4, 0.8)
BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)
TAIL_CHUNK = 1 << 16
SFTP_PARALLEL = 16  # files in flight at once: a high-latency link is not paid once per file


class _Client(asyncssh.SSHClient):
    """Tracks the link and implements accept-new host keys (called only for keys not in known_hosts)."""

    def __init__(self, owner: "SshTransport"):
        self._owner = owner

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._link_lost(exc)

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        return self._owner._accept_new_key(host, addr, port, key)


class SshTransport(Transport):
    kind = "ssh"

    def __init__(self, host: HostSpec):
        super().__init__(host)
        self._conn: asyncssh.SSHClientConnection | None = None
        self._jump: asyncssh.SSHClientConnection | None = None
        self._lock = asyncio.Lock()
        self._channels = asyncio.Semaphore(MAX_CHANNELS)
        self._failures = 0
        self._retry_at = 0.0
        self._last_error: str | None = None
        self.lost_reason: str | None = None  # why the last link went down
        self.accepted_key: str | None = None  # the known_hosts line written under accept_new_host_key
        # the last host key offered that known_hosts does not trust: (name, port, key) as ssh checks it, and
        # "new" (no key at all for that name) or "changed" (another key is recorded for it)
        self.offered: tuple[str, int, asyncssh.SSHKey] | None = None
        self.offered_verdict: str | None = None
        self._encrypted_key: str | None = None  # an identity file with a passphrase: only ssh-agent can use it

    # ---- the connection ------------------------------------------------------------------------------------
    @property
    def known_hosts_path(self) -> str:
        """The user's known_hosts file: where accept_new_host_key writes, and the one the messages name."""
        return known_hosts_files(self.host)[0][0]

    @property
    def server_host_key(self) -> asyncssh.SSHKey | None:
        """The host key the open connection was made with (None when none is open)."""
        return self._conn.get_server_host_key() if self._conn is not None and not self._conn.is_closed() else None

    def _known_hosts(self) -> asyncssh.SSHKnownHosts:
        """Every known_hosts file ssh would consult for the host, the global ones included: a key handed out in
        /etc/ssh/ssh_known_hosts (or ssh_config's UserKnownHostsFile) was "unknown" where ssh connected."""
        user, system = known_hosts_files(self.host)
        present = [p for p in user + system if os.path.isfile(p)]
        return asyncssh.read_known_hosts(present) if present else asyncssh.import_known_hosts("")

    async def connect(self) -> None:
        await self._connection()

    async def _connection(self) -> asyncssh.SSHClientConnection:
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            now = time.monotonic()
            if self._last_error and now < self._retry_at:  # back off: do not hammer a host that just failed
                raise TransportError(self._last_error + backoff_note(self._retry_at - now), link=True)
            try:
                self._conn = await self._open()
            except (OSError, asyncssh.Error, asyncssh.KeyImportError, asyncio.TimeoutError, TransportError) as e:
                self._conn = None
                self._last_error = str(e) if isinstance(e, TransportError) else self._describe(e)
                self._retry_at = time.monotonic() + BACKOFF_S[min(self._failures, len(BACKOFF_S) - 1)]
                self._failures += 1
                raise TransportError(self._last_error, link=True) from None
            self._failures, self._last_error, self.lost_reason = 0, None, None
            return self._conn

    def _options(self) -> dict:
        """Connection options from the profile; what it leaves unset comes from ~/.ssh/config, then defaults."""
        h = self.host
        options: dict[str, Any] = dict(
            known_hosts=self._known_hosts(),
            connect_timeout=h.connect_timeout, login_timeout=h.connect_timeout,
            keepalive_interval=KEEPALIVE_S, keepalive_count_max=KEEPALIVE_COUNT,
            client_factory=lambda: _Client(self),
        )
        if h.user is not None:
            options["username"] = h.user
        if h.identity_file:
            path = os.path.expanduser(h.identity_file)
            if not os.path.exists(path):  # else the reason is a bare ENOENT "cannot reach"
                raise TransportError(f"hosts.{h.name}.identity_file: {missing_key(h)}", link=True)
            self._check_key(path, f"hosts.{h.name}.identity_file")
            options["client_keys"] = [path]
        elif (configured := identity_files(h)):
            # as ssh: an IdentityFile of ssh_config that is not there is skipped (asyncssh stops at it, ENOENT)
            options["client_keys"] = [p for p in configured if os.path.isfile(p)]
        # as ssh: a key with a passphrase is left to ssh-agent, which holds it unlocked (asyncssh raises instead)
        options["ignore_encrypted"] = True
        if h.ssh_config:
            options["config"] = [os.path.expanduser(h.ssh_config)]
            if not os.path.isfile(options["config"][0]):  # else a bare ENOENT "cannot reach", naming no file
                raise TransportError(f"hosts.{h.name}.ssh_config: {h.ssh_config} does not exist on this machine"
                                     + (f" (where the alias {h.ssh_alias} would be)" if h.ssh_alias else ""),
                                     link=True)
        return options

    async def _open(self) -> asyncssh.SSHClientConnection:
        h = self.host
        options = self._options()
        if h.port is not None:
            options["port"] = h.port
        jump_spec = h.jump_host or proxy_jump(h)
        if jump_spec:
            # like ssh -J, with this host's key, known_hosts and timeouts (a bare tunnel string, or asyncssh's own
            # ProxyJump from ssh_config, would check the jump's key against ~/.ssh/known_hosts instead)
            user, jump, port = parse_jump(jump_spec)
            jump_options = self._options()
            if not h.identity_file:  # the jump's own IdentityFile lines, as ssh takes them, not the target's
                own = identity_files(SimpleNamespace(target=jump, ssh_config=h.ssh_config))
                jump_options["client_keys"] = [p for p in own if os.path.isfile(p)]
            if user:
                jump_options["username"] = user
            elif h.jump_host is None:
                jump_options.pop("username", None)  # a ProxyJump alias brings its own User from the config
            if port is not None:
                jump_options["port"] = port
            if self._jump is not None:
                self._jump.close()  # the one under a link that dropped
            try:
                self._jump = await asyncio.wait_for(asyncssh.connect(jump, **jump_options), h.connect_timeout * 2)
            except (OSError, asyncssh.Error, asyncssh.KeyImportError, asyncio.TimeoutError) as e:
                # the reason is the jump's, under the name, user and port dialled for it (not the target's)
                dialled = (jump_options.get("username"), jump, port)
                raise TransportError(f"jump host {jump_spec}: {self._describe(e, dialled)}", link=True) from None
            options["tunnel"] = self._jump
        # connect_timeout covers TCP + handshake; wait_for bounds the whole login too
        return await asyncio.wait_for(asyncssh.connect(h.target, **options), h.connect_timeout * 2)

    def _link_lost(self, exc: Exception | None) -> None:
        self.lost_reason = f"link lost: {exc}" if exc else "link closed"

    def _accept_new_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        """Called by asyncssh for every key known_hosts does not trust. Opt-in trust on first use: only for a host
        with no key at all in known_hosts (a CHANGED key is refused whatever the profile or the command line say)."""
        self.offered = (host, port, key)
        self.offered_verdict = "changed" if self._known_keys(host, addr, port) else "new"
        if not self.host.accept_new_host_key or self.offered_verdict == "changed":
            return False
        self.accepted_key = self.record_key(host, port, key)
        return True

    def record_key(self, host: str, port: int, key: asyncssh.SSHKey) -> str:
        """Append the key to the user's known_hosts as ssh writes it (`name` on port 22, else `[name]:port`); the
        line written. Called only for a host known_hosts has no key for (accept-new, or `hostkeys` after a yes)."""
        pattern = host if port == 22 else f"[{host}]:{port}"
        algorithm, blob = key.export_public_key("openssh").decode().split()[:2]  # drop the key's comment
        line = f"{pattern} {algorithm} {blob}\n"
        os.makedirs(os.path.dirname(self.known_hosts_path) or ".", exist_ok=True)
        with open(self.known_hosts_path, "a") as f:
            f.write(line)
        return line.strip()

    def _known_keys(self, host: str, addr: str | None, port: int | None) -> list[asyncssh.SSHKey]:
        """The keys (and CA keys) known_hosts records for the name and port."""
        try:
            trusted = asyncssh.match_known_hosts(self._known_hosts(), host, addr or "",
                                                 None if port in (None, 22) else port)
        except (OSError, ValueError):
            return []
        return [*trusted[0], *trusted[1]]

    def _check_key(self, path: str, key: str) -> None:
        """One line for an identity file that is no private key (a .pub named by mistake); a key with a passphrase
        is remembered, for the reason a refused login then gives."""
        try:
            asyncssh.read_private_key(path)
        except asyncssh.KeyImportError as e:
            if "assphrase" not in str(e):
                raise TransportError(f"{key}: {path} is not a private key ({e})", link=True) from None
            self._encrypted_key = path
        except OSError as e:
            raise TransportError(f"{key}: cannot read {path}: {e.strerror or e}", link=True) from None

    def _describe(self, e: BaseException, dialled: tuple | None = None) -> str:
        """One line for a failed connection. dialled: (user, host, port) of a jump host, else this host."""
        h = self.host
        if dialled is None:
            user, target, port = h.user, h.target, h.port
            # the name and port ssh checks the key under: an alias's HostName and Port from ssh_config
            key_name, key_port = h.address or ssh_hostname(h) or h.target, h.port or ssh_port(h)
        else:
            user, target, port = dialled
            jump = SimpleNamespace(target=target, ssh_config=h.ssh_config)  # the jump may be an alias too
            key_name, key_port = ssh_hostname(jump) or target, port or ssh_port(jump)
        where = f"{user + '@' if user else ''}{target}{':' + str(port) if port else ''}"
        if isinstance(e, asyncssh.HostKeyNotVerifiable):
            offered = fingerprint(self.offered[2]) if self.offered else "a key"
            recorded = self._known_keys(key_name, None, key_port)
            if recorded:
                pattern = key_name if key_port in (None, 22) else f"[{key_name}]:{key_port}"
                return (f"host key CHANGED for {where}: it offers {offered}, known_hosts has "
                        f"{', '.join(fingerprint(k) for k in recorded)}: refused; if the host was reinstalled, check "
                        f"its new key, then remove the old one (ssh-keygen -R '{pattern}' -f {self.known_hosts_path})")
            return (f"host key of {where} is unknown ({offered}): not in {self.known_hosts_path}; compare it with the "
                    "host's own, then accept it: zeroband-console PROFILE hostkeys (asks yes), or add "
                    "--accept-new-host-keys (or accept_new_host_key = true in the profile)")
        if isinstance(e, asyncssh.PermissionDenied):
            hint = (f"; {self._encrypted_key} has a passphrase: add it to ssh-agent (ssh-add)"
                    if self._encrypted_key else "")
            return f"authentication failed for {where}: wrong user or key ({e.reason}){hint}"
        if isinstance(e, asyncssh.KeyImportError):
            return f"a key for {where} cannot be read: {e}"
        if isinstance(e, asyncio.TimeoutError):
            return f"connect to {where} timed out after {h.connect_timeout:g}s"
        if isinstance(e, ConnectionRefusedError):
            return f"connection refused by {where} (no sshd on that port?)"
        if isinstance(e, socket.gaierror):
            return f"unknown host {target}: {e.strerror}"
        if isinstance(e, asyncssh.Error):
            return f"ssh to {where} failed: {e.reason}"
        named = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
        return f"cannot reach {where}: {getattr(e, 'strerror', None) or e}{named}"

    async def close(self) -> None:
        async with self._lock:
            conns, self._conn, self._jump = (self._conn, self._jump), None, None
        for conn in conns:
            if conn is None:
                continue
            conn.close()
            try:
                await asyncio.wait_for(conn.wait_closed(), 5)
            except (asyncio.TimeoutError, OSError, asyncssh.Error):
                pass

    # ---- channels --------------------------------------------------------------------------------------------
    async def run_bytes(self, cmd: str, timeout: float | None = 30.0,
                        stdin: bytes | None = None) -> tuple[int, bytes, str]:
        conn = await self._connection()
        async with self._channels:
            try:
                proc = await self._open_channel(conn, cmd, stdin)
                try:
                    result = await proc.wait(check=False, timeout=timeout)
                finally:
                    await _close_channel(proc)
            except (asyncssh.TimeoutError, asyncio.TimeoutError):
                raise TransportError(f"command timed out after {timeout}s on {self.host.name}") from None
            except (OSError, asyncssh.Error) as e:
                raise TransportError(self.lost_reason or self._describe(e), link=True) from None
        if result.exit_status is None:
            # the channel closed without an exit status: the link went down under the command. Saying "exit -1"
            # here read as "no such process" to alive() and the watcher settled a live node while sshd restarted
            raise TransportError(self.lost_reason or f"no exit status from {self.host.name} (link lost?)", link=True)
        rc = result.exit_status if result.exit_status >= 0 else -1
        out = result.stdout if isinstance(result.stdout, bytes) else b""
        err = _text(result.stderr)
        if rc == C.UNDECODED and C.UNDECODED_SAYS in err:  # no command ran: not an answer of the command's
            raise TransportError(f"{self.host.name}: {err.strip().splitlines()[-1]}")
        return rc, out, err

    @staticmethod
    async def _open_channel(conn: asyncssh.SSHClientConnection, cmd: str,
                            stdin: bytes | None = None) -> asyncssh.SSHClientProcess:
        """Open a session channel, retrying briefly when sshd still counts recently closed sessions against
        MaxSessions (seen here: ten sessions open on the server while the client had eight). stdin, when given,
        is written to the channel and closed (EOF)."""
        mode = asyncssh.DEVNULL if stdin is None else asyncssh.PIPE
        cmd = C.through_sh(cmd)  # the login shell (fish, tcsh...) parses it first: sh gets it as written
        for delay in CHANNEL_RETRY_S:
            try:
                proc = await conn.create_process(cmd, stdin=mode, encoding=None)
                break
            except asyncssh.ChannelOpenError:
                await asyncio.sleep(delay)
        else:
            proc = await conn.create_process(cmd, stdin=mode, encoding=None)
        if stdin is not None:
            proc.stdin.write(stdin)
            proc.stdin.write_eof()
        return proc

    def tail(self, path: str, from_offset: int = 0) -> Tail:
        return SshTail(self, path, from_offset)

    async def put_files(self, root: str, files: Sequence[tuple[str, bytes, int]]) -> None:
        """Over SFTP on this host's connection (one channel), SFTP_PARALLEL files in flight."""
        conn = await self._connection()
        async with self._channels:
            try:
                async with conn.start_sftp_client() as sftp:
                    for folder in sorted({posixpath.dirname(f"{root}/{rel}") for rel, _, _ in files}):
                        await sftp.makedirs(folder, exist_ok=True)
                    slots = asyncio.Semaphore(SFTP_PARALLEL)

                    async def put(rel: str, data: bytes, mode: int) -> None:
                        dst = f"{root}/{rel}"
                        async with slots:
                            async with sftp.open(dst + C.SYNC_SUFFIX, "wb") as f:
                                await f.write(data)
                            await sftp.chmod(dst + C.SYNC_SUFFIX, mode)
                            await sftp.posix_rename(dst + C.SYNC_SUFFIX, dst)
                    await asyncio.gather(*(put(*f) for f in files))
            except (OSError, asyncssh.Error) as e:
                reason = getattr(e, "reason", None) or str(e)
                raise TransportError(self.lost_reason or f"sftp to {self.host.name} failed: {reason}",
                                     link=isinstance(e, (OSError, asyncssh.DisconnectError))) from None


class SshTail(Tail):
    """Follows a remote file with `tail -c +OFFSET -F` on one channel; a broken link raises TransportError."""

    def __init__(self, transport: SshTransport, path: str, offset: int = 0):
        self.transport = transport
        self.path = path if path.startswith(("/", "~")) else f"{transport.workdir.rstrip('/')}/{path}"
        self.offset = offset
        self._proc: asyncssh.SSHClientProcess | None = None
        self._held = False
        self._pending: deque[bytes] = deque()  # complete lines read past self.offset
        self._partial = b""

    async def __anext__(self) -> bytes:
        if self._proc is None:
            await self._open()
        assert self._proc is not None
        while not self._pending:
            try:
                # chunks, not readline: asyncssh's readline hands back a part of a line longer than the channel's
                # window (~2 MiB) as if the file ended there, and the tail reopened at the same offset for ever
                chunk = await self._proc.stdout.read(TAIL_CHUNK)
            except (OSError, asyncssh.Error) as e:
                await self.aclose()
                raise TransportError(self.transport.lost_reason or f"tail of {self.path} failed: {e}",
                                     link=True) from None
            if not chunk:  # EOF: the channel or the link went away; a partial line is not ours yet
                await self.aclose()
                raise TransportError(self.transport.lost_reason or f"tail of {self.path} ended", link=True)
            lines, self._partial = lines_of(chunk, self._partial)
            self._pending.extend(lines)
        line = self._pending.popleft()
        self.offset += len(line) + 1
        return line

    async def _open(self) -> None:
        conn = await self.transport._connection()
        await self.transport._channels.acquire()
        self._held = True
        try:
            self._proc = await self.transport._open_channel(conn, C.tail_command(self.path, self.offset))
        except (OSError, asyncssh.Error) as e:
            await self.aclose()
            raise TransportError(self.transport.lost_reason or f"cannot tail {self.path}: {e}", link=True) from None

    async def aclose(self) -> None:
        proc, self._proc = self._proc, None
        self._pending.clear()  # a reopen reads again from self.offset: the first line not yet handed out
        self._partial = b""
        try:
            if proc is not None:
                await _close_channel(proc)
        finally:  # even when cancelled mid-close: a slot lost here is lost for the connection's life
            if self._held:
                self._held = False
                self.transport._channels.release()


def fingerprint(key: asyncssh.SSHKey) -> str:
    """`ssh-ed25519 SHA256:...`: the key's type and the fingerprint ssh-keygen -l prints for it."""
    return f"{key.get_algorithm()} {key.get_fingerprint()}"


def parse_jump(text: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (as ssh -J takes it) -> (user, host, port); port None: ssh_config's, else 22."""
    if "," in text:
        raise TransportError(f"jump host {text!r}: several hops are not supported; name one jump host", link=True)
    parts = split_target(text)
    if parts is None:
        raise TransportError(f"jump_host {text!r}: expected [user@]host[:port]", link=True)
    return parts


async def _close_channel(proc: asyncssh.SSHClientProcess) -> None:
    """Close and wait for the close to complete before the slot is free (sshd counts a session until then);
    bounded, since the link may be dead."""
    proc.close()
    try:
        await asyncio.wait_for(proc.wait_closed(), CLOSE_WAIT_S)
    except (asyncio.TimeoutError, OSError, asyncssh.Error):
        pass


def _text(value: object) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
