"""Shell command builders: pure functions from values to POSIX `sh` text. Every value goes through shlex.quote.

The same text runs through a local `sh -c` and through an SSH channel, so local and remote behave alike. sshd hands
a command to the user's login shell, which may be fish or tcsh: over SSH the text goes through `through_sh`, which
reaches sh unchanged whatever that shell.

Detached start (what lets an engine outlive the console and the link):

    cd WORKDIR && mkdir -p RUN && rm -f RUN/rc && (umask 077 && cat > RUN/env) || exit 1;
    setsid nohup sh -c 'trap : TERM ...; rc=$1; envf=$2; shift 2; . "$envf"; rm -f "$envf"; "$@"; ...' zeroband
        RUN/rc RUN/env ARGV... > RUN/events.jsonl 2> RUN/engine.log < /dev/null & echo $! > RUN/pid && echo $!

The environment (the profile's `env`, which may hold an HF_TOKEN or a WANDB_API_KEY) never appears in a command
line: `ps` and /proc/*/cmdline show every argument to every user of the host, and the command text itself runs as
`sh -c TEXT`. It travels on the channel's stdin (env_file_text) into RUN/env, created mode 0600, which the wrapper
sources (`set -a`: exported) and removes before it starts the engine.

setsid makes the wrapper shell the leader of a new session and process group (its pid is the group id), so
`kill -- -PID` reaches the engine and everything it forked; nohup and the redirects cut it loose from the
channel. The wrapper records the exit status in RUN/rc; a process killed with its group leaves no rc.
"""

from __future__ import annotations

import base64
import shlex
import signal
from typing import Mapping, Sequence

EVENTS = "events.jsonl"
LOG = "engine.log"
PID = "pid"
RC = "rc"
DRAIN = "drain"

# The trap keeps the wrapper alive through a TERM/INT/HUP/USR1 sent to the whole group (stop, drain), so it can
# still record the exit status; a trap with a command (unlike an ignored signal) is reset for the child it runs.
_WRAPPER = ('trap : TERM INT HUP USR1 USR2; rc=$1; envf=$2; shift 2; '
            # sourced, then removed at once: the secrets live on only in the engine's own environment
            'if [ -n "$envf" ]; then set -a; . "$envf"; set +a; rm -f "$envf"; fi; "$@"; echo $? > "$rc"')
ENV_FILE = "env"
TAG = "zeroband"  # the wrapper's $0: marks our processes, so a reused pid is not taken for an engine
SYNC_SUFFIX = ".zb-sync"  # Transport.put_files writes a file here first, then renames it over the old one


UNDECODED = 125  # through_sh's exit status where the host could not decode a command, with UNDECODED_SAYS on stderr
UNDECODED_SAYS = "zeroband: cannot decode a command of the console"  # no ' \ ! (in the login shell's quotes)


def through_sh(cmd: str) -> str:
    """cmd as text that every login shell (sh, bash, zsh, fish, tcsh) hands to sh as it is. sshd runs a command
    through the user's login shell, which parses it first: fish and csh read sh's `if`, `$(...)` and quoting their
    own way (fish even answers status 0 after its parse error). The text travels as base64, whose letters every
    shell leaves alone inside single quotes; sh decodes and evaluates it. A host that cannot decode it says so
    (UNDECODED): an empty command would have answered status 0 to everything (alive, kill, launch_check)."""
    encoded = base64.b64encode(cmd.encode("utf-8", "surrogateescape")).decode()
    return (f"sh -c 'c=$(echo {encoded} | base64 -d) || {{ echo \"{UNDECODED_SAYS}: base64 -d failed (the host "
            f"needs coreutils or busybox)\" >&2; exit {UNDECODED}; }}; eval \"$c\"'")


_SIGNALS = frozenset(s.name.removeprefix("SIG") for s in signal.Signals)

# launch_check exit statuses -> what they mean
LAUNCH_CHECK_REASONS = {
    3: "working directory {workdir} does not exist on the host",
    4: "python not found on the host: {python}",
    5: "engine config {config} not found in {workdir}",
}


def q(value: object) -> str:
    return shlex.quote(str(value))


