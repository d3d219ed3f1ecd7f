"""A dependency's deprecation warning goes to a debug log, never among the console's lines.

Why: a library the console uses may warn about another library's future, for the developers of the first. With
cryptography 51, which deprecates DSA, asyncssh 2.24 makes Python print ten `CryptographyDeprecationWarning: DSA is
deprecated ...` lines, each with its source line, the first time it is imported: `check` printed them among its
report lines as if they were problems of the hosts, and they came before every SSH command's lines. The user can do
nothing about them; the project's developers want them (a library is about to drop what another one uses).

    route_dependency_warnings()     # once, first thing in console/cli.py main(), before asyncssh is imported

The rule, by category and origin (routed()): a warning whose category is a deprecation (DeprecationWarning,
PendingDeprecationWarning, FutureWarning, or any class named *Deprecat*, such as cryptography's, which is a
UserWarning) and whose origin is a module outside the project (the module Python attributes it to: asyncssh.* for
the DSA lines, as asyncssh's code names the deprecated classes) is logged at DEBUG on the logger
`console.dependencies`. Every other warning is shown as Python shows it: the project's own (console.*, engine.*),
and a dependency's warning of another kind (it may be about this machine's set-up). Python's filters stay as they
are, but for one addition: a dependency's DeprecationWarning and PendingDeprecationWarning, which Python hides
outside __main__, reach the log too (once per place, as "default" does). Nothing is ignored that was shown before,
and the project's own warnings are filtered as Python filters them.

The log (debug_log()): `$XDG_STATE_HOME/zeroband-console/debug.log` (~/.local/state/zeroband-console/debug.log),
created at its first record, kept under 1 MB (one older file beside it, debug.log.1). To see the warnings on stderr
instead, give Python any warning option (`PYTHONWARNINGS=default zeroband-console PROFILE check`, or
`python -W default -m console ...`): the routing then steps aside, as the user asked for warnings.

A host's python (the preflight's host script, scripts/setup.sh under sync, an engine, the store) prints its warnings on
stderr in Python's format, `FILE:LINE: CATEGORY: MESSAGE` and an indented source line. Where the console quotes
such stderr (the host script's error, setup's output, the last line of an engine's or the store's log as its reason),
without_dependency_warnings() leaves out the same warnings by the same rule, the origin read from FILE (the module
path under site-packages, dist-packages or lib/pythonX.Y). The logs on the hosts keep everything.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import re
import sys
import warnings
from pathlib import Path
from io import TextIOWrapper
from typing import Any, Iterable

LOGGER = "console.dependencies"
OWN = ("console", "engine")  # the project's own packages: their warnings are never routed
NOT_OWN = rf"(?!(?:{'|'.join(OWN)})(?:\.|$))"  # a warnings filter's module pattern: any module but the project's
LOG_BYTES = 1_000_000
_MARK = "_zeroband_routes_dependencies"


def debug_log() -> Path:
    """Where the routed warnings go (the XDG state folder of this user)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "zeroband-console" / "debug.log"


# ---- the rule (pure) ----------------------------------------------------------------------------------------
def is_deprecation(category_names: Iterable[str]) -> bool:
    """A deprecation by its class names (the category and its bases; only its own name in a host's stderr)."""
    return any("Deprecat" in name or name == "FutureWarning" for name in category_names)


def routed(category_names: Iterable[str], module: str | None) -> bool:
    """Whether a warning of this category from this module goes to the debug log: a deprecation from any module
    but the project's own (which origin() always places, by its folder; None is code without a file)."""
    return is_deprecation(category_names) and (module is None or module.split(".")[0] not in OWN)


def module_of(filename: str, roots: Iterable[str] | None = None) -> str | None:
    """The dotted module held by `filename` (an absolute path), from the longest import path entry (sys.path)
    that holds it; None for anything else (`<frozen ...>`, `<string>`)."""
    if not os.path.isabs(filename):
        return None
    path = os.path.normpath(filename)
    best = ""
    for entry in sys.path if roots is None else roots:
        root = os.path.abspath(entry or os.curdir)
        if path.startswith(root.rstrip(os.sep) + os.sep) and len(root) > len(best):
            best = root
    if not best:
        return None
    parts = os.path.splitext(os.path.relpath(path, best))[0].split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or None


def origin(filename: str) -> str | None:
    """The module a warning's file holds: the project's own by its folder in this checkout (whatever sys.path
    holds), else by the import path."""
    own = module_of(filename, [_CHECKOUT])
    return own if own is not None and own.split(".")[0] in OWN else module_of(filename)


_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INSTALLED = re.compile(r"^.*/(?:site-packages|dist-packages|lib/python\d+\.\d+)/(?P<rel>[^:]+?)\.py$")
_WARNING = re.compile(r"^(?P<file>\S.*?):(?P<line>\d+): (?P<category>[A-Za-z_][\w.]*): ")


def installed_module(filename: str) -> str | None:
    """The module of a file a host's python named, when it lies among installed packages or the standard library
    (site-packages/asyncssh/crypto/misc.py -> asyncssh.crypto.misc); None for any other file (the workdir's)."""
    m = _INSTALLED.match(filename.replace(os.sep, "/"))
    if m is None:
        return None
    parts = m["rel"].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def without_dependency_warnings(text: str) -> str:
    """A python's stderr without the warnings routed() sends to the debug log: each such `FILE:LINE: CATEGORY:
    MESSAGE` line and the one indented source line Python prints under it. Everything else stays, in order."""
    kept: list[str] = []
    skipping = False
    for line in text.splitlines():
        if skipping and line.startswith("  "):
            skipping = False  # the warning's source line
            continue
        m = _WARNING.match(line)
        module = installed_module(m["file"]) if m else None  # None: the workdir's (the project's) or unplaced
        skipping = m is not None and module is not None and routed([m["category"].rsplit(".", 1)[-1]], module)
        if not skipping:
            kept.append(line)
    return "\n".join(kept) + ("\n" if kept and text.endswith("\n") else "")


# ---- the hook -------------------------------------------------------------------------------------------------
class _QuietFile(logging.handlers.RotatingFileHandler):
    """The debug log: its folder and file made at the first record (a run with nothing to log leaves nothing)."""

    def _open(self) -> TextIOWrapper:
        os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        return super()._open()

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        pass  # a debug log that cannot be written (a read-only home) is no reason for a line on stderr


def route_dependency_warnings() -> None:
    """Send dependency deprecation warnings to the debug log from now on (idempotent); other warnings unchanged.

    Nothing happens when Python was given warning options (-W, PYTHONWARNINGS): the user asked to see them."""
    if sys.warnoptions or getattr(warnings.showwarning, _MARK, False):
        return
    logger = logging.getLogger(LOGGER)
    if not logger.handlers:
        handler = _QuietFile(debug_log(), maxBytes=LOG_BYTES, backupCount=1, delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(name)s: %(message)s"))
        logger.addHandler(handler)
    for category in (DeprecationWarning, PendingDeprecationWarning):  # hidden by Python outside __main__: the log
        warnings.filterwarnings("default", category=category, module=NOT_OWN)  # keeps a dependency's, once a place
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # a library that configures the root logger must not echo them onto stderr
    shown = warnings.showwarning

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if routed([c.__name__ for c in category.__mro__], origin(filename)):
            logger.debug("%s", warnings.formatwarning(message, category, filename, lineno, line).rstrip())
        else:
            shown(message, category, filename, lineno, file, line)

    setattr(show, _MARK, True)
    warnings.showwarning = show
