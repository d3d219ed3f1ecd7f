"""torchrun's worker when the tests fork their engines (tests/forkserver.py): it asks the fork server for the engine
with its own arguments, environment, folder and standard streams, passes on every signal torchrun sends, and exits
as the engine did. The engine ends with it, even when it is SIGKILLed. Imports the standard library only."""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from forkserver import SOCKET_ENV, Forked, child_argv  # noqa: E402


def forward(pid: int, sig: int) -> None:
    """To the engine's process group, as torchrun's killpg reaches the group of the worker it started."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def main() -> None:
    args = [sys.executable, *sys.argv[1:]]
    env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    try:
        proc = Forked(os.environ[SOCKET_ENV], args, *child_argv(args), env, os.getcwd(), None, None, False,
                      watch=os.getpid())
    except (OSError, ValueError) as e:  # the server is gone or refused (no pidfd_open, say): a real start
        print(f"forkclient: {type(e).__name__}: {e}; the engine starts for real", file=sys.stderr, flush=True)
        os.environ.pop(SOCKET_ENV, None)
        os.execv(sys.executable, args)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda s, _: forward(proc.pid, s))
    code = proc.wait()
    if code < 0:  # killed by a signal: so is this process, for torchrun to read
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled, so need no reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os._exit(128 - code)
    sys.exit(code)


if __name__ == "__main__":
    main()