def qpath(path: str) -> str:
    """Quote a path but keep a leading ~ meaning the remote user's home (quoting would make it literal)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + q(path[2:])
    return q(path)


def join(run_dir: str, *names: str) -> str:
    return "/".join([run_dir.rstrip("/") or "/", *names])


def env_file_text(env: Mapping[str, str]) -> str:
    """The environment as `K='v'` lines for the wrapper to source: what start_detached sends on stdin."""
    for key in env:
        if not key or "=" in key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise ValueError(f"detached_command: bad environment variable name {key!r}")
    return "".join(f"{k}={q(v)}\n" for k, v in env.items())


def detached_command(argv: Sequence[str], *, workdir: str, run_dir: str, with_env: bool = False,
                     append: bool = False) -> str:
    """Start argv detached in workdir; its output goes to run_dir; prints the pid (also written to run_dir/pid).

    with_env: the command reads env_file_text(...) from its stdin into run_dir/env (mode 0600) first, and the
    wrapper exports it to argv and removes the file: values never appear in any process's command line."""
    if not argv:
        raise ValueError("detached_command: empty argv")
    run = qpath(run_dir)
    env_path = qpath(join(run_dir, ENV_FILE))  # join() puts a '/' in it: `.` never searches $PATH for it
    redirect = ">>" if append else ">"  # a restart appends, so a tail's offset stays valid
    write_env = f" && (umask 077 && rm -f {env_path} && cat > {env_path})" if with_env else ""
    words = " ".join([qpath(argv[0]), *(q(a) for a in argv[1:])])  # a python under ~ is the host user's, as checked
    # `|| exit 1;` ends the first list: `a && b & c` would send cd and mkdir to the background too
    return (f"cd {qpath(workdir)} && mkdir -p {run} && rm -f {run}/{RC}{write_env} || exit 1; "
            f"setsid nohup sh -c {q(_WRAPPER)} {TAG} {run}/{RC} {env_path if with_env else q('')} {words}"
            f" {redirect} {run}/{EVENTS} 2{redirect} {run}/{LOG} < /dev/null & "
            f"echo $! > {run}/{PID} && echo $!")


def kill_command(pid: int, sig: str = "TERM", group: bool = True) -> str:
    """`kill` by pid or by process group: OpenSSH delivers channel signals only to non-root sessions. A KILL of a
    group also reaches every process descended from it in sessions of their own: torchrun starts its workers so, and
    forwards a TERM to them but cannot forward a KILL (an operator's kill left a node's workers training)."""
    sig = sig.upper().removeprefix("SIG")
    if sig not in _SIGNALS:
        raise ValueError(f"kill_command: unknown signal {sig!r}")
    pid = _pid(pid)
    if not (group and sig == "KILL"):
        return f"kill -s {sig} -- {'-' if group else ''}{pid}"
    # /proc/PID/stat: "pid (comm) state ppid pgrp ...", comm may hold spaces and parentheses: cut at the last ") ".
    # First the group's processes, then their descendants, until none is added; the group's kill says if any lived
    each = ('for f in /proc/[0-9]*/stat; do read -r s 2>/dev/null < "$f" || continue; p=${s%% *}; '
            'set -- ${s##*) }; ')
    return (f"if [ -d /proc/self ]; then all=' '; {each}[ \"$3\" = {pid} ] && all=\"$all$p \"; done; "
            f"while :; do more=$all; {each}case $all in *\" $p \"*) continue;; esac; "
            f"case $all in *\" $2 \"*) more=\"$more$p \";; esac; done; [ \"$more\" = \"$all\" ] && break; "
            f"all=$more; done; fi; kill -s KILL -- -{pid}; rc=$?; "
            f"for p in $all; do kill -s KILL -- -$p 2>/dev/null; kill -s KILL $p 2>/dev/null; done; exit $rc")


def alive_command(pid: int, tag: str | None = None) -> str:
    """Exit 0 while pid is a live process (a zombie is not alive); with tag, only if its command line has it. A
    process in the middle of an exec shows an empty command line (the new image's arguments are not set yet): a
    command line without the tag is looked at again after a moment (one look called a store just started dead)."""
    pid = _pid(pid)
    grep = f"grep -qaF {q(tag)} /proc/{pid}/cmdline"
    check_tag = f" && {{ {grep} || {{ sleep 0.5; {grep}; }}; }}" if tag else ""
    return (f"if [ -d /proc/self ]; then [ -d /proc/{pid} ] && ! grep -qs '^State:[[:space:]]*Z' /proc/{pid}/status"
            f"{check_tag}; else kill -0 {pid} 2>/dev/null; fi")


def group_alive_command(pgid: int) -> str:
    """Exit 0 while any live process (a zombie is not alive) is in process group pgid. A wrapper gone is not its
    group gone: a launcher's workers, or anything else the engine forked, may live on in it."""
    pgid = _pid(pgid)
    # /proc/PID/stat: "pid (comm) state ppid pgrp ...", and comm may hold spaces and parentheses: cut at the last ") "
    return ("if [ -d /proc/self ]; then for f in /proc/[0-9]*/stat; do read -r s 2>/dev/null < \"$f\" || continue; "
            f"set -- ${{s##*) }}; [ \"$3\" = {pgid} ] && [ \"$1\" != Z ] && exit 0; done; exit 1; "
            f"else kill -0 -- -{pgid} 2>/dev/null; fi")


def tail_command(path: str, offset: int = 0) -> str:
    """Follow a file from a byte offset (waits for it to appear; follows it if it is replaced)."""
    if offset < 0:
        raise ValueError("tail_command: negative offset")
    return f"exec tail -c +{int(offset) + 1} -F {qpath(path)} 2>/dev/null"


def read_from_command(path: str, offset: int, workdir: str = ".") -> str:
    """Print a file from a byte offset to its current end (exit 1 if it is not there)."""
    if offset < 0:
        raise ValueError("read_from_command: negative offset")
    return f"cd {qpath(workdir)} && tail -c +{int(offset) + 1} {qpath(path)} 2>/dev/null"


def read_command(path: str, workdir: str = ".") -> str:
    """Print a small file; exit 1 (and print nothing) if it is not there."""
    return f"cd {qpath(workdir)} && cat {qpath(path)} 2>/dev/null"


def tail_lines_command(path: str, lines: int = 5, workdir: str = ".") -> str:
    return f"cd {qpath(workdir)} && tail -n {int(lines)} {qpath(path)} 2>/dev/null"


def size_command(path: str, workdir: str = ".") -> str:
    """Print a file's size in bytes; exit 1 (and print nothing) if it is not there."""
    return f"cd {qpath(workdir)} && wc -c 2>/dev/null < {qpath(path)}"


def touch_command(path: str, workdir: str = ".") -> str:
    return f"cd {qpath(workdir)} && touch {qpath(path)}"


def write_command(path: str, workdir: str = ".") -> str:
    """stdin into a small file, its folder made if need be (in place: its one reader reads it at a start, never
    while it is written)."""
    return f"cd {qpath(workdir)} && mkdir -p -- \"$(dirname -- {qpath(path)})\" && cat > {qpath(path)}"


def remove_command(path: str, workdir: str = ".") -> str:
    return f"cd {qpath(workdir)} && rm -f {qpath(path)}"


def archive_command(path: str, archive_dir: str, workdir: str = ".") -> str:
    """Move a previous run's folder into archive_dir (nothing is deleted); a no-op when it is not there."""
    src, dst = qpath(path), qpath(archive_dir)
    return f"cd {qpath(workdir)} && if [ -e {src} ]; then mkdir -p {dst} && mv {src} {dst}/; fi"


def launch_check_command(*, workdir: str, python: str, config: str | None = None) -> str:
    """Check a host before starting on it; the exit status keys LAUNCH_CHECK_REASONS."""
    check_config = f" && {{ [ -f {qpath(config)} ] || exit 5; }}" if config else ""
    return (f"{{ cd {qpath(workdir)} 2>/dev/null || exit 3; }}"
            f" && {{ command -v {qpath(python)} >/dev/null 2>&1 || exit 4; }}{check_config}")


def launch_check_reason(rc: int, *, workdir: str, python: str, config: str | None = None) -> str | None:
    if rc == 0:
        return None
    template = LAUNCH_CHECK_REASONS.get(rc, "host check failed with status {rc}")
    return template.format(workdir=workdir, python=python, config=config, rc=rc)


def _pid(pid: int) -> int:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        raise ValueError(f"not a process id: {pid!r}")  # kill -- -1 would signal every process we may
    return pid
